"""How fast G programs (one an SM) can stream HBM: the read rate a kernel with few programs can reach.

A split-free or cluster-merged verify attention reads a request's K and V with a few dozen
programs instead of one a SM; this measures what such a design can hope for. Each of G programs
(Pallas, Triton lowering) sums its contiguous share of a [rows, 256] bf16 array (512 bytes a row,
a K cache row at D 256) in blocks of `block_rows` rows, `num_stages` deep, and writes one [256]
float32 row; the time is the GPU's busy time of the kernel (profiler trace), the rate = bytes read
/ time, per program = rate / G.

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
    ap.add_argument("--mb", type=float, default=64.0, help="MB read a call (spread over the programs)")
    ap.add_argument("--programs", default="16,32,64,132,264")
    ap.add_argument("--configs", default="64:2,64:3,64:4,128:3,32:4", help="block_rows:num_stages,...")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/out"))
    args = ap.parse_args(argv)
    benchutil.setup_jax(False)
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

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

    results = []
    for g in (int(v) for v in args.programs.split(",")):
        for cfg in args.configs.split(","):
            block_rows, stages = (int(v) for v in cfg.split(":"))
            rows_per_program = max(block_rows, int(args.mb * 2**20 / (2 * D) / g) // block_rows * block_rows)
            x = jax.random.normal(jax.random.key(g), (g * rows_per_program, D), jnp.bfloat16)
            fn = jax.jit(pl.pallas_call(
                functools.partial(kernel, rows_per_program=rows_per_program, block_rows=block_rows),
                out_shape=jax.ShapeDtypeStruct((g, D), jnp.float32), grid=(g,),
                compiler_params=plgpu.CompilerParams(num_warps=args.warps, num_stages=stages)))
            got = fn(x)
            want = x.astype(jnp.float32).reshape(g, rows_per_program, D).sum(axis=1)
            ok = bool(jnp.allclose(got, want, rtol=1e-3, atol=1e-1))
            busy = benchutil.gpu_kernel_times(fn, x, calls=10).get("busy_us")
            nbytes = x.size * 2
            rate = nbytes / (busy * 1e-6) if busy else None
            row = dict(programs=g, block_rows=block_rows, stages=stages, bytes=nbytes, busy_us=busy,
                       tb_s=rate and rate / 1e12, gb_s_per_program=rate and rate / g / 1e9, ok=ok)
            results.append(row)
            print(f"G {g:4d} block {block_rows:4d} x {stages} stages: {busy:8.1f} us, "
                  f"{row['tb_s']:.2f} TB/s, {row['gb_s_per_program']:.1f} GB/s a program, ok {ok}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sm_bandwidth.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
