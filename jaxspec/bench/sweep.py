"""`jaxspec bench`: decode tokens/s against concurrency for verify modes none, static and compact.

Per concurrency level c (1, 2, 4, ...): engines with num_slots = c, a closed-loop client keeping
c requests in flight (`client.closed_loop`: a new request as soon as one finishes, admitted by
the engine at its next turn), max(--min-requests, --requests-factor x c) requests per level, each
asking for an output length drawn from [--output-len / 2, --output-len]. Every program a level
runs is compiled ahead in threads; compact's cost table is profiled at c on this machine
(`Engine.profile`, as `jaxspec profile`), saved under --cost-tables and reused by later runs.
Each (temperature, mode, acceptance setting) is warmed up (compact: until the planner is past
its warm-up steps), then run --repeats times, modes interleaved within a repeat, in reverse order every other repeat.

Workloads: `tiny` (the shipped byte-level target and DFlash draft, held-out stdlib code,
real acceptance) and `real-shape` (the Qwen3.5-27B-shaped random-weight target cut to --layers
layers and a 5-layer draft, random ids, SIMULATED acceptance: per --accept-lengths L, (a, b) of
sigmoid(a x + b) calibrated on the draft features of a probe run so the mean accept length is L).

Writes into --out, after every level: results.json (every level, every repeat, the spreads, the
calibration, the host share of a c = 1 step), results.md (the tables) and the PNGs (`plots`).
--smoke: the tiny pair (or toy real-shape models) at c 1 and 2, T = 0, few tokens (the CPU test).
"""

import argparse
import datetime
import json
import os
import platform
import shlex
import sys
import time

from jaxspec.bench import level as level_mod
from jaxspec.bench.plots import plot
from jaxspec.bench.report import markdown
from jaxspec.bench.shapes import MODELS, shapes_of
from jaxspec.config import VERIFY_MODES

SPEC_MODES = VERIFY_MODES[1:]


def _list(cast, name):
    def parse(text):
        try:
            values = [cast(x) for x in text.split(",") if x]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a comma-separated list, got {text!r}") from None
        if not values:
            raise argparse.ArgumentTypeError(f"{name} is empty")
        return values

    return parse


# defaults of the flags --smoke changes (an explicit flag wins over both)
DEFAULTS = dict(
    output_len=128,
    prompt_len=128,
    min_requests=16,
    requests_factor=2,
    temperatures=[0.0, 1.0],
    num_tiers=4,
    refit_interval=100,
    profile_repeats=10,
    host_turns=30,
    compile_workers=min(16, os.cpu_count() or 1),
)
SMOKE = dict(
    concurrency=[1, 2],
    output_len=8,
    prompt_len=32,
    min_requests=4,
    requests_factor=2,
    temperatures=[0.0],
    num_tiers=2,
    refit_interval=8,
    profile_repeats=2,
    host_turns=4,
    compile_workers=2,
)


