"""Which implementation impl="auto" picks, checked on the CPU.

On a GPU (dispatch.on_gpu patched to True) every op with a kernel must run it for a call its
kernel's supports(...) covers and its reference for any other call; off the GPU "auto" never runs
a kernel; "pallas" raises on an unsupported call. The calls are traced abstractly (jax.eval_shape
on ShapeDtypeStructs): nothing runs, and each kernel entry point is replaced by one that raises
Picked, so a call either reaches its kernel or completes through its reference.
"""

from functools import partial

import jax
import jax.numpy as jnp
import pytest

from jaxspec.ops import attention, conv, dispatch, gdn, sampling
from jaxspec.pallas import attention_verify as pallas_attention
from jaxspec.pallas import conv as pallas_conv
from jaxspec.pallas import fold as pallas_fold
from jaxspec.pallas import gdn_chunked as pallas_chunked
from jaxspec.pallas import gdn_verify as pallas_verify
from jaxspec.pallas import observe as pallas_observe
from jaxspec.pallas import topk as pallas_topk
from jaxspec.spec import estimator

F32, BF16, I32 = jnp.float32, jnp.bfloat16, jnp.int32
SD = jax.ShapeDtypeStruct
B, T, S1, M, HQ, KVH, D = 3, 6, 4, 32, 4, 2, 16  # requests, window, slots + 1, cache length, heads
C, W = 32, 4  # conv channels and width
H, HV, K, V, L = 2, 6, 16, 32, 16  # GDN key / value heads and dims, ring length


class Picked(Exception):
    """A kernel entry point was reached."""


KERNELS = {  # kernel -> (module, entry point the ops call)
    "attention": (pallas_attention, "attention_verify"),
    "conv": (pallas_conv, "conv_verify"),
    "gdn_chunked": (pallas_chunked, "gdn_chunked"),
    "fold": (pallas_fold, "gdn_fold"),
    "gdn_verify": (pallas_verify, "gdn_verify"),
    "top_k": (pallas_topk, "top_k"),
    "observe": (pallas_observe, "observe"),
}


def _attention_verify(d=D, q_dtype=F32, lead=(), t_max=T, layer=None):
    cache = lead + (S1, M, KVH, d)
    return partial(attention.attention_verify, t_max=t_max, layer=layer), (
        SD((B * T, HQ, d), q_dtype),
        SD(cache, F32),
        SD(cache, F32),
        SD((S1,), I32),
        SD((B + 1,), I32),
        SD((B,), I32),
    )


def _attention_block(d=D, dtype=F32, layer=None, lead=()):
    cache = lead + (S1, M, KVH, d)
    return partial(attention.attention_block, layer=layer), (
        SD((B, T, HQ, d), dtype),
        SD(cache, dtype),
        SD(cache, dtype),
        SD((B,), I32),
        SD((B,), I32),
        SD((B, T, KVH, d), dtype),
        SD((B, T, KVH, d), dtype),
    )


def _conv_verify(width=W, window=T, x_dtype=F32, layer=None, lead=()):
    return partial(conv.conv_verify, layer=layer), (
        SD((B * T, C), x_dtype),
        SD(lead + (S1, width - 1, C), F32),
        SD(lead + (S1, window, C), F32),
        SD((C, width), F32),
        SD((B + 1,), I32),
        SD((B,), I32),
    )


def _gdn_chunked(k=K, dtype=F32):
    return gdn.gdn_chunked, (
        SD((2, 37, H, k), dtype),
        SD((2, 37, H, k), dtype),
        SD((2, 37, HV, V), dtype),
        SD((2, 37, HV), F32),
        SD((2, 37, HV), F32),
        SD((2, HV, k, V), F32),
        SD((2,), I32),
    )


def _fold(ring_len=L, ring_u="f32", lead=()):
    u = SD(lead + (S1, HV, ring_len, V), F32)
    if ring_u == "hilo":
        u = (SD(u.shape, BF16),) * 2
    elif ring_u == "bf16":  # bf16 without its lo half
        u = SD(u.shape, BF16)
    return gdn.gdn_fold, (
        SD(lead + (S1, HV, K, V), F32),
        SD(lead + (S1, H, ring_len, K), F32),
        u,
        SD(lead + (S1, HV, ring_len), F32),
        SD((S1,), I32),
    )


def _gdn_verify(t_max=T, gates=F32, layer=None, lead=()):
    n = B * T
    return partial(gdn.gdn_verify, t_max=t_max, layer=layer), (
        SD((n, H, K), F32),
        SD((n, H, K), F32),
        SD((n, HV, V), F32),
        SD((n, HV), F32),
        SD((n, HV), F32),
        SD(lead + (S1, HV, K, V), F32),
        SD(lead + (S1, H, L, K), F32),
        SD(lead + (S1, HV, L, V), F32),
        SD(lead + (S1, HV, L), gates),
        SD((S1,), I32),
        SD((B + 1,), I32),
        SD((B,), I32),
    )


def _top_k(k=8, dtype=F32, vocab=512):
    return partial(sampling.top_k, k=k), (SD((5, vocab), dtype),)


def _observe(positions=5):
    return estimator.observe, (estimator.init(positions), SD((B, positions), F32), SD((B,), I32), SD((B,), I32))


