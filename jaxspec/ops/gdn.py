"""Gated DeltaNet (GDN): gating, l2norm, recurrent and chunked prefill, replay verify, fold.

Per token, per value head, with h [K, V] (docs/design.md section 3):
    h <- e^g h ;  u = beta (v - h^T k) ;  h <- h + k u^T ;  o = h^T q      (read after the update)
q and k arrive l2-normalised (q also scaled by K^-1/2); value head hv reads key head hv // r with
r = HV / H. u is the *corrected* update, so the state after any prefix of records (k_j, u_j, g_j) on
top of a checkpoint h0 is  h_m = e^{G_m} h0 + sum_j e^{G_m - G_j} k_j u_j^T  (G inclusive cumsum;
the references form each G_i - G_j as a sum of its own gates, `_log_decays`).
That identity gives rollback without snapshots: verify writes records into a per-slot ring, commit
advances a cursor, and a fold (one matmul) moves live records into the checkpoint.

Ring layouts per slot: keys [H, L, K] (activation dtype), updates [HV, L, V] as one float32 array
or a (hi, lo) pair of bfloat16 arrays with u ~= hi + lo, gates [HV, L] float32.
"""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxspec.ops import packing, tp
from jaxspec.ops.dispatch import use_kernel
from jaxspec.pallas import fold as pallas_fold
from jaxspec.pallas import gdn_chunked as pallas_chunked
from jaxspec.pallas import gdn_verify as pallas_verify

HIGHEST = jax.lax.Precision.HIGHEST


