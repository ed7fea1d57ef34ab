import dataclasses
import json
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxspec.config import LAYOUTS, TargetConfig
from jaxspec.weights import load_config, load_params, param_shapes, save_params

FIXTURE = Path(__file__).parent / "fixtures" / "tiny-qwen3_5"
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}


@pytest.fixture(scope="module")
def tiny() -> TargetConfig:
    return load_config(FIXTURE)


@pytest.fixture(scope="module")
def hf_tensors() -> dict:
    return load_file(FIXTURE / "model.safetensors")


def random_params(config, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map(
        lambda s: jnp.asarray(rng.standard_normal(s), dtype),
        param_shapes(config),
        is_leaf=lambda x: isinstance(x, tuple),
    )


def assert_same(a, b):
    """Same tree, dtypes and bits."""
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree_util.tree_leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(
            np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8), err_msg=jax.tree_util.keystr(path)
        )


def write_checkpoint(path: Path, tensors: dict, config: dict):
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config))


def fuse_qwen3_next(tensors: dict, config: TargetConfig) -> dict:
    """Independent Qwen3-Next writer: fuse each GDN layer's HF in_proj_{qkv,z,b,a} by key head.

    For key head h: qkvz rows [q_h (K), k_h (K), v of value heads h*r..h*r+r-1 (r*V), z of
    those heads (r*V)]; ba rows [b of its r value heads, a of its r value heads].
    """
    H, K, V = config.linear_num_key_heads, config.linear_key_head_dim, config.linear_value_head_dim
    r = config.linear_num_value_heads // H
    out = dict(tensors)
    for i in config.gdn_layers:
        p = f"model.layers.{i}.linear_attn."
        qkv, z = out.pop(p + "in_proj_qkv.weight"), out.pop(p + "in_proj_z.weight")
        b, a = out.pop(p + "in_proj_b.weight"), out.pop(p + "in_proj_a.weight")
        q, k, v = qkv[: H * K], qkv[H * K : 2 * H * K], qkv[2 * H * K :]
        qkvz_rows, ba_rows = [], []
        for h in range(H):
            qkvz_rows += [
                q[h * K : (h + 1) * K],
                k[h * K : (h + 1) * K],
                v[h * r * V : (h + 1) * r * V],
                z[h * r * V : (h + 1) * r * V],
            ]
            ba_rows += [b[h * r : (h + 1) * r], a[h * r : (h + 1) * r]]
        out[p + "in_proj_qkvz.weight"] = np.concatenate(qkvz_rows)
        out[p + "in_proj_ba.weight"] = np.concatenate(ba_rows)
    return out


def test_fixture_loads(tiny, hf_tensors):
    params = load_params(FIXTURE, tiny)
    shapes = jax.tree_util.tree_map(lambda x: tuple(x.shape), params)
    assert shapes == param_shapes(tiny)
    gdn, attn = params["layers"][0]["gdn"], params["layers"][3]["attn"]
    assert gdn["qkv"].shape == (64, 160) and gdn["conv"].shape == (160, 4)
    assert gdn["z"].shape == (64, 96) and gdn["b"].shape == (64, 6) and gdn["out"].shape == (96, 64)
    assert attn["q"].shape == (64, 4 * 2 * 16) and attn["o"].shape == (64, 64)
    assert params["lm_head"].shape == (64, 512) and params["embed"].shape == (512, 64)
    assert "attn" not in params["layers"][0] and "gdn" not in params["layers"][3]
    np.testing.assert_array_equal(gdn["qkv"], hf_tensors["model.layers.0.linear_attn.in_proj_qkv.weight"].T)
    np.testing.assert_array_equal(gdn["conv"], hf_tensors["model.layers.0.linear_attn.conv1d.weight"][:, 0])
    np.testing.assert_array_equal(params["lm_head"], hf_tensors["lm_head.weight"].T)
    np.testing.assert_array_equal(
        params["layers"][1]["mlp"]["down"], hf_tensors["model.layers.1.mlp.down_proj.weight"].T
    )
    assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(params))
    bf16 = load_params(FIXTURE, tiny, dtype=jnp.bfloat16)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree_util.tree_leaves(bf16))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_save_load_round_trip(tiny, tmp_path, layout, dtype):
    config = dataclasses.replace(tiny, layout=layout)
    params = random_params(config, DTYPES[dtype])
    save_params(tmp_path, params, config)
    assert load_config(tmp_path) == config
    assert_same(load_params(tmp_path, config, DTYPES[dtype]), params)


