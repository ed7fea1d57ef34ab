"""The engine's streaming API: submit / step events, continuous admission as slots free, refusals,
per-request sampling in one batch, fixed-row prefills, and compilation ahead from `lowerings`."""

from pathlib import Path

import jax
import numpy as np
import pytest
from proposers import random_draft

import jaxspec
from jaxspec.bench.compile import counting, precompile
from jaxspec.config import SpecConfig
from jaxspec.engine import Engine, _raw_key

FIXTURE = Path(__file__).parent / "fixtures" / "tiny-qwen3_5"
SPEC = SpecConfig(verify_mode="static", num_slots=2, max_len=96)


@pytest.fixture(scope="module")
def model():
    return jaxspec.load_target(FIXTURE)


@pytest.fixture(scope="module")
def draft(model):
    return random_draft(model, 4)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(11)
    return [list(map(int, rng.integers(0, 512, n))) for n in (6, 19, 3, 12, 9)]


@pytest.fixture(scope="module")
def greedy_reference(model, prompts):
    engine = Engine(model, None, SpecConfig(verify_mode="none", num_slots=2, max_len=96))
    return [r.tokens for r in engine.generate(prompts, max_new_tokens=12)]


def drive(engine):
    """Run `step` until the engine is idle: the list of each turn's events."""
    turns = []
    while engine.busy:
        turns.append(engine.step())
    return turns


def test_events_stream_each_request_once_and_mix_sampling(model, draft, prompts, greedy_reference):
    """Events carry each request's tokens in order (first flag on its first token, one finishing
    event with the result, nothing after it); greedy and sampled requests share steps, and the
    greedy ones still decode the target's greedy tokens; a sampled request's tokens equal
    generate's for its seed."""
    engine = Engine(model, draft, SPEC)
    temps = [0.0, 0.9, 0.0, 0.9, 0.0]
    ids = [engine.submit(p, 12, temperature=t, seed=7 + i) for i, (p, t) in enumerate(zip(prompts, temps))]
    assert ids == list(range(5)) and engine.busy
    stream, results = {i: [] for i in ids}, {}
    for turn in drive(engine):
        assert len({ev.request for ev in turn}) == len(turn)
        for ev in turn:
            assert ev.request not in results, "an event after the request finished"
            assert ev.first == (not stream[ev.request] and bool(ev.tokens))
            stream[ev.request] += ev.tokens
            if ev.result is not None:
                results[ev.request] = ev.result
    assert sorted(results) == ids and engine.step() == []
    for i in ids:
        assert stream[i] == results[i].tokens and len(stream[i]) == 12
        if temps[i] == 0:
            assert stream[i] == greedy_reference[i], i
    sampled = engine.generate([prompts[1]], max_new_tokens=12, temperature=0.9, seed=8)[0]
    assert sampled.tokens == stream[1]


def test_a_freed_slot_takes_the_next_request_at_the_next_turn(model, draft, prompts, greedy_reference):
    """Two slots, three requests: the third waits in the queue and gets its first token in the
    turn right after the one that reported the first finish (continuous batching, not waves)."""
    engine = Engine(model, draft, SPEC)
    short = engine.submit(prompts[0], 3)
    engine.submit(prompts[1], 12)
    third = engine.submit(prompts[2], 12)
    turns = drive(engine)
    first = {ev.request: t for t, turn in enumerate(turns) for ev in turn if ev.first}
    finished = {ev.request: t for t, turn in enumerate(turns) for ev in turn if ev.result is not None}
    assert first[short] == 0 and first[third] == finished[short] + 1
    assert max(sum(1 for r in first if first[r] <= t < finished[r] + 1) for t in range(len(turns))) <= 2
    assert engine.tier_counts and engine.totals["rows"] <= 2 * engine.totals["steps"]
    assert engine.step() == [] and engine._free == [1, 2]  # idle: slots from 1 up, as each generate


def test_request_keys_are_jax_keys_made_on_the_host():
    for seed in (0, 1, 7, 2**31 - 1, 2**31, -1, -(2**31) - 1, 2**32 + 5, 2**40 + 3):
        np.testing.assert_array_equal(_raw_key(seed), np.asarray(jax.random.PRNGKey(seed)), err_msg=str(seed))


def test_refusals_and_misuse(model, draft, prompts):
    engine = Engine(model, draft, SPEC)
    bad = engine.submit([], 4)
    good = engine.submit(prompts[0], 2)
    turn = engine.step()
    assert turn[0].request == bad and turn[0].result.error == f"request {bad}: empty" and turn[0].tokens == ()
    with pytest.raises(RuntimeError, match="generate"):
        engine.generate([prompts[1]], max_new_tokens=2)
    with pytest.raises(RuntimeError, match="forced_step"):
        engine.forced_step(1, engine.tier_tokens[-1])
    with pytest.raises(ValueError, match="temperature"):
        engine.submit(prompts[0], 2, temperature=-1.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.submit(prompts[0], 0)
    while engine.busy:
        engine.step()
    assert good == bad + 1 and not engine.busy


def test_fixed_prefill_rows_and_ahead_compilation(model, draft, prompts, greedy_reference):
    """SpecConfig.prefill_rows = 1: joins of two prefill one row at a time, the same tokens as
    power-of-two batches; after compiling `lowerings` ahead, decoding compiles nothing."""
    spec = SpecConfig(verify_mode="static", num_slots=2, max_len=96, prefill_rows=1)
    engine = Engine(model, draft, spec)
    jobs = engine.lowerings(greedy=True, prompt_lengths=[len(p) for p in prompts])
    assert sorted(jobs) == ["prefill 1x16", "prefill 1x32", f"step {engine.tier_tokens[-1]}"]
    compiled = precompile(list(jobs.items()), workers=2)
    assert all("error" not in v for v in compiled.values()), compiled
    with counting() as compiles:
        out = engine.generate(prompts, max_new_tokens=12)
    assert [r.tokens for r in out] == greedy_reference
    assert not [name for name in compiles if "step" in name or "prefill" in name], compiles
