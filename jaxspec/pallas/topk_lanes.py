"""Top-k of large rows in one read: per-lane top-`keep` buffers (Pallas, Triton lowering).

Contract: `jaxspec.ops.sampling.top_k` (jax.lax.top_k's order: key descending in the IEEE total
order, ties by the lower column); bfloat16 and float32 logits. The column rides in the low half of
the key, so the buffers order keys by their high half (all of a bfloat16 key) and the offset.

Why: the chunked top-k (topk.py) selects candidates per 4096-column chunk with a threshold, a
count, a scan and a scatter store for every element: ~40 instructions an element, 5-7x the read
floor on the H200. Here a program owns a segment of one row (<= 32768 columns) and its `lanes`
lanes stream it with coalesced loads (lane j sees offsets j, j + lanes, ...). Each lane keeps its
`keep` largest packed keys in registers, sorted, updated by an insertion of max / min pairs:

    key = sort_key(x)'s high half | (0xFFFF - offset)      (distinct inside a segment)
    t = key;  for i in 1..keep:  a_i, t = max(a_i, t), min(a_i, t)

about 2 * keep + 8 instructions an element and no reduction, store or branch in the loop. After it,
the segment's top-k is the top-k of the lanes' buffers U unless a lane had more than `keep` keys in
it. Stage 1 then selects, from U, the keys >= t (the stage-1 selection of topk.py: the k-th largest
of the groups' maxima, and bisection while more than `slots` remain: k <= #{U >= t} <= slots),
and writes them, SENTINEL after them. If some lane's smallest kept key a_keep is >= t, a key it
dropped could belong to the top-k: the segment is flagged, and a fixup kernel (launched only if
any segment is flagged) redoes flagged segments exactly: a bisection over the segment's keys
(about 33 passes over its columns, from L2) to the k-th largest key, then one compacting pass.
For i.i.d. logits a lane of a 1024-lane, 32768-column segment (32 keys a lane) holds `keep` = 6 of
its top 128 with probability about C(128, 6) / 1024^5 = 5e-6 a segment: the fixup is for
adversarial rows (e.g. logits periodic in the column with the lane count's period), where it is
slow but exact. When more than `fallback_share` of a call's segments are flagged, the chunked
kernel (topk.py) redoes the whole call instead (one lax.switch on the flag count).

float32: the packed key keeps the high half of the 32-bit key only, so the buffers' top-k is the
top-k by that half (ties broken by offset), not by value. The true k-th largest value's high half is
>= that of t (k keys reach t), so stage 1 selects the whole band, every packed key >= t & 0xFFFF0000
(the values whose high half is >= t's), and flags the segment when those exceed `slots` or a lane's
a_keep reaches the band. A band holds 2**16 neighbouring keys (8 mantissa bits): for Gaussian
logits a few extra candidates. The fixup works on the full 32-bit keys: a bisection to the k-th
largest key t*, the count of keys > t*, then one pass in column order that writes those and the
first ties at t* (lax.top_k's lower columns first).

The candidates, [rows, num_segments, slots] packed keys (segment and offset give the column), are
few (8 x 64 a row at 248,320 x k = 64): XLA gathers their logits and sorts them by (key descending,
column ascending), the exact lax.top_k order.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxspec.pallas import topk as tk
from jaxspec.pallas.tiles import is_pow2, next_pow2

# impl="auto" takes this kernel on the GPU once its GPU tests passed. On the H200: 2026-12-01 the
# bfloat16 path matched lax.top_k bit for bit at 1024 and 4096 x 248,320 (Gaussian, tied, clustered,
# 99 % -inf rows, fixup included); 2026-12-02 every case of test_top_k_lanes_gpu (both dtypes, five
# shapes from 5 x 40 to 256 x 248,320, Gaussian / ties / -inf / special values / masked rows, k 1,
# 20, 64) and all four config cases (forced fixups, the float32 band's fixup) passed.
GPU_VALIDATED = True
MAX_SEGMENT = 32768         # 0xFFFF - offset stays >= 0x8000: no packed key reaches SENTINEL / INT_MIN
_TARGET_PROGRAMS = 4 * 132  # about four programs per H200 SM
_I32 = jnp.int32


@dataclasses.dataclass(frozen=True)
class LanesConfig:
    """Tile sizes of the lane-buffer top-k.

    lanes: lanes of a program (power of two, 32..8192), each streaming segment / lanes columns.
      Defaults (512 lanes, keep 6, 4 warps, unroll 8): the fastest of five configs timed on the H200
      (bench/RESULTS.md, 2026-12-01 third session), on Gaussian and adversarial rows.
    keep: keys each lane keeps (1..8): more costs 2 instructions an element, fewer flags more
      segments for the fixup.
    segment: columns per program (power of two, >= lanes, <= 32768); None: 32768, halved (down to
      2 * lanes) while rows * cdiv(vocab, segment) < 528 (four programs per H200 SM); clipped to
      next_pow2(vocab).
    num_warps: warps of a stage-1 / fixup program (1..16, power of two).
    slots: candidate slots a segment (power of two >= k, 16..1024); None: max(16, next_pow2(k)) for
      bfloat16, max(16, next_pow2(2k)) for float32, whose band of ties in the high half (module
      docstring) needs room above the at most slots / 2 keys the threshold leaves.
      More slots let the threshold from the groups' maxima stand without bisection steps, at a
      lower threshold, so more lanes reach it with their smallest kept key (flags for the fixup).
    unroll: steps loaded together before their insertions (1..16): one step of 1024 lanes is 2 KB a
      program, too little in flight to cover the DRAM latency (the first H200 run, unroll 1: stage 1
      4.8x the read floor at 1024 x 248,320 for ~1.2x worth of instructions).
    fallback_share: above this share of a call's segments flagged, the chunked kernel (topk.py)
      redoes the whole call instead of the fixup (0.0: on any flag; 1.0: never). The fixup's ~33
      serial passes cost about one stage 1 per wave of flagged segments, the chunked kernel ~2.5
      stage 1s: float32 rows of integer ties flag every segment (a band of exact ties wider than
      the slots), 8898 us through the fixup against 1283 us for the chunked kernel at
      1024 x 248,320, k 64 (H200, 2026-12-02).
    """
    lanes: int = 512
    keep: int = 6
    segment: int | None = None
    num_warps: int = 4
    unroll: int = 8
    slots: int | None = None
    fallback_share: float = 0.125

    def __post_init__(self):
        if not (is_pow2(self.lanes) and 32 <= self.lanes <= 8192):
            raise ValueError(f"LanesConfig.lanes={self.lanes!r}: must be a power of two in [32, 8192]")
        if not (isinstance(self.keep, int) and 1 <= self.keep <= 8):
            raise ValueError(f"LanesConfig.keep={self.keep!r}: must be an int in [1, 8]")
        if self.segment is not None and not (is_pow2(self.segment) and self.lanes <= self.segment <= MAX_SEGMENT):
            raise ValueError(f"LanesConfig.segment={self.segment!r}: must be a power of two in "
                             f"[lanes={self.lanes}, {MAX_SEGMENT}]")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"LanesConfig.num_warps={self.num_warps!r}: must be one of 1, 2, 4, 8, 16")
        if not (isinstance(self.unroll, int) and 1 <= self.unroll <= 16):
            raise ValueError(f"LanesConfig.unroll={self.unroll!r}: must be an int in [1, 16]")
        if self.slots is not None and not (is_pow2(self.slots) and 16 <= self.slots <= 1024):
            raise ValueError(f"LanesConfig.slots={self.slots!r}: must be a power of two in [16, 1024]")
        share = self.fallback_share
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 <= share <= 1.0:
            raise ValueError(f"LanesConfig.fallback_share={share!r}: must be a number in [0, 1]")

    def resolve(self, rows: int, vocab: int, k: int, dtype=jnp.bfloat16) -> dict:
        """The launch plan: segment, lanes, num_segments, slots, groups."""
        segment = self.segment
        if segment is None:
            segment = MAX_SEGMENT
            while segment > 2 * self.lanes and rows * pl.cdiv(vocab, segment) < _TARGET_PROGRAMS:
                segment //= 2
        segment = min(segment, max(32, next_pow2(vocab)))
        lanes = min(self.lanes, segment)
        band = jnp.dtype(dtype) != jnp.dtype(jnp.bfloat16)
        slots = self.slots or max(16, next_pow2(2 * k if band else k))
        if slots < (2 * k if band else k):
            raise ValueError(f"LanesConfig.slots={slots}: must be >= {'2k' if band else 'k'}={2 * k if band else k} "
                             f"for {jnp.dtype(dtype).name}")
        return dict(segment=segment, lanes=lanes, keep=self.keep, num_segments=pl.cdiv(vocab, segment),
                    slots=slots, band=band, select_slots=slots // 2 if band else slots, groups=min(128, lanes),
                    num_warps=self.num_warps, unroll=self.unroll, fallback_share=float(self.fallback_share))


def supports(logits, k) -> bool:
    """[..., vocab] bfloat16 / float32, 1 <= k <= min(64, vocab)."""
    try:
        if logits.ndim < 1 or jnp.dtype(logits.dtype) not in tk._DTYPES:
            return False
        if not isinstance(k, int) or isinstance(k, bool):
            return False
        rows, vocab = tk._rows_vocab(logits)
        return rows >= 1 and 1 <= k <= min(tk.MAX_K, vocab) and vocab < 2**31 - 2 * MAX_SEGMENT
    except (AttributeError, TypeError):
        return False


def _full_keys(x):
    """Logits -> int32 sort keys (IEEE total order), at least KEY_FLOOR."""
    return jnp.maximum(tk.sort_key(x), _I32(tk.KEY_FLOOR))


def _pack(full, offset):
    """Full keys -> packed keys: the high half over 0xFFFF - offset (distinct within a segment,
    ordered by the high half descending, then offset ascending)."""
    return (full & _I32(tk._HIGH_HALF)) | (_I32(0xFFFF) - offset)


def _packed_keys(x, offset):
    return _pack(_full_keys(x), offset)


def _packed_and_full(x, offset):
    """Both keys of the fixup's compacting pass, the sort key computed once."""
    full = _full_keys(x)
    return _pack(full, offset), full


