"""The command line: the documented flags, --json output, `info`, `profile`; every failure a user can
cause is one line on stderr naming the argument and the file, exit status 2 (run as a subprocess)."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jaxspec
from jaxspec import cli, dflash
from jaxspec.config import DraftConfig
from jaxspec.spec.planner import CostTable

ROOT = Path(__file__).parent.parent
FIXTURE = str(Path(__file__).parent / "fixtures" / "tiny-qwen3_5")


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    target = jaxspec.load_target(FIXTURE)
    config = DraftConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512,
        block_size=4,
        target_layer_ids=(0, 2),
        mask_token_id=511,
        target_hidden_size=64,
    )
    draft = dflash.init_draft(config, jax.random.PRNGKey(3))
    path = tmp_path_factory.mktemp("draft")
    dflash.save_draft(path, draft)
    loaded = dflash.load_draft(path, target)
    assert loaded.config == config
    for a, b in zip(jax.tree_util.tree_leaves(loaded.params), jax.tree_util.tree_leaves(draft.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    return str(path)


def test_generate_json_static_equals_none(capsys):
    """The shipped pair (models/), not the random draft of `draft_dir`: a random draft has every
    proposal rejected (measured: accept length 1.0 on both prompts), so static == none would only
    exercise the bonus token. The shipped draft accepts, so the equality covers accepted drafts."""
    outs = {}
    for mode in ("none", "static"):
        argv = [
            "generate",
            "--target",
            cli.DEFAULT_TARGET,
            "--draft",
            cli.DEFAULT_DRAFT,
            "--prompt",
            "def f(x):",
            "--prompt",
            "ab",
            "--max-new-tokens",
            "16",
            "--verify-mode",
            mode,
            "--seed",
            "1",
            "--json",
        ]
        assert cli.main(argv) == 0
        outs[mode] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(outs["none"]) == len(outs["static"]) == 2
    for none, static in zip(outs["none"], outs["static"]):
        assert none["tokens"] == static["tokens"] and len(none["tokens"]) == 16
        assert set(static["stats"]) == {
            "accept_length",
            "steps",
            "tokens_per_s",
            "first_token_s",
            "decode_tokens_per_s",
            "includes_compilation",
        }
        assert isinstance(static["text"], str)
        # none commits one token a step; the first token comes from prefill
        assert none["stats"]["steps"] == 15 and none["stats"]["accept_length"] == 1.0
        # the reported accept length is what the step count implies
        assert static["stats"]["accept_length"] == pytest.approx(15 / static["stats"]["steps"])
        # measured (CPU, 2026-12): 15.0 (1 step) for "def f(x):", 2.14 (7 steps) for "ab"; 1.5 is
        # the floor test_shipped_models uses for this draft (a broken draft or verify gives 1.0)
        assert static["stats"]["accept_length"] > 1.5, static["stats"]


@pytest.mark.parametrize(
    "argv,argument",
    [
        (["--max-new-tokens", "0"], "--max-new-tokens"),
        (["--temperature", "-1"], "--temperature"),
        (["--verify-mode", "fast"], "--verify-mode"),
        (["--verify-mode", "static"], "--draft"),
        (["--target", "/nonexistent"], "--target"),
    ],
    ids=["max-new-tokens", "temperature", "mode", "missing-draft", "target"],
)
def test_invalid_arguments_exit_2_naming_the_argument(argv, argument, capsys):
    base = ["generate", "--target", FIXTURE, "--prompt", "x", "--verify-mode", "none"]
    with pytest.raises(SystemExit) as exit_info:
        cli.main(base + argv)
    assert exit_info.value.code == 2
    assert argument in capsys.readouterr().err


def test_info_prints_target_draft_and_cost_table(draft_dir, tmp_path, capsys):
    from jaxspec.spec.planner import CostTable

    assert cli.main(["info", FIXTURE]) == 0
    assert json.loads(capsys.readouterr().out)["vocab_size"] == 512
    assert cli.main(["info", os.path.join(draft_dir, "config.json")]) == 0
    draft = json.loads(capsys.readouterr().out)
    assert draft["block_size"] == 4 and draft["target_layer_ids"] == [0, 2]
    CostTable({(1, 4): 1e-3, (1, 8): 2e-3}).save(tmp_path / "costs.json")
    assert cli.main(["info", str(tmp_path / "costs.json")]) == 0
    assert len(json.loads(capsys.readouterr().out)["entries"]) == 2


def test_profile_writes_a_cost_table_that_generate_reads(draft_dir, tmp_path, capsys):
    from jaxspec.spec.planner import CostTable

    out = str(tmp_path / "costs.json")
    assert (
        cli.main(
            [
                "profile",
                "--target",
                FIXTURE,
                "--draft",
                draft_dir,
                "--batches",
                "1,3",
                "--num-slots",
                "3",
                "--max-len",
                "64",
                "--repeats",
                "2",
                "--block-size",
                "3",
                "--trim-draft",
                "--out",
                out,
            ]
        )
        == 0
    )
    table = CostTable.load(out)
    assert table.metadata["window"] == 3 and table.metadata["trim_draft"] is True  # what was timed
    assert {b for b, _ in table.entries} == {1, 3} and not table.is_trivial
    assert all(t > 0 for t in table.entries.values())
    printed = capsys.readouterr()
    progress = printed.err
    assert f"{len(table.entries)}/{len(table.entries)}" in progress and "profile" in progress  # the tqdm bar
    assert table.noise >= 0 and f"noise {table.noise:.1%}" in printed.out  # saved and printed
    argv = [
        "generate",
        "--target",
        FIXTURE,
        "--draft",
        draft_dir,
        "--prompt",
        "ab",
        "--max-new-tokens",
        "5",
        "--verify-mode",
        "compact",
        "--cost-table",
        out,
        "--block-size",
        "3",
        "--trim-draft",
        "--json",
    ]
    assert cli.main(argv) == 0
    compact = json.loads(capsys.readouterr().out)["tokens"]
    # greedy decoding is lossless: the cost-table-driven compact mode emits what mode none does
    none = argv[: argv.index("--verify-mode")] + ["--verify-mode", "none", "--json"]
    assert cli.main(none) == 0
    assert compact == json.loads(capsys.readouterr().out)["tokens"] and len(compact) == 5


def test_overflowing_target_is_an_error_not_garbage(tmp_path, capsys):
    """Finite weights whose activations overflow: the request ends with `error` set, exit status 1."""
    shutil.copytree(FIXTURE, tmp_path / "target")
    tensors = load_file(tmp_path / "target" / "model.safetensors")
    tensors["model.norm.weight"][:] = 3e38
    save_file(tensors, tmp_path / "target" / "model.safetensors", metadata={"format": "pt"})
    argv = ["generate", "--target", str(tmp_path / "target"), "--prompt", "ab", "--verify-mode", "none", "--json"]
    assert cli.main(argv) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == [] and out["error"].startswith("prompt 0: the target's logits are not finite")


# ---------------------------------------------------------------------------------------------
# failures as a user meets them: a subprocess, exit status 2, one line on stderr


def _run(*argv):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "jaxspec.cli", *argv], capture_output=True, cwd=ROOT, env=env, timeout=300
    )


def _assert_one_line_error(proc, *needles):
    err = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err


def _edit_tensors(path, edit):
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def _set(name, value, at=(0, 0)):
    def edit(tensors):
        tensors[name][at] = value

    return edit


def _truncate(path):
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])


def _drop_config_field(field):
    def edit(path):
        config = json.loads((path / "config.json").read_text())
        del config[field]
        (path / "config.json").write_text(json.dumps(config))

    return edit


TARGET_BREAKS = {  # id: (how the copy of the fixture is broken, what the one line must name)
    "nan-weight": (
        lambda p: _edit_tensors(p, _set("model.layers.1.mlp.down_proj.weight", np.nan)),
        ["model.layers.1.mlp.down_proj.weight", "non-finite"],
    ),
    "inf-lm-head": (
        lambda p: _edit_tensors(p, _set("lm_head.weight", np.inf, (3, 5))),
        ["'lm_head.weight'", "inf at [3, 5]"],
    ),
    "config-not-json": (lambda p: (p / "config.json").write_text("{not json"), ["config.json", "not valid JSON"]),
    "config-field": (_drop_config_field("vocab_size"), ["config.json", "vocab_size"]),
    "truncated": (_truncate, ["model.safetensors", "not a readable safetensors file"]),
    "no-safetensors": (lambda p: (p / "model.safetensors").unlink(), ["no *.safetensors"]),
    "missing-tensor": (lambda p: _edit_tensors(p, lambda t: t.pop("model.norm.weight")), ["'model.norm.weight'"]),
    "wrong-shape": (
        lambda p: _edit_tensors(p, lambda t: t.update({"model.norm.weight": t["model.norm.weight"][:-1]})),
        ["'model.norm.weight'", "(63,)"],
    ),
}


@pytest.mark.parametrize("case", TARGET_BREAKS)
def test_broken_target_is_one_line_naming_it(case, tmp_path):
    target = tmp_path / "target"
    shutil.copytree(FIXTURE, target)
    breaks, needles = TARGET_BREAKS[case]
    breaks(target)
    _assert_one_line_error(
        _run("generate", "--target", str(target), "--prompt", "ab", "--verify-mode", "none"),
        "argument --target:",
        *needles,
    )


@pytest.mark.parametrize("case", ["hidden-size", "nan-weight"])
def test_broken_draft_is_one_line_naming_it(case, draft_dir, tmp_path):
    draft = tmp_path / "draft"
    shutil.copytree(draft_dir, draft)
    if case == "hidden-size":
        config = json.loads((draft / "config.json").read_text())
        (draft / "config.json").write_text(json.dumps({**config, "hidden_size": 128}))
        needles = ["hidden_size", "128"]
    else:
        _edit_tensors(draft, _set("layers.0.mlp.down_proj.weight", np.nan))
        needles = ["'layers.0.mlp.down_proj.weight'", "non-finite"]
    _assert_one_line_error(
        _run("generate", "--target", FIXTURE, "--draft", str(draft), "--prompt", "ab"), "argument --draft:", *needles
    )


def test_bad_arguments_are_one_line_naming_them(draft_dir, tmp_path):
    (tmp_path / "costs.json").write_text("not json")
    (tmp_path / "a-file").write_text("")
    gen = ["generate", "--target", FIXTURE, "--verify-mode", "none"]
    compact = ["generate", "--target", FIXTURE, "--draft", draft_dir, "--verify-mode", "compact", "--prompt", "ab"]
    for name, window, trimmed in (("w3.json", 3, False), ("w4-trimmed.json", 4, True)):
        CostTable({(1, 1): 1e-3, (1, window): 2e-3}, {"window": window, "trim_draft": trimmed}).save(tmp_path / name)
    cases = [
        (gen + ["--prompt", os.fsdecode(b"ab\xff")], ["argument --prompt:", "prompt 0", "UTF-8"]),
        (
            gen + ["--prompt", "ab", "--cost-table", str(tmp_path / "costs.json")],
            ["argument --cost-table:", "costs.json", "not a cost table"],
        ),
        (gen + ["--prompt", "ab", "--top-k", "-1"], ["argument --top-k:"]),
        (gen + ["--prompt", "ab", "--top-p", "2"], ["argument --top-p:"]),
        (
            gen + ["--prompt", "ab", "--prompt", "x" * 60, "--max-new-tokens", "40", "--max-len", "96"],
            ["argument --max-new-tokens:", "prompt 1", "--max-len 96"],
        ),
        (["info", "/nonexistent"], ["argument path:", "/nonexistent"]),
        (
            ["profile", "--target", FIXTURE, "--draft", draft_dir, "--out", "/nonexistent/dir/costs.json"],
            ["argument --out:", "/nonexistent/dir"],
        ),
        (["train", "target", "--out", str(tmp_path / "a-file" / "run")], ["argument --out:", "a-file"]),
        (
            compact + ["--cost-table", str(tmp_path / "w3.json")],
            ["argument --cost-table:", "windows of 3 tokens", "this run verifies 4"],
        ),
        (
            compact + ["--cost-table", str(tmp_path / "w4-trimmed.json")],
            ["argument --cost-table:", "profiled with --trim-draft", "this run without"],
        ),
        (
            ["bench", "--workload", "real-shape", "--out", str(tmp_path / "rs")],
            ["argument --workload:", "real-shape", "backend is 'cpu'"],
        ),
        (
            ["estimator", str(tmp_path / "trace.npz"), "--plot", "/nonexistent/dir/plot.png"],
            ["argument --plot:", "/nonexistent/dir"],
        ),
    ]
    for argv, needles in cases:
        _assert_one_line_error(_run(*argv), *needles)


def test_debug_shows_the_traceback(tmp_path):
    shutil.copytree(FIXTURE, tmp_path / "target")
    (tmp_path / "target" / "config.json").write_text("{not json")
    proc = _run("generate", "--target", str(tmp_path / "target"), "--prompt", "ab", "--verify-mode", "none", "--debug")
    assert proc.returncode != 0 and b"Traceback" in proc.stderr and b"not valid JSON" in proc.stderr


def test_speed_without_warmup_says_it_includes_compilation():
    argv = ["generate", "--target", FIXTURE, "--prompt", "ab", "--verify-mode", "none", "--max-new-tokens", "4"]
    cold, warm = _run(*argv), _run(*argv, "--warmup")
    assert cold.returncode == 0 and warm.returncode == 0
    assert b"tokens/s including compilation (--warmup leaves it out): first token" in cold.stderr
    assert b"tokens/s]" in warm.stderr and b"including compilation" not in warm.stderr


def test_compare_none_prints_the_demo_line():
    """`make demo`'s line: the accept length, the decode and end-to-end speed-ups against mode
    none, and the device, in a fixed form."""
    argv = ["generate", "--prompt", "def f(x):", "--max-new-tokens", "12", "--block-size", "4", "--trim-draft"]
    proc = _run(*argv, "--warmup", "--compare-none")
    assert proc.returncode == 0, proc.stderr
    err = proc.stderr.decode()
    static_line = r"\[static: 12 tokens, \d+ steps, accept length \d+\.\d\d, [\d.]+ tokens/s: first token \d+ ms"
    assert re.search(static_line, err), err
    assert re.search(r"decode speed-up \d+\.\d\dx, end to end \d+\.\d\dx on the CPU \(\d+ cores\)\]", err), err
