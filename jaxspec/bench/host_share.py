"""The host's share of a concurrency-1 decode step, from a profiler trace of the real host loop."""

import time

from jaxspec.bench import trace


def host_share(engine, prompt, *, turns, sampling, seed=0) -> dict:
    """One request decoding alone on an idle `engine`; after its first token, `turns` turns of the
    host loop (`Engine.step`) run untimed by any profiler, then `turns` more under the profiler.

    wall_ms: the untraced turns' wall time / the device steps they read (the profiler's own
    overhead left out; traced_wall_ms: the same under the profiler); gpu_busy_ms: the time at
    least one kernel runs (the union of the kernels' intervals: kernels of a CUDA graph overlap)
    / the steps its turns read (the step in flight at either end makes it approximate to about one
    step in `turns`); kernel_sum_ms: the kernels' summed durations a step; host_share = 1 -
    gpu_busy / wall: the part of a step the GPU waits for the host. GPU fields are None where the
    trace holds no GPU kernel (a CPU run). The request asks for enough tokens to outlast both
    windows and is run to its end.
    """
    window = engine.window
    engine.submit(
        prompt, min(engine.spec.max_len - len(prompt) - window, (2 * turns + 4) * window), seed=seed, **sampling
    )
    first = False
    while engine.busy and not first:
        first = any(event.first for event in engine.step())

    def turns_wall():
        before, start = engine.totals["steps"], time.perf_counter()
        for _ in range(turns):
            if not engine.busy:
                break
            engine.step()
        return time.perf_counter() - start, engine.totals["steps"] - before

    wall_s, steps = turns_wall()
    box = {}
    gpu, _ = trace.traced(lambda: box.update(zip(("wall_s", "steps"), turns_wall())))
    while engine.busy:
        engine.step()
    kernels = [e for e in gpu if not trace.is_copy(e)]
    traced_steps = max(box["steps"], 1)
    wall_ms = wall_s * 1e3 / max(steps, 1)
    busy_ms = trace.busy_ns(kernels) / 1e6 / traced_steps if kernels else None
    sum_ms = sum(e[1] for e in kernels) / 1e6 / traced_steps if kernels else None
    return {
        "steps": steps,
        "traced_steps": box["steps"],
        "wall_ms": wall_ms,
        "traced_wall_ms": box["wall_s"] * 1e3 / traced_steps,
        "gpu_busy_ms": busy_ms,
        "kernel_sum_ms": sum_ms,
        "host_share": 1.0 - busy_ms / wall_ms if busy_ms is not None else None,
        "kernels_per_step": len(kernels) / traced_steps if kernels else None,
    }
