"""Pallas (Triton lowering) top-k and greedy argmax over the vocabulary axis of the target logits.

Contracts: `jaxspec.ops.sampling.top_k` (reference `jax.lax.top_k`) and
`jaxspec.ops.sampling.greedy_tokens` (reference `jnp.argmax`).

Status: `sampling.top_k` no longer dispatches this chunked top-k (since 2026-12-02): the
chunk-maxima kernel (topk_maxima.py) and the lane-buffer kernel (topk_lanes.py) cover every call it
covers and are faster on the H200. It stays as the baseline of bench/topk_kernel.py; the sort key,
the argmax and the helpers the other top-k kernels import live here.

Order
-----
Every comparison runs on an int32 *sort key*: the float32 bits of the logit with the magnitude bits
flipped for negative numbers, `key = bits ^ ((bits >> 31) & 0x7fffffff)`. Signed int32 order of the
key is the IEEE total order that `lax.top_k` uses (checked on the CPU): -NaN < -inf < ... < -0.0 <
+0.0 < ... < +inf < +NaN. bfloat16 converts to float32 exactly, so both dtypes share one key. Ties
(equal keys) go to the lower column: the kernel returns exactly `lax.top_k`'s indices, including
rows with fewer than k finite logits (their -inf entries come last, lowest unused columns first).
Values are gathered from the logits by index at the end, so they are bit-exact. Two keys are
reserved below every real one: REMOVED (INT_MIN, an entry already taken) and SENTINEL (INT_MIN + 1,
out-of-range columns and empty candidate slots); real keys are clamped to >= INT_MIN + 2, which only
touches the two negative-NaN bit patterns 0xfffffffe / 0xffffffff (ranked with 0xfffffffd).

Top-k design: two kernels
-------------------------
Stage 1, grid (rows, cdiv(vocab, chunk)), one program per (row, chunk of `chunk` columns, 4096 by
default): it reads its chunk once (one masked [chunk] load, every load in flight at once; the tail
chunk is masked explicitly, the Triton lowering does not mask overhanging blocks) and writes a
*superset* of the chunk's top-k: `slots` = M candidates (key, column) per chunk, M = max(16,
next_pow2(2k)) (128 for k = 64, 64 for k = 20). It never sorts:

  1. Threshold. The chunk is split into G groups of chunk/G contiguous columns (G = clip(next_pow2(2k),
     32, 128)); their maxima m_g come from one reduction. t0 = the k-th largest group maximum, found
     without a serial loop: cnt_g = #{h : m_h >= m_g} over a [G, G] comparison (G^2 / threads = 64
     compares a thread at G = 128, 256 threads), t0 = max{m_g : cnt_g >= k}. At least k elements of
     the chunk (k group maxima) are >= t0, so the chunk's top-k all have keys >= t0.
  2. Counts. n_gt = #{key > t}, n_eq = #{key == t} (one packed int32 sum: gt + eq << 16).
     If n_gt <= M the candidates are every key > t plus the first M - n_gt ties (== t) in column
     order. This holds the top-k: if t is below the k-th largest key v_k, the top-k are all > t;
     if t == v_k, they are the n_gt keys > t plus the lowest-column k - n_gt ties (k <= M).
  3. Bisection (rare). If n_gt > M (e.g. a contiguous block of high logits covering fewer than k
     groups), t is raised by bisection over the int32 key space between t0 and the chunk max with
     the invariants #{key >= lo} >= k and #{key > hi} < k, stopping as soon as n_gt(t) <= M. At
     lo == hi, t = v_k and n_gt < k <= M, so it ends in at most 32 steps of one compare + one sum.
     For i.i.d. logits (any distribution: only ranks matter) n_gt is 86 +- 6 at k = 64 (G = 128,
     max 113 in 2000 chunks) and 23 at k = 20, so the loop does not run.
  4. Compaction in column order: one inclusive cumsum of the packed (gt, eq) flags gives, for each
     selected element, slot = #gt before + min(#eq before, M - n_gt); a masked scatter store writes
     (key, column) there, and SENTINEL fills the unused slots (the two stores touch disjoint slots).
     Column order is kept so that stage 2 can break ties by slot position.

  With TopKConfig(bisection="fixup") step 3 leaves stage 1: a chunk with n_gt(t0) > M writes no
     candidates, only a flag, and a second kernel (one program per row, looping over its chunks)
     redoes the flagged chunks with the bisection into the same buffers. Stage 1 then carries no
     data-dependent loop over its live chunk (whether that frees enough registers to matter is a
     GPU measurement: bench/topk_kernel.py --sweep-bisection inline,fixup).

  Cost per element: load, key (~5 int ops), group max, two compares, pack, sum, scan, predicated
  store: ~25-30 instructions a thread per element, against k rounds of (max + lowest-index argmax +
  mask) for the obvious in-register extraction: 64 rounds x ~6 ops = ~380 ops an element and 64-128
  serial block reductions per program, ~10x the work (estimated ~1.6 ms at 1024 x 248,320 bf16 for
  k = 64 against a read floor of 0.12 ms). A bitonic partial sort costs ~28 compare-exchange passes
  of (key, index) pairs over the chunk plus layout shuffles, also far more than one pass. The
  filter keeps stage 1 close to a single read of the logits.

Packed bfloat16 keys (TopKConfig.pack_bf16, the default): a bfloat16 logit's key has all its
information in the high 16 bits (the low half is 0x0000, or 0xFFFF for a negative number), so
stage 1 replaces the low half by 0xFFFF - (column offset in the chunk): the packed keys of a chunk
are distinct and ordered by (logit descending, column ascending), the order lax.top_k wants. Steps
2-4 then have no ties: the candidates are {key >= t} with k <= #{key >= t} <= M (the bisection, when
needed, ends at the k-th largest key, where the count is exactly k), one cumsum gives the slots, and
one scatter store writes them (no column array: stage 2 gets the column back from the candidate's
position, chunk = position // M, and the low half). The low half orders equal logits inside a
chunk only; stage 2 re-packs each candidate with 0xFFFF - its position, which orders them across
chunks too (positions follow the columns; at most 2**15 candidates a row, so that no re-packed key
reaches REMOVED). Each masked [chunk] scatter costs stage 1 about 220 us at 1024 x 248,320 on the
H200 (a thread issues chunk / threads predicated stores, though at most M lanes write), so this
removes one of two along with the tie bookkeeping.

Stage 2, grid (rows,): one program per row loads the row's cdiv(vocab, chunk) * M candidates (7808
at 248,320 x k = 64, chunk 4096) and runs k rounds of argmax (one tuple reduction: max key, lowest
position on ties) + remove. Candidate positions increase with the column (chunks in order, column
order inside a chunk), so the lowest position among equal keys is the lowest column: the output
is in `lax.top_k` order. It then gathers the k columns and their logits and writes values [rows, k]
(input dtype) and indices [rows, k] int32. TopKConfig(stage2="filter") replaces the k rounds by
the stage-1 selection over the row's candidates (groups strided across the chunks, bisection
inline) down to next_pow2(2k) (key, column) pairs in column order, a few block reductions instead
of k, and lets XLA's lax.top_k order those [rows, next_pow2(2k)] (equal keys: lower position, so
lower column, first) before the values are gathered. Candidate traffic (8 bytes x M per chunk, written once
and read once) is ~12 % of the fp32 logits bytes and ~25 % of the bf16 ones at k = 64, chunk 4096
(half that at k = 20 or chunk 8192; the sweep still found 4096 faster: stage 1 is bound by
instruction issue, not by bytes).

Where stage 1's time goes (H200, 1024 x 248,320 bf16, k = 64; timing-only variants of the kernel,
2026-12-01): load + key + one max 155-165 us (the read floor), + group maxima ~160, + the [G, G]
threshold 225-243, + the (gt, eq) count 331-337, + the compaction scan 387-435, the whole stage 1
1050-1450 (the bisection loop that does not run, the scatter stores and the register pressure of
keeping the chunk live across them); a second probe (12-01, second session): + the key scatter
store 693, + the column scatter store 914, + the SENTINEL fill 976, stage 1 1029. Packed bf16 keys
drop the column store and the tie bookkeeping: stage 1 700-790 us, the whole top-k 0.97 ms (1.29x
faster at k = 64, 1.35x at k = 20). Reaching 2x the read floor needs a stage 1 of ~25 instructions
an element: the H200 issues ~17 a bf16 element at its copy bandwidth.

Greedy argmax
-------------
One pass: grid (rows, splits); a program streams its span of the row in `block`-column steps,
keeping a per-lane running best (key, column) (strictly greater wins, so a lane keeps its first
column of a tie) and reduces once at the end (max key, then the lowest column holding it). The key
follows `jnp.argmax`: any NaN is the maximum, -0.0 == +0.0. splits > 1 (few rows) gives more
programs; the partial results [rows, splits] are combined by a tiny jnp argmax (the first split
wins ties, i.e. the lowest column).

Stage-1 tile sizes: the H200 sweep (bench/topk_kernel.py --sweep); the argmax's are estimates.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxspec.pallas.tiles import is_pow2, next_pow2

_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
# tests/test_pallas_topk.py -m gpu passed on the H200 (2026-11-30, jax 0.11.2: all 23 top-k cases
# and the dispatch test; 2026-12-01: 54 cases with the packed bf16 keys), so impl="auto" takes the
# top-k kernel on the GPU (ops/sampling.py); stage2="filter" passed its GPU tests on 2026-12-01 (third session).
GPU_VALIDATED = True
MAX_K = 64                  # largest k the top-k kernel takes (registers of the stage-2 rounds)
MAX_CHUNK = 16384           # counts are packed as gt + eq << 16 (eq <= chunk must stay < 2**15);
                            # packed bf16 keys hold 0xFFFF - offset in their low half
MAX_CANDIDATES = 16384      # stage 2 keeps a row's candidates in registers
_TARGET_PROGRAMS = 4 * 132  # about four programs per H200 SM before tiles grow

REMOVED = -2**31            # an entry already taken (stage 2), the argmax's initial best
SENTINEL = -2**31 + 1       # out-of-range column / empty candidate slot
KEY_FLOOR = -2**31 + 2      # smallest key of a real logit
_MAGNITUDE = 0x7FFFFFFF
_HIGH_HALF = -2**16           # 0xFFFF0000: the high half of an int32 (a bfloat16 logit's whole key)
_I32_MAX = 2**31 - 1


def _i32(v):
    return jnp.int32(v)


def sort_key(x):
    """int32 key whose signed order is the IEEE total order of x (float32 / bfloat16)."""
    bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    return bits ^ ((bits >> 31) & _i32(_MAGNITUDE))


def argmax_key(x):
    """int32 key of jnp.argmax's order: NaN above everything, -0.0 == +0.0, otherwise IEEE."""
    key = sort_key(x)
    key = jnp.where(key == _i32(-1), _i32(0), key)            # -0.0 (key -1) ties with +0.0
    return jnp.where(x != x, _i32(_I32_MAX), key)


