"""Engine steps at real shapes (Qwen3.5-27B by default; --model; random bf16 weights): mode none vs the DFlash
spec step, against their HBM floors, with a per-component GPU breakdown, compile times and a memory report.

Models (`jaxspec.bench.shapes.build`: random weights, bf16):
  target: Qwen3.5-27B-shaped (hidden 5120, intermediate 17408, layer i full attention iff (i+1) % 4 == 0,
    attention 24 query / 4 KV heads of dim 256 with a quarter rotary and theta 1e7, GDN 16 key / 48 value heads
    of dim 128 and conv width 4, vocab 248320, untied lm_head), cut to the first --layers layers (default 16;
    a multiple of 4). `jaxspec.target.init_target` makes one leaf at a time (float32, then cast), so only the
    bf16 tree and one leaf's float32 temporaries (the largest leaf: the embedding, 5.1 GB in float32) are
    alive at once: it is used as is.
  draft: DFlash, 5 layers (hidden 5120, intermediate 17408, 32 query / 8 KV heads of dim 128), block --block
    (16), 5 taps spread over the kept layers (`train.default_taps`), mask id vocab - 1.

Per batch in --batches (engines have num_slots = batch, max_len --max-len, state_dtype bfloat16; every step
runs exactly `batch` rows; `Engine.forced_step` prefills --prompt-len random tokens per row, then each call
is one step with forced acceptance):
  - none: the mode "none" step (one token per row), forced_step(batch, batch).
  - spec full: the mode "static" step (every row verifies its whole block: batch * block tokens; in static
    mode the step ignores the tier it is given, so only the full tier is timed there).
  - spec tier t (the other tiers of the ladder, `Engine.tier_tokens`): the mode "compact" step at tier t.
    With forced acceptance the compact step plans lengths from the estimator's initial survivals with a
    budget of t - batch drafts, packs exactly t tokens (anchors + planned drafts), and commits all of
    them; `tokens_per_step` in the JSON is that count measured from the slots' seq_len growth.
    --compact-full also times compact at the full tier (the static step's tokens plus the planning).
  Each: the median wall ms of --reps calls, each synchronised (jax.block_until_ready), after an untimed
  first call. For none and spec full also a profiler (CUPTI) trace of --trace-calls steps:
  GPU busy ms a step, by engine scope (the named scopes of the engine's step, jaxspec/step.py: draft, estimator,
  plan, verify, accept, commit, draft_context; else other) and the top kernels by time.

Kernel -> scope (`jaxspec.bench.trace`): each GPU kernel event of the trace carries XLA's launch annotation
as stats. A stat holding the op_name path (tf_op / op_name / name / long_name) gives the scope directly (its
first path component that is a scope name); else the kernel's hlo_op stat is looked up in the compiled step's HLO text
(`jit(...).lower(...).compile().as_text()`: metadata op_name of that instruction, or of the instructions it
calls); else the kernel name itself is tried as an HLO instruction name. Kernels still unmapped count as
"other" and are listed (first 30) in the JSON, beside the stat names the trace had (`trace_stats`).
Kernels that XLA launches from a command buffer (a CUDA graph: the default for runs of fusions and
library calls) carry the command buffer's name as hlo_op, not their own: they are counted under
"command_buffer" (mapping them through the graph's HLO would credit every kernel of a graph to its
most common scope, which misleads); --no-command-buffers turns command buffers off for the whole run
(XLA_FLAGS --xla_gpu_enable_command_buffer=) so every kernel maps, at the price of one launch per
kernel in the timed steps too.
Off the GPU the trace has no GPU kernels: the breakdown is None; the same mapping is then checked on the
XLA:CPU thunk events (`cpu_mapping_check`), which carry hlo_op / hlo_module.

Floors (`step_floor`): the bytes a step must move through HBM / the copy bandwidth (torch copy when torch is
installed, measured first in a subprocess; else the jitted JAX x+1 pass, which is slower: floors against it
are optimistic for the step). Compute floor (`step_flops`): the FLOPs a step must run / the run's own
bf16 GEMM rate (`benchutil.gemm_throughput`, an 8192^3 product): above ~32 rows a verify's products
are bound by the tensor cores, not the weight reads, and "/ bound" divides by the larger floor.

Memory report: bytes of the weights (target, draft), KV cache, GDN checkpoints, ring, conv state and the
draft's context cache at 64 slots x 8192 context for the whole --model target whatever --layers is
(jax.eval_shape: nothing allocated), and whether it fits in 141e9 bytes.

Compile: a batch's programs (pass 1: the none prefill and step, the spec prefill and the static step; pass 2:
the compact steps) are lowered in turn and compiled together in --compile-workers threads (XLA compiles
outside the GIL, so on a many-core host they overlap), ahead of the calls, which then find them in jax's
caches; each program's lower and compile wall times are recorded, and the first call's wall time (about one
step when the compile was ahead; the compile itself with --compile-workers 0).

Compile only (--compile-only): the 64-layer target + draft do not fit an 80 GB H100 with their state at
batch 8 and up (bf16 weights alone ~54 GB), yet their compile times are wanted there. Lowering and
compiling need only shapes, so the target and draft are built as abstract trees (jax.eval_shape of the same
builders: jax.ShapeDtypeStruct leaves, no random init run, nothing allocated), the engines' state too
(`abstract_engine`), and each batch's programs above (pass 1 and pass 2) are lowered and compiled as in a
normal run, none run: no timing, trace, floor or copy bandwidth. The report holds the compile table per
program, the totals per batch and overall, the concrete leaves the models and states had (0) and the live
device array bytes at the end. On the GPU XLA's autotuning still allocates an op's operands while it
compiles (one op at a time: well under the weights).

Order (a timeout still leaves results; the JSON and markdown are rewritten after each case): pass 1, per
batch in order: none, then spec full (with breakdowns); pass 2: the compact tiers per batch. --budget-s:
no batch or case starts after that many seconds.

Usage (GPU):
  PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false python3 bench/real_shape.py --out $OUT
  python3 bench/real_shape.py --smoke --out /tmp/rs      (CPU, tiny config, the same code path)
  PYTHONPATH=$PWD python3 bench/real_shape.py --layers 64 --batches 1,8,32,64 --compile-only --out $OUT
Writes DIR/real_shape.md and DIR/real_shape.json (DIR = --out, default $OUT or bench/out).
"""

