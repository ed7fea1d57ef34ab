"""The grouped expert products (jaxspec/pallas/expert_matmul.py) against their jnp reference and a
float64 numpy oracle: interpret mode on the CPU, the real kernel on a GPU (same tests), and the
H200 Triton lowering of the MoE benchmark shapes on the CPU. Through `ops.moe`, the routed experts
with impl="pallas" against the jnp gathered form and the dense reference.
"""

import jax
import jax.numpy as jnp
import numpy as np
import oracle
import pytest
from gpu_lowering import lower_for_h200

from jaxspec.ops import moe
from jaxspec.pallas import expert_matmul as em

ON_GPU = jax.default_backend() == "gpu"


def oracle_products(x, ids, live, w, rows_div):
    """float64: out[p] = x[p // rows_div] @ w[ids[p]] for live pairs, 0 for dead ones."""
    x, w = oracle.f64(x), oracle.f64(w)
    out = np.zeros((len(ids), w.shape[2]))
    for p, (e, keep) in enumerate(zip(np.asarray(ids), np.asarray(live))):
        if keep:
            out[p] = x[p // rows_div] @ w[e]
    return out


def make_case(rng, pairs, rows_div, k, n, n_experts, dtype, dead=()):
    rows = -(-pairs // rows_div)
    x = jnp.asarray(rng.standard_normal((rows, k)), dtype)
    w = jnp.asarray(rng.standard_normal((n_experts, k, n)) * k**-0.5, dtype)
    ids = jnp.asarray(rng.integers(0, n_experts, pairs), jnp.int32)
    live = np.ones(pairs, bool)
    live[list(dead)] = False
    return x, ids, jnp.asarray(live), w


# (pairs, rows_div, K, N, experts, dead pairs): odd K and N overhang every tile; rows_div 3 is a
# top-3 gate_up product, 1 a down product; repeated experts (pairs > experts) read one expert twice
CASES = {
    "decode-top3": (6, 3, 40, 24, 5, ()),
    "odd-k-n": (7, 1, 37, 300, 9, (2,)),
    "shared-experts": (12, 4, 64, 48, 3, (0, 11)),
    "one-pair": (1, 1, 8, 16, 2, ()),
}


SMALL = em.ExpertMatmulConfig(block_n=16, inner_k=16, direct_pairs=0)  # several n tiles and k splits at these sizes
FORMS = {"direct": em.ExpertMatmulConfig(block_n=16, inner_k=16, direct_pairs=128), "sorted": SMALL}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("form", list(FORMS))
def test_kernel_matches_reference_and_oracle(form, case, dtype):
    pairs, rows_div, k, n, n_experts, dead = CASES[case]
    rng = np.random.default_rng(oracle.seed_of("expert-products", case, str(jnp.dtype(dtype))))
    x, ids, live, w = make_case(rng, pairs, rows_div, k, n, n_experts, dtype, dead)
    out = jax.jit(lambda *a: em.expert_matmul(*a, rows_div=rows_div, config=FORMS[form]))(x, ids, live, w)
    assert out.shape == (pairs, n) and out.dtype == jnp.float32
    got = np.asarray(out)
    ref = np.asarray(jax.jit(lambda *a: em.expert_matmul_reference(*a, rows_div=rows_div))(x, ids, live, w))
    want = oracle_products(x, ids, live, w, rows_div)
    # float32 sums of exact products (bf16 x bf16 is exact in float32): the kernel, the reference
    # and the oracle differ by summation order only, ~1e-7 of max|oracle| at these K
    oracle.assert_close(got, want, 2e-6, "kernel vs float64")
    oracle.assert_close(ref, want, 2e-6, "reference vs float64")
    assert np.all(got[~np.asarray(live)] == 0.0), "dead pairs must be exact zeros"


@pytest.mark.parametrize("form", list(FORMS))
def test_dead_pairs_read_nothing(form):
    """A dead pair's expert id may be anything, its row NaN: its output is 0 and no other pair moves."""
    rng = np.random.default_rng(oracle.seed_of("expert-dead"))
    x, ids, live, w = make_case(rng, 5, 1, 24, 40, 4, jnp.float32, dead=(1, 3))
    x = x.at[1].set(jnp.nan).at[3].set(jnp.inf)
    bad_ids = ids.at[1].set(10**6).at[3].set(-7)  # out of range: must never be dereferenced
    clean = np.asarray(em.expert_matmul(x, ids, live, w, config=FORMS[form]))
    got = np.asarray(em.expert_matmul(x, bad_ids, live, w, config=FORMS[form]))
    np.testing.assert_array_equal(got, clean)
    assert np.all(got[[1, 3]] == 0.0) and np.all(np.isfinite(got))


def test_groups_list_each_hit_expert_once():
    """expert_groups: live pairs sorted by expert, one group per distinct expert (start, count),
    unused groups marked E; dead pairs in no group, also when every expert is hit (G = E)."""
    ids = jnp.asarray([2, 0, 2, 1, 0, 2, 1], jnp.int32)
    live = jnp.asarray([True, True, True, False, True, True, True])
    order, gexp, gstart, gcount = (np.asarray(a) for a in em.expert_groups(ids, live, 3))
    assert list(gexp) == [0, 1, 2] and list(gcount) == [2, 1, 3] and list(gstart) == [0, 2, 3]
    assert sorted(order[:6]) == [0, 1, 2, 4, 5, 6] and order[6] == 3
    assert list(np.asarray(ids)[order[:6]]) == [0, 0, 1, 2, 2, 2]
    order, gexp, gstart, gcount = (np.asarray(a) for a in em.expert_groups(ids[:3], live[:3], 8))
    assert list(gexp) == [0, 2, 8] and list(gcount) == [1, 2, 0]  # G = P = 3 groups, one unused


def test_split_length_depends_on_the_matrix_only():
    """block_k comes from (K, N) alone: a token's sums are grouped the same way at every batch,
    and an expert spans PROGRAMS_PER_GROUP programs at the MoE shapes (8 experts fill the GPU)."""
    cfg = em.ExpertMatmulConfig()
    assert cfg.resolve(2048, 1024) == (128, 512, 64)  # gate_up of 35B-A3B / 80B-A3B: 8 x 4 programs
    assert cfg.resolve(512, 2048) == (128, 256, 64)  # down: 16 x 2 programs
    assert cfg.resolve(40, 24) == (32, 64, 64)
    assert cfg.resolve(8, 8) == (16, 16, 16)  # MMA operands are at least 16 x 16
    assert em.ExpertMatmulConfig(block_k=128).resolve(2048, 1024) == (128, 128, 64)
    assert cfg.resolve(2048, 1024, 1024) == (128, 512, 64)  # a verify window of 128 tokens x top-8
    assert cfg.resolve(2048, 1024, 1025) == (128, 2048, 64)  # beyond split_pairs: one split
    assert cfg.resolve(40, 24, 1025) == (32, 64, 64)


def test_unsplit_reduction_above_split_pairs():
    """Past split_pairs the kernel runs one split over all of K with wide_block_m rows a pass (a
    prefill-sized call). 80 pairs over 2 experts: groups of 33 rows or more, so both row widths (16 and
    32) take several passes over a group."""
    rng = np.random.default_rng(oracle.seed_of("expert-unsplit"))
    x, ids, live, w = make_case(rng, 80, 4, 72, 40, 2, jnp.float32, dead=(3, 17))
    assert min(np.bincount(np.asarray(ids)[np.asarray(live)])) > 32
    want = oracle_products(x, ids, live, w, 4)
    for split_pairs in (1024, 8):
        config = em.ExpertMatmulConfig(block_n=16, inner_k=16, split_pairs=split_pairs, wide_block_m=32)
        got = np.asarray(em.expert_matmul(x, ids, live, w, rows_div=4, config=config))
        oracle.assert_close(got, want, 2e-6, f"split_pairs {split_pairs}")


def test_config_validation():
    for field, bad in [
        ("block_n", 100),
        ("block_n", 8),
        ("inner_k", 3),
        ("inner_k", 8),  # below the MMA's 16
        ("block_m", 8),
        ("num_warps", 3),
        ("block_k", 48),
        ("direct_pairs", -1),
        ("direct_pairs", 256),
        ("split_pairs", -1),
        ("wide_block_m", 24),
    ]:
        with pytest.raises(ValueError, match=field):
            em.ExpertMatmulConfig(**{field: bad})
    with pytest.raises(ValueError, match="block_k"):
        em.ExpertMatmulConfig(block_k=16, inner_k=32)
    with pytest.raises(ValueError, match="num_stages"):
        em.ExpertMatmulConfig(num_stages=0)


def test_supports():
    S = jax.ShapeDtypeStruct
    x, ids, live, w = S((2, 64), jnp.bfloat16), S((8,), jnp.int32), S((8,), bool), S((16, 64, 32), jnp.bfloat16)
    assert em.supports(x, ids, live, w, 4)
    assert not em.supports(x, ids, live, w, 3)  # 8 pairs need 3 rows at 3 pairs a row
    assert not em.supports(x, ids, live, S((16, 64, 32), jnp.float32))  # mixed dtypes
    assert not em.supports(S((2, 64), jnp.float16), ids, live, S((16, 64, 32), jnp.float16), 4)
    assert not em.supports(x, ids, S((7,), bool), w, 4)
    assert not em.supports(x, ids, live, S((16, 63, 32), jnp.bfloat16), 4)
    with pytest.raises(ValueError, match="expert_matmul"):
        em.expert_matmul(jnp.zeros((2, 64)), jnp.zeros(8, jnp.int32), jnp.ones(8, bool), jnp.zeros((4, 32, 8)))


@pytest.mark.parametrize(
    "name,pairs,rows_div,k,n,n_experts,dtype,kernel",
    [
        ("35b-a3b-gate-up", 64, 8, 2048, 1024, 256, jnp.bfloat16, "expert_matmul_direct"),
        ("35b-a3b-down", 64, 1, 512, 2048, 256, jnp.bfloat16, "expert_matmul_direct"),
        ("80b-a3b-gate-up", 10, 10, 2048, 1024, 512, jnp.bfloat16, "expert_matmul_direct"),
        ("35b-a3b-verify-b8", 512, 8, 2048, 1024, 256, jnp.bfloat16, "expert_matmul"),
        ("f32-verify", 640, 10, 2048, 1024, 512, jnp.float32, "expert_matmul"),
        ("f32-decode", 80, 10, 2048, 1024, 512, jnp.float32, "expert_matmul_direct"),
        ("35b-a3b-prefill-512", 4096, 8, 2048, 1024, 256, jnp.bfloat16, "expert_matmul"),  # unsplit, wide rows
    ],
)
def test_lowers_for_h200(name, pairs, rows_div, k, n, n_experts, dtype, kernel):
    """The Triton lowering of the benchmark shapes (decode at batch 8 x top-8 and batch 1 x top-10:
    the direct form; verify windows of 64 tokens: the sorted form; a 512-token prefill: one split,
    wide_block_m rows a pass), on the CPU."""
    S = jax.ShapeDtypeStruct
    args = (
        S((-(-pairs // rows_div), k), dtype),
        S((pairs,), jnp.int32),
        S((pairs,), bool),
        S((n_experts, k, n), dtype),
    )
    config = em.ExpertMatmulConfig(direct_pairs=128)
    text = lower_for_h200(lambda *a: em.expert_matmul(*a, rows_div=rows_div, config=config, interpret=False), *args)
    direct = "expert_matmul_direct" in text
    assert "expert_matmul" in text and direct == (kernel == "expert_matmul_direct"), name


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_routed_experts_through_the_kernel(dtype):
    """ops.moe.moe_experts with impl="pallas" (a decode-sized call: T·k <= 8·E) runs the kernel and
    agrees with the jnp gathered form and the dense reference; padding rows get exactly 0."""
    rng = np.random.default_rng(oracle.seed_of("moe-kernel", str(jnp.dtype(dtype))))
    t, d, n_experts, ie, top_k = 3, 40, 20, 12, 2
    x = jnp.asarray(rng.standard_normal((t, d)), dtype)
    router = jnp.asarray(rng.standard_normal((d, n_experts)) * d**-0.5 * 3, dtype)
    gate_up = jnp.asarray(rng.standard_normal((n_experts, d, 2 * ie)) * d**-0.5, dtype)
    down = jnp.asarray(rng.standard_normal((n_experts, ie, d)) * ie**-0.5, dtype)
    valid = jnp.asarray([True, False, True])
    weights, experts = moe.route(x, router, top_k, True)
    kernel = np.asarray(moe.moe_experts(x, weights, experts, gate_up, down, valid, impl="pallas"), np.float32)
    direct = moe.moe_gathered(x, weights, experts, gate_up, down, valid, kernel=True)
    np.testing.assert_array_equal(kernel, np.asarray(direct, np.float32), "impl='pallas' runs the kernel")
    gathered = np.asarray(moe.moe_gathered(x, weights, experts, gate_up, down, valid), np.float32)
    ref = np.asarray(moe.moe_experts(x, weights, experts, gate_up, down, valid, impl="ref"), np.float32)
    assert np.all(kernel[1] == 0.0)
    # float32: summation order only (~1e-7); bf16: each product rounded to bf16 (8 bits) after
    # differently ordered float32 sums, so one rounding step apart at most (~4e-3 of max)
    tol = 1e-6 if dtype == jnp.float32 else 1.6e-2
    oracle.assert_close(kernel, gathered, tol, "kernel vs jnp gathered")
    oracle.assert_close(kernel, ref, tol, "kernel vs dense reference")
