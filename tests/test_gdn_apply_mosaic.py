"""The Mosaic GPU apply kernel (jaxspec/pallas/gdn_apply_mosaic.py) against the Triton two-pass apply.

CPU: Mosaic's GPU interpret mode (TMA, barriers and wgmma simulated; scratch and outputs start as
NaN, so a row the kernel fails to write shows). GPU (`pytest -m gpu`): the same cases compiled."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.pallas import gdn_apply_mosaic as mosaic
from jaxspec.pallas import gdn_verify_two_pass as two_pass
from tests.gpu_lowering import lower_for_h200
from tests.test_pallas_gdn_verify import make_case

ON_GPU = jax.default_backend() == "gpu"
gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
SHAPES = dict(H=2, HV=6, K=64, V=64, L=16, S1=6)
# (slot, window length): slot 0 is the null slot, slot 2 is not in the batch, 0 an empty window
REQUESTS = [(3, 5), (0, 3), (1, 2), (5, 0), (4, 1)]
T_MAX, N_PAD = 5, 3
RTOL = 2e-5


def case(seed, hist, t_max=T_MAX, requests=REQUESTS, shapes=SHAPES, v_dtype=jnp.float32):
    q, k, v, g, beta, ckpt, rk, ru, rg, wpos, qsl, slots = make_case(
        seed, hist, jnp.bfloat16, "f32", requests=requests, t_max=t_max, n_pad=N_PAD, shapes=shapes)
    mat, mat_h, _, _ = two_pass.coefficients(q, k, g, beta, rk, rg, wpos, qsl, slots, t_max, block_k=16,
                                             num_warps=1, interpret=not ON_GPU, layer=None)
    return q, k, v.astype(v_dtype), ckpt, mat, mat_h, ru, wpos, qsl, slots


def triton_apply(q, k, v, ckpt, mat, mat_h, ru, wpos, qsl, slots, t_max, interpret):
    o, (ru2,) = two_pass.apply(q, k, v, ckpt, mat, mat_h, (ru,), wpos, qsl, slots, t_max, block_v=16,
                               block_k=16, num_warps=4, num_stages=1, pad_rows=8, interpret=interpret, layer=None)
    return o, ru2


def check(got, ref):
    for name, g, r in zip(("o", "ring_u"), got, ref):
        g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
        assert g.shape == r.shape, name
        np.testing.assert_array_equal(np.isfinite(g), np.isfinite(r), f"{name}: non-finite pattern")
        ok = np.isfinite(r)
        scale = np.abs(r[ok]).max()
        np.testing.assert_allclose(g[ok], r[ok], rtol=RTOL, atol=RTOL * scale, err_msg=name)


def test_supports():
    q, k, v, ckpt, mat, mat_h, ru, *_ = case(0, "empty")
    assert mosaic.supports(q, k, v, ckpt, (ru,), 8, None)
    assert not mosaic.supports(q, k, v, ckpt, (ru,), 9, None)                        # t_max > 8
    assert not mosaic.supports(q, k, v, ckpt.astype(jnp.float32), (ru,), 8, None)    # fp32 checkpoint
    assert not mosaic.supports(q, k, v, ckpt, (ru.astype(jnp.bfloat16), ru), 8, None)  # hi/lo ring
    assert not mosaic.supports(q, k, v, ckpt, (ru,), 8, 0)                          # layer stacks
    with pytest.raises(ValueError, match="unsupported"):
        mosaic.apply_mosaic(q, k, v, ckpt.astype(jnp.float32), mat, mat_h, ru, *case(0, "empty")[7:], 5)


@pytest.mark.parametrize("v_dtype", [jnp.float32, jnp.bfloat16], ids=["v-f32", "v-bf16"])
@pytest.mark.parametrize("hist", ["empty", "partial", "full", "overflow"])
def test_matches_triton_apply(hist, v_dtype):
    """Ragged windows (5, 3, 2, 0, 1 tokens), a null-slot request, padding rows, every history."""
    args = case(7, hist, v_dtype=v_dtype)
    got = jax.jit(lambda *a: mosaic.apply_mosaic(*a, T_MAX, interpret=True))(*args)
    check(got, triton_apply(*args, T_MAX, interpret=True))


def test_full_window_and_nonfinite_inputs():
    """t_max 8 (the whole tile); a NaN in one token's value and key rows stays in that token's and
    later tokens' outputs of its own request (causality by selection), as in the Triton apply."""
    requests = [(2, 8), (4, 6), (1, 8)]
    q, k, v, ckpt, mat, mat_h, ru, wpos, qsl, slots = case(3, "partial", t_max=8, requests=requests)
    v = v.at[int(qsl[1]) + 3, 1].set(jnp.nan)
    k = k.at[int(qsl[2]) + 5, 0].set(jnp.inf)
    args = (q, k, v, ckpt, mat, mat_h, ru, wpos, qsl, slots)
    got = jax.jit(lambda *a: mosaic.apply_mosaic(*a, 8, interpret=True))(*args)
    check(got, triton_apply(*args, 8, interpret=True))


@pytest.mark.parametrize("batch", [128, 3])
def test_lowers_for_h200(batch):
    """The benchmark's Qwen3.8-27B shapes (H 16, HV 48, K = V = 128, ring 16, T 8)."""
    n_tok, sd = batch * 8, jax.ShapeDtypeStruct
    args = (sd((n_tok, 16, 128), jnp.float32), sd((n_tok, 16, 128), jnp.float32), sd((n_tok, 48, 128), jnp.bfloat16),
            sd((batch + 1, 48, 128, 128), jnp.bfloat16), sd((batch, 48, 16, 32), jnp.float32),
            sd((batch, 48, 16, 16), jnp.float32), sd((batch + 1, 48, 16, 128), jnp.float32),
            sd((batch + 1,), jnp.int32), sd((batch + 1,), jnp.int32), sd((batch,), jnp.int32))
    text = lower_for_h200(lambda *a: mosaic.apply_mosaic(*a, 8, interpret=False), *args)
    assert "mosaic_gpu" in text


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("v_dtype", [jnp.float32, jnp.bfloat16], ids=["v-f32", "v-bf16"])
@pytest.mark.parametrize("hist", ["empty", "partial", "overflow"])
def test_gpu_matches_triton_apply(hist, v_dtype):
    """K = V = 128, windows up to t_max = 8 (rows past t_max are outside the contract: unwritten)."""
    args = case(11, hist, t_max=8, shapes=dict(H=4, HV=12, K=128, V=128, L=16, S1=9), v_dtype=v_dtype,
                requests=[(3, 5), (0, 3), (1, 8), (5, 0), (4, 1), (8, 8), (7, 2)])
    got = jax.jit(lambda *a: mosaic.apply_mosaic(*a, 8, interpret=False))(*args)
    check(got, triton_apply(*args, 8, interpret=False))
