"""The engine: slots, queue, continuous batching and the host loop around the jitted step.

The device side (EngineState, the jitted step draft -> verify -> accept -> commit and the
prefill) is jaxspec/step.py; the verify tier of each step comes from jaxspec/tier_planner.py.
Requests join by prefill into free slots (one jitted prefill per prompt-length bucket) and leave
on EOS, max_new_tokens or a stop string. The host loop below never touches model arrays except
to read the emitted tokens.

Two ways to drive it: `generate(prompts)` returns finished results; `submit(prompt)` queues one
request and each `step()` call runs one turn of the host loop and returns its `Event`s (tokens
per request, first token, finish), so a caller can keep requests in flight and add new ones as
slots free (continuous batching). `generate` is `submit` + `step` until done.

Non-finite logits: a request whose target logits hold a NaN or an inf in a step (or at prefill)
emits NON_FINITE instead of tokens, and the host ends it with `error` set; the others go on. A
draft row with non-finite logits verifies no drafts that step (the target alone picks the token,
so decoding stays lossless) and counts in `EngineState.draft_non_finite`, which `generate` reads
once at its end to warn.
"""

import collections
import dataclasses
import statistics
import time
import warnings
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import cache as cache_mod
from jaxspec import parallel
from jaxspec.config import PLANNED_MODES, SpecConfig
from jaxspec.dflash import Draft
from jaxspec.ops.sampling import SamplingParams
from jaxspec.proposer import DFlashProposer, dflash_proposer
from jaxspec.spec import estimator
from jaxspec.spec.calibration import TraceRecorder
from jaxspec.spec.planner import CostTable
from jaxspec.step import NON_FINITE, EngineState, jitted_prefill, jitted_step, split_readout
from jaxspec.target import Target
from jaxspec.tier_planner import TierPlanner

HOST_TURNS = 16  # decoding turns whose host time `Engine.host_seconds` takes the median of


@dataclasses.dataclass
class GenerationResult:
    """tokens: generated ids (prompt excluded); text: their decoding when a tokenizer is known;
    stats: steps, accepted and verified (drafts per step; the last step may accept past the end),
    accept_length (tokens the verify steps returned / steps: the returned tokens but the first,
    which the prefill gives), tokens_per_s (from admission to the last token), first_token_s
    (admission to the first token on the host), decode_tokens_per_s (the tokens after the first
    / the time after it; 0.0 for a single token) and includes_compilation (whether `generate`
    compiled a step or a prefill while it ran, so tokens_per_s counts compile time); error: why
    the request was refused (then tokens is empty) or ended early (then tokens are those emitted
    before), naming the prompt's index."""

    tokens: list
    stats: dict
    text: str | None = None
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class Event:
    """One request's news from one `Engine.step` call.

    request: the id `Engine.submit` returned; tokens: the ids it emitted in this call, in order
    (empty for a refused request); first: tokens[0] is its first generated token; result: its
    GenerationResult when it finished in this call (no later event names it), else None."""

    request: int
    tokens: tuple
    first: bool = False
    result: GenerationResult | None = None


@dataclasses.dataclass
class _Request:
    id: int
    name: str
    prompt: list
    key: np.ndarray
    max_new_tokens: int
    sampling: tuple  # (temperature, top_k, top_p)
    eos: frozenset
    stop: tuple | None
    slot: int = 0
    tokens: list = dataclasses.field(default_factory=list)
    accepted: list = dataclasses.field(default_factory=list)
    verified: list = dataclasses.field(default_factory=list)
    start: float = 0.0
    first_at: float = 0.0
    compiled: int = 0
    done: bool = False


def _check_sampling(max_new_tokens, temperature, top_k, top_p):
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r}: must be a positive int")
    if not temperature >= 0:
        raise ValueError(f"temperature={temperature!r}: must be >= 0")
    if not (isinstance(top_k, int) and top_k >= 0):
        raise ValueError(f"top_k={top_k!r}: must be an int >= 0 (0 = off)")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p!r}: must be in (0, 1]")


def _raw_key(seed: int) -> np.ndarray:
    """`jax.random.PRNGKey(seed)` as raw uint32 [2], computed on the host for the default threefry
    keys (a device computation would wait behind the step in flight: `submit` runs mid-decoding)."""
    if jax.config.jax_default_prng_impl != "threefry2x32":
        return np.asarray(jax.random.PRNGKey(seed), np.uint32)
    high = (seed % 2**64) >> 32 if jax.config.jax_enable_x64 else 0
    return np.array([high, seed & 0xFFFFFFFF], np.uint32)


