import itertools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.spec.layout import tiers
from jaxspec.spec.planner import CostTable, choose_budget, expected_tokens, monotone_costs, plan_lengths

plan_jit = jax.jit(plan_lengths)


def _key(s, k, r):
    """Sort key of candidate (request r, position k) in the total order: larger is taken first."""
    s = -math.inf if math.isnan(s) else float(s)
    return (s, -k, -r)


def brute_force_prefix(survival, budget):
    """Over ALL prefix-length vectors with sum = budget, the one whose chosen set is best in the
    total order (its keys, sorted descending, lexicographically largest: that is the top-budget set)."""
    b, d = survival.shape
    best, best_keys = None, None
    for lengths in itertools.product(range(d + 1), repeat=b):
        if sum(lengths) != budget:
            continue
        keys = sorted((_key(survival[r, k], k, r) for r in range(b) for k in range(lengths[r])), reverse=True)
        if best_keys is None or keys > best_keys:
            best, best_keys = lengths, keys
    return np.array(best, np.int32)


def top_counts(survival, budget):
    """Per request, how many of the top-budget candidates (any set, not only prefixes) it owns."""
    b, d = survival.shape
    cands = sorted(
        ((r, k) for r in range(b) for k in range(d)), key=lambda rk: _key(survival[rk], rk[1], rk[0]), reverse=True
    )
    counts = np.zeros(b, np.int32)
    for r, _ in cands[: max(0, min(budget, b * d))]:
        counts[r] += 1
    return counts


def random_survival(rng, b, d, quantum):
    """Rows non-increasing; values on a grid of `quantum` so ties across requests and positions are common."""
    p = rng.integers(0, round(1 / quantum) + 1, size=(b, d)) * quantum
    return -np.sort(-p, axis=1)


@pytest.mark.parametrize("b,d", [(1, 1), (1, 4), (2, 3), (3, 2), (3, 4), (2, 4)])
def test_plan_lengths_brute_force(b, d):
    rng = np.random.default_rng(100 * b + d)
    for case in range(12):
        quantum = [0.5, 0.25, 0.125, 1 / 1024][case % 4]
        s = random_survival(rng, b, d, quantum).astype(np.float32)
        for budget in range(b * d + 1):
            got = np.asarray(plan_jit(jnp.asarray(s), jnp.int32(budget)))
            want = brute_force_prefix(s, budget)
            np.testing.assert_array_equal(got, want, f"s={s.tolist()} budget={budget}")
            np.testing.assert_array_equal(got, top_counts(s, budget))
            assert got.dtype == np.int32 and got.sum() == budget
            # the chosen set has the largest survival mass of any prefix allocation
            assert np.isclose(
                sum(s[r, : got[r]].sum() for r in range(b)), expected_tokens(s)[budget] - b, rtol=0, atol=1e-6
            )


def test_plan_lengths_ties_explicit():
    s = np.full((3, 4), 0.5, np.float32)
    # equal survivals: position ascending first, then request ascending
    want = {
        0: [0, 0, 0],
        1: [1, 0, 0],
        2: [1, 1, 0],
        3: [1, 1, 1],
        4: [2, 1, 1],
        5: [2, 2, 1],
        7: [3, 2, 2],
        12: [4, 4, 4],
    }
    for budget, lengths in want.items():
        np.testing.assert_array_equal(plan_jit(s, budget), lengths, f"budget={budget}")
    s = np.array([[0.9, 0.5, 0.5], [0.5, 0.5, 0.1]], np.float32)
    # 0.9 first; then the 0.5s: (r1,k0), (r0,k1), (r1,k1), (r0,k2); then 0.1
    for budget, lengths in {1: [1, 0], 2: [1, 1], 3: [2, 1], 4: [2, 2], 5: [3, 2], 6: [3, 3]}.items():
        np.testing.assert_array_equal(plan_jit(s, budget), lengths, f"budget={budget}")
    # ties across requests at different positions: the earlier position wins even for a later request
    s = np.array([[0.8, 0.6], [0.6, 0.6]], np.float32)
    np.testing.assert_array_equal(plan_jit(s, 2), [1, 1])
    np.testing.assert_array_equal(plan_jit(s, 3), [2, 1])
    # -0.0 ties 0.0
    s = np.array([[0.0, 0.0], [-0.0, -0.0]], np.float32)
    np.testing.assert_array_equal(plan_jit(s, 1), [1, 0])
    np.testing.assert_array_equal(plan_jit(s, 3), [2, 1])


