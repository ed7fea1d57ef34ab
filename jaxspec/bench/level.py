"""One concurrency level of `jaxspec bench`: engines per (mode, acceptance setting), compilation
ahead of the runs, the compact cost table, warm-up, repeated closed-loop runs, their numbers."""

import gc
import os
import time

from jaxspec.bench import client, metrics
from jaxspec.bench import compile as compile_mod
from jaxspec.bench.host_share import host_share

SPREAD_FIELDS = (
    "decode_tokens_per_s",
    "output_tokens_per_s",
    "accept_length",
    "verified_per_step",
    "tier_tokens_per_step",
    "running",
    "steps_per_s",
)


def sampling_of(temperature, top_k, top_p) -> dict:
    """`Engine.submit`'s sampling arguments at a temperature (T = 0: greedy)."""
    return (
        {"temperature": 0.0}
        if temperature == 0
        else {"temperature": float(temperature), "top_k": top_k, "top_p": top_p}
    )


def spec_config(mode, concurrency, cfg, workload, sim=None):
    from jaxspec.config import SpecConfig

    return SpecConfig(
        verify_mode=mode,
        num_slots=concurrency,
        max_len=cfg["max_len"],
        block_size=cfg["block"],
        state_dtype=workload.state_dtype,
        num_tiers=cfg["num_tiers"],
        prefill_rows=cfg["prefill_rows"],
        refit_interval=cfg["refit_interval"],
        simulated_acceptance=sim,
        tp=cfg.get("tp", 1),
    )


def _engines(workload, concurrency, cfg, settings):
    """{(mode, setting name): Engine}: mode none once (setting None), the spec modes per setting."""
    from jaxspec.engine import Engine

    out = {}
    for mode in cfg["modes"]:
        if mode == "none":
            out[("none", None)] = Engine(workload.target, None, spec_config("none", concurrency, cfg, workload))
            continue
        for setting in settings:
            out[(mode, setting["name"])] = Engine(
                workload.target, workload.draft, spec_config(mode, concurrency, cfg, workload, setting["sim"])
            )
    return out


def _compile_jobs(engines, cfg, profile_needed):
    """Lowering thunks of every program the level runs: per mode (settings share programs: the
    simulated acceptance is data), per greedy flag of its temperatures, and the prefills once per
    state layout (none / spec)."""
    jobs, seen = [], set()
    for (mode, _), engine in engines.items():
        flags = {t == 0 for t in cfg["temperatures"]} | ({True} if mode == "compact" and profile_needed else set())
        for greedy in sorted(flags):
            for name, thunk in engine.lowerings(greedy=greedy, prompt_lengths=[cfg["prompt_len"]]).items():
                kind = "none" if mode == "none" else "spec"
                key = (kind, name) if name.startswith("prefill") else (mode, name, greedy)
                if key not in seen:
                    seen.add(key)
                    jobs.append((" ".join(map(str, key)), thunk))
    return jobs


def _cost_table_path(workload, concurrency, cfg):
    return os.path.join(cfg["cost_tables"], f"{workload.key}-b{cfg['block']}-c{concurrency}.json")


def _table_key(workload, concurrency, cfg, device):
    return {"model": workload.key, "block": cfg["block"], "num_slots": concurrency, "device": device}


def _saved_table(path, key):
    """The cost table saved at `path` when its metadata matches `key` (model, block, slot count,
    device), else None."""
    from jaxspec.spec.planner import CostTable

    if not os.path.isfile(path):
        return None
    table = CostTable.load(path)
    return table if all(table.metadata.get(k) == v for k, v in key.items()) else None


def _profile_table(engine, path, key, cfg):
    """Profile the compact step (`Engine.profile`, what `jaxspec profile` runs) at this level's
    slot count and save the table at `path`. Returns (CostTable, seconds)."""
    start = time.perf_counter()
    table = engine.profile([engine.spec.num_slots], repeats=cfg["profile_repeats"], prompt_len=cfg["prompt_width"])
    table.metadata.update(key)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    table.save(path)
    return table, time.perf_counter() - start


def _warm_up(engine, reqs, concurrency, sampling):
    """Untimed closed-loop runs until the engine plans budgets (compact: past its warm-up steps)."""
    spec = engine.spec
    need = engine.warmup_steps + spec.lag if spec.verify_mode == "compact" else 0
    client.closed_loop(engine, reqs, concurrency, sampling=sampling)
    while engine.steps_run < need:
        client.closed_loop(engine, reqs, concurrency, sampling=sampling)


