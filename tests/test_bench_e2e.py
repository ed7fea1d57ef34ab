"""`jaxspec bench`: the closed-loop client and its numbers on a fake engine and a fake clock, the
workload's requests and calibrated settings, cost-table reuse, and the --smoke run (CPU, the
shipped tiny pair) writing results.json, results.md and the PNGs."""

import collections
import json
import math
import os

import child
import numpy as np
import pytest

from jaxspec.bench import calibrate, client, level, metrics, workload
from jaxspec.engine import Event, GenerationResult
from jaxspec.spec.planner import CostTable


class FakeEngine:
    """submit / step / busy like Engine's, on a fake clock: a turn takes 1 s; a request admitted
    in a turn emits its first token in that turn and one more token each later turn, every step
    accepting one draft of three verified (so a step commits 2 tokens a request in its stats)."""

    def __init__(self, num_slots):
        self.num_slots, self.now, self.next_id = num_slots, 0.0, 0
        self.queue, self.active = collections.deque(), {}
        self.totals, self.tier_counts = collections.Counter(), collections.Counter()
        self.submitted = []

    @property
    def busy(self):
        return bool(self.queue or self.active)

    def submit(self, prompt, max_new_tokens, *, seed, temperature, **kw):
        self.submitted.append((self.now, len(self.active) + len(self.queue), temperature, kw))
        self.queue.append((self.next_id, max_new_tokens))
        self.next_id += 1
        return self.next_id - 1

    def step(self):
        self.now += 1.0
        events = []
        if self.active:
            self.totals.update(steps=1, rows=len(self.active), verified=4 * len(self.active), tier_tokens=16)
            self.tier_counts[16] += 1
        for rid, req in list(self.active.items()):
            req["tokens"].append(1)
            req["accepted"].append(1)
            done = len(req["tokens"]) == req["max"]
            result = (
                GenerationResult(
                    list(req["tokens"]), {"steps": len(req["accepted"]), "accepted": list(req["accepted"])}
                )
                if done
                else None
            )
            events.append(Event(rid, (1,), False, result))
            if done:
                del self.active[rid]
        while self.queue and len(self.active) < self.num_slots:
            rid, max_new = self.queue.popleft()
            self.active[rid] = {"tokens": [0], "accepted": [], "max": max_new}
            events.append(Event(rid, (0,), True, None))
        return events


def test_closed_loop_keeps_c_in_flight_and_its_numbers():
    engine = FakeEngine(num_slots=8)
    reqs = [client.Request([1, 2], n, i) for i, n in enumerate([3, 5, 3, 4, 2, 3])]
    finished = []
    run = client.closed_loop(
        engine,
        reqs,
        2,
        sampling={"temperature": 1.0, "top_k": 20, "top_p": 0.95},
        clock=lambda: engine.now,
        on_finish=finished.append,
    )
    assert len(finished) == 6 and not engine.busy
    assert max(inflight for _, inflight, _, _ in engine.submitted) == 1  # the others were in flight
    assert engine.submitted[0][2] == 1.0 and engine.submitted[0][3] == {"top_k": 20, "top_p": 0.95}
    recs = run["records"]
    # a freed place is refilled before the next turn: a request is submitted at its predecessor's finish
    finishes = sorted(r.finished for r in recs)
    assert [r.submitted for r in recs[2:]] == finishes[:4]
    for r, req in zip(recs, reqs):
        assert r.first == r.submitted + 1 and r.finished == r.first + req.max_new_tokens - 1
    s = metrics.summarise(run, 2)
    assert s["decode_tokens_per_s"] == pytest.approx(2.0)  # one token a turn a request, x c = 2
    assert s["ttft_ms"] == {"mean": 1000.0, "p50": 1000.0, "p99": 1000.0}
    assert s["accept_length"] == 2.0 and s["tier_tokens_per_step"] == 16
    assert s["verified_per_step"] == pytest.approx(4 * s["running"]) and 1 < s["running"] <= 2
    assert s["running"] == pytest.approx(run["totals"]["rows"] / run["totals"]["steps"])
    assert s["output_tokens"] == 20 and s["steps_per_s"] == run["totals"]["steps"] / run["wall_s"]


