"""bench/skinny_gemm.py: its --smoke run on the CPU (small shapes) times every (set, rows, variant) and
holds each variant's output, transposed weight layouts included, to the float64 product."""

import json
import math

import child


def test_smoke_run_checks_every_variant_against_float64(tmp_path):
    variants = "bf16_out,transposed,rowsum_t"
    child.run_smoke(
        "skinny_gemm.py",
        "--smoke",
        "--sets",
        "moe35,gdn",
        "--rows",
        "1,3",
        "--variants",
        variants,
        "--tag",
        "smoke",
        "--out",
        str(tmp_path),
        timeout=600,
    )
    rows = json.loads((tmp_path / "skinny_gemm_smoke.json").read_text())["rows"]
    want = [(s, m, v) for s in ("moe35", "gdn") for m in (1, 3) for v in variants.split(",")]
    assert [(r["set"], r["rows"], r["variant"]) for r in rows] == want
    for r in rows:
        assert 0 < r["rel_err"] < 1e-2, r  # bf16 results: a few 1e-3 of the largest value
        assert math.isfinite(r["wall_us"]) and r["wall_us"] > 0 and r["floor_us"] > 0
        assert r["gpu_busy_us"] is None  # no GPU kernels in a CPU trace
