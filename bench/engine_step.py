"""The engine step: planning overhead, tokens/s per verify mode, and host- vs device-chosen tiers.

(a) Planning, no model, at --plan-batches, block --block. Host: `planner.choose_budget` with a
  CostTable over the admissible budgets of `layout.tiers` plus `layout.tier_for`; the engine's
  whole host path `TierPlanner.choose_tier` (it reads the lagged survival back from the device);
  the switch dispatch's `TierPlanner.device_plan`. Device: `planner.plan_lengths` +
  `layout.step_layout` per tier and `engine.device_tier`, jitted: a step's share of a --scan-steps
  lax.scan, and one synchronised call a step.
(b) generate at --batches for the verify modes none, static, cap-accept and compact (compact with
  tier_dispatch host and switch): one engine per (mode, batch), num_slots = batch; prompts of
  --prompt-len bytes from the held-out corpus (jaxspec.train), no EOS stop, --max-new-tokens each;
  cost tables profiled in the run (`Engine.profile`); warmed up past the estimator's warm-up with
  every tier's step compiled (`compiled_in_run` says if anything compiled later). Reports tokens/s
  (generated tokens / generate wall time), wall a step, acceptance length (tokens committed a
  request-step), steps and tier counts.
(c) Host vs switch on the device alone: the jitted step per tier against the switch step with a
  DevicePlan forcing that tier (`Engine.forced_step`: random prompts of the prefill width, forced
  acceptance), synchronised call by call (median of --step-reps), each with its GPU busy time and
  kernels (`benchutil.gpu_kernel_times`): wall - busy = dispatch and launch gaps.
Without --target/--draft, random-weight tiny models are built (acceptance is then meaningless).

Usage:
  PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false python3 bench/engine_step.py --out $OUT \\
      --target models/tiny-target --draft models/tiny-dflash
  python3 bench/engine_step.py --smoke      (CPU, random tiny models, tiny sizes)
Writes DIR/engine_step.md and DIR/engine_step.json (DIR = --out).
"""

import argparse
import collections
import functools
import json
import os
import statistics
import sys
import tempfile
import time

import benchutil  # bench/benchutil.py: the script directory is first on sys.path

