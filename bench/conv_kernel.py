"""Conv verify: the packed Pallas kernel (jaxspec/pallas/conv.py) against the XLA reference and its byte floor.

Shapes: conv channels C = 10240 (Qwen3.8-27B at TP1), bf16, width 4, T = 8 (--T); batches 128, 32,
8, 1; layouts `uniform` (every request verifies T tokens) and `mixed` (lengths drawn from 1..T,
packed, N rounded up to a multiple of 64 with padding rows).

floor = bytes that must move (x's window rows, each request's W-1 state rows and the weights read; y
written for every row, padding too; the window rows saved) / the fastest copy of the run
(`benchutil.floor_copies`).

Timings:
* in-model (default): K calls chained in one jitted function (each call's conv_window, donated,
  feeds the next; R input sets in rotation so that the working set exceeds L2 where the batch
  allows); median wall time of reps minus the dispatch + sync cost of a jitted one-kernel function,
  / K, so launch gaps are included. The XLA reference (conv_verify impl="ref") is timed the same
  way, and every config's result is checked against it.
* kernel alone (`--ncu-sweep` under Nsight Compute, then `--ncu-parse CSV`): the GPU duration of
  each launch of the NCU_SWEEP tile configs, caches flushed (cold L2); the fastest per case
  (ncu_best.json) is timed in-model beside the default config.
* `--fla`: flash-linear-attention's causal_conv1d on the same shapes (torch only: its own process).

Usage (GPU):
  python3 bench/conv_kernel.py --torch-copy --out $OUT        (own process, first)
  PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false python3 bench/conv_kernel.py --out $OUT [--batches 128,32]
  ncu ... python3 bench/conv_kernel.py --ncu-sweep   then   python3 bench/conv_kernel.py --ncu-parse FILE
  python3 bench/conv_kernel.py --fla --out $OUT
  python3 bench/conv_kernel.py --smoke                         (CPU, interpret mode, tiny: checks the script)
Writes into DIR (--out, default $OUT or bench/out): conv_bench.json / .md, copy_bw.json, ncu_plan.json,
ncu_sweep.json, ncu_best.json (its table appended to conv_bench.md), conv_fla.json.
"""

import argparse
import csv
import json
import math
import os
import statistics
import time

import benchutil  # bench/benchutil.py: the script directory is first on sys.path

W = 4


def parse():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="128,32,8,1")
    ap.add_argument("--T", type=int, default=8)
    ap.add_argument("--C", type=int, default=10240)
    ap.add_argument("--K", type=int, default=32, help="calls chained per timed jit")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--fla", action="store_true", help="flash-linear-attention's causal_conv1d (torch), then exit")
    ap.add_argument("--ncu-sweep", action="store_true", help="launch the NCU_SWEEP configs (run under ncu)")
    ap.add_argument("--ncu-parse", default=None, metavar="CSV", help="join ncu's CSV with the sweep's plan")
    benchutil.add_common_args(ap)
    return ap.parse_args()


def layout(rng, B, T, kind):
    import numpy as np

    if kind == "uniform":
        lengths = np.full(B, T)
        n = B * T
    else:
        lengths = rng.integers(1, T + 1, B)
        n = max(int(math.ceil(lengths.sum() / 64) * 64), int(lengths.sum()))
    qsl = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return lengths, qsl, n


def must_move_bytes(lengths, n, B, C, isz):
    tokens = int(lengths.sum())
    return dict(
        x=tokens * C * isz, state=B * (W - 1) * C * isz, weight=C * W * isz, y=n * C * isz, saved=tokens * C * isz
    )


# Tile configs of the Nsight Compute sweep: (block_c, num_warps, requests_per_program). The first
# of each list is the kernel's default for that batch (ConvVerifyConfig.resolve).
NCU_SWEEP = {
    128: [
        (512, 4, 1),
        (1024, 8, 1),
        (1024, 4, 1),
        (512, 8, 1),
        (2048, 8, 1),
        (256, 4, 1),
        (1024, 8, 2),
        (512, 4, 2),
        (512, 8, 4),
        (1024, 16, 4),
        (512, 4, 4),
        (256, 2, 4),
    ],
    32: [(512, 4, 1), (1024, 8, 1), (512, 8, 1), (256, 4, 1), (512, 4, 2)],
    8: [(128, 1, 1), (256, 2, 1), (256, 1, 1), (512, 2, 1), (64, 1, 1)],
    1: [(64, 1, 1), (256, 2, 1), (128, 1, 1), (256, 1, 1), (512, 4, 1)],
}
NCU_LAUNCHES = 2


