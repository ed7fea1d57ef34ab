"""Separate vs fused same-input projections (jaxspec.fused) at real shapes: one layer kind's input
projections, --layers distinct layers chained in one jitted program (so no weight stays in L2), bf16,
at --batches rows. Reports µs a layer (wall of back-to-back calls / layers), the bytes' rate, and the
kernels and concatenates XLA's optimized program holds (a `concatenate` there is XLA's dot merger
copying separate weights together at every call).

Usage (GPU): PYTHONPATH=$PWD python3 bench/fused_projections.py --out $OUT
Writes DIR/fused_projections.md and .json (DIR = --out, default $OUT or bench/out).
"""

import argparse
import json
import os
import re
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxspec.fused import split_columns  # noqa: E402

# name -> (d, widths of the projections that read one input), Qwen3.5-27B and Qwen3.5-35B-A3B
SHAPES = {
    "27b GDN in [qkv|a|b|z]": (5120, (2 * 16 * 128 + 48 * 128, 48, 48, 48 * 128)),
    "27b attention in [q|k|v]": (5120, (2 * 24 * 256, 4 * 256, 4 * 256)),
    "27b MLP in [gate|up]": (5120, (17408, 17408)),
    "35b-a3b GDN in": (2048, (2 * 16 * 128 + 32 * 128, 32, 32, 32 * 128)),
    "35b-a3b MoE in [router|shared_gate|gate|up]": (2048, (256, 1, 512, 512)),
    "35b-a3b attention in": (2048, (2 * 16 * 256, 2 * 256, 2 * 256)),
}


def case(d, widths, batch, layers, fused, reps):
    """(µs a layer, TB/s of the weights, kernels in the entry computation, concatenates)."""
    keys = iter(jax.random.split(jax.random.PRNGKey(0), layers * len(widths) + 1))
    if fused:
        ws = [jax.random.normal(next(keys), (d, sum(widths)), jnp.bfloat16) for _ in range(layers)]
    else:
        ws = [[jax.random.normal(next(keys), (d, n), jnp.bfloat16) for n in widths] for _ in range(layers)]
    x = jax.random.normal(next(keys), (batch, d), jnp.bfloat16)

    @jax.jit
    def run(x, ws):
        total = jnp.zeros((batch,), jnp.float32)
        for w in ws:
            outs = split_columns(jnp.dot(x, w), widths) if fused else [jnp.dot(x, part) for part in w]
            s = sum(o[:, :1].astype(jnp.float32).sum(-1) for o in outs)
            x = x + (s[:, None] * 1e-3).astype(x.dtype)  # chain the layers
            total = total + s
        return total

    text = run.lower(x, ws).compile().as_text()
    entry = text[text.index("ENTRY") :]
    kernels = sum(1 for line in entry.splitlines() if " = " in line and ("fusion(" in line or "custom-call(" in line))
    concats = len(re.findall(r" concatenate\(", text))
    for _ in range(3):
        jax.block_until_ready(run(x, ws))
    start = time.perf_counter()
    for _ in range(reps):
        out = run(x, ws)
    jax.block_until_ready(out)
    seconds = (time.perf_counter() - start) / reps
    nbytes = layers * d * sum(widths) * 2
    return seconds / layers * 1e6, nbytes / seconds / 1e12, kernels, concats


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--shapes", default="", help="only the SHAPES whose name holds this text (default: all)")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/out"))
    args = ap.parse_args(argv)
    rows = []
    for name, (d, widths) in SHAPES.items():
        if args.shapes not in name:
            continue
        for batch in (int(b) for b in args.batches.split(",")):
            r = {"shape": name, "batch": batch}
            for form in ("separate", "fused"):
                us, tbs, kernels, concats = case(d, widths, batch, args.layers, form == "fused", args.reps)
                r[form] = dict(us=us, TB_per_s=tbs, kernels=kernels, concatenates=concats)
            rows.append(r)
            print(json.dumps(r), flush=True)
    os.makedirs(args.out, exist_ok=True)
    info = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, layers=args.layers, rows=rows)
    with open(os.path.join(args.out, "fused_projections.json"), "w") as f:
        json.dump(info, f, indent=1)
    lines = [
        f"# fused projections, {info['device']}, jax {info['jax']}, {args.layers} layers",
        "",
        "| projections | batch | separate µs a layer (TB/s; kernels, concatenates) | fused | fused / separate |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        s, f = r["separate"], r["fused"]
        lines.append(
            f"| {r['shape']} | {r['batch']} | {s['us']:.1f} ({s['TB_per_s']:.2f}; {s['kernels']}, {s['concatenates']}) "
            f"| {f['us']:.1f} ({f['TB_per_s']:.2f}; {f['kernels']}, {f['concatenates']}) | {f['us'] / s['us']:.2f} |"
        )
    with open(os.path.join(args.out, "fused_projections.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return info


if __name__ == "__main__":
    main()
