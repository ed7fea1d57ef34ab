"""Benchmark of the acceptance estimator's per-step work (jaxspec/spec/estimator.py, issue #5).

Per decode step the engine runs, inside its jitted step: `features(draft_logits, temperature)`
(x = logit(q_max) per draft position: reads the draft logits [B, P, V]), `predict` (p and survival
[B, P], each row with its slot's request history) and `observe` (the Newton statistics, a refit
selected every refit_interval calls, the slots' histories).
This script times that work inside one jitted function: a lax.scan of --steps steps with the
estimator state carried, so launch gaps between steps are the device's own (no host dispatch per
step); per step = wall time of the scan (CUDA-synchronised, jax.block_until_ready) / steps, the
median over --reps calls. The scan is unrolled --unroll steps per loop iteration: an XLA GPU loop
iteration costs ~8 µs of its own (measured: the `loop` case at unroll 1), which a decode step,
one straight-line program, does not pay per estimator call.

Cases at batch B x positions P (P = 7: block 8; P = 15: block 16):
- `loop`: an empty scan step (the loop's own per-step cost, a floor for the others).
- `predict+observe`: from precomputed features, the estimator math alone. "plain": refit never
  fires (refit_interval 10**9, the cond is still there); "amortised": refit_interval
  --refit-interval (100), so a 200-step scan includes 2 refits.
- `refit`: refit every call (refit_interval 1): predict + observe + one refit per step.
- each predict+observe case once per --observe-impls: "ref" (jnp) and "pallas"
  (jaxspec/pallas/observe.py: the statistics and the refit in one launch).
- `features V=...`: features alone over bf16 logits of the full vocabulary (248,320); floor = logits
  bytes (read once) / copy bandwidth measured in the same run (jitted x + 1 over 1 GiB, read + write
  counted; or a torch copy from `--torch-copy` in an earlier process, as in topk_kernel.py).
- `features+predict+observe V=...`: the whole per-step estimator work, full vocabulary.
- `draft argmax` and `draft argmax+features+predict+observe` (full vocabulary): the
  engine reads the draft logits anyway for its draft tokens (greedy: an argmax); the difference of
  the two is what the estimator adds to a step where XLA may fuse the feature's max pass with the
  argmax's.
- the same with a small vocabulary (--small-vocab, 260: the tiny byte-level models) to isolate the
  estimator math from the logits read.

Inputs are rotated (a stack of distinct logits / features sets, at least 2 and up to 256 MiB of
logits in all, one set per step in turn) so no step's input is loop-invariant (XLA would hoist it
out of the scan) and small batches read DRAM, not the 50 MB L2.
Goal (issue #5): <= 10 us per step for predict + observe; features scale with B x P x V bytes.

Usage (GPU machine):
  PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false python3 bench/estimator_step.py --out $OUT
  python3 bench/estimator_step.py --smoke          (CPU, tiny shapes: checks the script)
Writes DIR/estimator_step.md and DIR/estimator_step.json (DIR = --out, default $OUT or bench/out).
"""

import argparse
import functools
import json
import math
import os
import sys
import time

import benchutil  # bench/benchutil.py: the script directory is first on sys.path

HERE = os.path.dirname(os.path.abspath(__file__))


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(HERE, "out"))
    ap.add_argument("--batches", default="1,128,512")
    ap.add_argument("--positions", default="7,15", help="draft positions P per row (block - 1)")
    ap.add_argument("--vocab", type=int, default=248320)
    ap.add_argument("--small-vocab", type=int, default=260)
    ap.add_argument("--steps", type=int, default=200, help="steps per scan (>= refit interval)")
    ap.add_argument("--refit-interval", type=int, default=100)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--unroll", type=int, default=10, help="scan steps per loop iteration")
    ap.add_argument("--rotate-mib", type=float, default=256, help="rotate input sets up to this many MiB")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--budget-s", type=float, default=1e9, help="start no new case after this many seconds")
    ap.add_argument(
        "--observe-impls",
        default="ref,pallas",
        help="observe implementations: ref (jnp, eight kernels), pallas (one launch)",
    )
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    if args.smoke:
        args.batches, args.vocab, args.steps, args.reps, args.refit_interval = "1,8", 3000, 24, 2, 10
        args.rotate_mib = 1
    if args.steps < args.refit_interval:
        ap.error(f"--steps {args.steps} must be >= --refit-interval {args.refit_interval}")
    return args


