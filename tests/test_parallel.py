"""Tensor parallelism (jaxspec.parallel) on four CPU devices: TP 1, 2 and 4 emit the same greedy
tokens in every verify mode, replicated state is identical on every device, the per-shard kernels
match, collectives are one all-reduce per block, bad tp values are refused.

XLA reads --xla_force_host_platform_device_count once, when the backend starts, and the rest of
the suite runs on one device (a multi-device CPU client under the whole suite crashed XLA:CPU in
donated steps of other tests), so a process with fewer than 4 devices runs this module again in a
child pytest with the flag (`test_cases_on_four_cpu_devices`) and skips the cases itself.
"""

import collections
import dataclasses
import re

import child
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from float64 import random_config
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from proposers import random_draft

from jaxspec import parallel
from jaxspec import target as target_mod
from jaxspec.config import DEFAULT_DRAFT, DEFAULT_TARGET, SpecConfig
from jaxspec.dflash import load_draft
from jaxspec.engine import Engine
from jaxspec.ops import sampling

MODES = ("none", "static", "cap-accept", "compact")
PROMPTS = [[5, 9, 2, 7, 1], [3, 3, 8], [11, 4, 6, 2, 9, 10, 1]]

FOUR_DEVICES = "--xla_force_host_platform_device_count=4"
needs_four = pytest.mark.skipif(len(jax.devices()) < 4, reason="runs in test_cases_on_four_cpu_devices' child")


@pytest.mark.skipif(len(jax.devices()) >= 4, reason="the cases run in this process")
def test_cases_on_four_cpu_devices():
    result = child.run_module(__file__, extra_env=child.with_xla_flags(FOUR_DEVICES, child.O0))
    assert result.returncode == 0, child.verdict(result)
    assert " passed" in result.stdout and " skipped" in result.stdout  # the cases ran, this wrapper skipped


def _config(**overrides):
    """The float64 tests' random target, smaller, whose heads split 4 ways once key and KV heads
    are repeated (H=2, KVH=1)."""
    small = dict(
        vocab_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        layer_types=("linear_attention",) * 3 + ("full_attention",),
        num_key_value_heads=1,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
    )
    return dataclasses.replace(random_config("qwen3_5_text"), **(small | overrides))


@pytest.fixture(scope="module")
def random_pair():
    target = target_mod.init_target(_config(), jax.random.PRNGKey(3))
    return target, random_draft(target, block_size=4, seed=4, taps=(1, 3))


@pytest.fixture(scope="module")
def shipped_pair():
    target = target_mod.load_target(DEFAULT_TARGET)
    return target, load_draft(DEFAULT_DRAFT, target)


def _tokens(target, draft, mode, tp, sampling=None, **kwargs):
    spec = SpecConfig(verify_mode=mode, num_slots=4, max_len=64, block_size=4, tp=tp)
    engine = Engine(target, draft, spec, **kwargs)
    results = engine.generate(PROMPTS, max_new_tokens=12, **(sampling or {}))
    assert all(r.error is None for r in results)
    return [r.tokens for r in results], engine


def _replicated_everywhere(tree):
    """Every leaf fully replicated, with the same bytes on every device."""
    for leaf in jax.tree.leaves(tree):
        assert leaf.sharding.is_fully_replicated
        first = np.asarray(leaf.addressable_shards[0].data)
        for shard in leaf.addressable_shards[1:]:
            np.testing.assert_array_equal(np.asarray(shard.data), first)


@needs_four
@pytest.mark.parametrize("mode", MODES)
def test_shipped_models_emit_the_same_tokens_at_tp2(shipped_pair, mode):
    target, draft = shipped_pair
    expected, _ = _tokens(target, draft, mode, 1)
    got, engine = _tokens(target, draft, mode, 2)
    assert got == expected
    assert engine.state.cache.ckpt.sharding.spec == P(None, None, "tp", None, None)
    if mode != "none":
        _replicated_everywhere(engine.state.estimator)
    _replicated_everywhere((engine.state.anchor, engine.state.keys, engine.state.cache.seq_len))


@needs_four
@pytest.mark.parametrize("mode", ("none", "static", "compact"))
def test_random_model_emits_the_same_tokens_at_tp_1_2_4(random_pair, mode):
    target, draft = random_pair
    expected, _ = _tokens(target, draft, mode, 1)
    for tp in (2, 4):
        got, engine = _tokens(target, draft, mode, tp)
        assert got == expected, f"tp={tp}"
        assert engine.target.config.linear_num_key_heads == max(2, tp)  # repeated to one per device
        assert engine.target.config.num_key_value_heads == tp
        if mode != "none":
            _replicated_everywhere(engine.state.estimator)