import argparse
import datetime
import importlib.util
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time

import benchutil  # bench/benchutil.py: the script directory is first on sys.path

sys.path.insert(0, benchutil.ROOT)
from jaxspec.bench.compile import precompile  # noqa: E402
from jaxspec.bench.shapes import MODELS, build, draft_config, shapes_of, target_config  # noqa: E402
from jaxspec.bench.trace import hlo_scopes, map_events, trace_events  # noqa: E402,F401  (hlo_scopes: tests)

HERE = os.path.dirname(os.path.abspath(__file__))
HBM_BYTES = 141e9  # H200


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(HERE, "out"))
    ap.add_argument(
        "--model",
        choices=sorted(MODELS),
        default="qwen3.5-27b",
        help="the target's shape (jaxspec.bench.shapes.MODELS; the MoE ones with their own drafts)",
    )
    ap.add_argument("--layers", type=int, default=16, help="target layers kept (a multiple of 4; --model's count: all)")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per row forced_step prefills")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--trace-calls", type=int, default=3, help="steps in one profiler trace (0: no trace)")
    ap.add_argument(
        "--tiers",
        default="all",
        help="tier indices of the ladder to time (comma list, negative from the top: -1 = full "
        "block, timed by the static step; the others by compact), or 'all'",
    )
    ap.add_argument("--compact-full", action="store_true", help="also time the compact step at the full tier")
    ap.add_argument("--modes", default="none,spec", help="subset of none,spec")
    ap.add_argument("--num-tiers", type=int, default=4)
    ap.add_argument(
        "--budget-s",
        type=float,
        default=400.0,
        help="start no new batch or case after this many seconds (the GPU call's limit is 600 s)",
    )
    ap.add_argument(
        "--compile-workers",
        type=int,
        default=4,
        help="compile a batch's programs ahead of their calls in this many threads (0: each compiles "
        "at its first call, one after another)",
    )
    ap.add_argument(
        "--no-command-buffers",
        action="store_true",
        help="XLA_FLAGS --xla_gpu_enable_command_buffer= (every kernel maps to its scope)",
    )
    ap.add_argument("--no-torch-copy", action="store_true", help="skip the torch copy bandwidth subprocess")
    ap.add_argument("--torch-copy", action="store_true", help=argparse.SUPPRESS)  # the subprocess itself
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--layer-layout",
        choices=("list", "groups"),
        default="list",
        help="target layers as a per-layer list, unrolled (list), or stacked by group and run as one scan "
        "(groups: on the GPU each group's weights are sliced out of the stack, a copy: see bench/RESULTS.md)",
    )
    ap.add_argument(
        "--separate-projections",
        action="store_true",
        help="the target's same-input projections as separate matrices (default: fused, one GEMM each: "
        "jaxspec.fused, as load_target gives them)",
    )
    ap.add_argument(
        "--compile-only",
        action="store_true",
        help="abstract weights and state (jax.eval_shape: nothing allocated): lower and compile each batch's "
        "programs, run none (compile times of a model too large for the device)",
    )
    ap.add_argument(
        "--sampled",
        action="store_true",
        help="time the steps' sampling variant (greedy=False: target distributions, sampled drafts from the "
        "processed draft distribution, rejection sampling) instead of the greedy-only one",
    )
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    if args.compile_only and args.compile_workers < 1:
        ap.error("--compile-only: needs --compile-workers >= 1 (it compiles ahead, there are no calls)")
    if args.smoke:
        args.layers, args.batches, args.max_len, args.block = shapes_of(args.model, True)[0]["layers"], "1,2", 64, 4
        args.reps, args.prompt_len, args.trace_calls = 2, 8, 2
    elif args.layers < 4 or args.layers % 4 or args.layers > shapes_of(args.model)[0]["layers"]:
        ap.error(f"--layers={args.layers}: must be a positive multiple of 4, at most the model's layers")
    calls = max(2, args.trace_calls + 2)  # one prefill holds the first call + one timed, and a trace
    if args.prompt_len + calls * args.block > args.max_len:
        ap.error(f"--max-len={args.max_len}: must hold --prompt-len + {calls} steps of --block tokens")
    return args


# --------------------------------------------------------------------------------------------- models


def spec_config(mode, batch, args):
    from jaxspec.config import SpecConfig

    return SpecConfig(
        verify_mode=mode, num_slots=batch, max_len=args.max_len, state_dtype="bfloat16", num_tiers=args.num_tiers
    )


def _nbytes(tree):
    import jax

    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))


def param_bytes(tc, dc, itemsize=2):
    """{"target_layers", "routed_experts" (the part of target_layers in routed experts), "target_norm", "embed",
    "lm_head", "draft"}: weight bytes from the shape tables."""
    import jax

    from jaxspec import dflash, weights

    count = lambda t: sum(math.prod(s) for s in jax.tree_util.tree_leaves(t, is_leaf=lambda x: isinstance(x, tuple)))
    shapes = weights.param_shapes(tc)
    out = {
        "target_layers": count(shapes["layers"]) * itemsize,
        "routed_experts": sum(count([m["moe"]["gate_up"], m["moe"]["down"]]) for m in shapes["layers"] if "moe" in m)
        * itemsize,
        "target_norm": count(shapes["norm"]) * itemsize,
        "embed": count(shapes["embed"]) * itemsize,
        "lm_head": count(shapes.get("lm_head", ())) * itemsize,
    }
    out["draft"] = count(dflash.param_shapes(dc)) * itemsize if dc is not None else 0
    return out


# --------------------------------------------------------------------------------------------- floors


