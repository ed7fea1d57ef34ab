"""The least time a verify attention kernel's data movement takes: its skeleton, with no math.

bench/sm_bandwidth.py gives the least time any kernel takes to read a shape's K / V. A verify
attention kernel must also learn where to read (a request's slot and length, one dependent load
before its first K / V copy), load its queries and, where it splits the keys, merge the splits'
partial outputs. This script times Mosaic GPU kernels that do exactly that data movement, at the
verify shapes, and compute nothing: a kernel that also multiplies, exponentiates and merges cannot
be faster than its skeleton, so a skeleton over a time goal puts the goal out of reach of that
design (each variant leaves out work the real kernel has, e.g. the second scalar level slots ->
seq_lens, the lse exchange, the proxy fence between a peer's TMA store and load: the bound stays
a lower bound).

One CTA a (request r, kv head g, split s); 64 query rows (T 8 x GQA 6 = 48 real) a CTA, D 256,
bf16, n = context + 8 keys a request, M = context + 16 rounded up to 64 (the Mosaic kernel's blocked
cache view), split s covering blocks [s nb // S, (s + 1) nb // S) of the nb = cdiv(n, block_k)
blocks of block_k keys (an even share; the kernels round a split up to whole blocks). Modes:
* read: K / V of the split streamed by TMA (`slots` K and V blocks in flight, a slot refilled as soon
  as its copy lands), the slot taken from the grid (slot r + 1) and n static: no dependent load;
  the split's last 64 keys of V stored to o[r, g] (S = 1) or part[r, g, s] (S > 1). The pure read
  with the verify problem's boxes and grid;
* split: as read, but the request's (n, slot, nb) come first by a 16-byte TMA that the K / V
  copies wait for, and the CTA also loads its [64, D] query tile (as S column slices, into the
  32 KB buffer that later takes the peers' slices): the first kernel of a split + combine design,
  whose second kernel comes on top;
* cluster: split, then the CTAs of a (request, kv head) as one cluster of S: each stores its partial
  [64, D] to a global scratch, a cluster barrier, each loads columns [s D/S, (s+1) D/S) of all S
  partials (TMA, from L2) and stores them to o: the one-kernel, cluster-merged design;
* dsmem: split, then the cluster merges through distributed shared memory: each CTA's partial is
  its q tile plus s (one register pass: the real kernel's normalisation of o), a cluster barrier,
  each CTA reads columns [s D/S, (s+1) D/S) of every peer's partial from the peer's shared memory
  (`plgpu.cluster_ref`, GPU only: interpret mode has no rule for it), sums them, stores them to o,
  and waits at a second cluster barrier (no CTA leaves while a peer may still read it);
* barrier: split, then a cluster barrier and each CTA's columns [s D/S, (s+1) D/S) of o stored
  (from its query slice: a contiguous shared-memory tile of the right size; TMA takes no strided
  one): no partial moves between CTAs, so no cluster-merged design (through global or distributed
  shared memory) can be faster.
`--layouts head-major` times the same on caches laid out [S1, KVH, M, D] (a CTA's keys contiguous)
instead of the project's [S1, M, KVH, D] (DESIGN.md; a CTA's 512-byte key rows 2 KB apart), to see
what the layout costs the read.
Every output is checked against numpy, so the copies are the right ones: a partial (or o at S = 1)
holds the split's last 64 keys of V; cluster: o's columns of CTA s are those of partial (s + 1) mod S;
dsmem: o = S q + S (S - 1) / 2 (bf16 tolerance); barrier: o = q.

The time is the GPU's busy time from a profiler trace, a call's share of R calls on R distinct
cache copies in one jitted function (benchutil.cycled_sets: L2 holds none of them).

Usage (GPU machine): PYTHONPATH=$PWD python3 bench/verify_floor.py --out $OUT
          (CPU): .venv/bin/python bench/verify_floor.py --smoke   (interpret mode, tiny shapes)
Writes DIR/verify_floor.json and prints a line a case.
"""
import argparse
import functools
import json
import os

import numpy as np

import benchutil  # bench/benchutil.py: the script directory is first on sys.path
from attention_kernel import cache_len  # the benchmark's cache length M of a context

T, KVH, D, ROWS = 8, 4, 256, 64          # window, kv heads, head dim, query rows a CTA (8 x GQA 6 = 48 real)
MODES = ("read", "split", "cluster", "dsmem", "barrier")


