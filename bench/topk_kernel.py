"""Benchmark of the top-k kernel (jaxspec/pallas/topk.py) against XLA.

Shapes: rows 1024 and 4096 x vocab 248,320 (Qwen3.5/3.6 vocabulary), float32 and bfloat16 logits,
k = 20 and 64, Gaussian rows of N(0, 9). Per case and `--configs` entry: the whole top-k, the
stream kernel alone (`chunk_maxima`), and the GPU's own time (the kernels' summed durations a call
from a profiler trace, `benchutil.gpu_kernel_times`, whatever the host's dispatch costs); per case,
`lax.top_k` and a two-stage chunked `lax.top_k` in XLA (pad to a multiple of the chunk, top-k per
chunk, top-k of the candidates; chunks 256 and 2048, the best is reported), and per shape
`jnp.argmax` (greedy decoding's one XLA pass over the same logits). Floor = logits bytes
(read once) / copy bandwidth measured in the same run: the best of a jitted elementwise pass over
1 GiB (read + write counted) and, when `--torch-copy` ran first in its own process, a torch
device-to-device copy. A read-only XLA pass (`jnp.max` over 1 GiB) is reported too.

Timing: each jitted call is dispatched `inner` times back to back and synchronised once
(jax.block_until_ready); the median over `reps` of (wall time / inner). The inputs (1-4 GB) are far
larger than the 60 MB L2, so repeated calls on one buffer measure DRAM, not the cache.

Adversarial inputs at the first row count and the largest k (`--no-adversarial` skips them):
integer ties, the same times 1 + 2^-10 (which float32 holds but bfloat16 does not), a high block
every 4096 columns, and 99 % -inf (a masked vocabulary); their times against the Gaussian row's.

Every result is checked against `lax.top_k` (indices equal, values equal) in the same run; the
`ok` column says so, and the exit status is 1 if any is not.

Usage (GPU machine):
  python3 bench/topk_kernel.py --torch-copy        (own process first: torch copy bandwidth)
  PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false python3 bench/topk_kernel.py --out $OUT
  python3 bench/topk_kernel.py --smoke             (CPU, interpret mode, tiny shapes: checks the script)
Writes DIR/topk_bench.md and DIR/topk_bench.json (DIR = --out, default $OUT or bench/out).
"""

import argparse
import json
import os
import time

import benchutil  # bench/benchutil.py: the script directory is first on sys.path

CONFIG_FIELDS = ("chunk", "group", "blocks_per_step", "unroll", "steps", "num_warps", "select_warps")


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1024,4096")
    ap.add_argument("--vocab", type=int, default=248320)
    ap.add_argument("--ks", default="20,64")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--inner", type=int, default=5)
    ap.add_argument("--xla-reps", type=int, default=3, help="reps for the slow XLA baselines")
    ap.add_argument("--no-xla", action="store_true", help="skip lax.top_k and the two-stage XLA top-k")
    ap.add_argument("--no-adversarial", action="store_true")
    ap.add_argument(
        "--configs",
        default="16:16:16:2:0:4:2",
        help="TopKConfig " + ":".join(CONFIG_FIELDS) + " entries, comma-separated (steps 0: default)",
    )
    benchutil.add_common_args(ap)
    args = ap.parse_args(argv)
    if args.smoke:
        args.rows, args.vocab, args.ks, args.reps, args.inner, args.xla_reps = "4,8", 3000, "5,20", 2, 1, 1
    return args


