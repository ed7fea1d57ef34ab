import jax.numpy as jnp
import numpy as np
import oracle
import pytest

from jaxspec.ops.attention import attention_block, attention_prefill, attention_verify, kv_write
from jaxspec.ops.packing import to_packed, to_padded

D = 16
TOL = 1e-5


@pytest.mark.parametrize("heads", [(6, 2), (4, 4), (3, 1)], ids=["gqa6-2", "mha4", "gqa3-1"])
def test_attention_prefill(heads):
    Hq, KVH = heads
    lengths = [7, 3, 1, 0]
    B, T = len(lengths), 7
    rng = np.random.default_rng(Hq * 10 + KVH)
    q = rng.standard_normal((B, T, Hq, D)).astype(np.float32)
    k = rng.standard_normal((B, T, KVH, D)).astype(np.float32)
    v = rng.standard_normal((B, T, KVH, D)).astype(np.float32)
    o = np.asarray(attention_prefill(q, k, v, jnp.asarray(lengths, jnp.int32), impl="ref"))
    assert o.shape == q.shape
    for b, n in enumerate(lengths):
        if n:
            oracle.assert_close(o[b, :n], oracle.attention(q[b, :n], k[b, :n], v[b, :n], np.arange(n)), TOL, f"o[{b}]")
        assert not o[b, n:].any(), f"rows past length of request {b} must be 0"


# (slot, window length); slot 0 is a padding request, slot 3's window ends at the cache's end.
REQUESTS = [(2, 4), (0, 3), (1, 5), (3, 5), (4, 0)]
SEQ_LENS = np.array([7, 0, 12, 19, 3], np.int32)  # committed tokens per slot
S1, M, T_MAX, N_PAD = 5, 24, 5, 2


@pytest.mark.parametrize("heads", [(6, 2), (3, 3)], ids=["gqa6-2", "mha3"])
def test_kv_write_attention_verify(heads):
    Hq, KVH = heads
    rng = np.random.default_rng(50 + Hq)
    slots = np.array([s for s, _ in REQUESTS], np.int32)
    qsl = oracle.qsl_from_lengths([n for _, n in REQUESTS])
    N = qsl[-1] + N_PAD
    q = rng.standard_normal((N, Hq, D)).astype(np.float32)
    k = rng.standard_normal((N, KVH, D)).astype(np.float32)
    v = rng.standard_normal((N, KVH, D)).astype(np.float32)
    # past seq_len: large garbage from rejected tokens, which must never be read
    kc = (rng.standard_normal((S1, M, KVH, D)) * 30).astype(np.float32)
    vc = (rng.standard_normal((S1, M, KVH, D)) * 30).astype(np.float32)
    for s in range(S1):
        kc[s, : SEQ_LENS[s]] /= 30
        vc[s, : SEQ_LENS[s]] /= 30

    kc2, vc2 = kv_write(*map(jnp.asarray, (kc, vc, k, v, SEQ_LENS, qsl, slots)))
    kc2, vc2 = np.asarray(kc2), np.asarray(vc2)
    exp_kc, exp_vc = kc.copy(), vc.copy()
    for r, (s, n) in enumerate(REQUESTS):
        if s:
            exp_kc[s, SEQ_LENS[s] : SEQ_LENS[s] + n] = k[qsl[r] : qsl[r + 1]]
            exp_vc[s, SEQ_LENS[s] : SEQ_LENS[s] + n] = v[qsl[r] : qsl[r + 1]]
    np.testing.assert_array_equal(kc2, exp_kc, "k_cache'")
    np.testing.assert_array_equal(vc2, exp_vc, "v_cache'")

    o = np.asarray(attention_verify(q, kc2, vc2, SEQ_LENS, qsl, slots, T_MAX, impl="ref"))
    assert o.shape == q.shape
    for r, (s, n) in enumerate(REQUESTS):
        rows = slice(qsl[r], qsl[r + 1])
        if s == 0:
            assert not o[rows].any(), "slot-0 request must output 0"
        elif n:
            pos = SEQ_LENS[s] + np.arange(n)
            oracle.assert_close(o[rows], oracle.attention(q[rows], exp_kc[s], exp_vc[s], pos), TOL, f"o of request {r}")
    assert not o[qsl[-1] :].any(), "padding rows must output 0"


# draft blocks: (slot, context length); slot 0 is a padding request, slot 3's block ends at M - 1
BLOCK_REQUESTS = [(2, 9), (0, 4), (1, 0), (3, 18)]
BLOCK_T, BLOCK_LAYERS = 6, 3


