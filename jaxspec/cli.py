"""`jaxspec` command line: generate, profile, bench, estimator, train (target | draft), info.

Every failure a user can cause (arguments, paths, checkpoints, configs, cost tables, output
paths) exits with status 2 and one line on stderr, `jaxspec: error: argument X: ...`, naming the
argument and the file; `--debug` shows the traceback instead. Output paths are checked before any
long work starts. Any other exception is an internal error: one line, status 1 (`--debug` shows it).
"""

import argparse
import contextlib
import json
import os
import statistics
import sys

from jaxspec.argtypes import (
    bounded,
    non_negative_float,
    non_negative_int,
    output_dir_problem,
    output_file_problem,
    positive_float,
    positive_int,
)
from jaxspec.config import DEFAULT_DRAFT, DEFAULT_TARGET, PLANNED_MODES

# What loading or writing a user's file raises (the loaders' errors name the file and the tensor).
USER_ERRORS = (OSError, ValueError, KeyError, NotImplementedError)


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line, `prog: error: message`, exit status 2 (`-h` shows the
    usage); `blame` reports a failure under an argument the same way."""

    debug = False

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {_one_line(message)}\n")

    @contextlib.contextmanager
    def blame(self, argument, errors=USER_ERRORS):
        """Report `errors` raised inside as `argument X: <message>` (status 2), or re-raise them
        when --debug was given."""
        try:
            yield
        except errors as e:
            if self.debug:
                raise
            self.error(f"argument {argument}: {_one_line(e.args[0] if isinstance(e, KeyError) and e.args else e)}")


def _one_line(message) -> str:
    """The message with its line breaks and runs of spaces as single spaces."""
    return " ".join(str(message).split())


def _parser():
    from jaxspec.config import VERIFY_MODES

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="show the traceback of an error")
    parser = _Parser(prog="jaxspec", description="Speculative decoding for GDN-hybrid LLMs in JAX")
    sub = parser.add_subparsers(dest="command", required=True)
    add = lambda name, **kw: sub.add_parser(name, parents=[common], **kw)
    gen = add("generate", help="decode prompts with a target and a draft")
    gen.add_argument(
        "--target",
        default=DEFAULT_TARGET,
        help="target checkpoint directory (HF layout; default: the shipped models/tiny-target)",
    )
    gen.add_argument(
        "--draft",
        help="DFlash draft directory (needed unless --verify-mode none; default: "
        "models/tiny-dflash when the target is the shipped one)",
    )
    gen.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for several)")
    gen.add_argument("--max-new-tokens", type=positive_int("--max-new-tokens"), default=64)
    gen.add_argument("--verify-mode", choices=VERIFY_MODES, default="static")
    gen.add_argument("--temperature", type=non_negative_float("--temperature"), default=0.0)
    gen.add_argument("--top-k", type=non_negative_int("--top-k"), default=0, help="0: off")
    gen.add_argument(
        "--top-p", type=bounded("--top-p", float, "a number", "in (0, 1]", lambda v: 0 < v <= 1), default=1.0
    )
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--num-slots", type=positive_int("--num-slots"), default=8)
    gen.add_argument("--max-len", type=positive_int("--max-len"), default=1024)
    gen.add_argument(
        "--block-size",
        type=bounded("--block-size", int, "an int", "in 2..64", lambda v: 2 <= v <= 64),
        help="verify window (anchor + block_size - 1 drafts; default: the draft's block)",
    )
    gen.add_argument(
        "--tp",
        type=positive_int("--tp"),
        default=1,
        help="split the target over this many devices (tensor parallelism: SpecConfig.tp)",
    )
    gen.add_argument(
        "--trim-draft",
        action="store_true",
        help="run the draft's forward over the verify window only, not its whole block "
        "(cheaper when --block-size is below the draft's block; the drafts change: SpecConfig.trim_draft)",
    )
    gen.add_argument(
        "--warmup",
        action="store_true",
        help="decode the prompts once first, so tokens/s "
        "leaves compilation out (without it, a speed that includes compilation says so)",
    )
    gen.add_argument(
        "--repeats",
        type=positive_int("--repeats"),
        default=1,
        help="decode the prompts this many times (with --compare-none, alternating with mode none) "
        "and print the median speeds",
    )
    gen.add_argument(
        "--compare-none",
        action="store_true",
        help="also decode with the target alone (verify mode none) and print both speeds",
    )
    gen.add_argument("--cost-table", help="profiled cost table JSON (from `jaxspec profile`) for cap-accept / compact")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt")
    prof = add("profile", help="time the verify step per (batch, tier); write the cost table")
    prof.add_argument("--target", required=True)
    prof.add_argument("--draft", required=True)
    prof.add_argument("--batches", default="1", help="comma-separated active batch sizes")
    prof.add_argument("--num-slots", type=positive_int("--num-slots"), default=8)
    prof.add_argument("--max-len", type=positive_int("--max-len"), default=256)
    prof.add_argument("--repeats", type=positive_int("--repeats"), default=10)
    prof.add_argument(
        "--block-size",
        type=bounded("--block-size", int, "an int", "in 2..64", lambda v: 2 <= v <= 64),
        help="verify window to profile, as `generate --block-size` (default: the draft's block)",
    )
    prof.add_argument(
        "--trim-draft", action="store_true", help="profile the trimmed draft forward, as `generate --trim-draft`"
    )
    prof.add_argument("--out", required=True, help="cost table JSON to write")
    prof.add_argument("--no-progress", action="store_true", help="no progress bar")
    from jaxspec.bench import sweep
    from jaxspec.spec import calibration

    sweep.add_arguments(
        add(
            "bench",
            help="decode tokens/s against concurrency for verify modes none, static and "
            "compact (closed-loop client; results.json, results.md, PNGs)",
        )
    )
    calibration.add_arguments(
        add("estimator", help="AUC and calibration of the acceptance estimator on a recorded trace")
    )
    _train_parser(
        sub.add_parser(
            "train",
            help="train the tiny byte-level target or a DFlash draft on the "
            "Python standard library's source (jaxspec.train)",
        ),
        common,
    )
    info = add("info", help="print the config of a target or a draft checkpoint, or a cost table")
    info.add_argument("path", help="checkpoint directory, its config.json, or a cost table JSON")
    return parser


def _train_parser(train, common):
    """`jaxspec train target` and `jaxspec train draft`: flags shared by both, then each one's model shape."""
    what = train.add_subparsers(dest="what", required=True)
    target = what.add_parser("target", parents=[common], help="train a byte-level GDN-hybrid target from scratch")
    draft = what.add_parser("draft", parents=[common], help="train a DFlash draft against a frozen target")
    for p, steps in ((target, 2000), (draft, 2000)):
        p.add_argument(
            "--out",
            required=True,
            help="checkpoint directory to write (HF layout + metrics.json "
            "+ loss_curve.png); rewritten at every evaluation",
        )
        p.add_argument("--steps", type=positive_int("--steps"), default=steps)
        p.add_argument("--batch", type=positive_int("--batch"), default=32, help="sequences per step")
        p.add_argument("--seq-len", type=positive_int("--seq-len"), default=512, help="tokens (bytes) per sequence")
        p.add_argument("--lr", type=positive_float("--lr"), default=2e-3, help="peak learning rate (AdamW)")
        p.add_argument("--warmup", type=non_negative_int("--warmup"), default=100, help="linear warmup steps")
        p.add_argument("--weight-decay", type=non_negative_float("--weight-decay"), default=0.1)
        p.add_argument("--grad-clip", type=positive_float("--grad-clip"), default=1.0)
        p.add_argument(
            "--eval-every",
            type=non_negative_int("--eval-every"),
            default=200,
            help="steps between held-out evaluations and checkpoints (0: only at the end)",
        )
        p.add_argument("--eval-batches", type=positive_int("--eval-batches"), default=8)
        p.add_argument("--log-every", type=positive_int("--log-every"), default=10)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="dtype of the saved weights")
        p.add_argument(
            "--compute-dtype",
            choices=("float32", "bfloat16"),
            default="float32",
            help="dtype of the forward pass (master weights stay float32)",
        )
        p.add_argument(
            "--corpus",
            help="directory whose *.py files are the corpus (default: the running Python's standard library)",
        )
        p.add_argument(
            "--time-limit",
            type=positive_float("--time-limit"),
            help="seconds after which training stops early, evaluates and saves",
        )
        p.add_argument("--no-progress", action="store_true", help="no progress bar")
    target.add_argument("--hidden-size", type=positive_int("--hidden-size"), default=256)
    target.add_argument(
        "--intermediate-size", type=positive_int("--intermediate-size"), help="MLP width (default 3 x hidden size)"
    )
    target.add_argument("--layers", type=positive_int("--layers"), default=8)
    target.add_argument(
        "--full-attention-interval",
        type=positive_int("--full-attention-interval"),
        default=4,
        help="layer i is full attention iff (i + 1) %% interval == 0",
    )
    target.add_argument("--head-dim", type=positive_int("--head-dim"), default=64, help="attention and GDN head dim")
    draft.add_argument("--target", required=True, help="the frozen target's checkpoint directory")
    draft.add_argument(
        "--init",
        help="a draft checkpoint directory to start from (continue or fine-tune: its config is the draft's, "
        "so --layers, --block-size, --taps and --intermediate-size are not given with it)",
    )
    draft.add_argument("--layers", type=positive_int("--layers"), help="draft decoder layers (default 2)")
    draft.add_argument("--block-size", type=positive_int("--block-size"), help="tokens a block (default 8)")
    draft.add_argument(
        "--taps",
        help="comma-separated target layers whose outputs feed the draft (default: evenly spaced from 1 to layers - 3)",
    )
    draft.add_argument(
        "--intermediate-size", type=positive_int("--intermediate-size"), help="MLP width (default 3 x hidden size)"
    )
    draft.add_argument("--anchors", type=positive_int("--anchors"), default=16, help="random blocks per sequence")
    draft.add_argument(
        "--gamma",
        type=positive_float("--gamma"),
        default=4.0,
        help="loss weight of block position k is exp(-(k-1)/gamma)",
    )
    draft.add_argument(
        "--labels",
        choices=("data", "target", "mix"),
        default="data",
        help="what block position k learns: the corpus token (data), the frozen target's distribution "
        "of that token given the corpus prefix (target: distillation), or the mean of the two losses (mix)",
    )


