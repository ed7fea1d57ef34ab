"""What an 8-token verify costs against a one-token decode on the host CPU: float32 products x @ W
of one and eight rows over weights larger than the last-level cache.

Per shape (K x N, `copies` distinct matrices multiplied in one jit so the set leaves the cache): the
least wall time of --reps synchronised calls at 1 and 8 rows, the weight bytes read a second at one
row (GB/s) and the arithmetic rate at eight (GFLOP/s), and their ratio (eight rows / one). A ratio
near 1 means a verify of 8 tokens costs what a decode does (weight-bound: speculation pays); near
8 means the products are compute-bound. Each product is held to the float64 product first.

Usage: python3 bench/cpu_products.py [--smoke] --out DIR  -> DIR/cpu_products.json and a table.
"""

import argparse
import json
import os
import platform
import time

import numpy as np

SHAPES = ((256, 768, 24), (384, 1152, 24), (512, 1536, 16), (1024, 3072, 4))  # K, N, copies: 19-50 MB
SMOKE_SHAPES = ((64, 96, 3), (96, 160, 2))


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, 2 reps")
    return ap.parse_args(argv)


def main(args) -> int:
    import jax
    import jax.numpy as jnp

    os.makedirs(args.out, exist_ok=True)
    rng = np.random.default_rng(0)
    product = jax.jit(lambda x, ws: [x @ w for w in ws])
    rows_out = []
    for k, n, copies in SMOKE_SHAPES if args.smoke else SHAPES:
        weights = [rng.standard_normal((k, n)).astype(np.float32) for _ in range(copies)]
        on_device = [jnp.asarray(w) for w in weights]
        row = {"k": k, "n": n, "copies": copies, "mb": 4 * k * n * copies / 1e6}
        for m in (1, 8):
            x = rng.standard_normal((m, k)).astype(np.float32)
            x_on_device = jnp.asarray(x)
            got = product(x_on_device, on_device)
            for w, y in zip(weights, got):
                want = x.astype(np.float64) @ w.astype(np.float64)
                err = np.max(np.abs(np.asarray(y, np.float64) - want)) / np.max(np.abs(want))
                assert err < 1e-4, f"{k}x{n} at {m} rows: relative error {err:.2e}"
            best = float("inf")
            for _ in range(2 if args.smoke else args.reps):
                start = time.perf_counter()
                jax.block_until_ready(product(x_on_device, on_device))
                best = min(best, time.perf_counter() - start)
            row[f"ms_{m}"] = 1e3 * best
        row["gb_s_1"] = row["mb"] / 1e3 / (row["ms_1"] / 1e3)
        row["gflop_s_8"] = 2 * 8 * k * n * copies / (row["ms_8"] / 1e3) / 1e9
        row["ratio_8_1"] = row["ms_8"] / row["ms_1"]
        rows_out.append(row)
        print(
            f"{k} x {n} x {copies} ({row['mb']:.1f} MB): 1 row {row['ms_1']:.3f} ms ({row['gb_s_1']:.1f} GB/s), "
            f"8 rows {row['ms_8']:.3f} ms ({row['gflop_s_8']:.1f} GFLOP/s), 8 / 1 = {row['ratio_8_1']:.2f}",
            flush=True,
        )
    meta = {"cpus": os.cpu_count(), "machine": platform.machine(), "jax": jax.__version__, "smoke": args.smoke}
    with open(os.path.join(args.out, "cpu_products.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows_out}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(parse()))
