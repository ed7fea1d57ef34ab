"""The GDN replay-verify Pallas kernel against the jnp reference (jaxspec.ops.gdn.gdn_verify, impl="ref").

CPU: interpret mode, small shapes (K = V = 32, two V blocks, two K chunks). GPU (-m gpu): the real
Triton kernel at model shapes. Both check every element the contract writes (outputs of real tokens,
zero rows of padding and null-slot requests, the window's ring records) and that everything else in
the ring is bit-identical; interpret mode fills fresh outputs with NaN, so unwritten rows fail.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import oracle
import pytest
from gpu_lowering import lower_for_h200

from jaxspec.ops.gdn import gdn_verify
from jaxspec.pallas import gdn_verify as kv

bf16 = jnp.bfloat16
ON_GPU = jax.default_backend() == "gpu"
gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")

# Small CPU shapes: r = 3 value heads per key head, 2 V blocks, 2 K chunks, ring 16.
SMALL = dict(H=2, HV=6, K=32, V=32, L=16, S1=6)
SMALL_CFG = kv.VerifyConfig(block_v=16, block_k=16)
# (slot, window length): slot 0 is a padding request, slot 2 is not in the batch; 5 = t_max, 0 empty.
REQUESTS = [(3, 5), (0, 3), (1, 2), (5, 0), (4, 1)]
T_MAX, N_PAD = 5, 2


def f32(x):
    return np.asarray(x, np.float32)


def write_positions(hist, s1, ring_len, t_max, rng):
    if hist == "empty":
        return np.zeros(s1, np.int32)
    if hist == "full":  # nearly full: the window just fits
        return np.full(s1, ring_len - t_max, np.int32)
    if hist == "overflow":  # records past the ring end are dropped
        return np.full(s1, ring_len - 2, np.int32)
    return rng.integers(0, ring_len - t_max + 1, s1).astype(np.int32)  # "partial" / mixed


def make_case(seed, hist, ckpt_dtype, ring, requests=REQUESTS, t_max=T_MAX, n_pad=N_PAD, shapes=SMALL):
    """Random packed window over ring histories; dead records (>= write_pos) hold NaN / inf."""
    H, HV, K, V, L, S1 = (shapes[x] for x in ("H", "HV", "K", "V", "L", "S1"))
    rng = np.random.default_rng(seed)
    slots = np.array([s for s, _ in requests], np.int32)
    qsl = oracle.qsl_from_lengths([n for _, n in requests])
    n = int(qsl[-1]) + n_pad
    q = f32(oracle.l2n(rng.standard_normal((n, H, K))) * K**-0.5)
    k = f32(oracle.l2n(rng.standard_normal((n, H, K))))
    v = f32(rng.standard_normal((n, HV, V)))
    g = f32(-0.4 * oracle.softplus(rng.standard_normal((n, HV))))
    beta = f32(oracle.sigmoid(rng.standard_normal((n, HV))))
    ckpt = f32(rng.standard_normal((S1, HV, K, V)) * 0.5)
    rk = f32(oracle.l2n(rng.standard_normal((S1, H, L, K))))
    ru = f32(rng.standard_normal((S1, HV, L, V)) * 0.3)
    rg = f32(-0.5 * oracle.softplus(rng.standard_normal((S1, HV, L))))
    write_pos = write_positions(hist, S1, L, t_max, rng)
    dead = np.arange(L)[None, :] >= write_pos[:, None]  # [S1, L]
    rk[np.broadcast_to(dead[:, None, :], rk.shape[:3])] = np.nan
    ru[np.broadcast_to(dead[:, None, :], ru.shape[:3])] = np.inf
    rg[np.broadcast_to(dead[:, None, :], rg.shape)] = np.nan
    ckpt = jnp.asarray(ckpt, ckpt_dtype)
    if ring == "f32":
        ring_u = jnp.asarray(ru)
        rk = jnp.asarray(rk)
    else:
        k = f32(jnp.asarray(k, bf16))  # keys arrive bf16-exact when the ring stores bf16
        rk = jnp.asarray(rk, bf16)
        hi = jnp.asarray(ru, bf16)
        with np.errstate(invalid="ignore"):  # inf - inf in the dead records
            lo = jnp.asarray(ru - np.asarray(hi, np.float32), bf16)
        ring_u = (hi, jnp.where(jnp.isfinite(lo), lo, jnp.inf).astype(bf16))
    args = (
        jnp.asarray(q),
        jnp.asarray(k),
        jnp.asarray(v),
        jnp.asarray(g),
        jnp.asarray(beta),
        ckpt,
        rk,
        ring_u,
        jnp.asarray(rg),
        jnp.asarray(write_pos),
        jnp.asarray(qsl),
        jnp.asarray(slots),
    )
    return args


@functools.cache
def _ref_fn(t_max):
    return jax.jit(lambda *a: gdn_verify(*a, t_max, impl="ref"))


@functools.cache
def _kernel_fn(t_max, cfg, interpret):
    return jax.jit(lambda *a: kv.gdn_verify(*a, t_max, config=cfg, interpret=interpret))


def as_np(out):
    o, rk, ru, rg = out
    ru = tuple(np.asarray(x) for x in ru) if isinstance(ru, tuple) else (np.asarray(ru),)
    return np.asarray(o), np.asarray(rk), ru, np.asarray(rg)


def u_value(parts):
    return sum(p.astype(np.float64) for p in parts)


def written_mask(args, t_max, ring_len):
    """[S1, L] ring positions the contract writes: write_pos[slot] + t for the real tokens."""
    write_pos, qsl, slots = (np.asarray(x) for x in args[9:12])
    w = np.zeros((write_pos.shape[0], ring_len), bool)
    for r, s in enumerate(slots):
        n = min(int(qsl[r + 1] - qsl[r]), t_max)
        if s > 0 and n > 0:
            pos = write_pos[s] + np.arange(n)
            w[s, pos[pos < ring_len]] = True
    return w


def oracle_u(args, t_max):
    """float64 oracle of the window's updates u: [S1, HV, L, V], NaN where nothing is written.

    The u records are held to this oracle rather than to the reference's (hi, lo) pair: on the GPU,
    XLA's excess-precision rewrite (xla_allow_excess_precision, on by default) folds the
    reference's f32 -> bf16 -> f32 round trip away, so its lo part comes out 0."""
    q, k, v, g, beta, ckpt, rk, ru, rg, write_pos, qsl, slots = (
        tuple(np.asarray(p, np.float64) for p in x) if isinstance(x, tuple) else np.asarray(x) for x in args
    )
    u_hist = sum(ru) if isinstance(ru, tuple) else ru
    ring_len = rg.shape[-1]
    out = np.full(u_hist.shape, np.nan)
    for r, s in enumerate(slots):
        n = min(int(qsl[r + 1] - qsl[r]), t_max)
        if s == 0 or n == 0:
            continue
        rows = slice(qsl[r], qsl[r] + n)
        m = int(write_pos[s])
        h = oracle.gdn_fold(ckpt[s].astype(np.float64), rk[s], u_hist[s], rg[s], m)
        _, eu, _ = oracle.gdn_recurrence(q[rows], k[rows], v[rows], g[rows], beta[rows], h)
        for i in range(n):
            if m + i < ring_len:
                out[s, :, m + i] = eu[i]
    return out


