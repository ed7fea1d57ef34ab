"""Verify attention: the Pallas kernel (jaxspec/pallas/attention_verify.py) against XLA and its byte floor.

Shapes: batch 1, 8, 64, 128 x context 1k, 4k, 32k (--shapes, the most informative first); T = 8
queries a request (every request full), 24 q heads / 4 kv heads, D = 256, bf16. A request's slot
holds `context` tokens, so its window reads n = context + 8 keys; the cache holds M = context + 16
rounded up to 64 rows.

Per shape: the kernel (default config); `launch`, a Pallas kernel that reads q and writes o (the
least a kernel costs at the shape); the jnp reference (`impl="ref"`) under jit, where its float32
K / V repeat fits (--ref-mem-gb); `jax.nn.dot_product_attention` (xla, cudnn) on the padded
equivalent, q [B, 8, 24, 256] against [B, M, 4, 256] with key_value_seq_lengths = n (no in-window
causal mask: same bytes and flops). Each kernel result is checked against the reference.
floor = K + V bytes read (B * n * 4 * 256 * 2 * 2) / the fastest copy of the run
(`benchutil.floor_copies`).

Timing: R distinct cache sets cycled inside one jitted function (R >= --min-calls and >= --min-set-mb
in all, within --max-sets and --max-sets-gb: L2 holds none, and a dispatch outlasts the host's next
one); `inner` dispatches back to back, synchronised once; median over reps of the wall time a call.
GPU busy / span: the kernels' summed durations / first start to last end, a call's share, from a
profiler trace (`benchutil.gpu_kernel_times`).
--sweep: configs at a few shapes; --sweep-configs block_k:num_stages:num_warps[:min_split
[:target_programs[:combine_block_d[:combine_warps]]]][:name=value...] or `default`, comma-separated,
and --sweep-shapes all | B:ctx,... replace them; --sweep-trace adds GPU times to the sweep rows.
--layer-stack: also L chained calls (L = R) on one layer each of [L, S1, M, KVH, D] stacks in one
jit, each o the next q (the engine's way), µs a layer.

Usage (GPU):
  python3 bench/attention_kernel.py --torch-copy --out $OUT        (own process, first)
  PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false python3 bench/attention_kernel.py --out $OUT \\
      [--sweep] [--layer-stack]
  python3 bench/attention_kernel.py --smoke                         (CPU, interpret mode, tiny shapes)
Writes DIR/attention_bench.json and DIR/attention_bench.md (DIR = --out, default $OUT or bench/out).
"""

import argparse
import json
import os
import time
import traceback

import benchutil  # bench/benchutil.py: the script directory is first on sys.path

# the most informative shapes first (a budget cut keeps them)
DEFAULT_ORDER = [
    (64, 4096),
    (1, 32768),
    (8, 4096),
    (128, 4096),
    (8, 32768),
    (1, 4096),
    (64, 32768),
    (128, 32768),
    (1, 1024),
    (8, 1024),
    (64, 1024),
    (128, 1024),
]


