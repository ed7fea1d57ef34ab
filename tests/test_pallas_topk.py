"""The top-k and greedy argmax kernels (jaxspec/pallas/topk.py) against jax.lax.top_k / jnp.argmax
and an independent numpy oracle: interpret mode on the CPU, the real kernels on the GPU (-m gpu),
and the H200 Triton lowering of the benchmark shapes on the CPU.

Unwritten outputs show: interpret mode starts every output as NaN (floats) / INT_MIN (ints), and
the tests also pass `poison_outputs=True` (NaN / INT_MIN buffers aliased to the outputs, which is
what proves it on the GPU). INT_MIN is the stage-1 REMOVED key that stage 1 never writes, so an
unwritten candidate slot is caught too. Values are compared bit for bit, indices exactly.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oracle
from gpu_lowering import lower_for_h200
from jaxspec.ops import sampling
from jaxspec.pallas import topk as tk

ON_GPU = jax.default_backend() == "gpu"
gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
DTYPES = [jnp.float32, jnp.bfloat16]
DT_IDS = ["f32", "bf16"]
INT_MIN = -2**31

# ------------------------------------------------------------------------------ numpy oracle


def np_keys(x):
    """int64 keys in the IEEE total order (lax.top_k's order) of a float32 / bfloat16 array."""
    b = np.asarray(jnp.asarray(x).astype(jnp.float32)).view(np.int32).astype(np.int64)
    return np.where(b < 0, b ^ 0x7FFFFFFF, b)


def np_top_k(x, k):
    """Indices [rows, k] of the k largest per row: key descending, then column ascending."""
    keys = np_keys(x)
    rows, vocab = keys.shape
    comb = ((keys + 2**31) << 20) | ((2**20 - 1) - np.arange(vocab, dtype=np.int64))   # unique, vocab < 2**20
    part = np.argpartition(-comb, k - 1, axis=1)[:, :k]
    order = np.argsort(-np.take_along_axis(comb, part, 1), axis=1)
    return np.take_along_axis(part, order, 1).astype(np.int32)


def np_argmax(x):
    """jnp.argmax's rule: the first NaN if any, else the first maximum (-0.0 == +0.0)."""
    x = np.asarray(jnp.asarray(x).astype(jnp.float32))
    nan = np.isnan(x)
    return np.where(nan.any(1), nan.argmax(1), np.nanargmax(np.where(nan, -np.inf, x), 1)).astype(np.int32)


def bits(a):
    a = np.asarray(a)
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


def check_top_k(x, k, vals, idx, against_lax=True):
    x2 = np.asarray(x).reshape(-1, x.shape[-1])
    idx2 = np.asarray(idx).reshape(-1, k)
    ref_i = np_top_k(x2, k)
    np.testing.assert_array_equal(idx2, ref_i, "indices vs the numpy oracle")
    np.testing.assert_array_equal(bits(np.asarray(vals).reshape(-1, k)), bits(np.take_along_axis(x2, ref_i, 1)),
                                  "values (bits)")
    if against_lax:
        lv, li = jax.lax.top_k(jnp.asarray(x), k)
        np.testing.assert_array_equal(np.asarray(idx), np.asarray(li), "indices vs lax.top_k")
        np.testing.assert_array_equal(bits(vals), bits(lv), "values vs lax.top_k")


def check_auto_dispatch(x, k, kernel_name):
    """GPU: sampling.top_k(impl='auto') on x [rows, vocab] (rows a multiple of 8) compiles to the
    named kernel and matches lax.top_k; the target distribution of [8, rows / 8, vocab] logits through
    it equals impl='ref'."""
    top = jax.jit(lambda x: sampling.top_k(x, k, impl="auto"))
    assert kernel_name in top.lower(x).as_text()
    vals, idx = top(x)
    lv, li = jax.lax.top_k(x, k)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(li))
    np.testing.assert_array_equal(bits(vals), bits(lv))
    params = sampling.SamplingParams.create(8, temperature=0.7, top_k=40, top_p=0.9)
    td = jax.jit(sampling.target_distribution, static_argnums=2, static_argnames="impl")
    logits = x.reshape(8, x.shape[0] // 8, -1)
    p_ref, i_ref = td(logits, params, k, impl="ref")
    p_auto, i_auto = td(logits, params, k, impl="auto")
    np.testing.assert_array_equal(np.asarray(i_auto), np.asarray(i_ref))
    np.testing.assert_allclose(np.asarray(p_auto), np.asarray(p_ref), rtol=1e-6, atol=1e-7)


def check_candidates(x, k, plan, cand_key, cand_col):
    """Stage 1's contract per chunk: every slot written, the real candidates first and in column
    order, inside the chunk, with the logit's key, and a superset of the chunk's exact top-k."""
    x = np.asarray(x)
    ck, cc = np.asarray(cand_key), np.asarray(cand_col)
    assert not np.any(ck == INT_MIN), "a candidate slot was not written"
    chunk = plan["chunk"]
    keys = np.maximum(np_keys(x), tk.KEY_FLOOR)
    for r in range(x.shape[0]):
        for c in range(plan["num_chunks"]):
            real = ck[r, c] != tk.SENTINEL
            n = int(real.sum())
            assert real[:n].all(), "real candidates must come first"
            cols = cc[r, c, :n]
            lo, hi = c * chunk, min((c + 1) * chunk, x.shape[1])
            assert np.all(np.diff(cols) > 0) and np.all((cols >= lo) & (cols < hi)), "columns in order, in chunk"
            np.testing.assert_array_equal(ck[r, c, :n], keys[r, cols])
            kk = min(k, hi - lo)
            exact = lo + np_top_k(x[r:r + 1, lo:hi], kk)[0]
            assert set(exact.tolist()) <= set(cols.tolist()), f"row {r} chunk {c}: top-k not in the candidates"


@functools.lru_cache(maxsize=None)
def _jit_top_k(k, config, interpret, candidates_out):
    return jax.jit(lambda x: tk.top_k(x, k, config=config, interpret=interpret, candidates_out=candidates_out,
                                      poison_outputs=True))


def run_top_k(x, k, config=None, interpret=True, candidates=False):
    return _jit_top_k(k, config, interpret, candidates)(jnp.asarray(x))


# ------------------------------------------------------------------------------ inputs


def gen_rows(rng, kind, rows, vocab, k, dtype):
    """float32 numpy rows of one kind (cast to dtype by the caller)."""
    if kind == "gauss":
        return rng.standard_normal((rows, vocab)).astype(np.float32) * 3
    if kind == "ties":
        # few distinct values: long runs of equal keys inside and across chunk boundaries
        x = rng.integers(-3, 4, (rows, vocab)).astype(np.float32)
        x[0] = 1.0                                         # one row all equal
        if rows > 1:
            x[1] = -2.0
            x[1, rng.choice(vocab, k // 2 + 1, replace=False)] = 5.0   # fewer maxima than k, tie at the cut
        return x
    if kind == "neginf":
        x = rng.standard_normal((rows, vocab)).astype(np.float32)
        x[rng.random((rows, vocab)) < 0.5] = -np.inf
        x[0] = -np.inf                                     # all -inf
        if rows > 1:
            x[1] = -np.inf
            x[1, rng.choice(vocab, max(1, k // 3), replace=False)] = rng.standard_normal(max(1, k // 3))
        if rows > 2:
            x[2] = -np.inf
            x[2, -3:] = [1.0, 2.0, 1.0]                    # finite only in the tail chunk
        return x
    if kind == "masked":                                   # a masked vocabulary: 99 % -inf
        x = rng.standard_normal((rows, vocab)).astype(np.float32)
        x[rng.random((rows, vocab)) < 0.99] = -np.inf
        return x
    if kind == "special":
        x = rng.standard_normal((rows, vocab)).astype(np.float32)
        pick = rng.random((rows, vocab))
        x[pick < 0.05] = 0.0
        x[(pick >= 0.05) & (pick < 0.1)] = -0.0
        x[(pick >= 0.1) & (pick < 0.12)] = np.inf
        x[(pick >= 0.12) & (pick < 0.14)] = -np.inf
        x[(pick >= 0.14) & (pick < 0.15)] = np.nan
        x[(pick >= 0.15) & (pick < 0.16)] = -np.nan
        if rows > 1:
            x[1] = np.where(rng.random(vocab) < 0.5, 0.0, -0.0)
        return x
    if kind == "clustered":
        # a contiguous block of high logits that spans fewer than k groups: the group-maximum
        # threshold leaves more than `slots` keys above it, so stage 1 bisects
        # (with CLUSTER's chunk of 512: 19 groups of 8 at k = 20, 50 groups of 4 at k = 64)
        x = rng.standard_normal((rows, vocab)).astype(np.float32)
        hi = 190 if k <= 20 else 240
        x[:, 40:hi] += 8.0
        if rows > 1:
            x[1, 40:hi] = 6.0                              # ... all equal: bisection ends on a tie
        return x
    raise ValueError(kind)


# ------------------------------------------------------------------------------ top-k, interpret


# vocab 1000 = 3 x 256 + 232: the tail chunk is masked; the filter path runs for every k.
SMALL = tk.TopKConfig(chunk=256)
# clustered rows: vocab 2000 = 3 x 512 + 464, groups long enough for the bisection to be needed
CLUSTER = tk.TopKConfig(chunk=512)


@pytest.mark.parametrize("bisection", ["inline", "fixup"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("k", [1, 20, 64])
@pytest.mark.parametrize("kind", ["gauss", "ties", "neginf", "clustered"])
def test_top_k_interpret(kind, k, dtype, bisection):
    """bisection="fixup": the clustered rows' flagged chunks are written by the second kernel
    only (stage 1 leaves their poisoned slots as they were)."""
    rng = np.random.default_rng(oracle.seed_of(kind, k))
    cfg, vocab = (CLUSTER, 2000) if kind == "clustered" else (SMALL, 1000)
    cfg = dataclasses.replace(cfg, bisection=bisection)
    x = jnp.asarray(gen_rows(rng, kind, 4, vocab, k, dtype), dtype)
    vals, idx, ck, cc = run_top_k(x, k, cfg, candidates=True)
    check_top_k(x, k, vals, idx)
    check_candidates(np.asarray(x.astype(jnp.float32)), k, cfg.resolve(4, vocab, k), ck, cc)


@pytest.mark.parametrize("bisection", ["inline", "fixup"])
@pytest.mark.parametrize("kind", ["ties", "clustered", "neginf"])
def test_top_k_bf16_unpacked(kind, bisection):
    """pack_bf16=False: bfloat16 logits through the (key, column) path of float32."""
    k = 64
    cfg, vocab = (CLUSTER, 2000) if kind == "clustered" else (SMALL, 1000)
    cfg = dataclasses.replace(cfg, bisection=bisection, pack_bf16=False)
    x = jnp.asarray(gen_rows(np.random.default_rng(21), kind, 4, vocab, k, jnp.bfloat16), jnp.bfloat16)
    vals, idx, ck, cc = run_top_k(x, k, cfg, candidates=True)
    check_top_k(x, k, vals, idx)
    check_candidates(np.asarray(x.astype(jnp.float32)), k, cfg.resolve(4, vocab, k), ck, cc)


def test_packed_keys_order_and_unpack():
    """Packed bf16 keys order as (logit descending, column ascending) over every bf16 pattern, and
    unpack_candidates gives back the sort key and the column; reserved values stay reserved."""
    patterns = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    x = np.asarray(jnp.asarray(patterns.view(jnp.bfloat16)).astype(jnp.float32))     # every bf16 value
    keys = np.maximum(np_keys(x), tk.KEY_FLOOR).astype(np.int64)
    chunk, rng = 4096, np.random.default_rng(4)
    offset = rng.integers(0, chunk, keys.size)
    packed = ((keys & 0xFFFF0000) | (0xFFFF - offset)).astype(np.int64)
    packed = np.where(packed >= 2**31, packed - 2**32, packed)
    assert packed.min() >= tk.KEY_FLOOR
    a, b = rng.integers(0, keys.size, (2, 200_000))
    want = (keys[a] > keys[b]) | ((keys[a] == keys[b]) & (offset[a] < offset[b]))
    np.testing.assert_array_equal(packed[a] > packed[b], want)
    pick = rng.choice(keys.size, (2, 1000), replace=False)                   # two chunks of candidates
    grid = jnp.asarray(np.concatenate([packed[pick], [[tk.SENTINEL, INT_MIN]] * 2], 1).astype(np.int32)[None])
    sort, cols = (np.asarray(a)[0] for a in tk.unpack_candidates(grid, chunk))
    np.testing.assert_array_equal(sort[:, :-2], keys[pick])
    np.testing.assert_array_equal(cols[:, :-2], offset[pick] + np.arange(2)[:, None] * chunk)
    np.testing.assert_array_equal(sort[:, -2:], [[tk.SENTINEL, INT_MIN]] * 2)
    np.testing.assert_array_equal(cols[:, -2:], -1)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("k", [1, 20, 64])
@pytest.mark.parametrize("kind", ["gauss", "ties", "masked", "clustered"])
def test_top_k_stage2_rounds(kind, k, dtype):
    """stage2="rounds": k rounds of argmax over the row's candidates (the default is the filter)."""
    cfg, vocab = (CLUSTER, 2000) if kind == "clustered" else (SMALL, 1000)
    x = jnp.asarray(gen_rows(np.random.default_rng(k + 7), kind, 4, vocab, k, dtype), dtype)
    vals, idx = run_top_k(x, k, dataclasses.replace(cfg, stage2="rounds"))
    check_top_k(x, k, vals, idx)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_top_k_stage2_filter_bisects(dtype):
    """Eleven of twelve chunks high: the strided group-maximum threshold over a row's candidates
    leaves more than 2k above it, so the filter bisects (checked for the float32 keys by numpy)."""
    k, vocab, cfg = 64, 3000, tk.TopKConfig(chunk=256, stage2="filter")
    plan = cfg.resolve(4, vocab, k)
    x = np.random.default_rng(3).standard_normal((4, vocab)).astype(np.float32)
    x[:, :2816] += 8.0
    x = jnp.asarray(x, dtype)
    vals, idx, ck, _ = run_top_k(x, k, cfg, candidates=True)
    check_top_k(x, k, vals, idx)
    if dtype == jnp.float32:
        block, groups = plan["stage2_block"], 128
        keys = np.full((4, block), tk.SENTINEL, np.int64)
        keys[:, :plan["candidates"]] = np.asarray(ck).reshape(4, -1)
        gmax = keys.reshape(4, block // groups, groups).max(1)
        t0 = -np.sort(-gmax, axis=1)[:, k - 1]
        assert np.any((keys > t0[:, None]).sum(1) > 2 * k), "the case must need the filter's bisection"


@pytest.mark.parametrize("vocab,k,rows", [(40, 8, 3), (3000, 5, 2), (5000, 64, 3)])
def test_top_k_stage2_filter_shapes(vocab, k, rows):
    """Fewer candidates than kept pairs (every candidate passes), default chunks, the unpacked path."""
    rng = np.random.default_rng(vocab)
    for dtype in DTYPES:
        x = jnp.asarray(gen_rows(rng, "ties", rows, vocab, k, dtype), dtype)
        for pack in (True, False):
            vals, idx = run_top_k(x, k, tk.TopKConfig(stage2="filter", pack_bf16=pack))
            check_top_k(x, k, vals, idx)


def test_top_k_special_values():
    """NaN, -NaN, +-inf, -0.0 / +0.0: the IEEE total order of lax.top_k, bit-exact values."""
    rng = np.random.default_rng(1)
    for dtype in DTYPES:
        x = jnp.asarray(gen_rows(rng, "special", 3, 700, 64, dtype), dtype)
        for k in (64, 7):
            vals, idx = run_top_k(x, k, SMALL)
            check_top_k(x, k, vals, idx)


@pytest.mark.parametrize("bisection", ["inline", "fixup"])
@pytest.mark.parametrize("kind", ["ties", "clustered"])
def test_top_k_slots_equal_k(kind, bisection):
    """slots == k: no spare slot, so the tie cap and the tie positions must be exact."""
    k, cfg = 16, tk.TopKConfig(chunk=256, groups=32, slots=16, bisection=bisection)
    x = jnp.asarray(gen_rows(np.random.default_rng(9), kind, 4, 1000, k, jnp.float32))
    vals, idx, ck, cc = run_top_k(x, k, cfg, candidates=True)
    check_top_k(x, k, vals, idx)
    check_candidates(np.asarray(x), k, cfg.resolve(4, 1000, k), ck, cc)


@pytest.mark.parametrize("k", [20, 64])
def test_top_k_bisection_is_exercised(k):
    """The clustered rows really take the bisection path: n_gt(t0) > slots in their first chunk."""
    plan = CLUSTER.resolve(4, 2000, k)
    x = gen_rows(np.random.default_rng(2), "clustered", 4, 2000, k, jnp.float32)
    keys = np_keys(x[:, :plan["chunk"]])
    gmax = keys.reshape(4, plan["groups"], -1).max(-1)
    t0 = -np.sort(-gmax, axis=1)[:, k - 1]
    assert np.all((keys > t0[:, None]).sum(1) > plan["slots"])


def np_packed_keys(x, chunk):
    """Stage 1's packed bf16 keys (int64 values of the int32 bits), by numpy."""
    keys = np.maximum(np_keys(x), tk.KEY_FLOOR)
    offset = np.arange(x.shape[1]) % chunk
    packed = (keys & 0xFFFF0000) | (0xFFFF - offset)
    return np.where(packed >= 2**31, packed - 2**32, packed)


@pytest.mark.parametrize("bisection", ["inline", "fixup"])
@pytest.mark.parametrize("k", [20, 64])
def test_top_k_masked_vocabulary_bf16(k, bisection):
    """99 % -inf: the group-maximum threshold falls inside the run of -inf keys, so packed stage 1
    bisects among ties (the first chunk of row 0 checked by numpy); exact results and candidates."""
    cfg = tk.TopKConfig(chunk=512, bisection=bisection)
    plan = cfg.resolve(4, 3000, k)
    x = jnp.asarray(gen_rows(np.random.default_rng(k), "masked", 4, 3000, k, jnp.float32), jnp.bfloat16)
    packed = np_packed_keys(np.asarray(x[:1, :512].astype(jnp.float32)), 512)[0]
    gmax = packed.reshape(plan["groups"], -1).max(-1)
    t0 = np.sort(gmax)[::-1][k - 1]
    assert (packed >= t0).sum() > plan["slots"], "the case must need the bisection"
    vals, idx, ck, cc = run_top_k(x, k, cfg, candidates=True)
    check_top_k(x, k, vals, idx)
    check_candidates(np.asarray(x.astype(jnp.float32)), k, plan, ck, cc)


@pytest.mark.parametrize("vocab,k,rows", [(40, 8, 3), (20, 20, 2), (300, 20, 5), (130, 64, 2), (5000, 64, 3)])
def test_top_k_default_config_shapes(vocab, k, rows):
    """Vocab smaller than a chunk (every column a candidate when slots >= chunk), k == vocab,
    a single partly masked chunk, several default-sized chunks."""
    rng = np.random.default_rng(vocab + k)
    for dtype in DTYPES:
        x = jnp.asarray(gen_rows(rng, "ties" if dtype == jnp.bfloat16 else "gauss", rows, vocab, k, dtype), dtype)
        vals, idx = run_top_k(x, k)
        check_top_k(x, k, vals, idx)


def test_top_k_leading_dims_and_configs():
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((2, 3, 777)), jnp.bfloat16)
    vals, idx = run_top_k(x, 9)
    assert vals.shape == (2, 3, 9) and idx.shape == (2, 3, 9) and vals.dtype == jnp.bfloat16
    check_top_k(x, 9, vals, idx)
    for cfg in [tk.TopKConfig(chunk=128, groups=4, slots=16), tk.TopKConfig(chunk=512, groups=256, slots=1024),
                tk.TopKConfig(chunk=64, num_warps=4, stage2_warps=2)]:
        vals, idx = run_top_k(x, 9, cfg)
        check_top_k(x, 9, vals, idx)


# ------------------------------------------------------------------------------ argmax, interpret


@functools.lru_cache(maxsize=None)
def _jit_argmax(config, interpret):
    return jax.jit(lambda x: tk.argmax(x, config=config, interpret=interpret, partials_out=True,
                                       poison_outputs=True))


def check_argmax(x, config=None, interpret=True):
    out, keys, cols = _jit_argmax(config, interpret)(jnp.asarray(x))
    assert out.dtype == jnp.int32 and out.shape == x.shape[:-1]
    np.testing.assert_array_equal(np.asarray(out).reshape(-1), np_argmax(np.asarray(x).reshape(-1, x.shape[-1])))
    # jnp.argmax agrees except on rows with several NaNs: there XLA's GPU argmax returns one of
    # them (seen: the last of two), the kernel and numpy the first
    single_nan = np.sum(np.isnan(np.asarray(x, np.float32)), axis=-1) <= 1
    np.testing.assert_array_equal(np.asarray(out)[single_nan],
                                  np.asarray(jnp.argmax(jnp.asarray(x), axis=-1))[single_nan])
    cols = np.asarray(cols)
    assert not np.any(np.asarray(keys) == INT_MIN) and np.all((cols >= 0) & (cols < x.shape[-1])), \
        "an argmax partial was not written"


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("config", [None, tk.ArgmaxConfig(block=128, splits=3)], ids=["default", "splits3"])
def test_argmax_interpret(config, dtype):
    rng = np.random.default_rng(4)
    V = 1000                                                # 8 blocks of 128 (tail 104): 3 splits of 3, 3, 2
    x = rng.integers(-3, 4, (8, V)).astype(np.float32)
    x[0] = 3.0                                              # all equal
    x[1, [5, 300, 700, 999]] = 9.0                          # ties across splits: the first wins
    x[2, -1] = 50.0                                         # max in the masked tail block
    x[3] = -np.inf                                          # all -inf
    x[4, 17], x[4, 600] = np.nan, np.nan                    # the first NaN wins
    x[5, 400] = -np.nan
    x[6] = -1.0
    x[6, 10], x[6, 3] = 0.0, -0.0                           # -0.0 == +0.0: the lower index
    x[7] = -np.inf
    x[7, 900] = -1e30
    check_argmax(jnp.asarray(x, dtype), config)


def test_argmax_leading_dims_and_small_vocab():
    rng = np.random.default_rng(5)
    check_argmax(jnp.asarray(rng.standard_normal((2, 3, 77)), jnp.float32))
    check_argmax(jnp.asarray(rng.integers(0, 2, (3, 1)), jnp.bfloat16))
    check_argmax(jnp.asarray(rng.integers(0, 3, (5, 4099)), jnp.bfloat16), tk.ArgmaxConfig(block=256, splits=4))


# ------------------------------------------------------------------------------ dispatch


def test_dispatch_matches_reference():
    rng = np.random.default_rng(6)
    x = jnp.asarray(gen_rows(rng, "ties", 6, 300, 20, jnp.float32), jnp.bfloat16)
    ref = jax.jit(lambda x: sampling.top_k(x, 20, impl="ref"))(x)
    ker = jax.jit(lambda x: sampling.top_k(x, 20, impl="pallas"))(x)
    np.testing.assert_array_equal(np.asarray(ker[1]), np.asarray(ref[1]))
    np.testing.assert_array_equal(bits(ker[0]), bits(ref[0]))
    np.testing.assert_array_equal(np.asarray(sampling.greedy_tokens(x, impl="pallas")),
                                  np.asarray(sampling.greedy_tokens(x, impl="ref")))
    # target_distribution through the kernel: same ids, same probabilities
    params = sampling.SamplingParams.create(6, temperature=[0.0, 1.0, 0.7, 2.0, 1.0, 0.5], top_k=[0, 5, 0, 300, 1, 7],
                                            top_p=[1.0, 0.9, 0.5, 1.0, 1.0, 0.8])
    td = jax.jit(sampling.target_distribution, static_argnums=2, static_argnames="impl")
    p_ref, i_ref = td(x, params, 20, impl="ref")
    p_ker, i_ker = td(x, params, 20, impl="pallas")
    np.testing.assert_array_equal(np.asarray(i_ker), np.asarray(i_ref))
    np.testing.assert_array_equal(np.asarray(p_ker), np.asarray(p_ref))


def test_dispatch_unsupported():
    x = jnp.zeros((2, 100), jnp.float32)
    with pytest.raises(ValueError, match="top_k"):
        sampling.top_k(x, 65, impl="pallas")
    with pytest.raises(ValueError, match="top_k"):
        sampling.top_k(x.astype(jnp.float16), 5, impl="pallas")
    with pytest.raises(ValueError, match="greedy_tokens"):
        sampling.greedy_tokens(x.astype(jnp.float16), impl="pallas")
    # auto off the GPU (and where unsupported) is the reference
    v, i = sampling.top_k(x.astype(jnp.float16), 65)
    assert i.shape == (2, 65)


def test_supports():
    S = jax.ShapeDtypeStruct
    assert tk.supports_top_k(S((1024, 248320), jnp.bfloat16), 64)
    assert tk.supports_top_k(S((248320,), jnp.float32), 1)
    assert tk.supports_top_k(S((2, 3, 20), jnp.float32), 20)
    assert not tk.supports_top_k(S((4, 100), jnp.float32), 65)         # k > 64
    assert not tk.supports_top_k(S((4, 10), jnp.float32), 11)          # k > vocab
    assert not tk.supports_top_k(S((4, 100), jnp.float32), 0)
    assert not tk.supports_top_k(S((4, 100), jnp.float16), 5)
    assert not tk.supports_top_k(S((0, 100), jnp.float32), 5)          # no rows
    assert not tk.supports_top_k(S((4, 100), jnp.float32), 5.0)        # k not a static int
    assert not tk.supports_top_k(S((1, 2**28), jnp.float32), 64)       # candidates beyond stage 2's registers
    assert tk.supports_argmax(S((1024, 248320), jnp.float32))
    assert tk.supports_argmax(S((7,), jnp.bfloat16))
    assert not tk.supports_argmax(S((4, 0), jnp.float32))
    assert not tk.supports_argmax(S((4, 10), jnp.int32))


def test_config_validation_and_plans():
    for field, bad in [("chunk", 100), ("chunk", 32), ("chunk", 32768), ("groups", 3), ("groups", 512),
                       ("slots", 8), ("slots", 96), ("num_warps", 3), ("stage2_warps", 32)]:
        with pytest.raises(ValueError, match=field):
            tk.TopKConfig(**{field: bad})
    for field, bad in [("block", 64), ("block", 1000), ("splits", 0), ("num_warps", 5)]:
        with pytest.raises(ValueError, match=field):
            tk.ArgmaxConfig(**{field: bad})
    with pytest.raises(ValueError, match="slots"):
        tk.TopKConfig(slots=16).resolve(8, 1000, 20)
    with pytest.raises(ValueError, match="bisection"):
        tk.TopKConfig(bisection="loop")
    with pytest.raises(ValueError, match="stage2"):
        tk.TopKConfig(stage2="sort")
    with pytest.raises(ValueError, match="pack_bf16"):                   # 3880 chunks x 32 slots
        tk.top_k(jnp.zeros((1, 248320), jnp.bfloat16), 16, config=tk.TopKConfig(chunk=64))
    with pytest.raises(ValueError, match="stage2"):
        tk.top_k(jnp.zeros((1, 248320), jnp.float32), 16, config=tk.TopKConfig(chunk=64, stage2="filter"))
    assert tk.TopKConfig().resolve(1024, 248320, 64)["stage2"] == "filter"
    assert tk.TopKConfig(chunk=64).resolve(1, 248320, 16)["stage2"] == "rounds"      # 2**16 candidates a row
    p = tk.TopKConfig().resolve(1024, 248320, 64)
    assert (p["chunk"], p["groups"], p["slots"], p["num_chunks"], p["candidates"], p["stage2_block"]) == \
        (4096, 128, 128, 61, 7808, 8192)
    p = tk.TopKConfig().resolve(1024, 248320, 20)
    assert (p["groups"], p["slots"], p["candidates"]) == (64, 64, 3904)
    p = tk.TopKConfig().resolve(8, 248320, 64)                          # few rows: smaller chunks
    assert (p["chunk"], p["candidates"], p["stage2_block"], p["stage2_warps"]) == (2048, 15616, 16384, 16)
    p = tk.TopKConfig().resolve(3, 40, 8)
    assert (p["chunk"], p["slots"], p["num_chunks"]) == (64, 16, 1)
    a = tk.ArgmaxConfig().resolve(1024, 248320, 4)
    assert (a["block"], a["splits"]) == (2048, 1)
    a = tk.ArgmaxConfig().resolve(8, 248320, 2)
    assert (a["block"], a["splits"], a["steps"]) == (4096, 13, 5)     # 61 blocks: 13 splits of <= 5


# ------------------------------------------------------------------------------ H200 lowering


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("rows,vocab,k", [(1024, 248320, 20), (1024, 248320, 64), (4096, 248320, 64),
                                          (8, 248320, 20), (3, 40, 8), (5, 1000, 1)])
def test_top_k_lowers_for_h200(rows, vocab, k, dtype):
    text = lower_for_h200(lambda x: tk.top_k(x, k, interpret=False), jax.ShapeDtypeStruct((rows, vocab), dtype))
    assert text.count("__gpu$xla.gpu.triton") == 2


@pytest.mark.parametrize("rows,vocab,k", [(1024, 248320, 64), (3, 1000, 20)])
def test_top_k_fixup_lowers_for_h200(rows, vocab, k):
    cfg = tk.TopKConfig(bisection="fixup")
    text = lower_for_h200(lambda x: tk.top_k(x, k, config=cfg, interpret=False),
                          jax.ShapeDtypeStruct((rows, vocab), jnp.bfloat16))
    assert text.count("__gpu$xla.gpu.triton") == 3              # stage 1, the fix-up, stage 2


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("rows,vocab", [(1024, 248320), (4096, 248320), (8, 248320), (3, 77)])
def test_argmax_lowers_for_h200(rows, vocab, dtype):
    text = lower_for_h200(lambda x: tk.argmax(x, interpret=False), jax.ShapeDtypeStruct((rows, vocab), dtype))
    assert "__gpu$xla.gpu.triton" in text


def test_poisoned_and_config_variants_lower_for_h200():
    S = jax.ShapeDtypeStruct((1024, 248320), jnp.bfloat16)
    for cfg in [tk.TopKConfig(chunk=16384, num_warps=16), tk.TopKConfig(chunk=4096, num_warps=4, stage2_warps=4),
                tk.TopKConfig(pack_bf16=False), tk.TopKConfig(stage2="rounds"),
                tk.TopKConfig(stage2="filter", pack_bf16=False)]:
        lower_for_h200(lambda x: tk.top_k(x, 64, config=cfg, interpret=False, poison_outputs=True), S)
    lower_for_h200(lambda x: tk.argmax(x, config=tk.ArgmaxConfig(splits=4), interpret=False, poison_outputs=True), S)
    # (the op-level dispatch picks interpret mode from the default backend, the CPU here: not lowered)


# ------------------------------------------------------------------------------ GPU


GPU_SHAPES = [(1024, 248320), (7, 248320), (33, 1000), (5, 40), (16, 131075)]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("rows,vocab", GPU_SHAPES)
def test_top_k_gpu(rows, vocab, dtype):
    rng = np.random.default_rng(rows + vocab)
    x = jnp.asarray(gen_rows(rng, "gauss", rows, vocab, 64, dtype), dtype)
    for k in (1, 20, 64):
        if k > vocab:
            continue
        vals, idx = run_top_k(x, k, interpret=False)
        check_top_k(x, k, vals, idx)                       # also against lax.top_k on the GPU


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("bisection,stage2", [("inline", "rounds"), ("fixup", "rounds"), ("inline", "filter")])
@pytest.mark.parametrize("kind", ["ties", "neginf", "special", "clustered", "masked"])
def test_top_k_gpu_adversarial(kind, dtype, bisection, stage2):
    rng = np.random.default_rng(11)
    x = jnp.asarray(gen_rows(rng, kind, 6, 248320, 64, dtype), dtype)
    cfg = tk.TopKConfig(bisection=bisection, stage2=stage2)
    for k in (1, 20, 64):
        vals, idx, ck, cc = run_top_k(x, k, cfg, interpret=False, candidates=True)
        # the oracle is the contract; lax.top_k on the GPU is compared where no NaN / -0.0 is involved
        check_top_k(x, k, vals, idx, against_lax=kind != "special")
        check_candidates(np.asarray(x.astype(jnp.float32)), k, tk.TopKConfig().resolve(6, 248320, k), ck, cc)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [dict(chunk=2048, stage2_warps=4), dict(chunk=16384, num_warps=16),
                                 dict(chunk=8192, groups=32, slots=256), dict(chunk=1024, num_warps=2, stage2_warps=16),
                                 dict(bisection="fixup"), dict(pack_bf16=False),
                                 dict(pack_bf16=False, bisection="fixup"), dict(stage2="rounds"),
                                 dict(stage2="filter", pack_bf16=False), dict(stage2="filter", chunk=1024)])
def test_top_k_gpu_configs(cfg):
    rng = np.random.default_rng(12)
    x = jnp.asarray(gen_rows(rng, "ties", 64, 248320 - 5, 64, jnp.bfloat16), jnp.bfloat16)
    for k in (20, 64):
        vals, idx = run_top_k(x, k, tk.TopKConfig(**cfg), interpret=False)
        check_top_k(x, k, vals, idx)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("rows,vocab,config", [(r, v, None) for r, v in GPU_SHAPES + [(1, 248320)]] + [
    (7, 248320, tk.ArgmaxConfig(block=512, splits=7)), (16, 131075, tk.ArgmaxConfig(block=1024, splits=5))])
def test_argmax_gpu(rows, vocab, config, dtype):
    rng = np.random.default_rng(rows * vocab % 1000)
    x = rng.integers(-50, 50, (rows, vocab)).astype(np.float32)      # ties
    x[0, -1] = 1000.0
    if rows > 3:
        x[1, [vocab // 3, vocab - 2]] = np.nan
        x[2] = -np.inf
        x[3] = -0.0
        x[3, vocab // 2] = 0.0
    check_argmax(jnp.asarray(x, dtype), config, interpret=False)


@gpu
@pytest.mark.gpu
def test_dispatch_gpu_auto():
    """impl='auto' takes the kernels on the GPU and matches the reference inside jit."""
    rng = np.random.default_rng(13)
    x = jnp.asarray(rng.standard_normal((64, 248320)) * 4, jnp.bfloat16)
    params = sampling.SamplingParams.create(64, temperature=1.0, top_k=20, top_p=0.9)
    td = jax.jit(sampling.target_distribution, static_argnums=2, static_argnames="impl")
    p_ref, i_ref = td(x, params, 64, impl="ref")
    p_auto, i_auto = td(x, params, 64, impl="auto")
    np.testing.assert_array_equal(np.asarray(i_auto), np.asarray(i_ref))
    np.testing.assert_allclose(np.asarray(p_auto), np.asarray(p_ref), rtol=1e-6, atol=1e-7)
    g = jax.jit(sampling.greedy_tokens, static_argnames="impl")
    np.testing.assert_array_equal(np.asarray(g(x, impl="auto")), np.asarray(g(x, impl="ref")))
