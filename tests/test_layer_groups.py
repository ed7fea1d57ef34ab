"""Layer groups: a target whose layers are stacked by position and run as one lax.scan over the
groups gives what the per-layer list (a Python loop over the same group code) gives: prefill,
chained verify + commit with the references and with every kernel (interpret mode), and greedy
decoding through the engine."""

import dataclasses
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from proposers import random_draft

from jaxspec import cache as cache_mod
from jaxspec import target as tgt
from jaxspec.bench import shapes
from jaxspec.config import CacheConfig, SpecConfig
from jaxspec.engine import Engine
from jaxspec.ops.linear import head_logits
from jaxspec.ops.norms import rms_norm
from jaxspec.weights import load_config

FIXTURES = Path(__file__).parent / "fixtures"
# two groups of (GDN, GDN, GDN, attention) at toy size
CONFIG = shapes.target_config(dict(shapes.SMOKE_TARGET, interval=4), 8)
TAPS = (1, 4, 6)  # group 0 position 1, group 1 positions 0 and 2


@pytest.fixture(scope="module")
def models():
    listed = tgt.init_target(CONFIG, jax.random.PRNGKey(3))
    return {"list": listed, "stacked": tgt.stack_layers(listed)}


@pytest.mark.parametrize(
    "layer_types,period",
    [("lllf" * 3, 4), ("lf" * 3, 2), ("l" * 5, 1), ("llfl", 4), ("llfllllf", 8)],
    ids=["3gdn-1attn-x3", "alternating", "all-gdn", "irregular", "halves-differ"],
)
def test_layer_period(layer_types, period):
    kinds = {"l": "linear_attention", "f": "full_attention"}
    config = dataclasses.replace(
        CONFIG, num_hidden_layers=len(layer_types), layer_types=tuple(kinds[c] for c in layer_types)
    )
    assert tgt.layer_period(config) == period


def test_layer_period_counts_mixture_of_experts_layers():
    """qwen3_next fixture: types repeat every 3 layers but its MoE layers (1, 5) do not."""
    config = load_config(FIXTURES / "tiny-qwen3_next-moe")
    assert config.layer_types[:3] * 2 == config.layer_types and config.moe_layers == (1, 5)
    assert tgt.layer_period(config) == 6


def test_stacking_keeps_every_weight(models):
    listed, stacked = models["list"], models["stacked"]
    assert "layers" not in stacked.params and len(stacked.params["layer_groups"]) == 4
    assert stacked.params["layer_groups"][3]["attn"]["q"].shape == (2,) + listed.params["layers"][3]["attn"]["q"].shape
    for a, b in zip(jax.tree.leaves(listed.params), jax.tree.leaves(tgt.unstack_layers(stacked).params)):
        assert a.shape == b.shape and np.array_equal(a, b)
    built = tgt.init_target(CONFIG, jax.random.PRNGKey(3), stacked=True)
    for a, b in zip(jax.tree.leaves(stacked.params), jax.tree.leaves(built.params)):
        assert np.array_equal(a, b)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)


def test_prefill_matches_the_layer_list(models):
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, CONFIG.vocab_size, (3, 21)), jnp.int32)
    lengths = jnp.array([21, 13, 5], jnp.int32)
    run = jax.jit(tgt.prefill_layers, static_argnums=(3, 4))
    want = run(models["list"], tokens, lengths, TAPS, "ref")
    got = run(models["stacked"], tokens, lengths, TAPS, "ref")
    assert got[1].shape == (3, 21, len(TAPS), CONFIG.hidden_size)
    # float32 both ways: measured bit-identical on the CPU (2026-12-05); XLA may still order a scan
    # body's sums differently from a layer loop's (see the verify test)
    for name, g, w in zip(("logits", "hidden", "gdn states", "kv"), got, want):
        for gp, wp in zip(jax.tree.leaves(g), jax.tree.leaves(w)):
            assert gp.shape == wp.shape and gp.dtype == wp.dtype, name
            assert _rel(gp, wp) <= 2e-5, f"{name}: {_rel(gp, wp):.3g}"


def _truncated(model, layers):
    """The per-layer-list model cut to its first `layers` layers (norm and head kept)."""
    listed = tgt.unstack_layers(model)
    config = dataclasses.replace(
        listed.config, num_hidden_layers=layers, layer_types=listed.config.layer_types[:layers]
    )
    return tgt.Target(params={**listed.params, "layers": listed.params["layers"][:layers]}, config=config)


@pytest.mark.parametrize("layout", ["list", "stacked"])
def test_taps_are_the_hidden_states_of_those_layers(models, layout):
    """Tap r of prefill and of verify is the residual stream after layer TAPS[r]: head(norm(tap))
    equals the logits of the model cut after that layer (which involve no taps)."""
    model = models[layout]
    rng = np.random.default_rng(3)
    prompt, window = rng.integers(0, CONFIG.vocab_size, 12), rng.integers(0, CONFIG.vocab_size, 5)
    cfg = CacheConfig(num_slots=1, max_len=32, window=5)
    tokens, lengths, slots = jnp.asarray(prompt[None], jnp.int32), jnp.array([12], jnp.int32), jnp.array([1])
    _, prefill_taps, state = tgt.prefill(model, cache_mod.init_cache(CONFIG, cfg), tokens, lengths, slots, TAPS)
    qsl = jnp.array([0, 5], jnp.int32)
    _, verify_taps, _ = tgt.verify(model, state, jnp.asarray(window, jnp.int32), qsl, slots, TAPS)
    for r, layer in enumerate(TAPS):
        cut = _truncated(model, layer + 1)
        want = np.asarray(tgt.target_logits(cut, np.concatenate([prompt, window]), impl="ref"))
        x = jnp.concatenate([prefill_taps[0, :, r], verify_taps[:, r]])
        got = head_logits(rms_norm(x, cut.params["norm"], CONFIG.rms_norm_eps), tgt.lm_head(cut))
        assert _rel(got, want) <= 1e-4, f"tap {r} (layer {layer}): {_rel(got, want):.3g}"


