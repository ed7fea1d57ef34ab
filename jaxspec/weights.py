"""HF safetensors checkpoints <-> target param pytrees.

Param pytree (matrices stored for `x @ W`, i.e. transposed from HF's [out, in]); d = hidden,
V = vocab, I = intermediate, C = conv_dim = 2*H*K + HV*V_head, W = conv kernel, Hq / KVH / D =
attention heads / KV heads / head dim:
```
params = {
  "embed": [V, d], "norm": [d], "lm_head": [d, V]   (no "lm_head" when tie_word_embeddings),
  "layers": [ per layer i, a dict:
     "input_norm": [d], "post_norm": [d],
     dense layers: "mlp": {"gate": [d, I], "up": [d, I], "down": [I, d]},
     mixture-of-experts layers (config.moe_layers; E experts of width Ie, shared width Is):
          "moe": {"router": [d, E], "gate_up": [E, d, 2*Ie], "down": [E, Ie, d],
                  "shared": {"gate": [d, Is], "up": [d, Is], "down": [Is, d]}, "shared_gate": [d, 1]},
     linear_attention layers also: "gdn": {"qkv": [d, C], "z": [d, HV*V], "b": [d, HV],
          "a": [d, HV], "conv": [C, W], "A_log": [HV], "dt_bias": [HV], "norm": [V],
          "out": [HV*V, d]}
     full_attention layers also: "attn": {"q": [d, Hq*2*D], "k": [d, KVH*D], "v": [d, KVH*D],
          "o": [Hq*D, d], "q_norm": [D], "k_norm": [D]} ],
}
```
The conv channels (and the columns of "qkv") are ordered [q (H*K) | k (H*K) | v (HV*V)], value
heads in order; "q" columns are [q_h (D) | gate_h (D)] per head, as HF's q_proj rows. Every
leaf has the dtype given to `load_params` (float32 or bfloat16).

HF names: the text model lives under "model." ("qwen3_5_text", "qwen3_next") or
"model.language_model." (released "qwen3_5"); "lm_head.weight" is top level in all three. Other
tensors (e.g. "model.visual.*", "mtp.*") are ignored. Qwen3-Next fuses the GDN input
projections by key head: `in_proj_qkvz` [H*(2K + 2rV), d] holds, for key head h, the rows
[q_h (K), k_h (K), v of value heads h*r..h*r+r-1 (r*V), z of those heads (r*V)] and
`in_proj_ba` [H*2r, d] the rows [b of its r value heads, a of its r value heads]
(transformers' `Qwen3NextGatedDeltaNet.fix_query_key_value_ordering`); the loader splits them
once into qkv / z / b / a and the writer fuses them back.

Mixture-of-experts layers: the router is "mlp.gate.weight" [E, d], the shared expert
"mlp.shared_expert.{gate,up,down}_proj.weight" and its gate "mlp.shared_expert_gate.weight" [1, d].
The routed experts come in either of two layouts, read per layer by which names are present:
per expert, "mlp.experts.{e}.{gate,up,down}_proj.weight" ([Ie, d], [Ie, d], [d, Ie]: what
transformers' save_pretrained writes), or fused 3-D, "mlp.experts.gate_up_proj" [E, 2*Ie, d] (rows
[gate (Ie) | up (Ie)]) and "mlp.experts.down_proj" [E, d, Ie] (transformers' in-memory layout, as
the released Qwen3.5-MoE checkpoints store it). Both are stacked at load into "gate_up" [E, d, 2*Ie]
(columns [gate | up]) and "down" [E, Ie, d]; `save_params` writes either (per expert by default).
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from jaxspec.config import TargetConfig
from jaxspec.fused import unfuse_params

PARAM_DTYPES = (jnp.dtype("float32"), jnp.dtype("bfloat16"))
_INDEX = "model.safetensors.index.json"
_WEIGHTS = "model.safetensors"

# How a param leaf relates to its HF tensor: "copy" (same array), "linear" (HF [out, in] is
# the transpose of the param [in, out]), "conv" (HF [C, 1, W] is the param [C, W]).
_COPY, _LINEAR, _CONV = "copy", "linear", "conv"
EXPERT_LAYOUTS = ("per_expert", "fused")


def load_config(path: str | os.PathLike) -> TargetConfig:
    """The TargetConfig of a checkpoint directory (its config.json)."""
    return TargetConfig.from_json(os.path.join(path, "config.json"))


def param_shapes(config: TargetConfig) -> dict:
    """The param pytree of `config` (module doc) with shape tuples as leaves."""
    c = config
    d, r_dim = c.hidden_size, c.linear_num_value_heads * c.linear_value_head_dim
    hv, hq, kvh, hd = (c.linear_num_value_heads, c.num_attention_heads, c.num_key_value_heads, c.head_dim)
    shapes = {"embed": (c.vocab_size, d), "norm": (d,), "layers": []}
    if not c.tie_word_embeddings:
        shapes["lm_head"] = (d, c.vocab_size)
    for kind in c.layer_types:
        layer = {"input_norm": (d,), "post_norm": (d,)}
        if c.is_moe(len(shapes["layers"])):
            e, ie, i_s = c.num_experts, c.moe_intermediate_size, c.shared_expert_intermediate_size
            layer["moe"] = {
                "router": (d, e),
                "gate_up": (e, d, 2 * ie),
                "down": (e, ie, d),
                "shared": {"gate": (d, i_s), "up": (d, i_s), "down": (i_s, d)},
                "shared_gate": (d, 1),
            }
        else:
            i = c.intermediate_size
            layer["mlp"] = {"gate": (d, i), "up": (d, i), "down": (i, d)}
        if kind == "linear_attention":
            layer["gdn"] = {
                "qkv": (d, c.conv_dim),
                "z": (d, r_dim),
                "b": (d, hv),
                "a": (d, hv),
                "conv": (c.conv_dim, c.linear_conv_kernel_dim),
                "A_log": (hv,),
                "dt_bias": (hv,),
                "norm": (c.linear_value_head_dim,),
                "out": (r_dim, d),
            }
        else:
            layer["attn"] = {
                "q": (d, hq * 2 * hd),
                "k": (d, kvh * hd),
                "v": (d, kvh * hd),
                "o": (hq * hd, d),
                "q_norm": (hd,),
                "k_norm": (hd,),
            }
        shapes["layers"].append(layer)
    return shapes


def _tensor_map(config: TargetConfig) -> list[tuple[str, tuple, str]]:
    """(HF name, param key path, relation) for every tensor stored one-to-one.

    Qwen3-Next's fused GDN projections (`_split_qwen3_next`) and the routed experts
    (`_read_experts`) are not listed.
    """
    p = _prefix(config)
    out = [(p + "embed_tokens.weight", ("embed",), _COPY), (p + "norm.weight", ("norm",), _COPY)]
    if not config.tie_word_embeddings:
        out.append(("lm_head.weight", ("lm_head",), _LINEAR))
    gdn = [
        ("in_proj_qkv.weight", "qkv", _LINEAR),
        ("in_proj_z.weight", "z", _LINEAR),
        ("in_proj_b.weight", "b", _LINEAR),
        ("in_proj_a.weight", "a", _LINEAR),
    ]
    if config.layout == "qwen3_next":
        gdn = []
    gdn += [
        ("conv1d.weight", "conv", _CONV),
        ("A_log", "A_log", _COPY),
        ("dt_bias", "dt_bias", _COPY),
        ("norm.weight", "norm", _COPY),
        ("out_proj.weight", "out", _LINEAR),
    ]
    attn = [
        ("q_proj.weight", "q", _LINEAR),
        ("k_proj.weight", "k", _LINEAR),
        ("v_proj.weight", "v", _LINEAR),
        ("o_proj.weight", "o", _LINEAR),
        ("q_norm.weight", "q_norm", _COPY),
        ("k_norm.weight", "k_norm", _COPY),
    ]
    for i, kind in enumerate(config.layer_types):
        lp = f"{p}layers.{i}."
        out += [
            (lp + "input_layernorm.weight", ("layers", i, "input_norm"), _COPY),
            (lp + "post_attention_layernorm.weight", ("layers", i, "post_norm"), _COPY),
        ]
        if config.is_moe(i):
            moe = ("layers", i, "moe")
            out += [(lp + "mlp.gate.weight", moe + ("router",), _LINEAR)]
            out += [
                (f"{lp}mlp.shared_expert.{n}_proj.weight", moe + ("shared", n), _LINEAR) for n in ("gate", "up", "down")
            ]
            out += [(lp + "mlp.shared_expert_gate.weight", moe + ("shared_gate",), _LINEAR)]
        else:
            out += [(f"{lp}mlp.{n}_proj.weight", ("layers", i, "mlp", n), _LINEAR) for n in ("gate", "up", "down")]
        if kind == "linear_attention":
            out += [(lp + "linear_attn." + n, ("layers", i, "gdn", k), rel) for n, k, rel in gdn]
        else:
            out += [(lp + "self_attn." + n, ("layers", i, "attn", k), rel) for n, k, rel in attn]
    return out


def _prefix(config: TargetConfig) -> str:
    """Where the text model's tensors live."""
    return "model.language_model." if config.layout in ("qwen3_5", "qwen3_5_moe") else "model."


