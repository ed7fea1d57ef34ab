"""Engine(tier_dispatch="switch"): one compiled step picks the tier on the device (lax.switch over
the tiers in compact mode) and emits exactly the tokens of the host-chosen tiers."""

import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct

import jaxspec
from jaxspec import step as step_mod
from jaxspec import target as target_mod
from jaxspec.config import SpecConfig
from jaxspec.engine import Engine
from jaxspec.spec import layout
from jaxspec.spec.planner import CostTable

FIXTURE = Path(__file__).parent / "fixtures" / "tiny-qwen3_5"
SLOTS = 3


@struct.dataclass
class ChainProposer:
    """A draft that compiles fast: draft k+1 = table[draft k] from the anchor, with logits of
    varying sharpness (so the estimator's features, and the planned tiers, vary)."""

    table: jax.Array  # [vocab] the target's greedy next token after each token alone
    block_size: int = struct.field(pytree_node=False)
    taps = ()

    def init_state(self, num_slots, max_len):
        return jnp.zeros((), jnp.int32)

    def observe(self, state, tokens, hidden, positions, slots, valid):
        return state

    def propose(self, state, anchors, slots, ctx_len):
        drafts, tok = [], anchors
        for _ in range(self.block_size - 1):
            tok = self.table[tok]
            drafts.append(tok)
        drafts = jnp.stack(drafts, axis=1)
        scale = 2.0 + (drafts % 5).astype(jnp.float32) * 2.0
        return jax.nn.one_hot(drafts, self.table.shape[0]) * scale[..., None], state


@pytest.fixture(scope="module")
def model():
    return jaxspec.load_target(FIXTURE)


@pytest.fixture(scope="module")
def table(model):
    vocab = model.config.vocab_size
    forward = jax.jit(lambda ids: target_mod.prefill_layers(model, ids, jnp.ones((vocab,), jnp.int32), (), "ref")[0])
    return jnp.argmax(forward(jnp.arange(vocab)[:, None])[:, 0], -1).astype(jnp.int32)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(9)
    return [list(rng.integers(0, 512, n)) for n in (6, 19, 11, 3, 25)]


def _cost_table(slots, block):
    """A verify that costs more with more tokens, and seconds a step (far above the host's own
    time a turn, which would otherwise floor every tier's cost): the planner picks partial tiers."""
    tiers, _ = layout.tiers(slots, block)
    return CostTable({(b, n): 1.0 + 0.05 * n for b in range(1, slots + 1) for n in range(1, tiers[-1] + 1)})


def _engine(model, table, mode, dispatch, block):
    spec = SpecConfig(verify_mode=mode, num_slots=SLOTS, max_len=64, warmup_refits=0, refit_interval=4, lag=1)
    return Engine(
        model,
        None,
        spec,
        proposer=ChainProposer(table, block),
        cost_table=_cost_table(SLOTS, block),
        tier_dispatch=dispatch,
    )


def test_device_tier_is_the_host_tier(model, table):
    """The device rule picks the host's tier for random survivals, occupancy, request changes and
    host times a step (which floor every tier's cost)."""
    BLOCK = 6  # tiers (3, 8, 16, 18)
    engine = _engine(model, table, "compact", "switch", BLOCK)
    tier_planner, past_warmup = engine.tier_planner, 10**6
    pick = jax.jit(step_mod.device_tier, static_argnums=(2, 3))
    rng = np.random.default_rng(0)
    requests = [object() for _ in range(2 * SLOTS)]
    seen = set()
    for trial in range(200):
        survival = np.cumprod(rng.uniform(0.05, 1.0, (SLOTS, BLOCK - 1)) ** rng.uniform(0.1, 3), axis=1)
        survival = survival.astype(np.float32)
        old_rows = [requests[i] if rng.random() < 0.8 else None for i in range(SLOTS)]
        rows = [
            r if rng.random() < 0.7 else (requests[SLOTS + i] if rng.random() < 0.7 else None)
            for i, r in enumerate(old_rows)
        ]
        if all(r is None for r in rows):
            rows[0] = requests[0]
        old = (old_rows, jax.numpy.asarray(survival))
        host_seconds = 0.0 if trial % 2 else rng.uniform(0.9, 2.0)  # the table: 1.15-1.9 s a step
        host = tier_planner.choose_tier(rows, old, past_warmup, host_seconds)
        active = jax.numpy.asarray([r is not None for r in rows])
        plan = tier_planner.device_plan(rows, old, past_warmup, host_seconds)
        device = engine.tier_tokens[int(pick(plan, active, engine.tier_tokens, BLOCK - 1))]
        assert device == host, (trial, rows, old_rows, survival)
        seen.add(host)
    assert len(seen) > 2, seen
    # no plan (no history): the full block, as on the host
    rows = [requests[0]] + [None] * (SLOTS - 1)
    active = jax.numpy.asarray([r is not None for r in rows])
    assert tier_planner.choose_tier(rows, None, past_warmup) == engine.tier_tokens[-1]
    plan = tier_planner.device_plan(rows, None, past_warmup)
    assert int(pick(plan, active, engine.tier_tokens, BLOCK - 1)) == len(engine.tier_tokens) - 1


