"""`jaxspec` command line: generate, profile, estimator, train (target | draft), info.

Invalid arguments exit with status 2 and a message naming the argument (argparse's convention).
"""
import argparse
import json
import os
import sys

# The tiny byte-level models trained by `jaxspec train` and shipped in the repository (models/README.md).
MODELS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models")
DEFAULT_TARGET = os.path.join(MODELS_DIR, "tiny-target")
DEFAULT_DRAFT = os.path.join(MODELS_DIR, "tiny-dflash")


def _bounded(name, cast, kind, rule, ok):
    """argparse type: `cast` of the text, kept only where ok(value); messages name the argument."""
    def parse(text):
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be {kind}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{name} must be {rule}, got {value}")
        return value
    return parse


def positive_int(name):
    return _bounded(name, int, "an int", ">= 1", lambda v: v >= 1)


def _non_negative_int(name):
    return _bounded(name, int, "an int", ">= 0", lambda v: v >= 0)


def _positive_float(name):
    return _bounded(name, float, "a number", "> 0", lambda v: v > 0)


def _non_negative_float(name):
    return _bounded(name, float, "a number", ">= 0", lambda v: v >= 0)


def _parser():
    from jaxspec.config import VERIFY_MODES

    parser = argparse.ArgumentParser(prog="jaxspec", description="Speculative decoding for GDN-hybrid LLMs in JAX")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="decode prompts with a target and a draft")
    gen.add_argument("--target", default=DEFAULT_TARGET,
                     help="target checkpoint directory (HF layout; default: the shipped models/tiny-target)")
    gen.add_argument("--draft", help="DFlash draft directory (needed unless --verify-mode none; default: "
                     "models/tiny-dflash when the target is the shipped one)")
    gen.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for several)")
    gen.add_argument("--max-new-tokens", type=positive_int("--max-new-tokens"), default=64)
    gen.add_argument("--verify-mode", choices=VERIFY_MODES, default="static")
    gen.add_argument("--temperature", type=_non_negative_float("--temperature"), default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--num-slots", type=positive_int("--num-slots"), default=8)
    gen.add_argument("--max-len", type=positive_int("--max-len"), default=1024)
    gen.add_argument("--block-size", type=_bounded("--block-size", int, "an int", "in 2..64", lambda v: 2 <= v <= 64),
                     help="verify window (anchor + block_size - 1 drafts; default: the draft's block)")
    gen.add_argument("--warmup", action="store_true", help="decode the prompts once first, so tokens/s "
                     "leaves compilation out")
    gen.add_argument("--compare-none", action="store_true", help="also decode with the target alone "
                     "(verify mode none) and print both speeds")
    gen.add_argument("--cost-table", help="profiled cost table JSON (from `jaxspec profile`) for "
                     "cap-accept / compact")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt")
    prof = sub.add_parser("profile", help="time the verify step per (batch, tier); write the cost table")
    prof.add_argument("--target", required=True)
    prof.add_argument("--draft", required=True)
    prof.add_argument("--batches", default="1", help="comma-separated active batch sizes")
    prof.add_argument("--num-slots", type=positive_int("--num-slots"), default=8)
    prof.add_argument("--max-len", type=positive_int("--max-len"), default=256)
    prof.add_argument("--repeats", type=positive_int("--repeats"), default=10)
    prof.add_argument("--out", required=True, help="cost table JSON to write")
    from jaxspec.spec import calibration

    calibration.add_arguments(sub.add_parser("estimator", help="AUC and calibration of the acceptance "
                                             "estimator on a recorded trace"))
    _train_parser(sub.add_parser("train", help="train the tiny byte-level target or a DFlash draft on the "
                                 "Python standard library's source (jaxspec.train)"))
    info = sub.add_parser("info", help="print a checkpoint's config")
    info.add_argument("path")
    return parser


def _train_parser(train):
    """`jaxspec train target` and `jaxspec train draft`: flags shared by both, then each one's model shape."""
    what = train.add_subparsers(dest="what", required=True)
    target = what.add_parser("target", help="train a byte-level GDN-hybrid target from scratch")
    draft = what.add_parser("draft", help="train a DFlash draft against a frozen target")
    for p, steps in ((target, 2000), (draft, 2000)):
        p.add_argument("--out", required=True, help="checkpoint directory to write (HF layout + metrics.json "
                       "+ loss_curve.png); rewritten at every evaluation")
        p.add_argument("--steps", type=positive_int("--steps"), default=steps)
        p.add_argument("--batch", type=positive_int("--batch"), default=32, help="sequences per step")
        p.add_argument("--seq-len", type=positive_int("--seq-len"), default=512, help="tokens (bytes) per sequence")
        p.add_argument("--lr", type=_positive_float("--lr"), default=2e-3, help="peak learning rate (AdamW)")
        p.add_argument("--warmup", type=_non_negative_int("--warmup"), default=100, help="linear warmup steps")
        p.add_argument("--weight-decay", type=_non_negative_float("--weight-decay"), default=0.1)
        p.add_argument("--grad-clip", type=_positive_float("--grad-clip"), default=1.0)
        p.add_argument("--eval-every", type=_non_negative_int("--eval-every"), default=200,
                       help="steps between held-out evaluations and checkpoints (0: only at the end)")
        p.add_argument("--eval-batches", type=positive_int("--eval-batches"), default=8)
        p.add_argument("--log-every", type=positive_int("--log-every"), default=10)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                       help="dtype of the saved weights")
        p.add_argument("--compute-dtype", choices=("float32", "bfloat16"), default="float32",
                       help="dtype of the forward pass (master weights stay float32)")
        p.add_argument("--corpus", help="directory whose *.py files are the corpus (default: the running "
                       "Python's standard library)")
        p.add_argument("--time-limit", type=_positive_float("--time-limit"),
                       help="seconds after which training stops early, evaluates and saves")
        p.add_argument("--no-progress", action="store_true", help="no progress bar")
    target.add_argument("--hidden-size", type=positive_int("--hidden-size"), default=256)
    target.add_argument("--intermediate-size", type=positive_int("--intermediate-size"),
                        help="MLP width (default 3 x hidden size)")
    target.add_argument("--layers", type=positive_int("--layers"), default=8)
    target.add_argument("--full-attention-interval", type=positive_int("--full-attention-interval"), default=4,
                        help="layer i is full attention iff (i + 1) %% interval == 0")
    target.add_argument("--head-dim", type=positive_int("--head-dim"), default=64,
                        help="attention and GDN head dim")
    draft.add_argument("--target", required=True, help="the frozen target's checkpoint directory")
    draft.add_argument("--layers", type=positive_int("--layers"), default=2, help="draft decoder layers")
    draft.add_argument("--block-size", type=positive_int("--block-size"), default=8)
    draft.add_argument("--taps", help="comma-separated target layers whose outputs feed the draft "
                       "(default: evenly spaced from 1 to layers - 3)")
    draft.add_argument("--intermediate-size", type=positive_int("--intermediate-size"),
                       help="MLP width (default 3 x hidden size)")
    draft.add_argument("--anchors", type=positive_int("--anchors"), default=16, help="random blocks per sequence")
    draft.add_argument("--gamma", type=_positive_float("--gamma"), default=4.0,
                       help="loss weight of block position k is exp(-(k-1)/gamma)")