def _expert_names(config: TargetConfig, layer: int) -> dict:
    """HF names of one MoE layer's routed experts: "fused" -> (gate_up, down), "per_expert" ->
    [(gate, up, down) of expert e for every e]."""
    lp = f"{_prefix(config)}layers.{layer}.mlp.experts."
    return {
        "fused": (lp + "gate_up_proj", lp + "down_proj"),
        "per_expert": [
            tuple(f"{lp}{e}.{n}_proj.weight" for n in ("gate", "up", "down")) for e in range(config.num_experts)
        ],
    }


def _hf_shape(shape: tuple, relation: str) -> tuple:
    """The HF tensor shape of a param leaf of `shape`."""
    if relation == _LINEAR:
        return shape[::-1]
    if relation == _CONV:
        return (shape[0], 1, shape[1])
    return shape


def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def _put(tree, path, value):
    for k in path[:-1]:
        tree = tree[k] if isinstance(k, int) else tree.setdefault(k, {})
    tree[path[-1]] = value


class Checkpoint:
    """Lazy reader of the safetensors files of a directory (one file or sharded with an index).

    Every failure raises an error naming the file or the tensor: FileNotFoundError (no directory,
    no *.safetensors), ValueError (an index or a safetensors file that cannot be read, a tensor of
    the wrong shape), KeyError (a missing tensor).
    """

    def __init__(self, path):
        self.path = os.fspath(path)
        index = os.path.join(self.path, _INDEX)
        if os.path.exists(index):
            self.file_of = {k: os.path.join(self.path, v) for k, v in _weight_map(index).items()}
            return
        files = sorted(f for f in os.listdir(self.path) if f.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors file in {self.path}")
        self.file_of = {}
        for name in files:
            full = os.path.join(self.path, name)
            with _open(full) as f:
                for key in f.keys():
                    if key in self.file_of:
                        raise ValueError(f"tensor {key!r} is in both {self.file_of[key]} and {full}")
                    self.file_of[key] = full

    def read(self, name: str, shape: tuple) -> np.ndarray:
        """Tensor `name` as a numpy array (bfloat16 via ml_dtypes), checked to be `shape`."""
        return self.read_stack([name], shape)[0]

    def read_stack(self, names: list[str], shape: tuple) -> np.ndarray:
        """Tensors `names`, each checked to be `shape`, stacked into [len(names), *shape]; each
        file is opened once (a layer's per-expert tensors are thousands)."""
        for name in names:
            if name not in self.file_of:
                raise KeyError(f"tensor {name!r} is missing from the checkpoint in {self.path}")
        by_file = {}
        for j, name in enumerate(names):
            by_file.setdefault(self.file_of[name], []).append(j)
        out = None
        for file, rows in by_file.items():
            with _open(file) as f:
                for j in rows:
                    got = tuple(f.get_slice(names[j]).get_shape())
                    if got != tuple(shape):
                        raise ValueError(f"tensor {names[j]!r} has shape {got}, the config needs {tuple(shape)}")
                    try:
                        x = f.get_tensor(names[j])
                    except SafetensorError as e:
                        raise ValueError(f"{file}: tensor {names[j]!r} cannot be read ({e})") from None
                    if out is None:
                        out = np.empty((len(names),) + tuple(shape), x.dtype)
                    out[j] = x
        return out

    def first_non_finite(self, name: str) -> str:
        """Where tensor `name` first holds NaN or inf, e.g. 'nan at [0, 3]' (reads it again)."""
        with _open(self.file_of[name]) as f:
            x = f.get_tensor(name)
        flat = ~np.isfinite(x.reshape(-1))
        i = int(np.argmax(flat))
        return f"{x.reshape(-1)[i]} at {list(map(int, np.unravel_index(i, x.shape)))}"


class FiniteCheck:
    """Refuses non-finite weights at load, in one pass where the tensors live: `add(name, x)`
    queues an all-finite flag per tensor (a device reduction, nothing read back), `check()` reads
    the flags once and raises ValueError naming the first tensor that holds a NaN or an inf."""

    def __init__(self, ckpt: Checkpoint):
        self.ckpt, self.names, self.flags = ckpt, [], []

    def add(self, name: str, x) -> None:
        self.add_stacked([name], x[None])

    def add_stacked(self, names: list[str], x) -> None:
        """One flag per entry of x's leading axis, entry j read from tensor names[j]."""
        self.names += names
        self.flags.append(jnp.all(jnp.isfinite(x), axis=tuple(range(1, x.ndim))))  # [len(names)]

    def check(self) -> None:
        flags = np.concatenate(jax.device_get(self.flags)) if self.flags else np.ones(0, bool)
        bad = [n for n, ok in zip(self.names, flags) if not ok]
        if bad:
            more = f" (and {len(bad) - 1} more tensors)" if len(bad) > 1 else ""
            raise ValueError(
                f"tensor {bad[0]!r} in {self.ckpt.file_of[bad[0]]} holds a non-finite value "
                f"({self.ckpt.first_non_finite(bad[0])}){more}: the checkpoint is corrupt"
            )


def _open(file):
    """safe_open, with an unreadable file (truncated, not safetensors) as a ValueError naming it."""
    try:
        return safe_open(file, framework="numpy")
    except SafetensorError as e:
        raise ValueError(f"{file}: not a readable safetensors file ({e})") from None


def _weight_map(index):
    """The tensor -> shard file map of a model.safetensors.index.json."""
    try:
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{index}: not a safetensors index (a JSON object with a weight_map): {e!r}") from None
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index}: weight_map must map tensor names to shard files")
    return weight_map


