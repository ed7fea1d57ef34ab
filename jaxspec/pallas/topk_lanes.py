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
it. The kernel then selects, from U, the keys >= t (the stage-1 selection of topk.py: the k-th
largest of the groups' maxima, and bisection while more than `slots` remain: k <= #{U >= t} <=
slots), and writes them, SENTINEL after them. If some lane's smallest kept key a_keep is >= t, a
key it dropped could belong to the top-k: the segment is flagged, and the same program redoes it
exactly instead: a search over the segment's keys (one pass over its columns a step, from L2) to
the k-th largest key, then one compacting pass. No XLA conditional and no second launch: on the
H200 a conditional's predicate goes to the host, which waits for it, and the engine runs this in
every sampled verify step. For i.i.d. logits a lane of a 1024-lane, 32768-column segment (32 keys
a lane) holds `keep` = 6 of its top 128 with probability about C(128, 6) / 1024^5 = 5e-6 a
segment: the redo is for adversarial rows (e.g. logits periodic in the column with the lane
count's period), where it is slow but exact.

float32: the packed key keeps the high half of the 32-bit key only, so the buffers' top-k is the
top-k by that half (ties broken by offset), not by value. The true k-th largest value's high half is
>= that of t (k keys reach t), so the kernel selects the whole band, every packed key >= t & 0xFFFF0000
(the values whose high half is >= t's), and flags the segment when those exceed `slots` or a lane's
a_keep reaches the band. A band holds 2**16 neighbouring keys (8 mantissa bits): for Gaussian
logits a few extra candidates. A segment whose float32 values all have zero low halves (values
bfloat16 holds exactly: upcast bf16 logits, small integers) orders exactly by its packed keys: the
kernel ORs the bits it reads and then takes the bfloat16 selection (rows of integer ties used to
flag every segment, a band of exact ties wider than the slots). The exact redo works on the full
32-bit keys: a search to the k-th largest key t* that cuts its range at the midpoint and moves the
kept end to the nearest existing key (few distinct values, e.g. ties, end in a few passes), the
count of keys > t*, then one pass in column order that writes those and the first ties at t*
(lax.top_k's lower columns first).

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
# bfloat16 path matched lax.top_k bit for bit at 1024 and 4096 x 248,320; 2026-12-02 (second
# session) the one-kernel form passed the whole GPU module (both dtypes, five shapes from 5 x 40 to
# 256 x 248,320, Gaussian / ties / -inf / special values / masked rows, k 1, 20, 64; forced exact
# redos in all, some or no segments; float32 tie rows bfloat16-exact and not; the dispatch).
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
      segments for the exact redo.
    segment: columns per program (power of two, >= lanes, <= 32768); None: 32768, halved (down to
      2 * lanes) while rows * cdiv(vocab, segment) < 528 (four programs per H200 SM); clipped to
      next_pow2(vocab).
    num_warps: warps of a program (1..16, power of two).
    slots: candidate slots a segment (power of two >= k, 16..1024); None: max(16, next_pow2(k)) for
      bfloat16, max(16, next_pow2(2k)) for float32, whose band of ties in the high half (module
      docstring) needs room above the at most slots / 2 keys the threshold leaves.
      More slots let the threshold from the groups' maxima stand without bisection steps, at a
      lower threshold, so more lanes reach it with their smallest kept key (flags for the redo).
    unroll: steps loaded together before their insertions (1..16): one step of 1024 lanes is 2 KB a
      program, too little in flight to cover the DRAM latency (the first H200 run, unroll 1: the kernel
      4.8x the read floor at 1024 x 248,320 for ~1.2x worth of instructions).
    """
    lanes: int = 512
    keep: int = 6
    segment: int | None = None
    num_warps: int = 4
    unroll: int = 8
    slots: int | None = None

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
                    num_warps=self.num_warps, unroll=self.unroll)


def supports(logits, k) -> bool:
    """[..., vocab] bfloat16 / float32, 1 <= k <= min(64, vocab)."""
    shape = tk.top_k_rows_vocab(logits, k)
    return shape is not None and shape[1] < 2**31 - 2 * MAX_SEGMENT


def _full_keys(x):
    """Logits -> int32 sort keys (IEEE total order), at least KEY_FLOOR."""
    return jnp.maximum(tk.sort_key(x), _I32(tk.KEY_FLOOR))


def _pack(full, offset):
    """Full keys -> packed keys: the high half over 0xFFFF - offset (distinct within a segment,
    ordered by the high half descending, then offset ascending)."""
    return (full & _I32(tk._HIGH_HALF)) | (_I32(0xFFFF) - offset)


def _packed_keys(x, offset):
    return _pack(_full_keys(x), offset)


def _packed_and_bits(x, offset):
    """Packed keys and the logits' float32 bits (whose low halves tell a bfloat16-exact row)."""
    return _packed_keys(x, offset), lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)


def _packed_and_full(x, offset):
    """Both keys of the exact redo's compacting pass, the sort key computed once."""
    full = _full_keys(x)
    return _pack(full, offset), full


def _segment_span(s, vocab, segment):
    return jnp.minimum(_I32(vocab) - s * segment, _I32(segment))


def _load_keys(x_ref, r, s, i, lane, *, segment, lanes, span, masked, keys=_packed_keys, fill=tk.SENTINEL):
    """keys(x, offset) of step i of segment s (a key or a tuple of keys; past the segment's span,
    when masked: `fill`, one value or a tuple like the keys)."""
    offset = i * lanes + lane
    start = s * segment + i * lanes
    if masked:
        inb = offset < span
        x = plgpu.load(x_ref.at[r, pl.ds(start, lanes)], mask=inb, other=0)
        out = keys(x, offset)
        fills = fill if isinstance(fill, tuple) else jax.tree.map(lambda _: fill, out)
        return jax.tree.map(lambda key, f: jnp.where(inb, key, _I32(f)), out, fills)
    return keys(plgpu.load(x_ref.at[r, pl.ds(start, lanes)]), offset)


def _scan_segment(x_ref, r, s, body, init, *, vocab, segment, lanes, unroll, keys=_packed_keys, fill=tk.SENTINEL):
    """fori over segment s's steps, carry = body(keys(x, offset) [lanes], carry) a step: blocks of
    `unroll` full steps (all loads issued before the first body), then the remaining full steps,
    then the partial tail step masked (keys `fill` past the span). Steps, and lanes inside a step,
    go in column order."""
    span = _segment_span(s, vocab, segment)
    lane = jnp.arange(lanes, dtype=jnp.int32)
    load = functools.partial(_load_keys, x_ref, r, s, lane=lane, segment=segment, lanes=lanes, span=span,
                             keys=keys, fill=fill)
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


def _insert_and_or(keys, carry):
    """_insert, and the OR of the float32 bits seen by each lane."""
    (packed, bits), (bufs, seen) = keys, carry
    return _insert(packed, bufs), seen | bits


def _scatter(key_ref, r, s, key, sel, base, *, slots):
    """Scatter the selected keys to slots base, base + 1, ... in lane order -> base + #selected."""
    pos = jnp.where(sel, base + jnp.cumsum(sel.astype(jnp.int32)) - 1, _I32(slots))
    plgpu.store(key_ref.at[r, s, pos], key, mask=sel)
    return base + jnp.sum(sel.astype(jnp.int32))


def _fill(key_ref, r, s, n, *, slots):
    """SENTINEL into slots n.. of (r, s)."""
    empty = jnp.arange(slots, dtype=jnp.int32) >= n
    plgpu.store(key_ref.at[r, s, pl.ds(0, slots)], jnp.full((slots,), tk.SENTINEL, jnp.int32), mask=empty)


def _exact_candidates(scan, key_ref, r, s, lo, hi, *, k, vocab, segment, lanes, slots):
    """Segment s's top want = min(k, span) keys, exactly, given full keys lo <= hi with
    #{key >= lo} >= want > #{key > hi}: the want-th largest full key t* by a search that cuts
    [lo, hi] at its midpoint and then moves the kept end to the nearest key that exists (one pass
    a step, from L2: the count above the cut, the least key above it and the greatest below it; a
    range of few distinct values, e.g. ties, ends in a few steps, any range in <= 32), the count of
    keys > t*, then one pass in column order writing (packed) the keys > t* and the first ties at
    t* (lax.top_k's lower columns)."""
    want = jnp.minimum(_I32(k), _segment_span(s, vocab, segment))

    def full_keys(x, offset):
        return _full_keys(x)

    def lane_ints(v):
        return jnp.full((lanes,), v, jnp.int32)

    def cut(lohi):                # invariant: #{key >= lo} >= want > #{key > hi}, lo, hi keys once cut
        lo, hi = lohi
        mid = tk._ceil_avg(lo, hi)

        def body(key, c):
            n, above, below = c
            up = key >= mid
            return (n + up.astype(jnp.int32), jnp.minimum(above, jnp.where(up, key, _I32(tk._I32_MAX))),
                    jnp.maximum(below, jnp.where(up, _I32(tk.SENTINEL), key)))

        n, above, below = scan(body, (lane_ints(0), lane_ints(tk._I32_MAX), lane_ints(tk.SENTINEL)), keys=full_keys)
        ok = jnp.sum(n) >= want
        return jnp.where(ok, jnp.min(above), lo), jnp.where(ok, hi, jnp.max(below))

    t, _ = lax.while_loop(lambda lohi: lohi[0] < lohi[1], cut, (lo, hi))
    above_t = scan(lambda key, n: n + (key > t).astype(jnp.int32), lane_ints(0), keys=full_keys)
    cap = want - jnp.sum(above_t)                          # ties at t to take, lowest columns first

    def write(keys, carry):
        packed, full = keys
        n, ties = carry
        eq = full == t
        tie_rank = ties + jnp.cumsum(eq.astype(jnp.int32))
        n = _scatter(key_ref, r, s, packed, (full > t) | (eq & (tie_rank <= cap)), n, slots=slots)
        return n, ties + jnp.sum(eq.astype(jnp.int32))

    n, _ = scan(write, (_I32(0), _I32(0)), keys=_packed_and_full)
    _fill(key_ref, r, s, n, slots=slots)


def _segment_kernel(x_ref, *refs, vocab, k, segment, lanes, unroll, keep, slots, groups, band, select_slots):
    """One (row, segment): its candidates and the overflow flag. Unflagged: the top-k of the lanes'
    buffers (float32 with some low half set: every buffered key in the high-half band of that
    top-k's smallest or above). Flagged (a lane's dropped key may be in the top-k, or the band
    exceeds the slots): `_exact_candidates`, in the same program (no second launch, no XLA
    conditional on the flags)."""
    key_ref, flag_ref = refs[-2:]
    r, s = pl.program_id(0), pl.program_id(1)
    scan = functools.partial(_scan_segment, x_ref, r, s, vocab=vocab, segment=segment, lanes=lanes, unroll=unroll)
    empty = jnp.full((lanes,), tk.SENTINEL, jnp.int32)
    if band:
        bufs, seen = scan(_insert_and_or, ((empty,) * keep, jnp.zeros((lanes,), jnp.int32)),
                          keys=_packed_and_bits, fill=(tk.SENTINEL, 0))
    else:
        bufs = scan(_insert, (empty,) * keep)
    # bufs[0] holds each lane's maximum: the k-th largest of the groups' maxima starts the threshold.
    gmax = jnp.max(bufs[0].reshape(groups, lanes // groups), axis=1)                 # [G]
    cnt = jnp.sum((gmax[None, :] >= gmax[:, None]).astype(jnp.int32), axis=1)
    t0 = jnp.max(jnp.where(cnt >= k, gmax, _I32(tk.SENTINEL)))
    t, _ = tk._distinct_threshold(bufs, t0, jnp.max(gmax), k=k, slots=select_slots, bisect=True)
    too_many = False
    if band:
        # float32 whose values all fit bfloat16 (low halves 0: integer ties, upcast bf16 logits):
        # the packed keys order exactly, as for bfloat16. Else the values whose high half is >= t's.
        exact = jnp.max(seen & _I32(0xFFFF)) == 0
        t = jnp.where(exact, t, jnp.maximum(t & _I32(tk._HIGH_HALF), _I32(tk.KEY_FLOOR)))
        taken = functools.reduce(jnp.add, [jnp.sum((kv >= t).astype(jnp.int32)) for kv in bufs])
        too_many = ~exact & (taken > slots)
    overflow = (jnp.max(bufs[-1]) >= t) | too_many        # a lane's dropped key may be in the top-k

    @pl.when(~overflow)
    def _buffered():
        n = _I32(0)
        for kv in bufs:
            n = _scatter(key_ref, r, s, kv, kv >= t, n, slots=slots)
        _fill(key_ref, r, s, n, slots=slots)

    @pl.when(overflow)
    def _exact():
        # >= k buffered keys reach t (or t is KEY_FLOOR); the greatest key is a lane's first
        lo = jnp.maximum(t & _I32(tk._HIGH_HALF), _I32(tk.KEY_FLOOR))
        hi = jnp.maximum(jnp.max(bufs[0]) | _I32(0xFFFF), lo)
        _exact_candidates(scan, key_ref, r, s, lo, hi, k=k, vocab=vocab, segment=segment, lanes=lanes, slots=slots)

    flag_ref[...] = jnp.full((1, 1), overflow, jnp.int32)


def top_k_candidates(x, k, plan, *, interpret, poison_outputs=False):
    """x [rows, vocab] bf16 / f32 -> (packed keys [rows, num_segments, slots] int32, flags [rows,
    num_segments] int32): each segment's first slots hold k..slots of its keys, its top
    min(k, span) among them (a flagged segment: exactly those, from the exact redo), SENTINEL after.
    float32: the packed keys order by their high half only; `order_candidates` sorts by value.
    poison_outputs: the keys are written into an INT_MIN-filled buffer (unwritten slots show)."""
    rows, nseg = x.shape[0], plan["num_segments"]
    out_shape, extra, aliases = tk._outputs([((rows, nseg, plan["slots"]), jnp.int32)], poison_outputs, 1)
    return pl.pallas_call(
        functools.partial(_segment_kernel, vocab=x.shape[1], k=k, segment=plan["segment"], lanes=plan["lanes"],
                          unroll=plan["unroll"], slots=plan["slots"], keep=plan["keep"], groups=plan["groups"],
                          band=plan["band"], select_slots=plan["select_slots"]),
        out_shape=out_shape + (jax.ShapeDtypeStruct((rows, nseg), jnp.int32),),
        out_specs=(pl.no_block_spec, pl.BlockSpec((1, 1), lambda r, s: (r, s))),
        grid=(rows, nseg),
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=plan["num_warps"], num_stages=1),
        interpret=interpret,
        name="topk_lanes",
    )(x, *extra)


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
      candidates and which segments the exact redo wrote.
    poison_outputs: the candidates are written into an INT_MIN-filled buffer (tests: unwritten slots show).
    One Pallas launch and no XLA conditional; XLA then gathers and sorts the few candidates.
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
    keys, flags = top_k_candidates(x, k, plan, interpret=interpret, poison_outputs=poison_outputs)
    vals, idx = order_candidates(x, keys, k, plan["segment"])
    out = vals.reshape(*lead, k), idx.reshape(*lead, k)
    return out + (keys, flags) if candidates_out else out
