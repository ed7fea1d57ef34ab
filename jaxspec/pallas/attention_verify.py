"""Verify attention as Pallas Triton kernels: packed ragged windows against the slot KV cache.

Contract: `jaxspec.ops.attention.attention_verify` (its jnp reference, `impl="ref"`, is the
semantics): q [N, Hq, D] packed (request r owns rows query_start_loc[r] : query_start_loc[r+1],
1..t_max of them); caches [S1, M, KVH, D], or [A, S1, M, KVH, D] stacks with a `layer` index;
window token t of request r sits at p = seq_lens[slots[r]] + t and reads cache positions
0..min(p, M-1); q head h reads kv head h // (Hq / KVH); scale D^-1/2, softmax in float32; padding
rows (>= query_start_loc[B]) and slot-0 requests output 0. `ops.attention.attention_block` (the
draft) calls it with causal=False (every window token reads up to the window's last position) and
key_window = w > 0 (keys from max(0, seq_len - w) on).

Design (split-KV flash decoding; the op is a read of the KV cache):
* Grid (B, KVH, num_splits). A program stacks every window token t and q head j of its kv head's
  GQA group as the rows i = t * rep + j of one tile (R = next_pow2(t_max * rep) >= 16 rows), so
  K/V are read once for all of them and both dots (Q K^T, P V) have M = R: Hopper's warpgroup MMA.
* Split s covers keys [lo + s * chunk, min(lo + (s+1) * chunk, n)), lo the first key read,
  n = min(seq_len + len, M): the loop bound comes from seq_lens, never M. chunk is per request
  (`split_range`, at least min_split), so a short context uses fewer, fuller splits. num_splits =
  target_programs // (B * KVH), at least 1: one program per SM is resident (its K/V pipeline
  buffers fill shared memory), so that is one full wave.
* Online softmax in the log2 domain (float32 m, l, accumulator). Keys past the split's end (blocks
  overhanging M included: the Triton lowering does not mask them) are not loaded and score -inf;
  the causal mask applies per row; m starts at -1e30 (finite), so an empty row gets p = 0, no NaN.
* num_splits > 1: programs write normalised partials o_s (`partial_dtype`) and lse_s (float32;
  -1e30 for an empty split); the combine kernel loads all of a tile's splits in one masked 3-D load
  (addressed by the program id alone) and writes o = sum_s 2^(lse_s - max) o_s / sum_s 2^(lse_s - max).
* The kernel that writes o also writes its zeros (slot-0 rows; padding rows split over the B
  programs of each kv head): every element of o is written exactly once.

Numerics: bf16 MMAs with float32 accumulation, P rounded to bf16 for P V (as flash attention does);
float32 inputs (small models, tests) use precision=HIGHEST dots on the CUDA cores in head-dim chunks
(`block_d`). Assumed (the packed layout guarantees it): query_start_loc[0] == 0, non-decreasing,
lengths <= t_max, query_start_loc[B] <= N, slots in [0, S1). Interpret mode needs all-array
indexers for gathers and scatters, and drops masked scatter lanes pointed past the array.
Timings: bench/RESULTS.md.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxspec.pallas.hardware import NUM_SMS, default_interpret
from jaxspec.pallas.tiles import (
    check_int_fields,
    check_pow2_fields,
    given_fields,
    gqa_row_map,
    is_layer_index,
    layer_operand,
    next_pow2,
)

F32, BF16 = jnp.float32, jnp.bfloat16
_DTYPES = (jnp.dtype(F32), jnp.dtype(BF16))
MAX_ROWS = 128  # rows of the stacked (token, q head) tile: t_max * Hq/KVH <= 128
MAX_TILE = 128 * 256  # R * D (padded) <= 32768: the fp32 accumulator lives in registers
MAX_D = 256
NEG = -1e30  # finite "minus infinity" for m and lse (exp2(NEG - x) == 0, no NaN)
LOG2E = 1.4426950408889634
PARTIAL_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class AttentionVerifyConfig:
    """Tile sizes and launch parameters of the verify attention kernel.

    block_k: keys per step of a program's loop (power of two, 16..256). None: 16 for fp32; for bf16
      16 (with 4 pipeline stages) when the requests alone fill the SMs (B * KVH > target_programs
      / 2: one split); 64 (with 3 stages) where the splits are long (M >= 512 * num_splits) and
      the tile at most 64 x 256; else 32 (with 3 stages). The deeper pipeline pays only on long
      splits; a 128-row tile (T 16, GQA 6) with 64 keys x 3 stages exceeds shared memory, so it
      keeps 32.
    block_d: head-dim chunk of the main kernel's dots (power of two, 16..256). None: the whole
      (padded) D for bf16 (one tensor-core MMA with K = D), 32 for fp32: the fp32 dots
      (precision=HIGHEST) run on the CUDA cores, where Triton holds a whole K extent of each
      operand per thread in registers, so they are chunked over D, and q is re-read (from L1/L2)
      inside the key loop rather than pinned in registers.
    num_splits: KV splits per (request, kv head), 1..512. None: target_programs // (B * KVH),
      at least 1, at most the number of min_split chunks of M. With one resident program per
      SM (shared memory), B * KVH * num_splits <= NUM_SMS is one full wave; with one split the
      main kernel writes o itself (no combine).
    min_split: the fewest keys a split covers (a power of two >= 16, rounded up to block_k): a
      short context is cut into fewer, fuller pieces (fewer partials to merge): the key loop's
      per-block latency, not the merge, sets the time of short splits.
    target_programs: programs the split aims at (>= 1): one per SM by default.
    num_warps: warps of the main kernel (1, 2, 4, 8 or 16). None: R * D / 2048 (fp32) or
      R * D / 4096 (bf16) clipped to 4..16 (the fp32 accumulator is R * D / (32 * num_warps)
      registers a thread: 64 for fp32 at 8 warps, 128 for bf16 at 4 warps for a 64 x 256 tile;
      fewer warps are faster for bf16 on the H200, whose dots are tensor-core MMAs).
    num_stages: Triton software-pipelining depth of the key loop (1..4). None: 1 for fp32; for bf16
      4 with 16-key blocks, 3 with 32- and 64-key blocks (K and V blocks in flight while one is
      multiplied).
    combine_block_d: head-dim columns per program of the split-merge kernel (power of two 16..256).
    combine_warps: warps of the split-merge kernel (1, 2, 4, 8 or 16).
    partial_dtype: None, "float32" or "bfloat16": the dtype in which the Triton split kernel stores
      its normalised partials o_s = acc / l for the merge (lse stays float32). None: the input's
      dtype. bfloat16 halves the partials' bytes (written by the split kernel, read by the
      combine), as vLLM's paged attention v2 keeps its partials in the output dtype, at one
      extra bfloat16 rounding (relative 2^-9) before the merge.
    """

    block_k: int | None = None
    block_d: int | None = None
    num_splits: int | None = None
    min_split: int = 64
    target_programs: int = NUM_SMS
    num_warps: int | None = None
    num_stages: int | None = None
    combine_block_d: int = 64
    combine_warps: int = 4
    partial_dtype: str | None = None

    def __post_init__(self):
        name = type(self).__name__
        pow2 = (("block_k", 16, 256), ("block_d", 16, 256), ("num_warps", 1, 16))
        check_pow2_fields(
            self,
            given_fields(self, pow2)
            + [("min_split", 16, None), ("combine_block_d", 16, 256), ("combine_warps", 1, 16)],
        )
        check_int_fields(self, given_fields(self, (("num_splits", 1, 512), ("num_stages", 1, 4))))
        check_int_fields(self, (("target_programs", 1, None),))
        if self.partial_dtype is not None and self.partial_dtype not in PARTIAL_DTYPES:
            raise ValueError(f"{name}.partial_dtype={self.partial_dtype!r}: must be one of {PARTIAL_DTYPES}")

    def resolve(self, num_requests: int, kv_heads: int, max_len: int, rows: int, d: int, dtype) -> dict:
        """The launch plan of a call (all static)."""
        f32 = jnp.dtype(dtype) == jnp.dtype(F32)
        d_pad = max(16, next_pow2(d))
        fills = 2 * num_requests * kv_heads > self.target_programs  # one split per (request, head)
        num_splits = self.num_splits or max(1, self.target_programs // (num_requests * kv_heads))
        # 64-key blocks where splits are long (>= 512 keys) and the tile small: 64 keys x 3 stages
        # of K and V at D 256 is 192 KB of shared memory (a 128-row tile does not fit); on
        # short splits the deeper pipeline's fill costs more than it saves
        keys_64 = rows * d_pad <= 64 * 256 and max_len >= 512 * num_splits
        block_k = min(self.block_k or (16 if f32 or fills else 64 if keys_64 else 32), max(16, next_pow2(max_len)))
        block_d = min(self.block_d or (32 if f32 else d_pad), d_pad)
        if block_d < d_pad and d % block_d:
            # chunks must not overhang D (static slices); else the largest power of two dividing D
            block_d = d & -d if (d & -d) >= 16 else d_pad
        min_split = max(self.min_split, block_k)
        num_splits = max(1, min(num_splits, pl.cdiv(max_len, min_split)))
        num_warps = self.num_warps or min(16, max(4, rows * d_pad // (2048 if f32 else 4096)))
        num_stages = self.num_stages or (1 if f32 else 4 if fills else 3)
        # split-merge tiles: [splits (pow2), rows, columns] of ~8192 fp32 values per program
        combine_d = min(self.combine_block_d, d_pad)
        return dict(
            block_k=block_k,
            block_d=block_d,
            num_splits=num_splits,
            min_split=min_split,
            num_warps=num_warps,
            num_stages=num_stages,
            combine_d=combine_d,
            combine_warps=self.combine_warps,
            partial_dtype=jnp.dtype(self.partial_dtype or dtype),
        )

    def resolve_call(self, q_shape, k_shape, t_max: int, num_requests: int, dtype) -> dict:
        """The launch plan (`resolve`) of an `attention_verify` call: q_shape [N, Hq, D], k_shape
        one layer's cache [S1, M, KVH, D], t_max and num_requests (B) as in the call, dtype q's."""
        _, rows, _ = _geometry(q_shape, k_shape, t_max)
        return self.resolve(num_requests, k_shape[2], k_shape[1], rows, q_shape[2], dtype)


def combine_tile_rows(rows: int, partials: int, combine_d: int) -> int:
    """Rows of a split-merge program's [pow2(partials), rows, combine_d] tile: ~8192 fp32 values."""
    return max(1, min(rows, 8192 // (next_pow2(partials) * combine_d)))


def _geometry(q_shape, k_shape, t_max):
    """(rep, rows R, padded head dim) of a call."""
    hq, d = q_shape[1], q_shape[2]
    rep = hq // k_shape[2]
    return rep, max(16, next_pow2(t_max * rep)), max(16, next_pow2(d))


def supports(q, k_cache, v_cache, seq_lens, query_start_loc, slots, t_max, layer=None) -> bool:
    """Shapes and dtypes the kernel covers (see jaxspec.ops.attention.attention_verify).

    q, k_cache and v_cache share one dtype, bfloat16 or float32; D <= 256; Hq a multiple of KVH;
    t_max * Hq / KVH <= 128 rows, and rows (padded) x D (padded) <= 32768 (registers). With
    `layer` (an int or int32 scalar, traced is fine) the caches are layer stacks [A, S1, M, KVH, D]."""
    try:
        if layer is not None:
            if not (
                len(k_cache.shape) == 5
                and is_layer_index(layer, k_cache.shape[0])
                and tuple(v_cache.shape) == tuple(k_cache.shape)
            ):
                return False
            k_cache = v_cache = jax.ShapeDtypeStruct(k_cache.shape[1:], k_cache.dtype)
        if q.ndim != 3 or k_cache.ndim != 4 or slots.ndim != 1:
            return False
        n, hq, d = q.shape
        s1, m, kvh, dk = k_cache.shape
        b = slots.shape[0]
        if not (isinstance(t_max, int) and t_max >= 1 and kvh >= 1 and hq % kvh == 0):
            return False
        _, rows, d_pad = _geometry(q.shape, k_cache.shape, t_max)
        return bool(
            n >= 1
            and b >= 1
            and s1 >= 1
            and m >= 1
            and 1 <= d <= MAX_D
            and dk == d
            and tuple(v_cache.shape) == tuple(k_cache.shape)
            and seq_lens.shape == (s1,)
            and query_start_loc.shape == (b + 1,)
            and t_max * (hq // kvh) <= MAX_ROWS
            and rows * d_pad <= MAX_TILE
            and jnp.dtype(q.dtype) in _DTYPES
            and jnp.dtype(k_cache.dtype) == jnp.dtype(q.dtype)
            and jnp.dtype(v_cache.dtype) == jnp.dtype(q.dtype)
            and jnp.issubdtype(seq_lens.dtype, jnp.integer)
            and jnp.issubdtype(query_start_loc.dtype, jnp.integer)
            and jnp.issubdtype(slots.dtype, jnp.integer)
        )
    except (AttributeError, TypeError, ValueError, IndexError):
        return False


# ---------------------------------------------------------------------------------------------
# In-kernel helpers


def _request(qsl_ref, slots_ref, r):
    start = qsl_ref[r]
    return start, qsl_ref[r + 1] - start, slots_ref[r]


def split_range(seq_len, length, max_len, num_splits, block_k, min_split, key_lo=0):
    """(n keys that exist, keys per split) of requests (scalars in a kernel, arrays in a wrapper):
    the split length adapts to the context; split s covers keys [key_lo + s * chunk,
    min(key_lo + (s+1) * chunk, n))."""
    n = jnp.minimum(seq_len + length, max_len)
    chunk = pl.cdiv(pl.cdiv(n - key_lo, num_splits), block_k) * block_k
    return n, jnp.maximum(chunk, min_split)


def first_key(seq_len, key_window):
    """The first key a request reads: 0, or max(0, seq_len - key_window) with a sliding window."""
    return jnp.maximum(seq_len - key_window, 0) if key_window else 0


def _write_rows(o_ref, vals, start, tok, head, valid, cols, cmask):
    """o[start + tok, head, cols] = vals on valid rows (masked lanes point past the array)."""
    n_tok = o_ref.shape[0]
    tok = jnp.where(valid, start + tok, n_tok)
    plgpu.store(
        o_ref.at[tok[:, None], head[:, None], cols[None, :]],
        vals.astype(o_ref.dtype),
        mask=valid[:, None] & cmask[None, :],
    )


def _zero_padding(o_ref, qsl_ref, p, num_requests, g, rep, pair_rows, cols, cmask):
    """Zeros on this program's share of the padding rows [qsl[B], N), q heads of kv head g.

    The share of program p (one per request) is tokens [pad0 + p*k, pad0 + (p+1)*k), k =
    cdiv(N - pad0, B), written pair_rows (token, head) pairs at a time."""
    n_tok = o_ref.shape[0]
    pad0 = jnp.minimum(qsl_ref[num_requests], n_tok)
    share = pl.cdiv(n_tok - pad0, num_requests)
    lo = pad0 + p * share
    pairs = (jnp.minimum(lo + share, n_tok) - lo) * rep
    zeros = jnp.zeros((pair_rows, cols.shape[0]), o_ref.dtype)

    def body(c, carry):
        pair = c * pair_rows + jnp.arange(pair_rows, dtype=jnp.int32)
        _write_rows(o_ref, zeros, lo, pair // rep, g * rep + pair % rep, pair < pairs, cols, cmask)
        return carry

    jax.lax.fori_loop(0, pl.cdiv(pairs, pair_rows), body, 0)  # pairs <= 0: no iteration


# ---------------------------------------------------------------------------------------------
# Kernels


def _verify_kernel(
    layer_ref,
    qsl_ref,
    slots_ref,
    seq_lens_ref,
    q_ref,
    k_ref,
    v_ref,
    *refs,
    num_requests,
    t_max,
    rep,
    rows,
    d,
    d_pad,
    block_d,
    block_k,
    num_splits,
    min_split,
    scale,
    final,
    stacked,
    causal,
    key_window,
):
    r, g, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    max_len = k_ref.shape[-3]
    # With a layer the caches are the whole stacks (no per-layer slice for XLA to copy).
    lay = (layer_ref[0],) if stacked else ()
    start, length, slot = _request(qsl_ref, slots_ref, r)
    tok, head, in_win = gqa_row_map(jnp.arange(rows, dtype=jnp.int32), rep, t_max, g)
    valid = in_win & (tok < length)
    f32_dots = q_ref.dtype == jnp.float32
    precision = jax.lax.Precision.HIGHEST if f32_dots else None
    # head-dim chunks of the dots: whole chunks inside D, or one chunk of d_pad (masked tail)
    chunks = [c * block_d + jnp.arange(block_d, dtype=jnp.int32) for c in range(pl.cdiv(d, block_d))]
    cmasks = [cols < d for cols in chunks]
    tail = len(chunks) * block_d != d  # one chunk, masked

    seq_len = seq_lens_ref[slot]
    key_lo = first_key(seq_len, key_window)
    n, chunk = split_range(seq_len, length, max_len, num_splits, block_k, min_split, key_lo)
    lo = key_lo + s * chunk
    hi = jnp.minimum(lo + chunk, n)

    @pl.when((slot > 0) & (length > 0))
    def _():
        q_tok = jnp.where(valid, start + tok, 0)

        def load_q():  # [R, block_d] per chunk
            return [
                plgpu.load(
                    q_ref.at[q_tok[:, None], head[:, None], cols[None, :]], mask=valid[:, None] & cm[None, :], other=0
                )
                for cols, cm in zip(chunks, cmasks)
            ]

        q_in = None if f32_dots else load_q()
        pos = seq_len + (tok if causal else jnp.full_like(tok, length - 1))  # [R] last key a row reads

        def body(b, carry):
            accs, m, l = carry
            qs = q_in if q_in is not None else load_q()
            k0 = lo + b * block_k
            keys = k0 + jnp.arange(block_k, dtype=jnp.int32)
            live = keys < hi  # split end, and M
            sc, vbs = None, []
            for c, cm in enumerate(cmasks):
                kmask = live[:, None] & cm[None, :] if tail else live[:, None]
                at = (*lay, slot, pl.ds(k0, block_k), g, pl.ds(c * block_d, block_d))
                kb = plgpu.load(k_ref.at[at], mask=kmask, other=0)
                vbs.append(plgpu.load(v_ref.at[at], mask=kmask, other=0))
                part = plgpu.dot(qs[c], kb, trans_b=True, precision=precision)
                sc = part if sc is None else sc + part
            sc = sc * scale  # [R, block_k] f32, log2 units
            sc = jnp.where((keys[None, :] <= pos[:, None]) & live[None, :], sc, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(sc, axis=1))
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(sc - m_new[:, None])
            l = l * alpha + jnp.sum(p, axis=1)
            pv = p.astype(vbs[0].dtype)
            accs = tuple(acc * alpha[:, None] + plgpu.dot(pv, vb, precision=precision) for acc, vb in zip(accs, vbs))
            return accs, m_new, l

        init = (
            tuple(jnp.zeros((rows, block_d), F32) for _ in chunks),
            jnp.full((rows,), NEG, F32),
            jnp.zeros((rows,), F32),
        )
        # an empty split (lo >= n: hi - lo <= 0, no block) stores o_s = 0 and lse = NEG like any other
        accs, m, l = jax.lax.fori_loop(0, pl.cdiv(hi - lo, block_k), body, init)
        inv = 1.0 / jnp.where(l > 0, l, 1.0)
        if final:
            for acc, cols, cm in zip(accs, chunks, cmasks):
                _write_rows(refs[-1], acc * inv[:, None], start, tok, head, valid, cols, cm)
        else:
            opart_ref, lse_ref = refs[-2:]
            for c, acc in enumerate(accs):
                plgpu.store(
                    opart_ref.at[r, g, s, pl.ds(0, rows), pl.ds(c * block_d, block_d)],
                    (acc * inv[:, None]).astype(opart_ref.dtype),
                    mask=valid[:, None],
                )
            lse = jnp.where(l > 0, m + jnp.log2(jnp.where(l > 0, l, 1.0)), NEG)
            plgpu.store(lse_ref.at[r, g, s, pl.ds(0, rows)], lse, mask=valid)

    if final:
        o_ref = refs[-1]

        @pl.when((slot == 0) & (length > 0))
        def _():
            for cols, cm in zip(chunks, cmasks):
                _write_rows(o_ref, jnp.zeros((rows, block_d), o_ref.dtype), start, tok, head, valid, cols, cm)

        for cols, cm in zip(chunks, cmasks):
            _zero_padding(o_ref, qsl_ref, r, num_requests, g, rep, rows, cols, cm)


def _combine_kernel(
    qsl_ref,
    slots_ref,
    opart_ref,
    lse_ref,
    *refs,
    num_requests,
    t_max,
    rep,
    rows,
    d,
    combine_d,
    combine_rows,
    num_splits,
):
    """Merge the splits of rows [i0, i0 + combine_rows) x columns [c0, c0 + combine_d) of one
    (request, kv head): every split's lse and o tile in one masked load ([splits, rows, cols]).

    Every split of a live request wrote its lse (NEG where its key range was empty), so the loads
    depend on the program id alone and are issued at once, beside the request's scalars, not after
    a chain qsl, slots -> seq_lens -> key range; a zero weight selects an empty split's o_s away."""
    o_ref = refs[-1]
    r, g, t = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    col_tiles = pl.cdiv(d, combine_d)
    i0 = (t // col_tiles) * combine_rows
    c0 = (t % col_tiles) * combine_d
    tok, head, in_win = gqa_row_map(i0 + jnp.arange(combine_rows, dtype=jnp.int32), rep, t_max, g)
    cols = c0 + jnp.arange(combine_d, dtype=jnp.int32)
    cmask = cols < d
    split = jnp.arange(next_pow2(num_splits), dtype=jnp.int32)
    stored = (split < num_splits)[:, None] & in_win[None, :]  # [splits, rows] in bounds
    lse = plgpu.load(lse_ref.at[r, g, pl.ds(0, split.shape[0]), pl.ds(i0, combine_rows)], mask=stored, other=NEG)
    o_s = plgpu.load(
        opart_ref.at[r, g, pl.ds(0, split.shape[0]), pl.ds(i0, combine_rows), pl.ds(c0, combine_d)],
        mask=stored[:, :, None] & cmask[None, None, :],
        other=0,
    ).astype(F32)
    start, length, slot = _request(qsl_ref, slots_ref, r)
    valid = in_win & (tok < length)

    @pl.when((slot > 0) & (length > 0) & (i0 < length * rep))
    def _():
        w = jnp.exp2(lse - jnp.max(lse, axis=0)[None, :])[:, :, None]  # [splits, rows, 1]; 0: empty split
        o = jnp.sum(jnp.where(w > 0, w * o_s, 0), axis=0) / jnp.sum(w, axis=0)
        _write_rows(o_ref, o, start, tok, head, valid, cols, cmask)

    @pl.when((slot == 0) & (length > 0))
    def _():
        _write_rows(o_ref, jnp.zeros((combine_rows, combine_d), o_ref.dtype), start, tok, head, valid, cols, cmask)

    @pl.when(i0 == 0)
    def _():
        _zero_padding(o_ref, qsl_ref, r, num_requests, g, rep, rows, cols, cmask)


# ---------------------------------------------------------------------------------------------
# Wrapper


def attention_verify(
    q,
    k_cache,
    v_cache,
    seq_lens,
    query_start_loc,
    slots,
    t_max,
    *,
    config: AttentionVerifyConfig | None = None,
    interpret: bool | None = None,
    o_buffer=None,
    layer: int | None = None,
    causal: bool = True,
    key_window: int = 0,
):
    """Verify attention; same contract as jaxspec.ops.attention.attention_verify.

    q [N, Hq, D]; k_cache, v_cache [S1, M, KVH, D], or layer stacks [A, S1, M, KVH, D] with
    `layer` the index to read (an int or int32 scalar); seq_lens [S1]; query_start_loc [B+1]; slots [B]; t_max
    static -> o [N, Hq, D] in q.dtype.
    o_buffer: optional [N, Hq, D] array of q.dtype aliased to o; every element is overwritten
    (tests pass a NaN-filled one to prove it).
    causal (static): True, window token t reads keys up to seq_len + t; False, every window token
    reads up to the window's last key seq_len + len - 1 (the draft block's bidirectional mask).
    key_window (static int >= 0): 0 reads keys from 0; w > 0 from max(0, seq_len - w) (the draft's
    sliding context window; the window's own keys are always read).
    """
    if not supports(q, k_cache, v_cache, seq_lens, query_start_loc, slots, t_max, layer):
        raise ValueError(
            "attention_verify kernel: unsupported shapes/dtypes "
            f"q {q.shape} {q.dtype}, k_cache {k_cache.shape} {k_cache.dtype}, "
            f"v_cache {v_cache.shape} {v_cache.dtype}, seq_lens {seq_lens.shape}, "
            f"query_start_loc {query_start_loc.shape}, slots {slots.shape}, t_max {t_max!r}"
        )
    if not (isinstance(key_window, int) and key_window >= 0):
        raise ValueError(f"key_window={key_window!r}: must be an int >= 0 (0 = every key from position 0)")
    if interpret is None:
        interpret = default_interpret()
    config = config or AttentionVerifyConfig()
    n, hq, d = q.shape
    max_len, kvh = k_cache.shape[-3:-1]
    b = slots.shape[0]
    rep, rows, d_pad = _geometry(q.shape, k_cache.shape[-4:], t_max)
    plan = config.resolve_call(q.shape, k_cache.shape[-4:], t_max, b, q.dtype)
    num_splits = plan["num_splits"]
    final = num_splits == 1
    if o_buffer is not None and (o_buffer.shape != (n, hq, d) or o_buffer.dtype != q.dtype):
        raise ValueError(f"o_buffer: expected {(n, hq, d)} {q.dtype}, got {o_buffer.shape} {o_buffer.dtype}")
    ints = (query_start_loc.astype(jnp.int32), slots.astype(jnp.int32), seq_lens.astype(jnp.int32))
    o_shape = jax.ShapeDtypeStruct((n, hq, d), q.dtype)
    extra = () if o_buffer is None else (o_buffer,)
    kernel = functools.partial(
        _verify_kernel,
        num_requests=b,
        t_max=t_max,
        rep=rep,
        rows=rows,
        d=d,
        d_pad=d_pad,
        block_d=plan["block_d"],
        block_k=plan["block_k"],
        num_splits=num_splits,
        min_split=plan["min_split"],
        scale=d**-0.5 * LOG2E,
        final=final,
        stacked=layer is not None,
        causal=causal,
        key_window=key_window,
    )
    main_params = plgpu.CompilerParams(num_warps=plan["num_warps"], num_stages=plan["num_stages"])
    if final:
        return pl.pallas_call(
            kernel,
            out_shape=o_shape,
            grid=(b, kvh, 1),
            input_output_aliases={} if o_buffer is None else {7: 0},
            compiler_params=main_params,
            interpret=interpret,
            name="attention_verify",
        )(layer_operand(layer), *ints, q, k_cache, v_cache, *extra)

    opart, lse = pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((b, kvh, num_splits, rows, d_pad), plan["partial_dtype"]),
            jax.ShapeDtypeStruct((b, kvh, num_splits, rows), F32),
        ),
        grid=(b, kvh, num_splits),
        compiler_params=main_params,
        interpret=interpret,
        name="attention_verify_split",
    )(layer_operand(layer), *ints, q, k_cache, v_cache)
    combine_d = plan["combine_d"]
    combine_rows = combine_tile_rows(rows, num_splits, combine_d)
    combine = functools.partial(
        _combine_kernel,
        num_requests=b,
        t_max=t_max,
        rep=rep,
        rows=rows,
        d=d,
        combine_d=combine_d,
        combine_rows=combine_rows,
        num_splits=num_splits,
    )
    tiles = pl.cdiv(min(rows, t_max * rep), combine_rows) * pl.cdiv(d, combine_d)
    return pl.pallas_call(
        combine,
        out_shape=o_shape,
        grid=(b, kvh, tiles),
        input_output_aliases={} if o_buffer is None else {4: 0},
        compiler_params=plgpu.CompilerParams(num_warps=plan["combine_warps"], num_stages=1),
        interpret=interpret,
        name="attention_verify_combine",
    )(*ints[:2], opart, lse, *extra)
