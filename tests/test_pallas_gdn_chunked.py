"""The chunked GDN prefill kernels (jaxspec/pallas/gdn_chunked.py) against the jnp reference
(jaxspec.ops.gdn.gdn_chunked, impl="ref") and an independent float64 token-by-token recurrence
(tests/oracle.py).

CPU: interpret mode on small shapes (K = V = 32 or 16/64, chunks of 16 / 32 / 64, two V blocks);
the real Triton kernels are lowered for an H200 at the benchmark shapes. GPU (`-m gpu`): the
compiled kernels at small and Qwen3.8-27B head shapes. Every case poisons what the contract says
must not be read: q, k, v, g and beta hold NaN at every position past a request's length. Outputs
are checked element by element: o rows past the length exactly 0, every other element finite
(interpret mode fills fresh outputs with NaN, so an element the kernels never write fails) and
close to both references.

Tolerances (relative RMS error, rms(got - want) / rms(want), per output; and max-abs error over
max |want|): the kernels multiply on bf16 tensor cores with float32 accuracy from hi/lo splits
(~2^-16 per product), measured at 5e-6..8e-6 RMS and <= 2e-5 max against float64 on these cases,
where the float32 reference lands at ~1e-7..1.6e-6. Bounds leave ~5x margin.
"""

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import oracle
import pytest
from gpu_lowering import lower_for_h200

from jaxspec.ops.gdn import gdn_chunked
from jaxspec.pallas import gdn_chunked as kc

bf16 = jnp.bfloat16
SD = jax.ShapeDtypeStruct
ON_GPU = jax.default_backend() == "gpu"
gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")

TOL_RMS = 4e-5  # kernel vs float64 oracle and vs the float32 reference, relative RMS
TOL_MAX = 1e-4  # max-abs error / max |expected|

_ref = jax.jit(functools.partial(gdn_chunked, impl="ref"))


def decays(rng, shape, decay):
    """'mild' (g ~ -0.035), 'sig' (log-sigmoid of a normal, as the benchmark) or 'strong' (down to
    ~-20 per token: a 64-token chunk spans e^-300, so any unmasked exp(-G) would overflow)."""
    z = rng.standard_normal(shape)
    if decay == "mild":
        return -0.05 * oracle.softplus(z)
    if decay == "sig":
        return np.log(oracle.sigmoid(z))
    return -3.0 * oracle.softplus(2 * z + 1)


def make_case(seed, *, B, T, H, HV, K, V, lengths, dtype, decay="sig", poison=True):
    """Normalised q (scaled K^-1/2) and k, v in `dtype`; g, beta, h0 float32; NaN past each length."""
    rng = np.random.default_rng(seed)
    q = oracle.l2n(rng.standard_normal((B, T, H, K))) * K**-0.5
    k = oracle.l2n(rng.standard_normal((B, T, H, K)))
    v = rng.standard_normal((B, T, HV, V))
    g = decays(rng, (B, T, HV), decay)
    beta = oracle.sigmoid(rng.standard_normal((B, T, HV)))
    h0 = rng.standard_normal((B, HV, K, V)) * 0.5
    lengths = np.asarray(lengths, np.int32)
    if poison:
        dead = np.arange(T)[None, :] >= lengths[:, None]  # [B, T]
        q, k, v = (np.where(dead[:, :, None, None], np.nan, x) for x in (q, k, v))
        g, beta = (np.where(dead[:, :, None], np.nan, x) for x in (g, beta))
    q, k, v = (jnp.asarray(x.astype(np.float32)).astype(dtype) for x in (q, k, v))
    g, beta, h0 = (jnp.asarray(x.astype(np.float32)) for x in (g, beta, h0))
    return (q, k, v, g, beta, h0, jnp.asarray(lengths))


def rel_rms(got, want):
    return np.sqrt(np.mean((got - want) ** 2)) / max(np.sqrt(np.mean(want**2)), 1e-30)


def close(got, want, name, tol_rms=TOL_RMS, tol_max=TOL_MAX):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
    assert np.all(np.isfinite(got)), f"{name}: non-finite values"
    if want.size == 0:
        return
    err = rel_rms(got, want)
    assert err <= tol_rms, f"{name}: relative RMS error {err:.3g} > {tol_rms:g}"
    err_max = np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)
    assert err_max <= tol_max, f"{name}: max-abs error / max|expected| {err_max:.3g} > {tol_max:g}"


