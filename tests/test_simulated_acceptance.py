"""Simulated acceptance (benchmark-only): off unless asked, the device rule against sigmoid(a x + b)
per position with chain truncation, its calibration, and the engine step that applies it."""

import argparse
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from proposers import random_draft
from stats import chi2_test

import jaxspec
from jaxspec import cli
from jaxspec.config import SimulatedAcceptance, SpecConfig
from jaxspec.engine import Engine
from jaxspec.spec import simulation

FIXTURE = Path(__file__).parent / "fixtures" / "tiny-qwen3_5"


def test_off_unless_asked():
    """No default turns it on: SpecConfig has none, and `jaxspec generate` / `profile` have no flag
    for it (only `jaxspec bench --workload real-shape` builds one, see test_bench_e2e)."""
    assert SpecConfig().simulated_acceptance is None
    assert SpecConfig(verify_mode="compact").simulated_acceptance is None
    subparsers = next(a for a in cli._parser()._actions if isinstance(a, argparse._SubParsersAction))
    for command in ("generate", "profile"):
        flags = [f for a in subparsers.choices[command]._actions for f in a.option_strings]
        assert "--verify-mode" in flags or "--batches" in flags
        assert not [f for f in flags if "sim" in f or "accept" in f], (command, flags)
    with pytest.raises(ValueError, match="simulated_acceptance"):
        SpecConfig(verify_mode="none", simulated_acceptance=SimulatedAcceptance(0.0, 0.0))
    with pytest.raises(ValueError, match="simulated_acceptance"):
        SpecConfig(simulated_acceptance=(1.0, 0.0, 0))
    for kwargs, field in (
        ({"a": float("nan"), "b": 0.0}, "a"),
        ({"a": 0.0, "b": "1"}, "b"),
        ({"a": 0.0, "b": 0.0, "seed": -1}, "seed"),
    ):
        with pytest.raises(ValueError, match=f"SimulatedAcceptance.{field}"):
            SimulatedAcceptance(**kwargs)


B, D = 6000, 7  # every case runs at this shape: the rule compiles once


@jax.jit
def _jitted_rule(seed, x, lengths, a, b):
    keys = jax.random.key_data(jax.random.split(jax.random.PRNGKey(seed), B))
    probs = jax.nn.softmax(jax.random.normal(jax.random.PRNGKey(seed + 1), (B, D + 1, 3)), -1)
    ids = jax.random.randint(jax.random.PRNGKey(seed + 2), (B, D + 1, 3), 0, 100)
    drafts = jax.random.randint(jax.random.PRNGKey(seed + 3), (B, D), 100, 200)
    return simulation.accept((a, b, seed.astype(jnp.uint32)), keys, x, lengths, drafts, probs, ids), drafts, ids


def _rule(x, lengths, a, b, seed=0):
    """simulation.accept on rows of features x [B, D], random target distributions over 3 ids.
    -> ((accepted, bonus, emitted), drafts, ids) as numpy."""
    (acc, bonus, emitted), drafts, ids = _jitted_rule(
        jnp.int32(seed), jnp.asarray(x, jnp.float32), jnp.asarray(lengths, jnp.int32), jnp.float32(a), jnp.float32(b)
    )
    return [np.asarray(acc), np.asarray(bonus), np.asarray(emitted)], np.asarray(drafts), np.asarray(ids)


