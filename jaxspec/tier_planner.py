"""Host-side tier planning: the verify tier of each step, chosen on the host.

Model-free and scheduling only: it reads the rows' requests and the lagged survivals and never
runs the model. The only jax arrays it builds are a `DevicePlan`'s cost matrix and placeholder
survivals (tier_dispatch "switch": the step chooses the tier on the device, jaxspec/step.py).
docs/design.md section 7.
"""

import functools
import itertools

import jax.numpy as jnp
import numpy as np

from jaxspec.config import PLANNED_MODES, SpecConfig
from jaxspec.spec import estimator, layout
from jaxspec.spec.planner import CostTable, trim_overhead
from jaxspec.step import DevicePlan


def timed_for_another_step(table: CostTable, window: int, trim_draft: bool) -> str | None:
    """The field of `table.metadata` ("window", then "trim_draft", as `Engine.profile` records them)
    whose value differs from a step of `window` tokens with this draft forward, or None (they
    match, or the table does not record them)."""
    timed_window, timed_trim = table.metadata.get("window"), table.metadata.get("trim_draft")
    if timed_window is not None and timed_window != window:
        return "window"
    if timed_trim is not None and bool(timed_trim) != trim_draft:
        return "trim_draft"
    return None


class TierPlanner:
    """The verify tier of each step, model-free: chosen on the host (tier_dispatch "host",
    `choose_tier`) or handed to the device as a DevicePlan (tier_dispatch "switch",
    `device_plan`; the step applies the same rule, `device_tier`). An Engine plans through its
    `tier_planner`; a benchmark can time one alone.

    spec: the engine's SpecConfig (verify_mode, num_slots, num_tiers and the estimator's refit
    schedule, which sets the warm-up); window: the tokens a request verifies at most (anchor +
    drafts); cost_table: the profiled CostTable, None or trivial = verify everything.
    tier_tokens: the tier ladder, `layout.tiers(num_slots, window, num_tiers)`.

    The rows and history the methods read: rows, the request of each slot 1..num_slots (None =
    idle; compared by identity); old, (rows, survival [num_slots, window - 1]) of the step `lag`
    steps back, or None; steps_run, the device steps dispatched so far (the warm-up counts them).
    """

    def __init__(self, spec: SpecConfig, window: int, cost_table: CostTable | None = None):
        self.spec, self.window = spec, window
        self.cost_table = cost_table
        self.tier_tokens, _ = layout.tiers(spec.num_slots, window, spec.num_tiers)
        self._costs, self._ladders = None, {}  # (cost table, *`_cost_matrix`), {n: `_ladder(n)`}

    @property
    def cost_table(self) -> CostTable | None:
        """The profiled costs (assignable). In the modes that plan from it (cap-accept, compact) a
        table whose metadata records the verify window or the draft forward it was timed with
        (`Engine.profile`: "window", "trim_draft") must match this planner's: a step of another
        window or draft forward costs otherwise."""
        return self._cost_table

    @cost_table.setter
    def cost_table(self, table: CostTable | None):
        if table is not None and self.spec.verify_mode in PLANNED_MODES:
            field = timed_for_another_step(table, self.window, self.spec.trim_draft)
            if field == "window":
                raise ValueError(
                    f"cost_table: profiled with verify windows of {table.metadata['window']} tokens, this engine "
                    f"verifies {self.window}"
                )
            if field == "trim_draft":
                raise ValueError(
                    f"cost_table: profiled with trim_draft={bool(table.metadata['trim_draft'])}, this engine has "
                    f"{self.spec.trim_draft}"
                )
        self._cost_table = table

    @functools.cached_property
    def warmup_steps(self) -> int:
        """Steps that verify full blocks before compact / cap-accept plan: those before the
        estimator's `warmup_refits`-th refit (its schedule: `estimator.refit_calls`)."""
        spec = self.spec
        refits = estimator.refit_calls(
            spec.warmup_refits, refit_interval=spec.refit_interval, first_refit=spec.first_refit
        )
        return refits[-1] if refits else 0

    def plans(self, old, steps_run: int) -> bool:
        """Whether the next step plans a budget: not in modes none and static, during warm-up,
        without the step `lag` back (old is None) or without profiled costs (then it verifies
        everything)."""
        return not (
            self.spec.verify_mode in ("none", "static")
            or steps_run < self.warmup_steps
            or old is None
            or self.cost_table is None
            or self.cost_table.is_trivial
        )

    def choose_tier(self, rows, old, steps_run: int, host_seconds: float = 0.0) -> int:
        """The tier tokens of the next step, chosen on the host by the device's rule
        (`planner.choose_tier`: the first tier maximising tau(budget) / cost, with the same cost
        matrix) over the lagged survivals read back from the device: the full block unless
        `plans`; a request that was not in its slot `lag` steps back counts its survivals as 1.
        host_seconds: the host's own time a step (`Engine.host_seconds`); a step costs at least
        that whatever its tier, so each cost is max(table, host_seconds) and where the host alone
        takes the full block's time no trim can shorten the step: the full block, no survivals read.
        Plain Python over S x (window - 1) floats: at one request the engine's host loop bounds
        the step, and a dozen numpy calls cost it ~10% (bench/RESULTS.md)."""
        if not self.plans(old, steps_run):
            return self.tier_tokens[-1]
        n = sum(req is not None for req in rows)
        tiers, budgets, costs, full, settled = self._ladder(n)
        if settled is not None:  # the full block wins whatever the survivals: none read back
            return settled
        floor = float(np.float32(host_seconds))  # as the device's float32 cost matrix holds it
        if floor >= costs[full]:  # host-bound: every tier costs the host's time
            return tiers[full]
        old_rows, old_survival = old
        old_survival = np.asarray(old_survival).tolist()
        newcomer = [1.0] * (self.window - 1)  # assume acceptance
        flat = []
        for i, req in enumerate(rows):
            if req is not None:
                flat += old_survival[i] if req is old_rows[i] else newcomer
        top = sorted((0.0 if x != x else x for x in flat), reverse=True)  # NaN counts as 0
        tau = list(itertools.accumulate(top, initial=float(n)))  # tau[b]: n + the b largest
        rates = [tau[b] / max(c, floor) for b, c in zip(budgets, costs)]
        return tiers[rates.index(max(rates))]

    def _ladder(self, n: int):
        """At n active rows, over the tiers holding n rows, smallest first: (the tier each runs,
        its admissible draft budget min(tier - n, n (window - 1)), that budget's cost from
        `_cost_matrix`), as lists, the index of the full block's budget n (window - 1) in them, and
        the settled tier: the full block's tier where every budget
        that trims drafts costs strictly more than the full block (its rate tau(b) / c(b) is then
        below the full block's for any survivals, tau being non-decreasing), else None; a budget
        runs in the smallest tier holding n + budget tokens (`layout.tier_for`). A table flat
        within `plan_overhead` settles every n: the host then reads no survivals."""
        costs = self._cost_matrix()[0]
        if n not in self._ladders:
            d = self.window - 1
            j = [j for j, tier in enumerate(self.tier_tokens) if tier >= n]
            budgets = [min(self.tier_tokens[i] - n, n * d) for i in j]
            tiers = [self.tier_tokens[layout.tier_for(n + b, self.tier_tokens)] for b in budgets]
            ladder_costs = [float(c) for c in costs[n, j]]
            full = budgets.index(n * d)
            trims = [c for b, c in zip(budgets, ladder_costs) if b < n * d]
            settled = tiers[full] if all(c > ladder_costs[full] for c in trims) else None
            self._ladders[n] = (tiers, budgets, ladder_costs, full, settled)
        return self._ladders[n]

    def _cost_matrix(self):
        """(costs [S + 1, tiers] float32 numpy, trims [S + 1, tiers] bool numpy, placeholder
        survivals [S, window - 1] on the device): the price of tier j's admissible budget b at n
        active rows, built once per cost table (1 s everywhere without a table): its profiled step
        time, plus `SpecConfig.plan_overhead` x the full block's (n + n (window - 1) tokens) where
        b < n (window - 1) trims drafts (`planner.choose_budget`'s price); trims marks those b."""
        if self._costs is None or self._costs[0] is not self.cost_table:
            s, d = self.spec.num_slots, self.window - 1
            costs = np.ones((s + 1, len(self.tier_tokens)), np.float32)
            trims = np.zeros(costs.shape, bool)
            for n in range(1, s + 1):
                for j, tier in enumerate(self.tier_tokens):
                    budget = min(tier - n, n * d)
                    trims[n, j] = budget < n * d
                    if tier >= n and self.cost_table is not None and not self.cost_table.is_trivial:
                        trim = trim_overhead(self.cost_table, n, budget, d, self.spec.plan_overhead)
                        costs[n, j] = self.cost_table.step_time(n, n + budget) + trim
            self._costs = (self.cost_table, costs, trims, jnp.ones((s, d), jnp.float32))
            self._ladders = {}
        return self._costs[1:]

    def device_plan(self, rows, old, steps_run: int, host_seconds: float = 0.0) -> DevicePlan:
        """`choose_tier`'s inputs for the device: nothing is read back; the lagged survivals stay
        on the device (plan, same and costs go as numpy: the step's call transfers them).
        host_seconds as in `choose_tier`: every cost raised to it, and at the row counts where the
        host alone takes the full block's time the budgets that trim priced out (1e9 s), so the
        device runs the full block there as the host would."""
        plans = self.plans(old, steps_run)
        costs, trims, ones = self._cost_matrix()
        floor = np.float32(host_seconds)
        if plans and floor > 0:
            host_bound = floor >= costs[:, -1:]  # [S + 1, 1]: the last tier holds every full block
            costs = np.where(host_bound & trims, np.float32(1e9), np.maximum(costs, floor))
        same = np.array([plans and req is not None and req is old[0][i] for i, req in enumerate(rows)], bool)
        return DevicePlan(plan=np.asarray(plans), survival=old[1] if plans else ones, same=same, costs=costs)

    def forcing(self, tier: int) -> DevicePlan:
        """A DevicePlan under which the device chooses `tier` (one of `tier_tokens`) whenever its
        budget fits the active rows (tier - active <= active * (window - 1); else the smallest tier
        that holds them all): that tier's costs are 1e-9 s, the others' 1e9 s; survivals 1."""
        s, d = self.spec.num_slots, self.window - 1
        costs = np.full((s + 1, len(self.tier_tokens)), 1e9, np.float32)
        costs[:, self.tier_tokens.index(tier)] = 1e-9
        return DevicePlan(
            plan=np.asarray(True),
            survival=jnp.ones((s, d), jnp.float32),
            same=np.ones((s,), bool),
            costs=costs,
        )
