"""The packed conv verify kernel (jaxspec/pallas/conv.py) against its jnp reference and the
float64 oracle: interpret mode on the CPU, the real kernel on the GPU (-m gpu), and the H200
Triton lowering of the benchmark shapes on the CPU.

Every output the contract says is written is checked after poisoning it with NaN (y through the
kernel's y_buffer alias, conv_window through its own alias); every entry it says is untouched is
checked bit for bit (NaN poison included).
"""

import jax
import jax.numpy as jnp
import numpy as np
import oracle
import pytest
from gpu_lowering import lower_for_h200

from jaxspec.ops.conv import conv_verify as op_conv_verify
from jaxspec.pallas import conv as pconv

W = 4
ON_GPU = jax.default_backend() == "gpu"
gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")


def make_case(
    rng, lengths, slots, C, t_max, dtype, n_pad=3, s1=None, state_dtype=None, window_dtype=None, poison_window=False
):
    """Random packed verify inputs. Stale window contents are random, or NaN when poisoned."""
    lengths = np.asarray(lengths)
    slots = np.asarray(slots, np.int32)
    s1 = s1 or int(slots.max()) + 2
    qsl = oracle.qsl_from_lengths(lengths)
    n = int(qsl[-1]) + n_pad
    x = rng.standard_normal((n, C)).astype(np.float32)
    state = rng.standard_normal((s1, W - 1, C)).astype(np.float32)
    if poison_window:
        window = np.full((s1, t_max, C), np.nan, np.float32)
    else:
        window = rng.standard_normal((s1, t_max, C)).astype(np.float32)
    w = (rng.standard_normal((C, W)) * 0.5).astype(np.float32)
    return dict(
        x=jnp.asarray(x, dtype),
        conv_state=jnp.asarray(state, state_dtype or dtype),
        conv_window=jnp.asarray(window, window_dtype or dtype),
        weight=jnp.asarray(w, dtype),
        query_start_loc=jnp.asarray(qsl, jnp.int32),
        slots=jnp.asarray(slots),
    )


def check(case, y, window2, tol):
    """y and conv_window' against the oracle and the contract (exact zeros, untouched bits)."""
    x = np.asarray(case["x"].astype(jnp.float32))
    state = np.asarray(case["conv_state"].astype(case["x"].dtype).astype(jnp.float32))
    w = np.asarray(case["weight"].astype(jnp.float32))
    qsl = np.asarray(case["query_start_loc"])
    slots = np.asarray(case["slots"])
    window = np.asarray(case["conv_window"])
    y = np.asarray(y.astype(jnp.float32))
    window2 = np.asarray(window2)
    assert y.shape == x.shape and window2.shape == window.shape and window2.dtype == window.dtype

    exp_window = window.copy()
    for r, s in enumerate(slots):
        rows = slice(qsl[r], qsl[r + 1])
        n = qsl[r + 1] - qsl[r]
        if s == 0:
            assert np.all(y[rows] == 0), f"slot-0 request {r} must output 0"
            continue
        exp_window[s, :n] = np.asarray(case["x"][rows].astype(window.dtype))
        if n:
            oracle.assert_close(y[rows], oracle.causal_conv(x[rows], w, history=state[s]), tol, f"y of request {r}")
    assert np.all(y[qsl[-1] :] == 0), "padding rows must output 0"
    np.testing.assert_array_equal(oracle.bits(window2), oracle.bits(exp_window), "conv_window'")


def run_kernel(case, config=None, interpret=None):
    nan_y = jnp.full(case["x"].shape, jnp.nan, case["x"].dtype)
    fn = jax.jit(lambda c, yb: pconv.conv_verify(**c, config=config, interpret=interpret, y_buffer=yb))
    return fn(case, nan_y)


TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}

