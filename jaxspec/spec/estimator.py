"""Online acceptance estimator (docs/design.md section 6).

A logistic model of "draft k is accepted given drafts < k were", calibrated while serving:

    p_k = sigmoid(a * x_k + b_k),      survival s_k = prod_{j<=k} p_j,

with one slope ``a`` shared by all draft positions, one intercept ``b_k`` per position, and the
feature ``x_k = logit(q_max,k)`` of the temperature-scaled draft distribution (`features`).

Everything is a pure function over a device-resident `EstimatorState` pytree, so it can run
inside the jitted decode step: `observe` adds the Newton (IRLS) statistics of a step's labels,
evaluated at the current coefficients, and at the calls of its refit schedule it takes one damped
Newton step, selected on the device call counter: early refits at calls ``first_refit * 2^j`` below
``refit_interval`` (4, 8, 16, 32, 64 by default: calibrated within the first ~50 steps), then every
``refit_interval`` calls (`refit_calls`). The selection is branch-free (the step is
computed every call and kept only when due, `jnp.where`): an XLA GPU conditional copies its
predicate to the host and waits, which costs more per step than computing the refit every time
(docs/design.md section 1). Nothing here reads a value back to the host. Under sharding (a
batch-sharded ``x``) the statistics are sums over the batch, so every device ends with the same
replicated state.

The Newton system of the negative log-likelihood, with ridge ``r`` added to the diagonal, is an
arrowhead: a dense slope row/column and a diagonal intercept block,

    [ Sum w x^2 + r    (Sum_k w x)^T       ] [da]   [ Sum (y-p) x   ]
    [ Sum_k w x        diag(Sum_k w + r)   ] [db] = [ Sum_k (y-p)   ],

solved in O(P) by the Schur complement of the diagonal block (`arrowhead_solve`). The step is
damped by f = n / (n + damping) (n = observations since the last refit), i.e. it solves
``H d = f g``. A slope step that would make the slope negative is halved (at most 8 times) and
dropped if it still does; the intercepts then take their Newton step given the slope step
actually taken: ``db = (f g_b - h_ab da) / (h_bb + r)``, which is exactly ``f`` times the
Newton step when the slope step was not cut. Last, a trust region scales (da, db) by one factor
so that no position's logit moves by more than MAX_LOGIT_STEP at a typical observation:
``|da x̄_k + db_k| + |da| sd(x) <= MAX_LOGIT_STEP`` (x̄_k and sd(x) weighted by w, from the
statistics). Far from the data (every p near 0 or 1) the weights vanish and the raw Newton step
is huge and overshoots; features of a narrow range (random-weight drafts) make the slope and the
intercepts nearly collinear, so the step would swing them against each other without it. A
non-finite step is dropped whole.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec.config import FIRST_REFIT
from jaxspec.ops import sampling
from jaxspec.ops.dispatch import use_kernel
from jaxspec.pallas import observe as pallas_observe

FEATURE_CLAMP = 40.0  # |x| <= 40: logit(q_max) is clamped (q_max = 1 exactly gives +inf)
MAX_SLOPE_HALVINGS = 8
MAX_LOGIT_STEP = 4.0  # a refit moves the logit of a typical observation by at most this much

__all__ = [
    "EstimatorState",
    "init",
    "features",
    "predict",
    "observe",
    "refit",
    "arrowhead_solve",
    "trust_scale",
    "refit_calls",
    "FEATURE_CLAMP",
]


@struct.dataclass
class EstimatorState:
    """Device state of the estimator: coefficients, Newton statistics since the last refit, and
    the call counter. Hyper-parameters are static (part of the tree structure)."""

    slope: jax.Array  # []    a, float32, kept >= 0
    intercepts: jax.Array  # [P]   b_k, float32
    h_xx: jax.Array  # []    Sum w x^2          (w = p (1 - p))
    h_x: jax.Array  # [P]   Sum_k w x          (per position)
    h_1: jax.Array  # [P]   Sum_k w
    g_x: jax.Array  # []    Sum (y - p) x
    g_1: jax.Array  # [P]   Sum_k (y - p)
    n: jax.Array  # []    int32 observations since the last refit
    calls: jax.Array  # []    int32 `observe` calls so far
    refit_interval: int = struct.field(pytree_node=False, default=100)
    early_refits: tuple[int, ...] = struct.field(pytree_node=False, default=())
    ridge: float = struct.field(pytree_node=False, default=1e-3)
    damping: float = struct.field(pytree_node=False, default=50.0)

    @property
    def num_positions(self) -> int:
        return self.intercepts.shape[-1]


def _early_refits(first_refit: int, refit_interval: int) -> tuple[int, ...]:
    """The calls first_refit * 2^j below refit_interval."""
    calls = []
    while first_refit and (first_refit << len(calls)) < refit_interval:
        calls.append(first_refit << len(calls))
    return tuple(calls)


def refit_calls(count: int, *, refit_interval: int = 100, first_refit: int = FIRST_REFIT) -> list[int]:
    """The first `count` values of the call counter (1-based, after the call) at which `observe`
    refits, for an estimator made by init(..., refit_interval, first_refit)."""
    early = list(_early_refits(first_refit, refit_interval))
    return (early + [refit_interval * (j + 1) for j in range(count)])[:count]


def refit_due(calls, refit_interval: int, early_refits: tuple[int, ...]):
    """Whether call number `calls` (int32, 1-based) refits: the early calls, then every interval
    (an unrolled chain of compares: no table, no branch)."""
    due = calls % refit_interval == 0
    for call in early_refits:
        due = due | (calls == call)
    return due


def _check(name, value, ok, rule):
    if not ok:
        raise ValueError(f"estimator {name}={value!r}: {rule}")


def init(
    num_positions: int,
    *,
    slope: float = 0.5,
    intercept: float | Sequence[float] = -0.2,
    refit_interval: int = 100,
    first_refit: int = FIRST_REFIT,
    ridge: float = 1e-3,
    damping: float = 50.0,
) -> EstimatorState:
    """A fresh estimator for ``num_positions`` draft positions (block size - 1).

    ``intercept`` is one value for every position or a sequence of ``num_positions`` values.
    Refits at calls first_refit, 2 first_refit, 4 first_refit, ... below refit_interval, then at
    every multiple of refit_interval (first_refit = 0: the multiples only).
    """
    _check(
        "num_positions",
        num_positions,
        isinstance(num_positions, int) and not isinstance(num_positions, bool) and num_positions >= 1,
        "must be an int >= 1",
    )
    _check(
        "slope",
        slope,
        isinstance(slope, (int, float)) and math.isfinite(slope) and slope >= 0,
        "must be a finite number >= 0 (the slope is kept non-negative)",
    )
    _check(
        "refit_interval",
        refit_interval,
        isinstance(refit_interval, int) and not isinstance(refit_interval, bool) and refit_interval >= 1,
        "must be an int >= 1",
    )
    _check(
        "first_refit",
        first_refit,
        isinstance(first_refit, int) and not isinstance(first_refit, bool) and first_refit >= 0,
        "must be an int >= 0 (0: no early refits)",
    )
    _check(
        "ridge",
        ridge,
        isinstance(ridge, (int, float)) and math.isfinite(ridge) and ridge > 0,
        "must be a finite number > 0",
    )
    _check(
        "damping",
        damping,
        isinstance(damping, (int, float)) and math.isfinite(damping) and damping >= 0,
        "must be a finite number >= 0",
    )
    if isinstance(intercept, (int, float)):
        _check("intercept", intercept, math.isfinite(intercept), "must be finite")
        b = jnp.full((num_positions,), intercept, jnp.float32)
    else:
        vals = [float(v) for v in intercept]
        _check(
            "intercept",
            intercept,
            len(vals) == num_positions and all(math.isfinite(v) for v in vals),
            f"must be one finite number or {num_positions} finite numbers",
        )
        b = jnp.asarray(vals, jnp.float32)
    # distinct buffers per field, so the state can be donated to a jitted step
    zero = lambda: jnp.zeros((), jnp.float32)
    zeros = lambda: jnp.zeros((num_positions,), jnp.float32)
    return EstimatorState(
        slope=jnp.asarray(slope, jnp.float32),
        intercepts=b,
        h_xx=zero(),
        h_x=zeros(),
        h_1=zeros(),
        g_x=zero(),
        g_1=zeros(),
        n=jnp.zeros((), jnp.int32),
        calls=jnp.zeros((), jnp.int32),
        refit_interval=int(refit_interval),
        early_refits=_early_refits(first_refit, refit_interval),
        ridge=float(ridge),
        damping=float(damping),
    )


# --------------------------------------------------------------------------------- feature


def features(draft_logits: jax.Array, temperature) -> jax.Array:
    """x = logit(q_max) of the temperature-scaled draft distribution: [..., P, V] -> [..., P].

    ``temperature`` broadcasts against ``draft_logits.shape[:-2]`` (one value per row, or a
    scalar); rows with temperature <= 0 (greedy) use 1. Clamped to +-40.

    Computed without forming q: with z = logits / T and z* = max z,
        logit(q_max) = log q_max - log(1 - q_max) = z* - logsumexp_{i != argmax} z_i
                     = -log( Sum_{i != argmax} exp(z_i - z*) ),
    where the sum over the non-maximal entries is taken directly (tied maxima each add 1), so
    there is no cancellation in 1 - q_max even when q_max rounds to 1. Non-finite logits give a
    non-finite feature (which `observe` ignores and `predict` treats as least confident).
    """
    x = _feature_logits(draft_logits, temperature)
    return jnp.clip(x, -FEATURE_CLAMP, FEATURE_CLAMP)


def _scaled_logits(draft_logits, temperature):
    """z = logits / T in float32 [..., P, V], T broadcast to [...]; rows with T <= 0 use T = 1."""
    draft_logits = jnp.asarray(draft_logits)
    t = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), draft_logits.shape[:-2])
    return sampling.scaled_logits(draft_logits, t)


def _feature_logits(draft_logits, temperature):
    """The jnp form of `features` before the clamp (two passes over the logits)."""
    _, _, ties, rest = sampling.logit_stats(_scaled_logits(draft_logits, temperature))
    return _logit_q_max(ties, rest)


def _logit_q_max(ties, rest):
    # (ties - 1) first: with a unique maximum rest stays exact (1 + rest - 1 would cancel)
    return -jnp.log(rest + (ties - 1.0))


def distribution_features(q: sampling.DraftDistribution) -> jax.Array:
    """`features` of a step's `sampling.DraftDistribution` (the engine's draft side): the same
    statistics, so the feature costs no pass over the logits of its own. -> [..., P] float32,
    clamped to +-40."""
    return jnp.clip(_logit_q_max(q.ties, q.rest), -FEATURE_CLAMP, FEATURE_CLAMP)


# -------------------------------------------------------------------------- predict/observe


def _clean_features(x):
    """Clamp to +-40; NaN becomes -40 (least confident)."""
    x = jnp.asarray(x, jnp.float32)
    return jnp.where(jnp.isnan(x), -FEATURE_CLAMP, jnp.clip(x, -FEATURE_CLAMP, FEATURE_CLAMP))


def _check_positions(state, x):
    if x.shape[-1] != state.num_positions:
        raise ValueError(
            f"estimator features shape {tuple(x.shape)}: last axis must be the "
            f"{state.num_positions} draft positions of the state"
        )


def predict(state: EstimatorState, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-position acceptance p [..., P] and survival s [..., P] (s_k = prod_{j<=k} p_j).

    The product is taken left to right, so s is exactly non-increasing along a row (a product
    with a factor in [0, 1] never rounds up) - the planner's prefix property relies on it.
    """
    x = _clean_features(x)
    _check_positions(state, x)
    p = jax.nn.sigmoid(state.slope * x + state.intercepts)
    s = [p[..., 0]]
    for k in range(1, x.shape[-1]):
        s.append(s[-1] * p[..., k])
    return p, jnp.stack(s, axis=-1)