@needs_four
def test_sampled_tokens_match_at_tp2(shipped_pair):
    """T=1, top-k 20, top-p 0.95: the keys, the draws and the acceptance are decided once."""
    target, draft = shipped_pair
    sampled = {"temperature": 1.0, "top_k": 20, "top_p": 0.95, "seed": 7}
    expected, _ = _tokens(target, draft, "compact", 1, sampled)
    got, engine = _tokens(target, draft, "compact", 2, sampled)
    assert got == expected
    _replicated_everywhere((engine.state.estimator, engine.state.keys))


@needs_four
def test_kernels_run_per_shard(random_pair):
    """impl="pallas" (interpret mode here) under shard_map: each device's kernels see its heads only."""
    target, draft = random_pair
    expected, _ = _tokens(target, draft, "static", 1, impl="ref")
    got, _ = _tokens(target, draft, "static", 2, impl="pallas")
    assert got == expected


@needs_four
def test_stacked_layer_groups_split_alike():
    target = target_mod.init_target(
        _config(num_hidden_layers=8, layer_types=_config().layer_types * 2), jax.random.PRNGKey(5)
    )
    ids = jnp.asarray([7, 1, 30, 2, 2, 9, 63, 0, 5], jnp.int32)
    expected = target_mod.target_logits(target, ids)
    mesh = parallel.tp_mesh(4)
    split = parallel.shard_target(target_mod.stack_layers(target), mesh)
    with jax.set_mesh(mesh):
        got = target_mod.target_logits(split, ids)
    np.testing.assert_allclose(got, expected, atol=2e-5 * float(jnp.max(jnp.abs(expected))), rtol=0)
    assert split.params["layer_groups"][0]["gdn"]["qkv"].sharding.spec == P(None, None, "tp")


@needs_four
def test_one_all_reduce_per_block_output(random_pair):
    """The decode step's collectives over [rows, hidden]: the embedding gather and one per mixer
    and MLP output (2 per layer); the rest are the vocabulary-split argmax and a row flag."""
    target, _ = random_pair
    engine = Engine(target, None, SpecConfig(verify_mode="none", num_slots=3, max_len=32, tp=2))
    (lower_step,) = [lower for name, lower in engine.lowerings(greedy=True).items() if name.startswith("step")]
    hlo = lower_step().compile().as_text()
    hidden = target.config.hidden_size
    reduces = re.findall(r"= \w+\[(\d+),(\d+)\]\{[0-9,]*\} all-reduce\(", hlo)
    shapes = collections.Counter((int(r), int(d)) for r, d in reduces)
    assert shapes == {(3, hidden): 1 + 2 * target.config.num_hidden_layers}, shapes
    assert "all-to-all(" not in hlo and "collective-permute(" not in hlo


@needs_four
def test_top_k_over_vocabulary_shards_matches_lax_top_k():
    rng = np.random.default_rng(0)
    logits = rng.integers(-3, 4, size=(5, 96)).astype(np.float32)  # many ties across shards
    logits[1, :40] = -np.inf
    logits[2] = 1.0
    mesh = parallel.tp_mesh(4)
    sharded = jax.device_put(logits, NamedSharding(mesh, P(None, "tp")))
    with jax.set_mesh(mesh):
        values, ids = jax.jit(lambda x: sampling.top_k(x, 7, impl="ref"))(sharded)
    want_values, want_ids = jax.lax.top_k(jnp.asarray(logits), 7)
    np.testing.assert_array_equal(values, want_values)
    np.testing.assert_array_equal(ids, want_ids)


@pytest.mark.parametrize(
    "overrides, tp, message",
    [
        ({}, 8, r"SpecConfig.tp=8: only 4 devices are visible"),
        (
            {"linear_num_value_heads": 6},
            4,
            r"SpecConfig.tp=4: the target's linear_num_value_heads=6 is not divisible by 4",
        ),
        ({"num_attention_heads": 2}, 4, r"SpecConfig.tp=4: the target's num_attention_heads=2 is not divisible by 4"),
        ({"linear_num_key_heads": 3, "linear_num_value_heads": 12}, 2, r"linear_num_key_heads=3 neither divides"),
        ({"vocab_size": 66}, 4, r"SpecConfig.tp=4: the target's vocab_size=66 is not divisible by 4"),
    ],
    ids=["too-few-devices", "value-heads", "query-heads", "key-heads", "vocab"],
)
@needs_four
def test_refuses_a_split_the_model_or_machine_cannot_take(overrides, tp, message):
    target = target_mod.init_target(_config(**overrides), jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match=message):
        Engine(target, None, SpecConfig(verify_mode="none", num_slots=1, max_len=16, tp=tp))


def test_spec_config_rejects_a_non_positive_tp():
    with pytest.raises(ValueError, match="SpecConfig.tp"):
        SpecConfig(tp=0)


def test_split_config_repeats_only_what_is_short():
    config = _config()
    assert parallel.split_config(config, 2) == dataclasses.replace(config, num_key_value_heads=2)
    assert parallel.split_config(config, 1) == config
