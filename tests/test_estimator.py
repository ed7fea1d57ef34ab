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


def np_stats(a, b, x, verified, accepted):
    """float64 labels and IRLS statistics, written from the spec."""
    x = np.asarray(x, np.float64)
    B, P = x.shape
    y = np.full((B, P), np.nan)
    for i in range(B):
        for k in range(P):
            if k < accepted[i]:
                y[i, k] = 1.0
            elif k == accepted[i] and accepted[i] < verified[i]:
                y[i, k] = 0.0
    obs = ~np.isnan(y) & np.isfinite(x)
    xs = np.where(obs, x, 0.0)
    p = 1.0 / (1.0 + np.exp(-(a * xs + b)))
    w = np.where(obs, p * (1 - p), 0.0)
    r = np.where(obs, np.nan_to_num(y) - p, 0.0)
    x_mean = (w * xs).sum() / w.sum()
    return dict(
        h_xx=(w * xs * xs).sum(),
        h_x=(w * xs).sum(0),
        h_1=w.sum(0),
        g_x=(r * xs).sum(),
        g_1=r.sum(0),
        n=int(obs.sum()),
        x_bar=np.where(w.sum(0) > 0, (w * xs).sum(0) / np.maximum(w.sum(0), 1e-300), x_mean),
        sd=np.sqrt(max((w * (xs - x_mean) ** 2).sum() / w.sum(), 0.0)),
    )


def np_newton(a, b, st, ridge, damping):
    """One damped Newton step by a dense solve, with the slope rule of the spec."""
    P = len(b)
    H = np.zeros((P + 1, P + 1))
    H[0, 0] = st["h_xx"]
    H[0, 1:] = H[1:, 0] = st["h_x"]
    H[1:, 1:] = np.diag(st["h_1"])
    H += ridge * np.eye(P + 1)
    g = np.r_[st["g_x"], st["g_1"]]
    f = st["n"] / (st["n"] + damping)
    step = f * np.linalg.solve(H, g)
    da = step[0]
    halvings = 0
    while a + da < 0 and halvings < 8:
        da /= 2
        halvings += 1
    if a + da < 0:
        da = 0.0
    db = np.linalg.solve(H[1:, 1:], f * g[1:] - H[1:, 0] * da)
    worst = np.max(np.abs(da * st["x_bar"] + db) + abs(da) * st["sd"])  # the trust region
    scale = min(1.0, est.MAX_LOGIT_STEP / worst)
    return a + scale * da, np.asarray(b) + scale * db, step, scale


# ------------------------------------------------------------------------------------- init


def test_init_defaults_and_validation():
    s = est.init(7)
    assert s.num_positions == 7 and float(s.slope) == 0.5
    np.testing.assert_array_equal(np.asarray(s.intercepts), np.full(7, -0.2, np.float32))
    assert (s.refit_interval, s.ridge, s.damping) == (100, 1e-3, 50.0)
    # one default first refit (config.FIRST_REFIT) for the estimator, its schedule, the engine and the CLI
    cli = calibration.add_arguments(argparse.ArgumentParser()).parse_args(["trace.npz"])
    assert FIRST_REFIT == SpecConfig().first_refit == cli.first_refit == 4
    assert s.early_refits == (4, 8, 16, 32, 64) and est.refit_calls(6) == [4, 8, 16, 32, 64, 100]
    assert int(s.calls) == 0 and int(s.n) == 0
    s = est.init(3, intercept=[0.1, 0.2, 0.3])
    np.testing.assert_allclose(np.asarray(s.intercepts), [0.1, 0.2, 0.3], rtol=1e-6)
    for kwargs, field in [
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


def test_arrowhead_solve_equals_a_dense_solve():
    rng = np.random.default_rng(4)
    for P in (1, 3, 7, 15):
        x = rng.normal(1.0, 2.0, (200, P))
        w = rng.uniform(0.0, 0.25, (200, P))
        h_aa, h_ab, h_bb = (w * x * x).sum(), (w * x).sum(0), w.sum(0)
        g_a, g_b = rng.normal(0, 5), rng.normal(0, 5, P)
        ridge = 1e-3
        args = [jnp.asarray(v, jnp.float32) for v in (h_aa, h_ab, h_bb, g_a, g_b)]
        da, db = jax.jit(est.arrowhead_solve)(*args, ridge)
        H = np.zeros((P + 1, P + 1))
        H[0, 0], H[0, 1:], H[1:, 0], H[1:, 1:] = h_aa, h_ab, h_ab, np.diag(h_bb)
        ref = np.linalg.solve(H + ridge * np.eye(P + 1), np.r_[g_a, g_b])
        got = np.r_[float(da), np.asarray(db, np.float64)]
        np.testing.assert_allclose(got, ref, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("case", ["plain", "halved", "dropped", "trust"])
def test_one_refit_is_one_damped_newton_step(case):
    rng = np.random.default_rng(5)
    P, B = 5, 300
    b0 = [0.3, 0.1, -0.1, -0.2, -0.4]
    if case == "plain":  # data slope 1.2 from a = 0.7: an ordinary step
        a0, x, v, acc = 0.7, *(t[0] for t in gen(rng, 1, B, 1.2, b0))
    elif case == "halved":  # data slope -1 from a = 0.05: the step is halved until a >= 0
        a0, x, v, acc = 0.05, *(t[0] for t in gen(rng, 1, B, -1.0, b0))
    elif case == "dropped":  # from a = 0 a negative step can never be taken: dropped
        a0, x, v, acc = 0.0, *(t[0] for t in gen(rng, 1, B, -1.0, b0))
    else:  # from intercepts of -12 (every p ~ 0) the Newton step overshoots: the trust region cuts it
        a0, x, v, acc = 0.7, *(t[0] for t in gen(rng, 1, B, 1.2, b0))
        b0 = [-12.0] * P
    state = est.init(P, slope=a0, intercept=b0, refit_interval=1)
    a32 = float(state.slope)
    b32 = np.asarray(state.intercepts, np.float64)
    st = np_stats(a32, b32, x, v, acc)
    a_ref, b_ref, full_step, scale = np_newton(a32, b32, st, 1e-3, 50.0)
    if case == "plain":
        assert a32 + full_step[0] > 0
    elif case != "trust":
        assert a32 + full_step[0] < 0
    assert (scale < 0.5) == (case == "trust"), scale
    if case == "dropped":
        assert a_ref == a32
    new = _observe(state, x, v, acc)  # refit_interval = 1: refits on this call
    assert int(new.n) == 0 and float(new.h_xx) == 0.0
    np.testing.assert_allclose(float(new.slope), a_ref, atol=1e-5)
    np.testing.assert_allclose(np.asarray(new.intercepts), b_ref, atol=1e-5)


def test_statistics_match_numpy_before_the_refit():
    rng = np.random.default_rng(6)
    x, v, acc = (t[0] for t in gen(rng, 1, 257, 1.0, [0.5, 0.0, -0.5]))
    state = est.init(3, slope=0.6, intercept=[0.1, 0.0, -0.1])
    new = _observe(state, x, v, acc)
    st = np_stats(float(state.slope), np.asarray(state.intercepts, np.float64), x, v, acc)
    for name in ("h_xx", "h_x", "h_1", "g_x", "g_1"):
        np.testing.assert_allclose(np.asarray(getattr(new, name)), st[name], rtol=1e-5, atol=1e-4)
    assert int(new.n) == st["n"] and int(new.calls) == 1
    np.testing.assert_array_equal(np.asarray(new.slope), np.asarray(state.slope))  # no refit yet


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
