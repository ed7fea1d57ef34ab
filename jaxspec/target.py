"""The GDN-hybrid target (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) as pure, jittable functions.

    prefill(target, cache, tokens [B, T], lengths [B], slots [B])        whole prompts into slots
    verify(target, cache, tokens [N], query_start_loc [B+1], slots [B])  a packed window per request
    commit(cache, slots [B], num_accepted [B])                           a + 1 window tokens enter

The window of request r is [anchor, draft_1, ..., draft_{len_r - 1}]: the anchor is the token
emitted last step, not yet in the state. verify writes ring records, the saved conv row and the
window's K/V but never the SSM checkpoint; commit advances cursors, folds and slices the conv row.
All three take the cache and return a new one (donate it under jit). `taps` is a static tuple of
layer indices whose output hidden states are returned for the draft.
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxspec.cache import CacheState
from jaxspec.config import TargetConfig
from jaxspec.fused import fuse_layer, fused_widths, split_columns
from jaxspec.ops import attention, conv, gdn, moe, packing
from jaxspec.ops.linear import dense, head_logits, swiglu_mlp
from jaxspec.ops.norms import gated_rms_norm, rms_norm
from jaxspec.ops.rope import apply_rope
from jaxspec.weights import load_config, load_params, param_shapes


@struct.dataclass
class Target:
    """Parameters (layout: jaxspec.weights) and the static config of a target model.

    qkv_groups: the GDN conv channels (qkv columns, conv rows, conv state) are ordered as
    qkv_groups consecutive groups [q_i | k_i | v_i], group i holding the i-th qkv_groups-th of the
    key and value heads: 1 is the checkpoint's order [q | k | v]; a tensor-parallel target
    (jaxspec.parallel.shard_target) has one group per device, so a device's channels are contiguous.
    """

    params: dict
    config: TargetConfig = struct.field(pytree_node=False)
    qkv_groups: int = struct.field(pytree_node=False, default=1)

    @property
    def dtype(self):
        return self.params["embed"].dtype


def load_target(path, dtype=jnp.float32, *, stacked=False, fused=True) -> Target:
    """A target from an HF-layout directory (config.json + *.safetensors), params in `dtype`;
    stacked=True: the layers as stacked groups (`stack_layers`), stacked leaf by leaf as loaded;
    fused (default): each layer's same-input projections as one matrix (`jaxspec.fused`:
    fewer, larger GEMMs; False keeps the checkpoint's separate matrices)."""
    config = load_config(path)
    target = Target(params=load_params(path, config, dtype), config=config)
    return _maybe_stacked(_maybe_fused(target, fused), stacked)


def init_target(config: TargetConfig, key, dtype=jnp.float32, *, stacked=False, fused=False) -> Target:
    """Random params: matrices N(0, 1/fan_in) (stacked experts [E, in, out] per expert), zero-centred
    norm weights 0, the GDN output norm 1, conv taps N(0, 1/W), A_log = log U(1, 16), dt_bias 0.
    stacked=True: the layers as stacked groups (`stack_layers`; the same values); fused=True: the
    same-input projections as one matrix each (`jaxspec.fused`, as `load_target` does)."""
    shapes = param_shapes(config)
    paths, tree = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(key, len(paths))

    # No name may hold the leaves past the tree: fusing and stacking drop each separate leaf as its
    # replacement is made, and a list of them kept here would hold every projection twice.
    params = jax.tree_util.tree_unflatten(
        tree, [_init_leaf(k, _leaf_kind(p), s, dtype) for (p, s), k in zip(paths, keys)]
    )
    return _maybe_stacked(_maybe_fused(Target(params=params, config=config), fused), stacked)


def _leaf_kind(path) -> str:
    """Which initialiser `init_target` gives the leaf at `path`."""
    name = jax.tree_util.keystr(path[-1:])
    if name == "['A_log']":
        return "A_log"
    if name == "['norm']" and path[-2:-1] and jax.tree_util.keystr(path[-2:-1]) == "['gdn']":
        return "ones"
    return "conv" if name == "['conv']" else "matrix"