class _Unread:
    """Survivals that fail the test if the planner reads them."""

    def __array__(self, *args, **kwargs):
        raise AssertionError("the planner read the survivals")


def test_host_time_floors_the_tier_costs(model, table):
    """A step costs at least the host's own time: each tier is priced at max(table, host_seconds)
    (a brute-force rate oracle), and where the host alone takes the full block's time the full
    block is chosen without reading survivals, on the host and on the device."""
    BLOCK = 6
    engine = _engine(model, table, "compact", "switch", BLOCK)
    planner, d = engine.tier_planner, BLOCK - 1
    costs = _cost_table(SLOTS, BLOCK)
    rows = [object() for _ in range(SLOTS)]
    survival = np.tile(np.float32([0.9, 0.2, 0.05, 0.01, 0.0]), (SLOTS, 1))  # trimming pays
    full = SLOTS * BLOCK

    def oracle(host_seconds):
        best = None
        for tier in engine.tier_tokens:
            budget = min(tier - SLOTS, SLOTS * d)
            tau = SLOTS + np.sort(survival.reshape(-1))[::-1][:budget].sum()
            price = costs.step_time(SLOTS, SLOTS + budget) + (
                planner.spec.plan_overhead * costs.step_time(SLOTS, full) if budget < SLOTS * d else 0.0
            )
            rate = tau / max(price, np.float32(host_seconds))
            if best is None or rate > best[0] * (1 + 1e-6):
                best = (rate, engine.tier_tokens[layout.tier_for(SLOTS + budget, engine.tier_tokens)])
        return best[1]

    old = (rows, jnp.asarray(survival))
    trimmed = planner.choose_tier(rows, old, 10**6)
    assert trimmed < full and trimmed == oracle(0.0)
    for host_seconds in (1.2, 1.5, 1.86):  # prices 1.21 / 1.46 / 1.86 / 1.9 s (tiers 3 / 8 / 16 / 18)
        assert planner.choose_tier(rows, old, 10**6, host_seconds) == oracle(host_seconds), host_seconds
    assert oracle(1.86) == 16 != trimmed  # the floor changes the choice
    at_full = costs.step_time(SLOTS, full)
    for host_seconds in (at_full, 2 * at_full):
        assert planner.choose_tier(rows, (rows, _Unread()), 10**6, host_seconds) == full
        plan = planner.device_plan(rows, old, 10**6, host_seconds)
        active = jnp.ones((SLOTS,), bool)
        assert engine.tier_tokens[int(step_mod.device_tier(plan, active, engine.tier_tokens, d))] == full