def check(out, args, *, ref=None, oracle_check=True, **tol):
    """Kernel outputs against the contract: o past each length exactly 0, everything finite, and
    close to the float64 recurrence over the first lengths[b] tokens and to the jnp reference."""
    o, h = (np.asarray(x) for x in out)
    q, k, v, g, beta, h0, lengths = (
        np.asarray(x.astype(jnp.float32)) if x.dtype == bf16 else np.asarray(x) for x in args
    )
    B, T, HV, V = v.shape
    assert o.dtype == np.float32 and o.shape == (B, T, HV, V)
    assert h.dtype == np.float32 and h.shape == h0.shape
    for b, n in enumerate(lengths):
        n = int(n)
        np.testing.assert_array_equal(o[b, n:], 0.0, f"o[{b}] past its length {n} must be exactly 0")
        if oracle_check:
            eo, _, eh = oracle.gdn_recurrence(q[b, :n], k[b, :n], v[b, :n], g[b, :n], beta[b, :n], h0[b])
            close(o[b, :n], eo, f"o[{b}] vs float64 (len {n})", **tol)
            close(h[b], eh, f"h[{b}] vs float64 (len {n})", **tol)
    if ref is not None:
        ro, rh = (np.asarray(x) for x in ref)
        close(o, ro, "o vs reference", **tol)
        close(h, rh, "h vs reference", **tol)


# ------------------------------------------------------------------------------ config, supports


def test_config_rejects_bad_values():
    for field, bad in (
        ("chunk", 8),
        ("chunk", 48),
        ("chunk", 128),
        ("block_v", 8),
        ("block_v", 24),
        ("num_warps", 3),
        ("num_warps", 32),
        ("prep_warps", 0),
        ("num_stages", 0),
        ("num_stages", 1.5),
        ("chunk", True),
    ):
        with pytest.raises(ValueError, match=field):
            kc.ChunkConfig(**{field: bad})
    kc.ChunkConfig(chunk=16, block_v=16, num_warps=8, num_stages=3, prep_warps=2)


def _sds(B=1, T=4096, H=16, HV=48, K=128, V=128, dtype=bf16, lengths=True, h0=jnp.float32):
    return (
        SD((B, T, H, K), dtype),
        SD((B, T, H, K), dtype),
        SD((B, T, HV, V), dtype),
        SD((B, T, HV), jnp.float32),
        SD((B, T, HV), jnp.float32),
        SD((B, HV, K, V), h0),
        SD((B,), jnp.int32) if lengths else None,
    )


def test_supports():
    assert kc.supports(*_sds())
    assert kc.supports(*_sds(B=4, dtype=jnp.float32, lengths=False))
    assert kc.supports(*_sds(T=37, H=2, HV=2, K=16, V=32, h0=bf16))
    assert not kc.supports(*_sds(V=8))  # below the MMA's 16
    assert not kc.supports(*_sds(K=96))  # not a power of two
    assert not kc.supports(*_sds(K=256))  # state kernel's shared memory
    assert not kc.supports(*_sds(HV=40))  # HV not a multiple of H
    assert not kc.supports(*_sds(dtype=jnp.float16))
    assert not kc.supports(*_sds(B=64, T=1 << 16))  # int32 addressing
    assert kc.supports(*_sds(), config=kc.ChunkConfig(block_v=256))  # block_v is clipped to V
    q, k, v, g, beta, h0, lengths = _sds()
    assert not kc.supports(q, k, v, g, beta, h0, SD((2,), jnp.int32))
    assert not kc.supports(q, k, v, g, beta, h0, SD((1,), jnp.float32))
    assert not kc.supports(q, k, v, SD((1, 4096, 16), jnp.float32), beta, h0, lengths)


# ------------------------------------------------------------------------------ interpret mode

SMALL = dict(H=2, HV=6, K=32, V=32)  # GQA ratio 3, two V blocks of 16
CFG16 = kc.ChunkConfig(chunk=16, block_v=16)
CFG32 = kc.ChunkConfig(chunk=32, block_v=16)
CFG64 = kc.ChunkConfig(chunk=64, block_v=16)
# (B, T, lengths, dtype, decay, shapes, config): T = 1, non-multiples of the chunk, exact multiples;
# lengths 0, T and ragged in between; bf16 and float32 q/k/v; GQA ratio 3 and 1; the three chunks.
CASES = [
    (2, 1, [1, 0], bf16, "sig", SMALL, CFG16),
    (3, 37, [37, 0, 20], bf16, "strong", SMALL, CFG16),
    (2, 37, [37, 16], jnp.float32, "mild", SMALL, CFG32),
    (2, 64, [64, 33], jnp.float32, "sig", dict(H=3, HV=3, K=16, V=64), CFG64),
    (2, 130, [130, 65], bf16, "sig", SMALL, CFG64),
    (2, 130, [0, 129], jnp.float32, "strong", dict(H=2, HV=2, K=32, V=32), CFG32),
    (2, 200, [200, 150], bf16, "mild", dict(H=1, HV=3, K=32, V=16), CFG32),
    (1, 200, [200], bf16, "sig", SMALL, None),
]


