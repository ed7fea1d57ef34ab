"""bench/arg_cost.py on the CPU: every row timed, and the step's pytrees counted as the engine
builds them (the DFlash proposer: the draft's arrays and the two it shares with the target)."""

import json

import child


def test_rows_and_array_counts(tmp_path):
    child.run_smoke(
        "arg_cost.py", "--num-slots", "2", "--calls", "3", "--rounds", "1", "--out", str(tmp_path), timeout=300
    )
    result = json.loads((tmp_path / "arg_cost.json").read_text())
    rows = result["us_a_call"]
    assert list(rows) == [
        "one array",
        "state",
        "state, target, proposer",
        "state, target, proposer; state donated and returned",
    ]
    assert all(us > 0 for us in rows.values())
    arrays = result["arrays"]
    # models/tiny-dflash: 6 layers of 11 arrays + fc, hidden_norm, norm; plus embed and lm_head
    assert arrays["proposer"] == 6 * 11 + 3 + 2 and arrays["target"] > arrays["proposer"]
