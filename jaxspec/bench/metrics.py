"""The numbers of one closed-loop run, and their spread over repeats."""

import numpy as np


def summarise(run, concurrency) -> dict:
    """One `client.closed_loop` run at `concurrency` -> its numbers (times in seconds / ms):

    decode_tokens_per_s: concurrency x the mean over requests of the per-request decode rate,
        (output tokens - 1) / (finish - first token) (requests with one token or no time after
        it are left out of the mean);
    output_tokens_per_s: every output token / the run's wall time;
    ttft_ms {mean, p50, p99}: submission to the turn that returned the first token;
    accept_length: tokens committed per request-step (accepted drafts + 1), over all requests;
    verified_per_step: tokens verified a step (anchors + planned drafts, every row), mean;
    tier_tokens_per_step: tokens the verify computed a step (the tier), mean;
    running: requests in a step (rows), mean; steps_per_s: device steps read / wall time.
    """
    records = run["records"]
    rates = [
        (len(r.result.tokens) - 1) / (r.finished - r.first)
        for r in records
        if len(r.result.tokens) > 1 and r.finished > r.first
    ]
    ttft = np.asarray([(r.first - r.submitted) * 1e3 for r in records], np.float64)
    committed = sum(a + 1 for r in records for a in r.result.stats["accepted"])
    request_steps = sum(r.result.stats["steps"] for r in records)
    tokens = sum(len(r.result.tokens) for r in records)
    totals, wall = run["totals"], run["wall_s"]
    steps = totals.get("steps", 0)
    per_step = lambda key: totals.get(key, 0) / steps if steps else None
    return {
        "concurrency": concurrency,
        "requests": len(records),
        "output_tokens": tokens,
        "wall_s": wall,
        "decode_tokens_per_s": concurrency * float(np.mean(rates)) if rates else None,
        "output_tokens_per_s": tokens / wall,
        "ttft_ms": {
            "mean": float(ttft.mean()),
            "p50": float(np.percentile(ttft, 50)),
            "p99": float(np.percentile(ttft, 99)),
        },
        "accept_length": committed / request_steps if request_steps else None,
        "verified_per_step": per_step("verified"),
        "tier_tokens_per_step": per_step("tier_tokens"),
        "running": per_step("rows"),
        "steps": steps,
        "steps_per_s": steps / wall,
        "tier_counts": {str(k): v for k, v in sorted(run["tier_counts"].items())},
    }


def spread(values) -> dict:
    """{"mean", "min", "max", "rel_spread" ((max - min) / mean), "values"} of repeated
    measurements (None entries are dropped; all fields None when nothing is left)."""
    v = [float(x) for x in values if x is not None]
    if not v:
        return {"mean": None, "min": None, "max": None, "rel_spread": None, "values": []}
    mean = float(np.mean(v))
    return {
        "mean": mean,
        "min": min(v),
        "max": max(v),
        "rel_spread": (max(v) - min(v)) / mean if mean else None,
        "values": v,
    }


def not_below(candidate: dict, others: list[dict]) -> bool | None:
    """Whether a mode is >= the best of the others within the measured spread: its best repeat
    reaches the worst repeat of the best other mode (by mean). None when a spread is empty."""
    if candidate["max"] is None or any(o["mean"] is None for o in others):
        return None
    best = max(others, key=lambda o: o["mean"])
    return candidate["max"] >= best["min"]
