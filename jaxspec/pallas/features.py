"""Pallas (Triton lowering) kernel for the estimator's feature: one pass over the draft logits.

Contract: `jaxspec.spec.estimator.features` (its jnp form, impl="ref", is the semantics; it clamps
the result of either to +-40):
    z = logits / T (T <= 0 -> 1),  x = -log( sum_{i: z_i < z*} e^{z_i - z*} + (#{z_i == z*} - 1) ),
and a NaN anywhere in the row gives NaN (as the reference's max does).

XLA computes this in two passes over the logits (a max, then the exp-sum against it): at batch 128
x 7 positions x 248,320 bf16 logits it reads them twice, 263-298 us on the H200 against a 105-114 us
read floor. Here each row is read once. Every lane of a `block_v`-wide program keeps its own online state over
the columns it sees (lane j sees columns j, j + block_v, ...): its running maximum m and the sum s of
2^{z - m} over the other entries it has seen, in base-2 units (z = logits * log2(e) / T, so that
each entry costs one `ex2`). A new entry z costs one exponential and no branch:
    hi = max(m, z),  e = 2^{min(m, z) - hi},  s' = (s + 1) e  if z > m  else  s + e,  m' = hi
(a tie z == m adds e = 1: it is one of the "other" entries of this lane's maximum). z is clamped to
+-FLT_MAX so that -inf and +inf entries take part as the largest finite magnitudes (never inf - inf);
a NaN sets the lane's flag and makes x NaN, as the reference's max does. Only the tail block is
masked (a second loop), so the steady-state loop is about 16 instructions an element: the H200
moves ~9 bf16 elements per SM cycle, so anything much above that is bound by instruction issue
(a first version that reduced every block to one (max, sum, ties) ran at 0.23 of the read floor).
The lanes are merged once at the end, each lane's maximum counting as one tie of its own:
    M = max_j m_j,  rest = sum_{m_j == M} s_j + sum_{m_j < M} (s_j + 1) 2^{m_j - M},
    ties = #{j : m_j == M},   x = -log(rest + ties - 1).
Ties of the maximum inside one lane sit in `rest` as 1s; that only happens when q_max <= 1/2, where
rest + ties - 1 >= 1 does not cancel. A unique maximum keeps rest free of it, so x stays accurate
when q_max is near 1 (summing e^0 = 1 for the maximum and subtracting 1 would cancel in float32).

Grid (rows, splits): a program owns a contiguous span of one row (whole blocks; the tail block is
masked explicitly: the Triton lowering does not mask overhanging blocks). With few rows the
vocabulary is split so that rows x splits >= `min_programs` programs keep the SMs busy; the
partials [rows, splits, 4] (M in base-2 units, rest, ties, NaN count) are merged by the same rule in a small jnp
epilogue. With one split (many rows, or a small vocabulary) each program writes x itself: one launch.
"""
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxspec.pallas.tiles import check_pow2_fields

# impl="auto" takes the kernel on a GPU only where it is faster than XLA's two passes. On the H200
# (2026-12-01) it passed its GPU tests but was slower: 320 against 263 us at 128 x 7 x 248,320 bf16,
# 10.4 against 8.0 us at 1 x 7 (bench/RESULTS.md). impl="pallas" reaches it.
AUTO_ON_GPU = False


@dataclasses.dataclass(frozen=True)
class FeaturesConfig:
    """block_v: columns per step (power of two); num_warps, num_stages: Triton launch parameters
    (stages pipeline the block loads); min_programs: split rows until rows x splits >= this
    (2 programs per SM of the H200's 132)."""
    block_v: int = 4096
    num_warps: int = 8
    num_stages: int = 3
    min_programs: int = 264

    def __post_init__(self):
        check_pow2_fields(self, (("block_v", 16, 1 << 16), ("num_warps", 1, 16)))
        for name in ("num_stages", "min_programs"):
            val = getattr(self, name)
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ValueError(f"FeaturesConfig.{name}={val!r}: must be an int >= 1")


def supports(draft_logits, temperature) -> bool:
    """Float logits [..., P, V] (V >= 1) with a temperature broadcastable to the leading axes."""
    try:
        shape = draft_logits.shape
        ok = (len(shape) >= 2 and shape[-1] >= 1 and jnp.issubdtype(draft_logits.dtype, jnp.floating)
              and jnp.issubdtype(jnp.result_type(temperature), jnp.floating))
        if ok:
            jnp.broadcast_shapes(jnp.shape(temperature), shape[:-2])
        return bool(ok)
    except (AttributeError, TypeError, ValueError):
        return False


LOG2_E = 1.4426950408889634
F32_MAX = float(jnp.finfo(jnp.float32).max)


def _merge_lanes(m, s, c, axis):
    """States along `axis` -> (M, rest, ties): c is each state's count of its maximum (1 for a lane
    that saw an entry, 0 for an empty one; the tie count for a split's partial). Base-2 units."""
    top = jnp.max(m, axis=axis, keepdims=True)
    at_top = m == top                          # also where every state is empty (top = -inf)
    w = jnp.where(at_top, 1.0, jnp.exp2(m - top))
    rest = jnp.sum(jnp.where(at_top, s, (s + c) * w), axis=axis)
    ties = jnp.sum(jnp.where(at_top, c, 0.0), axis=axis)
    return jnp.squeeze(top, axis), rest, ties