def check_against_ref(args, got, exp, t_max, tol):
    """Every written element close to the reference (u: to the float64 oracle) and finite; all
    other ring bits unchanged."""
    o, rk, ru, rg = got
    eo, erk, eru, erg = exp
    qsl, slots = np.asarray(args[10]), np.asarray(args[11])
    assert o.dtype == np.float32 and o.shape == eo.shape
    assert np.all(np.isfinite(o)), "every output row is written (interpret mode starts from NaN)"
    oracle.assert_close(o, eo, tol, "o")
    pad = o[qsl[-1] :]
    assert not pad.any(), "padding rows must be exactly 0"
    for r, s in enumerate(slots):
        if s == 0:
            assert not o[qsl[r] : qsl[r + 1]].any(), "null-slot request rows must be exactly 0"
    ring_len = rg.shape[-1]
    w = written_mask(args, t_max, ring_len)
    keep = ~w
    old_rk, old_ru, old_rg = np.asarray(args[6]), args[7], np.asarray(args[8])
    old_ru = tuple(np.asarray(x) for x in old_ru) if isinstance(old_ru, tuple) else (np.asarray(old_ru),)
    sel3 = lambda a: np.broadcast_to(keep[:, None, :], a.shape[:3])
    np.testing.assert_array_equal(oracle.bits(rk)[sel3(rk)], oracle.bits(old_rk)[sel3(rk)], "ring_k untouched")
    np.testing.assert_array_equal(oracle.bits(rg)[sel3(rg)], oracle.bits(old_rg)[sel3(rg)], "ring_g untouched")
    for new, old in zip(ru, old_ru):
        np.testing.assert_array_equal(oracle.bits(new)[sel3(new)], oracle.bits(old)[sel3(new)], "ring_u untouched")
    # written records: keys and gates are copies (exact), u close to the reference
    sel_w = lambda a: np.broadcast_to(w[:, None, :], a.shape[:3])
    np.testing.assert_array_equal(oracle.bits(rk)[sel_w(rk)], oracle.bits(erk)[sel_w(rk)], "ring_k records")
    np.testing.assert_array_equal(oracle.bits(rg)[sel_w(rg)], oracle.bits(erg)[sel_w(rg)], "ring_g records")
    u, eu = u_value(ru), oracle_u(args, t_max)
    assert np.all(np.isfinite(u[sel_w(u)])), "written u records finite"
    oracle.assert_close(u[sel_w(u)], eu[sel_w(u)], tol, "ring_u records")
    if len(ru) == 2:  # a compensated pair: lo is the bf16 residual of hi
        hi, lo = (x.astype(np.float64)[sel_w(x)] for x in ru)
        assert np.all(np.abs(lo) <= 2.0**-8 * np.abs(hi) + 1e-30)