def _check_dtype(dtype):
    dtype = jnp.dtype(dtype)
    if dtype not in PARAM_DTYPES:
        raise ValueError(f"dtype={dtype}: must be float32 or bfloat16")
    return dtype


def _split_qwen3_next(qkvz: np.ndarray, ba: np.ndarray, c: TargetConfig) -> dict:
    """Qwen3-Next's key-head-grouped in_proj_qkvz / in_proj_ba -> HF-oriented qkv, z, b, a."""
    h, k, v, r = (c.linear_num_key_heads, c.linear_key_head_dim, c.linear_value_head_dim, c.value_heads_per_key)
    d = qkvz.shape[-1]
    q_, k_, v_, z_ = np.split(qkvz.reshape(h, 2 * k + 2 * r * v, d), [k, 2 * k, 2 * k + r * v], axis=1)
    b_, a_ = np.split(ba.reshape(h, 2 * r, d), [r], axis=1)

    def flat(x):  # [H, n, d] -> [H*n, d], key head major
        return x.reshape(-1, d)

    return {"qkv": np.concatenate([flat(q_), flat(k_), flat(v_)]), "z": flat(z_), "b": flat(b_), "a": flat(a_)}


def _fuse_qwen3_next(gdn: dict, c: TargetConfig) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of `_split_qwen3_next`: HF-oriented qkv, z, b, a -> (in_proj_qkvz, in_proj_ba)."""
    h, k = c.linear_num_key_heads, c.linear_key_head_dim
    d = gdn["qkv"].shape[-1]
    q_, k_, v_ = np.split(gdn["qkv"], [h * k, 2 * h * k])

    def per_head(x):  # [H*n, d] -> [H, n, d]
        return x.reshape(h, -1, d)

    qkvz = np.concatenate([per_head(q_), per_head(k_), per_head(v_), per_head(gdn["z"])], axis=1)
    ba = np.concatenate([per_head(gdn["b"]), per_head(gdn["a"])], axis=1)
    return qkvz.reshape(-1, d), ba.reshape(-1, d)


def _read_experts(ckpt: Checkpoint, finite: FiniteCheck, config: TargetConfig, layer: int, dtype) -> dict:
    """One MoE layer's routed experts, fused or per expert (module doc), stacked:
    {"gate_up": [E, d, 2Ie], "down": [E, Ie, d]} in `dtype`."""
    e, d, ie = config.num_experts, config.hidden_size, config.moe_intermediate_size
    names = _expert_names(config, layer)
    gate_up_name, down_name = names["fused"]
    if gate_up_name in ckpt.file_of:
        gate_up = jnp.asarray(ckpt.read(gate_up_name, (e, 2 * ie, d)))  # [E, 2Ie, d]
        down = jnp.asarray(ckpt.read(down_name, (e, d, ie)))  # [E, d, Ie]
        finite.add(gate_up_name, gate_up)
        finite.add(down_name, down)
    else:
        per = [[triple[j] for triple in names["per_expert"]] for j in range(3)]  # gate, up, down names
        gate = jnp.asarray(ckpt.read_stack(per[0], (ie, d)))  # [E, Ie, d]
        up = jnp.asarray(ckpt.read_stack(per[1], (ie, d)))  # [E, Ie, d]
        down = jnp.asarray(ckpt.read_stack(per[2], (d, ie)))  # [E, d, Ie]
        for j, x in enumerate((gate, up, down)):
            finite.add_stacked(per[j], x)
        gate_up = jnp.concatenate([gate, up], axis=1)
    return {"gate_up": gate_up.transpose(0, 2, 1).astype(dtype), "down": down.transpose(0, 2, 1).astype(dtype)}


def _write_experts(moe: dict, config: TargetConfig, layer: int, layout: str) -> dict:
    """Inverse of `_read_experts`: HF tensors of one MoE layer's routed experts in `layout`."""
    gate_up = np.ascontiguousarray(np.asarray(moe["gate_up"]).transpose(0, 2, 1))  # [E, 2Ie, d]
    down = np.ascontiguousarray(np.asarray(moe["down"]).transpose(0, 2, 1))  # [E, d, Ie]
    names = _expert_names(config, layer)
    if layout == "fused":
        return dict(zip(names["fused"], (gate_up, down)))
    ie = config.moe_intermediate_size
    out = {}
    for e, (g, u, dn) in enumerate(names["per_expert"]):
        out.update({g: gate_up[e, :ie], u: gate_up[e, ie:], dn: down[e]})
    return out


