"""GDN fold: the Pallas kernel (jaxspec/pallas/fold.py) against the XLA reference and its byte floor.

Shapes: H 16, HV 48, K = V = 128, ring L = 16, m = 8 live records in each of slots 1..B (slot 0,
the null slot, has none); bf16 / fp32 checkpoints, fp32 or bf16 (hi, lo) ring updates (keys bf16);
1 layer or 48 layers in one call (--layers); batches 128, 32, 8, 1.

Method: the checkpoint is donated and folded in place, as the engine's commit does. Time = the GPU
time a call from CUPTI (Mosaic GPU's profiler hooks: every kernel a call launches, summed), median
over iterations; `wall` = host time a call in a queue of calls. floor = bytes that must move (the
checkpoints of the m > 0 slots read and written, their live records read) / the fastest copy of the
run (`benchutil.floor_copies`). XLA = `gdn_fold(impl="ref")` under jit, checkpoint donated; every
kernel result is compared with it. --sweep first times SWEEP's tile configs at one batch and uses
the fastest per checkpoint dtype.

Usage (GPU):
  python3 bench/fold_kernel.py --torch-copy --out $OUT       (own process, first)
  PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false python3 bench/fold_kernel.py --out $OUT [--sweep]
  python3 bench/fold_kernel.py --smoke      (CPU, interpret mode, tiny heads: checks the script)
Writes DIR/fold_bench.md and DIR/fold_bench.json (DIR = --out, default $OUT or bench/out).
"""

import argparse
import functools
import gc
import itertools
import json
import os
import statistics
import sys
import time

import benchutil  # bench/benchutil.py: the script directory is first on sys.path
import jax
import jax.numpy as jnp

sys.path.insert(0, benchutil.ROOT)
from jaxspec.ops.gdn import gdn_fold  # noqa: E402
from jaxspec.pallas import fold  # noqa: E402

H, HV, K, V, L, M = 16, 48, 128, 128, 16, 8
# (block_v, num_warps, heads per program) tried by --sweep at --sweep-batch, 1 layer
SWEEP = (
    (64, 4, 1),
    (64, 4, 2),
    (64, 4, 4),
    (64, 4, 8),
    (32, 4, 1),
    (32, 4, 4),
    (32, 4, 8),
    (32, 2, 4),
    (64, 8, 4),
    (128, 8, 1),
    (128, 8, 2),
)

try:
    from jax._src.lib import mosaic_gpu as _mgpu

    _CUPTI = _mgpu._mosaic_gpu_ext
except Exception:  # noqa: BLE001
    _CUPTI = None


def timed(step, state, rest, iters):
    """Run state = step(state, *rest) iters times; returns (state, kernel ms per iter list, wall ms per call)."""
    state = step(state, *rest)
    jax.block_until_ready(state)
    per_iter = None
    if _CUPTI is not None:
        try:
            _CUPTI._cupti_init()
            try:
                for _ in range(iters):
                    state = step(state, *rest)
                jax.block_until_ready(state)
            finally:
                timings = _CUPTI._cupti_get_timings(True)
            if timings and len(timings) % iters == 0:
                n = len(timings) // iters
                per_iter = [sum(t for _, t in timings[i * n : (i + 1) * n]) for i in range(iters)]
        except Exception as e:  # noqa: BLE001
            print("cupti failed:", repr(e), flush=True)
    t0 = time.perf_counter()
    for _ in range(iters):
        state = step(state, *rest)
    jax.block_until_ready(state)
    wall = (time.perf_counter() - t0) * 1e3 / iters
    if per_iter is None:
        per_iter = [wall]
    return state, per_iter, wall


def make_inputs(key, layers, batch, ckpt_dtype, ring):
    s1 = batch + 1
    ks = jax.random.split(key, 5)
    lead = (layers, s1)
    ckpt = (0.1 * jax.random.normal(ks[0], lead + (HV, K, V), jnp.float32)).astype(ckpt_dtype)
    rk = jax.random.normal(ks[1], lead + (H, L, K), jnp.float32)
    rk = (rk * jax.lax.rsqrt(jnp.sum(rk * rk, -1, keepdims=True))).astype(jnp.bfloat16)
    u = jax.random.normal(ks[2], lead + (HV, L, V), jnp.float32)
    if ring == "hilo":
        hi = u.astype(jnp.bfloat16)
        ru = (hi, (u - hi.astype(jnp.float32)).astype(jnp.bfloat16))
    else:
        ru = u
    rg = -0.1 * jax.nn.softplus(jax.random.normal(ks[3], lead + (HV, L), jnp.float32))
    nr = jnp.asarray([0] + [M] * batch, jnp.int32)
    return ckpt, rk, ru, rg, nr