def test_engine_measures_its_host_time(model, table, prompts):
    """`Engine.host_seconds` is measured while decoding; with a table whose every step is faster
    than that (a host-bound engine) compact verifies full blocks, with a table of seconds a step
    it trims."""
    block, trimmed = 5, {}  # not the block the switch test counts compilations of
    for name, scale in (("host-bound", 1e-9), ("device-bound", 1.0)):
        engine = _engine(model, table, "compact", "host", block)
        engine.cost_table = CostTable({key: scale * s for key, s in _cost_table(SLOTS, block).entries.items()})
        choose, steps = engine.tier_planner.choose_tier, []

        def spy(rows, old, steps_run, host_seconds, choose=choose, steps=steps):
            tier = choose(rows, old, steps_run, host_seconds)
            if host_seconds > 0:  # measured after HOST_TURNS // 2 turns; the table alone before
                steps.append((sum(r is not None for r in rows), tier))
            return tier

        engine.tier_planner.choose_tier = spy
        engine.generate(prompts, max_new_tokens=24)
        assert engine.host_seconds > 0.0
        whole = {n: min(t for t in engine.tier_tokens if t >= n * block) for n in range(1, SLOTS + 1)}
        trimmed[name] = sum(tier < whole[n] for n, tier in steps)
        assert len(steps) > 20
    assert trimmed["host-bound"] == 0 < trimmed["device-bound"], trimmed


class _SlowFirst:
    """A prefill's first tokens that take `delay` seconds to arrive on the host."""

    def __init__(self, first, delay):
        self.first, self.delay = first, delay

    def copy_to_host_async(self):
        pass

    def __array__(self, *args, **kwargs):
        time.sleep(self.delay)
        return np.asarray(self.first, *args, **kwargs)


def test_host_time_leaves_out_waiting_for_prefills(model, table):
    """Waiting for a prefill's first tokens is device time: with a 0.2 s wait at every join (short
    requests joining every other turn) no turn's host time counts it."""
    engine = _engine(model, table, "compact", "host", 5)
    prefill = engine._prefill

    def slow_prefill(*args):
        state, first = prefill(*args)
        return state, _SlowFirst(first, 0.2)

    slow_prefill._cache_size = prefill._cache_size  # the engine counts its compiled programs
    engine._prefill = slow_prefill
    rng = np.random.default_rng(3)
    results = engine.generate([list(rng.integers(0, 512, 5)) for _ in range(24)], max_new_tokens=2)
    assert all(len(r.tokens) == 2 for r in results)
    assert len(engine._host_busy) >= 8 and engine.host_seconds > 0.0
    assert max(engine._host_busy) < 0.15, list(engine._host_busy)  # no turn counts a 0.2 s wait


@pytest.mark.parametrize("mode", ["compact", "cap-accept"])
def test_switch_emits_the_host_tokens_and_compiles_once(model, table, prompts, mode):
    """Same tokens, per-step verified and accepted lengths and tier counts as the host dispatch,
    greedy (compact) and seeded sampling; the switch step compiles once per variant."""
    outs = {}
    for dispatch in ("host", "switch"):
        engine = _engine(model, table, mode, dispatch, block=4)  # tiers (3, 8, 12)
        # engines share compiled steps: count this engine's compilations as the growth of its step's
        # cache (its steps take a ChainProposer, which only this module builds: none exist before)
        before = engine._step._cache_size()
        results = []
        if mode == "compact":  # greedy is lossless anyway: once is enough
            results += engine.generate(prompts, max_new_tokens=16)
            if dispatch == "switch":
                assert engine._step._cache_size() - before == 1, "the switch step compiled more than once"
        results += engine.generate(prompts, max_new_tokens=16, temperature=0.8, seed=[1, 2, 3, 4, 5])
        outs[dispatch] = (
            [(r.tokens, r.stats["verified"], r.stats["accepted"]) for r in results],
            dict(engine.tier_counts),
            engine._step._cache_size() - before,
        )
    (host, host_tiers, host_compiles), (switch, switch_tiers, switch_compiles) = outs["host"], outs["switch"]
    assert switch == host
    assert switch_tiers == host_tiers and len(host_tiers) == 3, (host_tiers, switch_tiers)
    variants = 2 if mode == "compact" else 1  # greedy and sampling
    assert switch_compiles == variants and host_compiles == 3 * variants


def test_tier_dispatch_is_checked(model, table):
    with pytest.raises(ValueError, match="tier_dispatch"):
        _engine(model, table, "compact", "device", 4)