@partial(jax.jit, static_argnums=(1, 2, 3))
def _init_leaf(key, kind: str, shape: tuple, dtype):
    """One random leaf, drawn in float32 and cast inside one program: only the `dtype` result reaches
    device memory. (Drawn op by op, each leaf's float32 draw is a buffer of its own, and asynchronous
    dispatch lets the draws of many leaves be alive at once: at 27B scale that overran an 80 GB GPU.)"""
    if kind == "A_log":
        leaf = jnp.log(jax.random.uniform(key, shape, minval=1.0, maxval=16.0))
    elif kind == "ones":
        leaf = jnp.ones(shape)
    elif len(shape) == 1:
        leaf = jnp.zeros(shape)
    else:
        leaf = jax.random.normal(key, shape) * shape[-1 if kind == "conv" else -2] ** -0.5
    return leaf.astype(dtype)


def _maybe_fused(target: Target, fuse: bool) -> Target:
    """`target` with fused projections when asked, a layer at a time (the separate matrices of a
    layer are dropped as its fused ones are made: one layer's input projections held twice at most)."""
    if not fuse:
        return target
    params = dict(target.params)
    layers, params["layers"] = params["layers"], []
    while layers:
        params["layers"].append(fuse_layer(layers.pop(0)))
    return target.replace(params=params)


def _maybe_stacked(target: Target, stacked: bool) -> Target:
    """`target` as stacked groups when asked, consuming its own per-layer list (one leaf held twice
    at most)."""
    if not stacked:
        return target
    params = dict(target.params)
    params["layer_groups"] = _stack_positions(params.pop("layers"), layer_period(target.config))
    return target.replace(params=params)


def lm_head(target: Target):
    """The output projection [d, vocab] (the transposed embedding when tied)."""
    params = target.params
    return params["embed"].T if target.config.tie_word_embeddings else params["lm_head"]


def _logits(target, x):
    x = rms_norm(x, target.params["norm"], target.config.rms_norm_eps)
    return head_logits(x, lm_head(target))


# ---------------------------------------------------------------------------------------------
# GDN sublayer pieces shared by prefill and verify ([...] = any leading token axes)


def _gdn_in(p, cfg, x):
    """x [..., d] -> raw conv inputs qkv [..., C], z [..., HV, V], g and beta [..., HV]."""
    hv, vd = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    if "in_proj" in p:
        qkv, a, b, z = split_columns(dense(x, p["in_proj"]), fused_widths("gdn", p, cfg))
    else:
        qkv, a, b, z = (dense(x, p[name]) for name in ("qkv", "a", "b", "z"))
    g, beta = gdn.gating(a, b, p["A_log"], p["dt_bias"])
    return qkv, z.reshape(x.shape[:-1] + (hv, vd)), g, beta


