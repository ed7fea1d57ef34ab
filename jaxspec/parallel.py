"""Tensor parallelism: the `tp` mesh, the target's and the device state's shardings (docs/design.md
section 12).

Megatron-style over one mesh axis `tp` of N devices, by JAX's own machinery: parameters and state
carry NamedShardings, XLA's propagation partitions the projections, and the head-local ops run per
device under shard_map (jaxspec.ops.tp). Per layer:
- GDN: the N-th of the key heads with their value heads on each device: qkv columns and conv rows
  regrouped so a device's channels are contiguous (Target.qkv_groups = N), z / a / b columns,
  A_log, dt_bias, the output projection's rows; checkpoint, ring, conv state split by head.
- attention: query heads with their KV head; when N > KVH, each KV head is repeated N / KVH times
  (its k / v columns copied) so every device holds exactly the one it reads.
- MLP: gate / up columns, down rows; mixture-of-experts layers split the shared expert alike and
  keep router and routed experts whole on every device.
- embed rows and lm_head columns split by vocabulary (the top-k merges the N shards' candidates).
Every row-split projection (GDN out, attention o, MLP down) ends in one all-reduce. The draft,
the estimator, the sampling state and every per-slot scalar are replicated: each device computes
the same plan, the same keys and the same acceptance. Several hosts: `jax.distributed.initialize()`
first; `jax.devices()` then lists every host's devices and the same mesh spans them.
"""

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxspec.cache import CacheState
from jaxspec.config import TargetConfig
from jaxspec.fused import unfuse_projections
from jaxspec.ops import tp as tp_ops
from jaxspec.ops.tp import AXIS
from jaxspec.target import Target


def _refusal(field: str, tp, message: str) -> ValueError:
    """The error of a tp the target or the machine cannot take; `field` "" leaves the name out
    (the CLI names its flag itself)."""
    return ValueError(f"{field}={tp!r}: {message}" if field else message)


def check_tp(config: TargetConfig, tp: int, field: str = "SpecConfig.tp") -> None:
    """Raise ValueError naming `field` (and the model field) when the target cannot split over tp
    or fewer than tp devices are visible."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise _refusal(field, tp, "must be an int >= 1")
    c = config
    must_divide = {
        "linear_num_value_heads": c.linear_num_value_heads,
        "num_attention_heads": c.num_attention_heads,
        "vocab_size": c.vocab_size,
    }
    if c.intermediate_size:
        must_divide["intermediate_size"] = c.intermediate_size
    if c.shared_expert_intermediate_size:
        must_divide["shared_expert_intermediate_size"] = c.shared_expert_intermediate_size
    for name, value in must_divide.items():
        if value % tp:
            raise _refusal(field, tp, f"the target's {name}={value} is not divisible by {tp}")
    for name in ("linear_num_key_heads", "num_key_value_heads"):
        value = getattr(c, name)
        if value % tp and tp % value:
            raise _refusal(field, tp, f"the target's {name}={value} neither divides nor is divisible by {tp}")
    _visible_devices(tp, None, field)


def _visible_devices(tp: int, devices, field: str) -> list:
    """`devices` (default: every device of every host), refused when fewer than tp."""
    devices = jax.devices() if devices is None else list(devices)
    if len(devices) < tp:
        raise _refusal(field, tp, f"only {len(devices)} devices are visible")
    return devices


def tp_mesh(tp: int, devices=None, field: str = "SpecConfig.tp") -> jax.sharding.Mesh:
    """A one-axis mesh `tp` over the first tp of `devices` (default: every device of every host)."""
    devices = _visible_devices(tp, devices, field)
    return jax.make_mesh((tp,), (AXIS,), devices=devices[:tp], axis_types=(jax.sharding.AxisType.Auto,))


def split_config(config: TargetConfig, tp: int) -> TargetConfig:
    """The config a tp-way target computes with: key heads / KV heads repeated up to tp when fewer."""
    return dataclasses.replace(
        config,
        linear_num_key_heads=max(config.linear_num_key_heads, tp),
        num_key_value_heads=max(config.num_key_value_heads, tp),
    )


def _repeat_heads(w, heads, repeat, axis):
    """Columns (axis -1) or rows (axis 0) of `heads` equal blocks, each repeated `repeat` times."""
    if repeat == 1:
        return w
    w = jnp.moveaxis(w, axis, 0)
    w = jnp.repeat(w.reshape((heads, -1) + w.shape[1:]), repeat, axis=0).reshape((-1,) + w.shape[1:])
    return jnp.moveaxis(w, 0, axis)


def _group_qkv(w, config: TargetConfig, tp: int, axis: int):
    """qkv columns (axis -1) or conv rows (axis 0) from [q | k | v] to tp groups [q_i | k_i | v_i],
    repeating key heads up to tp first."""
    c = config
    h, kd = c.linear_num_key_heads, c.linear_key_head_dim
    repeat = max(1, tp // h)
    w = jnp.moveaxis(w, axis, 0)
    q, k, v = jnp.split(w, [h * kd, 2 * h * kd], axis=0)
    q, k = (_repeat_heads(x, h, repeat, 0) for x in (q, k))
    parts = [x.reshape((tp, -1) + x.shape[1:]) for x in (q, k, v)]
    return jnp.moveaxis(jnp.concatenate(parts, axis=1).reshape((-1,) + w.shape[1:]), 0, axis)


def _layer_specs(layer: dict) -> dict:
    """PartitionSpecs of one layer's params (leading axes beyond a leaf's own are replicated)."""
    col, row, rep = P(None, AXIS), P(AXIS, None), P()
    rules = {
        ("gdn", "qkv"): col,
        ("gdn", "z"): col,
        ("gdn", "a"): col,
        ("gdn", "b"): col,
        ("gdn", "conv"): row,
        ("gdn", "A_log"): P(AXIS),
        ("gdn", "dt_bias"): P(AXIS),
        ("gdn", "out"): row,
        ("attn", "q"): col,
        ("attn", "k"): col,
        ("attn", "v"): col,
        ("attn", "o"): row,
        ("mlp", "gate"): col,
        ("mlp", "up"): col,
        ("mlp", "down"): row,
        ("moe", "shared", "gate"): col,
        ("moe", "shared", "up"): col,
        ("moe", "shared", "down"): row,
    }

    def spec(path, leaf):
        key = tuple(p.key for p in path)
        own = rules.get(key, rep)
        return P(*((None,) * (leaf.ndim - len(own)) + tuple(own)))

    return jax.tree_util.tree_map_with_path(spec, layer)


def param_specs(target: Target) -> dict:
    """PartitionSpecs of a target's params (a per-layer list or stacked layer groups)."""
    params = target.params
    specs = {"embed": P(AXIS, None), "norm": P()}
    if "lm_head" in params:
        specs["lm_head"] = P(None, AXIS)
    if "layers" in params:
        specs["layers"] = [_layer_specs(layer) for layer in params["layers"]]
    else:
        specs["layer_groups"] = tuple(_layer_specs(group) for group in params["layer_groups"])
    return specs