def _segment_span(s, vocab, segment):
    return jnp.minimum(_I32(vocab) - s * segment, _I32(segment))


def _load_keys(x_ref, r, s, i, lane, *, segment, lanes, span, masked, keys=_packed_keys):
    """keys(x, offset) of step i of segment s (a key or a tuple of keys; SENTINEL past the segment's
    span when masked)."""
    offset = i * lanes + lane
    start = s * segment + i * lanes
    if masked:
        inb = offset < span
        x = plgpu.load(x_ref.at[r, pl.ds(start, lanes)], mask=inb, other=0)
        return jax.tree.map(lambda key: jnp.where(inb, key, _I32(tk.SENTINEL)), keys(x, offset))
    return keys(plgpu.load(x_ref.at[r, pl.ds(start, lanes)]), offset)


def _scan_segment(x_ref, r, s, body, init, *, vocab, segment, lanes, unroll, keys=_packed_keys):
    """fori over segment s's steps, carry = body(keys(x, offset) [lanes], carry) a step: blocks of
    `unroll` full steps (all loads issued before the first body), then the remaining full steps,
    then the partial tail step masked. Steps, and lanes inside a step, go in column order."""
    span = _segment_span(s, vocab, segment)
    lane = jnp.arange(lanes, dtype=jnp.int32)
    load = functools.partial(_load_keys, x_ref, r, s, lane=lane, segment=segment, lanes=lanes, span=span, keys=keys)
    n_full = span // lanes
    n_blocks = n_full // unroll

    def block(b, carry):
        keys = [load(b * unroll + j, masked=False) for j in range(unroll)]
        for key in keys:
            carry = body(key, carry)
        return carry

    carry = lax.fori_loop(0, n_blocks, block, init)
    carry = lax.fori_loop(n_blocks * unroll, n_full, lambda i, c: body(load(i, masked=False), c), carry)
    return lax.fori_loop(n_full, pl.cdiv(span, lanes), lambda i, c: body(load(i, masked=True), c), carry)