def main_ncu_sweep(args):
    """Launch each sweep config NCU_LAUNCHES times (profiled by the ncu wrapping this process)."""
    benchutil.setup_jax(args.smoke)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxspec.pallas import conv as pconv

    os.makedirs(args.out, exist_ok=True)
    T, C, dt = args.T, args.C, jnp.bfloat16
    plan, t0 = [], time.time()
    for B in [int(b) for b in args.batches.split(",")]:
        for kind in ("uniform", "mixed"):
            if B <= 8 and kind == "mixed":
                continue
            rng = np.random.default_rng(B * 7 + (kind == "mixed"))
            lengths, qsl, n = layout(rng, B, T, kind)
            x = jnp.asarray(rng.standard_normal((n, C)), dt)
            state = jnp.asarray(rng.standard_normal((B + 1, W - 1, C)), dt)
            window = jnp.asarray(rng.standard_normal((B + 1, T, C)), dt)
            weight = jnp.asarray(rng.standard_normal((C, W)) * 0.5, dt)
            slots = jnp.asarray(rng.permutation(np.arange(1, B + 1)), jnp.int32)
            qsl_j = jnp.asarray(qsl)
            nbytes = sum(must_move_bytes(lengths, n, B, C, 2).values())
            for bc, nw, rpp in NCU_SWEEP.get(B, NCU_SWEEP[1]):
                if time.time() - t0 > args.budget_s:
                    break
                cfg = pconv.ConvVerifyConfig(block_c=bc, num_warps=nw, requests_per_program=rpp)
                bc_r, nw_r, rpp_r = cfg.resolve(B, C, 2, T)
                fn = jax.jit(lambda *a, cfg=cfg: pconv.conv_verify(*a, config=cfg))
                try:
                    for _ in range(NCU_LAUNCHES):
                        jax.block_until_ready(fn(x, state, window, weight, qsl_j, slots))
                except Exception as e:  # a config that fails is reported, the sweep goes on
                    print("ncu-sweep: config failed", bc, nw, rpp, repr(e)[:300], flush=True)
                    continue
                plan.append(
                    dict(
                        batch=B,
                        layout=kind,
                        block_c=bc_r,
                        num_warps=nw_r,
                        rpp=rpp_r,
                        grid=math.ceil(B / rpp_r) * math.ceil(C / bc_r),
                        threads=32 * nw_r,
                        launches=NCU_LAUNCHES,
                        bytes=nbytes,
                        tokens=int(lengths.sum()),
                        N=n,
                    )
                )
                with open(os.path.join(args.out, "ncu_plan.json"), "w") as f:
                    json.dump(plan, f, indent=1)
    print(f"ncu-sweep: {len(plan)} configs in {time.time() - t0:.0f} s", flush=True)