HERE = os.path.dirname(os.path.abspath(__file__))
MODES = ("compact", "static", "none", "cap-accept")


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(HERE, "out"))
    ap.add_argument("--target", help="target checkpoint dir (default: random tiny model)")
    ap.add_argument("--draft", help="DFlash draft checkpoint dir (default: random tiny draft)")
    ap.add_argument("--dtype", default="float32", help="params dtype the checkpoints are loaded in")
    ap.add_argument("--plan-batches", default="1,128", help="batches of part (a); '' skips it")
    ap.add_argument("--block", type=int, default=8, help="block of the model-free planning part (a)")
    ap.add_argument("--plan-iters", type=int, default=300)
    ap.add_argument("--scan-steps", type=int, default=100)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--modes", help="subset of " + ",".join(MODES) + " (default: all; --smoke: all but cap-accept)")
    ap.add_argument("--dispatch", default="host,switch", help="tier dispatch(es) of compact")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--num-tiers", type=int, default=4)
    ap.add_argument("--profile-repeats", type=int, default=10)
    ap.add_argument("--step-reps", type=int, default=10)
    ap.add_argument("--no-engine", action="store_true", help="part (a) only")
    ap.add_argument("--budget-s", type=float, default=1e9, help="start no new case after this many seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    if args.smoke:
        args.plan_batches, args.plan_iters, args.scan_steps = "1,16", 50, 20
        args.batches, args.prompt_len, args.max_new_tokens = "2", 16, 24
        args.profile_repeats, args.step_reps, args.num_tiers = 2, 2, 2
        args.modes = args.modes or "compact,static,none"
    args.modes = args.modes or ",".join(MODES)
    return args


def timed_host(fn, items, reps=5):
    """Median over reps of the mean µs per call of fn(item) over items (host clock)."""
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        for it in items:
            fn(it)
        ts.append((time.perf_counter() - t) / len(items))
    return statistics.median(ts) * 1e6


def main(args):
    benchutil.setup_jax(args.smoke)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxspec import dflash, train
    from jaxspec import target as target_mod
    from jaxspec.config import SpecConfig
    from jaxspec.engine import Engine
    from jaxspec.spec import layout, planner
    from jaxspec.spec.planner import CostTable
    from jaxspec.step import DevicePlan, device_tier
    from jaxspec.tier_planner import TierPlanner

    os.makedirs(args.out, exist_ok=True)
    t_start = time.time()
    dev = jax.devices()[0]
    on_gpu = jax.default_backend() == "gpu"
    rng = np.random.default_rng(args.seed)
    plan_rows, gen_rows, step_rows, notes = [], [], [], []
    model_desc = {}

    def over_budget():
        return time.time() - t_start > args.budget_s

    def dump():
        summary = dict(
            device=dev.device_kind,
            backend=jax.default_backend(),
            jax=jax.__version__,
            smoke=args.smoke,
            models=model_desc,
            args=vars(args),
            planning=plan_rows,
            generate=gen_rows,
            steps=step_rows,
            notes=notes,
            elapsed_s=round(time.time() - t_start, 1),
        )
        with open(os.path.join(args.out, "engine_step.json"), "w") as f:
            json.dump(summary, f, indent=1)
        fmt = lambda v, d=1: "–" if v is None else f"{v:.{d}f}"
        lines = [
            f"# engine step, {dev.device_kind} ({jax.default_backend()}), jax {jax.__version__}"
            + (" — SMOKE (CPU, random tiny models: no meaning as timings)" if args.smoke else ""),
            "",
        ]
        if plan_rows:
            lines += [
                f"## (a) planning overhead per step (block {args.block}; µs)",
                "",
                "host: choose_budget + tier_for on host survivals; choose_tier: the engine's host path "
                "(reads the lagged survival from the device; cold, and after copy_to_host_async as the engine "
                "starts it at dispatch); switch host: building the DevicePlan (its two "
                "small host arrays travel with the step call). "
                "device: plan_lengths + step_layout per tier (scan: device time per step; call: one "
                "synchronised jitted call); device tier: the switch's on-device tier choice (scan).",
                "",
                "| batch | tiers | host choose_budget | host choose_tier cold | copied | switch host "
                "| device tier (scan) | device plan+layout per tier (scan) | same, one call each |",
                "|---|---|---|---|---|---|---|---|---|",
            ]
            for r in plan_rows:
                lines.append(
                    f"| {r['batch']} | {r['tiers']} | {fmt(r['host_choose_budget_us'])} "
                    f"| {fmt(r['host_choose_tier_us'])} | {fmt(r['host_choose_tier_copied_us'])} "
                    f"| {fmt(r['switch_host_us'])} "
                    f"| {fmt(r['device_tier_scan_us'], 2)} "
                    f"| {', '.join(fmt(v, 2) for v in r['device_scan_us'])} "
                    f"| {', '.join(fmt(v) for v in r['device_call_us'])} |"
                )
        if gen_rows:
            lines += [
                "",
                f"## (b) generate: {args.max_new_tokens} new tokens per request, prompt {args.prompt_len} "
                f"tokens, temperature {args.temperature}",
                "",
                "| batch | mode | dispatch | tokens/s | step ms | accept length | steps | tiers (tokens: steps) "
                "| wall s | compiled in run |",
                "|---|---|---|---|---|---|---|---|---|---|",
            ]
            for r in gen_rows:
                tiers = ", ".join(f"{k}: {v}" for k, v in sorted(r["tier_counts"].items()))
                lines.append(
                    f"| {r['batch']} | {r['mode']} | {r['dispatch']} | {fmt(r['tokens_per_s'], 0)} "
                    f"| {fmt(r['step_ms'], 3)} | {fmt(r['accept_length'], 2)} | {r['steps']} | {tiers} "
                    f"| {fmt(r['wall_s'], 2)} | {r['compiled_in_run']} |"
                )
        if step_rows:
            lines += [
                "",
                "## (c) compact step by tier: host (one jitted step per tier) vs switch (one step, "
                "lax.switch, tier forced through the DevicePlan); ms per synchronised call; GPU busy = "
                "the kernels' summed durations a step (profiler trace)",
                "",
                "| batch | tier tokens | host ms | host GPU busy ms | distinct kernels | switch ms "
                "| switch GPU busy ms | switch / host | switch ran tier |",
                "|---|---|---|---|---|---|---|---|---|",
            ]
            for r in step_rows:
                lines.append(
                    f"| {r['batch']} | {r['tier']} | {fmt(r['host_ms'], 3)} | {fmt(r['host_busy_ms'], 3)} "
                    f"| {r['host_kernels'] or '–'} | {fmt(r['switch_ms'], 3)} "
                    f"| {fmt(r['switch_busy_ms'], 3)} | {fmt(r['switch_ms'] / r['host_ms'], 2)} "
                    f"| {r['switch_tier']} |"
                )
        if notes:
            lines += [""] + [f"- {n}" for n in notes]
        with open(os.path.join(args.out, "engine_step.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
        return lines

    # ------------------------------------------------------------------------- (a) planning
    d = args.block - 1
    for b in [int(x) for x in args.plan_batches.split(",") if x]:
        if over_budget():
            break
        tiers, admissible = layout.tiers(b, args.block, args.num_tiers)
        table = CostTable({(b, t): 1e-3 * (1.0 + t / (b * args.block)) for t in tiers})
        n_items = args.plan_iters

        def survival_np():
            return np.cumprod(rng.uniform(0.3, 1.0, (b, d)), axis=1).astype(np.float32)

        host_surv = [survival_np() for _ in range(32)]

        def host_choose(s):
            n = planner.choose_budget(s, table, admissible)
            return layout.tier_for(b + n, tiers)

        host_us = timed_host(host_choose, host_surv * (n_items // 32 + 1))

        # the engine's planning alone (what Engine.tier_planner runs each step), past its warm-up
        spec_b = SpecConfig(verify_mode="compact", num_slots=b, num_tiers=args.num_tiers)
        tier_planner = TierPlanner(spec_b, args.block, table)
        assert tier_planner.tier_tokens == tiers
        past_warmup = 10**9
        reqs = [object() for _ in range(b)]
        dev_surv = [[jax.device_put(survival_np()) for _ in range(n_items)] for _ in range(4)]
        jax.block_until_ready(dev_surv)

        def choose(s):
            return tier_planner.choose_tier(reqs, (reqs, s), past_warmup)

        def device_plan(s):
            return tier_planner.device_plan(reqs, (reqs, s), past_warmup)

        choose_us = min(timed_host(choose, dev_surv[i], reps=1) for i in (0, 1))
        for s in dev_surv[3]:  # as the engine does when it dispatches a step
            s.copy_to_host_async()
        time.sleep(0.1)
        choose_async_us = timed_host(choose, dev_surv[3], reps=1)
        device_plan(dev_surv[2][0])  # builds the cost matrix once
        switch_host_us = timed_host(device_plan, dev_surv[2], reps=3)

        slots = jnp.arange(1, b + 1, dtype=jnp.int32)
        anchors = jnp.asarray(rng.integers(0, 256, b), jnp.int32)
        drafts = jnp.asarray(rng.integers(0, 256, (b, d)), jnp.int32)
        surv_stack = jnp.asarray(np.stack([survival_np() for _ in range(16)]))

        def plan_layout(s, tier):
            lengths = planner.plan_lengths(s, tier - b)
            return layout.step_layout(lengths, anchors, drafts, slots, tier)

        def scan_us(step, carry0):
            @jax.jit
            def run(carry):
                return jax.lax.scan(
                    lambda c, i: (step(c, surv_stack[i % 16]), None), carry, jnp.arange(args.scan_steps)
                )[0]

            jax.block_until_ready(run(carry0))
            ts = []
            for _ in range(5):
                t = time.perf_counter()
                jax.block_until_ready(run(carry0))
                ts.append(time.perf_counter() - t)
            return statistics.median(ts) / args.scan_steps * 1e6

        scan, call = [], []
        for tier in tiers:

            def step(c, s, tier=tier):
                tokens, qsl, _ = plan_layout(s, tier)
                return c + tokens[0] + qsl[-1]

            scan.append(scan_us(step, jnp.zeros((), jnp.int32)))
            f = jax.jit(functools.partial(plan_layout, tier=tier))
            jax.block_until_ready(f(surv_stack[0]))

            def one(i, f=f):
                jax.block_until_ready(f(surv_stack[i % 16]))

            call.append(timed_host(one, range(n_items), reps=3))
        costs = jnp.asarray(
            np.array(
                [[1.0] * len(tiers)]
                + [
                    [table.step_time(n, n + min(t - n, n * d)) if t >= n else 1.0 for t in tiers]
                    for n in range(1, b + 1)
                ],
                np.float32,
            )
        )
        active = slots > 0

        def dev_tier(c, s):
            plan = DevicePlan(plan=jnp.asarray(True), survival=s, same=active, costs=costs)
            return c + device_tier(plan, active, tiers, d)

        tier_us = scan_us(dev_tier, jnp.zeros((), jnp.int32))
        plan_rows.append(
            dict(
                batch=b,
                tiers=list(tiers),
                host_choose_budget_us=host_us,
                host_choose_tier_us=choose_us,
                host_choose_tier_copied_us=choose_async_us,
                switch_host_us=switch_host_us,
                device_scan_us=scan,
                device_call_us=call,
                device_tier_scan_us=tier_us,
            )
        )
        print(dump()[-1], flush=True)
        del dev_surv

    if args.no_engine:
        print("\n".join(dump()), flush=True)
        return 0

    # ------------------------------------------------------------------------- models, prompts
    if bool(args.target) != bool(args.draft):
        raise SystemExit("engine_step: give both --target and --draft, or neither")
    if not args.target:
        tmp = tempfile.mkdtemp(prefix="engine_step_")
        small = (
            dict(hidden_size=32, num_hidden_layers=2, full_attention_interval=2, head_dim=16, intermediate_size=64)
            if args.smoke
            else {}
        )
        cfg = train.tiny_target_config(**small)
        target = target_mod.init_target(cfg, jax.random.PRNGKey(args.seed))
        args.target, args.draft = os.path.join(tmp, "target"), os.path.join(tmp, "draft")
        train.save_target(args.target, target.params, cfg)
        dcfg = train.tiny_draft_config(cfg, num_hidden_layers=1 if args.smoke else 2)
        train.save_draft_checkpoint(args.draft, dflash.init_draft(dcfg, jax.random.PRNGKey(args.seed + 1)).params, dcfg)
        notes.append("random-weight tiny models (no --target/--draft): acceptance and tier choice are meaningless")
    target = target_mod.load_target(args.target, jnp.dtype(args.dtype))
    draft = dflash.load_draft(args.draft, target)
    model_desc.update(
        target=args.target,
        draft=args.draft,
        dtype=args.dtype,
        vocab=target.config.vocab_size,
        target_layers=target.config.num_hidden_layers,
        hidden=target.config.hidden_size,
        block=draft.config.block_size,
        draft_layers=draft.config.num_hidden_layers,
    )
    block = draft.config.block_size

    _, held_files = train.corpus_files()
    held = train.Corpus.from_files(train.stdlib_root(), held_files).tokens
    prompts = []
    while len(prompts) < max(int(x) for x in args.batches.split(",")):
        start = int(rng.integers(0, len(held) - args.prompt_len))
        window = held[start : start + args.prompt_len]
        if not (window == train.EOS_ID).any():
            prompts.append([int(t) for t in window])
    max_len = -(-(args.prompt_len + args.max_new_tokens + 2 * block + 8) // 64) * 64
    # the engine's prefill bucket of a prompt_len prompt: profiling and (c) prefill at the same shape
    width = min(max(16, 1 << (args.prompt_len - 1).bit_length()), max_len)
    max_len = max(max_len, width + (max(args.profile_repeats, args.step_reps) + 2) * block)

    def spec(mode, b):
        return SpecConfig(verify_mode=mode, num_slots=b, max_len=max_len, num_tiers=args.num_tiers)

    def gen(engine, b):
        return engine.generate(
            prompts[:b],
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            seed=list(range(b)),
            eos_token_id=[],
        )

    def compile_tiers(engine, b):
        """Compile the step of every tier the host may pick (host dispatch) ahead of the timed run."""
        for name, lower in engine.lowerings(greedy=args.temperature == 0).items():
            if name.startswith("step"):
                lower().compile()

    def run_generate(b, mode, dispatch):
        engine = Engine(
            target, None if mode == "none" else draft, spec(mode, b), cost_table=tables.get(b), tier_dispatch=dispatch
        )
        if mode in ("compact", "cap-accept") and b not in tables:
            # compact's verify costs (cap-accept shares compact's plans: same table, same tokens)
            prof = engine if mode == "compact" else Engine(target, draft, spec("compact", b))
            t = time.perf_counter()
            tables[b] = engine.cost_table = prof.profile([b], repeats=args.profile_repeats, prompt_len=width)
            notes.append(
                f"batch {b}: cost table profiled (compact engine, {prof.tier_dispatch} dispatch) in "
                f"{time.perf_counter() - t:.1f} s: "
                + ", ".join(f"{k[1]} tok {v * 1e3:.3f} ms" for k, v in sorted(tables[b].entries.items()))
            )
        warmup = engine.warmup_steps if mode in ("cap-accept", "compact") else 0
        t = time.perf_counter()
        gen(engine, b)
        while engine.steps_run < warmup and not over_budget():
            gen(engine, b)
        if mode in ("cap-accept", "compact") and dispatch == "host":
            compile_tiers(engine, b)
        warm_s = time.perf_counter() - t
        compiled = engine.compiled_programs
        counts, steps0 = collections.Counter(engine.tier_counts), engine.steps_run
        t = time.perf_counter()
        results = gen(engine, b)
        wall = time.perf_counter() - t
        steps = engine.steps_run - steps0
        tokens = sum(len(r.tokens) for r in results)
        req_steps = sum(r.stats["steps"] for r in results)
        committed = sum(a + 1 for r in results for a in r.stats["accepted"])
        row = dict(
            batch=b,
            mode=mode,
            dispatch=dispatch if mode in ("cap-accept", "compact") else "–",
            tokens=tokens,
            wall_s=wall,
            tokens_per_s=tokens / wall,
            steps=steps,
            step_ms=wall / steps * 1e3,
            accept_length=committed / req_steps if req_steps else None,
            tier_counts={int(k): v for k, v in (engine.tier_counts - counts).items()},
            compiled_in_run=engine.compiled_programs != compiled,
            warmup_s=warm_s,
            past_estimator_warmup=engine.steps_run - steps >= warmup,
        )
        gen_rows.append(row)
        print(dump()[-1], flush=True)
        return engine

    def step_times(b, host_engine, switch_engine):
        """Per-tier step time: host static tier vs switch with the tier forced by the DevicePlan."""
        greedy = args.temperature == 0

        def time_calls(engine, tier, switch):
            """(median ms a synchronised step, tier the step ran, GPU busy ms a step, distinct kernels
            of a step); None for the last two off the GPU."""
            step = engine.forced_step(b, tier, prompt_len=width, seed=args.seed, greedy=greedy, switch=switch)
            ts = []
            for _ in range(args.step_reps + 1):
                t = time.perf_counter()
                readout, used = step()
                jax.block_until_ready(readout)
                ts.append(time.perf_counter() - t)
            # a fresh prefill: each call advances the rows by a window
            step = engine.forced_step(b, tier, prompt_len=width, seed=args.seed, greedy=greedy, switch=switch)
            gpu = benchutil.gpu_kernel_times(step) if on_gpu else {}
            busy_ms = gpu["busy_us"] / 1e3 if gpu else None
            return statistics.median(ts[1:]) * 1e3, int(used), busy_ms, len(gpu["kernels"]) if gpu else None

        for tier in host_engine.tier_tokens:
            if over_budget():
                break
            host_ms, _, host_busy_ms, host_kernels = time_calls(host_engine, tier, False)
            switch_ms, used, switch_busy_ms, _ = time_calls(switch_engine, tier, True)
            step_rows.append(
                dict(
                    batch=b,
                    tier=tier,
                    host_ms=host_ms,
                    switch_ms=switch_ms,
                    switch_tier=used,
                    host_busy_ms=host_busy_ms,
                    switch_busy_ms=switch_busy_ms,
                    host_kernels=host_kernels,
                )
            )
            print(dump()[-1], flush=True)

    # ------------------------------------------------------------------------- (b), (c)
    modes = [m for m in MODES if m in args.modes.split(",")]
    dispatches = [x for x in ("host", "switch") if x in args.dispatch.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    tables = {}
    # first pass: compact (both dispatches, then the per-tier step times) and static; second: none, cap-accept
    for pass_modes in (("compact", "static"), ("none", "cap-accept")):
        for b in batches:
            for mode in (m for m in modes if m in pass_modes):
                engines = {}
                for dispatch in dispatches if mode == "compact" else ["host"]:
                    if over_budget():
                        break
                    engines[dispatch] = run_generate(b, mode, dispatch)
                if mode == "compact" and len(engines) == 2 and not over_budget():
                    step_times(b, engines["host"], engines["switch"])
                del engines
    if over_budget():
        notes.append(f"stopped early: --budget-s {args.budget_s} reached")
    lines = dump()
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(parse()))
