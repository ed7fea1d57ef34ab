"""Benchmark of the GDN replay-verify Pallas kernel against the XLA reference (and flash-linear-attention).

Run on the GPU machine (device tool), from the repository root:
    XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD python3 bench/gdn_verify_kernel.py --out $OUT
flash-linear-attention runs in its own process (.carry/anchors/fla_gdn_bench.py); pass its JSON lines
with --fla FILE (several files allowed) and they are folded into the markdown table.

Shapes: Qwen3.8-27B GDN layer (H 16, HV 48, K = V = 128); full windows of T tokens for `batch`
requests in slots 1..batch; q, k float32 (l2norm output), v bfloat16 (activation dtype), g, beta
float32. A bf16 checkpoint comes with the bf16 (hi, lo) ring and bf16 keys (fold policy `every`),
a float32 checkpoint with the float32 ring (policy `lazy`). Ring length 16 for T = 8, 32 for T = 16.
History: write_pos = 0 (none) or 8 records per slot.

Timing: the op runs `iters` times inside one jitted lax.fori_loop whose carry is the ring (aliased
in place, no copies: checked on the compiled HLO), wall clock around block_until_ready, median of
`reps` repetitions, divided by iters. The copy bandwidth is measured in the same process (a 1 GiB
float32 elementwise pass: read + write). Bytes that must move: the checkpoint tiles read once, the
window inputs, the history records read, the outputs and the window records written.

`--mosaic B1,B2,...`: the two-pass verify with its apply kernel in Triton and in Mosaic GPU
(jaxspec/pallas/gdn_apply_mosaic.py) side by side, bf16 checkpoint with one float32 ring part (the
Mosaic kernel's contract), T 8, each --hists; the same loop timing, the coefficient kernel alone,
and the Mosaic result's error against the Triton one. Then the script exits.
"""
import argparse
import dataclasses
import functools
import json
import os
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp

import benchutil  # bench/benchutil.py: the script directory is first on sys.path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jaxspec.ops.gdn import gdn_verify  # noqa: E402
from jaxspec.pallas import gdn_verify as kv  # noqa: E402
from jaxspec.pallas import gdn_apply_mosaic  # noqa: E402
from jaxspec.pallas import gdn_verify_two_pass as two_pass  # noqa: E402

H, HV, K, V = 16, 48, 128, 128


def make_inputs(batch, t, ckpt_dtype, hist, seed=0):
    ring_len = 16 if t <= 8 else 32
    hilo = ckpt_dtype == jnp.bfloat16
    key = jax.random.split(jax.random.PRNGKey(seed), 10)
    n, s1 = batch * t, batch + 1
    nrm = lambda x: x / jnp.sqrt(jnp.sum(x * x, -1, keepdims=True) + 1e-6)
    q = nrm(jax.random.normal(key[0], (n, H, K))) * K ** -0.5
    k = nrm(jax.random.normal(key[1], (n, H, K)))
    if hilo:
        k = k.astype(jnp.bfloat16).astype(jnp.float32)
    v = jax.random.normal(key[2], (n, HV, V), jnp.bfloat16)
    g = -0.1 * jax.nn.softplus(jax.random.normal(key[3], (n, HV)))
    beta = jax.nn.sigmoid(jax.random.normal(key[4], (n, HV)))
    ckpt = (0.3 * jax.random.normal(key[5], (s1, HV, K, V))).astype(ckpt_dtype)
    rk = nrm(jax.random.normal(key[6], (s1, H, ring_len, K))).astype(jnp.bfloat16 if hilo else jnp.float32)
    u = 0.2 * jax.random.normal(key[7], (s1, HV, ring_len, V))
    if hilo:
        hi = u.astype(jnp.bfloat16)
        ru = (hi, (u - hi.astype(jnp.float32)).astype(jnp.bfloat16))
    else:
        ru = u
    rg = -0.1 * jax.nn.softplus(jax.random.normal(key[8], (s1, HV, ring_len)))
    write_pos = jnp.full((s1,), hist, jnp.int32).at[0].set(0)
    qsl = jnp.arange(batch + 1, dtype=jnp.int32) * t
    slots = jnp.arange(1, batch + 1, dtype=jnp.int32)
    return (q, k, v, g, beta, ckpt, rk, ru, rg, write_pos, qsl, slots), ring_len


def nbytes(x):
    return x.size * x.dtype.itemsize