TOL = {("f32", "f32"): 2e-5, ("f32", "bf16-hilo"): 5e-5, ("bf16", "bf16-hilo"): 5e-5, ("bf16", "f32"): 2e-5}


# ------------------------------------------------------------------------------ CPU (interpret)


def test_config_validation():
    with pytest.raises(ValueError, match="block_k"):
        kv.VerifyConfig(block_k=8)
    with pytest.raises(ValueError, match="block_v"):
        kv.VerifyConfig(block_v=48)
    with pytest.raises(ValueError, match="block_v"):
        kv.VerifyConfig(block_v=8)
    with pytest.raises(ValueError, match="coeff_warps"):
        kv.VerifyConfig(coeff_warps=32)
    with pytest.raises(ValueError, match="coeff_warps"):
        kv.VerifyConfig(coeff_warps=3)
    with pytest.raises(ValueError, match="num_warps"):
        kv.VerifyConfig(num_warps=3)
    with pytest.raises(ValueError, match="num_stages"):
        kv.VerifyConfig(num_stages=0)


def test_supports():
    args = make_case(1, "partial", jnp.float32, "f32")
    assert kv.supports(*args, T_MAX)
    assert not kv.supports(*args, 33)  # token tile <= 32
    bad_v = (args[0], args[1], args[2][..., :24]) + args[3:]  # V not a power of two
    assert not kv.supports(*bad_v, T_MAX)
    bad_ring = args[:8] + (args[8].astype(bf16),) + args[9:]  # gates must be f32
    assert not kv.supports(*bad_ring, T_MAX)


@pytest.mark.parametrize(
    "ckpt_dtype,ring", [("f32", "f32"), ("bf16", "bf16-hilo"), ("f32", "bf16-hilo"), ("bf16", "f32")]
)
@pytest.mark.parametrize("hist", ["empty", "partial", "full", "overflow"])
def test_matches_reference(hist, ckpt_dtype, ring):
    args = make_case(10, hist, {"f32": jnp.float32, "bf16": bf16}[ckpt_dtype], ring)
    got = as_np(_kernel_fn(T_MAX, SMALL_CFG, True)(*args))
    exp = as_np(_ref_fn(T_MAX)(*args))
    check_against_ref(args, got, exp, T_MAX, TOL[(ckpt_dtype, ring)])


def test_decode_t1():
    """T = 1 (the decode path) through the same kernel: every request has one token."""
    reqs = [(2, 1), (0, 1), (5, 1), (1, 0), (3, 1)]
    args = make_case(20, "partial", jnp.float32, "f32", requests=reqs, t_max=1, n_pad=3)
    got = as_np(_kernel_fn(1, SMALL_CFG, True)(*args))
    exp = as_np(_ref_fn(1)(*args))
    check_against_ref(args, got, exp, 1, 2e-5)


def coefficient_groupings(args, t_max, interpret):
    """The coefficient kernel with one value head per program and with the r heads of a
    key head per program, on the same inputs: (M, M_h, ring_k, ring_g) of each, as numpy."""
    q, k, v, g, beta, ckpt, rk, ru, rg, wpos, qsl, slots = args
    ratio = v.shape[1] // q.shape[1]
    run = lambda hpp: [
        np.asarray(x)
        for x in jax.jit(
            lambda *a: kv.coefficients(
                *a, t_max, block_k=16, num_warps=1, interpret=interpret, layer=None, heads_per_program=hpp
            )
        )(q, k, g, beta, rk, rg, wpos, qsl, slots)
    ]
    return run(1), run(ratio)


