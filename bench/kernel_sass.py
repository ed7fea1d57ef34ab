"""SASS of the project's Triton kernels for the H200, on a machine without a GPU.

Lowers a kernel case for an abstract H200 (tests/gpu_lowering.py), captures the Triton IR that
Pallas hands to XLA, compiles it for sm_90 with the pip `triton` package (its own ptxas and
cuobjdump ship in the wheel), and prints per kernel: registers, shared memory (static, and
DYNAMIC_SHARED: the bytes Triton asks at launch, which with 228 KB an SM set the programs an SM),
local memory (spills), and every loop (a backward branch) with its instruction count and op mix.
Per-element costs follow by hand: e.g. the bf16 lane top-k's main loop (8 steps x 4 lanes a thread = 32
elements) is 592 instructions, 364 of them VIMNMX (2026-12-02, third session).

Needs `pip install triton==3.6.0` in the venv that has jax (the device image's Triton version).
jaxlib embeds its own Triton build, whose passes may differ a little from the pip package's: read
the output as the shape of the code (op mix, loop sizes, registers), and time on the GPU.

Usage:
  .venv/bin/python bench/kernel_sass.py --case topk_lanes --dtype bfloat16 --k 64 --out /tmp/sass
  .venv/bin/python bench/kernel_sass.py --case attention_verify --batch 1 --context 32768
Writes DIR/<kernel>.{in.ttir,ttir,ttgir,ptx,cubin,sass} (in.ttir: as Pallas lowered it).
"""
import argparse
import collections
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = ("topk_lanes", "topk_maxima", "topk_chunked", "argmax", "attention_verify")


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", choices=CASES, required=True)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--rows", type=int, default=1024, help="top-k / argmax rows")
    ap.add_argument("--vocab", type=int, default=248320)
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--batch", type=int, default=64, help="attention: requests (T 8, 24 / 4 heads of 256)")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--config", nargs="*", default=[], metavar="FIELD=VALUE",
                    help="fields of the case's config (LanesConfig, MaximaConfig, TopKConfig, ArgmaxConfig, AttentionVerifyConfig)")
    ap.add_argument("--out", default="/tmp/sass")
    ap.add_argument("--top-ops", type=int, default=10, help="ops listed per loop")
    return ap.parse_args(argv)


def config_value(text):
    """'8' -> 8, '8.5' -> 8.5, 'true' / 'false' -> bool."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    return float(text) if "." in text else int(text)


def case_fn(args):
    """(fn, argument shapes) of the case."""
    import jax
    import jax.numpy as jnp
    from jaxspec.pallas import attention_verify as pav
    from jaxspec.pallas import topk as tk
    from jaxspec.pallas import topk_lanes as tl
    from jaxspec.pallas import topk_maxima as tm

    dt = jnp.dtype(args.dtype)
    logits = jax.ShapeDtypeStruct((args.rows, args.vocab), dt)
    fields = {f: config_value(v) for f, v in (c.split("=") for c in args.config)}
    if args.case == "topk_lanes":
        config = tl.LanesConfig(**fields)
        return (lambda x: tl.top_k(x, args.k, config=config, interpret=False)), (logits,)
    if args.case == "topk_maxima":
        config = tm.MaximaConfig(**fields)
        return (lambda x: tm.top_k(x, args.k, config=config, interpret=False)), (logits,)
    if args.case == "topk_chunked":
        config = tk.TopKConfig(**fields)
        return (lambda x: tk.top_k(x, args.k, config=config, interpret=False)), (logits,)
    if args.case == "argmax":
        config = tk.ArgmaxConfig(**fields)
        return (lambda x: tk.argmax(x, config=config, interpret=False)), (logits,)
    config = pav.AttentionVerifyConfig(**fields)
    b, t, hq, kvh, d, m = args.batch, 8, 24, 4, 256, args.context + 16
    i32 = jnp.int32
    shapes = (jax.ShapeDtypeStruct((b * t, hq, d), dt), jax.ShapeDtypeStruct((b + 1, m, kvh, d), dt),
              jax.ShapeDtypeStruct((b + 1, m, kvh, d), dt), jax.ShapeDtypeStruct((b + 1,), i32),
              jax.ShapeDtypeStruct((b + 1,), i32), jax.ShapeDtypeStruct((b,), i32))
    return (lambda q, k, v, s, qsl, sl: pav.attention_verify(q, k, v, s, qsl, sl, t, config=config,
                                                             interpret=False)), shapes


def triton_modules(fn, shapes):
    """[(name, Triton IR text, num_warps, num_stages)] of the Triton custom calls of fn for the H200."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from gpu_lowering import lower_for_h200
    from jax._src.pallas.triton import pallas_call_registration as registration

    captured = []
    lower = registration.lowering.lower_jaxpr_to_triton_module

    def capture(*a, **kw):
        res = lower(*a, **kw)
        captured.append(res.module.operation.get_asm(enable_debug_info=False))
        return res

    registration.lowering.lower_jaxpr_to_triton_module = capture
    try:
        text = lower_for_h200(fn, *shapes)
    finally:
        registration.lowering.lower_jaxpr_to_triton_module = lower
    configs = re.findall(r'name = "([^"]+)", num_stages = (\d+) : i32, num_warps = (\d+) : i32', text)
    if len(configs) != len(captured):
        raise RuntimeError(f"{len(captured)} Triton modules but {len(configs)} custom calls")
    return [(name, ir, int(warps), int(stages)) for ir, (name, stages, warps) in zip(captured, configs)]


