"""The engine's device side: `EngineState` and the pure jitted step draft -> verify -> accept -> commit.

Pure functions of the device state, one jitted program per configuration and variant (greedy-only
or sampling), donating the state; `jitted_step` and `jitted_prefill` cache them at module level,
so every Engine of one configuration shares them. The host loop (jaxspec/engine.py) calls them
and reads the emitted tokens; it chooses the verify tier (jaxspec/tier_planner.py) or hands the
step a `DevicePlan` to choose it on the device (`device_tier`). docs/design.md section 8.

The contract. Layouts: S1 = num_slots + 1 slots, slot 0 the null slot; S rows a step (num_slots),
R rows and P (padded) prompt positions a prefill; T = window (anchor + drafts). The step never
recompiles for a new mix of requests: slot occupancy is data (inactive rows point at slot 0).
- step, `jitted_step(window, mode, max_top_k, impl, tiers, switch)(state, target, proposer,
  slots [S], plan, force_accept, *, greedy, tier, simulate=None)` -> (state, readout [S, 2T + 1]
  int32 = emitted [S, T] | accepted [S] | verified [S] | survival [S, T-1] as float32 bits
  (`readout`, `split_readout`), features [S, T-1], survival [S, T-1], tier tokens []); see `_step`
  (mode "none": `_decode`, whose features and survival are None and whose readout is [S, T + 2]).
- prefill, `jitted_prefill(max_top_k, impl)(state, target, proposer, tokens [R, P], lengths [R],
  slots [R], keys [R, 2], params)` -> (state, first generated token [R]); see `_prefill`. One
  compiled prefill per prompt-length bucket (and row count) the host pads to.

Non-finite logits: a request whose target logits hold a NaN or an inf in a step (or at prefill)
emits NON_FINITE instead of tokens; the others go on. A draft row with non-finite logits verifies
no drafts that step (the target alone picks the token, so decoding stays lossless) and counts in
`EngineState.draft_non_finite`.
"""

from functools import cache, partial, wraps

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxspec import parallel
from jaxspec import target as target_mod
from jaxspec.cache import CacheState
from jaxspec.ops import packing, sampling
from jaxspec.ops.sampling import SamplingParams
from jaxspec.spec import estimator, layout, planner, simulation
from jaxspec.target import Target

NON_FINITE = -1  # the token id a step emits for a request whose target logits are not finite


@struct.dataclass
class EngineState:
    """Device state: the target cache, the proposer's state, the acceptance estimator, per slot
    [S1] the anchor (the token emitted last, not yet in the target state), a raw PRNG key [S1, 2]
    and sampling params, and draft_non_finite (int32 []: draft rows whose logits were not finite,
    since the last `generate` began)."""

    cache: CacheState
    proposer: object
    estimator: estimator.EstimatorState | None
    anchor: jnp.ndarray
    keys: jnp.ndarray
    sampling: SamplingParams
    draft_non_finite: jnp.ndarray


def _finite_rows(logits, used=None):
    """logits [S, vocab] or [S, T, vocab] -> bool [S]: every logit the request uses is finite; with
    `used` [S], window rows 0..used only (the rows that give emitted tokens: a rejected draft's
    row reaches no token and no committed state)."""
    finite = jnp.all(jnp.isfinite(logits), axis=-1)
    if used is not None:
        finite = finite | (jnp.arange(logits.shape[1])[None, :] > used[:, None])
    return jnp.all(finite.reshape(logits.shape[0], -1), axis=-1)


def _target_rows(logits, params, greedy, max_top_k):
    """logits [S, T, vocab] -> (probs, ids) [S, T, k] of the processed target distribution; a
    greedy-only batch takes the argmax (k = 1) and never sorts the vocabulary."""
    if greedy:
        ids = sampling.greedy_tokens(logits)[..., None]
        return jnp.ones(ids.shape, jnp.float32), ids
    return sampling.target_distribution(logits, params, max_top_k)


@struct.dataclass
class DevicePlan:
    """Inputs of the device-side tier choice (tier_dispatch "switch"), all traced data so one
    compiled step serves every tier: plan (bool []: False = verify everything, the host's
    warm-up / no-history / no-cost-table rule), survival [S, T-1] of the step `lag` steps back,
    same [S] (the row holds the request it held then; otherwise its survivals count as 1) and
    costs [S+1, tiers] (seconds of tier j's admissible budget at n active rows: the table's, at
    least the host's own time a step, `TierPlanner.device_plan`)."""

    plan: jnp.ndarray
    survival: jnp.ndarray
    same: jnp.ndarray
    costs: jnp.ndarray