def step_floor(tc, dc, cache_cfg, *, batch, tokens, ctx, bandwidth):
    """HBM bytes one engine step must move, by term, and its floor: {"terms": {name: bytes}, "info": {name:
    bytes} (not in the floor), "bytes", "ms"} (ms = bytes / bandwidth).

    `tokens` verified tokens over `batch` rows (none: tokens = batch), every row's context `ctx` tokens
    before the step; dc None = the none step (no draft terms). bf16 weights and activations (cache_cfg.dtype),
    GDN checkpoints in cache_cfg.state_dtype, ring updates in cache_cfg.ring_dtype.
    Target:
      weights      every layer param + the final norm + the lm_head, read once; the embedding: `tokens` rows.
                   Mixture-of-experts layers read only the routed experts that `tokens` hit: with uniform
                   routing of top-k of E, E (1 - (1 - k / E)^tokens) of them in expectation
      kv           per attention layer: K and V of batch x (ctx + tokens / batch) positions read
                   (batch x ctx x KVH x D x 2 x bytes, plus the window's), and the window's `tokens` written
      gdn_state    per GDN layer: the checkpoint batch x HV x K x V x state bytes read (verify) and written (fold)
      conv         per GDN layer: conv state batch x (W-1) x C read and written, the window's `tokens` x C
                   raw inputs (conv_window) written by verify and read by commit
      ring         per GDN layer and token: the record (ring_k H x K act, ring_u HV x V ring bytes, ring_g HV
                   x 4) written by verify and read back by the fold
    Draft (spec step only):
      draft_weights    fc, norms and every draft layer read once
      draft_lm_head    the target's lm_head read again for the draft's logits (shared, not in draft_weights)
      draft_embed      batch x block embedding rows (anchor + masks)
      draft_ctx_kv     the context K/V cache read by propose: L_d x batch x ctx x KVH_d x D_d x 2 x act bytes,
                       and the step's `tokens` rows written by draft_context
    info (not in the floor: a fused lm_head + argmax need not write them): target logits tokens x vocab x 4,
    draft logits batch x (block - 1) x vocab x 4.
    """
    import jax.numpy as jnp

    act = jnp.dtype(cache_cfg.dtype).itemsize
    state_b = jnp.dtype(cache_cfg.state_dtype).itemsize
    ring_u_b = 4  # ring_u: one float32, or a bfloat16 (hi, lo) pair: 4 bytes either way
    pb = param_bytes(tc, dc)
    g, a = len(tc.gdn_layers), len(tc.attn_layers)
    kvh, d = tc.num_key_value_heads, tc.head_dim
    h, hv, kd, vd = tc.linear_num_key_heads, tc.linear_num_value_heads, tc.linear_key_head_dim, tc.linear_value_head_dim
    per_row = tokens / batch
    terms = {
        "weights": pb["target_layers"]
        - pb["routed_experts"] * (1 - expert_share(tc, tokens))
        + pb["target_norm"]
        + pb["lm_head"]
        + tokens * tc.hidden_size * act,
        "kv": a * (batch * (ctx + per_row) + tokens) * kvh * d * 2 * act,
        "gdn_state": g * batch * hv * kd * vd * state_b * 2,
        "conv": g * (batch * (tc.linear_conv_kernel_dim - 1) * tc.conv_dim * act * 2 + tokens * tc.conv_dim * act * 2),
        "ring": g * tokens * (h * kd * act + hv * vd * ring_u_b + hv * 4) * 2,
    }
    info = {"target_logits": tokens * tc.vocab_size * 4}
    if dc is not None:
        blk = dc.block_size
        terms.update(
            draft_weights=pb["draft"],
            draft_lm_head=pb["lm_head"],
            draft_embed=batch * blk * tc.hidden_size * act,
            draft_ctx_kv=dc.num_hidden_layers * (batch * ctx + tokens) * dc.num_key_value_heads * dc.head_dim * 2 * act,
        )
        info["draft_logits"] = batch * (blk - 1) * tc.vocab_size * 4
    total = sum(terms.values())
    return {"terms": terms, "info": info, "bytes": total, "ms": total / bandwidth * 1e3}


def step_flops(tc, dc, *, batch, tokens, ctx):
    """Floating-point operations one engine step must run, by term: {"terms": {name: FLOPs}, "flops"}.

    Same arguments as `step_floor`. A product of a row with a [K, N] matrix is 2 K N FLOPs.
    Target:
      target_products  every token through every layer's matrices and the lm_head (a mixture-of-
                       experts layer: its top-k routed experts of E, besides the rest)
      attention        per attention layer and token: scores and values over its context,
                       4 x heads x head_dim x (ctx + the window so far)
      gdn              per GDN layer and token: the state read by q and k and its rank-one update,
                       6 x HV x K x V
    Draft (spec step only):
      draft_products   batch x block rows (anchor + masks) through the draft's matrices
      draft_lm_head    batch x (block - 1) rows through the shared lm_head
      draft_attention  per draft layer and row: 4 x heads x head_dim x (ctx + block)
    Norms, activations, sampling and the fold are left out (a few FLOPs a byte moved)."""
    pb = param_bytes(tc, dc, itemsize=1)  # itemsize 1: parameter counts
    per_row = tokens / batch
    layers = pb["target_layers"] - pb["routed_experts"] * (
        1 - tc.num_experts_per_tok / tc.num_experts if tc.num_experts else 1
    )
    g, a = len(tc.gdn_layers), len(tc.attn_layers)
    hv, kd, vd = tc.linear_num_value_heads, tc.linear_key_head_dim, tc.linear_value_head_dim
    terms = {
        "target_products": 2 * tokens * (layers + pb["lm_head"]),
        "attention": a * tokens * 4 * tc.num_attention_heads * tc.head_dim * (ctx + (per_row + 1) / 2),
        "gdn": g * tokens * 6 * hv * kd * vd,
    }
    if dc is not None:
        rows, draft_heads = batch * dc.block_size, dc.num_attention_heads * dc.head_dim
        terms.update(
            draft_products=2 * rows * pb["draft"],
            draft_lm_head=2 * batch * (dc.block_size - 1) * pb["lm_head"],
            draft_attention=dc.num_hidden_layers * rows * 4 * draft_heads * (ctx + dc.block_size),
        )
    return {"terms": terms, "flops": sum(terms.values())}


