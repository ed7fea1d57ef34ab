"""`jaxspec generate` and `jaxspec info`: the documented flags, --json output, exit status 2."""
import json
from pathlib import Path

import jax
import numpy as np
import pytest

import jaxspec
from jaxspec import cli, dflash
from jaxspec.config import DraftConfig

FIXTURE = str(Path(__file__).parent / "fixtures" / "tiny-qwen3_5")


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    target = jaxspec.load_target(FIXTURE)
    config = DraftConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=512, block_size=4, target_layer_ids=(0, 2),
                         mask_token_id=511, target_hidden_size=64)
    draft = dflash.init_draft(config, jax.random.PRNGKey(3))
    path = tmp_path_factory.mktemp("draft")
    dflash.save_draft(path, draft)
    loaded = dflash.load_draft(path, target)
    assert loaded.config == config
    for a, b in zip(jax.tree_util.tree_leaves(loaded.params), jax.tree_util.tree_leaves(draft.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    return str(path)


def test_generate_json_static_equals_none(draft_dir, capsys):
    outs = {}
    for mode in ("none", "static"):
        argv = ["generate", "--target", FIXTURE, "--draft", draft_dir, "--prompt", "def f(x):", "--prompt", "ab",
                "--max-new-tokens", "6", "--verify-mode", mode, "--seed", "1", "--json"]
        assert cli.main(argv) == 0
        outs[mode] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    for none, static in zip(outs["none"], outs["static"]):
        assert none["tokens"] == static["tokens"] and len(none["tokens"]) == 6
        assert set(static["stats"]) == {"accept_length", "steps", "tokens_per_s"}
        assert static["stats"]["accept_length"] >= 1.0 and isinstance(static["text"], str)


@pytest.mark.parametrize("argv,argument", [
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--temperature", "-1"], "--temperature"),
    (["--verify-mode", "fast"], "--verify-mode"),
    (["--verify-mode", "static"], "--draft"),
    (["--target", "/nonexistent"], "--target"),
], ids=["max-new-tokens", "temperature", "mode", "missing-draft", "target"])
def test_invalid_arguments_exit_2_naming_the_argument(argv, argument, capsys):
    base = ["generate", "--target", FIXTURE, "--prompt", "x", "--verify-mode", "none"]
    with pytest.raises(SystemExit) as exit_info:
        cli.main(base + argv)
    assert exit_info.value.code == 2
    assert argument in capsys.readouterr().err


def test_info_prints_the_config(capsys):
    assert cli.main(["info", FIXTURE]) == 0
    assert json.loads(capsys.readouterr().out)["vocab_size"] == 512


def test_profile_writes_a_cost_table_that_generate_reads(draft_dir, tmp_path, capsys):
    from jaxspec.spec.planner import CostTable

    out = str(tmp_path / "costs.json")
    assert cli.main(["profile", "--target", FIXTURE, "--draft", draft_dir, "--batches", "1,3", "--num-slots", "3",
                     "--max-len", "64", "--repeats", "2", "--out", out]) == 0
    table = CostTable.load(out)
    assert {b for b, _ in table.entries} == {1, 3} and not table.is_trivial
    assert all(t > 0 for t in table.entries.values())
    capsys.readouterr()
    argv = ["generate", "--target", FIXTURE, "--draft", draft_dir, "--prompt", "ab", "--max-new-tokens", "5",
            "--verify-mode", "compact", "--cost-table", out, "--json"]
    assert cli.main(argv) == 0
    assert len(json.loads(capsys.readouterr().out)["tokens"]) == 5