def device_tier(plan: DevicePlan, active, tiers, drafts_per_row):
    """Index (int32 []) of the verify tier the device chooses (`planner.choose_tier`, jittable):
    plan a DevicePlan (`TierPlanner.device_plan`), active bool [S] (the rows that decode), tiers
    the ascending tier ladder (static), drafts_per_row (static: window - 1). The last (full) tier
    while `plan.plan` is False."""
    survival = jnp.where(plan.same[:, None], plan.survival, 1.0)
    tier = planner.choose_tier(survival, active, plan.costs, tiers, drafts_per_row)
    return jnp.where(plan.plan, tier, len(tiers) - 1).astype(jnp.int32)


def _step(
    state: EngineState,
    target: Target,
    proposer,
    slots,
    plan,
    force_accept,
    *,
    window,
    tier,
    mode,
    greedy,
    max_top_k,
    impl,
    tiers=None,
    simulate=None,
):
    """One decoding step for the rows `slots` [S] (0 = inactive row).

    mode "static" verifies every row's whole block; "cap-accept" and "compact" plan per-request
    lengths from the estimator's current survivals with a budget of `tier` - active rows tokens.
    `tier` static: the host chose it from survivals `lag` steps old (the full tier, S·T, plans
    nothing: every row verifies its block, as in static). `tier` None (tier_dispatch
    "switch"): the device chooses it from `plan` (a DevicePlan) among `tiers`, and compact runs
    the verify under lax.switch over the tiers. cap-accept verifies the whole block and caps
    acceptance at the planned length; compact packs only the planned windows into `tier` rows.
    force_accept: bool [], traced (so profiling and decoding share one compiled step per tier);
    True (profiling only) accepts every verified draft. simulate: None, or the traced (a, b, seed)
    of `SpecConfig.simulated_acceptance`, whose rule (`simulation.accept`) then decides acceptance
    in place of the chain rule. Returns (state, emitted [S, T],
    accepted [S], verified [S], features [S, T-1], survival [S, T-1], tier tokens []); a row whose
    target logits are not finite at a window position up to its last accepted one emits NON_FINITE
    throughout, a row whose draft logits are not finite verifies no drafts.
    """
    s, t = slots.shape[0], window
    active = slots > 0
    anchors, ctx_len = state.anchor[slots], state.cache.seq_len[slots]
    keys = jax.vmap(lambda k: jax.random.split(k, 3))(state.keys[slots])
    key_draft, key_accept, key_next = keys[:, 0], keys[:, 1], keys[:, 2]
    params = jax.tree_util.tree_map(lambda x: x[slots], state.sampling)

    # draft (features score the distribution, never the drawn token: non-anticipation)
    # one argmax pass and one exp-sum pass give the drafts (greedy), q's normaliser and the feature
    with jax.named_scope("draft"):
        draft_logits, proposer_state = proposer.propose(state.proposer, anchors, slots, ctx_len)
        dist = sampling.draft_distribution(draft_logits[:, : t - 1], params.temperature)
        if greedy:
            drafts, q = dist.argmax, None
        else:  # drawn from the head the target keeps (its top-k / top-p), not from the full softmax
            q = sampling.processed_draft(draft_logits[:, : t - 1], params, max_top_k, impl=impl)
            drafts = sampling.sample_draft(key_draft, q)
        # [S]: from the row statistics the distribution already holds (no pass over the logits)
        draft_finite = jnp.all(jnp.isfinite(dist.zmax) & jnp.isfinite(dist.rest), axis=-1)
        live = active & (anchors != NON_FINITE)  # a NON_FINITE anchor: the request already ended
    with jax.named_scope("estimator"):
        features = estimator.distribution_features(dist)
        _, survival = estimator.predict(state.estimator, features, slots)

    # plan: drafts to verify per request, and the packed layout of the verify
    tier_index = None
    if mode == "static" or tier == s * t:
        # a host-chosen full tier holds every row's block: no planning (its sort) to run
        lengths = jnp.full((s,), t - 1, jnp.int32)
        tier = s * t
    else:
        with jax.named_scope("plan"):
            if tier is None:
                tier_index = device_tier(plan, active, tiers, t - 1)
                tier = jnp.asarray(tiers, jnp.int32)[tier_index]
            budget = tier - jnp.sum(active, dtype=jnp.int32)
            lengths = planner.plan_lengths(jnp.where(active[:, None], survival, jnp.nan), budget)
    lengths = jnp.where(active & draft_finite, lengths, 0)

    def verify_commit(layout_tier, cache, proposer_state):
        """Verify the planned windows in a layout of `layout_tier` tokens (static), accept,
        commit, and feed the committed rows to the draft."""
        with jax.named_scope("verify"):
            tokens, query_start_loc, layout_slots = layout.step_layout(lengths, anchors, drafts, slots, layout_tier)
            logits, hidden, cache = target_mod.verify(
                target, cache, tokens, query_start_loc, layout_slots, proposer.taps, impl=impl
            )
        with jax.named_scope("accept"):
            logits = layout.unpack_rows(logits, query_start_loc, t)  # [S, T, vocab]
            probs, ids = _target_rows(logits, params, greedy, max_top_k)
            if simulate is None:
                accepted, bonus, emitted = sampling.accept(
                    key_accept, probs, ids, drafts, q, lengths, params.temperature
                )
            else:
                accepted, bonus, emitted = simulation.accept(
                    simulate, key_accept, features, lengths, drafts, probs, ids
                )
            accepted = jnp.where(force_accept, lengths, accepted)
            emitted = jnp.where(_finite_rows(logits, accepted)[:, None], emitted, NON_FINITE)
        with jax.named_scope("commit"):
            cache = target_mod.commit(cache, slots, accepted, impl=impl)
        with jax.named_scope("draft_context"):
            request, pos, valid = packing.packed_index(query_start_loc, tokens.shape[0])
            proposer_state = proposer.observe(
                proposer_state,
                tokens,
                hidden,
                ctx_len[request] + pos,
                slots[request],
                valid & (pos <= accepted[request]),
            )
        return cache, proposer_state, accepted, bonus, emitted

    if mode != "compact":
        out = verify_commit(s * t, state.cache, proposer_state)
    elif tier_index is None:
        out = verify_commit(tier, state.cache, proposer_state)
    else:
        out = jax.lax.switch(tier_index, [partial(verify_commit, tt) for tt in tiers], state.cache, proposer_state)
    cache, proposer_state, accepted, bonus, emitted = out
    with jax.named_scope("estimator"):
        estimator_state = estimator.observe(state.estimator, features, lengths, accepted, slots)
    state = state.replace(
        cache=cache,
        proposer=proposer_state,
        anchor=state.anchor.at[slots].set(bonus),
        keys=state.keys.at[slots].set(key_next),
        estimator=estimator_state,
        draft_non_finite=state.draft_non_finite + jnp.sum(live & ~draft_finite, dtype=jnp.int32),
    )
    return parallel.constrain_state(state), emitted, accepted, lengths, features, survival, jnp.asarray(tier, jnp.int32)


