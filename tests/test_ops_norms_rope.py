import jax.numpy as jnp
import numpy as np
import oracle
import pytest

from jaxspec.ops.norms import gated_rms_norm, rms_norm
from jaxspec.ops.rope import apply_rope

EPS = 1e-6
# bf16 in -> bf16 out: one rounding of the result (2^-8 relative) on top of f32 math.
TOL = {"f32": 1e-5, "bf16": 8e-3}
DTYPE = {"f32": jnp.float32, "bf16": jnp.bfloat16}
REF = {"impl": "ref"}  # the contract's impl switch (every reference op takes it)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("shape", [(7, 64), (2, 5, 3, 37)], ids=["2d", "4d-odd"])
def test_rms_norm(shape, dtype):
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal(shape) * 3, DTYPE[dtype])
    w = jnp.asarray(rng.standard_normal(shape[-1]) * 0.2, jnp.float32)
    y = rms_norm(x, w, EPS, **REF)
    assert y.dtype == x.dtype
    oracle.assert_close(y, oracle.rms_norm(x, w, EPS), TOL[dtype], "rms_norm")


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("shape", [(7, 64), (2, 5, 3, 37)], ids=["2d", "4d-odd"])
def test_gated_rms_norm(shape, dtype):
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal(shape) * 3, DTYPE[dtype])
    z = jnp.asarray(rng.standard_normal(shape) * 2, DTYPE[dtype])
    w = jnp.asarray(1 + rng.standard_normal(shape[-1]) * 0.2, jnp.float32)
    y = gated_rms_norm(x, z, w, EPS, **REF)
    assert y.dtype == x.dtype
    oracle.assert_close(y, oracle.gated_rms_norm(x, z, w, EPS), TOL[dtype], "gated_rms_norm")


@pytest.mark.parametrize("max_pos", [64, 4096], ids=["pos<64", "pos<4096"])
@pytest.mark.parametrize("theta", [1e4, 1e7], ids=["theta1e4", "theta1e7"])
@pytest.mark.parametrize("rotary_dim", [32, 16, 8], ids=["rd=D", "rd=D/2", "rd=D/4"])
@pytest.mark.parametrize("heads", [1, 3])
def test_rope(heads, rotary_dim, theta, max_pos):
    D = 32
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 9, heads, D)).astype(np.float32)
    pos = rng.integers(0, max_pos, (2, 9)).astype(np.int32)
    pos[0, 0] = 0
    y = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(pos), rotary_dim, theta, **REF))
    # The f32 angle pos * inv_freq carries ~1e-7 * pos absolute error, inherent to f32.
    tol = max(1e-5, 2e-7 * max_pos)
    oracle.assert_close(y, oracle.rope(x, pos, rotary_dim, theta), tol, "rope")
    np.testing.assert_array_equal(y[..., rotary_dim:], x[..., rotary_dim:])  # pass-through dims
