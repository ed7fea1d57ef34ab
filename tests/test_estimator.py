"""Online acceptance estimator (docs/design.md section 6): recovery of a known logistic model, the
refit against an independent float64 numpy Newton step, the arrowhead solve against a dense
solve, features against a float64 oracle, robustness to non-finite inputs, no host transfers,
determinism, and replicated state on a sharded batch (4 CPU devices, in a subprocess).
"""

import argparse
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.config import FIRST_REFIT, SpecConfig
from jaxspec.ops import sampling
from jaxspec.spec import calibration
from jaxspec.spec import estimator as est

# the two forms of the feature: from the logits, and from the engine's draft distribution
FEATURE_FORMS = {
    "logits": est.features,
    "distribution": lambda logits, t: est.distribution_features(sampling.draft_distribution(logits, t)),
}

# ------------------------------------------------------------------------------------ helpers


def gen(rng, calls, batch, slope, intercepts, mu=0.5, sd=2.0, full=0.75):
    """Steps drawn from the logistic model: x ~ N(mu, sd); draft k accepted with probability
    sigmoid(slope x_k + b_k) given drafts < k were; verified = P for a fraction `full` of rows,
    else uniform in [1, P]. -> x [C, B, P] f32, verified [C, B], accepted [C, B] int32."""
    P = len(intercepts)
    x = rng.normal(mu, sd, (calls, batch, P)).astype(np.float32)
    p = 1.0 / (1.0 + np.exp(-(slope * x.astype(np.float64) + np.asarray(intercepts))))
    rej = rng.random((calls, batch, P)) >= p
    first = np.where(rej.any(-1), rej.argmax(-1), P)
    ver = np.where(rng.random((calls, batch)) < full, P, rng.integers(1, P + 1, (calls, batch)))
    return x, ver.astype(np.int32), np.minimum(first, ver).astype(np.int32)


@jax.jit
def run_calls(state, x, verified, accepted):
    """observe once per leading index; returns the final state and the slope/intercepts after
    every call."""

    def body(s, inp):
        s = est.observe(s, *inp)
        return s, (s.slope, s.intercepts)

    return jax.lax.scan(body, state, (x, verified, accepted))


def after_refits(traj, interval):
    """Coefficients right after each refit from a `run_calls` trajectory."""
    slopes, intercepts = (np.asarray(t) for t in traj)
    return slopes[interval - 1 :: interval], intercepts[interval - 1 :: interval]


_observe = jax.jit(est.observe)
_refit = jax.jit(est.refit)


@pytest.mark.parametrize(
    "first_refit,interval,want",
    [
        (8, 100, [8, 16, 32, 64, 100, 200]),
        (4, 20, [4, 8, 16, 20, 40, 60]),
        (0, 25, [25, 50, 75, 100, 125, 150]),
        (8, 8, [8, 16, 24, 32, 40, 48]),
        (3, 13, [3, 6, 12, 13, 26, 39]),
    ],
    ids=["first-8", "early-then-20", "no-early", "first-is-interval", "odd"],
)
def test_refit_schedule(first_refit, interval, want):
    """refit_calls lists the schedule, and observe refits (resets its statistics) exactly there."""
    assert est.refit_calls(len(want), refit_interval=interval, first_refit=first_refit) == want
    rng = np.random.default_rng(first_refit * 1000 + interval)
    x = jnp.asarray(rng.standard_normal((6, 3)), jnp.float32)
    verified, accepted = jnp.full((6,), 3, jnp.int32), jnp.asarray(rng.integers(0, 4, 6), jnp.int32)
    state = est.init(3, refit_interval=interval, first_refit=first_refit)
    resets = []
    for call in range(1, want[-1] + 1):
        state = _observe(state, x, verified, accepted)  # every call observes: n > 0 unless it refit
        if int(state.n) == 0:
            resets.append(call)
    assert resets == want


def np_history_feature(history):
    """h of history rows [..., 3] (A, N, Q) in float64, from the spec."""
    a, n, q = (np.asarray(history, np.float64)[..., i] for i in range(3))
    return np.log((a + 1) / (n - a + 1)) - np.log((q + 1) / (n - q + 1))


