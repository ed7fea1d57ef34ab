"""The simulated-acceptance settings of a random-weight workload: (a, b) per target mean accept
length, calibrated on the draft features of probe runs (`simulation.calibrate`)."""

from jaxspec.bench import client, level
from jaxspec.bench.compile import precompile


def probe_features(work, cfg, sim, *, compile_first=False):
    """Draft features x [N, block - 1] of every verified row of a probe run: static mode at the
    first concurrency level under simulated acceptance `sim` (the programs the timed runs use:
    the setting is data), max(c, 8) requests at T = 0. compile_first: compile its programs ahead
    in threads (the first probe)."""
    from jaxspec.bench.workload import requests
    from jaxspec.engine import Engine

    c = cfg["concurrency"][0]
    probe = Engine(work.target, work.draft, level.spec_config("static", c, cfg, work, sim), record_trace=True)
    if compile_first:
        precompile(
            list(probe.lowerings(greedy=True, prompt_lengths=[cfg["prompt_len"]]).items()), cfg["compile_workers"]
        )
    client.closed_loop(
        probe, requests(work, max(c, 8), cfg["output_len"], cfg["seed"]), c, sampling={"temperature": 0.0}
    )
    return probe.recorder.trace().features


def calibrated(features, length, *, slope, seed) -> dict:
    """{"name": "acc<L>", "sim": SimulatedAcceptance, "calibration": `simulation.calibrate`'s dict}
    for mean accept length `length` on features [N, D]."""
    from jaxspec.config import SimulatedAcceptance
    from jaxspec.spec import simulation

    cal = simulation.calibrate(features, length, slope=slope)
    return {"name": f"acc{length:g}", "sim": SimulatedAcceptance(cal["a"], cal["b"], seed), "calibration": cal}


def settings(work, cfg) -> list[dict]:
    """One setting per cfg["accept_lengths"]: calibrated on a probe at a = 0, b = 0, then once
    more on a probe under that first setting (accepted drafts change the draft's context, so the
    features it sees shift); the first round is kept as calibration["first_round"]."""
    from jaxspec.config import SimulatedAcceptance

    x = probe_features(work, cfg, SimulatedAcceptance(0.0, 0.0, cfg["seed"]), compile_first=True)
    out = []
    for length in cfg["accept_lengths"]:
        first = calibrated(x, length, slope=cfg["sim_slope"], seed=cfg["seed"])
        setting = calibrated(probe_features(work, cfg, first["sim"]), length, slope=cfg["sim_slope"], seed=cfg["seed"])
        setting["calibration"]["first_round"] = first["calibration"]
        out.append(setting)
    return out
