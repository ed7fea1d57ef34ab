"""Configuration: frozen dataclasses validated at construction.

A bad value raises `ValueError` whose message names the field, the value and the rule, e.g.
``CacheConfig.ring_len=24: must be a power of two >= 16``. A configuration the library does not
implement yet (scaled RoPE, attention biases, activations other than SiLU) raises
`NotImplementedError` naming the field that asks for it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

LAYOUTS = ("qwen3_5", "qwen3_5_text", "qwen3_next")
MOE_LAYOUTS = ("qwen3_5_moe", "qwen3_5_moe_text")
LAYER_TYPES = ("linear_attention", "full_attention")
DTYPES = ("float32", "bfloat16")
FOLD_POLICIES = ("every", "lazy")

_ARCHITECTURES = {
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
}
# The text model type of each layout (the composite layouts hold it under "text_config").
_TEXT_TYPES = {
    "qwen3_5": "qwen3_5_text",
    "qwen3_5_text": "qwen3_5_text",
    "qwen3_next": "qwen3_next",
    "qwen3_5_moe": "qwen3_5_moe_text",
    "qwen3_5_moe_text": "qwen3_5_moe_text",
}


def _fail(cls: str, field: str, value: Any, rule: str) -> ValueError:
    return ValueError(f"{cls}.{field}={value!r}: {rule}")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    """Shapes and hyper-parameters of a GDN-hybrid target (Qwen3.5, Qwen3.5-MoE, Qwen3-Next).

    `layout` is the HF checkpoint layout the config was read from and is written back in:
      - "qwen3_5": the released `Qwen3_5ForConditionalGeneration` (text fields under
        "text_config", rope under text_config["rope_parameters"], weights under
        "model.language_model.", lm_head at "lm_head.weight");
      - "qwen3_5_text": text-only `Qwen3_5ForCausalLM` (flat fields, "rope_parameters",
        weights under "model.");
      - "qwen3_next": `Qwen3NextForCausalLM` (flat fields, rope_theta and
        partial_rotary_factor at the top level or in rope_parameters, fused key-head-grouped
        GDN projections);
      - "qwen3_5_moe": the released `Qwen3_5MoeForConditionalGeneration` (as "qwen3_5", text
        model type "qwen3_5_moe_text"); "qwen3_5_moe_text": `Qwen3_5MoeForCausalLM` (as
        "qwen3_5_text"). Every layer of these two is mixture-of-experts.
    Layer i is `layer_types[i]` ("linear_attention" = Gated DeltaNet, "full_attention" = gated
    GQA attention). GDN dims: H = linear_num_key_heads, HV = linear_num_value_heads,
    K = linear_key_head_dim, V = linear_value_head_dim, W = linear_conv_kernel_dim.
    `eos_token_id` is a tuple (empty when the checkpoint names none). The instance is
    hashable, so it can be a static argument of a jitted function.

    Mixture-of-experts (docs/design.md section 2): the layers in `moe_layers` replace the SwiGLU
    MLP of width `intermediate_size` by a sparse block: a router (softmax over `num_experts`,
    the top `num_experts_per_tok`, renormalised to sum 1 iff `norm_topk_prob`), SwiGLU experts
    of width `moe_intermediate_size` and a shared SwiGLU expert of width
    `shared_expert_intermediate_size` scaled by sigmoid(x . shared_expert_gate). A dense
    config has moe_layers == () and the four expert sizes 0; `intermediate_size` may be 0 only
    when every layer is MoE (Qwen3.5-MoE has no dense MLP).
    """

    layout: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    rms_norm_eps: float
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    eos_token_id: tuple[int, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[int, ...] = ()

    def __post_init__(self):
        # Sequences given as lists become tuples so the config stays hashable.
        for name in ("layer_types", "eos_token_id", "moe_layers"):
            value = getattr(self, name)
            if not isinstance(value, (list, tuple)):
                raise _fail("TargetConfig", name, value, "must be a sequence")
            object.__setattr__(self, name, tuple(value))
        self._validate()

    def _validate(self):
        def bad(field, rule):
            return _fail("TargetConfig", field, getattr(self, field), rule)

        if self.layout not in LAYOUTS + MOE_LAYOUTS:
            raise bad("layout", f"must be one of {LAYOUTS + MOE_LAYOUTS}")
        for field in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "linear_num_key_heads",
            "linear_num_value_heads",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "linear_conv_kernel_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, field)
            if not _is_int(value) or value <= 0:
                raise bad(field, "must be a positive int")
        for field in ("rms_norm_eps", "rope_theta", "partial_rotary_factor"):
            if not _is_real(getattr(self, field)) or not getattr(self, field) > 0:
                raise bad(field, "must be a positive number")
        if len(self.layer_types) != self.num_hidden_layers:
            raise bad("layer_types", f"must have num_hidden_layers={self.num_hidden_layers} entries")
        if any(t not in LAYER_TYPES for t in self.layer_types):
            raise bad("layer_types", f"every entry must be one of {LAYER_TYPES}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise bad(
                "linear_num_value_heads", f"must be a multiple of linear_num_key_heads={self.linear_num_key_heads}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise bad("num_key_value_heads", f"must divide num_attention_heads={self.num_attention_heads}")
        if self.partial_rotary_factor > 1:
            raise bad("partial_rotary_factor", "must be in (0, 1]")
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise bad(
                "partial_rotary_factor",
                f"rotary_dim = int(partial_rotary_factor * head_dim) = {self.rotary_dim} must be even and >= 2",
            )
        if self.linear_conv_kernel_dim < 2:
            raise bad("linear_conv_kernel_dim", "must be >= 2")
        if not isinstance(self.tie_word_embeddings, bool):
            raise bad("tie_word_embeddings", "must be a bool")
        if any(not _is_int(t) or not 0 <= t < self.vocab_size for t in self.eos_token_id):
            raise bad("eos_token_id", f"every id must be an int in [0, vocab_size={self.vocab_size})")
        self._validate_moe(bad)

    def _validate_moe(self, bad):
        n = self.num_hidden_layers
        if any(not _is_int(i) or not 0 <= i < n for i in self.moe_layers) or list(self.moe_layers) != sorted(
            set(self.moe_layers)
        ):
            raise bad("moe_layers", f"must be ascending distinct layer indices in [0, num_hidden_layers={n})")
        all_moe = len(self.moe_layers) == n
        if not _is_int(self.intermediate_size) or self.intermediate_size < (0 if all_moe else 1):
            raise bad("intermediate_size", "must be a positive int" + ("" if all_moe else " (a layer is dense)"))
        if self.layout in MOE_LAYOUTS and not all_moe:
            raise bad("moe_layers", f"layout {self.layout!r} makes every layer mixture-of-experts")
        if self.layout in ("qwen3_5", "qwen3_5_text") and self.moe_layers:
            raise bad("moe_layers", f"layout {self.layout!r} is dense; the MoE layouts are {MOE_LAYOUTS}")
        sizes = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")
        if not self.moe_layers:
            for field in sizes:
                if getattr(self, field) != 0:
                    raise bad(field, "must be 0 when no layer is mixture-of-experts (moe_layers is empty)")
            return
        for field in sizes:
            if not _is_int(getattr(self, field)) or getattr(self, field) < 1:
                raise bad(field, "must be a positive int")
        if self.num_experts_per_tok > self.num_experts:
            raise bad("num_experts_per_tok", f"must be <= num_experts={self.num_experts}")
        if not isinstance(self.norm_topk_prob, bool):
            raise bad("norm_topk_prob", "must be a bool")

    # ------------------------------------------------------------------ derived shapes

    @property
    def rotary_dim(self) -> int:
        """Leading dims of each attention head that get rotary embedding."""
        return int(self.partial_rotary_factor * self.head_dim)

    @property
    def gdn_layers(self) -> tuple[int, ...]:
        """Indices of the linear-attention (Gated DeltaNet) layers, ascending."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def attn_layers(self) -> tuple[int, ...]:
        """Indices of the full-attention layers, ascending."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    def is_moe(self, layer: int) -> bool:
        """Whether layer `layer` has the sparse mixture-of-experts block instead of the MLP."""
        return layer in self.moe_layers

    @property
    def conv_dim(self) -> int:
        """GDN conv channels C = 2*H*K + HV*V, ordered [q (H*K) | k (H*K) | v (HV*V)]."""
        return (
            2 * self.linear_num_key_heads * self.linear_key_head_dim
            + self.linear_num_value_heads * self.linear_value_head_dim
        )

    @property
    def value_heads_per_key(self) -> int:
        """r = HV // H: value head hv reads key head hv // r."""
        return self.linear_num_value_heads // self.linear_num_key_heads

    # ------------------------------------------------------------------ HF config.json

    @classmethod
    def from_hf(cls, d: dict) -> TargetConfig:
        """Read a HuggingFace config dict in any of the five layouts (see the class doc).

        Without `layer_types`, layer i is full attention iff (i+1) % full_attention_interval
        == 0 (default interval 4); without `head_dim`, head_dim = hidden_size //
        num_attention_heads. `eos_token_id` may be an int, a list or null. Mixture-of-experts
        follows transformers' modeling code: Qwen3-Next layer i is sparse iff num_experts > 0,
        i is not in `mlp_only_layers` and (i+1) % decoder_sparse_step == 0; every Qwen3.5-MoE
        layer is sparse and renormalises its top-k (it has no norm_topk_prob switch). Absent
        expert fields take transformers' defaults (Qwen3-Next: 512 experts, top 10, widths 512;
        Qwen3.5-MoE: 256 experts, top 8, widths 512).
        """
        model_type = d.get("model_type")
        if model_type in ("qwen3_5", "qwen3_5_moe"):
            text = d.get("text_config")
            if not isinstance(text, dict):
                raise ValueError(
                    f"text_config={text!r}: a model_type {model_type!r} config must hold its text model "
                    "under text_config"
                )
            text_type = text.get("model_type", _TEXT_TYPES[model_type])
            if text_type != _TEXT_TYPES[model_type]:
                raise ValueError(
                    f"text_config.model_type={text_type!r}: must be {_TEXT_TYPES[model_type]!r} "
                    f"under model_type {model_type!r}"
                )
            # The composite model ties its lm_head by the top-level flag.
            tie = _first(d.get("tie_word_embeddings"), text.get("tie_word_embeddings"), False)
            eos = _first(text.get("eos_token_id"), d.get("eos_token_id"), ())
        elif model_type in ("qwen3_5_text", "qwen3_next", "qwen3_5_moe_text"):
            text = d
            tie = _first(d.get("tie_word_embeddings"), False)
            eos = _first(d.get("eos_token_id"), ())
        else:
            raise ValueError(f"model_type={model_type!r}: must be one of {LAYOUTS + MOE_LAYOUTS}")

        def need(key):
            if text.get(key) is None:
                raise ValueError(f"{key}: missing from the {model_type!r} config")
            return text[key]

        def opt(key, default):
            return _first(text.get(key), default)

        n_layers = need("num_hidden_layers")
        _reject_unsupported(text)
        layer_types = text.get("layer_types")
        if layer_types is None:
            interval = opt("full_attention_interval", 4)
            if not _is_int(interval) or interval <= 0:
                raise ValueError(f"full_attention_interval={interval!r}: must be a positive int")
            layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)]
        head_dim = text.get("head_dim")
        if head_dim is None:
            head_dim = need("hidden_size") // need("num_attention_heads")
        if _is_int(eos):
            eos = (eos,)
        moe = _moe_fields(model_type, text, n_layers)
        return cls(
            layout=model_type,
            vocab_size=need("vocab_size"),
            hidden_size=need("hidden_size"),
            intermediate_size=0 if model_type in MOE_LAYOUTS else need("intermediate_size"),
            num_hidden_layers=n_layers,
            layer_types=tuple(layer_types),
            rms_norm_eps=_as_float(opt("rms_norm_eps", 1e-6)),
            num_attention_heads=need("num_attention_heads"),
            num_key_value_heads=need("num_key_value_heads"),
            head_dim=head_dim,
            rope_theta=_as_float(_rope_value(text, "rope_theta", 10000.0)),
            partial_rotary_factor=_as_float(_rope_value(text, "partial_rotary_factor", 0.25)),
            linear_num_key_heads=need("linear_num_key_heads"),
            linear_num_value_heads=need("linear_num_value_heads"),
            linear_key_head_dim=need("linear_key_head_dim"),
            linear_value_head_dim=need("linear_value_head_dim"),
            linear_conv_kernel_dim=opt("linear_conv_kernel_dim", 4),
            tie_word_embeddings=tie,
            max_position_embeddings=opt("max_position_embeddings", 32768),
            eos_token_id=eos,
            **moe,
        )

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> TargetConfig:
        """Read a config.json file (or the config.json inside a directory); errors name the file."""
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        return _from_file(path, cls.from_hf)

    def to_hf(self) -> dict:
        """The HF config dict in this config's layout; `from_hf(c.to_hf()) == c`.

        It is complete enough for transformers to build the same model (a Qwen3-Next MoE config
        names its dense layers in mlp_only_layers, with decoder_sparse_step 1).
        """
        eos = (
            None
            if not self.eos_token_id
            else self.eos_token_id[0]
            if len(self.eos_token_id) == 1
            else list(self.eos_token_id)
        )
        text = {
            "model_type": _TEXT_TYPES[self.layout],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "layer_types": list(self.layer_types),
            "rms_norm_eps": self.rms_norm_eps,
            "hidden_act": "silu",
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "attention_bias": False,
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
            "linear_key_head_dim": self.linear_key_head_dim,
            "linear_value_head_dim": self.linear_value_head_dim,
            "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "eos_token_id": eos,
        }
        if self.layout not in MOE_LAYOUTS:
            text["intermediate_size"] = self.intermediate_size
        if self.moe_layers:
            text.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                shared_expert_intermediate_size=self.shared_expert_intermediate_size,
            )
        if self.layout == "qwen3_next":
            text.update(rope_theta=self.rope_theta, partial_rotary_factor=self.partial_rotary_factor)
            text.update(num_experts=self.num_experts, decoder_sparse_step=1, norm_topk_prob=self.norm_topk_prob)
            text["mlp_only_layers"] = [i for i in range(self.num_hidden_layers) if not self.is_moe(i)]
        else:
            text["rope_parameters"] = {
                "rope_type": "default",
                "rope_theta": self.rope_theta,
                "partial_rotary_factor": self.partial_rotary_factor,
            }
        if self.layout not in ("qwen3_5", "qwen3_5_moe"):
            return {"architectures": [_ARCHITECTURES[self.layout]], **text}
        return {
            "architectures": [_ARCHITECTURES[self.layout]],
            "model_type": self.layout,
            "tie_word_embeddings": self.tie_word_embeddings,
            "text_config": text,
        }


