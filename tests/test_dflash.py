"""The DFlash draft against a float64 numpy forward with no cache."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import oracle
import pytest

import jaxspec
from jaxspec import dflash
from jaxspec.config import DraftConfig

FIXTURE = Path(__file__).parent / "fixtures" / "tiny-qwen3_5"


def _np_draft_logits(draft, target, ctx_hidden, anchor, ctx_len, window, block=None):
    """One request, float64: ctx_hidden [ctx_len, n_taps, d] -> logits [blk-1, vocab] of the block
    [anchor, MASK x (blk-1)], blk = block or the draft's own."""
    p = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float64), draft.params)
    c = draft.config
    blk = block or c.block_size
    norm = lambda x, w: x / np.sqrt(np.mean(x * x, -1, keepdims=True) + c.rms_norm_eps) * w
    ctx = norm(ctx_hidden.reshape(ctx_len, -1) @ p["fc"], p["hidden_norm"])
    lo = max(0, ctx_len - window) if window else 0
    emb = np.asarray(target.params["embed"], np.float64)
    x = emb[[anchor] + [c.mask_token_id] * (blk - 1)]
    ctx_pos = np.arange(ctx_len)
    blk_pos = ctx_len + np.arange(blk)
    H, KVH, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    for layer in p["layers"]:
        a = layer["attn"]
        xn = norm(x, layer["input_norm"])
        kv = lambda h, pos: (
            oracle.rope(norm((h @ a["k"]).reshape(len(h), KVH, D), a["k_norm"]), pos, D, c.rope_theta),
            (h @ a["v"]).reshape(len(h), KVH, D),
        )
        k_ctx, v_ctx = kv(ctx, ctx_pos)
        k_blk, v_blk = kv(xn, blk_pos)
        q = oracle.rope(norm((xn @ a["q"]).reshape(len(xn), H, D), a["q_norm"]), blk_pos, D, c.rope_theta)
        k = np.concatenate([k_ctx[lo:], k_blk])
        v = np.concatenate([v_ctx[lo:], v_blk])
        o = oracle.attention(q, k, v, np.full(len(q), len(k) - 1))  # every query sees every key
        x = x + o.reshape(len(x), -1) @ a["o"]
        m = layer["mlp"]
        h = norm(x, layer["post_norm"])
        g = h @ m["gate"]
        x = x + (g / (1 + np.exp(-g)) * (h @ m["up"])) @ m["down"]
    head = np.asarray(target.params["lm_head"], np.float64)
    return norm(x[1:], p["norm"]) @ head


@pytest.mark.parametrize("impl", ["ref", "pallas"])
@pytest.mark.parametrize("block", [None, 3], ids=["own-block", "trimmed3"])
@pytest.mark.parametrize("window", [0, 5], ids=["full-context", "window5"])
def test_propose_matches_uncached_float64_forward(window, block, impl):
    """propose against the float64 forward; 'pallas' runs the block attention through the verify
    kernel (interpret mode here); block 3: the forward of a trimmed block (SpecConfig.trim_draft)."""
    target = jaxspec.load_target(FIXTURE)
    config = DraftConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512,
        block_size=5,
        target_layer_ids=(0, 2, 3),
        mask_token_id=511,
        target_hidden_size=64,
        context_window=window,
    )
    draft = dflash.init_draft(config, jax.random.PRNGKey(4))
    rng = np.random.default_rng(4)
    ctx_lens = np.array([9, 14])
    slots = np.array([2, 1], np.int32)
    hidden = rng.normal(size=(2, 14, 3, 64)).astype(np.float32)
    state = dflash.init_state(config, num_slots=2, max_len=32, dtype=jnp.float32)
    # the context arrives in two installments (prefill, then a verify window), as in the engine
    for lo, hi in ((0, 6), (6, 14)):
        pos = np.arange(lo, hi)
        rows = hidden[:, lo:hi].reshape(-1, 3, 64)
        valid = (pos[None, :] < ctx_lens[:, None]).reshape(-1)
        state = dflash.write_context(
            draft,
            state,
            jnp.asarray(rows),
            jnp.asarray(np.tile(pos, 2)),
            jnp.asarray(np.repeat(slots, hi - lo)),
            jnp.asarray(valid),
        )
    anchors = np.array([7, 300], np.int32)
    logits, _ = dflash.propose(
        draft,
        target,
        state,
        jnp.asarray(anchors),
        jnp.asarray(slots),
        jnp.asarray(ctx_lens),
        block_size=block,
        impl=impl,
    )
    assert logits.shape == (2, (block or 5) - 1, 512)
    for r in range(2):
        want = _np_draft_logits(draft, target, hidden[r, : ctx_lens[r]], anchors[r], ctx_lens[r], window, block)
        oracle.assert_close(np.asarray(logits[r]), want, 1e-5, f"request {r}")


def test_non_finite_draft_tensor_is_refused_by_name(tmp_path):
    target = jaxspec.load_target(FIXTURE)
    config = DraftConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512,
        block_size=4,
        target_layer_ids=(0, 2),
        mask_token_id=511,
        target_hidden_size=64,
    )
    draft = dflash.init_draft(config, jax.random.PRNGKey(0))
    layer = draft.params["layers"][0]
    layer["attn"]["o"] = layer["attn"]["o"].at[2, 7].set(jnp.nan)  # HF o_proj [out, in]: [7, 2]
    dflash.save_draft(tmp_path, draft)
    with pytest.raises(ValueError, match=r"'layers\.0\.self_attn\.o_proj\.weight' in .* \(nan at \[7, 2\]\)"):
        dflash.load_draft(tmp_path, target)
