"""The engine: lossless greedy decoding in every mode, continuous batching, bad input, memory."""

import collections
import math
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest
from proposers import OracleProposer, lookup_proposer, random_draft

import jaxspec
from jaxspec import step as step_mod
from jaxspec.cache import cache_nbytes
from jaxspec.config import SpecConfig
from jaxspec.engine import Engine
from jaxspec.spec import layout
from jaxspec.spec.planner import CostTable

FIXTURE = Path(__file__).parent / "fixtures" / "tiny-qwen3_5"
MAX_NEW = 24


@pytest.fixture(scope="module")
def model():
    return jaxspec.load_target(FIXTURE)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(7)
    return [list(rng.integers(0, 512, n)) for n in (5, 17, 9, 30, 2, 11, 23, 8)]


@pytest.fixture(scope="module")
def reference(model, prompts):
    """Target-only greedy decoding (mode none) of every prompt, run one at a time."""
    engine = Engine(model, None, SpecConfig(verify_mode="none", num_slots=1, max_len=96))
    return [r.tokens for r in engine.generate(prompts, max_new_tokens=MAX_NEW)]


@pytest.mark.parametrize(
    "block_size,fold_policy",
    [(2, "every"), (4, "lazy"), (8, "every"), (16, "lazy")],
    ids=["B2-every", "B4-lazy", "B8-every", "B16-lazy"],
)
def test_static_greedy_is_lossless(model, prompts, reference, block_size, fold_policy):
    ring = 16 if fold_policy == "every" or block_size <= 8 else 32
    spec = SpecConfig(verify_mode="static", num_slots=4, max_len=96, fold_policy=fold_policy, ring_len=ring)
    engine = Engine(model, random_draft(model, block_size), spec)
    before = engine._step._cache_size()  # engines share compiled steps: count this one's
    compiled = []
    for batch in ([0], [1, 2, 3], list(range(8))):  # 8 requests > 4 slots: a queue
        results = engine.generate([prompts[i] for i in batch], max_new_tokens=MAX_NEW)
        for i, r in zip(batch, results):
            assert r.error is None
            assert r.tokens == reference[i], f"prompt {i}, batch {batch}"
        compiled.append(engine._step._cache_size() - before)
    assert compiled[0] <= 1 and compiled == compiled[:1] * 3, "the step recompiled for a new mix of requests"


def test_engines_with_one_configuration_share_compiled_steps(model, prompts, reference):
    """A second engine with the same configuration (a new Engine per request batch, a profiling
    engine beside the decoding one) reuses the first one's compiled step and prefill."""
    spec = SpecConfig(verify_mode="static", num_slots=2, max_len=96)
    draft = random_draft(model, 4)
    first = Engine(model, draft, spec)
    assert [r.tokens for r in first.generate(prompts[:2], max_new_tokens=MAX_NEW)] == reference[:2]
    compiled = (first._step._cache_size(), first._prefill._cache_size())
    second = Engine(model, draft, spec)
    assert [r.tokens for r in second.generate(prompts[2:4], max_new_tokens=MAX_NEW)] == reference[2:4]
    assert (second._step._cache_size(), second._prefill._cache_size()) == compiled, "second engine recompiled"
    other = Engine(model, draft, SpecConfig(verify_mode="static", num_slots=2, max_len=96, block_size=2))
    assert other._step is not first._step, "a different verify window must not share the step"


def test_dflash_proposer_carries_only_the_shared_weights(model):
    """The step takes the target as an argument; the engine's DFlash proposer holds only the
    embedding and lm_head it shares (the same arrays), not the target's layers a second time."""
    draft = random_draft(model, 4)
    engine = Engine(model, draft, SpecConfig(verify_mode="static", num_slots=2, max_len=96))
    shared = engine.proposer.target.params
    assert sorted(shared) == sorted(k for k in ("embed", "lm_head") if k in model.params)
    assert all(shared[k] is model.params[k] for k in shared)
    assert len(jax.tree.leaves(engine.proposer)) == len(jax.tree.leaves(draft)) + len(shared)