def must_move(args, t, hist):
    """Bytes each element of which must cross HBM once."""
    q, k, v, g, beta, ckpt, rk, ru, rg, write_pos, qsl, slots = args
    batch = slots.shape[0]
    ru_parts = ru if isinstance(ru, tuple) else (ru,)
    u_bytes = sum(p.dtype.itemsize for p in ru_parts)
    n = batch * t
    ckpt_read = batch * HV * K * V * ckpt.dtype.itemsize
    window = nbytes(q) + nbytes(k) + nbytes(v) + nbytes(g) + nbytes(beta)
    history = batch * hist * (H * K * rk.dtype.itemsize + HV * V * u_bytes + HV * 4)
    outputs = n * HV * V * 4 + n * (H * K * rk.dtype.itemsize + HV * V * u_bytes + HV * 4)
    return dict(ckpt=ckpt_read, total=ckpt_read + window + history + outputs)


def looped(fn, iters):
    @functools.partial(jax.jit, donate_argnums=(6, 7, 8))
    def run(q, k, v, g, beta, ckpt, rk, ru, rg, write_pos, qsl, slots):
        def body(i, c):
            rk, ru, rg, acc = c
            o, rk, ru, rg = fn(q, k, v, g, beta, ckpt, rk, ru, rg, write_pos, qsl, slots)
            return rk, ru, rg, acc + o[-1, -1, -1]
        return jax.lax.fori_loop(0, iters, body, (rk, ru, rg, jnp.float32(0)))
    return run


def count_copies(run, args):
    """Shapes of the copy instructions in the compiled loop (a ring copy would show up here)."""
    txt = run.lower(*args).compile().as_text()
    return re.findall(r"= (\S+) copy(?:-start)?\(", txt)


def time_loop(fn, args, iters, reps):
    """(median us, min us, copies) of the op inside a jitted fori_loop (launch gaps excluded)."""
    run = looped(fn, iters)
    state = list(args)
    copies = count_copies(run, state)
    out = run(*state)                      # compile + warm up
    jax.block_until_ready(out)
    state[6], state[7], state[8] = out[0], out[1], out[2]
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = run(*state)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / iters * 1e6)
        state[6], state[7], state[8] = out[0], out[1], out[2]
    return statistics.median(times), min(times), copies


def time_calls(fn, args, iters, reps):
    """(median us, copies) of back-to-back jitted calls with the ring donated (async dispatch)."""
    run = jax.jit(fn, donate_argnums=(6, 7, 8))
    state = list(args)
    copies = count_copies(run, state)
    out = run(*state)
    jax.block_until_ready(out)
    state[6], state[7], state[8] = out[1], out[2], out[3]
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = run(*state)
            state[6], state[7], state[8] = out[1], out[2], out[3]
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / iters * 1e6)
    return statistics.median(times), copies


INTERPRET = False


def kernel_fn(t, cfg):
    return lambda *a: kv.gdn_verify(*a, t, config=cfg, interpret=INTERPRET)


def coeff_fn(t, cfg):
    """The two-pass verify's first kernel alone (M's first column stands in for o)."""
    def fn(q, k, v, g, beta, ckpt, rk, ru, rg, write_pos, qsl, slots):
        mat, _, rk, rg = two_pass.coefficients(q, k, g, beta, rk, rg, write_pos, qsl, slots, t,
                                               block_k=min(cfg.block_k, K), num_warps=cfg.coeff_warps,
                                               interpret=INTERPRET, layer=None)
        return mat[..., 0], rk, ru, rg
    return fn


def coeff_us(t, cfg, batch, dtype, hist, iters, reps):
    """Median µs of the coefficient kernel alone, on fresh inputs (the full verify donated its own)."""
    a, _ = make_inputs(batch, t, dtype, hist)
    return round(time_loop(coeff_fn(t, cfg), a, iters, reps)[0], 1)


def ref_fn(t):
    return lambda *a: gdn_verify(*a, t, impl="ref")


def apply_variant_fn(t, cfg, which):
    """Coefficients + one apply kernel over a single float32 ring_u part (the Mosaic kernel's
    contract): which = "triton" (gdn_verify_two_pass.apply) or "mosaic" (gdn_apply_mosaic, its
    compact records scattered into the ring by XLA)."""
    def fn(q, k, v, g, beta, ckpt, rk, ru, rg, write_pos, qsl, slots):
        mat, mat_h, rk, rg = two_pass.coefficients(q, k, g, beta, rk, rg, write_pos, qsl, slots, t,
                                                   block_k=min(cfg.block_k, K), num_warps=cfg.coeff_warps,
                                                   interpret=INTERPRET, layer=None)
        if which == "mosaic":
            o, ru = gdn_apply_mosaic.apply_mosaic(q, k, v, ckpt, mat, mat_h, ru, write_pos, qsl, slots, t,
                                                  interpret=INTERPRET)
        else:
            o, (ru,) = two_pass.apply(q, k, v, ckpt, mat, mat_h, (ru,), write_pos, qsl, slots, t,
                                      block_v=min(cfg.block_v, V), block_k=min(cfg.block_k, K),
                                      num_warps=cfg.num_warps, num_stages=cfg.num_stages, pad_rows=cfg.pad_rows,
                                      interpret=INTERPRET, layer=None)
        return o, rk, ru, rg
    return fn


