"""The offline planner replay (jaxspec.spec.replay) against a brute-force oracle of the planner's
rule written from docs/design.md section 7, and the `jaxspec estimator --cost-table` command."""

import json

import numpy as np
import pytest

from jaxspec.spec import calibration, layout, replay
from jaxspec.spec.calibration import Trace, replay_online, save_trace
from jaxspec.spec.planner import CostTable

P = 7  # drafts a row (block 8)


def _trace(seed, batches=(1, 3, 16, 16, 5, 16)):
    """Steps of the given row counts; features and acceptance drawn so higher x accepts more."""
    rng = np.random.default_rng(seed)
    rows = sum(batches)
    x = rng.normal(-1.0, 2.0, (rows, P)).astype(np.float32)
    p = 1.0 / (1.0 + np.exp(-x))
    ok = rng.uniform(size=(rows, P)) < p
    accepted = np.argmin(np.c_[ok, np.zeros((rows, 1), bool)], axis=1).astype(np.int32)  # first rejection
    step = np.repeat(np.arange(len(batches)), batches)
    return Trace(x, np.full(rows, P, np.int32), accepted, step=step)


def _table(per_token, fixed=1e-3, batches=(1, 3, 5, 16)):
    """Seconds = fixed + per_token x tokens at every tier of each batch's ladder."""
    entries = {}
    for b in batches:
        for t in layout.tiers(b, P + 1)[0]:
            entries[(b, t)] = fixed + per_token * t
    return CostTable(entries)


def _oracle(trace, table, plan_overhead, num_tiers=4):
    """Totals of static and compact from the rule's definition, by loops in float64: a budget that
    trims drafts is priced (and timed) at its table time + plan_overhead x the full block's."""
    surv, _ = replay_online(trace)
    totals = {m: dict(verified=0, committed=0, seconds=0.0, rows=0) for m in ("static", "compact")}
    for s in np.unique(trace.step):
        idx = np.flatnonzero(trace.step == s)
        n, sv, acc = len(idx), surv[idx], trace.accepted[idx]
        tiers, admissible = layout.tiers(n, P + 1, num_tiers)
        flat = sorted(
            ((-sv[r, k], k, r) for r in range(n) for k in range(P)), key=lambda c: (c[0], c[1], c[2])
        )  # survival descending, then position, then request
        full = table.step_time(n, n * (P + 1))

        def price(budget):
            return table.step_time(n, n + budget) + (plan_overhead * full if budget < n * P else 0.0)

        best, best_rate = None, -np.inf
        for budget in sorted(admissible):
            tau = n + sum(-c[0] for c in flat[:budget])
            rate = tau / price(budget)
            if rate > best_rate:
                best, best_rate = budget, rate
        lengths = np.zeros(n, int)
        for _, _, r in flat[:best]:
            lengths[r] += 1
        tier = min(t for t in tiers if t >= n + best)
        for mode, verified, ell, seconds in (
            ("static", n * (P + 1), np.full(n, P), full),
            ("compact", tier, lengths, table.step_time(n, tier) + price(best) - table.step_time(n, n + best)),
        ):
            t = totals[mode]
            t["verified"] += verified
            t["committed"] += int(np.sum(np.minimum(acc, ell) + 1))
            t["seconds"] += seconds
            t["rows"] += n
    return totals


@pytest.mark.parametrize("plan_overhead", [0.0, 0.03], ids=["no-overhead", "overhead"])
@pytest.mark.parametrize("per_token", [1e-4, 1e-3, 1e-2], ids=["cheap-tokens", "mid", "dear-tokens"])
def test_replay_matches_the_oracle(per_token, plan_overhead):
    trace, table = _trace(int(per_token * 1e5)), _table(per_token)
    got = replay.replay_planner(trace, table, plan_overhead=plan_overhead)
    want = _oracle(trace, table, plan_overhead)
    assert got["steps"] == 6 and got["rows"] == trace.num_rows
    for mode in ("static", "compact"):
        assert got[mode]["verified"] == want[mode]["verified"], mode
        assert got[mode]["committed"] == want[mode]["committed"], mode
        assert got[mode]["seconds"] == pytest.approx(want[mode]["seconds"], rel=1e-12)
        assert got[mode]["accept_length"] == pytest.approx(want[mode]["committed"] / want[mode]["rows"], rel=1e-12)
    assert got["verified_saving"] == pytest.approx(1 - want["compact"]["verified"] / want["static"]["verified"])
    s, c = want["static"], want["compact"]
    assert got["speedup"] == pytest.approx((c["committed"] / c["seconds"]) / (s["committed"] / s["seconds"]))
    assert sum(r["steps"] for r in got["by_batch"].values()) == 6 and sorted(got["by_batch"]) == [1, 3, 5, 16]


