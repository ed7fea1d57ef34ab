"""Mixture-of-experts targets (issue 35): logits against transformers on tiny random Qwen3-Next /
Qwen3.5-MoE checkpoints (tests/fixtures/make_moe_fixtures.py made them), both expert weight
layouts, the routed-expert op (ragged_dot path, dense reference, a float64 numpy oracle), router
ties, padding rows, verify / decode through the cache, lossless greedy through the engine, configs.
"""

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from float64 import float64_logits, relative_error
from oracle import f64, seed_of, sigmoid, silu
from safetensors.numpy import load_file, save_file
from stats import chi2_test

import jaxspec
from jaxspec import cache as cache_mod
from jaxspec import dflash
from jaxspec import target as tgt
from jaxspec.config import CacheConfig, DraftConfig, SpecConfig, TargetConfig
from jaxspec.engine import Engine
from jaxspec.fused import unfuse_params
from jaxspec.ops import moe
from jaxspec.weights import load_config, load_params, param_shapes, save_params

FIXTURES = Path(__file__).parent / "fixtures"
MODELS = {
    "qwen3_next": FIXTURES / "tiny-qwen3_next-moe",  # per-expert tensors, layers 1 and 5 MoE
    "qwen3_5_moe_text": FIXTURES / "tiny-qwen3_5_moe_text",  # per-expert tensors, every layer MoE
    "qwen3_5_moe": FIXTURES / "tiny-qwen3_5_moe",  # VLM wrapper, fused 3-D expert tensors
}


@pytest.fixture(scope="module")
def models():
    return {name: jaxspec.load_target(path) for name, path in MODELS.items()}


def assert_same(a, b):
    """Same tree, dtypes and bits."""
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree_util.tree_leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))


# ---------------------------------------------------------------------------- against transformers


@pytest.mark.parametrize("name,impl", [(name, "auto") for name in MODELS] + [("qwen3_next", "ref")], ids=lambda v: v)
def test_logits_match_transformers(models, name, impl):
    model = models[name]
    expected = np.load(MODELS[name] / "expected.npz")
    want = expected["logits"].reshape(-1, model.config.vocab_size)
    got = np.asarray(jaxspec.target_logits(model, expected["input_ids"].reshape(-1), impl=impl))
    assert got.shape == want.shape and got.dtype == np.float32
    err = np.abs(got - want).max() / np.abs(want).max()
    # measured 2026-12-05: 2.3e-6 (qwen3_next), 2.3e-6 (qwen3_5_moe_text), 1.4e-6 (qwen3_5_moe)
    assert err <= 1e-4, f"max|logits - transformers| / max|transformers| = {err:.3g}"


def test_logits_within_float32_rounding_of_float64(models):
    """The same jnp code run in float64 (tests/float64.py) on the mixed dense / MoE fixture: our
    float32 logits are 1.2e-6 of max|logit| from it, and it is 2.4e-6 from transformers' float32
    logits (measured 2026-12-05), so the 2.3e-6 against transformers is float32 rounding on both
    sides, not a difference of formulas. Tolerances ~4x."""
    model = models["qwen3_next"]
    expected = np.load(MODELS["qwen3_next"] / "expected.npz")
    ids = expected["input_ids"].reshape(-1)
    f64_logits = float64_logits(model, ids)
    assert relative_error(jaxspec.target_logits(model, ids), f64_logits).max() <= 5e-6
    want = expected["logits"].reshape(len(ids), -1)
    assert np.abs(f64_logits - want).max() <= 1e-5 * np.abs(want).max()


