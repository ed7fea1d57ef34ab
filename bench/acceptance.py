"""Acceptance length of a target + DFlash draft pair on held-out text, per verify block and temperature.

Prompts are windows of the held-out corpus (jaxspec.train: the fixed held-out stdlib modules of
the interpreter that runs this, or --corpus DIR), sampled with a fixed seed. Each (block,
temperature) case decodes every prompt in static verify mode with SpecConfig.block_size = block
(the draft proposes its own block and the first block - 1 drafts are verified) and reports the
acceptance length: tokens emitted per request per step (accepted drafts + 1), summed over
requests, and the share of accepted drafts that sit inside an exact repeat of their context
(`repeat_share`: the REPEAT_NGRAM tokens ending at the draft occurred earlier in prompt + output),
so copying is told apart from prediction. Runs on the CPU or the GPU. Usage:

  python3 bench/acceptance.py --target models/tiny-target --draft models/tiny-dflash --out bench/out
Writes DIR/acceptance.json and DIR/acceptance.md.
"""

import argparse
import json
import os
import statistics
import sys
import time


def _ints(text):
    return [int(x) for x in text.split(",")]


def _floats(text):
    return [float(x) for x in text.split(",")]


REPEAT_NGRAM = 16  # bytes for the shipped byte-level models: a line fragment, not a common word


def repeat_share(prompt, tokens, accepted, n=REPEAT_NGRAM):
    """(accepted drafts inside an exact repeat, accepted drafts) of one request: step i emitted
    accepted[i] drafts then one target token, in order, as `tokens`; a draft at position j of
    prompt + tokens is inside a repeat when the n tokens ending at j also end at some j' < j."""
    seq = [int(t) for t in prompt] + [int(t) for t in tokens]
    seen = {tuple(seq[j - n + 1 : j + 1]) for j in range(n - 1, len(prompt))}
    drafts, pos = set(), len(prompt)
    for count in accepted:
        drafts.update(range(pos, pos + count))
        pos += count + 1
    repeated = total = 0
    for j in range(len(prompt), len(seq)):
        gram = tuple(seq[j - n + 1 : j + 1]) if j >= n - 1 else None
        if j in drafts:
            total += 1
            repeated += gram in seen
        if gram is not None:
            seen.add(gram)
    return repeated, total