def test_plan_lengths_nan_last_and_budget_clamp():
    s = np.array([[0.9, np.nan, np.nan], [0.3, 0.2, 0.0]], np.float32)
    for budget in range(7):
        np.testing.assert_array_equal(plan_jit(s, budget), top_counts(s, budget))
    np.testing.assert_array_equal(plan_jit(s, 4), [1, 3])
    np.testing.assert_array_equal(plan_jit(s, 5), [2, 3])
    np.testing.assert_array_equal(plan_jit(s, -3), [0, 0])
    np.testing.assert_array_equal(plan_jit(s, 99), [3, 3])


def test_plan_lengths_non_monotone_rows():
    """Rows that are not non-increasing: the result is the per-request count of chosen candidates."""
    rng = np.random.default_rng(7)
    for _ in range(10):
        b, d = rng.integers(1, 4), rng.integers(1, 5)
        s = (rng.integers(0, 5, size=(b, d)) / 4).astype(np.float32)
        for budget in range(b * d + 1):
            np.testing.assert_array_equal(plan_jit(s, budget), top_counts(s, budget), f"s={s.tolist()} n={budget}")
    s = np.array([[0.1, 0.9], [0.5, 0.4]], np.float32)
    np.testing.assert_array_equal(plan_jit(s, 1), [1, 0])  # the 0.9 at position 1 counts as length 1
    np.testing.assert_array_equal(plan_jit(s, 2), [1, 1])


def test_plan_lengths_traced_budget_and_eager():
    s = jnp.asarray([[0.9, 0.7, 0.2], [0.8, 0.1, 0.05]], jnp.float32)
    f = jax.jit(lambda s, n: plan_lengths(s, n))
    lowered = f.lower(s, jnp.int32(0))  # budget is a tracer: one compile for all
    compiled = lowered.compile()
    for budget in range(7):
        want = top_counts(np.asarray(s), budget)
        np.testing.assert_array_equal(compiled(s, jnp.int32(budget)), want)
        np.testing.assert_array_equal(plan_lengths(s, budget), want)  # eager, python int
    # inside a larger traced computation: vmap over budgets
    got = jax.vmap(plan_lengths, in_axes=(None, 0))(s, jnp.arange(7, dtype=jnp.int32))
    np.testing.assert_array_equal(got, [top_counts(np.asarray(s), n) for n in range(7)])


# ---------------------------------------------------------------- choose_budget


def brute_force_budget(survival, table, admissible):
    b = survival.shape[0]
    ordered = sorted((x for x in survival.reshape(-1).tolist() if not math.isnan(x)), reverse=True)
    best, best_rate = None, None
    for n in sorted(admissible):
        tau = float(b)
        for x in ordered[:n]:
            tau += x
        rate = tau / table.step_time(b, b + n)
        if best_rate is None or rate > best_rate:
            best, best_rate = n, rate
    return best


def test_choose_budget_brute_force():
    rng = np.random.default_rng(3)
    for case in range(60):
        b, block = int(rng.integers(1, 9)), int(rng.integers(2, 9))
        d = block - 1
        tier_tokens, admissible = tiers(b, block)
        # a concave-ish or convex-ish cost curve per batch, plus a neighbouring batch
        base, slope, curve = rng.uniform(0.5, 2), rng.uniform(0.001, 0.2), rng.uniform(0.5, 1.5)
        entries = {(bb, t): base + slope * t**curve for bb in (b, b + 3) for t in tiers(bb, block)[0]}
        table = CostTable(entries)
        s = np.cumprod(rng.uniform(0.3, 1.0, size=(b, d)), axis=1)
        got = choose_budget(s, table, admissible)
        assert got == brute_force_budget(s, table, admissible), case
        assert got in admissible


