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

`trim_frontier` asks what the survival ranking alone allows, free of the cost table, the tier
ladder and the planner's objective: on the steps of >= min_batch rows, keep a fixed share f of
the step's drafts (budget = floor(f n P), the same top-budget rule) and report the verified
tokens saved and the accept length lost, for the estimator's survivals and for the raw
prod-q_max baseline (`calibration.baseline_survival`). Compact's own point on that curve is where
the cost table's committed-tokens-per-second optimum puts it.

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
from jaxspec.spec.calibration import Trace, baseline_survival, replay_online
from jaxspec.spec.planner import CostTable


def _step_bounds(trace: Trace, caller: str) -> np.ndarray:
    """Row offsets where `trace`'s steps begin, then its row count; refuses a trace without a step
    index or with a row that did not verify its whole block (not recorded in static mode)."""
    if trace.step is None:
        raise ValueError(f"{caller}: the trace has no step index (record it with Engine(record_trace=True))")
    p = trace.num_positions
    if np.any(trace.verified != p):
        raise ValueError(f"{caller}: every row must verify its whole block ({p} drafts): record in static mode")
    return np.flatnonzero(np.r_[True, trace.step[1:] != trace.step[:-1], True])


def _survival(trace: Trace, state, survival, caller: str) -> np.ndarray:
    """The estimator's online survivals [S, P]: `survival` checked against the trace, or replayed."""
    if survival is None:
        return replay_online(trace, state)[0]
    survival = np.asarray(survival, np.float64)
    if survival.shape != trace.features.shape:
        raise ValueError(f"{caller}: survival has shape {survival.shape}, the trace's features {trace.features.shape}")
    return survival


def replay_planner(
    trace: Trace,
    cost_table: CostTable,
    *,
    num_tiers: int = 4,
    plan_overhead: float = PLAN_OVERHEAD,
    state=None,
    survival=None,
    min_batch: int = 16,
) -> dict:
    """Compact against static on `trace` (rows grouped into steps by `trace.step`). plan_overhead:
    the engine's `SpecConfig.plan_overhead`, which a trimmed step also pays in the reported seconds.
    survival: the estimator's survivals [S, P] when already replayed (`calibration.replay_online`),
    else they are replayed here from `state`.

    Returns {"steps", "rows", "static": totals, "compact": totals, "verified_saving" (1 - compact /
    static verified tokens), "accept_length_loss" (1 - compact / static accept length),
    "speedup" (compact / static committed tokens per second of the table), "by_batch": {n: the
    same for steps of n rows}, "at_least": the same pooled over the steps of >= min_batch rows
    (high concurrency, where verified tokens cost) with its "min_batch", or None without such
    steps}; totals = {"verified" (tokens the verify runs: the tier),
    "useful" (anchors + verified drafts), "committed", "seconds", "accept_length"}.
    """
    bounds = _step_bounds(trace, "replay_planner")
    if cost_table is None or cost_table.is_trivial:
        raise ValueError("replay_planner: cost_table must measure at least two token counts")
    p = trace.num_positions
    survival = _survival(trace, state, survival, "replay_planner")  # [S, P]
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


FRONTIER_SHARES = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8)


def trim_frontier(
    trace: Trace, *, shares=FRONTIER_SHARES, state=None, survival=None, min_batch: int = 16
) -> list[dict] | None:
    """Verified-token saving against accept-length loss when each step of >= min_batch rows keeps
    the share f of its n P drafts (budget floor(f n P), `planner.plan_lengths` on the survivals):
    one dict a share, {"share", "verified_saving" (1 - (n + budget) / (n (P + 1)) pooled over the
    steps: anchors + kept drafts, no tier rounding), "accept_length_loss" (1 - sum(min(a, l) + 1) /
    sum(a + 1)) with the online estimator's survivals, "baseline_loss" the same with prod q_max}.
    None when no step has min_batch rows. survival: as in `replay_planner`."""
    bounds = _step_bounds(trace, "trim_frontier")
    p = trace.num_positions
    survival = {
        "estimator": _survival(trace, state, survival, "trim_frontier"),
        "baseline": baseline_survival(trace.features),
    }
    steps = [(s, e) for s, e in zip(bounds[:-1], bounds[1:]) if e - s >= min_batch]
    if not steps:
        return None
    full = sum((e - s) * (p + 1) for s, e in steps)
    static = sum(int(np.sum(trace.accepted[s:e] + 1)) for s, e in steps)
    out = []
    for share in shares:
        budgets = [int(np.floor(share * (e - s) * p)) for s, e in steps]
        row = {
            "share": float(share),
            "verified_saving": 1.0 - sum(e - s + b for (s, e), b in zip(steps, budgets)) / full,
        }
        for name, surv in survival.items():
            committed = 0
            for (s, e), budget in zip(steps, budgets):
                lengths = np.asarray(planner.plan_lengths(surv[s:e], budget))
                committed += int(np.sum(np.minimum(trace.accepted[s:e], lengths) + 1))
            row["accept_length_loss" if name == "estimator" else "baseline_loss"] = 1.0 - committed / static
        out.append(row)
    return out


def format_frontier(frontier: list[dict], min_batch: int = 16) -> str:
    """The frontier as a table: one line per share of drafts kept."""
    lines = [
        f"trim frontier (steps of >= {min_batch} rows keep a share of their drafts, ranked by survival)",
        f"{'kept':>5} {'verified saving':>15} {'loss: estimator':>15} {'baseline':>9}",
    ]
    for r in frontier:
        lines.append(
            f"{r['share']:>5.0%} {r['verified_saving']:>15.1%} "
            f"{r['accept_length_loss']:>15.2%} {r['baseline_loss']:>9.2%}"
        )
    return "\n".join(lines)


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