def test_fixture_configs_follow_transformers_layer_rule(models):
    nxt = models["qwen3_next"].config
    # decoder_sparse_step 2 -> layers 1, 3, 5; mlp_only_layers [3] -> 1 and 5
    assert nxt.moe_layers == (1, 5) and nxt.norm_topk_prob is False
    assert (nxt.num_experts, nxt.num_experts_per_tok, nxt.moe_intermediate_size) == (8, 3, 16)
    assert nxt.intermediate_size == 48 and nxt.shared_expert_intermediate_size == 24
    layers = models["qwen3_next"].params["layers"]
    assert ["moe" in layer for layer in layers] == [False, True, False, False, False, True]
    assert layers[1]["moe"]["gate_up"].shape == (8, 32, 32) and layers[1]["moe"]["down"].shape == (8, 16, 32)
    for name in ("qwen3_5_moe_text", "qwen3_5_moe"):
        c = models[name].config
        assert c.layout == name and c.moe_layers == (0, 1, 2, 3) and c.norm_topk_prob is True
        assert c.intermediate_size == 0 and (c.num_experts, c.num_experts_per_tok) == (6, 2)
    # the VLM checkpoint is the text one's weights under model.language_model. and fused
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in load_file(
        MODELS["qwen3_5_moe"] / "model.safetensors"
    )


# ---------------------------------------------------------------------------- weight layouts


def fuse_experts(tensors: dict, n_experts: int) -> dict:
    """Independent writer of the fused layout: per layer, gate_up_proj [E, 2Ie, d] = per expert
    [gate_proj; up_proj] stacked, down_proj [E, d, Ie] = down_proj stacked."""
    out = dict(tensors)
    for key in [k for k in tensors if k.endswith(".experts.0.gate_proj.weight")]:
        base = key[: -len("0.gate_proj.weight")]
        gate = [out.pop(f"{base}{e}.gate_proj.weight") for e in range(n_experts)]
        up = [out.pop(f"{base}{e}.up_proj.weight") for e in range(n_experts)]
        down = [out.pop(f"{base}{e}.down_proj.weight") for e in range(n_experts)]
        out[base + "gate_up_proj"] = np.concatenate([np.stack(gate), np.stack(up)], axis=1)
        out[base + "down_proj"] = np.stack(down)
    return out


@pytest.mark.parametrize("name", list(MODELS))
def test_expert_layouts_load_alike_and_round_trip(models, name, tmp_path):
    """The per-expert fixtures fused by an independent writer load to the same params (and the
    fused VLM fixture likewise per expert: save_params writes that layout by default); load ->
    save -> load is exact in both layouts, and the writer's fused tensors are the writer above's."""
    model, config = models[name], models[name].config
    params = unfuse_params(model.params, config)  # load_params' layout (load_target fuses projections)
    tensors = load_file(MODELS[name] / "model.safetensors")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text((MODELS[name] / "config.json").read_text())
    if name == "qwen3_5_moe":  # fused on disk: write it per expert with save_params
        save_params(tmp_path / "per", model.params, config)
        other = load_file(tmp_path / "per" / "model.safetensors")
        assert fuse_experts(other, config.num_experts).keys() == {k for k in tensors if "visual" not in k}
    else:
        other = fuse_experts(tensors, config.num_experts)
        assert not any(".experts.0." in k for k in other)
    save_file(other, tmp_path / "other" / "model.safetensors")
    assert_same(load_params(tmp_path / "other", config), params)
    for layout in ("per_expert", "fused"):
        save_params(tmp_path / layout, model.params, config, expert_layout=layout)
        assert load_config(tmp_path / layout) == config
        assert_same(load_params(tmp_path / layout, config), params)
    written = load_file(tmp_path / "fused" / "model.safetensors")
    per = load_file(tmp_path / "per_expert" / "model.safetensors")
    for key, x in fuse_experts(per, config.num_experts).items():
        np.testing.assert_array_equal(written[key], x, err_msg=key)


