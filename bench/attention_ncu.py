"""A few verify-attention calls at one shape, for Nsight Compute (`ncu`) to profile.

The bench's case (T 8 queries a request, 24 q / 4 kv heads, D 256, bf16, every request holding
`context` committed tokens, M = context + 16 rounded up to 64); `--calls` calls, synchronised one by
one so that each kernel launch is its own ncu range. Profile, e.g. (GPU machine):

  ncu --clock-control none --set full --import-source yes -k regex:attention_verify \
      --launch-skip 4 --launch-count 2 -o $OUT/b8_1k python3 bench/attention_ncu.py --shape 8:1024
"""
import argparse
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from attention_kernel import cache_len  # noqa: E402  (bench/: the script directory is on sys.path)
from jaxspec.pallas import attention_verify as pav  # noqa: E402

T, HQ, KVH, D = 8, 24, 4, 256


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="1:4096", help="batch:context")
    ap.add_argument("--calls", type=int, default=6)
    ap.add_argument("--config", default="", help="AttentionVerifyConfig fields, e.g. block_k=32,num_stages=3")
    args = ap.parse_args(argv)
    batch, ctx = (int(x) for x in args.shape.split(":"))
    fields = dict(kv.split("=") for kv in args.config.split(",") if kv)
    config = pav.AttentionVerifyConfig(**{k: v if k == "split_kernel" else int(v) for k, v in fields.items()})
    m = cache_len(ctx)
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (batch * T, HQ, D), jnp.bfloat16)
    kc = jax.random.normal(ks[1], (batch + 1, m, KVH, D), jnp.bfloat16)
    vc = jax.random.normal(ks[2], (batch + 1, m, KVH, D), jnp.bfloat16)
    seq = jnp.full((batch + 1,), ctx, jnp.int32)
    qsl = jnp.arange(batch + 1, dtype=jnp.int32) * T
    slots = jnp.arange(1, batch + 1, dtype=jnp.int32)
    fn = jax.jit(lambda *a: pav.attention_verify(*a, T, config=config))
    for _ in range(args.calls):
        jax.block_until_ready(fn(q, kc, vc, seq, qsl, slots))
    print(f"{args.calls} calls at batch {batch} x context {ctx}, config {config}")


if __name__ == "__main__":
    main()