def _gdn_split(cfg, y, groups):
    """Conv output [..., C] in `groups` groups (Target.qkv_groups) -> q̂ [..., H, K] (l2norm,
    K^-1/2), k̂ [..., H, K], v [..., HV, V]."""
    h, kd = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    lead = y.shape[:-1]
    if groups == 1:
        q, k, v = jnp.split(y, [h * kd, 2 * h * kd], axis=-1)
    else:
        y = y.reshape(lead + (groups, -1))  # [..., groups, C / groups]
        parts = jnp.split(y, [h * kd // groups, 2 * h * kd // groups], axis=-1)
        q, k, v = (part.reshape(lead + (-1,)) for part in parts)
    q = gdn.l2norm(q.reshape(lead + (h, kd))) * kd**-0.5
    k = gdn.l2norm(k.reshape(lead + (h, kd)))
    return q, k, v.reshape(lead + (cfg.linear_num_value_heads, cfg.linear_value_head_dim))


def _gdn_out(p, cfg, o, z, dtype):
    """o [..., HV, V] float32, z [..., HV, V] -> out_proj(RMSNorm(o) * silu(z)) [..., d]."""
    y = gated_rms_norm(o.astype(dtype), z, p["norm"], cfg.rms_norm_eps)
    return dense(y.reshape(y.shape[:-2] + (-1,)), p["out"])


def _attn_in(p, cfg, x, positions):
    """x [..., d] -> q [..., Hq, D] (normed, rotary), gate [..., Hq, D], k [..., KVH, D] (normed, rotary), v."""
    lead, D = x.shape[:-1], cfg.head_dim
    if "in_proj" in p:
        qg, k, v = split_columns(dense(x, p["in_proj"]), fused_widths("attn", p, cfg))
    else:
        qg, k, v = (dense(x, p[name]) for name in ("q", "k", "v"))
    qg = qg.reshape(lead + (cfg.num_attention_heads, 2 * D))
    q, gate = qg[..., :D], qg[..., D:]
    k = k.reshape(lead + (cfg.num_key_value_heads, D))
    v = v.reshape(lead + (cfg.num_key_value_heads, D))
    q = apply_rope(rms_norm(q, p["q_norm"], cfg.rms_norm_eps), positions, cfg.rotary_dim, cfg.rope_theta)
    k = apply_rope(rms_norm(k, p["k_norm"], cfg.rms_norm_eps), positions, cfg.rotary_dim, cfg.rope_theta)
    return q, gate, k, v


def _attn_out(p, o, gate):
    o = o * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(o.dtype)
    return dense(o.reshape(o.shape[:-2] + (-1,)), p["o"])


def _block(layer, cfg, x, mixer, valid, impl):
    """Pre-norm residual block: x + mixer(norm(x)), then x + mlp(norm(x)); the MLP is the sparse
    mixture-of-experts block in a MoE layer, where rows with valid [...] False route to no expert."""
    x = x + mixer(rms_norm(x, layer["input_norm"], cfg.rms_norm_eps))
    xn = rms_norm(x, layer["post_norm"], cfg.rms_norm_eps)
    if "moe" in layer:
        top_k, norm = cfg.num_experts_per_tok, cfg.norm_topk_prob
        return x + moe.sparse_moe_block(layer["moe"], xn, valid, top_k=top_k, norm_topk_prob=norm, impl=impl)
    return x + swiglu_mlp(layer["mlp"], xn)


# ---------------------------------------------------------------------------------------------
# Layer groups: the layers as G groups of P positions (Qwen3.5: 3 GDN layers then 1 attention
# layer, G = L / 4). A per-layer list (the default) runs as a Python loop over the groups calling
# one jitted group function with the group index as data: it is traced and lowered once (the 27B
# shape's 64-layer step lowers in 3 s instead of 24 on the CPU, its module 2.9 MB instead of 30),
# and XLA inlines the G calls, so the compiled program still holds one copy of the layer code per
# group. Stacked groups run as one lax.scan, one group in the program whatever G is. On the CPU the
# scan compiles 64 layers 4-7x faster; on the GPU, XLA copies each group's weights out of the
# stack before its GEMMs, so a step reads the weights three times (bench/RESULTS.md: 16 layers,
# 2.3x the list's step time) and compiles about as fast.


def layer_period(config: TargetConfig) -> int:
    """The smallest P dividing the layer count with layer i of the same kind as layer i % P (mixer
    type, and dense MLP or mixture of experts)."""
    kinds = [(t, config.is_moe(i)) for i, t in enumerate(config.layer_types)]
    n = len(kinds)
    return next(p for p in range(1, n + 1) if n % p == 0 and all(kinds[i] == kinds[i % p] for i in range(n)))


def _stack_positions(layers: list, period: int) -> tuple:
    """A list of per-layer dicts -> a tuple of `period` dicts whose leaves are stacked over the
    groups [G, ...] (layer g*period + j at index g of position j). Empties `layers` as it goes, so a
    caller that owns the list holds at most one stacked leaf twice."""
    flat = []
    for i, layer in enumerate(layers):
        flat.append(jax.tree_util.tree_flatten(layer))
        layers[i] = None
    groups = []
    for j in range(period):
        members = [leaves for leaves, _ in flat[j::period]]
        stacked = []
        for n in range(len(members[0])):
            stacked.append(jnp.stack([leaves[n] for leaves in members]))
            for leaves in members:
                leaves[n] = None
        groups.append(jax.tree_util.tree_unflatten(flat[j][1], stacked))
    return tuple(groups)


def stack_layers(target: Target) -> Target:
    """The same model with params["layers"] (a list of L per-layer dicts) replaced by
    params["layer_groups"]: a tuple of P = layer_period dicts whose leaves are stacked over the
    G = L / P groups [G, ...] (layer g*P + j at index g of position j). prefill and verify then run
    the layers as one scan. The target passed in keeps its list: drop it to free that memory."""
    if "layer_groups" in target.params:
        return target
    return _maybe_stacked(target.replace(params={**target.params, "layers": list(target.params["layers"])}), True)


def unstack_layers(target: Target) -> Target:
    """The inverse of stack_layers: params["layers"] as a list of per-layer dicts (slices)."""
    if "layers" in target.params:
        return target
    params = dict(target.params)
    groups = params.pop("layer_groups")
    num_groups = target.config.num_hidden_layers // len(groups)
    params["layers"] = [jax.tree.map(lambda x, g=g: x[g], group) for g in range(num_groups) for group in groups]
    return target.replace(params=params)


def _over_groups(target, body, carry):
    """carry, ys = body(carry, g, group) for every layer group g, where group is a tuple of P layer
    dicts (layer g*P + j at position j) and g an int32 scalar (per-layer list: a jitted call per
    group, one trace; stacked: one lax.scan). Returns the last carry and ys stacked over the groups
    [G, ...]."""
    params, cfg = target.params, target.config
    if "layer_groups" in params:
        groups = params["layer_groups"]
        num_groups = cfg.num_hidden_layers // len(groups)
        return jax.lax.scan(lambda c, xs: body(c, *xs), carry, (jnp.arange(num_groups, dtype=jnp.int32), groups))
    period = layer_period(cfg)
    layers, outputs = params["layers"], []
    group_step = jax.jit(body)  # traced and lowered once for all groups: the group index is data
    for g in range(len(layers) // period):
        carry, y = group_step(carry, jnp.int32(g), tuple(layers[g * period : (g + 1) * period]))
        outputs.append(y)
    return carry, jax.tree.map(lambda *ys: jnp.stack(ys), *outputs)


def _group_layout(cfg, period):
    """Per position j of a group: its mixer type and its index among the group's layers of that
    type; and the group's counts of GDN and attention layers."""
    kinds = cfg.layer_types[:period]
    rank = [kinds[:j].count(kinds[j]) for j in range(period)]
    return kinds, rank, kinds.count("linear_attention"), kinds.count("full_attention")


def _tap_writer(taps, num_layers, period):
    """(n_taps, write): write(hidden, x, g, j) sets row r of hidden [n_taps + 1, ...] to x when
    layer g*P + j is the r-th tapped layer (taps in layer order). With g an int (the per-layer
    loop) other layers write nothing; with g traced (the scan) they write the spare last row, and
    positions j that no group taps write nothing."""
    taps = sorted(set(taps))
    row_of_layer = np.full(num_layers, len(taps), np.int32)
    row_of_layer[taps] = np.arange(len(taps), dtype=np.int32)
    tapped_positions = {i % period for i in taps}

    def write(hidden, x, g, j):
        if j not in tapped_positions:
            return hidden
        if isinstance(g, int):
            row = int(row_of_layer[g * period + j])
            return hidden if row == len(taps) else hidden.at[row].set(x.astype(hidden.dtype))
        row = jnp.asarray(row_of_layer)[g * period + j]
        return jax.lax.dynamic_update_index_in_dim(hidden, x.astype(hidden.dtype), row, 0)

    return len(taps), write


# ---------------------------------------------------------------------------------------------
# Prefill


def _prefill_run(target: Target, tokens, lengths, taps, impl, logits_at, states, write_gdn, write_attn):
    """The layers over whole sequences; each layer's states go into `states` as it makes them.

    states: a dict of arrays carried through the layers; write_gdn(states, gi, conv_state, h) and
    write_attn(states, ai, k, v) return it with GDN layer gi's / attention layer ai's states put in
    (gi, ai: the layer's index among its kind, a traced scalar). -> (logits, tapped hidden
    [B, T, n_taps, d], states). Writing into the carry, not stacking the layers' outputs, keeps
    one copy of the states: at 27B shapes and batch 32 the 48 layers' h are 2.4 GB in bf16."""
    params, cfg = target.params, target.config
    period = layer_period(cfg)
    kinds, rank, num_gdn, num_attn = _group_layout(cfg, period)
    n_taps, write_tap = _tap_writer(taps, cfg.num_hidden_layers, period)
    x = params["embed"][tokens]
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    valid = positions < lengths[:, None]  # [B, T]

    def body(carry, g, group):
        x, states, hidden = carry
        box = [states]
        for j, layer in enumerate(group):
            if kinds[j] == "linear_attention":

                def mixer(xn, p=layer["gdn"], gi=g * num_gdn + rank[j]):
                    qkv, z, g_, beta = _gdn_in(p, cfg, xn)
                    y, conv_state = conv.conv_prefill(qkv, p["conv"], lengths, impl=impl)
                    q, k, v = _gdn_split(cfg, y, target.qkv_groups)
                    h0 = jnp.zeros(v.shape[:1] + (v.shape[2], q.shape[-1], v.shape[-1]), jnp.float32)
                    o, h = gdn.gdn_chunked(q, k, v, g_, beta, h0, lengths, impl=impl)
                    box[0] = write_gdn(box[0], gi, conv_state, h)
                    return _gdn_out(p, cfg, o, z, xn.dtype)
            else:

                def mixer(xn, p=layer["attn"], ai=g * num_attn + rank[j]):
                    q, gate, k, v = _attn_in(p, cfg, xn, positions)
                    box[0] = write_attn(box[0], ai, k, v)
                    return _attn_out(p, attention.attention_prefill(q, k, v, lengths, impl=impl), gate)

            x = _block(layer, cfg, x, mixer, valid, impl)
            hidden = write_tap(hidden, x, g, j)
        return (x, box[0], hidden), None

    hidden = jnp.zeros((n_taps + 1,) + x.shape, x.dtype)
    (x, states, hidden), _ = _over_groups(target, body, (x, states, hidden))
    if logits_at is not None:
        x = jnp.take_along_axis(x, logits_at[:, None, None], axis=1)[:, 0]  # [B, d]
    return _logits(target, x), jnp.moveaxis(hidden[:n_taps], 0, 2), states


def prefill_layers(target: Target, tokens, lengths, taps, impl, *, logits_at=None):
    """Whole sequences, no cache. tokens [B, T], lengths [B] -> (logits [B, T, vocab] f32, tapped
    hidden [B, T, n_taps, d], GDN states (conv_state [Lg, B, W-1, C], h [Lg, B, HV, K, V] f32) and
    attention (k, v) [La, B, T, KVH, D], layers in model order).

    logits_at [B] int32: the logits of those positions alone, [B, vocab] (the lm_head then reads B
    rows, not B x T: at 27B shapes [B, T, vocab] in float32 is gigabytes)."""
    cfg = target.config
    b, t = tokens.shape
    num_gdn = cfg.layer_types.count("linear_attention")
    num_attn = cfg.num_hidden_layers - num_gdn
    hv, kd, vd = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    dtype = target.params["embed"].dtype
    states = dict(
        conv_state=jnp.zeros((num_gdn, b, cfg.linear_conv_kernel_dim - 1, cfg.conv_dim), dtype),
        h=jnp.zeros((num_gdn, b, hv, kd, vd), jnp.float32),
        k=jnp.zeros((num_attn, b, t, cfg.num_key_value_heads, cfg.head_dim), dtype),
        v=jnp.zeros((num_attn, b, t, cfg.num_key_value_heads, cfg.head_dim), dtype),
    )
    put = lambda a, i, x: jax.lax.dynamic_update_index_in_dim(a, x.astype(a.dtype), i, 0)

    def write_gdn(s, gi, conv_state, h):
        return dict(s, conv_state=put(s["conv_state"], gi, conv_state), h=put(s["h"], gi, h))

    def write_attn(s, ai, k, v):
        return dict(s, k=put(s["k"], ai, k), v=put(s["v"], ai, v))

    logits, hidden, s = _prefill_run(target, tokens, lengths, taps, impl, logits_at, states, write_gdn, write_attn)
    return logits, hidden, (s["conv_state"], s["h"]), (s["k"], s["v"])


def prefill(target: Target, cache: CacheState, tokens, lengths, slots, taps=(), *, impl="auto", last_logits=False):
    """Put whole prompts into their slots. tokens [B, T] int32 (rows padded past lengths[b]),
    lengths [B], slots [B] (0 = padding row) -> (logits [B, T, vocab] f32, hidden [B, T, n_taps, d], cache);
    last_logits=True: the logits of each row's last prompt position alone, [B, vocab].

    Each slot gets its SSM checkpoint, conv state and K/V at positions 0..len-1; write_pos = 0,
    seq_len = len. Requires T <= cache max_len. Each layer writes its states into the cache as it
    makes them, in the cache's dtypes: no stack over the layers is held.
    """
    rows = jnp.where(slots > 0, slots, cache.seq_len.shape[0])  # [B]; out of range: dropped
    t = tokens.shape[1]
    keep = jnp.arange(t)[None, :] < lengths[:, None]
    at = (jnp.where(keep, rows[:, None], cache.seq_len.shape[0]), jnp.arange(t)[None, :])  # [B, T] each

    def write_gdn(s, gi, conv_state, h):
        return dict(
            s,
            ckpt=s["ckpt"].at[gi, rows].set(h.astype(s["ckpt"].dtype), mode="drop"),
            conv_state=s["conv_state"].at[gi, rows].set(conv_state.astype(s["conv_state"].dtype), mode="drop"),
        )

    def write_attn(s, ai, k, v):
        return dict(
            s,
            k_cache=s["k_cache"].at[(ai,) + at].set(k.astype(s["k_cache"].dtype), mode="drop"),
            v_cache=s["v_cache"].at[(ai,) + at].set(v.astype(s["v_cache"].dtype), mode="drop"),
        )

    states = {f: getattr(cache, f) for f in ("ckpt", "conv_state", "k_cache", "v_cache")}
    logits_at = lengths - 1 if last_logits else None
    logits, hidden, states = _prefill_run(target, tokens, lengths, taps, impl, logits_at, states, write_gdn, write_attn)
    cache = cache.replace(
        **states,
        write_pos=packing.scatter_slots(cache.write_pos, slots, jnp.zeros_like(slots)),
        seq_len=packing.scatter_slots(cache.seq_len, slots, lengths),
    )
    return logits, hidden, cache


@partial(jax.jit, static_argnames=("impl",))
def _target_logits(target, ids, impl):
    logits, *_ = prefill_layers(target, ids[None], jnp.array([ids.shape[0]], jnp.int32), (), impl)
    return logits[0]


def target_logits(target: Target, ids, *, impl="auto"):
    """Causal logits [len(ids), vocab] float32 of one sequence, no cache."""
    ids = jnp.asarray(ids, jnp.int32)
    if ids.ndim != 1 or ids.shape[0] == 0:
        raise ValueError(f"ids: expected a non-empty 1-D sequence of token ids, got shape {ids.shape}")
    return _target_logits(target, ids, impl)


# ---------------------------------------------------------------------------------------------
# Verify and commit


def verify(target: Target, cache: CacheState, tokens, query_start_loc, slots, taps=(), *, impl="auto"):
    """Run packed windows on top of each slot's state. tokens [N] int32, query_start_loc [B+1]
    (each window <= cache window), slots [B] -> (logits [N, vocab] f32, hidden [N, n_taps, d], cache).

    Window token t of request r sits at position seq_len[slot] + t. Writes ring records at
    write_pos + t, the saved conv row and K/V at seq_len + t; never the checkpoint. Padding rows
    (>= query_start_loc[B]) and slot-0 requests write nothing; their logits are garbage-free but
    meaningless. With fold policy `every` the ring holds no live record between steps (prefill and
    every commit leave write_pos at 0), so the windows start from the checkpoint alone.
    """
    params, cfg = target.params, target.config
    t_max = cache.config.window
    ring_empty = cache.config.fold_policy == "every"
    period = layer_period(cfg)
    kinds, rank, num_gdn, num_attn = _group_layout(cfg, period)
    n_taps, write_tap = _tap_writer(taps, cfg.num_hidden_layers, period)
    request, pos, in_window = packing.packed_index(query_start_loc, tokens.shape[0])
    positions = cache.seq_len[slots[request]] + pos
    valid = in_window & (slots[request] > 0)  # [N]
    x = params["embed"][tokens]
    written = ("ring_k", "ring_u", "ring_g", "conv_window", "k_cache", "v_cache")

    def body(carry, g, group):
        x, state, hidden = carry
        state = dict(state)
        for j, layer in enumerate(group):
            if kinds[j] == "linear_attention":

                def mixer(xn, p=layer["gdn"], gi=g * num_gdn + rank[j]):
                    qkv, z, g_, beta = _gdn_in(p, cfg, xn)
                    y, state["conv_window"] = conv.conv_verify(
                        qkv,
                        cache.conv_state,
                        state["conv_window"],
                        p["conv"],
                        query_start_loc,
                        slots,
                        layer=gi,
                        impl=impl,
                    )
                    q, k, v = _gdn_split(cfg, y, target.qkv_groups)
                    o, state["ring_k"], state["ring_u"], state["ring_g"] = gdn.gdn_verify(
                        q,
                        k,
                        v,
                        g_,
                        beta,
                        cache.ckpt,
                        state["ring_k"],
                        state["ring_u"],
                        state["ring_g"],
                        cache.write_pos,
                        query_start_loc,
                        slots,
                        t_max,
                        layer=gi,
                        ring_empty=ring_empty,
                        impl=impl,
                    )
                    return _gdn_out(p, cfg, o, z, xn.dtype)
            else:

                def mixer(xn, p=layer["attn"], ai=g * num_attn + rank[j]):
                    q, gate, k, v = _attn_in(p, cfg, xn, positions)
                    state["k_cache"], state["v_cache"] = attention.kv_write(
                        state["k_cache"], state["v_cache"], k, v, cache.seq_len, query_start_loc, slots, layer=ai
                    )
                    o = attention.attention_verify(
                        q,
                        state["k_cache"],
                        state["v_cache"],
                        cache.seq_len,
                        query_start_loc,
                        slots,
                        t_max,
                        layer=ai,
                        impl=impl,
                    )
                    return _attn_out(p, o, gate)

            x = _block(layer, cfg, x, mixer, valid, impl)
            hidden = write_tap(hidden, x, g, j)
        return (x, state, hidden), None

    carry = (x, {f: getattr(cache, f) for f in written}, jnp.zeros((n_taps + 1,) + x.shape, x.dtype))
    (x, state, hidden), _ = _over_groups(target, body, carry)
    return _logits(target, x), jnp.moveaxis(hidden[:n_taps], 0, 1), cache.replace(**state)


def commit(cache: CacheState, slots, num_accepted, *, impl="auto"):
    """After acceptance: a = num_accepted[r] drafts of request r were accepted, so its anchor and
    a drafts (a + 1 tokens) enter the state. slots [B] (0 = padding row), num_accepted [B] int32.

    Cursors advance by a + 1; fold policy `every` folds all live records and resets the cursor,
    `lazy` folds only slots whose next window might not fit (write_pos + window > ring_len); the
    conv state becomes rows a+1.. of the saved row; seq_len += a + 1.
    """
    cfg = cache.config
    real = slots > 0
    advance = jnp.where(real, num_accepted + 1, 0)
    live = cache.write_pos.at[jnp.where(real, slots, cache.write_pos.shape[0])].add(advance, mode="drop")
    if cfg.fold_policy == "every":
        fold = jnp.ones_like(live, bool)
    else:
        fold = live + cfg.window > cfg.ring_len
    num_records = jnp.where(fold, live, 0)
    bound = cfg.window if cfg.fold_policy == "every" else None  # every: at most one window is live
    ckpt = gdn.gdn_fold(cache.ckpt, cache.ring_k, cache.ring_u, cache.ring_g, num_records, max_records=bound, impl=impl)
    conv_state = jax.vmap(lambda s, w: conv.conv_commit(s, w, slots, num_accepted, impl=impl))(
        cache.conv_state, cache.conv_window
    )
    seq_len = cache.seq_len.at[jnp.where(real, slots, cache.seq_len.shape[0])].add(advance, mode="drop")
    return cache.replace(ckpt=ckpt, conv_state=conv_state, write_pos=jnp.where(fold, 0, live), seq_len=seq_len)
