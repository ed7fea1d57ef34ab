"""Training of the project's tiny models (docs/design.md section 5): a byte-level GDN-hybrid
target and a DFlash draft against it, on a corpus every machine has.

Corpus. The Python source files (`*.py`) of the standard library of the interpreter that runs
this code (`sysconfig.get_path("stdlib")`), minus the third-party directories `site-packages` /
`dist-packages`. Files are ordered by their relative POSIX path. The held-out split is a rule on
the path alone, so the two splits never overlap on any machine: a file is held out iff its module
is one of `HELD_OUT_MODULES`, where the module of `argparse.py` is "argparse", of
`json/decoder.py` "json", and of a test file `test/test_json/...` or `test/test_argparse.py` the
module it tests ("json", "argparse"). Everything else is training text. (The corpus itself
depends on the Python version and on what the distribution installs, e.g. Debian ships `test/`
separately; `corpus_stats` records the file counts, byte counts and a content hash.)

Tokens. Byte level (`jaxspec.tokenizer.ByteTokenizer`): id = byte value, and a few specials
above 255: EOS_ID = 256 ends every file (the corpus is the files joined with EOS), MASK_ID = 257
is the DFlash draft's mask token (never seen by the target), 258..VOCAB_SIZE-1 are reserved.
Windows of a fixed length start at uniformly random offsets of the joined stream (numpy RNG);
held-out evaluation uses a fixed set of windows (seed EVAL_SEED) so numbers compare across runs.

Target training: cross-entropy of the next byte through the real cache-free model forward
(`target.prefill_layers`, the reference ops), AdamW with linear warmup and cosine decay,
global-norm clipping, optional bfloat16 compute on float32 master weights.

Draft training (DFlash): the frozen target's forward gives the tapped hidden states (the outputs
of `DraftConfig.target_layer_ids`). Each sequence gets `anchors_per_seq` distinct random anchors
a in [1, T - B]; block n is [token a, MASK x (B-1)] at positions a..a+B-1, attending to the
fc-projected context at positions < a (the block mask) and bidirectionally to itself: exactly
what `dflash.propose` computes at inference with ctx_len = a (tests/test_train.py holds the two to
1e-5). Block position k = 1..B-1 predicts token a + k with loss weight exp(-(k-1)/gamma), learning
(`labels`) the corpus token a + k ("data", the default), the frozen target's distribution at
position a + k - 1 of the teacher-forced window ("target": distillation, since speculative
acceptance is agreement with the target), or the mean of the two losses ("mix"). The target's
embedding and lm_head are shared and frozen.

Checkpoints are HF-layout directories (config.json + model.safetensors) that
`jaxspec.load_target` / `jaxspec.load_draft` read, next to `metrics.json` (recipe, corpus, train
and held-out curves, throughput) and `loss_curve.png`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
import sys
import sysconfig
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxspec import dflash
from jaxspec.config import DraftConfig, TargetConfig
from jaxspec.dflash import Draft, key_values
from jaxspec.ops.linear import dense, head_logits, swiglu_mlp
from jaxspec.ops.norms import rms_norm_plain
from jaxspec.ops.rope import apply_rope
from jaxspec.target import Target, init_target, lm_head, prefill_layers
from jaxspec.weights import save_params

HIGHEST = jax.lax.Precision.HIGHEST

BYTE_VOCAB = 256
EOS_ID = 256
MASK_ID = 257
VOCAB_SIZE = 260
EVAL_SEED = 1234
LABEL_MODES = ("data", "target", "mix")  # what a DFlash draft learns (`block_loss`)

# Held out: these modules (single files or packages) and their tests. They exist in every
# CPython 3.8+ standard library.
HELD_OUT_MODULES = (
    "argparse",
    "base64",
    "bisect",
    "calendar",
    "csv",
    "difflib",
    "fractions",
    "heapq",
    "json",
    "pprint",
    "queue",
    "random",
    "shlex",
    "statistics",
    "string",
    "textwrap",
    "threading",
    "uuid",
    "wave",
    "zipfile",
)
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


# ---------------------------------------------------------------------------------------------
# Corpus


def stdlib_root() -> str:
    """The standard library directory of the running interpreter."""
    return sysconfig.get_path("stdlib")


def module_of(relpath: str) -> str:
    """The module a stdlib file belongs to: 'json/decoder.py' -> 'json', 'argparse.py' ->
    'argparse', 'test/test_json/test_fail.py' and 'test/test_argparse.py' -> 'json', 'argparse'."""
    parts = relpath.split("/")
    name = parts[0]
    if name == "test" and len(parts) > 1:
        name = parts[1]
        name = name[len("test_") :] if name.startswith("test_") else name
    return name[:-3] if name.endswith(".py") else name


def is_held_out(relpath: str) -> bool:
    """The held-out rule (module doc): a function of the relative path alone."""
    return module_of(relpath) in HELD_OUT_MODULES


def corpus_files(root: str | os.PathLike | None = None) -> tuple[list[str], list[str]]:
    """(train, held_out): the relative POSIX paths of the *.py files under `root` (default: the
    stdlib), sorted, without site-packages / dist-packages / __pycache__, split by `is_held_out`."""
    root = os.fspath(root or stdlib_root())
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        rel = os.path.relpath(dirpath, root)
        for f in filenames:
            if f.endswith(".py"):
                files.append(f if rel == "." else f"{rel.replace(os.sep, '/')}/{f}")
    files.sort()
    train = [f for f in files if not is_held_out(f)]
    held_out = [f for f in files if is_held_out(f)]
    return train, held_out


@dataclasses.dataclass
class Corpus:
    """Files joined into one token stream, each followed by EOS_ID."""

    root: str
    files: list[str]
    tokens: np.ndarray  # [N] uint16
    sha256: str  # of the stream

    @classmethod
    def from_files(cls, root, files) -> Corpus:
        root = os.fspath(root)
        parts = []
        for f in files:
            with open(os.path.join(root, f), "rb") as fh:
                parts.append(np.frombuffer(fh.read(), np.uint8).astype(np.uint16))
            parts.append(np.array([EOS_ID], np.uint16))
        tokens = np.concatenate(parts) if parts else np.zeros((0,), np.uint16)
        return cls(root=root, files=list(files), tokens=tokens, sha256=hashlib.sha256(tokens.tobytes()).hexdigest())

    def sample(self, rng: np.random.Generator, batch: int, length: int) -> np.ndarray:
        """[batch, length] int32 windows at uniformly random offsets."""
        if len(self.tokens) < length + 1:
            raise ValueError(f"seq_len={length}: the corpus ({len(self.tokens)} tokens) is too short")
        starts = rng.integers(0, len(self.tokens) - length + 1, size=batch)
        return self.tokens[starts[:, None] + np.arange(length)[None, :]].astype(np.int32)

    def fixed_batches(self, n: int, batch: int, length: int, seed: int = EVAL_SEED) -> list[np.ndarray]:
        """n batches of windows that depend only on (corpus, seed): the held-out evaluation set."""
        rng = np.random.default_rng(seed)
        return [self.sample(rng, batch, length) for _ in range(n)]


def load_corpus(root: str | os.PathLike | None = None) -> tuple[Corpus, Corpus]:
    """(train, held_out) corpora of `root` (default: the stdlib)."""
    root = os.fspath(root or stdlib_root())
    train, held_out = corpus_files(root)
    if not train or not held_out:
        raise ValueError(
            f"corpus root {root!r}: needs *.py files in both splits, found "
            f"{len(train)} train and {len(held_out)} held-out"
        )
    return Corpus.from_files(root, train), Corpus.from_files(root, held_out)


def corpus_stats(train: Corpus, held_out: Corpus) -> dict:
    return {
        "root": train.root,
        "python": sys.version.split()[0],
        "held_out_modules": list(HELD_OUT_MODULES),
        "train_files": len(train.files),
        "train_tokens": int(len(train.tokens)),
        "train_sha256": train.sha256,
        "held_out_files": len(held_out.files),
        "held_out_tokens": int(len(held_out.tokens)),
        "held_out_sha256": held_out.sha256,
    }


# ---------------------------------------------------------------------------------------------
# Default configs


def tiny_target_config(
    hidden_size=256,
    num_hidden_layers=8,
    intermediate_size=None,
    full_attention_interval=4,
    head_dim=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    linear_num_key_heads=2,
    linear_num_value_heads=6,
    max_position_embeddings=4096,
) -> TargetConfig:
    """The shipped tiny target: a byte-level Qwen3.5-shaped GDN hybrid (text-only layout).

    Defaults: vocab VOCAB_SIZE (bytes + EOS + MASK + reserved), hidden 256, 8 layers with every
    4th full attention (layers 3, 7), GDN with 2 key / 6 value heads of dim 64 and conv width 4,
    gated attention with 4 query / 2 KV heads of dim 64 (rotary on a quarter), SwiGLU 3x hidden,
    untied lm_head, EOS = EOS_ID. About 7.6M parameters.
    """
    return TargetConfig(
        layout="qwen3_5_text",
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 3 * hidden_size,
        num_hidden_layers=num_hidden_layers,
        layer_types=tuple(
            "full_attention" if (i + 1) % full_attention_interval == 0 else "linear_attention"
            for i in range(num_hidden_layers)
        ),
        rms_norm_eps=1e-6,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        rope_theta=10000.0,
        partial_rotary_factor=0.25,
        linear_num_key_heads=linear_num_key_heads,
        linear_num_value_heads=linear_num_value_heads,
        linear_key_head_dim=head_dim,
        linear_value_head_dim=head_dim,
        linear_conv_kernel_dim=4,
        tie_word_embeddings=False,
        max_position_embeddings=max_position_embeddings,
        eos_token_id=(EOS_ID,),
    )


def default_taps(num_target_layers: int, num_taps: int = 3) -> tuple[int, ...]:
    """Evenly spaced tap layers from 1 to num_target_layers - 3 (DFlash's rule), widened to fit
    num_taps distinct layers in a shallow target: 8 layers -> (1, 3, 5); 4 layers -> (1, 2, 3)."""
    n = min(num_taps, num_target_layers)
    lo = 1 if num_target_layers > n else 0
    hi = min(max(lo + n - 1, num_target_layers - 3), num_target_layers - 1)
    if n == 1:
        return (lo,)
    return tuple(sorted({round(lo + (hi - lo) * i / (n - 1)) for i in range(n)}))


def tiny_draft_config(
    target_config: TargetConfig,
    num_hidden_layers=2,
    block_size=8,
    target_layer_ids=None,
    intermediate_size=None,
    mask_token_id=None,
) -> DraftConfig:
    """The shipped tiny DFlash draft for `target_config`: its hidden size (shared embedding and
    lm_head), its attention head shapes, 2 layers, block 8, taps `default_taps`, mask MASK_ID."""
    t = target_config
    if mask_token_id is None:
        mask_token_id = MASK_ID if t.vocab_size > MASK_ID else t.vocab_size - 1
    return DraftConfig(
        hidden_size=t.hidden_size,
        intermediate_size=intermediate_size or 3 * t.hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=t.num_attention_heads,
        num_key_value_heads=t.num_key_value_heads,
        head_dim=t.head_dim,
        vocab_size=t.vocab_size,
        block_size=block_size,
        target_layer_ids=target_layer_ids or default_taps(t.num_hidden_layers),
        mask_token_id=mask_token_id,
        target_hidden_size=t.hidden_size,
        rms_norm_eps=t.rms_norm_eps,
        rope_theta=t.rope_theta,
    )


# ---------------------------------------------------------------------------------------------
# Forward passes and losses


def _cast(tree, dtype):
    return jax.tree_util.tree_map(lambda x: x.astype(dtype), tree)


def target_loss(params, config: TargetConfig, tokens, compute_dtype=jnp.float32):
    """Mean next-token cross-entropy (nats) of windows tokens [b, T+1] through the cache-free forward."""
    target = Target(params=_cast(params, compute_dtype), config=config)
    inputs = tokens[:, :-1]
    lengths = jnp.full((inputs.shape[0],), inputs.shape[1], jnp.int32)
    logits, *_ = prefill_layers(target, inputs, lengths, (), "ref")
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def target_hidden(target: Target, tokens, taps):
    """The frozen target's forward on tokens [b, T]: (logits [b, T, V] f32, tapped hidden [b, T, n_taps, d])."""
    lengths = jnp.full((tokens.shape[0],), tokens.shape[1], jnp.int32)
    logits, hidden, _, _ = prefill_layers(target, tokens, lengths, tuple(taps), "ref")
    return jax.lax.stop_gradient(logits), jax.lax.stop_gradient(hidden)


def _block_attention(q, k_ctx, v_ctx, k_blk, v_blk, ctx_mask):
    """q [b, N, B, Hq, D]; context k, v [b, T, KVH, D]; block k, v [b, N, B, KVH, D]; ctx_mask
    [b, N, T] -> o [b, N, B, Hq, D] in q.dtype. Every query sees the unmasked context and the whole
    block (the math of ops.attention._attend: GQA, D^-1/2, float32 softmax)."""
    b, n, blk, hq, d = q.shape
    kvh = k_ctx.shape[2]
    f32 = jnp.float32
    qg = q.astype(f32).reshape(b, n, blk, kvh, hq // kvh, d)
    scale = d**-0.5
    s_ctx = jnp.einsum("bnqgrd,btgd->bngrqt", qg, k_ctx.astype(f32), precision=HIGHEST) * scale
    s_blk = jnp.einsum("bnqgrd,bnkgd->bngrqk", qg, k_blk.astype(f32), precision=HIGHEST) * scale
    s_ctx = jnp.where(ctx_mask[:, :, None, None, None, :], s_ctx, -jnp.inf)
    probs = jax.nn.softmax(jnp.concatenate([s_ctx, s_blk], axis=-1), axis=-1)
    t = k_ctx.shape[1]
    o = jnp.einsum("bngrqt,btgd->bnqgrd", probs[..., :t], v_ctx.astype(f32), precision=HIGHEST) + jnp.einsum(
        "bngrqk,bnkgd->bnqgrd", probs[..., t:], v_blk.astype(f32), precision=HIGHEST
    )
    return o.reshape(b, n, blk, hq, d).astype(q.dtype)


def draft_block_logits(draft: Draft, target: Target, hidden, tokens, anchors):
    """The DFlash training forward: every block of every sequence in one pass.

    hidden [b, T, n_taps, Dt] (target taps of tokens [b, T]), anchors [b, N] int32 in [1, T - B]
    -> logits [b, N, B - 1, vocab] float32: block n of sequence i is [tokens[i, a], MASK x (B-1)]
    at positions a..a+B-1 (a = anchors[i, n]) attending to the context at positions < a (and
    >= a - context_window when the config has one) and to the whole block; row k - 1 is the
    prediction for token a + k. Equals `dflash.propose` after `write_context` of positions < a.
    """
    p, c = draft.params, draft.config
    b, t = tokens.shape
    blk = c.block_size
    ctx = dense(hidden.reshape(b, t, -1).astype(p["fc"].dtype), p["fc"])
    ctx = rms_norm_plain(ctx, p["hidden_norm"], c.rms_norm_eps)  # [b, T, d]
    ctx_pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    offs = jnp.arange(blk)
    anchor_tok = jnp.take_along_axis(tokens, anchors, axis=1)  # [b, N]
    blk_tokens = jnp.where(offs == 0, anchor_tok[..., None], c.mask_token_id).astype(tokens.dtype)
    x = target.params["embed"][blk_tokens].astype(p["fc"].dtype)  # [b, N, B, d]
    positions = anchors[..., None] + offs  # [b, N, B]
    key_pos = jnp.arange(t)
    ctx_mask = key_pos < anchors[..., None]  # [b, N, T]
    if c.context_window:
        ctx_mask &= key_pos >= anchors[..., None] - c.context_window
    for layer in p["layers"]:
        a = layer["attn"]
        xn = rms_norm_plain(x, layer["input_norm"], c.rms_norm_eps)
        q = dense(xn, a["q"]).reshape(xn.shape[:3] + (c.num_attention_heads, c.head_dim))
        q = apply_rope(rms_norm_plain(q, a["q_norm"], c.rms_norm_eps), positions, c.head_dim, c.rope_theta)
        k_blk, v_blk = key_values(a, c, xn, positions)
        k_ctx, v_ctx = key_values(a, c, ctx, ctx_pos)
        o = _block_attention(q, k_ctx, v_ctx, k_blk, v_blk, ctx_mask)
        x = x + dense(o.reshape(o.shape[:3] + (-1,)), a["o"])
        x = x + swiglu_mlp(layer["mlp"], rms_norm_plain(x, layer["post_norm"], c.rms_norm_eps))
    x = rms_norm_plain(x[:, :, 1:], p["norm"], c.rms_norm_eps)
    return head_logits(x, lm_head(target))


def position_weights(block_size: int, gamma: float):
    """Loss weight exp(-(k-1)/gamma) of block position k = 1..B-1."""
    return jnp.exp(-jnp.arange(block_size - 1, dtype=jnp.float32) / gamma)


def block_labels(tokens, anchors, block_size):
    """tokens[i, a + k] for k = 1..B-1: [b, N, B-1]."""
    idx = anchors[..., None] + jnp.arange(1, block_size)
    return jnp.take_along_axis(tokens[:, None, :], idx, axis=2)


def block_target_probs(target_logits, anchors, block_size):
    """The target's distribution of token a + k given the corpus prefix up to a + k - 1, for
    k = 1..B-1: softmax(target_logits[i, a + k - 1]) (temperature 1) -> [b, N, B-1, V] float32.
    target_logits [b, T, V] are the frozen target's logits of the teacher-forced window
    (`target_hidden`); position t holds its prediction of token t + 1."""
    idx = anchors[..., None] + jnp.arange(block_size - 1)  # [b, N, B-1]: the position before a + k
    rows = jax.vmap(lambda lg, i: lg[i])(target_logits, idx)  # [b, N, B-1, V]
    return jax.nn.softmax(rows.astype(jnp.float32), axis=-1)


def block_loss(logits, tokens, anchors, gamma, labels="data", target_logits=None):
    """Position-weighted mean cross-entropy (nats) of draft block logits [b, N, B-1, V] (row k - 1
    predicts token a + k): sum_k w_k ce_k / sum_k w_k averaged over blocks, w_k = exp(-(k-1)/gamma).

    labels: "data", ce against the corpus token a + k (`block_labels`); "target", ce against the
    frozen target's distribution `block_target_probs` (needs target_logits [b, T, V]); "mix", the
    mean of the two, which (ce being linear in the label distribution) is ce against
    0.5 one-hot(data) + 0.5 target distribution."""
    if labels not in LABEL_MODES:
        raise ValueError(f"labels={labels!r}: must be one of {LABEL_MODES}")
    if labels != "data" and target_logits is None:
        raise ValueError(f"labels={labels!r} needs the target's logits")
    blk = logits.shape[2] + 1
    logits = logits.astype(jnp.float32)
    ce = 0.0
    if labels in ("data", "mix"):
        ce_data = optax.softmax_cross_entropy_with_integer_labels(logits, block_labels(tokens, anchors, blk))
        ce = ce + (0.5 if labels == "mix" else 1.0) * ce_data
    if labels in ("target", "mix"):
        ce_target = optax.softmax_cross_entropy(logits, block_target_probs(target_logits, anchors, blk))
        ce = ce + (0.5 if labels == "mix" else 1.0) * ce_target
    w = position_weights(blk, gamma)
    return jnp.mean(jnp.sum(ce * w, axis=-1) / jnp.sum(w))


def draft_loss(draft_params, draft_config, target, hidden, tokens, anchors, gamma, labels="data", target_logits=None):
    """`block_loss` of the draft's training forward over all blocks (nats); target_logits: the
    first output of `target_hidden` on the same tokens (needed unless labels == "data")."""
    logits = draft_block_logits(Draft(params=draft_params, config=draft_config), target, hidden, tokens, anchors)
    return block_loss(logits, tokens, anchors, gamma, labels, target_logits)


def sample_anchors(rng: np.random.Generator, batch: int, seq_len: int, block_size: int, num: int) -> np.ndarray:
    """[batch, num] int32 distinct anchors per row, uniform in [1, seq_len - block_size]."""
    hi = seq_len - block_size  # a + B - 1 <= T - 1
    if num > hi:
        raise ValueError(f"anchors_per_seq={num}: at most seq_len - block_size = {hi} distinct anchors fit")
    return (np.argsort(rng.random((batch, hi)), axis=1)[:, :num] + 1).astype(np.int32)


# ---------------------------------------------------------------------------------------------
# Optimiser, checkpoints, metrics


def _optimizer(weight_decay, grad_clip, decay_mask):
    """AdamW without its learning rate: the step multiplies the update by -learning_rate(...), so the
    schedule can follow wall time under a time limit."""
    return optax.chain(
        optax.clip_by_global_norm(grad_clip),
        optax.scale_by_adam(b1=0.9, b2=0.95),
        optax.add_decayed_weights(weight_decay, mask=decay_mask),
    )


def learning_rate(step: int, progress: float, peak: float, warmup: int) -> float:
    """Linear warm-up over `warmup` steps, times a cosine from peak to peak / 10 over progress in
    [0, 1] (the fraction of the step budget or of the time limit used, whichever is larger)."""
    ramp = min(1.0, step / warmup) if warmup else 1.0
    return peak * ramp * (0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, progress))))