def f32_ring(args):
    """The bf16 case's inputs with ring_u as one float32 part (hi + lo)."""
    args = list(args)
    if isinstance(args[7], tuple):
        hi, lo = args[7]
        args[7] = hi.astype(jnp.float32) + lo.astype(jnp.float32)
    return tuple(args)


# (ckpt dtype, config fields) tried by --sweep at batch 128, T 8, no history; the fastest per dtype is
# then used for the whole table. The first of each dtype is the default (fastest measured so far).
SWEEP = [
    ("bf16", dict(group="two_pass", block_v=128, block_k=32, num_stages=3, coeff_warps=1)),
    ("bf16", dict(group="two_pass", block_v=128, block_k=32, num_stages=4, coeff_warps=1)),
    ("bf16", dict(group="two_pass", block_v=128, block_k=64, num_stages=2, coeff_warps=1)),
    ("bf16", dict(group="two_pass", block_v=128, block_k=64, num_stages=3, coeff_warps=1)),
    ("bf16", dict(group="two_pass", block_v=128, block_k=32, num_stages=3, coeff_warps=2)),
    ("bf16", dict(group="value_head", block_v=128, block_k=64)),
    ("f32", dict(group="two_pass", block_v=64, block_k=32, coeff_warps=1)),
    ("f32", dict(group="two_pass", block_v=128, block_k=16, num_stages=3, coeff_warps=1)),
    ("f32", dict(group="two_pass", block_v=128, block_k=32, num_stages=3, coeff_warps=1)),
    ("f32", dict(group="two_pass", block_v=64, block_k=32, num_stages=3, coeff_warps=1)),
    ("f32", dict(group="value_head", block_v=64, block_k=32)),
]
DTYPES = {"bf16": jnp.bfloat16, "f32": jnp.float32}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--ts", default="8,16")
    ap.add_argument("--dtypes", default="bf16,f32")
    ap.add_argument("--hists", default="0,8")
    ap.add_argument("--sweep", action="store_true", help="sweep configs at batch 128 first, keep the best")
    ap.add_argument("--sweep-batch", type=int, default=128)
    ap.add_argument("--no-ref", action="store_true")
    ap.add_argument("--ref-batches", default="", help="run the XLA reference only at these batches (default all)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--fla", nargs="*", default=[])
    ap.add_argument("--config", default="", help='dtype=json-config;... e.g. bf16={"group":"key_head"}')
    ap.add_argument("--profile", default="", help="dtype:json-config: run that kernel 3 times at batch 128, T 8 (for ncu)")
    ap.add_argument("--interpret", action="store_true", help="CPU smoke run of the script (interpret mode)")
    ap.add_argument("--mosaic", default="", help="batches at which to time coefficients + the Triton and the "
                    "Mosaic apply (bf16 checkpoint, float32 ring, T 8, --hists), then exit")
    args_cli = ap.parse_args()
    global INTERPRET
    INTERPRET = args_cli.interpret
    os.makedirs(args_cli.out, exist_ok=True)
    log = open(os.path.join(args_cli.out, "gdn_verify_bench.jsonl"), "a")

    def emit(rec):
        print(json.dumps(rec), flush=True)
        log.write(json.dumps(rec) + "\n")
        log.flush()

    if args_cli.profile:
        d, fields = args_cli.profile.split(":", 1)
        cfg = kv.VerifyConfig(**json.loads(fields))
        a, _ = make_inputs(128, 8, DTYPES[d], 0)
        run = jax.jit(lambda *x: kv.gdn_verify(*x, 8, config=cfg, interpret=False))
        for _ in range(3):
            jax.block_until_ready(run(*a))
        return
    bw, copy_us = benchutil.jax_copy_bandwidth()
    emit(dict(kind="copy", bytes=round(bw * copy_us * 1e-6), us=round(copy_us, 1), TB_per_s=round(bw / 1e12, 3),
              device=str(jax.devices()[0].device_kind)))
    if args_cli.mosaic:
        cfg = kv.default_config(jnp.bfloat16, V)
        for batch in [int(b) for b in args_cli.mosaic.split(",")]:
            for hist in [int(h) for h in args_cli.hists.split(",")]:
                mv = must_move(f32_ring(make_inputs(batch, 8, jnp.bfloat16, hist)[0]), 8, hist)
                rec = dict(kind="mosaic", batch=batch, hist=hist, ckpt_floor_us=round(mv["ckpt"] / bw * 1e6, 1),
                           floor_us=round(mv["total"] / bw * 1e6, 1))
                for which in ("triton", "mosaic"):
                    try:
                        a = f32_ring(make_inputs(batch, 8, jnp.bfloat16, hist)[0])     # fresh: the ring is donated
                        us, us_min, copies = time_loop(apply_variant_fn(8, cfg, which), a, args_cli.iters,
                                                       args_cli.reps)
                        rec.update({f"{which}_us": round(us, 1), f"{which}_copies": copies[:4]})
                    except Exception as e:
                        rec[f"{which}_error"] = str(e)[:300]
                outs = [jax.jit(apply_variant_fn(8, cfg, w))(*f32_ring(make_inputs(batch, 8, jnp.bfloat16, hist)[0]))
                         for w in ("triton", "mosaic")]
                for name, i in (("o", 0), ("ring_u", 2)):        # the Mosaic result against the Triton one
                    ref, got = outs[0][i], outs[1][i]
                    ok = jnp.isfinite(ref)
                    rec[f"err_{name}"] = float(jnp.max(jnp.where(ok, jnp.abs(got - ref), 0.0)) /
                                               jnp.max(jnp.where(ok, jnp.abs(ref), 0.0)))
                rec["coeff_us"] = coeff_us(8, cfg, batch, jnp.bfloat16, hist, args_cli.iters, args_cli.reps)
                emit(rec)
        return
    best = {d: kv.default_config(DTYPES[d], V) for d in DTYPES}
    for spec in filter(None, args_cli.config.split(";")):
        d, fields = spec.split("=", 1)
        best[d] = kv.VerifyConfig(**json.loads(fields))
    dtypes = args_cli.dtypes.split(",")
    ts = [int(x) for x in args_cli.ts.split(",")]
    if args_cli.sweep:
        results = {d: [] for d in dtypes}
        for d, fields in SWEEP:
            if d not in dtypes:
                continue
            cfg = kv.VerifyConfig(**fields)
            a, _ = make_inputs(args_cli.sweep_batch, 8, DTYPES[d], 0)
            name = ",".join(f"{k}={v}" for k, v in fields.items())
            try:
                us, us_min, copies = time_loop(kernel_fn(8, cfg), a, args_cli.iters, args_cli.reps)
            except Exception as e:  # a config that fails to compile is reported, not fatal
                emit(dict(kind="sweep", dtype=d, variant=name, error=str(e)[:300]))
                continue
            mv = must_move(a, 8, 0)
            extra = {}
            if cfg.group == "two_pass":
                extra["coeff_us"] = coeff_us(8, cfg, args_cli.sweep_batch, DTYPES[d], 0, args_cli.iters, args_cli.reps)
            emit(dict(kind="sweep", dtype=d, variant=name, us=round(us, 1), us_min=round(us_min, 1),
                      frac_bw=round(mv["total"] / bw / (us * 1e-6), 3), copies=copies[:6], **extra))
            results[d].append((us, cfg))
        for d in dtypes:
            if results[d]:
                best[d] = min(results[d], key=lambda r: r[0])[1]
            emit(dict(kind="best", dtype=d, config=dataclasses.asdict(best[d])))

    rows = []
    for t in ts:
        for d in dtypes:
            for batch in [int(b) for b in args_cli.batches.split(",")]:
                for hist in [int(h) for h in args_cli.hists.split(",")]:
                    a, ring_len = make_inputs(batch, t, DTYPES[d], hist)
                    mv = must_move(a, t, hist)
                    iters = args_cli.iters if batch >= 32 else 4 * args_cli.iters
                    rec = dict(kind="case", T=t, ckpt=d, batch=batch, hist=hist, ring=ring_len,
                               config=dataclass_tuple(best[d]), bytes=mv["total"], ckpt_bytes=mv["ckpt"],
                               floor_us=round(mv["total"] / bw * 1e6, 1), ckpt_floor_us=round(mv["ckpt"] / bw * 1e6, 1))
                    try:
                        us, us_min, copies = time_loop(kernel_fn(t, best[d]), a, iters, args_cli.reps)
                        rec.update(us_loop=round(us, 1), us_min=round(us_min, 1), copies=copies[:6])
                        if copies:   # XLA copied something inside the loop: time donated calls as well
                            a, _ = make_inputs(batch, t, DTYPES[d], hist)
                            c_us, c_copies = time_calls(kernel_fn(t, best[d]), a, iters, args_cli.reps)
                            rec.update(us_calls=round(c_us, 1), copies_calls=c_copies[:6])
                            us = us if c_copies else min(us, c_us)
                        rec.update(us=round(us, 1), frac_bw=round(mv["total"] / bw / (us * 1e-6), 3))
                        if best[d].group == "two_pass":
                            rec.update(coeff_us=coeff_us(t, best[d], batch, DTYPES[d], hist, iters, args_cli.reps))
                    except Exception as e:
                        rec.update(error=str(e)[:300])
                    ref_b = [int(x) for x in args_cli.ref_batches.split(",") if x]
                    if not args_cli.no_ref and (not ref_b or batch in ref_b):
                        try:
                            a, _ = make_inputs(batch, t, DTYPES[d], hist)
                            r_us, _, r_copies = time_loop(ref_fn(t), a, max(4, iters // 10), max(3, args_cli.reps // 2))
                            rec.update(ref_us=round(r_us, 1), ref_copies=r_copies[:6])
                            if "us" in rec:
                                rec["speedup_vs_ref"] = round(r_us / rec["us"], 2)
                        except Exception as e:
                            rec.update(ref_error=str(e)[:300])
                    emit(rec)
                    rows.append(rec)
    fla = load_fla(args_cli.fla)
    write_markdown(os.path.join(args_cli.out, "gdn_verify_bench.md"), bw, rows, fla)


def dataclass_tuple(cfg):
    grp = {"value_head": "V", "key_head": "Kp" if cfg.prefetch else "K", "two_pass": f"2P{cfg.coeff_warps}"}[cfg.group]
    return [grp, cfg.block_v, cfg.block_k, cfg.num_warps, cfg.num_stages]


def load_fla(paths):
    out = {}
    for p in paths:
        if not os.path.exists(p):
            continue
        for line in open(p):
            line = line.strip()
            if not line.startswith("{"):
                continue
            r = json.loads(line)
            if r.get("kernel") == "fla fused_recurrent":
                d = "f32" if "float32" in r["state"] else "bf16"
                out[(r["T"], d, r["batch"])] = r["us"]
            if r.get("kernel", "").startswith("torch copy"):
                out["copy_TBps"] = r["TB_per_s"]
    return out


def write_markdown(path, bw, rows, fla):
    lines = [
        "# GDN replay verify: Pallas (Triton) kernel",
        "",
        f"Device: {jax.devices()[0].device_kind}; copy bandwidth measured in the same run: {bw / 1e12:.2f} TB/s"
        + (f" (torch copy in the fla process: {fla['copy_TBps']} TB/s)" if "copy_TBps" in fla else "") + ".",
        "H 16, HV 48, K = V = 128, full windows of T tokens; bf16 checkpoint with the bf16 (hi, lo) ring,",
        "fp32 checkpoint with the fp32 ring. floor = bytes that must move / copy bandwidth; ckpt floor = the",
        "checkpoint read once. frac = floor / time. fla = flash-linear-attention fused_recurrent (H = HV,",
        "separate process, same machine), state of the checkpoint's dtype.",
        "",
        "| T | ckpt | hist | batch | config (group,BV,BK,W,S) | kernel us | MB | floor us | ckpt floor us | frac bw | XLA ref us | x vs ref | fla us | x vs fla |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        f = fla.get((r["T"], r["ckpt"], r["batch"]))
        us = r.get("us")
        lines.append("| {T} | {ckpt} | {hist} | {batch} | {cfg} | {us_s} | {mb:.1f} | {floor_us} | {ckpt_floor_us} | {frac} | "
                     "{ref} | {sp} | {fla} | {xf} |".format(
                         cfg=",".join(map(str, r["config"])), us_s=us if us is not None else r.get("error", "-")[:60],
                         mb=r["bytes"] / 1e6, frac=r.get("frac_bw", "-"), ref=r.get("ref_us", "-"),
                         sp=r.get("speedup_vs_ref", "-"), fla=f if f else "-",
                         xf=round(f / us, 1) if (f and us) else "-", **r))
    open(path, "w").write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