# ------------------------------------------------------------------------------ configs


@dataclasses.dataclass(frozen=True)
class TopKConfig:
    """Tile sizes of the two-stage top-k.

    chunk: columns per stage-1 program (power of two, 64..16384). None: 4096, halved (down to 2048)
      while rows * cdiv(vocab, chunk) < 528 (four programs per H200 SM), then doubled while the
      row's candidate count exceeds 16384; clipped to next_pow2(vocab).
    groups: G, groups of the threshold step (power of two, 2..256); None: clip(next_pow2(2k), 32,
      128). Larger G gives a tighter threshold (fewer candidates) at G^2 compares per program.
    slots: M, candidate slots per chunk (power of two, >= k, 16..1024); None: max(16, next_pow2(2k)).
    num_warps / stage2_warps: warps of the stage-1 / stage-2 programs (1..16, power of two); None:
      4 for stage 1 (32 elements a thread at chunk 4096), stage 2 8 (16 when it holds more than 8192
      candidates). The H200 sweep (bench/RESULTS.md, 2026-12-01) put chunk 4096 x 4 warps first at
      fp32 / bf16 and k 20 / 64: 1.3-1.4x faster than 8192 x 8, whose 255-register programs ran one
      per SM.
    bisection: where a chunk with more than M keys above t0 raises its threshold. "inline": inside
      stage 1 (a data-dependent loop that keeps the whole chunk live in registers across it, in
      every program). "fixup": stage 1 only flags such chunks (writing no candidates for them), and
      a second kernel, one program per row, redoes the flagged chunks with the bisection; stage 1
      then holds no loop. Both give the same candidates.
    pack_bf16: bfloat16 logits keep one int32 per candidate, the key's high half (all of a bf16
      key's information) over 0xFFFF - the column's offset in the chunk: keys become distinct and
      their order is (logit descending, column ascending), so stage 1 needs no tie handling and
      one scatter store instead of two (module docstring, "Packed bfloat16 keys").
    stage2: "rounds": k rounds of argmax over the row's candidates (k block reductions). "filter":
      the stage-1 selection once more over the row's candidates (one group-maximum threshold, a
      count, a scan: a few block reductions) down to next_pow2(2k) of them, then jax.lax.top_k
      over those [rows, next_pow2(2k)] in XLA (module docstring, "Stage 2"). None: "filter" where
      a row has at most 2**15 candidates (its packed counts), else "rounds". On the H200 (1024 x
      248,320, 2026-12-01) the filter took 0.84x the rounds' time at k = 64 and 0.94-0.99x at k = 20.
    """
    chunk: int | None = None
    groups: int | None = None
    slots: int | None = None
    num_warps: int | None = None
    stage2_warps: int | None = None
    bisection: str = "inline"
    pack_bf16: bool = True
    stage2: str | None = None

    def __post_init__(self):
        if self.bisection not in ("inline", "fixup"):
            raise ValueError(f"TopKConfig.bisection={self.bisection!r}: must be 'inline' or 'fixup'")
        if self.stage2 not in (None, "rounds", "filter"):
            raise ValueError(f"TopKConfig.stage2={self.stage2!r}: must be 'rounds', 'filter' or None")
        if self.chunk is not None and not (is_pow2(self.chunk) and 64 <= self.chunk <= MAX_CHUNK):
            raise ValueError(f"TopKConfig.chunk={self.chunk!r}: must be a power of two in [64, {MAX_CHUNK}]")
        if self.groups is not None and not (is_pow2(self.groups) and 2 <= self.groups <= 256):
            raise ValueError(f"TopKConfig.groups={self.groups!r}: must be a power of two in [2, 256]")
        if self.slots is not None and not (is_pow2(self.slots) and 16 <= self.slots <= 1024):
            raise ValueError(f"TopKConfig.slots={self.slots!r}: must be a power of two in [16, 1024]")
        for name in ("num_warps", "stage2_warps"):
            v = getattr(self, name)
            if v is not None and v not in (1, 2, 4, 8, 16):
                raise ValueError(f"TopKConfig.{name}={v!r}: must be one of 1, 2, 4, 8, 16")

    def resolve(self, rows: int, vocab: int, k: int) -> dict:
        """The launch plan of a call: chunk, groups, slots, num_chunks, candidates, warps."""
        slots = self.slots or max(16, next_pow2(2 * k))
        if slots < k:
            raise ValueError(f"TopKConfig.slots={slots}: must be >= k={k}")
        chunk = self.chunk
        if chunk is None:
            chunk = 4096
            while chunk > 2048 and rows * pl.cdiv(vocab, chunk) < _TARGET_PROGRAMS:
                chunk //= 2
            while chunk < MAX_CHUNK and pl.cdiv(vocab, chunk) * min(slots, chunk) > MAX_CANDIDATES:
                chunk *= 2
        chunk = min(chunk, max(16, next_pow2(vocab)))
        slots = min(slots, chunk)                     # slots == chunk: every column is a candidate
        groups = min(self.groups or min(128, max(32, next_pow2(2 * k))), chunk)
        num_chunks = pl.cdiv(vocab, chunk)
        candidates = num_chunks * slots
        stage2_block = max(16, next_pow2(candidates))
        return dict(chunk=chunk, groups=groups, slots=slots, num_chunks=num_chunks,
                    candidates=candidates, stage2_block=stage2_block, bisection=self.bisection,
                    pack_bf16=self.pack_bf16, stage2=self.stage2 or ("filter" if stage2_block <= 2**15 else "rounds"),
                    num_warps=self.num_warps or 4,
                    stage2_warps=self.stage2_warps or (16 if stage2_block > 8192 else 8))


