"""Pallas GDN fold kernel (jaxspec/pallas/fold.py) against the float64 oracle and the jnp reference.

CPU: the kernel runs in Pallas interpret mode on small shapes; the real (Triton) kernel is lowered
for an H200 at the benchmark shapes. GPU (`-m gpu`): the compiled kernel at Qwen3.8-27B head shapes.

Every case poisons what the contract says must not be read: dead ring records (j >= m) hold NaN/inf,
and the checkpoints of slots with m = 0 hold NaN, which must come back bit for bit (the kernel
skips those slots; their aliased checkpoint is never touched) and must not leak anywhere else.
Every element of a slot with m > 0 must be written: the expected state differs from the old one
everywhere, and assert_close also demands it finite.
"""

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import oracle
import pytest
from gpu_lowering import lower_for_h200

from jaxspec.ops.gdn import gdn_fold
from jaxspec.pallas import fold

bf16 = jnp.bfloat16
SD = jax.ShapeDtypeStruct
ON_GPU = jax.default_backend() == "gpu"

# Relative state error (max-abs / max|expected|) against float64. The jnp reference lands at
# ~1e-7..4e-7 with a float32 checkpoint; the kernel must stay at that level (the op test's bound is
# 1e-5). A bf16 checkpoint is one rounding of the folded state (2^-9 relative).
TOL_F32 = 2e-6
TOL_BF16 = 4e-3


def make_case(rng, *, layers, s1, h, hv, kd, vd, ring_len, num_records, ckpt_dtype, ring):
    """Random fold inputs with dead records poisoned and m = 0 checkpoints set to NaN.

    ring: "f32" (float32 keys and updates), "f32u" (bf16 keys, float32 updates),
    "hilo" (bf16 keys, (hi, lo) bf16 updates). Returns (args, u_exact float64)."""
    lead = () if layers is None else (layers,)
    nr = np.asarray(num_records, np.int32)
    ckpt = rng.standard_normal(lead + (s1, hv, kd, vd)).astype(np.float32)
    rk = oracle.l2n(rng.standard_normal(lead + (s1, h, ring_len, kd))).astype(np.float32)
    ru = rng.standard_normal(lead + (s1, hv, ring_len, vd)).astype(np.float32)
    rg = (-oracle.softplus(rng.standard_normal(lead + (s1, hv, ring_len)))).astype(np.float32)
    dead = np.arange(ring_len) >= nr[:, None]  # [S1, L]
    dead_rec = dead[:, None, :, None]
    rk = np.where(dead_rec, np.nan, rk).astype(np.float32)
    ru = np.where(dead_rec, np.inf, ru).astype(np.float32)
    rg = np.where(dead[:, None, :], np.nan, rg).astype(np.float32)
    ckpt[..., nr == 0, :, :, :] = np.nan
    ckpt = ckpt.astype(ckpt_dtype)
    if ring == "f32":
        return (ckpt, rk, ru, rg, nr), ru.astype(np.float64)
    rk = rk.astype(bf16)
    if ring == "f32u":
        return (ckpt, rk, ru, rg, nr), ru.astype(np.float64)
    hi = ru.astype(bf16)
    with np.errstate(invalid="ignore"):
        lo = (ru - hi.astype(np.float32)).astype(bf16)
    hi = np.where(dead_rec, np.nan, hi).astype(bf16)
    lo = np.where(dead_rec, np.nan, lo).astype(bf16)
    return (ckpt, rk, (hi, lo), rg, nr), hi.astype(np.float64) + lo.astype(np.float64)