def _apply(params, updates, lr):
    return jax.tree.map(lambda p, u: (p - lr * u).astype(p.dtype), params, updates)


def _decay_mask(params, skip=("embed",)):
    """Weight decay on matrices only, never on norms, gates, biases or the embedding."""

    def keep(path, x):
        names = {getattr(k, "key", None) for k in path}
        return x.ndim >= 2 and not names & set(skip)

    return jax.tree_util.tree_map_with_path(keep, params)


def check_out_dir(out_dir) -> None:
    """Raise ValueError if `out_dir` holds safetensors files a checkpoint loader would mix with ours."""
    if out_dir is None or not os.path.isdir(out_dir):
        if out_dir is not None and os.path.exists(out_dir):
            raise ValueError(f"out_dir={os.fspath(out_dir)!r}: exists and is not a directory")
        return
    others = sorted(
        f
        for f in os.listdir(out_dir)
        if f == "model.safetensors.index.json" or (f.endswith(".safetensors") and f != "model.safetensors")
    )
    if others:
        raise ValueError(f"out_dir={os.fspath(out_dir)!r}: already holds {others}; use a clean directory")


def _save_dir(out_dir, write):
    """Run write(tmp) into a scratch directory, then move its files into out_dir (a crash mid-write
    leaves the previous checkpoint intact)."""
    os.makedirs(out_dir, exist_ok=True)
    tmp = os.path.join(out_dir, ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    write(tmp)
    for f in os.listdir(tmp):
        os.replace(os.path.join(tmp, f), os.path.join(out_dir, f))
    os.rmdir(tmp)


def save_target(out_dir, params, config: TargetConfig, dtype="float32"):
    """HF-layout checkpoint (config.json + model.safetensors) with params cast to `dtype`."""
    cast = jax.device_get(_cast(params, jnp.dtype(dtype)))
    _save_dir(out_dir, lambda tmp: save_params(tmp, cast, config))


def save_draft_checkpoint(out_dir, params, config: DraftConfig, dtype="float32"):
    cast = jax.device_get(_cast(params, jnp.dtype(dtype)))
    _save_dir(out_dir, lambda tmp: dflash.save_draft(tmp, Draft(params=cast, config=config)))


def _write_metrics(out_dir, metrics, title):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=2)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # plotting is an optional extra
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    # a draft trained on other labels than the data's plots the held-out loss of its own labels
    labels = metrics["recipe"].get("labels", "data")
    held = {
        "data": lambda r: r["loss"],
        "target": lambda r: r["loss_target"],
        "mix": lambda r: 0.5 * (r["loss"] + r["loss_target"]),
    }[labels]
    suffix = "" if labels == "data" else f" (labels: {labels})"
    if metrics["train"]:
        ax.plot([r["step"] for r in metrics["train"]], [r["loss"] for r in metrics["train"]], label="train" + suffix)
    if metrics["eval"]:
        steps = [r["step"] for r in metrics["eval"]]
        ax.plot(steps, [held(r) for r in metrics["eval"]], "o-", label="held-out" + suffix)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "loss_curve.png"), dpi=120)
    plt.close(fig)