def load_params(path: str | os.PathLike, config: TargetConfig, dtype=jnp.float32) -> dict:
    """Read the target params (module doc) from the HF checkpoint directory `path`.

    Reads `model.safetensors.index.json`'s shards if present, else every *.safetensors in the
    directory; only the tensors the config needs are read. Every leaf is cast to `dtype`
    (float32 or bfloat16). A missing tensor raises KeyError; a tensor of the wrong shape, one
    holding NaN or inf, or an unreadable file raises ValueError, each naming the HF tensor or file.
    A mixture-of-experts layer's routed experts may be fused or per expert (module doc).
    """
    dtype = _check_dtype(dtype)
    ckpt = Checkpoint(path)
    finite = FiniteCheck(ckpt)
    shapes = param_shapes(config)
    params = {"layers": [{} for _ in config.layer_types]}

    def put(name, keys, hf_array, relation):
        x = jnp.asarray(hf_array)
        finite.add(name, x)
        if relation == _LINEAR:
            x = x.T
        elif relation == _CONV:
            x = x[:, 0, :]
        _put(params, keys, x.astype(dtype))

    for name, keys, relation in _tensor_map(config):
        put(name, keys, ckpt.read(name, _hf_shape(_get(shapes, keys), relation)), relation)
    if config.layout == "qwen3_next":
        c, d = config, config.hidden_size
        qkvz_rows = c.linear_num_key_heads * (
            2 * c.linear_key_head_dim + 2 * c.value_heads_per_key * c.linear_value_head_dim
        )
        for i in config.gdn_layers:
            lp = f"model.layers.{i}.linear_attn."
            qkvz, ba = lp + "in_proj_qkvz.weight", lp + "in_proj_ba.weight"
            parts = _split_qwen3_next(
                ckpt.read(qkvz, (qkvz_rows, d)), ckpt.read(ba, (2 * c.linear_num_value_heads, d)), c
            )
            for k, x in parts.items():
                put(ba if k in ("b", "a") else qkvz, ("layers", i, "gdn", k), x, _LINEAR)
    for i in config.moe_layers:
        params["layers"][i]["moe"].update(_read_experts(ckpt, finite, config, i, dtype))
    finite.check()
    return params