@pytest.mark.parametrize(
    "B,T,lengths,dtype,decay,shapes,config",
    CASES,
    ids=[
        f"B{c[0]}-T{c[1]}-{np.dtype(c[3]).name}-{c[4]}-r{c[5]['HV'] // c[5]['H']}-C{(c[6] or kc.ChunkConfig()).chunk}"
        for c in CASES
    ],
)
def test_interpret(B, T, lengths, dtype, decay, shapes, config):
    seed = zlib.crc32(repr((B, T, lengths, np.dtype(dtype).name, decay, shapes)).encode())
    args = make_case(seed, B=B, T=T, lengths=lengths, dtype=dtype, decay=decay, **shapes)
    out = jax.jit(functools.partial(kc.gdn_chunked, config=config, interpret=True))(*args)
    check(out, args, ref=_ref(*args))


def test_interpret_no_lengths_and_bf16_state():
    """lengths=None (all T) and a bfloat16 h0; no poisoning (every position is live)."""
    args = make_case(11, B=2, T=45, lengths=[45, 45], dtype=bf16, poison=False, **SMALL)
    q, k, v, g, beta, h0, _ = args
    h0 = h0.astype(bf16)
    out = jax.jit(functools.partial(kc.gdn_chunked, config=CFG16, interpret=True))(q, k, v, g, beta, h0, None)
    check(
        out,
        (q, k, v, g, beta, h0.astype(jnp.float32), jnp.full((2,), 45, jnp.int32)),
        ref=_ref(q, k, v, g, beta, h0, None),
    )


def test_interpret_chained():
    """Prefill in two pieces (the state of the first is the h0 of the second; the second piece
    ragged) equals one pass over the concatenation."""
    args = make_case(12, B=2, T=96, lengths=[96, 70], dtype=bf16, poison=False, **SMALL)
    q, k, v, g, beta, h0, lengths = args
    run = jax.jit(functools.partial(kc.gdn_chunked, config=CFG32, interpret=True))
    o, h = run(*args)
    first, second = (tuple(x[:, s] for x in (q, k, v, g, beta)) for s in (slice(0, 48), slice(48, 96)))
    o1, h1 = run(*first, h0, jnp.array([48, 48], jnp.int32))
    o2, h2 = run(*second, h1, jnp.array([48, 22], jnp.int32))
    close(np.concatenate([np.asarray(o1), np.asarray(o2)], axis=1), np.asarray(o), "o in two pieces")
    close(h2, h, "h in two pieces")


def test_dispatch():
    args = make_case(13, B=2, T=37, lengths=[37, 5], dtype=bf16, **SMALL)
    kernel = jax.jit(functools.partial(kc.gdn_chunked, interpret=True))(*args)
    via_op = jax.jit(functools.partial(gdn_chunked, impl="pallas"))(*args)
    for a, b in zip(via_op, kernel):
        np.testing.assert_array_equal(oracle.bits(np.asarray(a)), oracle.bits(np.asarray(b)))
    ref = _ref(*args)
    auto = jax.jit(functools.partial(gdn_chunked, impl="auto"))(*args)
    if not ON_GPU:  # auto takes the kernel only on a GPU
        for a, b in zip(auto, ref):
            np.testing.assert_array_equal(oracle.bits(np.asarray(a)), oracle.bits(np.asarray(b)))
    check(via_op, args, ref=ref)
    # an unsupported call: V = 8 is below the MMA width
    small = make_case(14, B=1, T=5, lengths=[5], dtype=jnp.float32, H=1, HV=2, K=16, V=8)
    with pytest.raises(ValueError, match="gdn_chunked"):
        gdn_chunked(*small, impl="pallas")
    # auto falls back to the reference, on any device: bit-equal to impl="ref" (the same jnp code
    # under the same jit), and that result right against the float64 recurrence (so a fallback that
    # returns something else, or a broken reference, fails here)
    fallback = jax.jit(functools.partial(gdn_chunked, impl="auto"))(*small)
    small_ref = jax.jit(functools.partial(gdn_chunked, impl="ref"))(*small)
    for a, b in zip(fallback, small_ref):
        np.testing.assert_array_equal(oracle.bits(np.asarray(a)), oracle.bits(np.asarray(b)))
    check(fallback, small)