def expert_share(tc, tokens):
    """Expected share of a mixture-of-experts layer's routed experts that `tokens` tokens hit when each
    picks top-k of E uniformly: 1 - (1 - k / E)^tokens (0 for a dense target)."""
    if not tc.num_experts:
        return 0.0
    return 1 - (1 - tc.num_experts_per_tok / tc.num_experts) ** tokens


def floor_line(name, floor, bandwidth):
    parts = ", ".join(f"{k} {v / 1e6:.1f} MB ({v / bandwidth * 1e3:.3f} ms)" for k, v in floor["terms"].items())
    info = ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in floor["info"].items())
    return f"floor {name}: {floor['bytes'] / 1e9:.3f} GB = {floor['ms']:.3f} ms: {parts}; not in floor: {info}"


# --------------------------------------------------------------------------------------------- memory


def memory_report(args, batch=64, context=8192):
    """Bytes of the whole --model target's weights and state at `batch` slots x `context` tokens, from
    jax.eval_shape (nothing allocated): {"items": {name: bytes}, "total", "fits", ...}."""
    import jax
    import jax.numpy as jnp

    from jaxspec import cache as cache_mod
    from jaxspec import dflash
    from jaxspec import target as target_mod
    from jaxspec.spec import estimator

    tshape, dshape = shapes_of(args.model)
    tc = target_config(tshape, tshape["layers"])
    dc = draft_config(dshape, tc, args.block)
    spec = spec_config("static", batch, argparse.Namespace(max_len=context, num_tiers=args.num_tiers))
    cache_cfg = spec.cache_config(args.block, "bfloat16")
    key = jax.random.PRNGKey(0)
    tgt = jax.eval_shape(lambda k: target_mod.init_target(tc, k, jnp.bfloat16).params, key)
    drf = jax.eval_shape(lambda k: dflash.init_draft(dc, k, jnp.bfloat16).params, key)
    cache = jax.eval_shape(lambda: cache_mod.init_cache(tc, cache_cfg))
    ctx = jax.eval_shape(lambda: dflash.init_state(dc, batch, context, jnp.bfloat16))
    est = jax.eval_shape(lambda: estimator.init(args.block - 1))
    items = {
        "target weights": _nbytes(tgt),
        "draft weights": _nbytes(drf),
        "KV cache": _nbytes((cache.k_cache, cache.v_cache)),
        "GDN checkpoints": _nbytes(cache.ckpt),
        "ring": _nbytes((cache.ring_k, cache.ring_u, cache.ring_g, cache.write_pos)),
        "conv": _nbytes((cache.conv_state, cache.conv_window)),
        "draft context cache": _nbytes(ctx),
        # + the engine's per-slot anchor (int32), PRNG key (2 x uint32) and sampling params (3 x 4 bytes)
        "other state": _nbytes((cache.seq_len, est)) + (batch + 1) * 24,
    }
    total = sum(items.values())
    return dict(
        layers=tc.num_hidden_layers,
        batch=batch,
        context=context,
        block=args.block,
        state_dtype=cache_cfg.state_dtype,
        ring_dtype=cache_cfg.ring_dtype,
        items=items,
        target_params=_nbytes(tgt) // 2,
        detail_target={k: _nbytes(v) for k, v in tgt.items()},
        total=total,
        hbm=HBM_BYTES,
        fits=total <= HBM_BYTES,
        note="state arrays have num_slots + 1 rows (slot 0 is the null slot); activations, logits and "
        "XLA scratch are not included",
    )


def memory_lines(mem):
    lines = [
        f"## memory at {mem['layers']} layers, {mem['batch']} slots x {mem['context']} context, block "
        f"{mem['block']} (state {mem['state_dtype']}, ring {mem['ring_dtype']})",
        "",
        "| item | GB |",
        "|---|---|",
    ]
    lines += [f"| {k} | {v / 1e9:.2f} |" for k, v in mem["items"].items()]
    lines += [
        f"| **total** | **{mem['total'] / 1e9:.2f}** |",
        "",
        f"fits in {mem['hbm'] / 1e9:.0f} GB (H200): {'yes' if mem['fits'] else 'NO'}; " + mem["note"],
    ]
    return lines


# --------------------------------------------------------------------------------------------- stepping


class Stepper:
    """Engine.forced_step(batch, tier) that prefills afresh (the prefill compiles once per shape) before the
    slots' max_len runs out: at most (max_len - prompt_len) // window calls fit one prefill."""

    def __init__(self, engine, batch, tier, prompt_len, seed, greedy=True):
        import jax

        self.jax, self.engine, self.batch, self.tier, self.prompt_len, self.seed = (
            jax,
            engine,
            batch,
            tier,
            prompt_len,
            seed,
        )
        self.greedy = greedy
        if self.capacity() < 1:
            raise ValueError(
                f"--max-len {engine.spec.max_len}: no step fits after a {prompt_len}-token prompt "
                f"(window {engine.window})"
            )
        t = time.perf_counter()
        self.fresh()
        self.prefill_s = time.perf_counter() - t  # the first one compiles the prefill

    def capacity(self):
        return (self.engine.spec.max_len - self.prompt_len) // self.engine.window

    def fresh(self):
        self.run = self.engine.forced_step(
            self.batch, self.tier, prompt_len=self.prompt_len, seed=self.seed, greedy=self.greedy
        )
        self.jax.block_until_ready(self.engine.state)
        self.calls = 0

    def ensure(self, n):
        """Room for n more calls without a new prefill (a fresh prefill when there is not), if it can fit."""
        if self.calls + n > self.capacity():
            self.fresh()

    def __call__(self):
        self.ensure(1)
        self.calls += 1
        return self.run()

    def committed_per_step(self):
        """Tokens the slots' seq_len grew by per call since the last prefill (forced acceptance: the step's
        verified tokens)."""
        import numpy as np

        if not self.calls:
            return None
        seq = np.asarray(self.engine.state.cache.seq_len)[1 : self.batch + 1]
        return float(seq.sum() - self.batch * self.prompt_len) / self.calls

    def hlo_text(self):
        """The compiled HLO text of this step: jax's lowering / compilation caches return the executable the
        calls run (same function, same argument types), so nothing compiles again."""
        return lower_step(self.engine, self.batch, self.tier, self.greedy).compile().as_text()


