"""Chunked GDN prefill: XLA (`jaxspec.ops.gdn.gdn_chunked`, the jnp reference) and the Pallas
kernels (`jaxspec.pallas.gdn_chunked`, impl="pallas") against flash-linear-attention's
`chunk_gated_delta_rule` on the same shapes (issue 4 item 5).

Shapes: Qwen3.8-27B TP1 GDN layer (H 16 key heads, HV 48 value heads, K = V = 128), bf16 q/k/v,
fp32 gates and state, one layer. fla takes as many key heads as value heads: its run repeats the
16 key heads 3x (same math; it reads 3x the q/k bytes, which is < 15 % of its traffic). Timing:
CUDA-synchronised median of back-to-back jitted calls. fla runs in its own process (the anchor
script) in the same device call: `fla_gdn_bench.py --batches 1,4 --T 4096` prints "fla chunk
varlen" rows (B sequences of T tokens, varlen); its fused_recurrent timing, which runs first,
crashed at T = 4096 on the H200, so run a copy of the script with that timing removed.
Pallas rows: the default configuration ("pallas gdn_chunked") with its ratio to the XLA row of
the same case (vs_xla = xla_us / us), to fla (vs_fla = us / fla_us, when --fla-jsonl names the
anchor's output of the same call), its prep kernel alone (prep_us: the chunk-parallel part; the
rest is the sequential state kernel), the read+write floor of the op's own inputs and outputs
(q, k, v, g, beta, h0, o, h) at the copy bandwidth measured here (floor_us, frac_bw = floor / us),
and the relative RMS difference of o and h from the XLA result. --sweep adds one row per state-
kernel configuration "BVxWARPSxSTAGES" (optionally "xCHUNK" and "xPREPWARPS").
Usage (GPU): PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false python3 bench/prefill_chunk.py --out $OUT
  [--fla-jsonl fla.jsonl] [--sweep 16x4x1,32x4x1,32x4x2,64x4x2,64x8x1,128x8x1,64x4x1x32x1,128x8x1x32x1]
(the default configuration is 64x4x1x32x1: block_v 64, 4 warps, 1 stage, chunk 32, 1 prep warp).
"""
import argparse
import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp

import benchutil  # bench/benchutil.py: the script directory is first on sys.path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jaxspec.ops.gdn import gdn_chunked  # noqa: E402
from jaxspec.pallas import gdn_chunked as pallas_chunked  # noqa: E402

H, HV, K, V = 16, 48, 128, 128


def inputs(batch, t, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    q = jax.random.normal(ks[0], (batch, t, H, K), jnp.bfloat16)
    k = jax.random.normal(ks[1], (batch, t, H, K), jnp.float32)
    k = (k / jnp.linalg.norm(k, axis=-1, keepdims=True)).astype(jnp.bfloat16)
    v = jax.random.normal(ks[2], (batch, t, HV, V), jnp.bfloat16)
    g = jax.nn.log_sigmoid(jax.random.normal(ks[3], (batch, t, HV), jnp.float32))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (batch, t, HV), jnp.float32))
    h0 = jax.random.normal(ks[5], (batch, HV, K, V), jnp.float32) * 0.1
    return q, k, v, g, beta, h0


def op_bytes(args):
    """Bytes the op must move at least: its inputs once, o and h written once."""
    q, k, v, g, beta, h0 = args
    b, t, hv, vd = v.shape
    return sum(x.nbytes for x in args) + b * t * hv * vd * 4 + h0.size * 4


def parse_config(spec):
    """"BVxWARPSxSTAGES[xCHUNK[xPREPWARPS]]" -> ChunkConfig."""
    vals = [int(x) for x in spec.split("x")]
    names = ("block_v", "num_warps", "num_stages", "chunk", "prep_warps")
    return pallas_chunked.ChunkConfig(**dict(zip(names, vals)))


def read_fla(path):
    """{(batch, T): us} from the fla anchor's JSON lines ("fla chunk varlen", fp32 state)."""
    out = {}
    if path and os.path.exists(path):
        for line in open(path):
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if row.get("kernel") == "fla chunk varlen" and "float32" in str(row.get("state", "float32")):
                out[(row["batch"], row["T"])] = row["us"]
    return out