# (kernel the call must reach or None, the call); the unsupported calls differ from a supported one
# in one property its kernel's supports() rules out
CASES = {
    "attention_verify": ("attention", _attention_verify()),
    "attention_verify-layer": ("attention", _attention_verify(lead=(2,), layer=1)),
    "attention_verify-head-dim": (None, _attention_verify(d=512)),  # D > 256
    "attention_verify-dtypes": (None, _attention_verify(q_dtype=BF16)),  # q bf16, caches f32
    "attention_verify-rows": (None, _attention_verify(t_max=65)),  # t_max * Hq / KVH > 128 rows
    "attention_block": ("attention", _attention_block()),
    "attention_block-layer": ("attention", _attention_block(layer=1, lead=(2,))),
    "attention_block-head-dim": (None, _attention_block(d=512)),  # D > 256
    "attention_block-float16": (None, _attention_block(dtype=jnp.float16)),
    "conv_verify": ("conv", _conv_verify()),
    "conv_verify-layer": ("conv", _conv_verify(layer=1, lead=(3,))),
    "conv_verify-width": (None, _conv_verify(width=9)),  # more taps than MAX_WIDTH
    "conv_verify-window": (None, _conv_verify(window=65)),  # window > MAX_T
    "conv_verify-float16": (None, _conv_verify(x_dtype=jnp.float16)),
    "gdn_chunked": ("gdn_chunked", _gdn_chunked()),
    "gdn_chunked-bf16": ("gdn_chunked", _gdn_chunked(dtype=BF16)),
    "gdn_chunked-key-dim": (None, _gdn_chunked(k=24)),  # not a power of two
    "gdn_chunked-float16": (None, _gdn_chunked(dtype=jnp.float16)),
    "fold": ("fold", _fold()),
    "fold-hilo-layers": ("fold", _fold(ring_u="hilo", lead=(3,))),
    "fold-ring-len": (None, _fold(ring_len=8)),  # below 16
    "fold-bf16-without-lo": (None, _fold(ring_u="bf16")),
    "gdn_verify": ("gdn_verify", _gdn_verify()),
    "gdn_verify-layer": ("gdn_verify", _gdn_verify(layer=2, lead=(3,))),
    "gdn_verify-window": (None, _gdn_verify(t_max=33)),  # window tile > 32
    "gdn_verify-gates": (None, _gdn_verify(gates=BF16)),  # gates must be f32
    "top_k": ("top_k", _top_k()),
    "top_k-bf16": ("top_k", _top_k(dtype=BF16)),
    "top_k-k": (None, _top_k(k=65)),  # k > 64
    "top_k-float16": (None, _top_k(dtype=jnp.float16)),
    "observe": ("observe", _observe()),
    "observe-positions": (None, _observe(positions=257)),  # more than 256 positions
}


@pytest.fixture
def picked(monkeypatch):
    """Every kernel entry point raises Picked(kernel)."""

    def reached(name):
        def kernel(*args, **kwargs):
            raise Picked(name)

        return kernel

    for name, (module, attr) in KERNELS.items():
        monkeypatch.setattr(module, attr, reached(name))
    return monkeypatch


def _pick(call, impl):
    """The kernel `call` reaches with `impl`, or None when it completes through its reference."""
    fn, args = call
    try:
        jax.eval_shape(partial(fn, impl=impl), *args)
    except Picked as kernel:
        return kernel.args[0]
    return None


@pytest.mark.parametrize("case", CASES)
def test_auto_on_a_gpu_takes_the_kernel_exactly_where_it_is_supported(picked, case):
    picked.setattr(dispatch, "on_gpu", lambda: True)
    want, call = CASES[case]
    assert _pick(call, "auto") == want
    assert _pick(call, "ref") is None


@pytest.mark.parametrize("case", CASES)
def test_off_the_gpu_auto_runs_the_reference_and_pallas_demands_the_kernel(picked, case):
    assert not dispatch.on_gpu()
    want, call = CASES[case]
    assert _pick(call, "auto") is None
    if want is None:
        with pytest.raises(ValueError, match="no Pallas kernel covers"):
            _pick(call, "pallas")
    else:
        assert _pick(call, "pallas") == want


@pytest.mark.parametrize(
    "call",
    [
        (
            attention.attention_prefill,
            (SD((B, T, HQ, D), F32), SD((B, T, KVH, D), F32), SD((B, T, KVH, D), F32), SD((B,), I32)),
        ),
        (conv.conv_prefill, (SD((B, T, C), F32), SD((C, W), F32), SD((B,), I32))),
        (conv.conv_commit, (SD((S1, W - 1, C), F32), SD((S1, T, C), F32), SD((B,), I32), SD((B,), I32))),
        (sampling.greedy_tokens, (SD((5, 512), F32),)),
    ],
    ids=["attention_prefill", "conv_prefill", "conv_commit", "greedy_tokens"],
)
def test_ops_without_a_kernel_run_their_reference_with_any_impl(picked, call):
    picked.setattr(dispatch, "on_gpu", lambda: True)
    for impl in dispatch.IMPLS:
        assert _pick(call, impl) is None
    with pytest.raises(ValueError, match="impl"):
        _pick(call, "kernel")