def test_missing_and_non_finite_expert_tensors_are_named(models, tmp_path):
    config = models["qwen3_next"].config
    tensors = load_file(MODELS["qwen3_next"] / "model.safetensors")
    (tmp_path / "cut").mkdir()
    name = "model.layers.5.mlp.experts.7.up_proj.weight"
    save_file({k: v for k, v in tensors.items() if k != name}, tmp_path / "cut" / "model.safetensors")
    with pytest.raises(KeyError, match=name.replace(".", r"\.")):
        load_params(tmp_path / "cut", config)
    (tmp_path / "nan").mkdir()
    bad = dict(tensors)
    bad[name] = bad[name].copy()
    bad[name][2, 3] = np.nan
    save_file(bad, tmp_path / "nan" / "model.safetensors")
    with pytest.raises(ValueError, match=rf"'{name.replace('.', '.')}' .* non-finite value \(nan at \[2, 3\]\)"):
        load_params(tmp_path / "nan", config)
    with pytest.raises(ValueError, match="expert_layout"):
        save_params(tmp_path / "x", models["qwen3_next"].params, config, expert_layout="stacked")


# ---------------------------------------------------------------------------- the op


def oracle_moe(x, router, gate_up, down, top_k, norm):
    """float64 numpy, one token at a time: softmax, the top k by (probability descending, expert id
    ascending), optional renormalisation, Σ w_e · down_eᵀ(silu(gate_e x) ⊙ up_e x)."""
    x, router, gate_up, down = map(f64, (x, router, gate_up, down))
    ie = down.shape[1]
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        logits = x[t] @ router
        p = np.exp(logits - logits.max())
        p /= p.sum()
        top = sorted(range(len(p)), key=lambda e: (-p[e], e))[:top_k]
        w = p[top] / (p[top].sum() if norm else 1.0)
        for e, we in zip(top, w):
            h = x[t] @ gate_up[e]
            out[t] += we * ((silu(h[:ie]) * h[ie:]) @ down[e])
    return out


def random_moe(rng, t, d, n_experts, ie, dtype=jnp.float32):
    x = rng.standard_normal((t, d))
    router = rng.standard_normal((d, n_experts)) * d**-0.5 * 3  # peaked softmax: routing varies
    gate_up = rng.standard_normal((n_experts, d, 2 * ie)) * d**-0.5
    down = rng.standard_normal((n_experts, ie, d)) * ie**-0.5
    return [jnp.asarray(a, dtype) for a in (x, router, gate_up, down)]


@pytest.mark.parametrize(
    "t,n_experts,top_k,norm",
    [(1, 8, 2, True), (7, 6, 3, False), (37, 12, 4, True), (50, 5, 5, True)],
    ids=["decode-1", "ragged-7", "prefill-37", "all-experts-50"],
)
def test_routed_experts_match_float64_oracle(t, n_experts, top_k, norm):
    """Fresh random inputs at non-power-of-two token counts: the ragged path, the dense reference
    and the float64 oracle agree; the two float32 paths agree with each other more tightly."""
    rng = np.random.default_rng(seed_of("moe-op", t, n_experts, top_k))
    x, router, gate_up, down = random_moe(rng, t, 24, n_experts, 12)
    weights, experts = jax.jit(moe.route, static_argnums=(2, 3))(x, router, top_k, norm)
    valid = jnp.ones(t, bool)
    ragged = np.asarray(jax.jit(moe.moe_ragged)(x, weights, experts, gate_up, down, valid))
    gathered = np.asarray(jax.jit(moe.moe_gathered)(x, weights, experts, gate_up, down, valid))
    ref = np.asarray(jax.jit(moe.moe_reference)(x, weights, experts, gate_up, down, valid))
    want = oracle_moe(x, router, gate_up, down, top_k, norm)
    scale = np.abs(want).max()
    # measured 2026-12-05 (this CPU): both float32 paths within 2.5e-7 of the float64 oracle and of
    # each other, relative to max|oracle| (float32 rounding of ~30-term dot products); tolerance
    # 4x that. A wrong expert, weight or renormalisation is an O(1) error.
    assert np.abs(ragged - want).max() <= 1e-6 * scale
    assert np.abs(gathered - want).max() <= 1e-6 * scale
    assert np.abs(ref - want).max() <= 1e-6 * scale
    assert np.abs(ragged - ref).max() <= 1e-6 * scale
    assert np.abs(gathered - ref).max() <= 1e-6 * scale