# ------------------------------------------------------------------------------ H200 lowering


@pytest.mark.parametrize(
    "shapes",
    [dict(), dict(B=4), dict(dtype=jnp.float32, lengths=False), dict(T=4000)],
    ids=["1x4096-bf16", "4x4096-bf16", "1x4096-f32-nolengths", "1x4000-bf16"],
)
@pytest.mark.parametrize(
    "config",
    [
        None,
        kc.ChunkConfig(block_v=32, num_stages=2),
        kc.ChunkConfig(block_v=128, num_warps=8),
        kc.ChunkConfig(chunk=32),
    ],
    ids=["default", "v32-s2", "v128-w8", "c32"],
)
def test_lowers_for_h200(shapes, config):
    """The real kernels lower to Triton at the benchmark shape (1 x 4096 tokens, H 16, HV 48,
    K = V = 128) and its variants: two Triton calls (prep, state), no fallback."""
    text = lower_for_h200(functools.partial(kc.gdn_chunked, config=config, interpret=False), *_sds(**shapes))
    assert text.count("__gpu$xla.gpu.triton") == 2


# ------------------------------------------------------------------------------ GPU

GPU_CASES = [
    (3, 37, [37, 0, 20], bf16, "strong", SMALL, None),
    (2, 200, [200, 131], jnp.float32, "sig", dict(H=2, HV=2, K=64, V=64), None),
    (2, 300, [300, 64], bf16, "sig", dict(H=4, HV=12, K=128, V=128), kc.ChunkConfig(chunk=32, block_v=32)),
    (2, 257, [257, 1], bf16, "mild", dict(H=4, HV=12, K=128, V=128), kc.ChunkConfig(block_v=32, num_stages=2)),
    (1, 130, [130], bf16, "sig", dict(H=4, HV=12, K=128, V=128), kc.ChunkConfig(block_v=128, num_warps=8)),
    (1, 130, [100], bf16, "sig", dict(H=4, HV=12, K=128, V=128), kc.ChunkConfig(chunk=16, prep_warps=8)),
]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(
    "B,T,lengths,dtype,decay,shapes,config",
    GPU_CASES,
    ids=[f"B{c[0]}-T{c[1]}-{np.dtype(c[3]).name}-{c[4]}-K{c[5]['K']}-{i}" for i, c in enumerate(GPU_CASES)],
)
def test_gpu_small(B, T, lengths, dtype, decay, shapes, config):
    seed = zlib.crc32(repr((B, T, lengths, np.dtype(dtype).name, decay, shapes, "gpu")).encode())
    args = make_case(seed, B=B, T=T, lengths=lengths, dtype=dtype, decay=decay, **shapes)
    out = jax.jit(functools.partial(kc.gdn_chunked, config=config, interpret=False))(*args)
    check(out, args, ref=_ref(*args))
    if config is None:  # impl="auto" takes the kernel on the GPU
        auto = jax.jit(functools.partial(gdn_chunked, impl="auto"))(*args)
        for a, b in zip(auto, out):
            np.testing.assert_array_equal(oracle.bits(np.asarray(a)), oracle.bits(np.asarray(b)))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("B,lengths", [(1, [4096]), (4, [4096, 4000, 1, 0])], ids=["1x4096", "4x4096-ragged"])
def test_gpu_benchmark_shape(B, lengths):
    """Qwen3.8-27B GDN layer shapes (H 16, HV 48, K = V = 128), bf16 q/k/v: kernel vs reference
    (the float64 oracle is too slow here; it is checked on the first request's first 256 tokens)."""
    args = make_case(21 + B, B=B, T=4096, lengths=lengths, dtype=bf16, H=16, HV=48, K=128, V=128)
    out = jax.jit(functools.partial(kc.gdn_chunked, interpret=False))(*args)
    check(out, args, ref=_ref(*args), oracle_check=False)
    short = tuple(x[:1, :256] for x in args[:5])  # q, k, v, g, beta
    args256 = short + (args[5][:1], jnp.array([256], jnp.int32))
    check(jax.jit(functools.partial(kc.gdn_chunked, interpret=False))(*args256), args256)
