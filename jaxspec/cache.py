"""Device state of every request (docs/design.md section 4): SSM checkpoints, rings, conv and KV caches.

Every array has a slot axis of size num_slots + 1. Slot 0 is the null slot: padding rows point at
it, nothing is written to it and nothing reads it. Real requests own slots 1..num_slots.
There is no per-draft-token SSM state: rejected drafts are rolled back by the ring cursor.
"""

import math

import jax.numpy as jnp
from flax import struct

from jaxspec.config import CacheConfig, TargetConfig


@struct.dataclass
class CacheState:
    """The state arrays (G = GDN layers, A = attention layers, S1 = num_slots + 1).

    ckpt        [G, S1, HV, K, V]      state_dtype   SSM checkpoint, written only by prefill and fold
    ring_k      [G, S1, H, L, K]       dtype         record keys, once per key head
    ring_u      [G, S1, HV, L, V]      float32, or a (hi, lo) pair of bfloat16 (u ~= hi + lo)
    ring_g      [G, S1, HV, L]         float32       record log-decays
    write_pos   [S1]                   int32         live records per slot (a fold resets it to 0)
    conv_state  [G, S1, W-1, C]        dtype         raw inputs of the last W-1 committed tokens
    conv_window [G, S1, T, C]          dtype         raw inputs of the last verify window
    k_cache     [A, S1, M, KVH, D]     dtype         (v_cache alike)
    seq_len     [S1]                   int32         tokens in the state (the anchor is not yet in it)
    """

    ckpt: jnp.ndarray
    ring_k: jnp.ndarray
    ring_u: jnp.ndarray | tuple
    ring_g: jnp.ndarray
    write_pos: jnp.ndarray
    conv_state: jnp.ndarray
    conv_window: jnp.ndarray
    k_cache: jnp.ndarray
    v_cache: jnp.ndarray
    seq_len: jnp.ndarray
    config: CacheConfig = struct.field(pytree_node=False)


def _shapes(target: TargetConfig, cache: CacheConfig):
    """Name -> (shape, dtype) of every state array; ring_u maps to a list of parts."""
    s1, t, L = cache.num_slots + 1, cache.window, cache.ring_len
    g, a = len(target.gdn_layers), len(target.attn_layers)
    h, hv = target.linear_num_key_heads, target.linear_num_value_heads
    k, v = target.linear_key_head_dim, target.linear_value_head_dim
    act = jnp.dtype(cache.dtype)
    u_parts = [jnp.float32] if cache.ring_dtype == "float32" else [jnp.bfloat16, jnp.bfloat16]
    kv = ((a, s1, cache.max_len, target.num_key_value_heads, target.head_dim), act)
    return {
        "ckpt": ((g, s1, hv, k, v), jnp.dtype(cache.state_dtype)),
        "ring_k": ((g, s1, h, L, k), act),
        "ring_u": [((g, s1, hv, L, v), jnp.dtype(d)) for d in u_parts],
        "ring_g": ((g, s1, hv, L), jnp.dtype(jnp.float32)),
        "write_pos": ((s1,), jnp.dtype(jnp.int32)),
        "conv_state": ((g, s1, target.linear_conv_kernel_dim - 1, target.conv_dim), act),
        "conv_window": ((g, s1, t, target.conv_dim), act),
        "k_cache": kv,
        "v_cache": kv,
        "seq_len": ((s1,), jnp.dtype(jnp.int32)),
    }


def init_cache(target: TargetConfig, cache: CacheConfig) -> CacheState:
    """All-zero state for `cache.num_slots` requests of the target."""
    arrays = {}
    for name, spec in _shapes(target, cache).items():
        if name == "ring_u":
            parts = tuple(jnp.zeros(shape, dtype) for shape, dtype in spec)
            arrays[name] = parts[0] if len(parts) == 1 else parts
        else:
            arrays[name] = jnp.zeros(*spec)
    return CacheState(config=cache, **arrays)


def cache_nbytes(target: TargetConfig, cache: CacheConfig) -> int:
    """Bytes of the device state, from the docs/design.md section 4 table (no per-draft-token state)."""
    total = 0
    for spec in _shapes(target, cache).values():
        for shape, dtype in spec if isinstance(spec, list) else [spec]:
            total += math.prod(shape) * dtype.itemsize
    return total