def _train(args, parser):

    from jaxspec import train

    if args.corpus is not None:
        if not os.path.isdir(args.corpus):
            parser.error(f"argument --corpus: {args.corpus!r} is not a directory")
        n_train, n_held_out = map(len, train.corpus_files(args.corpus))
        if not n_train or not n_held_out:
            parser.error(f"argument --corpus: {args.corpus!r} has {n_train} training and {n_held_out} held-out "
                         f"*.py files; both splits need some (held out: {', '.join(train.HELD_OUT_MODULES)})")
    try:
        train.check_out_dir(args.out)
    except ValueError as e:
        parser.error(f"argument --out: {e}")
    common = dict(steps=args.steps, batch=args.batch, seq_len=args.seq_len, lr=args.lr, warmup=args.warmup,
                  weight_decay=args.weight_decay, grad_clip=args.grad_clip, out_dir=args.out,
                  eval_every=args.eval_every, eval_batches=args.eval_batches, log_every=args.log_every,
                  seed=args.seed, save_dtype=args.dtype, compute_dtype=args.compute_dtype,
                  corpus_root=args.corpus, progress=not args.no_progress, time_limit=args.time_limit)
    if args.what == "target":
        if args.head_dim % 8:
            parser.error(f"argument --head-dim: must be a multiple of 8 (rotary on an even quarter), "
                         f"got {args.head_dim}")
        config = train.tiny_target_config(
            hidden_size=args.hidden_size, num_hidden_layers=args.layers, intermediate_size=args.intermediate_size,
            full_attention_interval=args.full_attention_interval, head_dim=args.head_dim,
            max_position_embeddings=max(4096, args.seq_len))
        _, metrics = _run_training(parser, lambda: train.train_target(config, **common))
    else:
        from jaxspec.target import load_target

        if not os.path.isfile(os.path.join(args.target, "config.json")):
            parser.error(f"argument --target: {args.target!r} is not a checkpoint directory (no config.json)")
        if os.path.abspath(args.target) == os.path.abspath(args.out):
            parser.error("argument --out: must differ from --target")
        target = load_target(args.target)
        n_layers = target.config.num_hidden_layers
        taps = None
        if args.taps is not None:
            try:
                taps = tuple(int(t) for t in args.taps.split(","))
            except ValueError:
                parser.error(f"argument --taps: {args.taps!r} is not a comma-separated list of ints")
            if not taps or any(not 0 <= t < n_layers for t in taps):
                parser.error(f"argument --taps: {args.taps!r}: every layer must be in [0, {n_layers})")
        if args.block_size < 2 or args.block_size > 64:
            parser.error(f"argument --block-size: must be in 2..64, got {args.block_size}")
        if args.seq_len - args.block_size < args.anchors:
            parser.error(f"argument --anchors: {args.anchors} distinct anchors do not fit in --seq-len "
                         f"{args.seq_len} with --block-size {args.block_size} (at most seq_len - block_size)")
        try:
            config = train.tiny_draft_config(target.config, num_hidden_layers=args.layers,
                                             block_size=args.block_size, target_layer_ids=taps,
                                             intermediate_size=args.intermediate_size)
        except ValueError as e:
            parser.error(str(e))
        _, metrics = _run_training(parser, lambda: train.train_draft(
            target, config, anchors_per_seq=args.anchors, gamma=args.gamma,
            target_path=os.path.abspath(args.target), **common))
    last = metrics["eval"][-1]
    rate = metrics["tokens_per_s"]
    print(json.dumps({"out": args.out, "steps": metrics["last_step"], "tokens_per_s": rate and round(rate, 1),
                      "held_out": {k: v for k, v in last.items() if k != "step"}}))
    return 0