def written_coefficients(args, t_max):
    """[B] requests whose M the apply kernel reads, [B] those whose M_h it reads."""
    wpos, qsl, slots = (np.asarray(x) for x in args[9:12])
    real = (slots > 0) & (np.diff(qsl) > 0)
    return real, real & (wpos[slots] > 0)


@pytest.mark.parametrize("hist", ["empty", "partial"])
def test_coefficients_same_per_head_or_key_head(hist):
    """A request's coefficients do not depend on the grouping the batch size picks: bit-identical."""
    args = make_case(22, hist, jnp.float32, "f32")
    (m1, mh1, rk1, rg1), (m3, mh3, rk3, rg3) = coefficient_groupings(args, T_MAX, True)
    real, hist_rows = written_coefficients(args, T_MAX)
    np.testing.assert_array_equal(oracle.bits(m1[real]), oracle.bits(m3[real]))
    np.testing.assert_array_equal(oracle.bits(mh1[hist_rows]), oracle.bits(mh3[hist_rows]))
    np.testing.assert_array_equal(oracle.bits(rk1), oracle.bits(rk3))
    np.testing.assert_array_equal(oracle.bits(rg1), oracle.bits(rg3))
    with pytest.raises(ValueError, match="heads_per_program"):
        kv.coefficients(
            *(args[i] for i in (0, 1, 3, 4, 6, 8, 9, 10, 11)),
            T_MAX,
            block_k=16,
            num_warps=1,
            interpret=True,
            layer=None,
            heads_per_program=2,
        )


@pytest.mark.parametrize("t_max", [12, 19], ids=["t12", "t19"])
def test_long_windows(t_max):
    """Windows whose token tile is 16 or 32 (the coefficient kernel's own tile or larger)."""
    reqs = [(2, t_max), (0, 3), (5, t_max - 5), (1, 0), (3, 1)]
    args = make_case(21, "partial", jnp.float32, "f32", requests=reqs, t_max=t_max, n_pad=3, shapes=dict(SMALL, L=32))
    got = as_np(_kernel_fn(t_max, SMALL_CFG, True)(*args))
    exp = as_np(_ref_fn(t_max)(*args))
    check_against_ref(args, got, exp, t_max, 5e-5)


def test_dispatch_pallas_matches_kernel():
    args = make_case(30, "partial", jnp.float32, "f32")
    via_op = as_np(jax.jit(lambda *a: gdn_verify(*a, T_MAX, impl="pallas"))(*args))
    exp = as_np(_ref_fn(T_MAX)(*args))
    check_against_ref(args, via_op, exp, T_MAX, 2e-5)


def stack_layers(cases):
    """Stack the checkpoint and rings of per-layer cases into [G, ...] arrays (window inputs from case 0)."""
    stack = lambda xs: tuple(jnp.stack(p) for p in zip(*xs)) if isinstance(xs[0], tuple) else jnp.stack(xs)
    return cases[0][:5] + tuple(stack([c[i] for c in cases]) for i in range(5, 9)) + cases[0][9:]


def check_stacked(cases, layer, run_stacked, run_single):
    """Layer `layer` of the stacked call equals the single-layer call on that layer's slices bit for
    bit; every other layer of every ring is left bit-identical."""
    stacked = stack_layers(cases)
    single = cases[0][:5] + tuple(x for x in stacked[5:9]) + cases[0][9:]
    pick = lambda x: tuple(p[layer] for p in x) if isinstance(x, tuple) else x[layer]
    single = single[:5] + tuple(pick(x) for x in single[5:9]) + single[9:]
    got = as_np(run_stacked(*stacked))
    exp = as_np(run_single(*single))
    np.testing.assert_array_equal(oracle.bits(got[0]), oracle.bits(exp[0]), "o")
    old = as_np((stacked[0],) + stacked[6:9])
    for name, g, e, o in (("ring_k", got[1], exp[1], old[1]), ("ring_g", got[3], exp[3], old[3])):
        np.testing.assert_array_equal(oracle.bits(g[layer]), oracle.bits(e), name)
        others = [i for i in range(g.shape[0]) if i != layer]
        np.testing.assert_array_equal(oracle.bits(g[others]), oracle.bits(o[others]), name + " other layers")
    for g, e, o in zip(got[2], exp[2], old[2]):
        np.testing.assert_array_equal(oracle.bits(g[layer]), oracle.bits(e), "ring_u")
        others = [i for i in range(g.shape[0]) if i != layer]
        np.testing.assert_array_equal(oracle.bits(g[others]), oracle.bits(o[others]), "ring_u other layers")


