"""bench/fused_projections.py runs on the CPU (one layer, one row, the 35B-A3B shapes) and reports both
forms. In a child process, as the other benchmark smoke runs: jax 0.11.2's XLA:CPU segfaulted while
compiling this bench inside a long-lived test worker of the full suite once (tests/child.py)."""

import importlib.util
import json
from pathlib import Path

import child

BENCH = Path(__file__).parent.parent / "bench" / "fused_projections.py"


def test_fused_projections_bench_reports_both_forms(tmp_path):
    args = ["--layers", "1", "--batches", "1", "--reps", "1", "--shapes", "35b", "--out", str(tmp_path)]
    child.run_smoke("fused_projections.py", *args, timeout=300)
    spec = importlib.util.spec_from_file_location("fused_projections_bench", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    saved = json.loads((tmp_path / "fused_projections.json").read_text())
    assert saved["layers"] == 1
    assert [r["shape"] for r in saved["rows"]] == [name for name in bench.SHAPES if "35b" in name]
    for r in saved["rows"]:
        assert r["batch"] == 1
        for form in ("separate", "fused"):
            assert r[form]["us"] > 0 and r[form]["kernels"] >= 1, r
    text = (tmp_path / "fused_projections.md").read_text()
    assert "| fused / separate |" in text and text.count("| 1 |") == len(saved["rows"])
