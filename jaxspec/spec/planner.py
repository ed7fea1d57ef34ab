"""Confidence-scheduled verification: how many drafts to verify, and which (docs/design.md section 7).

Two halves, split by where they run:

- `choose_budget` (host, numpy): the total number of drafts n* a step verifies, maximising the
  expected committed tokens per second tau(n) / c(n) over the budgets a tier can realise. It
  decides the tier (a static shape), so it runs on survivals `lag` steps old and never waits
  for the device.
- `plan_lengths` (device, jittable): which drafts, given the budget: the top-n candidates in
  the total order (survival descending, position ascending, request ascending); per request a
  prefix of its drafts, returned as its length.

`CostTable` holds the profiled step times the budget is priced with.
"""

from __future__ import annotations

import bisect
import datetime
import json
import math
from collections.abc import Iterable, Mapping

import jax.numpy as jnp
import numpy as np

COST_TABLE_VERSION = 1


class CostTable:
    """Measured step times: entries {(batch, total verify tokens): seconds}.

    Interpolation (`step_time(batch, tokens)`):
    - within one measured batch: piecewise linear in tokens between its measured token counts,
      clamped (constant) below the smallest and above the largest one;
    - across batches: the two nearest measured batches around `batch` are each interpolated in
      tokens as above, then blended linearly in batch; a batch below the smallest (above the
      largest) measured batch uses that batch's curve alone (clamped).
    The profiler measures every tier of every profiled batch, so the planner's queries (a tier
    of a measured batch) hit measured points exactly; interpolation only serves other batches.

    Monotone in tokens: at one batch a step that computes more tokens cannot cost less, so a
    tier costs at most what any larger tier was measured at, and each batch's curve is that bound,
    the least measurement at its token count or above (`monotone_costs`); `entries` keep the
    measurements. Timing noise only adds time (a neighbour's burst, a GPU clock ramping up under
    the first tiers timed), so where a small tier measured dearer than a larger one the larger
    one's time is the better estimate of both, and noise is not read as a saving the planner
    would trim drafts for.

    A table with a single probe (or none) carries no information about how cost grows with the
    token count: it `is_trivial`, and the planner then verifies everything.

    metadata: free-form JSON-able dict; `save` records `device` (the default JAX device, unless
    given), `date` (UTC, ISO 8601, unless given) and `model` (when given). Its "noise", when
    present, is the profile's own timing noise (`noise`).
    """

    def __init__(
        self,
        entries: Mapping | None = None,
        metadata: Mapping | None = None,
        *,
        model: str | None = None,
        device: str | None = None,
        date: str | None = None,
    ):
        self.entries: dict[tuple[int, int], float] = {}
        for key, seconds in dict(entries or {}).items():
            batch, tokens = key
            if not (_is_int(batch) and _is_int(tokens) and batch >= 1 and tokens >= 1):
                raise ValueError(f"CostTable: entry key {key!r} must be (batch >= 1, tokens >= 1) ints")
            seconds = float(seconds)
            if not (math.isfinite(seconds) and seconds > 0):
                raise ValueError(f"CostTable: entry {key!r} = {seconds!r} must be a finite positive time")
            self.entries[(int(batch), int(tokens))] = seconds
        self.metadata: dict = dict(metadata or {})
        for name, value in (("model", model), ("device", device), ("date", date)):
            if value is not None:
                self.metadata[name] = value
        noise = self.metadata.get("noise", 0.0)
        if not (_is_real(noise) and math.isfinite(noise) and noise >= 0):
            raise ValueError(f"CostTable: metadata noise={noise!r} must be a finite number >= 0")
        curves: dict[int, list[tuple[int, float]]] = {}
        for (batch, tokens), seconds in sorted(self.entries.items()):
            curves.setdefault(batch, []).append((tokens, seconds))
        self._batches = sorted(curves)
        self._curves = {
            b: (np.array([t for t, _ in c], np.float64), monotone_costs([s for _, s in c])) for b, c in curves.items()
        }

    @property
    def is_trivial(self) -> bool:
        """A single probe or none: no cost model, verify everything."""
        return len(self.entries) <= 1

    @property
    def noise(self) -> float:
        """The profile's timing noise, relative (metadata "noise", 0.0 where absent): the median over
        entries of how far an entry's slowest round ran above its fastest (`Engine.profile`). Two
        tiers whose times differ by less than this are not told apart by the table, so a trimmed
        budget is priced at least this share of the full block above its table time
        (`trim_overhead`)."""
        return float(self.metadata.get("noise", 0.0))

    @property
    def batches(self) -> tuple[int, ...]:
        return tuple(self._batches)

    def __len__(self):
        return len(self.entries)

    def __repr__(self):
        return f"CostTable({len(self.entries)} entries, batches={self.batches}, metadata={self.metadata})"

    def _curve(self, batch: int, tokens: float) -> float:
        xs, ys = self._curves[batch]
        return float(np.interp(tokens, xs, ys))  # np.interp clamps outside [xs[0], xs[-1]]

    def step_time(self, batch: int, tokens: int) -> float:
        """Interpolated seconds of a step of `batch` requests verifying `tokens` tokens in all."""
        if not self._batches:
            raise ValueError("CostTable.step_time: the table is empty")
        bs = self._batches
        if batch <= bs[0]:
            return self._curve(bs[0], tokens)
        if batch >= bs[-1]:
            return self._curve(bs[-1], tokens)
        hi = bisect.bisect_left(bs, batch)
        if bs[hi] == batch:
            return self._curve(batch, tokens)
        b0, b1 = bs[hi - 1], bs[hi]
        w = (batch - b0) / (b1 - b0)
        return (1 - w) * self._curve(b0, tokens) + w * self._curve(b1, tokens)

    def to_json(self) -> dict:
        return {
            "version": COST_TABLE_VERSION,
            "metadata": self.metadata,
            "entries": [{"batch": b, "tokens": t, "seconds": s} for (b, t), s in sorted(self.entries.items())],
        }

    @classmethod
    def from_json(cls, obj: Mapping) -> CostTable:
        if obj.get("version") != COST_TABLE_VERSION:
            raise ValueError(f"CostTable: unsupported version {obj.get('version')!r} (expected {COST_TABLE_VERSION})")
        return cls({(e["batch"], e["tokens"]): e["seconds"] for e in obj["entries"]}, obj.get("metadata") or {})

    def save(self, path) -> None:
        """Write JSON; fills metadata `device` and `date` when absent."""
        if "device" not in self.metadata:
            self.metadata["device"] = _default_device()
        if "date" not in self.metadata:
            self.metadata["date"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1)
            f.write("\n")

    @classmethod
    def load(cls, path) -> CostTable:
        """The table a `save` wrote to `path`; ValueError naming the file when it holds none."""
        with open(path) as f:
            try:
                return cls.from_json(json.load(f))
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise ValueError(f"{path}: not a cost table ({type(e).__name__}: {e})") from None