def test_choose_budget_ties_and_trivial():
    b, block = 4, 8
    _, admissible = tiers(b, block)
    s = np.ones((b, block - 1))
    # cost proportional to tokens and every draft surely accepted: tau(n)/c(n) = 1 for every n
    table = CostTable({(b, t): float(t) for t in range(1, b * block + 1)})
    assert choose_budget(s, table, admissible) == admissible[0] == 0
    assert choose_budget(s, table, [12, 4, 28]) == 4  # smallest n, whatever the order given
    # a flat cost: verify everything; a steep one: nothing
    assert choose_budget(s * 0.5, CostTable({(b, 4): 1.0, (b, 32): 1.0}), admissible) == 28
    assert choose_budget(s * 0.01, CostTable({(b, 4): 1.0, (b, 32): 100.0}), admissible) == 0
    # trivial tables: verify everything
    for table in (CostTable({}), CostTable({(b, 4): 1.0}), None):
        assert choose_budget(s * 0.01, table, admissible) == max(admissible)
    # NaN survivals contribute nothing
    s_nan = np.full((b, block - 1), np.nan)
    assert choose_budget(s_nan, CostTable({(b, 4): 1.0, (b, 32): 2.0}), admissible) == 0
    with pytest.raises(ValueError):
        choose_budget(s, table, [0, b * (block - 1) + 1])
    with pytest.raises(ValueError):
        choose_budget(s, table, [])


def test_expected_tokens():
    s = np.array([[0.9, 0.5], [0.7, np.nan]])
    np.testing.assert_allclose(expected_tokens(s), [2, 2.9, 3.6, 4.1, 4.1])


# ---------------------------------------------------------------- CostTable


def test_cost_table_interpolation():
    t = CostTable({(2, 2): 1.0, (2, 10): 3.0, (4, 4): 2.0, (4, 20): 6.0})
    assert t.step_time(2, 2) == 1.0 and t.step_time(2, 10) == 3.0  # measured points exactly
    assert t.step_time(2, 6) == pytest.approx(2.0)  # linear in tokens
    assert t.step_time(2, 1) == 1.0 and t.step_time(2, 100) == 3.0  # clamped in tokens
    assert t.step_time(1, 6) == pytest.approx(2.0)  # batch below: the smallest batch's curve
    assert t.step_time(9, 12) == pytest.approx(4.0)  # batch above: the largest batch's curve
    # batch 3 = halfway between 2 and 4: at tokens 10, batch 2 gives 3.0 (clamped), batch 4 gives 3.5
    assert t.step_time(3, 10) == pytest.approx(3.25)
    assert t.step_time(3, 4) == pytest.approx(0.5 * 1.5 + 0.5 * 2.0)
    assert not t.is_trivial and t.batches == (2, 4) and len(t) == 4
    assert CostTable({}).is_trivial and CostTable({(1, 1): 1.0}).is_trivial
    assert CostTable({(1, 1): 2.0}).step_time(7, 99) == 2.0
    with pytest.raises(ValueError):
        CostTable({}).step_time(1, 1)
    for bad in ({(0, 4): 1.0}, {(2, 0): 1.0}, {(2, 4): 0.0}, {(2, 4): float("nan")}, {(2.5, 4): 1.0}):
        with pytest.raises(ValueError):
            CostTable(bad)


def monotone_oracle(values):
    """The least of the values at or after each position, by loops over Python floats."""
    v = [float(x) for x in values]
    return [min(v[i:]) for i in range(len(v))]


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13])
def test_monotone_costs_match_the_suffix_min_oracle(n):
    rng = np.random.default_rng(n)
    for _ in range(20):
        values = rng.uniform(0.5, 1.5, n) * rng.choice([1.0, 1e-3])
        fit = monotone_costs(values)
        assert fit.dtype == np.float64 and fit.tolist() == monotone_oracle(values)
        assert np.all(np.diff(fit) >= 0) and np.all(fit <= values)
    sorted_values = np.sort(rng.uniform(size=n))
    np.testing.assert_array_equal(monotone_costs(sorted_values), sorted_values)  # already monotone: unchanged


def test_cost_table_is_monotone_in_tokens():
    """A measured curve that falls with the tokens (timing noise: the profile's first tiers ran
    slower) takes its larger tiers' least time, so the noise reads as no saving; a curve that
    rises keeps its measurements; entries keep the measurements."""
    measured = {(16, 16): 0.912e-3, (16, 32): 0.872e-3, (16, 64): 0.743e-3, (16, 128): 0.700e-3}
    t = CostTable(measured | {(64, 64): 0.949e-3, (64, 128): 0.932e-3, (64, 256): 1.024e-3})
    assert t.entries[(16, 16)] == 0.912e-3
    for tokens in (16, 40, 128):
        assert t.step_time(16, tokens) == 0.700e-3
    assert t.step_time(64, 64) == t.step_time(64, 128) == 0.932e-3
    assert t.step_time(64, 256) == 1.024e-3
    assert t.step_time(64, 192) == pytest.approx((0.932e-3 + 1.024e-3) / 2)