def main(args):
    benchutil.setup_jax(args.smoke)
    import jax
    import jax.numpy as jnp

    from jaxspec.pallas import topk as tk

    os.makedirs(args.out, exist_ok=True)
    t_start = time.time()
    dev = jax.devices()[0]
    on_gpu = jax.default_backend() == "gpu"
    dtypes = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

    def timed(fn, *a, reps=None, inner=None):
        return benchutil.median_us(fn, *a, reps=reps or args.reps, inner=inner or args.inner)

    # ---- bandwidth, same run
    copies, bw_src, bw = benchutil.floor_copies(args.out)
    nbw = (1 << 28) if on_gpu else (1 << 20)
    big = jax.random.normal(jax.random.key(1), (nbw,), jnp.float32)
    read_us, _ = timed(jax.jit(jnp.max), big, reps=10, inner=3)
    read_bw = big.nbytes / (read_us * 1e-6)
    del big
    print(f"read-only jnp.max {read_bw / 1e12:.3f} TB/s", flush=True)

    configs = []
    for spec in filter(None, args.configs.split(",")):
        fields = dict(zip(CONFIG_FIELDS, (int(v) for v in spec.split(":"))))
        fields["steps"] = fields.get("steps") or None
        configs.append(tk.TopKConfig(**fields))
    results, adversarial = [], []

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

    def config_name(c):
        return "/".join(str(getattr(c, f) or "auto") for f in CONFIG_FIELDS)

    def dump():
        summary = dict(
            device=dev.device_kind,
            backend=jax.default_backend(),
            jax=jax.__version__,
            copy_TB_per_s={k: round(v / 1e12, 3) for k, v in copies.items()},
            floor_bandwidth=bw_src,
            read_only_TB_per_s=round(read_bw / 1e12, 3),
            vocab=args.vocab,
            smoke=args.smoke,
            config_fields=CONFIG_FIELDS,
            results=[{**r, "config": config_name(r["config"])} for r in results],
            adversarial=[{**r, "config": config_name(r["config"])} for r in adversarial],
        )
        with open(os.path.join(args.out, "topk_bench.json"), "w") as f:
            json.dump(summary, f, indent=1)
        fmt = lambda v, d=1: "–" if v is None else f"{v:.{d}f}"
        ratio = lambda a, b: a / b if a and b else None
        lines = [
            f"# top-k kernel, {dev.device_kind} ({jax.default_backend()}), jax {jax.__version__}"
            + (" — SMOKE (CPU interpret, tiny shapes: no meaning as timings)" if args.smoke else ""),
            "",
            f"vocab {args.vocab}. Copy bandwidth (same run, {nbw * 4 >> 20} MiB): "
            + ", ".join(f"{k} {v / 1e12:.3f} TB/s" for k, v in copies.items())
            + f"; read-only `jnp.max` {read_bw / 1e12:.3f} TB/s. floor = logits bytes / {bw_src}. "
            f"config = {'/'.join(CONFIG_FIELDS)}.",
            "",
            "| rows | dtype | k | config | kernel µs | stream µs | floor µs | × floor | GPU busy µs | busy × floor "
            "| lax.top_k µs | × vs lax | two-stage µs (chunk) | × vs two-stage | jnp.argmax µs | ok |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in results:
            lines.append(
                f"| {r['rows']} | {r['dtype']} | {r['k']} | {config_name(r['config'])} | {fmt(r['kernel_us'])} "
                f"| {fmt(r['stream_us'])} | {fmt(r['floor_us'])} | {fmt(ratio(r['kernel_us'], r['floor_us']), 2)} "
                f"| {fmt(r['busy_us'])} | {fmt(ratio(r['busy_us'], r['floor_us']), 2)} | {fmt(r['lax_us'], 0)} "
                f"| {fmt(ratio(r['lax_us'], r['kernel_us']))} | {fmt(r['two_stage_us'], 0)} ({r['two_stage_chunk']}) "
                f"| {fmt(ratio(r['two_stage_us'], r['kernel_us']))} | {fmt(r['argmax_us'])} | {r['ok']} |"
            )
        if adversarial:
            lines += [
                "",
                "Adversarial inputs: kernel µs against the Gaussian-input time of the same shape and config.",
                "",
                "| rows | dtype | k | input | config | kernel µs | stream µs | × floor | × gaussian | ok |",
                "|---|---|---|---|---|---|---|---|---|---|",
            ]
            for r in adversarial:
                lines.append(
                    f"| {r['rows']} | {r['dtype']} | {r['k']} | {r['input']} | {config_name(r['config'])} "
                    f"| {fmt(r['kernel_us'])} | {fmt(r['stream_us'])} "
                    f"| {fmt(ratio(r['kernel_us'], r['floor_us']), 2)} | {fmt(r['x_gauss'], 2)} | {r['ok']} |"
                )
        with open(os.path.join(args.out, "topk_bench.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
        return lines

    def kernel_times(x, k, cfg, ref):
        """The whole top-k, the stream alone and the GPU's busy time of one config, checked against ref."""
        plan = cfg.resolve(x.shape[0], x.shape[1], k, x.dtype)
        fn = jax.jit(lambda x: tk.top_k(x, k, config=cfg))
        kus, out = timed(fn, x)
        sus, _ = timed(jax.jit(lambda x: tk.chunk_maxima(x, plan, interpret=not on_gpu)), x)
        gpu = benchutil.gpu_kernel_times(fn, x) if on_gpu else {}
        return dict(
            rows=x.shape[0],
            dtype=jnp.dtype(x.dtype).name,
            k=k,
            config=cfg,
            kernel_us=kus,
            stream_us=sus,
            floor_us=x.nbytes / bw * 1e6,
            busy_us=gpu.get("busy_us"),
            kernels=gpu.get("kernels"),
            ok=same(out, ref),
        )

    def over_budget():
        return time.time() - t_start > args.budget_s

    rows_list = [int(r) for r in args.rows.split(",")]
    ks = [int(k) for k in args.ks.split(",")]
    for rows in rows_list:
        for dname in args.dtypes.split(","):
            x = (jax.random.normal(jax.random.key(rows), (rows, args.vocab), jnp.float32) * 3).astype(dtypes[dname])
            argmax_us = None if args.no_xla else timed(jax.jit(lambda x: jnp.argmax(x, axis=-1)), x)[0]
            for k in ks:
                if over_budget():
                    break
                ref = lax_top_k(k)(x)
                lax_us = ts_us = ts_chunk = None
                xla_ok = True
                if not args.no_xla:
                    lax_us, _ = timed(lax_top_k(k), x, reps=args.xla_reps, inner=1)
                    for chunk in (256, 2048):
                        us, o = timed(two_stage(k, chunk), x, reps=args.xla_reps, inner=1)
                        if ts_us is None or us < ts_us:
                            ts_us, ts_chunk = us, chunk
                        xla_ok = xla_ok and same(o, ref)  # the baseline must agree too
                for cfg in configs:
                    if over_budget():
                        break
                    r = kernel_times(x, k, cfg, ref)
                    results.append(
                        {
                            **r,
                            "ok": r["ok"] and xla_ok,
                            "lax_us": lax_us,
                            "two_stage_us": ts_us,
                            "two_stage_chunk": ts_chunk,
                            "argmax_us": argmax_us,
                        }
                    )
                    print(dump()[-1], flush=True)
            del x

    if not args.no_adversarial:
        rows, k = rows_list[0], max(ks)
        col = jnp.arange(args.vocab)
        for dname in args.dtypes.split(","):
            g = jax.random.normal(jax.random.key(7), (rows, args.vocab), jnp.float32)
            ties = jnp.round(g * 1.5).clip(-3, 3)
            inputs = {
                "integer ties -3..3": ties,
                "ties x (1 + 2^-10) (float32: not bf16-exact)": ties * (1 + 2**-10),
                "high block per 4096": g + jnp.where(col % 4096 < 200, 8.0, 0.0)[None, :],
                "99% -inf": jnp.where(jax.random.uniform(jax.random.key(8), g.shape) < 0.99, -jnp.inf, g),
            }
            for name, xin in inputs.items():
                x = xin.astype(dtypes[dname])
                ref = lax_top_k(k)(x)
                for cfg in configs:
                    if over_budget():
                        break
                    base = next(
                        (
                            r["kernel_us"]
                            for r in results
                            if (r["rows"], r["dtype"], r["k"], r["config"]) == (rows, dname, k, cfg)
                        ),
                        None,
                    )
                    r = kernel_times(x, k, cfg, ref)
                    adversarial.append({**r, "input": name, "x_gauss": r["kernel_us"] / base if base else None})
                    print(dump()[-1], flush=True)
                del x
            del g, ties, inputs

    lines = dump()
    print("\n".join(lines), flush=True)
    return 1 if any(not r["ok"] for r in results + adversarial) else 0


if __name__ == "__main__":
    benchutil.run_main(parse, main)