def test_rule_matches_sigmoid_per_position_and_truncates_the_chain():
    """Per position k, among rows that reached it, the acceptance rate is sigmoid(a x_k + b) within
    4.5 binomial standard deviations; accept lengths follow the chain's exact distribution
    (chi-square); emitted = accepted drafts, the bonus (a target id of row a), then -1."""
    a, b = 1.3, -0.4
    xk = np.array([-1.0, 0.0, 1.0, 2.0, 0.5, 1.5, 3.0], np.float32)
    x = np.broadcast_to(xk, (B, D)).copy()
    (acc, bonus, emitted), drafts, ids = _rule(x, np.full(B, D), a, b)
    p = 1.0 / (1.0 + np.exp(-(a * xk.astype(np.float64) + b)))
    for k in range(xk.size):
        reached = acc >= k
        n, hits = reached.sum(), (acc[reached] > k).sum()
        sd = np.sqrt(n * p[k] * (1 - p[k]))
        assert abs(hits - n * p[k]) < 4.5 * sd, (k, hits / n, p[k])
    exact = np.append(np.cumprod(np.append(1.0, p))[:-1] * (1 - p), np.prod(p))  # P(acc = j), j = 0..D
    _, _, pvalue = chi2_test(np.bincount(acc, minlength=xk.size + 1), exact)
    assert pvalue > 1e-3, pvalue
    # control: counting accepts without stopping at the first rejection must fail the same test
    untruncated = np.sum(np.random.default_rng(0).random((B, D)) < p, axis=1)
    assert chi2_test(np.bincount(untruncated, minlength=xk.size + 1), exact)[2] < 1e-6
    for r in range(50):
        j = acc[r]
        np.testing.assert_array_equal(emitted[r, :j], drafts[r, :j])
        assert emitted[r, j] == bonus[r] and bonus[r] in ids[r, j]
        assert np.all(emitted[r, j + 1 :] == -1)


def test_rule_respects_lengths_and_rejects_non_finite_features():
    x = np.zeros((B, D), np.float32)
    x[:, 2] = np.nan
    lengths = np.arange(B) % (D + 2)  # some beyond D: clipped to D
    (acc, _, _), _, _ = _rule(x, lengths, 0.0, 40.0)  # every finite position is accepted
    np.testing.assert_array_equal(acc, np.minimum(lengths, 2))


def test_calibration_hits_the_target_and_agrees_with_the_device_rule():
    rng = np.random.default_rng(4)
    x = rng.normal(-3.0, 0.7, (B, D)) + rng.normal(0, 0.5, (B, 1))
    for length in (3.0, 5.0):
        cal = simulation.calibrate(x, length, slope=2.0)
        assert cal["predicted"] == pytest.approx(length, abs=1e-6)
        assert cal["a"] == pytest.approx(2.0 / np.std(x))
        (acc, _, _), _, _ = _rule(x, np.full(B, D), cal["a"], cal["b"], seed=int(length))
        # Monte Carlo mean of 6000 rows: the accept length's sd is < 2.5, so the standard error < 0.035
        assert np.mean(acc + 1) == pytest.approx(length, abs=0.15)
    with pytest.raises(ValueError, match="mean_length"):
        simulation.calibrate(x, 8.0)
    assert simulation.calibrate(np.ones((10, 3)), 2.0)["a"] == 0.0  # no spread: no slope


@pytest.fixture(scope="module")
def model():
    return jaxspec.load_target(FIXTURE)


def test_engine_simulation_commits_drafts_and_default_is_real(model):
    """b = -40: nothing is accepted, so the tokens are the target's greedy ones (mode none's);
    b = +40: every verified draft is accepted (accept length = window) and the tokens are the
    draft's. The default engine passes no simulation to its step and is lossless."""
    rng = np.random.default_rng(9)
    prompts = [list(map(int, rng.integers(0, 500, n))) for n in (7, 12, 5)]
    spec = lambda **kw: SpecConfig(verify_mode="static", num_slots=2, max_len=64, **kw)
    none = Engine(model, None, SpecConfig(verify_mode="none", num_slots=2, max_len=64))
    reference = [r.tokens for r in none.generate(prompts, max_new_tokens=10)]
    draft = random_draft(model, 4)
    default = Engine(model, draft, spec())
    assert default._simulate == {}
    assert [r.tokens for r in default.generate(prompts, max_new_tokens=10)] == reference
    never = Engine(model, draft, spec(simulated_acceptance=SimulatedAcceptance(0.0, -40.0, 3)))
    assert [r.tokens for r in never.generate(prompts, max_new_tokens=10)] == reference
    always = Engine(model, draft, spec(simulated_acceptance=SimulatedAcceptance(0.0, 40.0, 3)))
    for r, ref in zip(always.generate(prompts, max_new_tokens=10), reference):
        assert r.stats["accepted"] and all(a == 3 for a in r.stats["accepted"]), r.stats["accepted"]
        assert r.tokens[0] == ref[0] and r.tokens != ref  # the prefill's token, then the draft's