def test_spread_and_not_below():
    s = metrics.spread([2.0, None, 4.0])
    assert s == {"mean": 3.0, "min": 2.0, "max": 4.0, "rel_spread": 2.0 / 3.0, "values": [2.0, 4.0]}
    assert metrics.spread([None])["mean"] is None
    static, none = metrics.spread([10.5, 11.0]), metrics.spread([5.0, 6.0])
    assert metrics.not_below(metrics.spread([9.0, 10.6]), [static, none])  # reaches static's worst repeat
    assert not metrics.not_below(metrics.spread([9.0, 10.4]), [static, none])
    assert metrics.not_below(metrics.spread([7.0]), [none])


def test_run_order_alternates_so_no_mode_always_follows_another():
    modes = [("none", None), ("static", None), ("compact", None), ("compact", "acc5")]
    orders = [level.run_order(modes, rep) for rep in range(4)]
    assert orders[0] == orders[2] == modes and orders[1] == orders[3] == modes[::-1]
    followers = {(a, b) for order in orders[:2] for a, b in zip(order, order[1:])}
    assert not any((b, a) not in followers for a, b in followers)  # each pair runs both ways


def test_requests_and_calibrated_settings():
    work = workload.Workload("w", None, None, [[1], [2], [3]], "float32", True, {})
    reqs = workload.requests(work, 50, 9, seed=3)
    assert [r.prompt for r in reqs[:4]] == [[1], [2], [3], [1]] and [r.seed for r in reqs] == list(range(50))
    lengths = [r.max_new_tokens for r in reqs]
    assert min(lengths) >= 5 and max(lengths) <= 9 and len(set(lengths)) > 1
    assert lengths == [r.max_new_tokens for r in workload.requests(work, 50, 9, seed=3)]
    x = np.random.default_rng(0).normal(-2.0, 1.0, (500, 7))
    for length in (3.0, 5.0):
        s = calibrate.calibrated(x, length, slope=2.0, seed=4)
        assert s["name"] == f"acc{length:g}" and s["sim"].seed == 4
        assert s["calibration"]["predicted"] == pytest.approx(length, abs=1e-6)
        assert (s["sim"].a, s["sim"].b) == (s["calibration"]["a"], s["calibration"]["b"])


def test_saved_cost_table_is_reused_only_for_its_model_and_device(tmp_path):
    work = workload.Workload("tiny", None, None, [], "float32", False, {})
    cfg = {"cost_tables": str(tmp_path), "block": 8}
    key = level._table_key(work, 4, cfg, "gpu:H200")
    path = level._cost_table_path(work, 4, cfg)
    assert level._saved_table(path, key) is None
    CostTable({(4, 4): 1e-3, (4, 32): 2e-3}, dict(key)).save(path)
    assert level._saved_table(path, key).entries == {(4, 4): 1e-3, (4, 32): 2e-3}
    assert level._saved_table(path, dict(key, device="cpu:cpu")) is None
    assert level._saved_table(path, dict(key, num_slots=8)) is None