def test_trimmed_draft_block_is_lossless_and_drafts_differently(model, prompts, reference):
    """SpecConfig.trim_draft: a block-8 draft verified in windows of 4 runs a 4-position forward;
    decoding stays the target's greedy output, and the drafts' features differ from the untrimmed
    forward's (the trim reaches the draft)."""
    draft = random_draft(model, 8)
    features = {}
    for trim in (False, True):
        spec = SpecConfig(verify_mode="static", num_slots=4, max_len=96, block_size=4, trim_draft=trim)
        engine = Engine(model, draft, spec, record_trace=True)
        assert engine.proposer.forward_block == (4 if trim else None)
        results = engine.generate(prompts[:4], max_new_tokens=MAX_NEW)
        assert [r.tokens for r in results] == reference[:4], f"trim_draft={trim}"
        features[trim] = engine.recorder.trace().features
    assert features[True].shape == features[False].shape
    assert not np.allclose(features[True], features[False], atol=1e-3)
    with pytest.raises(ValueError, match="trim_draft"):
        Engine(model, None, spec, proposer=OracleProposer(target=model, block_size=8))
    with pytest.raises(ValueError, match="trim_draft"):
        SpecConfig(trim_draft=1)


def test_speed_stats_split_first_token_and_decode(model, prompts, reference):
    """tokens_per_s covers admission to the last token, first_token_s the prefill's share and
    decode_tokens_per_s the rest: n / tokens_per_s == first_token_s + (n - 1) / decode_tokens_per_s."""
    engine = Engine(model, random_draft(model, 4), SpecConfig(verify_mode="static", num_slots=2, max_len=96))
    results = engine.generate(prompts[:2] + [prompts[2]], max_new_tokens=MAX_NEW)
    single = engine.generate(prompts[:1], max_new_tokens=1)[0]
    for r in results:
        st, n = r.stats, len(r.tokens)
        assert n == MAX_NEW and st["first_token_s"] > 0 and st["decode_tokens_per_s"] > 0
        assert n / st["tokens_per_s"] == pytest.approx(st["first_token_s"] + (n - 1) / st["decode_tokens_per_s"])
    assert single.stats["decode_tokens_per_s"] == 0.0 and single.stats["first_token_s"] > 0


@pytest.fixture(scope="module")
def oracle_drafts(model, prompts, reference):
    """A LookupProposer of blocks of 8 over the greedy continuations (mode none, one request at a
    time, as `reference`; 8 tokens longer, so a block drafted near the end is known too)."""
    engine = Engine(model, None, SpecConfig(verify_mode="none", num_slots=1, max_len=96))
    longer = [r.tokens for r in engine.generate(prompts, max_new_tokens=MAX_NEW + 8)]
    assert [t[:MAX_NEW] for t in longer] == reference
    return lookup_proposer(model, prompts, longer, 8)


@pytest.mark.parametrize("fold_policy", ["every", "lazy"])
def test_oracle_drafts_hit_every_accept_length(model, prompts, reference, oracle_drafts, fold_policy):
    """Drafts: the greedy continuation with one random position wrong (OracleProposer's drafts,
    looked up instead of recomputed by 7 model passes a step)."""
    block = 8
    spec = SpecConfig(verify_mode="static", num_slots=4, max_len=96, fold_policy=fold_policy, ring_len=16)
    engine = Engine(model, None, spec, proposer=oracle_drafts)
    results = engine.generate(prompts, max_new_tokens=MAX_NEW)
    seen = set()
    for i, r in enumerate(results):
        assert r.tokens == reference[i], f"prompt {i}"
        seen.update(r.stats["accepted"])
        steps = r.stats["steps"]
        # tokens the steps returned per step: the first token is the prefill's, and the last step's
        # accepted drafts past max_new_tokens are not returned
        assert r.stats["accept_length"] == pytest.approx((len(r.tokens) - 1) / steps)
        assert len(r.tokens) - 1 <= sum(a + 1 for a in r.stats["accepted"])
    assert seen == set(range(block)), f"accepted lengths seen: {sorted(seen)}"


def test_request_joining_mid_run_matches_running_alone(model, prompts):
    spec = SpecConfig(verify_mode="static", num_slots=2, max_len=96)
    engine = Engine(model, random_draft(model, 4), spec)
    for temperature in (0.0, 0.8):
        together = engine.generate(prompts[:3], max_new_tokens=12, temperature=temperature, seed=[5, 6, 7])
        alone = engine.generate(prompts[2:3], max_new_tokens=12, temperature=temperature, seed=7)
        assert together[2].tokens == alone[0].tokens, f"temperature {temperature}"