def _from_file(path: str | os.PathLike, parse):
    """parse(the JSON object in `path`); a file that is not a JSON object, or a config error, is
    raised again (ValueError / NotImplementedError) with the file named."""
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path}: must hold a JSON object, not {type(d).__name__}")
    try:
        return parse(d)
    except NotImplementedError as e:
        raise NotImplementedError(f"{path}: {e}") from None
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path}: {e}") from None


def _first(*values: Any) -> Any:
    """The first value that is not None."""
    return next(v for v in values if v is not None)


def _as_float(x: Any) -> Any:
    """JSON numbers as float; anything else unchanged, for validation to name."""
    return float(x) if _is_real(x) else x


def _rope_value(text: dict, key: str, default: float) -> float:
    """A rope field from rope_parameters (Qwen3.5, transformers 5) or the top level (Qwen3-Next)."""
    return _first((text.get("rope_parameters") or {}).get(key), text.get(key), default)


def _moe_fields(model_type: str, text: dict, n_layers: int) -> dict:
    """The TargetConfig mixture-of-experts fields of a text config, by transformers' rules (from_hf)."""
    if model_type in ("qwen3_5", "qwen3_5_text"):
        return {}
    qwen3_next = model_type == "qwen3_next"
    n_experts = _first(text.get("num_experts"), 512 if qwen3_next else 256)
    if not _is_int(n_experts) or n_experts < 0:
        raise ValueError(f"num_experts={n_experts!r}: must be an int >= 0")
    if qwen3_next:
        step = _first(text.get("decoder_sparse_step"), 1)
        if not _is_int(step) or step <= 0:
            raise ValueError(f"decoder_sparse_step={step!r}: must be a positive int")
        dense_only = _first(text.get("mlp_only_layers"), [])
        if not isinstance(dense_only, list) or not all(_is_int(i) for i in dense_only):
            raise ValueError(f"mlp_only_layers={dense_only!r}: must be a list of layer indices")
        moe_layers = tuple(i for i in range(n_layers) if n_experts > 0 and i not in dense_only and (i + 1) % step == 0)
    else:
        if n_experts == 0:
            raise ValueError(f"num_experts=0: a {model_type!r} config has a mixture-of-experts block in every layer")
        moe_layers = tuple(range(n_layers))
    if not moe_layers:
        return {}
    return {
        "num_experts": n_experts,
        "num_experts_per_tok": _first(text.get("num_experts_per_tok"), 10 if qwen3_next else 8),
        "moe_intermediate_size": _first(text.get("moe_intermediate_size"), 512),
        "shared_expert_intermediate_size": _first(text.get("shared_expert_intermediate_size"), 512),
        # Qwen3.5-MoE's router always renormalises (transformers' Qwen3_5MoeTopKRouter).
        "norm_topk_prob": _first(text.get("norm_topk_prob"), True) if qwen3_next else True,
        "moe_layers": moe_layers,
    }