def add_arguments(p):
    from jaxspec.argtypes import non_negative_int, positive_int
    from jaxspec.config import DEFAULT_DRAFT, DEFAULT_TARGET

    dflt = lambda key: f" (default {DEFAULTS[key]}; --smoke: {SMOKE[key]})"
    p.add_argument("--out", required=True, help="directory for results.json, results.md and the PNGs")
    p.add_argument("--workload", choices=("tiny", "real-shape"), default="tiny")
    p.add_argument("--target", default=DEFAULT_TARGET, help="tiny: target checkpoint (default: models/tiny-target)")
    p.add_argument("--draft", default=DEFAULT_DRAFT, help="tiny: DFlash draft checkpoint (default: models/tiny-dflash)")
    p.add_argument(
        "--model",
        choices=sorted(MODELS),
        default="qwen3.5-27b",
        help="real-shape: the target's shape (jaxspec.bench.shapes.MODELS; default qwen3.5-27b)",
    )
    p.add_argument(
        "--layers",
        type=positive_int("--layers"),
        default=16,
        help="real-shape: target layers kept of the model's (a multiple of 4)",
    )
    p.add_argument(
        "--block",
        type=positive_int("--block"),
        default=8,
        help="verify window (anchor + block - 1 drafts); real-shape: also the draft's block",
    )
    p.add_argument(
        "--concurrency",
        type=_list(int, "--concurrency"),
        help="levels, run in the order given (default 1, 2, 4, ... 256 for tiny, ... 64 for real-shape; --smoke: 1, 2)",
    )
    p.add_argument(
        "--min-requests", type=positive_int("--min-requests"), help="requests per level" + dflt("min_requests")
    )
    p.add_argument(
        "--requests-factor",
        type=positive_int("--requests-factor"),
        help="requests per level: max(--min-requests, factor x c)" + dflt("requests_factor"),
    )
    p.add_argument(
        "--output-len",
        type=positive_int("--output-len"),
        help="most new tokens a request asks for (each asks for a length in [N/2, N])" + dflt("output_len"),
    )
    p.add_argument("--prompt-len", type=positive_int("--prompt-len"), help="prompt tokens" + dflt("prompt_len"))
    p.add_argument("--modes", type=_list(str, "--modes"), default=["none", "static", "compact"])
    p.add_argument("--temperatures", type=_list(float, "--temperatures"), help="T = 0: greedy" + dflt("temperatures"))
    p.add_argument("--top-k", type=int, default=20, help="sampling (T > 0)")
    p.add_argument("--top-p", type=float, default=0.95, help="sampling (T > 0)")
    p.add_argument(
        "--accept-lengths",
        type=_list(float, "--accept-lengths"),
        default=[3.0, 5.0],
        help="real-shape: simulated mean accept lengths at --block",
    )
    p.add_argument(
        "--sim-slope",
        type=float,
        default=2.0,
        help="real-shape: a = slope / std(x): acceptance logit change per std of the feature",
    )
    p.add_argument("--repeats", type=positive_int("--repeats"), default=2)
    p.add_argument(
        "--prefill-rows",
        type=positive_int("--prefill-rows"),
        default=1,
        help="SpecConfig.prefill_rows: rows of every prefill call (one compiled prefill a level)",
    )
    p.add_argument("--num-tiers", type=positive_int("--num-tiers"), help="compact's verify tiers" + dflt("num_tiers"))
    p.add_argument(
        "--tp", type=positive_int("--tp"), default=1, help="split the target over this many devices (SpecConfig.tp)"
    )
    p.add_argument(
        "--refit-interval",
        type=positive_int("--refit-interval"),
        help="estimator refit interval (steps)" + dflt("refit_interval"),
    )
    p.add_argument(
        "--profile-repeats",
        type=positive_int("--profile-repeats"),
        help="timed calls per cost-table entry" + dflt("profile_repeats"),
    )
    p.add_argument("--cost-tables", help="directory of compact cost tables to reuse / write (default: OUT/costs)")
    p.add_argument(
        "--host-turns",
        type=non_negative_int("--host-turns"),
        help="host-loop turns timed, then as "
        "many traced, for the host share of a c = 1 step (0: none)" + dflt("host_turns"),
    )
    p.add_argument(
        "--compile-workers",
        type=positive_int("--compile-workers"),
        help="threads compiling a level's programs ahead of its runs" + dflt("compile_workers"),
    )
    p.add_argument(
        "--compile-cache",
        help="jax's persistent compilation cache directory (a rerun on the same "
        "machine then loads the programs instead of compiling them)",
    )
    p.add_argument("--budget-s", type=float, help="start no level after this many seconds (default: no limit)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="c 1 and 2, T = 0, few tokens (the CPU test); real-shape: toy shapes of the same structure",
    )


