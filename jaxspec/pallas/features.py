"""Pallas (Triton lowering) kernel for the estimator's feature: one pass over the draft logits.

Contract: `jaxspec.spec.estimator.features` (its jnp form, impl="ref", is the semantics; it clamps
the result of either to +-40):
    z = logits / T (T <= 0 -> 1),  x = -log( sum_{i: z_i < z*} e^{z_i - z*} + (#{z_i == z*} - 1) ),
and a NaN anywhere in the row gives NaN (as the reference's max does).

XLA computes this in two passes over the logits (a max, then the exp-sum against it): at batch 128
x 7 positions x 248,320 bf16 logits it reads them twice, 298 us on the H200 against a 105 us read
floor. Here each row is read once, with an online maximum: every block of `block_v` columns gives
(block max b, sum of e^{z - b} over the entries below b, count of entries equal to b, NaN count),
merged into the running (m, s, c) by rescaling whichever side has the smaller maximum:
    m' = max(m, b),  s' = s w_m + [m < m'] c w_m + s_b w_b + [b < m'] c_b w_b,
    c' = [m == m'] c + [b == m'] c_b,   w_x = e^{x - m'} (1 where x == m': no -inf - -inf).
A former maximum that is overtaken turns its ties into ordinary entries (the [m < m'] c term).

Grid (rows, splits): a program owns a contiguous span of one row (whole blocks; the tail block is
masked explicitly: the Triton lowering does not mask overhanging blocks). With few rows the
vocabulary is split so that rows x splits >= `min_programs` programs keep the SMs busy; the
partials [rows, splits, 4] (m, s, c, NaN count) are merged by the same rule in a small jnp epilogue.
With one split (many rows, or a small vocabulary) each program writes x itself: one launch.
"""
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxspec.pallas.tiles import check_pow2_fields

# The kernel ran its GPU tests (tests/test_pallas_features.py -m gpu) on the H200: until then
# impl="auto" keeps the jnp form; impl="pallas" reaches the kernel.
GPU_VALIDATED = False


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


def _merge(m, s, c, b, s_b, c_b):
    """The running (m, s, c) merged with a block's (b, s_b, c_b); see the module docstring."""
    new = jnp.maximum(m, b)
    w_m = jnp.where(m == new, 1.0, jnp.exp(m - new))
    w_b = jnp.where(b == new, 1.0, jnp.exp(b - new))
    s = s * w_m + jnp.where(m == new, 0.0, c * w_m) + s_b * w_b + jnp.where(b == new, 0.0, c_b * w_b)
    c = jnp.where(m == new, c, 0.0) + jnp.where(b == new, c_b, 0.0)
    return new, s, c


def _feature(rest, ties, nans):
    """x = -log(rest + ties - 1) from the merged sums; NaN where the row held a NaN."""
    return jnp.where(nans > 0, jnp.nan, -jnp.log(rest + (ties - 1.0)))


def _kernel(logits_ref, temp_ref, out_ref, *, block_v, steps, span, final):
    row, split = pl.program_id(0), pl.program_id(1)
    vocab = logits_ref.shape[1]
    t = temp_ref[row]
    t = jnp.where(t > 0, t, 1.0)
    lane = jnp.arange(block_v, dtype=jnp.int32)
    first = split * span

    def step(i, carry):
        m, s, c, nans = carry
        cols = first + i * block_v + lane
        ok = (cols < vocab) & (cols < first + span)
        z = plgpu.load(logits_ref.at[row, jnp.where(ok, cols, 0)], mask=ok, other=0.0).astype(jnp.float32) / t
        is_nan = ok & (z != z)
        live = ok & ~is_nan
        b = jnp.max(jnp.where(live, z, -jnp.inf))
        at_max = live & (z == b)
        s_b = jnp.sum(jnp.where(live & ~at_max, jnp.exp(z - b), 0.0))
        c_b = jnp.sum(at_max.astype(jnp.float32))
        m, s, c = _merge(m, s, c, b, s_b, c_b)
        return m, s, c, nans + jnp.sum(is_nan.astype(jnp.float32))

    zero = jnp.float32(0.0)
    m, s, c, nans = jax.lax.fori_loop(0, steps, step, (jnp.float32(-jnp.inf), zero, zero, zero))
    if final:        # the whole row in this program: x itself, no partials and no second launch
        out_ref[...] = jnp.full((1,), _feature(s, c, nans), jnp.float32)
    else:
        k = jax.lax.broadcasted_iota(jnp.int32, (1, 1, 4), 2)
        out_ref[...] = jnp.where(k == 0, m, jnp.where(k == 1, s, jnp.where(k == 2, c, nans)))


def _combine(parts):
    """[R, splits, 4] partials -> x [R], unclamped (the same merge, over the splits)."""
    m, s, c, nans = (parts[..., i] for i in range(4))
    top = jnp.max(m, axis=-1, keepdims=True)
    w = jnp.where(m == top, 1.0, jnp.exp(m - top))
    rest = jnp.sum(s * w + jnp.where(m == top, 0.0, c * w), axis=-1)
    ties = jnp.sum(jnp.where(m == top, c, 0.0), axis=-1)
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
    kernel = functools.partial(_kernel, block_v=block_v, steps=steps, span=steps * block_v, final=final)
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