def _run_training(parser, fn):
    try:
        return fn()
    except ValueError as e:   # what the flags' own checks cannot see (e.g. a corpus too small for --seq-len)
        parser.error(str(e))


def _generate(args, parser):
    from jaxspec.config import SpecConfig
    from jaxspec.dflash import load_draft
    from jaxspec.engine import Engine
    from jaxspec.target import load_target
    from jaxspec.tokenizer import load_tokenizer

    if args.draft is None and os.path.abspath(args.target) == DEFAULT_TARGET:
        args.draft = DEFAULT_DRAFT
    for flag, path in (("--target", args.target), ("--draft", args.draft)):
        if path is not None and not os.path.isfile(os.path.join(path, "config.json")):
            parser.error(f"argument {flag}: {path!r} is not a checkpoint directory (no config.json)")
    if args.verify_mode != "none" and args.draft is None:
        parser.error(f"argument --draft: required with --verify-mode {args.verify_mode}")
    if args.cost_table is not None and not os.path.isfile(args.cost_table):
        parser.error(f"argument --cost-table: {args.cost_table!r} is not a file")
    try:
        spec = SpecConfig(verify_mode=args.verify_mode, num_slots=args.num_slots, max_len=args.max_len,
                          block_size=args.block_size)
    except ValueError as e:
        parser.error(str(e))
    target = load_target(args.target)
    draft = load_draft(args.draft, target) if args.draft and args.verify_mode != "none" else None
    tokenizer = load_tokenizer(args.target)

    def decode(engine_spec, engine_draft, cost_table):
        try:
            engine = Engine(target, engine_draft, engine_spec, tokenizer=tokenizer, cost_table=cost_table)
            run = lambda: engine.generate(args.prompt, max_new_tokens=args.max_new_tokens,
                                          temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                          seed=args.seed)
            if args.warmup:
                run()
            return run()
        except (ValueError, NotImplementedError) as e:
            parser.error(str(e))

    results = decode(spec, draft, args.cost_table)
    baseline = None
    if args.compare_none and args.verify_mode != "none":
        baseline = decode(SpecConfig(verify_mode="none", num_slots=args.num_slots, max_len=args.max_len), None, None)
    refused = 0
    for i, r in enumerate(results):
        refused += r.error is not None
        base = baseline[i] if baseline is not None and r.error is None else None
        if args.json:
            stats = {k: r.stats[k] for k in ("accept_length", "steps", "tokens_per_s")} if r.error is None else {}
            if base is not None:
                stats["tokens_per_s_none"] = base.stats["tokens_per_s"]
                stats["same_tokens_as_none"] = base.tokens == r.tokens
            print(json.dumps({"tokens": r.tokens, "text": r.text, "stats": stats, "error": r.error}))
        elif r.error is not None:
            print(f"refused: {r.error}", file=sys.stderr)
        else:
            print(r.text)
            print(f"[{args.verify_mode}: {len(r.tokens)} tokens, {r.stats['steps']} steps, accept length "
                  f"{r.stats['accept_length']:.2f}, {r.stats['tokens_per_s']:.1f} tokens/s]", file=sys.stderr)
            if base is not None:
                same = "the same tokens" if base.tokens == r.tokens else "different tokens"
                print(f"[none: {len(base.tokens)} tokens, {base.stats['steps']} steps, "
                      f"{base.stats['tokens_per_s']:.1f} tokens/s ({same}); speculative speed-up "
                      f"{r.stats['tokens_per_s'] / base.stats['tokens_per_s']:.2f}x]", file=sys.stderr)
    return 1 if refused else 0