@pytest.mark.parametrize("ckpt_dtype,ring", [("f32", "f32"), ("bf16", "bf16-hilo")])
def test_layer_stack_in_place(ckpt_dtype, ring):
    """With `layer`, the kernel reads the checkpoint stack and writes the ring stacks at that layer
    (the model passes whole stacks: no per-layer copy); the reference path does the same."""
    dt = {"f32": jnp.float32, "bf16": bf16}[ckpt_dtype]
    cases = [make_case(60 + i, "partial", dt, ring) for i in range(3)]
    for layer in (0, 2):
        check_stacked(
            cases,
            layer,
            jax.jit(lambda *a: kv.gdn_verify(*a, T_MAX, config=SMALL_CFG, interpret=True, layer=layer)),
            _kernel_fn(T_MAX, SMALL_CFG, True),
        )
    traced = jax.jit(lambda i, *a: kv.gdn_verify(*a, T_MAX, config=SMALL_CFG, interpret=True, layer=i))
    check_stacked(cases, 2, functools.partial(traced, jnp.int32(2)), _kernel_fn(T_MAX, SMALL_CFG, True))
    check_stacked(cases, 1, jax.jit(lambda *a: gdn_verify(*a, T_MAX, layer=1, impl="ref")), _ref_fn(T_MAX))
    stacked = stack_layers(cases)
    assert kv.supports(*stacked, T_MAX, layer=2)
    assert not kv.supports(*stacked, T_MAX, layer=3) and not kv.supports(*stacked, T_MAX)


POISON_REQ, POISON_T = 0, 2  # request 0 (slot 3, 5 tokens): poison its window token 2


@pytest.fixture(scope="module")
def clean_run():
    args = make_case(40, "partial", jnp.float32, "f32")
    return args, _kernel_fn(T_MAX, SMALL_CFG, True)(*args)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("field", ["q", "k", "v", "g", "beta"])
def test_poison_contained(clean_run, field, bad):
    """A non-finite input at a rejected token leaves every earlier output and record bit-identical."""
    args, clean = clean_run
    oracle.check_verify_poison(args, clean, field, bad, _kernel_fn(T_MAX, SMALL_CFG, True), POISON_REQ, POISON_T)


# ------------------------------------------------------------------------------ H200 lowering

BENCH = dict(H=16, HV=48, K=128, V=128, L=16)


def bench_structs(batch, t_max, ckpt_dtype, hilo, ring_len=16):
    sd = jax.ShapeDtypeStruct
    H, HV, K, V = BENCH["H"], BENCH["HV"], BENCH["K"], BENCH["V"]
    s1, n = batch + 1, batch * t_max
    ring_u = (sd((s1, HV, ring_len, V), bf16),) * 2 if hilo else sd((s1, HV, ring_len, V), jnp.float32)
    return (
        sd((n, H, K), jnp.float32),
        sd((n, H, K), jnp.float32),
        sd((n, HV, V), jnp.float32),
        sd((n, HV), jnp.float32),
        sd((n, HV), jnp.float32),
        sd((s1, HV, K, V), ckpt_dtype),
        sd((s1, H, ring_len, K), bf16 if hilo else jnp.float32),
        ring_u,
        sd((s1, HV, ring_len), jnp.float32),
        sd((s1,), jnp.int32),
        sd((batch + 1,), jnp.int32),
        sd((batch,), jnp.int32),
    )


@pytest.mark.parametrize(
    "t_max,ckpt_dtype,hilo,ring_len",
    [(8, bf16, True, 16), (1, bf16, True, 16), (16, jnp.float32, False, 32), (32, jnp.float32, True, 64)],
)
def test_lowers_for_h200(t_max, ckpt_dtype, hilo, ring_len):
    structs = bench_structs(128, t_max, ckpt_dtype, hilo, ring_len)
    assert kv.supports(*structs, t_max)
    text = lower_for_h200(lambda *a: kv.gdn_verify(*a, t_max, interpret=False), *structs)
    assert "__gpu$xla.gpu.triton" in text