def _train(args, parser):

    from jaxspec import train

    if args.corpus is not None:
        if not os.path.isdir(args.corpus):
            parser.error(f"argument --corpus: {args.corpus!r} is not a directory")
        n_train, n_held_out = map(len, train.corpus_files(args.corpus))
        if not n_train or not n_held_out:
            parser.error(
                f"argument --corpus: {args.corpus!r} has {n_train} training and {n_held_out} held-out "
                f"*.py files; both splits need some (held out: {', '.join(train.HELD_OUT_MODULES)})"
            )
    problem = output_dir_problem(args.out)
    if problem:
        parser.error(f"argument --out: {problem}")
    with parser.blame("--out"):
        train.check_out_dir(args.out)
    common = dict(
        steps=args.steps,
        batch=args.batch,
        seq_len=args.seq_len,
        lr=args.lr,
        warmup=args.warmup,
        weight_decay=args.weight_decay,
        grad_clip=args.grad_clip,
        out_dir=args.out,
        eval_every=args.eval_every,
        eval_batches=args.eval_batches,
        log_every=args.log_every,
        seed=args.seed,
        save_dtype=args.dtype,
        compute_dtype=args.compute_dtype,
        corpus_root=args.corpus,
        progress=not args.no_progress,
        time_limit=args.time_limit,
    )
    if args.what == "target":
        if args.head_dim % 8:
            parser.error(
                f"argument --head-dim: must be a multiple of 8 (rotary on an even quarter), got {args.head_dim}"
            )
        config = train.tiny_target_config(
            hidden_size=args.hidden_size,
            num_hidden_layers=args.layers,
            intermediate_size=args.intermediate_size,
            full_attention_interval=args.full_attention_interval,
            head_dim=args.head_dim,
            max_position_embeddings=max(4096, args.seq_len),
        )
        _, metrics = _run_training(parser, lambda: train.train_target(config, **common))
    else:
        from jaxspec.target import load_target

        _check_checkpoint_dir(parser, "--target", args.target)
        if os.path.abspath(args.target) == os.path.abspath(args.out):
            parser.error("argument --out: must differ from --target")
        with parser.blame("--target"):
            target = load_target(args.target)
        config, init = _draft_shape(args, parser, target)
        _, metrics = _run_training(
            parser,
            lambda: train.train_draft(
                target,
                config,
                anchors_per_seq=args.anchors,
                gamma=args.gamma,
                labels=args.labels,
                target_path=os.path.abspath(args.target),
                init=init,
                init_path=None if args.init is None else os.path.abspath(args.init),
                **common,
            ),
        )
    last = metrics["eval"][-1]
    rate = metrics["tokens_per_s"]
    print(
        json.dumps(
            {
                "out": args.out,
                "steps": metrics["last_step"],
                "tokens_per_s": rate and round(rate, 1),
                "held_out": {k: v for k, v in last.items() if k != "step"},
            }
        )
    )
    return 0