def cache_len(ctx):
    """M of a context: its window's 8 keys and 8 spare, rounded up to 64."""
    return -(-(ctx + 16) // 64) * 64


def sweep_config(text):
    """'32:3:4:64' -> the AttentionVerifyConfig fields block_k, num_stages, num_warps, min_split,
    target_programs, combine_block_d, combine_warps in that order, then any name=value fields
    ('32:2:4:64:264:partial_dtype=bfloat16'; values that read as integers are integers);
    'default' -> the default config."""
    tokens = text.split(":")
    if tokens[0] == "default":
        return {}
    named = [t for t in tokens if "=" in t]
    positional = [int(t) for t in tokens if "=" not in t]
    cfg = dict(
        zip(
            ("block_k", "num_stages", "num_warps", "min_split", "target_programs", "combine_block_d", "combine_warps"),
            positional,
        )
    )
    for item in named:
        name, value = item.split("=", 1)
        cfg[name] = int(value) if value.lstrip("-").isdigit() else value
    return cfg


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=None, help="B:ctx,B:ctx,... (default: the 12 shapes, informative first)")
    ap.add_argument("--T", type=int, default=8)
    ap.add_argument("--hq", type=int, default=24)
    ap.add_argument("--kvh", type=int, default=4)
    ap.add_argument("--D", type=int, default=256)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--inner", type=int, default=5)
    ap.add_argument("--xla-reps", type=int, default=5)
    ap.add_argument("--min-set-mb", type=float, default=512.0)
    ap.add_argument("--max-sets", type=int, default=16)
    ap.add_argument(
        "--min-calls",
        type=int,
        default=8,
        help="at least this many cache sets (calls) per dispatch, while they fit in --max-sets-gb",
    )
    ap.add_argument("--max-sets-gb", type=float, default=32.0)
    ap.add_argument("--ref-mem-gb", type=float, default=40.0)
    ap.add_argument("--no-xla", action="store_true", help="skip the reference and dot_product_attention")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument(
        "--sweep-configs",
        default=None,
        help="block_k:num_stages:num_warps[:min_split[:target_programs[:combine_block_d[:combine_warps]]]],..."
        " (default: a fixed list)",
    )
    ap.add_argument("--sweep-shapes", default=None, help="'all' (the 12 shapes) or B:ctx,... (default: 3 shapes)")
    ap.add_argument(
        "--layer-stack",
        action="store_true",
        help="also time the kernel the engine's way: L layers of stacked caches, o -> next q, one jit",
    )
    ap.add_argument("--sweep-trace", action="store_true", help="GPU trace (GPU µs) for every sweep config too")
    benchutil.add_common_args(ap)
    args = ap.parse_args(argv)
    if args.shapes:
        args.shape_list = [tuple(int(v) for v in s.split(":")) for s in args.shapes.split(",")]
    else:
        args.shape_list = DEFAULT_ORDER
    args.sweep_config_list = (
        None if not args.sweep_configs else [sweep_config(c) for c in args.sweep_configs.split(",")]
    )
    args.sweep_shape_list = (
        None
        if not args.sweep_shapes
        else DEFAULT_ORDER
        if args.sweep_shapes == "all"
        else [tuple(int(v) for v in s.split(":")) for s in args.sweep_shapes.split(",")]
    )
    if args.smoke:
        args.shape_list, args.reps, args.inner, args.xla_reps = [(2, 40), (1, 300)], 2, 1, 1
        args.hq, args.kvh, args.D, args.min_set_mb = 6, 2, 32, 0.0
    return args