def monotone_costs(values) -> np.ndarray:
    """Costs measured at increasing token counts -> the non-decreasing bound float64 [n]:
    out[i] = min(values[i:]), the least time measured at token count i or above (a step that
    computes fewer tokens costs no more than one that computes more)."""
    return np.minimum.accumulate(np.asarray(values, np.float64)[::-1])[::-1].copy()


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


def _default_device() -> str:
    try:
        import jax

        d = jax.devices()[0]
        return f"{d.platform}:{d.device_kind}"
    except Exception:  # pragma: no cover - no backend at all
        return "unknown"


def expected_tokens(survival) -> np.ndarray:
    """tau(n) for n = 0..B*D: B + the sum of the n largest survivals (NaN counts as 0, sorts last). [B*D + 1]."""
    s = np.asarray(survival, np.float64)
    if s.ndim != 2:
        raise ValueError(f"survival must be [B, D], got shape {s.shape}")
    flat = s.reshape(-1)
    flat = np.where(np.isnan(flat), -np.inf, flat)
    top = -np.sort(-flat)  # descending, NaN (-inf) last
    top = np.where(np.isfinite(top), top, 0.0)
    return s.shape[0] + np.concatenate([[0.0], np.cumsum(top)])


def choose_budget(
    survival, cost_table: CostTable, admissible: Iterable[int], *, overhead: float = 0.0, plan_overhead: float = 0.0
) -> int:
    """The draft budget n in `admissible` maximising tau(n) / c(n) (host, numpy).

    survival [B, D]: estimated acceptance probability of each draft (rows non-increasing; only
    the multiset matters here). tau(n) = B + the n largest survivals; c(n) =
    cost_table.step_time(B, B + n) + overhead (overhead: per-step seconds outside the verify, e.g.
    the draft, when the table does not include them), plus plan_overhead x c(B D) for a budget
    n < B D that trims drafts (`SpecConfig.plan_overhead`: what a trimmed step costs beyond the
    table). First maximum wins, scanning budgets ascending, so ties go to the smallest n. A
    trivial table returns max(admissible).
    """
    survival = np.asarray(survival)
    budgets = sorted(int(n) for n in admissible)
    if not budgets:
        raise ValueError("choose_budget: no admissible budget")
    if survival.ndim != 2:
        raise ValueError(f"choose_budget: survival must be [B, D], got shape {survival.shape}")
    b, d = survival.shape
    if budgets[0] < 0 or budgets[-1] > b * d:
        raise ValueError(f"choose_budget: admissible budgets {budgets} must lie in 0..B*D = {b * d}")
    if cost_table is None or cost_table.is_trivial or b == 0:
        return budgets[-1]
    tau = expected_tokens(survival)
    best, best_rate = budgets[0], -math.inf
    for n in budgets:
        cost = cost_table.step_time(b, b + n) + trim_overhead(cost_table, b, n, d, plan_overhead)
        rate = tau[n] / (cost + overhead)
        if rate > best_rate:
            best, best_rate = n, rate
    return best