def plan(ctx, block_k):
    """(n keys, nb blocks): split s of S covers blocks [s nb // S, (s + 1) nb // S)."""
    n = ctx + T
    return n, -(-n // block_k)


def skeleton(mode, batch, ctx, splits, block_k, slots, head_major=False, interpret=False):
    """The jitted skeleton kernel f(info, q, k, v) -> (o, part): info [B, 4] int32 (n, slot, nb, 0);
    q [B, KVH, 64, D] bf16; k, v the blocked cache view, [S1, M / block_k, block_k, KVH, D] bf16
    ([S1, KVH, M / block_k, block_k, D] head-major); o [B, KVH, 64, D] bf16, part [B, KVH, S, 64, D]
    bf16."""
    import jax
    import jax.numpy as jnp
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    nb_static = plan(ctx, block_k)[1]
    tail = ROWS // block_k                      # blocks a partial (the split's last 64 keys) spans
    cols = D // splits
    clustered = mode in ("cluster", "dsmem", "barrier") and splits > 1

    def kernel(info_ref, q_ref, k_ref, v_ref, o_ref, part_ref, info_s, q_s, k_s, v_s, sum_s,
               info_bar, q_bar, k_bar, v_bar, peer_bar, *extra):
        r, g, s = jax.lax.axis_index("r"), jax.lax.axis_index("g"), jax.lax.axis_index("s")

        def store_o(src):                       # this CTA's columns of o
            plgpu.copy_smem_to_gmem(src, o_ref.at[r, g, :, pl.ds(s * cols, cols)])
            plgpu.wait_smem_to_gmem(0)

        def merge_gmem(cbar):
            plgpu.barrier_arrive(cbar)          # every partial of the cluster is in global memory
            plgpu.barrier_wait(cbar)
            for p in range(splits):
                plgpu.copy_gmem_to_smem(part_ref.at[r, g, p, :, pl.ds(s * cols, cols)], q_s.at[p], peer_bar.at[p])
            for p in range(splits):
                plgpu.barrier_wait(peer_bar.at[p])
            store_o(q_s.at[(s + 1) % splits])

        def merge_dsmem(cbar, *parts):
            for p in range(splits):
                parts[p][...] = (q_s[p].astype(jnp.float32) + s.astype(jnp.float32)).astype(jnp.bfloat16)
            plgpu.commit_smem()
            plgpu.barrier_arrive(cbar)          # every partial of the cluster is in its CTA's shared memory
            plgpu.barrier_wait(cbar)
            for c in range(splits):             # cluster_ref takes whole buffers only (jax 0.11.2)
                @pl.when(s == c)
                def _merge(c=c):
                    total = sum(plgpu.cluster_ref(parts[c], {"s": p})[...].astype(jnp.float32) for p in range(splits))
                    sum_s[...] = total.astype(jnp.bfloat16)
            plgpu.commit_smem()
            store_o(sum_s)
            plgpu.barrier_arrive(cbar)          # no CTA leaves while a peer may still read it
            plgpu.barrier_wait(cbar)

        def merge_barrier(cbar):
            plgpu.barrier_arrive(cbar)
            plgpu.barrier_wait(cbar)
            store_o(q_s.at[s])

        if mode == "read":
            slot, nb = r + 1, nb_static
        else:
            for p in range(splits):             # q in S column slices: its buffer then takes the peers' slices
                plgpu.copy_gmem_to_smem(q_ref.at[r, g, :, pl.ds(p * cols, cols)], q_s.at[p], q_bar.at[p])
            plgpu.copy_gmem_to_smem(info_ref.at[r], info_s, info_bar.at[0])
            plgpu.barrier_wait(info_bar.at[0])
            slot, nb = info_s[1], info_s[2]
        first = s * nb // splits
        blocks = (s + 1) * nb // splits - first

        def fetch(b, st):
            at = (slot, g, first + b) if head_major else (slot, first + b, slice(None), g)
            plgpu.copy_gmem_to_smem(k_ref.at[at], k_s.at[st], k_bar.at[st])
            plgpu.copy_gmem_to_smem(v_ref.at[at], v_s.at[st], v_bar.at[st])

        for b in range(slots):
            pl.when(b < blocks)(functools.partial(fetch, b, b))

        @pl.loop(0, blocks)
        def _stream(b):
            st = b % slots
            plgpu.barrier_wait(k_bar.at[st])
            plgpu.barrier_wait(v_bar.at[st])

            @pl.when(b + slots < blocks)
            def _refill():
                fetch(b + slots, st)

        if mode != "read":
            for p in range(splits):
                plgpu.barrier_wait(q_bar.at[p])
        if clustered and mode != "cluster":
            return (merge_dsmem if mode == "dsmem" else merge_barrier)(*extra)
        dest = o_ref.at[r, g] if splits == 1 else part_ref.at[r, g, s]
        for i in range(tail):                   # the split's last 64 keys of V: the partial's bytes
            b = blocks - tail + i
            plgpu.copy_smem_to_gmem(v_s.at[b % slots], dest.at[pl.ds(i * block_k, block_k)])
        plgpu.wait_smem_to_gmem(0)
        if clustered:
            merge_gmem(*extra)

    scratch = [
        plgpu.SMEM((4,), jnp.int32),
        plgpu.SMEM((splits, ROWS, cols), jnp.bfloat16),      # q's column slices, then the peers' (32 KB)
        plgpu.SMEM((slots, block_k, D), jnp.bfloat16),
        plgpu.SMEM((slots, block_k, D), jnp.bfloat16),
        plgpu.SMEM((ROWS, cols) if mode == "dsmem" else (8, 8), jnp.bfloat16),    # dsmem: the merged columns
        plgpu.Barrier(num_barriers=1),
        plgpu.Barrier(num_barriers=splits),
        plgpu.Barrier(num_barriers=slots),
        plgpu.Barrier(num_barriers=slots),
        plgpu.Barrier(num_barriers=splits),
        *([plgpu.ClusterBarrier(collective_axes=("s",))] if clustered else []),
        *([plgpu.SMEM((ROWS, cols), jnp.bfloat16)] * splits if clustered and mode == "dsmem" else []),
    ]
    out_type = (jax.ShapeDtypeStruct((batch, KVH, ROWS, D), jnp.bfloat16),
                jax.ShapeDtypeStruct((batch, KVH, splits, ROWS, D), jnp.bfloat16))
    grid = dict(grid=(batch, KVH), grid_names=("r", "g"), cluster=(splits,), cluster_names=("s",)) if clustered \
        else dict(grid=(batch, KVH, splits), grid_names=("r", "g", "s"))
    return jax.jit(plgpu.kernel(kernel, out_type=out_type, scratch_types=scratch, **grid,
                                interpret=plgpu.InterpretGPUParams() if interpret else None))


def inputs(batch, ctx, splits, block_k, seed, head_major=False):
    """(info, q, k, v) of a shape: request r in slot r + 1, n keys, the blocked cache view."""
    import jax
    import jax.numpy as jnp

    m = cache_len(ctx)
    n, nb = plan(ctx, block_k)
    info = jnp.array([[n, r + 1, nb, 0] for r in range(batch)], jnp.int32)
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (batch, KVH, ROWS, D), jnp.bfloat16)
    shape = (batch + 1, KVH, m // block_k, block_k, D) if head_major else (batch + 1, m // block_k, block_k, KVH, D)
    return info, q, jax.random.normal(keys[1], shape, jnp.bfloat16), jax.random.normal(keys[2], shape, jnp.bfloat16)


def expected(mode, batch, ctx, splits, block_k, q, v, head_major=False):
    """numpy (o, part) the skeleton must write (None where it writes nothing)."""
    n, nb = plan(ctx, block_k)
    vals = np.asarray(v.astype(np.float32))
    vals = np.moveaxis(vals, 1, 3) if head_major else vals        # [S1, M / bk, bk, KVH, D]
    flat = vals.reshape(vals.shape[0], -1, KVH, D)                # [S1, M, KVH, D]
    part = np.empty((batch, KVH, splits, ROWS, D), np.float32)
    for s in range(splits):
        end = (s + 1) * nb // splits * block_k                  # one past the split's last block
        part[:, :, s] = flat[1:batch + 1, end - ROWS:end].transpose(0, 2, 1, 3)
    if splits == 1:
        return part[:, :, 0], None
    if mode == "barrier":
        return np.asarray(q.astype(np.float32)), None
    if mode == "dsmem":
        return splits * np.asarray(q.astype(np.float32)) + splits * (splits - 1) / 2, None
    if mode != "cluster":
        return None, part
    cols = D // splits
    o = np.concatenate([part[:, :, (s + 1) % splits, :, s * cols:(s + 1) * cols] for s in range(splits)], axis=-1)
    return o, part


def check(mode, batch, ctx, splits, block_k, out, q, v, head_major=False):
    want_o, want_part = expected(mode, batch, ctx, splits, block_k, q, v, head_major)
    ok = True
    for got, want in zip(out, (want_o, want_part)):
        if want is None:
            continue
        got = np.asarray(got.astype(np.float32))
        if mode == "dsmem":                     # bf16 roundings of q + s and of the sum; a wrong peer is off by >= 1
            ok &= bool(np.allclose(got, want, rtol=2**-6, atol=0.25))
        else:                                   # copies: bit-exact
            ok &= bool(np.array_equal(got, want))
    return ok


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="8:1024,1:4096,1:1024", help="batch:context,...")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--splits", default="1,2,4,8,16", help="S a (request, kv head); cluster mode takes S <= 8")
    ap.add_argument("--configs", default="64:2,32:4", help="block_k:slots,... (K and V blocks in flight)")
    ap.add_argument("--layouts", default="slot-major", help="slot-major (the project's [S1, M, KVH, D] cache), "
                    "head-major ([S1, KVH, M, D]: a CTA's keys contiguous); a list")
    ap.add_argument("--min-ctas", type=int, default=16, help="skip cases with fewer CTAs than this")
    ap.add_argument("--smoke", action="store_true", help="CPU, interpret mode, small shapes")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/out"))
    return ap.parse_args(argv)