def test_pooled_high_concurrency_row_sums_its_batches():
    """ "at_least" pools the steps of >= min_batch rows: its totals are the sums of those batches' totals."""
    trace, table = _trace(7), _table(1e-2, fixed=1e-4)
    got = replay.replay_planner(trace, table, min_batch=5)
    pooled, parts = got["at_least"], [got["by_batch"][n] for n in (5, 16)]
    assert pooled["min_batch"] == 5 and pooled["steps"] == sum(p["steps"] for p in parts) == 4
    for mode in ("static", "compact"):
        for key in ("verified", "committed"):
            assert pooled[mode][key] == sum(p[mode][key] for p in parts), (mode, key)
        rows = sum(p[mode]["committed"] / p[mode]["accept_length"] for p in parts)
        assert pooled[mode]["accept_length"] == pytest.approx(pooled[mode]["committed"] / rows, rel=1e-12)
    assert pooled["verified_saving"] == pytest.approx(1 - pooled["compact"]["verified"] / pooled["static"]["verified"])
    assert pooled["verified_saving"] > 0.0  # dear tokens: compact trims at high concurrency
    assert replay.replay_planner(trace, table, min_batch=17)["at_least"] is None
    assert ">=5 " in replay.format_replay(got)


def test_dear_tokens_trim_and_free_tokens_do_not():
    """When a verified token costs nothing beyond the step, compact verifies every block (same as
    static); when it dominates the step, compact verifies fewer tokens and loses some acceptance."""
    trace = _trace(4)
    flat = replay.replay_planner(trace, _table(0.0))
    assert flat["verified_saving"] == 0.0 and flat["accept_length_loss"] == 0.0
    dear = replay.replay_planner(trace, _table(1e-2, fixed=1e-4))
    assert dear["verified_saving"] > 0.3 and 0.0 < dear["accept_length_loss"] < 1.0 and dear["speedup"] > 1.0


def test_replay_refuses_traces_it_cannot_replay():
    trace = _trace(5)
    with pytest.raises(ValueError, match="step index"):
        replay.replay_planner(Trace(trace.features, trace.verified, trace.accepted), _table(1e-3))
    capped = trace.verified.copy()
    capped[0] = 3
    with pytest.raises(ValueError, match="static mode"):
        replay.replay_planner(
            Trace(trace.features, capped, np.minimum(trace.accepted, 3), step=trace.step), _table(1e-3)
        )
    with pytest.raises(ValueError, match="two token counts"):
        replay.replay_planner(trace, CostTable({(1, 8): 1e-3}))


