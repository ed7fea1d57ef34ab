"""Compilation ahead of the calls: lower programs in turn, compile them in threads; and a counter
of the compilations a block of code triggers."""

import concurrent.futures
import contextlib
import time


def precompile(jobs, workers):
    """Compile ahead of the calls: jobs [(name, lower_fn)]; each is lowered here in turn (tracing
    holds the GIL) and handed at once to a pool of `workers` threads that compile (XLA compiles
    outside the GIL, so compiles overlap each other and the next lowering). The calls then find
    the executables in jax's caches. Returns {name: {"lower_s", "compile_s" (wall of that
    compile, overlapping the others), "temp_bytes" (XLA's scratch buffers of the program beyond its
    arguments and outputs, None where the backend does not say), "compiled" (jax.stages.Compiled) or
    "error"}}."""

    def compile_one(low):
        t = time.perf_counter()
        try:
            compiled = low.compile()
        except Exception as e:  # noqa: BLE001 - the call compiles it instead
            return {"error": repr(e)[:300]}
        seconds = time.perf_counter() - t
        memory = compiled.memory_analysis()
        temp = None if memory is None else memory.temp_size_in_bytes
        return {"compile_s": seconds, "temp_bytes": temp, "compiled": compiled}

    out, futures = {}, {}
    with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
        for name, fn in jobs:
            t = time.perf_counter()
            try:
                low = fn()
            except Exception as e:  # noqa: BLE001
                out[name] = {"error": repr(e)[:300]}
                continue
            out[name] = {"lower_s": time.perf_counter() - t}
            futures[name] = pool.submit(compile_one, low)
        for name, future in futures.items():
            out[name].update(future.result())
    return out


@contextlib.contextmanager
def counting():
    """Yields a list that collects the names of the functions XLA compiles inside the block (a
    benchmark's timed runs should find it empty: everything was compiled ahead)."""
    import jax

    seen = []

    def listen(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            seen.append(str(kwargs.get("fun_name")))

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