def _run_training(parser, fn):
    try:
        return fn()
    except ValueError as e:  # what the flags' own checks cannot see (e.g. a corpus too small for --seq-len)
        parser.error(str(e))


def _draft_shape(args, parser, target):
    """(DraftConfig, the --init Draft or None) of `jaxspec train draft`: from --init's checkpoint,
    or from --layers / --block-size / --taps / --intermediate-size over the target."""
    from jaxspec import train
    from jaxspec.dflash import load_draft

    init = None
    if args.init is not None:
        for flag in ("layers", "block_size", "taps", "intermediate_size"):
            if getattr(args, flag) is not None:
                parser.error(f"argument --{flag.replace('_', '-')}: not with --init (the draft's shape comes from it)")
        _check_checkpoint_dir(parser, "--init", args.init)
        with parser.blame("--init"):
            init = load_draft(args.init, target)
    block_size = init.config.block_size if init else 8 if args.block_size is None else args.block_size
    if not 2 <= block_size <= 64:
        parser.error(f"argument --block-size: must be in 2..64, got {block_size}")
    if args.seq_len - block_size < args.anchors:
        parser.error(
            f"argument --anchors: {args.anchors} distinct anchors do not fit in --seq-len "
            f"{args.seq_len} with block size {block_size} (at most seq_len - block_size)"
        )
    if init is not None:
        return init.config, init
    n_layers = target.config.num_hidden_layers
    taps = None
    if args.taps is not None:
        try:
            taps = tuple(int(t) for t in args.taps.split(","))
        except ValueError:
            parser.error(f"argument --taps: {args.taps!r} is not a comma-separated list of ints")
        if not taps or any(not 0 <= t < n_layers for t in taps):
            parser.error(f"argument --taps: {args.taps!r}: every layer must be in [0, {n_layers})")
    try:
        config = train.tiny_draft_config(
            target.config,
            num_hidden_layers=2 if args.layers is None else args.layers,
            block_size=block_size,
            target_layer_ids=taps,
            intermediate_size=args.intermediate_size,
        )
    except ValueError as e:
        parser.error(str(e))
    return config, None