def test_bf16_paths_agree():
    """bfloat16 weights and activations: both paths round at the same places (expert outputs in
    bf16, combined in float32), so they differ only by accumulation order."""
    rng = np.random.default_rng(seed_of("moe-bf16"))
    x, router, gate_up, down = random_moe(rng, 19, 32, 8, 16, jnp.bfloat16)
    weights, experts = moe.route(x, router, 2, True)
    assert weights.dtype == jnp.bfloat16
    valid = jnp.ones(19, bool)
    ragged = np.asarray(moe.moe_ragged(x, weights, experts, gate_up, down, valid), np.float32)
    gathered = np.asarray(moe.moe_gathered(x, weights, experts, gate_up, down, valid), np.float32)
    ref = np.asarray(moe.moe_reference(x, weights, experts, gate_up, down, valid), np.float32)
    want = oracle_moe(x, router, gate_up, down, 2, True)
    # measured 2026-12-05: paths 4.8e-3 apart, 3.6e-3 (ragged) and 8.1e-3 (reference) from float64,
    # of max|oracle| (bf16 keeps 8 bits); tolerances ~5x
    assert np.abs(ragged - ref).max() <= 2.5e-2 * np.abs(want).max()
    assert np.abs(gathered - ref).max() <= 2.5e-2 * np.abs(want).max()
    assert np.abs(ragged - want).max() <= 4e-2 * np.abs(want).max()
    assert np.abs(gathered - want).max() <= 4e-2 * np.abs(want).max()


def test_invalid_rows_route_nowhere_and_non_finite_rows_stay_put():
    """Padding rows (valid False) get exactly 0 from the routed experts in both paths, whatever
    they hold (NaN included); a NaN in a valid row stays in that row."""
    rng = np.random.default_rng(seed_of("moe-nan"))
    x, router, gate_up, down = random_moe(rng, 11, 16, 6, 8)
    valid = jnp.asarray(np.arange(11) % 3 != 1)
    x = x.at[1].set(jnp.nan).at[4].set(jnp.inf)  # invalid rows
    x = x.at[6].set(jnp.nan)  # a valid row
    weights, experts = moe.route(x, router, 2, True)
    clean_x = x.at[1].set(0.0).at[4].set(0.0).at[6].set(0.0)
    clean_w, clean_e = moe.route(clean_x, router, 2, True)
    for fn in (moe.moe_ragged, moe.moe_gathered, moe.moe_reference):
        out = np.asarray(fn(x, weights, experts, gate_up, down, valid))
        clean = np.asarray(fn(clean_x, clean_w, clean_e, gate_up, down, valid))
        assert np.all(out[~np.asarray(valid)] == 0.0), fn.__name__
        assert np.all(np.isnan(out[6])), fn.__name__
        others = [i for i in range(11) if i != 6]
        np.testing.assert_array_equal(out[others], clean[others], err_msg=fn.__name__)


def test_router_ties_match_torch_topk():
    """Rows whose router probabilities tie across the top-k boundary (10 experts tie for the top 8 of
    512): transformers' Qwen3_5MoeSparseMoeBlock (torch.topk on the CPU) took the lowest tied expert
    ids, as jax.lax.top_k does, and the block outputs agree.

    torch.topk has no documented tie rule; measured on the CPU (torch 2.13) with k + 2 experts
    tied at the top, it takes the k lowest ids every time for (E, k) = (512, 2..8), (256, 2..3) and
    k = 1 from 64 experts up, but an unordered mix for smaller E or larger k (e.g. (8, 2),
    (256, 8), (512, 10)): no fixed rule reproduces it there. jaxspec's rule is the lower id first."""
    f = np.load(FIXTURES / "moe-router-ties.npz")
    p = {
        "router": f["router"].T,
        "gate_up": f["gate_up"].transpose(0, 2, 1),
        "down": f["down"].transpose(0, 2, 1),
        "shared": {"gate": f["shared_gate"].T, "up": f["shared_up"].T, "down": f["shared_down"].T},
        "shared_gate": f["shared_expert_gate"].T,
    }
    p = jax.tree_util.tree_map(jnp.asarray, p)
    x = jnp.asarray(f["x"])
    _, experts = moe.route(x, p["router"], 8, True)
    experts = np.asarray(experts)
    for i, group in enumerate(f["tie_groups"]):
        assert sorted(experts[i]) == sorted(group)[:8] == sorted(f["chosen"][i]), f"tie row {i}"
    for i in range(8, 16):
        assert sorted(experts[i]) == sorted(f["chosen"][i]), f"row {i}"
    valid = jnp.ones(16, bool)
    for impl in ("auto", "ref"):
        out = np.asarray(moe.sparse_moe_block(p, x, valid, top_k=8, norm_topk_prob=True, impl=impl))
        # measured 3e-7 of max|out| (float32 sums in another order)
        assert np.abs(out - f["out"]).max() <= 1e-5 * np.abs(f["out"]).max(), impl


