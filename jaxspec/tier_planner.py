"""Host-side tier planning: the verify tier of each step, from numpy on the host.

Model-free and scheduling only: it reads the rows' requests and the lagged survivals and never
runs the model. The only jax arrays it builds are a `DevicePlan`'s cost matrix and placeholder
survivals (tier_dispatch "switch": the step chooses the tier on the device, jaxspec/step.py).
docs/design.md section 7.
"""

import jax.numpy as jnp
import numpy as np

from jaxspec.config import SpecConfig
from jaxspec.spec import estimator, layout, planner
from jaxspec.spec.planner import CostTable
from jaxspec.step import DevicePlan


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
        self.spec, self.window, self.cost_table = spec, window, cost_table
        self.tier_tokens, _ = layout.tiers(spec.num_slots, window, spec.num_tiers)
        self._costs = None  # (cost table, its device cost matrix, placeholder survivals)

    @property
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

    def choose_tier(self, rows, old, steps_run: int) -> int:
        """The tier tokens of the next step, chosen on the host (`planner.choose_budget` over the
        ladder's admissible budgets; reads the lagged survival back from the device). The full
        block unless `plans`; a request that was not in its slot `lag` steps back counts its
        survivals as 1."""
        full = self.tier_tokens[-1]
        if not self.plans(old, steps_run):
            return full
        old_rows, old_survival = old
        old_survival = np.asarray(old_survival)
        survival = [
            old_survival[i] if req is old_rows[i] else np.ones(self.window - 1, np.float32)
            for i, req in enumerate(rows)
            if req is not None
        ]  # a newcomer: assume acceptance
        n = len(survival)
        admissible = sorted({min(t - n, n * (self.window - 1)) for t in self.tier_tokens if t >= n})
        budget = planner.choose_budget(np.stack(survival), self.cost_table, admissible)
        return self.tier_tokens[layout.tier_for(n + budget, self.tier_tokens)]

    def device_plan(self, rows, old, steps_run: int) -> DevicePlan:
        """`choose_tier`'s inputs for the device: nothing is read back; the lagged survivals stay
        on the device (plan and same go as numpy: the step's call transfers them). The cost
        matrix is built once per cost table."""
        s, d = self.spec.num_slots, self.window - 1
        plans = self.plans(old, steps_run)
        same = np.array([plans and req is not None and req is old[0][i] for i, req in enumerate(rows)], bool)
        if self._costs is None or self._costs[0] is not self.cost_table:
            costs = np.ones((s + 1, len(self.tier_tokens)), np.float32)
            if self.cost_table is not None and not self.cost_table.is_trivial:
                for n in range(1, s + 1):
                    for j, tier in enumerate(self.tier_tokens):
                        if tier >= n:
                            costs[n, j] = self.cost_table.step_time(n, n + min(tier - n, n * d))
            self._costs = (self.cost_table, jnp.asarray(costs), jnp.ones((s, d), jnp.float32))
        survival = old[1] if plans else self._costs[2]
        return DevicePlan(plan=np.asarray(plans), survival=survival, same=same, costs=self._costs[1])

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
            costs=jnp.asarray(costs),
        )