def _check_checkpoint_dir(parser, flag, path):
    if not os.path.isfile(os.path.join(path, "config.json")):
        parser.error(f"argument {flag}: {path!r} is not a checkpoint directory (no config.json)")


def _encode_prompts(parser, texts, tokenizer) -> list[list[int]]:
    """The --prompt texts as token ids; text that is not UTF-8 (the shell passed bytes) or encodes to
    nothing is refused, naming the prompt."""
    prompts = []
    for i, text in enumerate(texts):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            parser.error(
                f"argument --prompt: prompt {i} is not valid UTF-8 text (byte "
                f"{os.fsencode(text[e.start : e.end])!r} at character {e.start})"
            )
        ids = tokenizer.encode(text)
        if not ids:
            parser.error(f"argument --prompt: prompt {i} is empty")
        prompts.append(ids)
    return prompts


def _check_lengths(parser, args, prompts, window):
    """Every prompt + --max-new-tokens + the verify window fits --max-len (the engine's refusal, up front)."""
    for i, ids in enumerate(prompts):
        need = len(ids) + args.max_new_tokens + window
        if need > args.max_len:
            parser.error(
                f"argument --max-new-tokens: prompt {i} ({len(ids)} tokens) + --max-new-tokens "
                f"{args.max_new_tokens} + the verify window {window} = {need} exceeds --max-len "
                f"{args.max_len}"
            )