def test_estimator_command_prints_the_replay(tmp_path, capsys):
    trace = _trace(6)
    save_trace(tmp_path / "t.npz", trace.features, trace.verified, trace.accepted, step=trace.step)
    _table(1e-2, fixed=1e-4).save(tmp_path / "costs.json")
    assert calibration.main([str(tmp_path / "t.npz"), "--cost-table", str(tmp_path / "costs.json"), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["planner_replay"]
    want = replay.replay_planner(trace, CostTable.load(tmp_path / "costs.json"))
    assert got["compact"] == want["compact"] and got["static"] == want["static"]
    assert calibration.main([str(tmp_path / "t.npz"), "--cost-table", str(tmp_path / "costs.json")]) == 0
    text = capsys.readouterr().out
    assert "planner replay" in text and f"{want['verified_saving']:.1%}" in text
    assert "trim frontier" in text
    save_trace(tmp_path / "nostep.npz", trace.features, trace.verified, trace.accepted)
    with pytest.raises(SystemExit) as e:
        calibration.main([str(tmp_path / "nostep.npz"), "--cost-table", str(tmp_path / "costs.json")])
    assert e.value.code == 2 and "--cost-table" in capsys.readouterr().err


def _frontier_oracle(trace, survival, share, min_batch):
    """Pooled (saving, loss) of keeping floor(share n P) drafts a step, by loops: the top candidates
    by survival descending, then position, then request."""
    kept = full = committed = static = 0
    for s in np.unique(trace.step):
        idx = np.flatnonzero(trace.step == s)
        n = len(idx)
        if n < min_batch:
            continue
        budget = int(np.floor(share * n * P))
        flat = sorted((-survival[idx[r], k], k, r) for r in range(n) for k in range(P))
        lengths = np.zeros(n, int)
        for _, _, r in flat[:budget]:
            lengths[r] += 1
        acc = trace.accepted[idx]
        kept, full = kept + n + budget, full + n * (P + 1)
        committed += int(np.sum(np.minimum(acc, lengths) + 1))
        static += int(np.sum(acc + 1))
    return 1 - kept / full, 1 - committed / static


@pytest.mark.parametrize("min_batch", [3, 16], ids=["from-3-rows", "from-16-rows"])
def test_trim_frontier_matches_the_oracle(min_batch):
    trace = _trace(11)
    got = replay.trim_frontier(trace, shares=(0.0, 0.35, 0.5, 1.0), min_batch=min_batch)
    surv = {
        "accept_length_loss": replay_online(trace)[0],
        "baseline_loss": calibration.baseline_survival(trace.features),
    }
    assert [r["share"] for r in got] == [0.0, 0.35, 0.5, 1.0]
    for r in got:
        for key, s in surv.items():
            saving, loss = _frontier_oracle(trace, s, r["share"], min_batch)
            assert r["verified_saving"] == pytest.approx(saving, rel=1e-12)
            assert r[key] == pytest.approx(loss, rel=1e-12, abs=1e-15)
    assert got[-1]["verified_saving"] == 0.0 and got[-1]["accept_length_loss"] == 0.0  # keep all: static
    assert got[0]["verified_saving"] == pytest.approx(P / (P + 1))  # anchors only
    losses = [r["accept_length_loss"] for r in got]
    assert losses == sorted(losses, reverse=True) and losses[0] > 0.0
    assert replay.trim_frontier(trace, min_batch=17) is None
    with pytest.raises(ValueError, match="trim_frontier: the trace has no step index"):
        replay.trim_frontier(Trace(trace.features, trace.verified, trace.accepted))
    assert "trim frontier" in replay.format_frontier(got, min_batch)


def test_given_survivals_replace_the_replay():
    """`survival=` is what the ranking uses (the baseline's survivals give the baseline's losses),
    the estimator's own survivals give what replaying them does, and a wrong shape is refused."""
    trace = _trace(12)
    baseline = calibration.baseline_survival(trace.features)
    for r in replay.trim_frontier(trace, shares=(0.4, 0.7), survival=baseline, min_batch=3):
        assert (
            r["accept_length_loss"]
            == r["baseline_loss"]
            == pytest.approx(_frontier_oracle(trace, baseline, r["share"], 3)[1], rel=1e-12)
        )
    replayed = replay_online(trace)
    table = _table(1e-2, fixed=1e-4)
    assert replay.replay_planner(trace, table, survival=replayed[0]) == replay.replay_planner(trace, table)
    same = [
        json.dumps(calibration._json_ready(calibration.evaluate(trace, **kw))) for kw in ({"replayed": replayed}, {})
    ]
    assert same[0] == same[1]  # as text: the reports hold NaN (empty reliability bins)
    scored = calibration.evaluate(trace, replayed=(baseline, replayed[1]))
    assert scored["auc"] == scored["auc_baseline"] and scored["ece"] == scored["ece_baseline"]
    with pytest.raises(ValueError, match=r"replay_planner: survival has shape \(5, 7\)"):
        replay.replay_planner(trace, table, survival=baseline[:5])
    with pytest.raises(ValueError, match="trim_frontier: survival has shape"):
        replay.trim_frontier(trace, survival=baseline[:, :3])
