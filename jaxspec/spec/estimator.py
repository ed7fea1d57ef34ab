"""Online acceptance estimator (docs/design.md section 6).

A logistic model of "draft k is accepted given drafts < k were", calibrated while serving:

    p_k = sigmoid(a * x_k + c * h + b_k),      survival s_k = prod_{j<=k} p_j,

with slopes ``a`` and ``c`` shared by all draft positions, one intercept ``b_k`` per position,
the feature ``x_k = logit(q_max,k)`` of the temperature-scaled draft distribution (`features`)
and the request's history ``h`` (`history_feature`): how much more (or less) of its earlier drafts
were accepted than their q_max expected,

    h = log((A + 1) / (N - A + 1)) - log((Q + 1) / (N - Q + 1)),

where A, N and Q are the request's accepted drafts, observed positions and sum of q_max over
those positions, each step of age j weighted ``history_decay^j``. They live per slot in the state
(``history`` [num_slots + 1, 3]); `reset_history` zeroes a slot when it takes a request (h = 0
then), `observe` adds the step's counts after using the history from before the step. Requests
differ in how much of their text the draft can predict (repeats, boilerplate): q_max alone does
not see that, a request's own record does (bench/RESULTS.md, "Estimator calibration").

Everything is a pure function over a device-resident `EstimatorState` pytree, so it can run
inside the jitted decode step: `observe` adds the Newton (IRLS) statistics of a step's labels,
evaluated at the current coefficients, and at the calls of its refit schedule it takes one damped
Newton step, selected on the device call counter: early refits at calls ``first_refit * 2^j`` below
``refit_interval`` (2, 4, 8, 16, 32, 64 by default: calibrated within the first ~50 steps), then every
``refit_interval`` calls (`refit_calls`). The selection is branch-free (the step is
computed every call and kept only when due, `jnp.where`): an XLA GPU conditional copies its
predicate to the host and waits, which costs more per step than computing the refit every time
(docs/design.md section 1). Nothing here reads a value back to the host. Under sharding (a
batch-sharded ``x``) the statistics are sums over the batch, so every device ends with the same
replicated state.

The Newton system of the negative log-likelihood, with ridge ``r`` added to the diagonal, is an
arrowhead: a dense 2 x 2 slope block, two dense rows/columns and a diagonal intercept block,

    [ Sum w x^2 + r   Sum w x h         (Sum_k w x)^T     ] [da]   [ Sum (y-p) x ]
    [ Sum w x h       Sum w h^2 + r     (Sum_k w h)^T     ] [dc] = [ Sum (y-p) h ]
    [ Sum_k w x       Sum_k w h         diag(Sum_k w + r) ] [db]   [ Sum_k (y-p) ],

solved in O(P) by the Schur complement of the diagonal block, a 2 x 2 system (`arrowhead_solve`).
With h = 0 throughout (no history yet) it is the one-slope system and dc = 0. The step is damped
by f = n / (n + damping) (n = observations since the last refit), i.e. it solves ``H d = f g``.
A slope step that would make ``a`` negative is halved (at most 8 times) and dropped if it still
does; ``c`` then takes its Newton step given the ``da`` taken (``dc = (f g_c - S_ac da) / S_cc``
on the Schur complement S) and the intercepts theirs given both: ``db = (f g_b - h_ab da -
h_cb dc) / (h_bb + r)``, which is exactly ``f`` times the Newton step when ``da`` was not cut.
Last, a trust region scales (da, dc, db) by one factor so that no position's logit moves by more
than MAX_LOGIT_STEP at a typical observation: ``|da x̄_k + dc h̄_k + db_k| + |da| sd(x) + |dc|
sd(h) <= MAX_LOGIT_STEP`` (means and deviations weighted by w, from the statistics). Far from
the data (every p near 0 or 1) the weights vanish and the raw Newton step is huge and overshoots;
features of a narrow range (random-weight drafts) make the slope and the intercepts nearly
collinear, so the step would swing them against each other without it. A non-finite step is
dropped whole.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec.config import FIRST_REFIT
from jaxspec.ops import packing, sampling
from jaxspec.ops.dispatch import use_kernel
from jaxspec.pallas import observe as pallas_observe

FEATURE_CLAMP = 40.0  # |x| <= 40: logit(q_max) is clamped (q_max = 1 exactly gives +inf)
HISTORY_DECAY = 0.9  # a request's step of age j counts 0.9^j in its history (bench/RESULTS.md)
MAX_SLOPE_HALVINGS = 8
MAX_LOGIT_STEP = 4.0  # a refit moves the logit of a typical observation by at most this much

__all__ = [
    "EstimatorState",
    "init",
    "features",
    "predict",
    "observe",
    "history_feature",
    "reset_history",
    "refit",
    "arrowhead_solve",
    "schur_system",
    "solve_slopes",
    "trust_scale",
    "refit_calls",
    "FEATURE_CLAMP",
]


@struct.dataclass
class EstimatorState:
    """Device state of the estimator: coefficients, Newton statistics since the last refit, the
    per-slot request history and the call counter. Hyper-parameters are static (part of the tree
    structure)."""

    slope: jax.Array  # []    a, float32, kept >= 0
    history_slope: jax.Array  # []    c, float32
    intercepts: jax.Array  # [P]   b_k, float32
    h_xx: jax.Array  # []    Sum w x^2          (w = p (1 - p))
    h_x: jax.Array  # [P]   Sum_k w x          (per position)
    h_1: jax.Array  # [P]   Sum_k w
    g_x: jax.Array  # []    Sum (y - p) x
    g_1: jax.Array  # [P]   Sum_k (y - p)
    h_xh: jax.Array  # []    Sum w x h
    h_hh: jax.Array  # []    Sum w h^2
    h_h: jax.Array  # [P]   Sum_k w h
    g_h: jax.Array  # []    Sum (y - p) h
    n: jax.Array  # []    int32 observations since the last refit
    calls: jax.Array  # []    int32 `observe` calls so far
    history: jax.Array  # [R, 3] float32 per slot: decayed accepted A, observed N, Sum q_max Q
    refit_interval: int = struct.field(pytree_node=False, default=100)
    early_refits: tuple[int, ...] = struct.field(pytree_node=False, default=())
    ridge: float = struct.field(pytree_node=False, default=1e-3)
    damping: float = struct.field(pytree_node=False, default=50.0)
    history_decay: float = struct.field(pytree_node=False, default=HISTORY_DECAY)

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
    num_slots: int = 1,
    history_decay: float = HISTORY_DECAY,
) -> EstimatorState:
    """A fresh estimator for ``num_positions`` draft positions (block size - 1) and a history of
    ``num_slots`` slots plus the null slot 0 (rows num_slots + 1: the engine's slot numbering).

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
    _check(
        "num_slots",
        num_slots,
        isinstance(num_slots, int) and not isinstance(num_slots, bool) and num_slots >= 1,
        "must be an int >= 1",
    )
    _check(
        "history_decay",
        history_decay,
        isinstance(history_decay, (int, float)) and 0 <= history_decay <= 1,
        "must be a number in [0, 1] (the weight of a step one step older)",
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
        history_slope=zero(),
        intercepts=b,
        h_xx=zero(),
        h_x=zeros(),
        h_1=zeros(),
        g_x=zero(),
        g_1=zeros(),
        h_xh=zero(),
        h_hh=zero(),
        h_h=zeros(),
        g_h=zero(),
        n=jnp.zeros((), jnp.int32),
        calls=jnp.zeros((), jnp.int32),
        history=jnp.zeros((num_slots + 1, 3), jnp.float32),
        refit_interval=int(refit_interval),
        early_refits=_early_refits(first_refit, refit_interval),
        ridge=float(ridge),
        damping=float(damping),
        history_decay=float(history_decay),
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


def history_feature(history: jax.Array) -> jax.Array:
    """h of each row of a history [..., 3] (decayed accepted A, observed N, Sum q_max Q):
    log((A + 1) / (N - A + 1)) - log((Q + 1) / (N - Q + 1)), the request's log odds of acceptance
    so far minus those q_max predicted for the same positions. 0 for an empty history. -> [...]."""
    a, n, q = history[..., 0], history[..., 1], history[..., 2]
    return jnp.log((a + 1.0) / (n - a + 1.0)) - jnp.log((q + 1.0) / (n - q + 1.0))


def _row_history(state: EstimatorState, x, slots):
    """h [B] of the rows' slots (0 for every row when slots is None)."""
    if slots is None:
        return jnp.zeros(x.shape[:-1], jnp.float32)
    slots = jnp.asarray(slots)
    if slots.shape != x.shape[:-1]:
        raise ValueError(f"estimator slots {tuple(slots.shape)}: must be {tuple(x.shape[:-1])}, one per row of x")
    return history_feature(state.history[slots])


def reset_history(state: EstimatorState, slots: jax.Array) -> EstimatorState:
    """Empty the history of ``slots`` [R] (a slot taking a new request); slot 0 (the null slot)
    is left alone."""
    slots = jnp.asarray(slots)
    empty = jnp.zeros(slots.shape + state.history.shape[1:], state.history.dtype)
    return state.replace(history=packing.scatter_slots(state.history, slots, empty))


def predict(state: EstimatorState, x: jax.Array, slots: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Per-position acceptance p [..., P] and survival s [..., P] (s_k = prod_{j<=k} p_j) of the
    drafts with features x [..., P] of the requests in ``slots`` [...] (None: no history, h = 0).

    The product is taken left to right, so s is exactly non-increasing along a row (a product
    with a factor in [0, 1] never rounds up) - the planner's prefix property relies on it.
    """
    x = _clean_features(x)
    _check_positions(state, x)
    h = _row_history(state, x, slots)
    p = jax.nn.sigmoid(state.slope * x + (state.history_slope * h)[..., None] + state.intercepts)
    s = [p[..., 0]]
    for k in range(1, x.shape[-1]):
        s.append(s[-1] * p[..., k])
    return p, jnp.stack(s, axis=-1)


def _labels(x, verified, accepted):
    """Observed positions and label-1 positions [B, P]: positions < accepted are 1, position ==
    accepted is 0 if verified, later ones and non-finite features are not observed."""
    k = jnp.arange(x.shape[-1], dtype=jnp.int32)[None, :]
    ver = verified.astype(jnp.int32)[:, None]
    acc = accepted.astype(jnp.int32)[:, None]
    pos = k < jnp.minimum(acc, ver)  # label 1
    neg = (k == acc) & (acc < ver)  # label 0: the first rejection
    return (pos | neg) & jnp.isfinite(x), pos


def _add_history(state: EstimatorState, x, verified, accepted, slots) -> EstimatorState:
    """The rows' step added to their slots' history: A, N, Q <- decay * (A, N, Q) + the step's
    accepted drafts, observed positions and their Sum q_max."""
    obs, pos = _labels(x, verified, accepted)
    q = jax.nn.sigmoid(_clean_features(x))
    step = jnp.stack(
        [
            _sum_positions(jnp.where(obs & pos, 1.0, 0.0)),
            _sum_positions(jnp.where(obs, 1.0, 0.0)),
            _sum_positions(jnp.where(obs, q, 0.0)),
        ],
        axis=-1,
    )  # [B, 3]
    new = state.history_decay * state.history[slots] + step  # padding rows (slot 0) write nothing
    return state.replace(history=packing.scatter_slots(state.history, slots, new))


def observe(
    state: EstimatorState,
    x: jax.Array,
    verified: jax.Array,
    accepted: jax.Array,
    slots: jax.Array | None = None,
    *,
    impl: str = "auto",
) -> EstimatorState:
    """Add one step's labels to the Newton statistics; refit at the calls of the schedule
    (`refit_calls`); add the step to the history of ``slots``.

    x [B, P] features of the drafts, verified [B] drafts verified, accepted [B] drafts accepted,
    slots [B] the rows' slots (None: no history, h = 0; rows of slot 0 keep none). Positions <
    accepted are labelled 1; position == accepted is labelled 0 if it was verified (accepted <
    verified); later positions are not observed. Positions whose feature is not finite
    contribute nothing (selected away). Rows with verified = 0 (padding) observe nothing. The
    statistics use each row's history from before this step, as `predict` did.

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
    h = _row_history(state, x, slots)
    if use_kernel("observe", impl, lambda: pallas_observe.supports(state, x, verified, accepted)):
        new = pallas_observe.observe(state, x, h, verified, accepted)
    else:
        new = _observe_statistics(state, x, h, verified, accepted)
    return new if slots is None else _add_history(new, x, verified, accepted, jnp.asarray(slots))


def _observe_statistics(state, x, h, verified, accepted):
    """The jnp form of the statistics and the scheduled refit (`observe` without the history)."""
    obs, pos = _labels(x, verified, accepted)
    xs = jnp.where(jnp.isfinite(x), jnp.clip(x, -FEATURE_CLAMP, FEATURE_CLAMP), 0.0)
    hs = h[:, None]  # [B, 1]
    z = state.slope * xs + state.history_slope * hs + state.intercepts
    p, q = jax.nn.sigmoid(z), jax.nn.sigmoid(-z)  # p and 1 - p without cancellation
    w = jnp.where(obs, p * q, 0.0)
    r = jnp.where(obs, jnp.where(pos, q, -p), 0.0)  # y - p
    # one reduction over the batch for all ten statistics (one kernel on the GPU, not ten), with
    # the batch the minor axis: a row reduction, XLA's fastest kind
    terms = (w * xs * xs, w * xs, w, r * xs, r, obs.astype(jnp.float32), w * xs * hs, w * hs * hs, w * hs, r * hs)
    sums = jnp.sum(jnp.stack([jnp.broadcast_to(t, xs.shape).T for t in terms]), axis=-1)  # [10, P]
    state = state.replace(
        h_xx=state.h_xx + _sum_positions(sums[0]),
        h_x=state.h_x + sums[1],
        h_1=state.h_1 + sums[2],
        g_x=state.g_x + _sum_positions(sums[3]),
        g_1=state.g_1 + sums[4],
        n=state.n + _sum_positions(sums[5]).astype(jnp.int32),  # exact: counts < 2^24 per step
        h_xh=state.h_xh + _sum_positions(sums[6]),
        h_hh=state.h_hh + _sum_positions(sums[7]),
        h_h=state.h_h + sums[8],
        g_h=state.g_h + _sum_positions(sums[9]),
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


def schur_system(h_aa, h_ac, h_cc, h_ab, h_cb, h_bb, g_a, g_c, g_b, ridge):
    """The slopes' 2 x 2 system left after eliminating the intercepts from the ridged arrowhead
    system of the module docstring (slopes a, c; intercepts b): S [da, dc] = [r_a, r_c].
    -> (S_aa, S_ac, S_cc, r_a, r_c).

    For a PSD Hessian the exact Schur complement S is >= r I (Cauchy-Schwarz): its diagonal is
    clamped at r, so float32 cancellation on a near-singular system cannot flip its sign.
    """
    d = h_bb + ridge
    s_aa = jnp.maximum(h_aa + ridge - _sum_positions(h_ab * h_ab / d), ridge)
    s_cc = jnp.maximum(h_cc + ridge - _sum_positions(h_cb * h_cb / d), ridge)
    s_ac = h_ac - _sum_positions(h_ab * h_cb / d)
    r_a = g_a - _sum_positions(h_ab * g_b / d)
    r_c = g_c - _sum_positions(h_cb * g_b / d)
    return s_aa, s_ac, s_cc, r_a, r_c


def arrowhead_solve(h_aa, h_ac, h_cc, h_ab, h_cb, h_bb, g_a, g_c, g_b, ridge):
    """Solve the ridged arrowhead system (`schur_system`; the determinant of S clamped at r^2, its
    floor for a PSD Hessian). -> (da [], dc [], db [P])."""
    da, dc = solve_slopes(*schur_system(h_aa, h_ac, h_cc, h_ab, h_cb, h_bb, g_a, g_c, g_b, ridge), ridge)
    db = (g_b - h_ab * da - h_cb * dc) / (h_bb + ridge)
    return da, dc, db


def solve_slopes(s_aa, s_ac, s_cc, r_a, r_c, ridge):
    """The slope steps (da [], dc []) of `schur_system`'s 2 x 2 system, by Cramer's rule with the
    determinant clamped at r^2 (its floor for a PSD Hessian)."""
    det = jnp.maximum(s_aa * s_cc - s_ac * s_ac, ridge * ridge)
    return (s_cc * r_a - s_ac * r_c) / det, (s_aa * r_c - s_ac * r_a) / det


def trust_scale(da, dc, db, state, live=None):
    """The factor in (0, 1] that keeps the step's logit change within MAX_LOGIT_STEP: over
    positions k (those with `live` [P] True), max |da x̄_k + dc h̄_k + db_k| + |da| sd(x) +
    |dc| sd(h), where x̄_k = h_x,k / h_1,k (the overall weighted mean where position k has no
    weight), h̄_k likewise, and sd(.) is the weighted standard deviation of every observation."""
    h_1 = state.h_1
    live = jnp.ones(h_1.shape, bool) if live is None else live
    total = jnp.sum(jnp.where(live, h_1, 0.0))
    safe = jnp.maximum(total, jnp.float32(1e-30))
    change, spread = db, 0.0
    for step, h_v, h_vv in ((da, state.h_x, state.h_xx), (dc, state.h_h, state.h_hh)):
        mean = jnp.sum(jnp.where(live, h_v, 0.0)) / safe
        sd = jnp.sqrt(jnp.maximum(h_vv / safe - mean * mean, 0.0))
        v_bar = jnp.where(h_1 > 0, h_v / jnp.where(h_1 > 0, h_1, 1.0), mean)
        change = change + step * v_bar
        spread = spread + jnp.abs(step) * sd
    worst = jnp.max(jnp.where(live, jnp.abs(change) + spread, 0.0))
    return jnp.where(worst > MAX_LOGIT_STEP, MAX_LOGIT_STEP / jnp.where(worst > 0, worst, 1.0), 1.0)


def refit(state: EstimatorState) -> EstimatorState:
    """One damped Newton step from the accumulated statistics, then clear them (keeps `calls` and
    the history)."""
    ridge = jnp.float32(state.ridge)
    n = state.n.astype(jnp.float32)
    f = n / (n + jnp.float32(state.damping))
    stats = (state.h_xx, state.h_xh, state.h_hh, state.h_x, state.h_h, state.h_1, state.g_x, state.g_h, state.g_1)
    s_aa, s_ac, s_cc, r_a, r_c = schur_system(*stats, ridge)
    da, _ = solve_slopes(s_aa, s_ac, s_cc, r_a, r_c, ridge)
    ok = jnp.isfinite(f) & jnp.isfinite(da)
    a = state.slope
    da = f * da
    for _ in range(MAX_SLOPE_HALVINGS):
        da = jnp.where(a + da < 0, da * 0.5, da)
    da = jnp.where(a + da < 0, 0.0, da)
    dc = (f * r_c - s_ac * da) / s_cc  # given the slope step taken
    db = (f * state.g_1 - state.h_x * da - state.h_h * dc) / (state.h_1 + ridge)
    scale = trust_scale(da, dc, db, state)
    da, dc, db = scale * da, scale * dc, scale * db
    ok = ok & jnp.isfinite(da) & jnp.isfinite(dc) & _all_finite(db)
    new_a = jnp.where(ok, a + da, a)
    new_c = jnp.where(ok, state.history_slope + dc, state.history_slope)
    new_b = jnp.where(ok, state.intercepts + db, state.intercepts)
    ok = jnp.isfinite(new_a) & jnp.isfinite(new_c) & _all_finite(new_b)
    zero = jnp.zeros_like
    return state.replace(
        slope=jnp.where(ok, new_a, a),
        history_slope=jnp.where(ok, new_c, state.history_slope),
        intercepts=jnp.where(ok, new_b, state.intercepts),
        h_xx=zero(state.h_xx),
        h_x=zero(state.h_x),
        h_1=zero(state.h_1),
        g_x=zero(state.g_x),
        g_1=zero(state.g_1),
        h_xh=zero(state.h_xh),
        h_hh=zero(state.h_hh),
        h_h=zero(state.h_h),
        g_h=zero(state.g_h),
        n=zero(state.n),
    )