def _median_speeds(runs):
    """The last of `runs` (lists of GenerationResult of the same prompts, the same tokens), each
    request's speeds replaced by their medians over the runs."""
    out = []
    for tries in zip(*runs):
        last = tries[-1]
        if last.error is None:
            speeds = ("tokens_per_s", "first_token_s", "decode_tokens_per_s")
            last.stats.update({k: statistics.median(r.stats[k] for r in tries) for k in speeds})
        out.append(last)
    return out


def _speed(stats) -> str:
    compiled = " including compilation (--warmup leaves it out)" if stats["includes_compilation"] else ""
    return (
        f"{stats['tokens_per_s']:.1f} tokens/s{compiled}: first token {stats['first_token_s'] * 1e3:.0f} ms, "
        f"then {stats['decode_tokens_per_s']:.1f} tokens/s"
    )


def _speed_ups(stats, base) -> str:
    """Speculation against mode none: the decode rate after the first token, and end to end."""
    rate = lambda key: stats[key] / base[key] if base[key] else float("nan")
    return f"decode speed-up {rate('decode_tokens_per_s'):.2f}x, end to end {rate('tokens_per_s'):.2f}x"


def _generate(args, parser):
    from jaxspec import parallel
    from jaxspec.config import SpecConfig
    from jaxspec.dflash import load_draft
    from jaxspec.engine import Engine
    from jaxspec.spec.planner import CostTable
    from jaxspec.target import load_target
    from jaxspec.tokenizer import load_tokenizer

    if args.draft is None and os.path.abspath(args.target) == DEFAULT_TARGET:
        args.draft = DEFAULT_DRAFT
    for flag, path in (("--target", args.target), ("--draft", args.draft)):
        if path is not None:
            _check_checkpoint_dir(parser, flag, path)
    if args.verify_mode != "none" and args.draft is None:
        parser.error(f"argument --draft: required with --verify-mode {args.verify_mode}")
    cost_table = None
    if args.cost_table is not None:
        if not os.path.isfile(args.cost_table):
            parser.error(f"argument --cost-table: {args.cost_table!r} is not a file")
        with parser.blame("--cost-table"):
            cost_table = CostTable.load(args.cost_table)
    with parser.blame("--target"):
        # a tensor-parallel split takes the separate projections: loaded so, there is no second copy
        target = load_target(args.target, fused=args.tp == 1)
        tokenizer = load_tokenizer(args.target)
    with parser.blame("--tp"):
        parallel.check_tp(target.config, args.tp, "")
    prompts = _encode_prompts(parser, args.prompt, tokenizer)
    draft = None
    if args.draft and args.verify_mode != "none":
        with parser.blame("--draft"):
            draft = load_draft(args.draft, target)
        if args.block_size is not None and args.block_size > draft.config.block_size:
            parser.error(
                f"argument --block-size: {args.block_size} exceeds the draft's block of {draft.config.block_size}"
            )

    def decoder(mode, engine_draft, table):
        """A callable that decodes the prompts once in `mode` (after the --warmup run)."""
        spec = SpecConfig(
            verify_mode=mode,
            num_slots=args.num_slots,
            max_len=args.max_len,
            block_size=args.block_size if mode != "none" else None,
            trim_draft=args.trim_draft and mode != "none",
            tp=args.tp,
        )
        engine = Engine(target, engine_draft, spec, tokenizer=tokenizer)
        _check_lengths(parser, args, prompts, engine.window)
        if table is not None and mode in PLANNED_MODES:
            _check_table_matches(parser, table, engine.window, spec.trim_draft)
        engine.cost_table = table
        run = lambda: engine.generate(
            prompts,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
        )
        if args.warmup:
            run()
        return run

    runs = {args.verify_mode: decoder(args.verify_mode, draft, cost_table)}
    if args.compare_none and args.verify_mode != "none":
        runs["none"] = decoder("none", None, None)
    decoded = {mode: [] for mode in runs}
    for _ in range(args.repeats):  # modes alternate, so a slow spell of the machine hits both
        for mode, run in runs.items():
            decoded[mode].append(run())
    results = _median_speeds(decoded[args.verify_mode])
    baseline = _median_speeds(decoded["none"]) if "none" in decoded else None
    failed = 0
    for i, r in enumerate(results):
        failed += r.error is not None
        base = baseline[i] if baseline is not None and r.error is None else None
        if args.json:
            keys = (
                "accept_length",
                "steps",
                "tokens_per_s",
                "first_token_s",
                "decode_tokens_per_s",
                "includes_compilation",
            )
            stats = {k: r.stats[k] for k in keys} if r.stats else {}
            if base is not None:
                stats["tokens_per_s_none"] = base.stats["tokens_per_s"]
                stats["decode_tokens_per_s_none"] = base.stats["decode_tokens_per_s"]
                stats["same_tokens_as_none"] = base.tokens == r.tokens
            print(json.dumps({"tokens": r.tokens, "text": r.text, "stats": stats, "error": r.error}))
            continue
        if r.tokens:
            print(r.text)
        if r.error is not None:
            print(f"{parser.prog}: error: {r.error}", file=sys.stderr)
            continue
        print(
            f"[{args.verify_mode}: {len(r.tokens)} tokens, {r.stats['steps']} steps, accept length "
            f"{r.stats['accept_length']:.2f}, {_speed(r.stats)}]",
            file=sys.stderr,
        )
        if base is not None:
            same = "the same tokens" if base.tokens == r.tokens else "different tokens"
            print(
                f"[none: {len(base.tokens)} tokens, {base.stats['steps']} steps, {_speed(base.stats)} ({same}); "
                f"{_speed_ups(r.stats, base.stats)} on {_device_name(args.tp)}]",
                file=sys.stderr,
            )
    return 1 if failed else 0