def main(args):
    benchutil.setup_jax(args.smoke)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import pallas as pl

    from jaxspec.ops.attention import attention_verify as op_verify
    from jaxspec.pallas import attention_verify as pav

    os.makedirs(args.out, exist_ok=True)
    t_start = time.time()
    dev = jax.devices()[0]
    on_gpu = jax.default_backend() == "gpu"
    T, Hq, KVH, D = args.T, args.hq, args.kvh, args.D
    dt = jnp.bfloat16
    isz = 2

    def over_budget():
        return time.time() - t_start > args.budget_s

    def num_splits(B, M, config=None):
        """The kernel's key splits for B requests over a cache of M positions (its launch plan)."""
        config = config or pav.AttentionVerifyConfig()
        return config.resolve_call((B * T, Hq, D), (B + 1, M, KVH, D), T, B, dt)["num_splits"]

    def timed(fn, *a, reps=None, inner=None, per_call=1):
        us, out = benchutil.median_us(fn, *a, reps=reps or args.reps, inner=inner or args.inner)
        return us / per_call, out

    copies, bw_src, bw = benchutil.floor_copies(args.out)

    results, sweep = [], []

    def make_sets(B, ctx, n_sets, key):
        M = cache_len(ctx)
        sets = []
        for i in range(n_sets):
            ks = jax.random.split(jax.random.fold_in(key, i), 3)
            q = jax.random.normal(ks[0], (B * T, Hq, D), dt)
            kc = jax.random.normal(ks[1], (B + 1, M, KVH, D), dt)
            vc = jax.random.normal(ks[2], (B + 1, M, KVH, D), dt)
            sets.append((q, kc, vc))
        seq = jnp.full((B + 1,), ctx, jnp.int32)
        qsl = jnp.arange(B + 1, dtype=jnp.int32) * T
        slots = jnp.arange(1, B + 1, dtype=jnp.int32)
        return sets, seq, qsl, slots

    def layer_stack_us(B, ctx, n_layers, rest, key):
        """(wall µs, GPU busy µs or None off the GPU) a layer of `n_layers` calls in one jitted function,
        call i on layer i of [L, S1, M, KVH, D] stacks with call i's o as call i+1's q: the engine's shape of use
        (the caches passed once, one q in, one o out), so the host pays one dispatch for L kernels'
        worth of work instead of a buffer's handling per call."""
        ks = jax.random.split(key, 3)
        q = jax.random.normal(ks[0], (B * T, Hq, D), dt)
        k_stack = jax.random.normal(ks[1], (n_layers, B + 1, cache_len(ctx), KVH, D), dt)
        v_stack = jax.random.normal(ks[2], (n_layers, B + 1, cache_len(ctx), KVH, D), dt)

        @jax.jit
        def layers(q, k_stack, v_stack, seq, qsl, slots):
            for layer in range(n_layers):
                q = pav.attention_verify(q, k_stack, v_stack, seq, qsl, slots, T, layer=layer)
            return q

        us, _ = timed(layers, q, k_stack, v_stack, *rest)
        gpu = benchutil.gpu_kernel_times(layers, q, k_stack, v_stack, *rest) if on_gpu else {}
        return us / n_layers, gpu["busy_us"] / n_layers if gpu else None

    def count_sets(cache_bytes):
        return benchutil.cycled_sets(cache_bytes, args.min_calls, args.min_set_mb, args.max_sets, args.max_sets_gb)

    def launch_fn(q, *_):
        """A Pallas kernel that reads q and writes o's bytes (zeros): the least one kernel costs."""
        width = min(4096, q.size & -q.size)  # a power of two dividing the size
        flat = q.reshape(-1, width)

        def body(q_ref, o_ref):
            o_ref[...] = q_ref[...] * 0

        spec = pl.BlockSpec((1, width), lambda i: (i, 0))
        return pl.pallas_call(
            body,
            out_shape=jax.ShapeDtypeStruct(flat.shape, flat.dtype),
            grid=(flat.shape[0],),
            in_specs=[spec],
            out_specs=spec,
            interpret=not on_gpu,
        )(flat).reshape(q.shape)

    def run_multi(f, sets, rest, reps=None, gpu=None):
        """Median us per call of f over the cycled sets (one dispatch per len(sets) calls); with
        `gpu` (a dict), also the GPU's own time a call from a profiler trace: gpu["busy_us"] (the
        kernels' summed durations), gpu["span_us"] (first kernel start to last kernel end), both a
        call's share, and gpu["kernels"] (median µs by name)."""
        g = jax.jit(lambda ss, rest: [f(*s, *rest) for s in ss])  # rest an argument: no constants to build
        # inner dispatches back to back, one sync: a sync per dispatch would add the host's round trip
        # to every timing
        us, outs = timed(g, sets, rest, reps=reps, per_call=len(sets))
        if gpu is not None and on_gpu:
            trace = benchutil.gpu_kernel_times(g, sets, rest)
            if trace:
                gpu.update(trace, span_us=trace["span_us"] / len(sets), busy_us=trace["busy_us"] / len(sets))
        return us, outs[0]

    def err(a, b):
        a = np.asarray(jnp.asarray(a, jnp.float32))
        b = np.asarray(jnp.asarray(b, jnp.float32))
        return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))

    def dump():
        summary = dict(
            device=dev.device_kind,
            backend=jax.default_backend(),
            jax=jax.__version__,
            copy_TB_per_s={k: round(v / 1e12, 3) for k, v in copies.items()},
            floor_bandwidth=bw_src,
            T=T,
            Hq=Hq,
            KVH=KVH,
            D=D,
            smoke=args.smoke,
            results=results,
            sweep=sweep,
        )
        with open(os.path.join(args.out, "attention_bench.json"), "w") as f:
            json.dump(summary, f, indent=1)
        fmt = lambda v, d=1: "–" if v is None else f"{v:.{d}f}"
        lines = [
            f"# verify attention kernel, {dev.device_kind} ({jax.default_backend()}), jax {jax.__version__}"
            + (" — SMOKE (CPU interpret, tiny shapes: no meaning as timings)" if args.smoke else ""),
            "",
            f"T {T}, {Hq} q / {KVH} kv heads, D {D}, bf16, every request full, M = context + 16 rounded up to 64. "
            "Copy bandwidth (same run): "
            + ", ".join(f"{k} {v / 1e12:.3f} TB/s" for k, v in copies.items())
            + f". floor = K+V bytes read / {bw_src}. sets = cache copies cycled per timing.",
            "",
            "launch = a Pallas kernel that reads q and writes o (zeros), timed the same way: the least "
            "one kernel costs at that shape.",
            "",
            "GPU busy = the kernels' summed durations a call, GPU span = first kernel start to last kernel "
            "end of a dispatch / calls (gaps and waits for the host included); both from a profiler trace.",
            "",
            "layer µs = µs a call of --layer-stack's L chained calls on one layer each of stacked "
            "caches (the engine's way: one jit, caches passed once).",
            "",
            "| batch | context | splits | sets | kernel µs | floor µs | kernel/floor | GPU busy µs | busy/floor "
            "| GPU span µs | layers | layer µs | layer/floor | layer GPU busy µs "
            "| launch µs | ref (XLA) µs | dpa xla µs | dpa cudnn µs | × vs ref | × vs dpa xla | × vs cudnn "
            "| err vs ref | ok |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in results:
            x = lambda k: r[k] / r["kernel_us"] if r.get(k) and r.get("kernel_us") else None
            lines.append(
                f"| {r['B']} | {r['ctx']} | {r['splits']} | {r['sets']} | {fmt(r['kernel_us'])} "
                f"| {fmt(r['floor_us'])} | {fmt(r['floor_ratio'], 2)} | {fmt(r['busy_us'])} "
                f"| {fmt(r['busy_floor_ratio'], 2)} | {fmt(r['span_us'])} | {r['layers'] or '–'} "
                f"| {fmt(r['layer_us'])} "
                f"| {fmt(r['layer_us'] and r['layer_us'] / r['floor_us'], 2)} | {fmt(r['layer_busy_us'])} "
                f"| {fmt(r['launch_us'])} | {fmt(r['ref_us'])} "
                f"| {fmt(r['dpa_xla_us'])} "
                f"| {fmt(r['dpa_cudnn_us'])} "
                f"| {fmt(x('ref_us'), 2)} | {fmt(x('dpa_xla_us'), 2)} | {fmt(x('dpa_cudnn_us'), 2)} "
                f"| {fmt(r['err'], 4) if r['err'] is not None else '–'} | {r['ok']} |"
            )
        if sweep:
            lines += [
                "",
                "Config sweep (kernel µs; kernel/floor).",
                "",
                "| batch | context | config | splits | kernel µs | kernel/floor | GPU busy µs | busy/floor "
                "| GPU span µs | err | note |",
                "|---|---|---|---|---|---|---|---|---|---|---|",
            ]
            for r in sweep:
                lines.append(
                    f"| {r['B']} | {r['ctx']} | {r['config']} | {r.get('splits', '–')} "
                    f"| {fmt(r.get('kernel_us'))} | {fmt(r.get('floor_ratio'), 2)} "
                    f"| {fmt(r.get('busy_us'))} | {fmt(r.get('busy_floor_ratio'), 2)} "
                    f"| {fmt(r.get('span_us'))} "
                    f"| {fmt(r.get('err'), 4) if r.get('err') is not None else '–'} | {r.get('note', '')} |"
                )
        with open(os.path.join(args.out, "attention_bench.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
        return lines

    def kernel_fn(config=None):
        return lambda q, kc, vc, seq, qsl, slots: pav.attention_verify(q, kc, vc, seq, qsl, slots, T, config=config)

    def ref_fn(q, kc, vc, seq, qsl, slots):
        return op_verify(q, kc, vc, seq, qsl, slots, T, impl="ref")

    def dpa_fn(impl, n_keys):
        """q [B, T, Hq, D] against the per-request caches [B, M, KVH, D] (sliced outside the timing)."""

        def f(q, k, v):
            kv_len = jnp.full((q.shape[0],), n_keys, jnp.int32)
            return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=kv_len, implementation=impl)

        return f

    for B, ctx in args.shape_list:
        if over_budget():
            print(f"budget: stop before B{B} ctx{ctx}", flush=True)
            break
        M = cache_len(ctx)
        n_keys = ctx + T
        cache_bytes = 2 * (B + 1) * M * KVH * D * isz
        floor_bytes = 2 * B * n_keys * KVH * D * isz
        n_sets = count_sets(cache_bytes)
        row = dict(
            B=B,
            ctx=ctx,
            M=M,
            sets=n_sets,
            floor_bytes=floor_bytes,
            floor_us=floor_bytes / bw * 1e6,
            kernel_us=None,
            floor_ratio=None,
            busy_us=None,
            busy_floor_ratio=None,
            span_us=None,
            launch_us=None,
            layers=None,
            layer_us=None,
            layer_busy_us=None,
            ref_us=None,
            dpa_xla_us=None,
            dpa_cudnn_us=None,
            err=None,
            ok=False,
            splits=None,
        )
        try:
            sets, seq, qsl, slots = make_sets(B, ctx, n_sets, jax.random.key(B * 100003 + ctx))
            rest = (seq, qsl, slots)
            row["splits"] = num_splits(B, M)
            gpu, launch_gpu = {}, {}
            kus, out = run_multi(kernel_fn(), sets, rest, gpu=gpu)
            row.update(kernel_us=kus, floor_ratio=kus / row["floor_us"], gpu=gpu)
            row["launch_us"], _ = run_multi(launch_fn, sets, rest, gpu=launch_gpu)
            row["launch_gpu"] = launch_gpu
            if gpu:
                row.update(
                    busy_us=gpu["busy_us"], busy_floor_ratio=gpu["busy_us"] / row["floor_us"], span_us=gpu["span_us"]
                )
            print(
                f"B{B} ctx{ctx}: kernel {kus:.1f} us (floor {row['floor_us']:.1f}, one-kernel launch "
                f"{row['launch_us']:.1f}); GPU trace: {gpu}; launch kernel: {launch_gpu}",
                flush=True,
            )
            check_against = None
            ref_mem = 2 * B * M * Hq * D * 4 + B * Hq * T * M * 4 * 3
            if not args.no_xla and ref_mem < args.ref_mem_gb * 2**30 and not over_budget():
                try:
                    rus, rout = run_multi(ref_fn, sets[:1], rest, reps=args.xla_reps)
                    row["ref_us"] = rus
                    check_against = rout
                except Exception as e:
                    print(f"ref failed: {repr(e)[:300]}", flush=True)
            if not args.no_xla and not over_budget():
                q, kc, vc = sets[0]
                dpa_set = [(q.reshape(B, T, Hq, D), kc[1:], vc[1:])]
                for impl in ("xla", "cudnn") if on_gpu else ("xla",):
                    try:
                        dus, _ = run_multi(dpa_fn(impl, n_keys), dpa_set, (), reps=args.xla_reps)
                        row[f"dpa_{impl}_us"] = dus
                    except Exception as e:
                        print(f"dpa {impl} failed: {repr(e)[:300]}", flush=True)
                del dpa_set, q, kc, vc
            if check_against is None:
                check_against = jax.jit(ref_fn)(*sets[0], *rest) if ref_mem < args.ref_mem_gb * 2**30 else None
            if check_against is not None:
                row["err"] = err(out, check_against)
                row["ok"] = row["err"] < 2e-2
            else:  # too big for the reference: check 2 requests of it
                q, kc, vc = sets[0]
                sub = jnp.array([0, B - 1], jnp.int32)
                idx = (sub[:, None] * T + jnp.arange(T)[None, :]).reshape(-1)
                sub_ref = op_verify(q[idx], kc, vc, seq, jnp.arange(3, dtype=jnp.int32) * T, slots[sub], T, impl="ref")
                row["err"] = err(out[idx], sub_ref)
                row["ok"] = row["err"] < 2e-2
            del sets, out, check_against
            if args.layer_stack and not over_budget():
                row["layers"] = n_sets
                row["layer_us"], row["layer_busy_us"] = layer_stack_us(B, ctx, n_sets, rest, jax.random.key(B + ctx))
                print(
                    f"B{B} ctx{ctx}: layer stack x {n_sets}: {row['layer_us']:.1f} us a layer "
                    f"(GPU busy {row['layer_busy_us']})",
                    flush=True,
                )
        except Exception as e:
            traceback.print_exc()
            row["note"] = repr(e)[:300]
        results.append(row)
        print(dump()[-1], flush=True)

    if args.sweep and not over_budget():
        cfgs = [
            dict(block_k=64, num_stages=2, num_warps=8),
            dict(block_k=64, num_stages=2, num_warps=4),
            dict(block_k=64, num_stages=3, num_warps=4),
            dict(block_k=32, num_stages=3, num_warps=8),
            dict(block_k=32, num_stages=4, num_warps=4),
            dict(block_k=16, num_stages=4, num_warps=4),
            dict(target_programs=264),
            dict(min_split=1024),
        ]
        cfgs = args.sweep_config_list or cfgs
        shapes = args.sweep_shape_list or [(64, 4096), (1, 32768), (8, 4096)]
        shapes = shapes if not args.smoke else [(2, 40)]
        for B, ctx in shapes:
            M = cache_len(ctx)
            floor_us = 2 * B * (ctx + T) * KVH * D * isz / bw * 1e6
            cache_bytes = 2 * (B + 1) * M * KVH * D * isz
            n_sets = count_sets(cache_bytes)
            sets, seq, qsl, slots = make_sets(B, ctx, n_sets, jax.random.key(7))
            rest = (seq, qsl, slots)
            base = jax.jit(kernel_fn())(*sets[0], *rest)
            for cfg in cfgs:
                if over_budget():
                    break
                rec = dict(B=B, ctx=ctx, config=cfg)
                try:
                    c = pav.AttentionVerifyConfig(**cfg)
                    rec["splits"] = num_splits(B, M, c)
                    gpu = {}
                    kus, out = run_multi(kernel_fn(c), sets, rest, gpu=gpu if args.sweep_trace else None)
                    rec.update(kernel_us=kus, floor_ratio=kus / floor_us, err=err(out, base))
                    if gpu:
                        rec.update(
                            busy_us=gpu["busy_us"],
                            busy_floor_ratio=gpu["busy_us"] / floor_us,
                            span_us=gpu["span_us"],
                            kernels=gpu["kernels"],
                        )
                except Exception as e:
                    rec["note"] = repr(e)[:200].replace("|", "/")
                sweep.append(rec)
                print(dump()[-1], flush=True)
            del sets

    lines = dump()
    print("\n".join(lines), flush=True)
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    benchutil.run_main(parse, main)
