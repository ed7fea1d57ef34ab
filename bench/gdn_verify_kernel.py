"""GDN replay verify: the Pallas kernel (jaxspec/pallas/gdn_verify.py) against XLA, its byte floors and fla.

Shapes: a Qwen3.8-27B GDN layer (H 16, HV 48, K = V = 128); full windows of T tokens (--ts) for B
requests (--batches) in slots 1..B; q, k float32, v bf16, g, beta float32. A bf16 checkpoint comes
with bf16 ring keys and the bf16 (hi, lo) ring, a float32 checkpoint with the float32 ring. Ring
length 16 for T <= 8, else 32; history: write_pos = 0 or 8 records a slot (--hists).

Method: the op runs `iters` times in one jitted lax.fori_loop whose carry is the ring, aliased in
place; median over `reps` of wall time / iters. Where the compiled loop holds a copy, donated
back-to-back calls are timed too, and the faster of the two kept if those calls copy nothing. The
coefficient kernel is timed alone the same way. floor = bytes that must move (checkpoint read once,
window inputs, history records read, o and the window records written) / the fastest copy of the
run (`benchutil.floor_copies`); ckpt floor = the checkpoint read alone. XLA =
`jaxspec.ops.gdn.gdn_verify(impl="ref")` under jit. fla = flash-linear-attention's fused_recurrent
(H = HV, state in the checkpoint's dtype) from the anchor's JSON lines (--fla, its own process).
--sweep first times SWEEP at one batch and keeps the fastest config per checkpoint dtype.

Usage (GPU):
  python3 bench/gdn_verify_kernel.py --torch-copy --out $OUT       (own process, first)
  PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false python3 bench/gdn_verify_kernel.py --out $OUT \\
      [--sweep] [--fla fla_T8.jsonl ...]
  python3 bench/gdn_verify_kernel.py --smoke      (CPU, interpret mode, tiny shapes: checks the script)
Writes DIR/gdn_verify_bench.jsonl (a line a case) and DIR/gdn_verify_bench.md.
"""

import argparse
import dataclasses
import functools
import itertools
import json
import os
import re
import statistics
import sys
import time

import benchutil  # bench/benchutil.py: the script directory is first on sys.path
import jax
import jax.numpy as jnp

sys.path.insert(0, benchutil.ROOT)
from jaxspec.ops.gdn import gdn_verify  # noqa: E402
from jaxspec.pallas import gdn_verify as kv  # noqa: E402
from jaxspec.pallas.hardware import default_interpret  # noqa: E402

H, HV, K, V = 16, 48, 128, 128


def make_inputs(batch, t, ckpt_dtype, hist, seed=0):
    ring_len = 16 if t <= 8 else 32
    hilo = ckpt_dtype == jnp.bfloat16
    key = jax.random.split(jax.random.PRNGKey(seed), 10)
    n, s1 = batch * t, batch + 1
    nrm = lambda x: x / jnp.sqrt(jnp.sum(x * x, -1, keepdims=True) + 1e-6)
    q = nrm(jax.random.normal(key[0], (n, H, K))) * K**-0.5
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
    out = run(*state)  # compile + warm up
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


def kernel_fn(t, cfg):
    return lambda *a: kv.gdn_verify(*a, t, config=cfg)


def coeff_fn(t, cfg):
    """The coefficient kernel alone (M's first column stands in for o)."""

    def fn(q, k, v, g, beta, ckpt, rk, ru, rg, write_pos, qsl, slots):
        mat, _, rk, rg = kv.coefficients(
            q,
            k,
            g,
            beta,
            rk,
            rg,
            write_pos,
            qsl,
            slots,
            t,
            block_k=min(cfg.block_k, K),
            num_warps=cfg.coeff_warps,
            interpret=default_interpret(),
            layer=None,
        )
        return mat[..., 0], rk, ru, rg

    return fn


def coeff_us(t, cfg, batch, dtype, hist, iters, reps):
    """Median µs of the coefficient kernel alone, on fresh inputs (the full verify donated its own)."""
    a, _ = make_inputs(batch, t, dtype, hist)
    return round(time_loop(coeff_fn(t, cfg), a, iters, reps)[0], 1)


def ref_fn(t):
    return lambda *a: gdn_verify(*a, t, impl="ref")