def observe(
    state: EstimatorState, x: jax.Array, verified: jax.Array, accepted: jax.Array, *, impl: str = "auto"
) -> EstimatorState:
    """Add one step's labels to the Newton statistics; refit at the calls of the schedule
    (`refit_calls`).

    x [B, P] features of the drafts, verified [B] drafts verified, accepted [B] drafts accepted.
    Positions < accepted are labelled 1; position == accepted is labelled 0 if it was verified
    (accepted < verified); later positions are not observed. Positions whose feature is not
    finite contribute nothing (selected away). Rows with verified = 0 (padding) observe nothing.

    impl: "auto" (the kernel on a GPU, else jnp), "ref" (jnp: several small XLA kernels on the
    GPU) or "pallas" (`jaxspec.pallas.observe`: statistics and refit in one launch).
    """
    x = jnp.asarray(x, jnp.float32)
    if x.ndim != 2:
        raise ValueError(f"estimator observe: x must be [batch, positions], got {x.shape}")
    _check_positions(state, x)
    B, P = x.shape
    verified, accepted = jnp.asarray(verified), jnp.asarray(accepted)
    if verified.shape != (B,) or accepted.shape != (B,):
        raise ValueError(
            f"estimator observe: verified {verified.shape} and accepted "
            f"{accepted.shape} must both be [{B}] (one per row of x)"
        )
    if use_kernel("observe", impl, lambda: pallas_observe.supports(state, x, verified, accepted)):
        return pallas_observe.observe(state, x, verified, accepted)
    k = jnp.arange(P, dtype=jnp.int32)[None, :]
    ver = verified.astype(jnp.int32)[:, None]
    acc = accepted.astype(jnp.int32)[:, None]
    pos = k < jnp.minimum(acc, ver)  # label 1
    neg = (k == acc) & (acc < ver)  # label 0: the first rejection
    finite = jnp.isfinite(x)
    obs = (pos | neg) & finite
    xs = jnp.where(finite, jnp.clip(x, -FEATURE_CLAMP, FEATURE_CLAMP), 0.0)
    z = state.slope * xs + state.intercepts
    p, q = jax.nn.sigmoid(z), jax.nn.sigmoid(-z)  # p and 1 - p without cancellation
    w = jnp.where(obs, p * q, 0.0)
    r = jnp.where(obs, jnp.where(pos, q, -p), 0.0)  # y - p
    # one reduction over the batch for all six statistics (one kernel on the GPU, not six), with
    # the batch the minor axis: a row reduction, XLA's fastest kind
    terms = (w * xs * xs, w * xs, w, r * xs, r, obs.astype(jnp.float32))
    sums = jnp.sum(jnp.stack([t.T for t in terms]), axis=-1)  # [6, P]
    state = state.replace(
        h_xx=state.h_xx + _sum_positions(sums[0]),
        h_x=state.h_x + sums[1],
        h_1=state.h_1 + sums[2],
        g_x=state.g_x + _sum_positions(sums[3]),
        g_1=state.g_1 + sums[4],
        n=state.n + _sum_positions(sums[5]).astype(jnp.int32),  # exact: counts < 2^24 per step
        calls=state.calls + 1,
    )
    due = refit_due(state.calls, state.refit_interval, state.early_refits)
    return jax.tree_util.tree_map(lambda new, old: jnp.where(due, new, old), refit(state), state)


