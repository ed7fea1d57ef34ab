"""Gated full attention's core: causal prefill and window verify against the per-slot KV cache.

GQA: query head h reads kv head h // (Hq / KVH). Scale D^-1/2, softmax in float32.
KV cache per layer [S1, max_len, KVH, D]; a slot holds positions 0..seq_len-1 of its request, and
a verify window's K/V are written at seq_len + t before attention reads them. Rejected window
tokens leave garbage past seq_len that later windows overwrite; seq_len decides what is read.
"""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxspec.ops import packing, tp
from jaxspec.ops.dispatch import use_kernel
from jaxspec.pallas import attention_verify as attention_verify_kernel

HIGHEST = jax.lax.Precision.HIGHEST


def _attend(q, k, v, mask):
    """q [B, T, Hq, D]; k, v [B, S, KVH, D]; mask [B, T, S] -> [B, T, Hq, D] float32 (0 where no key).

    Query heads are grouped by their kv head ([B, T, KVH, Hq / KVH, D]) rather than the keys
    repeated per query head: on the CPU the repeat and the transposes it forces cost more than the
    attention's arithmetic (2-2.6x the grouped form at 512 keys)."""
    b, t, hq, d = q.shape
    kvh = k.shape[2]
    qg = q.astype(jnp.float32).reshape(b, t, kvh, hq // kvh, d)
    scores = jnp.einsum("btgrd,bsgd->btgrs", qg, k.astype(jnp.float32), precision=HIGHEST) * d**-0.5
    mask = mask[:, :, None, None, :]
    scores = jnp.where(mask, scores, -jnp.inf)
    probs = jnp.exp(scores - jnp.max(jnp.where(mask, scores, 0.0), axis=-1, keepdims=True))
    probs = jnp.where(mask, probs, 0.0)
    denom = jnp.sum(probs, axis=-1, keepdims=True)
    probs = probs / jnp.where(denom > 0, denom, 1.0)
    o = jnp.einsum("btgrs,bsgd->btgrd", probs, v.astype(jnp.float32), precision=HIGHEST)
    return o.reshape(b, t, hq, d)


def attention_prefill(q, k, v, lengths, *, impl="auto"):
    """Causal attention over whole sequences. q [B, T, Hq, D]; k, v [B, T, KVH, D]; lengths [B]
    -> o [B, T, Hq, D] in q.dtype; rows t >= lengths[b] are 0."""
    use_kernel("attention_prefill", impl, None)
    t = q.shape[1]
    pos = jnp.arange(t)
    mask = (pos[None, :, None] >= pos[None, None, :]) & (pos[None, None, :] < lengths[:, None, None])
    mask = mask & (pos[None, :, None] < lengths[:, None, None])
    return _attend(q, k, v, mask).astype(q.dtype)


def kv_write(k_cache, v_cache, k, v, seq_lens, query_start_loc, slots, layer=None):
    """Write a packed window's K/V [N, KVH, D] at positions seq_lens[slot] + t of each request's slot.
    Caches are [S1, M, KVH, D], or stacked [A, S1, M, KVH, D] with `layer` the index to write (one
    scatter into the donated stack, no per-layer copy). Padding rows and slot-0 requests write nothing."""
    num_slots = k_cache.shape[-4]
    request, pos, valid = packing.packed_index(query_start_loc, k.shape[0])
    slot = slots[request]
    slot = jnp.where(valid & (slot > 0), slot, num_slots)
    at = (slot, seq_lens[jnp.minimum(slot, num_slots - 1)] + pos)
    if layer is not None:
        at = (layer,) + at
    return (
        k_cache.at[at].set(k.astype(k_cache.dtype), mode="drop"),
        v_cache.at[at].set(v.astype(v_cache.dtype), mode="drop"),
    )


def attention_verify(q, k_cache, v_cache, seq_lens, query_start_loc, slots, t_max, *, layer=None, impl="auto"):
    """Window attention against the cache. q [N, Hq, D]; caches [S1, M, KVH, D]; seq_lens [S1]
    (committed tokens before the window); query_start_loc [B+1]; slots [B]; t_max static
    -> o [N, Hq, D] in q.dtype.

    Window token t of request r sits at position p = seq_lens[slots[r]] + t and reads cache
    positions 0..p. Padding rows and slot-0 requests output 0. With `layer` (an int or int32 scalar) the
    caches are the layer stacks [A, S1, M, KVH, D] and that layer is read: the kernel reads the
    stack in place (a layer slice handed to a kernel is a copy of the whole layer cache).
    """
    if tp.size() > 1:
        return tp.per_shard_at_layer(
            lambda *a, layer: attention_verify(*a, t_max, layer=layer, impl=impl),
            (q, k_cache, v_cache, seq_lens, query_start_loc, slots),
            (tp.split(3, 1), tp.split(k_cache.ndim, -2), tp.split(v_cache.ndim, -2), P(), P(), P()),
            tp.split(3, 1),
            layer,
        )
    if use_kernel(
        "attention_verify",
        impl,
        lambda: attention_verify_kernel.supports(q, k_cache, v_cache, seq_lens, query_start_loc, slots, t_max, layer),
    ):
        return attention_verify_kernel.attention_verify(
            q, k_cache, v_cache, seq_lens, query_start_loc, slots, t_max, layer=layer
        )
    if layer is not None:
        k_cache, v_cache = k_cache[layer], v_cache[layer]
    qp, valid = packing.to_padded(q, query_start_loc, t_max)  # [B, T, Hq, D]
    valid = valid & (slots > 0)[:, None]
    last = seq_lens[slots][:, None] + jnp.arange(t_max)[None, :]  # [B, T]
    key_pos = jnp.arange(k_cache.shape[1])
    mask = (key_pos[None, None, :] <= last[..., None]) & valid[..., None]
    o = _attend(qp, k_cache[slots], v_cache[slots], mask)
    return packing.to_packed(o, query_start_loc, q.shape[0]).astype(q.dtype)


def _block_write(k_cache, v_cache, k_block, v_block, ctx_len, slots, layer):
    """Write a block's K/V [B, T, KVH, D] at positions ctx_len + t of each request's slot (slot 0
    and positions past the cache write nothing)."""
    t = k_block.shape[1]
    num_slots = k_cache.shape[-4]
    slot = jnp.where(slots > 0, slots, num_slots)[:, None]
    at = (slot, ctx_len[:, None] + jnp.arange(t)[None, :])
    if layer is not None:
        at = (layer,) + at
    return (
        k_cache.at[at].set(k_block.astype(k_cache.dtype), mode="drop"),
        v_cache.at[at].set(v_block.astype(v_cache.dtype), mode="drop"),
    )


def attention_block(
    q, k_cache, v_cache, ctx_len, slots, k_block, v_block, context_window=0, *, layer=None, impl="auto"
):
    """A draft block attending to its slot's cached context and, bidirectionally, to itself.

    q [B, T, Hq, D]; caches [S1, M, KVH, D] (context positions 0..ctx_len-1 valid), or layer stacks
    [A, S1, M, KVH, D] with `layer` the index; ctx_len [B]; slots [B] (0 = padding row);
    k_block, v_block [B, T, KVH, D]; context_window static (0 = the whole context, else only
    positions >= ctx_len - context_window) -> (o [B, T, Hq, D] in q.dtype, k_cache, v_cache).

    The block's K/V are written into the caches at positions ctx_len .. ctx_len + T - 1 first
    (scratch: the context's own K/V overwrite them once those positions are committed), then every
    block token reads keys [max(0, ctx_len - context_window) or 0, ctx_len + T): the cost follows
    the tokens in context, not M. Needs M >= ctx_len + T. Slot-0 rows write nothing and output 0.
    The kernel is the verify attention's, called with causal=False and a key window.
    """
    b, t = q.shape[:2]
    k_cache, v_cache = _block_write(k_cache, v_cache, k_block, v_block, ctx_len, slots, layer)
    num_slots = k_cache.shape[-4]
    seq_lens = (
        jnp.zeros((num_slots,), jnp.int32)
        .at[jnp.where(slots > 0, slots, num_slots)]
        .set(ctx_len.astype(jnp.int32), mode="drop")
    )
    query_start_loc = jnp.arange(b + 1, dtype=jnp.int32) * t
    packed = q.reshape((b * t,) + q.shape[2:])
    if use_kernel(
        "attention_block",
        impl,
        lambda: attention_verify_kernel.supports(packed, k_cache, v_cache, seq_lens, query_start_loc, slots, t, layer),
    ):
        o = attention_verify_kernel.attention_verify(
            packed,
            k_cache,
            v_cache,
            seq_lens,
            query_start_loc,
            slots,
            t,
            layer=layer,
            causal=False,
            key_window=context_window,
        )
        return o.reshape(q.shape), k_cache, v_cache
    kc, vc = (k_cache, v_cache) if layer is None else (k_cache[layer], v_cache[layer])
    pos = jnp.arange(kc.shape[1])[None, :]
    mask = pos < (ctx_len + t)[:, None]  # [B, M]
    if context_window:
        mask &= pos >= ctx_len[:, None] - context_window
    mask &= (slots > 0)[:, None]
    o = _attend(q, kc[slots], vc[slots], jnp.broadcast_to(mask[:, None, :], (b, t, mask.shape[-1])))
    return o.astype(q.dtype), k_cache, v_cache