def measure(
    target, draft, prompts, *, block, temperature, max_new_tokens, seed=0, trace_path=None, top_k=0, top_p=1.0, seeds=1
):
    """Decode `prompts` in static mode with verify window `block`; returns a dict of the totals.
    trace_path: also save the timed run's estimator trace there (`jaxspec estimator TRACE
    [--cost-table costs.json]` reads it). top_k / top_p: the requests' sampling (T > 0). seeds: the
    timed run is repeated with sampling seeds seed .. seed + seeds - 1 (the totals pool them;
    accept_length_seeds lists each run's accept length: a sampled run's spread)."""
    from jaxspec.config import SpecConfig
    from jaxspec.engine import Engine
    from jaxspec.spec.calibration import TraceRecorder

    max_len = max(map(len, prompts)) + max_new_tokens + block + 1
    spec = SpecConfig(verify_mode="static", block_size=block, num_slots=len(prompts), max_len=max_len)
    engine = Engine(target, draft, spec, record_trace=trace_path is not None)
    sampling = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p)
    engine.generate(prompts, seed=seed, **sampling)  # compiles
    if trace_path is not None:
        engine.recorder = TraceRecorder()  # the timed runs' steps only
    results, per_seed, seconds = [], [], 0.0
    for run_seed in range(seed, seed + seeds):
        start = time.perf_counter()
        run = engine.generate(prompts, seed=run_seed, **sampling)
        seconds += time.perf_counter() - start
        bad = [r.error for r in run if r.error is not None]
        if bad:
            raise RuntimeError(f"a request was refused: {bad[0]}")
        per_seed.append(sum(len(r.tokens) for r in run) / sum(r.stats["steps"] for r in run))
        results += run
    if trace_path is not None:
        engine.recorder.save(trace_path)
    tokens = sum(len(r.tokens) for r in results)
    steps = sum(r.stats["steps"] for r in results)
    per_request = [r.stats["accept_length"] for r in results]
    repeated, accepted = map(
        sum, zip(*(repeat_share(p, r.tokens, r.stats["accepted"]) for p, r in zip(prompts * seeds, results)))
    )
    return {
        "block": block,
        "temperature": temperature,
        "top_k": top_k,
        "top_p": top_p,
        "accept_length_seeds": per_seed,
        "requests": len(results),
        "tokens": tokens,
        "steps": steps,
        "accept_length": tokens / steps,
        "accept_length_min": min(per_request),
        "accept_length_max": max(per_request),
        "tokens_per_s": tokens / seconds,
        "accepted_drafts": accepted,
        "accepted_in_repeats": repeated / max(accepted, 1),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--blocks", type=_ints, default=[4, 8, 16])
    ap.add_argument("--temperatures", type=_floats, default=[0.0, 1.0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--top-k", type=int, default=0, help="the requests' top-k (0 = off; sampled rows)")
    ap.add_argument("--top-p", type=float, default=1.0, help="the requests' top-p (1 = off; sampled rows)")
    ap.add_argument(
        "--sample-seeds", type=int, default=1, help="timed runs with seeds seed.. at T > 0 (the spread of sampling)"
    )
    ap.add_argument("--corpus", help="directory whose *.py files are the corpus (default: the stdlib)")
    ap.add_argument("--traces", action="store_true", help="save each case's trace as DIR/trace_b<block>_T<T>.npz")
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "out"))
    args = ap.parse_args(argv)

    import jax

    from jaxspec.bench.prompts import held_out_prompts
    from jaxspec.dflash import load_draft
    from jaxspec.target import load_target

    target = load_target(args.target)
    draft = load_draft(args.draft, target)
    too_big = [b for b in args.blocks if b > draft.config.block_size]
    if too_big:
        ap.error(f"argument --blocks: {too_big} exceed the draft's block size {draft.config.block_size}")
    prompts, _ = held_out_prompts(args.prompts, args.prompt_len, args.seed, args.corpus)
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for block in args.blocks:
        for temperature in args.temperatures:
            row = measure(
                target,
                draft,
                prompts,
                block=block,
                temperature=temperature,
                max_new_tokens=args.max_new_tokens,
                seed=args.seed,
                trace_path=os.path.join(args.out, f"trace_b{block}_T{temperature:g}.npz") if args.traces else None,
                top_k=args.top_k,
                top_p=args.top_p,
                seeds=args.sample_seeds if temperature > 0 else 1,
            )
            rows.append(row)
            print(json.dumps(row), flush=True)
    os.makedirs(args.out, exist_ok=True)
    meta = {
        "target": args.target,
        "draft": args.draft,
        "prompts": args.prompts,
        "prompt_len": args.prompt_len,
        "max_new_tokens": args.max_new_tokens,
        "seed": args.seed,
        "device": str(jax.devices()[0]),
        "command": " ".join(["python3", "bench/acceptance.py"] + (argv if argv is not None else sys.argv[1:])),
    }
    with open(os.path.join(args.out, "acceptance.json"), "w") as f:
        json.dump({**meta, "rows": rows}, f, indent=1)
    lines = [
        f"{args.prompts} held-out prompts of {args.prompt_len} bytes, {args.max_new_tokens} new tokens each, "
        f"static verify mode ({meta['device']}); sampled rows: top-k {args.top_k}, top-p {args.top_p:g}, "
        f"{args.sample_seeds} seed(s) (sd = the spread of the runs' accept lengths).",
        "",
        f"| block | T | acceptance length | sd over seeds | min..max per request | accepted drafts in exact "
        f"{REPEAT_NGRAM}-token repeats | tokens/s |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['block']} | {r['temperature']:g} | {r['accept_length']:.3f} | "
        f"{statistics.stdev(r['accept_length_seeds']) if len(r['accept_length_seeds']) > 1 else 0:.3f} | "
        f"{r['accept_length_min']:.2f}..{r['accept_length_max']:.2f} | {100 * r['accepted_in_repeats']:.1f}% | "
        f"{r['tokens_per_s']:.0f} |"
        for r in rows
    ]
    with open(os.path.join(args.out, "acceptance.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