def check(out, args, u_exact, *, ref=None):
    """out vs the float64 oracle per (layer, slot); m = 0 slots bit-equal to their (NaN) input."""
    ckpt, rk, _, rg, nr = args
    out = np.asarray(out)
    assert out.dtype == ckpt.dtype and out.shape == ckpt.shape
    tol = TOL_F32 if ckpt.dtype == np.float32 else TOL_BF16
    ring_len = rk.shape[-2]
    for idx in np.ndindex(ckpt.shape[:-4]):
        for s, m in enumerate(nr):
            at = idx + (s,)
            if m <= 0:
                np.testing.assert_array_equal(
                    oracle.bits(out[at]), oracle.bits(ckpt[at]), f"slot {at} with no records must be untouched"
                )
                continue
            exp = oracle.gdn_fold(
                np.asarray(ckpt[at]), np.asarray(rk[at]), u_exact[at], np.asarray(rg[at]), min(int(m), ring_len)
            )
            oracle.assert_close(out[at], exp, tol, f"ckpt' {at} (m={m})")
    if ref is not None:  # same function as the jnp reference: bf16 outputs within one rounding
        ref = np.asarray(ref).astype(np.float64)
        live = nr > 0
        got = out.astype(np.float64)[..., live, :, :, :]
        want = ref[..., live, :, :, :]
        scale = np.abs(want).max()
        lim = 2e-6 if ckpt.dtype == np.float32 else 2**-8
        assert np.abs(got - want).max() <= lim * scale


# ------------------------------------------------------------------------------ config, supports


def test_config_rejects_bad_values():
    for field, bad in (
        ("block_v", 48),
        ("block_v", 8),
        ("chunk", 8),
        ("chunk", 24),
        ("num_warps", 3),
        ("num_stages", 0),
        ("heads", 3),
    ):
        with pytest.raises(ValueError, match=field):
            fold.FoldConfig(**{field: bad})
    fold.FoldConfig(block_v=64, chunk=32, num_warps=4, num_stages=1)


def _sds(
    g=48,
    s1=129,
    h=16,
    hv=48,
    kd=128,
    vd=128,
    ring_len=16,
    ckpt=jnp.bfloat16,
    keys=jnp.bfloat16,
    ring="hilo",
    nr_dtype=jnp.int32,
):
    lead = () if g is None else (g,)
    u = (
        (SD(lead + (s1, hv, ring_len, vd), bf16),) * 2
        if ring == "hilo"
        else SD(lead + (s1, hv, ring_len, vd), jnp.float32)
    )
    return (
        SD(lead + (s1, hv, kd, vd), ckpt),
        SD(lead + (s1, h, ring_len, kd), keys),
        u,
        SD(lead + (s1, hv, ring_len), jnp.float32),
        SD((s1,), nr_dtype),
    )


def test_supports():
    assert fold.supports(*_sds())
    assert fold.supports(*_sds(ckpt=jnp.float32, ring="f32"))
    assert fold.supports(*_sds(g=None, ring_len=64, keys=jnp.float32, ring="f32"))
    assert not fold.supports(*_sds(vd=8))  # below the MMA's 16
    assert not fold.supports(*_sds(kd=96))  # not a power of two
    assert not fold.supports(*_sds(ring_len=8))
    assert not fold.supports(*_sds(hv=40, h=16))  # HV not a multiple of H
    assert not fold.supports(*_sds(ckpt=jnp.float16))
    assert not fold.supports(*_sds(keys=jnp.float16))
    assert not fold.supports(*_sds(nr_dtype=jnp.int64 if jax.config.jax_enable_x64 else jnp.int16))
    ckpt, k, u, g, nr = _sds()
    assert not fold.supports(ckpt, k, (u[0], SD(u[1].shape, jnp.float32)), g, nr)  # mixed pair
    assert not fold.supports(ckpt, k, SD(u[0].shape, bf16), g, nr)  # bf16 without lo
    assert not fold.supports(ckpt, k, u, g, SD((128,), jnp.int32))  # num_records != S1


# ------------------------------------------------------------------------------ interpret mode