def must_move(layers, batch, ckpt_dtype, ring):
    cb = jnp.dtype(ckpt_dtype).itemsize
    ub = 4
    per_layer = batch * (2 * HV * K * V * cb + H * M * K * 2 + HV * M * V * ub + HV * M * 4)
    return layers * per_layer


@jax.jit
def _compare(a, b):
    """(max|a - b| / max|b|, all finite(a)), one layer at a time (no full-size temporaries: a
    48-layer fp32 checkpoint at batch 128 is 19.5 GB)."""

    def one(ab):
        x, y = ab[0].astype(jnp.float32), ab[1].astype(jnp.float32)
        return jnp.max(jnp.abs(x - y)), jnp.max(jnp.abs(y)), jnp.all(jnp.isfinite(x))

    d, s, f = jax.lax.map(one, (a, b)) if a.ndim == 5 else one((a, b))
    return jnp.max(d) / jnp.max(s), jnp.all(f)


_REF = jax.jit(functools.partial(gdn_fold, impl="ref"), donate_argnums=0)
_KERNELS = {}


def kernel_fn(config):
    if config not in _KERNELS:
        _KERNELS[config] = jax.jit(
            functools.partial(gdn_fold, impl="pallas")
            if config is None
            else functools.partial(fold.gdn_fold, config=config),
            donate_argnums=0,
        )
    return _KERNELS[config]