def main(args):
    benchutil.setup_jax(args.smoke)
    import jax
    import jax.numpy as jnp

    from jaxspec.ops import sampling
    from jaxspec.spec import estimator as est

    os.makedirs(args.out, exist_ok=True)
    t_start = time.time()
    dev = jax.devices()[0]

    def timed(fn, *a, reps=None):
        return benchutil.median_us(fn, *a, reps=reps or args.reps)[0]

    # ---- copy bandwidth, same run
    copies = benchutil.copy_bandwidths(args.out)
    bw_src, bw = benchutil.floor_bandwidth(copies)
    print("copy bandwidth: " + ", ".join(f"{k} {v / 1e12:.3f} TB/s" for k, v in copies.items()), flush=True)

    steps = args.steps
    results = []

    def scan_us(step_fn, carry, xs):
        """Per-step µs of lax.scan(step_fn) over `steps` steps, xs rotated by step index."""
        n_sets = jax.tree_util.tree_leaves(xs)[0].shape[0]

        @jax.jit
        def run(carry, xs):
            def body(c, i):
                return step_fn(c, jax.tree_util.tree_map(lambda x: x[i % n_sets], xs)), None

            return jax.lax.scan(body, carry, jnp.arange(steps), unroll=args.unroll)[0]

        return timed(run, carry, xs) / steps

    def sets_for(nbytes):
        """Input sets to rotate through: >= 2 so no step's input is loop-invariant (XLA would hoist
        the features out of the scan), up to --rotate-mib in all."""
        return int(max(2, min(steps, math.ceil(args.rotate_mib * 2**20 / nbytes))))

    def est_state(p, interval, b):
        return est.init(p, refit_interval=interval, num_slots=b)

    def labels(key, n_sets, b, p):
        kv, ka = jax.random.split(key)
        verified = jax.random.randint(kv, (n_sets, b), 0, p + 1)
        accepted = jnp.minimum(jax.random.randint(ka, (n_sets, b), 0, p + 1), verified)
        return verified.astype(jnp.int32), accepted.astype(jnp.int32)

    def dump():
        summary = dict(
            device=dev.device_kind,
            backend=jax.default_backend(),
            jax=jax.__version__,
            copy_TB_per_s={k: round(v / 1e12, 3) for k, v in copies.items()},
            floor_bandwidth=bw_src,
            vocab=args.vocab,
            small_vocab=args.small_vocab,
            steps=steps,
            refit_interval=args.refit_interval,
            unroll=args.unroll,
            smoke=args.smoke,
            results=results,
        )
        with open(os.path.join(args.out, "estimator_step.json"), "w") as f:
            json.dump(summary, f, indent=1)
        fmt = lambda v, d=1: "–" if v is None else f"{v:.{d}f}"
        lines = [
            f"# estimator per-step work, {dev.device_kind} ({jax.default_backend()}), jax {jax.__version__}"
            + (" — SMOKE (CPU, tiny shapes: no meaning as timings)" if args.smoke else ""),
            "",
            f"lax.scan of {steps} steps unrolled {args.unroll} per iteration, state carried, "
            f"median of {args.reps} synchronised calls / steps. "
            f"plain: no refit; amortised: refit every {args.refit_interval} steps. floor = logits bytes "
            f"read once / {bw_src} {bw / 1e12:.3f} TB/s (same run). Goal: predict+observe <= 10 µs/step.",
            "",
            "| batch | P | case | vocab | logits MB/step | µs/step plain | µs/step amortised | floor µs "
            "| floor/plain | sets |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in results:
            mb = r["batch"] * r["positions"] * r["vocab"] * 2 / 1e6 if r["vocab"] else None
            lines.append(
                f"| {r['batch']} | {r['positions']} | {r['case']} | {r['vocab'] or '–'} | {fmt(mb, 2)} "
                f"| {fmt(r['us_plain'], 2)} | {fmt(r['us_amortised'], 2)} | {fmt(r['floor_us'], 2)} "
                f"| {fmt(r['floor_us'] / r['us_plain'] if r['floor_us'] else None, 2)} | {r['sets']} |"
            )
        with open(os.path.join(args.out, "estimator_step.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
        return lines

    def add(**r):
        r.setdefault("us_amortised", None)
        r.setdefault("floor_us", None)
        r.setdefault("vocab", None)
        results.append(r)
        print(dump()[-1], flush=True)

    def over_budget():
        return time.time() - t_start > args.budget_s

    temp = args.temperature
    for b in [int(x) for x in args.batches.split(",")]:
        slots = jnp.arange(1, b + 1, dtype=jnp.int32)  # every row its own slot's history
        for p in [int(x) for x in args.positions.split(",")]:
            if over_budget():
                break
            key = jax.random.key(b * 100 + p)
            # loop overhead
            add(
                batch=b,
                positions=p,
                case="loop",
                sets=1,
                us_plain=scan_us(lambda c, x: c + x, jnp.zeros((), jnp.float32), jnp.ones((1,), jnp.float32)),
            )

            # predict + observe from features (the estimator math alone)
            n_sets = sets_for(b * p * 4)
            x = jax.random.normal(key, (n_sets, b, p), jnp.float32) * 3.0
            verified, accepted = labels(key, n_sets, b, p)

            for obs_impl in args.observe_impls.split(","):

                def po(state, xs, obs_impl=obs_impl, slots=slots):
                    xk, ver, acc = xs
                    _, s = est.predict(state, xk, slots)
                    state = est.observe(state, xk, ver, acc, slots, impl=obs_impl)
                    # the survival is an output of the real step: keep it live
                    return state.replace(h_xx=state.h_xx + 0.0 * s[0, -1])

                times = {
                    interval: scan_us(po, est_state(p, interval, b), (x, verified, accepted))
                    for interval in (10**9, args.refit_interval, 1)
                }
                tag = "" if obs_impl == "ref" else f" (observe {obs_impl})"
                add(
                    batch=b,
                    positions=p,
                    case=f"predict+observe{tag}",
                    sets=n_sets,
                    us_plain=times[10**9],
                    us_amortised=times[args.refit_interval],
                )
                add(
                    batch=b,
                    positions=p,
                    case=f"predict+observe+refit (every step){tag}",
                    sets=n_sets,
                    us_plain=times[1],
                )

            # features over the vocabulary, alone and with the estimator
            for vocab in (args.vocab, args.small_vocab):
                if over_budget():
                    break
                nbytes = b * p * vocab * 2
                n_sets = sets_for(nbytes)
                logits = (jax.random.normal(key, (n_sets, b, p, vocab), jnp.float32) * 3.0).astype(jnp.bfloat16)
                verified, accepted = labels(key, n_sets, b, p)
                temperature = jnp.full((b,), temp, jnp.float32)
                floor_us = nbytes / bw * 1e6

                def feat(acc, xs):
                    return acc + jnp.sum(est.features(xs, temperature))

                def full(state, xs, slots=slots):
                    lg, ver, acc = xs
                    xk = est.features(lg, temperature)
                    _, s = est.predict(state, xk, slots)
                    state = est.observe(state, xk, ver, acc, slots)
                    return state.replace(h_xx=state.h_xx + 0.0 * s[0, -1])

                if vocab == args.vocab:
                    add(
                        batch=b,
                        positions=p,
                        case="features",
                        vocab=vocab,
                        sets=n_sets,
                        floor_us=floor_us,
                        us_plain=scan_us(feat, jnp.zeros((), jnp.float32), logits),
                    )
                times = {
                    interval: scan_us(full, est_state(p, interval, b), (logits, verified, accepted))
                    for interval in (10**9, args.refit_interval)
                }
                add(
                    batch=b,
                    positions=p,
                    case="features+predict+observe",
                    vocab=vocab,
                    sets=n_sets,
                    floor_us=floor_us,
                    us_plain=times[10**9],
                    us_amortised=times[args.refit_interval],
                )
                if vocab == args.vocab:

                    def draft_tokens(acc, lg):
                        return acc + jnp.sum(jnp.argmax(lg, axis=-1))

                    def draft_tokens_full(state, xs):
                        state = full(state, xs)
                        return state.replace(h_xx=state.h_xx + 0.0 * jnp.sum(jnp.argmax(xs[0], axis=-1)))

                    add(
                        batch=b,
                        positions=p,
                        case="draft argmax",
                        vocab=vocab,
                        sets=n_sets,
                        floor_us=floor_us,
                        us_plain=scan_us(draft_tokens, jnp.zeros((), jnp.int32), logits),
                    )
                    add(
                        batch=b,
                        positions=p,
                        case="draft argmax+features+predict+observe",
                        vocab=vocab,
                        sets=n_sets,
                        floor_us=floor_us,
                        us_plain=scan_us(draft_tokens_full, est_state(p, 10**9, b), (logits, verified, accepted)),
                    )

                    def engine_draft(state, xs, sampled, with_estimator=True):
                        """The engine's draft side: one DraftDistribution for the drafts (argmax, or
                        a draw at T > 0), q at the drafts (what accept reads) and, with the
                        estimator, the feature, predict and observe."""
                        lg, ver, acc = xs
                        t = temperature if sampled else jnp.zeros_like(temperature)
                        dist = sampling.draft_distribution(lg, t)
                        drafts = sampling.sample_draft(draw_keys, dist) if sampled else dist.argmax
                        live = jnp.sum(drafts) + (jnp.sum(dist.prob_at(drafts[..., None])) if sampled else 0.0)
                        if with_estimator:
                            xk = est.distribution_features(dist)
                            _, s = est.predict(state, xk, slots)
                            state = est.observe(state, xk, ver, acc, slots)
                            live = live + s[0, -1]
                        return state.replace(h_xx=state.h_xx + 0.0 * live)

                    def materialised_q(state, xs):
                        """The sampled draft side before 2026-12-02: q = softmax over the vocabulary
                        (float32, written), a draw from log q, the feature in its own two passes."""
                        lg, ver, acc = xs
                        q = jax.nn.softmax(lg.astype(jnp.float32) / temp, axis=-1)
                        drafts = jax.vmap(lambda k, qq: jax.random.categorical(k, jnp.log(qq), axis=-1))(draw_keys, q)
                        xk = est.features(lg, temperature)
                        _, s = est.predict(state, xk, slots)
                        state = est.observe(state, xk, ver, acc, slots)
                        live = jnp.sum(jnp.take_along_axis(q, drafts[..., None], axis=-1)) + s[0, -1]
                        return state.replace(h_xx=state.h_xx + 0.0 * live)

                    draw_keys = jax.random.split(jax.random.key(b), b)
                    for case, fn in (
                        (
                            "engine draft, greedy: argmax",
                            functools.partial(engine_draft, sampled=False, with_estimator=False),
                        ),
                        (
                            "engine draft, greedy: argmax+features+predict+observe",
                            functools.partial(engine_draft, sampled=False),
                        ),
                        (
                            f"engine draft, T={temp}: draw+q",
                            functools.partial(engine_draft, sampled=True, with_estimator=False),
                        ),
                        (
                            f"engine draft, T={temp}: draw+q+features+predict+observe",
                            functools.partial(engine_draft, sampled=True),
                        ),
                        (f"materialised q, T={temp}: draw+q+features+predict+observe", materialised_q),
                    ):
                        add(
                            batch=b,
                            positions=p,
                            case=case,
                            vocab=vocab,
                            sets=n_sets,
                            floor_us=floor_us,
                            us_plain=scan_us(fn, est_state(p, 10**9, b), (logits, verified, accepted)),
                        )
                del logits

    lines = dump()
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(parse()))
