"""Benchmark of the top-k and greedy argmax kernels (jaxspec/pallas/topk.py) against XLA.

Shapes: rows 1024 and 4096 x vocab 248,320 (Qwen3.5/3.6 vocabulary), float32 and bfloat16 logits,
k = 20 and 64. Per case: the kernel (both stages), stage 1 alone, `lax.top_k`, a two-stage chunked
`lax.top_k` (pad to a multiple of the chunk, top-k per chunk, top-k of the candidates; chunks 256
and 2048, the best is reported), and the greedy argmax kernel against `jnp.argmax`. Floor = logits
bytes (read once; the outputs and the ~3 % of candidate traffic are not counted) / copy bandwidth
measured in the same run: the best of a jitted elementwise pass over 1 GiB (read + write counted)
and, when `--torch-copy` ran first in its own process, a torch device-to-device copy. A read-only
XLA pass (`jnp.max` over 1 GiB) is reported too.

Timing: each jitted call is dispatched `inner` times back to back and synchronised once
(jax.block_until_ready); the median over `reps` of (wall time / inner). With kernels of >= 100 us
the dispatch (~10-20 us) overlaps the previous call's GPU work. The inputs (1-4 GB) are far larger
than the 60 MB L2, so repeated calls on one buffer measure DRAM, not the cache.

Also: adversarial inputs at 1024 rows, k = 64 (`--adversarial`, on by default): heavy ties (integer
logits; and the same times 1 + 2^-10, which float32 holds but bfloat16 does not), a high block at
the start of every chunk (stage 1 bisects in every chunk), and 99 % -inf (masked vocabulary); and
`--sweep`: TopKConfig chunk x num_warps x stage-2 warps x bisection x pack_bf16 (`--sweep-pack 1,0`:
bf16 rows only) x stage2 (`--sweep-stage2 rounds,filter`) at 1024 rows.

GPU busy (chunk-maxima rows): the kernels' summed durations a call, from a profiler trace
(benchutil.gpu_kernel_times), what the GPU spends whatever the host's dispatch costs.

Every row also times the lane-buffer top-k (jaxspec/pallas/topk_lanes.py) at each `--lanes-configs`
entry and the chunk-maxima top-k (jaxspec/pallas/topk_maxima.py) at each `--maxima-configs` entry, on
the Gaussian and the adversarial inputs (`--no-chunked`: those two alone).

Every kernel result is checked against `lax.top_k` / `jnp.argmax` (indices equal, values equal)
in the same run; the `ok` column says so.

Usage (GPU machine):
  python3 bench/topk_kernel.py --torch-copy        (own process first: torch copy bandwidth)
  PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false python3 bench/topk_kernel.py --out $OUT [--sweep]
  python3 bench/topk_kernel.py --smoke             (CPU, interpret mode, tiny shapes: checks the script)
Writes DIR/topk_bench.md and DIR/topk_bench.json (DIR = --out, default $OUT or bench/out).
"""
import argparse
import itertools
import json
import os
import sys
import time

import benchutil  # bench/benchutil.py: the script directory is first on sys.path

