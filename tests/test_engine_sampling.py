"""Lossless speculative sampling through the engine: the first emitted tokens of a static-mode
engine with a (bad) random DFlash draft follow the target's own distribution exactly.

Vocabulary 16, 10,240 seeded requests; the exact target distribution of the first three tokens
is enumerated with cache-free forwards (16 + 256 continuations). A deliberately wrong acceptance
(the classic bug: after a rejection, draw the bonus from p instead of the residual max(p - q, 0))
must fail the same test. At this sample size (2026-12-08) the lossless runs gave p = 0.42 .. 0.84
and every control p < 1e-37, far below the 1e-3 line.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from proposers import OracleProposer
from stats import chi2_test

from jaxspec import dflash
from jaxspec import step as step_mod
from jaxspec import target as target_mod
from jaxspec.config import DraftConfig, SpecConfig, TargetConfig
from jaxspec.engine import Engine
from jaxspec.spec import layout
from jaxspec.spec.planner import CostTable

VOCAB, SLOTS, ROUNDS, PROMPT = 16, 512, 20, [3, 1, 4, 1]
TEMPERATURE = 1.0


@pytest.fixture(scope="module")
def models():
    config = TargetConfig(
        layout="qwen3_5_text",
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        layer_types=("linear_attention",) * 3 + ("full_attention",),
        rms_norm_eps=1e-6,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        rope_theta=1e4,
        partial_rotary_factor=0.25,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        tie_word_embeddings=False,
        max_position_embeddings=64,
    )
    target = target_mod.init_target(config, jax.random.PRNGKey(11))
    # sharpen the target a little so the distribution has structure worth testing
    target = target.replace(params={**target.params, "lm_head": target.params["lm_head"] * 4.0})
    draft_config = DraftConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        vocab_size=VOCAB,
        block_size=4,
        target_layer_ids=(1, 3),
        mask_token_id=VOCAB - 1,
        target_hidden_size=32,
    )
    return target, dflash.init_draft(draft_config, jax.random.PRNGKey(12))


@pytest.fixture(scope="module")
def joint(models):
    """P(t1, t2, t3 | PROMPT) of target-only sampling at TEMPERATURE, [16, 16, 16] float64, once per
    module. One jitted cache-free forward of the 256 sequences PROMPT + (t1, t2) gives all three
    factors (causal: position i's logits see only positions <= i): P(t1) at the last prompt
    position, P(t2 | t1) one later, P(t3 | t1, t2) at the end."""
    target = models[0]
    seqs = jnp.asarray([PROMPT + [a, b] for a in range(VOCAB) for b in range(VOCAB)], jnp.int32)

    @jax.jit
    def next_probs(seqs):
        lengths = jnp.full((seqs.shape[0],), seqs.shape[1], jnp.int32)
        logits = target_mod.prefill_layers(target, seqs, lengths, (), "ref")[0]
        return jax.nn.softmax(logits[:, len(PROMPT) - 1 :] / TEMPERATURE, axis=-1)

    probs = np.asarray(next_probs(seqs), np.float64).reshape(VOCAB, VOCAB, 3, VOCAB)
    p1, p2, p3 = probs[0, 0, 0], probs[:, 0, 1], probs[:, :, 2]
    return p1[:, None, None] * p2[:, :, None] * p3


def _sample(engine):
    firsts = []
    for round_ in range(ROUNDS):
        seeds = list(range(round_ * SLOTS, (round_ + 1) * SLOTS))
        results = engine.generate([PROMPT] * SLOTS, max_new_tokens=3, temperature=TEMPERATURE, seed=seeds)
        firsts += [r.tokens for r in results]
    counts = np.zeros((VOCAB,) * 3)
    np.add.at(counts, tuple(np.array(firsts).T), 1)
    return counts


def _pvalues(counts, joint):
    return {
        "joint12": chi2_test(counts.sum(2), joint.sum(2))[2],
        "t2": chi2_test(counts.sum((0, 2)), joint.sum((0, 2)))[2],
        "t3": chi2_test(counts.sum((0, 1)), joint.sum((0, 1)))[2],
    }


def _engine(models):
    target, draft = models
    return Engine(target, draft, SpecConfig(verify_mode="static", num_slots=SLOTS, max_len=16, max_top_k=VOCAB))


def test_speculative_sampling_through_the_engine_is_lossless(models, joint):
    engine = _engine(models)
    pvalues = _pvalues(_sample(engine), joint)
    assert min(pvalues.values()) > 1e-3, pvalues


def _bonus_from_p(right):
    def accept(keys, probs, ids, drafts, q, num_verify, temperature):
        a, bonus, emitted = right(keys, probs, ids, drafts, q, num_verify, temperature)
        rows = jnp.arange(probs.shape[0])
        keys = jax.vmap(lambda k: jax.random.fold_in(k, 99))(keys)
        pick = jax.vmap(jax.random.categorical)(keys, jnp.log(probs[rows, a]))
        bonus = jnp.where(a < num_verify, ids[rows, a, pick], bonus)
        emitted = jnp.where(jnp.arange(emitted.shape[1])[None] == a[:, None], bonus[:, None], emitted)
        return a, bonus, emitted

    return accept


@pytest.fixture
def retrace():
    """Engines share compiled steps (one jit per configuration, cached by step.jitted_step): a
    test that patches a function the step traces must trace it afresh, and must not leave its
    patched step behind for later tests. Only the step factory is cleared: the prefill traces none
    of the patched functions (sampling.accept, sampling.sample_draft, planner.plan_lengths), so its
    compiled programs are shared with the unpatched tests, as are the module's forwards."""
    step_mod.jitted_step.cache_clear()
    yield
    step_mod.jitted_step.cache_clear()


def test_wrong_acceptance_fails_the_same_test(models, joint, monkeypatch, retrace):
    monkeypatch.setattr(step_mod.sampling, "accept", _bonus_from_p(step_mod.sampling.accept))
    pvalues = _pvalues(_sample(_engine(models)), joint)
    assert min(pvalues.values()) < 1e-3, pvalues


# ---------------------------------------------------------------------------------------------
# compact mode: planned lengths from the online estimator, packed tiers


def _compact_engine(models, tier_dispatch="host"):
    """Compact mode with a draft whose first position is the target's own distribution, so drafts
    are often accepted and any anticipation shows."""
    target = models[0]
    tiers, _ = layout.tiers(SLOTS, 3)
    costs = CostTable({(b, n): 1.0 + 0.004 * n for b in (1, SLOTS) for n in range(1, tiers[-1] + 1)})
    spec = SpecConfig(
        verify_mode="compact", num_slots=SLOTS, max_len=16, max_top_k=VOCAB, lag=1, warmup_refits=0, refit_interval=2
    )
    return Engine(
        target,
        None,
        spec,
        proposer=OracleProposer(target=target, block_size=3, soft=True),
        cost_table=costs,
        tier_dispatch=tier_dispatch,
    )


def _sample_in_waves(engine):
    """Twice as many requests as slots per call: the second wave joins while the first decodes,
    so its first verify steps are planned from survivals of the step before."""
    firsts = []
    for round_ in range(ROUNDS // 2):
        seeds = list(range(round_ * 2 * SLOTS, (round_ + 1) * 2 * SLOTS))
        results = engine.generate([PROMPT] * (2 * SLOTS), max_new_tokens=3, temperature=TEMPERATURE, seed=seeds)
        firsts += [r.tokens for r in results]
    counts = np.zeros((VOCAB,) * 3)
    np.add.at(counts, tuple(np.array(firsts).T), 1)
    return counts


def test_compact_sampling_with_the_estimator_is_lossless(models, joint):
    engine = _compact_engine(models)
    pvalues = _pvalues(_sample_in_waves(engine), joint)
    assert engine.tier_tokens[0] in engine.tier_counts and len(engine.tier_counts) > 1, dict(engine.tier_counts)
    assert min(pvalues.values()) > 1e-3, pvalues


def test_a_planner_that_peeks_at_the_drafts_fails_the_same_test(models, joint, monkeypatch, retrace):
    """Verifying draft 1 only when its sampled value is even anticipates the draft: not lossless.
    Under tier_dispatch "switch", where every step runs the planner (a host-chosen full tier plans
    nothing, so there the peek would bite only in the partial tiers)."""
    drawn = []
    sample, plan = step_mod.sampling.sample_draft, step_mod.planner.plan_lengths

    def sample_and_remember(key, q):
        drawn.append(sample(key, q))
        return drawn[-1]

    def peeking_plan(survival, budget):
        return jnp.where(drawn[-1][:, 0] % 2 == 0, plan(survival, budget), 0)

    monkeypatch.setattr(step_mod.sampling, "sample_draft", sample_and_remember)
    monkeypatch.setattr(step_mod.planner, "plan_lengths", peeking_plan)
    pvalues = _pvalues(_sample_in_waves(_compact_engine(models, "switch")), joint)
    assert min(pvalues.values()) < 1e-3, pvalues