def test_cost_table_save_load(tmp_path):
    entries = {(1, 1): 0.011, (1, 8): 0.0123456789, (8, 8): 0.02, (8, 24): 0.031, (8, 128): 0.1 / 3}
    t = CostTable(entries, model="qwen-test", metadata={"note": "x"})
    path = tmp_path / "cost.json"
    t.save(path)
    u = CostTable.load(path)
    assert u.entries == entries  # floats round-trip exactly
    assert u.metadata["model"] == "qwen-test" and u.metadata["note"] == "x"
    assert u.metadata["device"] and u.metadata["date"]
    assert u.metadata == t.metadata
    for b in range(1, 10):
        for n in range(1, 130, 7):
            assert u.step_time(b, n) == t.step_time(b, n)
    raw = json.loads(path.read_text())
    assert raw["version"] == 1 and len(raw["entries"]) == len(entries)
    # given device/date are kept
    v = CostTable(entries, device="gpu:H200", date="2025-01-01")
    v.save(path)
    assert CostTable.load(path).metadata == {"device": "gpu:H200", "date": "2025-01-01"}
    raw["version"] = 99
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError):
        CostTable.load(path)


def test_tier_planner_takes_choose_budgets_tier():
    """TierPlanner.choose_tier (plain Python on the host) runs the tier of `choose_budget`'s budget
    (numpy, float64) over the admissible budgets of the ladder: random survivals with NaNs, idle
    slots, newcomers (survivals 1), several slot counts, blocks and plan overheads."""
    from jaxspec.config import SpecConfig
    from jaxspec.spec.layout import tier_for
    from jaxspec.tier_planner import TierPlanner

    rng = np.random.default_rng(11)
    chosen = set()
    for case in range(80):
        slots, block = int(rng.integers(1, 11)), int(rng.integers(2, 9))
        overhead = float(rng.choice([0.0, 0.03, rng.uniform(0, 0.5)]))
        spec = SpecConfig(
            verify_mode="compact", num_slots=slots, block_size=block, warmup_refits=0, plan_overhead=overhead
        )
        ladder = tiers(slots, block)[0]
        slope = float(rng.choice([0.0, 1e-4, rng.uniform(0.001, 0.3)]))  # flat, within plan_overhead, steep
        table = CostTable({(b, t): 1.0 + slope * t for b in range(1, slots + 1) for t in range(1, ladder[-1] + 1)})
        planner = TierPlanner(spec, block, table)
        survival = np.cumprod(rng.uniform(0.2, 1.0, (slots, block - 1)), axis=1).astype(np.float32)
        survival[rng.random(survival.shape) < 0.1] = np.nan
        requests = [object() for _ in range(slots)]
        old_rows = [r if rng.random() < 0.8 else None for r in requests]
        rows = [r if rng.random() < 0.7 else (object() if rng.random() < 0.5 else None) for r in requests]
        if not any(rows):
            rows[0] = requests[0]
        live = [i for i, r in enumerate(rows) if r is not None]
        n = len(live)
        want_survival = np.stack([survival[i] if rows[i] is old_rows[i] else np.ones(block - 1) for i in live])
        admissible = sorted({min(t - n, n * (block - 1)) for t in ladder if t >= n})
        budget = choose_budget(want_survival, table, admissible, plan_overhead=overhead)
        want = ladder[tier_for(n + budget, ladder)]
        got = planner.choose_tier(rows, (old_rows, jnp.asarray(survival)), 10**6)
        assert got == want, case
        chosen.add(got == ladder[-1])
    assert chosen == {True, False}