def run_level(workload, concurrency, cfg, settings, *, device, progress) -> dict:
    """Every (temperature, mode, setting) at one concurrency: `cfg["repeats"]` closed-loop runs of
    the same requests each, modes interleaved within a repeat (`run_order`). Returns {"level": compile / cost
    table / host share info, "points": one dict per (temperature, mode, setting) with every
    repeat's `metrics.summarise` and the spread of each number, speedups paired by repeat}."""
    from jaxspec.bench.workload import requests as make_requests

    start = time.perf_counter()
    n = max(cfg["min_requests"], cfg["requests_factor"] * concurrency)
    reqs = make_requests(workload, n, cfg["output_len"], cfg["seed"])
    engines = _engines(workload, concurrency, cfg, settings)
    level = {"concurrency": concurrency, "requests": n}
    compact = [e for (mode, _), e in engines.items() if mode == "compact"]
    path, key = _cost_table_path(workload, concurrency, cfg), _table_key(workload, concurrency, cfg, device)
    table = _saved_table(path, key) if compact else None
    jobs = _compile_jobs(engines, cfg, profile_needed=bool(compact) and table is None)
    t = time.perf_counter()
    compiled = compile_mod.precompile(jobs, cfg["compile_workers"])
    level["compile_wall_s"] = time.perf_counter() - t
    level["compile"] = {k: {kk: vv for kk, vv in v.items() if kk != "compiled"} for k, v in compiled.items()}
    del compiled
    if compact:
        level["cost_table"] = {"path": path, "profiled": table is None}
        if table is None:
            table, level["cost_table"]["seconds"] = _profile_table(compact[0], path, key, cfg)
        level["cost_table"]["entries"] = {f"{b}x{n}": v for (b, n), v in sorted(table.entries.items())}
        level["cost_table"]["noise"] = table.noise
        for engine in compact:
            engine.cost_table = table
    points = []
    warm = reqs[: min(n, max(concurrency, 4))]
    for temperature in cfg["temperatures"]:
        sampling = sampling_of(temperature, cfg["top_k"], cfg["top_p"])
        with compile_mod.counting() as compiles:
            for engine in engines.values():
                _warm_up(engine, warm, concurrency, sampling)
        level.setdefault("compiled_in_warm_up", []).extend(compiles)
        runs = {key: [] for key in engines}
        bar = progress(total=cfg["repeats"] * len(engines) * n, desc=f"c={concurrency} T={temperature:g}")
        for rep in range(cfg["repeats"]):
            for mode, setting in run_order(list(engines), rep):
                engine = engines[(mode, setting)]
                bar.set_postfix_str(f"{mode}{'' if setting is None else ' ' + setting} rep {rep + 1}")
                gc.collect()  # no run pays for the garbage of the one before it
                with compile_mod.counting() as compiles:
                    run = client.closed_loop(
                        engine, reqs, concurrency, sampling=sampling, on_finish=lambda _record: bar.update(1)
                    )
                runs[(mode, setting)].append(dict(metrics.summarise(run, concurrency), compiles=compiles))
        bar.close()
        points += _points(runs, workload, concurrency, temperature)
    if concurrency == 1 and cfg["host_turns"] > 0:
        temperature = 0.0 if 0.0 in cfg["temperatures"] else cfg["temperatures"][0]
        sampling = sampling_of(temperature, cfg["top_k"], cfg["top_p"])
        level["host_share"] = [
            dict(
                mode=mode,
                setting=setting,
                temperature=temperature,
                **host_share(engine, reqs[0].prompt, turns=cfg["host_turns"], sampling=sampling),
            )
            for (mode, setting), engine in engines.items()
        ]
    level["tier_ladders"] = {f"{mode} {setting}": list(e.tier_tokens) for (mode, setting), e in engines.items()}
    level["wall_s"] = time.perf_counter() - start
    return {"level": level, "points": points}


def run_order(keys: list, rep: int) -> list:
    """The order of the modes' runs in repeat `rep`: as given in even repeats, reversed in odd
    ones, so that over two repeats no mode always runs right after another (a drift in the host's
    or the GPU's speed within a repeat then biases no pair of modes the same way every time)."""
    return keys if rep % 2 == 0 else keys[::-1]


def _points(runs, workload, concurrency, temperature):
    """The per-(mode, setting) results of one temperature: every repeat, each number's spread,
    the decode speedup over none paired by repeat, and (compact) whether it is not below the
    best other mode within the spread."""
    none = runs.get(("none", None))
    out = []
    for (mode, setting), reps in runs.items():
        point = {
            "workload": workload.key,
            "concurrency": concurrency,
            "temperature": temperature,
            "mode": mode,
            "setting": setting,
            "repeats": reps,
        }
        for field in SPREAD_FIELDS:
            point[field] = metrics.spread([r[field] for r in reps])
        for q in ("mean", "p50", "p99"):
            point[f"ttft_ms_{q}"] = metrics.spread([r["ttft_ms"][q] for r in reps])
        if none is not None and mode != "none":
            point["speedup_vs_none"] = metrics.spread(
                [
                    r["decode_tokens_per_s"] / b["decode_tokens_per_s"]
                    for r, b in zip(reps, none)
                    if r["decode_tokens_per_s"] and b["decode_tokens_per_s"]
                ]
            )
        out.append(point)
    for point in out:
        if point["mode"] == "compact":
            others = [
                p["decode_tokens_per_s"]
                for p in out
                if p["mode"] != "compact" and p["setting"] in (None, point["setting"])
            ]
            point["not_below_others"] = metrics.not_below(point["decode_tokens_per_s"], others) if others else None
    return out
