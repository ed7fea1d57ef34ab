"""The building blocks of a one-kernel, cluster-merged verify attention, checked on the CPU.

At batch 1 / 4k the split + combine pair is launch-bound (bench/RESULTS.md, 2026-12-03 second
session); a cluster of CTAs that merges its partials itself would need no combine kernel. Each probe
is a tiny Mosaic GPU kernel, lowered for an H200 (tests/gpu_lowering.py) and run in interpret mode
against a numpy answer:

* dsmem: 4-CTA clusters sum their peers' shared-memory tiles through `plgpu.cluster_ref`;
* gmem: the same sum through global memory (TMA store of each CTA's tile, cluster barrier, TMA loads
  of the peers' tiles);
* scatter: per-token TMA stores of [rep, D] rows from an untiled shared-memory buffer into an output
  viewed as [N, KVH, rep, D] at [start + t, g] (the packed o of verify attention).

Usage (CPU): .venv/bin/python bench/cluster_probe.py. Prints one line a probe and stage ("ok",
"wrong" or the error). The GPU's answer (memory ordering between a peer's TMA store and load,
speed) is not probed here.
"""
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.experimental.pallas as pl  # noqa: E402
import jax.experimental.pallas.mosaic_gpu as plgpu  # noqa: E402
from gpu_lowering import lower_for_h200  # noqa: E402

C, R, D, H = 4, 64, 64, 3              # cluster size, tile rows and columns, clusters
T, KVH, REP, DQ, N = 8, 4, 6, 256, 40  # scatter: window, kv heads, GQA, head dim, packed rows


def _cluster_sum(kernel, n_out):
    def build(interpret):
        return plgpu.kernel(
            kernel, out_type=(jax.ShapeDtypeStruct((H, C, R, D), jnp.float32),) * n_out,
            grid=(H,), grid_names=("h",), cluster=(C,), cluster_names=("c",),
            scratch_types=[plgpu.SMEM((R, D), jnp.float32), plgpu.SMEM((R, D), jnp.float32),
                           plgpu.Barrier(num_barriers=1), plgpu.ClusterBarrier(collective_axes=("c",))],
            interpret=plgpu.InterpretGPUParams() if interpret else None)
    x = np.random.default_rng(0).standard_normal((H, C, R, D)).astype(np.float32)
    want = np.broadcast_to(x.sum(1, keepdims=True), x.shape)
    return build, (jax.ShapeDtypeStruct(x.shape, jnp.float32),), (jnp.asarray(x),), lambda out: out[-1], want


def dsmem_probe():
    def kernel(x_ref, o_ref, mine, total, bar, cbar):
        h, c = jax.lax.axis_index("h"), jax.lax.axis_index("c")
        plgpu.copy_gmem_to_smem(x_ref.at[h, c], mine, bar.at[0])
        plgpu.barrier_wait(bar.at[0])
        plgpu.barrier_arrive(cbar)                 # every CTA's tile is in its shared memory
        plgpu.barrier_wait(cbar)
        acc = mine[...]
        for k in range(1, C):
            acc = acc + plgpu.cluster_ref(mine, {"c": (c + k) % C})[...]
        total[...] = acc
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(total, o_ref.at[h, c])
        plgpu.wait_smem_to_gmem(0)
        plgpu.barrier_arrive(cbar)                 # no CTA leaves while a peer may still read it
        plgpu.barrier_wait(cbar)
    return _cluster_sum(kernel, 1)


def gmem_probe():
    def kernel(x_ref, part_ref, o_ref, mine, peer, bar, cbar):
        h, c = jax.lax.axis_index("h"), jax.lax.axis_index("c")
        plgpu.copy_gmem_to_smem(x_ref.at[h, c], mine, bar.at[0])
        plgpu.barrier_wait(bar.at[0])
        plgpu.copy_smem_to_gmem(mine, part_ref.at[h, c])
        plgpu.wait_smem_to_gmem(0)
        plgpu.barrier_arrive(cbar)                 # every partial is in global memory
        plgpu.barrier_wait(cbar)
        acc = mine[...]
        for k in range(1, C):
            plgpu.copy_gmem_to_smem(part_ref.at[h, (c + k) % C], peer, bar.at[0])
            plgpu.barrier_wait(bar.at[0])
            acc = acc + peer[...]
        mine[...] = acc
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(mine, o_ref.at[h, c])
        plgpu.wait_smem_to_gmem(0)
    return _cluster_sum(kernel, 2)


def scatter_probe():
    def kernel(info_ref, x_ref, o_ref, info_s, rows_s, bar):
        g = jax.lax.axis_index("g")
        plgpu.copy_gmem_to_smem(info_ref, info_s, bar.at[0])
        plgpu.barrier_wait(bar.at[0])
        start = info_s[0]
        plgpu.copy_gmem_to_smem(x_ref.at[g], rows_s, bar.at[0])
        plgpu.barrier_wait(bar.at[0])
        for t in range(T):
            plgpu.copy_smem_to_gmem(rows_s.at[pl.ds(t * REP, REP)], o_ref.at[start + t, g])
        plgpu.wait_smem_to_gmem(0)

    def build(interpret):
        return plgpu.kernel(
            kernel, out_type=jax.ShapeDtypeStruct((N, KVH, REP, DQ), jnp.bfloat16), grid=(KVH,), grid_names=("g",),
            scratch_types=[plgpu.SMEM((4,), jnp.int32), plgpu.SMEM((64, DQ), jnp.bfloat16),
                           plgpu.Barrier(num_barriers=1)],
            interpret=plgpu.InterpretGPUParams() if interpret else None)
    start = 5
    x = np.random.default_rng(1).standard_normal((KVH, 64, DQ)).astype(np.float32)
    x = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
    want = x[:, :T * REP].reshape(KVH, T, REP, DQ).transpose(1, 0, 2, 3)
    info = jnp.array([start, 0, 0, 0], jnp.int32)
    shapes = (jax.ShapeDtypeStruct((4,), jnp.int32), jax.ShapeDtypeStruct(x.shape, jnp.bfloat16))
    return build, shapes, (info, jnp.asarray(x, jnp.bfloat16)), lambda out: out[start:start + T], want


def _last_line(error):
    """The last line of an error (a callback's error carries the whole traceback)."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[-1][:160] if lines else ''}"


def main():
    for name, probe in (("dsmem", dsmem_probe), ("gmem", gmem_probe), ("scatter", scatter_probe)):
        build, shapes, args, pick, want = probe()
        try:
            lower_for_h200(build(False), *shapes)
            lowered = "ok"
        except Exception as e:  # noqa: BLE001 - a probe reports any failure
            lowered = _last_line(e)
        try:
            got = np.asarray(pick(build(True)(*args)), np.float32)
            interpreted = "ok" if np.allclose(got, want, atol=1e-4) else "wrong"
        except Exception as e:  # noqa: BLE001
            interpreted = _last_line(e)
        print(f"{name:8s} lower for H200: {lowered}; interpret mode: {interpreted}", flush=True)


if __name__ == "__main__":
    main()
