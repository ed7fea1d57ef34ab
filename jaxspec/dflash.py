"""The DFlash block-diffusion draft (docs/design.md section 5): one parallel forward proposes a block.

Target hidden states of `target_layer_ids` are concatenated, projected by `fc` and normalised
into the draft's context; every draft layer projects that context to K/V, cached per slot at the
context's positions (committed tokens only). The block [anchor, MASK x (B-1)] attends to all the
cached context and bidirectionally to itself; the target's embed_tokens and lm_head are shared.

Params (matrices for `x @ W`; d = hidden, n = len(target_layer_ids), Dt = target hidden):
```
{"fc": [n*Dt, d], "hidden_norm": [d], "norm": [d],
 "layers": [{"input_norm": [d], "post_norm": [d],
             "attn": {"q": [d, Hq*D], "k": [d, KVH*D], "v": [d, KVH*D], "o": [Hq*D, d],
                      "q_norm": [D], "k_norm": [D]},
             "mlp": {"gate": [d, I], "up": [d, I], "down": [I, d]}}]}
```
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from safetensors.numpy import save_file

from jaxspec.config import DraftConfig
from jaxspec.ops import attention
from jaxspec.ops.linear import dense, head_logits, swiglu_mlp
from jaxspec.ops.norms import rms_norm_plain
from jaxspec.ops.rope import apply_rope
from jaxspec.target import Target, lm_head
from jaxspec.weights import Checkpoint, FiniteCheck

_LAYER_TENSORS = {  # param path inside a layer -> HF name suffix, and whether it is a linear
    ("input_norm",): ("input_layernorm.weight", False),
    ("post_norm",): ("post_attention_layernorm.weight", False),
    ("attn", "q"): ("self_attn.q_proj.weight", True),
    ("attn", "k"): ("self_attn.k_proj.weight", True),
    ("attn", "v"): ("self_attn.v_proj.weight", True),
    ("attn", "o"): ("self_attn.o_proj.weight", True),
    ("attn", "q_norm"): ("self_attn.q_norm.weight", False),
    ("attn", "k_norm"): ("self_attn.k_norm.weight", False),
    ("mlp", "gate"): ("mlp.gate_proj.weight", True),
    ("mlp", "up"): ("mlp.up_proj.weight", True),
    ("mlp", "down"): ("mlp.down_proj.weight", True),
}
_TOP_TENSORS = {
    ("fc",): ("fc.weight", True),
    ("hidden_norm",): ("hidden_norm.weight", False),
    ("norm",): ("norm.weight", False),
}


@struct.dataclass
class Draft:
    params: dict
    config: DraftConfig = struct.field(pytree_node=False)


@struct.dataclass
class DraftState:
    """Context K/V per draft layer: ctx_k, ctx_v [L_draft, S1, max_len + block_size, KVH, D].
    Positions below the target's seq_len of a slot are valid; `propose` writes its block's own K/V
    just past them (scratch); the rest is garbage that later writes overwrite."""

    ctx_k: jnp.ndarray
    ctx_v: jnp.ndarray


def param_shapes(c: DraftConfig) -> dict:
    d, D, I = c.hidden_size, c.head_dim, c.intermediate_size
    layer = {
        "input_norm": (d,),
        "post_norm": (d,),
        "attn": {
            "q": (d, c.num_attention_heads * D),
            "k": (d, c.num_key_value_heads * D),
            "v": (d, c.num_key_value_heads * D),
            "o": (c.num_attention_heads * D, d),
            "q_norm": (D,),
            "k_norm": (D,),
        },
        "mlp": {"gate": (d, I), "up": (d, I), "down": (I, d)},
    }
    return {
        "fc": (len(c.target_layer_ids) * c.target_hidden_size, d),
        "hidden_norm": (d,),
        "norm": (d,),
        "layers": [layer for _ in range(c.num_hidden_layers)],
    }


def init_draft(config: DraftConfig, key, dtype=jnp.float32) -> Draft:
    """Random params: matrices N(0, 1/fan_in), norm weights 1."""
    shapes = param_shapes(config)
    leaves, tree = jax.tree_util.tree_flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(key, len(leaves))
    make = lambda s, k: jnp.ones(s, dtype) if len(s) == 1 else (jax.random.normal(k, s) * s[0] ** -0.5).astype(dtype)
    return Draft(params=jax.tree_util.tree_unflatten(tree, [make(s, k) for s, k in zip(leaves, keys)]), config=config)


def _tensors(config: DraftConfig):
    """(param path, HF name, is_linear) for every tensor."""
    out = [(p, n, lin) for p, (n, lin) in _TOP_TENSORS.items()]
    for i in range(config.num_hidden_layers):
        out += [(("layers", i) + p, f"layers.{i}.{n}", lin) for p, (n, lin) in _LAYER_TENSORS.items()]
    return out


def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def load_draft(path, target: Target, dtype=None) -> Draft:
    """A DFlash draft directory (config.json + *.safetensors) checked against its target.

    Errors name the file or tensor: ValueError for a config that does not fit the target, an
    unreadable file, a tensor of the wrong shape or one holding NaN or inf; KeyError for a missing
    tensor (as `jaxspec.weights.load_params`).
    """
    config = DraftConfig.from_json(os.path.join(path, "config.json"), target.config.hidden_size)
    tc = target.config
    if config.vocab_size != tc.vocab_size or config.hidden_size != tc.hidden_size:
        raise ValueError(
            f"draft {path}: vocab_size/hidden_size {config.vocab_size}/{config.hidden_size} must "
            f"match the target's {tc.vocab_size}/{tc.hidden_size} (shared embedding and lm_head)"
        )
    if max(config.target_layer_ids) >= tc.num_hidden_layers:
        raise ValueError(
            f"draft {path}: DraftConfig.target_layer_ids={config.target_layer_ids}: the target has "
            f"{tc.num_hidden_layers} layers"
        )
    dtype = target.dtype if dtype is None else jnp.dtype(dtype)
    ckpt, shapes = Checkpoint(path), param_shapes(config)
    finite = FiniteCheck(ckpt)
    params = jax.tree_util.tree_map(lambda s: None, shapes, is_leaf=lambda x: isinstance(x, tuple))
    for p, name, linear in _tensors(config):
        shape = _get(shapes, p)
        x = jnp.asarray(ckpt.read(name, shape[::-1] if linear else shape))
        finite.add(name, x)
        parent = _get(params, p[:-1])
        parent[p[-1]] = (x.T if linear else x).astype(dtype)
    finite.check()
    return Draft(params=params, config=config)


def save_draft(path, draft: Draft) -> None:
    """Write config.json + model.safetensors in the DFlash HF layout."""
    os.makedirs(path, exist_ok=True)
    tensors = {}
    for p, name, linear in _tensors(draft.config):
        x = np.asarray(_get(draft.params, p))
        tensors[name] = np.ascontiguousarray(x.T) if linear else x
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(draft.config.to_hf(), f, indent=2)


def init_state(config: DraftConfig, num_slots: int, max_len: int, dtype) -> DraftState:
    """Zero context caches for `num_slots` slots of up to `max_len` committed tokens (and the block
    past them)."""
    shape = (
        config.num_hidden_layers,
        num_slots + 1,
        max_len + config.block_size,
        config.num_key_value_heads,
        config.head_dim,
    )
    return DraftState(ctx_k=jnp.zeros(shape, dtype), ctx_v=jnp.zeros(shape, dtype))


def write_context(draft: Draft, state: DraftState, hidden, positions, slot_of_row, valid) -> DraftState:
    """Project target hidden taps into every layer's context K/V and cache them.

    hidden [R, n_taps, Dt] (rows: tokens), positions [R], slot_of_row [R], valid [R] (False rows and
    slot 0 write nothing).
    """
    p, c = draft.params, draft.config
    ctx = dense(hidden.reshape(hidden.shape[0], -1).astype(p["fc"].dtype), p["fc"])
    ctx = rms_norm_plain(ctx, p["hidden_norm"], c.rms_norm_eps)
    rows = jnp.where(valid & (slot_of_row > 0), slot_of_row, state.ctx_k.shape[1])
    ks, vs = [], []
    for layer in p["layers"]:
        k, v = key_values(layer["attn"], c, ctx, positions)
        ks.append(k)
        vs.append(v)
    at = (slice(None), rows, positions)
    return DraftState(
        ctx_k=state.ctx_k.at[at].set(jnp.stack(ks).astype(state.ctx_k.dtype), mode="drop"),
        ctx_v=state.ctx_v.at[at].set(jnp.stack(vs).astype(state.ctx_v.dtype), mode="drop"),
    )


def key_values(a, c, x, positions):
    """A draft layer's keys and values of hidden states x [..., d] at `positions` [...]: attention
    params `a`, DraftConfig `c` -> (k, v) [..., KVH, D]; k is normed and rotated."""
    lead = x.shape[:-1]
    k = dense(x, a["k"]).reshape(lead + (c.num_key_value_heads, c.head_dim))
    k = apply_rope(rms_norm_plain(k, a["k_norm"], c.rms_norm_eps), positions, c.head_dim, c.rope_theta)
    return k, dense(x, a["v"]).reshape(lead + (c.num_key_value_heads, c.head_dim))


def shared_head(target: Target) -> Target:
    """The part of `target` a draft reads: its embedding and (unless tied) lm_head, as a Target
    with the same config (what `propose` needs, two arrays instead of every layer's)."""
    params = {k: v for k, v in target.params.items() if k in ("embed", "lm_head")}
    return Target(params=params, config=target.config, qkv_groups=target.qkv_groups)


def propose(draft: Draft, target: Target, state: DraftState, anchors, slots, ctx_len, *, block_size=None, impl="auto"):
    """Draft logits for one block per request.

    anchors [B] int32 (the last emitted token, at position ctx_len), slots [B], ctx_len [B] (the
    slot's committed tokens = target seq_len) -> (logits [B, blk - 1, vocab] float32 for the
    positions after the anchor, state with the block's K/V written past each slot's context).
    block_size: None (the draft's own block) or a shorter static blk: the forward then runs
    [anchor, MASK x (blk - 1)] only, so its mask positions attend to fewer masks than in training.
    """
    p, c = draft.params, draft.config
    blk = c.block_size if block_size is None else block_size
    if not 2 <= blk <= c.block_size:
        raise ValueError(f"block_size: {blk} is not in 2..{c.block_size} (the draft's block)")
    tokens = jnp.concatenate(
        [anchors[:, None], jnp.full((anchors.shape[0], blk - 1), c.mask_token_id, anchors.dtype)], 1
    )
    x = target.params["embed"][tokens].astype(p["fc"].dtype)  # [B, blk, d]
    positions = ctx_len[:, None] + jnp.arange(blk)[None, :]
    ctx_k, ctx_v = state.ctx_k, state.ctx_v
    for li, layer in enumerate(p["layers"]):
        a = layer["attn"]
        xn = rms_norm_plain(x, layer["input_norm"], c.rms_norm_eps)
        q = dense(xn, a["q"]).reshape(xn.shape[:2] + (c.num_attention_heads, c.head_dim))
        q = apply_rope(rms_norm_plain(q, a["q_norm"], c.rms_norm_eps), positions, c.head_dim, c.rope_theta)
        k, v = key_values(a, c, xn, positions)
        o, ctx_k, ctx_v = attention.attention_block(
            q, ctx_k, ctx_v, ctx_len, slots, k, v, c.context_window, layer=li, impl=impl
        )
        x = x + dense(o.reshape(o.shape[:2] + (-1,)), a["o"])
        x = x + swiglu_mlp(layer["mlp"], rms_norm_plain(x, layer["post_norm"], c.rms_norm_eps))
    x = rms_norm_plain(x[:, 1:], p["norm"], c.rms_norm_eps)
    logits = head_logits(x, lm_head(target))
    return logits, DraftState(ctx_k=ctx_k, ctx_v=ctx_v)