def test_layer_stack_lowers_for_h200():
    """48 layers' checkpoint stack (Qwen3.8-27B, batch 128: 9.7 GB bf16) at layer 47: 64-bit offsets."""
    structs = bench_structs(128, 8, bf16, True, 16)
    stack = lambda x: jax.ShapeDtypeStruct((48,) + x.shape, x.dtype)
    stacked = (
        structs[:5]
        + (stack(structs[5]), stack(structs[6]), tuple(map(stack, structs[7])), stack(structs[8]))
        + structs[9:]
    )
    assert kv.supports(*stacked, 8, layer=47)
    text = lower_for_h200(lambda *a: kv.gdn_verify(*a, 8, interpret=False, layer=47), *stacked)
    assert "__gpu$xla.gpu.triton" in text


# ------------------------------------------------------------------------------ GPU

GPU_SHAPES = dict(H=16, HV=48, K=128, V=128, L=16, S1=12)
GPU_REQUESTS = [(3, 8), (0, 5), (1, 2), (7, 0), (4, 1), (9, 8), (11, 3), (0, 8)]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("ckpt_dtype,ring", [("f32", "f32"), ("bf16", "bf16-hilo"), ("f32", "bf16-hilo")])
@pytest.mark.parametrize("hist", ["empty", "partial", "full"])
def test_gpu_matches_reference(hist, ckpt_dtype, ring):
    dt = {"f32": jnp.float32, "bf16": bf16}[ckpt_dtype]
    cfg = kv.default_config(dt, GPU_SHAPES["V"])
    args = make_case(50, hist, dt, ring, requests=GPU_REQUESTS, t_max=8, n_pad=5, shapes=GPU_SHAPES)
    got = as_np(_kernel_fn(8, cfg, False)(*args))
    exp = as_np(_ref_fn(8)(*args))
    check_against_ref(args, got, exp, 8, 1e-4)
    again = as_np(_kernel_fn(8, cfg, False)(*args))  # deterministic (no race)
    np.testing.assert_array_equal(oracle.bits(got[0]), oracle.bits(again[0]))


@pytest.mark.gpu
@gpu
def test_gpu_coefficients_same_per_head_or_key_head():
    args = make_case(51, "partial", jnp.float32, "f32", requests=GPU_REQUESTS, t_max=8, n_pad=5, shapes=GPU_SHAPES)
    (m1, mh1, rk1, rg1), (m3, mh3, rk3, rg3) = coefficient_groupings(args, 8, False)
    real, hist_rows = written_coefficients(args, 8)
    np.testing.assert_array_equal(oracle.bits(m1[real]), oracle.bits(m3[real]))
    np.testing.assert_array_equal(oracle.bits(mh1[hist_rows]), oracle.bits(mh3[hist_rows]))
    np.testing.assert_array_equal(oracle.bits(rk1), oracle.bits(rk3))
    np.testing.assert_array_equal(oracle.bits(rg1), oracle.bits(rg3))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("ckpt_dtype,ring", [("f32", "f32"), ("bf16", "bf16-hilo")])
def test_gpu_layer_stack_in_place(ckpt_dtype, ring):
    dt = {"f32": jnp.float32, "bf16": bf16}[ckpt_dtype]
    cases = [
        make_case(70 + i, "partial", dt, ring, requests=GPU_REQUESTS, t_max=8, n_pad=5, shapes=GPU_SHAPES)
        for i in range(3)
    ]
    check_stacked(cases, 1, jax.jit(lambda *a: kv.gdn_verify(*a, 8, layer=1)), _kernel_fn(8, None, False))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("t_max", [1, 16, 27])
def test_gpu_t_max(t_max):
    reqs = [(3, t_max), (0, 1), (1, max(1, t_max // 2)), (7, 0), (4, 1)]
    args = make_case(
        60, "partial", bf16, "bf16-hilo", requests=reqs, t_max=t_max, n_pad=3, shapes=dict(GPU_SHAPES, L=32)
    )
    got = as_np(_kernel_fn(t_max, None, False)(*args))
    exp = as_np(_ref_fn(t_max)(*args))
    check_against_ref(args, got, exp, t_max, 1e-4)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("field", ["q", "k", "v", "g", "beta"])
def test_gpu_poison_contained(field):
    args = make_case(70, "partial", jnp.float32, "f32", requests=GPU_REQUESTS, t_max=8, n_pad=5, shapes=GPU_SHAPES)
    fn = _kernel_fn(8, None, False)
    oracle.check_verify_poison(args, fn(*args), field, np.nan, fn, POISON_REQ, POISON_T)
