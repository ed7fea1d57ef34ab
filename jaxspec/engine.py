"""The engine: slots, continuous batching and the jitted step draft -> verify -> accept -> commit.

One jitted step per variant (greedy-only or sampling), donating the state; requests join by
prefill into free slots (one jitted prefill per prompt-length bucket) and leave on EOS,
max_new_tokens or a stop string. The step never recompiles for a new mix of requests: slot
occupancy is data (inactive rows point at the null slot 0). The host loop below never touches
model arrays except to read the emitted tokens.

Non-finite logits: a request whose target logits hold a NaN or an inf in a step (or at prefill)
emits NON_FINITE instead of tokens, and the host ends it with `error` set; the others go on. A
draft row with non-finite logits verifies no drafts that step (the target alone picks the token,
so decoding stays lossless) and counts in `EngineState.draft_non_finite`, which `generate` reads
once at its end to warn.
"""
import collections
import dataclasses
import time
import warnings
from functools import cache, partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxspec import cache as cache_mod
from jaxspec import target as target_mod
from jaxspec.cache import CacheState
from jaxspec.config import SpecConfig
from jaxspec.dflash import Draft
from jaxspec.ops import packing, sampling
from jaxspec.ops.sampling import SamplingParams
from jaxspec.proposer import DFlashProposer
from jaxspec.spec import estimator, layout, planner
from jaxspec.spec.calibration import TraceRecorder
from jaxspec.spec.planner import CostTable
from jaxspec.target import Target

NON_FINITE = -1     # the token id a step emits for a request whose target logits are not finite


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


@dataclasses.dataclass
class GenerationResult:
    """tokens: generated ids (prompt excluded); text: their decoding when a tokenizer is known;
    stats: steps, accepted and verified (drafts per step; the last step may accept past the end),
    accept_length (tokens the verify steps returned / steps: the returned tokens but the first,
    which the prefill gives), tokens_per_s (from admission to the last token) and
    includes_compilation (whether `generate` compiled a step or a prefill while it ran, so
    tokens_per_s counts compile time); error: why the request was refused (then tokens is empty)
    or ended early (then tokens are those emitted before), naming the prompt's index."""

    tokens: list
    stats: dict
    text: str | None = None
    error: str | None = None