# (ckpt dtype, VerifyConfig fields) timed by --sweep at --sweep-batch, T 8, no history; the first of
# each dtype is kv.default_config's choice.
SWEEP = [
    ("bf16", dict(block_v=128, block_k=32, num_stages=3)),
    ("bf16", dict(block_v=128, block_k=32, num_stages=4)),
    ("bf16", dict(block_v=128, block_k=64, num_stages=2)),
    ("bf16", dict(block_v=128, block_k=64, num_stages=3)),
    ("bf16", dict(block_v=128, block_k=32, num_stages=3, coeff_warps=2)),
    ("bf16", dict(block_v=128, block_k=32, num_stages=3, num_warps=8)),
    ("bf16", dict(block_v=64, block_k=32, num_stages=3)),
    ("f32", dict(block_v=64, block_k=32)),
    ("f32", dict(block_v=128, block_k=16, num_stages=3)),
    ("f32", dict(block_v=128, block_k=32, num_stages=3)),
    ("f32", dict(block_v=64, block_k=32, num_stages=3)),
]
DTYPES = {"bf16": jnp.bfloat16, "f32": jnp.float32}


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--ts", default="8,16")
    ap.add_argument("--dtypes", default="bf16,f32")
    ap.add_argument("--hists", default="0,8")
    ap.add_argument("--sweep", action="store_true", help="time SWEEP at --sweep-batch first, keep the fastest")
    ap.add_argument("--sweep-batch", type=int, default=128)
    ap.add_argument("--no-ref", action="store_true")
    ap.add_argument("--ref-batches", default="", help="run the XLA reference only at these batches (default all)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--fla", nargs="*", default=[], help="the fla anchor's JSON lines (files)")
    ap.add_argument("--config", default="", help='dtype=json;... VerifyConfig per dtype, e.g. bf16={"block_v":64}')
    ap.add_argument(
        "--profile", default="", help="dtype:json: run that config 3 times at batch 128, T 8, then exit (for ncu)"
    )
    benchutil.add_common_args(ap)
    args = ap.parse_args(argv)
    if args.smoke:
        args.batches, args.ts, args.hists, args.sweep_batch, args.iters, args.reps = "2", "8", "8", 2, 1, 1
    return args


def main(args):
    global H, HV, K, V
    benchutil.setup_jax(args.smoke)
    if args.smoke:
        H, HV, K, V = 2, 4, 32, 32
    t_start = time.time()
    os.makedirs(args.out, exist_ok=True)
    log = open(os.path.join(args.out, "gdn_verify_bench.jsonl"), "a")

    def emit(rec):
        print(json.dumps(rec), flush=True)
        log.write(json.dumps(rec) + "\n")
        log.flush()

    if args.profile:
        d, fields = args.profile.split(":", 1)
        a, _ = make_inputs(128, 8, DTYPES[d], 0)
        run = jax.jit(kernel_fn(8, kv.VerifyConfig(**json.loads(fields))))
        for _ in range(3):
            jax.block_until_ready(run(*a))
        return 0
    copies, bw_src, bw = benchutil.floor_copies(args.out)
    emit(
        dict(
            kind="copy",
            TB_per_s={k: round(v / 1e12, 3) for k, v in copies.items()},
            floor=bw_src,
            device=str(jax.devices()[0].device_kind),
        )
    )
    best = {d: kv.default_config(DTYPES[d], V) for d in DTYPES}
    for spec in filter(None, args.config.split(";")):
        d, fields = spec.split("=", 1)
        best[d] = kv.VerifyConfig(**json.loads(fields))
    dtypes = args.dtypes.split(",")
    if args.sweep:
        results = {d: [] for d in dtypes}
        for d, fields in SWEEP:
            if d not in dtypes:
                continue
            cfg = kv.VerifyConfig(**fields)
            a, _ = make_inputs(args.sweep_batch, 8, DTYPES[d], 0)
            name = ",".join(f"{k}={v}" for k, v in fields.items())
            try:
                us, us_min, copied = time_loop(kernel_fn(8, cfg), a, args.iters, args.reps)
            except Exception as e:  # a config that fails to compile is reported, not fatal
                emit(dict(kind="sweep", dtype=d, variant=name, error=str(e)[:300]))
                continue
            mv = must_move(a, 8, 0)
            emit(
                dict(
                    kind="sweep",
                    dtype=d,
                    variant=name,
                    us=round(us, 1),
                    us_min=round(us_min, 1),
                    frac_bw=round(mv["total"] / bw / (us * 1e-6), 3),
                    copies=copied[:6],
                    coeff_us=coeff_us(8, cfg, args.sweep_batch, DTYPES[d], 0, args.iters, args.reps),
                )
            )
            results[d].append((us, cfg))
        for d in dtypes:
            if results[d]:
                best[d] = min(results[d], key=lambda r: r[0])[1]
            emit(dict(kind="best", dtype=d, config=dataclasses.asdict(best[d])))

    rows = []
    ref_b = [int(x) for x in args.ref_batches.split(",") if x]
    ints = lambda text: [int(x) for x in text.split(",")]
    for t, d, batch, hist in itertools.product(ints(args.ts), dtypes, ints(args.batches), ints(args.hists)):
        if time.time() - t_start > args.budget_s:
            print(f"budget: stop before T {t}, {d}, batch {batch}, hist {hist}", flush=True)
            break
        run_ref = not args.no_ref and (not ref_b or batch in ref_b)
        rows.append(run_case(args, t, d, batch, hist, best[d], bw, run_ref))
        emit(rows[-1])
    write_markdown(os.path.join(args.out, "gdn_verify_bench.md"), bw_src, bw, rows, load_fla(args.fla))
    return 0


