"""The estimator's `observe` (statistics and refit) as one Pallas Triton launch.

Contract: `jaxspec.spec.estimator.observe` (its jnp form, impl="ref", is the semantics: the labels,
the Newton statistics and the damped arrowhead step; docs/design.md section 6).

Why a kernel: the work is tiny (B x P features), so its cost on the GPU is the number of launches,
and XLA compiles the jnp form into several small kernels (the statistics, their reduction, then
small fusions for the refit's divides and selects). Here one program walks the batch in
`block_b`-row tiles (masked rows and positions add nothing), keeps the ten sums in registers, adds
them to the state, computes the refit every call and keeps it when the schedule says (`refit_due`)
(no branch, as the jnp form) and writes the fourteen state fields (`FIELDS`). The per-slot
history is read and written by the caller (`estimator.observe`): the kernel takes each row's
history feature h.

Layout: x [B, P] float32 (non-finite features observe nothing), h [B] float32, verified /
accepted [B] int32; state scalars are 0-d, per-position fields [P]. The padded tile is [block_b, P_pad] (powers of
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
FIELDS = (
    "slope",
    "history_slope",
    "intercepts",
    "h_xx",
    "h_x",
    "h_1",
    "g_x",
    "g_1",
    "h_xh",
    "h_hh",
    "h_h",
    "g_h",
    "n",
    "calls",
)


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
    hist_ref,
    ver_ref,
    acc_ref,
    slope_ref,
    c_ref,
    b_ref,
    h_xx_ref,
    h_x_ref,
    h_1_ref,
    g_x_ref,
    g_1_ref,
    h_xh_ref,
    h_hh_ref,
    h_h_ref,
    g_h_ref,
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
    c = c_ref[...]
    b = load_vec(b_ref)
    rows = jnp.arange(block_b, dtype=jnp.int32)

    def tile(i, sums):
        r = i * block_b + rows
        live_r = r < batch
        x = plgpu.load(
            x_ref.at[pl.ds(i * block_b, block_b), pl.ds(0, p_pad)], mask=live_r[:, None] & live_k[None, :], other=0.0
        )  # [Bt, P_pad]
        h = plgpu.load(hist_ref.at[pl.ds(i * block_b, block_b)], mask=live_r, other=0.0)[:, None]
        ver = plgpu.load(ver_ref.at[pl.ds(i * block_b, block_b)], mask=live_r, other=0)[:, None]
        acc = plgpu.load(acc_ref.at[pl.ds(i * block_b, block_b)], mask=live_r, other=0)[:, None]
        pos = (k[None, :] < jnp.minimum(acc, ver)) & live_k[None, :]  # label 1
        neg = (k[None, :] == acc) & (acc < ver) & live_k[None, :]  # label 0
        finite = _finite(x)
        obs = (pos | neg) & finite
        xs = jnp.where(finite, jnp.clip(x, -FEATURE_CLAMP, FEATURE_CLAMP), 0.0)
        z = slope * xs + c * h + b[None, :]
        p, q = _sigmoid(z), _sigmoid(-z)  # p, 1 - p
        w = jnp.where(obs, p * q, 0.0)
        res = jnp.where(obs, jnp.where(pos, q, -p), 0.0)  # y - p
        terms = (w * xs * xs, w * xs, w, res * xs, res, obs.astype(jnp.float32), w * xs * h, w * h * h, w * h, res * h)
        return tuple(s + jnp.sum(t, axis=0) for s, t in zip(sums, terms))

    zeros = jnp.zeros((p_pad,), jnp.float32)
    sums = jax.lax.fori_loop(0, pl.cdiv(batch, block_b), tile, (zeros,) * 10)
    h_xx = h_xx_ref[...] + jnp.sum(sums[0])
    h_x = load_vec(h_x_ref) + sums[1]
    h_1 = load_vec(h_1_ref) + sums[2]
    g_x = g_x_ref[...] + jnp.sum(sums[3])
    g_1 = load_vec(g_1_ref) + sums[4]
    n = n_ref[...] + jnp.sum(sums[5]).astype(jnp.int32)
    h_xh = h_xh_ref[...] + jnp.sum(sums[6])
    h_hh = h_hh_ref[...] + jnp.sum(sums[7])
    h_h = load_vec(h_h_ref) + sums[8]
    g_h = g_h_ref[...] + jnp.sum(sums[9])
    calls = calls_ref[...] + 1

    # the damped arrowhead Newton step (jaxspec.spec.estimator.schur_system / arrowhead_solve / refit)
    def all_finite(v):
        return jnp.sum(jnp.where(live_k & ~_finite(v), 1, 0)) == 0

    def over_k(v):
        return jnp.sum(jnp.where(live_k, v, 0.0))

    nf = n.astype(jnp.float32)
    f = nf / (nf + damping)
    d = h_1 + ridge
    s_aa = jnp.maximum(h_xx + ridge - over_k(h_x * h_x / d), ridge)
    s_cc = jnp.maximum(h_hh + ridge - over_k(h_h * h_h / d), ridge)
    s_ac = h_xh - over_k(h_x * h_h / d)
    r_a = g_x - over_k(h_x * g_1 / d)
    r_c = g_h - over_k(h_h * g_1 / d)
    det = jnp.maximum(s_aa * s_cc - s_ac * s_ac, ridge * ridge)
    da = (s_cc * r_a - s_ac * r_c) / det
    dc = (s_aa * r_c - s_ac * r_a) / det
    db = (g_1 - h_x * da - h_h * dc) / d
    ok = _finite(f) & _finite(da) & _finite(dc) & all_finite(db)
    da = f * da
    for _ in range(MAX_SLOPE_HALVINGS):
        da = jnp.where(slope + da < 0, da * 0.5, da)
    da = jnp.where(slope + da < 0, 0.0, da)
    dc = (f * r_c - s_ac * da) / s_cc
    db = (f * g_1 - h_x * da - h_h * dc) / d
    # the trust region (jaxspec.spec.estimator.trust_scale)
    total = jnp.maximum(over_k(h_1), 1e-30)
    change, spread = db, 0.0
    for step, h_v, h_vv in ((da, h_x, h_xx), (dc, h_h, h_hh)):
        mean = over_k(h_v) / total
        sd = jnp.sqrt(jnp.maximum(h_vv / total - mean * mean, 0.0))
        change = change + step * jnp.where(h_1 > 0, h_v / jnp.where(h_1 > 0, h_1, 1.0), mean)
        spread = spread + jnp.abs(step) * sd
    worst = jnp.max(jnp.where(live_k, jnp.abs(change) + spread, 0.0))
    scale = jnp.where(worst > MAX_LOGIT_STEP, MAX_LOGIT_STEP / jnp.where(worst > 0, worst, 1.0), 1.0)
    da, dc, db = scale * da, scale * dc, scale * db
    ok = ok & _finite(da) & _finite(dc) & all_finite(db)
    new_a = jnp.where(ok, slope + da, slope)
    new_c = jnp.where(ok, c + dc, c)
    new_b = jnp.where(ok, b + db, b)
    ok = _finite(new_a) & _finite(new_c) & all_finite(new_b)
    due = calls % refit_interval == 0  # the schedule (jaxspec.spec.estimator.refit_due)
    for call in early_refits:
        due = due | (calls == call)

    out = dict(
        slope=jnp.where(due & ok, new_a, slope),
        history_slope=jnp.where(due & ok, new_c, c),
        intercepts=jnp.where(due & ok, new_b, b),
        h_xx=jnp.where(due, 0.0, h_xx),
        h_x=jnp.where(due, 0.0, h_x),
        h_1=jnp.where(due, 0.0, h_1),
        g_x=jnp.where(due, 0.0, g_x),
        g_1=jnp.where(due, 0.0, g_1),
        h_xh=jnp.where(due, 0.0, h_xh),
        h_hh=jnp.where(due, 0.0, h_hh),
        h_h=jnp.where(due, 0.0, h_h),
        g_h=jnp.where(due, 0.0, g_h),
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
    first = 4 + len(FIELDS)  # x, h, verified, accepted, then the state fields
    return kernel(*refs[:first], *refs[first + count :])


def _poisoned(v):
    """A buffer of NaN (floats) or INT_MIN (ints): a field the kernel fails to write stays so."""
    fill = jnp.nan if jnp.issubdtype(v.dtype, jnp.floating) else jnp.iinfo(v.dtype).min
    return jnp.full(v.shape, fill, v.dtype)


def observe(
    state,
    x,
    h,
    verified,
    accepted,
    *,
    config: ObserveConfig | None = None,
    interpret: bool | None = None,
    poison_outputs: bool = False,
):
    """`jaxspec.spec.estimator.observe`'s statistics and refit in one launch, h [B] each row's
    history feature: -> the new EstimatorState (its history untouched).

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
    inputs = [
        jnp.asarray(x, jnp.float32),
        jnp.asarray(h, jnp.float32),
        jnp.asarray(verified, jnp.int32),
        jnp.asarray(accepted, jnp.int32),
        *fields,
    ]
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