def test_bad_requests_are_refused_and_others_finish(model, prompts, reference):
    engine = Engine(model, None, SpecConfig(verify_mode="none", num_slots=2, max_len=96))
    bad = [[], [1, 512, 3], list(range(80))]
    results = engine.generate([prompts[0]] + bad + [prompts[1]], max_new_tokens=MAX_NEW)
    assert results[0].tokens == reference[0] and results[4].tokens == reference[1]
    assert results[1].error.startswith("prompt 1:") and results[1].tokens == []
    assert results[2].error.startswith("prompt 2:") and "512" in results[2].error and "vocabulary" in results[2].error
    assert results[3].error.startswith("prompt 3:") and "max_new_tokens" in results[3].error


def test_token_ids_that_are_not_ints_are_refused(model, prompts, reference):
    engine = Engine(model, None, SpecConfig(verify_mode="none", num_slots=2, max_len=96))
    results = engine.generate([[1, 100.5, 3], [True, 2], prompts[0], np.array(prompts[1])], max_new_tokens=MAX_NEW)
    assert results[0].error == "prompt 0: token id 100.5 is not an int"
    assert results[1].error == "prompt 1: token id True is not an int"
    assert [r.tokens for r in results[2:]] == reference[:2]


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"verify_mode": "fast"}, "verify_mode"),
        ({"num_slots": 0}, "num_slots"),
        ({"block_size": 1}, "block_size"),
        ({"ring_len": 24}, "ring_len"),
    ],
    ids=["mode", "slots", "block", "ring"],
)
def test_invalid_spec_config_names_the_field(model, kwargs, field):
    with pytest.raises(ValueError, match=field):
        Engine(model, random_draft(model, 4), SpecConfig(**kwargs))


def test_generate_arguments_are_checked(model):
    engine = Engine(model, None, SpecConfig(verify_mode="none", num_slots=1, max_len=64))
    for kwargs, field in (
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -2}, "top_k"),
    ):
        with pytest.raises(ValueError, match=field):
            engine.generate([[1, 2]], **kwargs)


def test_device_state_bytes_match_design_formula(model):
    """No per-draft-token SSM state: the state is exactly docs/design.md section 4's table."""
    c = model.config
    spec = SpecConfig(verify_mode="static", num_slots=3, max_len=64, ring_dtype="bfloat16", state_dtype="bfloat16")
    engine = Engine(model, random_draft(model, 8), spec)
    s1, T, L, act = 4, 8, 16, 4  # float32 activations
    g, a = 3, 1
    H, HV, K, V, C, W = 2, 6, 16, 16, 160, 4
    formula = (
        g * s1 * HV * K * V * 2  # bf16 checkpoint
        + g * s1 * H * L * K * act  # ring keys
        + 2 * g * s1 * HV * L * V * 2  # ring updates, bf16 hi + lo
        + g * s1 * HV * L * 4  # ring gates
        + s1 * 4  # write_pos
        + g * s1 * (W - 1) * C * act
        + g * s1 * T * C * act  # conv state, saved window row
        + 2 * a * s1 * 64 * c.num_key_value_heads * c.head_dim * act  # kv cache
        + s1 * 4
    )  # seq_len
    leaves = jax.tree_util.tree_leaves(engine.state.cache)
    assert sum(x.nbytes for x in leaves) == formula == cache_nbytes(c, engine.cache_config)
    per_token_snapshot = T * HV * K * V
    for x in leaves:
        assert math.prod(x.shape[-3:]) < per_token_snapshot or x.shape[-2:] == (K, V) and T not in x.shape[:-2]