@pytest.mark.slow
def test_smoke_run_writes_results_and_plots(tmp_path):
    """The CPU smoke (tiny pair, c 1 and 2, T = 0, three modes, two repeats): every number of every
    level, real acceptance (no simulation), nothing compiled during the timed runs, the cost
    tables saved, results.md and the PNGs written. ~4-5 min on a 2-core machine shared with
    other jobs (compilation: ~10 programs at XLA:CPU -O0)."""
    child.run_smoke("e2e.py", "--smoke", "--no-progress", "--out", str(tmp_path), timeout=1500)
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["meta"]["smoke"] and res["meta"]["command"].startswith("jaxspec bench --smoke")
    assert res["meta"]["workload"]["acceptance"] == "real"
    assert res["settings"] == [{"name": "real", "simulated": False, "calibration": None}]
    assert [lv["concurrency"] for lv in res["levels"]] == [1, 2]
    points = {(p["concurrency"], p["mode"]): p for p in res["points"]}
    assert sorted(points) == [(c, m) for c in (1, 2) for m in ("compact", "none", "static")]
    for (c, mode), p in points.items():
        assert p["temperature"] == 0.0 and len(p["repeats"]) == 2
        for rep in p["repeats"]:
            assert rep["requests"] == 4 and rep["compiles"] == [], rep["compiles"]
            assert rep["decode_tokens_per_s"] > 0 and rep["steps_per_s"] > 0
            assert 0 < rep["ttft_ms"]["p50"] <= rep["ttft_ms"]["p99"]
        assert p["running"]["mean"] <= c and p["accept_length"]["mean"] >= 1.0
        assert p["decode_tokens_per_s"]["min"] <= p["decode_tokens_per_s"]["mean"] <= p["decode_tokens_per_s"]["max"]
        if mode == "none":
            assert p["accept_length"]["mean"] == 1.0 and p["verified_per_step"]["mean"] == pytest.approx(c)
        else:
            assert math.isfinite(p["speedup_vs_none"]["mean"]) and len(p["speedup_vs_none"]["values"]) == 2
            assert p["verified_per_step"]["mean"] <= 8 * c
    assert points[(1, "compact")]["not_below_others"] in (True, False)
    for lv in res["levels"]:
        assert lv["cost_table"]["profiled"] and os.path.isfile(lv["cost_table"]["path"])
        saved = CostTable.load(lv["cost_table"]["path"])
        assert lv["cost_table"]["noise"] == saved.noise >= 0  # the profile's noise, reported as saved
        assert lv["compile"] and all("error" not in v for v in lv["compile"].values()), lv["compile"]
        late = [name for name in lv["compiled_in_warm_up"] if "step" in name or "prefill" in name]
        assert not late, f"compiled after the ahead-of-time compilation: {late}"
    shares = res["levels"][0]["host_share"]
    assert [h["mode"] for h in shares] == ["none", "static", "compact"]
    assert all(
        h["steps"] > 0 and h["traced_steps"] > 0 and h["wall_ms"] > 0 and h["host_share"] is None for h in shares
    )  # no GPU kernels
    assert set(res["goals"]) == {"compact_not_below_others_every_level", "c1_speedup_vs_none", "c1_host_share"}
    assert sorted(res["plots"]) == ["speedup_T0_real.png", "throughput_T0_real.png"]
    for name in res["plots"]:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (tmp_path / "results.md").read_text()
    assert "| c | mode | decode tok/s |" in md and "## host share" in md


@pytest.mark.slow
def test_smoke_real_shape_simulates_calibrated_acceptance(tmp_path):
    """The real-shape workload at toy shapes (2 target layers, vocab 512): two calibrated settings
    (simulated, never the default), their runs measuring the ordered accept lengths. ~3-4 min."""
    child.run_smoke(
        "e2e.py",
        "--smoke",
        "--no-progress",
        "--workload",
        "real-shape",
        "--host-turns",
        "0",
        "--out",
        str(tmp_path),
        timeout=1500,
    )
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["meta"]["workload"]["acceptance"].startswith("SIMULATED")
    assert [(s["name"], s["simulated"]) for s in res["settings"]] == [("acc3", True), ("acc5", True)]
    for s in res["settings"]:
        cal = s["calibration"]
        assert cal["a"] > 0 and math.isfinite(cal["b"]) and cal["first_round"]["x"]["rows"] > 0
    accept = {(p["concurrency"], p["mode"], p["setting"]): p["accept_length"]["mean"] for p in res["points"]}
    assert sorted(accept) == sorted(
        [(c, "none", None) for c in (1, 2)]
        + [(c, m, s) for c in (1, 2) for m in ("static", "compact") for s in ("acc3", "acc5")]
    )
    for c in (1, 2):
        assert accept[(c, "none", None)] == 1.0
        assert 1.0 < accept[(c, "static", "acc3")] < accept[(c, "static", "acc5")]
    assert sorted(res["plots"]) == [
        "speedup_T0_acc3.png",
        "speedup_T0_acc5.png",
        "throughput_T0_acc3.png",
        "throughput_T0_acc5.png",
    ]