@pytest.mark.parametrize("impl", ["ref", "pallas"])
@pytest.mark.parametrize("window", [0, 5], ids=["all-context", "window5"])
def test_attention_block(window, impl):
    """The block's K/V land at ctx_len + t of layer 1 of the stacks (nothing else changes), every
    block row reads [ctx_len - window or 0, ctx_len + T) against the float64 oracle, slot-0 rows
    output 0. 'pallas' is the verify kernel (causal=False) in interpret mode, so the other
    layers and the cache past each block hold NaN: a read there fails."""
    Hq, KVH = 6, 2
    rng = np.random.default_rng(70 + window)
    slots = np.array([s for s, _ in BLOCK_REQUESTS], np.int32)
    ctx = np.array([n for _, n in BLOCK_REQUESTS], np.int32)
    B = len(BLOCK_REQUESTS)
    q = rng.standard_normal((B, BLOCK_T, Hq, D)).astype(np.float32)
    kb = rng.standard_normal((B, BLOCK_T, KVH, D)).astype(np.float32)
    vb = rng.standard_normal((B, BLOCK_T, KVH, D)).astype(np.float32)
    shape = (BLOCK_LAYERS, S1, M, KVH, D)
    kc = np.full(shape, np.nan, np.float32)
    vc = np.full(shape, np.nan, np.float32)
    kc[1] = rng.standard_normal(shape[1:])
    vc[1] = rng.standard_normal(shape[1:])
    if impl == "ref":  # the reference masks the whole cache: finite garbage
        kc, vc = np.nan_to_num(kc, nan=30.0), np.nan_to_num(vc, nan=30.0)
    else:
        for s, n in BLOCK_REQUESTS:
            kc[1, s, n + BLOCK_T :] = vc[1, s, n + BLOCK_T :] = np.nan
    o, kc2, vc2 = attention_block(*map(jnp.asarray, (q, kc, vc, ctx, slots, kb, vb)), window, layer=1, impl=impl)
    o, kc2, vc2 = map(np.asarray, (o, kc2, vc2))
    exp_kc, exp_vc = kc.copy(), vc.copy()
    for r, (s, n) in enumerate(BLOCK_REQUESTS):
        if s:
            exp_kc[1, s, n : n + BLOCK_T], exp_vc[1, s, n : n + BLOCK_T] = kb[r], vb[r]
    np.testing.assert_array_equal(kc2, exp_kc, "k_cache'")
    np.testing.assert_array_equal(vc2, exp_vc, "v_cache'")
    assert o.shape == q.shape
    for r, (s, n) in enumerate(BLOCK_REQUESTS):
        if s == 0:
            assert not o[r].any(), "slot-0 request must output 0"
            continue
        lo = max(0, n - window) if window else 0
        last = np.full(BLOCK_T, n + BLOCK_T - 1 - lo)
        want = oracle.attention(q[r], exp_kc[1, s, lo:], exp_vc[1, s, lo:], last)
        oracle.assert_close(o[r], want, TOL, f"o of request {r}")


# ------------------------------------------------------------------------------ packing

LAYOUTS = {
    "ragged+pad": ([3, 0, 5, 1], 2),
    "full-no-pad": ([5, 5], 0),
    "all-empty": ([0, 0], 3),
    "single": ([1], 0),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_packing_round_trip(layout):
    lengths, pad = LAYOUTS[layout]
    t_max = 5
    qsl = oracle.qsl_from_lengths(lengths)
    N, B = qsl[-1] + pad, len(lengths)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((N, 3, 2)).astype(np.float32) + 10  # nonzero everywhere

    xp, valid = to_padded(jnp.asarray(x), jnp.asarray(qsl), t_max)
    xp, valid = np.asarray(xp), np.asarray(valid)
    exp_xp = np.zeros((B, t_max, 3, 2), np.float32)
    exp_valid = np.zeros((B, t_max), bool)
    for r, n in enumerate(lengths):
        exp_xp[r, :n] = x[qsl[r] : qsl[r + 1]]
        exp_valid[r, :n] = True
    np.testing.assert_array_equal(valid, exp_valid)
    np.testing.assert_array_equal(xp, exp_xp)

    # garbage in the invalid padded entries must not leak into the packed rows
    xp_dirty = np.where(exp_valid[..., None, None], exp_xp, 99.0).astype(np.float32)
    back = np.asarray(to_packed(jnp.asarray(xp_dirty), jnp.asarray(qsl), N))
    exp_back = x.copy()
    exp_back[qsl[-1] :] = 0
    np.testing.assert_array_equal(back, exp_back)