def test_eos_and_stop_strings_end_a_request(model, prompts, reference):
    from jaxspec.tokenizer import ByteTokenizer

    engine = Engine(
        model,
        random_draft(model, 4),
        SpecConfig(verify_mode="static", num_slots=2, max_len=96),
        tokenizer=ByteTokenizer(),
    )
    ref = reference[1]
    eos = ref[5]
    out = engine.generate([prompts[1]], max_new_tokens=MAX_NEW, eos_token_id=eos)[0]
    assert out.tokens == ref[: ref.index(eos) + 1]
    text_ids = [t for t in ref if t < 256]  # byte tokens decode to text
    assert text_ids, "the reference continuation has no byte-level token to stop on"
    stop = ByteTokenizer().decode([text_ids[0]])
    out = engine.generate([prompts[1]], max_new_tokens=MAX_NEW, stop=[stop])[0]
    assert out.tokens == ref[: ref.index(text_ids[0]) + 1] and stop in out.text


def test_trace_recorder_feeds_the_estimator_report(model, prompts, tmp_path):
    from jaxspec.spec import calibration, estimator

    spec = SpecConfig(verify_mode="static", num_slots=4, max_len=96, refit_interval=5)
    engine = Engine(model, None, spec, proposer=OracleProposer(target=model, block_size=6), record_trace=True)
    results = engine.generate(prompts, max_new_tokens=16)
    trace = engine.recorder.save(tmp_path / "trace.npz")
    # every row the device verified is in the trace: the host's steps, plus the one extra row a
    # request runs in the step already in flight when the host sees it finish
    host = collections.Counter(a for r in results for a in r.stats["accepted"])
    assert trace.features.shape[1] == 5 and np.all(trace.verified == 5)
    assert not host - collections.Counter(trace.accepted.tolist())
    assert len(trace.accepted) <= sum(host.values()) + len(prompts)
    # each row names its request (8 requests through 4 slots, so a slot serves several): a request's
    # rows, in step order, are its host steps plus at most the one in flight when it finished
    assert set(trace.request.tolist()) == set(range(len(prompts)))
    for i, r in enumerate(results):
        rows = trace.accepted[trace.request == i].tolist()
        assert rows[: len(r.stats["accepted"])] == r.stats["accepted"], i
        assert len(rows) <= len(r.stats["accepted"]) + 1, i
    # replayed with no refit inside the trace (first_refit 0: the first refit would be at call
    # 100), so the estimator's coefficients are the same for every row
    fixed = estimator.init(trace.features.shape[1], first_refit=0, num_slots=len(prompts))
    report = calibration.evaluate(calibration.load_trace(tmp_path / "trace.npz"), fixed)
    assert report["samples"] == int(trace.verified.sum()) and report["refits"] == 0
    # The oracle's drafts are one-hot logits, so every feature of the trace is the same value
    # (measured: 23.76 everywhere) and the only signal is the position: both the fixed estimator and
    # the prod-q_max baseline rank a sample by its position alone (survival falls with the position).
    # Their AUC is then exactly the AUC of "earlier position = more likely accepted", computed here
    # from the trace's own labels (Mann-Whitney over all (accepted, rejected) pairs, ties half).
    # Measured: 0.7574 for all three (40 rows, 200 samples). A report that mislabels samples, or an
    # estimator whose survival is not falling with the position, moves the AUC off this value.
    assert np.ptp(trace.features) == 0
    pos = np.broadcast_to(np.arange(trace.features.shape[1]), trace.features.shape)
    live = pos < trace.verified[:, None]
    label = (pos < trace.accepted[:, None])[live]
    yes, no = pos[live][label], pos[live][~label]
    by_position = (np.sum(yes[:, None] < no[None]) + 0.5 * np.sum(yes[:, None] == no[None])) / (yes.size * no.size)
    assert 0.6 < by_position < 0.9, by_position  # the oracle spreads the accepted lengths 0..5
    assert report["auc"] == pytest.approx(by_position, abs=1e-9), (report["auc"], by_position)
    assert report["auc_baseline"] == pytest.approx(by_position, abs=1e-9)
    rates = [label_j.mean() for label_j in (pos < trace.accepted[:, None]).T]
    assert [p["accept_rate"] for p in report["per_position"]] == pytest.approx(rates)