def _device_name(tp: int = 1) -> str:
    """The devices decoding ran on, for a printed speed: their kind (a GPU's name) and count, or
    the CPU's core count."""
    import jax

    device = jax.devices()[0]
    if device.platform == "cpu":
        return f"the CPU ({os.cpu_count()} cores)"
    return device.device_kind if tp == 1 else f"{tp} x {device.device_kind}"


def _check_table_matches(parser, table, window, trim_draft):
    """`TierPlanner.cost_table`'s refusal of a table `jaxspec profile` timed for another verify
    window or draft forward, as a one-line argument error naming the flags (tables without the
    record are taken as they are)."""
    from jaxspec.tier_planner import timed_for_another_step

    field = timed_for_another_step(table, window, trim_draft)
    if field == "window":
        parser.error(
            f"argument --cost-table: profiled with verify windows of {table.metadata['window']} tokens, this run "
            f"verifies {window} (profile with --block-size {window})"
        )
    if field == "trim_draft":
        with_ = lambda on: "with" if on else "without"
        parser.error(
            f"argument --cost-table: profiled {with_(table.metadata['trim_draft'])} --trim-draft, this run "
            f"{with_(trim_draft)}"
        )


def _profile(args, parser):
    from tqdm.auto import tqdm

    from jaxspec.config import SpecConfig
    from jaxspec.dflash import load_draft
    from jaxspec.engine import Engine
    from jaxspec.target import load_target

    problem = output_file_problem(args.out)
    if problem:
        parser.error(f"argument --out: {problem}")
    for flag, path in (("--target", args.target), ("--draft", args.draft)):
        _check_checkpoint_dir(parser, flag, path)
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        parser.error(f"argument --batches: {args.batches!r} is not a comma-separated list of ints")
    bad = [b for b in batches if not 1 <= b <= args.num_slots]
    if bad:
        parser.error(f"argument --batches: {bad[0]} is not in 1..--num-slots {args.num_slots}")
    with parser.blame("--target"):
        target = load_target(args.target)
    with parser.blame("--draft"):
        draft = load_draft(args.draft, target)
    if args.block_size is not None and args.block_size > draft.config.block_size:
        parser.error(f"argument --block-size: {args.block_size} exceeds the draft's block of {draft.config.block_size}")
    spec = SpecConfig(
        verify_mode="compact",
        num_slots=args.num_slots,
        max_len=args.max_len,
        block_size=args.block_size,
        trim_draft=args.trim_draft,
    )
    engine = Engine(target, draft, spec)
    prompt_len = 8
    need = prompt_len + (args.repeats + 1) * engine.window
    if need > args.max_len:
        parser.error(
            f"argument --max-len: a prompt of {prompt_len} + (--repeats {args.repeats} + 1) verify windows "
            f"of {engine.window} = {need} tokens exceed --max-len {args.max_len}"
        )
    entries = sum(tier >= b for b in batches for tier in engine.tier_tokens)
    with tqdm(total=entries, desc="profile", unit="entry", disable=args.no_progress, dynamic_ncols=True) as bar:

        def progress(batch, tokens, seconds):
            bar.set_postfix_str(f"batch {batch} tokens {tokens}: {seconds * 1e3:.2f} ms")
            bar.update(1)

        table = engine.profile(batches, repeats=args.repeats, prompt_len=prompt_len, on_entry=progress)
    table.metadata["model"] = os.path.basename(os.path.normpath(args.target))
    with parser.blame("--out"):
        table.save(args.out)
    for (batch, tokens), seconds in sorted(table.entries.items()):
        print(f"batch {batch:4d}  tokens {tokens:5d}  {seconds * 1e3:9.3f} ms")
    print(f"noise {table.noise:.1%} (median slowest / fastest round - 1: a trim must save more)")
    return 0