@pytest.mark.parametrize("overhead", [0.0, 0.03, 0.2])
def test_plan_overhead_prices_trimmed_budgets(overhead):
    """A budget that trims drafts costs its table time + plan_overhead x the full block's: against a
    float64 oracle of tau / c over every budget, on a table whose time grows with tokens by 0..10%
    across the block (flat: a host-bound step)."""
    rng = np.random.default_rng(int(overhead * 100))
    for case in range(60):
        b, d = int(rng.integers(1, 9)), int(rng.integers(1, 8))
        slope = float(rng.choice([0.0, rng.uniform(0, 0.1 / (b * (d + 1)))]))
        table = CostTable({(b, t): 1.0 + slope * t for t in (b, b * (d + 1))})
        survival = np.sort(rng.uniform(0, 1, (b, d)), axis=1)[:, ::-1]
        budgets = list(range(b * d + 1))
        top = np.sort(survival.ravel())[::-1].astype(np.float64)
        tau = b + np.concatenate([[0.0], np.cumsum(top)])
        full = 1.0 + slope * b * (d + 1)
        price = [1.0 + slope * (b + n) + (overhead * full if n < b * d else 0.0) for n in budgets]
        want = int(np.argmax(tau / np.asarray(price)))
        assert choose_budget(survival, table, budgets, plan_overhead=overhead) == want, case
        if slope == 0.0 and overhead > 0:
            assert want == b * d, case  # flat table: every draft is verified


def test_flat_cost_table_verifies_full_blocks_through_the_tier_planner():
    """The engine's host rule on a table flat within 1% (a host-bound tiny step) keeps the full tier
    at the default plan_overhead, and trims on the same survivals without it."""
    from jaxspec.config import SpecConfig
    from jaxspec.tier_planner import TierPlanner

    slots, block = 16, 8
    ladder = tiers(slots, block)[0]
    table = CostTable({(n, t): 1.0 + 0.01 * t / ladder[-1] for n in range(1, slots + 1) for t in ladder})
    survival = np.cumprod(np.full((slots, block - 1), 0.2, np.float32), axis=1)
    rows = [object() for _ in range(slots)]
    picks = {}
    for overhead in (0.0, SpecConfig().plan_overhead):
        spec = SpecConfig(verify_mode="compact", num_slots=slots, block_size=block, plan_overhead=overhead)
        picks[overhead] = TierPlanner(spec, block, table).choose_tier(rows, (rows, jnp.asarray(survival)), 10**6)
    assert picks[SpecConfig().plan_overhead] == ladder[-1]
    assert picks[0.0] < ladder[-1]


@pytest.mark.parametrize("noise", [0.0, 0.01, 0.1, 0.5])
def test_trim_overhead_is_the_larger_of_plan_overhead_and_the_table_noise(noise):
    """A trimmed budget pays max(plan_overhead, CostTable.noise) x the full block's time; a full
    budget pays nothing."""
    from jaxspec.spec.planner import trim_overhead

    rng = np.random.default_rng(int(noise * 100))
    rows, d = 5, 7
    table = CostTable({(rows, t): float(rng.uniform(1e-3, 2e-3)) * t for t in (5, 13, 40)}, {"noise": noise})
    full = table.step_time(rows, rows * (d + 1))
    for overhead in (0.0, 0.03):
        assert trim_overhead(table, rows, rows * d, d, overhead) == 0.0
        assert trim_overhead(table, rows, rows * d - 1, d, overhead) == pytest.approx(max(overhead, noise) * full)
        assert trim_overhead(table, rows, 0, d, overhead) == pytest.approx(max(overhead, noise) * full)


def test_a_saving_within_the_profile_noise_is_not_trimmed():
    """The host rule and the device rule (switch dispatch) keep the full block where the smaller tiers
    save 7% (a noisy profile of a flat step, as an H100 tiny run measured at c = 16) and the table's
    noise is 10%, and trim on the same survivals where its noise is 1%."""
    from jaxspec.config import SpecConfig
    from jaxspec.step import device_tier
    from jaxspec.tier_planner import TierPlanner

    slots, block = 16, 8
    ladder = tiers(slots, block)[0]
    times = {t: 0.93e-3 for t in ladder[:-1]} | {ladder[-1]: 1.0e-3}
    survival = np.cumprod(np.full((slots, block - 1), 0.2, np.float32), axis=1)
    rows = [object() for _ in range(slots)]
    spec = SpecConfig(verify_mode="compact", num_slots=slots, block_size=block)
    for noise, trims in ((0.1, False), (0.01, True)):
        table = CostTable({(slots, t): s for t, s in times.items()}, {"noise": noise})
        planner = TierPlanner(spec, block, table)
        host = planner.choose_tier(rows, (rows, jnp.asarray(survival)), 10**6)
        plan = planner.device_plan(rows, (rows, jnp.asarray(survival)), 10**6)
        device = ladder[int(device_tier(plan, jnp.ones(slots, bool), ladder, block - 1))]
        assert host == device
        assert (host < ladder[-1]) == trims, (noise, host)


