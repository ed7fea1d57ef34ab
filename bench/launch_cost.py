"""What the host adds to a kernel inside one jitted call, on the GPU machine.

Four jitted functions of 16 tiny kernels each (a [12, 4096] bf16 array, ~1 µs of GPU time a
kernel): a Pallas kernel or an XLA fusion (kept apart by `optimization_barrier`), either chained on
one buffer (one argument, one result) or applied to 16 separate buffers (16 arguments, 16 results).
Per kernel: wall µs (median of `--reps` timings of `--inner` back-to-back dispatches, one sync),
GPU busy µs and GPU span µs (profiler trace, `benchutil.gpu_kernel_times`). Run it under different
XLA_FLAGS to see what XLA's command buffers (CUDA graphs) change.

Usage (GPU machine):
  PYTHONPATH=$PWD python3 bench/launch_cost.py
  XLA_FLAGS=--xla_gpu_enable_command_buffer= PYTHONPATH=$PWD python3 bench/launch_cost.py
Prints one JSON line.
"""
import argparse
import json
import os

import benchutil  # bench/benchutil.py: the script directory is first on sys.path

KERNELS = 16


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--inner", type=int, default=10)
    args = ap.parse_args()
    benchutil.setup_jax(smoke=False)
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    on_gpu = jax.default_backend() == "gpu"

    def pallas_kernel(x):
        def body(x_ref, o_ref):
            o_ref[...] = x_ref[...] * 0.5 + 1

        spec = pl.BlockSpec((1, x.shape[1]), lambda i: (i, 0))
        return pl.pallas_call(body, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(x.shape[0],),
                              in_specs=[spec], out_specs=spec, interpret=not on_gpu)(x)

    def xla_kernel(x):
        return jax.lax.optimization_barrier(x * 0.5 + 1)

    def chained(kernel):
        def f(x):
            for _ in range(KERNELS):
                x = kernel(x)
            return x
        return f

    xs = [jnp.full((12, 4096), i, jnp.bfloat16) for i in range(KERNELS)]
    result = {"device": jax.devices()[0].device_kind, "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")}
    for name, kernel in (("pallas", pallas_kernel), ("xla", xla_kernel)):
        cases = (("chained", jax.jit(chained(kernel)), xs[0]),
                 ("separate", jax.jit(lambda xs, kernel=kernel: [kernel(x) for x in xs]), xs))
        for mode, fn, arg in cases:
            us, _ = benchutil.median_us(fn, arg, reps=args.reps, inner=args.inner)
            trace = benchutil.gpu_kernel_times(fn, arg) if on_gpu else {}
            result[f"{name} {mode}"] = {"wall_us": round(us / KERNELS, 2),
                                        "gpu_busy_us": round(trace.get("busy_us", 0.0) / KERNELS, 2),
                                        "gpu_span_us": round(trace.get("span_us", 0.0) / KERNELS, 2)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
