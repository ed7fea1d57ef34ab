"""Pieces the GPU benchmark scripts share: the JAX process setup, the `__main__` entry with its
`--torch-copy` mode, one median timer, the copy bandwidths floors divide by (JAX's `x + 1` in the
script's process; torch's device-to-device copy, measured in a process of its own beforehand and
passed on through DIR/copy_bw_torch.json), and the GPU's own kernel times from a profiler trace."""

import glob
import json
import math
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TORCH_COPY_JSON = "copy_bw_torch.json"


def run_main(parse, main) -> None:
    """A script's `__main__`: args = parse(); with `args.torch_copy`, only `torch_copy_bandwidth(args.out)`
    (run it in a process of its own before the script: JAX holds the GPU's memory once started) and
    exit 0; else exit with main(args)'s status."""
    args = parse()
    if args.torch_copy:
        torch_copy_bandwidth(args.out)
        sys.exit(0)
    sys.exit(main(args))


def add_common_args(ap, budget: bool = True) -> None:
    """The flags the scripts share: --out DIR (default $OUT, else bench/out), --budget-s (with
    `budget`), --torch-copy (`run_main`'s own mode) and --smoke (CPU, interpret mode, tiny shapes)."""
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, "bench", "out"))
    if budget:
        ap.add_argument("--budget-s", type=float, default=1e9, help="start no new case after this many seconds")
    ap.add_argument(
        "--torch-copy",
        action="store_true",
        help="measure the torch copy bandwidth alone (in a process of its own, before the run), then exit",
    )
    ap.add_argument("--smoke", action="store_true", help="CPU, interpret mode, tiny shapes: checks the script")


def setup_jax(smoke: bool, *, require_gpu: bool | None = None) -> None:
    """Before JAX's first computation: the CPU for a smoke run (unless JAX_PLATFORMS says otherwise),
    no GPU memory preallocation (a torch or second JAX process may share the GPU), and the
    repository root importable. Without preallocation XLA's allocator still stops at its memory
    fraction, 75% of the GPU by default (60 GB of an H100, which the 64-layer 27B-shaped target's
    57 GB of weights and its state overran), so that fraction is 0.95 unless XLA_CLIENT_MEM_FRACTION
    (or its deprecated name, never both: the CUDA plugin then fails) is set. require_gpu (default:
    not smoke): exit naming the backend where JAX has no GPU, as when its CUDA plugin failed to
    start and JAX fell back to the CPU with only a warning, so no CPU timing passes for a GPU one."""
    if smoke:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        if "jax" in sys.modules:  # imported already: it read JAX_PLATFORMS then
            sys.modules["jax"].config.update("jax_platforms", os.environ["JAX_PLATFORMS"])
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if "XLA_CLIENT_MEM_FRACTION" not in os.environ and "XLA_PYTHON_CLIENT_MEM_FRACTION" not in os.environ:
        os.environ["XLA_CLIENT_MEM_FRACTION"] = "0.95"
    sys.path.insert(0, ROOT)
    if require_gpu is None:
        require_gpu = not smoke
    if require_gpu:
        import jax

        if jax.default_backend() != "gpu":
            sys.exit(
                f"{os.path.basename(sys.argv[0])}: JAX's backend is {jax.default_backend()!r}, not a GPU (see any "
                "plugin error above); this benchmark times the GPU: run it with --smoke to check it on the CPU"
            )


def median_us(fn, *args, reps, inner=1):
    """(median µs per call, last output) of `fn(*args)`: two untimed calls (compile, warm-up),
    then `reps` timings of `inner` back-to-back calls synchronised once (jax.block_until_ready),
    so dispatch overlaps the previous call's GPU work."""
    import jax

    jax.block_until_ready(fn(*args))
    out = fn(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(inner):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / inner)
    return statistics.median(times) * 1e6, out


def jax_copy_bandwidth(reps=10, inner=10) -> tuple[float, float]:
    """(bytes/s, µs) of a jitted `x + 1` over 1 GiB of float32 (read + write counted; 1 MiB off
    the GPU): `inner` chained calls with the input donated (no fresh 1 GiB output per call, and
    the dispatch overlaps the previous call), synchronised once, median over `reps`. XLA's
    elementwise pass is slower than torch's copy: floors against it are optimistic for the kernel."""
    import jax
    import jax.numpy as jnp

    n = (1 << 28) if jax.default_backend() == "gpu" else (1 << 18)
    step = jax.jit(lambda a: a + 1.0, donate_argnums=0)
    x = step(step(jnp.zeros((n,), jnp.float32)))
    jax.block_until_ready(x)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(inner):
            x = step(x)
        jax.block_until_ready(x)
        times.append((time.perf_counter() - start) / inner)
    us = statistics.median(times) * 1e6
    return 2 * x.nbytes / (us * 1e-6), us