def _progress(total, enabled, desc):
    from tqdm.auto import tqdm

    return tqdm(total=total, disable=not enabled, desc=desc, unit="step", dynamic_ncols=True)


def _n_params(params):
    return int(sum(x.size for x in jax.tree_util.tree_leaves(params)))


class _Clock:
    """Training throughput that leaves out the first step (compilation) and evaluation time."""

    def __init__(self, now=time.perf_counter):
        self.now = now
        self.t0, self.excluded, self.steps, self.compile_s = None, 0.0, 0, float("nan")

    def first_step_done(self):
        self.t0, self.excluded = self.now(), 0.0  # evaluations before this are not excluded

    def rate(self, tokens_per_step):
        """Tokens per second over the steps after the first; None before there are any."""
        if self.t0 is None or self.steps == 0:
            return None
        return self.steps * tokens_per_step / max(self.now() - self.t0 - self.excluded, 1e-9)


def _loop(
    *,
    steps,
    step_fn,
    batch_fn,
    eval_fn,
    eval_every,
    log_every,
    tokens_per_step,
    save_fn,
    progress,
    desc,
    train_log,
    eval_log,
    time_limit=None,
    lr=1.0,
    warmup=0,
    now=time.perf_counter,
):
    """The shared training loop. step_fn(batch, learning_rate) -> (loss, grad_norm) device scalars,
    the rate from `learning_rate(step, progress, lr, warmup)`, progress the larger of step / steps
    and elapsed / time_limit (so under a time limit the cosine ends when the time does); eval_fn() ->
    dict of floats (with "loss"); save_fn(step) writes a checkpoint. Appends to train_log (the mean
    loss and gradient norm over each log_every steps) and eval_log. After time_limit seconds (if
    given) the step in hand is the last: evaluated and saved like the final one. `now` () -> seconds
    is the clock (tests pass a fake one). Returns the clock, whose last_step is the step training
    ended at."""
    pending = []
    clock = _Clock(now)
    bar = _progress(steps, progress, desc)
    t_begin = now()
    last_eval = None
    for step in range(1, steps + 1):
        done = step / steps if time_limit is None else max(step / steps, (now() - t_begin) / time_limit)
        rate = learning_rate(step, done, lr, warmup)
        pending.append(step_fn(batch_fn(), np.float32(rate)))
        if step == 1:
            jax.block_until_ready(pending[-1])
            clock.first_step_done()
            clock.compile_s = now() - t_begin
        else:
            clock.steps += 1
        last = step == steps or (time_limit is not None and now() - t_begin > time_limit)
        if step % log_every == 0 or last:
            losses, gnorms = np.asarray(jax.device_get(pending), np.float64).T
            pending = []
            train_log.append(
                {
                    "step": step,
                    "loss": float(losses.mean()),
                    "grad_norm": float(gnorms.mean()),
                    "lr": rate,
                    "elapsed_s": round(now() - t_begin, 3),
                }
            )
            post = {"loss": f"{losses.mean():.3f}", "tok/s": f"{clock.rate(tokens_per_step) or 0:.3g}"}
            if last_eval is not None:
                post["held_out"] = f"{last_eval['loss']:.3f}"
            bar.set_postfix(post, refresh=False)
        if (eval_every and step % eval_every == 0) or last:
            jax.block_until_ready(pending)  # training steps in flight are not evaluation time
            t_eval = now()
            last_eval = {"step": step, **eval_fn()}
            eval_log.append(last_eval)
            save_fn(step)
            clock.excluded += now() - t_eval
            bar.write(
                f"step {step}: held-out "
                + ", ".join(f"{k} {v:.4g}" for k, v in last_eval.items() if k != "step" and isinstance(v, float)),
                file=sys.stderr,
            )
        bar.update(1)
        if last:
            break
    bar.close()
    clock.last_step = step
    if step < steps:
        print(f"{desc}: stopped at step {step} of {steps} by the time limit ({time_limit} s)", file=sys.stderr)
    return clock


