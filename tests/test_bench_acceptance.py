"""bench/acceptance.py: the share of accepted drafts inside exact repeats of their context (against
a brute-force search), and a CPU run on the shipped models writing its table."""

import json
import os
import sys

import child
import numpy as np
import pytest

sys.path.insert(0, os.path.join(child.ROOT, "bench"))
import acceptance  # noqa: E402


def brute_force(prompt, tokens, accepted, n):
    seq = list(prompt) + list(tokens)
    pos, repeated, total = len(prompt), 0, 0
    for count in accepted:
        for j in range(pos, pos + count):
            if j >= len(seq):
                break
            total += 1
            gram = seq[j - n + 1 : j + 1] if j >= n - 1 else None
            repeated += gram is not None and any(seq[i - n + 1 : i + 1] == gram for i in range(n - 1, j))
        pos += count + 1
    return repeated, total


def test_repeat_share_by_hand():
    # prompt "abcab", then step 1 accepts 2 drafts ("c", "a") and emits "b"; step 2 accepts 1 ("x")
    prompt, tokens = list(b"abcab"), list(b"cabx!")
    assert acceptance.repeat_share(prompt, tokens, [2, 1], n=3) == (2, 3)  # "abc", "bca" repeat; "abx" no
    assert acceptance.repeat_share(prompt, tokens, [0, 0, 0], n=3) == (0, 0)
    assert acceptance.repeat_share(prompt, tokens, [2, 1], n=6) == (0, 3)  # longer than any repeat


@pytest.mark.parametrize("n", [1, 3, 5])
def test_repeat_share_against_brute_force(n):
    rng = np.random.default_rng(n)
    for _ in range(50):
        prompt = list(rng.integers(0, 3, rng.integers(0, 12)))
        accepted = list(rng.integers(0, 5, rng.integers(1, 7)))
        tokens = list(rng.integers(0, 3, sum(accepted) + len(accepted) - int(rng.integers(0, 2))))
        assert acceptance.repeat_share(prompt, tokens, accepted, n) == brute_force(prompt, tokens, accepted, n)


def test_cpu_run_writes_the_table(tmp_path):
    models = os.path.join(child.ROOT, "models")
    child.run_smoke(
        "acceptance.py",
        "--target",
        os.path.join(models, "tiny-target"),
        "--draft",
        os.path.join(models, "tiny-dflash"),
        "--blocks",
        "4",
        "--temperatures",
        "0,1",
        "--top-k",
        "20",
        "--top-p",
        "0.95",
        "--sample-seeds",
        "2",
        "--prompts",
        "2",
        "--prompt-len",
        "64",
        "--max-new-tokens",
        "12",
        "--out",
        str(tmp_path),
        timeout=600,
    )
    greedy, sampled = json.loads((tmp_path / "acceptance.json").read_text())["rows"]
    assert greedy["tokens"] == 24 and 1.0 <= greedy["accept_length"] <= 4.0 and len(greedy["accept_length_seeds"]) == 1
    # the sampled row: two timed runs (seeds 0 and 1) pooled, each run's accept length listed
    assert sampled["tokens"] == 48 and (sampled["top_k"], sampled["top_p"]) == (20, 0.95)
    assert len(sampled["accept_length_seeds"]) == 2 and all(1.0 <= a <= 4.0 for a in sampled["accept_length_seeds"])
    for row in (greedy, sampled):
        # every step emits its drafts and one target token; a request's last step may be cut short
        cut = row["requests"]
        assert row["tokens"] - row["steps"] <= row["accepted_drafts"] <= row["tokens"] - row["steps"] + cut
        assert 0.0 <= row["accepted_in_repeats"] <= 1.0
    assert "exact 16-token repeats" in (tmp_path / "acceptance.md").read_text()