def test_tied_round_trip_and_loading_ignores_lm_head(tiny, tmp_path):
    config = dataclasses.replace(
        tiny,
        tie_word_embeddings=True,
        layer_types=("full_attention", "linear_attention", "full_attention", "linear_attention"),
    )
    params = random_params(config, jnp.float32)
    assert "lm_head" not in params
    save_params(tmp_path, params, config)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    assert_same(load_params(tmp_path, config), params)
    # A tied config reading an untied checkpoint leaves its lm_head.weight unread.
    assert "lm_head" not in load_params(FIXTURE, dataclasses.replace(tiny, tie_word_embeddings=True))


def test_qwen3_next_checkpoint_matches_unfused(tiny, tmp_path):
    params = random_params(tiny, jnp.float32, seed=1)
    save_params(tmp_path / "text", params, tiny)
    next_cfg = dataclasses.replace(tiny, layout="qwen3_next")
    fused = fuse_qwen3_next(load_file(tmp_path / "text" / "model.safetensors"), tiny)
    write_checkpoint(tmp_path / "next", fused, next_cfg.to_hf())
    assert_same(load_params(tmp_path / "next", next_cfg), load_params(tmp_path / "text", tiny))
    # The writer re-fuses exactly as the independent helper does.
    save_params(tmp_path / "written", params, next_cfg)
    written = load_file(tmp_path / "written" / "model.safetensors")
    assert written.keys() == fused.keys()
    for name, x in fused.items():
        np.testing.assert_array_equal(written[name], x, err_msg=name)


def test_released_layout_loads(tiny, hf_tensors, tmp_path):
    tensors = {
        ("model.language_model." + k[len("model.") :] if k.startswith("model.") else k): v
        for k, v in hf_tensors.items()
    }
    tensors["model.visual.x"] = np.ones((3, 5), np.float32)
    tensors["mtp.fc.weight"] = np.ones((2, 2), np.float32)
    text = json.loads((FIXTURE / "config.json").read_text())
    del text["architectures"]
    write_checkpoint(
        tmp_path,
        tensors,
        {
            "architectures": ["Qwen3_5ForConditionalGeneration"],
            "model_type": "qwen3_5",
            "tie_word_embeddings": False,
            "vision_config": {"depth": 2},
            "text_config": text,
        },
    )
    config = load_config(tmp_path)
    assert config == dataclasses.replace(tiny, layout="qwen3_5")
    assert_same(load_params(tmp_path, config), load_params(FIXTURE, tiny))


def test_sharded_checkpoint_loads(tiny, hf_tensors, tmp_path):
    names = sorted(hf_tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: hf_tensors[k] for k in keys}, tmp_path / file, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_same(load_params(tmp_path, tiny), load_params(FIXTURE, tiny))
    (tmp_path / "model.safetensors.index.json").unlink()  # every *.safetensors is read without it
    assert_same(load_params(tmp_path, tiny), load_params(FIXTURE, tiny))


def test_bf16_checkpoint_loads_exactly(tiny, tmp_path):
    params = random_params(tiny, jnp.bfloat16, seed=2)
    save_params(tmp_path, params, tiny)
    as_f32 = load_params(tmp_path, tiny, jnp.float32)
    assert_same(as_f32, jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), params))


def test_missing_tensor_is_named(tiny, hf_tensors, tmp_path):
    name = "model.layers.3.self_attn.k_norm.weight"
    shutil.copy(FIXTURE / "config.json", tmp_path)
    save_file({k: v for k, v in hf_tensors.items() if k != name}, tmp_path / "model.safetensors")
    with pytest.raises(KeyError, match=name):
        load_params(tmp_path, tiny)