def _check_args(dtypes, **values):
    """Positive ints, and the (name, value) pairs of `dtypes` in float32 / bfloat16."""
    for name, v in values.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name}={v!r}: must be a positive int")
    for name, v in dtypes.items():
        if v not in ("float32", "bfloat16"):
            raise ValueError(f"{name}={v!r}: must be 'float32' or 'bfloat16'")


# ---------------------------------------------------------------------------------------------
# Training entry points


def train_target(
    config: TargetConfig | None = None,
    *,
    steps: int = 2000,
    batch: int = 32,
    seq_len: int = 512,
    lr: float = 2e-3,
    warmup: int = 100,
    weight_decay: float = 0.1,
    grad_clip: float = 1.0,
    out_dir=None,
    eval_every: int = 200,
    eval_batches: int = 8,
    log_every: int = 10,
    seed: int = 0,
    save_dtype: str = "float32",
    compute_dtype: str = "float32",
    corpus: tuple | None = None,
    corpus_root=None,
    progress: bool = True,
    time_limit: float | None = None,
):
    """Train a target from scratch on the corpus; returns (Target with float32 params, metrics dict).

    config: default `tiny_target_config()`. Windows of seq_len + 1 tokens give seq_len
    predictions each; a step sees batch * seq_len tokens. lr peaks after `warmup` steps and decays
    (cosine) to lr / 10 at `steps`. Every eval_every steps (and at the end) the held-out loss,
    perplexity and bits per byte are measured on eval_batches fixed batches and, with out_dir, the
    checkpoint (save_dtype) and metrics.json / loss_curve.png are written there. corpus: a
    (train, held_out) pair of `Corpus` (default `load_corpus(corpus_root)`). time_limit: seconds
    after which training stops early (evaluated and saved); the cosine decay then follows the
    elapsed fraction of time_limit when that runs ahead of step / steps.
    metrics: recipe, config, corpus, "train" (mean loss / grad norm per log_every steps), "eval",
    tokens_per_s (after the first step, evaluation excluded), compile_s (the first step), last_step.
    """
    config = config or tiny_target_config()
    _check_args(
        {"save_dtype": save_dtype, "compute_dtype": compute_dtype},
        steps=steps,
        batch=batch,
        seq_len=seq_len,
        eval_batches=eval_batches,
        log_every=log_every,
    )
    if seq_len > config.max_position_embeddings:
        raise ValueError(f"seq_len={seq_len}: must be <= max_position_embeddings={config.max_position_embeddings}")
    if config.vocab_size < VOCAB_SIZE:
        raise ValueError(f"TargetConfig.vocab_size={config.vocab_size}: the byte corpus needs >= {VOCAB_SIZE}")
    check_out_dir(out_dir)
    compute = jnp.dtype(compute_dtype)
    train_corpus, held_out = corpus or load_corpus(corpus_root)
    recipe = {
        "kind": "target",
        "steps": steps,
        "batch": batch,
        "seq_len": seq_len,
        "lr": lr,
        "warmup": warmup,
        "weight_decay": weight_decay,
        "grad_clip": grad_clip,
        "eval_every": eval_every,
        "eval_batches": eval_batches,
        "seed": seed,
        "save_dtype": save_dtype,
        "compute_dtype": compute_dtype,
        "time_limit": time_limit,
    }

    params = init_target(config, jax.random.PRNGKey(seed)).params
    tx = _optimizer(weight_decay, grad_clip, _decay_mask(params))
    opt_state = tx.init(params)
    loss_fn = lambda p, tokens: target_loss(p, config, tokens, compute)

    @jax.jit
    def eval_loss(p, tokens):
        return loss_fn(p, tokens)

    def step(p, s, tokens, rate):
        loss, grads = jax.value_and_grad(loss_fn)(p, tokens)
        updates, s = tx.update(grads, s, p)
        return _apply(p, updates, rate), s, loss, optax.tree.norm(grads)

    step = jax.jit(step, donate_argnums=(0, 1))
    rng = np.random.default_rng(seed)
    eval_set = held_out.fixed_batches(eval_batches, batch, seq_len + 1)
    state = {"params": params, "opt": opt_state}

    def step_fn(tokens, rate):
        state["params"], state["opt"], loss, gnorm = step(state["params"], state["opt"], tokens, rate)
        return loss, gnorm

    def eval_fn():
        loss = float(np.mean([float(eval_loss(state["params"], jnp.asarray(b))) for b in eval_set]))
        return {"loss": loss, "perplexity": math.exp(loss), "bits_per_byte": loss / math.log(2)}

    train_log, eval_log = [], []
    metrics = {
        "recipe": recipe,
        "config": config.to_hf(),
        "params": _n_params(params),
        "corpus": corpus_stats(train_corpus, held_out),
        "device": str(jax.devices()[0]),
        "train": train_log,
        "eval": eval_log,
    }
    title = "tiny target (byte-level GDN hybrid)"

    def save_fn(step_no):
        if out_dir is not None:
            save_target(out_dir, state["params"], config, save_dtype)
            _write_metrics(out_dir, {**metrics, "last_step": step_no}, title)

    def batch_fn():
        return jnp.asarray(train_corpus.sample(rng, batch, seq_len + 1))

    clock = _loop(
        steps=steps,
        step_fn=step_fn,
        batch_fn=batch_fn,
        eval_fn=eval_fn,
        eval_every=eval_every,
        log_every=log_every,
        tokens_per_step=batch * seq_len,
        save_fn=save_fn,
        progress=progress,
        desc="train target",
        train_log=train_log,
        eval_log=eval_log,
        time_limit=time_limit,
        lr=lr,
        warmup=warmup,
    )
    metrics.update(tokens_per_s=clock.rate(batch * seq_len), compile_s=clock.compile_s, last_step=clock.last_step)
    if out_dir is not None:
        _write_metrics(out_dir, metrics, title)
    return Target(params=state["params"], config=config), metrics


