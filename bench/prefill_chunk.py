"""Chunked GDN prefill: the Pallas kernels (jaxspec/pallas/gdn_chunked.py) against XLA and fla's chunk kernel.

Shapes: a Qwen3.8-27B GDN layer (H 16 key heads, HV 48 value heads, K = V = 128), bf16 q/k/v, fp32
gates and state, one layer; cases BATCHxT (--cases: B sequences of T tokens).

Method: CUDA-synchronised median of back-to-back jitted calls (`benchutil.median_us`). Rows: "xla
gdn_chunked" (`jaxspec.ops.gdn.gdn_chunked`, the jnp reference, under jit); "pallas gdn_chunked"
(the default ChunkConfig) with vs_xla = xla / ours, prep_us = its chunk-parallel prep kernel alone
(the rest is the sequential state kernel), and the relative RMS difference of o and h from XLA's;
floor = the op's own bytes (q, k, v, g, beta, h0 read; o, h written) / the fastest copy of the run
(`benchutil.floor_copies`), frac_bw = floor / time. fla: the anchor's "fla chunk varlen" rows
(fp32 state, its own process, H = HV: the key heads repeated) from --fla-jsonl, vs_fla = ours / fla.
--sweep adds a row per state-kernel config BVxWARPSxSTAGES[xCHUNK[xPREPWARPS]].

Usage (GPU):
  python3 bench/prefill_chunk.py --torch-copy --out $OUT       (own process, first)
  PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false python3 bench/prefill_chunk.py --out $OUT \\
      [--fla-jsonl fla.jsonl] [--sweep 32x4x1,64x4x2,128x8x1]
  python3 bench/prefill_chunk.py --smoke      (CPU, interpret mode, tiny shapes: checks the script)
Writes DIR/prefill_chunk.json (DIR = --out, default $OUT or bench/out).
"""

import argparse
import functools
import json
import os
import sys
import time

import benchutil  # bench/benchutil.py: the script directory is first on sys.path
import jax
import jax.numpy as jnp

sys.path.insert(0, benchutil.ROOT)
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
    """ "BVxWARPSxSTAGES[xCHUNK[xPREPWARPS]]" -> ChunkConfig."""
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
    return float(jnp.sqrt(jnp.mean((a - b) ** 2)) / jnp.sqrt(jnp.mean(b**2)))


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="1x1024,1x4096,1x16384,8x1024", help="BATCHxT, comma-separated")
    ap.add_argument("--impls", default="xla,pallas", help="which rows: xla, pallas (comma-separated)")
    ap.add_argument("--sweep", default="", help="extra Pallas configs BVxWARPSxSTAGES[xCHUNK[xPREPWARPS]]")
    ap.add_argument("--fla-jsonl", default="", help="fla anchor output of the same device call")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--reps", type=int, default=7)
    benchutil.add_common_args(ap)
    args = ap.parse_args(argv)
    if args.smoke:
        args.cases, args.iters, args.reps = "1x64", 1, 1
    return args


def main(args):
    global H, HV, K, V
    benchutil.setup_jax(args.smoke)
    if args.smoke:
        H, HV, K, V = 2, 4, 32, 32
    os.makedirs(args.out, exist_ok=True)
    impls = set(args.impls.split(","))
    fla = read_fla(args.fla_jsonl)
    copies, bw_src, bw = benchutil.floor_copies(args.out)
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
                emit(
                    {
                        "kernel": "xla gdn_chunked",
                        "batch": batch,
                        "T": t,
                        "us": round(xla_us, 1),
                        "tokens_per_s": round(batch * t / xla_us * 1e6),
                        "floor_us": round(floor_us, 1),
                    }
                )
            if "pallas" not in impls:
                continue
            for name, cfg in cfgs:
                if time.perf_counter() - start > args.budget_s:
                    break
                kernel = jax.jit(functools.partial(pallas_chunked.gdn_chunked, config=cfg))
                prep = jax.jit(functools.partial(pallas_chunked.chunk_matrices, num_value_heads=HV, config=cfg))
                try:
                    us, out = benchutil.median_us(kernel, *xs, reps=args.reps, inner=args.iters)
                    prep_us, _ = benchutil.median_us(
                        prep, xs[0], xs[1], xs[3], xs[4], None, reps=args.reps, inner=args.iters
                    )
                except Exception as e:  # noqa: BLE001 - a config the GPU rejects (e.g. shared memory)
                    emit({"kernel": name, "batch": batch, "T": t, "error": f"{type(e).__name__}: {str(e)[:300]}"})
                    continue
                row = {
                    "kernel": name,
                    "batch": batch,
                    "T": t,
                    "us": round(us, 1),
                    "prep_us": round(prep_us, 1),
                    "tokens_per_s": round(batch * t / us * 1e6),
                    "floor_us": round(floor_us, 1),
                    "frac_bw": round(floor_us / us, 3),
                }
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
        json.dump(
            {
                "device": str(jax.devices()[0]),
                "floor_bandwidth": bw_src,
                "copy_TB_per_s": {k: round(v / 1e12, 3) for k, v in copies.items()},
                "rows": rows,
            },
            f,
            indent=1,
        )
    return 0


if __name__ == "__main__":
    benchutil.run_main(parse, main)
