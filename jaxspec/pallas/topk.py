"""Top-k over the vocabulary axis: chunk maxima in one read, then a small exact selection (Pallas, Triton).

Contract: `jaxspec.ops.sampling.top_k`, whose reference is `jax.lax.top_k`: logits [..., vocab]
bfloat16 / float32, k static in 1..min(64, vocab) -> (values [..., k] logits.dtype, indices [..., k]
int32), key descending in the IEEE total order (-NaN < -inf < ... < -0.0 < +0.0 < ... < +inf < +NaN),
ties: the lower column first. Values are gathered from the logits by index, so they are bit-exact.

Layouts (rows = the product of the leading dims):
1. `chunk_maxima`, grid (rows, programs a row), one read of the logits: the largest key of every
   chunk of `chunk` contiguous columns and of every block of `group` chunks:
       cm [rows, num_blocks * group]  int16 keys for bfloat16, int32 for float32
       bm [rows, num_blocks]          int32
2. `select_top_k`, one program a row: three exact selections of min(k, n) out of n keys, each
   {key > t} plus the first ties at t in index order, t the k-th largest key (bisection from a
   lower bound the step before provides): the top-k blocks by (bm desc, block asc); the top-k
   chunks of those blocks; the top-k logits of those chunks' columns (a gather of k chunks, one
   32-byte DRAM sector each for bfloat16); then the k ordered by rank.

Exact by construction, ties included: cut a row into contiguous parts and order the parts by
(max desc, index asc); the row's top-k lies in the first k parts. (Let t be the k-th largest key.
A key > t lies in a part whose max > t, and fewer than k parts have one. A key == t that the
top-k takes is one of the first r = k - #{key > t} ties in column order; were its part not among
the first k, at least k - #{parts with max > t} >= r parts with max == t would precede it, each
holding a tie at a lower column.) Blocks are parts of the row, chunks parts of the chosen blocks,
so ties and masked rows cost what Gaussian rows cost.

Keys: `sort_key` maps a logit to an int32 whose signed order is the IEEE total order (the float32
bits with the magnitude flipped for negative numbers). bfloat16 keys are its high half, exact for
bfloat16 and held in int16; float32 keys are clamped to KEY_FLOOR, which ranks the one negative-NaN
bit pattern 0xffffffff with 0xfffffffe. Sentinels: INT_MIN (float32) and -2**15 (bfloat16, which the
negative NaN 0xffff shares) are the least keys, the maxima of columns past the vocabulary; the
selection excludes chunks, blocks and columns past it by index, so a tie with them is harmless.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxspec.pallas.hardware import NUM_SMS, default_interpret
from jaxspec.pallas.tiles import check_int_fields, check_pow2_fields, given_fields, next_pow2

MAX_K = 64  # the selection's [K, group] / [K, chunk] tiles live in registers
MAX_BLOCKS = 4096  # select_top_k holds a row's block maxima in registers
_TARGET_PROGRAMS = 4 * NUM_SMS  # about four stream programs an SM keep enough loads in flight
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
_I32 = jnp.int32
INT_MIN = -(2**31)
KEY_FLOOR = INT_MIN + 1  # the least float32 key of a logit: above the sentinel


def sort_key(x):
    """int32 key whose signed order is the IEEE total order of x (float32 / bfloat16)."""
    bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    return bits ^ ((bits >> 31) & _I32(0x7FFFFFFF))


def _rows_vocab(logits):
    rows = 1
    for d in logits.shape[:-1]:
        rows *= d
    return rows, logits.shape[-1]


def _ceil_avg(lo, hi):
    """ceil((lo + hi) / 2) in int32 without overflow (arithmetic shift)."""
    return (lo | hi) - ((lo ^ hi) >> 1)


def _outputs(shapes, poison, first_input):
    """(out_shape, extra inputs, input_output_aliases) of outputs that, with poison, are written into
    NaN (floats) / INT_MIN (ints) buffers aliased to them: an element a kernel fails to write shows."""
    out_shape = tuple(jax.ShapeDtypeStruct(s, d) for s, d in shapes)
    if not poison:
        return out_shape, (), {}
    extra = tuple(jnp.full(s, jnp.nan if jnp.issubdtype(d, jnp.floating) else jnp.iinfo(d).min, d) for s, d in shapes)
    return out_shape, extra, {first_input + i: i for i in range(len(shapes))}


def _sentinel(key16):
    """The least key, the maximum of columns past the vocabulary (int16's least for bfloat16 keys,
    INT_MIN for float32)."""
    return -(2**15) if key16 else INT_MIN


@dataclasses.dataclass(frozen=True)
class TopKConfig:
    """Tile sizes of the top-k (the defaults are the best of bench/topk_kernel.py's H200 sweep).

    chunk: columns of a chunk (power of two, 4..64). 16: a bfloat16 chunk is 32 bytes, one DRAM
      sector, so the selection's gather of k chunks moves k sectors a row.
    group: chunks of a block (power of two, 4..64); a row has cdiv(vocab, chunk * group) blocks
      (<= MAX_BLOCKS), whose maxima the selection holds in registers.
    blocks_per_step: blocks a stream step loads (power of two, 1..64): 16 x 16 x 16 = 4096 columns,
      8 KB of bfloat16 a program a step. A step ends in two small stores (its chunk and block
      maxima), each a layout change through shared memory with barriers: longer steps pay them less.
    unroll: steps loaded together before their maxima (1..16): bytes in flight against the DRAM
      latency, which one step at a time does not cover.
    steps: steps a stream program takes (>= 1); None: the most of <= 32768 columns, halved while
      rows * programs a row < 4 * NUM_SMS (too few programs to fill the SMs), then, at one step,
      the step halved likewise (down to one block).
    num_warps / select_warps: warps of a stream / selection program (1..16, power of two).
    """

    chunk: int = 16
    group: int = 16
    blocks_per_step: int = 16
    unroll: int = 2
    steps: int | None = None
    num_warps: int = 4
    select_warps: int = 2

    def __post_init__(self):
        check_pow2_fields(
            self,
            [
                ("chunk", 4, 64),
                ("group", 4, 64),
                ("blocks_per_step", 1, 64),
                ("num_warps", 1, 16),
                ("select_warps", 1, 16),
            ],
        )
        check_int_fields(self, [("unroll", 1, 16), *given_fields(self, (("steps", 1, None),))])

    def resolve(self, rows: int, vocab: int, k: int, dtype=jnp.bfloat16) -> dict:
        """The launch plan: block geometry, steps and programs of the stream, K (k's power of two)."""
        width = self.chunk * self.group
        num_blocks = pl.cdiv(vocab, width)
        if num_blocks > MAX_BLOCKS:
            raise ValueError(
                f"TopKConfig: vocab={vocab} makes {num_blocks} blocks of {width} columns, more "
                f"than {MAX_BLOCKS}: raise chunk or group"
            )
        step_blocks = min(self.blocks_per_step, next_pow2(num_blocks))
        total_steps = pl.cdiv(num_blocks, step_blocks)
        steps = self.steps
        if steps is None:
            steps = max(1, min(total_steps, 32768 // (step_blocks * width)))
            while steps > 1 and rows * pl.cdiv(total_steps, steps) < _TARGET_PROGRAMS:
                steps //= 2
            while steps == 1 and step_blocks > 1 and rows * pl.cdiv(num_blocks, step_blocks) < _TARGET_PROGRAMS:
                step_blocks //= 2  # few rows: programs of one shorter step
            total_steps = pl.cdiv(num_blocks, step_blocks)
        steps = min(steps, total_steps)
        return dict(
            chunk=self.chunk,
            group=self.group,
            width=width,
            num_blocks=num_blocks,
            blocks_pad=next_pow2(num_blocks),
            step_blocks=step_blocks,
            steps=steps,
            programs=pl.cdiv(total_steps, steps),
            unroll=min(self.unroll, steps),
            K=next_pow2(k),
            key16=jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16),
            num_warps=self.num_warps,
            select_warps=self.select_warps,
        )


def supports(logits, k, config: TopKConfig | None = None) -> bool:
    """Whether the kernel takes the call: [..., vocab] bfloat16 / float32 with at least one row, k a
    static int in 1..min(64, vocab), at most MAX_BLOCKS blocks of the config's (default: vocab <=
    2**20). False for anything else, a non-array included."""
    try:
        if logits.ndim < 1 or jnp.dtype(logits.dtype) not in _DTYPES:
            return False
        rows, vocab = _rows_vocab(logits)
    except (AttributeError, TypeError):
        return False
    if not isinstance(k, int) or isinstance(k, bool) or rows < 1 or not 1 <= k <= min(MAX_K, vocab):
        return False
    cfg = config or TopKConfig()
    return pl.cdiv(vocab, cfg.chunk * cfg.group) <= MAX_BLOCKS


def _keys(x, key16):
    """Logits -> int32 keys in the IEEE total order: bfloat16's 16-bit key (sort_key's high half,
    exact for bfloat16 values) or float32's full key (clamped to KEY_FLOOR)."""
    full = sort_key(x)
    return full >> 16 if key16 else jnp.maximum(full, _I32(KEY_FLOOR))


# ------------------------------------------------------------------------------ stream


def _chunk_keys(x, key16):
    """The largest key of each chunk, x [..., chunk] logits -> [...] int32 (as `_keys`), from the
    signed max and min of the raw bits: the key order is the bits' signed order on values with the
    sign bit clear and its reverse on the others, so a chunk's largest key is its largest bits when
    those are >= 0, else (all negative) the key of its smallest bits. Two max / min an element
    instead of the key's shift, and, xor and a max."""
    bits = lax.bitcast_convert_type(x, jnp.int16 if key16 else jnp.int32)
    hi = jnp.max(bits, axis=-1).astype(_I32)
    lo = jnp.min(bits, axis=-1).astype(_I32)
    key = jnp.where(hi >= 0, hi, lo ^ _I32(0x7FFF if key16 else 0x7FFFFFFF))
    return key if key16 else jnp.maximum(key, _I32(KEY_FLOOR))


def _maxima_kernel(x_ref, *refs, vocab, chunk, group, width, num_blocks, step_blocks, steps, unroll, key16):
    """Program (r, p): blocks [p * steps * step_blocks, ...) of row r, a step of step_blocks blocks
    at a time: [step_blocks, group, chunk] keys -> chunk maxima [step_blocks, group] -> block maxima."""
    cm_ref, bm_ref = refs[-2:]  # (the poisoned buffers they alias come first)
    r, p = pl.program_id(0), pl.program_id(1)
    first = p * (steps * step_blocks)
    n_cols = step_blocks * width
    blk = jnp.arange(step_blocks, dtype=_I32)
    within = jnp.arange(group, dtype=_I32)[None, :]
    sentinel = _I32(_sentinel(key16))
    cm_dtype = jnp.int16 if key16 else jnp.int32

    def load(i, masked):
        start = (first + i * step_blocks) * width
        if not masked:
            return plgpu.load(x_ref.at[r, pl.ds(start, n_cols)])
        inb = start + jnp.arange(n_cols, dtype=_I32) < vocab
        x = plgpu.load(x_ref.at[r, pl.ds(start, n_cols)], mask=inb, other=0)
        return jnp.where(inb, _keys(x, key16), sentinel)

    def store(i, loaded, masked):
        b0 = first + i * step_blocks
        if masked:
            cmax = jnp.max(loaded.reshape(step_blocks, group, chunk), axis=2)  # [B, G]
        else:
            cmax = _chunk_keys(loaded.reshape(step_blocks, group, chunk), key16)
        bmax = jnp.max(cmax, axis=1)  # [B]
        chunk_ids = (b0 + blk)[:, None] * group + within  # [B, G]
        ok = b0 + blk < num_blocks if masked else None
        plgpu.store(cm_ref.at[r, chunk_ids], cmax.astype(cm_dtype), mask=None if ok is None else ok[:, None])
        plgpu.store(bm_ref.at[r, b0 + blk], bmax, mask=ok)

    full_blocks = vocab // width
    n_full = jnp.clip((full_blocks - first) // step_blocks, 0, steps)
    n_all = jnp.clip(pl.cdiv(num_blocks - first, step_blocks), 0, steps)

    def unrolled(b, carry):
        keys = [load(b * unroll + j, False) for j in range(unroll)]
        for j, key in enumerate(keys):
            store(b * unroll + j, key, False)
        return carry

    lax.fori_loop(0, n_full // unroll, unrolled, 0)
    lax.fori_loop((n_full // unroll) * unroll, n_full, lambda i, c: (store(i, load(i, False), False), c)[1], 0)
    lax.fori_loop(n_full, n_all, lambda i, c: (store(i, load(i, True), True), c)[1], 0)


def chunk_maxima(x, plan, *, interpret, poison_outputs=False):
    """x [rows, vocab] bf16 / f32 -> (cm [rows, num_blocks * group] int16 (bf16) / int32 (f32): each
    chunk's largest key, SENTINEL for chunks past the vocabulary; bm [rows, num_blocks] int32: each
    block's). poison_outputs: written into INT_MIN-filled buffers (unwritten entries show)."""
    rows, vocab = x.shape
    key16 = plan["key16"]
    shapes = [
        ((rows, plan["num_blocks"] * plan["group"]), jnp.int16 if key16 else jnp.int32),
        ((rows, plan["num_blocks"]), jnp.int32),
    ]
    out_shape, extra, aliases = _outputs(shapes, poison_outputs, 1)
    return pl.pallas_call(
        functools.partial(
            _maxima_kernel,
            vocab=vocab,
            chunk=plan["chunk"],
            group=plan["group"],
            width=plan["width"],
            num_blocks=plan["num_blocks"],
            step_blocks=plan["step_blocks"],
            steps=plan["steps"],
            unroll=plan["unroll"],
            key16=key16,
        ),
        out_shape=out_shape,
        out_specs=(pl.no_block_spec, pl.no_block_spec),
        grid=(rows, plan["programs"]),
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=plan["num_warps"], num_stages=1),
        interpret=interpret,
        name="topk_chunk_maxima",
    )(x, *extra)


def chunk_maxima_reference(x, plan):
    """jnp form of `chunk_maxima` (same outputs, same dtypes)."""
    rows, vocab = x.shape
    key16, nb, group, chunk = plan["key16"], plan["num_blocks"], plan["group"], plan["chunk"]
    keys = jnp.full((rows, nb * plan["width"]), _sentinel(key16), _I32).at[:, :vocab].set(_keys(x, key16))
    cm = jnp.max(keys.reshape(rows, nb, group, chunk), axis=3)
    return cm.reshape(rows, nb * group).astype(jnp.int16 if key16 else jnp.int32), jnp.max(cm, axis=2)


# ------------------------------------------------------------------------------ selection


def _row_major_cumsum(m):
    """Inclusive cumsum of a 2-D int tile [n, m] in row-major order (a 1-D tile: plain cumsum)."""
    if m.ndim == 1:
        return jnp.cumsum(m)
    rows = jnp.sum(m, axis=1)
    return jnp.cumsum(m, axis=1) + (jnp.cumsum(rows) - rows)[:, None]


def _reduce_all(op, x):
    """op over every axis of a tile, one axis at a time (Pallas' Triton lowering of a multi-axis
    reduction gives the intermediate its input's sharding rank: an error for an H200 target)."""
    while x.ndim > 1:
        x = op(x, axis=x.ndim - 1)
    return op(x)


def _count(mask):
    return _reduce_all(jnp.sum, mask.astype(_I32))


def _select(keys, valid, k, lo):
    """Mask of the top want = min(k, #valid) keys of a tile (row-major index order breaks ties)
    and t, the want-th largest key. lo: a key with #{keys >= lo} >= want (INT_MIN: none known);
    the search starts at the larger of it and the least valid key (a bfloat16 key: <= 16 steps,
    not the 32 from INT_MIN). Bisection keeps #{keys >= lo} >= want > #{keys > hi}; then
    {key > t} and the first want - #{key > t} ties at t."""
    lo = jnp.maximum(lo, _reduce_all(jnp.min, jnp.where(valid, keys, _I32(2**31 - 1))))
    keys = jnp.where(valid, keys, _I32(INT_MIN))
    want = jnp.minimum(_I32(k), _count(valid))

    def cut(lohi):
        lo, hi = lohi
        mid = _ceil_avg(lo, hi)
        ok = _count(keys >= mid) >= want
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

    t, _ = lax.while_loop(lambda lohi: lohi[0] < lohi[1], cut, (lo, jnp.maximum(_reduce_all(jnp.max, keys), lo)))
    above = keys > t
    ties = valid & (keys == t)
    cap = want - _count(above)
    return above | (ties & (_row_major_cumsum(ties.astype(_I32)) <= cap)), t, want


def _compact(ids_ref, r, base, values, sel, K, interpret):
    """The selected values (row-major order) -> [K] (slot i: the i-th selected), through
    ids_ref[r, base:base + K]: a scatter, a CTA barrier, a load."""
    # unselected entries point past the buffer (3K): masked on the GPU, dropped in interpret mode,
    # where a masked store's repeated indices would otherwise collide with written ones
    pos = jnp.where(sel, base + _row_major_cumsum(sel.astype(_I32)) - 1, 3 * K)
    plgpu.store(ids_ref.at[r, pos], values, mask=sel)
    if not interpret:  # interpret mode runs a program's stores before its loads anyway
        plgpu.debug_barrier()
    return plgpu.load(ids_ref.at[r, pl.ds(base, K)])


def _select_kernel(x_ref, cm_ref, bm_ref, *refs, vocab, k, K, chunk, group, num_blocks, blocks_pad, key16, interpret):
    """Row r: top-k blocks -> top-k chunks of those -> top-k logits of those -> sorted by rank."""
    val_ref, idx_ref, ids_ref = refs[-3:]
    r = pl.program_id(0)
    num_chunks = pl.cdiv(vocab, chunk)
    slot = jnp.arange(K, dtype=_I32)
    compact = functools.partial(_compact, ids_ref, r, K=K, interpret=interpret)

    def lower_bound(t, want):  # the step before took k keys >= t, each a key of this step's tile
        return jnp.where(want == k, t, _I32(INT_MIN))

    blocks = jnp.arange(blocks_pad, dtype=_I32)
    b_ok = blocks < num_blocks
    b_keys = plgpu.load(bm_ref.at[r, jnp.where(b_ok, blocks, 0)], mask=b_ok, other=0)  # [NB]
    sel, t, want = _select(b_keys, b_ok, k, _I32(INT_MIN))
    top_blocks = compact(0, blocks, sel)  # [K]

    chunks = top_blocks[:, None] * group + jnp.arange(group, dtype=_I32)[None, :]  # [K, G]
    c_ok = (slot < want)[:, None] & (chunks < num_chunks)
    c_keys = plgpu.load(cm_ref.at[r, jnp.where(c_ok, chunks, 0)], mask=c_ok, other=0).astype(_I32)
    sel, t, want = _select(c_keys, c_ok, k, lower_bound(t, want))
    top_chunks = compact(K, chunks, sel)  # [K]

    cols = top_chunks[:, None] * chunk + jnp.arange(chunk, dtype=_I32)[None, :]  # [K, C]
    e_ok = (slot < want)[:, None] & (cols < vocab)
    e_keys = _keys(plgpu.load(x_ref.at[r, jnp.where(e_ok, cols, 0)], mask=e_ok, other=0), key16)
    sel, _, want = _select(e_keys, e_ok, k, lower_bound(t, want))
    top_cols = compact(2 * K, cols, sel)  # [K], column order

    ok = slot < want  # want == k
    top_cols = jnp.where(ok, top_cols, 0)
    vals = plgpu.load(x_ref.at[r, top_cols])
    key = jnp.where(ok, _keys(vals, key16), _I32(INT_MIN))
    # rank: keys ahead of it in lax.top_k's order (larger, or equal at a lower column)
    ahead = (key[None, :] > key[:, None]) | ((key[None, :] == key[:, None]) & (slot[None, :] < slot[:, None]))
    rank = jnp.sum((ahead & ok[None, :]).astype(_I32), axis=1)
    rank = jnp.where(ok, rank, k)  # past the row: see _compact
    plgpu.store(val_ref.at[r, rank], vals, mask=ok)
    plgpu.store(idx_ref.at[r, rank], top_cols, mask=ok)


def select_top_k(x, cm, bm, k, plan, *, interpret, poison_outputs=False):
    """(x [rows, vocab], its chunk_maxima) -> (values [rows, k] x.dtype, indices [rows, k] int32) in
    lax.top_k's order. poison_outputs: written into NaN / INT_MIN-filled buffers."""
    rows, vocab = x.shape
    K = plan["K"]
    shapes = [((rows, k), x.dtype), ((rows, k), jnp.int32)]
    out_shape, extra, aliases = _outputs(shapes, poison_outputs, 3)
    vals, idx, _ = pl.pallas_call(
        functools.partial(
            _select_kernel,
            vocab=vocab,
            k=k,
            K=K,
            chunk=plan["chunk"],
            group=plan["group"],
            num_blocks=plan["num_blocks"],
            blocks_pad=plan["blocks_pad"],
            key16=plan["key16"],
            interpret=interpret,
        ),
        out_shape=out_shape + (jax.ShapeDtypeStruct((rows, 3 * K), jnp.int32),),
        out_specs=(pl.no_block_spec,) * 3,
        grid=(rows,),
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=plan["select_warps"], num_stages=1),
        interpret=interpret,
        name="topk_select",
    )(x, cm, bm, *extra)
    return vals, idx


def top_k(logits, k, *, config: TopKConfig | None = None, interpret: bool | None = None, poison_outputs: bool = False):
    """Values and indices of the k largest logits per row, in jax.lax.top_k's order.

    logits [..., vocab] bfloat16 / float32; k static, 1 <= k <= min(64, vocab) (`supports`).
    -> (values [..., k] logits.dtype, indices [..., k] int32), descending, ties: lower index first.
    Two Pallas launches (the stream of maxima, the selection), no XLA sort or conditional.
    poison_outputs: every output starts NaN / INT_MIN (tests: an unwritten element shows).
    """
    if not supports(logits, k, config):
        raise ValueError(
            f"top_k kernel: unsupported logits {getattr(logits, 'shape', None)} "
            f"{getattr(logits, 'dtype', None)} with k={k!r} (bf16/fp32, 1 <= k <= min(64, vocab))"
        )
    if interpret is None:
        interpret = default_interpret()
    lead = logits.shape[:-1]
    rows, vocab = _rows_vocab(logits)
    x = logits.reshape(rows, vocab)
    plan = (config or TopKConfig()).resolve(rows, vocab, k, logits.dtype)
    cm, bm = chunk_maxima(x, plan, interpret=interpret, poison_outputs=poison_outputs)
    vals, idx = select_top_k(x, cm, bm, k, plan, interpret=interpret, poison_outputs=poison_outputs)
    return vals.reshape(*lead, k), idx.reshape(*lead, k)