def test_sparse_block_matches_float64_oracle():
    """The whole block, shared expert and its sigmoid gate included, against float64 numpy."""
    rng = np.random.default_rng(seed_of("moe-block"))
    d, n_experts, ie, i_s = 16, 6, 8, 12
    x, router, gate_up, down = random_moe(rng, 9, d, n_experts, ie)
    shared = {
        k: jnp.asarray(rng.standard_normal(s) * s[0] ** -0.5, jnp.float32)
        for k, s in (("gate", (d, i_s)), ("up", (d, i_s)), ("down", (i_s, d)))
    }
    shared_gate = jnp.asarray(rng.standard_normal((d, 1)), jnp.float32)
    p = {"router": router, "gate_up": gate_up, "down": down, "shared": shared, "shared_gate": shared_gate}
    out = np.asarray(moe.sparse_moe_block(p, x[None], jnp.ones((1, 9), bool), top_k=3, norm_topk_prob=True))[0]
    xs = f64(x)
    s = (silu(xs @ f64(shared["gate"])) * (xs @ f64(shared["up"]))) @ f64(shared["down"])
    want = oracle_moe(x, router, gate_up, down, 3, True) + sigmoid(xs @ f64(shared_gate)) * s
    assert np.abs(out - want).max() <= 1e-6 * np.abs(want).max()  # measured 2e-7


# ---------------------------------------------------------------------------- through the cache


def test_verify_windows_and_decode_match_whole_prefill(models):
    """Packed ragged windows (a padding request on slot 0, padding rows), then decode-like windows
    of 1, on the mixed dense / MoE Qwen3-Next target give the logits of a cache-free forward over
    the whole sequence (one batched prefill of prompt + both windows)."""
    model = models["qwen3_next"]
    rng = np.random.default_rng(4)
    vocab = model.config.vocab_size
    prompts = [rng.integers(0, vocab, n) for n in (19, 6, 27)]
    steps = ([4, 1, 5], [1, 1, 1])
    windows = [[rng.integers(0, vocab, n) for n in lengths] for lengths in steps]
    state = cache_mod.init_cache(model.config, CacheConfig(num_slots=3, max_len=64, window=5))
    whole = [np.concatenate([p] + [w[i] for w in windows]) for i, p in enumerate(prompts)]
    tokens = np.zeros((3, 33), np.int32)
    for i, s in enumerate(whole):
        tokens[i, : len(s)] = s
    want, *_ = jax.jit(tgt.prefill_layers, static_argnums=(3, 4))(
        model, jnp.asarray(tokens), jnp.array([len(s) for s in whole], jnp.int32), (), "auto"
    )
    lengths = jnp.array([len(s) for s in prompts], jnp.int32)
    prefill = jax.jit(tgt.prefill, static_argnames=("taps", "impl"))
    _, _, state = prefill(model, state, jnp.asarray(tokens[:, :27]), lengths, jnp.array([2, 3, 1], jnp.int32))
    verify, commit = jax.jit(tgt.verify, static_argnames=("taps", "impl")), jax.jit(tgt.commit)
    pos = [len(s) for s in prompts]
    for step, window in enumerate(windows):
        lengths = steps[step]
        qsl = np.concatenate([[0], np.cumsum(lengths), [sum(lengths)]]).astype(np.int32)
        flat = np.zeros(13, np.int32)
        flat[: qsl[3]] = np.concatenate(window)
        slots = jnp.array([2, 3, 1, 0], jnp.int32)  # the last request is padding
        logits, _, state = verify(model, state, jnp.asarray(flat), jnp.asarray(qsl), slots)
        assert np.all(np.isfinite(np.asarray(logits)))
        for i, n in enumerate(lengths):
            ref = np.asarray(want[i, pos[i] : pos[i] + n])
            err = np.abs(np.asarray(logits[qsl[i] : qsl[i + 1]]) - ref).max() / np.abs(ref).max()
            assert err <= 5e-6, f"step {step} request {i}: {err:.3g}"  # measured 2026-12-05: <= 1.4e-6
            pos[i] += n
        state = commit(state, slots, jnp.array([n - 1 for n in lengths] + [0], jnp.int32))