def draft_eval_metrics(draft_params, draft_config, target, tokens, anchors, gamma):
    """Held-out numbers of one batch, the same whatever labels the draft trained on: the weighted
    loss against the data ("loss") and against the target's distribution ("loss_target", the
    `block_loss` of labels "data" and "target"), per-position accuracy against the data, and
    acceptance-length estimates (1 + the expected run of correct leading drafts) against the
    data and against the target's greedy prediction on the data prefix (teacher forced, so an
    estimate of greedy-decoding acceptance, not a measurement)."""
    logits_t, hidden = target_hidden(target, tokens, draft_config.target_layer_ids)
    draft = Draft(params=draft_params, config=draft_config)
    logits = draft_block_logits(draft, target, hidden, tokens, anchors)
    blk = draft_config.block_size
    labels = block_labels(tokens, anchors, blk)
    pred = jnp.argmax(logits, axis=-1)
    correct = pred == labels  # [b, N, B-1]
    greedy = jnp.argmax(logits_t, axis=-1)  # target's next token at each position
    idx = anchors[..., None] + jnp.arange(blk - 1)  # prediction at a+k-1 is for a+k
    agree = pred == jnp.take_along_axis(greedy[:, None, :], idx, axis=2)
    run = lambda ok: 1.0 + jnp.mean(jnp.sum(jnp.cumprod(ok.astype(jnp.float32), axis=-1), axis=-1))
    return {
        "loss": block_loss(logits, tokens, anchors, gamma, "data"),
        "loss_target": block_loss(logits, tokens, anchors, gamma, "target", logits_t),
        "accuracy_per_position": jnp.mean(correct, axis=(0, 1)),
        "accept_len_data": run(correct),
        "accept_len_target": run(agree),
    }


