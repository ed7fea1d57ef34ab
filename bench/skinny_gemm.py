"""The target's projections at Qwen3.5-27B shapes with few rows: each form of `x @ W` against its weight-read floor.

Few rows: decode and verify steps.

Shapes: bf16 weight sets, the SwiGLU MLP (gate, up [5120, 17408], down [17408, 5120], 535 MB),
a GDN layer's projections (qkv [5120, 10240], z [5120, 6144], a, b [5120, 48], out [6144, 5120],
232 MB), the lm_head [5120, 248320] (2.5 GB) and `moe35`, the two narrow once-a-layer products of
the Qwen3.5-35B-A3B MoE block (the fused input [router | shared gate | shared gate / up]
[2048, 1281] and the shared expert's down [512, 2048], 7.3 MB; its rows are M tokens of hidden
2048), at M rows for M in --rows. Variants of `x @ W`:
  highest    jnp.dot(..., precision=HIGHEST, preferred_element_type=float32).astype(bf16)
  default    the same with the default precision
  pad8       highest on x padded with zero rows to a multiple of 8 (a shape XLA hands to cuBLAS)
  bf16_out   jnp.dot(x, W), bf16 result (XLA picks the accumulation): `jaxspec.ops.linear.dense`
             on bf16 operands
  transposed the weights stored [N, K] (made so before the call), einsum("mk,nk->mn"), bf16 result:
             the reduction runs over the contiguous axis (for one row XLA emits a row reduction
             instead of a column reduction over K)
  rowsum_t   the same layout as an explicit float32 multiply and row sum
Each row also records its output's max |error| against the float64 product, relative to the
product's max |value| (`rel_err`).
Method: each function jitted; GPU busy = the kernels' summed durations from a profiler trace
(`benchutil.gpu_kernel_times`), with the kernel names; floor = weight bytes / the fastest copy of
the run (`benchutil.floor_copies`). Run it under different XLA_FLAGS in one device call to compare
flags (--tag names the run).

Usage (GPU):
  python3 bench/skinny_gemm.py --torch-copy --out $OUT      (own process, first)
  PYTHONPATH=$PWD python3 bench/skinny_gemm.py --out $OUT [--rows 1,2,4,8,16,32,64]
  python3 bench/skinny_gemm.py --smoke      (CPU, small shapes)
Writes DIR/skinny_gemm_TAG.json and prints a table.
"""

import argparse
import json
import os

import benchutil  # bench/benchutil.py: the script directory is first on sys.path
import numpy as np

D, I, VOCAB = 5120, 17408, 248320
GDN = dict(qkv=(D, 10240), z=(D, 6144), a=(D, 48), b=(D, 48), out=(6144, D))
MOE35 = dict(moe_in=(2048, 256 + 1 + 2 * 512), shared_down=(512, 2048))
HIDDEN = dict(mlp=D, gdn=D, lm_head=D, moe35=2048)
TRANSPOSED = ("transposed", "rowsum_t")  # variants that take each weight as [N, K]


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,4,8,16,32,64")
    ap.add_argument(
        "--variants",
        default="highest,default,pad8,bf16_out,transposed",
        help="comma list of the variants above (rowsum_t: on request)",
    )
    ap.add_argument("--sets", default="mlp,gdn,lm_head,moe35")
    ap.add_argument("--tag", default=os.environ.get("XLA_FLAGS", "") or "default flags")
    benchutil.add_common_args(ap, budget=False)
    return ap.parse_args(argv)


