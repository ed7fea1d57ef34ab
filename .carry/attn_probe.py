"""Per-kernel durations of verify attention at launch-bound shapes (run under ncu)."""
import sys
import jax, jax.numpy as jnp, numpy as np
from jaxspec.pallas import attention_verify as pav

T, HQ, KVH, D = 8, 24, 4, 256
for b, ctx in [(1, 1024), (1, 4096), (1, 32768), (8, 1024), (8, 4096)]:
    m = ctx + 16
    key = jax.random.key(b * ctx)
    k1, k2, k3 = jax.random.split(key, 3)
    q = jax.random.normal(k1, (b * T, HQ, D), jnp.bfloat16)
    kc = jax.random.normal(k2, (b + 1, m, KVH, D), jnp.bfloat16)
    vc = jax.random.normal(k3, (b + 1, m, KVH, D), jnp.bfloat16)
    seq = jnp.full((b + 1,), ctx, jnp.int32)
    qsl = jnp.arange(b + 1, dtype=jnp.int32) * T
    slots = jnp.arange(1, b + 1, dtype=jnp.int32)
    f = jax.jit(lambda q, kc, vc, seq, qsl, slots: pav.attention_verify(q, kc, vc, seq, qsl, slots, T))
    for _ in range(5):
        o = f(q, kc, vc, seq, qsl, slots)
    o.block_until_ready()
    print("shape", b, ctx, pav.AttentionVerifyConfig().resolve(b, KVH, m, 64, D, jnp.bfloat16), flush=True)