def gemm_throughput(reps=5, inner=4) -> tuple[float, float]:
    """(FLOP/s, µs) of a jitted bfloat16 [n, n] @ [n, n] product with float32 accumulation, the
    tensor cores' rate on the kind of GEMM a verify at many tokens runs (n = 8192 on the GPU, 256
    elsewhere): `inner` back-to-back calls synchronised once, median over `reps`. The compute
    floor of a step divides its FLOPs by it."""
    import jax
    import jax.numpy as jnp

    n = 8192 if jax.default_backend() == "gpu" else 256
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    us, _ = median_us(jax.jit(lambda x: x @ x), a, reps=reps, inner=inner)
    return 2 * n**3 / (us * 1e-6), us


def torch_copy_bandwidth(out_dir) -> float:
    """Time a 1 GiB float32 device-to-device torch copy (read + write counted) with triton's
    do_bench, write DIR/copy_bw_torch.json, and return the bandwidth in bytes/s."""
    import torch
    from triton.testing import do_bench

    a = torch.empty(1 << 28, device="cuda")
    b = torch.empty_like(a)
    us = do_bench(lambda: b.copy_(a), return_mode="median") * 1e3
    bw = 2 * a.numel() * 4 / (us * 1e-6)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, TORCH_COPY_JSON), "w") as f:
        json.dump(dict(us=us, TB_per_s=bw / 1e12), f)
    print(json.dumps({"kernel": "torch copy 1 GiB", "us": round(us, 1), "TB_per_s": round(bw / 1e12, 3)}))
    return bw


def read_torch_copy(out_dir) -> float | None:
    """The bandwidth (bytes/s) an earlier `torch_copy_bandwidth(out_dir)` wrote, or None."""
    try:
        with open(os.path.join(out_dir, TORCH_COPY_JSON)) as f:
            return json.load(f)["TB_per_s"] * 1e12
    except OSError:
        return None


def copy_bandwidths(out_dir) -> dict[str, float]:
    """The copy bandwidths (bytes/s) of this run: the jitted `x + 1` pass (`jax_copy_bandwidth`) and,
    when `torch_copy_bandwidth(out_dir)` ran first in its own process, the torch copy."""
    copies = {"jax x+1": jax_copy_bandwidth()[0]}
    if torch_bw := read_torch_copy(out_dir):
        copies["torch copy"] = torch_bw
    return copies


def floor_bandwidth(copies: dict[str, float]) -> tuple[str, float]:
    """(name, bytes/s) of the fastest copy: the floors divide by it (the strictest floor)."""
    return max(copies.items(), key=lambda kv: kv[1])


def floor_copies(out_dir) -> tuple[dict[str, float], str, float]:
    """(copies, name, bytes/s): `copy_bandwidths(out_dir)` and its `floor_bandwidth`, printed."""
    copies = copy_bandwidths(out_dir)
    name, bw = floor_bandwidth(copies)
    print(
        "copy bandwidth: " + ", ".join(f"{k} {v / 1e12:.3f} TB/s" for k, v in copies.items()) + f"; floors use {name}",
        flush=True,
    )
    return copies, name, bw


def cycled_sets(nbytes, min_calls=8, min_set_mb=512.0, max_sets=16, max_sets_gb=32.0) -> int:
    """How many distinct copies of an `nbytes` working set to cycle in one timing: at least
    `min_calls` and at least `min_set_mb` MiB in all (so L2, 60 MB, holds none of them, and one
    dispatch holds enough GPU work to outlast the host's next one), within `max_sets` copies and
    `max_sets_gb` GiB."""
    n = max(min_calls, math.ceil(min_set_mb * 2**20 / nbytes))
    return max(1, min(n, max_sets, int(max_sets_gb * 2**30 // nbytes)))


def gpu_kernel_times(fn, *args, calls=5) -> dict:
    """What the GPU itself spends on `fn(*args)`, from a jax profiler (CUPTI) trace of `calls`
    back-to-back calls after two untimed ones: {"span_us": (last kernel end - first kernel start) /
    calls: GPU time a call including the gaps between its kernels, and any wait for the host's
    dispatch; "busy_us": the kernels' summed durations / calls, what the GPU spends with the gaps
    left out; "kernels": {name: median µs}; "lines": the trace's GPU line names}. Empty dict
    where the trace holds no GPU kernel (CPU runs)."""
    import jax
    from jax.profiler import ProfileData

    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        jax.profiler.stop_trace()
        paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
        events, lines = [], set()
        for plane in ProfileData.from_file(paths[0]).planes if paths else ():
            if not plane.name.startswith("/device:GPU"):
                continue
            for line in plane.lines:  # stream lines; "XLA Ops" / "XLA Modules" are derived
                lines.add(line.name)
                if "stream" in line.name.lower():
                    events += [(ev.start_ns, ev.duration_ns, ev.name) for ev in line.events]
    kernels = [e for e in events if "memcpy" not in e[2].lower() and "memset" not in e[2].lower()]
    if not kernels:
        return {}
    start = min(e[0] for e in kernels)
    end = max(e[0] + e[1] for e in kernels)
    by_name: dict[str, list[float]] = {}
    for _, dur, name in kernels:
        by_name.setdefault(name, []).append(dur / 1e3)
    return {
        "span_us": (end - start) / 1e3 / calls,
        "busy_us": sum(e[1] for e in kernels) / 1e3 / calls,
        "lines": sorted(lines),
        "kernels": {name: statistics.median(v) for name, v in by_name.items()},
    }