@pytest.mark.parametrize("impl", ["ref", "pallas"])
def test_verify_commit_matches_the_layer_list(models, impl):
    """Two chained verify + commit steps on ragged packed windows (a slot-0 padding request),
    taps in both groups. impl="pallas": every kernel gets a traced layer index inside the scan."""
    rng = np.random.default_rng(1)
    vocab = CONFIG.vocab_size
    cfg = CacheConfig(num_slots=3, max_len=64, window=7, fold_policy="lazy", ring_len=16)
    prompts = np.zeros((3, 19), np.int32)
    lengths = jnp.array([19, 6, 11], jnp.int32)
    prompts[:] = rng.integers(0, vocab, prompts.shape)
    slots = jnp.array([2, 3, 1, 0], jnp.int32)
    steps = [([5, 1, 7], [4, 0, 6, 0]), ([7, 3, 2], [2, 2, 1, 0])]
    windows = [rng.integers(0, vocab, 20).astype(np.int32) for _ in steps]
    out = {}
    for layout, model in models.items():
        _, _, state = tgt.prefill(model, cache_mod.init_cache(CONFIG, cfg), jnp.asarray(prompts), lengths, slots[:3])
        verify = jax.jit(partial(tgt.verify, taps=TAPS, impl=impl))
        commit = jax.jit(partial(tgt.commit, impl=impl))
        out[layout] = []
        for (window_lengths, accepted), tokens in zip(steps, windows):
            qsl = np.concatenate([[0], np.cumsum(window_lengths), [sum(window_lengths)]]).astype(np.int32)
            logits, hidden, state = verify(model, state, jnp.asarray(tokens), jnp.asarray(qsl), slots)
            state = commit(state, slots, jnp.array(accepted, jnp.int32))
            out[layout].append((logits[: qsl[-1]], hidden[: qsl[-1]]))
        out[layout].append(state)
    # float32 both ways, but XLA orders a scan body's float32 sums differently from a layer loop's:
    # the two drift apart by ~2e-7 after layer 0 to <= 6e-5 of max after 8 (measured 2026-12-05;
    # the list path jitted vs eager alone differs by 8e-6); on an H100 the logits of step 0 drift
    # by 3.1e-4 (impl "ref", 2026-12-05: GPU fusions reorder more). A wrong layer index differs by O(1).
    tol = 2e-4 if jax.default_backend() == "cpu" else 1e-3
    for step, (got, want) in enumerate(zip(out["stacked"][:2], out["list"][:2])):
        assert _rel(got[0], want[0]) <= tol, f"step {step} logits"
        assert _rel(got[1], want[1]) <= tol, f"step {step} hidden"
    got, want = out["stacked"][2], out["list"][2]
    for field in ("ckpt", "ring_k", "ring_g", "conv_state", "conv_window", "k_cache", "v_cache"):
        assert _rel(getattr(got, field), getattr(want, field)) <= tol, field
    for field in ("write_pos", "seq_len"):
        assert np.array_equal(getattr(got, field), getattr(want, field)), field


def test_engine_decodes_the_same_tokens(models):
    """Greedy static speculation on the stacked target with a random draft tapping both groups
    emits the target-only greedy tokens of the per-layer list."""
    draft = random_draft(models["stacked"], 4, seed=4, taps=TAPS)
    rng = np.random.default_rng(2)
    prompts = [list(rng.integers(0, CONFIG.vocab_size, n)) for n in (9, 3, 14)]
    none = Engine(models["list"], None, SpecConfig(verify_mode="none", num_slots=3, max_len=64))
    static = Engine(models["stacked"], draft, SpecConfig(verify_mode="static", num_slots=3, max_len=64))
    want = [r.tokens for r in none.generate(prompts, max_new_tokens=12)]
    got = [r.tokens for r in static.generate(prompts, max_new_tokens=12)]
    assert got == want


def test_layer_list_is_traced_once():
    """A per-layer list runs one jitted group function G times: the lowered verify of 16 layers is
    about the size of 8 layers' (one group function, called 4 times instead of 2), not twice it."""
    sizes = {}
    for layers in (8, 16):
        config = shapes.target_config(dict(shapes.SMOKE_TARGET, interval=4), layers)
        target = jax.eval_shape(lambda c=config: tgt.init_target(c, jax.random.PRNGKey(0)))
        cache = jax.eval_shape(lambda c=config: cache_mod.init_cache(c, CacheConfig(num_slots=2, max_len=32, window=4)))
        tokens, qsl, slots = jnp.zeros((8,), jnp.int32), jnp.array([0, 4, 8], jnp.int32), jnp.array([1, 2], jnp.int32)
        verify = jax.jit(lambda t, c: tgt.verify(t, c, tokens, qsl, slots, (), impl="ref")[0])
        sizes[layers] = len(verify.lower(target, cache).as_text())
    assert sizes[16] < 1.2 * sizes[8], sizes
