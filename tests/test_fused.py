"""Fused same-input projections (jaxspec.fused): the layout, exact round trips, and the fused model
computing the separate one's logits (prefill, verify through the cache) on dense and MoE targets,
per-layer list and stacked groups; the checkpoint writer and the tensor-parallel split take the
separate form."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import cache as cache_mod
from jaxspec import fused
from jaxspec import target as tgt
from jaxspec.config import CacheConfig
from jaxspec.weights import load_params, save_params

FIXTURES = Path(__file__).parent / "fixtures"
MODELS = {
    "dense": FIXTURES / "tiny-qwen3_5",
    "qwen3_next-moe": FIXTURES / "tiny-qwen3_next-moe",  # dense and MoE layers mixed
    "qwen3_5_moe": FIXTURES / "tiny-qwen3_5_moe",
}


def _leaves(params):
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(params)[0]}


@pytest.fixture(scope="module", params=list(MODELS), ids=list(MODELS))
def pair(request):
    path = MODELS[request.param]
    return tgt.load_target(path, fused=False), tgt.load_target(path)


def test_load_target_fuses_every_same_input_projection(pair):
    separate, fused_target = pair
    assert not fused.is_fused(separate.params) and fused.is_fused(fused_target.params)
    for plain, layer in zip(separate.params["layers"], fused_target.params["layers"]):
        for sub, (key, parts) in fused.PARTS.items():
            if sub not in plain:
                continue
            pieces = []
            for part in parts:
                leaf = plain[sub]
                for name in part:
                    leaf = leaf[name]
                pieces.append(np.asarray(leaf))
                assert part[0] not in layer[sub] or len(part) == 2 and part[1] not in layer[sub][part[0]]
            np.testing.assert_array_equal(np.asarray(layer[sub][key]), np.concatenate(pieces, axis=-1))
            want = fused.fused_widths(sub, layer[sub], separate.config)
            assert [p.shape[-1] for p in pieces] == list(want), sub


@pytest.mark.parametrize("stacked", [False, True], ids=["list", "stacked"])
def test_round_trip_is_exact(pair, stacked):
    separate, _ = pair
    if stacked:
        separate = tgt.stack_layers(separate)
    back = fused.unfuse_projections(fused.fuse_projections(separate))
    got, want = _leaves(back.params), _leaves(separate.params)
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    assert fused.fuse_projections(fused.fuse_projections(separate)).params.keys() == separate.params.keys()


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b**2)))


@pytest.mark.parametrize("stacked", [False, True], ids=["list", "stacked"])
def test_fused_target_computes_the_separate_logits(pair, stacked):
    """Prefill of two ragged prompts, then a packed verify of windows 3 and 5 on top, float32."""
    separate, fused_target = pair
    if stacked:
        separate, fused_target = tgt.stack_layers(separate), tgt.stack_layers(fused_target)
    cfg = separate.config
    rng = np.random.default_rng(7)
    cache_cfg = CacheConfig(num_slots=2, max_len=64, window=5, ring_len=16)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 11)), jnp.int32)
    lengths, slots = jnp.asarray([11, 7], jnp.int32), jnp.asarray([1, 2], jnp.int32)
    window = jnp.asarray(rng.integers(0, cfg.vocab_size, 8), jnp.int32)
    qsl = jnp.asarray([0, 3, 8], jnp.int32)
    out = {}
    for name, model in (("separate", separate), ("fused", fused_target)):
        cache = cache_mod.init_cache(cfg, cache_cfg)
        logits, _, cache = tgt.prefill(model, cache, tokens, lengths, slots)
        verify_logits, _, _ = tgt.verify(model, cache, window, qsl, slots)
        out[name] = (
            np.where(np.arange(11)[None, :, None] < np.asarray(lengths)[:, None, None], logits, 0),
            verify_logits,
        )
    for got, want in zip(out["fused"], out["separate"]):
        assert np.all(np.isfinite(got))
        assert _rel(got, want) < 1e-5


def test_checkpoint_writer_takes_the_separate_form(pair, tmp_path):
    separate, fused_target = pair
    save_params(tmp_path / "a", fused_target.params, fused_target.config)
    written = load_params(tmp_path / "a", separate.config, jnp.float32)
    got, want = _leaves(written), _leaves(separate.params)
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_a_tensor_parallel_target_cannot_be_fused(pair):
    separate, _ = pair
    with pytest.raises(ValueError, match="tensor parallelism"):
        fused.fuse_projections(separate.replace(qkv_groups=2))


@pytest.mark.parametrize("stacked", [False, True], ids=["list", "stacked"])
def test_init_target_fuses_without_holding_every_layer_twice(monkeypatch, stacked):
    """A fresh random target is fused a layer at a time, each layer's separate matrices dropped as
    its fused ones are made: the live device bytes never pass the finished tree's by more than one
    layer's (at 27B scale holding both forms overran an 80 GB GPU)."""
    from jaxspec.bench import shapes

    config = shapes.target_config(dict(shapes.SMOKE_TARGET, interval=4), 8)
    real_fuse, peaks = tgt.fuse_layer, []

    def fuse_and_measure(layer):
        out = real_fuse(layer)
        peaks.append(sum(a.nbytes for a in jax.live_arrays()))
        return out

    monkeypatch.setattr(tgt, "fuse_layer", fuse_and_measure)
    before = sum(a.nbytes for a in jax.live_arrays())
    target = tgt.init_target(config, jax.random.PRNGKey(3), jnp.bfloat16, fused=True, stacked=stacked)
    layers = target.params["layer_groups"] if stacked else target.params["layers"]
    tree_bytes = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(target.params))
    layer_bytes = max(sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(layer)) for layer in layers)
    assert len(peaks) == config.num_hidden_layers and fused.is_fused(target.params)
    assert max(peaks) - before <= tree_bytes + layer_bytes / (2 if stacked else 1)
