"""The verify attention kernel (jaxspec/pallas/attention_verify.py) against the float64 oracle and
the jnp reference: interpret mode on the CPU, the real kernel on the GPU (-m gpu), and the H200
Triton lowering of the benchmark shapes on the CPU.

Every output row is checked after poisoning o with NaN (through the kernel's o_buffer alias): real
rows must be finite and match, slot-0 and padding rows must be exactly 0. The caches hold NaN at
every position no request may read (past each slot's last window position, other slots, the null
slot), so a read past the loop bound or of an overhanging block shows up as NaN.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import oracle
import pytest
from gpu_lowering import lower_for_h200

from jaxspec.ops.attention import attention_verify as op_attention_verify
from jaxspec.pallas import attention_verify as pav

ON_GPU = jax.default_backend() == "gpu"
gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1.5e-2}


def make_case(rng, lengths, slots, seq_lens, Hq, KVH, D, M, t_max, dtype, n_pad=3, poison=True, key_window=0):
    """Random packed verify inputs. seq_lens [S1] per slot. With poison, every cache position no
    request reads is NaN (with a key window, the positions before it too); otherwise it is large
    finite garbage (x30), as rejected tokens leave."""
    lengths = np.asarray(lengths)
    slots = np.asarray(slots, np.int32)
    seq_lens = np.asarray(seq_lens, np.int32)
    s1 = seq_lens.shape[0]
    qsl = oracle.qsl_from_lengths(lengths)
    n = int(qsl[-1]) + n_pad
    q = rng.standard_normal((n, Hq, D)).astype(np.float32)
    k = rng.standard_normal((s1, M, KVH, D)).astype(np.float32)
    v = rng.standard_normal((s1, M, KVH, D)).astype(np.float32)
    readable = np.zeros((s1, M), bool)
    for r, s in enumerate(slots):
        if s > 0 and lengths[r] > 0:
            readable[s, first_key(seq_lens[s], key_window) : seq_lens[s] + lengths[r]] = True
    bad = np.nan if poison else 30.0
    k = np.where(readable[:, :, None, None], k, k * 30 if not poison else bad).astype(np.float32)
    v = np.where(readable[:, :, None, None], v, v * 30 if not poison else bad).astype(np.float32)
    return dict(
        q=jnp.asarray(q, dtype),
        k_cache=jnp.asarray(k, dtype),
        v_cache=jnp.asarray(v, dtype),
        seq_lens=jnp.asarray(seq_lens),
        query_start_loc=jnp.asarray(qsl, jnp.int32),
        slots=jnp.asarray(slots),
    )


def first_key(seq_len, key_window):
    return max(0, seq_len - key_window) if key_window else 0


def check(case, o, tol, causal=True, key_window=0):
    """o against the float64 oracle (real rows) and the contract (exact zeros elsewhere). causal
    False: every window row reads up to the window's last key; key_window: keys before
    seq_len - key_window are not read."""
    f32 = lambda x: np.asarray(jnp.asarray(x).astype(jnp.float32))
    q, k, v = f32(case["q"]), f32(case["k_cache"]), f32(case["v_cache"])
    qsl, slots, seq = (np.asarray(case[n]) for n in ("query_start_loc", "slots", "seq_lens"))
    o = f32(o)
    assert o.shape == q.shape
    for r, s in enumerate(slots):
        rows = slice(qsl[r], qsl[r + 1])
        n = qsl[r + 1] - qsl[r]
        if s == 0:
            assert np.all(o[rows] == 0), f"slot-0 request {r} must output 0"
        elif n:
            lo = first_key(seq[s], key_window)
            pos = seq[s] - lo + (np.arange(n) if causal else np.full(n, n - 1))
            oracle.assert_close(o[rows], oracle.attention(q[rows], k[s, lo:], v[s, lo:], pos), tol, f"o of request {r}")
    assert np.all(o[qsl[-1] :] == 0), "padding rows must output 0"


def run_kernel(case, t_max, config=None, interpret=None, causal=True, key_window=0):
    nan_o = jnp.full(case["q"].shape, jnp.nan, case["q"].dtype)
    fn = jax.jit(
        lambda c, ob: pav.attention_verify(
            **c, t_max=t_max, config=config, interpret=interpret, o_buffer=ob, causal=causal, key_window=key_window
        )
    )
    return fn(case, nan_o)


# Requests (window length, slot) with M = 100 and t_max = 16: windows of 1, odd and 16 tokens;
# seq_len 0 (slot 2: reads key 0 only), small (slot 1), near M so that position M - 1 is read
# (slot 4: 84 + 16 = 100 keys; slot 6: 96 + 3 = 99); an empty request (slot 5); a slot-0 request
# in the middle; padding rows at the end. M is not a multiple of any block_k (overhanging blocks).
M, T_MAX = 100, 16
LENGTHS = [5, 16, 1, 3, 0, 16, 3]
SLOTS = [1, 4, 2, 0, 5, 3, 6]
SEQ_LENS = [9, 11, 0, 77, 84, 50, 96]  # per slot 0..6


def small_case(dtype, heads, D, seed, poison=True, n_pad=5):
    Hq, KVH = heads
    rng = np.random.default_rng(seed)
    seq = np.array(SEQ_LENS, np.int32)
    return make_case(rng, LENGTHS, SLOTS, seq, Hq, KVH, D, M, T_MAX, dtype, n_pad=n_pad, poison=poison)


CFG_SINGLE = pav.AttentionVerifyConfig(block_k=32)  # M = 100: overhanging last block
CFG_SPLIT = pav.AttentionVerifyConfig(block_k=16, num_splits=3, min_split=16, combine_block_d=32)
CFG_WIDE_SPLIT = pav.AttentionVerifyConfig(block_k=64, num_splits=2, num_stages=3)
CFG_BF16_PARTIALS = pav.AttentionVerifyConfig(block_k=16, num_splits=3, min_split=16, partial_dtype="bfloat16")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(
    "heads,D", [((12, 2), 64), ((2, 2), 256), ((6, 1), 256)], ids=["gqa6-d64", "mha-d256", "gqa6-d256"]
)
def test_verify_interpret(heads, D, dtype):
    """One split per program (the kernel writes o itself), three splits merged by the combine, and
    two 64-key splits (the long-split block size; M = 100: the second split's block overhangs)."""
    case = small_case(dtype, heads, D, seed=D + heads[0])
    check(case, run_kernel(case, T_MAX, CFG_SINGLE, interpret=True), TOL[dtype])
    check(case, run_kernel(case, T_MAX, CFG_SPLIT, interpret=True), TOL[dtype])
    check(case, run_kernel(case, T_MAX, CFG_WIDE_SPLIT, interpret=True), TOL[dtype])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_verify_interpret_bf16_partials(dtype):
    """Three splits whose partials are stored in bfloat16: within the bfloat16 tolerance of the
    oracle, and the same as the float32-partials path up to one bfloat16 rounding of each partial."""
    case = small_case(dtype, (12, 2), 64, seed=29)
    o_bf16 = run_kernel(case, T_MAX, CFG_BF16_PARTIALS, interpret=True)
    check(case, o_bf16, TOL[jnp.bfloat16])
    o_f32 = run_kernel(case, T_MAX, dataclasses.replace(CFG_BF16_PARTIALS, partial_dtype="float32"), interpret=True)
    oracle.assert_close(
        np.asarray(o_bf16.astype(jnp.float32)), np.asarray(o_f32.astype(jnp.float32)), 8e-3, "bf16 against f32 partials"
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_verify_interpret_odd_head_dim_and_short_window(dtype):
    """D = 80: fp32 dots in five 16-column chunks, bf16 in one 128-column chunk with a masked tail;
    t_max = 5 (10 rows -> a 16-row tile), GQA 2."""
    rng = np.random.default_rng(11)
    case = make_case(rng, [5, 2, 0, 1], [2, 1, 3, 0], [0, 40, 3, 70], 4, 2, 80, 45, 5, dtype, n_pad=2)
    check(case, run_kernel(case, 5, pav.AttentionVerifyConfig(block_k=16), interpret=True), TOL[dtype])
    cfg = pav.AttentionVerifyConfig(block_k=16, num_splits=4, min_split=16, combine_block_d=64)
    check(case, run_kernel(case, 5, cfg, interpret=True), TOL[dtype])


def test_verify_interpret_all_null_and_padding():
    """Every request on slot 0 or empty: o is all zeros; almost every row is padding."""
    rng = np.random.default_rng(8)
    case = make_case(rng, [0, 2, 0], [1, 0, 2], [4, 4, 4], 4, 2, 16, 20, 4, jnp.float32, n_pad=37)
    for cfg in (None, pav.AttentionVerifyConfig(num_splits=2, min_split=16)):
        o = np.asarray(run_kernel(case, 4, cfg, interpret=True))
        assert np.all(o == 0)


# Draft blocks (causal=False, every request a whole block of 7): contexts of 0, short, long, near M;
# a slot-0 request; key windows that cut the context (9), exceed it (200) or are off (0).
BLOCK_T, BLOCK_M = 7, 90
BLOCK_SLOTS = [3, 1, 0, 4, 2]
BLOCK_SEQ = [0, 40, 0, 13, 83]  # per slot 0..4; slot 4 reads up to M - 1


@pytest.mark.parametrize("key_window", [0, 9, 200], ids=["all-keys", "window9", "window200"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_block_interpret(dtype, key_window):
    """The draft block's bidirectional mask and sliding key window, one split and three splits,
    NaN-poisoned keys outside each request's range."""
    rng = np.random.default_rng(101 + key_window)
    case = make_case(
        rng, [BLOCK_T] * 5, BLOCK_SLOTS, BLOCK_SEQ, 8, 2, 32, BLOCK_M, BLOCK_T, dtype, n_pad=0, key_window=key_window
    )
    for cfg in (CFG_SINGLE, CFG_SPLIT):
        o = run_kernel(case, BLOCK_T, cfg, interpret=True, causal=False, key_window=key_window)
        check(case, o, TOL[dtype], causal=False, key_window=key_window)


def test_block_refusals():
    case = small_case(jnp.float32, (6, 2), 32, seed=3)
    with pytest.raises(ValueError, match="key_window"):
        run_kernel(case, T_MAX, interpret=True, causal=False, key_window=-1)


def test_dispatch_matches_reference():
    """ops.attention_verify impl='pallas' (interpret here) against impl='ref', finite garbage past
    the readable positions (the reference reads the whole cache through a mask)."""
    case = small_case(jnp.float32, (6, 2), 32, seed=3, poison=False)
    o_ref = jax.jit(lambda c: op_attention_verify(**c, t_max=T_MAX, impl="ref"))(case)
    o_k = jax.jit(lambda c: op_attention_verify(**c, t_max=T_MAX, impl="pallas"))(case)
    np.testing.assert_allclose(np.asarray(o_k), np.asarray(o_ref), rtol=2e-5, atol=2e-5)
    assert np.all(np.asarray(o_k)[np.asarray(case["query_start_loc"])[-1] :] == 0)


@pytest.mark.parametrize("cfg", [CFG_SINGLE, CFG_SPLIT], ids=["one-split", "three-splits"])
def test_layer_stack(cfg):
    """With `layer`, the kernel reads that layer of the [A, S1, M, KVH, D] stacks: bit-identical to
    the call on the layer's own cache; the other layers (NaN everywhere) are never read. The
    reference path takes the same arguments."""
    case = small_case(jnp.float32, (6, 2), 32, seed=21, poison=False)  # the reference reads all of M
    nan = jnp.full_like(case["k_cache"], jnp.nan)
    stacked = dict(case, k_cache=jnp.stack([nan, nan, case["k_cache"]]), v_cache=jnp.stack([nan, case["v_cache"], nan]))
    stacked["v_cache"] = stacked["v_cache"].at[2].set(case["v_cache"])
    run = jax.jit(lambda c: pav.attention_verify(**c, t_max=T_MAX, config=cfg, interpret=True, layer=2))
    single = run_kernel(case, T_MAX, cfg, interpret=True)
    np.testing.assert_array_equal(oracle.bits(np.asarray(run(stacked))), oracle.bits(np.asarray(single)))
    traced = jax.jit(lambda c, i: pav.attention_verify(**c, t_max=T_MAX, config=cfg, interpret=True, layer=i))
    np.testing.assert_array_equal(
        oracle.bits(np.asarray(traced(stacked, jnp.int32(2)))), oracle.bits(np.asarray(single)), "traced layer index"
    )
    check(case, single, TOL[jnp.float32])
    assert pav.supports(**stacked, t_max=T_MAX, layer=2)
    assert not pav.supports(**stacked, t_max=T_MAX, layer=3) and not pav.supports(**stacked, t_max=T_MAX)
    o_ref = jax.jit(lambda c: op_attention_verify(**c, t_max=T_MAX, layer=2, impl="ref"))(stacked)
    oracle.assert_close(np.asarray(o_ref), np.asarray(single), 1e-5, "reference with layer")


def test_config_validation():
    for field, bad in [
        ("block_k", 100),
        ("block_k", 8),
        ("block_k", 512),
        ("num_splits", 0),
        ("num_splits", 513),
        ("min_split", 24),
        ("min_split", 8),
        ("target_programs", 0),
        ("block_d", 8),
        ("block_d", 48),
        ("num_warps", 3),
        ("num_stages", 0),
        ("num_stages", 5),
        ("combine_block_d", 48),
        ("combine_warps", 32),
        ("partial_dtype", "float16"),
    ]:
        with pytest.raises(ValueError, match=field):
            pav.AttentionVerifyConfig(**{field: bad})
    cfg = pav.AttentionVerifyConfig()
    # the benchmark shape (T 8, GQA 6 -> 64 rows, D 256): batch 64 fills the SMs without splitting
    plan = cfg.resolve(64, 4, 4112, 64, 256, jnp.bfloat16)
    assert (plan["block_k"], plan["num_splits"], plan["num_warps"], plan["num_stages"]) == (16, 1, 4, 4)
    assert cfg.resolve(1, 4, 32784, 64, 256, jnp.bfloat16)["num_splits"] == 33  # 132 programs
    split = cfg.resolve(8, 4, 4112, 64, 256, jnp.bfloat16)  # splits of >= 512 keys: 64 keys x 3
    assert (split["block_k"], split["num_stages"], split["num_splits"]) == (64, 3, 4)  # 128 programs
    short = cfg.resolve(8, 4, 1040, 64, 256, jnp.bfloat16)  # 260-key splits: 32 x 3
    assert (short["block_k"], short["num_stages"], short["num_splits"]) == (32, 3, 4)
    assert cfg.resolve(2, 1, 32784, 128, 256, jnp.bfloat16)["block_k"] == 32  # 128-row tile: shared memory
    assert cfg.resolve(1, 4, 1040, 64, 256, jnp.bfloat16)["num_splits"] == 17  # 64-key splits (min_split)
    assert cfg.resolve(1, 4, 300, 64, 256, jnp.bfloat16)["num_splits"] == 5  # capped by M / min_split
    f32 = cfg.resolve(2, 2, 100, 128, 256, jnp.float32)
    assert (f32["block_k"], f32["block_d"], f32["num_stages"], f32["num_warps"]) == (16, 32, 1, 16)
    assert cfg.resolve(2, 2, 100, 16, 80, jnp.float32)["block_d"] == 16  # chunks inside D
    assert cfg.resolve(2, 2, 100, 16, 72, jnp.float32)["block_d"] == 128  # one masked chunk
    assert cfg.resolve(2, 2, 100, 16, 80, jnp.bfloat16)["block_d"] == 128
    assert split["partial_dtype"] == jnp.bfloat16 and f32["partial_dtype"] == jnp.float32  # the input's
    assert (
        pav.AttentionVerifyConfig(partial_dtype="float32").resolve(8, 4, 1040, 64, 256, jnp.bfloat16)["partial_dtype"]
        == jnp.float32
    )
    assert pav.combine_tile_rows(64, 33, 64) == 2  # 64 x 2 x 64 tile
    assert pav.combine_tile_rows(64, 66, 64) == 1  # 128 x 1 x 64


def test_supports():
    S = jax.ShapeDtypeStruct
    ok = dict(
        q=S((16, 24, 256), jnp.bfloat16),
        k_cache=S((5, 100, 4, 256), jnp.bfloat16),
        v_cache=S((5, 100, 4, 256), jnp.bfloat16),
        seq_lens=S((5,), jnp.int32),
        query_start_loc=S((3,), jnp.int32),
        slots=S((2,), jnp.int32),
        t_max=16,
    )
    assert pav.supports(**ok)
    assert pav.supports(
        **{
            **ok,
            "q": S((16, 24, 256), jnp.float32),
            "k_cache": S((5, 100, 4, 256), jnp.float32),
            "v_cache": S((5, 100, 4, 256), jnp.float32),
        }
    )
    bad = [
        ("q", S((16, 24, 256), jnp.float16)),
        ("q", S((16, 24, 256), jnp.float32)),  # dtypes differ from the caches
        ("q", S((16, 22, 256), jnp.bfloat16)),  # Hq not a multiple of KVH
        ("k_cache", S((5, 100, 4, 128), jnp.bfloat16)),
        ("v_cache", S((5, 101, 4, 256), jnp.bfloat16)),
        ("seq_lens", S((4,), jnp.int32)),
        ("query_start_loc", S((2,), jnp.int32)),
        ("t_max", 22),  # 22 * 6 rows > 128
        ("t_max", 0),
    ]
    for name, val in bad:
        assert not pav.supports(**{**ok, name: val}), name
    big_d = S((16, 4, 512), jnp.bfloat16), S((5, 100, 4, 512), jnp.bfloat16)
    assert not pav.supports(big_d[0], big_d[1], big_d[1], ok["seq_lens"], ok["query_start_loc"], ok["slots"], 8)


# (B, T, Hq, KVH, D, M, dtype): the benchmark shape; batch 1 at 32k (split + combine); batch 128 at
# 32k (caches > 4 GB: 64-bit offsets); fp32 at t_max 16 (128-row tile, 16 warps); D 80.
BENCH_SHAPES = [
    (64, 8, 24, 4, 256, 4096, jnp.bfloat16),
    (1, 8, 24, 4, 256, 32784, jnp.bfloat16),
    (128, 8, 24, 4, 256, 32784, jnp.bfloat16),
    (3, 16, 24, 4, 256, 100, jnp.float32),
    (5, 5, 4, 2, 80, 1000, jnp.float32),
]


@pytest.mark.parametrize("B,T,Hq,KVH,D,M,dtype", BENCH_SHAPES)
def test_lowers_for_h200(B, T, Hq, KVH, D, M, dtype):
    S = jax.ShapeDtypeStruct

    def fn(q, kc, vc, sl, qsl, slots):
        return pav.attention_verify(q, kc, vc, sl, qsl, slots, T, interpret=False)

    text = lower_for_h200(
        fn,
        S((B * T, Hq, D), dtype),
        S((B + 1, M, KVH, D), dtype),
        S((B + 1, M, KVH, D), dtype),
        S((B + 1,), jnp.int32),
        S((B + 1,), jnp.int32),
        S((B,), jnp.int32),
    )
    assert "__gpu$xla.gpu.triton" in text


def test_layer_stack_lowers_for_h200():
    """16 attention layers' caches at batch 64, context 4k (16 GB bf16 each) read at layer 15."""
    S = jax.ShapeDtypeStruct
    B, T, M = 64, 8, 4112
    cache = S((16, B + 1, M, 4, 256), jnp.bfloat16)
    text = lower_for_h200(
        lambda q, kc, vc, sl, qsl, slots: pav.attention_verify(q, kc, vc, sl, qsl, slots, T, interpret=False, layer=15),
        S((B * T, 24, 256), jnp.bfloat16),
        cache,
        cache,
        S((B + 1,), jnp.int32),
        S((B + 1,), jnp.int32),
        S((B,), jnp.int32),
    )
    assert "__gpu$xla.gpu.triton" in text


# ------------------------------------------------------------------------------------- GPU


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(
    "heads,D", [((12, 2), 64), ((2, 2), 256), ((6, 1), 256)], ids=["gqa6-d64", "mha-d256", "gqa6-d256"]
)
def test_verify_gpu_small(heads, D, dtype):
    """The interpret-mode cases, compiled (NaN-poisoned caches and output), against the oracle."""
    case = small_case(dtype, heads, D, seed=D + heads[0])
    check(case, run_kernel(case, T_MAX, CFG_SPLIT), TOL[dtype])
    check(case, run_kernel(case, T_MAX), TOL[dtype])


@gpu
@pytest.mark.gpu
def test_verify_gpu_odd_and_null():
    rng = np.random.default_rng(11)
    for dtype in (jnp.float32, jnp.bfloat16):
        case = make_case(rng, [5, 2, 0, 1], [2, 1, 3, 0], [0, 40, 3, 70], 4, 2, 80, 45, 5, dtype, n_pad=2)
        check(case, run_kernel(case, 5), TOL[dtype])
        check(case, run_kernel(case, 5, pav.AttentionVerifyConfig(num_splits=4, min_split=16)), TOL[dtype])
    case = make_case(rng, [0, 2, 0], [1, 0, 2], [4, 4, 4], 4, 2, 16, 20, 4, jnp.float32, n_pad=37)
    assert np.all(np.asarray(run_kernel(case, 4)) == 0)


def device_case(seed, B, T, M, Hq=24, KVH=4, D=256, dtype=jnp.bfloat16, null_every=5, n_pad=11):
    """A large random batch built on the device, twice: the positions no request reads hold large
    finite garbage in one copy and NaN in the other. Windows 1..T (the first T), one window ending
    at position M - 1, every null_every-th request on slot 0."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, T + 1, B)
    lengths[0] = T
    slots = rng.permutation(np.arange(1, B + 1)).astype(np.int32)
    if null_every:
        slots[1::null_every] = 0
    seq = rng.integers(0, M - T + 1, B + 1).astype(np.int32)
    seq[slots[0]] = M - T
    readable = np.zeros((B + 1, M), bool)
    for r, s in enumerate(slots):
        if s:
            readable[s, : seq[s] + lengths[r]] = True
    qsl = oracle.qsl_from_lengths(lengths)
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (int(qsl[-1]) + n_pad, Hq, D), dtype)
    k = jax.random.normal(keys[1], (B + 1, M, KVH, D), dtype)
    v = jax.random.normal(keys[2], (B + 1, M, KVH, D), dtype)
    rd = jnp.asarray(readable)[:, :, None, None]
    ints = dict(seq_lens=jnp.asarray(seq), query_start_loc=jnp.asarray(qsl), slots=jnp.asarray(slots))
    garbage = dict(q=q, k_cache=jnp.where(rd, k, k * 30), v_cache=jnp.where(rd, v, v * 30), **ints)
    poisoned = dict(q=q, k_cache=jnp.where(rd, k, jnp.nan), v_cache=jnp.where(rd, v, jnp.nan), **ints)
    return garbage, poisoned


def check_device(garbage, poisoned, t_max, config=None, tol=1.5e-2):
    """kernel(poisoned) == kernel(garbage) bit for bit (nothing unreadable is read), finite where
    written, exact zeros on slot-0 and padding rows, and close to the jnp reference."""
    o_g = np.asarray(run_kernel(garbage, t_max, config).astype(jnp.float32))
    o_n = np.asarray(run_kernel(poisoned, t_max, config).astype(jnp.float32))
    o_ref = np.asarray(
        jax.jit(lambda c: op_attention_verify(**c, t_max=t_max, impl="ref"))(garbage).astype(jnp.float32)
    )
    np.testing.assert_array_equal(oracle.bits(o_n), oracle.bits(o_g), "poisoned vs garbage caches")
    qsl, slots = np.asarray(garbage["query_start_loc"]), np.asarray(garbage["slots"])
    real = np.zeros(o_g.shape[0], bool)
    for r, s in enumerate(slots):
        if s:
            real[qsl[r] : qsl[r + 1]] = True
    assert np.all(o_g[~real] == 0), "slot-0 and padding rows must output 0"
    oracle.assert_close(o_g[real], o_ref[real], tol, "kernel vs reference")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(
    "B,M,cfg",
    [
        (64, 4096 - 5, None),
        (3, 4096 - 5, None),
        (1, 20000, None),
        (40, 1000, None),
        (64, 4096 - 5, dict(block_k=32, num_stages=3)),
        (64, 4096 - 5, dict(num_warps=4)),
        (8, 3000, dict(num_splits=7, min_split=64, combine_block_d=128)),
        (8, 3000, dict(num_splits=7, min_split=64, partial_dtype="float32")),
        (1, 20000, dict(partial_dtype="float32")),
    ],
    ids=["b64", "b3", "b1-20k", "b40-1k", "bk32-s3", "w4", "split7", "split7-f32-partials", "b1-20k-f32-partials"],
)
def test_verify_gpu_bench_heads(B, M, cfg):
    """Benchmark heads (24 q / 4 kv, D 256, bf16, T 8): random windows and contexts; the split
    cases store bfloat16 partials (the default for bf16 input) unless they ask for float32."""
    garbage, poisoned = device_case(B + M, B, 8, M)
    check_device(garbage, poisoned, 8, None if cfg is None else pav.AttentionVerifyConfig(**cfg))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("key_window", [0, 9], ids=["all-keys", "window9"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_block_gpu_small(dtype, key_window):
    """The interpret-mode draft-block cases, compiled."""
    rng = np.random.default_rng(101 + key_window)
    case = make_case(
        rng, [BLOCK_T] * 5, BLOCK_SLOTS, BLOCK_SEQ, 8, 2, 32, BLOCK_M, BLOCK_T, dtype, n_pad=0, key_window=key_window
    )
    for cfg in (None, CFG_SPLIT):
        check(
            case,
            run_kernel(case, BLOCK_T, cfg, causal=False, key_window=key_window),
            TOL[dtype],
            causal=False,
            key_window=key_window,
        )


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("B,M", [(1, 1040), (32, 1040), (8, 4112)], ids=["b1-1k", "b32-1k", "b8-4k"])
def test_block_gpu_draft_heads(B, M):
    """The 27B-shaped draft's attention (32 q / 8 kv heads of 128, bf16, block 16): random contexts,
    whole blocks, NaN past each request's block, against the float64 oracle."""
    rng = np.random.default_rng(B + M)
    slots = rng.permutation(np.arange(1, B + 1)).astype(np.int32)
    seq = rng.integers(0, M - 16 + 1, B + 1).astype(np.int32)
    seq[slots[0]] = M - 16
    case = make_case(rng, [16] * B, slots, seq, 32, 8, 128, M, 16, jnp.bfloat16, n_pad=0)
    check(case, run_kernel(case, 16, causal=False), TOL[jnp.bfloat16], causal=False)


@gpu
@pytest.mark.gpu
def test_verify_gpu_f32_large():
    """fp32 (HIGHEST dots, head-dim chunks) at t_max 16 with GQA 6: 128-row tiles, 16 warps."""
    garbage, poisoned = device_case(5, 6, 16, 777, dtype=jnp.float32, null_every=3)
    check_device(garbage, poisoned, 16, tol=1e-5)


@gpu
@pytest.mark.gpu
def test_dispatch_gpu():
    """impl='pallas' reaches the kernel on the GPU and matches the reference; impl='auto' takes the kernel."""
    garbage, _ = device_case(4, 16, 8, 2048, null_every=4)
    run = lambda impl: np.asarray(
        jax.jit(lambda c: op_attention_verify(**c, t_max=8, impl=impl))(garbage).astype(jnp.float32)
    )
    o_ref, o_pallas, o_auto = run("ref"), run("pallas"), run("auto")
    oracle.assert_close(o_pallas, o_ref, 1.5e-2, "pallas")
    np.testing.assert_array_equal(oracle.bits(o_auto), oracle.bits(o_pallas), "auto")


@gpu
@pytest.mark.gpu
def test_layer_stack_gpu():
    """Compiled, layer 1 of a 3-layer stack whose other layers are NaN: bit-identical to the call on
    that layer's own cache (the kernel indexes the stack, it never reads another layer)."""
    garbage, _ = device_case(9, 16, 8, 1500, null_every=4)
    stack = lambda c: jnp.stack([jnp.full_like(c, jnp.nan), c, jnp.full_like(c, jnp.nan)])
    stacked = dict(garbage, k_cache=stack(garbage["k_cache"]), v_cache=stack(garbage["v_cache"]))
    for cfg in (None, pav.AttentionVerifyConfig(num_splits=3, min_split=64)):
        single = np.asarray(run_kernel(garbage, 8, cfg).astype(jnp.float32))
        layered = np.asarray(
            jax.jit(lambda c: pav.attention_verify(**c, t_max=8, config=cfg, layer=1))(stacked).astype(jnp.float32)
        )
        np.testing.assert_array_equal(oracle.bits(layered), oracle.bits(single), "layer 1 of the stack")