def test_a_slot_taking_a_request_starts_with_an_empty_history(model, prompts):
    """The estimator's per-slot history (decayed accepted / observed / expected counts) fills while
    a slot's request decodes; the prefill of the next request in that slot empties it; the null slot
    is never written."""
    spec = SpecConfig(verify_mode="static", num_slots=2, max_len=96)
    engine = Engine(model, None, spec, proposer=OracleProposer(target=model, block_size=6))
    engine.generate(prompts[:2], max_new_tokens=48)
    before = np.asarray(engine.state.estimator.history)
    assert before[0].tolist() == [0.0, 0.0, 0.0]
    # >= 8 steps of >= 1 observed position each (decay 0.9): more than one step's 5 positions
    assert before[1, 1] > 5 and before[2, 1] > 5, before
    assert np.all(before[1:, 0] <= before[1:, 1]) and np.all(before[1:, 2] <= before[1:, 1])
    engine.submit(prompts[2], max_new_tokens=8)
    engine.step()  # admits the request into slot 1 (slots are taken from 1 up), at most one step more
    after = np.asarray(engine.state.estimator.history)
    assert after[1, 1] <= 5, after
    np.testing.assert_array_equal(after[2], before[2])  # the idle slot keeps its history


# ---------------------------------------------------------------------------------------------
# non-finite logits and honest stats


def _with_nan_embedding(model, token):
    params = jax.tree_util.tree_map(lambda x: x, model.params)
    params["embed"] = params["embed"].at[token].set(np.nan)
    return model.replace(params=params)


def _unused_token(*token_lists):
    """A token id in none of the lists, and neither 0 (it pads prefill rows) nor 511 (the draft's mask)."""
    used = set().union(*map(set, token_lists))
    return next(t for t in range(1, 511) if t not in used)


def test_non_finite_prompt_logits_end_that_request_only(model, prompts, reference):
    """A token whose embedding is NaN makes the prefill logits of the prompt holding it non-finite:
    that request ends with `error` and no tokens, the others decode exactly, and the slot it held
    serves the next request exactly."""
    bad = _unused_token(prompts[0], prompts[1], prompts[2], reference[0], reference[1], reference[2])
    target = _with_nan_embedding(model, bad)
    engine = Engine(target, random_draft(model, 4), SpecConfig(verify_mode="static", num_slots=2, max_len=96))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no draft row went non-finite either
        results = engine.generate([prompts[0], [3, bad, 5], prompts[1], prompts[2]], max_new_tokens=MAX_NEW)
    assert results[1].tokens == [] and results[1].error.startswith("prompt 1: the target's logits are not finite")
    assert [r.tokens for r in (results[0], results[2], results[3])] == reference[:3]


@pytest.mark.parametrize("mode", ["none", "static"])
def test_non_finite_logits_mid_decode_end_that_request(model, prompts, reference, mode):
    """The token generated 6th has a NaN embedding: the step that reads it yields non-finite logits,
    the request ends with the tokens emitted before, and the request beside it goes on exactly (a
    rejected draft of that token reaches no emitted token). The draft reads the embedding too: in
    static mode its block goes non-finite as well, which is reported once."""
    at = next(
        p
        for p in range(5, MAX_NEW)
        if reference[0][p] not in set(prompts[0]) | set(reference[0][:p]) | set(prompts[1]) | set(reference[1])
    )
    target = _with_nan_embedding(model, reference[0][at])
    draft = random_draft(model, 4) if mode == "static" else None
    engine = Engine(target, draft, SpecConfig(verify_mode=mode, num_slots=2, max_len=96))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ended, other = engine.generate([prompts[0], prompts[1]], max_new_tokens=MAX_NEW)
    assert len(caught) == (mode == "static") and all("draft's logits" in str(w.message) for w in caught)
    assert ended.error.startswith("prompt 0: the target's logits are not finite")
    assert ended.tokens == reference[0][: len(ended.tokens)] and len(ended.tokens) <= at + 1
    assert other.error is None and other.tokens == reference[1]


def test_non_finite_draft_warns_once_and_stays_lossless(model, prompts, reference):
    draft = random_draft(model, 4)
    draft = draft.replace(params={**draft.params, "fc": draft.params["fc"].at[0, 0].set(np.nan)})
    engine = Engine(model, draft, SpecConfig(verify_mode="static", num_slots=2, max_len=96))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = engine.generate(prompts[:3], max_new_tokens=MAX_NEW)
        sampled = engine.generate(prompts[:3], max_new_tokens=MAX_NEW, temperature=0.8, seed=[1, 2, 3])
    assert [r.tokens for r in results] == reference[:3]
    for r in results:
        assert r.stats["accept_length"] == 1.0 and set(r.stats["verified"]) == {0}
    for r in sampled:  # sampled from the target alone: valid tokens, none lost
        assert r.error is None and len(r.tokens) == MAX_NEW and all(0 <= t < 512 for t in r.tokens)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 2 and all("draft's logits were not finite" in m for m in messages), messages