@dataclasses.dataclass
class _Request:
    index: int
    prompt: list
    key: np.ndarray
    slot: int = 0
    tokens: list = dataclasses.field(default_factory=list)
    accepted: list = dataclasses.field(default_factory=list)
    verified: list = dataclasses.field(default_factory=list)
    start: float = 0.0
    compiled: int = 0
    done: bool = False


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
    costs [S+1, tiers] (seconds of tier j's admissible budget at n active rows, from the table)."""

    plan: jnp.ndarray
    survival: jnp.ndarray
    same: jnp.ndarray
    costs: jnp.ndarray


def _device_tier(plan: DevicePlan, active, tiers, drafts_per_row):
    """Index of the verify tier chosen on the device (`planner.choose_tier`) from
    `Engine._choose_tier`'s inputs; the last (full) tier while `plan.plan` is False."""
    survival = jnp.where(plan.same[:, None], plan.survival, 1.0)
    tier = planner.choose_tier(survival, active, plan.costs, tiers, drafts_per_row)
    return jnp.where(plan.plan, tier, len(tiers) - 1).astype(jnp.int32)


def _step(state: EngineState, target: Target, proposer, slots, plan, force_accept, *, window, tier, mode, greedy,
          max_top_k, impl, tiers=None):
    """One decoding step for the rows `slots` [S] (0 = inactive row).

    mode "static" verifies every row's whole block; "cap-accept" and "compact" plan per-request
    lengths from the estimator's current survivals with a budget of `tier` - active rows tokens.
    `tier` static: the host chose it from survivals `lag` steps old. `tier` None (tier_dispatch
    "switch"): the device chooses it from `plan` (a DevicePlan) among `tiers`, and compact runs
    the verify under lax.switch over the tiers. cap-accept verifies the whole block and caps
    acceptance at the planned length; compact packs only the planned windows into `tier` rows.
    force_accept: bool [], traced (so profiling and decoding share one compiled step per tier);
    True (profiling only) accepts every verified draft. Returns (state, emitted [S, T],
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
        dist = sampling.draft_distribution(draft_logits[:, :t - 1], params.temperature)
        drafts, q = (dist.argmax, None) if greedy else (sampling.sample_draft(key_draft, dist), dist)
        # [S]: from the row statistics the distribution already holds (no pass over the logits)
        draft_finite = jnp.all(jnp.isfinite(dist.zmax) & jnp.isfinite(dist.rest), axis=-1)
    with jax.named_scope("estimator"):
        features = estimator.distribution_features(dist)
        _, survival = estimator.predict(state.estimator, features)

    # plan: drafts to verify per request, and the packed layout of the verify
    tier_index = None
    if mode == "static":
        lengths = jnp.full((s,), t - 1, jnp.int32)
        tier = s * t
    else:
        with jax.named_scope("plan"):
            if tier is None:
                tier_index = _device_tier(plan, active, tiers, t - 1)
                tier = jnp.asarray(tiers, jnp.int32)[tier_index]
            budget = tier - jnp.sum(active, dtype=jnp.int32)
            lengths = planner.plan_lengths(jnp.where(active[:, None], survival, jnp.nan), budget)
    lengths = jnp.where(active & draft_finite, lengths, 0)

    def verify_commit(layout_tier, cache, proposer_state):
        """Verify the planned windows in a layout of `layout_tier` tokens (static), accept,
        commit, and feed the committed rows to the draft."""
        with jax.named_scope("verify"):
            tokens, query_start_loc, layout_slots = layout.step_layout(lengths, anchors, drafts, slots, layout_tier)
            logits, hidden, cache = target_mod.verify(target, cache, tokens, query_start_loc, layout_slots,
                                                      proposer.taps, impl=impl)
        with jax.named_scope("accept"):
            logits = layout.unpack_rows(logits, query_start_loc, t)                            # [S, T, vocab]
            probs, ids = _target_rows(logits, params, greedy, max_top_k)
            accepted, bonus, emitted = sampling.accept(key_accept, probs, ids, drafts, q, lengths,
                                                       params.temperature)
            accepted = jnp.where(force_accept, lengths, accepted)
            emitted = jnp.where(_finite_rows(logits, accepted)[:, None], emitted, NON_FINITE)
        with jax.named_scope("commit"):
            cache = target_mod.commit(cache, slots, accepted, impl=impl)
        with jax.named_scope("draft_context"):
            request, pos, valid = packing.packed_index(query_start_loc, tokens.shape[0])
            proposer_state = proposer.observe(proposer_state, tokens, hidden, ctx_len[request] + pos,
                                              slots[request], valid & (pos <= accepted[request]))
        return cache, proposer_state, accepted, bonus, emitted

    if mode != "compact":
        out = verify_commit(s * t, state.cache, proposer_state)
    elif tier_index is None:
        out = verify_commit(tier, state.cache, proposer_state)
    else:
        out = jax.lax.switch(tier_index, [partial(verify_commit, tt) for tt in tiers], state.cache, proposer_state)
    cache, proposer_state, accepted, bonus, emitted = out
    with jax.named_scope("estimator"):
        estimator_state = estimator.observe(state.estimator, features, lengths, accepted)
    state = state.replace(cache=cache, proposer=proposer_state, anchor=state.anchor.at[slots].set(bonus),
                          keys=state.keys.at[slots].set(key_next), estimator=estimator_state,
                          draft_non_finite=state.draft_non_finite + jnp.sum(active & ~draft_finite, dtype=jnp.int32))
    return state, emitted, accepted, lengths, features, survival, jnp.asarray(tier, jnp.int32)


def _decode(state: EngineState, target: Target, proposer, slots, plan, force_accept, *, tier, greedy, max_top_k,
            impl):
    """Mode "none": one target token per request and step (window = the anchor alone; `tier` is
    always the batch). plan and force_accept are `_step`'s; with no drafts they have no use."""
    cache = state.cache
    s = slots.shape[0]
    keys = jax.vmap(lambda k: jax.random.split(k, 2))(state.keys[slots])
    params = jax.tree_util.tree_map(lambda x: x[slots], state.sampling)
    with jax.named_scope("verify"):
        logits, _, cache = target_mod.verify(target, cache, state.anchor[slots], jnp.arange(s + 1, dtype=jnp.int32),
                                             slots, (), impl=impl)
    with jax.named_scope("accept"):
        probs, ids = _target_rows(logits[:, None], params, greedy, max_top_k)
        none = jnp.zeros((s,), jnp.int32)
        accepted, bonus, emitted = sampling.accept(keys[:, 0], probs, ids, jnp.zeros((s, 0), jnp.int32), None,
                                                   none, params.temperature)
        emitted = jnp.where(_finite_rows(logits)[:, None], emitted, NON_FINITE)
    with jax.named_scope("commit"):
        cache = target_mod.commit(cache, slots, accepted, impl=impl)
    state = state.replace(cache=cache, anchor=state.anchor.at[slots].set(bonus), keys=state.keys.at[slots].set(keys[:, 1]))
    return state, emitted, accepted, none, None, None, jnp.asarray(s, jnp.int32)


def _prefill(state: EngineState, target: Target, proposer, tokens, lengths, slots, keys, params, *, max_top_k, impl):
    """Prompts into their slots: tokens [R, P] padded, lengths [R] (>= 1), slots [R] (0 = padding row),
    keys [R, 2] raw, params SamplingParams [R] -> (state, first generated token [R], NON_FINITE where
    the last prompt position's logits are not finite)."""
    r, p = tokens.shape
    taps = proposer.taps if proposer is not None else ()
    logits, hidden, cache = target_mod.prefill(target, state.cache, tokens, lengths, slots, taps, impl=impl)
    keys = jax.vmap(jax.random.split)(keys)
    last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]            # [R, vocab]
    probs, ids = sampling.target_distribution(last, params, max_top_k)
    choice = jax.vmap(lambda k, pr: jax.random.categorical(k, jnp.log(pr)))(keys[:, 0], probs)
    sampled = jnp.take_along_axis(ids, choice[:, None], axis=1)[:, 0]
    first = jnp.where(params.temperature > 0, sampled, ids[:, 0]).astype(jnp.int32)
    first = jnp.where(_finite_rows(last), first, NON_FINITE)
    proposer_state = state.proposer
    if proposer is not None:
        pos = jnp.arange(p)[None, :]
        proposer_state = proposer.observe(proposer_state, tokens.reshape(-1), hidden.reshape((r * p,) + hidden.shape[2:]),
                                          jnp.broadcast_to(pos, (r, p)).reshape(-1), jnp.repeat(slots, p),
                                          (pos < lengths[:, None]).reshape(-1))
    put = lambda arr, x: packing.scatter_slots(arr, slots, x)
    state = state.replace(
        cache=cache, proposer=proposer_state, anchor=put(state.anchor, first), keys=put(state.keys, keys[:, 1]),
        sampling=jax.tree_util.tree_map(put, state.sampling, params))
    return state, first


