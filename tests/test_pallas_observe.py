"""The one-launch observe kernel (jaxspec/pallas/observe.py) against the jnp `estimator.observe`
(every statistics and coefficient field; the history the caller keeps is not the kernel's).

CPU: interpret mode. GPU (`pytest -m gpu`): the same cases compiled."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.pallas import observe as po
from jaxspec.spec import estimator as est
from tests.gpu_lowering import lower_for_h200

gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
CONFIGS = {"default": po.ObserveConfig(), "tiles-16": po.ObserveConfig(block_b=16, num_warps=2)}
# per field: float32 sums in another order (positions as one reduction, batch tiles) -> relative
RTOL = 2e-5


HISTORY_SLOTS = 600


def make_step(rng, batch, positions, special=True):
    """Features [B, P] (float32) with verified / accepted [B] int32 and distinct slots [B] in
    1..HISTORY_SLOTS; non-finite features and the label edge cases planted."""
    x = (rng.standard_normal((batch, positions)) * 3).astype(np.float32)
    ver = rng.integers(0, positions + 1, batch).astype(np.int32)
    acc = np.minimum(ver, rng.integers(0, positions + 1, batch)).astype(np.int32)
    if special and batch >= 4:
        x[0, 0], x[1, -1], x[2, positions // 2] = np.nan, np.inf, -np.inf
        ver[3], acc[3] = 0, 0  # padding row: observes nothing
        ver[-1], acc[-1] = positions, positions  # every draft accepted: no 0 label
        x[-2, :] = 60.0  # clamped to +40
    slots = rng.permutation(HISTORY_SLOTS)[:batch] + 1
    return jnp.asarray(x), jnp.asarray(ver), jnp.asarray(acc), jnp.asarray(slots, jnp.int32)


def check_state(got, ref):
    for field in po.FIELDS:
        g, r = np.asarray(getattr(got, field)), np.asarray(getattr(ref, field))
        assert g.shape == r.shape and g.dtype == r.dtype, field
        if field in ("n", "calls"):
            np.testing.assert_array_equal(g, r, field)
        else:
            scale = max(1.0, float(np.max(np.abs(r))))
            np.testing.assert_allclose(g, r, rtol=RTOL, atol=RTOL * scale, err_msg=field)


def kernel(config, interpret, poison=True):
    """The kernel on the rows of `slots` (their history feature computed as observe does)."""

    def run(s, x, v, a, slots):
        h = est.history_feature(s.history[slots])
        return po.observe(s, x, h, v, a, config=config, interpret=interpret, poison_outputs=poison)

    return jax.jit(run)


def started_state(rng, positions, refit):
    """A state with non-zero statistics, slopes, intercepts and slot histories (observed counts
    0-30, accepted and expected counts within them); the next call refits or not."""
    state = est.init(
        positions,
        slope=0.8,
        intercept=list(rng.uniform(-1, 1, positions)),
        refit_interval=10,
        num_slots=HISTORY_SLOTS,
    )
    n = rng.uniform(0, 30, HISTORY_SLOTS + 1)
    history = np.stack([n * rng.random(n.shape), n, n * rng.random(n.shape)], axis=-1)
    state = state.replace(history=jnp.asarray(history, jnp.float32), history_slope=jnp.asarray(0.6, jnp.float32))
    state = est.observe(state, *make_step(rng, 64, positions, special=False), impl="ref")
    return state.replace(calls=jnp.asarray(9 if refit else 5, jnp.int32))


def test_constants_match_the_estimator():
    """The kernel keeps its own copies (jaxspec.spec.estimator imports this module): no drift."""
    assert (po.FEATURE_CLAMP, po.MAX_SLOPE_HALVINGS, po.MAX_LOGIT_STEP) == (
        est.FEATURE_CLAMP,
        est.MAX_SLOPE_HALVINGS,
        est.MAX_LOGIT_STEP,
    )


def test_trust_region_matches_reference():
    """Narrow features far below the intercepts' range (as a random-weight draft gives) and
    acceptance near 0.8: the raw Newton step from p ~ 0 is huge; both paths cut it to the same step
    and the learnt acceptance moves towards the data over a few refits without blowing up."""
    rng = np.random.default_rng(21)
    positions, batch = 7, 32
    ref = got = est.init(positions, refit_interval=5, first_refit=0)  # first refit at call 5
    step = kernel(None, True, poison=False)
    for i in range(30):
        x = rng.normal(-8.4, 0.25, (batch, positions)).astype(np.float32)
        p = 1 / (1 + np.exp(-(9.0 * x + 77.0)))
        accepted = np.argmin(
            np.concatenate([rng.random((batch, positions)) < p, np.zeros((batch, 1), bool)], 1), axis=1
        ).astype(np.int32)
        args = (jnp.asarray(x), jnp.asarray(np.full(batch, positions, np.int32)), jnp.asarray(accepted))
        before = float(ref.intercepts[0])
        ref, got = est.observe(ref, *args, impl="ref"), step(got, *args, jnp.zeros(batch, jnp.int32))
        if i == 4:  # the first refit: one trust-region step of at most MAX_LOGIT_STEP at x ~ -8.4
            change = abs(float(ref.intercepts[0]) - before + (float(ref.slope) - 0.5) * -8.4)
            assert 1.0 < change <= est.MAX_LOGIT_STEP + 1e-3, change
        np.testing.assert_allclose(float(got.slope), float(ref.slope), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(np.asarray(got.intercepts), np.asarray(ref.intercepts), rtol=1e-4, atol=1e-3)
    _, survival = est.predict(ref, jnp.asarray(rng.normal(-8.4, 0.25, (256, positions)).astype(np.float32)))
    assert 2.0 < 1 + float(jnp.mean(jnp.sum(survival, axis=1))) < 7.0  # the data's accept length is ~4.3


def test_config_validation():
    with pytest.raises(ValueError, match="block_b"):
        po.ObserveConfig(block_b=100)
    with pytest.raises(ValueError, match="num_warps"):
        po.ObserveConfig(num_warps=3)


def test_tracks_reference_with_histories():
    """120 steps of 24 requests whose acceptance carries a per-request offset (the history's signal),
    each step's rows in their slots and a quarter of the slots taking new requests every 30 steps:
    the kernel's state (history kept by observe either way) tracks the jnp form, and the history
    slope moves off 0."""
    rng = np.random.default_rng(12)
    positions, batch = 7, 24
    ref = got = est.init(positions, refit_interval=20, num_slots=batch)
    offset = rng.normal(0.0, 1.5, batch + 1)
    slots = jnp.arange(1, batch + 1, dtype=jnp.int32)
    ref_step, kernel_step = (jax.jit(functools.partial(est.observe, impl=impl)) for impl in ("ref", "pallas"))
    for call in range(120):
        if call and call % 30 == 0:
            new = rng.choice(batch, batch // 4, replace=False) + 1
            offset[new] = rng.normal(0.0, 1.5, len(new))
            ref, got = est.reset_history(ref, jnp.asarray(new)), est.reset_history(got, jnp.asarray(new))
        x = rng.standard_normal((batch, positions)).astype(np.float32) * 2
        p = 1 / (1 + np.exp(-(x + offset[1:, None])))
        accepted = np.argmin(
            np.concatenate([rng.random((batch, positions)) < p, np.zeros((batch, 1), bool)], 1), axis=1
        ).astype(np.int32)
        args = (jnp.asarray(x), jnp.full((batch,), positions, jnp.int32), jnp.asarray(accepted), slots)
        ref, got = ref_step(ref, *args), kernel_step(got, *args)
    assert float(ref.history_slope) > 0.2, float(ref.history_slope)
    for field in ("slope", "history_slope", "intercepts", "history"):
        np.testing.assert_allclose(
            np.asarray(getattr(got, field)), np.asarray(getattr(ref, field)), rtol=1e-4, atol=1e-4, err_msg=field
        )


def test_supports():
    s = est.init(7)
    x, v = jnp.zeros((4, 7)), jnp.zeros((4,), jnp.int32)
    assert po.supports(s, x, v, v)
    assert not po.supports(s, jnp.zeros((4, 6)), v, v)  # positions of another state
    assert not po.supports(s, x, jnp.zeros((3,), jnp.int32), v)  # one label per row
    assert not po.supports(s, x, v.astype(jnp.float32), v)  # integer labels


@pytest.mark.parametrize("cfg", list(CONFIGS), ids=list(CONFIGS))
@pytest.mark.parametrize("refit", [False, True], ids=["accumulate", "refit"])
@pytest.mark.parametrize(
    "batch,positions",
    [(1, 7), (5, 3), (37, 15), (130, 1), (300, 7)],
    ids=["b1-p7", "b5-p3", "b37-p15", "b130-p1", "b300-p7"],
)
def test_matches_reference(batch, positions, refit, cfg):
    rng = np.random.default_rng(batch * 100 + positions)
    state = started_state(rng, positions, refit)
    x, v, a, slots = make_step(rng, batch, positions)
    got = kernel(CONFIGS[cfg], True)(state, x, v, a, slots)
    ref = est.observe(state, x, v, a, slots, impl="ref")
    check_state(got, ref)
    if refit:  # the step was taken and the statistics cleared
        assert float(ref.slope) != float(state.slope) and int(got.n) == 0 and float(got.h_xx) == 0.0
    else:
        assert float(got.slope) == float(state.slope)
        observed = bool(np.any(np.asarray(v) > 0))  # a row verified something
        assert (int(got.n) > int(state.n)) == observed
        assert (float(got.h_hh) > float(state.h_hh)) == observed  # the rows had histories


def test_poisoned_batch_keeps_coefficients_finite():
    rng = np.random.default_rng(3)
    state = started_state(rng, 7, True)
    x = jnp.full((16, 7), jnp.nan, jnp.float32).at[0, 0].set(jnp.inf)
    v, a, slots = jnp.full((16,), 7, jnp.int32), jnp.full((16,), 3, jnp.int32), jnp.arange(1, 17, dtype=jnp.int32)
    got = kernel(None, True)(state, x, v, a, slots)
    for field in ("slope", "history_slope", "intercepts"):
        assert np.all(np.isfinite(np.asarray(getattr(got, field)))), field
    check_state(got, est.observe(state, x, v, a, slots, impl="ref"))


def test_tracks_reference_over_many_refits():
    """250 steps of logistic data, refits at calls 2, 4, 8 and 16 (early) then every 25: the two paths end
    with the same coefficients (rows without history here; test_tracks_reference_with_histories)."""
    rng = np.random.default_rng(11)
    positions, batch = 7, 48
    true_b = np.linspace(1.5, -0.5, positions)
    ref = got = est.init(positions, refit_interval=25)
    assert ref.early_refits == (2, 4, 8, 16)
    step = kernel(None, True, poison=False)
    for _ in range(250):
        x = rng.standard_normal((batch, positions)).astype(np.float32) * 2
        p = 1 / (1 + np.exp(-(1.0 * x + true_b)))
        accepted = np.argmin(
            np.concatenate([rng.random((batch, positions)) < p, np.zeros((batch, 1), bool)], 1), axis=1
        ).astype(np.int32)
        ver = np.full(batch, positions, np.int32)
        args = (jnp.asarray(x), jnp.asarray(ver), jnp.asarray(accepted))
        ref, got = est.observe(ref, *args, impl="ref"), step(got, *args, jnp.zeros(batch, jnp.int32))
    assert abs(float(ref.slope) - 1.0) < 0.2  # the data's slope is being learnt
    np.testing.assert_allclose(float(got.slope), float(ref.slope), rtol=1e-4)
    np.testing.assert_allclose(np.asarray(got.intercepts), np.asarray(ref.intercepts), rtol=1e-4, atol=1e-4)


def test_dispatch():
    rng = np.random.default_rng(5)
    state = started_state(rng, 7, False)
    x, v, a, slots = make_step(rng, 9, 7)
    auto = est.observe(state, x, v, a, slots)
    if jax.default_backend() != "gpu":  # auto is the jnp form off the GPU
        ref = est.observe(state, x, v, a, slots, impl="ref")
        for field in (*po.FIELDS, "history"):
            np.testing.assert_array_equal(np.asarray(getattr(auto, field)), np.asarray(getattr(ref, field)))
    pallas = est.observe(state, x, v, a, slots, impl="pallas")
    check_state(pallas, auto)
    np.testing.assert_array_equal(np.asarray(pallas.history), np.asarray(auto.history))  # the same jnp update
    with pytest.raises(ValueError, match="impl"):
        est.observe(state, x, v, a, impl="fast")


def test_deterministic():
    rng = np.random.default_rng(8)
    state = started_state(rng, 15, True)
    x, v, a, slots = make_step(rng, 300, 15)
    f = kernel(CONFIGS["tiles-16"], True)
    first, again = f(state, x, v, a, slots), f(state, x, v, a, slots)
    for field in po.FIELDS:
        np.testing.assert_array_equal(np.asarray(getattr(first, field)), np.asarray(getattr(again, field)))


@pytest.mark.parametrize("batch,positions", [(128, 7), (512, 15)])
def test_lowers_for_h200(batch, positions):
    state = est.init(positions)
    x = jax.ShapeDtypeStruct((batch, positions), jnp.float32)
    h = jax.ShapeDtypeStruct((batch,), jnp.float32)
    lab = jax.ShapeDtypeStruct((batch,), jnp.int32)
    text = lower_for_h200(lambda s, x, h, v, a: po.observe(s, x, h, v, a, interpret=False), state, x, h, lab, lab)
    assert "__gpu$xla.gpu.triton" in text


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("cfg", list(CONFIGS), ids=list(CONFIGS))
@pytest.mark.parametrize("refit", [False, True], ids=["accumulate", "refit"])
@pytest.mark.parametrize("batch,positions", [(1, 7), (37, 15), (300, 7), (512, 7)])
def test_gpu_matches_reference(batch, positions, refit, cfg):
    rng = np.random.default_rng(batch + positions)
    state = started_state(rng, positions, refit)
    x, v, a, slots = make_step(rng, batch, positions)
    got = kernel(CONFIGS[cfg], False)(state, x, v, a, slots)
    check_state(got, est.observe(state, x, v, a, slots, impl="ref"))
    again = kernel(CONFIGS[cfg], False)(state, x, v, a, slots)
    for field in po.FIELDS:
        np.testing.assert_array_equal(np.asarray(getattr(got, field)), np.asarray(getattr(again, field)))
