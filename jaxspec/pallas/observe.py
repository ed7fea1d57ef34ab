"""The estimator's `observe` (statistics and refit) as one Pallas Triton launch.

Contract: `jaxspec.spec.estimator.observe` (its jnp form, impl="ref", is the semantics: the labels,
the Newton statistics and the damped arrowhead step; docs/design.md section 6).

Why a kernel: the work is tiny (B x P features), so its cost on the GPU is the number of launches,
and XLA compiles the jnp form into several small kernels (the statistics, their reduction, then
small fusions for the refit's divides and selects). Here one program walks the batch in
`block_b`-row tiles (masked rows and positions add nothing), keeps the six sums in registers, adds
them to the state, computes the refit every call and keeps it when the schedule says (`refit_due`)
(no branch, as the jnp form) and writes the nine state fields.

Layout: x [B, P] float32 (non-finite features observe nothing), verified / accepted [B] int32;
state scalars are 0-d, per-position fields [P]. The padded tile is [block_b, P_pad] (powers of
two); the position sums are one reduction over P_pad where the jnp form chains them left to right,
so the two agree to float32 rounding, not bit for bit. A given kernel is deterministic: one
program, a fixed order.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxspec.pallas.hardware import default_interpret
from jaxspec.pallas.tiles import check_pow2_fields

FEATURE_CLAMP = 40.0  # as jaxspec.spec.estimator.FEATURE_CLAMP
MAX_SLOPE_HALVINGS = 8  # as jaxspec.spec.estimator.MAX_SLOPE_HALVINGS
MAX_LOGIT_STEP = 4.0  # as jaxspec.spec.estimator.MAX_LOGIT_STEP
FIELDS = ("slope", "intercepts", "h_xx", "h_x", "h_1", "g_x", "g_1", "n", "calls")


@dataclasses.dataclass(frozen=True)
class ObserveConfig:
    """block_b: batch rows per loop step (power of two): the tile [block_b, P_pad] stays in
    registers; num_warps: warps of the one program."""

    block_b: int = 256
    num_warps: int = 4

    def __post_init__(self):
        check_pow2_fields(self, (("block_b", 1, 4096), ("num_warps", 1, 16)))


def supports(state, x, verified, accepted) -> bool:
    """x [B, P] (B >= 1, 1 <= P <= 256) with verified / accepted [B] of an integer dtype."""
    try:
        ok = (
            len(x.shape) == 2
            and x.shape[0] >= 1
            and 1 <= x.shape[1] <= 256
            and tuple(verified.shape) == (x.shape[0],)
            and tuple(accepted.shape) == (x.shape[0],)
            and jnp.issubdtype(verified.dtype, jnp.integer)
            and jnp.issubdtype(accepted.dtype, jnp.integer)
            and state.intercepts.shape == (x.shape[1],)
        )
        return bool(ok)
    except (AttributeError, TypeError):
        return False


def _sigmoid(z):
    return 1.0 / (1.0 + jnp.exp(-z))


def _finite(v):
    return jnp.abs(v) < jnp.inf  # False for NaN too


def _kernel(
    x_ref,
    ver_ref,
    acc_ref,
    slope_ref,
    b_ref,
    h_xx_ref,
    h_x_ref,
    h_1_ref,
    g_x_ref,
    g_1_ref,
    n_ref,
    calls_ref,
    *out_refs,
    block_b,
    p_pad,
    refit_interval,
    early_refits,
    ridge,
    damping,
):
    batch, positions = x_ref.shape
    k = jnp.arange(p_pad, dtype=jnp.int32)
    live_k = k < positions  # [P_pad]

    def load_vec(ref):
        return plgpu.load(ref.at[pl.ds(0, p_pad)], mask=live_k, other=0.0)

    slope = slope_ref[...]
    b = load_vec(b_ref)
    rows = jnp.arange(block_b, dtype=jnp.int32)

    def tile(i, sums):
        r = i * block_b + rows
        live_r = r < batch
        x = plgpu.load(
            x_ref.at[pl.ds(i * block_b, block_b), pl.ds(0, p_pad)], mask=live_r[:, None] & live_k[None, :], other=0.0
        )  # [Bt, P_pad]
        ver = plgpu.load(ver_ref.at[pl.ds(i * block_b, block_b)], mask=live_r, other=0)[:, None]
        acc = plgpu.load(acc_ref.at[pl.ds(i * block_b, block_b)], mask=live_r, other=0)[:, None]
        pos = (k[None, :] < jnp.minimum(acc, ver)) & live_k[None, :]  # label 1
        neg = (k[None, :] == acc) & (acc < ver) & live_k[None, :]  # label 0
        finite = _finite(x)
        obs = (pos | neg) & finite
        xs = jnp.where(finite, jnp.clip(x, -FEATURE_CLAMP, FEATURE_CLAMP), 0.0)
        z = slope * xs + b[None, :]
        p, q = _sigmoid(z), _sigmoid(-z)  # p, 1 - p
        w = jnp.where(obs, p * q, 0.0)
        res = jnp.where(obs, jnp.where(pos, q, -p), 0.0)  # y - p
        terms = (w * xs * xs, w * xs, w, res * xs, res, obs.astype(jnp.float32))
        return tuple(s + jnp.sum(t, axis=0) for s, t in zip(sums, terms))

    zeros = jnp.zeros((p_pad,), jnp.float32)
    sums = jax.lax.fori_loop(0, pl.cdiv(batch, block_b), tile, (zeros,) * 6)
    h_xx = h_xx_ref[...] + jnp.sum(sums[0])
    h_x = load_vec(h_x_ref) + sums[1]
    h_1 = load_vec(h_1_ref) + sums[2]
    g_x = g_x_ref[...] + jnp.sum(sums[3])
    g_1 = load_vec(g_1_ref) + sums[4]
    n = n_ref[...] + jnp.sum(sums[5]).astype(jnp.int32)
    calls = calls_ref[...] + 1

    # the damped arrowhead Newton step (jaxspec.spec.estimator.arrowhead_solve / refit)
    def all_finite(v):
        return jnp.sum(jnp.where(live_k & ~_finite(v), 1, 0)) == 0

    nf = n.astype(jnp.float32)
    f = nf / (nf + damping)
    d = h_1 + ridge
    schur = jnp.maximum(h_xx + ridge - jnp.sum(jnp.where(live_k, h_x * h_x / d, 0.0)), ridge)
    da = (g_x - jnp.sum(jnp.where(live_k, h_x * g_1 / d, 0.0))) / schur
    db = (g_1 - h_x * da) / d
    ok = _finite(f) & _finite(da) & all_finite(db)
    da = f * da
    for _ in range(MAX_SLOPE_HALVINGS):
        da = jnp.where(slope + da < 0, da * 0.5, da)
    da = jnp.where(slope + da < 0, 0.0, da)
    db = (f * g_1 - h_x * da) / d
    # the trust region (jaxspec.spec.estimator.trust_scale)
    total = jnp.maximum(jnp.sum(jnp.where(live_k, h_1, 0.0)), 1e-30)
    mean = jnp.sum(jnp.where(live_k, h_x, 0.0)) / total
    sd = jnp.sqrt(jnp.maximum(h_xx / total - mean * mean, 0.0))
    x_bar = jnp.where(h_1 > 0, h_x / jnp.where(h_1 > 0, h_1, 1.0), mean)
    worst = jnp.max(jnp.where(live_k, jnp.abs(da * x_bar + db) + jnp.abs(da) * sd, 0.0))
    scale = jnp.where(worst > MAX_LOGIT_STEP, MAX_LOGIT_STEP / jnp.where(worst > 0, worst, 1.0), 1.0)
    da, db = scale * da, scale * db
    ok = ok & _finite(da) & all_finite(db)
    new_a = jnp.where(ok, slope + da, slope)
    new_b = jnp.where(ok, b + db, b)
    ok = _finite(new_a) & all_finite(new_b)
    due = calls % refit_interval == 0  # the schedule (jaxspec.spec.estimator.refit_due)
    for call in early_refits:
        due = due | (calls == call)

    out = dict(
        slope=jnp.where(due & ok, new_a, slope),
        intercepts=jnp.where(due & ok, new_b, b),
        h_xx=jnp.where(due, 0.0, h_xx),
        h_x=jnp.where(due, 0.0, h_x),
        h_1=jnp.where(due, 0.0, h_1),
        g_x=jnp.where(due, 0.0, g_x),
        g_1=jnp.where(due, 0.0, g_1),
        n=jnp.where(due, 0, n),
        calls=calls,
    )
    for name, ref in zip(FIELDS, out_refs):
        if ref.shape:
            plgpu.store(ref.at[pl.ds(0, p_pad)], out[name], mask=live_k)
        else:
            ref[...] = out[name]


def _skip_poison(kernel, count, *refs):
    """The kernel with the poisoned input buffers (aliased to its outputs) left out of its refs."""
    first = 3 + len(FIELDS)  # x, verified, accepted, then the state fields
    return kernel(*refs[:first], *refs[first + count :])


def _poisoned(v):
    """A buffer of NaN (floats) or INT_MIN (ints): a field the kernel fails to write stays so."""
    fill = jnp.nan if jnp.issubdtype(v.dtype, jnp.floating) else jnp.iinfo(v.dtype).min
    return jnp.full(v.shape, fill, v.dtype)


def observe(
    state,
    x,
    verified,
    accepted,
    *,
    config: ObserveConfig | None = None,
    interpret: bool | None = None,
    poison_outputs: bool = False,
):
    """`jaxspec.spec.estimator.observe` in one launch: -> the new EstimatorState.

    poison_outputs: the kernel writes into NaN / INT_MIN filled buffers (tests)."""
    if interpret is None:
        interpret = default_interpret()
    cfg = config or ObserveConfig()
    batch, positions = x.shape
    block_b = min(cfg.block_b, pl.next_power_of_2(batch))
    p_pad = pl.next_power_of_2(positions)
    fields = [getattr(state, name) for name in FIELDS]
    kernel = functools.partial(
        _kernel,
        block_b=block_b,
        p_pad=p_pad,
        refit_interval=state.refit_interval,
        early_refits=tuple(state.early_refits),
        ridge=float(state.ridge),
        damping=float(state.damping),
    )
    inputs = [jnp.asarray(x, jnp.float32), jnp.asarray(verified, jnp.int32), jnp.asarray(accepted, jnp.int32), *fields]
    poison = [_poisoned(v) for v in fields] if poison_outputs else []
    if poison:
        kernel = functools.partial(_skip_poison, kernel, len(poison))
    new = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct(v.shape, v.dtype) for v in fields],
        input_output_aliases={len(inputs) + i: i for i in range(len(poison))},
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=1),
        name="estimator_observe",
    )(*inputs, *poison)
    return state.replace(**dict(zip(FIELDS, new)))