def _reject_unsupported(text: dict) -> None:
    """Raise NotImplementedError for HF options the model code does not implement."""
    for key in ("rope_parameters", "rope_scaling"):
        rope = text.get(key) or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise NotImplementedError(
                f"{key}.rope_type={rope_type!r}: only unscaled ('default') rotary embedding is supported"
            )
    if text.get("attention_bias"):
        raise NotImplementedError("attention_bias=True: attention projections have no bias")
    act = text.get("hidden_act", "silu")
    if act != "silu":
        raise NotImplementedError(f"hidden_act={act!r}: only 'silu' (SwiGLU) is supported")


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """Shapes and dtypes of the device state (docs/design.md section 4).

    num_slots: real request slots S (arrays have S + 1 rows; slot 0 is the null slot).
    max_len: KV-cache positions per slot.
    window: T_max, tokens one verify window holds per request (anchor + drafts), 1..64.
    ring_len: L, GDN history records per slot and layer; a power of two >= 16 and >= window,
        and >= 2 * window with fold_policy "lazy".
    state_dtype: the SSM checkpoint h0, "float32" or "bfloat16".
    ring_dtype: ring updates u, "float32" (one f32 array) or "bfloat16" (a bf16 hi/lo pair).
    fold_policy: "every" (fold all live records at each commit) or "lazy" (fold only when the
        next window might not fit).
    dtype: activations (conv state, conv window inputs, ring keys, KV cache).
    """

    num_slots: int
    max_len: int
    window: int
    ring_len: int = 16
    state_dtype: str = "float32"
    ring_dtype: str = "float32"
    fold_policy: str = "every"
    dtype: str = "float32"

    def __post_init__(self):
        def bad(field, rule):
            return _fail("CacheConfig", field, getattr(self, field), rule)

        for field in ("num_slots", "max_len", "window", "ring_len"):
            if not _is_int(getattr(self, field)) or getattr(self, field) < 1:
                raise bad(field, "must be a positive int")
        if self.window > 64:
            raise bad("window", "must be in 1..64")
        if self.max_len < self.window:
            raise bad("max_len", f"must be >= window={self.window}")
        if self.ring_len < 16 or self.ring_len & (self.ring_len - 1):
            raise bad("ring_len", "must be a power of two >= 16")
        if self.ring_len < self.window:
            raise bad("ring_len", f"must be >= window={self.window}")
        for field in ("state_dtype", "ring_dtype", "dtype"):
            if getattr(self, field) not in DTYPES:
                raise bad(field, f"must be one of {DTYPES}")
        if self.fold_policy not in FOLD_POLICIES:
            raise bad("fold_policy", f"must be one of {FOLD_POLICIES}")
        if self.fold_policy == "lazy" and self.ring_len < 2 * self.window:
            raise bad("ring_len", f"must be >= 2 * window = {2 * self.window} with fold_policy 'lazy'")