def test_stats_label_compilation(model, prompts):
    """includes_compilation is True when a step or prefill compiled during the request (fresh step
    factories) and False once they are compiled."""
    step_mod.jitted_step.cache_clear()
    step_mod.jitted_prefill.cache_clear()
    try:
        engine = Engine(model, random_draft(model, 4), SpecConfig(verify_mode="static", num_slots=2, max_len=96))
        first = engine.generate(prompts[:2], max_new_tokens=8)
        second = engine.generate(prompts[:2], max_new_tokens=8)
    finally:
        step_mod.jitted_step.cache_clear()
        step_mod.jitted_prefill.cache_clear()
    assert [r.stats["includes_compilation"] for r in first] == [True, True]
    assert [r.stats["includes_compilation"] for r in second] == [False, False]


def test_readout_carries_the_survivals_bit_for_bit():
    """The step's one int32 readout holds emitted | accepted | verified | the survivals' float32
    bits; split_readout gives them back exactly (NaN, -0.0, subnormals included); mode none's
    readout has no survival columns."""
    rng = np.random.default_rng(11)
    s, t = 5, 7
    emitted = rng.integers(-1, 600, (s, t)).astype(np.int32)
    accepted, verified = rng.integers(0, t, s).astype(np.int32), rng.integers(0, t, s).astype(np.int32)
    survival = rng.uniform(0, 1, (s, t - 1)).astype(np.float32)
    survival[0, :4] = [np.nan, -0.0, np.float32(1e-40), 1.0]
    packed = np.asarray(step_mod.readout(emitted, accepted, verified, survival))
    assert packed.dtype == np.int32 and packed.shape == (s, 2 * t + 1)
    got = step_mod.split_readout(packed, t)
    for want, have in zip((emitted, accepted, verified), got[:3]):
        np.testing.assert_array_equal(have, want)
    np.testing.assert_array_equal(got[3].view(np.int32), survival.view(np.int32))
    plain = np.asarray(step_mod.readout(emitted[:, :1], accepted, verified))
    assert plain.shape == (s, 3) and step_mod.split_readout(plain, 1)[3] is None


def test_host_tier_choice_reads_the_steps_survivals_from_its_readout(model, prompts, reference):
    """Compact with host tier choice (lag 2): each choice reads numpy survivals, bit-identical to
    the device survivals of the step `lag` back (they arrive in that step's readout, no transfer
    of their own), and decoding stays lossless."""
    spec = SpecConfig(verify_mode="compact", num_slots=3, max_len=96, warmup_refits=0, plan_overhead=0.0)
    assert spec.lag == 2
    tiers, _ = layout.tiers(3, 6)  # the engine's ladder: 3 slots, window 6
    table = {(b, n): 1.0 + 0.05 * n for b in range(1, 4) for n in range(1, tiers[-1] + 1)}
    engine = Engine(model, random_draft(model, 6), spec, cost_table=CostTable(table))
    device, seen = [], []
    step, choose = engine._step, engine.tier_planner.choose_tier

    def spy_step(*args, **kwargs):
        out = step(*args, **kwargs)
        device.append(np.asarray(out[3]))
        return out

    def spy_choose(rows, old, steps_run, host_seconds):
        if old is not None:
            seen.append((len(device), old[1]))
        return choose(rows, old, steps_run, host_seconds)

    spy_step._cache_size = step._cache_size  # the engine counts its compiled programs
    engine._step, engine.tier_planner.choose_tier = spy_step, spy_choose
    results = engine.generate(prompts, max_new_tokens=MAX_NEW)
    assert [r.tokens for r in results] == reference
    assert len(seen) > 5
    for k, survival in seen:  # the choice for step k reads step k - 2's survivals
        assert isinstance(survival, np.ndarray) and survival.dtype == np.float32
        np.testing.assert_array_equal(survival.view(np.int32), device[k - 2].view(np.int32))