def main_ncu_parse(args):
    """Join ncu's CSV (raw page) with the plan; write ncu_sweep.json, ncu_best.json, a table."""
    with open(os.path.join(args.out, "ncu_plan.json")) as f:
        plan = json.load(f)
    with open(args.ncu_parse, newline="") as f:
        lines = f.read().splitlines()
    head = next(i for i, l in enumerate(lines) if l.startswith('"ID"'))
    rows = [r for r in csv.DictReader(lines[head:]) if "conv_verify" in r.get("Kernel Name", "")]
    bw = None
    try:
        with open(os.path.join(args.out, "copy_bw.json")) as f:
            bw = json.load(f)["TB_per_s"] * 1e12
    except OSError:
        pass

    def num(r, key):
        try:
            return float(str(r.get(key, "")).replace(",", ""))
        except ValueError:
            return None

    out, i = [], 0
    for p in plan:
        rs = rows[i : i + p["launches"]]
        i += p["launches"]
        durs = [num(r, "gpu__time_duration.sum") for r in rs]
        durs = [d for d in durs if d is not None]
        if not durs:
            continue
        us = statistics.median(durs) / 1e3
        r0 = rs[0]
        rec = dict(
            p,
            kernel_us=round(us, 2),
            regs=num(r0, "launch__registers_per_thread"),
            grid_ncu=num(r0, "launch__grid_size"),
            block_ncu=num(r0, "launch__block_size"),
            dram_read_MB=(num(r0, "dram__bytes_read.sum") or 0) / 1e6,
            dram_write_MB=(num(r0, "dram__bytes_write.sum") or 0) / 1e6,
            warps_active_pct=num(r0, "sm__warps_active.avg.pct_of_peak_sustained_active"),
        )
        if bw:
            floor = p["bytes"] / bw * 1e6
            rec.update(floor_us=round(floor, 2), x_floor=round(us / floor, 2))
        out.append(rec)
    best = {}
    for r in out:
        key = f"{r['batch']}/{r['layout']}"
        if key not in best or r["kernel_us"] < best[key]["kernel_us"]:
            best[key] = r
    with open(os.path.join(args.out, "ncu_sweep.json"), "w") as f:
        json.dump(out, f, indent=1)
    with open(os.path.join(args.out, "ncu_best.json"), "w") as f:
        json.dump(best, f, indent=1)
    md = [
        "",
        f"## Kernel time per config (Nsight Compute, gpu__time_duration, cold L2, median of {NCU_LAUNCHES} launches)",
        "",
        "| batch | layout | block_c | warps | req/program | grid | regs | kernel us | floor us | x floor "
        "| DRAM read MB | DRAM write MB | warps active % |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in out:
        md.append(
            f"| {r['batch']} | {r['layout']} | {r['block_c']} | {r['num_warps']} | {r['rpp']} | {r['grid']} "
            f"| {r['regs']} | {r['kernel_us']:.2f} | {r.get('floor_us', float('nan')):.2f} "
            f"| {r.get('x_floor', float('nan')):.2f} | {r['dram_read_MB']:.1f} | {r['dram_write_MB']:.1f} "
            f"| {r['warps_active_pct']} |"
        )
    text = "\n".join(md) + "\n"
    with open(os.path.join(args.out, "conv_bench.md"), "a") as f:
        f.write(text)
    print(text)
    if i != len(rows):
        print(f"ncu-parse: {len(rows)} conv_verify launches, {i} expected from the plan", flush=True)


def main_jax(args):
    benchutil.setup_jax(args.smoke)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxspec.ops.conv import conv_verify as op_conv_verify
    from jaxspec.pallas import conv as pconv

    dev = jax.devices()[0]
    print(f"device: {dev.device_kind} ({jax.default_backend()}), jax {jax.__version__}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    dt, isz = jnp.bfloat16, 2
    T, C, K, reps = args.T, args.C, args.K, args.reps
    if args.smoke:
        T, C, K, reps = 4, 300, 3, 2

    def timed(fn, *a, warm_s=0.2):
        """Median wall time (us) of fn(*a) with the sync; fn's last output feeds its last argument."""

        def call(cur):
            out = fn(*a[:-1], cur)
            jax.block_until_ready(out)
            return out, (out[-1] if isinstance(out, tuple) else out)

        _, cur = call(a[-1])  # compile
        t_end = time.perf_counter() + (warm_s if not args.smoke else 0)
        while time.perf_counter() < t_end:  # warm-up: clocks up, caches and allocator settled
            _, cur = call(cur)
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            _, cur = call(cur)
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts) * 1e6

    copies, bw_src, bw = benchutil.floor_copies(args.out)
    overhead_us = timed(jax.jit(lambda a: a + 1.0, donate_argnums=0), jnp.zeros((8, 128), jnp.float32))
    print(f"jit dispatch + sync overhead {overhead_us:.1f} us", flush=True)
    with open(os.path.join(args.out, "copy_bw.json"), "w") as f:
        json.dump(dict(TB_per_s=bw / 1e12, source=bw_src, all={k: v / 1e12 for k, v in copies.items()}), f)

    best = {}
    try:
        with open(os.path.join(args.out, "ncu_best.json")) as f:
            best = json.load(f)
    except OSError:
        pass

    def make_sets(rng, B, lengths, qsl, n):
        set_bytes = sum(must_move_bytes(lengths, n, B, C, isz).values())
        R = max(1, min(K, math.ceil(200e6 / set_bytes)))
        S1 = R * B + 1
        xs = [jnp.asarray(rng.standard_normal((n, C)), dt) for _ in range(R)]
        slots = [jnp.asarray(rng.permutation(np.arange(i * B + 1, (i + 1) * B + 1)), jnp.int32) for i in range(R)]
        state = jnp.asarray(rng.standard_normal((S1, W - 1, C)), dt)
        window = jnp.asarray(rng.standard_normal((S1, T, C)), dt)
        weight = jnp.asarray(rng.standard_normal((C, W)) * 0.5, dt)
        return R, xs, slots, state, window, weight, jnp.asarray(qsl)

    def chain_fn(call, R):
        def chain(xs, slots, state, weight, qsl, window):
            y = None
            for k in range(K):
                y, window = call(xs[k % R], state, window, weight, qsl, slots[k % R])
            return y, window

        return jax.jit(chain, donate_argnums=5)

    def kernel_call(cfg):
        return lambda x, s, w, wt, q, sl: pconv.conv_verify(x, s, w, wt, q, sl, config=cfg)

    def ref_call(x, s, w, wt, q, sl):
        return op_conv_verify(x, s, w, wt, q, sl, impl="ref")

    def per_call_us(call, R, data, window):
        xs, slots, state, weight, qsl = data
        total = timed(chain_fn(call, R), xs, slots, state, weight, qsl, jnp.array(window, copy=True))
        return max(total - overhead_us, 0.0) / K

    results = []

    def dump():
        summary = dict(
            device=dev.device_kind,
            copy_TB_per_s=round(bw / 1e12, 3),
            copy_source=bw_src,
            copy_all={k: round(v / 1e12, 3) for k, v in copies.items()},
            dispatch_overhead_us=round(overhead_us, 1),
            K=K,
            reps=reps,
            results=results,
        )
        with open(os.path.join(args.out, "conv_bench.json"), "w") as f:
            json.dump(summary, f, indent=1)
        md = [
            f"# conv verify kernel, {dev.device_kind}, C={C}, bf16, W={W}, T={T}",
            "",
            "Copy bandwidth (same run, 1 GiB read+write, best of: "
            + ", ".join(f"{k} {v / 1e12:.2f}" for k, v in copies.items())
            + f" TB/s): {bw / 1e12:.3f} TB/s. "
            f"In-model time per call = (chain of {K} calls in one jit, median of {reps}, minus "
            f"{overhead_us:.1f} us dispatch) / {K}; it includes launch gaps.",
            "",
            "| batch | layout | tokens | N | config (block_c/warps/req per program) | MB moved | floor us "
            "| kernel us (chain) | x floor | frac copy BW | XLA ref us | speedup | max abs err | window ok |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in sorted(results, key=lambda r: (r["batch"], r["layout"] != "uniform", r["config"])):
            md.append(
                f"| {r['batch']} | {r['layout']} | {r['tokens']} | {r['N']} | {r['config']} "
                f"| {r['bytes'] / 1e6:.2f} | {r['floor_us']:.2f} | {r['kernel_us']:.2f} | {r['x_floor']:.2f} "
                f"| {r['frac_copy_bw']:.2f} | {r['xla_ref_us']:.2f} | {r['speedup_vs_xla']:.1f}x "
                f"| {r['max_abs_err_vs_ref']:.3g} | {r['window_bit_equal']} |"
            )
        text = "\n".join(md) + "\n"
        with open(os.path.join(args.out, "conv_bench.md"), "w") as f:
            f.write(text)
        return text

    t0 = time.time()
    batches = [int(b) for b in args.batches.split(",")] if not args.smoke else [3, 1]
    for B in batches:
        for kind in ("uniform", "mixed"):
            if time.time() - t0 > args.budget_s:
                break
            rng = np.random.default_rng(B * 7 + (kind == "mixed"))
            lengths, qsl, n = layout(rng, B, T, kind)
            R, xs, slots, state, window, weight, qsl_j = make_sets(rng, B, lengths, qsl, n)
            nbytes = sum(must_move_bytes(lengths, n, B, C, isz).values())
            floor_us = nbytes / bw * 1e6
            data = (xs, slots, state, weight, qsl_j)
            r_us = per_call_us(ref_call, R, data, window)
            y_r, w_r = jax.jit(ref_call)(xs[0], state, window, weight, qsl_j, slots[0])
            cfgs = [pconv.ConvVerifyConfig()]
            b = best.get(f"{B}/{kind}") or best.get(f"{B}/uniform")
            if b:
                cfgs.append(
                    pconv.ConvVerifyConfig(
                        block_c=b["block_c"], num_warps=b["num_warps"], requests_per_program=b["rpp"]
                    )
                )
            seen = set()
            for cfg in cfgs:
                res = cfg.resolve(B, C, isz, T)
                if res in seen:
                    continue
                seen.add(res)
                # correctness spot check against the reference (one call, set 0)
                y_k, w_k = jax.jit(kernel_call(cfg))(xs[0], state, window, weight, qsl_j, slots[0])
                err = float(jnp.max(jnp.abs(y_k.astype(jnp.float32) - y_r.astype(jnp.float32))))
                win_ok = bool(jnp.all(w_k == w_r))
                del y_k, w_k
                k_us = per_call_us(kernel_call(cfg), R, data, window)
                row = dict(
                    batch=B,
                    layout=kind,
                    tokens=int(lengths.sum()),
                    N=n,
                    C=C,
                    T=T,
                    config="/".join(map(str, res)) + (" (default)" if cfg == cfgs[0] else " (ncu best)"),
                    bytes=nbytes,
                    floor_us=round(floor_us, 2),
                    kernel_us=round(k_us, 2),
                    xla_ref_us=round(r_us, 2),
                    frac_copy_bw=round(floor_us / max(k_us, 1e-9), 3),
                    x_floor=round(k_us / floor_us, 2),
                    speedup_vs_xla=round(r_us / max(k_us, 1e-9), 2),
                    max_abs_err_vs_ref=err,
                    window_bit_equal=win_ok,
                    input_sets=R,
                )
                results.append(row)
                print(json.dumps(row), flush=True)
            del xs, state, window, data, y_r, w_r
            dump()
    print(dump(), flush=True)


def main_fla(args):
    """flash-linear-attention's Triton causal_conv1d (varlen, initial state, silu) on the same shapes."""
    import numpy as np
    import torch
    from fla.modules.causal_conv1d import causal_conv1d_fwd
    from fla.ops.utils import prepare_chunk_indices
    from triton.testing import do_bench

    dev = "cuda"
    bw = benchutil.torch_copy_bandwidth(args.out)
    T, C = args.T, args.C
    rows = []
    for B in [int(x) for x in args.batches.split(",")]:
        for kind in ("uniform", "mixed"):
            rng = np.random.default_rng(B * 7 + (kind == "mixed"))
            lengths, qsl, n = layout(rng, B, T, kind)
            x = torch.randn(1, int(lengths.sum()), C, device=dev, dtype=torch.bfloat16)
            w = torch.randn(C, W, device=dev, dtype=torch.bfloat16) * 0.5
            h0 = torch.randn(B, C, W, device=dev, dtype=torch.bfloat16)
            cu = torch.tensor(qsl, device=dev, dtype=torch.int32)
            ci = prepare_chunk_indices(cu, 64)
            for fs in (False, True):
                try:
                    fn = lambda: causal_conv1d_fwd(
                        x,
                        w,
                        None,
                        None,
                        initial_state=h0,
                        output_final_state=fs,
                        activation="silu",
                        cu_seqlens=cu,
                        chunk_indices=ci,
                    )
                    us = do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
                    mv = must_move_bytes(lengths, int(lengths.sum()), B, C, 2)
                    nbytes = mv["x"] + mv["state"] + mv["y"] + (B * (W - 1) * C * 2 if fs else 0)
                    row = dict(
                        kernel="fla causal_conv1d_fwd" + (" + final state" if fs else ""),
                        batch=B,
                        layout=kind,
                        us=round(us, 2),
                        floor_us=round(nbytes / bw * 1e6, 2),
                    )
                except Exception as e:  # an anchor only: report and go on
                    row = dict(kernel="fla causal_conv1d_fwd", batch=B, layout=kind, error=repr(e)[:300])
                rows.append(row)
                print(json.dumps(row), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "conv_fla.json"), "w") as f:
        json.dump(dict(copy_TB_per_s=round(bw / 1e12, 3), rows=rows), f, indent=1)


def main(args):
    if args.fla:
        main_fla(args)
    elif args.ncu_sweep:
        main_ncu_sweep(args)
    elif args.ncu_parse:
        main_ncu_parse(args)
    else:
        main_jax(args)
    return 0


if __name__ == "__main__":
    benchutil.run_main(parse, main)
