"""Simulated acceptance (`config.SimulatedAcceptance`): the device rule the engine's step applies
in place of chain acceptance, and the host calibration of its intercept.

Benchmarks of random-weight models use it: their drafts are never accepted, yet the draft and
verify costs, and the feature the estimator reads, are the real ones. Position k of a verified
window is accepted with probability p_k = sigmoid(a * x_k + b), x_k = logit(q_max) the draft
feature, independently, and the chain stops at the first rejection, so the mean accept length
of a row is 1 + sum_k prod_{j<=k} p_j (the bonus token counts one).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def accept(params, keys, features, num_verify, drafts, target_probs, target_ids):
    """The simulated decision for one step of B requests (device, jittable).

    params (a, b, seed): float32 [], float32 [], uint32 [] (traced: one compiled step serves
    every setting); keys [B, 2] raw (the step's acceptance keys); features [B, T-1] (x); num_verify
    [B] int32 (drafts verified, l); drafts [B, T-1]; target_probs / target_ids [B, T, K] (the
    processed target distribution; K = 1 on a greedy step).
    -> (num_accepted [B] in 0..l, bonus [B], emitted [B, T]: the accepted drafts, the bonus, then
    -1), the shapes and meaning of `sampling.accept`'s. A non-finite feature is rejected. The bonus
    is drawn from the target's row a (its argmax on greedy rows, where K = 1 or probs are one-hot).
    """
    a, b, seed = params
    t_len = target_probs.shape[1]

    def one(key, x, n, d, probs, ids):
        key_u, key_bonus = jax.random.split(jax.random.fold_in(key, seed))
        u = jax.random.uniform(key_u, x.shape, jnp.float32)
        ok = (u < jax.nn.sigmoid(a * x.astype(jnp.float32) + b)) & (jnp.arange(t_len - 1) < n)
        acc = jnp.sum(jnp.cumprod(ok.astype(jnp.int32))).astype(jnp.int32)
        idx = jax.random.categorical(key_bonus, jnp.log(probs[acc]))
        bonus = ids[acc, idx].astype(jnp.int32)
        pos = jnp.arange(t_len)
        padded = jnp.concatenate([d.astype(jnp.int32), jnp.zeros((1,), jnp.int32)])
        emitted = jnp.where(pos < acc, padded, jnp.where(pos == acc, bonus, -1)).astype(jnp.int32)
        return acc, bonus, emitted

    n = jnp.clip(num_verify.astype(jnp.int32), 0, t_len - 1)
    return jax.vmap(one)(keys, features, n, drafts, target_probs.astype(jnp.float32), target_ids)


def expected_accept_length(x, a: float, b: float) -> float:
    """Mean accept length over rows of features x [N, D] (every drafted position verified):
    1 + mean_rows sum_k prod_{j<=k} sigmoid(a x_j + b). Non-finite features count as rejected."""
    x = np.asarray(x, np.float64)
    z = np.where(np.isfinite(x), a * np.nan_to_num(x) + b, -np.inf)
    p = 1.0 / (1.0 + np.exp(-z))
    return float(1.0 + np.mean(np.sum(np.cumprod(p, axis=1), axis=1)))


def calibrate(x, mean_length: float, *, slope: float = 2.0) -> dict:
    """(a, b) giving `mean_length` by `expected_accept_length` on features x [N, D] (host).

    a = slope / std(x): `slope` is the change of the acceptance logit per standard deviation of
    the observed feature, so the decision depends on x at any feature scale (a = 0 when x does not
    vary); b is found by bisection (the length increases with b). mean_length must lie in
    (1, D + 1). Returns {"a", "b", "slope", "mean_length" (target), "predicted" (at (a, b)),
    "x": {"rows", "mean", "std", "p05", "p50", "p95"}}.
    """
    x = np.asarray(x, np.float64)
    if x.ndim != 2 or x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError(f"calibrate: features must be [N >= 1, D >= 1], got shape {x.shape}")
    d = x.shape[1]
    if not 1.0 < mean_length < d + 1:
        raise ValueError(f"calibrate: mean_length={mean_length} must lie in (1, {d + 1}) for {d} drafts a row")
    finite = x[np.isfinite(x)]
    if finite.size == 0:
        raise ValueError("calibrate: no finite feature")
    std = float(np.std(finite))
    a = slope / std if std > 0 else 0.0
    lo, hi = -60.0 - abs(a) * float(np.max(np.abs(finite))), 60.0 + abs(a) * float(np.max(np.abs(finite)))
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if expected_accept_length(x, a, mid) < mean_length:
            lo = mid
        else:
            hi = mid
    b = 0.5 * (lo + hi)
    q = np.percentile(finite, [5, 50, 95])
    return {
        "a": a,
        "b": b,
        "slope": slope,
        "mean_length": mean_length,
        "predicted": expected_accept_length(x, a, b),
        "x": {
            "rows": int(x.shape[0]),
            "mean": float(np.mean(finite)),
            "std": std,
            "p05": float(q[0]),
            "p50": float(q[1]),
            "p95": float(q[2]),
        },
    }