SMALL = dict(h=2, hv=6, kd=32, vd=32)
# (layers, L, num_records, ckpt, ring, config): null slot 0, empty slots, one record, partial, full
# ring; L = 32 with chunk 16 runs the record loop over 1 or 2 chunks; block_v 16 tiles V in two.
CASES = [
    (None, 16, [0, 5, 16, 1, 0], np.float32, "f32", None),
    (2, 16, [0, 5, 16, 1, 0], np.float32, "f32u", None),
    (2, 16, [0, 7, 0, 16, 2], bf16, "hilo", None),
    (None, 16, [0, 3, 16, 9, 1], np.float32, "hilo", fold.FoldConfig(block_v=16)),
    (2, 32, [0, 16, 17, 32, 1, 0], np.float32, "f32u", None),
    (None, 32, [0, 31, 3, 0, 20, 32], bf16, "hilo", fold.FoldConfig(block_v=16, chunk=32)),
    (None, 64, [0, 33, 64, 0, 1], np.float32, "f32", fold.FoldConfig(chunk=16, num_stages=1)),
    # several tiles (value heads) per program; heads = 4 is clipped to 2 (HV = 6)
    (2, 16, [0, 5, 16, 1, 0], np.float32, "f32", fold.FoldConfig(heads=4, block_v=16)),
    (None, 32, [0, 16, 17, 32, 1, 0], bf16, "f32u", fold.FoldConfig(heads=2, block_v=32, num_warps=8)),
    (None, 16, [0, 7, 0, 16, 2], bf16, "hilo", fold.FoldConfig(heads=1, block_v=32)),
]


@pytest.mark.parametrize(
    "layers,ring_len,nr,ckpt_dtype,ring,config",
    CASES,
    ids=[f"{c[0] or 0}layers-L{c[1]}-{np.dtype(c[3]).name}-{c[4]}-{'cfg' if c[5] else 'dflt'}" for c in CASES],
)
def test_fold_interpret(layers, ring_len, nr, ckpt_dtype, ring, config):
    rng = np.random.default_rng(zlib.crc32(repr((layers, ring_len, nr, ring)).encode()))
    args, u_exact = make_case(
        rng, layers=layers, s1=len(nr), ring_len=ring_len, num_records=nr, ckpt_dtype=ckpt_dtype, ring=ring, **SMALL
    )
    out = jax.jit(functools.partial(fold.gdn_fold, config=config, interpret=True))(*args)
    ref = jax.jit(functools.partial(gdn_fold, impl="ref"))(*args)
    check(out, args, u_exact, ref=ref)


def test_dispatch():
    rng = np.random.default_rng(7)
    args, u_exact = make_case(
        rng, layers=None, s1=4, ring_len=16, num_records=[0, 4, 16, 1], ckpt_dtype=np.float32, ring="hilo", **SMALL
    )
    kernel = np.asarray(jax.jit(functools.partial(fold.gdn_fold, interpret=True))(*args))
    via_op = np.asarray(jax.jit(functools.partial(gdn_fold, impl="pallas"))(*args))
    np.testing.assert_array_equal(oracle.bits(via_op), oracle.bits(kernel))
    auto = np.asarray(jax.jit(functools.partial(gdn_fold, impl="auto"))(*args))
    ref = np.asarray(jax.jit(functools.partial(gdn_fold, impl="ref"))(*args))
    if not ON_GPU:  # auto takes the kernel only on a GPU
        np.testing.assert_array_equal(oracle.bits(auto), oracle.bits(ref))
    check(via_op, args, u_exact, ref=ref)
    # an unsupported call: V = 8 is below the MMA width
    small, small_exact = make_case(
        rng,
        layers=None,
        s1=2,
        ring_len=16,
        num_records=[0, 3],
        ckpt_dtype=np.float32,
        ring="f32",
        h=1,
        hv=2,
        kd=16,
        vd=8,
    )
    with pytest.raises(ValueError, match="gdn_fold"):
        gdn_fold(*small, impl="pallas")
    # auto falls back to the reference, on any device: bit-equal to impl="ref" (the same jnp code
    # under the same jit), and that result right against the float64 oracle (so a fallback that
    # returns the checkpoint unchanged, or a broken reference, fails here)
    fallback = np.asarray(jax.jit(functools.partial(gdn_fold, impl="auto"))(*small))
    small_ref = np.asarray(jax.jit(functools.partial(gdn_fold, impl="ref"))(*small))
    np.testing.assert_array_equal(oracle.bits(fallback), oracle.bits(small_ref))
    check(fallback, small, small_exact)


# ------------------------------------------------------------------------------ H200 lowering


