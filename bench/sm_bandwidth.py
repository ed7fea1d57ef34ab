"""How fast G programs (one an SM) can stream HBM: the read rate a kernel with few programs can reach.

A split-free or cluster-merged verify attention reads a request's K and V with a few dozen
programs instead of one a SM; this measures what such a design can hope for. Each of G programs
reads its contiguous share of a [rows, 256] bf16 array (512 bytes a row, a K cache row at D 256) in
blocks of `block_rows` rows:
* triton (`--configs block_rows:num_stages`): Pallas, Triton lowering, unmasked pointer loads,
  summed; writes one [256] float32 row a program (checked against XLA's sum);
* tma (`--tma-configs block_rows:slots`): Mosaic GPU, one warpgroup keeping `slots` TMA copies in
  flight (a slot is refilled as soon as its copy lands; nothing computes); writes its last block
  back (checked against the input).
The time is the GPU's busy time of the kernel (profiler trace), a call's share of R calls on R
distinct arrays in one jitted function (R * size >= --min-set-mb, so that L2, 60 MB, holds none of
them at the small sizes), the rate = bytes read / time, per program = rate / G. `--mb` takes a list
(MiB; a program's share is rounded to whole blocks, the bytes read are printed): e.g. the K + V
bytes of the verify attention shapes 1 x 1k, 1 x 4k, 8 x 1k (4.03, 16.03, 32.25 MiB) give the least
time a kernel of each kind takes just to read them.

Usage (GPU machine): PYTHONPATH=$PWD python3 bench/sm_bandwidth.py --out $OUT
Writes DIR/sm_bandwidth.json and prints a table.
"""
import argparse
import functools
import json
import os

import benchutil  # bench/benchutil.py: the script directory is first on sys.path

D = 256


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", default="64", help="MiB read a call, spread over the programs; a list")
    ap.add_argument("--min-set-mb", type=float, default=512.0, help="distinct arrays cycled: at least this many MiB")
    ap.add_argument("--programs", default="16,32,64,132,264")
    ap.add_argument("--configs", default="64:2,64:3,64:4,128:3,32:4", help="block_rows:num_stages,...")
    ap.add_argument("--tma-configs", default="64:2,64:4,64:6,128:3", help="block_rows:slots,... ('' skips)")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/out"))
    args = ap.parse_args(argv)
    benchutil.setup_jax(False)
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu
    import jax.experimental.pallas.mosaic_gpu as plmgpu

    def kernel(x_ref, o_ref, *, rows_per_program, block_rows):
        p = pl.program_id(0)
        lo = p * rows_per_program
        cols = jnp.arange(D, dtype=jnp.int32)

        def body(b, acc):
            rows = lo + b * block_rows + jnp.arange(block_rows, dtype=jnp.int32)
            blk = plgpu.load(x_ref.at[rows[:, None], cols[None, :]])
            return acc + jnp.sum(blk.astype(jnp.float32), axis=0)

        acc = jax.lax.fori_loop(0, rows_per_program // block_rows, body, jnp.zeros((D,), jnp.float32))
        o_ref[p, :] = acc

    def tma_kernel(x_ref, o_ref, buf, landed, *, blocks, slots):
        p = jax.lax.axis_index("p")
        for b in range(min(slots, blocks)):
            plmgpu.copy_gmem_to_smem(x_ref.at[p, b], buf.at[b], landed.at[b])

        @pl.loop(0, blocks)
        def _stream(b):
            slot = b % slots
            plmgpu.barrier_wait(landed.at[slot])

            @pl.when(b + slots < blocks)
            def _refill():
                plmgpu.copy_gmem_to_smem(x_ref.at[p, b + slots], buf.at[slot], landed.at[slot])

        plmgpu.copy_smem_to_gmem(buf.at[(blocks - 1) % slots], o_ref.at[p])
        plmgpu.wait_smem_to_gmem(0)

    def triton_case(g, block_rows, stages, rows_per_program):
        x = jax.random.normal(jax.random.key(g), (g * rows_per_program, D), jnp.bfloat16)
        fn = jax.jit(pl.pallas_call(
            functools.partial(kernel, rows_per_program=rows_per_program, block_rows=block_rows),
            out_shape=jax.ShapeDtypeStruct((g, D), jnp.float32), grid=(g,),
            compiler_params=plgpu.CompilerParams(num_warps=args.warps, num_stages=stages)))
        want = x.astype(jnp.float32).reshape(g, rows_per_program, D).sum(axis=1)
        return fn, x, bool(jnp.allclose(fn(x), want, rtol=1e-3, atol=1e-1))

    def tma_case(g, block_rows, slots, rows_per_program):
        blocks = rows_per_program // block_rows
        x = jax.random.normal(jax.random.key(g), (g, blocks, block_rows, D), jnp.bfloat16)
        fn = jax.jit(plmgpu.kernel(
            functools.partial(tma_kernel, blocks=blocks, slots=slots),
            out_type=jax.ShapeDtypeStruct((g, block_rows, D), jnp.bfloat16), grid=(g,), grid_names=("p",),
            scratch_types=[plmgpu.SMEM((slots, block_rows, D), jnp.bfloat16), plmgpu.Barrier(num_barriers=slots)]))
        return fn, x, bool(jnp.array_equal(fn(x), x[:, -1]))

    cases = [("triton", cfg, triton_case) for cfg in args.configs.split(",") if cfg]
    cases += [("tma", cfg, tma_case) for cfg in args.tma_configs.split(",") if cfg]
    results = []
    for mb in (float(v) for v in args.mb.split(",")):
        for g in (int(v) for v in args.programs.split(",")):
            for mode, cfg, make in cases:
                block_rows, depth = (int(v) for v in cfg.split(":"))
                rows_per_program = max(block_rows, round(mb * 2**20 / (2 * D) / g / block_rows) * block_rows)
                fn, x, ok = make(g, block_rows, depth, rows_per_program)
                n_sets = max(1, -(-int(args.min_set_mb * 2**20) // (x.size * 2)))
                xs = [x] + [x + i for i in range(1, n_sets)]                 # distinct buffers
                cycled = jax.jit(lambda xs, fn=fn: [fn(v) for v in xs])
                busy = benchutil.gpu_kernel_times(cycled, xs, calls=5).get("busy_us")
                busy = busy and busy / n_sets
                nbytes = x.size * 2
                rate = nbytes / (busy * 1e-6) if busy else None
                row = dict(mode=mode, programs=g, block_rows=block_rows, depth=depth, bytes=nbytes, sets=n_sets,
                           busy_us=busy, tb_s=rate and rate / 1e12, gb_s_per_program=rate and rate / g / 1e9, ok=ok)
                results.append(row)
                print(f"{mode:6s} {nbytes / 2**20:7.2f} MiB G {g:4d} block {block_rows:4d} x {depth} deep: "
                      f"{busy:8.2f} us, {row['tb_s']:.2f} TB/s, {row['gb_s_per_program']:.1f} GB/s a program, ok {ok}",
                      flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sm_bandwidth.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