def _decode(state: EngineState, target: Target, proposer, slots, plan, force_accept, *, tier, greedy, max_top_k, impl):
    """Mode "none": one target token per request and step (window = the anchor alone; `tier` is
    always the batch). plan and force_accept are `_step`'s; with no drafts they have no use."""
    cache = state.cache
    s = slots.shape[0]
    keys = jax.vmap(lambda k: jax.random.split(k, 2))(state.keys[slots])
    params = jax.tree_util.tree_map(lambda x: x[slots], state.sampling)
    with jax.named_scope("verify"):
        logits, _, cache = target_mod.verify(
            target, cache, state.anchor[slots], jnp.arange(s + 1, dtype=jnp.int32), slots, (), impl=impl
        )
    with jax.named_scope("accept"):
        probs, ids = _target_rows(logits[:, None], params, greedy, max_top_k)
        none = jnp.zeros((s,), jnp.int32)
        accepted, bonus, emitted = sampling.accept(
            keys[:, 0], probs, ids, jnp.zeros((s, 0), jnp.int32), None, none, params.temperature
        )
        emitted = jnp.where(_finite_rows(logits)[:, None], emitted, NON_FINITE)
    with jax.named_scope("commit"):
        cache = target_mod.commit(cache, slots, accepted, impl=impl)
    state = state.replace(
        cache=cache, anchor=state.anchor.at[slots].set(bonus), keys=state.keys.at[slots].set(keys[:, 1])
    )
    return parallel.constrain_state(state), emitted, accepted, none, None, None, jnp.asarray(s, jnp.int32)