@dataclasses.dataclass(frozen=True)
class ArgmaxConfig:
    """Tile sizes of the greedy argmax.

    block: columns per loop step (power of two, 128..16384); None: 16 bytes x 4 per thread per step
      (2048 fp32 / 4096 bf16 at 4 warps), clipped to next_pow2(vocab).
    splits: programs per row (>= 1); None: 1 when rows >= 528, else enough to give ~528 programs
      (each split still >= 4 blocks long).
    num_warps: 1..16, power of two; None: 4.
    """
    block: int | None = None
    splits: int | None = None
    num_warps: int | None = None

    def __post_init__(self):
        if self.block is not None and not (is_pow2(self.block) and 128 <= self.block <= 16384):
            raise ValueError(f"ArgmaxConfig.block={self.block!r}: must be a power of two in [128, 16384]")
        if self.splits is not None and not (isinstance(self.splits, int) and self.splits >= 1):
            raise ValueError(f"ArgmaxConfig.splits={self.splits!r}: must be a positive integer")
        if self.num_warps is not None and self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"ArgmaxConfig.num_warps={self.num_warps!r}: must be one of 1, 2, 4, 8, 16")

    def resolve(self, rows: int, vocab: int, itemsize: int) -> dict:
        num_warps = self.num_warps or 4
        block = self.block or (num_warps * 32 * 4 * 16 // itemsize)
        block = min(block, max(128, next_pow2(vocab)))
        blocks = pl.cdiv(vocab, block)
        splits = self.splits
        if splits is None:
            splits = 1 if rows >= _TARGET_PROGRAMS else max(1, min(pl.cdiv(_TARGET_PROGRAMS, rows), blocks // 4))
        splits = min(splits, blocks)
        steps = pl.cdiv(blocks, splits)               # loop steps per program
        splits = pl.cdiv(blocks, steps)               # no empty split
        return dict(block=block, splits=splits, steps=steps, num_warps=num_warps)


# ------------------------------------------------------------------------------ supports


def _rows_vocab(logits):
    shape = tuple(logits.shape)
    vocab = shape[-1]
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return rows, vocab


def top_k_rows_vocab(logits, k):
    """(rows, vocab) of a top-k call every top-k kernel takes in principle: [..., vocab] fp32/bf16
    with at least one row and an int k in 1..min(64, vocab); None for any other (or a non-array)."""
    try:
        if logits.ndim < 1 or jnp.dtype(logits.dtype) not in _DTYPES:
            return None
        if not isinstance(k, int) or isinstance(k, bool):
            return None
        rows, vocab = _rows_vocab(logits)
    except (AttributeError, TypeError):
        return None
    return (rows, vocab) if rows >= 1 and 1 <= k <= min(MAX_K, vocab) else None


def supports_top_k(logits, k) -> bool:
    """Shapes and dtypes the top-k kernel covers: [..., vocab] fp32/bf16, 1 <= k <= min(64, vocab)."""
    shape = top_k_rows_vocab(logits, k)
    if shape is None or shape[1] >= 2**31 - MAX_CHUNK:
        return False
    return TopKConfig().resolve(*shape, k)["candidates"] <= MAX_CANDIDATES


def supports_argmax(logits) -> bool:
    """[..., vocab] fp32/bf16 with at least one row and one column."""
    try:
        if logits.ndim < 1 or jnp.dtype(logits.dtype) not in _DTYPES:
            return False
        rows, vocab = _rows_vocab(logits)
        return rows >= 1 and 1 <= vocab < 2**31 - 2**16
    except (AttributeError, TypeError):
        return False


# ------------------------------------------------------------------------------ top-k kernels


def _ceil_avg(lo, hi):
    """ceil((lo + hi) / 2) in int32 without overflow (arithmetic shift)."""
    return (lo | hi) - ((lo ^ hi) >> 1)


def _select(key, inb, *, k, groups, slots, bisect, distinct, strided=False):
    """Steps 1-4 over one register-resident vector of keys [n] (SENTINEL where not inb): which keys
    are candidates and their slots in column order.

    -> (sel [n] bool, pos [n] int32: the slot of each selected key, n_sel, overflow). distinct:
    packed keys (no ties: {key >= t}); else keys > t plus the first ties at t. bisect=False: when
    more than `slots` keys lie above t0, nothing is selected and overflow is set. strided: group g
    is keys g, g + G, g + 2G, ... (stage 2, where each chunk's real candidates come first in its
    slots, so contiguous groups of empty slots would give too few real maxima)."""
    n_keys = key.shape[0]
    # 1. threshold: the k-th largest of the G group maxima, by counting (no serial rounds).
    if strided:
        gmax = jnp.max(key.reshape(n_keys // groups, groups), axis=0)             # [G]
    else:
        gmax = jnp.max(key.reshape(groups, n_keys // groups), axis=1)             # [G]
    cnt = jnp.sum((gmax[None, :] >= gmax[:, None]).astype(jnp.int32), axis=1)      # #{h: m_h >= m_g}
    t0 = jnp.max(jnp.where(cnt >= k, gmax, _i32(SENTINEL)))
    top = jnp.max(gmax)
    if distinct:
        return _select_distinct(key, t0, top, k=k, slots=slots, bisect=bisect)

    def counts(t):
        packed = (key > t).astype(jnp.int32) | (((key == t) & inb).astype(jnp.int32) << 16)
        s = jnp.sum(packed)
        return s & _i32(0xFFFF), s >> 16                                           # n_gt, n_eq

    # 2./3. raise t by bisection while more than `slots` keys are strictly above it.
    def cond(state):
        _, _, _, n_gt, _, it = state
        return (n_gt > slots) & (it < 40)          # ends by 33 steps (proof in the docstring)

    def body(state):
        lo, hi, t, n_gt, n_eq, it = state
        mid = _ceil_avg(lo, hi)                    # lo < hi here: mid in (lo, hi]
        m_gt, m_eq = counts(mid)
        ok = m_gt + m_eq >= k                      # #{key >= mid} >= k: mid is a valid threshold
        return (jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1), jnp.where(ok, mid, t),
                jnp.where(ok, m_gt, n_gt), jnp.where(ok, m_eq, n_eq), it + 1)

    t, (n_gt, n_eq) = t0, counts(t0)
    if bisect:
        _, _, t, n_gt, n_eq, _ = lax.while_loop(cond, body, (t0, top, t0, n_gt, n_eq, _i32(0)))
    overflow = n_gt > slots                        # only without the bisection

    # 4. compaction in column order: keys > t, then the first `cap` ties, by one packed scan.
    cap = slots - n_gt
    gt = key > t
    eq = (key == t) & inb
    scan = jnp.cumsum(gt.astype(jnp.int32) | (eq.astype(jnp.int32) << 16))
    ties_before = jnp.minimum(scan >> 16, cap)
    sel = (gt | (eq & ((scan >> 16) <= cap))) & ~overflow
    pos = jnp.where(sel, (scan & _i32(0xFFFF)) + ties_before - 1, _i32(slots))     # slots: masked off
    return sel, pos, n_gt + jnp.minimum(n_eq, cap), overflow


def _distinct_threshold(keys, t0, top, *, k, slots, bisect):
    """The threshold of distinct keys (a tuple of vectors, counted together): t >= KEY_FLOOR with
    k <= #{keys >= t} <= slots when bisect (else t0's count may exceed slots) -> (t, #{keys >= t})."""
    def count(t):
        return functools.reduce(jnp.add, [jnp.sum((kv >= t).astype(jnp.int32)) for kv in keys])

    def cond(state):
        _, _, _, n, it = state
        return (n > slots) & (it < 40)             # ends by 34 steps: at lo == hi, n == k

    def body(state):
        lo, hi, t, n, it = state
        # The first step splits at the least key of a larger logit than t's (band_top + 1): the
        # cut is then either above it or among the ties of t's logit (long runs of equal logits,
        # e.g. a masked vocabulary's -inf), where 16 steps over the low half find it, not 32.
        band_top = lo | _i32(0xFFFF)
        mid = jnp.where((it == 0) & (band_top < hi), band_top + 1, _ceil_avg(lo, hi))
        m = count(mid)
        ok = m >= k                                # #{key >= mid} >= k: mid is a valid threshold
        return (jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1), jnp.where(ok, mid, t),
                jnp.where(ok, m, n), it + 1)

    t = jnp.maximum(t0, _i32(KEY_FLOOR))           # a tail chunk with < k real groups: every real key
    n = count(t)
    if bisect:
        _, _, t, n, _ = lax.while_loop(cond, body, (t, top, t, n, _i32(0)))
    return t, n


def _select_distinct(key, t0, top, *, k, slots, bisect):
    """The packed-key form of steps 2-4: keys are distinct, so the candidates are {key >= t} with
    k <= #{key >= t} <= slots, in column order (no ties to cap)."""
    t, n = _distinct_threshold((key,), t0, top, k=k, slots=slots, bisect=bisect)
    overflow = n > slots
    sel = (key >= t) & ~overflow
    pos = jnp.where(sel, jnp.cumsum(sel.astype(jnp.int32)) - 1, _i32(slots))
    return sel, pos, n, overflow


def _store_candidates(key_ref, col_ref, at, key, cols, sel, pos, n_sel, overflow, slots):
    """Scatter the selected (key, column) to their slots of key_ref / col_ref at index prefix `at`
    (col_ref None: keys only) and SENTINEL / 0 into the slots >= n_sel; nothing on overflow."""
    plgpu.store(key_ref.at[(*at, pos)], key, mask=sel)
    if col_ref is not None:
        plgpu.store(col_ref.at[(*at, pos)], cols, mask=sel)
    empty = (jnp.arange(slots, dtype=jnp.int32) >= n_sel) & ~overflow
    plgpu.store(key_ref.at[(*at, pl.ds(0, slots))], jnp.full((slots,), SENTINEL, jnp.int32), mask=empty)
    if col_ref is not None:
        plgpu.store(col_ref.at[(*at, pl.ds(0, slots))], jnp.zeros((slots,), jnp.int32), mask=empty)


def _chunk_candidates(x_ref, key_ref, col_ref, r, c, *, vocab, k, chunk, groups, slots, bisect):
    """Write `slots` candidates (key, column) of chunk c of row r, a superset of its top-k
    (col_ref None: packed bf16 keys, which carry the column).

    bisect=False: a chunk with more than `slots` keys above t0 writes no candidates (its slots keep
    what they held); returns whether that happened (the chunk needs the bisection)."""
    c0 = c * chunk
    local = jnp.arange(chunk, dtype=jnp.int32)
    cols = c0 + local
    inb = cols < vocab
    x = plgpu.load(x_ref.at[r, pl.ds(c0, chunk)], mask=inb, other=0)
    key = jnp.maximum(sort_key(x), _i32(KEY_FLOOR))
    if col_ref is None:                        # packed bf16 keys: distinct, (logit desc, column asc)
        key = (key & _i32(_HIGH_HALF)) | (_i32(0xFFFF) - local)
    key = jnp.where(inb, key, _i32(SENTINEL))

    if slots >= chunk:
        # Small vocabulary: every column is a candidate (out-of-range ones carry SENTINEL).
        plgpu.store(key_ref.at[r, c, pl.ds(0, slots)], key)
        if col_ref is not None:
            plgpu.store(col_ref.at[r, c, pl.ds(0, slots)], cols)
        return jnp.bool_(False)
    sel, pos, n_sel, overflow = _select(key, inb, k=k, groups=groups, slots=slots, bisect=bisect,
                                        distinct=col_ref is None)
    _store_candidates(key_ref, col_ref, (r, c), key, cols, sel, pos, n_sel, overflow, slots)
    return overflow


def unpack_candidates(keys, chunk):
    """Packed bf16 candidates [rows, num_chunks, slots] -> (sort keys, columns), as the unpacked
    path writes them; reserved values (SENTINEL, and INT_MIN in a poisoned slot nobody wrote)
    are kept, with column -1."""
    real = keys >= KEY_FLOOR
    sort = (keys & _HIGH_HALF) | jnp.where(keys < 0, 0xFFFF, 0)
    chunk_ids = jnp.arange(keys.shape[1], dtype=jnp.int32)[None, :, None]
    cols = chunk_ids * chunk + (0xFFFF - (keys & 0xFFFF))
    return jnp.where(real, sort, keys), jnp.where(real, cols, -1)


def _stage1_kernel(x_ref, *refs, bisect, packed, **geometry):
    """One (row, chunk): its candidates; with bisect=False also its overflow flag. Outputs (the
    last refs; before them, poisoned buffers aliased to them in tests): keys, columns unless
    packed, the flags unless bisect."""
    outs = list(refs[-(1 + (not packed) + (not bisect)):])
    key_ref = outs.pop(0)
    col_ref = None if packed else outs.pop(0)
    r, c = pl.program_id(0), pl.program_id(1)
    overflow = _chunk_candidates(x_ref, key_ref, col_ref, r, c, bisect=bisect, **geometry)
    if not bisect:
        outs[0][...] = jnp.full((1, 1), overflow, jnp.int32)


def _fixup_kernel(x_ref, flag_ref, *refs, packed, num_chunks, flags_pad, **geometry):
    """One row: redo its flagged chunks with the bisection (the outputs alias stage 1's buffers,
    which come first in refs)."""
    key_ref, col_ref = (refs[-1], None) if packed else refs[-2:]
    r = pl.program_id(0)
    ids = jnp.arange(flags_pad, dtype=jnp.int32)
    flags = plgpu.load(flag_ref.at[r, pl.ds(0, flags_pad)], mask=ids < num_chunks, other=0)

    def chunk(c, carry):
        @pl.when(jnp.sum(jnp.where(ids == c, flags, 0)) > 0)
        def _redo():
            _chunk_candidates(x_ref, key_ref, col_ref, r, c, bisect=True, **geometry)
        return carry

    lax.fori_loop(0, num_chunks, chunk, 0)


def _repack(keys, pos, fill):
    """Packed stage-1 keys -> keys ordered across chunks: the high half over 0xFFFF - position
    (positions follow the columns); reserved values (< KEY_FLOOR) become `fill`."""
    return jnp.where(keys >= _i32(KEY_FLOOR), (keys & _i32(_HIGH_HALF)) | (_i32(0xFFFF) - pos), _i32(fill))


def _packed_column(pos, keys, slots, chunk):
    """The logit column of the packed stage-1 key `keys` at candidate position `pos`."""
    return (pos // slots) * chunk + (_i32(0xFFFF) - (keys & _i32(0xFFFF)))


def _stage2_kernel(x_ref, key_ref, *refs, k, candidates, block, k_block, packed, slots, chunk):
    """One row: the k largest candidates in lax.top_k order, then their logits. Packed keys carry
    the column: chunk = position // slots, offset = 0xFFFF - low half; their low half orders ties
    inside a chunk only, so here it is replaced by 0xFFFF - position (positions increase with the
    column; block <= 2**15, `top_k` checks, keeps them above REMOVED): distinct keys in (logit desc,
    column asc) order."""
    val_ref, idx_ref = refs[-2:]
    r = pl.program_id(0)
    pos = jnp.arange(block, dtype=jnp.int32)
    keys = plgpu.load(key_ref.at[r, pl.ds(0, block)], mask=pos < candidates, other=REMOVED)
    if packed:
        keys = _repack(keys, pos, REMOVED)
    j = jnp.arange(k_block, dtype=jnp.int32)

    def round_(i, carry):
        keys, picked = carry
        p = jnp.argmax(keys).astype(jnp.int32)         # max key, lowest position (= column) on ties
        return jnp.where(pos == p, _i32(REMOVED), keys), jnp.where(j == i, p, picked)

    _, picked = lax.fori_loop(0, k, round_, (keys, jnp.zeros((k_block,), jnp.int32)))
    live = j < k
    if packed:
        cols = _packed_column(picked, plgpu.load(key_ref.at[r, picked], mask=live, other=0), slots, chunk)
    else:
        cols = plgpu.load(refs[0].at[r, picked], mask=live, other=0)
    cols = jnp.where(live, cols, 0)
    vals = plgpu.load(x_ref.at[r, cols], mask=live, other=0)
    plgpu.store(val_ref.at[r, pl.ds(0, k_block)], vals, mask=live)
    plgpu.store(idx_ref.at[r, pl.ds(0, k_block)], cols, mask=live)


def _stage2_filter_kernel(x_ref, key_ref, *refs, k, candidates, block, groups, keep, packed, slots, chunk):
    """One row: the stage-1 selection over its candidates, down to `keep` (key, column) pairs in
    column order (a superset of the row's top-k; XLA's lax.top_k orders them). Packed keys are
    re-packed with 0xFFFF - position, as in `_stage2_kernel`."""
    out_key_ref, out_col_ref = refs[-2:]
    r = pl.program_id(0)
    pos = jnp.arange(block, dtype=jnp.int32)
    keys = plgpu.load(key_ref.at[r, pl.ds(0, block)], mask=pos < candidates, other=SENTINEL)
    if packed:
        cols = _packed_column(pos, keys, slots, chunk)
        keys = _repack(keys, pos, SENTINEL)
    else:
        cols = plgpu.load(refs[0].at[r, pl.ds(0, block)], mask=pos < candidates, other=0)
    if keep >= block:
        plgpu.store(out_key_ref.at[r, pl.ds(0, block)], keys)
        plgpu.store(out_col_ref.at[r, pl.ds(0, block)], cols)
        return
    real = keys >= _i32(KEY_FLOOR)
    sel, spos, n_sel, overflow = _select(keys, real, k=k, groups=groups, slots=keep, bisect=True, distinct=packed,
                                         strided=True)
    _store_candidates(out_key_ref, out_col_ref, (r,), keys, cols, sel, spos, n_sel, overflow, keep)


def _poisoned(shape, dtype):
    """A buffer of NaN (floats) or INT_MIN (ints): an element a kernel fails to write stays so."""
    fill = jnp.nan if jnp.issubdtype(dtype, jnp.floating) else jnp.iinfo(dtype).min
    return jnp.full(shape, fill, dtype)


def _outputs(shapes, poison, first_input):
    """(out_shape, extra inputs, input_output_aliases) for outputs optionally aliased to poison."""
    out_shape = tuple(jax.ShapeDtypeStruct(s, d) for s, d in shapes)
    if not poison:
        return out_shape, (), {}
    extra = tuple(_poisoned(s, d) for s, d in shapes)
    return out_shape, extra, {first_input + i: i for i in range(len(shapes))}


def packs_keys(x, plan) -> bool:
    """Whether stage 1 writes packed keys (bfloat16 logits, TopKConfig.pack_bf16)."""
    return plan["pack_bf16"] and jnp.dtype(x.dtype) == jnp.dtype(jnp.bfloat16)


def top_k_candidates(x, k, plan, *, interpret, poison_outputs=False):
    """Stage 1 alone: x [rows, vocab] -> (keys, columns) [rows, num_chunks, slots] int32; packed
    keys (`packs_keys`) come with columns None (`unpack_candidates` recovers both)."""
    rows, vocab = x.shape
    chunk, slots, nch = plan["chunk"], plan["slots"], plan["num_chunks"]
    packed = packs_keys(x, plan)
    geometry = dict(vocab=vocab, k=k, chunk=chunk, groups=plan["groups"], slots=slots)
    inline = plan["bisection"] == "inline"
    shapes = [((rows, nch, slots), jnp.int32)] * (1 if packed else 2)
    out_shape, extra, aliases = _outputs(shapes, poison_outputs, 1)
    specs = {}
    if not inline:       # + the overflow flags [rows, nch], one element a program
        out_shape += (jax.ShapeDtypeStruct((rows, nch), jnp.int32),)
        specs = dict(out_specs=(pl.no_block_spec,) * len(shapes) + (pl.BlockSpec((1, 1), lambda r, c: (r, c)),))
    outs = pl.pallas_call(
        functools.partial(_stage1_kernel, bisect=inline, packed=packed, **geometry),
        out_shape=out_shape,
        **specs,
        grid=(rows, nch),
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=plan["num_warps"], num_stages=1),
        interpret=interpret,
        name="topk_stage1",
    )(x, *extra)
    if not inline:
        *cands, flags = outs
        outs = pl.pallas_call(
            functools.partial(_fixup_kernel, packed=packed, num_chunks=nch, flags_pad=max(16, next_pow2(nch)),
                              **geometry),
            out_shape=tuple(jax.ShapeDtypeStruct(s, d) for s, d in shapes),
            grid=(rows,),
            input_output_aliases={2 + i: i for i in range(len(shapes))},
            compiler_params=plgpu.CompilerParams(num_warps=plan["num_warps"], num_stages=1),
            interpret=interpret,
            name="topk_stage1_fixup",
        )(x, flags, *cands)
    return (outs[0], None) if packed else tuple(outs)


def top_k_select(x, cand_key, cand_col, k, plan, *, interpret, poison_outputs=False):
    """Stage 2 alone: the top-k of the candidates -> (values [rows, k] x.dtype, indices [rows, k]).
    cand_col None: packed keys (`top_k_candidates`)."""
    rows = x.shape[0]
    n = plan["candidates"]
    packed = cand_col is None
    cand = (cand_key.reshape(rows, n),) + (() if packed else (cand_col.reshape(rows, n),))
    block = plan["stage2_block"]
    geometry = dict(k=k, candidates=n, block=block, packed=packed, slots=plan["slots"], chunk=plan["chunk"])

    def per_row(kernel, shapes, name):                  # one program a row, outputs `shapes`
        out_shape, extra, aliases = _outputs(shapes, poison_outputs, 1 + len(cand))
        return pl.pallas_call(
            kernel, out_shape=out_shape, grid=(rows,), input_output_aliases=aliases,
            compiler_params=plgpu.CompilerParams(num_warps=plan["stage2_warps"], num_stages=1),
            interpret=interpret, name=name,
        )(x, *cand, *extra)

    if plan["stage2"] == "filter":
        keep = min(max(16, next_pow2(2 * k)), block)
        keys, cols = per_row(functools.partial(_stage2_filter_kernel, groups=min(128, block), keep=keep, **geometry),
                             [((rows, keep), jnp.int32)] * 2, "topk_stage2_filter")
        _, order = lax.top_k(keys, k)           # equal keys: the lower position, i.e. column, first
        idx = jnp.take_along_axis(cols, order, axis=1)
        return jnp.take_along_axis(x, idx, axis=1), idx
    return per_row(functools.partial(_stage2_kernel, k_block=max(16, next_pow2(k)), **geometry),
                   [((rows, k), x.dtype), ((rows, k), jnp.int32)], "topk_stage2")


def top_k(logits, k, *, config: TopKConfig | None = None, interpret: bool | None = None,
          candidates_out: bool = False, poison_outputs: bool = False):
    """Values and indices of the k largest logits per row, in jax.lax.top_k's order.

    logits [..., vocab] float32 / bfloat16; k static, 1 <= k <= min(64, vocab).
    -> (values [..., k] logits.dtype, indices [..., k] int32), descending, ties: lower index first.
    candidates_out: also return stage 1's (keys, columns) [rows, num_chunks, slots] (tests).
    poison_outputs: write into NaN / INT_MIN filled buffers (input_output_aliases), so that an
      element a kernel does not write shows (tests; interpret mode poisons outputs anyway).
    """
    if not supports_top_k(logits, k):
        raise ValueError(f"top_k kernel: unsupported logits {getattr(logits, 'shape', None)} "
                         f"{getattr(logits, 'dtype', None)} with k={k!r} (fp32/bf16, 1 <= k <= min(64, vocab))")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    lead = logits.shape[:-1]
    rows, vocab = _rows_vocab(logits)
    x = logits.reshape(rows, vocab)
    plan = (config or TopKConfig()).resolve(rows, vocab, k)
    if (packs_keys(x, plan) or plan["stage2"] == "filter") and plan["stage2_block"] > 2**15:
        raise ValueError(f"top_k kernel: config {config} gives {plan['candidates']} candidates a row "
                         f"(cdiv(vocab, chunk) * slots); packed bf16 keys (pack_bf16) and the filter's "
                         f"packed counts (stage2='filter') take at most 2**15: use a larger chunk")
    cand_key, cand_col = top_k_candidates(x, k, plan, interpret=interpret, poison_outputs=poison_outputs)
    vals, idx = top_k_select(x, cand_key, cand_col, k, plan, interpret=interpret, poison_outputs=poison_outputs)
    out = vals.reshape(*lead, k), idx.reshape(*lead, k)
    if candidates_out:
        return out + ((cand_key, cand_col) if cand_col is not None else unpack_candidates(cand_key, plan["chunk"]))
    return out


# ------------------------------------------------------------------------------ greedy argmax


def _argmax_kernel(x_ref, *refs, vocab, block, steps):
    key_ref, col_ref = refs[-2:]
    r = pl.program_id(0)
    s = pl.program_id(1)
    start = s * (steps * block)
    lanes = jnp.arange(block, dtype=jnp.int32)

    def step(i, carry):
        best_key, best_col = carry
        c0 = start + i * block
        cols = c0 + lanes
        inb = cols < vocab
        x = plgpu.load(x_ref.at[r, pl.ds(c0, block)], mask=inb, other=0)
        key = jnp.where(inb, argmax_key(x), _i32(REMOVED))
        better = key > best_key                      # strict: a lane keeps its first column of a tie
        return jnp.where(better, key, best_key), jnp.where(better, cols, best_col)

    init = (jnp.full((block,), REMOVED, jnp.int32), jnp.full((block,), _I32_MAX, jnp.int32))
    best_key, best_col = lax.fori_loop(0, steps, step, init)
    top = jnp.max(best_key)
    col = jnp.min(jnp.where(best_key == top, best_col, _i32(_I32_MAX)))
    plgpu.store(key_ref.at[r, pl.ds(s, 1)], jnp.full((1,), top, jnp.int32))
    plgpu.store(col_ref.at[r, pl.ds(s, 1)], jnp.full((1,), col, jnp.int32))


def argmax(logits, *, config: ArgmaxConfig | None = None, interpret: bool | None = None,
           partials_out: bool = False, poison_outputs: bool = False):
    """logits [..., vocab] float32 / bfloat16 -> argmax [...] int32, jnp.argmax's result (the
    lowest index on ties, the first NaN if any).

    partials_out: also return the per-split (keys, columns) [rows, splits] (tests).
    poison_outputs: the kernel writes into INT_MIN filled buffers (tests).
    """
    if not supports_argmax(logits):
        raise ValueError(f"argmax kernel: unsupported logits {getattr(logits, 'shape', None)} "
                         f"{getattr(logits, 'dtype', None)} (fp32/bf16, at least one row and column)")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    lead = logits.shape[:-1]
    rows, vocab = _rows_vocab(logits)
    x = logits.reshape(rows, vocab)
    plan = (config or ArgmaxConfig()).resolve(rows, vocab, jnp.dtype(x.dtype).itemsize)
    splits = plan["splits"]
    out_shape, extra, aliases = _outputs([((rows, splits), jnp.int32)] * 2, poison_outputs, 1)
    keys, cols = pl.pallas_call(
        functools.partial(_argmax_kernel, vocab=vocab, block=plan["block"], steps=plan["steps"]),
        out_shape=out_shape,
        grid=(rows, splits),
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=plan["num_warps"], num_stages=2),
        interpret=interpret,
        name="greedy_argmax",
    )(x, *extra)
    if splits == 1:
        out = cols[:, 0]
    else:       # splits are in column order: the first split holding the max key wins ties
        out = jnp.take_along_axis(cols, jnp.argmax(keys, axis=1)[:, None], axis=1)[:, 0]
    if partials_out:
        return out.reshape(lead), keys, cols
    return out.reshape(lead)
