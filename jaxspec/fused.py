"""A layer's projections that read the same input, as one matrix: one GEMM instead of two to four.

At decode sizes (1-8 rows) every projection is a separate matrix-vector product whose kernel has
fixed costs (launch, a grid too small for the GPU, a tail), and XLA's dot merger, where it fires,
concatenates the weights again at every call. Concatenated once along the output axis, they run as
one product over the same bytes (bench/RESULTS.md, H200, 16 layers of bf16 at batch 1: the
Qwen3.5-35B-A3B shape's GDN input 40.5 -> 16.9 µs a layer, its MoE input 18.9 -> 8.1; the 27B
shape's GDN input 47.0 -> 41.3, attention input 47.3 -> 37.0, MLP input 86.6 -> 81.9).

Fused keys of a layer (jaxspec.weights layout otherwise; the parts in this order along the last axis):

    gdn  "in_proj"  [d, C + 2 HV + HV V] = [qkv | a | b | z]        (qkv: C = 2 H K + HV V)
    attn "in_proj"  [d, 2 Hq D + 2 KVH D] = [q | k | v]             (q holds the output gate)
    mlp  "gate_up"  [d, 2 I]              = [gate | up]
    moe  "in_proj"  [d, E + 1 + 2 Is]     = [router | shared_gate | shared gate | shared up]
                                            (the shared expert keeps its "down")

The layer code (jaxspec.target, ops.moe, ops.linear.swiglu_mlp) reads either form; `load_target`
fuses by default, `init_target` on request. A tensor-parallel split (jaxspec.parallel) and the
checkpoint writers take the separate form (`unfuse_projections`).
"""

import itertools

import jax.numpy as jnp

from jaxspec.config import TargetConfig

# sublayer -> (fused key, the separate parts as key paths inside the sublayer)
PARTS = {
    "gdn": ("in_proj", (("qkv",), ("a",), ("b",), ("z",))),
    "attn": ("in_proj", (("q",), ("k",), ("v",))),
    "mlp": ("gate_up", (("gate",), ("up",))),
    "moe": ("in_proj", (("router",), ("shared_gate",), ("shared", "gate"), ("shared", "up"))),
}


def fused_widths(sublayer: str, p: dict, config: TargetConfig) -> tuple[int, ...]:
    """Column counts of the parts of `sublayer`'s fused matrix (PARTS order), from the config and
    the separate params' shapes that fusing keeps (the MLP's and the shared expert's down)."""
    c = config
    if sublayer == "gdn":
        hv_v = c.linear_num_value_heads * c.linear_value_head_dim
        qkv = 2 * c.linear_num_key_heads * c.linear_key_head_dim + hv_v
        return (qkv, c.linear_num_value_heads, c.linear_num_value_heads, hv_v)
    if sublayer == "attn":
        kv = c.num_key_value_heads * c.head_dim
        return (2 * c.num_attention_heads * c.head_dim, kv, kv)
    if sublayer == "mlp":
        return mlp_widths(p)
    if sublayer == "moe":
        return moe_widths(p)
    raise ValueError(f"sublayer: {sublayer!r} is not one of {tuple(PARTS)}")


def mlp_widths(p: dict) -> tuple[int, int]:
    """(I, I) of a SwiGLU MLP's gate_up, from its down [..., I, d]."""
    return (p["down"].shape[-2],) * 2


def moe_widths(p: dict) -> tuple[int, int, int, int]:
    """(E, 1, Is, Is) of a MoE block's in_proj, from its routed gate_up [..., E, d, 2Ie] and its
    shared expert's down [..., Is, d]."""
    inter = p["shared"]["down"].shape[-2]
    return (p["gate_up"].shape[-3], 1, inter, inter)


def split_columns(y, sizes):
    """y [..., sum(sizes)] -> the parts [..., size] in order."""
    return jnp.split(y, list(itertools.accumulate(sizes[:-1])), axis=-1)


def _get(p, path):
    for key in path:
        p = p[key]
    return p


def _fuse_sublayer(name: str, p: dict) -> dict:
    key, parts = PARTS[name]
    if key in p:
        return p
    out = dict(p)
    out[key] = jnp.concatenate([_get(p, part) for part in parts], axis=-1)
    for part in parts:
        if len(part) == 1:
            del out[part[0]]
        else:
            out[part[0]] = {k: v for k, v in out[part[0]].items() if k != part[1]}
    return out


def _unfuse_sublayer(name: str, p: dict, config: TargetConfig) -> dict:
    key, parts = PARTS[name]
    if key not in p:
        return p
    out = {k: v for k, v in p.items() if k != key}
    for part, value in zip(parts, split_columns(p[key], fused_widths(name, p, config))):
        if len(part) == 1:
            out[part[0]] = value
        else:
            out[part[0]] = {**out[part[0]], part[1]: value}
    return out


def _map_layers(params: dict, fn) -> dict:
    params = dict(params)
    if "layers" in params:
        params["layers"] = [fn(layer) for layer in params["layers"]]
    else:
        params["layer_groups"] = tuple(fn(group) for group in params["layer_groups"])
    return params


def fuse_layer(layer: dict) -> dict:
    """One layer's (or stacked group position's) params with its same-input projections
    concatenated (module doc); fused sublayers come back as they are."""
    return {k: _fuse_sublayer(k, v) if k in PARTS else v for k, v in layer.items()}


def fuse_params(params: dict) -> dict:
    """Target params (jaxspec.weights layout: a per-layer list or stacked groups) with every layer
    fused (`fuse_layer`)."""
    return _map_layers(params, fuse_layer)


def unfuse_params(params: dict, config: TargetConfig) -> dict:
    """Inverse of `fuse_params` (exact: the columns are split back); separate ones come back as
    they are."""
    return _map_layers(
        params, lambda layer: {k: _unfuse_sublayer(k, v, config) if k in PARTS else v for k, v in layer.items()}
    )


def fuse_projections(target):
    """A jaxspec.target.Target with fused projections (`fuse_params`)."""
    if target.qkv_groups != 1:
        raise ValueError(f"target: split {target.qkv_groups} ways for tensor parallelism; fuse before splitting")
    return target.replace(params=fuse_params(target.params))


def unfuse_projections(target):
    """A jaxspec.target.Target in the separate form (`unfuse_params`)."""
    return target.replace(params=unfuse_params(target.params, target.config))


def is_fused(params: dict) -> bool:
    """Whether any layer of target `params` holds a fused matrix."""
    layers = params["layers"] if "layers" in params else params["layer_groups"]
    return any(k in PARTS and PARTS[k][0] in v for layer in layers for k, v in layer.items())
