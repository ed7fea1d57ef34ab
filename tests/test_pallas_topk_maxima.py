"""The chunk-maxima top-k (jaxspec/pallas/topk_maxima.py) against the numpy oracle and
jax.lax.top_k: interpret mode on the CPU, the real kernels on the GPU (-m gpu), the H200 Triton
lowering on the CPU.

Both kernels write into poisoned buffers (NaN / INT_MIN), so an element they fail to write shows;
values are compared bit for bit, indices exactly. The stream's maxima are checked against their
jnp reference and that against a numpy oracle of the keys."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oracle
from gpu_lowering import lower_for_h200
from jaxspec.pallas import topk as tk
from jaxspec.pallas import topk_maxima as tm
from test_pallas_topk import DT_IDS, DTYPES, check_auto_dispatch, check_top_k, gen_rows, np_keys

ON_GPU = jax.default_backend() == "gpu"
gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
INT_MIN = -2**31
KINDS = ["gauss", "ties", "neginf", "special", "masked", "clustered"]

TINY = tm.MaximaConfig(chunk=4, group=4, blocks_per_step=2, unroll=2, steps=3)   # 16-column blocks, 3 steps a program
CASES = [  # rows, vocab, k, config: vocabularies that end inside a chunk, a block, a step, a program
    (3, 1000, 20, TINY),
    (2, 3001, 64, tm.MaximaConfig(chunk=8, group=8, blocks_per_step=4, unroll=1, steps=4)),   # 4 prefetched steps
    (4, 777, 1, TINY),
    (1, 70, 64, None),
    (5, 5000, 33, None),
]
CASE_IDS = [f"{r}x{v}-k{k}-{'default' if c is None else f'c{c.chunk}g{c.group}'}" for r, v, k, c in CASES]


@functools.lru_cache(maxsize=None)
def _jit_top_k(k, config, interpret):
    return jax.jit(lambda x: tm.top_k(x, k, config=config, interpret=interpret, poison_outputs=True))


def run_checked(x, k, config=None, interpret=True, against_lax=True):
    """top_k checked against the numpy oracle (indices, value bits) and lax.top_k (whose GPU form
    does not keep NaN payloads: the GPU tests of special values compare with the oracle alone)."""
    vals, idx = _jit_top_k(k, config, interpret)(x)
    check_top_k(x, k, vals, idx, against_lax=against_lax)


def np_maxima(x, plan):
    """numpy oracle of chunk_maxima: int64 total-order keys (bfloat16: the high half), the least
    int16 / int32 past the vocabulary, maxima per chunk and per block."""
    rows, vocab = x.shape
    keys = np.maximum(np_keys(x), tk.KEY_FLOOR)
    if plan["key16"]:
        keys = keys >> 16
    pad = np.full((rows, plan["num_blocks"] * plan["width"]), -2**15 if plan["key16"] else INT_MIN, np.int64)
    pad[:, :vocab] = keys
    cm = pad.reshape(rows, plan["num_blocks"], plan["group"], plan["chunk"]).max(-1)
    return cm.reshape(rows, -1), cm.max(-1)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("rows,vocab,k,config", CASES, ids=CASE_IDS)
def test_chunk_maxima_interpret(rows, vocab, k, config, dtype):
    rng = np.random.default_rng(vocab + k)
    x = jnp.asarray(gen_rows(rng, "special", rows, vocab, k, dtype), dtype)
    plan = (config or tm.MaximaConfig()).resolve(rows, vocab, k, dtype)
    cm, bm = jax.jit(lambda x: tm.chunk_maxima(x, plan, interpret=True, poison_outputs=True))(x)
    ref_cm, ref_bm = tm.chunk_maxima_reference(x, plan)
    assert cm.dtype == (jnp.int16 if dtype == jnp.bfloat16 else jnp.int32) and bm.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(cm), np.asarray(ref_cm), "chunk maxima vs the jnp reference")
    np.testing.assert_array_equal(np.asarray(bm), np.asarray(ref_bm), "block maxima vs the jnp reference")
    np_cm, np_bm = np_maxima(np.asarray(x.astype(jnp.float32)), plan)
    np.testing.assert_array_equal(np.asarray(ref_cm).astype(np.int64), np_cm, "reference vs the numpy oracle")
    np.testing.assert_array_equal(np.asarray(ref_bm).astype(np.int64), np_bm, "reference vs the numpy oracle")


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows,vocab,k,config", CASES, ids=CASE_IDS)
def test_top_k_maxima_interpret(rows, vocab, k, config, kind, dtype):
    rng = np.random.default_rng(oracle.seed_of(rows, vocab, k, kind))
    x = jnp.asarray(gen_rows(rng, kind, rows, vocab, k, dtype), dtype)
    run_checked(x, k, config)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_top_k_maxima_tie_shapes(dtype):
    """Ties that span chunk and block boundaries: every row one value (the first k columns win),
    a tie at the k-th key split over blocks, ties only among -inf."""
    rows, vocab, k = 4, 600, 20
    x = np.zeros((rows, vocab), np.float32)
    x[1] = -1.0
    x[1, [3, 17, 40, 41, 300, 599]] = 2.0
    x[1, np.arange(5, 600, 23)] = 1.0                     # 27 ties at the cut, every block
    x[2] = -np.inf
    x[2, [590, 7]] = [3.0, 3.0]
    x[3] = np.tile(np.arange(16, dtype=np.float32), vocab // 16 + 1)[:vocab]   # each chunk holds every value
    run_checked(jnp.asarray(x, dtype), k, TINY)


def test_top_k_maxima_leading_dims_and_k():
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 3, 500)).astype(np.float32), jnp.bfloat16)
    for k in (1, 16, 64):
        vals, idx = tm.top_k(x, k, interpret=True)
        assert vals.shape == (2, 3, k) and idx.shape == (2, 3, k)
        lv, li = jax.lax.top_k(x, k)
        np.testing.assert_array_equal(np.asarray(idx), np.asarray(li))
        np.testing.assert_array_equal(np.asarray(vals.astype(jnp.float32)), np.asarray(lv.astype(jnp.float32)))


def test_supports_config_and_plans():
    bf = jax.ShapeDtypeStruct((8, 248320), jnp.bfloat16)
    assert tm.supports(bf, 64) and tm.supports(bf, 1)
    assert not tm.supports(bf, 65) and not tm.supports(bf, 0) and not tm.supports(bf, 2.0)
    assert not tm.supports(jax.ShapeDtypeStruct((8, 10), jnp.float32), 20)            # k > vocab
    assert not tm.supports(jax.ShapeDtypeStruct((8, 100), jnp.float16), 5)
    assert tm.supports(jax.ShapeDtypeStruct((2, 2**20), jnp.float32), 5)
    assert not tm.supports(jax.ShapeDtypeStruct((2, 2**20 + 1), jnp.float32), 5)        # 4097 blocks
    assert tm.supports(jax.ShapeDtypeStruct((2, 2**20 + 1), jnp.float32), 5, tm.MaximaConfig(group=32))
    with pytest.raises(ValueError, match="k=65"):
        tm.top_k(jnp.zeros((2, 100)), 65)
    for field, bad in [("chunk", 3), ("chunk", 128), ("group", 2), ("blocks_per_step", 0), ("num_warps", 32),
                       ("select_warps", 3), ("unroll", 0), ("steps", 0)]:
        with pytest.raises(ValueError, match=f"MaximaConfig.{field}"):
            tm.MaximaConfig(**{field: bad})
    plan = tm.MaximaConfig().resolve(1024, 248320, 64, jnp.bfloat16)
    assert (plan["num_blocks"], plan["blocks_pad"], plan["K"], plan["key16"]) == (970, 1024, 64, True)
    assert plan["steps"] * plan["step_blocks"] * plan["width"] == 32768 and plan["programs"] == 8
    small = tm.MaximaConfig().resolve(8, 248320, 20, jnp.float32)   # few rows: shorter programs
    assert small["programs"] * 8 >= 528 and not small["key16"] and small["K"] == 32
    tiny = tm.MaximaConfig().resolve(5, 40, 5, jnp.float32)
    assert (tiny["num_blocks"], tiny["step_blocks"], tiny["steps"], tiny["programs"]) == (1, 1, 1, 1)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("rows,vocab,k", [(1024, 248320, 64), (4096, 248320, 20), (3, 1000, 1), (5, 40, 5)])
def test_top_k_maxima_lowers_for_h200(rows, vocab, k, dtype):
    text = lower_for_h200(lambda x: tm.top_k(x, k, interpret=False, poison_outputs=True),
                          jax.ShapeDtypeStruct((rows, vocab), dtype))
    assert text.count("__gpu$xla.gpu.triton") == 2 and "stablehlo.sort" not in text


# ------------------------------------------------------------------------------ GPU


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows,vocab", [(256, 248320), (7, 248320), (33, 1000), (5, 40), (16, 131075)])
def test_top_k_maxima_gpu(rows, vocab, kind, dtype):
    rng = np.random.default_rng(rows * vocab)
    x = jnp.asarray(gen_rows(rng, kind, rows, vocab, 64, dtype), dtype)
    for k in (1, 20, 64) if vocab >= 64 else (1, 5, vocab):
        run_checked(x, k, interpret=False, against_lax=kind != "special")
    plan = tm.MaximaConfig().resolve(rows, vocab, 64 if vocab >= 64 else 5, dtype)
    cm, bm = jax.jit(lambda x: tm.chunk_maxima(x, plan, interpret=False, poison_outputs=True))(x)
    ref_cm, ref_bm = tm.chunk_maxima_reference(x, plan)
    np.testing.assert_array_equal(np.asarray(cm), np.asarray(ref_cm))
    np.testing.assert_array_equal(np.asarray(bm), np.asarray(ref_bm))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("rows,vocab,k,config", CASES, ids=CASE_IDS)
def test_top_k_maxima_configs_gpu(rows, vocab, k, config, dtype):
    rng = np.random.default_rng(vocab)
    for kind in ("gauss", "ties", "special"):
        run_checked(jnp.asarray(gen_rows(rng, kind, rows, vocab, k, dtype), dtype), k, config, interpret=False,
                    against_lax=kind != "special")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_top_k_maxima_tie_shapes_gpu(dtype):
    x = np.round(np.random.default_rng(3).standard_normal((64, 248320)) * 1.5).clip(-3, 3).astype(np.float32)
    run_checked(jnp.asarray(x, dtype), 64, interpret=False)
    run_checked(jnp.asarray(x * (1 + 2**-10), dtype), 64, interpret=False)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_top_k_maxima_dispatch_gpu(dtype):
    """impl='auto' takes this kernel (GPU-validated) at the Qwen vocabulary and matches lax.top_k."""
    assert tm.GPU_VALIDATED
    x = jnp.asarray(np.random.default_rng(23).standard_normal((64, 248320)) * 4, dtype)
    check_auto_dispatch(x, 64, "topk_chunk_maxima")