@cache
def _jitted_step(window, mode, max_top_k, impl, tiers, switch):
    """One jitted step per configuration, shared by every Engine with it (a profiling engine and
    the decoding engine, or a second engine on the same model, reuse the compiled steps). `switch`
    only keys the cache: that step is always called with tier None, so its compilations are its own."""
    if mode == "none":
        step = partial(_decode, max_top_k=max_top_k, impl=impl)
    else:
        step = partial(_step, window=window, mode=mode, max_top_k=max_top_k, impl=impl, tiers=list(tiers))
    return jax.jit(step, static_argnames=("greedy", "tier"), donate_argnums=(0,))


@cache
def _jitted_prefill(max_top_k, impl):
    return jax.jit(partial(_prefill, max_top_k=max_top_k, impl=impl), donate_argnums=(0,))


class Engine:
    """Speculative decoding of a GDN-hybrid target with a block draft.

    Engine(target, draft, SpecConfig(...)) uses the DFlash draft; `proposer=` takes any pytree
    that follows jaxspec.proposer's interface instead. Mode "none" needs no draft.

    tier_dispatch (cap-accept and compact; the other modes have one tier): "host" compiles one
    step per tier and the host picks it each step (`_choose_tier`); "switch" compiles one step
    that picks the tier on the device by the same rule and, in compact mode, runs the verify
    under lax.switch over the tiers. Both emit the same tokens.
    """

    def __init__(self, target: Target, draft: Draft | None = None, spec: SpecConfig = SpecConfig(), *,
                 proposer=None, tokenizer=None, cost_table: CostTable | str | None = None, record_trace=False,
                 impl="auto", tier_dispatch="host"):
        if tier_dispatch not in ("host", "switch"):
            raise ValueError(f"tier_dispatch={tier_dispatch!r}: must be 'host' or 'switch'")
        if proposer is None and draft is not None:
            proposer = DFlashProposer(draft, target, impl=impl)
        mode = spec.verify_mode
        if mode == "none":
            proposer, window = None, 1
        else:
            if proposer is None:
                raise ValueError(f"draft: verify_mode={mode!r} needs a draft (or a proposer)")
            window = spec.block_size or proposer.block_size
            if window > proposer.block_size:
                raise ValueError(f"SpecConfig.block_size={window}: the draft proposes blocks of "
                                 f"{proposer.block_size}")
        self.target, self.proposer, self.spec, self.window = target, proposer, spec, window
        self.tokenizer = tokenizer
        self.cost_table = CostTable.load(cost_table) if isinstance(cost_table, str) else cost_table
        self.tier_tokens, _ = layout.tiers(spec.num_slots, window, spec.num_tiers)
        self.recorder = TraceRecorder() if record_trace and mode != "none" else None
        self.tier_counts = collections.Counter()
        self.tier_dispatch = tier_dispatch
        self._switch = tier_dispatch == "switch" and mode in ("cap-accept", "compact")
        self._costs = None                  # (cost table, its device cost matrix, placeholder survivals)
        self._steps_run = 0
        self.cache_config = spec.cache_config(window, jnp.dtype(target.dtype).name)
        self._step = _jitted_step(window, mode, spec.max_top_k, impl, tuple(self.tier_tokens), self._switch)
        self._prefill = _jitted_prefill(spec.max_top_k, impl)
        self.state = self._init_state()

    def _init_state(self) -> EngineState:
        s1 = self.spec.num_slots + 1
        speculative = self.proposer is not None
        return EngineState(
            cache=cache_mod.init_cache(self.target.config, self.cache_config),
            proposer=self.proposer.init_state(self.spec.num_slots, self.spec.max_len) if speculative else None,
            estimator=estimator.init(self.window - 1, refit_interval=self.spec.refit_interval) if speculative else None,
            anchor=jnp.zeros((s1,), jnp.int32), keys=jnp.zeros((s1, 2), jnp.uint32),
            sampling=SamplingParams.create(s1), draft_non_finite=jnp.zeros((), jnp.int32))

    def _plans(self, old) -> bool:
        """Whether the next step plans a budget: not in static mode, during warm-up, without the
        step `lag` back (old is None) or without profiled costs (then it verifies everything)."""
        warmup = self.spec.warmup_refits * self.spec.refit_interval
        return not (self.spec.verify_mode in ("none", "static") or self._steps_run < warmup or old is None
                    or self.cost_table is None or self.cost_table.is_trivial)

    def _choose_tier(self, rows, old) -> int:
        """The verify tier of the next step. rows: the request of each slot (None = idle); old:
        (rows, survival [S, T-1]) of the step `lag` steps back, or None. The full block unless
        `_plans`."""
        full = self.tier_tokens[-1]
        if not self._plans(old):
            return full
        old_rows, old_survival = old
        old_survival = np.asarray(old_survival)
        survival = [old_survival[i] if req is old_rows[i] else np.ones(self.window - 1, np.float32)
                    for i, req in enumerate(rows) if req is not None]     # a newcomer: assume acceptance
        n = len(survival)
        admissible = sorted({min(t - n, n * (self.window - 1)) for t in self.tier_tokens if t >= n})
        budget = planner.choose_budget(np.stack(survival), self.cost_table, admissible)
        return self.tier_tokens[layout.tier_for(n + budget, self.tier_tokens)]

    def _device_plan(self, rows, old) -> DevicePlan:
        """`_choose_tier`'s inputs for the device (tier_dispatch "switch"): nothing is read back;
        the lagged survivals stay on the device (plan and same go as numpy: the step's call
        transfers them)."""
        s, d = self.spec.num_slots, self.window - 1
        plans = self._plans(old)
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

    def forced_step(self, batch, tier, *, prompt_len=8, seed=0):
        """A callable that runs one jitted step at (batch, tier) with forced acceptance (every
        verified draft accepted; mode none: one token) and returns its emitted tokens [S, T].

        The engine's state is reset and `batch` random prompts of `prompt_len` tokens are
        prefilled into slots 1..batch; every call advances them by one step, so at most
        (max_len - prompt_len) // window calls fit. Used by `profile` and by benchmarks that trace
        a step."""
        if not 1 <= batch <= self.spec.num_slots:
            raise ValueError(f"batch: {batch} is not in 1..num_slots={self.spec.num_slots}")
        if tier not in self.tier_tokens or tier < batch:
            raise ValueError(f"tier: {tier} is not one of this engine's tiers >= batch {batch}: {self.tier_tokens}")
        rng = np.random.default_rng(seed)
        slots = np.zeros(self.spec.num_slots, np.int32)
        slots[:batch] = np.arange(1, batch + 1)
        self.state = self._init_state()
        prompts = rng.integers(0, self.target.config.vocab_size, (batch, prompt_len)).astype(np.int32)
        self.state, _ = self._prefill(self.state, self.target, self.proposer, jnp.asarray(prompts),
                                      jnp.full((batch,), prompt_len, jnp.int32), jnp.asarray(slots[:batch]),
                                      jnp.zeros((batch, 2), jnp.uint32), SamplingParams.create(batch))

        def run():
            self.state, emitted, *_ = self._step(self.state, self.target, self.proposer, slots, None,
                                                 np.bool_(True), greedy=True, tier=tier)
            return emitted

        return run

    def profile(self, batches, *, repeats=10, prompt_len=8, seed=0, on_entry=None) -> CostTable:
        """Time the real jitted step per (batch, tier) with forced acceptance (every verified draft
        accepted) and return the cost table the planner reads. The engine's state is reset.
        on_entry(batch, tier, seconds), if given, is called after each entry (e.g. a progress bar)."""
        if self.proposer is None:
            raise ValueError("profile: verify_mode 'none' has no tiers to profile")
        entries = {}
        calls = repeats + 1
        if prompt_len + calls * self.window > self.spec.max_len:
            raise ValueError(f"profile: prompt_len + (repeats + 1) * window exceeds SpecConfig.max_len="
                             f"{self.spec.max_len}")
        for batch in batches:
            if not 1 <= batch <= self.spec.num_slots:
                raise ValueError(f"batches: {batch} is not in 1..num_slots={self.spec.num_slots}")
            for tier in self.tier_tokens:
                if tier < batch:
                    continue
                step = self.forced_step(batch, tier, prompt_len=prompt_len, seed=seed)
                times = []
                for _ in range(calls):
                    start = time.perf_counter()
                    jax.block_until_ready(step())
                    times.append(time.perf_counter() - start)
                entries[(batch, tier)] = float(np.median(times[1:]))       # the first call compiles
                if on_entry is not None:
                    on_entry(batch, tier, entries[(batch, tier)])
        self.state = self._init_state()
        return CostTable(entries)

    # ------------------------------------------------------------------------------ host side

    def _refusal(self, prompt, max_new_tokens) -> str | None:
        """Why `prompt` (token ids) cannot be decoded, or None."""
        vocab = self.target.config.vocab_size
        if len(prompt) == 0:
            return "empty"
        not_int = [t for t in prompt if not isinstance(t, (int, np.integer)) or isinstance(t, (bool, np.bool_))]
        if not_int:
            return f"token id {not_int[0]!r} is not an int"
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            return f"token id {bad[0]} is outside the vocabulary [0, {vocab})"
        need = len(prompt) + max_new_tokens + self.window
        if need > self.spec.max_len:
            return (f"max_new_tokens: prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) + window "
                    f"({self.window}) = {need} exceeds SpecConfig.max_len={self.spec.max_len}")
        return None

    def _compiled(self) -> int:
        """Compiled variants of this engine's step and prefill so far (they grow when a call compiles)."""
        return self._step._cache_size() + self._prefill._cache_size()

    def _bucket(self, n):
        return min(max(16, 1 << (n - 1).bit_length()), self.spec.max_len)

    def _admit(self, joining, free, active, params, emit):
        """Prefill the joining requests in one call padded to (count, length) buckets."""
        rows = 1 << (len(joining) - 1).bit_length()
        width = self._bucket(max(len(req.prompt) for req in joining))
        tokens = np.zeros((rows, width), np.int32)
        lengths, slots, keys = np.ones(rows, np.int32), np.zeros(rows, np.int32), np.zeros((rows, 2), np.uint32)
        for i, req in enumerate(joining):
            req.slot, req.start, req.compiled = free.pop(0), time.perf_counter(), self._compiled()
            active[req.slot] = req
            tokens[i, :len(req.prompt)] = req.prompt
            lengths[i], slots[i], keys[i] = len(req.prompt), req.slot, req.key
        row_params = jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x[:1], (rows,)), params)
        self.state, first = self._prefill(self.state, self.target, self.proposer, *map(jnp.asarray, (
            tokens, lengths, slots, keys)), row_params)
        for req, tok in zip(joining, np.asarray(first)):
            emit(req, tok)

    def generate(self, prompts, max_new_tokens=64, temperature=0.0, top_k=0, top_p=1.0, seed=0, stop=None,
                 eos_token_id=None):
        """Decode every prompt (a list of token-id lists, or strings with a tokenizer).

        Requests wait in a queue for a free slot; a bad request gets a result with `error` set and
        the others go on, as does a request whose target logits turn non-finite (it keeps the tokens
        emitted before). Per-request PRNG keys come from `seed` (an int, or one per prompt), so a
        request's tokens do not depend on the requests it ran beside. Draft rows with non-finite
        logits (they verify nothing, see the module doc) are reported by one warning at the end.
        """
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens!r}: must be a positive int")
        if not temperature >= 0:
            raise ValueError(f"temperature={temperature!r}: must be >= 0")
        if not (isinstance(top_k, int) and top_k >= 0):
            raise ValueError(f"top_k={top_k!r}: must be an int >= 0 (0 = off)")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p={top_p!r}: must be in (0, 1]")
        seeds = list(seed) if isinstance(seed, (list, tuple)) else [seed] * len(prompts)
        if len(seeds) != len(prompts):
            raise ValueError(f"seed: {len(seeds)} seeds for {len(prompts)} prompts")
        eos = set(self.target.config.eos_token_id if eos_token_id is None else
                  ([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id))
        params = SamplingParams.create(1, temperature, top_k, top_p)
        greedy = temperature == 0
        results, queue = [None] * len(prompts), collections.deque()
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    raise ValueError("prompts: text prompts need Engine(tokenizer=...)")
                prompt = self.tokenizer.encode(prompt)
            prompt = list(prompt)
            error = self._refusal(prompt, max_new_tokens)
            if error:
                results[i] = GenerationResult(tokens=[], stats={}, error=f"prompt {i}: {error}")
            else:
                queue.append(_Request(i, [int(t) for t in prompt], np.asarray(jax.random.PRNGKey(seeds[i]), np.uint32)))
        free = list(range(1, self.spec.num_slots + 1))
        active = {}
        self.state = self.state.replace(draft_non_finite=jnp.zeros((), jnp.int32))

        def finish(req, error=None):
            req.done = True
            free.append(req.slot)
            del active[req.slot]
            elapsed = max(time.perf_counter() - req.start, 1e-9)
            steps = len(req.accepted)
            stats = {"steps": steps, "accepted": req.accepted, "verified": req.verified,
                     "accept_length": (len(req.tokens) - 1) / steps if steps else 0.0,
                     "tokens_per_s": len(req.tokens) / elapsed,
                     "includes_compilation": self._compiled() != req.compiled}
            text = self.tokenizer.decode(req.tokens) if self.tokenizer is not None else None
            results[req.index] = GenerationResult(tokens=req.tokens, stats=stats, text=text,
                                                  error=None if error is None else f"prompt {req.index}: {error}")

        def emit(req, tok):
            if tok == NON_FINITE:
                finish(req, f"the target's logits are not finite (NaN or inf) after {len(req.tokens)} generated "
                            "tokens; the request was ended (its weights or activations overflow)")
                return
            req.tokens.append(int(tok))
            stopped = stop and self.tokenizer is not None and any(s in self.tokenizer.decode(req.tokens) for s in stop)
            if int(tok) in eos or len(req.tokens) >= max_new_tokens or stopped:
                finish(req)

        # One step in flight: step k + 1 is dispatched before the host reads step k's tokens, so
        # the host never waits for the device between steps. A request that finished at step k
        # runs one more (discarded) row in step k + 1; its slot is reused after that.
        in_flight, history = None, collections.deque(maxlen=self.spec.lag)
        while queue or active or in_flight:
            if queue and free:
                self._admit([queue.popleft() for _ in range(min(len(queue), len(free)))], free, active, params, emit)
            dispatched = None
            if active:
                rows = [active.get(s) for s in range(1, self.spec.num_slots + 1)]
                old = history[0] if len(history) == self.spec.lag else None
                if self._switch:
                    tier, plan = None, self._device_plan(rows, old)
                else:
                    tier, plan = self._choose_tier(rows, old), None
                slots = np.asarray([0 if r is None else r.slot for r in rows], np.int32)   # travels with the call
                self.state, emitted, accepted, verified, features, survival, used = self._step(
                    self.state, self.target, self.proposer, slots, plan, np.bool_(False), greedy=greedy, tier=tier)
                self._steps_run += 1
                # start the device-to-host copies now: by the time the host reads them (next
                # iteration; the survivals `lag` steps later) they are there, no round trip
                for out in (emitted, accepted, verified, survival if tier is not None else used):
                    if out is not None:                   # mode none has no survivals
                        out.copy_to_host_async()
                history.append((rows, survival))
                if self.recorder is not None:
                    self.recorder.add(features, verified, accepted, temperature)
                dispatched = (rows, emitted, accepted, verified, used if tier is None else tier)
            if in_flight is not None:
                rows, emitted, accepted, verified, step_tier = in_flight
                self.tier_counts[int(step_tier)] += 1
                emitted, accepted, verified = np.asarray(emitted), np.asarray(accepted), np.asarray(verified)
                for row, req in enumerate(rows):
                    if req is None or req.done:
                        continue
                    req.accepted.append(int(accepted[row]))
                    req.verified.append(int(verified[row]))
                    for tok in emitted[row, :accepted[row] + 1]:
                        if not req.done:
                            emit(req, tok)
            in_flight = dispatched
        self._warn_draft_non_finite()
        return results

    def _warn_draft_non_finite(self):
        """One warning when draft rows had non-finite logits in the last `generate` (reads the counter)."""
        count = int(self.state.draft_non_finite)
        if count:
            warnings.warn(f"the draft's logits were not finite (NaN or inf) in {count} request-steps; those steps "
                          "verified no drafts (the output is unchanged, only slower): the draft is broken",
                          RuntimeWarning, stacklevel=3)
