"""Chunked GDN prefill in XLA (`jaxspec.ops.gdn.gdn_chunked`, the jnp reference the prefill runs)
against flash-linear-attention's `chunk_gated_delta_rule` on the same shapes (issue 4 item 5: a
Pallas chunked-prefill kernel is due if XLA is more than 3x slower).

Shapes: Qwen3.8-27B TP1 GDN layer (H 16 key heads, HV 48 value heads, K = V = 128), bf16 q/k/v,
fp32 gates and state, one layer. fla takes as many key heads as value heads: its run repeats the
16 key heads 3x (same math; it reads 3x the q/k bytes, which is < 15 % of its traffic). Timing:
CUDA-synchronised median of back-to-back jitted calls. fla runs in its own process (the anchor
script) in the same device call: `python3 .carry/anchors/fla_gdn_bench.py --batches 1 --T 4096`
prints "fla chunk varlen" rows (one sequence of B*T tokens).
Usage (GPU): PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false python3 bench/prefill_chunk.py --out $OUT
"""
import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp

import benchutil  # bench/benchutil.py: the script directory is first on sys.path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jaxspec.ops.gdn import gdn_chunked  # noqa: E402

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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="1x1024,1x4096,1x16384,8x1024", help="BATCHxT, comma-separated")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--budget-s", type=float, default=1e9)
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "out"))
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    fn = jax.jit(lambda *a: gdn_chunked(*a, impl="ref"))
    rows, start = [], time.perf_counter()
    for case in args.cases.split(","):
        if time.perf_counter() - start > args.budget_s:
            break
        batch, t = map(int, case.split("x"))
        us, _ = benchutil.median_us(fn, *inputs(batch, t), reps=args.reps, inner=args.iters)
        row = {"kernel": "xla gdn_chunked", "batch": batch, "T": t, "us": round(us, 1),
               "tokens_per_s": round(batch * t / us * 1e6)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(os.path.join(args.out, "prefill_chunk.json"), "w") as f:
        json.dump({"device": str(jax.devices()[0]), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