def run_case(args, t, d, batch, hist, cfg, bw, run_ref):
    """One table row: the kernel (and its coefficient pass) and, with run_ref, the XLA reference."""
    a, ring_len = make_inputs(batch, t, DTYPES[d], hist)
    mv = must_move(a, t, hist)
    iters = args.iters if batch >= 32 else 4 * args.iters
    rec = dict(
        kind="case",
        T=t,
        ckpt=d,
        batch=batch,
        hist=hist,
        ring=ring_len,
        config=config_label(cfg),
        bytes=mv["total"],
        ckpt_bytes=mv["ckpt"],
        floor_us=round(mv["total"] / bw * 1e6, 1),
        ckpt_floor_us=round(mv["ckpt"] / bw * 1e6, 1),
    )
    try:
        us, us_min, copied = time_loop(kernel_fn(t, cfg), a, iters, args.reps)
        rec.update(us_loop=round(us, 1), us_min=round(us_min, 1), copies=copied[:6])
        if copied:  # XLA copied something inside the loop: time donated calls as well
            a, _ = make_inputs(batch, t, DTYPES[d], hist)
            c_us, c_copied = time_calls(kernel_fn(t, cfg), a, iters, args.reps)
            rec.update(us_calls=round(c_us, 1), copies_calls=c_copied[:6])
            us = us if c_copied else min(us, c_us)
        rec.update(
            us=round(us, 1),
            frac_bw=round(mv["total"] / bw / (us * 1e-6), 3),
            coeff_us=coeff_us(t, cfg, batch, DTYPES[d], hist, iters, args.reps),
        )
    except Exception as e:
        rec.update(error=str(e)[:300])
    if run_ref:
        try:
            a, _ = make_inputs(batch, t, DTYPES[d], hist)
            r_us, _, r_copied = time_loop(ref_fn(t), a, max(4, iters // 10), max(3, args.reps // 2))
            rec.update(ref_us=round(r_us, 1), ref_copies=r_copied[:6])
            if "us" in rec:
                rec["speedup_vs_ref"] = round(r_us / rec["us"], 2)
        except Exception as e:
            rec.update(ref_error=str(e)[:300])
    return rec


def config_label(cfg):
    return [cfg.block_v, cfg.block_k, cfg.num_warps, cfg.num_stages, cfg.coeff_warps]


def load_fla(paths):
    """{(T, ckpt dtype, batch): µs} of the anchor's "fla fused_recurrent" lines."""
    out = {}
    for p in paths:
        if not os.path.exists(p):
            continue
        for line in open(p):
            if not line.startswith("{"):
                continue
            r = json.loads(line)
            if r.get("kernel") == "fla fused_recurrent":
                out[(r["T"], "f32" if "float32" in r["state"] else "bf16", r["batch"])] = r["us"]
    return out


def write_markdown(path, bw_src, bw, rows, fla):
    lines = [
        "# GDN replay verify: Pallas kernel",
        "",
        f"Device: {jax.devices()[0].device_kind}; floors at {bw_src} {bw / 1e12:.2f} TB/s (same run).",
        f"H {H}, HV {HV}, K = V = {K}, full windows of T tokens; bf16 checkpoint with the bf16 (hi, lo) ring,",
        "fp32 checkpoint with the fp32 ring. floor = bytes that must move / copy bandwidth; ckpt floor = the",
        "checkpoint read once. frac = floor / time. coeff = the coefficient kernel alone. fla =",
        "flash-linear-attention fused_recurrent (H = HV, own process), state of the checkpoint's dtype.",
        "",
        "| T | ckpt | hist | batch | config (BV,BK,W,S,CW) | kernel us | coeff us | MB | floor us | ckpt floor us "
        "| frac bw | XLA ref us | x vs ref | fla us | x vs fla |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        f = fla.get((r["T"], r["ckpt"], r["batch"]))
        us = r.get("us")
        lines.append(
            "| {T} | {ckpt} | {hist} | {batch} | {cfg} | {us_s} | {coeff} | {mb:.1f} | {floor_us} "
            "| {ckpt_floor_us} | {frac} | {ref} | {sp} | {fla} | {xf} |".format(
                cfg=",".join(map(str, r["config"])),
                us_s=us if us is not None else r.get("error", "-")[:60],
                coeff=r.get("coeff_us", "-"),
                mb=r["bytes"] / 1e6,
                frac=r.get("frac_bw", "-"),
                ref=r.get("ref_us", "-"),
                sp=r.get("speedup_vs_ref", "-"),
                fla=f or "-",
                xf=round(f / us, 1) if (f and us) else "-",
                **r,
            )
        )
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    benchutil.run_main(parse, main)