def compile_sass(name, ir, num_warps, num_stages, out):
    """Triton IR -> PTX, cubin, SASS files under out -> (SASS text, resource line). The IR first goes
    through the backend's Triton-IR passes (canonicalize, combine: e.g. `acc + dot(a, b, 0)` becomes
    `dot(a, b, acc)`), which XLA runs on Pallas' module too and `triton.compile` skips for IR input."""
    import triton
    from triton._C.libtriton import ir as tir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    options = backend.parse_options(dict(num_warps=num_warps, num_stages=num_stages))
    base = os.path.join(out, name)
    with open(base + ".in.ttir", "w") as f:
        f.write(ir)
    context = tir.context()
    tir.load_dialects(context)
    backend.load_dialects(context)
    module = tir.parse_mlir_module(base + ".in.ttir", context)
    module.context = context                            # as triton.compiler.compiler.parse does
    module = type(backend).make_ttir(module, {}, options, 90)
    with open(base + ".ttir", "w") as f:
        f.write(str(module))
    kernel = triton.compile(base + ".ttir", target=target, options=dict(num_warps=num_warps, num_stages=num_stages))
    with open(base + ".ttgir", "w") as f:
        f.write(kernel.asm["ttgir"])
    with open(base + ".ptx", "w") as f:
        f.write(kernel.asm["ptx"])
    with open(base + ".cubin", "wb") as f:
        f.write(kernel.asm["cubin"])
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", base + ".cubin"],
                          capture_output=True, text=True, check=True).stdout
    with open(base + ".sass", "w") as f:
        f.write(sass)
    usage = subprocess.run([os.path.join(tools, "cuobjdump"), "-res-usage", base + ".cubin"],
                           capture_output=True, text=True, check=True).stdout
    res = next((line.strip() for line in usage.splitlines() if "REG:" in line), "")
    return sass, f"{res} DYNAMIC_SHARED:{kernel.metadata.shared}"


def opcode(instr):
    """'@!P0 VIMNMX.U32 R1, ...' -> 'VIMNMX'."""
    words = instr.split()
    word = words[1] if words[0].startswith("@") else words[0]
    return word.split(".")[0]


def loops(sass):
    """[(start address, end address, [instructions])] of every backward branch's body."""
    ins = [(int(m.group(1), 16), m.group(2).strip())
           for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    index = {addr: i for i, (addr, _) in enumerate(ins)}
    found = []
    for i, (addr, instr) in enumerate(ins):
        target = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", instr)
        if target and int(target.group(1), 16) < addr and int(target.group(1), 16) in index:
            start = index[int(target.group(1), 16)]
            found.append((ins[start][0], addr, [x for _, x in ins[start:i + 1]]))
    return found, len(ins)


def main(args):
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, ROOT)
    os.makedirs(args.out, exist_ok=True)
    fn, shapes = case_fn(args)
    for name, ir, warps, stages in triton_modules(fn, shapes):
        sass, usage = compile_sass(name, ir, warps, stages, args.out)
        body, total = loops(sass)
        print(f"{name}: {warps} warps, {stages} stages; {total} instructions; {usage}")
        for start, end, instrs in body:
            mix = collections.Counter(opcode(x) for x in instrs).most_common(args.top_ops)
            print(f"  loop {start:#07x}-{end:#07x}: {len(instrs):5d} instructions  "
                  + " ".join(f"{op} {n}" for op, n in mix))


if __name__ == "__main__":
    main(parse())
