import dataclasses
import json
from pathlib import Path

import pytest

from jaxspec.config import LAYOUTS, CacheConfig, TargetConfig

FIXTURE = Path(__file__).parent / "fixtures" / "tiny-qwen3_5"
GDN, ATTN = "linear_attention", "full_attention"


def fixture_dict() -> dict:
    return json.loads((FIXTURE / "config.json").read_text())


@pytest.fixture
def tiny() -> TargetConfig:
    return TargetConfig.from_json(FIXTURE / "config.json")


def released(text: dict, **top) -> dict:
    """The fixture's fields laid out as a released Qwen3_5ForConditionalGeneration config."""
    text = {k: v for k, v in text.items() if k not in ("architectures", "tie_word_embeddings")}
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "tie_word_embeddings": False,
        "image_token_id": 248056,
        "vision_config": {"model_type": "qwen3_5", "depth": 2, "hidden_size": 32},
        "text_config": text,
        **top,
    }


def next_dict(**extra) -> dict:
    """The fixture's fields as a Qwen3-Next config: flat rope fields, layers by interval."""
    d = fixture_dict()
    rope = d.pop("rope_parameters")
    del d["layer_types"]
    d.update(
        model_type="qwen3_next",
        architectures=["Qwen3NextForCausalLM"],
        rope_theta=rope["rope_theta"],
        partial_rotary_factor=rope["partial_rotary_factor"],
        full_attention_interval=4,
        rope_scaling=None,
        num_experts=0,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )
    return {**d, **extra}


def test_fixture_parses(tiny):
    assert tiny.layout == "qwen3_5_text"
    assert tiny.layer_types == (GDN, GDN, GDN, ATTN)
    assert tiny.gdn_layers == (0, 1, 2) and tiny.attn_layers == (3,)
    assert tiny.rotary_dim == 4
    assert tiny.conv_dim == 160
    assert tiny.value_heads_per_key == 3
    assert tiny.head_dim == 16 and tiny.rope_theta == 10000.0 and tiny.rms_norm_eps == 1e-6
    assert tiny.eos_token_id == () and tiny.tie_word_embeddings is False
    assert tiny.max_position_embeddings == 4096
    assert TargetConfig.from_json(FIXTURE) == tiny  # a directory reads its config.json
    hash(tiny)


def test_released_layout_parses(tiny):
    cfg = TargetConfig.from_hf(released(fixture_dict()))
    assert cfg == dataclasses.replace(tiny, layout="qwen3_5")


def test_released_layout_top_level_fields():
    # The composite model ties by its top-level flag; eos may sit at either level.
    cfg = TargetConfig.from_hf(released(fixture_dict(), tie_word_embeddings=True, eos_token_id=[5, 7]))
    assert cfg.tie_word_embeddings is True and cfg.eos_token_id == (5, 7)
    text = {**fixture_dict(), "eos_token_id": 9}
    assert TargetConfig.from_hf(released(text, eos_token_id=[5])).eos_token_id == (9,)


def test_qwen3_next_layout_parses(tiny):
    assert TargetConfig.from_hf(next_dict()) == dataclasses.replace(tiny, layout="qwen3_next")


@pytest.mark.parametrize("eos, want", [(None, ()), (3, (3,)), ([3, 4], (3, 4))])
def test_eos_token_id_forms(eos, want):
    assert TargetConfig.from_hf({**fixture_dict(), "eos_token_id": eos}).eos_token_id == want


@pytest.mark.parametrize("n_layers, interval, full", [(8, None, (3, 7)), (7, 3, (2, 5)), (3, 1, (0, 1, 2))])
def test_full_attention_interval_rule(n_layers, interval, full):
    d = next_dict(num_hidden_layers=n_layers)
    if interval is None:
        del d["full_attention_interval"]
    else:
        d["full_attention_interval"] = interval
    cfg = TargetConfig.from_hf(d)
    assert cfg.attn_layers == full
    assert cfg.gdn_layers == tuple(i for i in range(n_layers) if i not in full)


def test_head_dim_defaults_to_hidden_over_heads():
    d = fixture_dict()
    del d["head_dim"]
    assert TargetConfig.from_hf(d).head_dim == 64 // 4


def test_missing_required_field_is_named():
    d = fixture_dict()
    del d["linear_num_value_heads"]
    with pytest.raises(ValueError, match="linear_num_value_heads"):
        TargetConfig.from_hf(d)


@pytest.mark.parametrize("d", [{"model_type": "llama"}, {"model_type": "qwen3_5"}], ids=["llama", "no-text_config"])
def test_unknown_model_type(d):
    with pytest.raises(ValueError, match="model_type|text_config"):
        TargetConfig.from_hf(d)