def np_stats(a, b, x, verified, accepted, c=0.0, h=None):
    """float64 labels and IRLS statistics, written from the spec; h [B] the rows' history feature
    (None: 0)."""
    x = np.asarray(x, np.float64)
    B, P = x.shape
    h = np.zeros((B, 1)) if h is None else np.asarray(h, np.float64)[:, None]
    y = np.full((B, P), np.nan)
    for i in range(B):
        for k in range(P):
            if k < accepted[i]:
                y[i, k] = 1.0
            elif k == accepted[i] and accepted[i] < verified[i]:
                y[i, k] = 0.0
    obs = ~np.isnan(y) & np.isfinite(x)
    xs = np.where(obs, x, 0.0)
    hs = np.where(obs, h, 0.0)
    p = 1.0 / (1.0 + np.exp(-(a * xs + c * hs + b)))
    w = np.where(obs, p * (1 - p), 0.0)
    r = np.where(obs, np.nan_to_num(y) - p, 0.0)

    def bar_sd(v):  # per-position weighted means (the overall one where a position has no weight), sd
        mean = (w * v).sum() / w.sum()
        bar = np.where(w.sum(0) > 0, (w * v).sum(0) / np.maximum(w.sum(0), 1e-300), mean)
        return bar, np.sqrt(max((w * (v - mean) ** 2).sum() / w.sum(), 0.0))

    (x_bar, sd), (h_bar, sd_h) = bar_sd(xs), bar_sd(hs)
    return dict(
        h_xx=(w * xs * xs).sum(),
        h_x=(w * xs).sum(0),
        h_1=w.sum(0),
        g_x=(r * xs).sum(),
        g_1=r.sum(0),
        h_xh=(w * xs * hs).sum(),
        h_hh=(w * hs * hs).sum(),
        h_h=(w * hs).sum(0),
        g_h=(r * hs).sum(),
        n=int(obs.sum()),
        x_bar=x_bar,
        sd=sd,
        h_bar=h_bar,
        sd_h=sd_h,
    )


def np_newton(a, b, st, ridge, damping, c=0.0):
    """One damped Newton step by dense solves, with the slope rule of the spec: -> (a', b', the
    full damped step [da, dc, db...], trust scale, c')."""
    P = len(b)
    H = np.zeros((P + 2, P + 2))
    H[0, 0], H[0, 1], H[1, 1] = st["h_xx"], st["h_xh"], st["h_hh"]
    H[1, 0] = H[0, 1]
    H[0, 2:] = H[2:, 0] = st["h_x"]
    H[1, 2:] = H[2:, 1] = st["h_h"]
    H[2:, 2:] = np.diag(st["h_1"])
    H += ridge * np.eye(P + 2)
    g = np.r_[st["g_x"], st["g_h"], st["g_1"]]
    f = st["n"] / (st["n"] + damping)
    step = f * np.linalg.solve(H, g)
    da = step[0]
    halvings = 0
    while a + da < 0 and halvings < 8:
        da /= 2
        halvings += 1
    if a + da < 0:
        da = 0.0
    rest = np.linalg.solve(H[1:, 1:], f * g[1:] - H[1:, 0] * da)  # c and b given the da taken
    dc, db = rest[0], rest[1:]
    worst = np.max(np.abs(da * st["x_bar"] + dc * st["h_bar"] + db) + abs(da) * st["sd"] + abs(dc) * st["sd_h"])
    scale = min(1.0, est.MAX_LOGIT_STEP / worst)  # the trust region
    return a + scale * da, np.asarray(b) + scale * db, step, scale, c + scale * dc


# ------------------------------------------------------------------------------------- init


def test_init_defaults_and_validation():
    s = est.init(7)
    assert s.num_positions == 7 and float(s.slope) == 0.5
    np.testing.assert_array_equal(np.asarray(s.intercepts), np.full(7, -0.2, np.float32))
    assert (s.refit_interval, s.ridge, s.damping) == (100, 1e-3, 50.0)
    # one default first refit (config.FIRST_REFIT) for the estimator, its schedule, the engine and the CLI
    cli = calibration.add_arguments(argparse.ArgumentParser()).parse_args(["trace.npz"])
    assert FIRST_REFIT == SpecConfig().first_refit == cli.first_refit == 2
    assert s.early_refits == (2, 4, 8, 16, 32, 64) and est.refit_calls(7) == [2, 4, 8, 16, 32, 64, 100]
    assert int(s.calls) == 0 and int(s.n) == 0
    s = est.init(3, intercept=[0.1, 0.2, 0.3])
    np.testing.assert_allclose(np.asarray(s.intercepts), [0.1, 0.2, 0.3], rtol=1e-6)
    assert s.history.shape == (2, 3) and float(s.history_slope) == 0.0 and s.history_decay == est.HISTORY_DECAY
    assert est.init(3, num_slots=5).history.shape == (6, 3)
    for kwargs, field in [
        (dict(num_slots=0), "num_slots"),
        (dict(history_decay=1.5), "history_decay"),
        (dict(num_positions=0), "num_positions"),
        (dict(slope=-1.0), "slope"),
        (dict(refit_interval=0), "refit_interval"),
        (dict(first_refit=-1), "first_refit"),
        (dict(ridge=0.0), "ridge"),
        (dict(damping=-1.0), "damping"),
        (dict(intercept=[1.0]), "intercept"),
        (dict(intercept=float("nan")), "intercept"),
    ]:
        kwargs = {"num_positions": 4, **kwargs}
        with pytest.raises(ValueError, match=field):
            est.init(kwargs.pop("num_positions"), **kwargs)