def _prefill(state: EngineState, target: Target, proposer, tokens, lengths, slots, keys, params, *, max_top_k, impl):
    """Prompts into their slots: tokens [R, P] padded, lengths [R] (>= 1), slots [R] (0 = padding row),
    keys [R, 2] raw, params SamplingParams [R] -> (state, first generated token [R], NON_FINITE where
    the last prompt position's logits are not finite)."""
    r, p = tokens.shape
    taps = proposer.taps if proposer is not None else ()
    last, hidden, cache = target_mod.prefill(  # last: [R, vocab]
        target, state.cache, tokens, lengths, slots, taps, impl=impl, last_logits=True
    )
    keys = jax.vmap(jax.random.split)(keys)
    probs, ids = sampling.target_distribution(last, params, max_top_k)
    choice = jax.vmap(lambda k, pr: jax.random.categorical(k, jnp.log(pr)))(keys[:, 0], probs)
    sampled = jnp.take_along_axis(ids, choice[:, None], axis=1)[:, 0]
    first = jnp.where(params.temperature > 0, sampled, ids[:, 0]).astype(jnp.int32)
    first = jnp.where(_finite_rows(last), first, NON_FINITE)
    proposer_state = state.proposer
    if proposer is not None:
        pos = jnp.arange(p)[None, :]
        proposer_state = proposer.observe(
            proposer_state,
            tokens.reshape(-1),
            hidden.reshape((r * p,) + hidden.shape[2:]),
            jnp.broadcast_to(pos, (r, p)).reshape(-1),
            jnp.repeat(slots, p),
            (pos < lengths[:, None]).reshape(-1),
        )
    put = lambda arr, x: packing.scatter_slots(arr, slots, x)
    state = state.replace(
        cache=cache,
        proposer=proposer_state,
        estimator=None if state.estimator is None else estimator.reset_history(state.estimator, slots),
        anchor=put(state.anchor, first),
        keys=put(state.keys, keys[:, 1]),
        sampling=jax.tree_util.tree_map(put, state.sampling, params),
    )
    return parallel.constrain_state(state), first


@cache
def jitted_step(window, mode, max_top_k, impl, tiers, switch):
    """One jitted step per configuration, shared by every Engine with it (a profiling engine and
    the decoding engine, or a second engine on the same model, reuse the compiled steps). `switch`
    only keys the cache: that step is always called with tier None, so its compilations are its own."""
    if mode == "none":
        step = partial(_decode, max_top_k=max_top_k, impl=impl)
    else:
        step = partial(_step, window=window, mode=mode, max_top_k=max_top_k, impl=impl, tiers=list(tiers))
    return jax.jit(_with_readout(step), static_argnames=("greedy", "tier"), donate_argnums=(0,))


def _with_readout(step):
    """`step` returning (state, readout int32 = emitted tokens | accepted | verified | survival
    bits, features, survival, tier tokens): what the host reads of every step in one transfer (on
    a launch-bound step each device-to-host copy, or each conversion of a jax array to numpy, is
    tens of µs of host time); the survivals ride along for the host's tier choice `lag` steps
    later."""

    @wraps(step)
    def run(*args, **kwargs):
        state, emitted, accepted, verified, features, survival, used = step(*args, **kwargs)
        return state, readout(emitted, accepted, verified, survival), features, survival, used

    return run


def readout(emitted, accepted, verified, survival=None):
    """int32 [S, T + 2] = emitted [S, T] | accepted [S] | verified [S] side by side
    (`_with_readout`), then, given survival float32 [S, T - 1], its bits (bitcast): [S, 2T + 1]."""
    parts = [emitted, accepted[:, None], verified[:, None]]
    if survival is not None:
        parts.append(jax.lax.bitcast_convert_type(survival.astype(jnp.float32), jnp.int32))
    return jnp.concatenate([x.astype(jnp.int32) for x in parts], axis=1)


def split_readout(readout, window):
    """A step's readout as numpy, split: (emitted [S, T], accepted [S], verified [S], survival
    float32 [S, T - 1] or None where the readout carries none (mode none)); T = window."""
    readout = np.asarray(readout)
    survival = readout[:, window + 2 :].view(np.float32) if readout.shape[1] > window + 2 else None
    return readout[:, :window], readout[:, window], readout[:, window + 1], survival


@cache
def jitted_prefill(max_top_k, impl):
    """One jitted prefill per configuration, shared by every Engine with it (as `jitted_step`)."""
    return jax.jit(partial(_prefill, max_top_k=max_top_k, impl=impl), donate_argnums=(0,))