@pytest.mark.parametrize(
    "field, value",
    [
        ("layout", "llama"),
        ("vocab_size", 0),
        ("hidden_size", -64),
        ("intermediate_size", 12.5),
        ("num_hidden_layers", 0),
        ("num_attention_heads", True),
        ("head_dim", 0),
        ("linear_num_key_heads", 0),
        ("linear_key_head_dim", -1),
        ("linear_value_head_dim", 0),
        ("max_position_embeddings", 0),
        ("rms_norm_eps", 0.0),
        ("rope_theta", -1.0),
        ("layer_types", (GDN, GDN, GDN)),  # wrong length
        ("layer_types", (GDN, GDN, "mamba", ATTN)),  # unknown type
        ("linear_num_value_heads", 5),  # HV % H != 0
        ("num_key_value_heads", 3),  # num_attention_heads % KVH != 0
        ("partial_rotary_factor", 0.0),
        ("partial_rotary_factor", 1.5),
        ("partial_rotary_factor", 0.1875),  # rotary_dim = 3, odd
        ("linear_conv_kernel_dim", 1),
        ("tie_word_embeddings", 1),
        ("eos_token_id", (512,)),  # outside the vocabulary
        ("eos_token_id", (-1,)),
    ],
)
def test_target_validation_names_the_field(tiny, field, value):
    with pytest.raises(ValueError, match=rf"TargetConfig\.{field}="):
        dataclasses.replace(tiny, **{field: value})


def test_sequences_become_tuples(tiny):
    cfg = dataclasses.replace(tiny, layer_types=list(tiny.layer_types), eos_token_id=[1])
    assert cfg.layer_types == tiny.layer_types and cfg.eos_token_id == (1,)
    hash(cfg)


def test_experts_unused_by_every_layer_is_dense(tiny):
    # decoder_sparse_step 2 makes layers 1 and 3 sparse; mlp_only_layers turns both dense. (The
    # mixture-of-experts configs are tested in test_moe.py.)
    d = next_dict(num_experts=4, decoder_sparse_step=2, mlp_only_layers=[1, 3])
    assert TargetConfig.from_hf(d) == dataclasses.replace(tiny, layout="qwen3_next")


@pytest.mark.parametrize(
    "change, field",
    [
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "rope_parameters"),
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_unsupported_options_not_implemented(change, field):
    with pytest.raises(NotImplementedError, match=field):
        TargetConfig.from_hf({**fixture_dict(), **change})


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("variant", ["fixture", "tied-eos"])
def test_to_hf_round_trip(tiny, layout, variant):
    cfg = dataclasses.replace(tiny, layout=layout)
    if variant == "tied-eos":
        cfg = dataclasses.replace(
            cfg, tie_word_embeddings=True, eos_token_id=(1, 2), rope_theta=1e6, layer_types=(ATTN, GDN, ATTN, GDN)
        )
    d = json.loads(json.dumps(cfg.to_hf()))  # survives JSON
    assert TargetConfig.from_hf(d) == cfg
    text = d["text_config"] if layout == "qwen3_5" else d
    assert d["model_type"] == layout
    if layout == "qwen3_next":
        assert d["rope_theta"] == cfg.rope_theta and "rope_parameters" not in d
    else:
        assert text["rope_parameters"]["partial_rotary_factor"] == cfg.partial_rotary_factor


# ---------------------------------------------------------------------------- CacheConfig


def test_cache_config_defaults():
    c = CacheConfig(num_slots=4, max_len=256, window=8)
    assert (c.ring_len, c.state_dtype, c.ring_dtype, c.fold_policy, c.dtype) == (
        16,
        "float32",
        "float32",
        "every",
        "float32",
    )
    CacheConfig(
        num_slots=1,
        max_len=64,
        window=64,
        ring_len=128,
        fold_policy="lazy",
        state_dtype="bfloat16",
        ring_dtype="bfloat16",
        dtype="bfloat16",
    )


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"num_slots": 0}, "num_slots"),
        ({"window": 0}, "window"),
        ({"window": 65, "max_len": 128, "ring_len": 128}, "window"),
        ({"max_len": 4}, "max_len"),
        ({"ring_len": 24}, "ring_len"),  # not a power of two
        ({"ring_len": 8}, "ring_len"),  # < 16
        ({"window": 32, "ring_len": 16}, "ring_len"),  # < window
        ({"fold_policy": "lazy", "window": 12}, "ring_len"),  # lazy needs 2 * window
        ({"state_dtype": "float16"}, "state_dtype"),
        ({"ring_dtype": "int8"}, "ring_dtype"),
        ({"dtype": "float64"}, "dtype"),
        ({"fold_policy": "never"}, "fold_policy"),
    ],
)
def test_cache_validation_names_the_field(kwargs, field):
    base = {"num_slots": 2, "max_len": 64, "window": 8}
    with pytest.raises(ValueError, match=rf"CacheConfig\.{field}="):
        CacheConfig(**{**base, **kwargs})


def test_cache_message_states_value_and_rule():
    with pytest.raises(ValueError) as e:
        CacheConfig(num_slots=2, max_len=64, window=8, ring_len=24)
    assert str(e.value) == "CacheConfig.ring_len=24: must be a power of two >= 16"