def _insert(key, bufs):
    """Insert key [lanes] into each lane's sorted buffers (largest first)."""
    out = []
    for a in bufs:
        out.append(jnp.maximum(a, key))
        key = jnp.minimum(a, key)
    return tuple(out)


def _scatter(key_ref, r, s, key, sel, base, *, slots):
    """Scatter the selected keys to slots base, base + 1, ... in lane order -> base + #selected."""
    pos = jnp.where(sel, base + jnp.cumsum(sel.astype(jnp.int32)) - 1, _I32(slots))
    plgpu.store(key_ref.at[r, s, pos], key, mask=sel)
    return base + jnp.sum(sel.astype(jnp.int32))


def _fill(key_ref, r, s, n, *, slots):
    """SENTINEL into slots n.. of (r, s)."""
    empty = jnp.arange(slots, dtype=jnp.int32) >= n
    plgpu.store(key_ref.at[r, s, pl.ds(0, slots)], jnp.full((slots,), tk.SENTINEL, jnp.int32), mask=empty)


def _stage1_kernel(x_ref, *refs, vocab, k, segment, lanes, unroll, keep, slots, groups, band, select_slots):
    """One (row, segment): candidates (the top-k of the lanes' buffers; band: every buffered key in
    the high-half band of that top-k's smallest or above) and the overflow flag."""
    key_ref, flag_ref = refs[-2:]
    r, s = pl.program_id(0), pl.program_id(1)
    empty = jnp.full((lanes,), tk.SENTINEL, jnp.int32)
    bufs = _scan_segment(x_ref, r, s, _insert, (empty,) * keep, vocab=vocab, segment=segment, lanes=lanes,
                         unroll=unroll)
    # bufs[0] holds each lane's maximum: the k-th largest of the groups' maxima starts the threshold.
    gmax = jnp.max(bufs[0].reshape(groups, lanes // groups), axis=1)                 # [G]
    cnt = jnp.sum((gmax[None, :] >= gmax[:, None]).astype(jnp.int32), axis=1)
    t0 = jnp.max(jnp.where(cnt >= k, gmax, _I32(tk.SENTINEL)))
    t, _ = tk._distinct_threshold(bufs, t0, jnp.max(gmax), k=k, slots=select_slots, bisect=True)
    sel = [kv >= t for kv in bufs]
    if band:                                          # float32: the values whose high half is >= t's
        t = jnp.maximum(t & _I32(tk._HIGH_HALF), _I32(tk.KEY_FLOOR))
        sel = [kv >= t for kv in bufs]
        too_many = functools.reduce(jnp.add, [jnp.sum(sv.astype(jnp.int32)) for sv in sel]) > slots
        sel = [sv & ~too_many for sv in sel]
    n = _I32(0)
    for kv, sv in zip(bufs, sel):
        n = _scatter(key_ref, r, s, kv, sv, n, slots=slots)
    _fill(key_ref, r, s, n, slots=slots)
    overflow = jnp.max(bufs[-1]) >= t                 # a lane's dropped key may be in the top-k
    if band:
        overflow = overflow | too_many
    flag_ref[...] = jnp.full((1, 1), overflow, jnp.int32)


def _fixup_kernel(x_ref, flag_ref, *refs, vocab, k, segment, lanes, unroll, slots):
    """One flagged (row, segment), exactly: the k-th largest full key t* by bisection over the
    segment's keys (one pass a step), the count of keys > t*, then one pass in column order writing
    (packed) the keys > t* and the first ties at t*. Unflagged programs return at once."""
    key_ref = refs[-1]
    r, s = pl.program_id(0), pl.program_id(1)
    flagged = flag_ref[0, 0] != 0
    scan = functools.partial(_scan_segment, x_ref, r, s, vocab=vocab, segment=segment, lanes=lanes, unroll=unroll)
    want = jnp.minimum(_I32(k), _segment_span(s, vocab, segment))

    @pl.when(flagged)
    def _redo():
        def count(t, strict=False):
            above = (lambda key: key > t) if strict else (lambda key: key >= t)
            return scan(lambda key, n: n + jnp.sum(above(key).astype(jnp.int32)), _I32(0),
                        keys=lambda x, offset: _full_keys(x))

        def body(i, lohi):        # invariant: count(lo) >= want > count(hi + 1)
            lo, hi = lohi
            mid = tk._ceil_avg(lo, hi)
            ok = count(mid) >= want
            return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

        t, _ = lax.fori_loop(0, 33, body, (_I32(tk.KEY_FLOOR), _I32(tk._I32_MAX)))
        cap = want - count(t, strict=True)                # ties at t to take, lowest columns first

        def write(keys, carry):
            packed, full = keys
            n, ties = carry
            eq = full == t
            tie_rank = ties + jnp.cumsum(eq.astype(jnp.int32))
            n = _scatter(key_ref, r, s, packed, (full > t) | (eq & (tie_rank <= cap)), n, slots=slots)
            return n, ties + jnp.sum(eq.astype(jnp.int32))

        n, _ = scan(write, (_I32(0), _I32(0)), keys=_packed_and_full)
        _fill(key_ref, r, s, n, slots=slots)


def _geometry(x, k, plan):
    return dict(vocab=x.shape[1], k=k, segment=plan["segment"], lanes=plan["lanes"], unroll=plan["unroll"],
                slots=plan["slots"])


def _params(plan):
    return plgpu.CompilerParams(num_warps=plan["num_warps"], num_stages=1)


def _stage1(x, k, plan, *, interpret, poison_outputs):
    """-> (packed keys [rows, num_segments, slots], flags [rows, num_segments]) before the fixup."""
    rows, nseg = x.shape[0], plan["num_segments"]
    out_shape, extra, aliases = tk._outputs([((rows, nseg, plan["slots"]), jnp.int32)], poison_outputs, 1)
    return pl.pallas_call(
        functools.partial(_stage1_kernel, keep=plan["keep"], groups=plan["groups"], band=plan["band"],
                          select_slots=plan["select_slots"], **_geometry(x, k, plan)),
        out_shape=out_shape + (jax.ShapeDtypeStruct((rows, nseg), jnp.int32),),
        out_specs=(pl.no_block_spec, pl.BlockSpec((1, 1), lambda r, s: (r, s))),
        grid=(rows, nseg),
        input_output_aliases=aliases,
        compiler_params=_params(plan),
        interpret=interpret,
        name="topk_lanes_stage1",
    )(x, *extra)


def _fixup(x, flags, keys, k, plan, *, interpret):
    """Flagged segments' candidates redone exactly (keys aliased: the others are kept)."""
    return pl.pallas_call(
        functools.partial(_fixup_kernel, **_geometry(x, k, plan)),
        out_shape=jax.ShapeDtypeStruct(keys.shape, jnp.int32),
        in_specs=(pl.no_block_spec, pl.BlockSpec((1, 1), lambda r, s: (r, s)), pl.no_block_spec),
        out_specs=pl.no_block_spec,
        grid=flags.shape,
        input_output_aliases={2: 0},
        compiler_params=_params(plan),
        interpret=interpret,
        name="topk_lanes_fixup",
    )(x, flags, keys)


def top_k_candidates(x, k, plan, *, interpret, poison_outputs=False):
    """x [rows, vocab] bf16 / f32 -> (packed keys [rows, num_segments, slots] int32, flags [rows,
    num_segments] int32): each segment's first slots hold k..slots of its keys, its top
    min(k, span) among them (a flagged segment: exactly those, redone by the fixup), SENTINEL after.
    float32: the packed keys order by their high half only; `order_candidates` sorts by value."""
    keys, flags = _stage1(x, k, plan, interpret=interpret, poison_outputs=poison_outputs)
    keys = lax.cond(jnp.any(flags != 0), lambda keys: _fixup(x, flags, keys, k, plan, interpret=interpret),
                    lambda keys: keys, keys)
    return keys, flags


def order_candidates(x, keys, k, segment):
    """Packed candidates [rows, nseg, slots] -> (values [rows, k], indices [rows, k]) in lax.top_k's
    order: their logits gathered, then one XLA sort of the few by (key descending, column ascending)."""
    rows, nseg, _ = keys.shape
    real = keys >= tk.KEY_FLOOR
    seg = jnp.arange(nseg, dtype=jnp.int32)[None, :, None]
    cols = jnp.where(real, seg * segment + (0xFFFF - (keys & 0xFFFF)), 0).reshape(rows, -1)
    real = real.reshape(rows, -1)
    full = jnp.where(real, _full_keys(jnp.take_along_axis(x, cols, axis=1)), jnp.iinfo(jnp.int32).min)
    _, cols = lax.sort((~full, jnp.where(real, cols, jnp.iinfo(jnp.int32).max)), dimension=1, num_keys=2)
    idx = cols[:, :k]                                    # ~full: descending keys, without overflow
    return jnp.take_along_axis(x, idx, axis=1), idx


def top_k(logits, k, *, config: LanesConfig | None = None, interpret: bool | None = None,
          poison_outputs: bool = False, candidates_out: bool = False):
    """Values and indices of the k largest logits per row, in jax.lax.top_k's order.

    logits [..., vocab] bfloat16 / float32; k static, 1 <= k <= min(64, vocab).
    -> (values [..., k] logits.dtype, indices [..., k] int32), descending, ties: lower index first.
    candidates_out: also return (packed keys [rows, nseg, slots], overflow flags [rows, nseg]): the
      candidates after the fixup, or stage 1's when the chunked kernel took the call (flags show it).
    poison_outputs: stage 1 writes into an INT_MIN-filled buffer (tests: unwritten slots show).
    """
    if not supports(logits, k):
        raise ValueError(f"top_k lanes kernel: unsupported logits {getattr(logits, 'shape', None)} "
                         f"{getattr(logits, 'dtype', None)} with k={k!r} (bf16/fp32, 1 <= k <= min(64, vocab))")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    lead = logits.shape[:-1]
    rows, vocab = tk._rows_vocab(logits)
    x = logits.reshape(rows, vocab)
    plan = (config or LanesConfig()).resolve(rows, vocab, k, logits.dtype)
    keys, flags = _stage1(x, k, plan, interpret=interpret, poison_outputs=poison_outputs)
    # One XLA conditional (as the fixup's lax.cond before it): on the GPU its predicate is copied to
    # the host, which waits for it (the estimator measured ~13-15 us a step for that, README).
    flagged = jnp.sum(flags != 0)
    path = jnp.where(flagged == 0, 0, jnp.where(flagged > plan["fallback_share"] * flags.size, 2, 1))

    def lanes(keys):
        return order_candidates(x, keys, k, plan["segment"]) + (keys,)

    vals, idx, keys = lax.switch(path, [
        lanes,
        lambda keys: lanes(_fixup(x, flags, keys, k, plan, interpret=interpret)),
        lambda keys: tk.top_k(x, k, interpret=interpret) + (keys,)], keys)
    out = vals.reshape(*lead, k), idx.reshape(*lead, k)
    return out + (keys, flags) if candidates_out else out
