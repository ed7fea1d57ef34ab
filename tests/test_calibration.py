"""Estimator calibration tools: AUC against a brute-force pairwise count, ECE on calibrated and
miscalibrated data, the online replay (predict before observe), trace files, the recorder, the
reliability plot and the `jaxspec estimator` command.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.spec import calibration as cal
from jaxspec.spec import estimator as est


def synthetic_trace(rng, rows, slope, intercepts, mu=0.5, sd=2.0, temperature=False):
    """Rows drawn from the logistic model of the estimator (as in test_estimator)."""
    P = len(intercepts)
    x = rng.normal(mu, sd, (rows, P)).astype(np.float32)
    p = 1.0 / (1.0 + np.exp(-(slope * x.astype(np.float64) + np.asarray(intercepts))))
    rej = rng.random((rows, P)) >= p
    first = np.where(rej.any(-1), rej.argmax(-1), P)
    ver = np.where(rng.random(rows) < 0.7, P, rng.integers(1, P + 1, rows))
    temp = np.where(rng.random(rows) < 0.5, 0.0, 1.0).astype(np.float32) if temperature else None
    return cal.Trace(x, ver, np.minimum(first, ver), temp)


# ------------------------------------------------------------------------------------- AUC


def brute_auc(scores, labels):
    pos, neg = scores[labels], scores[~labels]
    wins = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return wins / (len(pos) * len(neg))


@pytest.mark.parametrize("seed", range(5))
def test_auc_equals_the_pairwise_count(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(5, 80))
    scores = rng.integers(0, 6, n).astype(np.float64) / 5  # many ties
    if seed % 2:
        scores = scores + rng.normal(0, 0.01, n)  # few ties
    labels = rng.random(n) < 0.4
    labels[0], labels[1] = True, False
    assert cal.auc(scores, labels) == pytest.approx(brute_auc(scores, labels), abs=1e-12)


def test_auc_edge_cases():
    assert cal.auc([0.1, 0.9], [False, True]) == 1.0
    assert cal.auc([0.9, 0.1], [False, True]) == 0.0
    assert cal.auc([0.5, 0.5, 0.5], [True, False, True]) == 0.5
    assert np.isnan(cal.auc([0.1, 0.2], [True, True]))
    with pytest.raises(ValueError):
        cal.auc([0.1, np.nan], [True, False])


# ------------------------------------------------------------------------------------- ECE


def test_ece_small_when_calibrated_large_when_not():
    rng = np.random.default_rng(0)
    pred = rng.random(40000)
    calibrated = rng.random(pred.size) < pred
    assert cal.ece(pred, calibrated) < 0.02
    overconfident = rng.random(pred.size) < 0.5 + 0.3 * (pred - 0.5)
    assert cal.ece(pred, overconfident) > 0.1
    assert cal.ece(pred, rng.random(pred.size) < pred**3) > 0.15
    # hand example: bin [0.2, 0.3) holds 0.2, 0.2 with labels 1, 0; bin [0.9, 1] holds 1.0 with 1
    assert cal.ece([0.2, 0.2, 1.0], [1, 0, 1]) == pytest.approx((2 * 0.3 + 0.0) / 3)
    r = cal.reliability_bins([0.2, 0.2, 1.0], [1, 0, 1])
    assert r["count"][2] == 2 and r["count"][9] == 1 and sum(r["count"]) == 3


# ---------------------------------------------------------------------------------- replay


def test_evaluate_on_a_known_model():
    rng = np.random.default_rng(1)
    slope, b = 0.8, [-0.5, -0.8, -1.1, -1.4, -1.7]
    trace = synthetic_trace(rng, 12000, slope, b, mu=1.5, temperature=True)
    truth = est.init(5, slope=slope, intercept=b, refit_interval=50)
    r = cal.evaluate(trace, truth, batch_rows=64)
    k = np.arange(5)[None, :]
    assert r["samples"] == int((k < trace.verified[:, None]).sum())
    # refits at calls 2, 4, 8, 16, 32 (early), then 50, 100, 150
    assert r["calls"] == -(-12000 // 64) == 188 and r["refits"] == 8
    # the estimator starts at the truth and stays calibrated; prod q_max overestimates
    for pp in r["per_position"]:
        assert pp["ece"] < 0.03, pp
    assert r["ece"] < 0.02 and r["ece_baseline"] > 0.1
    assert r["auc"] > r["auc_baseline"] > 0.75
    assert set(r["by_temperature"]) == {"0", "1"}
    assert abs(r["final_state"]["slope"] - slope) < 0.1
    # from the default start it learns the model while replaying
    r0 = cal.evaluate(trace, est.init(5, refit_interval=20), batch_rows=64)
    assert abs(r0["final_state"]["slope"] - slope) < 0.1
    assert r0["ece"] < r["ece_baseline"] / 2 and r0["auc_baseline"] == r["auc_baseline"]
    json.dumps(cal._json_ready(r))


def test_replay_predicts_before_it_observes():
    rng = np.random.default_rng(2)
    trace = synthetic_trace(rng, 40, 1.0, [0.5, 0.0, -0.5])
    state = est.init(3, refit_interval=1)  # refits after every call
    surv, final = cal.replay_online(trace, state, batch_rows=8)
    predict, observe = jax.jit(est.predict), jax.jit(est.observe)
    _, first = predict(state, trace.features[:8])  # the first call: untouched state
    np.testing.assert_array_equal(surv[:8], np.asarray(first, np.float64))
    s1 = observe(state, trace.features[:8], trace.verified[:8], trace.accepted[:8])
    _, second = predict(s1, trace.features[8:16])
    np.testing.assert_allclose(surv[8:16], np.asarray(second, np.float64), rtol=1e-6)
    assert int(final.calls) == 5
    # a step index groups rows into calls instead of fixed chunks
    stepped = cal.Trace(trace.features, trace.verified, trace.accepted, step=np.repeat(np.arange(4), [5, 15, 10, 10]))
    _, final = cal.replay_online(stepped, state)
    assert int(final.calls) == 4


def test_baseline_is_the_product_of_q_max():
    x = np.array([[0.0, 2.0, np.nan]], np.float32)
    q = 1 / (1 + np.exp(-np.array([0.0, 2.0, -40.0])))
    np.testing.assert_allclose(cal.baseline_survival(x)[0], np.cumprod(q), rtol=1e-12)


# ----------------------------------------------------------------------------- trace files


def test_trace_round_trip(tmp_path):
    rng = np.random.default_rng(3)
    t = synthetic_trace(rng, 50, 1.0, [0.3, 0.1, -0.2, -0.5], temperature=True)
    path = tmp_path / "trace"  # no suffix: written exactly there
    request = np.arange(50) % 3 + 10
    cal.save_trace(path, t.features, t.verified, t.accepted, t.temperature, step=np.arange(50) // 7, request=request)
    back = cal.load_trace(path)
    np.testing.assert_array_equal(back.features, t.features)
    np.testing.assert_array_equal(back.verified, t.verified)
    np.testing.assert_array_equal(back.accepted, t.accepted)
    np.testing.assert_array_equal(back.temperature, t.temperature)
    np.testing.assert_array_equal(back.step, np.arange(50) // 7)
    np.testing.assert_array_equal(back.request, request)
    assert back.features.dtype == np.float32 and back.verified.dtype == np.int32 and back.request.dtype == np.int64
    cal.save_trace(tmp_path / "plain.npz", t.features, t.verified, t.accepted)
    plain = cal.load_trace(tmp_path / "plain.npz")
    assert plain.temperature is None and plain.step is None and plain.request is None
    with pytest.raises(ValueError, match="request"):
        cal.Trace(t.features, t.verified, t.accepted, request=request[:-1])
    with pytest.raises(ValueError, match="accepted"):
        cal.Trace(t.features, t.verified, t.verified + 1)
    with pytest.raises(ValueError, match="verified"):
        cal.Trace(t.features, t.verified[:-1], t.accepted[:-1])


def test_recorder_keeps_device_arrays_and_drops_idle_rows(tmp_path):
    rec = cal.TraceRecorder()
    rng = np.random.default_rng(4)
    for _ in range(3):
        x = jnp.asarray(rng.normal(0, 1, (4, 3)), jnp.float32)
        ver = jnp.asarray([3, 0, 2, 3], jnp.int32)  # slot 1 idle
        acc = jnp.asarray([1, 0, 2, 3], jnp.int32)
        rec.add(x, ver, acc, jnp.asarray([0.0, 0.0, 1.0, 1.0]), [5, -1, 6, 7])
    t = rec.save(tmp_path / "rec.npz")
    assert t.num_rows == 9 and len(rec) == 3
    np.testing.assert_array_equal(t.step, np.repeat(np.arange(3), 3))
    np.testing.assert_array_equal(t.request, np.tile([5, 6, 7], 3))  # the idle row's -1 is dropped with it
    back = cal.load_trace(tmp_path / "rec.npz")
    np.testing.assert_array_equal(back.verified, t.verified)
    np.testing.assert_array_equal(back.request, t.request)
    rec.add(x, ver, acc)  # a step without request ids: the trace has no request column
    assert rec.trace().request is None and rec.trace().num_rows == 12


# ------------------------------------------------------------------------------ plot and CLI


def test_plot_and_cli(tmp_path, capsys):
    rng = np.random.default_rng(5)
    t = synthetic_trace(rng, 3000, 0.9, [0.4, 0.0, -0.4], temperature=True)
    path = tmp_path / "t.npz"
    cal.save_trace(path, t.features, t.verified, t.accepted, t.temperature)
    png = tmp_path / "rel.png"
    assert cal.main([str(path), "--json", "--plot", str(png)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["rows"] == 3000 and len(out["per_position"]) == 3
    assert 0.5 < out["auc"] <= 1 and 0.5 < out["auc_baseline"] <= 1
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert cal.main([str(path), "--refit-interval", "10"]) == 0
    text = capsys.readouterr().out
    assert "AUC" in text and "baseline" in text and "pos" in text
    with pytest.raises(SystemExit) as e:
        cal.main([str(tmp_path / "missing.npz")])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        cal.main([str(path), "--batch-rows", "0"])
    assert e.value.code == 2