# (lengths, slots): length 0 and T_max, a slot-0 request in the middle, one not in the batch.
LAYOUTS = {
    "ragged": ([3, 2, 0, 5, 1, 4], [3, 0, 1, 4, 6, 2]),
    "uniform": ([5, 5], [2, 1]),
    "single": ([1], [1]),
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_verify_interpret(layout, dtype):
    lengths, slots = LAYOUTS[layout]
    rng = np.random.default_rng(oracle.seed_of(layout))
    # C = 300 with 128-channel blocks: two full blocks and a masked tail of 44 channels.
    case = make_case(rng, lengths, slots, C=300, t_max=5, dtype=dtype, poison_window=layout == "ragged")
    y, window2 = run_kernel(case, config=pconv.ConvVerifyConfig(block_c=128, num_warps=1), interpret=True)
    check(case, y, window2, TOL[dtype])


@pytest.mark.parametrize("C", [37, 16])
def test_verify_interpret_small_channels(C):
    rng = np.random.default_rng(C)
    case = make_case(rng, [2, 4, 0, 1], [1, 3, 2, 0], C=C, t_max=4, dtype=jnp.float32, n_pad=5)
    y, window2 = run_kernel(case, interpret=True)
    check(case, y, window2, TOL[jnp.float32])


def test_verify_interpret_mixed_dtypes_and_row_groups():
    """f32 state (rounded to bf16 like the reference), f32 window of bf16 inputs; loads issued in
    groups of 2 rows; padding zeroed 2 rows at a time over several programs."""
    rng = np.random.default_rng(7)
    case = make_case(
        rng,
        [6, 1, 3],
        [2, 3, 1],
        C=40,
        t_max=6,
        dtype=jnp.bfloat16,
        n_pad=9,
        state_dtype=jnp.float32,
        window_dtype=jnp.float32,
    )
    cfg = pconv.ConvVerifyConfig(block_c=32, num_warps=1, pad_rows=2, row_group=2)
    y, window2 = run_kernel(case, config=cfg, interpret=True)
    check(case, y, window2, TOL[jnp.bfloat16])


@pytest.mark.parametrize("rpp", [2, 4])
def test_verify_interpret_requests_per_program(rpp):
    """Several requests per program (pipelined): B not a multiple of rpp, slot 0, length 0 and
    T_max, padding shared over fewer programs."""
    rng = np.random.default_rng(20 + rpp)
    lengths, slots = LAYOUTS["ragged"]
    case = make_case(rng, lengths + [5], slots + [5], C=100, t_max=5, dtype=jnp.bfloat16, n_pad=6, poison_window=True)
    cfg = pconv.ConvVerifyConfig(block_c=64, num_warps=1, requests_per_program=rpp, pad_rows=2)
    y, window2 = run_kernel(case, config=cfg, interpret=True)
    check(case, y, window2, TOL[jnp.bfloat16])


def test_verify_all_padding_and_null_requests():
    """Every request on slot 0 or empty; almost every row is padding."""
    rng = np.random.default_rng(8)
    case = make_case(rng, [0, 2, 0], [1, 0, 2], C=24, t_max=3, dtype=jnp.float32, n_pad=11)
    y, window2 = run_kernel(case, config=pconv.ConvVerifyConfig(pad_rows=4), interpret=True)
    check(case, y, window2, TOL[jnp.float32])
    np.testing.assert_array_equal(oracle.bits(np.asarray(window2)), oracle.bits(np.asarray(case["conv_window"])))


def test_dispatch_matches_reference():
    rng = np.random.default_rng(9)
    lengths, slots = LAYOUTS["ragged"]
    case = make_case(rng, lengths, slots, C=37, t_max=5, dtype=jnp.float32)
    y_ref, w_ref = jax.jit(lambda c: op_conv_verify(**c, impl="ref"))(case)
    y_k, w_k = jax.jit(lambda c: op_conv_verify(**c, impl="pallas"))(case)
    np.testing.assert_allclose(np.asarray(y_k), np.asarray(y_ref), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(oracle.bits(np.asarray(w_k)), oracle.bits(np.asarray(w_ref)))


def test_config_validation():
    for field, bad in [
        ("block_c", 100),
        ("block_c", 8),
        ("num_warps", 3),
        ("pad_rows", 3),
        ("row_group", 0),
        ("requests_per_program", 0),
        ("requests_per_program", 17),
    ]:
        with pytest.raises(ValueError, match=field):
            pconv.ConvVerifyConfig(**{field: bad})
    cfg = pconv.ConvVerifyConfig()
    assert cfg.resolve(128, 10240, 2) == (512, 4, 1)  # the tiles measured fastest on an H200
    assert cfg.resolve(32, 10240, 2) == (512, 4, 1)
    assert cfg.resolve(8, 10240, 2) == (128, 1, 1)
    assert cfg.resolve(1, 10240, 2) == (64, 1, 1)
    assert cfg.resolve(128, 10240, 4) == (512, 8, 1)
    assert cfg.resolve(4, 37, 4)[0] == 64
    assert pconv.ConvVerifyConfig(requests_per_program=4).resolve(128, 10240, 2, 8)[2] == 4
    assert pconv.ConvVerifyConfig(requests_per_program=4).resolve(128, 10240, 2, 64)[2] == 1  # T > row_group
    assert pconv.ConvVerifyConfig(requests_per_program=4).resolve(3, 10240, 2, 8)[2] == 3


def test_supports():
    S = jax.ShapeDtypeStruct
    ok = dict(
        x=S((16, 37), jnp.bfloat16),
        conv_state=S((5, 3, 37), jnp.bfloat16),
        conv_window=S((5, 8, 37), jnp.bfloat16),
        weight=S((37, 4), jnp.bfloat16),
        query_start_loc=S((3,), jnp.int32),
        slots=S((2,), jnp.int32),
    )
    assert pconv.supports_conv_verify(**ok)
    bad = [
        ("x", S((16, 37), jnp.float16)),
        ("conv_window", S((5, 65, 37), jnp.bfloat16)),  # T_max > 64
        ("conv_state", S((5, 2, 37), jnp.bfloat16)),  # W-1 mismatch
        ("weight", S((36, 4), jnp.bfloat16)),
        ("query_start_loc", S((2,), jnp.int32)),
    ]
    for name, val in bad:
        assert not pconv.supports_conv_verify(**{**ok, name: val}), name


def stack_layers(case, layer, num_layers=3):
    """The case's conv_state and conv_window as layer `layer` of [G, ...] stacks whose other
    layers are NaN (a read of another layer poisons the outputs)."""

    def stack(a):
        return jnp.stack([a if i == layer else jnp.full_like(a, jnp.nan) for i in range(num_layers)])

    return dict(case, conv_state=stack(case["conv_state"]), conv_window=stack(case["conv_window"]))


@pytest.mark.parametrize("rpp", [1, 2])
def test_layer_stack(rpp):
    """With `layer`, the kernel reads conv_state[layer] and writes conv_window[layer] of the stacks in
    place: y and that layer's window bit-identical to the call on the layer's own arrays, the other
    layers' bits untouched; the reference path takes the same arguments."""
    rng = np.random.default_rng(31)
    lengths, slots = LAYOUTS["ragged"]
    case = make_case(rng, lengths, slots, C=300, t_max=5, dtype=jnp.bfloat16)
    config = pconv.ConvVerifyConfig(block_c=128, num_warps=1, requests_per_program=rpp)
    y1, w1 = run_kernel(case, config=config, interpret=True)
    stacked = stack_layers(case, 1)
    run = jax.jit(lambda c: pconv.conv_verify(**c, config=config, interpret=True, layer=1))
    y, w = run(stacked)
    np.testing.assert_array_equal(oracle.bits(np.asarray(y)), oracle.bits(np.asarray(y1)), "y")
    np.testing.assert_array_equal(oracle.bits(np.asarray(w[1])), oracle.bits(np.asarray(w1)), "layer 1 window")
    for other in (0, 2):
        np.testing.assert_array_equal(
            oracle.bits(np.asarray(w[other])), oracle.bits(np.asarray(stacked["conv_window"][other])), f"layer {other}"
        )
    traced = jax.jit(lambda c, i: pconv.conv_verify(**c, config=config, interpret=True, layer=i))
    y_t, w_t = traced(stacked, jnp.int32(1))  # one kernel for every layer of the stack
    np.testing.assert_array_equal(oracle.bits(np.asarray(y_t)), oracle.bits(np.asarray(y)), "y, traced layer")
    np.testing.assert_array_equal(oracle.bits(np.asarray(w_t)), oracle.bits(np.asarray(w)), "window, traced layer")
    assert pconv.supports_conv_verify(**stacked, layer=2)
    assert not pconv.supports_conv_verify(**stacked, layer=3) and not pconv.supports_conv_verify(**stacked)
    y_ref, w_ref = jax.jit(lambda c: op_conv_verify(**c, layer=1, impl="ref"))(stacked)
    np.testing.assert_allclose(
        np.asarray(y_ref.astype(jnp.float32)), np.asarray(y1.astype(jnp.float32)), rtol=1e-2, atol=1e-2
    )
    np.testing.assert_array_equal(oracle.bits(np.asarray(w_ref)), oracle.bits(np.asarray(w)), "reference window stack")


def test_layer_stack_lowers_for_h200():
    """48 GDN layers' conv state and window at batch 128 (C 10240, T 8, bf16), layer 47."""
    S = jax.ShapeDtypeStruct
    B, C, T, G = 128, 10240, 8, 48
    fn = lambda x, st, win, w, qsl, sl: pconv.conv_verify(x, st, win, w, qsl, sl, interpret=False, layer=G - 1)
    text = lower_for_h200(
        fn,
        S((B * T, C), jnp.bfloat16),
        S((G, B + 1, W - 1, C), jnp.bfloat16),
        S((G, B + 1, T, C), jnp.bfloat16),
        S((C, W), jnp.bfloat16),
        S((B + 1,), jnp.int32),
        S((B,), jnp.int32),
    )
    assert "__gpu$xla.gpu.triton" in text


BENCH_SHAPES = [
    (1, 10240, 8, jnp.bfloat16),
    (8, 10240, 8, jnp.bfloat16),
    (32, 10240, 8, jnp.bfloat16),
    (128, 10240, 8, jnp.bfloat16),
    (5, 1000, 64, jnp.bfloat16),
    (3, 37, 5, jnp.float32),
]


@pytest.mark.parametrize("rpp", [1, 4])
@pytest.mark.parametrize("B,C,T,dtype", BENCH_SHAPES)
def test_lowers_for_h200(B, C, T, dtype, rpp):
    S = jax.ShapeDtypeStruct

    def fn(x, st, win, w, qsl, sl):
        return pconv.conv_verify(
            x, st, win, w, qsl, sl, interpret=False, config=pconv.ConvVerifyConfig(requests_per_program=rpp)
        )

    text = lower_for_h200(
        fn,
        S((B * T, C), dtype),
        S((B + 1, W - 1, C), dtype),
        S((B + 1, T, C), dtype),
        S((C, W), dtype),
        S((B + 1,), jnp.int32),
        S((B,), jnp.int32),
    )
    assert "__gpu$xla.gpu.triton" in text


# ------------------------------------------------------------------------------------- GPU


def random_layout(rng, B, T, null_every=0):
    lengths = rng.integers(0, T + 1, B)
    lengths[0], lengths[-1] = T, 0 if B > 1 else T
    slots = rng.permutation(np.arange(1, B + 1)).astype(np.int32)
    if null_every:
        slots[::null_every] = 0
    return lengths, slots


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("C,T,B", [(37, 5, 7), (1000, 8, 33), (10240, 8, 128), (10240, 64, 6), (256, 3, 1)])
def test_verify_gpu(C, T, B, dtype):
    rng = np.random.default_rng(C + T + B)
    lengths, slots = random_layout(rng, B, T, null_every=5)
    case = make_case(rng, lengths, slots, C=C, t_max=T, dtype=dtype, n_pad=T + 3, s1=B + 3, poison_window=True)
    y, window2 = run_kernel(case)
    check(case, y, window2, TOL[dtype])
    # again over stale random contents (untouched entries must keep their exact bits)
    case = make_case(rng, lengths, slots, C=C, t_max=T, dtype=dtype, n_pad=1, s1=B + 3)
    y, window2 = run_kernel(case)
    check(case, y, window2, TOL[dtype])


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(
    "cfg",
    [
        dict(block_c=512, num_warps=8),
        dict(block_c=1024, num_warps=4),
        dict(block_c=128, num_warps=1, row_group=3, pad_rows=1),
        dict(block_c=512, num_warps=2, requests_per_program=4),
        dict(block_c=1024, num_warps=4, requests_per_program=3),
        dict(block_c=256, num_warps=1, requests_per_program=8, pad_rows=4),
    ],
)
def test_verify_gpu_configs(cfg):
    rng = np.random.default_rng(3)
    lengths, slots = random_layout(rng, 40, 8, null_every=7)
    case = make_case(rng, lengths, slots, C=10240 - 3, t_max=8, dtype=jnp.bfloat16, n_pad=50, s1=45, poison_window=True)
    y, window2 = run_kernel(case, config=pconv.ConvVerifyConfig(**cfg))
    check(case, y, window2, TOL[jnp.bfloat16])


@gpu
@pytest.mark.gpu
def test_dispatch_gpu_auto_and_donation():
    """impl='auto' takes the kernel on the GPU; under jit with the window donated it matches ref."""
    rng = np.random.default_rng(4)
    lengths, slots = random_layout(rng, 16, 8, null_every=4)
    case = make_case(rng, lengths, slots, C=2048, t_max=8, dtype=jnp.bfloat16, n_pad=8, s1=20)
    y_ref, w_ref = jax.jit(lambda c: op_conv_verify(**c, impl="ref"))(case)
    win_copy = jnp.array(case["conv_window"], copy=True)
    fn = jax.jit(lambda c, win: op_conv_verify(**{**c, "conv_window": win}, impl="auto"), donate_argnums=1)
    y, w2 = fn(case, win_copy)
    np.testing.assert_allclose(
        np.asarray(y.astype(jnp.float32)), np.asarray(y_ref.astype(jnp.float32)), rtol=1e-2, atol=1e-2
    )
    np.testing.assert_array_equal(oracle.bits(np.asarray(w2)), oracle.bits(np.asarray(w_ref)))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("rpp", [1, 4])
def test_layer_stack_gpu(rpp):
    """Compiled, layer 2 of a 4-layer stack whose other layers are NaN: y and the layer's window
    bit-identical to the single-layer call, the other layers untouched."""
    rng = np.random.default_rng(17)
    lengths, slots = random_layout(rng, 33, 8, null_every=5)
    case = make_case(rng, lengths, slots, C=10240 - 3, t_max=8, dtype=jnp.bfloat16, n_pad=9, s1=36)
    config = pconv.ConvVerifyConfig(requests_per_program=rpp)
    y1, w1 = run_kernel(case, config=config)
    stacked = stack_layers(case, 2, num_layers=4)
    y, w = jax.jit(lambda c: pconv.conv_verify(**c, config=config, layer=2))(stacked)
    np.testing.assert_array_equal(oracle.bits(np.asarray(y)), oracle.bits(np.asarray(y1)), "y")
    np.testing.assert_array_equal(oracle.bits(np.asarray(w[2])), oracle.bits(np.asarray(w1)), "layer 2 window")
    for other in (0, 1, 3):
        assert np.all(np.isnan(np.asarray(w[other].astype(jnp.float32)))), f"layer {other} was written"