def save_params(path: str | os.PathLike, params: dict, config: TargetConfig, expert_layout: str = "per_expert") -> None:
    """Write `params` as an HF checkpoint in `config.layout`: model.safetensors + config.json.

    Tensors keep the dtype of their leaf. Routed experts are written in `expert_layout`,
    "per_expert" (as transformers' save_pretrained) or "fused" (module doc). The directory is
    created if needed; it must not hold other safetensors files or a shard index, which the
    loader would read too. Fused projections (jaxspec.fused) are written separate. Raises
    ValueError if the pytree's keys or shapes differ from `param_shapes(config)`.
    """
    if expert_layout not in EXPERT_LAYOUTS:
        raise ValueError(f"expert_layout={expert_layout!r}: must be one of {EXPERT_LAYOUTS}")
    params = unfuse_params(params, config)
    shapes = param_shapes(config)
    want = dict(jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))[0])
    got = dict(jax.tree_util.tree_flatten_with_path(params)[0])
    for keys in sorted(want.keys() ^ got.keys(), key=jax.tree_util.keystr):
        where = "missing from params" if keys in want else "not in the config's param tree"
        raise ValueError(f"params{jax.tree_util.keystr(keys)}: {where}")
    for keys, leaf in got.items():
        if tuple(leaf.shape) != want[keys]:
            raise ValueError(
                f"params{jax.tree_util.keystr(keys)} has shape {tuple(leaf.shape)}, the config needs {want[keys]}"
            )

    os.makedirs(path, exist_ok=True)
    others = [f for f in os.listdir(path) if f == _INDEX or (f.endswith(".safetensors") and f != _WEIGHTS)]
    if others:
        raise FileExistsError(f"{path} already holds {sorted(others)}; save into a clean directory")

    def hf(keys, relation):
        x = np.asarray(_get(params, keys))
        if relation == _LINEAR:
            return np.ascontiguousarray(x.T)
        return x[:, None, :] if relation == _CONV else x

    tensors = {name: hf(keys, relation) for name, keys, relation in _tensor_map(config)}
    if config.layout == "qwen3_next":
        for i in config.gdn_layers:
            gdn = {k: hf(("layers", i, "gdn", k), _LINEAR) for k in ("qkv", "z", "b", "a")}
            lp = f"model.layers.{i}.linear_attn."
            tensors[lp + "in_proj_qkvz.weight"], tensors[lp + "in_proj_ba.weight"] = _fuse_qwen3_next(gdn, config)
    for i in config.moe_layers:
        tensors.update(_write_experts(params["layers"][i]["moe"], config, i, expert_layout))
    save_file(tensors, os.path.join(path, _WEIGHTS), metadata={"format": "pt"})
    hf_config = config.to_hf()
    hf_config["dtype"] = str(jnp.dtype(params["embed"].dtype))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