def test_init_target_builds_moe_targets():
    """Random MoE targets for benchmarks: init_target follows param_shapes, routes and is finite."""
    config = TargetConfig.from_hf(json.loads((MODELS["qwen3_5_moe"] / "config.json").read_text()))
    config = dataclasses.replace(config, num_hidden_layers=2, layer_types=config.layer_types[2:], moe_layers=(0, 1))
    model = tgt.init_target(config, jax.random.PRNGKey(0))
    shapes = jax.tree_util.tree_map(lambda x: tuple(x.shape), model.params)
    assert shapes == param_shapes(config)
    layer = model.params["layers"][0]["moe"]
    assert float(jnp.std(layer["gate_up"])) == pytest.approx(config.hidden_size**-0.5, rel=0.1)  # N(0, 1/fan_in)
    x = jax.random.normal(jax.random.PRNGKey(1), (13, config.hidden_size))
    _, experts = moe.route(x, layer["router"], config.num_experts_per_tok, True)
    assert len(np.unique(np.asarray(experts))) > config.num_experts_per_tok  # tokens route differently
    out = moe.sparse_moe_block(layer, x, jnp.ones(13, bool), top_k=config.num_experts_per_tok, norm_topk_prob=True)
    assert np.all(np.isfinite(np.asarray(out)))


# ---------------------------------------------------------------------------- the engine


def test_static_greedy_is_lossless_with_moe_target(models):
    """Speculative greedy decoding with a random draft (static blocks of 4, a queue: 3 requests on 2
    slots) emits exactly the target-only tokens (mode none) on the all-MoE Qwen3.5-MoE target."""
    model = models["qwen3_5_moe_text"]
    c = model.config
    draft = dflash.init_draft(
        DraftConfig(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            vocab_size=c.vocab_size,
            block_size=4,
            target_layer_ids=(1, 3),
            mask_token_id=c.vocab_size - 1,
            target_hidden_size=c.hidden_size,
        ),
        jax.random.PRNGKey(0),
    )
    rng = np.random.default_rng(8)
    prompts = [list(rng.integers(0, c.vocab_size - 1, n)) for n in (5, 7, 6)]  # one length bucket
    none = Engine(model, None, SpecConfig(verify_mode="none", num_slots=2, max_len=48, prefill_rows=1))
    want = [r.tokens for r in none.generate(prompts, max_new_tokens=16)]
    spec = Engine(model, draft, SpecConfig(verify_mode="static", num_slots=2, max_len=48, prefill_rows=1))
    got = spec.generate(prompts, max_new_tokens=16)
    assert [r.error for r in got] == [None] * 3
    assert [r.tokens for r in got] == want