@pytest.mark.parametrize("noise", [-0.1, float("nan"), float("inf"), "5%", True])
def test_bad_noise_is_refused_by_name(noise):
    with pytest.raises(ValueError, match="noise"):
        CostTable({(1, 1): 1e-3, (1, 8): 2e-3}, {"noise": noise})


def test_a_table_timed_for_another_window_or_draft_forward_is_refused():
    """A planning engine (compact, cap-accept) refuses a table whose metadata records another verify
    window or draft forward than its own, at construction and on assignment; static keeps any table
    (it plans nothing from it), and a table without the record is taken as it is."""
    from jaxspec.config import SpecConfig
    from jaxspec.tier_planner import TierPlanner

    entries = {(4, 4): 1e-3, (4, 32): 2e-3}
    spec = SpecConfig(verify_mode="compact", num_slots=4, block_size=8, trim_draft=True)
    good = CostTable(entries, {"window": 8, "trim_draft": True})
    assert TierPlanner(spec, 8, good).cost_table is good
    assert TierPlanner(spec, 8, CostTable(entries)).cost_table is not None
    for metadata, needle in (
        ({"window": 16}, "verify windows of 16 tokens"),
        ({"trim_draft": False}, "trim_draft=False"),
    ):
        with pytest.raises(ValueError, match=f"cost_table: profiled with {needle}"):
            TierPlanner(spec, 8, CostTable(entries, metadata))
        planner = TierPlanner(spec, 8)
        with pytest.raises(ValueError, match="cost_table"):
            planner.cost_table = CostTable(entries, metadata)
        assert planner.cost_table is None  # refused, not half-assigned
        static = SpecConfig(verify_mode="static", num_slots=4, block_size=8, trim_draft=True)
        assert TierPlanner(static, 8, CostTable(entries, metadata)).cost_table is not None


def test_noise_survives_save_and_load(tmp_path):
    table = CostTable({(1, 1): 1e-3, (1, 8): 2e-3}, {"noise": 0.042})
    table.save(tmp_path / "t.json")
    assert CostTable.load(tmp_path / "t.json").noise == 0.042


class Unreadable:
    """Survivals the host must not read: converting them fails the test."""

    def __array__(self, *args, **kwargs):
        raise AssertionError("the host read survivals it did not need")


@pytest.mark.parametrize("active", [1, 5, 16])
def test_settled_tier_reads_no_survivals(active):
    """Where every trimmed budget costs more than the full block (a table flat within
    plan_overhead), the full block wins for any survivals: choose_tier returns its tier without
    reading them back (each read costs the host loop tens of µs); on a steep table it reads them."""
    from jaxspec.config import SpecConfig
    from jaxspec.spec.layout import tier_for
    from jaxspec.tier_planner import TierPlanner

    slots, block = 16, 8
    ladder = tiers(slots, block)[0]
    spec = SpecConfig(verify_mode="compact", num_slots=slots, block_size=block)
    rows = [object() if i < active else None for i in range(slots)]
    flat = CostTable({(slots, t): 1e-3 * (1.0 + 0.01 * t / ladder[-1]) for t in ladder})
    got = TierPlanner(spec, block, flat).choose_tier(rows, (rows, Unreadable()), 10**6)
    assert got == ladder[tier_for(active * block, ladder)]
    steep = TierPlanner(spec, block, CostTable({(slots, t): 1e-3 * t for t in ladder}))
    if active * block <= ladder[0]:  # every tier holds the full block: nothing to choose, nothing read
        assert steep.choose_tier(rows, (rows, Unreadable()), 10**6) == ladder[0]
    else:
        with pytest.raises(AssertionError, match="did not need"):
            steep.choose_tier(rows, (rows, Unreadable()), 10**6)
