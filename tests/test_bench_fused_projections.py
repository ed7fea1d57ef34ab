"""bench/fused_projections.py runs on the CPU (one layer, one row, the 35B-A3B shapes) and reports both forms."""

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).parent.parent / "bench" / "fused_projections.py"


def test_fused_projections_bench_reports_both_forms(tmp_path):
    spec = importlib.util.spec_from_file_location("fused_projections_bench", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    info = bench.main(["--layers", "1", "--batches", "1", "--reps", "1", "--shapes", "35b", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "fused_projections.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(info["rows"]))
    assert [r["shape"] for r in saved["rows"]] == [name for name in bench.SHAPES if "35b" in name]
    for r in saved["rows"]:
        for form in ("separate", "fused"):
            assert r[form]["us"] > 0 and r[form]["kernels"] >= 1, r
    assert "| fused / separate |" in (tmp_path / "fused_projections.md").read_text()
