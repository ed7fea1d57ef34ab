"""The top-k kernel (jaxspec/pallas/topk.py) against an independent numpy oracle and its op's reference,
jax.lax.top_k: interpret mode on the CPU, the real kernels on the GPU (-m gpu), and the H200 Triton
lowering on the CPU; and `sampling.top_k`'s dispatch to it.

Both kernels write into poisoned buffers (NaN / INT_MIN), so an element they fail to write shows;
values are compared bit for bit, indices exactly. The stream's maxima are checked against their
jnp reference and that against a numpy oracle of the keys."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import oracle
import pytest
from gpu_lowering import lower_for_h200

from jaxspec.ops import sampling
from jaxspec.pallas import topk as tk

ON_GPU = jax.default_backend() == "gpu"
gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
DTYPES = [jnp.float32, jnp.bfloat16]
DT_IDS = ["f32", "bf16"]
INT_MIN = -(2**31)
KINDS = ["gauss", "ties", "neginf", "special", "masked", "clustered"]

# ------------------------------------------------------------------------------ numpy oracle


def np_keys(x):
    """int64 keys in the IEEE total order (lax.top_k's order) of a float32 / bfloat16 array."""
    b = np.asarray(jnp.asarray(x).astype(jnp.float32)).view(np.int32).astype(np.int64)
    return np.where(b < 0, b ^ 0x7FFFFFFF, b)


def np_top_k(x, k):
    """Indices [rows, k] of the k largest per row: key descending, then column ascending."""
    keys = np_keys(x)
    rows, vocab = keys.shape
    comb = ((keys + 2**31) << 20) | ((2**20 - 1) - np.arange(vocab, dtype=np.int64))  # unique, vocab < 2**20
    part = np.argpartition(-comb, k - 1, axis=1)[:, :k]
    order = np.argsort(-np.take_along_axis(comb, part, 1), axis=1)
    return np.take_along_axis(part, order, 1).astype(np.int32)


def np_maxima(x, plan):
    """numpy oracle of chunk_maxima: int64 total-order keys (bfloat16: the high half), the least
    int16 / int32 past the vocabulary, maxima per chunk and per block."""
    rows, vocab = x.shape
    keys = np.maximum(np_keys(x), tk.KEY_FLOOR)
    if plan["key16"]:
        keys = keys >> 16
    pad = np.full((rows, plan["num_blocks"] * plan["width"]), -(2**15) if plan["key16"] else INT_MIN, np.int64)
    pad[:, :vocab] = keys
    cm = pad.reshape(rows, plan["num_blocks"], plan["group"], plan["chunk"]).max(-1)
    return cm.reshape(rows, -1), cm.max(-1)


def bits(a):
    a = np.asarray(a)
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


def check_top_k(x, k, vals, idx, against_lax=True):
    """Indices equal to the oracle's, values its logits bit for bit; and both equal to lax.top_k's
    (whose GPU form does not keep NaN payloads: GPU tests of special values use the oracle alone)."""
    x2 = np.asarray(x).reshape(-1, x.shape[-1])
    ref_i = np_top_k(x2, k)
    np.testing.assert_array_equal(np.asarray(idx).reshape(-1, k), ref_i, "indices vs the numpy oracle")
    np.testing.assert_array_equal(
        bits(np.asarray(vals).reshape(-1, k)), bits(np.take_along_axis(x2, ref_i, 1)), "values (bits)"
    )
    if against_lax:
        lv, li = jax.lax.top_k(jnp.asarray(x), k)
        np.testing.assert_array_equal(np.asarray(idx), np.asarray(li), "indices vs lax.top_k")
        np.testing.assert_array_equal(bits(vals), bits(lv), "values vs lax.top_k")


@functools.cache
def _jit_top_k(k, config, interpret):
    return jax.jit(lambda x: tk.top_k(x, k, config=config, interpret=interpret, poison_outputs=True))


def run_checked(x, k, config=None, interpret=True, against_lax=True):
    vals, idx = _jit_top_k(k, config, interpret)(x)
    check_top_k(x, k, vals, idx, against_lax=against_lax)


# ------------------------------------------------------------------------------ inputs


def gen_rows(rng, kind, rows, vocab, k, dtype):
    """float32 numpy rows of one kind (cast to dtype by the caller)."""
    if kind == "gauss":
        return rng.standard_normal((rows, vocab)).astype(np.float32) * 3
    if kind == "ties":
        # few distinct values: long runs of equal keys inside and across chunk and block boundaries
        x = rng.integers(-3, 4, (rows, vocab)).astype(np.float32)
        x[0] = 1.0  # one row all equal
        if rows > 1:
            x[1] = -2.0
            x[1, rng.choice(vocab, k // 2 + 1, replace=False)] = 5.0  # fewer maxima than k, tie at the cut
        return x
    if kind == "neginf":
        x = rng.standard_normal((rows, vocab)).astype(np.float32)
        x[rng.random((rows, vocab)) < 0.5] = -np.inf
        x[0] = -np.inf  # all -inf
        if rows > 1:
            x[1] = -np.inf
            x[1, rng.choice(vocab, max(1, k // 3), replace=False)] = rng.standard_normal(max(1, k // 3))
        if rows > 2:
            x[2] = -np.inf
            x[2, -3:] = [1.0, 2.0, 1.0]  # finite only in the tail chunk
        return x
    if kind == "masked":  # a masked vocabulary: 99 % -inf
        x = rng.standard_normal((rows, vocab)).astype(np.float32)
        x[rng.random((rows, vocab)) < 0.99] = -np.inf
        return x
    if kind == "special":  # signed zeros, infinities, NaNs of both signs
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
        # a contiguous run of high logits: the top-k crowd into few chunks and blocks
        x = rng.standard_normal((rows, vocab)).astype(np.float32)
        hi = 190 if k <= 20 else 240
        x[:, 40:hi] += 8.0
        if rows > 1:
            x[1, 40:hi] = 6.0  # ... all equal: the cut falls inside a tie
        return x
    raise ValueError(kind)


# ------------------------------------------------------------------------------ interpret


TINY = tk.TopKConfig(chunk=4, group=4, blocks_per_step=2, unroll=2, steps=3)  # 16-column blocks, 3 steps a program
PREFETCH = tk.TopKConfig(chunk=8, group=8, blocks_per_step=4, unroll=1, steps=4)
# Vocabularies that end inside a chunk, a block, a step, a program (none a power of two); each input
# kind meets one of them, both dtypes.
CASES = [  # kind, rows, vocab, k, config
    ("gauss", 1, 70, 64, None),
    ("ties", 5, 5000, 33, None),
    ("neginf", 2, 3001, 64, PREFETCH),
    ("special", 4, 777, 1, TINY),
    ("masked", 2, 3001, 20, PREFETCH),
    ("clustered", 3, 1000, 20, TINY),
]
CASE_IDS = [f"{kind}-{r}x{v}-k{k}-{'default' if c is None else f'c{c.chunk}g{c.group}'}" for kind, r, v, k, c in CASES]
SHAPES, SHAPE_IDS = [case[1:] for case in CASES], [case_id.split("-", 1)[1] for case_id in CASE_IDS]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("kind,rows,vocab,k,config", CASES, ids=CASE_IDS)
def test_top_k_interpret(kind, rows, vocab, k, config, dtype):
    rng = np.random.default_rng(oracle.seed_of(kind, rows, vocab, k))
    run_checked(jnp.asarray(gen_rows(rng, kind, rows, vocab, k, dtype), dtype), k, config)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize(
    "rows,vocab,k,config", [(3, 1000, 20, TINY), (2, 3001, 64, PREFETCH)], ids=["tiny", "prefetch"]
)
def test_chunk_maxima_interpret(rows, vocab, k, config, dtype):
    rng = np.random.default_rng(oracle.seed_of("maxima", rows, vocab, k))
    x = jnp.asarray(gen_rows(rng, "special", rows, vocab, k, dtype), dtype)
    plan = config.resolve(rows, vocab, k, dtype)
    cm, bm = jax.jit(lambda x: tk.chunk_maxima(x, plan, interpret=True, poison_outputs=True))(x)
    ref_cm, ref_bm = tk.chunk_maxima_reference(x, plan)
    assert cm.dtype == (jnp.int16 if dtype == jnp.bfloat16 else jnp.int32) and bm.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(cm), np.asarray(ref_cm), "chunk maxima vs the jnp reference")
    np.testing.assert_array_equal(np.asarray(bm), np.asarray(ref_bm), "block maxima vs the jnp reference")
    np_cm, np_bm = np_maxima(np.asarray(x.astype(jnp.float32)), plan)
    np.testing.assert_array_equal(np.asarray(ref_cm).astype(np.int64), np_cm, "reference vs the numpy oracle")
    np.testing.assert_array_equal(np.asarray(ref_bm).astype(np.int64), np_bm, "reference vs the numpy oracle")


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_top_k_tie_shapes(dtype):
    """Ties that span chunk and block boundaries: every row one value (the first k columns win),
    a tie at the k-th key split over blocks, ties only among -inf."""
    rows, vocab, k = 4, 600, 20
    x = np.zeros((rows, vocab), np.float32)
    x[1] = -1.0
    x[1, [3, 17, 40, 41, 300, 599]] = 2.0
    x[1, np.arange(5, 600, 23)] = 1.0  # 27 ties at the cut, every block
    x[2] = -np.inf
    x[2, [590, 7]] = [3.0, 3.0]
    x[3] = np.tile(np.arange(16, dtype=np.float32), vocab // 16 + 1)[:vocab]  # each chunk holds every value
    run_checked(jnp.asarray(x, dtype), k, TINY)


def test_top_k_leading_dims():
    x = jnp.asarray(np.random.default_rng(oracle.seed_of("leading")).standard_normal((2, 3, 500)), jnp.bfloat16)
    vals, idx = tk.top_k(x, 16, interpret=True)
    assert vals.shape == (2, 3, 16) and idx.shape == (2, 3, 16)
    check_top_k(x, 16, vals, idx)


def test_supports_config_and_plans():
    S = jax.ShapeDtypeStruct
    bf = S((8, 248320), jnp.bfloat16)
    assert tk.supports(bf, 64) and tk.supports(bf, 1) and tk.supports(S((248320,), jnp.float32), 1)
    assert not tk.supports(bf, 65) and not tk.supports(bf, 0) and not tk.supports(bf, 2.0)
    assert not tk.supports(bf, True) and not tk.supports(S((0, 100), jnp.float32), 5)  # no rows
    assert not tk.supports(S((8, 10), jnp.float32), 20)  # k > vocab
    assert not tk.supports(S((8, 100), jnp.float16), 5) and not tk.supports([[1.0, 2.0]], 1)
    assert tk.supports(S((2, 2**20), jnp.float32), 5)
    assert not tk.supports(S((2, 2**20 + 1), jnp.float32), 5)  # 4097 blocks
    assert tk.supports(S((2, 2**20 + 1), jnp.float32), 5, tk.TopKConfig(group=32))
    with pytest.raises(ValueError, match="k=65"):
        tk.top_k(jnp.zeros((2, 100)), 65)
    for field, bad in [
        ("chunk", 3),
        ("chunk", 128),
        ("group", 2),
        ("blocks_per_step", 0),
        ("num_warps", 32),
        ("select_warps", 3),
        ("unroll", 0),
        ("steps", 0),
    ]:
        with pytest.raises(ValueError, match=f"TopKConfig.{field}"):
            tk.TopKConfig(**{field: bad})
    plan = tk.TopKConfig().resolve(1024, 248320, 64, jnp.bfloat16)
    assert (plan["num_blocks"], plan["blocks_pad"], plan["K"], plan["key16"]) == (970, 1024, 64, True)
    assert plan["steps"] * plan["step_blocks"] * plan["width"] == 32768 and plan["programs"] == 8
    small = tk.TopKConfig().resolve(8, 248320, 20, jnp.float32)  # few rows: shorter programs
    assert small["programs"] * 8 >= 528 and not small["key16"] and small["K"] == 32
    tiny = tk.TopKConfig().resolve(5, 40, 5, jnp.float32)
    assert (tiny["num_blocks"], tiny["step_blocks"], tiny["steps"], tiny["programs"]) == (1, 1, 1, 1)


@pytest.mark.parametrize(
    "rows,vocab,k,dtype",
    [(1024, 248320, 64, jnp.bfloat16), (4096, 248320, 20, jnp.float32), (5, 40, 5, jnp.bfloat16)],
    ids=["1024-bf16", "4096-f32", "5x40-bf16"],
)
def test_top_k_lowers_for_h200(rows, vocab, k, dtype):
    text = lower_for_h200(
        lambda x: tk.top_k(x, k, interpret=False, poison_outputs=True), jax.ShapeDtypeStruct((rows, vocab), dtype)
    )
    assert text.count("__gpu$xla.gpu.triton") == 2 and "stablehlo.sort" not in text


# ------------------------------------------------------------------------------ dispatch


def test_dispatch_matches_reference():
    """impl='pallas' (interpret mode here) takes the kernel and equals impl='ref', through
    target_distribution too; greedy_tokens has no kernel, so impl='pallas' runs its reference."""
    rng = np.random.default_rng(oracle.seed_of("dispatch"))
    x = jnp.asarray(gen_rows(rng, "ties", 6, 300, 20, jnp.float32), jnp.bfloat16)
    top = jax.jit(sampling.top_k, static_argnums=1, static_argnames="impl")
    assert "topk_chunk_maxima" in str(jax.make_jaxpr(lambda x: sampling.top_k(x, 20, impl="pallas"))(x))
    ref, ker = top(x, 20, impl="ref"), top(x, 20, impl="pallas")
    np.testing.assert_array_equal(np.asarray(ker[1]), np.asarray(ref[1]))
    np.testing.assert_array_equal(bits(ker[0]), bits(ref[0]))
    params = sampling.SamplingParams.create(
        6, temperature=[0.0, 1.0, 0.7, 2.0, 1.0, 0.5], top_k=[0, 5, 0, 300, 1, 7], top_p=[1.0, 0.9, 0.5, 1.0, 1.0, 0.8]
    )
    td = jax.jit(sampling.target_distribution, static_argnums=2, static_argnames="impl")
    p_ref, i_ref = td(x, params, 20, impl="ref")
    p_ker, i_ker = td(x, params, 20, impl="pallas")
    np.testing.assert_array_equal(np.asarray(i_ker), np.asarray(i_ref))
    np.testing.assert_array_equal(np.asarray(p_ker), np.asarray(p_ref))
    np.testing.assert_array_equal(np.asarray(sampling.greedy_tokens(x, impl="pallas")), np.argmax(np.asarray(x), -1))


def test_dispatch_unsupported():
    """impl='pallas' raises where the kernel does not cover the call; impl='auto' runs the reference."""
    S = jax.ShapeDtypeStruct
    for shape, dtype, k in [((2, 100), jnp.float32, 65), ((2, 100), jnp.float16, 5), ((2, 2**20 + 1), jnp.float32, 5)]:
        with pytest.raises(ValueError, match="top_k"):
            jax.eval_shape(lambda x: sampling.top_k(x, k, impl="pallas"), S(shape, dtype))
        v, i = jax.eval_shape(lambda x: sampling.top_k(x, k), S(shape, dtype))
        assert v.shape == i.shape == (2, k)


# ------------------------------------------------------------------------------ GPU


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows,vocab", [(256, 248320), (7, 248320), (33, 1000), (5, 40), (16, 131075)])
def test_top_k_gpu(rows, vocab, kind, dtype):
    rng = np.random.default_rng(oracle.seed_of(rows, vocab, kind))
    x = jnp.asarray(gen_rows(rng, kind, rows, vocab, 64, dtype), dtype)
    for k in (1, 20, 64) if vocab >= 64 else (1, 5, vocab):
        run_checked(x, k, interpret=False, against_lax=kind != "special")
    plan = tk.TopKConfig().resolve(rows, vocab, 64 if vocab >= 64 else 5, dtype)
    cm, bm = jax.jit(lambda x: tk.chunk_maxima(x, plan, interpret=False, poison_outputs=True))(x)
    ref_cm, ref_bm = tk.chunk_maxima_reference(x, plan)
    np.testing.assert_array_equal(np.asarray(cm), np.asarray(ref_cm))
    np.testing.assert_array_equal(np.asarray(bm), np.asarray(ref_bm))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("rows,vocab,k,config", SHAPES, ids=SHAPE_IDS)
def test_top_k_configs_gpu(rows, vocab, k, config, dtype):
    rng = np.random.default_rng(oracle.seed_of("configs", rows, vocab, k))
    for kind in ("gauss", "ties", "special"):
        run_checked(
            jnp.asarray(gen_rows(rng, kind, rows, vocab, k, dtype), dtype),
            k,
            config,
            interpret=False,
            against_lax=kind != "special",
        )


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_top_k_tie_shapes_gpu(dtype):
    x = np.round(np.random.default_rng(oracle.seed_of("ties-gpu")).standard_normal((64, 248320)) * 1.5).clip(-3, 3)
    run_checked(jnp.asarray(x, dtype), 64, interpret=False)
    run_checked(jnp.asarray(x * (1 + 2**-10), dtype), 64, interpret=False)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_top_k_dispatch_gpu(dtype):
    """impl='auto' takes the kernel at the Qwen vocabulary and matches lax.top_k, through
    target_distribution too; above 2**20 columns it runs lax.top_k."""
    x = jnp.asarray(np.random.default_rng(oracle.seed_of("dispatch-gpu")).standard_normal((64, 248320)) * 4, dtype)
    top = jax.jit(lambda x: sampling.top_k(x, 64, impl="auto"))
    assert "topk_chunk_maxima" in top.lower(x).as_text()
    assert "topk_chunk_maxima" not in top.lower(jax.ShapeDtypeStruct((16, 2**20 + 7), dtype)).as_text()
    vals, idx = top(x)
    lv, li = jax.lax.top_k(x, 64)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(li))
    np.testing.assert_array_equal(bits(vals), bits(lv))
    params = sampling.SamplingParams.create(8, temperature=0.7, top_k=40, top_p=0.9)
    td = jax.jit(sampling.target_distribution, static_argnums=2, static_argnames="impl")
    logits = x.reshape(8, 8, -1)
    p_ref, i_ref = td(logits, params, 64, impl="ref")
    p_auto, i_auto = td(logits, params, 64, impl="auto")
    np.testing.assert_array_equal(np.asarray(i_auto), np.asarray(i_ref))
    np.testing.assert_allclose(np.asarray(p_auto), np.asarray(p_ref), rtol=1e-6, atol=1e-7)