def _feature(rest, ties, nans):
    """x = -log(rest + ties - 1) from the merged sums; NaN where the row held a NaN."""
    return jnp.where(nans > 0, jnp.nan, -jnp.log(rest + (ties - 1.0)))


def _ex2_approx(d):
    """2^d with one MUFU instruction (ex2.approx.ftz: ~2 ulp, subnormal results flushed to 0).
    libdevice's __nv_exp2f (jnp.exp2's lowering) measured 9 % slower here (350 against 320 us)."""
    [out] = plgpu.elementwise_inline_asm("ex2.approx.ftz.f32 $0, $1;", args=[d], constraints="=r,r", pack=1,
                                         result_shape_dtypes=[jax.ShapeDtypeStruct(d.shape, jnp.float32)])
    return out


def _lane_update(m, s, nans, x, scale, exp2, ok=None):
    """One block of entries into the lanes' (m, s, NaN count); `ok` masks the tail block."""
    z = x.astype(jnp.float32) * scale
    is_nan = z != z
    z = jnp.clip(z, -F32_MAX, F32_MAX)
    hi = jnp.maximum(m, z)
    e = exp2(jnp.minimum(m, z) - hi)
    s_new = jnp.where(z > m, (s + 1.0) * e, s + e)
    if ok is None:
        return hi, s_new, jnp.where(is_nan, 1.0, nans)
    return jnp.where(ok, hi, m), jnp.where(ok, s_new, s), jnp.where(ok & is_nan, 1.0, nans)


def _kernel(logits_ref, temp_ref, out_ref, *, block_v, steps, span, final, exp2):
    row, split = pl.program_id(0), pl.program_id(1)
    vocab = logits_ref.shape[1]
    t = temp_ref[row]
    scale = LOG2_E / jnp.where(t > 0, t, 1.0)
    lane = jnp.arange(block_v, dtype=jnp.int32)
    first = split * span
    full = jnp.clip((vocab - first) // block_v, 0, steps)     # blocks of this span inside the row

    def step(i, carry):
        x = logits_ref[row, pl.ds(first + i * block_v, block_v)]
        return _lane_update(*carry, x, scale, exp2)

    def tail_step(i, carry):
        start = first + i * block_v
        ok = start + lane < vocab
        x = plgpu.load(logits_ref.at[row, pl.ds(start, block_v)], mask=ok, other=0.0)
        return _lane_update(*carry, x, scale, exp2, ok)

    zeros = jnp.zeros((block_v,), jnp.float32)
    carry = (jnp.full((block_v,), -jnp.inf, jnp.float32), zeros, zeros)
    if block_v <= vocab:     # (else no block is whole; interpret mode checks the slice statically)
        carry = jax.lax.fori_loop(0, full, step, carry)
    else:
        full = 0
    m, s, nans = jax.lax.fori_loop(full, steps, tail_step, carry)
    top, rest, ties = _merge_lanes(m, s, (m > -jnp.inf).astype(jnp.float32), axis=0)
    nans = jnp.sum(nans)
    if final:        # the whole row in this program: x itself, no partials and no second launch
        out_ref[...] = jnp.full((1,), _feature(rest, ties, nans), jnp.float32)
    else:
        k = jax.lax.broadcasted_iota(jnp.int32, (1, 1, 4), 2)
        out_ref[...] = jnp.where(k == 0, top, jnp.where(k == 1, rest, jnp.where(k == 2, ties, nans)))


def _combine(parts):
    """[R, splits, 4] partials -> x [R], unclamped (the same merge, over the splits)."""
    m, s, c, nans = (parts[..., i] for i in range(4))
    _, rest, ties = _merge_lanes(m, s, c, axis=-1)
    return _feature(rest, ties, jnp.sum(nans, axis=-1))


def feature_logits(draft_logits, temperature, *, config: FeaturesConfig | None = None,
                   interpret: bool | None = None):
    """x = logit(q_max) of `jaxspec.spec.estimator.features` before its clamp: [..., P, V] logits
    (any float dtype) and a temperature broadcastable to [...] -> [..., P] float32."""
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    cfg = config or FeaturesConfig()
    shape = draft_logits.shape
    vocab = shape[-1]
    rows = math.prod(shape[:-1])
    temp = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), shape[:-2])
    temp = jnp.broadcast_to(temp[..., None], shape[:-1]).reshape(rows)
    block_v = min(cfg.block_v, pl.next_power_of_2(vocab))
    blocks = pl.cdiv(vocab, block_v)
    splits = max(1, min(blocks, pl.cdiv(cfg.min_programs, max(rows, 1))))
    steps = pl.cdiv(blocks, splits)
    final = splits == 1
    exp2 = jnp.exp2 if interpret else _ex2_approx      # inline PTX runs only on the GPU
    kernel = functools.partial(_kernel, block_v=block_v, steps=steps, span=steps * block_v, final=final,
                               exp2=exp2)
    if final:
        out_specs = pl.BlockSpec((1,), lambda r, j: (r,))
        out_shape = jax.ShapeDtypeStruct((rows,), jnp.float32)
    else:
        out_specs = pl.BlockSpec((1, 1, 4), lambda r, j: (r, j, 0))
        out_shape = jax.ShapeDtypeStruct((rows, splits, 4), jnp.float32)
    out = pl.pallas_call(
        kernel,
        grid=(rows, splits),
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        name="estimator_features",
    )(draft_logits.reshape(rows, vocab), temp)
    return (out if final else _combine(out)).reshape(shape[:-1])
