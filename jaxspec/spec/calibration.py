"""Calibration of the acceptance estimator on recorded traces (docs/design.md section 6).

A trace is one row per (request, decode step): the draft features x [S, P] the estimator saw,
how many drafts were verified and how many accepted, and optionally the request's
temperature, the step index (rows of one step form one `observe` call when replayed) and the
request id (rows of one request, in serving order, are its history). Stored as an ``.npz`` with
arrays ``features`` [S, P] float32, ``verified`` [S] int32, ``accepted`` [S] int32 and optional
``temperature`` [S] float32, ``step`` [S] int64, ``request`` [S] int64.

`evaluate` replays the estimator online over the trace in order - predict the step's
survivals, then observe its outcome, as in serving - and scores the predicted survival of
every verified (row, position) pair against its acceptance (position < accepted):
AUC (Mann-Whitney, ties counted one half) next to the raw prod-q_max baseline
(s_k = prod_{j<=k} sigmoid(x_j) = prod q_max,j), and per-position expected calibration error
(10 equal-width bins). `reliability_plot` draws the reliability diagrams; `main` is the
``jaxspec estimator TRACE.npz [--plot out.png] [--json]`` command.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import sys
from typing import Any

import numpy as np

from jaxspec.config import FIRST_REFIT
from jaxspec.spec import estimator as est

__all__ = [
    "Trace",
    "OPTIONAL_COLUMNS",
    "TraceRecorder",
    "save_trace",
    "load_trace",
    "evaluate",
    "auc",
    "ece",
    "reliability_bins",
    "reliability_plot",
    "main",
]

ECE_BINS = 10
OPTIONAL_COLUMNS = ("temperature", "step", "request")  # trace arrays a file may leave out
MIN_PLOT_BIN = 5  # bins with fewer samples are left out of the plot
DEFAULT_BATCH_ROWS = 32  # rows per replayed observe call when the trace has no step index


# ------------------------------------------------------------------------------------ traces


@dataclasses.dataclass(frozen=True)
class Trace:
    features: np.ndarray  # [S, P] float32
    verified: np.ndarray  # [S] int32
    accepted: np.ndarray  # [S] int32
    temperature: np.ndarray | None = None  # [S] float32
    step: np.ndarray | None = None  # [S] int64, non-decreasing
    request: np.ndarray | None = None  # [S] int64, the request id of each row

    def __post_init__(self):
        f = np.asarray(self.features, np.float32)
        if f.ndim != 2 or f.shape[1] < 1:
            raise ValueError(f"trace features shape {f.shape}: must be [rows, positions >= 1]")
        S, P = f.shape
        v = _int_column("verified", self.verified, S)
        a = _int_column("accepted", self.accepted, S)
        if S and (v.min() < 0 or v.max() > P):
            raise ValueError(f"trace verified in [{v.min()}, {v.max()}]: must lie in [0, {P}]")
        if S and (a.min() < 0 or np.any(a > v)):
            raise ValueError("trace accepted: must satisfy 0 <= accepted <= verified per row")
        t = None
        if self.temperature is not None:
            t = np.asarray(self.temperature, np.float32)
            if t.shape != (S,):
                raise ValueError(f"trace temperature shape {t.shape}: must be [{S}]")
        st = None
        if self.step is not None:
            st = _int_column("step", self.step, S, np.int64)
            if S > 1 and np.any(np.diff(st) < 0):
                raise ValueError("trace step: must be non-decreasing (rows in serving order)")
        req = None if self.request is None else _int_column("request", self.request, S, np.int64)
        for name, value in zip(("features", "verified", "accepted", *OPTIONAL_COLUMNS), (f, v, a, t, st, req)):
            object.__setattr__(self, name, value)

    @property
    def num_rows(self) -> int:
        return self.features.shape[0]

    @property
    def num_positions(self) -> int:
        return self.features.shape[1]


def _int_column(name, value, rows, dtype=np.int32):
    arr = np.asarray(value)
    if arr.shape != (rows,):
        raise ValueError(f"trace {name} shape {arr.shape}: must be [{rows}] (one per row)")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        if not np.all(np.isfinite(arr)) or np.any(arr != np.round(arr)):
            raise ValueError(f"trace {name}: must hold integers")
    return arr.astype(dtype)


def save_trace(path, features, verified, accepted, temperature=None, *, step=None, request=None) -> Trace:
    """Validate and write a trace ``.npz``; returns the `Trace`."""
    trace = Trace(features, verified, accepted, temperature, step, request)
    arrays = {"features": trace.features, "verified": trace.verified, "accepted": trace.accepted}
    arrays.update((k, getattr(trace, k)) for k in OPTIONAL_COLUMNS if getattr(trace, k) is not None)
    with open(path, "wb") as fh:  # a file object: np.savez would append ".npz"
        np.savez_compressed(fh, **arrays)
    return trace


def load_trace(path) -> Trace:
    with np.load(path, allow_pickle=False) as data:
        missing = [k for k in ("features", "verified", "accepted") if k not in data.files]
        if missing:
            raise ValueError(f"trace {path}: missing arrays {missing} (has {data.files})")
        opt = {k: data[k] for k in OPTIONAL_COLUMNS if k in data.files}
        return Trace(data["features"], data["verified"], data["accepted"], **opt)


class TraceRecorder:
    """Collects one `add` per decode step and writes a trace.

    `add` keeps the (device) arrays as they are - nothing is copied to the host until `trace()`
    or `save()`, so recording does not synchronise the decode loop. Rows with
    ``verified == 0`` (idle slots) are dropped when the trace is built. ``request`` [B] (host
    ints, one per row) names each row's request; the trace has the column when every step gave it.
    """

    def __init__(self):
        self._steps: list[tuple[Any, Any, Any, Any, Any]] = []

    def add(self, features, verified, accepted, temperature=None, request=None):
        self._steps.append((features, verified, accepted, temperature, request))

    def __len__(self):
        return len(self._steps)

    def trace(self) -> Trace:
        if not self._steps:
            raise ValueError("trace recorder: no steps were recorded")
        feats, vers, accs, temps, steps, reqs = [], [], [], [], [], []
        has_t = all(t is not None for *_, t, _ in self._steps)
        has_r = all(r is not None for *_, r in self._steps)
        for i, (f, v, a, t, r) in enumerate(self._steps):
            f = np.asarray(f, np.float32)
            v = np.asarray(v).reshape(-1)
            a = np.asarray(a).reshape(-1)
            keep = v > 0
            feats.append(f.reshape(-1, f.shape[-1])[keep])
            vers.append(v[keep])
            accs.append(a[keep])
            if has_t:
                temps.append(np.broadcast_to(np.asarray(t, np.float32), v.shape)[keep])
            if has_r:
                reqs.append(np.asarray(r, np.int64).reshape(-1)[keep])
            steps.append(np.full(int(keep.sum()), i, np.int64))
        return Trace(
            np.concatenate(feats),
            np.concatenate(vers),
            np.concatenate(accs),
            np.concatenate(temps) if has_t else None,
            np.concatenate(steps),
            np.concatenate(reqs) if has_r else None,
        )

    def save(self, path) -> Trace:
        t = self.trace()
        return save_trace(path, t.features, t.verified, t.accepted, t.temperature, step=t.step, request=t.request)


# ----------------------------------------------------------------------------------- metrics


def _average_ranks(values: np.ndarray) -> np.ndarray:
    """1-based ranks, tied values sharing their average rank."""
    order = np.argsort(values, kind="mergesort")
    sorted_vals = values[order]
    new_group = np.r_[True, sorted_vals[1:] != sorted_vals[:-1]]
    starts = np.flatnonzero(new_group)
    counts = np.diff(np.r_[starts, values.size])
    avg = starts + (counts + 1) / 2.0
    ranks = np.empty(values.size, np.float64)
    ranks[order] = avg[np.cumsum(new_group) - 1]
    return ranks


def auc(scores, labels) -> float:
    """Area under the ROC curve by the Mann-Whitney rank formula (ties count 1/2).

    NaN when there are no positives or no negatives.
    """
    scores = np.asarray(scores, np.float64).reshape(-1)
    labels = np.asarray(labels, bool).reshape(-1)
    if scores.shape != labels.shape:
        raise ValueError(f"auc: scores {scores.shape} and labels {labels.shape} differ in size")
    if np.any(np.isnan(scores)):
        raise ValueError("auc: scores must not be NaN")
    n_pos = int(labels.sum())
    n_neg = labels.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    ranks = _average_ranks(scores)
    return float((ranks[labels].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def reliability_bins(pred, labels, bins: int = ECE_BINS) -> dict:
    """Equal-width bins over [0, 1]: count, mean prediction, observed frequency per bin."""
    pred = np.asarray(pred, np.float64).reshape(-1)
    labels = np.asarray(labels, np.float64).reshape(-1)
    idx = np.clip(np.floor(pred * bins).astype(np.int64), 0, bins - 1)
    count = np.bincount(idx, minlength=bins).astype(np.float64)
    sum_pred = np.bincount(idx, weights=pred, minlength=bins)
    sum_lab = np.bincount(idx, weights=labels, minlength=bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_pred = np.where(count > 0, sum_pred / count, np.nan)
        freq = np.where(count > 0, sum_lab / count, np.nan)
    return {
        "edges": np.linspace(0.0, 1.0, bins + 1).tolist(),
        "count": count.astype(int).tolist(),
        "mean_pred": mean_pred.tolist(),
        "freq": freq.tolist(),
    }


def ece(pred, labels, bins: int = ECE_BINS) -> float:
    """Expected calibration error: sum over bins of (n_bin / n) |mean pred - observed rate|."""
    pred = np.asarray(pred, np.float64).reshape(-1)
    if pred.size == 0:
        return float("nan")
    r = reliability_bins(pred, labels, bins)
    count = np.asarray(r["count"], np.float64)
    gap = np.abs(np.nan_to_num(np.asarray(r["mean_pred"]) - np.asarray(r["freq"])))
    return float(np.sum(count * gap) / pred.size)


# ---------------------------------------------------------------------------------- replay


def _group_calls(trace: Trace, batch_rows: int):
    """Row ranges of the replayed observe calls: one per step index, else fixed chunks."""
    S = trace.num_rows
    if trace.step is not None:
        bounds = np.flatnonzero(np.r_[True, trace.step[1:] != trace.step[:-1]]) if S else []
        starts = np.asarray(bounds, np.int64)
    else:
        starts = np.arange(0, S, batch_rows, dtype=np.int64)
    ends = np.r_[starts[1:], S].astype(np.int64)
    return starts, ends


@functools.cache
def _replay_fn():
    import jax

    @jax.jit
    def replay(state, x, verified, accepted, slots):
        def body(s, inp):
            xb, vb, ab, sb = inp
            _, surv = est.predict(s, xb, sb)  # predict before observe, as in serving
            return est.observe(s, xb, vb, ab, sb), surv

        return jax.lax.scan(body, state, (x, verified, accepted, slots))

    return replay


def history_slots(trace: Trace) -> np.ndarray:
    """The history slot of each row [S] int32: request ids numbered 1, 2, ... in order of first
    appearance (a slot per request, never reused), or 0 (no history) without the request column."""
    if trace.request is None:
        return np.zeros(trace.num_rows, np.int32)
    _, first, inverse = np.unique(trace.request, return_index=True, return_inverse=True)
    rank = np.empty(len(first), np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(len(first))
    return (rank[inverse] + 1).astype(np.int32)


def history_slot_count(trace: Trace) -> int:
    """The estimator's `num_slots` for replaying `trace` (`history_slots`): one per request, at
    least 1."""
    return 1 if trace.request is None else max(len(np.unique(trace.request)), 1)


def replay_online(trace: Trace, state=None, *, batch_rows: int = DEFAULT_BATCH_ROWS):
    """Run the estimator over the trace in order, each request's rows with its own history (a
    trace without request ids: none). -> (survival [S, P] float64, final state). A given state
    needs a history slot per request (`estimator.init(..., num_slots=...)`)."""
    import jax.numpy as jnp

    P = trace.num_positions
    slot_of_row = history_slots(trace)
    slots_needed = history_slot_count(trace)
    if state is None:
        state = est.init(P, num_slots=slots_needed)
    if state.num_positions != P:
        raise ValueError(f"estimator state has {state.num_positions} positions, the trace {P}")
    if state.history.shape[0] <= slots_needed:
        raise ValueError(
            f"estimator state has {state.history.shape[0] - 1} history slots, the trace "
            f"{slots_needed} requests (estimator.init(..., num_slots={slots_needed}))"
        )
    if batch_rows < 1:
        raise ValueError(f"batch_rows={batch_rows}: must be >= 1")
    starts, ends = _group_calls(trace, batch_rows)
    C = len(starts)
    if C == 0:
        return np.zeros((0, P)), state
    width = int(np.max(ends - starts))
    x = np.zeros((C, width, P), np.float32)
    v = np.zeros((C, width), np.int32)  # padding rows verify nothing: no labels
    a = np.zeros((C, width), np.int32)
    h = np.zeros((C, width), np.int32)  # padding rows: the null slot
    call = np.repeat(np.arange(C), ends - starts)
    slot = np.arange(trace.num_rows) - np.repeat(starts, ends - starts)
    x[call, slot] = trace.features
    v[call, slot] = trace.verified
    a[call, slot] = trace.accepted
    h[call, slot] = slot_of_row
    state, surv = _replay_fn()(state, jnp.asarray(x), jnp.asarray(v), jnp.asarray(a), jnp.asarray(h))
    surv = np.asarray(surv, np.float64)[call, slot]
    return surv, state


def baseline_survival(features) -> np.ndarray:
    """prod_{j<=k} q_max,j = prod sigmoid(x_j) (features cleaned as the estimator does)."""
    x = np.asarray(features, np.float64)
    x = np.where(np.isnan(x), -est.FEATURE_CLAMP, np.clip(x, -est.FEATURE_CLAMP, est.FEATURE_CLAMP))
    return np.cumprod(1.0 / (1.0 + np.exp(-x)), axis=-1)


def _scores(surv, base, mask, labels):
    return {
        "auc": auc(surv[mask], labels[mask]),
        "auc_baseline": auc(base[mask], labels[mask]),
        "ece": ece(surv[mask], labels[mask]),
        "ece_baseline": ece(base[mask], labels[mask]),
    }


def evaluate(trace: Trace, state=None, *, batch_rows: int = DEFAULT_BATCH_ROWS, replayed=None) -> dict:
    """Replay the estimator online over ``trace`` (from ``state``, default `estimator.init`) and
    score its survival predictions against the prod-q_max baseline.

    Samples are the verified (row, position) pairs; label = position < accepted. Returns a
    JSON-ready dict: overall ``auc``/``auc_baseline``/``ece``/``ece_baseline``, ``per_position``
    (n, accept rate, mean predictions, ECE and AUC of both), ``reliability`` bins per position,
    ``by_temperature`` (when the trace has temperatures) and the final coefficients. replayed: the
    (survival, final state) of `replay_online(trace, state, batch_rows=...)` when already run.
    """
    if not isinstance(trace, Trace):
        raise TypeError(f"evaluate: expected a Trace, got {type(trace).__name__}")
    surv, final = replay_online(trace, state, batch_rows=batch_rows) if replayed is None else replayed
    base = baseline_survival(trace.features)
    S, P = trace.features.shape
    k = np.arange(P)[None, :]
    mask = k < trace.verified[:, None]
    labels = k < trace.accepted[:, None]
    out = {
        "rows": S,
        "positions": P,
        "samples": int(mask.sum()),
        "calls": int(final.calls),
        "refits": sum(c <= int(final.calls) for c in final.early_refits) + int(final.calls) // final.refit_interval,
        **_scores(surv, base, mask, labels),
    }
    per_pos, rel_est, rel_base = [], [], []
    for j in range(P):
        m = mask[:, j]
        s_j, b_j, y_j = surv[m, j], base[m, j], labels[m, j]
        n = int(m.sum())
        per_pos.append(
            {
                "position": j,
                "n": n,
                "accept_rate": float(y_j.mean()) if n else float("nan"),
                "mean_survival": float(s_j.mean()) if n else float("nan"),
                "mean_baseline": float(b_j.mean()) if n else float("nan"),
                "ece": ece(s_j, y_j),
                "ece_baseline": ece(b_j, y_j),
                "auc": auc(s_j, y_j),
                "auc_baseline": auc(b_j, y_j),
            }
        )
        rel_est.append(reliability_bins(s_j, y_j))
        rel_base.append(reliability_bins(b_j, y_j))
    out["per_position"] = per_pos
    out["reliability"] = {"estimator": rel_est, "baseline": rel_base}
    if trace.temperature is not None:
        groups = {}
        temps = np.unique(trace.temperature)
        if temps.size <= 8:
            for t in temps:
                rows = trace.temperature == t
                groups[f"{float(t):g}"] = {"rows": int(rows.sum()), **_scores(surv, base, mask & rows[:, None], labels)}
        out["by_temperature"] = groups
    out["final_state"] = {
        "slope": float(final.slope),
        "history_slope": float(final.history_slope),
        "intercepts": [float(b) for b in np.asarray(final.intercepts)],
    }
    return out


# ------------------------------------------------------------------------------------- plot


def reliability_plot(result: dict, path_png) -> None:
    """Reliability diagrams (observed acceptance vs predicted survival, one curve per draft
    position) for the estimator and the prod-q_max baseline, written as a PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4.6), dpi=110)
    FigureCanvasAgg(fig)
    P = len(result["per_position"])
    panels = (
        ("estimator", "online estimator", result["auc"], result["ece"]),
        ("baseline", "prod q_max baseline", result["auc_baseline"], result["ece_baseline"]),
    )
    for i, (key, title, auc_v, ece_v) in enumerate(panels):
        ax = fig.add_subplot(1, 2, i + 1)
        ax.plot([0, 1], [0, 1], color="0.6", lw=1, ls="--", label="calibrated")
        for j, rel in enumerate(result["reliability"][key]):
            mp = np.asarray(rel["mean_pred"], np.float64)
            fr = np.asarray(rel["freq"], np.float64)
            ok = np.asarray(rel["count"]) >= MIN_PLOT_BIN  # near-empty bins are noise
            if ok.any():
                ax.plot(mp[ok], fr[ok], marker="o", ms=3, lw=1.2, label=f"pos {j}", color=_position_color(j, P))
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_aspect("equal")
        ax.set_xlabel("predicted survival")
        ax.set_ylabel("observed acceptance")
        ax.set_title(f"{title}\nAUC {_fmt(auc_v)}  ECE {_fmt(ece_v)}", fontsize=10)
        ax.grid(alpha=0.3)
        if i == 0:
            ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path_png)