def _info(args, parser):
    """The config of a target or a DFlash draft (a directory or its config.json), or a cost table, as JSON."""
    from jaxspec.config import DraftConfig, TargetConfig
    from jaxspec.spec.planner import CostTable

    path = args.path
    if not os.path.exists(path):
        parser.error(f"argument path: {path!r} does not exist")
    if os.path.isdir(path):
        _check_checkpoint_dir(parser, "path", path)
        path = os.path.join(path, "config.json")
    with parser.blame("path"):
        with open(path, encoding="utf-8") as f:
            try:
                obj = json.load(f)
            except ValueError as e:
                raise ValueError(f"{path}: not valid JSON ({e})") from None
        is_dict = isinstance(obj, dict)
        if is_dict and "entries" in obj and "version" in obj:
            out = CostTable.load(path).to_json()
        elif is_dict and ("dflash_config" in obj or "DFlashDraftModel" in (obj.get("architectures") or ())):
            out = DraftConfig.from_json(path).to_hf()
        else:
            out = TargetConfig.from_json(path).to_hf()
    print(json.dumps(out, indent=2))
    return 0


_COMMANDS = {"generate": _generate, "profile": _profile, "train": _train, "info": _info}


def main(argv=None):
    parser = _parser()
    args = parser.parse_args(argv)
    parser.debug = args.debug
    try:
        if args.command == "bench":
            from jaxspec.bench import sweep

            return sweep.run(args, parser, argv=(sys.argv[1:] if argv is None else list(argv))[1:])
        if args.command == "estimator":
            from jaxspec.spec import calibration

            return calibration.run(args, parser)
        return _COMMANDS[args.command](args, parser)
    except KeyboardInterrupt:
        if args.debug:
            raise
        parser.exit(130, f"{parser.prog}: interrupted\n")
    except Exception as e:  # noqa: BLE001 - the one place every other failure ends
        if args.debug:
            raise
        parser.exit(
            1, f"{parser.prog}: internal error: {type(e).__name__}: {_one_line(e)} (--debug shows the traceback)\n"
        )


if __name__ == "__main__":
    sys.exit(main())
