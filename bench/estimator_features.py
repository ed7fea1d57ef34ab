"""Candidate second features for the acceptance estimator, scored offline on recorded traces.

Reads traces that carry the request id (`Engine(record_trace=True)`, e.g. `bench/acceptance.py
--traces`). For each candidate f [S, P] the logistic model

    p_k = sigmoid(a x_k + c f_k + b_k),      survival s_k = prod_{j<=k} p_j,

(x_k = logit q_max,k cleaned as the estimator does; one slope each, per-position intercepts) is
fitted by maximum likelihood (float64 Newton, ridge 1e-6) on the rows of the first half of the
requests (sorted by id) and scored on the rest: survival AUC and ECE over the held-out verified
(row, position) pairs, overall and per position (`calibration.auc`, `calibration.ece`), beside the
prod-q_max baseline, the one-feature fit (c = 0) and the engine's online estimator
(`calibration.replay_online` over the whole trace with its default schedule, scored on the same
rows). Training labels as `estimator.observe`: positions < accepted are 1, the first rejected
position (if verified) 0; scored samples as `calibration.evaluate`: positions < verified, label
position < accepted.

Candidates (every one known before the step is planned):
  hist_ema<L>   the request's log odds of acceptance so far, log((A + 1) / (N - A + 1)), A accepted
                and N observed positions of its earlier steps, a step of age j weighted L^j
  hist_resid<L> hist_ema<L> minus the same log odds of the baseline's expected acceptances
                (sum of q_max over the same observed positions): the request's excess over q_max
  hist_last     the request's accepted count at its previous step / P (0.5 at its first step)
  cum_x         sum_{j<k} log sigmoid(x_j), the draft's confidence before position k
  min_x         min_{j<=k} x_j
  x2            x_k^2 (curvature in the logit)
  <name>        any other [S, P] float array stored in the trace file (an instrumented recording)
and two references that are not candidates:
  x_perpos      one slope per position instead of the shared one (no second feature)
  oracle        a per-request intercept fitted on the held-out rows themselves: the most any
                request-level history feature could add (an in-sample ceiling, not a predictor)

Usage: python3 bench/estimator_features.py TRACE.npz [TRACE.npz ...] [--json OUT]
"""

import argparse
import json
import sys

import numpy as np

from jaxspec.spec import calibration as cal
from jaxspec.spec import estimator as est

RIDGE = 1e-6
ORACLE_RIDGE = 1e-3  # the per-request intercepts of a request with no rejection stay finite
NEWTON_STEPS = 60
EMA_DECAYS = (0.5, 0.9, 1.0)


def labels(trace):
    """-> observed [S, P] and y [S, P] (the estimator's training labels), sample [S, P] and
    survived [S, P] (the scored survival pairs)."""
    k = np.arange(trace.num_positions)[None, :]
    ver, acc = trace.verified[:, None], trace.accepted[:, None]
    pos = k < np.minimum(acc, ver)
    neg = (k == acc) & (acc < ver)
    return pos | neg, pos, k < ver, k < acc


def clean(x):
    """Features as `estimator.predict` sees them: clamped to +-40, NaN -> -40. float64 [S, P]."""
    x = np.asarray(x, np.float64)
    return np.where(np.isnan(x), -est.FEATURE_CLAMP, np.clip(x, -est.FEATURE_CLAMP, est.FEATURE_CLAMP))


def history_features(trace, x, decays=EMA_DECAYS):
    """Each row's request history before its step, in serving order (by step, then row).
    -> {name: [S] float64}."""
    S, P = x.shape
    observed, y, _, _ = labels(trace)
    q = 1.0 / (1.0 + np.exp(-x))
    step = trace.step if trace.step is not None else np.arange(S)
    dec = np.asarray(decays, np.float64)
    out = {f"hist_ema{d:g}": np.zeros(S) for d in decays}
    out.update({f"hist_resid{d:g}": np.zeros(S) for d in decays})
    out["hist_last"] = np.full(S, 0.5)
    seen = {}  # request -> (A, N, Q) per decay, last accepted
    for i in np.lexsort((np.arange(S), step)):
        zeros = np.zeros(len(decays))
        a, n, qs, last = seen.get(trace.request[i], (zeros, zeros, zeros, None))
        ema = np.log((a + 1.0) / (n - a + 1.0))
        resid = ema - np.log((qs + 1.0) / (n - qs + 1.0))
        for j, d in enumerate(decays):
            out[f"hist_ema{d:g}"][i], out[f"hist_resid{d:g}"][i] = ema[j], resid[j]
        if last is not None:
            out["hist_last"][i] = last / P
        obs = observed[i]
        seen[trace.request[i]] = (
            dec * a + y[i][obs].sum(),
            dec * n + obs.sum(),
            dec * qs + q[i][obs].sum(),
            trace.accepted[i],
        )
    return out


def row_features(x):
    """Features of the row's other positions and of x itself. -> {name: [S, P] float64}."""
    logq = -np.logaddexp(0.0, -x)  # log sigmoid(x)
    return {
        "cum_x": np.cumsum(logq, axis=1) - logq,
        "min_x": np.minimum.accumulate(x, axis=1),
        "x2": x * x,
    }