def l2norm(x, eps=1e-6):
    """x / sqrt(sum(x^2) + eps) over the last axis, in float32."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def gating(a, b, A_log, dt_bias):
    """Log-decay g = -exp(A_log) softplus(a + dt_bias) (<= 0) and beta = sigmoid(b), float32."""
    g = -jnp.exp(A_log.astype(jnp.float32)) * jax.nn.softplus(a.astype(jnp.float32) + dt_bias.astype(jnp.float32))
    return g, jax.nn.sigmoid(b.astype(jnp.float32))


def expand_heads(x, num_value_heads, axis):
    """Key-head array -> value-head array along `axis` (value head hv reads key head hv // r)."""
    return jnp.repeat(x, num_value_heads // x.shape[axis], axis=axis)


def read_updates(ring_u):
    """Ring updates as float32: the array itself, or hi + lo of a bfloat16 pair."""
    if isinstance(ring_u, (tuple, list)):
        hi, lo = ring_u
        return hi.astype(jnp.float32) + lo.astype(jnp.float32)
    return ring_u.astype(jnp.float32)


def _split_updates(ring_u, u):
    """u float32 -> what the ring stores: u itself, or (hi, lo) with hi = bf16(u), lo = bf16(u - hi)."""
    if isinstance(ring_u, (tuple, list)):
        # reduce_precision rounds to bfloat16 inside float32 explicitly: XLA's GPU excess-precision
        # rewrite may drop an f32 -> bf16 -> f32 round trip, which would zero the residual.
        hi = jax.lax.reduce_precision(u, exponent_bits=8, mantissa_bits=7)
        return hi.astype(ring_u[0].dtype), (u - hi).astype(ring_u[1].dtype)
    return (u,)


def _where(mask, x):
    """Causality by selection: masked entries become exactly 0 whatever they held (NaN included)."""
    return jnp.where(mask, x, jnp.zeros((), x.dtype))


def _log_decays(g):
    """g [..., T] -> D [..., T, T]: D[i, j] = g_{j+1} + ... + g_i (the log decay from token j to
    token i) for j <= i, -inf above the diagonal.

    Each entry sums its own gates down a column. The difference G_i - G_j of the cumsum G would
    carry the rounding of |G_j|, which large gates make much larger than the difference: at
    G ~ -400 a decay near 1 comes out 2e-5 off, and the model's float32 logits 1e-4 of their max
    off the float64 evaluation (random checkpoints with extreme gates, tests/test_precision.py).
    A non-finite g_t reaches rows >= t only.
    """
    t = g.shape[-1]
    strict = jnp.tril(jnp.ones((t, t), bool), -1)
    terms = _where(strict, jnp.broadcast_to(g[..., :, None], g.shape + (t,)))  # terms[i, j] = g_i, j < i
    return jnp.where(jnp.tril(jnp.ones((t, t), bool)), jnp.cumsum(terms, axis=-2), -jnp.inf)


def _suffix_sums(g):
    """g [..., L] -> S [..., L]: S[j] = g_{j+1} + ... + g_{L-1} (0 for the last), summed term by
    term from the end (no difference of large partial sums, as in `_log_decays`)."""
    inclusive = jnp.cumsum(g[..., ::-1], axis=-1)[..., ::-1]
    return jnp.concatenate([inclusive[..., 1:], jnp.zeros_like(g[..., :1])], axis=-1)


# ---------------------------------------------------------------------------------------------
# Recurrent and chunked forms (prefill)


def gdn_recurrent(q, k, v, g, beta, h0, *, impl="auto"):
    """Token-by-token gated delta rule.

    q, k [B, T, H, K]; v [B, T, HV, V]; g, beta [B, T, HV]; h0 [B, HV, K, V]
    -> (o [B, T, HV, V] float32, h [B, HV, K, V] float32).
    """
    use_kernel("gdn_recurrent", impl, None)
    hv = v.shape[2]
    q, k = (expand_heads(x.astype(jnp.float32), hv, 2) for x in (q, k))

    def step(h, inputs):
        qt, kt, vt, gt, bt = inputs
        h = h * jnp.exp(gt)[..., None, None]
        u = bt[..., None] * (vt - jnp.einsum("bhkv,bhk->bhv", h, kt, precision=HIGHEST))
        h = h + kt[..., :, None] * u[..., None, :]
        return h, jnp.einsum("bhkv,bhk->bhv", h, qt, precision=HIGHEST)

    xs = tuple(jnp.moveaxis(x.astype(jnp.float32), 1, 0) for x in (q, k, v, g, beta))
    h, o = jax.lax.scan(step, h0.astype(jnp.float32), xs)
    return jnp.moveaxis(o, 0, 1), h


def _chunk_step(h0, chunk):
    """One WY/UT chunk. h0 [B, HV, K, V]; chunk tensors head-major: q, k [B, HV, C, K], v [B, HV, C, V],
    g, beta [B, HV, C]. Returns (h1, o [B, HV, C, V])."""
    q, k, v, g, beta = chunk
    c = g.shape[-1]
    G = jnp.cumsum(g, axis=-1)
    incl = jnp.tril(jnp.ones((c, c), bool))
    strict = jnp.tril(jnp.ones((c, c), bool), -1)
    log_decay = _log_decays(g)  # [B, HV, C, C]
    decay = jnp.exp(log_decay)
    kk = jnp.einsum("bhik,bhjk->bhij", k, k, precision=HIGHEST)
    A = jnp.where(strict, beta[..., :, None] * kk * decay, 0.0)
    rhs = beta[..., None] * (v - jnp.exp(G)[..., None] * jnp.einsum("bhck,bhkv->bhcv", k, h0, precision=HIGHEST))
    u = _forward_substitute(A, rhs)
    qk = jnp.where(incl, jnp.einsum("bhik,bhjk->bhij", q, k, precision=HIGHEST) * decay, 0.0)
    o = jnp.exp(G)[..., None] * jnp.einsum("bhck,bhkv->bhcv", q, h0, precision=HIGHEST) + jnp.einsum(
        "bhij,bhjv->bhiv", qk, u, precision=HIGHEST
    )
    k_w = k * jnp.exp(log_decay[..., -1, :])[..., None]  # e^{G_c - G_j}
    h1 = jnp.exp(G[..., -1:])[..., None] * h0 + jnp.einsum("bhck,bhcv->bhkv", k_w, u, precision=HIGHEST)
    return h1, o


def gdn_chunked(q, k, v, g, beta, h0, lengths=None, *, chunk=64, impl="auto"):
    """Chunked (WY / UT) gated delta rule over whole sequences, chunks of min(`chunk`, T) tokens
    (the kernel: its own chunk size).

    Shapes as gdn_recurrent; lengths [B] or None (all T). Positions t >= lengths[b] leave the
    state unchanged and output 0. Returns (o [B, T, HV, V] float32, h [B, HV, K, V] float32).
    A short sequence is one chunk of its own length: padding a 4-token prompt to 64 made a
    512-row prefill ~25x slower on the CPU (the intra-chunk solve grows with the chunk squared).
    """
    if tp.size() > 1:
        heads = tp.split(4, 2)
        args = (q, k, v, g, beta, h0) + (() if lengths is None else (lengths,))
        specs = (heads, heads, heads, tp.split(3, 2), tp.split(3, 2), tp.split(4, 1), P())
        return tp.per_shard(
            lambda *a: gdn_chunked(*a, chunk=chunk, impl=impl), args, specs[: len(args)], (heads, tp.split(4, 1))
        )
    if use_kernel("gdn_chunked", impl, lambda: pallas_chunked.supports(q, k, v, g, beta, h0, lengths)):
        return pallas_chunked.gdn_chunked(q, k, v, g, beta, h0, lengths)  # its own chunk size
    b, t, hv, _ = v.shape
    chunk = max(1, min(chunk, t))
    lengths = jnp.full((b,), t, jnp.int32) if lengths is None else lengths
    valid = jnp.arange(t)[None, :] < lengths[:, None]  # [B, T]
    n_chunks = -(-t // chunk)
    pad = n_chunks * chunk - t

    def prep(x, heads_axis_expand):
        x = x.astype(jnp.float32)
        if heads_axis_expand:
            x = expand_heads(x, hv, 2)
        x = _where(valid.reshape(valid.shape + (1,) * (x.ndim - 2)), x)
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape((b, n_chunks, chunk) + x.shape[2:])
        return jnp.moveaxis(jnp.moveaxis(x, 3, 2), 1, 0)  # [n_chunks, B, HV, C, ...]

    xs = (prep(q, True), prep(k, True), prep(v, False), prep(g, False), prep(beta, False))
    h, o = jax.lax.scan(_chunk_step, h0.astype(jnp.float32), xs)
    o = jnp.moveaxis(o, 0, 1)  # [B, n_chunks, HV, C, V]
    o = jnp.moveaxis(o, 3, 2).reshape(b, n_chunks * chunk, hv, -1)[:, :t]
    return o, h


# ---------------------------------------------------------------------------------------------
# Fold and replay verify


def _fold_state(h0, keys, updates, gates, num_records):
    """h0 [B, HV, K, V] f32; keys [B, H, L, K]; updates [B, HV, L, V] f32; gates [B, HV, L];
    num_records [B] -> e^{G_m} h0 + sum_{j<m} e^{G_m - G_j} k_j u_j^T with G_j = g_0 + .. + g_j and
    G_m the sum of the m live gates (records j >= m ignored)."""
    hv, ring_len = gates.shape[1], gates.shape[2]
    live = (jnp.arange(ring_len)[None, :] < num_records[:, None])[:, None, :]  # [B, 1, L]
    gates = _where(live, gates.astype(jnp.float32))
    G_m = jnp.sum(gates, axis=-1)
    coef = _where(live, jnp.exp(_suffix_sums(gates)))  # [B, HV, L]
    k_w = _where(live[..., None], expand_heads(keys.astype(jnp.float32), hv, 1) * coef[..., None])
    u = _where(live[..., None], updates)
    return jnp.exp(G_m)[..., None, None] * h0 + jnp.einsum("bhlk,bhlv->bhkv", k_w, u, precision=HIGHEST)


def gdn_fold(ckpt, ring_k, ring_u, ring_g, num_records, *, max_records=None, impl="auto"):
    """Fold the first num_records[s] ring records of every slot into its checkpoint.

    ckpt [..., S1, HV, K, V] (float32 or bfloat16); ring_k [..., S1, H, L, K]; ring_u
    [..., S1, HV, L, V] float32 or a (hi, lo) bfloat16 pair; ring_g [..., S1, HV, L] float32;
    num_records [S1] int32. The optional leading axis is the GDN layer: all layers in one call.
    Returns the new checkpoint in ckpt's dtype; a slot with 0 records is unchanged.

    max_records: None, or a static bound the caller guarantees (num_records <= max_records; fold
    policy `every` folds at most one window): the reference then reads only the first max_records
    ring positions (on the CPU its product over all L positions was ~7% of a decode step). The
    kernel's loop already stops at each slot's count, so it ignores the bound.
    """
    if tp.size() > 1:
        return tp.per_shard(
            lambda *a: gdn_fold(*a, max_records=max_records, impl=impl),
            (ckpt, ring_k, ring_u, ring_g, num_records),
            (
                tp.split_like(ckpt, -3),
                tp.split_like(ring_k, -3),
                tp.split_like(ring_u, -3),
                tp.split_like(ring_g, -2),
                P(),
            ),
            tp.split_like(ckpt, -3),
        )
    if use_kernel("gdn_fold", impl, lambda: pallas_fold.supports(ckpt, ring_k, ring_u, ring_g, num_records)):
        return pallas_fold.gdn_fold(ckpt, ring_k, ring_u, ring_g, num_records)
    updates = read_updates(ring_u)
    if max_records is not None and max_records < ring_g.shape[-1]:
        ring_k, updates, ring_g = ring_k[..., :max_records, :], updates[..., :max_records, :], ring_g[..., :max_records]
    fold = lambda h, k, u, g: _fold_state(h.astype(jnp.float32), k, u, g, num_records).astype(ckpt.dtype)
    if ckpt.ndim == 5:
        return jax.vmap(fold)(ckpt, ring_k, updates, ring_g)
    return fold(ckpt, ring_k, updates, ring_g)


def _forward_substitute(A, rhs):
    """Solve (I + A) U = rhs with A [.., T, T] strictly lower; row i reads rows < i only, by
    selection, so a non-finite row reaches no earlier one. A verify window's loop (T <= 16) is
    unrolled: a rolled XLA while loop pays its loop ops again every row (on the CPU each op is a
    dispatch); a prefill chunk's (64 rows) stays rolled, for compile time."""
    t = A.shape[-1]

    def body(i, u):
        earlier = (jnp.arange(t) < i)[:, None]
        row = jnp.sum(_where(earlier, A[..., i, :, None] * u), axis=-2)
        return u.at[..., i, :].set(rhs[..., i, :] - row)

    return jax.lax.fori_loop(0, t, body, jnp.zeros_like(rhs), unroll=t <= 16)


def _window(h, q, k, v, g, beta, valid):
    """Run a verify window on top of the history state h, chunk-form with causal selection.

    h [B, HV, K, V] f32; q, k [B, HV, T, K]; v [B, HV, T, V]; g, beta [B, HV, T]; valid [B, 1, T].
    Returns (o [B, HV, T, V], u [B, HV, T, V]). A non-finite input at token t reaches no output
    or update of a token < t: every cross-token product is selected, never multiplied by zero.
    """
    t = g.shape[-1]
    q, k, v = (_where(valid[..., None], x) for x in (q, k, v))
    g, beta = _where(valid, g), _where(valid, beta)
    G = jnp.cumsum(g, axis=-1)
    incl = jnp.tril(jnp.ones((t, t), bool))
    strict = jnp.tril(jnp.ones((t, t), bool), -1)
    decay = jnp.exp(_log_decays(g))
    kk = jnp.einsum("bhik,bhjk->bhij", k, k, precision=HIGHEST)
    A = jnp.where(strict, beta[..., :, None] * kk * decay, 0.0)
    eG = jnp.exp(G)[..., None]
    rhs = beta[..., None] * (v - eG * jnp.einsum("bhtk,bhkv->bhtv", k, h, precision=HIGHEST))
    u = _forward_substitute(A, rhs)
    qk = jnp.where(incl, jnp.einsum("bhik,bhjk->bhij", q, k, precision=HIGHEST) * decay, 0.0)
    mixed = jnp.sum(_where(incl[..., None], qk[..., None] * u[..., None, :, :]), axis=-2)
    o = eG * jnp.einsum("bhtk,bhkv->bhtv", q, h, precision=HIGHEST) + mixed
    return o, u


def gdn_verify(
    q,
    k,
    v,
    g,
    beta,
    ckpt,
    ring_k,
    ring_u,
    ring_g,
    write_pos,
    query_start_loc,
    slots,
    t_max,
    *,
    layer=None,
    ring_empty=False,
    impl="auto",
):
    """Replay verify of a packed window on top of each slot's checkpoint and ring history.

    q, k [N, H, K] (normalised); v [N, HV, V]; g, beta [N, HV]; ckpt [S1, HV, K, V]; ring_k
    [S1, H, L, K]; ring_u [S1, HV, L, V] float32 or (hi, lo) bf16; ring_g [S1, HV, L]; write_pos [S1];
    query_start_loc [B+1]; slots [B]; t_max static.
    Returns (o [N, HV, V] float32, ring_k', ring_u', ring_g'): the window's records (k_t, u_t, g_t)
    written at ring positions write_pos[slot] + t. The checkpoint is only read. Padding rows and
    slot-0 requests output 0 and write nothing.

    layer: None, or an int / int32 scalar (traced is fine) when ckpt, ring_k, ring_u and ring_g
    are stacks over the GDN layers ([G, S1, ...]); the returned rings are then the stacks with that layer's records
    written. The kernel reads and writes the stacks in place (a per-layer slice passed to a kernel
    is a copy XLA must make, and writing it back is another).

    ring_empty: True promises write_pos[slot] == 0 for every slot (fold policy `every`: each commit
    folds all records), so the window starts from the checkpoint: the reference reads no ring
    history (on the CPU that replay's product was ~5% of a step). The kernel reads write_pos and
    replays nothing for a zero count, so it ignores the promise.
    """
    if tp.size() > 1:
        rings = (tp.split_like(ring_k, -3), tp.split_like(ring_u, -3), tp.split_like(ring_g, -2))
        return tp.per_shard_at_layer(
            lambda *a, layer: gdn_verify(*a, t_max, layer=layer, ring_empty=ring_empty, impl=impl),
            (q, k, v, g, beta, ckpt, ring_k, ring_u, ring_g, write_pos, query_start_loc, slots),
            (tp.split(3, 1),) * 3 + (tp.split(2, 1),) * 2 + (tp.split_like(ckpt, -3),) + rings + (P(),) * 3,
            (tp.split(3, 1),) + rings,
            layer,
        )
    args = (q, k, v, g, beta, ckpt, ring_k, ring_u, ring_g, write_pos, query_start_loc, slots, t_max)
    if use_kernel("gdn_verify", impl, lambda: pallas_verify.supports(*args, layer=layer)):
        return pallas_verify.gdn_verify(*args, layer=layer)
    if layer is not None:
        pick = lambda x: tuple(p[layer] for p in x) if isinstance(x, tuple) else x[layer]
        o, rk, ru, rg = gdn_verify(
            q,
            k,
            v,
            g,
            beta,
            ckpt[layer],
            ring_k[layer],
            pick(ring_u),
            ring_g[layer],
            write_pos,
            query_start_loc,
            slots,
            t_max,
            ring_empty=ring_empty,
            impl="ref",
        )
        put = lambda stack, x: stack.at[layer].set(x)
        ring_u = tuple(map(put, ring_u, ru)) if isinstance(ring_u, tuple) else put(ring_u, ru)
        return o, put(ring_k, rk), ring_u, put(ring_g, rg)
    hv = ring_g.shape[1]
    (qp, kp, vp, gp, bp), valid = zip(*(packing.to_padded(x, query_start_loc, t_max) for x in (q, k, v, g, beta)))
    valid = valid[0] & (slots > 0)[:, None]  # [B, T]
    base = write_pos[slots]
    h = ckpt[slots].astype(jnp.float32)
    if not ring_empty:
        h = _fold_state(h, ring_k[slots], read_updates(ring_u)[slots], ring_g[slots], base)
    heads_first = lambda x: jnp.moveaxis(x.astype(jnp.float32), 1, 2)
    o, u = _window(
        h,
        heads_first(expand_heads(qp, hv, 2)),
        heads_first(expand_heads(kp, hv, 2)),
        heads_first(vp),
        jnp.swapaxes(gp, 1, 2),
        jnp.swapaxes(bp, 1, 2),
        valid[:, None, :],
    )

    # Ring writes at (slot, head, write_pos + t); invalid tokens are sent out of range and dropped.
    num_slots = ring_g.shape[0]
    slot_t = jnp.where(valid, slots[:, None], num_slots)  # [B, T]
    pos_t = base[:, None] + jnp.arange(t_max)[None, :]
    kh = jnp.arange(ring_k.shape[1])[None, None, :]
    ring_k = ring_k.at[slot_t[..., None], kh, pos_t[..., None]].set(kp.astype(ring_k.dtype), mode="drop")
    vh = jnp.arange(hv)[None, :, None]
    at_u = (slot_t[:, None, :], vh, pos_t[:, None, :])
    ring_g = ring_g.at[at_u].set(jnp.swapaxes(gp, 1, 2).astype(ring_g.dtype), mode="drop")
    parts = tuple(ring_u) if isinstance(ring_u, (tuple, list)) else (ring_u,)
    new_parts = tuple(p.at[at_u].set(x.astype(p.dtype), mode="drop") for p, x in zip(parts, _split_updates(ring_u, u)))
    ring_u = new_parts if isinstance(ring_u, (tuple, list)) else new_parts[0]
    o = packing.to_packed(jnp.moveaxis(o, 1, 2), query_start_loc, q.shape[0])
    return o, ring_k, ring_u, ring_g
