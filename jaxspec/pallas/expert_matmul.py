"""Grouped expert products (Pallas, Triton): the routed experts of an MoE step (decode, verify,
prefill), each hit expert's weights read once, whatever number of the step's tokens chose it.

Contract (`expert_matmul_reference` below is its jnp form): x [R, K] (the rows), ids [P] int32
(pair p's expert, in [0, E)), live [P] bool, w [E, K, N] of x's dtype (float32 or bfloat16); pair p
reads row p // rows_div of x:

    out[p, n] = Σ_k x[p // rows_div, k] · w[ids[p], k, n]     (float32) for live pairs, 0 for dead ones

Design (memory-bound at decode and verify sizes: the bytes are the hit experts' weights): every
program streams one [block_k, block_n] tile of one hit expert and multiplies it into all the rows
that chose that expert, on the tensor cores, so each hit expert is read once and experts that no
token chose are never walked (XLA's GPU `ragged_dot` computes all of them). The reduction is split
over K / block_k programs (split-K: a decode step's 8-80 pairs would not fill the GPU otherwise);
the wrapper sums the float32 partials. block_k comes from (K, N) alone up to `split_pairs` pairs,
so a decode or verify token's sums do not depend on the batch it ran in; above that (prefills)
the reduction is whole. Two forms find an expert's rows:
* direct (P <= `direct_pairs`: decode up to batch 8 at top-8): grid (P, N / block_n, K / block_k);
  each program loads all P expert ids, and the lowest live pair of an expert multiplies its tile
  into every pair of that expert (one MMA block of all P rows, the others masked), writing in
  pair order; the other pairs' programs return at once. No sort, no XLA work around the kernel
  but the partial sum (at one token, the sort's small XLA kernels cost more than the tiles).
* sorted (more pairs): the wrapper sorts the live pairs by expert (an XLA argsort) and lists the
  groups (expert, first sorted position, count), at most G = min(E, P); grid (G, N / block_n,
  K / block_k), a group's rows block_m at a time (gathered from x by the sorted pairs' row index;
  a group of more than block_m rows re-reads its tile from L2); the rows go back to pair order.
* Dead pairs (padding rows, the null slot) and unused groups load nothing; dead pairs' rows are
  selected to 0 by the wrapper.
Products: bf16 x bf16 products are exact in float32 (the MMA accumulates in float32); float32
inputs use the full-precision dot (no TF32), as `dense` at HIGHEST.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxspec.pallas.hardware import default_interpret
from jaxspec.pallas.tiles import check_int_fields, check_pow2_fields, next_pow2

_FLOATS = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
PROGRAMS_PER_GROUP = 32  # n tiles x k splits of one expert: 8 experts (batch 1, top-8) fill 2 x 132 SMs


@dataclasses.dataclass(frozen=True)
class ExpertMatmulConfig:
    """Tile sizes of the grouped products.

    block_m: rows of a group multiplied per pass over the tile (16: the MMA's least M).
    block_n: output columns per program (clipped to N's next power of two, at least 16); 128 bf16
      columns are 256 contiguous bytes a weight row (128 and 256 within 4% on the H100:
      bench/RESULTS.md).
    block_k: reduction rows per program (None: chosen by `resolve` so an expert spans
      PROGRAMS_PER_GROUP programs; all of K above split_pairs pairs).
    inner_k: reduction rows per MMA step ([inner_k, block_n] weights in flight at a time).
    num_warps / num_stages: Triton launch parameters (stages pipeline the inner loop's loads).
    direct_pairs: up to this many pairs (P), the direct form: no sort; all P pairs are one MMA
      block of next_pow2(P) rows (at least 16) and each expert's lowest pair does its expert's
      programs. Above it, the sorted form. 64 (H100, bench/moe_experts.py, 2026-12-06): at one
      token the direct form takes 24 µs a layer where the sorted one takes 36 (35B-A3B; 80B-A3B
      29 vs 43), at 64 pairs 128 vs 138 µs, at 80 pairs (80B-A3B batch 8) 181 vs 175: the
      sort's small XLA kernels cost more than they save only up to ~64 pairs. At most 128: the
      [next_pow2(P), block_n] float32 accumulator is 128 registers a thread at 128 x 128 with 4
      warps.
    split_pairs: above this many pairs (prefills, verify at large batches) the reduction is not
      split: the groups (up to E of them) fill the GPU alone, and the float32 partials, S x P x N,
      would grow with P.
    wide_block_m: block_m above split_pairs pairs, where a group holds ~T·k/E rows (a prefill of
      4096 tokens at top-8 of 256: 128): a wider pass re-reads the tile from L2 fewer times.
    """

    block_m: int = 16
    block_n: int = 128
    block_k: int | None = None
    inner_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    direct_pairs: int = 64
    split_pairs: int = 1024
    wide_block_m: int = 64

    def __post_init__(self):
        check_pow2_fields(
            self,
            (
                ("block_m", 16, 128),
                ("wide_block_m", 16, 128),
                ("block_n", 16, 1024),
                ("inner_k", 16, 256),
                ("num_warps", 1, 16),
            ),
        )
        if self.block_k is not None:
            check_pow2_fields(self, (("block_k", 16, 1 << 16),))
            if self.block_k < self.inner_k:
                raise ValueError(f"ExpertMatmulConfig.block_k={self.block_k}: must be >= inner_k={self.inner_k}")
        check_int_fields(self, (("num_stages", 1, 8), ("split_pairs", 0, None), ("direct_pairs", 0, 128)))

    def resolve(self, k: int, n: int, pairs: int = 1) -> tuple[int, int, int]:
        """(block_n, block_k, inner_k) for a [K, N] weight matrix and `pairs` pairs (MMA operands
        need >= 16). Above split_pairs pairs the reduction is not split."""
        block_n = max(16, min(self.block_n, next_pow2(n)))
        inner_k = max(16, min(self.inner_k, next_pow2(k)))
        if pairs > self.split_pairs:
            return block_n, max(inner_k, next_pow2(k)), inner_k
        if self.block_k is not None:
            return block_n, max(inner_k, min(self.block_k, next_pow2(k))), inner_k
        splits = max(1, PROGRAMS_PER_GROUP // pl.cdiv(n, block_n))
        return block_n, max(inner_k, next_pow2(pl.cdiv(k, splits))), inner_k


def supports(x, ids, live, w, rows_div: int = 1) -> bool:
    """Shapes and dtypes the kernel covers (the contract above)."""
    try:
        return (
            x.ndim == 2
            and w.ndim == 3
            and ids.ndim == 1
            and live.shape == ids.shape
            and x.shape[1] == w.shape[1]
            and ids.shape[0] >= 1
            and isinstance(rows_div, int)
            and rows_div >= 1
            and pl.cdiv(ids.shape[0], rows_div) <= x.shape[0]
            and jnp.dtype(x.dtype) in _FLOATS
            and jnp.dtype(w.dtype) == jnp.dtype(x.dtype)
            and jnp.issubdtype(ids.dtype, jnp.integer)
        )
    except (AttributeError, TypeError):
        return False


def expert_groups(ids, live, n_experts: int):
    """The pairs sorted by expert and their groups: (order [P]: pair at each sorted position,
    group_expert [G] (E: an unused group), group_start [G], group_count [G]), G = min(E, P).
    Dead pairs sort last under the key E and form no group."""
    pairs = ids.shape[0]
    groups = min(n_experts, pairs)
    key = jnp.where(live, ids, n_experts).astype(jnp.int32)  # [P]
    order = jnp.argsort(key, stable=True).astype(jnp.int32)  # [P]
    sorted_key = key[order]
    first = jnp.concatenate([jnp.ones((1,), bool), sorted_key[1:] != sorted_key[:-1]])  # [P]
    group = jnp.cumsum(first) - 1  # [P]: group of each sorted position (the dead one may reach G)
    at = jnp.where(first & (sorted_key < n_experts), group, groups)  # group starts, G = dropped
    positions = jnp.arange(pairs, dtype=jnp.int32)
    group_expert = jnp.full((groups,), n_experts, jnp.int32).at[at].set(sorted_key, mode="drop")
    group_start = jnp.zeros((groups,), jnp.int32).at[at].set(positions, mode="drop")
    live_sorted = sorted_key < n_experts
    group_count = jnp.zeros((groups,), jnp.int32).at[jnp.where(live_sorted, group, groups)].add(1, mode="drop")
    return order, group_expert, group_start, group_count


def _expert_tile(x_ref, w_ref, src, rmask, e, k0, n0, cmask, *, rows, block_n, block_k, inner_k, precision):
    """[rows, block_n] float32: rows src of x (those with rmask) times expert e's weight tile
    w[e, k0 : k0 + block_k, n0 : n0 + block_n], inner_k reduction rows per MMA step."""
    kd = w_ref.shape[1]

    def step(i, acc):
        ks = k0 + i * inner_k + jnp.arange(inner_k)
        kmask = ks < kd
        xs = plgpu.load(x_ref.at[src[:, None], ks[None, :]], mask=rmask[:, None] & kmask[None, :], other=0)
        ws = plgpu.load(
            w_ref.at[e, pl.ds(k0 + i * inner_k, inner_k), pl.ds(n0, block_n)],
            mask=kmask[:, None] & cmask[None, :],
            other=0,
        )
        return acc + jnp.dot(xs, ws, preferred_element_type=jnp.float32, precision=precision)

    return lax.fori_loop(0, block_k // inner_k, step, jnp.zeros((rows, block_n), jnp.float32))


def _sorted_kernel(gexp_ref, gstart_ref, gcount_ref, src_ref, x_ref, w_ref, out_ref, *, block_m, block_n, **tile):
    """Program (group g, n tile, k split) of the sorted form: the group's rows, block_m at a time."""
    g, n0, s = pl.program_id(0), pl.program_id(1) * block_n, pl.program_id(2)
    e, start, count = gexp_ref[g], gstart_ref[g], gcount_ref[g]
    cols = n0 + jnp.arange(block_n)
    cmask = cols < w_ref.shape[2]

    @pl.when((e < w_ref.shape[0]) & (count > 0))
    def _():
        def row_block(c, carry):
            r = start + c * block_m + jnp.arange(block_m)  # sorted positions
            rmask = r < start + count
            src = plgpu.load(src_ref.at[r], mask=rmask, other=0)  # their rows of x
            acc = _expert_tile(
                x_ref, w_ref, src, rmask, e, s * tile["block_k"], n0, cmask, rows=block_m, block_n=block_n, **tile
            )
            plgpu.store(out_ref.at[s, r[:, None], cols[None, :]], acc, mask=rmask[:, None] & cmask[None, :])
            return carry

        lax.fori_loop(0, pl.cdiv(count, block_m), row_block, 0)


def _direct_kernel(ids_ref, live_ref, x_ref, w_ref, out_ref, *, pairs, pad, rows_div, block_n, **tile):
    """Program (pair p, n tile, k split) of the direct form: the lowest live pair of each expert
    multiplies the tile into every pair of that expert (all P pairs are one MMA block of `pad`
    rows, those of other experts masked); the other pairs' programs return at once."""
    p, n0, s = pl.program_id(0), pl.program_id(1) * block_n, pl.program_id(2)
    q = jnp.arange(pad)
    ids = plgpu.load(ids_ref.at[q], mask=q < pairs, other=-1)
    live = plgpu.load(live_ref.at[q], mask=q < pairs, other=0) != 0
    e = ids_ref[p]
    mine = live & (ids == e)  # the pairs of p's expert
    cols = n0 + jnp.arange(block_n)
    cmask = cols < w_ref.shape[2]

    @pl.when((live_ref[p] != 0) & (jnp.min(jnp.where(mine, q, pad)) == p))
    def _():
        acc = _expert_tile(
            x_ref, w_ref, q // rows_div, mine, e, s * tile["block_k"], n0, cmask, rows=pad, block_n=block_n, **tile
        )
        plgpu.store(out_ref.at[s, q[:, None], cols[None, :]], acc, mask=mine[:, None] & cmask[None, :])


def expert_matmul(x, ids, live, w, *, rows_div: int = 1, config: ExpertMatmulConfig | None = None, interpret=None):
    """The grouped products (module contract): -> [P, N] float32 in pair order."""
    if not supports(x, ids, live, w, rows_div):
        raise ValueError(
            "expert_matmul kernel: unsupported shapes/dtypes "
            f"x {x.shape} {x.dtype}, ids {ids.shape} {ids.dtype}, live {live.shape}, w {w.shape} {w.dtype}, "
            f"rows_div {rows_div!r}"
        )
    if interpret is None:
        interpret = default_interpret()
    config = config or ExpertMatmulConfig()
    n_experts, kd, nd = w.shape
    pairs = ids.shape[0]
    block_n, block_k, inner_k = config.resolve(kd, nd, pairs)
    splits = pl.cdiv(kd, block_k)
    precision = lax.Precision.HIGHEST if jnp.dtype(x.dtype) == jnp.dtype(jnp.float32) else None
    tile = dict(block_n=block_n, block_k=block_k, inner_k=inner_k, precision=precision)
    params = plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages)
    out_shape = jax.ShapeDtypeStruct((splits, pairs, nd), jnp.float32)
    ids = ids.astype(jnp.int32)
    if pairs <= config.direct_pairs:
        pad = max(16, next_pow2(pairs))
        partial = pl.pallas_call(
            functools.partial(_direct_kernel, pairs=pairs, pad=pad, rows_div=rows_div, **tile),
            out_shape=out_shape,
            grid=(pairs, pl.cdiv(nd, block_n), splits),
            compiler_params=params,
            interpret=interpret,
            name="expert_matmul_direct",
        )(ids, live.astype(jnp.int32), x, w)
        return jnp.where(live[:, None], jnp.sum(partial, axis=0), 0.0)  # dead pairs' rows unwritten
    order, group_expert, group_start, group_count = expert_groups(ids, live, n_experts)
    partial = pl.pallas_call(
        functools.partial(
            _sorted_kernel, block_m=config.block_m if pairs <= config.split_pairs else config.wide_block_m, **tile
        ),
        out_shape=out_shape,
        grid=(group_expert.shape[0], pl.cdiv(nd, block_n), splits),
        compiler_params=params,
        interpret=interpret,
        name="expert_matmul",
    )(group_expert, group_start, group_count, order // rows_div, x, w)
    y_sorted = jnp.sum(partial, axis=0)  # [P, N] in sorted order; dead pairs' rows unwritten
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(pairs, dtype=order.dtype))
    return jnp.where(live[:, None], y_sorted[inverse], 0.0)


def expert_matmul_reference(x, ids, live, w, *, rows_div: int = 1):
    """jnp form of the contract: [P, N] float32."""
    rows = x[jnp.arange(ids.shape[0]) // rows_div].astype(jnp.float32)  # [P, K]
    y = jnp.einsum("pk,pkn->pn", rows, w[ids].astype(jnp.float32), precision=lax.Precision.HIGHEST)
    return jnp.where(live[:, None], y, 0.0)