def _all_finite(v):
    """Whether every position of v is finite, without a reduce (see `_sum_positions`)."""
    return jnp.isfinite(_sum_positions(v * 0.0))


def _sum_positions(v):
    """Sum over the (few) draft positions as an unrolled chain of adds, left to right: elementwise
    work XLA fuses into its neighbours, where a reduce would start a kernel of its own."""
    total = v[..., 0]
    for k in range(1, v.shape[-1]):
        total = total + v[..., k]
    return total


# ------------------------------------------------------------------------------------ refit


def arrowhead_solve(h_aa, h_ab, h_bb, g_a, g_b, ridge):
    """Solve [[h_aa + r, h_ab^T], [h_ab, diag(h_bb + r)]] [da; db] = [g_a; g_b] by the Schur
    complement of the diagonal block. -> (da [], db [P]).

    For a PSD Hessian the exact Schur complement is >= r (Cauchy-Schwarz); it is clamped there so
    float32 cancellation on a near-singular system cannot flip its sign.
    """
    d = h_bb + ridge
    schur = jnp.maximum(h_aa + ridge - _sum_positions(h_ab * h_ab / d), ridge)
    da = (g_a - _sum_positions(h_ab * g_b / d)) / schur
    db = (g_b - h_ab * da) / d
    return da, db