def _profile(args, parser):
    from jaxspec.config import SpecConfig
    from jaxspec.dflash import load_draft
    from jaxspec.engine import Engine
    from jaxspec.target import load_target

    for flag, path in (("--target", args.target), ("--draft", args.draft)):
        if not os.path.isfile(os.path.join(path, "config.json")):
            parser.error(f"argument {flag}: {path!r} is not a checkpoint directory (no config.json)")
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        parser.error(f"argument --batches: {args.batches!r} is not a comma-separated list of ints")
    target = load_target(args.target)
    try:
        spec = SpecConfig(verify_mode="compact", num_slots=args.num_slots, max_len=args.max_len)
        engine = Engine(target, load_draft(args.draft, target), spec)
        table = engine.profile(batches, repeats=args.repeats)
    except ValueError as e:
        parser.error(str(e))
    table.metadata["model"] = os.path.basename(os.path.normpath(args.target))
    table.save(args.out)
    for (batch, tokens), seconds in sorted(table.entries.items()):
        print(f"batch {batch:4d}  tokens {tokens:5d}  {seconds * 1e3:9.3f} ms")
    return 0


def main(argv=None):
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "generate":
        return _generate(args, parser)
    if args.command == "profile":
        return _profile(args, parser)
    if args.command == "train":
        return _train(args, parser)
    if args.command == "estimator":
        from jaxspec.spec import calibration

        return calibration.run(args, parser)
    from jaxspec.weights import load_config

    print(json.dumps(load_config(args.path).to_hf(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
