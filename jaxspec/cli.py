"""`jaxspec` command line: generate, profile, estimator, info.

Invalid arguments exit with status 2 and a message naming the argument (argparse's convention).
"""
import argparse
import json
import sys


def positive_int(name):
    """argparse type: an int >= 1; the message names the argument."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an int, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{name} must be >= 1, got {value}")
        return value
    return parse


def _non_negative_float(name):
    def parse(text):
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {text!r}") from None
        if not value >= 0:
            raise argparse.ArgumentTypeError(f"{name} must be >= 0, got {value}")
        return value
    return parse


def _parser():
    from jaxspec.config import VERIFY_MODES

    parser = argparse.ArgumentParser(prog="jaxspec", description="Speculative decoding for GDN-hybrid LLMs in JAX")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="decode prompts with a target and a draft")
    gen.add_argument("--target", required=True, help="target checkpoint directory (HF layout)")
    gen.add_argument("--draft", help="DFlash draft directory (needed unless --verify-mode none)")
    gen.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for several)")
    gen.add_argument("--max-new-tokens", type=positive_int("--max-new-tokens"), default=64)
    gen.add_argument("--verify-mode", choices=VERIFY_MODES, default="static")
    gen.add_argument("--temperature", type=_non_negative_float("--temperature"), default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--num-slots", type=positive_int("--num-slots"), default=8)
    gen.add_argument("--max-len", type=positive_int("--max-len"), default=1024)
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
    info = sub.add_parser("info", help="print a checkpoint's config")
    info.add_argument("path")
    return parser


def _generate(args, parser):
    import os

    from jaxspec.config import SpecConfig
    from jaxspec.dflash import load_draft
    from jaxspec.engine import Engine
    from jaxspec.target import load_target
    from jaxspec.tokenizer import load_tokenizer

    for flag, path in (("--target", args.target), ("--draft", args.draft)):
        if path is not None and not os.path.isfile(os.path.join(path, "config.json")):
            parser.error(f"argument {flag}: {path!r} is not a checkpoint directory (no config.json)")
    if args.verify_mode != "none" and args.draft is None:
        parser.error(f"argument --draft: required with --verify-mode {args.verify_mode}")
    if args.cost_table is not None and not os.path.isfile(args.cost_table):
        parser.error(f"argument --cost-table: {args.cost_table!r} is not a file")
    try:
        spec = SpecConfig(verify_mode=args.verify_mode, num_slots=args.num_slots, max_len=args.max_len)
    except ValueError as e:
        parser.error(str(e))
    target = load_target(args.target)
    draft = load_draft(args.draft, target) if args.draft and args.verify_mode != "none" else None
    tokenizer = load_tokenizer(args.target)
    try:
        engine = Engine(target, draft, spec, tokenizer=tokenizer, cost_table=args.cost_table)
        results = engine.generate(args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                  top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    except (ValueError, NotImplementedError) as e:
        parser.error(str(e))
    refused = 0
    for r in results:
        refused += r.error is not None
        if args.json:
            stats = {k: r.stats[k] for k in ("accept_length", "steps", "tokens_per_s")} if r.error is None else {}
            print(json.dumps({"tokens": r.tokens, "text": r.text, "stats": stats, "error": r.error}))
        elif r.error is not None:
            print(f"refused: {r.error}", file=sys.stderr)
        else:
            print(r.text)
            print(f"[{len(r.tokens)} tokens, {r.stats['steps']} steps, accept length "
                  f"{r.stats['accept_length']:.2f}, {r.stats['tokens_per_s']:.1f} tokens/s]", file=sys.stderr)
    return 1 if refused else 0


def _profile(args, parser):
    import os

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
    if args.command == "estimator":
        from jaxspec.spec import calibration

        return calibration.run(args, parser)
    from jaxspec.weights import load_config

    print(json.dumps(load_config(args.path).to_hf(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