def trim_overhead(cost_table: CostTable, rows: int, budget: int, drafts_per_row: int, plan_overhead: float) -> float:
    """Seconds a step of `rows` requests pays beyond its table time for trimming drafts:
    max(plan_overhead, the table's measured noise) x the full block's step time (rows
    (drafts_per_row + 1) tokens) when budget < rows x drafts_per_row, else 0
    (`SpecConfig.plan_overhead`, `CostTable.noise`): a trim must save more than what the table
    cannot tell from noise."""
    if budget >= rows * drafts_per_row:
        return 0.0
    share = max(plan_overhead, cost_table.noise)
    return share * cost_table.step_time(rows, rows * (drafts_per_row + 1))


def choose_tier(survival, active, costs, tiers, drafts_per_row):
    """`choose_budget`'s rule on the device (jittable): the index of the verify tier.

    survival [S, D] float32 (rows of inactive slots ignored), active bool [S], costs [S + 1,
    len(tiers)] (seconds of tier j's admissible budget at n active rows), tiers ascending token
    counts, drafts_per_row static. With n active rows the budget of tier j is min(tier_j - n,
    n * drafts_per_row); the tier whose budget maximises tau / c wins (first maximum), and the
    index returned is that of the smallest tier holding n + budget tokens. Same choice as the host
    rule up to float32 rounding of tau / c in near-ties.
    """
    n = jnp.sum(active, dtype=jnp.int32)
    s = jnp.where(active[:, None], survival, -jnp.inf).reshape(-1)
    top = -jnp.sort(-jnp.where(jnp.isnan(s), -jnp.inf, s))
    tau = n + jnp.concatenate([jnp.zeros((1,), jnp.float32), jnp.cumsum(jnp.where(jnp.isfinite(top), top, 0.0))])
    tiers = jnp.asarray(tiers, jnp.int32)
    budgets = jnp.clip(jnp.minimum(tiers - n, n * drafts_per_row), 0, s.shape[0])
    rate = jnp.where(tiers >= n, tau[budgets] / costs[n], -jnp.inf)
    best = budgets[jnp.argmax(rate)]
    return jnp.searchsorted(tiers, n + best, side="left").astype(jnp.int32)


def plan_lengths(survival, budget):
    """Drafts to verify per request: int32 [B] (device, jittable; `budget` may be traced).

    Takes the top `budget` candidates (request r, draft position k) of survival [B, D] in the
    total order: survival descending, then position ascending, then request ascending (NaN
    survivals count as -inf, i.e. last; -0.0 equals 0.0). Returns, per request, the number of
    its candidates chosen. With rows non-increasing that set is a prefix of the row, so the
    count is the prefix length; with a non-monotone row the count is still returned (and read
    as a prefix length by the caller). Budgets outside 0..B*D are clamped; sum(lengths) =
    clip(budget, 0, B*D).
    """
    s = jnp.asarray(survival, jnp.float32)
    b, d = s.shape
    key = -jnp.where(jnp.isnan(s), -jnp.inf, s)
    key = jnp.where(key == 0, jnp.zeros((), key.dtype), key)  # -0.0 and 0.0 tie
    request = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, d)).reshape(-1)
    position = jnp.broadcast_to(jnp.arange(d, dtype=jnp.int32)[None, :], (b, d)).reshape(-1)
    # lexsort: the last key is the primary one. (survival, position, request) pairs are distinct,
    # so the order is total and stability never matters.
    order = jnp.lexsort((request, position, key.reshape(-1)))
    rank = jnp.zeros((b * d,), jnp.int32).at[order].set(jnp.arange(b * d, dtype=jnp.int32))
    chosen = rank < jnp.asarray(budget, jnp.int32)
    return chosen.reshape(b, d).sum(axis=1, dtype=jnp.int32)