# The tiny byte-level models trained by `jaxspec train` and shipped in the repository (models/README.md).
MODELS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models")
DEFAULT_TARGET = os.path.join(MODELS_DIR, "tiny-target")
DEFAULT_DRAFT = os.path.join(MODELS_DIR, "tiny-dflash")

VERIFY_MODES = ("none", "static", "cap-accept", "compact")
PLANNED_MODES = ("cap-accept", "compact")  # the verify modes that plan per request from a cost table
FIRST_REFIT = 2  # the estimator's first early refit call (`estimator.refit_calls`), by default
PLAN_OVERHEAD = 0.03  # a trimmed step's price beyond its cost-table time, x the full block's (SpecConfig)


@dataclasses.dataclass(frozen=True)
class DraftConfig:
    """A DFlash block-diffusion draft (docs/design.md section 5): Qwen3-style decoder layers (RMSNorm
    with a plain weight, GQA with q/k norm, full rotary, SwiGLU) without embedding or LM head of
    their own (the target's are shared).

    block_size: B, the block [anchor, MASK x (B-1)] gives B - 1 drafts in one forward.
    target_layer_ids: target layers whose output hidden states are concatenated, projected by
        `fc` (n_taps * target_hidden -> hidden_size) and normalised into the draft's context.
    mask_token_id: the token id whose embedding fills the B - 1 draft positions.
    context_window: attend to the last `context_window` context positions only (0 = all of them);
        the context K/V cache keeps every position either way.
    HF layout: config.json with these fields at the top level and `dflash_config`
    {"mask_token_id", "target_layer_ids"}; weights fc.weight, hidden_norm.weight, norm.weight,
    layers.{i}.{input_layernorm, post_attention_layernorm, self_attn.{q,k,v,o}_proj,
    self_attn.{q,k}_norm, mlp.{gate,up,down}_proj}.
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    target_hidden_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    context_window: int = 0

    def __post_init__(self):
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))

        def bad(field, rule):
            return _fail("DraftConfig", field, getattr(self, field), rule)

        for field in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "vocab_size",
            "target_hidden_size",
        ):
            if not _is_int(getattr(self, field)) or getattr(self, field) < 1:
                raise bad(field, "must be a positive int")
        if not _is_int(self.block_size) or not 2 <= self.block_size <= 64:
            raise bad("block_size", "must be an int in 2..64")
        if self.num_attention_heads % self.num_key_value_heads:
            raise bad("num_key_value_heads", f"must divide num_attention_heads={self.num_attention_heads}")
        if self.head_dim % 2:
            raise bad("head_dim", "must be even (rotary)")
        if not self.target_layer_ids or min(self.target_layer_ids) < 0:
            raise bad("target_layer_ids", "must be a non-empty tuple of layer indices >= 0")
        if not _is_int(self.mask_token_id) or not 0 <= self.mask_token_id < self.vocab_size:
            raise bad("mask_token_id", f"must be a token id in [0, vocab_size={self.vocab_size})")
        for field in ("rms_norm_eps", "rope_theta"):
            if not _is_real(getattr(self, field)) or getattr(self, field) <= 0:
                raise bad(field, "must be a positive number")
        if not _is_int(self.context_window) or self.context_window < 0:
            raise bad("context_window", "must be an int >= 0 (0 = the whole context)")

    @classmethod
    def from_hf(cls, d: dict, target_hidden_size: int | None = None) -> DraftConfig:
        dflash = d.get("dflash_config") or {}
        if not isinstance(dflash, dict):
            raise ValueError(f"dflash_config={dflash!r}: must be an object")
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: d[k] for k in fields if k in d}
        values["target_layer_ids"] = dflash.get("target_layer_ids", d.get("target_layer_ids"))
        values["mask_token_id"] = dflash.get("mask_token_id", d.get("mask_token_id"))
        values.setdefault("target_hidden_size", target_hidden_size or d.get("hidden_size"))
        missing = sorted(
            f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING and values.get(f.name) is None
        )
        if missing:
            raise ValueError(f"DraftConfig: config.json lacks {', '.join(missing)}")
        return cls(**values)

    @classmethod
    def from_json(cls, path: str | os.PathLike, target_hidden_size: int | None = None) -> DraftConfig:
        """Read a config.json file (or the config.json inside a directory); errors name the file."""
        path = os.path.join(path, "config.json") if os.path.isdir(path) else path
        return _from_file(path, lambda d: cls.from_hf(d, target_hidden_size))

    def to_hf(self) -> dict:
        d = dataclasses.asdict(self)
        d["target_layer_ids"] = list(self.target_layer_ids)
        d["dflash_config"] = {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)}
        d["architectures"] = ["DFlashDraftModel"]
        return d


@dataclasses.dataclass(frozen=True)
class SimulatedAcceptance:
    """Benchmark-only acceptance rule for models whose drafts the target never accepts (random
    weights): each drafted position k of a verified window is accepted with probability
    sigmoid(a * x_k + b), x_k the estimator's draft feature (logit of the draft's max
    probability), independently per position, and the chain stops at the first rejection, as
    the real rule does. The committed tokens are the accepted drafts, then the target's own token
    at the first rejected position (drawn from its processed distribution). The target verify
    runs at full cost; only the decision is replaced, so the output is NOT the target's
    distribution. `seed` is folded into each request's acceptance key."""

    a: float
    b: float
    seed: int = 0

    def __post_init__(self):
        for field in ("a", "b"):
            value = getattr(self, field)
            if not _is_real(value) or not math.isfinite(value):
                raise _fail("SimulatedAcceptance", field, value, "must be a finite number")
        if not _is_int(self.seed) or not 0 <= self.seed < 2**32:
            raise _fail("SimulatedAcceptance", "seed", self.seed, "must be an int in [0, 2**32)")


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """How the engine decodes (docs/design.md sections 7-8).

    verify_mode: "none" (target only, one token per step), "static" (verify the whole block),
        "cap-accept" (verify the whole block, accept at most the planned drafts) or "compact"
        (verify only the planned drafts, packed into a tier): docs/design.md section 7.
    num_slots, max_len: concurrent requests and tokens per request (prompt + generation).
    block_size: verify window of static mode (anchor + block_size - 1 drafts); None = the
        draft's block size.
    trim_draft: False: the draft's forward runs its own block and the window reads its first
        block_size - 1 drafts; True: the forward runs only [anchor, MASK x (block_size - 1)]
        (block_size / the draft's block of its cost; the drafts change, since their bidirectional
        attention sees fewer masks than in training; the DFlash proposer only).
    ring_len, fold_policy, state_dtype, ring_dtype: the GDN state (see CacheConfig).
    max_top_k: the static top-k bound of the target distribution for sampled requests.
    lag: steps between the survivals the host plans a budget with and the step it plans (>= 1:
        the host never waits for the step in flight).
    plan_overhead: a step that trims drafts (compact, cap-accept) is priced at its cost-table time
        plus plan_overhead x the full block's time at the same rows (or the table's measured
        noise x that time where larger, `CostTable.noise`): the survival read-back, the device's
        sort and packing, and the profile's noise, none of which the table times. So a trimmed
        tier must save more than this share to be chosen; where the table is flat (a host-bound
        step) the planner verifies full blocks.
    num_tiers: static verify shapes (total tokens) per step, from anchors only to the full block.
    refit_interval, first_refit: the estimator refits at steps first_refit * 2^j below
        refit_interval (2, 4, 8, 16, 32, 64), then every refit_interval steps (`estimator.refit_calls`;
        first_refit 0: only the multiples of refit_interval).
    warmup_refits: the steps before the estimator's warmup_refits-th refit (by default the 5th, step
        32) verify full blocks, so the estimator does not learn only from its own trimmed windows.
    prefill_rows: None: requests joining in one step are prefilled in one call padded to a
        power-of-two row count; an int R: every prefill call has exactly R rows (joins of more
        requests take several calls), so the prefill compiles once per prompt-length bucket.
    simulated_acceptance: None (always, unless a benchmark asks), or a `SimulatedAcceptance`
        that replaces the acceptance decision (benchmarks of random-weight models only).
    tp: devices the target is split over (tensor parallelism, jaxspec.parallel); 1 = one device.
    """

    verify_mode: str = "static"
    num_slots: int = 8
    max_len: int = 1024
    block_size: int | None = None
    trim_draft: bool = False
    ring_len: int = 16
    fold_policy: str = "every"
    state_dtype: str = "float32"
    ring_dtype: str = "float32"
    max_top_k: int = 64
    lag: int = 2
    plan_overhead: float = PLAN_OVERHEAD
    num_tiers: int = 4
    refit_interval: int = 100
    first_refit: int = FIRST_REFIT
    warmup_refits: int = 5
    prefill_rows: int | None = None
    simulated_acceptance: SimulatedAcceptance | None = None
    tp: int = 1

    def __post_init__(self):
        def bad(field, rule):
            return _fail("SpecConfig", field, getattr(self, field), rule)

        if self.verify_mode not in VERIFY_MODES:
            raise bad("verify_mode", f"must be one of {VERIFY_MODES}")
        for field in ("num_slots", "max_len", "max_top_k", "tp"):
            if not _is_int(getattr(self, field)) or getattr(self, field) < 1:
                raise bad(field, "must be a positive int")
        if self.block_size is not None and (not _is_int(self.block_size) or not 2 <= self.block_size <= 64):
            raise bad("block_size", "must be None or an int in 2..64")
        if not isinstance(self.trim_draft, bool):
            raise bad("trim_draft", "must be a bool")
        for field in ("lag", "num_tiers", "refit_interval"):
            if not _is_int(getattr(self, field)) or getattr(self, field) < 1:
                raise bad(field, "must be an int >= 1")
        if not _is_real(self.plan_overhead) or not 0 <= self.plan_overhead < 1:
            raise bad("plan_overhead", "must be a number in [0, 1)")
        for field in ("first_refit", "warmup_refits"):
            if not _is_int(getattr(self, field)) or getattr(self, field) < 0:
                raise bad(field, "must be an int >= 0")
        if self.prefill_rows is not None and (not _is_int(self.prefill_rows) or self.prefill_rows < 1):
            raise bad("prefill_rows", "must be None or an int >= 1")
        if self.simulated_acceptance is not None:
            if not isinstance(self.simulated_acceptance, SimulatedAcceptance):
                raise bad("simulated_acceptance", "must be None or a SimulatedAcceptance")
            if self.verify_mode == "none":
                raise bad("simulated_acceptance", "verify_mode 'none' has no drafts to accept")

    def cache_config(self, window: int, dtype: str) -> CacheConfig:
        """The device-state shapes for verify windows of `window` tokens (validated there)."""
        return CacheConfig(
            num_slots=self.num_slots,
            max_len=self.max_len,
            window=window,
            ring_len=self.ring_len,
            state_dtype=self.state_dtype,
            ring_dtype=self.ring_dtype,
            fold_policy=self.fold_policy,
            dtype=dtype,
        )