def abstract_engine():
    """Engine whose state is abstract (jax.eval_shape of Engine._init_state: jax.ShapeDtypeStruct leaves,
    nothing allocated). With abstract target and draft it lowers and compiles its programs
    (`forced_lowerings`: they read only shapes) but cannot run them (forced_step, decoding)."""
    import jax

    from jaxspec.engine import Engine

    class AbstractEngine(Engine):
        def _init_state(self):
            return jax.eval_shape(super()._init_state)

    return AbstractEngine


def concrete_leaves(*trees):
    """Leaves of `trees` that are not jax.ShapeDtypeStruct (arrays: what --compile-only must not make)."""
    import jax

    return sum(not isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree_util.tree_leaves(trees))


def live_array_bytes():
    """Bytes of the jax arrays alive in this process."""
    import jax

    return sum(x.nbytes for x in jax.live_arrays())


def lower_step(engine, batch, tier, greedy=True):
    """jax.stages.Lowered of the jitted step forced_step(batch, tier, greedy=greedy) calls."""
    return engine.forced_lowerings(batch, tier, greedy=greedy)["step"]()


def lower_prefill(engine, batch, prompt_len):
    """jax.stages.Lowered of the prefill forced_step(batch, ..., prompt_len=prompt_len) runs."""
    return engine.forced_lowerings(batch, engine.tier_tokens[-1], prompt_len=prompt_len)["prefill"]()


def time_case(stepper, reps):
    """(first call s, median ms of `reps` synchronised calls, per-call ms, tokens committed a step)."""
    jax = stepper.jax
    t = time.perf_counter()
    jax.block_until_ready(stepper())
    first_s = time.perf_counter() - t
    times = []
    for _ in range(reps):
        stepper.ensure(1)
        t = time.perf_counter()
        jax.block_until_ready(stepper())
        times.append((time.perf_counter() - t) * 1e3)
    return first_s, statistics.median(times), times, stepper.committed_per_step()


# --------------------------------------------------------------------------------------------- main


def torch_copy_subprocess(args, notes):
    """The torch copy bandwidth measured in its own process (JAX must not hold the GPU meanwhile)."""
    if args.smoke or args.no_torch_copy or args.compile_only or importlib.util.find_spec("torch") is None:
        return
    try:
        r = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--torch-copy", "--out", args.out],
            capture_output=True,
            text=True,
            timeout=180,
        )
        if r.returncode:
            notes.append(f"torch copy subprocess failed (rc {r.returncode}): {r.stderr[-300:]}")
    except Exception as e:  # noqa: BLE001
        notes.append(f"torch copy subprocess failed: {e!r}"[:300])