def test_forced_switch_step_runs_the_forced_tier(model, table):
    """forced_step(switch=True) runs the switch step at the tier its DevicePlan forces
    (`TierPlanner.forcing`) and emits the host step's tokens at that tier (forced acceptance, the
    same prompts); switch=True on a host-dispatch engine is refused."""
    host = _engine(model, table, "compact", "host", 4)  # tiers (3, 8, 12)
    switch = _engine(model, table, "compact", "switch", 4)
    for tier in host.tier_tokens:
        ran = {}
        for name, engine in (("host", host), ("switch", switch)):
            step = engine.forced_step(SLOTS, tier, switch=name == "switch")
            calls = [step() for _ in range(2)]
            ran[name] = (np.stack([np.asarray(e) for e, _ in calls]), [int(used) for _, used in calls])
        assert ran["switch"][1] == ran["host"][1] == [tier, tier]
        np.testing.assert_array_equal(ran["switch"][0], ran["host"][0])
    with pytest.raises(ValueError, match="switch"):
        host.forced_step(SLOTS, host.tier_tokens[-1], switch=True)


def test_static_profile_times_the_full_tier_only(model, table):
    """A static step verifies every slot's whole block whatever the tier: profile compiles and
    times one step, the full tier, per batch."""
    engine = _engine(model, table, "static", "host", 4)
    before = engine._step._cache_size()
    costs = engine.profile([1, SLOTS], repeats=1)
    full = engine.tier_tokens[-1]
    assert sorted(costs.entries) == [(1, full), (SLOTS, full)]
    assert engine._step._cache_size() - before == 1
    assert costs.metadata["noise"] == costs.noise >= 0  # three rounds: their spread
    assert costs.metadata["window"] == engine.window and costs.metadata["trim_draft"] is False  # the step timed
    assert engine.profile([SLOTS], repeats=1, rounds=1).noise == 0.0  # one round: no spread to tell


@pytest.mark.parametrize("mode", ["compact", "cap-accept"])
def test_full_tier_skips_the_plan(model, table, mode):
    """A host-chosen full tier holds every row's block: the step runs no planner (its lexsort),
    like a static step; a partial tier plans."""
    engine = _engine(model, table, mode, "host", 4)  # tiers (3, 8, 12)

    def sorts(tier):
        return engine.forced_lowerings(SLOTS, tier)["step"]().as_text().count("stablehlo.sort")

    baseline = _engine(model, table, "static", "host", 4).forced_lowerings(SLOTS, 12)["step"]().as_text()
    assert sorts(12) == baseline.count("stablehlo.sort")
    assert sorts(8) > sorts(12)


def test_profile_times_steps_back_to_back(model, table, monkeypatch):
    """Engine.profile times `repeats` calls run back to back with one synchronisation at the end
    (the pipelined loop's cost: the larger of the host's dispatch and the device's work), after a
    first call, in `rounds` rounds over the tiers in turn, and keeps each entry's least round:
    a round slowed for every tier (here the first, by 0.2 s a call) does not set the table but
    sets its noise; repeats or rounds < 1 is refused by name."""
    engine = _engine(model, table, "compact", "host", 4)  # tiers (3, 8, 12)
    syncs, order = [], []
    real_sync, real_forced_step = jax.block_until_ready, engine.forced_step

    def counting_sync(x):
        syncs.append(1)
        return real_sync(x)

    def recording_forced_step(batch, tier, **kwargs):
        order.append(tier)
        run, slow = real_forced_step(batch, tier, **kwargs), len(order) <= len(engine.tier_tokens)

        def timed_run():
            if slow:
                time.sleep(0.2)
            return run()

        return timed_run

    monkeypatch.setattr(jax, "block_until_ready", counting_sync)
    monkeypatch.setattr(engine, "forced_step", recording_forced_step)
    costs = engine.profile([SLOTS], repeats=3, rounds=2)
    assert sorted(costs.entries) == [(SLOTS, t) for t in engine.tier_tokens]
    assert order == list(engine.tier_tokens) * 2  # round 1 over every tier, then round 2
    assert all(0 < seconds < 0.2 for seconds in costs.entries.values())  # round 2's, not the slowed round 1's
    # noise: the median entry's slowest round / fastest - 1; the slowed round ran >= 0.2 s a call, the fast < 0.2 s
    assert costs.noise > 1.0
    assert len(syncs) == 2 * 2 * len(engine.tier_tokens)  # per round: the first call, then one after the repeats
    for name in ("repeats", "rounds"):
        with pytest.raises(ValueError, match=name):
            engine.profile([SLOTS], **{name: 0})