def _config(args, parser) -> dict:
    """The run's settings as a dict (what results.json records): flags not given take --smoke's
    values under --smoke, else DEFAULTS; every rule checked (parser.error names the argument)."""
    for key, value in (SMOKE if args.smoke else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.concurrency is None:
        args.concurrency = [1 << i for i in range(9 if args.workload == "tiny" else 7)]
    if any(c < 1 for c in args.concurrency):
        parser.error(f"argument --concurrency: every level must be >= 1, got {args.concurrency}")
    bad = [m for m in args.modes if m not in ("none",) + SPEC_MODES]
    if bad or len(set(args.modes)) != len(args.modes):
        parser.error(f"argument --modes: {args.modes} must be distinct of none, {', '.join(SPEC_MODES)}")
    if any(t < 0 for t in args.temperatures):
        parser.error(f"argument --temperatures: must be >= 0, got {args.temperatures}")
    if args.workload == "real-shape" and not args.smoke:
        most = shapes_of(args.model)[0]["layers"]
        if args.layers % 4 or args.layers > most:
            parser.error(f"argument --layers: must be a multiple of 4 at most {most} ({args.model}), got {args.layers}")
    if args.workload == "real-shape" and any(not 1 < a < args.block for a in args.accept_lengths):
        parser.error(f"argument --accept-lengths: each must lie in (1, {args.block}) at --block {args.block}")
    if not 2 <= args.block <= 64:
        parser.error(f"argument --block: must be in 2..64, got {args.block}")
    width = max(16, 1 << (args.prompt_len - 1).bit_length())
    room = max(args.output_len, (args.profile_repeats + 1) * args.block, (2 * args.host_turns + 4) * args.block)
    return {
        "workload": args.workload,
        "concurrency": list(dict.fromkeys(args.concurrency)),
        "modes": args.modes,
        "temperatures": args.temperatures,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "accept_lengths": args.accept_lengths,
        "sim_slope": args.sim_slope,
        "block": args.block,
        "layers": args.layers,
        "model": args.model,
        "min_requests": args.min_requests,
        "requests_factor": args.requests_factor,
        "output_len": args.output_len,
        "prompt_len": args.prompt_len,
        "prompt_width": width,
        "max_len": width + room + args.block,
        "repeats": args.repeats,
        "prefill_rows": args.prefill_rows,
        "num_tiers": args.num_tiers,
        "tp": args.tp,
        "refit_interval": args.refit_interval,
        "profile_repeats": args.profile_repeats,
        "host_turns": args.host_turns,
        "compile_workers": args.compile_workers,
        "budget_s": args.budget_s,
        "seed": args.seed,
        "smoke": args.smoke,
        "cost_tables": args.cost_tables or os.path.join(args.out, "costs"),
    }


def _progress(enabled):
    """A tqdm factory: requests finished; redrawn at most every 10 s when stderr is not a terminal
    (a log keeps a few lines a level, not thousands)."""
    from tqdm.auto import tqdm

    interval = 0.1 if sys.stderr.isatty() else 10.0
    return lambda **kw: tqdm(disable=not enabled, unit="req", dynamic_ncols=True, mininterval=interval, **kw)


def _workload(cfg, args):
    from jaxspec.bench import workload

    count = max(max(cfg["min_requests"], cfg["requests_factor"] * c) for c in cfg["concurrency"])
    if cfg["workload"] == "tiny":
        return workload.tiny(args.target, args.draft, count=count, prompt_len=cfg["prompt_len"], seed=cfg["seed"])
    return workload.real_shape(
        cfg["layers"],
        cfg["block"],
        model=cfg["model"],
        count=count,
        prompt_len=cfg["prompt_len"],
        seed=cfg["seed"],
        smoke=cfg["smoke"],
        fused=cfg["tp"] == 1,  # a tensor-parallel split takes separate projections: no second copy
    )


def _settings(work, cfg):
    """The acceptance settings: [{"name": "real", "sim": None}] for real acceptance; else one
    calibrated setting per --accept-lengths (`calibrate.settings`)."""
    from jaxspec.bench import calibrate

    if not work.simulated:
        return [{"name": "real", "sim": None}]
    if not any(m in SPEC_MODES for m in cfg["modes"]):
        return []
    return calibrate.settings(work, cfg)


def _goals(points, levels) -> dict:
    """The issue's goals as measured: compact not below max(none, static) within the spread at
    every level; the c = 1 speedup of each spec mode; the host share of a c = 1 step."""
    compact = [
        p["not_below_others"] for p in points if p["mode"] == "compact" and p.get("not_below_others") is not None
    ]
    c1 = {
        f"{p['mode']} {p['setting']} T={p['temperature']:g}": p["speedup_vs_none"]["mean"]
        for p in points
        if p["concurrency"] == 1 and p.get("speedup_vs_none")
    }
    shares = {
        h["mode"] + ("" if h["setting"] is None else " " + h["setting"]): h["host_share"]
        for lv in levels
        for h in lv.get("host_share", [])
    }
    return {
        "compact_not_below_others_every_level": all(compact) if compact else None,
        "c1_speedup_vs_none": c1,
        "c1_host_share": shares,
    }


def run(args, parser, argv) -> int:
    """`jaxspec bench`: returns the exit status (0; argument errors exit through parser.error)."""
    cfg = _config(args, parser)
    os.makedirs(args.out, exist_ok=True)
    t_start = time.time()
    import jax

    if args.compile_cache:
        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)

    dev = jax.devices()[0]
    if cfg["workload"] == "real-shape" and not cfg["smoke"] and dev.platform == "cpu":
        # a CUDA plugin that fails to start (e.g. two memory-fraction variables set) leaves JAX on
        # the CPU with only a warning: refuse rather than time 27B-scale steps there
        parser.error(
            "argument --workload: real-shape times Qwen3.5-27B-scale steps on a GPU and JAX's backend is 'cpu' "
            "(see any plugin error above); --smoke runs its toy shapes on the CPU"
        )
    device = f"{dev.platform}:{dev.device_kind}" + (f" x {cfg['tp']}" if cfg["tp"] > 1 else "")
    work = _workload(cfg, args)
    from jaxspec import parallel

    with parser.blame("--tp"):
        parallel.check_tp(work.target.config, cfg["tp"], "")
    print(f"{work.key}: models and prompts ready in {time.time() - t_start:.1f} s", flush=True)
    settings = _settings(work, cfg)
    for s in settings:
        if s["sim"] is not None:
            cal = s["calibration"]
            print(
                f"{s['name']}: a {cal['a']:.4g}, b {cal['b']:.4g} (x mean {cal['x']['mean']:.3f}, std "
                f"{cal['x']['std']:.3f}, {cal['x']['rows']} rows; {time.time() - t_start:.0f} s in all)",
                flush=True,
            )
    meta = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": f"{dev.device_kind} ({dev.platform}), {len(jax.devices())} device(s), host "
        f"{platform.machine()} x {os.cpu_count()} CPUs, {platform.platform()}",
        "device": device,
        "jax": jax.__version__,
        "python": sys.version.split()[0],
        "command": "jaxspec bench " + shlex.join(argv),
        "smoke": cfg["smoke"],
        "workload": work.info,
        "config": cfg,
        "setup_s": time.time() - t_start,
    }
    results = {
        "meta": meta,
        "settings": [
            {"name": s["name"], "simulated": s["sim"] is not None, "calibration": s.get("calibration")}
            for s in settings
        ],
        "levels": [],
        "points": [],
        "notes": [],
    }
    progress = _progress(not args.no_progress)

    def dump():
        results["elapsed_s"] = time.time() - t_start
        results["goals"] = _goals(results["points"], results["levels"])
        try:
            results["plots"] = [os.path.basename(p) for p in plot(results["points"], args.out, work.info["name"])]
        except ImportError as e:  # matplotlib is the optional `plot` extra
            results["plots"] = []
            if f"no PNGs: {e}" not in results["notes"]:
                results["notes"].append(f"no PNGs: {e}")
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)
        with open(os.path.join(args.out, "results.md"), "w") as f:
            f.write("\n".join(markdown(results)))

    for c in cfg["concurrency"]:
        if cfg["budget_s"] is not None and time.time() - t_start > cfg["budget_s"]:
            results["notes"].append(f"stopped before c={c}: --budget-s {cfg['budget_s']} reached")
            break
        out = level_mod.run_level(work, c, cfg, settings, device=device, progress=progress)
        results["levels"].append(out["level"])
        results["points"] += out["points"]
        dump()
        best = {
            p["mode"] + ("" if p["setting"] is None else " " + p["setting"]): p["decode_tokens_per_s"]["mean"]
            for p in out["points"]
            if p["temperature"] == cfg["temperatures"][0]
        }
        lv = out["level"]
        print(
            f"c={c}: {len(lv['compile'])} programs compiled in {lv['compile_wall_s']:.1f} s, level "
            f"{lv['wall_s']:.1f} s ({time.time() - t_start:.0f} s in all); decode tokens/s at "
            f"T={cfg['temperatures'][0]:g}: " + ", ".join(f"{k} {v:.1f}" for k, v in best.items() if v is not None),
            flush=True,
        )
    dump()
    print(f"wrote {os.path.join(args.out, 'results.json')}, results.md and {len(results['plots'])} PNGs", flush=True)
    return 0