@pytest.mark.slow
def test_speculative_sampling_with_moe_target_is_lossless():
    """The first three tokens of static-mode speculative sampling (random draft, temperature 1)
    follow the MoE target's own distribution: chi-square of 10,240 seeded requests against the
    joint of (t1, t2, t3) enumerated with cache-free forwards (as tests/test_engine_sampling.py,
    vocabulary 16, a random all-MoE Qwen3.5-MoE target of 6 experts, top 2)."""
    vocab, slots, rounds, prompt = 16, 512, 20, [3, 1, 4, 1]
    config = TargetConfig(
        layout="qwen3_5_moe_text",
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=0,
        num_hidden_layers=4,
        layer_types=("linear_attention",) * 3 + ("full_attention",),
        rms_norm_eps=1e-6,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        rope_theta=1e4,
        partial_rotary_factor=0.25,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        tie_word_embeddings=False,
        max_position_embeddings=64,
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        moe_layers=(0, 1, 2, 3),
    )
    target = tgt.init_target(config, jax.random.PRNGKey(11))
    target = target.replace(params={**target.params, "lm_head": target.params["lm_head"] * 4.0})
    draft = dflash.init_draft(
        DraftConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            vocab_size=vocab,
            block_size=4,
            target_layer_ids=(1, 3),
            mask_token_id=vocab - 1,
            target_hidden_size=32,
        ),
        jax.random.PRNGKey(12),
    )
    forward = jax.jit(
        lambda seqs: tgt.prefill_layers(target, seqs, jnp.full(seqs.shape[:1], seqs.shape[1], jnp.int32), (), "ref")[0][
            :, -1
        ]
    )

    def next_probs(prefixes):
        logits = forward(jnp.asarray([prompt + list(p) for p in prefixes], jnp.int32))
        return np.asarray(jax.nn.softmax(logits, axis=-1), np.float64)

    p1 = next_probs([()])[0]
    p2 = next_probs([(a,) for a in range(vocab)])
    p3 = next_probs([(a, b) for a in range(vocab) for b in range(vocab)]).reshape(vocab, vocab, vocab)
    joint = p1[:, None, None] * p2[:, :, None] * p3
    engine = Engine(target, draft, SpecConfig(verify_mode="static", num_slots=slots, max_len=16, max_top_k=vocab))
    counts = np.zeros((vocab,) * 3)
    for r in range(rounds):
        results = engine.generate(
            [prompt] * slots, max_new_tokens=3, temperature=1.0, seed=list(range(r * slots, (r + 1) * slots))
        )
        np.add.at(counts, tuple(np.array([x.tokens for x in results]).T), 1)
    pvalues = {
        "joint12": chi2_test(counts.sum(2), joint.sum(2))[2],
        "t2": chi2_test(counts.sum((0, 2)), joint.sum((0, 2)))[2],
        "t3": chi2_test(counts.sum((0, 1)), joint.sum((0, 1)))[2],
    }
    assert min(pvalues.values()) > 1e-3, pvalues


# ---------------------------------------------------------------------------- configs


def next_moe(**extra):
    d = json.loads((MODELS["qwen3_next"] / "config.json").read_text())
    return {**d, **extra}


@pytest.mark.parametrize(
    "extra,moe_layers",
    [
        ({}, (1, 5)),
        ({"decoder_sparse_step": 1, "mlp_only_layers": []}, (0, 1, 2, 3, 4, 5)),
        ({"decoder_sparse_step": 3, "mlp_only_layers": [5]}, (2,)),
        ({"num_experts": 0}, ()),
    ],
)
def test_qwen3_next_layer_rule(extra, moe_layers):
    c = TargetConfig.from_hf(next_moe(**extra))
    assert c.moe_layers == moe_layers
    assert (c.num_experts == 0) == (not moe_layers)
    assert TargetConfig.from_hf(json.loads(json.dumps(c.to_hf()))) == c


