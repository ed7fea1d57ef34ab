"""bench/cpu_products.py: its --smoke run times one and eight rows of every shape, each product held
to the float64 product, and reports rates that follow from its times."""

import json

import child


def test_smoke_run_reports_every_shape(tmp_path):
    child.run_smoke("cpu_products.py", "--smoke", "--out", str(tmp_path), timeout=300)
    rows = json.loads((tmp_path / "cpu_products.json").read_text())["rows"]
    assert [(r["k"], r["n"]) for r in rows] == [(64, 96), (96, 160)]
    for r in rows:
        assert r["ms_1"] > 0 and r["ms_8"] > 0
        assert abs(r["ratio_8_1"] - r["ms_8"] / r["ms_1"]) < 1e-12
        assert abs(r["gflop_s_8"] - 16 * r["k"] * r["n"] * r["copies"] / r["ms_8"] / 1e6) < 1e-9 * r["gflop_s_8"]
