"""Chunked GDN prefill as two Pallas Triton kernels (docs/design.md section 3).

Contract: `jaxspec.ops.gdn.gdn_chunked` (its jnp reference, `impl="ref"`, is the semantics):
q, k [B, T, H, K], v [B, T, HV, V], g, beta [B, T, HV], h0 [B, HV, K, V], lengths [B] or None
-> (o [B, T, HV, V] float32, h [B, HV, K, V] float32); value head hv reads key head hv // (HV / H);
positions t >= lengths[b] leave the state unchanged and output exactly 0. The chunk size C is a
config field, not part of the semantics.

Per chunk and value head, with G the inclusive cumulative log-decay (restarting each chunk),
E_ij = e^{G_i - G_j}, A = strict_lower(diag(beta)(K K^T * E)), T' = (I + A)^-1 diag(beta) and
P = incl_lower(Q K^T * E), everything that does not involve the state h is folded into two matrices:
    R = P T'  [C, C],    W = T'^T diag(e^{G_C - G}) K  [C, K],    r = V - diag(e^G) K h
    O = diag(e^G) Q h + R r,    h' = e^{G_C} h + W^T r
so the sequential part needs two products a chunk on its critical path (K h, then W^T r).

1. `_prep_kernel` (`chunk_matrices`), parallel: grid (HV, ceil(T / C), B). The 16 x 16 diagonal
   blocks of I + A are inverted by forward substitution, all blocks at once; Triton cannot index a
   register tensor, so their rows make a round trip through a small global scratch [C, 16] (with
   barriers). The blocks are merged on the tensor cores: I + A = (I + A_bd)(I + N) with N = X A_off
   nilpotent (X the block inverses), so (I + A)^-1 = (I - N)(I + N^2)... X. Writes W and R as
   (hi, lo) bfloat16 pairs and G; chunks at or past a request's length are skipped.
2. `_state_kernel`, sequential over chunks: grid (V / block_v, HV, B), h [K, block_v] float32 in
   registers. Axis 0 is the V block, so the programs reading one chunk's W, R, q, k run side by side
   and share them in L2. Chunks past the length store o = 0: every element of o is written once.

Precision: bf16 tensor-core products with hi/lo splits (a.b ~ a_hi.b_hi + a_hi.b_lo + a_lo.b_hi);
a bf16 operand is exact and needs no lo part; W and R are stored pre-split. Tests hold o and h to a
float64 recurrence. Every load past lengths[b] or T is masked (NaN there is never read), so such a
token has beta = g = 0, k = 0 and no part in A, R, W or the state; the intermediates are padded to
ceil(T / C) * C rows so no block overhangs an array. Timings (vs fla and XLA): bench/RESULTS.md.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxspec.pallas.hardware import default_interpret
from jaxspec.pallas.tiles import check_int_fields, check_pow2_fields, is_pow2, split_bf16

F32, BF16 = jnp.float32, jnp.bfloat16
W_COLS = 64  # columns of W per product in the prep kernel (register budget)
SUB = 16  # sub-block of the prep kernel: the tensor-core dot's minimum tile
_IN_DTYPES = (jnp.dtype(F32), jnp.dtype(BF16))


@dataclasses.dataclass(frozen=True)
class ChunkConfig:
    """Tile sizes and launch parameters; the defaults are the fastest on the H200
    (sweep: docs/journal.md). Only the chunk size changes the arithmetic (the WY grouping); the other
    fields change the tiling and the launch.

    chunk: tokens per chunk C (power of two in [16, 64]). The prep kernel inverts 16 x 16 diagonal
      blocks and merges C/16 of them; the state kernel's shared memory grows as C (K + C): C = 128
      does not fit an H200 SM.
    block_v: V columns per program of the state kernel (power of two >= 16, clipped to V). The
      state tile [K, block_v] float32 lives in registers; smaller tiles give more programs (B = 1:
      HV * V / block_v of them for NUM_SMS SMs) but re-read the chunk's W, R, q, k per tile (L2).
    num_warps / num_stages: the state kernel's Triton launch parameters; num_stages = 2 pipelines
      the loads of chunk c + 1 under chunk c's math but doubles the staging buffers (at block_v = 64
      just within an H200 SM's shared memory with bf16 inputs, beyond it with float32 ones).
    prep_warps: warps of the prep kernel (4 = one warpgroup: its [C, C] products run as wgmma).
    """

    chunk: int = 32
    block_v: int = 64
    num_warps: int = 4
    num_stages: int = 1
    prep_warps: int = 1

    def __post_init__(self):
        check_pow2_fields(self, (("chunk", 16, 64), ("block_v", 16, 256), ("num_warps", 1, 16), ("prep_warps", 1, 16)))
        check_int_fields(self, (("num_stages", 1, 8),))


def supports(q, k, v, g, beta, h0, lengths=None, config=None) -> bool:
    """Whether the kernels cover these shapes and dtypes (arrays or ShapeDtypeStructs)."""
    try:
        if q.ndim != 4 or v.ndim != 4:
            return False
        b, t, h, kd = q.shape
        hv, vd = v.shape[2], v.shape[3]
        cfg = config or ChunkConfig()
        ok = (
            k.shape == q.shape
            and v.shape[:2] == (b, t)
            and g.shape == (b, t, hv)
            and beta.shape == (b, t, hv)
            and h0.shape == (b, hv, kd, vd)
            and b >= 1
            and t >= 1
            and h >= 1
            and hv % h == 0
            # power-of-two register tiles (Triton); >= 16 for the tensor-core dots; K <= 128
            # bounds the state kernel's shared memory (q, k, W rows of a chunk) and registers
            and is_pow2(kd)
            and 16 <= kd <= 128
            and is_pow2(vd)
            and 16 <= vd <= 1024
            and vd % min(cfg.block_v, vd) == 0
            # the Triton lowering addresses with int32 offsets: every array (the padded
            # intermediates included) below 2^31 elements
            and b * pl.cdiv(t, cfg.chunk) * cfg.chunk * hv * max(kd, vd, cfg.chunk) < 2**31
            and all(jnp.dtype(x.dtype) in _IN_DTYPES for x in (q, k, v, g, beta, h0))
        )
        if lengths is not None:
            ok = ok and lengths.shape == (b,) and jnp.issubdtype(lengths.dtype, jnp.integer)
        return bool(ok)
    except (AttributeError, TypeError, ValueError, IndexError):
        return False


# ---------------------------------------------------------------------------------------------
# In-kernel helpers


def _parts(x):
    """Operand as bf16 parts: a (hi, lo) tuple as given, a bf16 array as itself (exact), else split."""
    if isinstance(x, tuple):
        return x
    if x.dtype == BF16:
        return (x,)
    return split_bf16(x.astype(F32))


def _mm(a, b, trans_a=False, trans_b=False):
    """op(a) @ op(b) to about float32 accuracy on the bf16 tensor cores (float32 accumulation):
    sum of the part products of order <= 2^-8 (lo.lo dropped), the small terms first."""
    ap, bp = _parts(a), _parts(b)
    terms = [(i, j) for i in range(len(ap)) for j in range(len(bp)) if i + j <= 1]
    acc = None
    for i, j in sorted(terms, key=lambda ij: -(ij[0] + ij[1])):
        d = plgpu.dot(ap[i], bp[j], trans_a=trans_a, trans_b=trans_b)
        acc = d if acc is None else acc + d
    return acc


def _diag_block_inverses(load_row, nb):
    """Inverses of the nb diagonal blocks (I + A_bb) [16, 16] of a strictly lower A, together as
    one [nb, 16, 16] tensor, by forward substitution: step s forms row s of every block at once,
    row_s = e_s - sum_{j<s} A[s, j] row_j. load_row(s) -> [nb, 16]: row s of each diagonal block
    of A, zero from column s on (it comes from memory: Triton cannot index register tensors)."""
    i = jnp.arange(SUB, dtype=jnp.int32)
    ii, jj = i[None, :, None], i[None, None, :]
    inv = jnp.broadcast_to(jnp.where(ii == jj, 1.0, 0.0), (nb, SUB, SUB)).astype(F32)
    for s in range(1, SUB):
        a_s = load_row(s)  # [nb, 16] over j
        contrib = jnp.sum(a_s[:, :, None] * inv, axis=1)  # [nb, 16] over c
        inv = jnp.where(ii == s, jnp.where(jj == s, 1.0, -contrib[:, None, :]), inv)
    return inv


def _block_merge(x, a_off, nb):
    """(I + A)^{-1} from X = (I + A_bd)^{-1} (A's diagonal blocks inverted) and A_off = A's strictly
    block-lower part: I + A = (I + A_bd)(I + N) with N = X A_off nilpotent (N^nb = 0), so
    (I + A)^{-1} = (I - N)(I + N^2)(I + N^4)... X, full-tile tensor-core products at float32
    accuracy (2 log2(nb) + 1 products, each an exact rearrangement of block forward substitution)."""
    if nb == 1:
        return x
    n = _mm(x, a_off)
    powers = [n]
    while 2 ** len(powers) < nb:
        powers.append(_mm(powers[-1], powers[-1]))
    y = x
    for pw in powers[:0:-1]:  # (I + N^{2^k}) for k >= 1, then (I - N)
        y = y + _mm(pw, y)
    return y - _mm(n, y)


# ---------------------------------------------------------------------------------------------
# Kernel 1: per-chunk matrices (parallel over chunks)


def _prep_kernel(
    len_ref,
    q_ref,
    k_ref,
    g_ref,
    beta_ref,
    w_hi_ref,
    w_lo_ref,
    r_hi_ref,
    r_lo_ref,
    gc_ref,
    scr_ref,
    *,
    chunk,
    ratio,
    barrier,
):
    hv, c, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    kh = hv // ratio
    n = len_ref[b]
    t0 = c * chunk
    nb = chunk // SUB
    kd = k_ref.shape[-1]
    sync = plgpu.debug_barrier if barrier else (lambda: None)

    @pl.when(t0 < n)
    def _chunk():
        t = jnp.arange(chunk, dtype=jnp.int32)
        row, col = t[:, None], t[None, :]
        incl, strict = col <= row, col < row
        same_blk = row // SUB == col // SUB
        at = pl.ds(t0, chunk)
        valid = t0 + t < n

        def load_keys(ref, cols=slice(None), width=kd):  # key head kh's rows (0 past the length), bf16 parts
            mask = jnp.broadcast_to(valid[:, None], (chunk, width))
            return _parts(plgpu.load(ref.at[b, at, kh, cols], mask=mask, other=0))

        g = plgpu.load(g_ref.at[b, at, hv], mask=valid, other=0.0).astype(F32)
        beta = plgpu.load(beta_ref.at[b, at, hv], mask=valid, other=0.0).astype(F32)
        G = jnp.cumsum(g)  # inclusive
        gc_ref[b, hv, at] = G
        decay = jnp.exp(jnp.where(incl, G[:, None] - G[None, :], -jnp.inf))  # masked before exp
        kp = load_keys(k_ref)
        a = jnp.where(strict, beta[:, None] * _mm(kp, kp, trans_b=True) * decay, 0.0)  # A [C, C]

        # Diagonal blocks of T = (I + A)^{-1} by forward substitution, which reads rows of A's
        # diagonal blocks: they make a round trip through a compact scratch [C, 16] (row i holds
        # A[i, 16 (i // 16) + j]; a few KiB per chunk and head, L1/L2-resident), the only way to index
        # a register tensor; the block inverses come back through it as a block-diagonal tile.
        # Barriers order the round trips between the program's threads.
        blk = jnp.arange(nb, dtype=jnp.int32)[:, None]
        sub = jnp.arange(SUB, dtype=jnp.int32)[None, :]
        blk_rows = t0 + SUB * blk  # [nb, 1]
        i3 = jnp.arange(SUB, dtype=jnp.int32)
        at3 = (b, hv, blk_rows[:, :, None] + i3[None, :, None], i3[None, None, :])  # [nb, 16, 16]
        b4 = jnp.arange(nb, dtype=jnp.int32)
        diag4 = b4[:, None, None, None] == b4[None, None, :, None]  # [nb, 1, nb, 1]
        plgpu.store(scr_ref.at[at3], jnp.sum(jnp.where(diag4, a.reshape(nb, SUB, nb, SUB), 0.0), axis=2))
        sync()

        def load_row(s):  # row s of every diagonal block of A, columns < s
            return plgpu.load(
                scr_ref.at[b, hv, blk_rows + s, sub], mask=jnp.broadcast_to(sub < s, (nb, SUB)), other=0.0
            )

        inv = _diag_block_inverses(load_row, nb)  # [nb, 16, 16]
        sync()  # every row read before the overwrite
        plgpu.store(scr_ref.at[at3], inv)
        sync()
        x = plgpu.load(scr_ref.at[b, hv, t0 + row, col % SUB], mask=same_blk, other=0.0)  # blockdiag [C, C]
        tp = _block_merge(x, jnp.where(same_blk, 0.0, a), nb) * beta[None, :]  # T' = T diag(beta)

        # R = P T' with P = incl_lower(Q K^T * decay);  W = T'^T diag(e^{G_C - G}) K.
        r = _mm(jnp.where(incl, _mm(load_keys(q_ref), kp, trans_b=True) * decay, 0.0), tp)
        r_hi, r_lo = split_bf16(r)
        r_hi_ref[b, hv, at, :] = r_hi
        r_lo_ref[b, hv, at, :] = r_lo
        dtp = _parts(jnp.exp(jnp.sum(g) - G)[:, None] * tp)
        wk = min(kd, W_COLS)
        for c0 in range(0, kd, wk):  # W by column blocks: a [C, K] float32 tile costs 64 registers
            cols = pl.ds(c0, wk)
            w_hi, w_lo = split_bf16(_mm(dtp, load_keys(k_ref, cols, wk), trans_a=True))  # [C, wk]
            w_hi_ref[b, hv, at, cols] = w_hi
            w_lo_ref[b, hv, at, cols] = w_lo


# ---------------------------------------------------------------------------------------------
# Kernel 2: the state recurrence over chunks, and the outputs


def _state_kernel(
    len_ref,
    q_ref,
    k_ref,
    v_ref,
    h0_ref,
    w_hi_ref,
    w_lo_ref,
    r_hi_ref,
    r_lo_ref,
    gc_ref,
    o_ref,
    h_ref,
    *,
    chunk,
    ratio,
    block_v,
    n_chunks,
):
    vb, hv, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    kh = hv // ratio
    n = len_ref[b]
    t_len = o_ref.shape[1]
    kd = q_ref.shape[-1]
    vcols = pl.ds(vb * block_v, block_v)
    t = jnp.arange(chunk, dtype=jnp.int32)

    h = h0_ref[b, hv, :, vcols].astype(F32)  # [K, BV]

    def step(c, h):
        t0 = pl.multiple_of(c * chunk, chunk)
        rows = t0 + t
        valid = rows < n
        at = pl.ds(t0, chunk)
        mk = jnp.broadcast_to(valid[:, None], (chunk, kd))
        mv = jnp.broadcast_to(valid[:, None], (chunk, block_v))
        q = plgpu.load(q_ref.at[b, at, kh, :], mask=mk, other=0)
        k = plgpu.load(k_ref.at[b, at, kh, :], mask=mk, other=0)
        v = plgpu.load(v_ref.at[b, at, hv, vcols], mask=mv, other=0).astype(F32)
        G = gc_ref[b, hv, at]  # [C]
        g_c = gc_ref[b, hv, t0 + chunk - 1]  # G is constant past the length: the chunk total
        w = (w_hi_ref[b, hv, at, :], w_lo_ref[b, hv, at, :])  # [C, K] pair
        r_mat = (r_hi_ref[b, hv, at, :], r_lo_ref[b, hv, at, :])  # [C, C] pair

        hp = split_bf16(h)
        e_g = jnp.exp(G)[:, None]
        rhs = v - e_g * _mm(k, hp)  # [C, BV]
        rp = split_bf16(rhs)
        o = e_g * _mm(q, hp) + _mm(r_mat, rp)
        # Rows past the length are 0 by selection; rows past T are not stored (masked).
        plgpu.store(
            o_ref.at[b, at, hv, vcols],
            jnp.where(mv, o, 0.0),
            mask=jnp.broadcast_to((rows < t_len)[:, None], (chunk, block_v)),
        )
        return jnp.exp(g_c) * h + _mm(w, rp, trans_a=True)

    n_live = (n + chunk - 1) // chunk
    h = lax.fori_loop(0, n_live, step, h)
    h_ref[b, hv, :, vcols] = h

    zeros = jnp.zeros((chunk, block_v), F32)

    def zero_step(c, carry):
        rows = c * chunk + t
        plgpu.store(
            o_ref.at[b, pl.ds(c * chunk, chunk), hv, vcols],
            zeros,
            mask=jnp.broadcast_to((rows < t_len)[:, None], (chunk, block_v)),
        )
        return carry

    lax.fori_loop(n_live, n_chunks, zero_step, 0)


# ---------------------------------------------------------------------------------------------
# Wrapper


def _setup(q, v, lengths, config, interpret):
    b, t = q.shape[:2]
    cfg = config or ChunkConfig()
    interpret = default_interpret() if interpret is None else interpret
    lengths = jnp.full((b,), t, jnp.int32) if lengths is None else lengths
    return cfg, interpret, jnp.clip(jnp.asarray(lengths).astype(jnp.int32), 0, t)


def chunk_matrices(
    q, k, g, beta, lengths, *, num_value_heads, config: ChunkConfig | None = None, interpret: bool | None = None
):
    """The prep kernel alone (exposed for benchmarks): -> (W hi, W lo [B, HV, Tp, K] bf16,
    R hi, R lo [B, HV, Tp, C] bf16, G [B, HV, Tp] f32), Tp = T rounded up to the chunk; rows of
    chunks that start at or past a request's length are not written."""
    b, t, _, kd = q.shape
    hv = num_value_heads
    cfg, interpret, lengths = _setup(q, jax.ShapeDtypeStruct((b, t, hv, SUB), F32), lengths, config, interpret)
    chunk = cfg.chunk
    n_chunks = pl.cdiv(t, chunk)
    tp = n_chunks * chunk
    out_shape = (
        jax.ShapeDtypeStruct((b, hv, tp, kd), BF16),  # W hi
        jax.ShapeDtypeStruct((b, hv, tp, kd), BF16),  # W lo
        jax.ShapeDtypeStruct((b, hv, tp, chunk), BF16),  # R hi
        jax.ShapeDtypeStruct((b, hv, tp, chunk), BF16),  # R lo
        jax.ShapeDtypeStruct((b, hv, tp), F32),  # G
        jax.ShapeDtypeStruct((b, hv, tp, SUB), F32),  # scratch: diagonal blocks of A, then of T
    )
    out = pl.pallas_call(
        functools.partial(_prep_kernel, chunk=chunk, ratio=hv // q.shape[2], barrier=not interpret),
        grid=(hv, n_chunks, b),
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=cfg.prep_warps, num_stages=1),
        name="gdn_chunked_prep",
    )(lengths, q, k, g, beta)
    return out[:5]


def gdn_chunked(
    q, k, v, g, beta, h0, lengths=None, *, config: ChunkConfig | None = None, interpret: bool | None = None
):
    """Kernel version of `jaxspec.ops.gdn.gdn_chunked` (same arguments and results; the chunk
    size is the config's, not a semantic parameter)."""
    if not supports(q, k, v, g, beta, h0, lengths, config):
        raise ValueError("pallas gdn_chunked: shapes/dtypes not supported (see gdn_chunked.supports)")
    cfg, interpret, lengths = _setup(q, v, lengths, config, interpret)
    b, t, h, kd = q.shape
    hv, vd = v.shape[2], v.shape[3]
    block_v = min(cfg.block_v, vd)
    inter = chunk_matrices(q, k, g, beta, lengths, num_value_heads=hv, config=cfg, interpret=interpret)
    return pl.pallas_call(
        functools.partial(
            _state_kernel, chunk=cfg.chunk, ratio=hv // h, block_v=block_v, n_chunks=pl.cdiv(t, cfg.chunk)
        ),
        grid=(vd // block_v, hv, b),
        out_shape=(jax.ShapeDtypeStruct((b, t, hv, vd), F32), jax.ShapeDtypeStruct((b, hv, kd, vd), F32)),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        name="gdn_chunked_state",
    )(lengths, q, k, v, h0, *inter)