def main(args):
    t_start = time.time()
    os.makedirs(args.out, exist_ok=True)
    notes = []
    torch_copy_subprocess(args, notes)
    if args.no_command_buffers:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()
        notes.append("command buffers off (--no-command-buffers): one launch per kernel")
    benchutil.setup_jax(args.smoke, require_gpu=not (args.smoke or args.compile_only))
    import jax

    from jaxspec.engine import Engine

    if args.compile_only:
        Engine = abstract_engine()  # the engines' state abstract too
        notes.append(
            "compile only (--compile-only): weights and state abstract (jax.ShapeDtypeStruct: nothing "
            "allocated), each program lowered and compiled, none run"
        )

    command = " ".join(
        shlex.quote(a) for a in [os.path.relpath(os.path.abspath(__file__), benchutil.ROOT)] + sys.argv[1:]
    )
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    dev = jax.devices()[0]
    batches = [int(x) for x in args.batches.split(",") if x]
    modes = set(args.modes.split(","))
    rows = {b: dict(batch=b, command=command, date=date, none=None, spec_full=None, compact={}) for b in batches}
    compiles = []
    tshape, dshape = shapes_of(args.model, args.smoke)
    tc = target_config(tshape, args.layers)
    dc = draft_config(dshape, tc, args.block)
    info = dict(
        command=command,
        date=date,
        device=dev.device_kind,
        backend=jax.default_backend(),
        jax=jax.__version__,
        smoke=args.smoke,
        compile_only=args.compile_only,
        args=vars(args),
        notes=notes,
        compiles=compiles,
        trace_stats={},
        target=dict(
            layers=tc.num_hidden_layers,
            hidden=tc.hidden_size,
            vocab=tc.vocab_size,
            attn_layers=list(tc.attn_layers),
            params=param_bytes(tc, dc),
        ),
        draft=dict(
            layers=dc.num_hidden_layers,
            block=dc.block_size,
            taps=list(dc.target_layer_ids),
            mask_token_id=dc.mask_token_id,
        ),
    )

    mem = memory_report(args)
    info["memory"] = mem
    print("\n".join(memory_lines(mem)), flush=True)

    bw_src = bw = gemm_rate = None
    if not args.compile_only:  # floors only where steps are timed
        copies = benchutil.copy_bandwidths(args.out)
        bw_src, bw = benchutil.floor_bandwidth(copies)
        gemm_rate = benchutil.gemm_throughput()[0]
        info.update(
            copy_TB_per_s={k: round(v / 1e12, 3) for k, v in copies.items()},
            floor_bandwidth=bw_src,
            gemm_TFLOP_per_s=round(gemm_rate / 1e12, 3),
        )
        if bw_src != "torch copy":
            notes.append(
                f"floors at the {bw_src} bandwidth ({bw / 1e12:.3f} TB/s; no torch copy measured): "
                "optimistic for the step"
            )
        print(json.dumps(info["copy_TB_per_s"]) + f"; bf16 GEMM {info['gemm_TFLOP_per_s']} TFLOP/s", flush=True)

    t = time.perf_counter()

    def models():
        return build(
            args.layers,
            args.block,
            model=args.model,
            smoke=args.smoke,
            seed=args.seed,
            stacked=args.layer_layout == "groups",
            fused=not args.separate_projections,
        )

    if args.compile_only:
        target, draft = jax.eval_shape(models)  # the same trees, jax.ShapeDtypeStruct leaves
    else:
        target, draft = models()
        jax.block_until_ready((target, draft))
    info["init_s"] = time.perf_counter() - t
    info["concrete_leaves"] = concrete_leaves(target, draft)  # --compile-only: engines' states added below
    print(
        f"models {'built abstract' if args.compile_only else 'initialised'} in {info['init_s']:.1f} s: "
        f"target {_nbytes(target.params) / 1e9:.2f} GB, draft {_nbytes(draft.params) / 1e9:.2f} GB",
        flush=True,
    )

    greedy = not args.sampled  # the steps' variant that every case times and compiles ahead

    def over_budget():
        return time.time() - t_start > args.budget_s

    def dump():
        info["elapsed_s"] = round(time.time() - t_start, 1)
        info["compile_totals"] = compile_totals(compiles)
        with open(os.path.join(args.out, "real_shape.json"), "w") as f:
            json.dump(dict(info, rows=list(rows.values())), f, indent=1, default=str)
        lines = markdown(info, rows, mem, bw_src, bw)
        with open(os.path.join(args.out, "real_shape.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
        return lines

    def tiers_chosen(ladder):
        if args.tiers == "all":
            return set(range(len(ladder)))
        return {int(i) % len(ladder) for i in args.tiers.split(",") if i}

    def case(engine, b, tier, trace, spec, pre):
        """Time one (engine, batch, tier) and, if trace, its GPU breakdown; a result dict. pre: precompile's
        result for this step (its compile time and HLO text), or {}."""
        stepper = Stepper(engine, b, tier, args.prompt_len, args.seed, greedy=greedy)
        first_s, ms, times, committed = time_case(stepper, args.reps)
        tokens = round(committed) if committed is not None else tier
        ctx = args.prompt_len + tokens / b * (args.reps + 1) / 2  # the mean context of the timed calls
        floor = step_floor(tc, dc if spec else None, engine.cache_config, batch=b, tokens=tokens, ctx=ctx, bandwidth=bw)
        flops = step_flops(tc, dc if spec else None, batch=b, tokens=tokens, ctx=ctx)
        compute_ms = flops["flops"] / gemm_rate * 1e3
        res = dict(
            tier=tier,
            ms=ms,
            times_ms=times,
            first_call_s=first_s,
            prefill_first_s=stepper.prefill_s,
            compile_s=pre.get("compile_s"),
            lower_s=pre.get("lower_s"),
            precompile_error=pre.get("error"),
            tokens_per_step=committed,
            ctx_mean=ctx,
            floor_ms=floor["ms"],
            floor_ratio=ms / floor["ms"],
            floor_terms_bytes=floor["terms"],
            floor_info_bytes=floor["info"],
            compute_floor_ms=compute_ms,
            compute_terms_flops=flops["terms"],
            bound_ratio=ms / max(floor["ms"], compute_ms),
        )
        print(
            f"batch {b} {engine.spec.verify_mode} tier {tier}: {ms:.3f} ms (compile {fmt_s(pre.get('compile_s'))}, "
            f"first call {first_s:.1f} s, tokens/step {committed}); "
            + floor_line(f"{engine.spec.verify_mode} b{b}", floor, bw)
            + f"; compute floor {flops['flops'] / 1e12:.2f} TFLOP = {compute_ms:.3f} ms",
            flush=True,
        )
        if trace and args.trace_calls > 0:
            try:
                stepper.ensure(2 + args.trace_calls)
                hlo_s = []

                def hlo_text():
                    t0 = time.perf_counter()
                    text = pre["compiled"].as_text() if pre.get("compiled") else stepper.hlo_text()
                    hlo_s.append(time.perf_counter() - t0)
                    return text

                gpu_events, cpu_events = trace_events(stepper, args.trace_calls)
                res["gpu"] = map_events(gpu_events, args.trace_calls, hlo_text)
                if res["gpu"] is None:
                    res["cpu_mapping_check"] = map_events(cpu_events, args.trace_calls, hlo_text)
                res["hlo_text_s"] = hlo_s[0] if hlo_s else None
                for key in ("gpu", "cpu_mapping_check"):
                    if res.get(key):
                        seen = info["trace_stats"].setdefault(key, [])
                        seen[:] = sorted(set(seen) | set(res[key]["stats"]))
                g = res["gpu"]
                if g:
                    print(
                        f"  GPU busy {g['busy_ms']:.3f} ms a step ({g['kernels_per_step']:.0f} kernels): "
                        + ", ".join(f"{k} {v:.3f}" for k, v in g["by_scope"].items())
                        + f"; mapped by {g['by_source']}; stats {g['stats']}",
                        flush=True,
                    )
            except Exception as e:  # noqa: BLE001 - the timings stand without it
                res["trace_error"] = repr(e)[:500]
                notes.append(f"batch {b} {engine.spec.verify_mode}: trace failed: {e!r}"[:300])
        return res

    def guarded(name, fn, *a):
        """fn(*a), or None with a note when it raises (e.g. out of memory): the other cases go on."""
        try:
            return fn(*a)
        except Exception as e:  # noqa: BLE001
            notes.append(f"{name} failed: {e!r}"[:400])
            print(f"{name} failed: {e!r}"[:2000], flush=True)
            return None

    def compile_group(b, jobs, group):
        """Precompile a batch's programs (none with --compile-workers 0: each compiles at its first call)."""
        if args.compile_workers < 1 or not jobs:
            return {}
        t = time.perf_counter()
        out = precompile(jobs, args.compile_workers)
        wall = time.perf_counter() - t
        compiles.append(
            dict(
                batch=b,
                group=group,
                wall_s=wall,
                workers=args.compile_workers,
                programs={k: {kk: vv for kk, vv in v.items() if kk != "compiled"} for k, v in out.items()},
            )
        )
        print(
            f"batch {b}: compiled {len(jobs)} programs in {wall:.1f} s ({args.compile_workers} workers): "
            + ", ".join(f"{k} {fmt_s(v.get('compile_s'))}" for k, v in out.items()),
            flush=True,
        )
        for k, v in out.items():
            if "error" in v:
                notes.append(f"batch {b}: precompile of {k} failed ({v['error'][:200]}); its first call compiles it")
        return out

    def pass1_case(engine, b, tokens, prefill_name, row_key):
        """Compile `engine`'s prefill and its step at `tokens` verify tokens, then time the step
        into rows[b][row_key] (with --compile-only, print the compile line instead)."""
        mode = engine.spec.verify_mode
        step_name = f"{mode} step"
        pre = compile_group(
            b,
            [
                (prefill_name, lambda: lower_prefill(engine, b, args.prompt_len)),
                (step_name, lambda: lower_step(engine, b, tokens, greedy)),
            ],
            f"pass 1 {mode}",
        )
        if args.compile_only:
            info["concrete_leaves"] += concrete_leaves(engine.state, engine.target, engine.proposer)
            print(compile_line(dump(), b), flush=True)
        elif not over_budget():
            rows[b][row_key] = guarded(
                f"batch {b} {mode}", case, engine, b, tokens, True, mode != "none", pre.get(step_name, {})
            )
            print(row_line(dump(), b), flush=True)

    def pass1(b):
        """Batch b: none, then spec full (the static step), with their breakdowns. One engine's state
        is on the device at a time (64 layers at batch 64: ~10 GB each beside 57 GB of weights)."""
        if "none" in modes:
            none = Engine(target, None, spec_config("none", b, args))
            pass1_case(none, b, b, "none prefill", "none")
            del none  # its state off the device before the next engine's
        if "spec" not in modes:
            return
        static = Engine(target, draft, spec_config("static", b, args))
        rows[b]["ladder"] = list(static.tier_tokens)
        if len(static.tier_tokens) - 1 in tiers_chosen(static.tier_tokens):
            pass1_case(static, b, static.tier_tokens[-1], "spec prefill", "spec_full")

    def pass2(b):
        """Batch b: the compact step per tier (the full tier only with --compact-full: static covers it)."""
        compact = Engine(target, draft, spec_config("compact", b, args))
        ladder = compact.tier_tokens
        rows[b]["ladder"] = list(ladder)
        tiers = [ladder[j] for j in sorted(tiers_chosen(ladder)) if j < len(ladder) - 1 or args.compact_full]
        if not tiers:
            return
        pre = compile_group(
            b,
            [("spec prefill", lambda: lower_prefill(compact, b, args.prompt_len))]
            + [(f"compact step {t}", lambda t=t: lower_step(compact, b, t, greedy)) for t in tiers],
            "pass 2",
        )
        if args.compile_only:
            info["concrete_leaves"] += concrete_leaves(compact.state, compact.target, compact.proposer)
            print(compile_line(dump(), b), flush=True)
            return
        for tier in tiers:
            if over_budget():
                break
            res = guarded(
                f"batch {b} compact {tier}", case, compact, b, tier, False, True, pre.get(f"compact step {tier}", {})
            )
            if res is not None:
                rows[b]["compact"][tier] = res
            print(row_line(dump(), b), flush=True)

    for run_pass, wanted in ((pass1, True), (pass2, "spec" in modes)):
        for b in batches if wanted else ():
            if over_budget():
                break
            guarded(f"batch {b} {run_pass.__name__}", run_pass, b)  # e.g. out of memory: the next batch goes on
    if over_budget():
        notes.append(f"stopped early: --budget-s {args.budget_s} reached")
    if args.compile_only:
        info["live_array_bytes"] = live_array_bytes()  # what this process still holds on its devices
        stats = dev.memory_stats() or {}  # GPU: the allocator's peak (None on the CPU)
        info["device_memory"] = {
            k: stats[k] for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit") if k in stats
        }
    lines = dump()
    print("\n".join(lines), flush=True)
    return 0


def fmt_s(v):
    return "–" if v is None else f"{v:.1f} s"


def compile_totals(compiles):
    """Sums of the compile groups' seconds: {"by_batch": {batch: {"programs", "lower_s", "compile_s",
    "wall_s", "errors"}}, and the same over every batch}. lower_s, compile_s: sums over the programs (the compiles of a
    group overlap in its threads); wall_s: the groups' walls (lowering and compiling)."""

    def total(groups):
        progs = [p for g in groups for p in g["programs"].values()]
        return dict(
            programs=len(progs),
            lower_s=sum(p.get("lower_s") or 0.0 for p in progs),
            compile_s=sum(p.get("compile_s") or 0.0 for p in progs),
            wall_s=sum(g["wall_s"] for g in groups),
            errors=sum("error" in p for p in progs),
        )

    batches = sorted({g["batch"] for g in compiles})
    return dict(total(compiles), by_batch={b: total([g for g in compiles if g["batch"] == b]) for b in batches})


def compile_line(lines, b):
    """The compile table's total row of batch b."""
    return next((ln for ln in reversed(lines) if ln.startswith(f"| {b} | total |")), "")


def compile_lines(info):
    """--compile-only's table: each program's lower and compile seconds per batch and compile group, the
    batch's totals, and the overall total."""
    fmt = lambda v: "–" if v is None else f"{v:.1f}"
    gb = lambda v: "–" if v is None else f"{v / 1e9:.2f}"
    lines = [
        "## compile (s; lower: tracing + lowering to StableHLO, one program after another; compile: XLA, a "
        f"group's programs in --compile-workers {info['args']['compile_workers']} threads, so they overlap; "
        "wall: the group's, lowering and compiling; pass 2's spec prefill, where it is pass 1's program, comes "
        "from jax's caches in about 0 s)",
        "",
        "| batch | group | program | lower s | compile s | XLA temp GB |",
        "|---|---|---|---|---|---|",
    ]
    totals = info["compile_totals"]
    for b, tot in totals["by_batch"].items():
        for g in (g for g in info["compiles"] if g["batch"] == b):
            for name, p in g["programs"].items():
                err = f" (failed: {p['error'][:80]})" if "error" in p else ""
                lines.append(
                    f"| {b} | {g['group']} | {name}{err} | {fmt(p.get('lower_s'))} | {fmt(p.get('compile_s'))} "
                    f"| {gb(p.get('temp_bytes'))} |"
                )
            lines.append(f"| {b} | {g['group']} | wall ({len(g['programs'])} programs) | | {fmt(g['wall_s'])} | |")
        lines.append(
            f"| {b} | total | {tot['programs']} programs, wall {fmt(tot['wall_s'])} s | {fmt(tot['lower_s'])} "
            f"| {fmt(tot['compile_s'])} | |"
        )
    lines += [
        "",
        f"overall: {totals['programs']} programs, lower {fmt(totals['lower_s'])} s + compile "
        f"{fmt(totals['compile_s'])} s (sums), wall {fmt(totals['wall_s'])} s"
        + (f", {totals['errors']} failed" if totals["errors"] else "")
        + f"; concrete leaves in the models and states: {info.get('concrete_leaves')}",
        "",
    ]
    return lines


def row_line(lines, b):
    """The steps table's row of batch b."""
    return next((ln for ln in reversed(lines) if ln.startswith(f"| {b} |")), "")


def markdown(info, rows, mem, bw_src, bw):
    """The report: header, memory, compile times, notes, and the steps table last (its last line is the
    last row, what the script prints after each case)."""
    fmt = lambda v, d=3: "–" if v is None else f"{v:.{d}f}"
    attn = info["target"]["attn_layers"]
    compile_only = info.get("compile_only")
    lines = [
        f"# real-shape engine step{' compile only' if compile_only else ''}, {info['device']} ({info['backend']}), "
        f"jax {info['jax']}" + (" — SMOKE (CPU, tiny config: no meaning as timings)" if info["smoke"] else ""),
        "",
        f"command: `{info['command']}`, {info['date']}; target {info['target']['layers']} layers "
        f"({'stacked groups, one scan' if info['args'].get('layer_layout') == 'groups' else 'a list, unrolled'}) "
        f"(attention at {attn[:8]}{'…' if len(attn) > 8 else ''}), draft {info['draft']['layers']} layers, "
        f"block {info['draft']['block']}, taps {info['draft']['taps']}, "
        f"{'sampling' if info['args'].get('sampled') else 'greedy'} steps"
        + ("" if compile_only else f"; floors at {bw_src} {bw / 1e12:.3f} TB/s"),
        "",
    ]
    lines += memory_lines(mem) + [""]
    if compile_only:  # no steps ran: the compile table, the notes
        lines += compile_lines(info)
        if "live_array_bytes" in info:
            lines += [
                f"live device arrays at the end: {info['live_array_bytes']} bytes; device memory: "
                f"{info.get('device_memory') or 'no allocator stats'}",
                "",
            ]
        return lines + [f"- {x}" for x in info["notes"]]
    comp = []
    for r in rows.values():
        for name, res in [("none", r["none"]), ("static (full)", r["spec_full"])] + [
            (f"compact {t}", v) for t, v in r["compact"].items()
        ]:
            if res:
                comp.append(
                    f"| {r['batch']} | {name} | {res['tier']} | {fmt(res['lower_s'], 1)} "
                    f"| {fmt(res['compile_s'], 1)} | {res['prefill_first_s']:.1f} | {res['first_call_s']:.1f} |"
                )
    if comp:
        groups = "; ".join(
            f"batch {c['batch']}: {len(c['programs'])} programs in {c['wall_s']:.1f} s" for c in info["compiles"]
        )
        lines += [
            "## compile (s; lower + compile: ahead of the calls, a batch's programs compiled "
            f"together in --compile-workers {info['args']['compile_workers']} threads, so the compiles of a "
            "group overlap; prefill: the first forced_step (its prefill: compiled ahead, or here); first "
            "call: wall of the first step (its compile when not ahead))",
            "",
            "| batch | step | tier | lower s | compile s | prefill s | first call s |",
            "|---|---|---|---|---|---|---|",
        ]
        lines += comp + (["", f"groups: {groups}"] if groups else []) + [""]
    if info["notes"]:
        lines += [f"- {x}" for x in info["notes"]] + [""]
    lines += [
        "## steps (wall ms a synchronised step, median; floor: HBM bytes / copy bandwidth; compute: the "
        "step's FLOPs / the run's bf16 GEMM rate (`step_flops`), and / bound: the wall over the larger of "
        "the two floors; spec full = static, every row verifies its block; compact tier t verifies t "
        "tokens; breakdown: GPU busy ms of the spec full step by engine scope)",
        "",
        "| batch | none ms | none floor ms | none / floor | spec tier → ms | spec full ms | spec floor ms "
        "| spec / floor | compute floor ms none / spec | / bound none / spec | spec / none | spec busy ms "
        "| breakdown ms (spec full) | none busy ms | made |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows.values():
        n, s = r["none"], r["spec_full"]
        tiers = ", ".join(f"{t}→{v['ms']:.2f}" for t, v in r["compact"].items()) or "–"
        sg, ng = (s or {}).get("gpu"), (n or {}).get("gpu")
        brk = ", ".join(f"{k} {v:.2f}" for k, v in sg["by_scope"].items()) if sg else "–"
        lines.append(
            f"| {r['batch']} | {fmt(n and n['ms'])} | {fmt(n and n['floor_ms'])} | {fmt(n and n['floor_ratio'], 2)} "
            f"| {tiers} | {fmt(s and s['ms'])} | {fmt(s and s['floor_ms'])} | {fmt(s and s['floor_ratio'], 2)} "
            f"| {fmt(n and n.get('compute_floor_ms'))} / {fmt(s and s.get('compute_floor_ms'))} "
            f"| {fmt(n and n.get('bound_ratio'), 2)} / {fmt(s and s.get('bound_ratio'), 2)} "
            f"| {fmt(s['ms'] / n['ms'] if s and n else None, 2)} | {fmt(sg and sg['busy_ms'])} | {brk} "
            f"| {fmt(ng and ng['busy_ms'])} | {r['date']} |"
        )
    return lines


if __name__ == "__main__":
    benchutil.run_main(parse, main)