HERE = os.path.dirname(os.path.abspath(__file__))


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(HERE, "out"))
    ap.add_argument("--rows", default="1024,4096")
    ap.add_argument("--vocab", type=int, default=248320)
    ap.add_argument("--ks", default="20,64")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--inner", type=int, default=5)
    ap.add_argument("--xla-reps", type=int, default=3, help="reps for the slow XLA baselines")
    ap.add_argument("--no-xla", action="store_true", help="skip lax.top_k and the two-stage baseline")
    ap.add_argument("--no-adversarial", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="TopKConfig sweep at the first row count")
    ap.add_argument("--sweep-chunks", default="2048,4096,8192,16384")
    ap.add_argument("--sweep-warps", default="4,8,16", help="stage-1 warps of the sweep")
    ap.add_argument("--sweep-bisection", default="inline", help="TopKConfig.bisection values of the sweep")
    ap.add_argument("--sweep-stage2-warps", default="4,8")
    ap.add_argument("--sweep-pack", default="1", help="TopKConfig.pack_bf16 values of the sweep (1 / 0)")
    ap.add_argument("--sweep-stage2", default="rounds", help="TopKConfig.stage2 values of the sweep")
    ap.add_argument("--lanes-configs", default="512:6:0:4:8",
                    help="LanesConfig lanes:keep:segment:num_warps:unroll[:slots] (segment / slots "
                         "0: default) to time; '' none")
    ap.add_argument("--maxima-configs", default="16:16:16:2:0:4:2",
                    help="MaximaConfig chunk:group:blocks_per_step:unroll:steps:num_warps:select_warps (steps 0: "
                         "default) to time; '' none")
    ap.add_argument("--no-chunked", action="store_true",
                    help="skip the chunked kernel, the argmax and their table (lane / maxima kernels only)")
    ap.add_argument("--budget-s", type=float, default=1e9, help="start no new case after this many seconds")
    ap.add_argument("--torch-copy", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    if args.smoke:
        args.rows, args.vocab, args.ks, args.reps, args.inner, args.xla_reps = "4,8", 3000, "5,20", 2, 1, 1
    return args


def main(args):
    benchutil.setup_jax(args.smoke)
    import jax
    import jax.numpy as jnp
    from jaxspec.pallas import topk as tk
    from jaxspec.pallas import topk_lanes as tl
    from jaxspec.pallas import topk_maxima as tm

    os.makedirs(args.out, exist_ok=True)
    t_start = time.time()
    dev = jax.devices()[0]
    on_gpu = jax.default_backend() == "gpu"
    dtypes = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

    def timed(fn, *a, reps=None, inner=None):
        return benchutil.median_us(fn, *a, reps=reps or args.reps, inner=inner or args.inner)

    # ---- bandwidth, same run
    copies = benchutil.copy_bandwidths(args.out)
    bw_src, bw = benchutil.floor_bandwidth(copies)
    nbw = (1 << 28) if on_gpu else (1 << 20)
    big = jax.random.normal(jax.random.key(1), (nbw,), jnp.float32)
    read_us, _ = timed(jax.jit(jnp.max), big, reps=10, inner=3)
    read_bw = big.nbytes / (read_us * 1e-6)
    del big
    print("copy bandwidth: " + ", ".join(f"{k} {v / 1e12:.3f} TB/s" for k, v in copies.items())
          + f"; read-only jnp.max {read_bw / 1e12:.3f} TB/s; floors use {bw_src}", flush=True)

    results, adversarial, sweep, lanes, maxima = [], [], [], [], []
    maxima_configs = [tm.MaximaConfig(chunk=int(a), group=int(b), blocks_per_step=int(c), unroll=int(d),
                                      steps=int(e) or None, num_warps=int(f), select_warps=int(g))
                      for a, b, c, d, e, f, g in (spec.split(":") for spec in args.maxima_configs.split(",") if spec)]
    lanes_configs = [tl.LanesConfig(lanes=int(a), keep=int(b), segment=int(c) or None, num_warps=int(d), unroll=int(e),
                                    slots=int(f[0]) if f and int(f[0]) else None)
                     for a, b, c, d, e, *f in (spec.split(":") for spec in args.lanes_configs.split(",") if spec)]

    def lax_top_k(k):
        return jax.jit(lambda x: jax.lax.top_k(x, k))

    def two_stage(k, chunk):
        @jax.jit
        def f(x):
            rows, vocab = x.shape
            pad = (-vocab) % chunk
            xp = jnp.pad(x, ((0, 0), (0, pad)), constant_values=-jnp.inf)
            c = xp.reshape(rows, -1, chunk)
            v1, i1 = jax.lax.top_k(c, min(k, chunk))
            i1 = i1 + (jnp.arange(c.shape[1], dtype=jnp.int32) * chunk)[None, :, None]
            v2, j = jax.lax.top_k(v1.reshape(rows, -1), k)
            return v2, jnp.take_along_axis(i1.reshape(rows, -1), j, -1)
        return f

    def same(a, b):
        va, ia = a
        vb, ib = b
        return bool(jnp.array_equal(ia, ib)) and bool(jnp.array_equal(va.astype(jnp.float32), vb.astype(jnp.float32)))

    def dump():
        summary = dict(device=dev.device_kind, backend=jax.default_backend(), jax=jax.__version__,
                       copy_TB_per_s={k: round(v / 1e12, 3) for k, v in copies.items()},
                       floor_bandwidth=bw_src, read_only_TB_per_s=round(read_bw / 1e12, 3),
                       vocab=args.vocab, smoke=args.smoke, results=results, adversarial=adversarial, sweep=sweep,
                       lanes=[{**r, "config": str(r["config"])} for r in lanes],
                       maxima=[{**r, "config": str(r["config"])} for r in maxima])
        with open(os.path.join(args.out, "topk_bench.json"), "w") as f:
            json.dump(summary, f, indent=1)
        fmt = lambda v, d=1: "–" if v is None else f"{v:.{d}f}"
        lines = [f"# top-k / argmax kernels, {dev.device_kind} ({jax.default_backend()}), jax {jax.__version__}"
                 + (" — SMOKE (CPU interpret, tiny shapes: no meaning as timings)" if args.smoke else ""), "",
                 f"vocab {args.vocab}. Copy bandwidth (same run, {nbw * 4 >> 20} MiB): "
                 + ", ".join(f"{k} {v / 1e12:.3f} TB/s" for k, v in copies.items())
                 + f"; read-only `jnp.max` {read_bw / 1e12:.3f} TB/s. floor = logits bytes / {bw_src}.", "",
                 "| rows | dtype | k | kernel µs | stage 1 µs | floor µs | floor/kernel | lax.top_k µs | two-stage µs "
                 "(chunk) | × vs lax | × vs two-stage | ok | argmax kernel µs | jnp.argmax µs | × | argmax ok |",
                 "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in results:
            lines.append(
                f"| {r['rows']} | {r['dtype']} | {r['k']} | {fmt(r['kernel_us'])} | {fmt(r['stage1_us'])} "
                f"| {fmt(r['floor_us'])} | {fmt(r['floor_frac'], 2)} | {fmt(r['lax_us'], 0)} "
                f"| {fmt(r['two_stage_us'], 0)} ({r['two_stage_chunk']}) | {fmt(r['x_vs_lax'])} "
                f"| {fmt(r['x_vs_two_stage'])} | {r['ok']} | {fmt(r['argmax_us'])} | {fmt(r['jnp_argmax_us'])} "
                f"| {fmt(r['argmax_x'])} | {r['argmax_ok']} |")
        if adversarial:
            lines += ["", f"Adversarial inputs (k = {max(ks)}): kernel µs against the Gaussian-input time of the "
                      "same shape.", "",
                      "| rows | dtype | input | kernel µs | stage 1 µs | × gaussian | ok |", "|---|---|---|---|---|---|---|"]
            for r in adversarial:
                lines.append(f"| {r['rows']} | {r['dtype']} | {r['input']} | {fmt(r['kernel_us'])} "
                             f"| {fmt(r['stage1_us'])} | {fmt(r['x_gauss'], 2)} | {r['ok']} |")
        if sweep:
            lines += ["", "TopKConfig sweep (Gaussian input).", "",
                      "| rows | dtype | k | chunk | num_warps | stage2_warps | bisection | pack_bf16 | stage2 "
                      "| kernel µs | stage 1 µs | ok |",
                      "|---|---|---|---|---|---|---|---|---|---|---|---|"]
            for r in sweep:
                lines.append(f"| {r['rows']} | {r['dtype']} | {r['k']} | {r['chunk']} | {r['num_warps']} "
                             f"| {r['stage2_warps']} | {r['bisection']} | {r['pack_bf16']} | {r['stage2']} "
                             f"| {fmt(r['kernel_us'])} "
                             f"| {fmt(r['stage1_us'])} | {r['ok']} |")
        if lanes:
            lines += ["", "Lane-buffer top-k (pallas/topk_lanes.py): 'stage 1' = its kernel alone (the candidates, "
                      "flagged segments' exact redo included); flags = segments flagged.", "",
                      "| rows | dtype | k | input | config (lanes/keep/segment/warps/unroll/slots) | kernel µs | stage 1 µs "
                      "| floor µs | × floor | flags | ok |", "|---|---|---|---|---|---|---|---|---|---|---|"]
            for r in lanes:
                c = r["config"]
                lines.append(f"| {r['rows']} | {r['dtype']} | {r['k']} | {r['input']} | {c.lanes}/{c.keep}/{c.segment or 'auto'}"
                             f"/{c.num_warps}/{c.unroll}/{c.slots or 'auto'} | {fmt(r['kernel_us'])} | {fmt(r['stage1_us'])} | {fmt(r['floor_us'])} "
                             f"| {fmt(r['kernel_us'] / r['floor_us'], 2)} | {r['flags']} | {r['ok']} |")
        if maxima:
            lines += ["", "Chunk-maxima top-k (pallas/topk_maxima.py): 'stream' = its first kernel alone (chunk and "
                      "block maxima).", "",
                      "| rows | dtype | k | input | config (chunk/group/blocks_per_step/unroll/steps/warps/select_warps) "
                      "| kernel µs | stream µs | floor µs | × floor | GPU busy µs | busy × floor | ok |",
                      "|---|---|---|---|---|---|---|---|---|---|---|---|"]
            for r in maxima:
                c = r["config"]
                lines.append(f"| {r['rows']} | {r['dtype']} | {r['k']} | {r['input']} | {c.chunk}/{c.group}/"
                             f"{c.blocks_per_step}/{c.unroll}/{c.steps or 'auto'}/{c.num_warps}/{c.select_warps} "
                             f"| {fmt(r['kernel_us'])} | {fmt(r['stream_us'])} | {fmt(r['floor_us'])} "
                             f"| {fmt(r['kernel_us'] / r['floor_us'], 2)} | {fmt(r['busy_us'])} "
                             f"| {fmt(r['busy_us'] and r['busy_us'] / r['floor_us'], 2)} | {r['ok']} |")
        with open(os.path.join(args.out, "topk_bench.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
        return lines

    def kernel_times(x, k, config=None):
        plan = (config or tk.TopKConfig()).resolve(x.shape[0], x.shape[1], k)
        kus, out = timed(jax.jit(lambda x: tk.top_k(x, k, config=config)), x)
        s1us, _ = timed(jax.jit(lambda x: tk.top_k_candidates(x, k, plan, interpret=not on_gpu)), x)
        return kus, s1us, out

    def lanes_times(x, k, input_name, floor_us, ref):
        for cfg in lanes_configs:
            if over_budget():
                return
            plan = cfg.resolve(x.shape[0], x.shape[1], k, x.dtype)
            kus, out = timed(jax.jit(lambda x: tl.top_k(x, k, config=cfg)), x)
            s1us, (_, flags) = timed(jax.jit(lambda x: tl.top_k_candidates(x, k, plan, interpret=not on_gpu)), x)
            lanes.append(dict(rows=x.shape[0], dtype=jnp.dtype(x.dtype).name, k=k, input=input_name, config=cfg,
                              kernel_us=kus, stage1_us=s1us,
                              floor_us=floor_us, flags=int(flags.sum()), ok=same(out, ref)))
            print(dump()[-1], flush=True)

    def maxima_times(x, k, input_name, floor_us, ref):
        for cfg in maxima_configs:
            if over_budget():
                return
            plan = cfg.resolve(x.shape[0], x.shape[1], k, x.dtype)
            fn = jax.jit(lambda x: tm.top_k(x, k, config=cfg))
            kus, out = timed(fn, x)
            sus, _ = timed(jax.jit(lambda x: tm.chunk_maxima(x, plan, interpret=not on_gpu)), x)
            gpu = benchutil.gpu_kernel_times(fn, x) if on_gpu else {}
            maxima.append(dict(rows=x.shape[0], dtype=jnp.dtype(x.dtype).name, k=k, input=input_name, config=cfg,
                               kernel_us=kus, stream_us=sus, floor_us=floor_us, ok=same(out, ref),
                               busy_us=gpu.get("busy_us"), kernels=gpu.get("kernels")))
            print(dump()[-1], flush=True)

    def over_budget():
        return time.time() - t_start > args.budget_s

    rows_list = [int(r) for r in args.rows.split(",")]
    ks = [int(k) for k in args.ks.split(",")]
    for rows in rows_list:
        for dname in args.dtypes.split(","):
            dt = dtypes[dname]
            if over_budget():
                break
            x = (jax.random.normal(jax.random.key(rows), (rows, args.vocab), jnp.float32) * 3).astype(dt)
            floor_us = x.nbytes / bw * 1e6
            if not args.no_chunked:
                am_us, am = timed(jax.jit(lambda x: tk.argmax(x)), x)
                jam_us, jam = timed(jax.jit(lambda x: jnp.argmax(x, axis=-1)), x)
                am_ok = bool(jnp.array_equal(am, jam))
            for k in ks:
                if over_budget():
                    break
                ref = lax_top_k(k)(x)
                lanes_times(x, k, "gaussian", floor_us, ref)
                maxima_times(x, k, "gaussian", floor_us, ref)
                if args.no_chunked:
                    continue
                kus, s1us, out = kernel_times(x, k)
                ok = same(out, ref)
                lax_us = ts_us = None
                ts_chunk = None
                if not args.no_xla:
                    lax_us, _ = timed(lax_top_k(k), x, reps=args.xla_reps, inner=1)
                    for chunk in (256, 2048):
                        us, o = timed(two_stage(k, chunk), x, reps=args.xla_reps, inner=1)
                        if ts_us is None or us < ts_us:
                            ts_us, ts_chunk = us, chunk
                        ok = ok and same(o, ref)       # the baseline must agree too
                results.append(dict(
                    rows=rows, dtype=dname, k=k, kernel_us=kus, stage1_us=s1us, floor_us=floor_us,
                    floor_frac=floor_us / kus, lax_us=lax_us, two_stage_us=ts_us, two_stage_chunk=ts_chunk,
                    x_vs_lax=lax_us / kus if lax_us else None, x_vs_two_stage=ts_us / kus if ts_us else None,
                    ok=ok, argmax_us=am_us, jnp_argmax_us=jam_us, argmax_x=jam_us / am_us, argmax_ok=am_ok,
                    plan=tk.TopKConfig().resolve(rows, args.vocab, k),
                    argmax_plan=tk.ArgmaxConfig().resolve(rows, args.vocab, jnp.dtype(dt).itemsize)))
                print(dump()[-1], flush=True)
            del x

    if not args.no_adversarial:
        rows, k = rows_list[0], max(ks)
        for dname in args.dtypes.split(","):
            dt = dtypes[dname]
            base = next((r["kernel_us"] for r in results if r["rows"] == rows and r["dtype"] == dname and r["k"] == k), None)
            key = jax.random.key(7)
            chunk = tk.TopKConfig().resolve(rows, args.vocab, k)["chunk"]
            g = jax.random.normal(key, (rows, args.vocab), jnp.float32)
            col = jnp.arange(args.vocab)
            inputs = {
                "ties (integers -3..3)": jnp.round(g * 1.5).clip(-3, 3),
                "ties x (1 + 2^-10) (float32: not bf16-exact)": jnp.round(g * 1.5).clip(-3, 3) * (1 + 2**-10),
                "high block per chunk (bisection)": g + jnp.where(col % chunk < 200, 8.0, 0.0)[None, :],
                "99% -inf": jnp.where(jax.random.uniform(key, g.shape) < 0.99, -jnp.inf, g),
            }
            for name, xin in inputs.items():
                if over_budget():
                    break
                x = xin.astype(dt)
                ref = lax_top_k(k)(x)
                lanes_times(x, k, name, x.nbytes / bw * 1e6, ref)
                maxima_times(x, k, name, x.nbytes / bw * 1e6, ref)
                if args.no_chunked:
                    del x
                    continue
                kus, s1us, out = kernel_times(x, k)
                ok = same(out, ref)
                adversarial.append(dict(rows=rows, dtype=dname, input=name, kernel_us=kus, stage1_us=s1us,
                                        x_gauss=kus / base if base else None, ok=ok))
                print(dump()[-1], flush=True)
                del x
            del g, inputs

    if args.sweep:
        rows = rows_list[0]
        chunks = [int(c) for c in args.sweep_chunks.split(",")] if not args.smoke else (256, 1024)
        for dname in args.dtypes.split(","):
            dt = dtypes[dname]
            x = (jax.random.normal(jax.random.key(3), (rows, args.vocab), jnp.float32) * 3).astype(dt)
            for k in ks:
                ref = lax_top_k(k)(x)
                for chunk in chunks:
                    for nw in [int(w) for w in args.sweep_warps.split(",")]:
                        for s2w, bis, pack, st2 in itertools.product(
                                [int(w) for w in args.sweep_stage2_warps.split(",")], args.sweep_bisection.split(","),
                                [bool(int(v)) for v in args.sweep_pack.split(",")], args.sweep_stage2.split(",")):
                            if over_budget():
                                break
                            if not pack and dname != "bfloat16":
                                continue
                            cfg = tk.TopKConfig(chunk=chunk, num_warps=nw, stage2_warps=s2w, bisection=bis,
                                                pack_bf16=pack, stage2=st2)
                            try:
                                kus, s1us, out = kernel_times(x, k, cfg)
                                ok = same(out, ref)
                            except Exception as e:       # a config that fails is reported, the sweep goes on
                                print("sweep: config failed", chunk, nw, s2w, repr(e)[:300], flush=True)
                                kus = s1us = None
                                ok = False
                            sweep.append(dict(rows=rows, dtype=dname, k=k, chunk=chunk, num_warps=nw,
                                              stage2_warps=s2w, bisection=bis, pack_bf16=pack, stage2=st2,
                                              kernel_us=kus,
                                              stage1_us=s1us, ok=ok))
                            print(dump()[-1], flush=True)
            del x

    lines = dump()
    print("\n".join(lines), flush=True)
    bad = [r for r in results + adversarial + sweep + lanes + maxima if not r["ok"]] + [r for r in results if not r["argmax_ok"]]
    return 1 if bad else 0


if __name__ == "__main__":
    a = parse()
    if a.torch_copy:
        benchutil.torch_copy_bandwidth(a.out)
        sys.exit(0)
    sys.exit(main(a))