@pytest.mark.parametrize(
    "shapes",
    [
        dict(),  # bench: bf16 ckpt, hi/lo ring
        dict(ckpt=jnp.float32, ring="f32"),  # fp32 ckpt, fp32 ring (bf16 keys)
        dict(g=None, s1=33, ring_len=64, ckpt=jnp.float32, keys=jnp.float32, ring="f32"),  # loop, f32 keys
    ],
    ids=["bf16-hilo-48L", "f32-f32-48L", "f32keys-L64-4d"],
)
@pytest.mark.parametrize(
    "config",
    [None, fold.FoldConfig(heads=1, block_v=128, num_warps=8), fold.FoldConfig(heads=4, block_v=32)],
    ids=["default", "h1-v128", "h4-v32"],
)
def test_lowers_for_h200(shapes, config):
    args = _sds(**shapes)
    text = lower_for_h200(functools.partial(fold.gdn_fold, config=config, interpret=False), *args)
    assert "__gpu$xla.gpu.triton" in text
    assert "tf.aliasing_output" in text or "output_operand_aliases" in text  # checkpoint in place


# ------------------------------------------------------------------------------ GPU

GPU_CASES = [
    # Qwen3.8-27B heads (H 16, HV 48, K = V = 128), ring 16, all ckpt/ring combinations
    (2, 16, [0, 8, 16, 1, 0, 5, 8, 3, 12], np.float32, "f32u", None),
    (2, 16, [0, 8, 16, 1, 0, 5, 8, 3, 12], np.float32, "hilo", None),
    (2, 16, [0, 8, 16, 1, 0, 5, 8, 3, 12], bf16, "hilo", None),
    (None, 16, [0, 8, 16, 1, 0, 5, 8, 3, 12], bf16, "f32u", None),
    # longer ring (record loop), float32 keys, V split in two programs
    (1, 64, [0, 64, 17, 1, 0, 40, 16, 33], np.float32, "f32", fold.FoldConfig(block_v=64)),
    (1, 32, [0, 32, 17, 1, 0, 16], bf16, "hilo", fold.FoldConfig(block_v=64, num_warps=4)),
    # the tile shapes of the benchmark's sweep
    (1, 16, [0, 8, 16, 1, 0, 5, 8, 3, 12], bf16, "hilo", fold.FoldConfig(heads=1, block_v=128, num_warps=8)),
    (1, 16, [0, 8, 16, 1, 0, 5, 8, 3, 12], bf16, "hilo", fold.FoldConfig(heads=4, block_v=32)),
    (1, 16, [0, 8, 16, 1, 0, 5, 8, 3, 12], np.float32, "f32u", fold.FoldConfig(heads=8, block_v=64)),
    (1, 16, [0, 8, 16, 1, 0, 5, 8, 3, 12], bf16, "f32u", fold.FoldConfig(heads=4, block_v=32, num_warps=2)),
    (1, 16, [0, 8, 16, 1, 0, 5, 8, 3, 12], np.float32, "hilo", fold.FoldConfig(heads=2, block_v=128, num_warps=8)),
]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "layers,ring_len,nr,ckpt_dtype,ring,config",
    GPU_CASES,
    ids=[f"{c[0] or 0}layers-L{c[1]}-{np.dtype(c[3]).name}-{c[4]}-{'cfg' if c[5] else 'dflt'}" for c in GPU_CASES],
)
def test_fold_gpu(layers, ring_len, nr, ckpt_dtype, ring, config):
    rng = np.random.default_rng(zlib.crc32(repr((layers, ring_len, nr, ring, np.dtype(ckpt_dtype).name)).encode()))
    args, u_exact = make_case(
        rng,
        layers=layers,
        s1=len(nr),
        ring_len=ring_len,
        num_records=nr,
        ckpt_dtype=ckpt_dtype,
        ring=ring,
        h=16,
        hv=48,
        kd=128,
        vd=128,
    )
    out = jax.jit(functools.partial(fold.gdn_fold, config=config, interpret=False))(*args)
    ref = jax.jit(functools.partial(gdn_fold, impl="ref"))(*args)
    check(out, args, u_exact, ref=ref)
    # impl="auto" takes the kernel on the GPU, with the donated checkpoint updated in place
    auto = jax.jit(functools.partial(gdn_fold, impl="auto"), donate_argnums=0)
    out2 = np.asarray(auto(jnp.asarray(args[0]), *args[1:]))
    if config is None:
        np.testing.assert_array_equal(oracle.bits(out2), oracle.bits(np.asarray(out)))