def shard_target(target: Target, mesh: jax.sharding.Mesh) -> Target:
    """The target split over the mesh's tp axis (module doc): heads repeated and qkv regrouped
    where the layout needs it, then every param placed with its NamedSharding."""
    tp = mesh.shape[AXIS]
    if target.qkv_groups != 1:
        raise ValueError(f"target: already split {target.qkv_groups} ways")
    target = unfuse_projections(target)  # the column split is per separate projection
    config = target.config
    check_tp(config, tp)
    kv_repeat = max(1, tp // config.num_key_value_heads)
    d_head = config.head_dim

    def split_layer(layer):
        layer = dict(layer)
        if "gdn" in layer:
            gdn = dict(layer["gdn"])
            gdn["qkv"] = _group_qkv(gdn["qkv"], config, tp, -1)
            gdn["conv"] = _group_qkv(gdn["conv"], config, tp, -2)
            layer["gdn"] = gdn
        if "attn" in layer and kv_repeat > 1:
            attn = dict(layer["attn"])
            for name in ("k", "v"):
                heads = attn[name].shape[-1] // d_head
                attn[name] = _repeat_heads(attn[name], heads, kv_repeat, -1)
            layer["attn"] = attn
        return layer

    params = dict(target.params)
    if "layers" in params:
        params["layers"] = [split_layer(layer) for layer in params["layers"]]
    else:
        params["layer_groups"] = tuple(split_layer(group) for group in params["layer_groups"])
    split = Target(params=params, config=split_config(config, tp), qkv_groups=tp)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(split))
    return split.replace(params=jax.device_put(split.params, shardings))


_STATE_HEAD_AXIS = {  # CacheState field -> the axis split over tp (the others are replicated)
    "ckpt": -3,
    "ring_k": -3,
    "ring_u": -3,
    "ring_g": -2,
    "conv_state": -1,
    "conv_window": -1,
    "k_cache": -2,
    "v_cache": -2,
}


def cache_specs(cache: CacheState) -> CacheState:
    """PartitionSpecs of a CacheState: the fields of `_STATE_HEAD_AXIS` split by head (or conv
    channel), the per-slot counters replicated."""

    def spec(path, leaf):
        axis = _STATE_HEAD_AXIS.get(path[0].name)
        return P() if axis is None else tp_ops.split(leaf.ndim, axis)

    return jax.tree_util.tree_map_with_path(spec, cache)


def state_specs(state):
    """PartitionSpecs of an EngineState: its cache by `cache_specs`, every other leaf (proposer,
    estimator, anchors, keys, sampling params) replicated."""
    return jax.tree.map(lambda _: P(), state).replace(cache=cache_specs(state.cache))


def constrain_state(state):
    """`state` held to `state_specs` inside a jitted step under a tp mesh; unchanged without one."""
    if tp_ops.size() == 1:
        return state
    return jax.lax.with_sharding_constraint(state, state_specs(state))


def place(tree, mesh: jax.sharding.Mesh, specs=None):
    """device_put every leaf with NamedSharding(mesh, spec) (specs default: all replicated)."""
    if specs is None:
        specs = jax.tree.map(lambda _: P(), tree)
    return jax.device_put(tree, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))


class OnMesh:
    """A jitted function called and lowered with `mesh` as the context mesh (jax.set_mesh)."""

    def __init__(self, fn, mesh):
        self.fn, self.mesh = fn, mesh

    def __call__(self, *args, **kwargs):
        with jax.set_mesh(self.mesh):
            return self.fn(*args, **kwargs)

    def lower(self, *args, **kwargs):
        with jax.set_mesh(self.mesh):
            return self.fn.lower(*args, **kwargs)

    def _cache_size(self):
        return self.fn._cache_size()
