"""Gathered expert products (Pallas, Triton): the routed experts of an MoE decode step, reading
only the experts its tokens hit.

Contract: `expert_gemv_reference` below (used by `jaxspec.ops.moe.moe_gathered`). x [R, K] (the
rows), ids [P] int32 (pair p's expert, in [0, E)), live [P] bool, w [E, K, N] of x's dtype (float32 or
bfloat16);
pair p reads row p // rows_div of x. With the reduction axis cut into S = ceil(K / block_k)
splits of block_k rows:

    out[s, p, n] = Σ_{k ∈ split s} x[p // rows_div, k] · w[ids[p], k, n]     (float32)
    out[s, p, :] = 0                                                     for dead pairs

The caller sums over s (a split-K partial sum: the reduction of one pair is spread over S programs
so that a decode step, 8-80 pairs, still fills the GPU).

Design (memory-bound: a decode step's products are matrix-vector products, and the bytes are the
experts' weights): XLA's GPU `ragged_dot` computes every expert whatever the routing, and a
gather-then-einsum copies the hit experts' weights before reading them again (~3 passes); here
each program streams one [block_k, block_n] tile of one expert straight from its place in the
stacked weights (the expert id is loaded first, then the tile address is known) and keeps a
[block_n] float32 accumulator. Rows of block_n contiguous weights make full 128-byte lines. Dead
pairs (padding rows, the null slot) load nothing and store zeros. A pair shared by two tokens'
routing reads its expert twice: at 64 pairs over 256 experts ~12% more bytes than the unique
experts, and none at batch 1.
Products: bf16 x bf16 products are exact in float32; float32 inputs are multiplied in float32 on
the FMA pipes (no TF32), as `dense` at HIGHEST.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxspec.pallas.hardware import default_interpret
from jaxspec.pallas.tiles import check_pow2_fields, next_pow2

_FLOATS = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
PROGRAMS_PER_PAIR = 32  # n tiles x k splits of one pair: 8 pairs (batch 1, top-8) fill 2 x 132 SMs


@dataclasses.dataclass(frozen=True)
class ExpertGemvConfig:
    """Tile sizes of the gathered products.

    block_n: output columns per program (clipped to N's next power of two). 256 bf16 columns are
      512 contiguous bytes a weight row.
    block_k: reduction rows per program (the split-K length; None: chosen by `resolve` so a pair
      spans PROGRAMS_PER_PAIR programs, from K and N only, so a token's result never depends on
      the batch it ran in).
    inner_k: rows loaded per loop step; the float32 accumulator is [inner_k, block_n] (64 registers
      a thread at 32 x 256 with 4 warps).
    num_warps / num_stages: Triton launch parameters (stages pipeline the loop's loads).
    """

    block_n: int = 256
    block_k: int | None = None
    inner_k: int = 32
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        check_pow2_fields(self, (("block_n", 16, 1024), ("inner_k", 8, 256), ("num_warps", 1, 16)))
        if self.block_k is not None:
            check_pow2_fields(self, (("block_k", 8, 1 << 16),))
            if self.block_k < self.inner_k:
                raise ValueError(f"ExpertGemvConfig.block_k={self.block_k}: must be >= inner_k={self.inner_k}")
        if not isinstance(self.num_stages, int) or not 1 <= self.num_stages <= 8:
            raise ValueError(f"ExpertGemvConfig.num_stages={self.num_stages!r}: must be an int in [1, 8]")

    def resolve(self, k: int, n: int) -> tuple[int, int, int]:
        """(block_n, block_k, inner_k) for a [K, N] weight matrix."""
        block_n = min(self.block_n, next_pow2(n))
        inner_k = min(self.inner_k, next_pow2(k))
        if self.block_k is not None:
            return block_n, max(inner_k, min(self.block_k, next_pow2(k))), inner_k
        n_tiles = pl.cdiv(n, block_n)
        splits = max(1, PROGRAMS_PER_PAIR // n_tiles)
        block_k = max(inner_k, next_pow2(pl.cdiv(k, splits)))
        return block_n, block_k, inner_k


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


def _kernel(ids_ref, live_ref, x_ref, w_ref, out_ref, *, rows_div, block_n, block_k, inner_k):
    f32 = jnp.float32
    p = pl.program_id(0)
    n0 = pl.program_id(1) * block_n
    s = pl.program_id(2)
    k0 = s * block_k
    kd, nd = w_ref.shape[1], w_ref.shape[2]
    cols = n0 + jnp.arange(block_n)
    cmask = cols < nd
    out_at = out_ref.at[s, p, pl.ds(n0, block_n)]
    live = live_ref[p] != 0

    @pl.when(live)
    def _():
        e = ids_ref[p]
        row = p // rows_div

        def step(i, acc):
            kk = k0 + i * inner_k
            rows = kk + jnp.arange(inner_k)
            rmask = rows < kd
            xs = plgpu.load(x_ref.at[row, pl.ds(kk, inner_k)], mask=rmask, other=0).astype(f32)
            ws = plgpu.load(
                w_ref.at[e, pl.ds(kk, inner_k), pl.ds(n0, block_n)],
                mask=rmask[:, None] & cmask[None, :],
                other=0,
                eviction_policy="evict_first",
            ).astype(f32)
            return acc + xs[:, None] * ws

        # a [inner_k, block_n] accumulator, reduced over its rows once at the end: a reduction
        # inside the loop would cross warps (shared memory and a barrier) every step
        acc = lax.fori_loop(0, block_k // inner_k, step, jnp.zeros((inner_k, block_n), f32))
        plgpu.store(out_at, jnp.sum(acc, axis=0), mask=cmask)

    @pl.when(jnp.logical_not(live))
    def _():
        plgpu.store(out_at, jnp.zeros((block_n,), f32), mask=cmask)


def expert_gemv(x, ids, live, w, *, rows_div: int = 1, config: ExpertGemvConfig | None = None, interpret=None):
    """The gathered products (module contract): -> [S, P, N] float32 split-K partial sums."""
    if not supports(x, ids, live, w, rows_div):
        raise ValueError(
            "expert_gemv kernel: unsupported shapes/dtypes "
            f"x {x.shape} {x.dtype}, ids {ids.shape} {ids.dtype}, live {live.shape}, w {w.shape} {w.dtype}, "
            f"rows_div {rows_div!r}"
        )
    if interpret is None:
        interpret = default_interpret()
    config = config or ExpertGemvConfig()
    _, kd, nd = w.shape
    pairs = ids.shape[0]
    block_n, block_k, inner_k = config.resolve(kd, nd)
    splits = pl.cdiv(kd, block_k)
    kernel = functools.partial(_kernel, rows_div=rows_div, block_n=block_n, block_k=block_k, inner_k=inner_k)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((splits, pairs, nd), jnp.float32),
        grid=(pairs, pl.cdiv(nd, block_n), splits),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="expert_gemv",
    )(ids.astype(jnp.int32), live.astype(jnp.int32), x, w)


def expert_gemv_reference(x, ids, live, w, *, rows_div: int = 1):
    """jnp form of the contract, summed over the splits: [P, N] float32."""
    rows = x[jnp.arange(ids.shape[0]) // rows_div].astype(jnp.float32)  # [P, K]
    y = jnp.einsum("pk,pkn->pn", rows, w[ids].astype(jnp.float32), precision=lax.Precision.HIGHEST)
    return jnp.where(live[:, None], y, 0.0)
