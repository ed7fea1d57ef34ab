"""The routed experts of an MoE decode step at real shapes: each implementation against its experts' bytes.

Shapes (--model): Qwen3.5-35B-A3B (256 experts, top-8, hidden 2048, expert width 512) or
Qwen3-Next-80B-A3B (512 experts, top-10), bf16, T tokens (--tokens) per step. A timed call runs
--layers distinct layers one after another (each its own [E, d, 2Ie] and [E, Ie, d] weights and its
own random routing, k distinct experts a token), so no layer's experts stay in L2 (60 MB: the hit
experts of one layer, 8 x 6.3 MB, would fit) from one call to the next. Variants:
  matmul[:CFG]  `ops.moe.moe_gathered(kernel=True)`: the Pallas grouped products
                (jaxspec/pallas/expert_matmul.py); CFG = block_m/block_n/inner_k/num_warps/num_stages
                [/direct_pairs] (the default config: the direct form up to 64 pairs, sorted above)
  gathered      the jnp form: each pair's weights gathered (a copy), batched products
  ragged        `ops.moe.moe_ragged` (jax.lax.ragged_dot over expert-sorted rows)
Floor = the distinct hit experts' weight bytes (gate_up + down) / the fastest copy of the run
(`benchutil.floor_copies`); GPU busy from a profiler trace (`benchutil.gpu_kernel_times`), per layer.

Usage (GPU):
  python3 bench/moe_experts.py --torch-copy --out $OUT      (own process, first)
  PYTHONPATH=$PWD python3 bench/moe_experts.py --out $OUT [--model qwen3-next-80b-a3b] [--tokens 1,8]
  python3 bench/moe_experts.py --smoke      (CPU, interpret mode, small shapes)
Writes DIR/moe_experts_MODEL.json and prints a table.
"""

import argparse
import json
import os

import benchutil  # bench/benchutil.py: the script directory is first on sys.path

MODELS = {
    "qwen3.5-35b-a3b": dict(experts=256, top_k=8, d=2048, ie=512),
    "qwen3-next-80b-a3b": dict(experts=512, top_k=10, d=2048, ie=512),
}


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="qwen3.5-35b-a3b")
    ap.add_argument("--tokens", default="1,8,64")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument(
        "--variants",
        default="matmul,matmul:16/128/64/4/3/0,matmul:16/128/64/4/3/128,gathered,ragged",
    )
    ap.add_argument("--reps", type=int, default=20)
    benchutil.add_common_args(ap, budget=False)
    return ap.parse_args(argv)


def variant_fn(name):
    from jaxspec.ops import moe
    from jaxspec.pallas.expert_matmul import ExpertMatmulConfig

    if name == "gathered":
        return moe.moe_gathered
    if name == "ragged":
        return moe.moe_ragged
    kind, _, cfg = name.partition(":")
    if kind != "matmul":
        raise SystemExit(f"--variants: unknown variant {name!r}")
    config = None
    if cfg:
        fields = ["block_m", "block_n", "inner_k", "num_warps", "num_stages", "direct_pairs"]
        config = ExpertMatmulConfig(**dict(zip(fields, map(int, cfg.split("/")))))

    def fn(x, weights, experts, gate_up, down, valid):
        return moe.moe_gathered(x, weights, experts, gate_up, down, valid, kernel=True, config=config)

    return fn


def main(args):
    benchutil.setup_jax(args.smoke)
    import jax
    import jax.numpy as jnp
    import numpy as np

    shape = dict(MODELS[args.model])
    layers = args.layers
    if args.smoke:
        shape, layers = dict(experts=16, top_k=4, d=64, ie=32), 2
    n_exp, top_k, d, ie = shape["experts"], shape["top_k"], shape["d"], shape["ie"]
    itemsize = 2
    expert_bytes = (d * 2 * ie + ie * d) * itemsize
    _, floor_name, bw = benchutil.floor_copies(args.out)

    key = jax.random.key(0)
    gate_up = [
        jax.random.normal(jax.random.fold_in(key, 2 * i), (n_exp, d, 2 * ie), jnp.bfloat16) * d**-0.5
        for i in range(layers)
    ]
    down = [
        jax.random.normal(jax.random.fold_in(key, 2 * i + 1), (n_exp, ie, d), jnp.bfloat16) * ie**-0.5
        for i in range(layers)
    ]
    rng = np.random.default_rng(0)
    rows = []
    print("| tokens | variant | distinct experts | floor µs | wall µs | GPU busy µs | busy / floor |", flush=True)
    for t in map(int, args.tokens.split(",")):
        experts = [
            jnp.asarray(np.stack([rng.choice(n_exp, top_k, replace=False) for _ in range(t)]), jnp.int32)
            for _ in range(layers)
        ]
        distinct = sum(len(np.unique(np.asarray(e))) for e in experts) / layers
        floor_us = distinct * expert_bytes / bw * 1e6
        weights = jnp.full((t, top_k), 1.0 / top_k, jnp.bfloat16)
        valid = jnp.ones(t, bool)
        x = jax.random.normal(jax.random.fold_in(key, 10_000 + t), (t, d), jnp.bfloat16)
        for name in args.variants.split(","):
            one = variant_fn(name)

            @jax.jit
            def run(x, gate_up, down, experts):
                for g, w, e in zip(gate_up, down, experts):
                    x = one(x, weights, e, g, w, valid)
                return x

            wall_us, _ = benchutil.median_us(run, x, gate_up, down, experts, reps=args.reps)
            trace = benchutil.gpu_kernel_times(run, x, gate_up, down, experts)
            busy = trace.get("busy_us", float("nan")) / layers
            row = dict(
                tokens=t,
                variant=name,
                distinct_experts=distinct,
                floor_us=floor_us,
                wall_us=wall_us / layers,
                busy_us=busy,
                x_floor=busy / floor_us,
            )
            rows.append(row)
            print(
                f"| {t} | {name} | {distinct:.1f} | {floor_us:.1f} | {wall_us / layers:.1f} | {busy:.1f} | "
                f"{busy / floor_us:.2f} |",
                flush=True,
            )
    out = dict(
        model=args.model,
        shape=shape,
        layers=layers,
        floor_copy=floor_name,
        floor_bw=bw,
        rows=rows,
        device=str(jax.devices()[0].device_kind),
    )
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"moe_experts_{args.model}.json"), "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    benchutil.run_main(parse, main)
