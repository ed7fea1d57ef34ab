"""The one-pass estimator-feature kernel (jaxspec.pallas.features) against the jnp form
(jaxspec.spec.estimator.features, impl="ref"; that one is held to a float64 oracle in
test_estimator.py).

CPU: interpret mode, vocabularies that are not a multiple of the block, one and several splits per
row, the rows the contract singles out (all -inf, a NaN, +inf, tied maxima, a clamped maximum,
V = 1). GPU (-m gpu): the compiled kernel on the same cases and at the 248,320 vocabulary.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpu_lowering import lower_for_h200
from jaxspec.pallas import features as pf
from jaxspec.spec import estimator as est

ON_GPU = jax.default_backend() == "gpu"
gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")

CONFIGS = {
    "one-split": pf.FeaturesConfig(block_v=256, min_programs=1),
    "splits": pf.FeaturesConfig(block_v=128, min_programs=64),
    "wide-block": pf.FeaturesConfig(),
}


def make_logits(seed, shape, special=True):
    """Random logits [B, P, V] (float32) with the contract's special rows planted."""
    rng = np.random.default_rng(seed)
    lg = (rng.standard_normal(shape) * 3).astype(np.float32)
    if special:
        vocab = shape[-1]
        lg[0, 1] = -np.inf                                    # every entry tied at -inf
        lg[0, 2, vocab - 1] = 60.0                            # q_max rounds to 1: clamps at +40
        lg[1, 0, 7] = np.nan                                  # NaN -> NaN
        lg[1, 1, :vocab // 2] = -np.inf                       # masked vocabulary
        lg[1, 2, 5] = 30.0                                    # q_max = 1 - 1e-8 .. 1e-11: x ~ 18-26, unclamped
        lg[-1, 0, vocab // 3] = np.inf                        # +inf maximum
        lg[-1, 1] = np.round(lg[-1, 1])                       # integer logits: ties everywhere
        lg[-1, 2, [3, vocab - 2]] = 40.0                      # two tied maxima in different blocks
    return lg


def check(got, ref, tol=2e-6):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert got.shape == ref.shape
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref), "NaN rows")
    ok = ~np.isnan(ref)
    np.testing.assert_allclose(got[ok], ref[ok], rtol=tol, atol=tol * 40)


def kernel(config, interpret):
    return jax.jit(lambda x, t: jnp.clip(pf.feature_logits(x, t, config=config, interpret=interpret), -40, 40))


def test_config_validation():
    with pytest.raises(ValueError, match="block_v"):
        pf.FeaturesConfig(block_v=1000)
    with pytest.raises(ValueError, match="num_warps"):
        pf.FeaturesConfig(num_warps=3)
    with pytest.raises(ValueError, match="num_stages"):
        pf.FeaturesConfig(num_stages=0)
    with pytest.raises(ValueError, match="min_programs"):
        pf.FeaturesConfig(min_programs=True)


def test_supports():
    x = jnp.zeros((2, 3, 10))
    assert pf.supports(x, jnp.ones(2)) and pf.supports(x, 1.0)
    assert not pf.supports(jnp.zeros((10,)), 1.0)                     # no position axis
    assert not pf.supports(jnp.zeros((2, 3, 10), jnp.int32), 1.0)     # integer logits
    assert not pf.supports(x, jnp.ones(3))                            # temperature does not broadcast


@pytest.mark.parametrize("cfg", list(CONFIGS), ids=list(CONFIGS))
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("vocab", [1000, 260, 37])
def test_matches_reference(vocab, dtype, cfg):
    dt = {"f32": jnp.float32, "bf16": jnp.bfloat16}[dtype]
    logits = jnp.asarray(make_logits(vocab, (3, 5, vocab)), dt)
    temperature = jnp.asarray([0.0, 0.7, 1.3], jnp.float32)              # 0: greedy rows use 1
    got = kernel(CONFIGS[cfg], True)(logits, temperature)
    ref = est.features(logits, temperature, impl="ref")
    check(got, ref)
    assert np.isnan(got[1, 0]) and got[0, 2] == 40.0 and got[-1, 0] == 40.0
    assert 15.0 < got[1, 2] < 39.0                                       # no cancellation near q_max = 1
    np.testing.assert_allclose(got[0, 1], -np.log(vocab - 1), rtol=1e-6)   # all -inf: V ties


def test_single_entry_vocabulary_and_scalar_temperature():
    got = kernel(CONFIGS["one-split"], True)(jnp.zeros((2, 3, 1)), 1.0)
    np.testing.assert_array_equal(np.asarray(got), np.full((2, 3), 40.0, np.float32))


def test_leading_axes_broadcast():
    """[B, R, P, V] logits with a per-B temperature, as the engine's batched rows may have."""
    logits = jnp.asarray(make_logits(5, (2, 3, 4, 300), special=False))
    temperature = jnp.asarray([0.5, 2.0])[:, None]
    got = kernel(CONFIGS["splits"], True)(logits, temperature)
    check(got, est.features(logits, temperature, impl="ref"))


def test_dispatch():
    logits = jnp.asarray(make_logits(3, (3, 5, 300)))
    t = jnp.asarray([1.0, 0.5, 0.0])
    check(est.features(logits, t, impl="pallas"), est.features(logits, t, impl="ref"))
    if not ON_GPU:   # off the GPU, auto is the jnp form, bit for bit
        np.testing.assert_array_equal(np.asarray(est.features(logits, t)), np.asarray(est.features(logits, t, impl="ref")))
    with pytest.raises(ValueError, match="impl"):
        est.features(logits, t, impl="triton")


@pytest.mark.parametrize("rows,positions", [(128, 7), (1, 15)])
def test_lowers_for_h200(rows, positions):
    logits = jax.ShapeDtypeStruct((rows, positions, 248_320), jnp.bfloat16)
    temp = jax.ShapeDtypeStruct((rows,), jnp.float32)
    text = lower_for_h200(lambda x, t: pf.feature_logits(x, t, interpret=False), logits, temp)
    assert "__gpu$xla.gpu.triton" in text


# ------------------------------------------------------------------------------ GPU

@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("cfg", list(CONFIGS), ids=list(CONFIGS))
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_gpu_matches_reference(dtype, cfg):
    dt = {"f32": jnp.float32, "bf16": jnp.bfloat16}[dtype]
    for vocab in (1000, 37):
        logits = jnp.asarray(make_logits(vocab, (3, 5, vocab)), dt)
        t = jnp.asarray([0.0, 0.7, 1.3], jnp.float32)
        check(kernel(CONFIGS[cfg], False)(logits, t), est.features(logits, t, impl="ref"))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("rows", [128, 1])
def test_gpu_full_vocabulary(rows):
    logits = jnp.asarray(make_logits(rows, (rows, 7, 248_320), special=rows > 1), jnp.bfloat16)
    t = jnp.linspace(0.0, 1.5, rows, dtype=jnp.float32)
    got = kernel(None, False)(logits, t)
    check(got, est.features(logits, t, impl="ref"), tol=1e-5)
    again = kernel(None, False)(logits, t)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(again))     # deterministic