def test_missing_fused_tensor_is_named(tiny, hf_tensors, tmp_path):
    fused = fuse_qwen3_next(hf_tensors, tiny)
    del fused["model.layers.1.linear_attn.in_proj_ba.weight"]
    save_file(fused, tmp_path / "model.safetensors")
    with pytest.raises(KeyError, match=r"model\.layers\.1\.linear_attn\.in_proj_ba\.weight"):
        load_params(tmp_path, dataclasses.replace(tiny, layout="qwen3_next"))


def test_shape_mismatch_is_named(tiny, hf_tensors, tmp_path):
    name = "model.layers.0.linear_attn.in_proj_z.weight"
    save_file({**hf_tensors, name: hf_tensors[name][:-1]}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=name):
        load_params(tmp_path, tiny)


def test_save_rejects_wrong_tree(tiny, tmp_path):
    params = random_params(tiny, jnp.float32)
    bad = jax.tree_util.tree_map(lambda x: x, params)
    bad["layers"][0]["gdn"]["a"] = bad["layers"][0]["gdn"]["a"][:, :-1]
    with pytest.raises(ValueError, match=r"\['layers'\]\[0\]\['gdn'\]\['a'\]"):
        save_params(tmp_path, bad, tiny)
    with pytest.raises(ValueError, match="lm_head"):
        save_params(tmp_path, params, dataclasses.replace(tiny, tie_word_embeddings=True))


def test_unsupported_dtype(tiny):
    with pytest.raises(ValueError, match="dtype"):
        load_params(FIXTURE, tiny, jnp.float16)


@pytest.mark.parametrize(
    "dtype,value,leaf,name,where",
    [
        ("bf16", np.nan, ("layers", 1, "mlp", "down"), "model.layers.1.mlp.down_proj.weight", "nan at [0, 0]"),
        ("f32", np.inf, ("lm_head",), "lm_head.weight", "inf at [0, 0]"),
        ("f32", -np.inf, ("layers", 0, "gdn", "A_log"), "model.layers.0.linear_attn.A_log", "-inf at [0]"),
    ],
    ids=["bf16-nan", "f32-inf", "f32-neg-inf"],
)
def test_non_finite_tensor_is_refused_by_name(tiny, tmp_path, dtype, value, leaf, name, where):
    params = random_params(tiny, DTYPES[dtype], seed=3)
    parent = params
    for k in leaf[:-1]:
        parent = parent[k]
    parent[leaf[-1]] = parent[leaf[-1]].at[(0,) * parent[leaf[-1]].ndim].set(value)  # HF element 0 too
    save_params(tmp_path, params, tiny)
    message = f"'{name}' in {tmp_path / 'model.safetensors'} holds a non-finite value ({where})"
    with pytest.raises(ValueError, match=re.escape(message)):
        load_params(tmp_path, tiny, DTYPES[dtype])


def test_non_finite_fused_tensor_is_named(tiny, tmp_path):
    config = dataclasses.replace(tiny, layout="qwen3_next")
    params = random_params(config, jnp.float32, seed=4)
    params["layers"][2]["gdn"]["b"] = params["layers"][2]["gdn"]["b"].at[5, 1].set(np.nan)
    save_params(tmp_path, params, config)
    with pytest.raises(ValueError, match=r"'model\.layers\.2\.linear_attn\.in_proj_ba\.weight' .* non-finite"):
        load_params(tmp_path, config)


def test_unreadable_files_are_named(tiny, tmp_path):
    shutil.copytree(FIXTURE, tmp_path / "cut")
    data = (tmp_path / "cut" / "model.safetensors").read_bytes()
    (tmp_path / "cut" / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"cut/model\.safetensors: not a readable safetensors file"):
        load_params(tmp_path / "cut", tiny)
    shutil.copytree(FIXTURE, tmp_path / "index")
    (tmp_path / "index" / "model.safetensors.index.json").write_text("[1, 2")
    with pytest.raises(ValueError, match=r"index/model\.safetensors\.index\.json: not a safetensors index"):
        load_params(tmp_path / "index", tiny)
    shutil.copytree(FIXTURE, tmp_path / "config")
    (tmp_path / "config" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config/config\.json: not valid JSON"):
        load_config(tmp_path / "config")
    (tmp_path / "config" / "config.json").write_text("[]")
    with pytest.raises(ValueError, match=r"config/config\.json: must hold a JSON object"):
        load_config(tmp_path / "config")