def extra_features(path, trace):
    """[S, P] float arrays of the trace file that are not trace columns. -> {name: float64}."""
    known = {"features", "verified", "accepted", *cal.OPTIONAL_COLUMNS}
    with np.load(path, allow_pickle=False) as data:
        return {
            k: np.asarray(data[k], np.float64)
            for k in data.files
            if k not in known and data[k].shape == trace.features.shape and np.issubdtype(data[k].dtype, np.floating)
        }


def fit(design, target, ridge=RIDGE):
    """Logistic maximum likelihood by Newton's method: design [n, d], target [n] in {0, 1}. -> [d]."""
    theta = np.zeros(design.shape[1])
    for _ in range(NEWTON_STEPS):
        p = 1.0 / (1.0 + np.exp(-(design @ theta)))
        g = design.T @ (target - p) - ridge * theta
        h = (design * (p * (1.0 - p))[:, None]).T @ design + ridge * np.eye(design.shape[1])
        step = np.linalg.solve(h, g)
        theta += step
        if np.max(np.abs(step)) < 1e-10:
            break
    return theta


def score(surv, sample, survived):
    """AUC / ECE of survival [S, P] over the pairs `sample`, overall and per position."""
    per = [
        {"auc": cal.auc(surv[m, k], survived[m, k]), "ece": cal.ece(surv[m, k], survived[m, k])}
        for k, m in enumerate(sample.T)
    ]
    return {
        "auc": cal.auc(surv[sample], survived[sample]),
        "ece": cal.ece(surv[sample], survived[sample]),
        "per_position": per,
    }


def analyse(trace, extras=None):
    """Fit on the first half of the requests, score on the rest. -> JSON-ready dict."""
    if trace.request is None:
        raise ValueError("the trace has no request column: record it with this engine (Engine(record_trace=True))")
    S, P = trace.features.shape
    x = clean(trace.features)
    observed, y, sample, survived = labels(trace)
    ids = np.unique(trace.request)
    test = np.isin(trace.request, ids[len(ids) // 2 :])
    train_obs, test_sample = observed & ~test[:, None], sample & test[:, None]
    eye = np.broadcast_to(np.eye(P), (S, P, P))

    def model(*columns):
        design = np.concatenate([c[..., None] if c.ndim == 2 else c for c in (*columns, eye)], axis=-1)
        theta = fit(design[train_obs], y[train_obs].astype(np.float64))
        surv = np.cumprod(1.0 / (1.0 + np.exp(-(design @ theta))), axis=1)
        return {"coef": theta[:-P].tolist(), **score(surv, test_sample, survived)}

    online, _ = cal.replay_online(trace)
    out = {
        "rows": S,
        "requests": len(ids),
        "held_out_rows": int(test.sum()),
        "baseline": score(cal.baseline_survival(trace.features), test_sample, survived),
        "online": score(online, test_sample, survived),
        "x_only": model(x),
        "x_perpos": model(eye * x[..., None]),
    }
    candidates = {k: np.broadcast_to(v[:, None], (S, P)) for k, v in history_features(trace, x).items()}
    candidates.update(row_features(x))
    candidates.update(extras or {})
    for name, f in candidates.items():
        out[name] = model(x, f)
    requests = np.unique(trace.request[test])
    onehot = np.zeros((S, len(requests)))
    onehot[test, np.searchsorted(requests, trace.request[test])] = 1.0
    design = np.concatenate([x[..., None], eye, np.broadcast_to(onehot[:, None, :-1], (S, P, len(requests) - 1))], -1)
    fit_obs = observed & test[:, None]
    theta = fit(design[fit_obs], y[fit_obs].astype(np.float64), ORACLE_RIDGE)
    out["oracle"] = score(np.cumprod(1.0 / (1.0 + np.exp(-(design @ theta))), axis=1), test_sample, survived)
    return out


def format_result(name, r):
    base = r["baseline"]
    lines = [
        f"{name}: {r['rows']} rows, {r['requests']} requests, {r['held_out_rows']} held-out rows",
        f"{'model':>14} {'AUC':>7} {'-base':>7} {'ECE':>6}   per-position AUC - baseline's{'':13}| per-position ECE",
    ]
    for key, v in r.items():
        if isinstance(v, dict):
            d_pos = " ".join(f"{p['auc'] - b['auc']:+.3f}" for p, b in zip(v["per_position"], base["per_position"]))
            e_pos = " ".join(f"{p['ece']:.3f}" for p in v["per_position"])
            lines.append(
                f"{key:>14} {v['auc']:7.4f} {v['auc'] - base['auc']:+7.4f} {v['ece']:6.4f}   {d_pos} | {e_pos}"
            )
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+", help="trace .npz files with a request column")
    ap.add_argument("--json", help="also write the results as JSON here")
    args = ap.parse_args(argv)
    results = {}
    for path in args.traces:
        trace = cal.load_trace(path)
        results[path] = analyse(trace, extra_features(path, trace))
        print(format_result(path, results[path]), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