def rel_rms(a, b):
    a, b = (jnp.asarray(x, jnp.float32) for x in (a, b))
    return float(jnp.sqrt(jnp.mean((a - b) ** 2)) / jnp.sqrt(jnp.mean(b ** 2)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="1x1024,1x4096,1x16384,8x1024", help="BATCHxT, comma-separated")
    ap.add_argument("--impls", default="xla,pallas", help="which rows: xla, pallas (comma-separated)")
    ap.add_argument("--sweep", default="", help="extra Pallas configs BVxWARPSxSTAGES[xCHUNK[xPREPWARPS]]")
    ap.add_argument("--fla-jsonl", default="", help="fla anchor output of the same device call")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--budget-s", type=float, default=1e9)
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "out"))
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    impls = set(args.impls.split(","))
    fla = read_fla(args.fla_jsonl)
    bw, _ = benchutil.jax_copy_bandwidth(args.reps)
    print(json.dumps({"kernel": "xla copy 1 GiB", "TB_per_s": round(bw / 1e12, 3)}), flush=True)
    fn = jax.jit(lambda *a: gdn_chunked(*a, impl="ref"))
    configs = [("pallas gdn_chunked", None)] + [(f"pallas {s}", parse_config(s)) for s in args.sweep.split(",") if s]
    rows, start = [], time.perf_counter()

    def emit(row):
        rows.append(row)
        print(json.dumps(row), flush=True)

    cases = [tuple(map(int, case.split("x"))) for case in args.cases.split(",")]
    xla = {}
    # Pass 1: XLA and the default Pallas configuration for every case; pass 2: the sweep (so a
    # tight --budget-s cuts sweep rows, not cases).
    for sweep_pass, cfgs in ((False, configs[:1]), (True, configs[1:])):
        for batch, t in cases if cfgs else ():
            if time.perf_counter() - start > args.budget_s:
                break
            xs = inputs(batch, t)
            floor_us = op_bytes(xs) / bw * 1e6
            if "xla" in impls and not sweep_pass:
                xla_us, ref = benchutil.median_us(fn, *xs, reps=args.reps, inner=args.iters)
                xla[(batch, t)] = xla_us, ref
                emit({"kernel": "xla gdn_chunked", "batch": batch, "T": t, "us": round(xla_us, 1),
                      "tokens_per_s": round(batch * t / xla_us * 1e6), "floor_us": round(floor_us, 1)})
            if "pallas" not in impls:
                continue
            for name, cfg in cfgs:
                if time.perf_counter() - start > args.budget_s:
                    break
                kernel = jax.jit(functools.partial(pallas_chunked.gdn_chunked, config=cfg))
                prep = jax.jit(functools.partial(pallas_chunked.chunk_matrices, num_value_heads=HV, config=cfg))
                try:
                    us, out = benchutil.median_us(kernel, *xs, reps=args.reps, inner=args.iters)
                    prep_us, _ = benchutil.median_us(prep, xs[0], xs[1], xs[3], xs[4], None, reps=args.reps,
                                                     inner=args.iters)
                except Exception as e:   # noqa: BLE001 - a config the GPU rejects (e.g. shared memory)
                    emit({"kernel": name, "batch": batch, "T": t, "error": f"{type(e).__name__}: {str(e)[:300]}"})
                    continue
                row = {"kernel": name, "batch": batch, "T": t, "us": round(us, 1), "prep_us": round(prep_us, 1),
                       "tokens_per_s": round(batch * t / us * 1e6), "floor_us": round(floor_us, 1),
                       "frac_bw": round(floor_us / us, 3)}
                if (batch, t) in xla:
                    xla_us, ref = xla[(batch, t)]
                    row["vs_xla"] = round(xla_us / us, 2)
                    row["rel_rms_o"] = float(f"{rel_rms(out[0], ref[0]):.3g}")
                    row["rel_rms_h"] = float(f"{rel_rms(out[1], ref[1]):.3g}")
                if (batch, t) in fla:
                    row["fla_us"] = fla[(batch, t)]
                    row["vs_fla"] = round(us / fla[(batch, t)], 2)
                emit(row)
    with open(os.path.join(args.out, "prefill_chunk.json"), "w") as f:
        json.dump({"device": str(jax.devices()[0]), "copy_TB_per_s": round(bw / 1e12, 3), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