def main(args):
    benchutil.setup_jax(args.smoke)
    import jax
    import jax.numpy as jnp

    scale = 16 if args.smoke else 1
    HIGHEST = jax.lax.Precision.HIGHEST

    def dot_highest(x, w):
        return jnp.dot(x, w, precision=HIGHEST, preferred_element_type=jnp.float32).astype(x.dtype)

    def dot_default(x, w):
        return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)

    def dot_pad8(x, w):
        m = x.shape[0]
        pad = -m % 8
        xp = jnp.pad(x, ((0, pad), (0, 0))) if pad else x
        return dot_highest(xp, w)[:m]

    def dot_bf16(x, w):
        return jnp.dot(x, w)

    def dot_transposed(x, wt):
        return jnp.einsum("mk,nk->mn", x, wt)

    def dot_rowsum_t(x, wt):
        return (x[:, None, :].astype(jnp.float32) * wt[None].astype(jnp.float32)).sum(-1).astype(x.dtype)

    variants = dict(
        highest=dot_highest,
        default=dot_default,
        pad8=dot_pad8,
        bf16_out=dot_bf16,
        transposed=dot_transposed,
        rowsum_t=dot_rowsum_t,
    )

    def mlp(dot, x, p):
        g, u = dot(x, p["gate"]), dot(x, p["up"])
        return dot((jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(x.dtype), p["down"])

    def gdn(dot, x, p):
        y = dot(x, p["qkv"])[:, : GDN["z"][1] // scale] + dot(x, p["z"])  # widths by name: p may be [N, K]
        return dot(y, p["out"]) + (dot(x, p["a"]) + dot(x, p["b"])).sum(-1, keepdims=True)

    def head(dot, x, p):
        return dot(x, p["w"])

    def moe35(dot, x, p):
        y = dot(x, p["moe_in"])
        return y[:, :256], dot(y[:, -(MOE35["shared_down"][0] // scale) :], p["shared_down"])

    shapes = dict(mlp=dict(gate=(D, I), up=(D, I), down=(I, D)), gdn=GDN, lm_head=dict(w=(D, VOCAB)), moe35=MOE35)
    fns = dict(mlp=mlp, gdn=gdn, lm_head=head, moe35=moe35)

    def float64_out(name, x, params):
        """The set's function in float64 numpy (the oracle of `rel_err`); params: the set's weights as
        float64 numpy."""
        dot64 = lambda x, w: np.asarray(x, np.float64) @ w
        if name == "mlp":
            g, u = dot64(x, params["gate"]), dot64(x, params["up"])
            return dot64(g / (1 + np.exp(-g)) * u, params["down"])
        if name == "gdn":
            y = dot64(x, params["qkv"])[:, : params["z"].shape[1]] + dot64(x, params["z"])
            return dot64(y, params["out"]) + (dot64(x, params["a"]) + dot64(x, params["b"])).sum(-1, keepdims=True)
        if name == "lm_head":
            return dot64(x, params["w"])
        y = dot64(x, params["moe_in"])
        return np.concatenate([y[:, :256], dot64(y[:, -params["shared_down"].shape[0] :], params["shared_down"])], 1)

    key = jax.random.PRNGKey(0)
    _, bw_name, bw = benchutil.floor_copies(args.out)
    rows = []
    for name in args.sets.split(","):
        params = {}
        for k, (a, b) in shapes[name].items():
            key, sub = jax.random.split(key)
            params[k] = (jax.random.normal(sub, (a // scale, b // scale), jnp.float32) * a**-0.5).astype(jnp.bfloat16)
        nbytes = sum(v.size * 2 for v in params.values())
        params_t = {k: jnp.asarray(np.asarray(v).T) for k, v in params.items()}  # stored [N, K]
        params64 = {k: np.asarray(v.astype(jnp.float32), np.float64) for k, v in params.items()}  # once a set
        for m in map(int, args.rows.split(",")):
            key, sub = jax.random.split(key)
            x = jax.random.normal(sub, (m, HIDDEN[name] // scale), jnp.bfloat16)
            want = float64_out(name, np.asarray(x.astype(jnp.float32)), params64)
            for vname in args.variants.split(","):
                fn = jax.jit(lambda x, p, f=fns[name], d=variants[vname]: f(d, x, p))
                p = params_t if vname in TRANSPOSED else params
                out = fn(x, p)
                got = np.concatenate(
                    [np.asarray(o.astype(jnp.float32), np.float64) for o in jax.tree_util.tree_leaves(out)], 1
                )
                rel_err = float(np.abs(got - want).max() / np.abs(want).max())
                wall_us, _ = benchutil.median_us(fn, x, p, reps=5 if args.smoke else 20, inner=5)
                gpu = benchutil.gpu_kernel_times(fn, x, p, calls=5)
                floor_us = nbytes / bw * 1e6
                busy = gpu.get("busy_us")
                top = sorted(gpu.get("kernels", {}).items(), key=lambda kv: -kv[1])[:4]
                rows.append(
                    dict(
                        set=name,
                        rows=m,
                        variant=vname,
                        flags=args.tag,
                        wall_us=round(wall_us, 1),
                        gpu_busy_us=None if busy is None else round(busy, 1),
                        floor_us=round(floor_us, 1),
                        busy_over_floor=None if busy is None else round(busy / floor_us, 2),
                        rel_err=rel_err,
                        kernels=[f"{k[:60]} {v:.1f}" for k, v in top],
                    )
                )
                print(json.dumps(rows[-1]), flush=True)
    os.makedirs(args.out, exist_ok=True)
    tag = "".join(c if c.isalnum() else "_" for c in args.tag)[:60]
    with open(os.path.join(args.out, f"skinny_gemm_{tag}.json"), "w") as f:
        json.dump(dict(bandwidth=dict(name=bw_name, bytes_per_s=bw), rows=rows), f, indent=1)
    print(
        f"\n| set | rows | variant | GPU busy us | floor us | ratio | rel err |  ({args.tag}; floor at {bw_name} "
        f"{bw / 1e12:.2f} TB/s)"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['set']} | {r['rows']} | {r['variant']} | {r['gpu_busy_us']} | {r['floor_us']} | "
            f"{r['busy_over_floor']} | {r['rel_err']:.1e} |"
        )


if __name__ == "__main__":
    benchutil.run_main(parse, main)