class Engine:
    """Speculative decoding of a GDN-hybrid target with a block draft.

    Engine(target, draft, SpecConfig(...)) uses the DFlash draft; `proposer=` takes any pytree
    that follows jaxspec.proposer's interface instead. Mode "none" needs no draft.

    tier_dispatch (cap-accept and compact; the other modes have one tier): "host" compiles one
    step per tier and the host picks it each step (`TierPlanner.choose_tier`); "switch" compiles
    one step that picks the tier on the device by the same rule and, in compact mode, runs the
    verify under lax.switch over the tiers. Both emit the same tokens.
    """

    def __init__(
        self,
        target: Target,
        draft: Draft | None = None,
        spec: SpecConfig = SpecConfig(),
        *,
        proposer=None,
        tokenizer=None,
        cost_table: CostTable | str | None = None,
        record_trace=False,
        impl="auto",
        tier_dispatch="host",
    ):
        if tier_dispatch not in ("host", "switch"):
            raise ValueError(f"tier_dispatch={tier_dispatch!r}: must be 'host' or 'switch'")
        self.mesh = None
        if spec.tp > 1:
            self.mesh = parallel.tp_mesh(spec.tp)
            target = parallel.shard_target(target, self.mesh)
            if draft is not None:
                draft = parallel.place(draft, self.mesh)
            if proposer is not None:
                proposer = parallel.place(proposer, self.mesh)
        if proposer is None and draft is not None:
            proposer = dflash_proposer(draft, target, impl=impl)
        mode = spec.verify_mode
        if mode == "none":
            proposer, window = None, 1
        else:
            if proposer is None:
                raise ValueError(f"draft: verify_mode={mode!r} needs a draft (or a proposer)")
            window = spec.block_size or proposer.block_size
            if window > proposer.block_size:
                raise ValueError(f"SpecConfig.block_size={window}: the draft proposes blocks of {proposer.block_size}")
            if spec.trim_draft and window < proposer.block_size:
                if not isinstance(proposer, DFlashProposer):
                    raise ValueError("SpecConfig.trim_draft=True: only the DFlash proposer can run a shorter block")
                proposer = proposer.replace(forward_block=window)
        self.target, self.proposer, self.spec, self.window = target, proposer, spec, window
        self.tokenizer = tokenizer
        self.tier_planner = TierPlanner(
            spec, window, CostTable.load(cost_table) if isinstance(cost_table, str) else cost_table
        )
        self.tier_tokens = self.tier_planner.tier_tokens
        self.recorder = TraceRecorder() if record_trace and mode != "none" else None
        self.tier_counts = collections.Counter()
        self.tier_dispatch = tier_dispatch
        self._switch = tier_dispatch == "switch" and mode in PLANNED_MODES
        self._plans_on_host = mode in PLANNED_MODES and not self._switch
        self._steps_run = 0
        self.totals = collections.Counter()  # over the steps read: steps, rows, verified, tier_tokens
        sim = spec.simulated_acceptance
        self._simulate = (
            {} if sim is None else {"simulate": (jnp.float32(sim.a), jnp.float32(sim.b), jnp.uint32(sim.seed))}
        )
        self._queue, self._refused, self._active = collections.deque(), collections.deque(), {}
        self._free = list(range(1, spec.num_slots + 1))
        self._in_flight, self._history = None, collections.deque(maxlen=spec.lag)
        # see host_seconds: host time of the last turns, when the last readout arrived, and the time
        # waited for prefills since then
        self._host_busy, self._ready_at, self._waited = collections.deque(maxlen=HOST_TURNS), None, 0.0
        self._next_id, self._news = 0, {}
        self.cache_config = spec.cache_config(window, jnp.dtype(target.dtype).name)
        self._step = jitted_step(window, mode, spec.max_top_k, impl, tuple(self.tier_tokens), self._switch)
        self._prefill = jitted_prefill(spec.max_top_k, impl)
        self.state = self._init_state()
        if self.mesh is not None:
            self._step, self._prefill = (parallel.OnMesh(f, self.mesh) for f in (self._step, self._prefill))

    def _init_state(self) -> EngineState:
        s1 = self.spec.num_slots + 1
        speculative = self.proposer is not None
        state = EngineState(
            cache=cache_mod.init_cache(self.target.config, self.cache_config),
            proposer=self.proposer.init_state(self.spec.num_slots, self.spec.max_len) if speculative else None,
            estimator=estimator.init(
                self.window - 1,
                refit_interval=self.spec.refit_interval,
                first_refit=self.spec.first_refit,
                num_slots=self.spec.num_slots,
            )
            if speculative
            else None,
            anchor=jnp.zeros((s1,), jnp.int32),
            keys=jnp.zeros((s1, 2), jnp.uint32),
            sampling=SamplingParams.create(s1),
            draft_non_finite=jnp.zeros((), jnp.int32),
        )
        return state if self.mesh is None else parallel.place(state, self.mesh, parallel.state_specs(state))

    @property
    def cost_table(self) -> CostTable | None:
        """The profiled costs the planner reads (`tier_planner.cost_table`; assignable)."""
        return self.tier_planner.cost_table

    @cost_table.setter
    def cost_table(self, table: CostTable | None):
        self.tier_planner.cost_table = table

    @property
    def warmup_steps(self) -> int:
        """Steps that verify full blocks before compact / cap-accept plan (`TierPlanner.warmup_steps`)."""
        return self.tier_planner.warmup_steps

    def _forced_call(self, batch, tier, greedy, switch):
        """The step call of `forced_step(batch, tier, greedy=greedy, switch=switch)`: (rows `slots`
        [num_slots], 1..batch then 0, and `_step_args`'s plan, force_accept, greedy and tier)."""
        if not 1 <= batch <= self.spec.num_slots:
            raise ValueError(f"batch: {batch} is not in 1..num_slots={self.spec.num_slots}")
        if tier not in self.tier_tokens or tier < batch:
            raise ValueError(f"tier: {tier} is not one of this engine's tiers >= batch {batch}: {self.tier_tokens}")
        if switch and not self._switch:
            raise ValueError("switch: only tier_dispatch 'switch' engines (cap-accept, compact) have a switch step")
        slots = np.zeros(self.spec.num_slots, np.int32)
        slots[:batch] = np.arange(1, batch + 1)
        if switch:
            return slots, dict(plan=self.tier_planner.forcing(tier), force_accept=True, greedy=greedy, tier=None)
        return slots, dict(plan=None, force_accept=True, greedy=greedy, tier=tier)

    def forced_step(self, batch, tier, *, prompt_len=8, seed=0, greedy=True, switch=False):
        """A callable that runs one jitted step at (batch, tier) with forced acceptance (every
        verified draft accepted; mode none: one token) and returns (the step's readout int32:
        emitted tokens [S, T], accepted and verified counts, survival bits (`step.readout`,
        `step.split_readout`); the tier
        tokens the step ran: int32 []).

        The engine must be idle; its state is reset and `batch` random prompts of `prompt_len`
        tokens are prefilled into slots 1..batch (temperature 0); every call advances them by one
        step, so at most (max_len - prompt_len) // window calls fit. greedy: the step's greedy-only
        variant (False: the sampling one). switch (tier_dispatch "switch" engines): run the one
        switch step with a DevicePlan that makes the device choose `tier`
        (`TierPlanner.forcing`: below a full batch a tier too large for the rows' drafts gives
        way to the smallest that holds them); otherwise the step compiled for `tier`. Used by
        `profile` and by benchmarks that time or trace a step."""
        if self.busy:
            raise RuntimeError("forced_step: the engine has requests in flight (it resets the state)")
        slots, call = self._forced_call(batch, tier, greedy, switch)
        rng = np.random.default_rng(seed)
        self.state = self._init_state()
        prompts = rng.integers(0, self.target.config.vocab_size, (batch, prompt_len)).astype(np.int32)
        self._prefill_rows(
            prompts,
            np.full(batch, prompt_len, np.int32),
            slots[:batch],
            np.zeros((batch, 2), np.uint32),
            [(0.0, 0, 1.0)] * batch,
        )

        def run():
            args, kwargs = self._step_args(slots, **call)
            self.state, readout, *_, used = self._step(*args, **kwargs)
            return readout, used

        return run

    def profile(self, batches, *, repeats=10, rounds=3, prompt_len=8, seed=0, on_entry=None) -> CostTable:
        """Time the real jitted step per (batch, tier) with forced acceptance (every verified draft
        accepted) and return the cost table the planner reads: entries {(batch, tier tokens):
        seconds a step}, for every tier >= batch; in static mode, which verifies every slot's whole
        block whatever the tier, the full tier alone (num_slots * window tokens). A step's seconds
        are those of `repeats` calls run back to back (after one that compiles), synchronised once
        at the end, as the decoding loop runs them: the host dispatches step k + 1 while the device
        runs step k, so a step costs the larger of the two, and where the host's dispatch is the
        larger (a small model) every tier costs about the same and the planner verifies full
        blocks. Each entry is the least of `rounds` such timings, taken in turn over a batch's
        tiers (round 1 over every tier, then round 2, ...), so a clock that ramps up or a
        neighbour's burst does not land on one tier alone; the table's metadata "noise" is the
        median over entries of (slowest round / fastest round - 1) (`CostTable.noise`, 0.0 with one
        round): the planner does not trim for a saving within it; "window" and "trim_draft" record
        the step timed (a planner refuses the table for another). The engine's state is reset.
        on_entry(batch, tier, seconds), if given, is called after each entry's last round (e.g. a
        progress bar)."""
        if self.proposer is None:
            raise ValueError("profile: verify_mode 'none' has no tiers to profile")
        for name, value in (("repeats", repeats), ("rounds", rounds)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: must be an int >= 1")
        timings = collections.defaultdict(list)  # {(batch, tier): seconds of each round}
        calls = repeats + 1
        if prompt_len + calls * self.window > self.spec.max_len:
            raise ValueError(
                f"profile: prompt_len + (repeats + 1) * window exceeds SpecConfig.max_len={self.spec.max_len}"
            )
        tiers = self.tier_tokens[-1:] if self.spec.verify_mode == "static" else self.tier_tokens
        for batch in batches:
            if not 1 <= batch <= self.spec.num_slots:
                raise ValueError(f"batches: {batch} is not in 1..num_slots={self.spec.num_slots}")
            fitting = [tier for tier in tiers if tier >= batch]
            for round_ in range(rounds):
                for tier in fitting:
                    step = self.forced_step(batch, tier, prompt_len=prompt_len, seed=seed)
                    jax.block_until_ready(step())  # compiles in the first round
                    start = time.perf_counter()
                    for _ in range(repeats):
                        out = step()
                    jax.block_until_ready(out)
                    timings[(batch, tier)].append((time.perf_counter() - start) / repeats)
                    if on_entry is not None and round_ == rounds - 1:
                        on_entry(batch, tier, min(timings[(batch, tier)]))
        self.state = self._init_state()
        noise = statistics.median(max(t) / min(t) - 1.0 for t in timings.values()) if timings else 0.0
        metadata = {"noise": noise, "window": self.window, "trim_draft": self.spec.trim_draft}
        return CostTable({key: min(t) for key, t in timings.items()}, metadata)

    def forced_lowerings(self, batch, tier, *, prompt_len=8, greedy=True, switch=False) -> dict:
        """What `forced_step(batch, tier, prompt_len=..., greedy=..., switch=...)` compiles, as
        {"prefill": thunk, "step": thunk}, each returning a jax.stages.Lowered (compile ahead, read
        the HLO, count the cost). Lowering reads only the shapes of the state."""
        slots, call = self._forced_call(batch, tier, greedy, switch)
        rows = self.spec.prefill_rows or batch
        return {
            "prefill": partial(self._lower_prefill, rows, prompt_len),
            "step": partial(self._lower_step, slots, **call),
        }

    def _step_args(self, slots, plan, force_accept, *, greedy, tier):
        """The jitted step's (args, kwargs) for rows `slots` on the current state."""
        args = (self.state, self.target, self.proposer, slots, plan, np.bool_(force_accept))
        return args, dict(greedy=greedy, tier=tier, **self._simulate)

    def _lower_step(self, slots, plan, force_accept, *, greedy, tier):
        args, kwargs = self._step_args(slots, plan, force_accept, greedy=greedy, tier=tier)
        return self._step.lower(*args, **kwargs)

    def lowerings(self, *, greedy: bool, prompt_lengths=()) -> dict:
        """What decoding compiles, as {name: thunk returning a jax.stages.Lowered}: the step at
        every tier decoding can pick (static and none: the full one; under tier_dispatch "switch"
        the one switch step) for this greedy flag, and the prefill of each prompt length's bucket
        at every row count a join takes (SpecConfig.prefill_rows, else the powers of two up to
        num_slots). Compiling them ahead (`.compile()`, e.g. in threads) fills jax's caches, so
        decoding then compiles none of them. Lowering reads only the shapes of the state."""
        s = self.spec.num_slots
        out = {}
        slots = np.zeros(s, np.int32)
        if self._switch:
            plan = self.tier_planner.device_plan([None] * s, None, self._steps_run)
            out["step switch"] = partial(self._lower_step, slots, plan, False, greedy=greedy, tier=None)
        else:
            planned = self.spec.verify_mode in PLANNED_MODES
            for tier in self.tier_tokens if planned else self.tier_tokens[-1:]:
                out[f"step {tier}"] = partial(self._lower_step, slots, None, False, greedy=greedy, tier=tier)
        counts = (
            [self.spec.prefill_rows] if self.spec.prefill_rows else [1 << i for i in range((s - 1).bit_length() + 1)]
        )
        for width in sorted({self._bucket(n) for n in prompt_lengths}):
            for rows in counts:
                out[f"prefill {rows}x{width}"] = partial(self._lower_prefill, rows, width)
        return out

    def _lower_prefill(self, rows, width):
        params = SamplingParams.create(
            rows, np.zeros(rows, np.float32), np.zeros(rows, np.int32), np.ones(rows, np.float32)
        )
        return self._prefill.lower(
            self.state,
            self.target,
            self.proposer,
            jnp.zeros((rows, width), jnp.int32),
            jnp.ones((rows,), jnp.int32),
            jnp.zeros((rows,), jnp.int32),
            jnp.zeros((rows, 2), jnp.uint32),
            params,
        )

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
            return (
                f"max_new_tokens: prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) + window "
                f"({self.window}) = {need} exceeds SpecConfig.max_len={self.spec.max_len}"
            )
        return None

    @property
    def compiled_programs(self) -> int:
        """Compiled variants of this engine's step and prefill so far (shared by engines of the same
        configuration; the count grows when a call compiles)."""
        return self._step._cache_size() + self._prefill._cache_size()

    def _bucket(self, n):
        return min(max(16, 1 << (n - 1).bit_length()), self.spec.max_len)

    @property
    def busy(self) -> bool:
        """Whether `step` has work: a request queued, refused and not yet reported, decoding, or a
        device step in flight."""
        return bool(self._queue or self._refused or self._active or self._in_flight is not None)

    @property
    def steps_run(self) -> int:
        """Device steps dispatched so far (the planner's warm-up counts them)."""
        return self._steps_run

    @property
    def host_seconds(self) -> float:
        """The host's own time a decoding turn: the median, over the last HOST_TURNS turns, of the
        time from one step's readout arriving to the host asking for the next one (emitting
        tokens, the caller's work between turns, admitting, planning, dispatching), less the time
        spent waiting for a prefill's first tokens (device time); 0.0 before
        HOST_TURNS // 2 turns. The loop keeps one step in flight, so a step costs at least this
        whatever its tier: the planner prices every tier at max(table, host_seconds), and
        verifies full blocks where the host alone takes the full block's time (a small model,
        many rows), since trimming drafts there saves no time and loses tokens."""
        if len(self._host_busy) < HOST_TURNS // 2:
            return 0.0
        return statistics.median(self._host_busy)

    def submit(
        self,
        prompt,
        max_new_tokens=64,
        *,
        temperature=0.0,
        top_k=0,
        top_p=1.0,
        seed=0,
        stop=None,
        eos_token_id=None,
        name=None,
    ) -> int:
        """Queue one request and return its id; `step` runs it. The arguments are `generate`'s for
        one prompt (seed: an int). Invalid arguments raise ValueError; a request the engine cannot
        serve (empty, a token id that is not an int or is out of the vocabulary, too long for max_len)
        is not an exception: the next `step` reports it finished with `result.error` set. Errors
        begin with `name` (default "request <id>")."""
        _check_sampling(max_new_tokens, temperature, top_k, top_p)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompts: text prompts need Engine(tokenizer=...)")
            prompt = self.tokenizer.encode(prompt)
        prompt = list(prompt)
        eos = frozenset(
            self.target.config.eos_token_id
            if eos_token_id is None
            else ([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)
        )
        rid, self._next_id = self._next_id, self._next_id + 1
        name = f"request {rid}" if name is None else name
        error = self._refusal(prompt, max_new_tokens)
        if error:
            self._refused.append((rid, f"{name}: {error}"))
        else:
            self._queue.append(
                _Request(
                    rid,
                    name,
                    [int(t) for t in prompt],
                    _raw_key(int(seed)),
                    max_new_tokens,
                    (float(temperature), int(top_k), float(top_p)),
                    eos,
                    tuple(stop) if stop else None,
                )
            )
        return rid

    def step(self) -> list[Event]:
        """One turn of the host loop; returns its news, one Event per request that emitted tokens
        or finished, in the order of their first news ([] when there was nothing to do).

        A turn admits queued requests into the free slots (prefills them), dispatches the next
        device step for the decoding requests, reads the joining requests' first tokens (their
        prefill's), then the tokens of the step the previous turn dispatched. One step stays in
        flight: step k + 1 is dispatched before the host reads step k or a prefill, so the host
        never waits for the device between steps; a request that finished at step k (or with its
        first token) runs one more (discarded) row in the next step, and its slot takes a queued
        request at the next turn. A turn that finds the engine idle starts afresh (so does each
        `generate` call): the planner forgets earlier survivals, slots are taken from slot 1 up."""
        if not self._active and self._in_flight is None:
            self._history.clear()
            self._free.sort()
            self._ready_at, self._waited = None, 0.0  # the idle time before this turn is nobody's step
        while self._refused:
            rid, error = self._refused.popleft()
            self._news[rid] = [[], False, GenerationResult(tokens=[], stats={}, error=error)]
        joined = None
        if self._queue and self._free:
            joined = self._admit([self._queue.popleft() for _ in range(min(len(self._queue), len(self._free)))])
        dispatched = self._dispatch() if self._active else None
        if joined is not None:
            self._emit_first(*joined)
        if self._in_flight is not None:
            self._read(self._in_flight)
        self._in_flight = dispatched
        news, self._news = self._news, {}
        return [Event(rid, tuple(tokens), first, result) for rid, (tokens, first, result) in news.items()]

    def _finish(self, req, error=None):
        req.done = True
        self._free.append(req.slot)
        del self._active[req.slot]
        now = time.perf_counter()
        elapsed = max(now - req.start, 1e-9)
        steps = len(req.accepted)
        stats = {
            "steps": steps,
            "accepted": req.accepted,
            "verified": req.verified,
            "accept_length": (len(req.tokens) - 1) / steps if steps else 0.0,
            "tokens_per_s": len(req.tokens) / elapsed,
            "first_token_s": req.first_at - req.start if req.tokens else 0.0,
            "decode_tokens_per_s": (len(req.tokens) - 1) / max(now - req.first_at, 1e-9)
            if len(req.tokens) > 1
            else 0.0,
            "includes_compilation": self.compiled_programs != req.compiled,
        }
        text = self.tokenizer.decode(req.tokens) if self.tokenizer is not None else None
        self._news.setdefault(req.id, [[], False, None])[2] = GenerationResult(
            tokens=req.tokens, stats=stats, text=text, error=None if error is None else f"{req.name}: {error}"
        )

    def _emit(self, req, tok):
        if tok == NON_FINITE:
            self._finish(
                req,
                f"the target's logits are not finite (NaN or inf) after {len(req.tokens)} generated "
                "tokens; the request was ended (its weights or activations overflow)",
            )
            return
        req.tokens.append(int(tok))
        if len(req.tokens) == 1:
            req.first_at = time.perf_counter()
        self._news.setdefault(req.id, [[], len(req.tokens) == 1, None])[0].append(int(tok))
        stopped = (
            req.stop and self.tokenizer is not None and any(s in self.tokenizer.decode(req.tokens) for s in req.stop)
        )
        if int(tok) in req.eos or len(req.tokens) >= req.max_new_tokens or stopped:
            self._finish(req)

    def _admit(self, joining):
        """Prefill the joining requests into free slots in one `_prefill_rows` (rows padded to a
        power of two unless SpecConfig.prefill_rows fixes them, length to a bucket). Returns
        (joining, their first tokens on the device) for `_emit_first`."""
        rows = len(joining) if self.spec.prefill_rows else 1 << (len(joining) - 1).bit_length()
        width = self._bucket(max(len(req.prompt) for req in joining))
        tokens = np.zeros((rows, width), np.int32)
        lengths, slots, keys = np.ones(rows, np.int32), np.zeros(rows, np.int32), np.zeros((rows, 2), np.uint32)
        sampling_rows = [joining[0].sampling] * rows  # padding rows: the first request's
        for i, req in enumerate(joining):
            req.slot, req.start, req.compiled = self._free.pop(0), time.perf_counter(), self.compiled_programs
            self._active[req.slot] = req
            tokens[i, : len(req.prompt)] = req.prompt
            lengths[i], slots[i], keys[i], sampling_rows[i] = len(req.prompt), req.slot, req.key, req.sampling
        return joining, self._prefill_rows(tokens, lengths, slots, keys, sampling_rows)

    def _emit_first(self, joining, firsts):
        start = time.perf_counter()
        first = np.concatenate([np.asarray(f) for f in firsts])  # waits for the prefill (and the step before)
        self._waited += time.perf_counter() - start
        for req, tok in zip(joining, first):
            self._emit(req, tok)

    def _prefill_rows(self, tokens, lengths, slots, keys, sampling_rows):
        """Prefill numpy rows (tokens [R, P], lengths [R], slots [R] with 0 = padding row, raw
        keys [R, 2], sampling_rows R (temperature, top_k, top_p)) in one call, or in calls of
        exactly SpecConfig.prefill_rows rows (the last padded with null-slot rows). Returns the
        calls' first generated tokens (device arrays, their copies to the host started), which
        concatenated begin with the R rows'."""
        n = tokens.shape[0]
        per = self.spec.prefill_rows or n
        pad = -n % per
        if pad:
            tokens = np.concatenate([tokens, np.zeros((pad, tokens.shape[1]), np.int32)])
            lengths = np.concatenate([lengths, np.ones(pad, np.int32)])
            slots = np.concatenate([slots, np.zeros(pad, np.int32)])
            keys = np.concatenate([keys, np.zeros((pad, 2), np.uint32)])
            sampling_rows = list(sampling_rows) + [sampling_rows[0]] * pad
        temperature, top_k, top_p = (
            np.asarray(v, dt) for v, dt in zip(zip(*sampling_rows), (np.float32, np.int32, np.float32))
        )
        firsts = []
        for i in range(0, n + pad, per):
            part = slice(i, i + per)
            # numpy straight into the jitted call: its C++ path moves them in one go, where
            # jnp.asarray / SamplingParams.create would dispatch ~10 eager ops, each on its own
            params = SamplingParams(temperature=temperature[part], top_k=top_k[part], top_p=top_p[part])
            self.state, first = self._prefill(
                self.state, self.target, self.proposer, tokens[part], lengths[part], slots[part], keys[part], params
            )
            first.copy_to_host_async()
            firsts.append(first)
        return firsts

    def _dispatch(self):
        """Dispatch the next device step for the active requests; returns what `_read` needs."""
        rows = [self._active.get(s) for s in range(1, self.spec.num_slots + 1)]
        old = self._history[0] if len(self._history) == self.spec.lag else None
        host = self.host_seconds if self._switch or self._plans_on_host else 0.0
        if self._switch:
            tier, plan = None, self.tier_planner.device_plan(rows, old, self._steps_run, host)
        else:
            tier, plan = self.tier_planner.choose_tier(rows, old, self._steps_run, host), None
        temperature = np.asarray([0.0 if r is None else r.sampling[0] for r in rows], np.float32)
        slots = np.asarray([0 if r is None else r.slot for r in rows], np.int32)  # travels with the call
        self.state, readout, features, survival, used = self._step(
            self.state,
            self.target,
            self.proposer,
            slots,
            plan,
            np.bool_(False),
            greedy=not temperature.any(),
            tier=tier,
            **self._simulate,
        )
        self._steps_run += 1
        # start the device-to-host copies now: by the time the host reads them (next turn) they
        # are there, no round trip. The readout carries the survivals too: `_read` puts their
        # host copy in this step's history entry, which the tier choice `lag` steps later reads
        readout.copy_to_host_async()
        if tier is None:
            used.copy_to_host_async()
        entry = [rows, survival]  # (rows, survivals): on the device until read, for a DevicePlan
        self._history.append(entry)
        if self.recorder is not None:
            t = self.window
            self.recorder.add(
                features, readout[:, t + 1], readout[:, t], temperature, [-1 if r is None else r.id for r in rows]
            )
        return rows, readout, used if tier is None else tier, entry

    def _read(self, in_flight):
        """Read a dispatched step's tokens and emit them to their requests (rows of requests that
        finished meanwhile are discarded)."""
        rows, readout, step_tier, entry = in_flight
        self.tier_counts[int(step_tier)] += 1
        start = time.perf_counter()
        if self._ready_at is not None:
            self._host_busy.append(start - self._ready_at - self._waited)
        emitted, accepted, verified, survival = split_readout(readout, self.window)  # waits for the step
        self._ready_at, self._waited = time.perf_counter(), 0.0
        if self._plans_on_host:
            entry[1] = survival  # the host's tier choice reads these numpy survivals, no transfer
        # Python ints from here: numpy scalars per row and token cost 1.5-2x as much (at 64 rows
        # ~0.3-0.5 ms a turn on a 2-core CPU, where the tiny pair's whole GPU step is ~1-3 ms)
        emitted, accepted, verified = emitted.tolist(), accepted.tolist(), verified.tolist()
        live = [row for row, req in enumerate(rows) if req is not None]
        self.totals.update(
            steps=1, rows=len(live), verified=sum(verified[row] for row in live) + len(live), tier_tokens=int(step_tier)
        )
        for row, req in enumerate(rows):
            if req is None or req.done:
                continue
            req.accepted.append(accepted[row])
            req.verified.append(verified[row])
            for tok in emitted[row][: accepted[row] + 1]:
                if not req.done:
                    self._emit(req, tok)

    def generate(
        self, prompts, max_new_tokens=64, temperature=0.0, top_k=0, top_p=1.0, seed=0, stop=None, eos_token_id=None
    ):
        """Decode every prompt (a list of token-id lists, or strings with a tokenizer): `submit`
        each, then `step` until all are done. Returns their GenerationResults in prompt order.

        Requests wait in a queue for a free slot; a bad request gets a result with `error` set and
        the others go on, as does a request whose target logits turn non-finite (it keeps the tokens
        emitted before); errors name the prompt by its index. Per-request PRNG keys come from `seed`
        (an int, or one per prompt), so a request's tokens do not depend on the requests it ran
        beside. Draft rows with non-finite logits (they verify nothing, see the module doc) are
        reported by one warning at the end. The engine must be idle (RuntimeError while requests
        from `submit` are still running).
        """
        if self.busy:
            raise RuntimeError("generate: the engine still runs submitted requests; drive them with step() first")
        _check_sampling(max_new_tokens, temperature, top_k, top_p)
        seeds = list(seed) if isinstance(seed, (list, tuple)) else [seed] * len(prompts)
        if len(seeds) != len(prompts):
            raise ValueError(f"seed: {len(seeds)} seeds for {len(prompts)} prompts")
        if self.tokenizer is None and any(isinstance(p, str) for p in prompts):
            raise ValueError("prompts: text prompts need Engine(tokenizer=...)")
        self.state = self.state.replace(draft_non_finite=jnp.zeros((), jnp.int32))
        ids = [
            self.submit(
                p,
                max_new_tokens,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                seed=s,
                stop=stop,
                eos_token_id=eos_token_id,
                name=f"prompt {i}",
            )
            for i, (p, s) in enumerate(zip(prompts, seeds))
        ]
        results = {}
        while self.busy:
            results.update((ev.request, ev.result) for ev in self.step() if ev.result is not None)
        self._warn_draft_non_finite()
        return [results[i] for i in ids]

    def _warn_draft_non_finite(self):
        """One warning when draft rows had non-finite logits in the last `generate` (reads the counter)."""
        count = int(self.state.draft_non_finite)
        if count:
            warnings.warn(
                f"the draft's logits were not finite (NaN or inf) in {count} request-steps; those steps "
                "verified no drafts (the output is unchanged, only slower): the draft is broken",
                RuntimeWarning,
                stacklevel=3,
            )