def trust_scale(da, db, h_xx, h_x, h_1, live=None):
    """The factor in (0, 1] that keeps the step's logit change within MAX_LOGIT_STEP: over
    positions k (those with `live` [P] True), max |da x̄_k + db_k| + |da| sd(x), where x̄_k =
    h_x,k / h_1,k (the overall weighted mean where position k has no weight) and sd(x) is the
    weighted standard deviation of every observation."""
    live = jnp.ones(h_1.shape, bool) if live is None else live
    total = jnp.sum(jnp.where(live, h_1, 0.0))
    safe = jnp.maximum(total, jnp.float32(1e-30))
    mean = jnp.sum(jnp.where(live, h_x, 0.0)) / safe
    sd = jnp.sqrt(jnp.maximum(h_xx / safe - mean * mean, 0.0))
    x_bar = jnp.where(h_1 > 0, h_x / jnp.where(h_1 > 0, h_1, 1.0), mean)
    change = jnp.where(live, jnp.abs(da * x_bar + db) + jnp.abs(da) * sd, 0.0)
    worst = jnp.max(change)
    return jnp.where(worst > MAX_LOGIT_STEP, MAX_LOGIT_STEP / jnp.where(worst > 0, worst, 1.0), 1.0)


def refit(state: EstimatorState) -> EstimatorState:
    """One damped Newton step from the accumulated statistics, then clear them (keeps `calls`)."""
    ridge = jnp.float32(state.ridge)
    n = state.n.astype(jnp.float32)
    f = n / (n + jnp.float32(state.damping))
    da, db = arrowhead_solve(state.h_xx, state.h_x, state.h_1, state.g_x, state.g_1, ridge)
    ok = jnp.isfinite(f) & jnp.isfinite(da) & _all_finite(db)
    a = state.slope
    da = f * da
    for _ in range(MAX_SLOPE_HALVINGS):
        da = jnp.where(a + da < 0, da * 0.5, da)
    da = jnp.where(a + da < 0, 0.0, da)
    db = (f * state.g_1 - state.h_x * da) / (state.h_1 + ridge)  # given the slope step taken
    scale = trust_scale(da, db, state.h_xx, state.h_x, state.h_1)
    da, db = scale * da, scale * db
    ok = ok & jnp.isfinite(da) & _all_finite(db)
    new_a = jnp.where(ok, a + da, a)
    new_b = jnp.where(ok, state.intercepts + db, state.intercepts)
    ok = jnp.isfinite(new_a) & _all_finite(new_b)
    zero = jnp.zeros_like
    return state.replace(
        slope=jnp.where(ok, new_a, a),
        intercepts=jnp.where(ok, new_b, state.intercepts),
        h_xx=zero(state.h_xx),
        h_x=zero(state.h_x),
        h_1=zero(state.h_1),
        g_x=zero(state.g_x),
        g_1=zero(state.g_1),
        n=zero(state.n),
    )