def run_case(layers, batch, ckpt_dtype, ring, *, config=None, with_ref=True, time_ref=True, iters=None):
    args = make_inputs(jax.random.PRNGKey(batch * 100 + layers), layers, batch, ckpt_dtype, ring)
    ckpt, rest = args[0], args[1:]
    kern, ref = kernel_fn(config), _REF
    # numerics on fresh copies: kernel vs the jnp reference on the GPU
    out_k = kern(jnp.array(ckpt, copy=True), *rest)
    err = None
    if with_ref:
        out_r = ref(jnp.array(ckpt, copy=True), *rest)
        err, finite = (float(x) for x in _compare(out_k, out_r))
        finite = bool(finite)
        del out_r
    else:
        finite = bool(_compare(out_k, out_k)[1])
    del out_k
    nbytes = must_move(layers, batch, ckpt_dtype, ring)
    est_ms = max(nbytes / 3.5e12 * 1e3, 0.005)
    n = iters or int(min(200, max(10, 60.0 / est_ms)))
    ckpt, t_k, wall_k = timed(kern, ckpt, rest, n)
    row = dict(
        layers=layers,
        batch=batch,
        ckpt=jnp.dtype(ckpt_dtype).name,
        ring=ring,
        bytes=nbytes,
        kernel_us=1e3 * statistics.median(t_k),
        kernel_wall_us=1e3 * wall_k,
        err_vs_ref=err,
        finite=finite,
        config=None if config is None else vars(config),
    )
    if with_ref and time_ref:
        ckpt, t_r, wall_r = timed(ref, ckpt, rest, max(5, n // 4))
        row.update(ref_us=1e3 * statistics.median(t_r), ref_wall_us=1e3 * wall_r)
    del ckpt, rest, args
    gc.collect()
    return row


def fmt_table(rows, bw):
    head = (
        "| ckpt | ring | layers | batch | kernel us | us/layer | MB moved | floor us | GB/s | frac of copy BW "
        "| XLA ref us | ref us/layer | speedup | wall us/call | max rel err vs ref |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        t = r["kernel_us"]
        gbs = r["bytes"] / (t * 1e-6) / 1e9
        ref = r.get("ref_us")
        lines.append(
            f"| {r['ckpt']} | {r['ring']} | {r['layers']} | {r['batch']} | {t:.1f} | {t / r['layers']:.1f} | "
            f"{r['bytes'] / 1e6:.1f} | {r['bytes'] / bw * 1e6:.1f} | {gbs:.0f} | {gbs * 1e9 / bw:.2f} | "
            + (f"{ref:.1f} | {ref / r['layers']:.1f} | {ref / t:.1f}x | " if ref else "- | - | - | ")
            + f"{r['kernel_wall_us']:.1f} | "
            + ("-" if r["err_vs_ref"] is None else f"{r['err_vs_ref']:.2e}")
            + ("" if r["finite"] else " NONFINITE")
            + " |"
        )
    return "\n".join(lines)


def write_md(result, a, bw):
    rows = sorted(result["rows"], key=lambda r: (r["ckpt"], r["ring"], r["layers"], r["batch"]))
    md = [
        f"# GDN fold: Pallas kernel vs XLA reference ({result['device']})",
        "",
        f"Floors at {result['floor_bandwidth']} {bw / 1e12:.3f} TB/s (same run). "
        f"H {H}, HV {HV}, K = V = {K}, ring L = {L}, m = {M} live records per slot, slot 0 null. "
        "Kernel and XLA times: CUPTI GPU time per call (median); wall: host time per call in a queue. "
        "Floor: bytes that must move / copy bandwidth. XLA ref: jax.jit(gdn_fold, impl='ref'), checkpoint "
        f"donated. Library default config: {result['default_config']}.",
        "",
        fmt_table(rows, bw),
    ]
    if result["sweep"]:
        md += [
            "",
            f"Config sweep (1 layer, batch {a.sweep_batch}, hi/lo ring):",
            "",
            "| block_v | num_warps | heads | ckpt | kernel us | floor us | max rel err vs ref |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in result["sweep"]:
            c = r["config"]
            md.append(
                f"| {c['block_v']} | {c['num_warps']} | {c['heads']} | {r['ckpt']} | "
                f"{r['kernel_us']:.1f} | {r['bytes'] / bw * 1e6:.1f} | {r['err_vs_ref']:.2e} |"
            )
        md += ["", f"Table rows use the sweep's fastest config per checkpoint dtype: {result.get('best')}."]
    text = "\n".join(md) + "\n"
    with open(os.path.join(a.out, "fold_bench.md"), "w") as f:  # rewritten after every row
        f.write(text)
    return text


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="128,32,8,1")
    ap.add_argument("--layers", default="1,48")
    ap.add_argument("--sweep", action="store_true", help="time SWEEP at --sweep-batch first, keep the fastest")
    ap.add_argument("--sweep-batch", type=int, default=128)
    ap.add_argument("--no-ref", action="store_true")
    benchutil.add_common_args(ap)
    a = ap.parse_args(argv)
    if a.smoke:
        a.batches, a.layers, a.sweep_batch = "2", "1,2", 2
    return a


def main(a):
    global H, HV, K, V
    benchutil.setup_jax(a.smoke)
    if a.smoke:
        H, HV, K, V = 2, 6, 32, 32
    t_start = time.time()
    os.makedirs(a.out, exist_ok=True)
    print(jax.devices(), "cupti:", _CUPTI is not None, flush=True)
    copies, bw_src, bw = benchutil.floor_copies(a.out)
    result = dict(
        device=str(jax.devices()[0].device_kind),
        copy_TB_per_s={k: v / 1e12 for k, v in copies.items()},
        floor_bandwidth=bw_src,
        default_config=vars(fold.FoldConfig()),
        sweep=[],
        rows=[],
    )

    def dump():
        with open(os.path.join(a.out, "fold_bench.json"), "w") as f:
            json.dump(result, f, indent=1)
        write_md(result, a, bw)

    best = {}
    if a.sweep:
        for bv, nw, hd in SWEEP:
            for cd in (jnp.bfloat16, jnp.float32):
                cfg = fold.FoldConfig(block_v=bv, num_warps=nw, heads=hd)
                try:
                    r = run_case(1, a.sweep_batch, cd, "hilo", config=cfg, time_ref=False)
                except Exception as e:  # noqa: BLE001
                    print("sweep", cfg, repr(e)[:500], flush=True)
                    continue
                result["sweep"].append(r)
                tol = 1e-5 if cd == jnp.float32 else 1e-2
                ok = r["finite"] and r["err_vs_ref"] is not None and r["err_vs_ref"] < tol
                name = jnp.dtype(cd).name
                if ok and (name not in best or r["kernel_us"] < best[name][1]):
                    best[name] = (cfg, r["kernel_us"])
                print(
                    f"sweep block_v={bv} warps={nw} heads={hd} {name}: {r['kernel_us']:.1f} us "
                    f"(floor {r['bytes'] / bw * 1e6:.1f}) err {r['err_vs_ref']}",
                    flush=True,
                )
                dump()
        result["best"] = {k: vars(v[0]) for k, v in best.items()}
    ints = lambda text: [int(x) for x in text.split(",")]
    for layers, batch, cd, ring in itertools.product(
        ints(a.layers), ints(a.batches), (jnp.bfloat16, jnp.float32), ("hilo", "f32")
    ):
        if time.time() - t_start > a.budget_s:
            print(f"budget: stop before L{layers} B{batch}", flush=True)
            break
        t0 = time.time()
        try:
            cfg = best.get(jnp.dtype(cd).name, (None,))[0]
            r = run_case(layers, batch, cd, ring, config=cfg, with_ref=not a.no_ref)
        except Exception as e:  # noqa: BLE001
            print(f"L{layers} B{batch} {jnp.dtype(cd).name} {ring} FAILED: {e!r}"[:2000], flush=True)
            continue
        result["rows"].append(r)
        dump()
        print(
            f"L{layers} B{batch} {r['ckpt']} {ring}: kernel {r['kernel_us']:.1f} us "
            f"ref {r.get('ref_us', 0):.1f} us err {r['err_vs_ref']} ({time.time() - t0:.1f}s)",
            flush=True,
        )
    print(write_md(result, a, bw))
    return 0


if __name__ == "__main__":
    benchutil.run_main(parse, main)