def train_draft(
    target: Target,
    draft_config: DraftConfig | None = None,
    *,
    steps: int = 2000,
    batch: int = 32,
    seq_len: int = 512,
    anchors_per_seq: int = 16,
    gamma: float = 4.0,
    lr: float = 2e-3,
    warmup: int = 100,
    weight_decay: float = 0.1,
    grad_clip: float = 1.0,
    out_dir=None,
    eval_every: int = 200,
    eval_batches: int = 8,
    log_every: int = 10,
    seed: int = 0,
    save_dtype: str = "float32",
    compute_dtype: str = "float32",
    corpus: tuple | None = None,
    corpus_root=None,
    progress: bool = True,
    target_path: str | None = None,
    time_limit: float | None = None,
    labels: str = "data",
    init: Draft | None = None,
    init_path: str | None = None,
):
    """Train a DFlash draft against the frozen `target`; returns (Draft with float32 params, metrics).

    draft_config: default `tiny_draft_config(target.config)`, or init's. init: a draft whose
    weights training starts from (continuing a time-limited run, fine-tuning; its config is the
    draft's, and a draft_config given too must equal it); init_path, where it came from, goes
    into the recipe. The optimizer state and the learning-rate schedule start afresh.
    Each step: windows [batch, seq_len], the target's taps and logits, `anchors_per_seq`
    distinct anchors per window, the loss of `draft_loss` (block position k weighted
    exp(-(k-1)/gamma)). labels (`LABEL_MODES`, recorded in the recipe): what block position k
    learns, "data" the corpus token a + k, "target" the frozen target's distribution at position
    a + k - 1 (distillation: speculative acceptance is agreement with the target), "mix" the
    mean of the two losses (`block_loss`). Held-out evaluation is the same for every labels
    mode: both losses, per-position accuracy and
    acceptance-length estimates (`draft_eval_metrics`). Other arguments as `train_target`.
    """
    tc = target.config
    if init is not None:
        if draft_config is not None and draft_config != init.config:
            raise ValueError(f"init: its config {init.config} differs from draft_config {draft_config}")
        draft_config = init.config
    draft_config = draft_config or tiny_draft_config(tc)
    c = draft_config
    _check_args(
        {"save_dtype": save_dtype, "compute_dtype": compute_dtype},
        steps=steps,
        batch=batch,
        seq_len=seq_len,
        anchors_per_seq=anchors_per_seq,
        eval_batches=eval_batches,
        log_every=log_every,
    )
    if c.hidden_size != tc.hidden_size or c.vocab_size != tc.vocab_size or c.target_hidden_size != tc.hidden_size:
        raise ValueError(
            f"DraftConfig hidden_size/vocab_size/target_hidden_size {c.hidden_size}/{c.vocab_size}/"
            f"{c.target_hidden_size} must match the target's {tc.hidden_size}/{tc.vocab_size}/"
            f"{tc.hidden_size} (shared embedding and lm_head)"
        )
    if max(c.target_layer_ids) >= tc.num_hidden_layers:
        raise ValueError(
            f"DraftConfig.target_layer_ids={c.target_layer_ids}: the target has {tc.num_hidden_layers} layers"
        )
    if not gamma > 0:
        raise ValueError(f"gamma={gamma!r}: must be > 0")
    if labels not in LABEL_MODES:
        raise ValueError(f"labels={labels!r}: must be one of {LABEL_MODES}")
    if seq_len > tc.max_position_embeddings:
        raise ValueError(f"seq_len={seq_len}: must be <= max_position_embeddings={tc.max_position_embeddings}")
    rng = np.random.default_rng(seed)
    sample_anchors(rng, 1, seq_len, c.block_size, anchors_per_seq)  # validates the counts early
    check_out_dir(out_dir)
    compute = jnp.dtype(compute_dtype)
    train_corpus, held_out = corpus or load_corpus(corpus_root)
    recipe = {
        "kind": "draft",
        "target": target_path,
        "steps": steps,
        "batch": batch,
        "seq_len": seq_len,
        "anchors_per_seq": anchors_per_seq,
        "gamma": gamma,
        "labels": labels,
        "lr": lr,
        "warmup": warmup,
        "weight_decay": weight_decay,
        "grad_clip": grad_clip,
        "eval_every": eval_every,
        "eval_batches": eval_batches,
        "seed": seed,
        "save_dtype": save_dtype,
        "compute_dtype": compute_dtype,
        "time_limit": time_limit,
        "init": init_path if init is not None else None,
    }

    frozen = Target(params=_cast(target.params, compute), config=tc)
    params = dflash.init_draft(c, jax.random.PRNGKey(seed)).params if init is None else _cast(init.params, jnp.float32)
    tx = _optimizer(weight_decay, grad_clip, _decay_mask(params, skip=()))
    opt_state = tx.init(params)
    taps = c.target_layer_ids

    def loss_fn(p, tgt, tokens, anchors):
        logits_t, hidden = target_hidden(tgt, tokens, taps)  # logits_t unused (dead code) for "data"
        return draft_loss(_cast(p, compute), c, tgt, hidden, tokens, anchors, gamma, labels, logits_t)

    def step(p, s, tgt, tokens, anchors, rate):
        loss, grads = jax.value_and_grad(loss_fn)(p, tgt, tokens, anchors)
        updates, s = tx.update(grads, s, p)
        return _apply(p, updates, rate), s, loss, optax.tree.norm(grads)

    step = jax.jit(step, donate_argnums=(0, 1))
    eval_step = jax.jit(
        lambda p, tgt, tokens, anchors: draft_eval_metrics(_cast(p, compute), c, tgt, tokens, anchors, gamma)
    )
    eval_rng = np.random.default_rng(EVAL_SEED)
    eval_set = [
        (jnp.asarray(b), jnp.asarray(sample_anchors(eval_rng, batch, seq_len, c.block_size, anchors_per_seq)))
        for b in held_out.fixed_batches(eval_batches, batch, seq_len)
    ]
    state = {"params": params, "opt": opt_state}

    def step_fn(data, rate):
        state["params"], state["opt"], loss, gnorm = step(state["params"], state["opt"], frozen, *data, rate)
        return loss, gnorm

    def batch_fn():
        tokens = train_corpus.sample(rng, batch, seq_len)
        return jnp.asarray(tokens), jnp.asarray(sample_anchors(rng, batch, seq_len, c.block_size, anchors_per_seq))

    def eval_fn():
        out = [jax.device_get(eval_step(state["params"], frozen, *b)) for b in eval_set]
        mean = {k: np.mean([o[k] for o in out], axis=0) for k in out[0]}
        return {
            "loss": float(mean["loss"]),
            "loss_target": float(mean["loss_target"]),
            "accept_len_data": float(mean["accept_len_data"]),
            "accept_len_target": float(mean["accept_len_target"]),
            "accuracy_per_position": [round(float(x), 4) for x in mean["accuracy_per_position"]],
        }

    train_log, eval_log = [], []
    metrics = {
        "recipe": recipe,
        "config": c.to_hf(),
        "params": _n_params(params),
        "corpus": corpus_stats(train_corpus, held_out),
        "device": str(jax.devices()[0]),
        "train": train_log,
        "eval": eval_log,
    }
    title = f"DFlash draft (block {c.block_size}, taps {list(c.target_layer_ids)})"

    def save_fn(step_no):
        if out_dir is not None:
            save_draft_checkpoint(out_dir, state["params"], c, save_dtype)
            _write_metrics(out_dir, {**metrics, "last_step": step_no}, title)

    clock = _loop(
        steps=steps,
        step_fn=step_fn,
        batch_fn=batch_fn,
        eval_fn=eval_fn,
        eval_every=eval_every,
        log_every=log_every,
        tokens_per_step=batch * seq_len,
        save_fn=save_fn,
        progress=progress,
        desc="train draft",
        train_log=train_log,
        eval_log=eval_log,
        time_limit=time_limit,
        lr=lr,
        warmup=warmup,
    )
    metrics.update(
        tokens_per_s=clock.rate(batch * seq_len),
        draft_positions_per_step=batch * anchors_per_seq * (c.block_size - 1),
        compile_s=clock.compile_s,
        last_step=clock.last_step,
    )
    if out_dir is not None:
        _write_metrics(out_dir, metrics, title)
    return Draft(params=state["params"], config=c), metrics
