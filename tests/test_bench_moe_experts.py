"""bench/moe_experts.py: its --smoke run on the CPU (interpret-mode kernel, small shapes) writes one
row per (tokens, variant) with the floor of the distinct hit experts' bytes."""

import json
import math

import child


def test_smoke_run_writes_rows(tmp_path):
    variants = "matmul,matmul:16/16/16/4/3/0,gathered,ragged"
    child.run_smoke(
        "moe_experts.py",
        "--smoke",
        "--tokens",
        "1,3",
        "--reps",
        "1",
        "--variants",
        variants,
        "--out",
        str(tmp_path),
        timeout=600,
    )
    report = json.loads((tmp_path / "moe_experts_qwen3.5-35b-a3b.json").read_text())
    rows = report["rows"]
    assert [(r["tokens"], r["variant"]) for r in rows] == [(t, v) for t in (1, 3) for v in variants.split(",")]
    expert_bytes = (64 * 2 * 32 + 32 * 64) * 2  # the smoke shape: d 64, width 32, bf16
    for r in rows:
        assert 1 <= r["distinct_experts"] <= 4 * r["tokens"]  # top-4 of 16 a token, 2 layers averaged
        assert math.isclose(r["floor_us"], r["distinct_experts"] * expert_bytes / report["floor_bw"] * 1e6)
        assert math.isfinite(r["wall_us"]) and r["wall_us"] > 0
        assert math.isnan(r["busy_us"])  # no GPU kernels in a CPU trace
    assert rows[0]["distinct_experts"] == 4  # one token: its 4 distinct experts in every layer