def test_predict_survival_is_the_running_product():
    s = est.init(5, slope=0.8, intercept=[0.5, 0.2, 0.0, -0.3, -1.0])
    x = np.random.default_rng(0).normal(0, 3, (64, 5)).astype(np.float32)
    x[0, 2] = np.nan  # NaN feature: treated as least confident (-40)
    x[1, 1] = np.inf
    p, surv = jax.jit(est.predict)(s, x)
    p, surv = np.asarray(p, np.float64), np.asarray(surv)
    xr = np.where(np.isnan(x), -40.0, np.clip(x, -40, 40)).astype(np.float64)
    ref = 1 / (1 + np.exp(-(0.8 * xr + np.array([0.5, 0.2, 0.0, -0.3, -1.0]))))
    np.testing.assert_allclose(p, ref, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(surv, np.cumprod(ref, -1), rtol=1e-5, atol=1e-7)
    assert np.all(np.diff(surv, axis=-1) <= 0)  # exactly non-increasing along a row
    assert np.all(np.isfinite(surv)) and surv[0, 2] < 1e-6


# ------------------------------------------------------------------------------- recovery


def test_recovers_true_slope_and_intercepts():
    rng = np.random.default_rng(1)
    b_true = [1.0, 0.6, 0.2, -0.2]
    x, v, a = gen(rng, 200, 4096, 1.0, b_true)
    state, traj = run_calls(est.init(4, refit_interval=25), x, v, a)
    assert int(state.calls) == 200 and int(state.n) == 0  # 8 refits, statistics cleared
    slopes, _ = after_refits(traj, 25)
    assert abs(slopes[-1] - 1.0) < 0.05 and abs(slopes[-2] - 1.0) < 0.05
    np.testing.assert_allclose(np.asarray(state.intercepts), b_true, atol=0.05)


def test_converges_from_a_steep_slope_within_ten_refits():
    rng = np.random.default_rng(2)
    b_true = [0.8, 0.4, 0.0, -0.4]
    x, v, a = gen(rng, 250, 1024, 1.0, b_true)
    _, traj = run_calls(est.init(4, slope=3.0, refit_interval=25), x, v, a)
    slopes, intercepts = after_refits(traj, 25)
    assert len(slopes) == 10
    assert abs(slopes[-1] - 1.0) < 0.1, slopes
    assert np.all(np.isfinite(intercepts))


@pytest.mark.parametrize("true_slope", [0.0, 0.03])
def test_no_signal_keeps_the_slope_small_and_non_negative(true_slope):
    rng = np.random.default_rng(3)
    x, v, a = gen(rng, 300, 1024, true_slope, [0.5, 0.0, -0.5, -1.0], mu=1.0)
    state, traj = run_calls(est.init(4, refit_interval=25), x, v, a)  # default start a = 0.5
    slopes, _ = after_refits(traj, 25)
    assert np.all(slopes >= 0), slopes
    assert 0.0 <= float(state.slope) <= 0.1, slopes


# ----------------------------------------------------------------------- the Newton step


@pytest.mark.parametrize("history", ["none", "rows"], ids=["h-zero", "h-per-row"])
def test_arrowhead_solve_equals_a_dense_solve(history):
    rng = np.random.default_rng(4)
    for P in (1, 3, 7, 15):
        x = rng.normal(1.0, 2.0, (200, P))
        h = np.zeros((200, 1)) if history == "none" else rng.normal(0.3, 1.0, (200, 1))
        w = rng.uniform(0.0, 0.25, (200, P))
        h_aa, h_ac, h_cc = (w * x * x).sum(), (w * x * h).sum(), (w * h * h).sum()
        h_ab, h_cb, h_bb = (w * x).sum(0), (w * h).sum(0), w.sum(0)
        g_a, g_c, g_b = rng.normal(0, 5), (0.0 if history == "none" else rng.normal(0, 5)), rng.normal(0, 5, P)
        ridge = 1e-3
        args = [jnp.asarray(v, jnp.float32) for v in (h_aa, h_ac, h_cc, h_ab, h_cb, h_bb, g_a, g_c, g_b)]
        da, dc, db = jax.jit(est.arrowhead_solve)(*args, ridge)
        H = np.zeros((P + 2, P + 2))
        H[0, 0], H[0, 1], H[1, 0], H[1, 1] = h_aa, h_ac, h_ac, h_cc
        H[0, 2:] = H[2:, 0] = h_ab
        H[1, 2:] = H[2:, 1] = h_cb
        H[2:, 2:] = np.diag(h_bb)
        ref = np.linalg.solve(H + ridge * np.eye(P + 2), np.r_[g_a, g_c, g_b])
        got = np.r_[float(da), float(dc), np.asarray(db, np.float64)]
        np.testing.assert_allclose(got, ref, rtol=2e-4, atol=2e-5)
        if history == "none":
            assert float(dc) == 0.0  # the one-slope system


@pytest.mark.parametrize("case", ["plain", "halved", "dropped", "trust", "history", "history-halved"])
def test_one_refit_is_one_damped_newton_step(case):
    rng = np.random.default_rng(5)
    P, B = 5, 300
    b0 = [0.3, 0.1, -0.1, -0.2, -0.4]
    c0, slots, h = 0.0, None, None
    if case.startswith("history"):  # every row its own slot, with a history; c starts at 0.4
        c0, slots = 0.4, jnp.arange(1, B + 1, dtype=jnp.int32)
        n = rng.uniform(0, 40, B + 1)
        history = np.stack([n * rng.random(B + 1), n, n * rng.random(B + 1)], -1).astype(np.float32)
        h = np_history_feature(history[1:])
        case = case.replace("history-", "").replace("history", "plain")
    if case == "plain":  # data slope 1.2 from a = 0.7: an ordinary step
        a0, x, v, acc = 0.7, *(t[0] for t in gen(rng, 1, B, 1.2, b0))
    elif case == "halved":  # data slope -1 from a = 0.05: the step is halved until a >= 0
        a0, x, v, acc = 0.05, *(t[0] for t in gen(rng, 1, B, -1.0, b0))
    elif case == "dropped":  # from a = 0 a negative step can never be taken: dropped
        a0, x, v, acc = 0.0, *(t[0] for t in gen(rng, 1, B, -1.0, b0))
    else:  # from intercepts of -12 (every p ~ 0) the Newton step overshoots: the trust region cuts it
        a0, x, v, acc = 0.7, *(t[0] for t in gen(rng, 1, B, 1.2, b0))
        b0 = [-12.0] * P
    state = est.init(P, slope=a0, intercept=b0, refit_interval=1, num_slots=B)
    if slots is not None:
        state = state.replace(history=jnp.asarray(history), history_slope=jnp.asarray(c0, jnp.float32))
    a32, c32 = float(state.slope), float(state.history_slope)
    b32 = np.asarray(state.intercepts, np.float64)
    st = np_stats(a32, b32, x, v, acc, c32, h)
    a_ref, b_ref, full_step, scale, c_ref = np_newton(a32, b32, st, 1e-3, 50.0, c32)
    if case == "plain":
        assert a32 + full_step[0] > 0
    elif case != "trust":
        assert a32 + full_step[0] < 0
    assert (scale < 0.5) == (case == "trust"), scale
    if case == "dropped":
        assert a_ref == a32
    new = _observe(state, x, v, acc, slots)  # refit_interval = 1: refits on this call
    assert int(new.n) == 0 and float(new.h_xx) == 0.0 and float(new.h_hh) == 0.0
    np.testing.assert_allclose(float(new.slope), a_ref, atol=1e-5)
    np.testing.assert_allclose(float(new.history_slope), c_ref, atol=1e-5)
    np.testing.assert_allclose(np.asarray(new.intercepts), b_ref, atol=1e-5)
    if slots is None:
        assert float(new.history_slope) == 0.0
    else:
        assert abs(c_ref - c32) > 1e-3  # the history slope took a step


def test_statistics_match_numpy_before_the_refit():
    rng = np.random.default_rng(6)
    B = 257
    x, v, acc = (t[0] for t in gen(rng, 1, B, 1.0, [0.5, 0.0, -0.5]))
    state = est.init(3, slope=0.6, intercept=[0.1, 0.0, -0.1], num_slots=300)
    n = rng.uniform(0, 25, 301)
    history = np.stack([n * rng.random(301), n, n * rng.random(301)], -1).astype(np.float32)
    state = state.replace(history=jnp.asarray(history), history_slope=jnp.asarray(0.3, jnp.float32))
    slots = rng.permutation(300)[:B] + 1
    slots[:5] = 0  # padding rows of the null slot: h = 0, no history written
    v[:5], acc[:5] = 0, 0
    new = _observe(state, x, v, acc, jnp.asarray(slots, jnp.int32))
    h = np.where(slots > 0, np_history_feature(history[slots]), 0.0)
    st = np_stats(0.6, np.asarray(state.intercepts, np.float64), x, v, acc, 0.3, h)
    for name in ("h_xx", "h_x", "h_1", "g_x", "g_1", "h_xh", "h_hh", "h_h", "g_h"):
        np.testing.assert_allclose(np.asarray(getattr(new, name)), st[name], rtol=1e-5, atol=1e-4, err_msg=name)
    assert int(new.n) == st["n"] and int(new.calls) == 1
    np.testing.assert_array_equal(np.asarray(new.slope), np.asarray(state.slope))  # no refit yet


# --------------------------------------------------------------------------- the history


def test_history_feature_matches_numpy():
    rng = np.random.default_rng(13)
    n = rng.uniform(0, 60, 500)
    history = np.stack([n * rng.random(500), n, n * rng.random(500)], -1)
    history[:3] = [[0, 0, 0], [10, 10, 10], [0, 10, 9.5]]  # empty; all accepted as expected; far below
    got = np.asarray(jax.jit(est.history_feature)(jnp.asarray(history, jnp.float32)), np.float64)
    np.testing.assert_allclose(got, np_history_feature(history), rtol=1e-5, atol=1e-5)
    assert got[0] == 0.0 and abs(got[1]) < 1e-6 and got[2] < -2.0


def test_observe_adds_the_step_to_the_slot_histories():
    """decay * (A, N, Q) + the step's accepted drafts, observed positions and Sum q_max (non-finite
    features observed by nothing), for the rows' slots only; slot 0 and other slots unchanged."""
    rng = np.random.default_rng(14)
    P, B, R = 6, 40, 64
    x, v, acc = (t[0] for t in gen(rng, 1, B, 1.0, np.linspace(1, -1, P), full=0.5))
    x[0, 1], x[1, 0] = np.nan, np.inf
    state = est.init(P, num_slots=R, history_decay=0.8)
    n = rng.uniform(0, 25, R + 1)
    history = np.stack([n * rng.random(R + 1), n, n * rng.random(R + 1)], -1).astype(np.float32)
    state = state.replace(history=jnp.asarray(history))
    slots = rng.permutation(R)[:B] + 1
    slots[-3:] = 0  # padding rows
    v[-3:], acc[-3:] = 0, 0
    new = np.asarray(_observe(state, x, v, acc, jnp.asarray(slots, jnp.int32)).history, np.float64)
    want = history.astype(np.float64)
    k = np.arange(P)[None, :]
    finite = np.isfinite(x)
    obs = ((k < np.minimum(acc, v)[:, None]) | ((k == acc[:, None]) & (acc < v)[:, None])) & finite
    yes = obs & (k < acc[:, None])
    q = 1 / (1 + np.exp(-np.clip(np.where(finite, x, 0.0), -40, 40)))
    for i, slot in enumerate(slots):
        if slot:
            want[slot] = 0.8 * want[slot] + [yes[i].sum(), obs[i].sum(), (q[i] * obs[i]).sum()]
    np.testing.assert_allclose(new, want, rtol=1e-5, atol=1e-5)
    assert not np.allclose(new[slots[:-3]], history[slots[:-3]])  # the rows' slots did change


def test_reset_history_empties_the_slots_but_never_the_null_slot():
    state = est.init(3, num_slots=5).replace(history=jnp.ones((6, 3), jnp.float32))
    got = np.asarray(jax.jit(est.reset_history)(state, jnp.asarray([2, 0, 5], jnp.int32)).history)
    np.testing.assert_array_equal(got[:, 0], [1, 1, 0, 1, 1, 0])


def test_predict_adds_the_slot_history():
    rng = np.random.default_rng(15)
    s = est.init(4, slope=0.7, intercept=[0.4, 0.1, -0.2, -0.6], num_slots=9)
    n = rng.uniform(0, 30, 10)
    history = np.stack([n * rng.random(10), n, n * rng.random(10)], -1).astype(np.float32)
    s = s.replace(history=jnp.asarray(history), history_slope=jnp.asarray(0.9, jnp.float32))
    x = rng.normal(0, 2, (9, 4)).astype(np.float32)
    slots = np.arange(1, 10, dtype=np.int32)
    p, surv = jax.jit(est.predict)(s, x, slots)
    h = np_history_feature(history[slots])[:, None]
    ref = 1 / (1 + np.exp(-(0.7 * x.astype(np.float64) + 0.9 * h + np.array([0.4, 0.1, -0.2, -0.6]))))
    np.testing.assert_allclose(np.asarray(p, np.float64), ref, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(surv, np.float64), np.cumprod(ref, -1), rtol=1e-5, atol=1e-7)
    p0, _ = jax.jit(est.predict)(s, x)  # no slots: no history
    np.testing.assert_allclose(
        np.asarray(p0, np.float64),
        1 / (1 + np.exp(-(0.7 * x.astype(np.float64) + np.array([0.4, 0.1, -0.2, -0.6])))),
        rtol=1e-5,
        atol=1e-7,
    )
    with pytest.raises(ValueError, match="slots"):
        est.predict(s, x, slots[:4])


@pytest.mark.parametrize("spread", [0.0, 1.5], ids=["no-request-effect", "request-offsets"])
def test_learns_the_history_slope(spread):
    """Requests whose acceptance is offset by u ~ N(0, spread) in the logit, 32 slots, each slot taking
    a new request every 40 steps (reset): the history slope grows where requests differ and stays
    near 0 where they do not."""
    rng = np.random.default_rng(16)
    P, B = 7, 32
    state = est.init(P, refit_interval=20, num_slots=B)
    offset = rng.normal(0, spread, B)
    slots = jnp.arange(1, B + 1, dtype=jnp.int32)
    step = jax.jit(est.observe)
    for call in range(240):
        if call % 40 == 0:
            offset = rng.normal(0, spread, B)
            state = est.reset_history(state, slots)
        x = rng.normal(0.5, 2.0, (B, P)).astype(np.float32)
        p = 1 / (1 + np.exp(-(x + offset[:, None] + np.linspace(0.5, -0.5, P))))
        rej = rng.random((B, P)) >= p
        acc = np.where(rej.any(-1), rej.argmax(-1), P).astype(np.int32)
        state = step(state, x, np.full(B, P, np.int32), acc, slots)
    c = float(state.history_slope)
    if spread:
        assert c > 0.3, c
    else:
        assert abs(c) < 0.15, c


# ----------------------------------------------------------------------------- features


def np_features(logits, temperature):
    logits = np.asarray(logits, np.float64)
    out = np.empty(logits.shape[:-1])
    for idx in np.ndindex(*logits.shape[:-1]):
        t = temperature[idx[:-1]] if np.ndim(temperature) else temperature
        t = t if t > 0 else 1.0
        z = logits[idx] / t
        p = np.exp(z - z.max())
        p /= p.sum()
        i = int(np.argmax(p))
        rest = np.delete(p, i).sum()  # 1 - q_max as the sum of the others
        out[idx] = np.log(p[i]) - np.log(rest) if rest > 0 else np.inf
    return np.clip(out, -40, 40)


@pytest.mark.parametrize("form", FEATURE_FORMS)
def test_features_match_a_float64_oracle(form):
    fn = FEATURE_FORMS[form]
    rng = np.random.default_rng(7)
    B, P, V = 4, 6, 50
    logits = rng.normal(0, 2, (B, P, V)).astype(np.float32)
    logits[0, 0, 3] = 30.0  # q_max = 1 - ~1e-11: rounds to 1 in float32
    logits[0, 1, 7] = 14.0  # q_max near 1, still resolvable in float32 terms
    logits[0, 2, :] = 0.0  # uniform: logit(1/50) = -log 49
    logits[1, 0, 5] = logits[1, 0, 9] = 20.0  # a tie at the maximum: logit(~1/2) ~ 0
    logits[2, 3, 1] = 60.0  # clamps at +40
    temperature = np.array([0.0, 0.7, 1.0, 2.5], np.float32)  # row 0 greedy -> temperature 1
    x = np.asarray(jax.jit(fn)(logits, temperature), np.float64)
    ref = np_features(logits, temperature)
    np.testing.assert_allclose(x, ref, rtol=1e-5, atol=2e-5)
    others = np.delete(logits[0, 0].astype(np.float64), 3)
    assert abs(x[0, 0] - (30 - np.log(np.exp(others).sum()))) < 1e-4 and x[2, 3] == 40.0
    assert np.float32(jax.nn.softmax(jnp.asarray(logits[0, 0])).max()) == 1.0
    np.testing.assert_allclose(x[0, 2], -np.log(49), rtol=1e-6)
    # naive log q - log(1 - q) in float32 loses the near-1 case entirely
    q = jax.nn.softmax(jnp.asarray(logits[0, 0])).max()
    assert (
        not np.isfinite(float(jnp.log(q) - jnp.log1p(-q))) or abs(float(jnp.log(q) - jnp.log1p(-q)) - ref[0, 0]) > 1.0
    )


def test_features_edge_cases():
    feats = jax.jit(est.features)
    one = feats(jnp.zeros((2, 3, 1)), jnp.ones(2))  # V = 1: q_max = 1
    np.testing.assert_array_equal(np.asarray(one), np.full((2, 3), 40.0, np.float32))
    bad = np.zeros((1, 2, 8), np.float32)
    bad[0, 0, 2] = np.nan
    x = np.asarray(feats(bad, 1.0))  # scalar temperature
    assert np.isnan(x[0, 0]) and np.isclose(x[0, 1], -np.log(7))
    masked = np.full((1, 1, 8), -np.inf, np.float32)
    masked[0, 0, :2] = [1.0, 0.0]  # vocab masking
    np.testing.assert_allclose(np.asarray(feats(masked, 1.0)), [[1.0]], rtol=1e-6)
    bf = feats(jnp.asarray(np.random.default_rng(0).normal(0, 1, (3, 4, 16)), jnp.bfloat16), jnp.zeros(3))
    assert bf.dtype == jnp.float32 and bf.shape == (3, 4)


@pytest.mark.parametrize("form", FEATURE_FORMS)
def test_features_special_rows(form):
    """+inf entries (one and tied), rows of -inf, a NaN, ragged temperatures, a large odd vocabulary;
    both forms bit for bit the same."""
    rng = np.random.default_rng(9)
    logits = rng.normal(0, 3, (3, 5, 1001)).astype(np.float32)
    logits[0, 0, 17] = np.inf  # q_max = 1: clamps at +40
    logits[0, 1, [3, 900]] = np.inf  # two tied maxima: logit(1/2) = 0
    logits[0, 2, :] = -np.inf  # all tied: logit(1/1001) = -log 1000
    logits[0, 3, 5] = np.nan
    logits[1, 4, :500] = -np.inf
    temperature = np.array([1.0, 0.3, 0.0], np.float32)
    x = np.asarray(jax.jit(FEATURE_FORMS[form])(logits, temperature))
    np.testing.assert_array_equal(x, np.asarray(jax.jit(est.features)(logits, temperature)))
    np.testing.assert_allclose(x[0, :3], [40.0, 0.0, -np.log(1000.0)], rtol=1e-6)
    assert np.isnan(x[0, 3]) and np.isnan(x).sum() == 1
    np.testing.assert_allclose(x[0, 4], np_features(logits[:1, 4:], temperature[:1])[0, 0], rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(x[1:], np_features(logits[1:], temperature[1:]), rtol=1e-5, atol=2e-5)


# ------------------------------------------------------------------------ non-finite input


def test_nonfinite_features_contribute_nothing():
    rng = np.random.default_rng(8)
    x, v, acc = (t[0] for t in gen(rng, 1, 200, 1.0, [0.5, 0.2, -0.1, -0.4]))
    bad = x.copy()
    bad[3, :] = np.nan  # a whole row
    bad[10, 0], bad[11, 2], bad[12, 1] = np.inf, -np.inf, np.nan
    state = est.init(4)
    got = _observe(state, bad, v, acc)
    st = np_stats(float(state.slope), np.asarray(state.intercepts, np.float64), bad, v, acc)
    for name in ("h_xx", "h_x", "h_1", "g_x", "g_1"):
        val = np.asarray(getattr(got, name))
        assert np.all(np.isfinite(val))
        np.testing.assert_allclose(val, st[name], rtol=1e-5, atol=1e-4)
    assert int(got.n) == st["n"]
    # a NaN row is as if the row had not been there
    row_nan = x.copy()
    row_nan[3, :] = np.nan
    with_row = _observe(state, row_nan, v, acc)
    without = _observe(state, np.delete(x, 3, 0), np.delete(v, 3), np.delete(acc, 3))
    assert int(with_row.n) == int(without.n)
    for name in ("h_xx", "h_x", "h_1", "g_x", "g_1"):
        np.testing.assert_allclose(
            np.asarray(getattr(with_row, name)), np.asarray(getattr(without, name)), rtol=1e-6, atol=1e-6
        )
    only_row = _observe(state, row_nan[3:4], v[3:4], acc[3:4])
    assert int(only_row.n) == 0 and float(only_row.h_xx) == 0.0 and float(only_row.g_x) == 0.0


def test_poisoned_batches_never_make_coefficients_non_finite():
    rng = np.random.default_rng(9)
    x, v, acc = gen(rng, 40, 64, 1.0, [0.5, 0.2, -0.1, -0.4])
    x = x.copy()
    x[5] = np.nan  # a batch of NaN features
    x[9] = np.inf
    x[13] = 1e30  # huge but finite
    x[17, :, 1] = -3e38
    v, acc = v.copy(), acc.copy()
    v[21], acc[21] = 10**6, -7  # garbage counts
    v[22], acc[22] = -3, 10**6
    state, traj = run_calls(est.init(4, refit_interval=4), x, v, acc)
    assert np.all(np.isfinite(np.asarray(traj[0]))) and np.all(np.isfinite(np.asarray(traj[1])))
    assert float(state.slope) >= 0
    # statistics poisoned directly: the non-finite step is dropped whole
    for field, value in [("g_x", np.nan), ("h_xx", np.inf), ("g_1", np.full(4, -np.inf))]:
        s = est.init(4).replace(n=jnp.int32(1000), **{field: jnp.asarray(value, jnp.float32)})
        r = _refit(s)
        assert float(r.slope) == 0.5 and np.all(np.asarray(r.intercepts) == np.float32(-0.2))
        assert int(r.n) == 0 and np.isfinite(float(r.g_x)) and float(r.h_xx) == 0.0


# ------------------------------------------------------------- device residency, determinism


def test_runs_jitted_with_no_host_transfer():
    dev = jax.devices()[0]
    rng = np.random.default_rng(10)
    P, V, B = 4, 32, 8
    ver_np = rng.integers(0, P + 1, (3, B)).astype(np.int32)
    acc_np = np.minimum(rng.integers(0, P + 1, (3, B)), ver_np).astype(np.int32)
    steps = [
        jax.device_put((rng.normal(0, 2, (B, P, V)).astype(np.float32), ver_np[i], acc_np[i]), dev) for i in range(3)
    ]
    temp = jax.device_put(np.array([0.0, 0.5, 1.0, 1.0, 0.0, 2.0, 1.0, 0.7], np.float32), dev)
    state = jax.device_put(est.init(P, refit_interval=2), dev)

    @jax.jit
    def step(state, logits, temp, ver, acc):
        x = est.features(logits, temp)
        p, surv = est.predict(state, x)
        return est.observe(state, x, ver, acc), surv

    with jax.transfer_guard("disallow"):
        for logits, ver, acc in steps:  # the second call refits (selected on the counter)
            state, surv = step(state, logits, temp, ver, acc)
    assert int(state.calls) == 3 and surv.shape == (B, P)
    assert np.all(np.isfinite(np.asarray(state.intercepts)))


def test_same_inputs_give_bit_identical_coefficients():
    rng = np.random.default_rng(11)
    x, v, a = gen(rng, 60, 256, 0.9, [0.7, 0.3, -0.1])
    runs = []
    for _ in range(2):
        fn = jax.jit(lambda s, x, v, a: run_calls(s, x, v, a))  # a fresh compile each time
        state, _ = fn(est.init(3, refit_interval=20), x, v, a)
        runs.append(jax.tree_util.tree_map(np.asarray, state))
    for l0, l1 in zip(jax.tree_util.tree_leaves(runs[0]), jax.tree_util.tree_leaves(runs[1])):
        assert l0.tobytes() == l1.tobytes()


SHARDED_SCRIPT = textwrap.dedent("""
    import numpy as np, jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from jaxspec.spec import estimator as est
    assert jax.device_count() == 4, jax.devices()
    rng = np.random.default_rng(0)
    C, B, K = 30, 64, 5
    x = rng.normal(0.5, 2, (C, B, K)).astype(np.float32)
    p = 1 / (1 + np.exp(-(1.1 * x + np.linspace(0.8, -0.4, K))))
    rej = rng.random((C, B, K)) >= p
    first = np.where(rej.any(-1), rej.argmax(-1), K)
    ver = rng.integers(1, K + 1, (C, B)).astype(np.int32)
    acc = np.minimum(first, ver).astype(np.int32)

    def run(state, x, ver, acc):
        def body(s, inp):
            s = est.observe(s, *inp)
            _, surv = est.predict(s, inp[0])
            return s, surv
        return jax.lax.scan(body, state, (x, ver, acc))

    mesh = Mesh(np.array(jax.devices()), ("b",))
    rep = NamedSharding(mesh, P())
    state0 = jax.device_put(est.init(K, refit_interval=10), rep)
    xs = jax.device_put(x, NamedSharding(mesh, P(None, "b", None)))
    vs = jax.device_put(ver, NamedSharding(mesh, P(None, "b")))
    As = jax.device_put(acc, NamedSharding(mesh, P(None, "b")))
    state, surv = jax.jit(run)(state0, xs, vs, As)
    assert int(state.calls) == C
    for leaf in jax.tree_util.tree_leaves(state):
        assert leaf.sharding.is_fully_replicated, leaf.sharding
        shards = [np.asarray(s.data) for s in leaf.addressable_shards]
        assert len(shards) == 4
        assert all(s.tobytes() == shards[0].tobytes() for s in shards), shards
    ref, _ = jax.jit(run)(est.init(K, refit_interval=10), x, ver, acc)   # one device
    np.testing.assert_allclose(np.asarray(state.slope), np.asarray(ref.slope), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(state.intercepts), np.asarray(ref.intercepts),
                               rtol=1e-5, atol=1e-6)
    assert float(state.slope) != 0.5
    print("SHARDED OK", float(state.slope))
""")


def test_sharded_batch_keeps_state_replicated():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-c", SHARDED_SCRIPT], env=env, cwd=root, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SHARDED OK" in proc.stdout