def cases(args):
    """(layout, batch, ctx, splits, block_k, slots) of the run: a split must hold a partial's 64 keys."""
    for layout in args.layouts.split(","):
        for shape in args.shapes.split(","):
            batch, ctx = (int(x) for x in shape.split(":"))
            for splits in (int(x) for x in args.splits.split(",")):
                for cfg in args.configs.split(","):
                    block_k, slots = (int(x) for x in cfg.split(":"))
                    if batch * KVH * splits >= args.min_ctas and plan(ctx, block_k)[1] // splits >= ROWS // block_k:
                        yield layout, batch, ctx, splits, block_k, slots


def main(argv=None):
    args = parse(argv)
    benchutil.setup_jax(args.smoke)
    import jax

    if args.smoke:          # interpret mode runs each CTA of a cluster as a thread blocking in a callback
        jax.config.update("jax_num_cpu_devices", 16)
        args.shapes, args.splits, args.configs, args.min_ctas = "2:100,1:200", "1,2,4", "64:2,32:4", 1
    os.makedirs(args.out, exist_ok=True)
    results = []
    for layout, batch, ctx, splits, block_k, slots in cases(args):
        head_major = layout == "head-major"
        info, q, k, v = inputs(batch, ctx, splits, block_k, seed=batch * 1000 + ctx + splits, head_major=head_major)
        for mode in args.modes.split(","):
            if mode in ("cluster", "dsmem", "barrier") and splits > 8 or mode == "dsmem" and splits > 1 and args.smoke:
                continue                # a portable cluster holds at most 8 CTAs; interpret mode has no cluster_ref
            fn = skeleton(mode, batch, ctx, splits, block_k, slots, head_major=head_major, interpret=args.smoke)
            ok = check(mode, batch, ctx, splits, block_k, fn(info, q, k, v), q, v, head_major)
            row = dict(mode=mode, layout=layout, batch=batch, context=ctx, splits=splits, ctas=batch * KVH * splits,
                       block_k=block_k, slots=slots, kv_mib=2 * batch * (ctx + T) * KVH * D * 2 / 2**20, ok=ok)
            if not args.smoke:
                n_sets = benchutil.cycled_sets(2 * k.nbytes)
                sets = [(k + i, v + i) for i in range(n_sets)]
                cycled = jax.jit(lambda sets, fn=fn: [fn(info, q, kc, vc) for kc, vc in sets])
                busy = benchutil.gpu_kernel_times(cycled, sets, calls=5).get("busy_us")
                row.update(sets=n_sets, busy_us=busy and busy / n_sets)
            results.append(row)
            with open(os.path.join(args.out, "verify_floor.json"), "w") as f:    # a cut run keeps its rows
                json.dump(results, f, indent=1)
            busy = row.get("busy_us")
            print(f"{mode:7s} {layout:10s} {batch:3d} x {ctx:5d}  S {splits:2d} ({row['ctas']:3d} CTAs)  block {block_k} x "
                  f"{slots} slots: " + (f"{busy:7.2f} us  " if busy else "") + f"ok {ok}", flush=True)


if __name__ == "__main__":
    main()