def test_moe_layouts_parse_and_round_trip(models):
    text = json.loads((MODELS["qwen3_5_moe_text"] / "config.json").read_text())
    vlm = json.loads((MODELS["qwen3_5_moe"] / "config.json").read_text())
    assert TargetConfig.from_hf(text) == dataclasses.replace(models["qwen3_5_moe"].config, layout="qwen3_5_moe_text")
    for name in MODELS:
        c = models[name].config
        assert TargetConfig.from_hf(json.loads(json.dumps(c.to_hf()))) == c
    # Qwen3.5-MoE always renormalises; absent expert fields take transformers' defaults
    assert TargetConfig.from_hf({**text, "norm_topk_prob": False}).norm_topk_prob is True
    bare = {k: v for k, v in text.items() if k not in ("num_experts", "num_experts_per_tok", "moe_intermediate_size")}
    c = TargetConfig.from_hf(bare)
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (256, 8, 512)
    # a Qwen3-Next config without num_experts is MoE, as transformers builds it (512 experts)
    c = TargetConfig.from_hf({k: v for k, v in next_moe().items() if k != "num_experts"})
    assert c.num_experts == 512 and c.moe_layers == (1, 5)
    with pytest.raises(ValueError, match="text_config.model_type='qwen3_5_text'"):
        TargetConfig.from_hf({**vlm, "text_config": {**vlm["text_config"], "model_type": "qwen3_5_text"}})


@pytest.mark.parametrize(
    "change,field",
    [
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),  # top-k > experts (8)
        ({"num_experts_per_tok": 0}, "num_experts_per_tok"),
        ({"num_experts": -1}, "num_experts"),
        ({"moe_intermediate_size": 0}, "moe_intermediate_size"),
        ({"shared_expert_intermediate_size": 2.5}, "shared_expert_intermediate_size"),
        ({"norm_topk_prob": 1}, "norm_topk_prob"),
        ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
        ({"mlp_only_layers": "3"}, "mlp_only_layers"),
        ({"intermediate_size": 0}, "intermediate_size"),  # layers 0, 2, 3, 4 are dense
    ],
)
def test_bad_moe_configs_name_the_field(change, field):
    with pytest.raises(ValueError, match=rf"\b{field}="):
        TargetConfig.from_hf(next_moe(**change))


@pytest.mark.parametrize(
    "change,field",
    [
        ({"moe_layers": (1, 1)}, "moe_layers"),
        ({"moe_layers": (6,)}, "moe_layers"),
        ({"layout": "qwen3_5_text"}, "moe_layers"),  # a dense layout with experts
        ({"layout": "qwen3_5_moe"}, "moe_layers"),  # every Qwen3.5-MoE layer is sparse
        ({"moe_layers": ()}, "num_experts"),  # sizes without MoE layers
    ],
)
def test_bad_moe_fields_name_the_field(models, change, field):
    with pytest.raises(ValueError, match=rf"TargetConfig\.{field}="):
        dataclasses.replace(models["qwen3_next"].config, **change)


@pytest.mark.parametrize("t,n_experts,top_k", [(1, 9, 3), (2, 9, 3), (30, 9, 3)], ids=["few", "many", "too-many"])
def test_auto_path_by_pair_count(t, n_experts, top_k):
    """impl "auto" on a GPU takes the grouped kernel at every size; elsewhere the jnp gathered form
    iff 3·T·k <= E (it reads fewer weight bytes), else ragged_dot; bit for bit."""
    rng = np.random.default_rng(seed_of("moe-auto", t))
    x, router, gate_up, down = random_moe(rng, t, 16, n_experts, 8)
    weights, experts = moe.route(x, router, top_k, True)
    valid = jnp.ones(t, bool)
    got = np.asarray(moe.moe_experts(x, weights, experts, gate_up, down, valid, impl="auto"))
    pairs = t * top_k
    if jax.default_backend() == "gpu":
        want = moe.moe_gathered(x, weights, experts, gate_up, down, valid, kernel=True)
    elif 3 * pairs <= n_experts:
        want = moe.moe_gathered(x, weights, experts, gate_up, down, valid)
    else:
        want = moe.moe_ragged(x, weights, experts, gate_up, down, valid)
    np.testing.assert_array_equal(got, np.asarray(want))
