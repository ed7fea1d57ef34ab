"""Offline planner replay: what compact verification would have done on a recorded trace.

A trace recorded in static mode (`Engine(record_trace=True)`, every row verifying its whole block;
see `calibration.Trace`) holds, per (request, step) row, the draft features x [P] and how many of
its P drafts were accepted, a. Chain acceptance stops at the first rejected draft and decides each
position from that position's draft and target distributions only, so had the step verified only
the first l drafts of the row it would have accepted min(a, l) of them. The replay runs the online
estimator over the trace (`calibration.replay_online`: survivals predicted before each step's
outcome is observed), and per step (rows of one `step` index, n of them) applies the engine's rule:

    budget = planner.choose_budget(survival [n, P], cost_table, admissible budgets of the tier ladder,
                                   plan_overhead=plan_overhead)
    l = planner.plan_lengths(survival, budget)         # drafts verified per row
    tier = the smallest tier holding n + budget tokens  # tokens the verify runs

and reports, against static (every row verifies P drafts, tier n (P + 1)): verified tokens, tokens
committed (sum of min(a, l) + 1), the accept-length loss, and the step time the cost table gives
both, so the adaptive policy can be judged without a GPU.

Approximations (all in compact's favour, each small): the tier is chosen from the step's own
survivals (the engine reads them `lag` steps late); the estimator observes static's full outcomes
(compact would observe truncated windows); later steps are those of the static run (compact
commits fewer tokens per step, so its requests take more steps: the report's time counts that
through the committed-token rate, not through the step count).
"""

from __future__ import annotations

import numpy as np

from jaxspec.config import PLAN_OVERHEAD
from jaxspec.spec import layout, planner
from jaxspec.spec.calibration import Trace, replay_online
from jaxspec.spec.planner import CostTable


def replay_planner(
    trace: Trace,
    cost_table: CostTable,
    *,
    num_tiers: int = 4,
    plan_overhead: float = PLAN_OVERHEAD,
    state=None,
    min_batch: int = 16,
) -> dict:
    """Compact against static on `trace` (rows grouped into steps by `trace.step`). plan_overhead:
    the engine's `SpecConfig.plan_overhead`, which a trimmed step also pays in the reported seconds.

    Returns {"steps", "rows", "static": totals, "compact": totals, "verified_saving" (1 - compact /
    static verified tokens), "accept_length_loss" (1 - compact / static accept length),
    "speedup" (compact / static committed tokens per second of the table), "by_batch": {n: the
    same for steps of n rows}, "at_least": the same pooled over the steps of >= min_batch rows
    (high concurrency, where verified tokens cost) with its "min_batch", or None without such
    steps}; totals = {"verified" (tokens the verify runs: the tier),
    "useful" (anchors + verified drafts), "committed", "seconds", "accept_length"}.
    """
    if trace.step is None:
        raise ValueError("replay_planner: the trace has no step index (record it with Engine(record_trace=True))")
    if cost_table is None or cost_table.is_trivial:
        raise ValueError("replay_planner: cost_table must measure at least two token counts")
    p = trace.num_positions
    if np.any(trace.verified != p):
        raise ValueError(f"replay_planner: every row must verify its whole block ({p} drafts): record in static mode")
    survival, _ = replay_online(trace, state)  # [S, P]
    bounds = np.flatnonzero(np.r_[True, trace.step[1:] != trace.step[:-1], True])
    rows = {"static": [], "compact": []}  # per step: (n, verified, useful, committed, seconds)
    for start, end in zip(bounds[:-1], bounds[1:]):
        n, surv, accepted = end - start, survival[start:end], trace.accepted[start:end]
        tier_tokens, admissible = layout.tiers(int(n), p + 1, num_tiers)
        budget = planner.choose_budget(surv, cost_table, admissible, plan_overhead=plan_overhead)
        lengths = np.asarray(planner.plan_lengths(surv, budget))
        tier = tier_tokens[layout.tier_for(int(n) + budget, tier_tokens)]
        full = n * (p + 1)
        rows["static"].append((n, full, full, int(np.sum(accepted + 1)), cost_table.step_time(n, full)))
        committed = int(np.sum(np.minimum(accepted, lengths) + 1))
        seconds = cost_table.step_time(n, tier) + planner.trim_overhead(cost_table, int(n), budget, p, plan_overhead)
        rows["compact"].append((n, tier, n + int(lengths.sum()), committed, seconds))
    out = {"steps": len(rows["static"]), "rows": trace.num_rows, **_compare(rows)}
    out["by_batch"] = {}
    for n in sorted({r[0] for r in rows["static"]}):
        pick = {mode: [r for r in rs if r[0] == n] for mode, rs in rows.items()}
        out["by_batch"][int(n)] = {"steps": len(pick["static"]), **_compare(pick)}
    pick = {mode: [r for r in rs if r[0] >= min_batch] for mode, rs in rows.items()}
    out["at_least"] = (
        {"min_batch": int(min_batch), "steps": len(pick["static"]), **_compare(pick)} if pick["static"] else None
    )
    return out


def _compare(rows) -> dict:
    totals = {}
    for mode, rs in rows.items():
        a = np.asarray(rs, np.float64).reshape(-1, 5)
        steps_rows = a[:, 0].sum()
        totals[mode] = {
            "verified": int(a[:, 1].sum()),
            "useful": int(a[:, 2].sum()),
            "committed": int(a[:, 3].sum()),
            "seconds": float(a[:, 4].sum()),
            "accept_length": float(a[:, 3].sum() / steps_rows),
        }
    s, c = totals["static"], totals["compact"]
    return {
        **totals,
        "verified_saving": 1.0 - c["verified"] / s["verified"],
        "accept_length_loss": 1.0 - c["accept_length"] / s["accept_length"],
        "speedup": (c["committed"] / c["seconds"]) / (s["committed"] / s["seconds"]),
    }


def format_replay(result: dict) -> str:
    """The replay as a table: one line per batch size, then the whole trace."""
    lines = [
        "planner replay (compact against static, step times from the cost table)",
        f"{'batch':>5} {'steps':>6} {'verified static':>15} {'compact':>8} {'saving':>7} "
        f"{'accept static':>13} {'compact':>8} {'loss':>6} {'speed-up':>8}",
    ]
    entries = [(str(n), r) for n, r in result["by_batch"].items()] + [("all", result)]
    if result.get("at_least") is not None:
        entries.append((f">={result['at_least']['min_batch']}", result["at_least"]))
    for name, r in entries:
        s, c = r["static"], r["compact"]
        lines.append(
            f"{name:>5} {r['steps']:>6} {s['verified']:>15} {c['verified']:>8} {r['verified_saving']:>7.1%} "
            f"{s['accept_length']:>13.3f} {c['accept_length']:>8.3f} {r['accept_length_loss']:>6.1%} "
            f"{r['speedup']:>7.3f}x"
        )
    return "\n".join(lines)
