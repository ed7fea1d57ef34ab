"""PyTorch's attention kernels on the verify-attention shapes: what the CUDA stack does with the
same K / V bytes.

Shapes as bench/attention_kernel.py: batch 1, 8, 64, 128 x context 1k, 4k, 32k; T = 8 queries a
request, 24 q heads / 4 kv heads, D = 256, bf16; n = context + 8 keys a request; K and V stored as
the kernel's caches, [B, n, 4, 256], views of one [2, B, n, 4, 256] buffer.

Backends:
* flash_gqa: FlashAttention-2 called directly (`torch.ops.aten._flash_attention_forward`): native
  GQA and the bottom-right causal mask, i.e. exactly the verify problem; it picks split-KV itself.
* flash, cudnn, efficient: `scaled_dot_product_attention` with that backend alone, q [B, 24, 8, 256],
  `enable_gqa=True`, no mask (these broadcast K / V to the 24 q heads); "refused" where one refuses.
* read: `torch.sum` of the K + V buffer in float32: the least a kernel takes to read the bytes.
Every attention output is checked against the math backend in float32 with the same mask where that
fits (--check-max-keys).

Method: R distinct K / V sets cycled (`benchutil.cycled_sets`: L2 holds none of them); two untimed
rounds, then a torch.profiler trace of --calls rounds. GPU busy = the kernels' summed durations a
call (memcpy and memset left out), GPU span = first kernel start to last kernel end a call; the
kernel names tell which algorithm ran. Run it in its own process: torch and JAX each hold GPU memory.

Usage (GPU): python3 bench/attention_torch.py --out $OUT [--shapes 1:4096,8:1024]
Writes DIR/attention_torch.json and prints a table.
"""

import argparse
import json
import os
import statistics

import benchutil  # bench/benchutil.py: the script directory is first on sys.path

DEFAULT_SHAPES = "1:1024,1:4096,1:32768,8:1024,8:4096,8:32768,64:1024,64:4096,64:32768,128:1024,128:4096,128:32768"
BACKENDS = ("flash_gqa", "read", "flash", "cudnn", "efficient")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--T", type=int, default=8)
    ap.add_argument("--hq", type=int, default=24)
    ap.add_argument("--kvh", type=int, default=4)
    ap.add_argument("--D", type=int, default=256)
    ap.add_argument("--calls", type=int, default=5, help="profiled rounds over the sets")
    ap.add_argument("--check-max-keys", type=int, default=1 << 17, help="check against math where B * n <= this")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/out"))
    args = ap.parse_args(argv)

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.profiler import ProfilerActivity, profile

    backend_of = dict(
        flash=SDPBackend.FLASH_ATTENTION,
        cudnn=SDPBackend.CUDNN_ATTENTION,
        efficient=SDPBackend.EFFICIENT_ATTENTION,
        math=SDPBackend.MATH,
    )
    T, Hq, KVH, D = args.T, args.hq, args.kvh, args.D
    dev = torch.device("cuda")
    results = []

    def attend(backend, q, kv, mask=None):
        """o [B, Hq, T, D] of q [B, Hq, T, D] against kv [2, B, n, KVH, D]."""
        k, v = kv[0], kv[1]
        if backend == "flash_gqa":
            o = torch.ops.aten._flash_attention_forward(
                q.transpose(1, 2), k, v, None, None, T, k.shape[1], 0.0, True, False
            )[0]
            return o.transpose(1, 2)
        if backend == "read":
            return kv.sum(dtype=torch.float32)
        with sdpa_kernel(backend_of[backend]):
            return F.scaled_dot_product_attention(
                q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, enable_gqa=True
            )

    def trace(fn, rounds):
        """(busy µs, span µs, {kernel name: median µs}) a round of `fn` over `rounds` profiled rounds."""
        fn(), fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(rounds):
                fn()
            torch.cuda.synchronize()
        kernels = [
            e
            for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA
            and "memcpy" not in e.name.lower()
            and "memset" not in e.name.lower()
        ]
        start = min(e.time_range.start for e in kernels)
        end = max(e.time_range.end for e in kernels)
        by_name = {}
        for e in kernels:
            by_name.setdefault(e.name, []).append(e.time_range.elapsed_us())
        busy = sum(e.time_range.elapsed_us() for e in kernels) / rounds
        return busy, (end - start) / rounds, {k: statistics.median(v) for k, v in by_name.items()}

    for shape in args.shapes.split(","):
        B, ctx = (int(v) for v in shape.split(":"))
        n = ctx + T
        kv_bytes = 2 * B * n * KVH * D * 2
        n_sets = benchutil.cycled_sets(kv_bytes)
        gen = torch.Generator(device=dev).manual_seed(B * 100003 + ctx)
        sets = [
            (
                torch.randn(B, Hq, T, D, device=dev, dtype=torch.bfloat16, generator=gen),
                torch.randn(2, B, n, KVH, D, device=dev, dtype=torch.bfloat16, generator=gen),
            )
            for _ in range(n_sets)
        ]
        want = {}
        if B * n <= args.check_max_keys:
            q, kv = (x.float() for x in sets[0])
            causal = torch.arange(n, device=dev)[None, :] <= (n - T + torch.arange(T, device=dev))[:, None]
            want = dict(causal=attend("math", q, kv, causal), full=attend("math", q, kv))
        for backend in args.backends.split(","):
            row = dict(B=B, ctx=ctx, n=n, backend=backend, sets=n_sets, kv_bytes=kv_bytes)
            try:
                out = attend(backend, *sets[0])
                if want and backend != "read":
                    ref = want["causal" if backend == "flash_gqa" else "full"]
                    row["rel_err"] = float((out.float() - ref).abs().max() / ref.abs().max())
                busy, span, kernels = trace(lambda: [attend(backend, *s) for s in sets], args.calls)
                row.update(busy_us=busy / n_sets, span_us=span / n_sets, kernels=kernels)
            except RuntimeError as exc:
                row["refused"] = str(exc).splitlines()[0][:200]
            results.append(row)
            if "refused" in row:
                print(f"B {B:3d} ctx {ctx:5d} {backend:9s}: refused ({row['refused']})", flush=True)
            else:
                print(
                    f"B {B:3d} ctx {ctx:5d} {backend:9s}: GPU busy {row['busy_us']:9.1f} us, span "
                    f"{row['span_us']:9.1f} us, err {row.get('rel_err', float('nan')):.2e}, kernels "
                    + "; ".join(f"{k[:60]} {v:.1f}" for k, v in row["kernels"].items()),
                    flush=True,
                )
        sets.clear()  # frees the K / V sets before the next shape
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "attention_torch.json"), "w") as f:
        json.dump(
            dict(
                torch=torch.__version__, device=torch.cuda.get_device_name(), T=T, Hq=Hq, KVH=KVH, D=D, results=results
            ),
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