def _position_color(j, P):
    from matplotlib import colormaps

    return colormaps["viridis"](j / max(P - 1, 1))


def _fmt(v, digits=4):
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}"


# -------------------------------------------------------------------------------------- CLI


def _json_ready(obj):
    if isinstance(obj, float):
        return None if not math.isfinite(obj) else obj
    if isinstance(obj, dict):
        return {k: _json_ready(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_ready(v) for v in obj]
    return obj


def format_report(result: dict) -> str:
    lines = [
        f"trace: {result['rows']} rows, {result['positions']} draft positions, "
        f"{result['samples']} verified samples, {result['calls']} observe calls, "
        f"{result['refits']} refits",
        f"AUC  estimator {_fmt(result['auc'])}   baseline (prod q_max) {_fmt(result['auc_baseline'])}",
        f"ECE  estimator {_fmt(result['ece'])}   baseline (prod q_max) {_fmt(result['ece_baseline'])}",
        "",
        f"{'pos':>3} {'n':>8} {'accept':>7} {'mean s':>7} {'ECE':>7} {'AUC':>7}"
        f"   {'mean q':>7} {'ECE q':>7} {'AUC q':>7}",
    ]
    for r in result["per_position"]:
        lines.append(
            f"{r['position']:>3} {r['n']:>8} {_fmt(r['accept_rate'], 3):>7} "
            f"{_fmt(r['mean_survival'], 3):>7} {_fmt(r['ece']):>7} {_fmt(r['auc']):>7}"
            f"   {_fmt(r['mean_baseline'], 3):>7} {_fmt(r['ece_baseline']):>7} "
            f"{_fmt(r['auc_baseline']):>7}"
        )
    for t, g in result.get("by_temperature", {}).items():
        lines.append(
            f"T={t}: {g['rows']} rows, AUC {_fmt(g['auc'])} vs "
            f"{_fmt(g['auc_baseline'])}, ECE {_fmt(g['ece'])} vs "
            f"{_fmt(g['ece_baseline'])}"
        )
    fs = result["final_state"]
    lines.append(
        f"final slope {fs['slope']:.4f}, history slope {fs['history_slope']:.4f}, intercepts "
        + " ".join(f"{b:.3f}" for b in fs["intercepts"])
    )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The `estimator` command's arguments (for a sub-parser of the main CLI)."""
    # imported here: `python -m jaxspec.cli` runs after `import jaxspec` (-> engine -> this module),
    # which must not have imported jaxspec.cli already
    from jaxspec.argtypes import non_negative_int, positive_int

    parser.add_argument("trace", help="trace .npz (features, verified, accepted[, temperature, step])")
    parser.add_argument("--plot", metavar="PNG", help="write a reliability plot")
    parser.add_argument("--json", action="store_true", help="print the full result as JSON")
    parser.add_argument(
        "--batch-rows",
        type=positive_int("--batch-rows"),
        default=DEFAULT_BATCH_ROWS,
        help="rows per replayed observe call when the trace has no step index",
    )
    parser.add_argument(
        "--refit-interval",
        type=positive_int("--refit-interval"),
        default=100,
        help="refit every N observe calls after the early refits (the engine's default: 100)",
    )
    parser.add_argument(
        "--first-refit",
        type=non_negative_int("--first-refit"),
        default=FIRST_REFIT,
        help="early refits at calls F, 2F, 4F, ... below --refit-interval "
        f"(0: none; the engine's default: {FIRST_REFIT})",
    )
    parser.add_argument(
        "--cost-table",
        help="cost table JSON (`jaxspec profile`): also replay the planner on the trace (recorded in static "
        "mode, with its step index) and report compact against static, and the trim frontier of the survival "
        "ranking (jaxspec.spec.replay)",
    )
    parser.add_argument(
        "--num-tiers", type=positive_int("--num-tiers"), default=4, help="verify tiers of the replayed ladder"
    )
    return parser


def run(args, parser: argparse.ArgumentParser) -> int:
    from jaxspec.argtypes import output_file_problem

    if args.plot and output_file_problem(args.plot):
        parser.error(f"argument --plot: {output_file_problem(args.plot)}")
    try:
        trace = load_trace(args.trace)
    except (OSError, ValueError, KeyError) as e:
        parser.error(f"argument trace: cannot read {args.trace!r}: {e}")
    costs = None
    if args.cost_table is not None:
        from jaxspec.spec.planner import CostTable

        try:
            costs = CostTable.load(args.cost_table)
        except (OSError, ValueError, KeyError) as e:
            parser.error(f"argument --cost-table: cannot read {args.cost_table!r}: {e}")
    state = est.init(
        trace.num_positions,
        refit_interval=args.refit_interval,
        first_refit=args.first_refit,
        num_slots=history_slot_count(trace),
    )
    replayed = replay_online(trace, state, batch_rows=args.batch_rows)  # once: the report, replay and frontier
    result = evaluate(trace, replayed=replayed)
    if costs is not None:
        from jaxspec.spec.replay import format_frontier, format_replay, replay_planner, trim_frontier

        try:
            result["planner_replay"] = replay_planner(trace, costs, num_tiers=args.num_tiers, survival=replayed[0])
        except ValueError as e:
            parser.error(f"argument --cost-table: {e}")
        result["trim_frontier"] = trim_frontier(trace, survival=replayed[0])
    if args.plot:
        reliability_plot(result, args.plot)
    if args.json:
        print(json.dumps(_json_ready(result)))
    else:
        print(format_report(result))
        if costs is not None:
            print()
            print(format_replay(result["planner_replay"]))
            if result["trim_frontier"] is not None:
                print()
                print(format_frontier(result["trim_frontier"]))
        if args.plot:
            print(f"reliability plot: {args.plot}")
    return 0


def main(argv=None) -> int:
    """``jaxspec estimator TRACE.npz [--plot out.png] [--json]``; returns the exit status."""
    parser = add_arguments(
        argparse.ArgumentParser(
            prog="jaxspec estimator", description="AUC and calibration of the online acceptance estimator on a trace"
        )
    )
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    return run(args, parser)


if __name__ == "__main__":
    sys.exit(main())
