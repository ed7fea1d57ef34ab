"""Random-weight models of the real Qwen3.5-27B shape (and a tiny one of the same structure):
their configs and a builder.

target: hidden 5120, intermediate 17408, layer i full attention iff (i+1) % 4 == 0, attention 24
query / 4 KV heads of dim 256 with a quarter rotary and theta 1e7, GDN 16 key / 48 value heads of
dim 128 and conv width 4, vocab 248320, untied lm_head; cut to its first `layers` layers.
draft: DFlash, 5 layers (hidden 5120, intermediate 17408, 32 query / 8 KV heads of dim 128), 5
taps spread over the kept layers (`train.default_taps`), mask id vocab - 1.
SMOKE_*: the same structure at toy size (2 target layers: one GDN, one attention), for CPU runs.
"""

REAL_TARGET = dict(
    vocab=248320,
    hidden=5120,
    intermediate=17408,
    layers=64,
    interval=4,
    heads=24,
    kv_heads=4,
    head_dim=256,
    rotary=0.25,
    rope_theta=1e7,
    gdn_k_heads=16,
    gdn_v_heads=48,
    gdn_dim=128,
    conv=4,
    eps=1e-6,
)
REAL_DRAFT = dict(layers=5, hidden=5120, intermediate=17408, heads=32, kv_heads=8, head_dim=128, taps=5)
SMOKE_TARGET = dict(
    vocab=512,
    hidden=64,
    intermediate=128,
    layers=2,
    interval=2,
    heads=4,
    kv_heads=2,
    head_dim=16,
    rotary=0.25,
    rope_theta=1e7,
    gdn_k_heads=2,
    gdn_v_heads=4,
    gdn_dim=16,
    conv=4,
    eps=1e-6,
)
SMOKE_DRAFT = dict(layers=1, hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16, taps=5)


def target_config(shape, layers):
    """The TargetConfig of `shape` (REAL_TARGET / SMOKE_TARGET) cut to its first `layers` layers."""
    from jaxspec.config import TargetConfig

    s = shape
    return TargetConfig(
        layout="qwen3_5_text",
        vocab_size=s["vocab"],
        hidden_size=s["hidden"],
        intermediate_size=s["intermediate"],
        num_hidden_layers=layers,
        layer_types=tuple(
            "full_attention" if (i + 1) % s["interval"] == 0 else "linear_attention" for i in range(layers)
        ),
        rms_norm_eps=s["eps"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        head_dim=s["head_dim"],
        rope_theta=s["rope_theta"],
        partial_rotary_factor=s["rotary"],
        linear_num_key_heads=s["gdn_k_heads"],
        linear_num_value_heads=s["gdn_v_heads"],
        linear_key_head_dim=s["gdn_dim"],
        linear_value_head_dim=s["gdn_dim"],
        linear_conv_kernel_dim=s["conv"],
        tie_word_embeddings=False,
        max_position_embeddings=262144,
        eos_token_id=(),
    )


def draft_config(shape, tc, block):
    """The DraftConfig of `shape` (REAL_DRAFT / SMOKE_DRAFT) for target config `tc`."""
    from jaxspec import train
    from jaxspec.config import DraftConfig

    s = shape
    return DraftConfig(
        hidden_size=s["hidden"],
        intermediate_size=s["intermediate"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        head_dim=s["head_dim"],
        vocab_size=tc.vocab_size,
        block_size=block,
        target_layer_ids=train.default_taps(tc.num_hidden_layers, s["taps"]),
        mask_token_id=tc.vocab_size - 1,
        target_hidden_size=tc.hidden_size,
        rms_norm_eps=tc.rms_norm_eps,
    )


def build(layers, block, *, smoke=False, seed=0, stacked=False):
    """(target, draft) with random bf16 weights: the REAL shapes (SMOKE with smoke=True, whose
    layer count is its own), the target cut to `layers` layers, the draft proposing blocks of
    `block`; the target's layers a per-layer list, unrolled (stacked=True: stacked groups run by one
    scan, `target.stack_layers`). `init_target` makes one leaf at a time, so only the bf16 tree and one leaf's float32
    temporaries (or stacked copy) are alive at once."""
    import jax
    import jax.numpy as jnp

    from jaxspec import dflash
    from jaxspec import target as target_mod

    tshape, dshape = (SMOKE_TARGET, SMOKE_DRAFT) if smoke else (REAL_TARGET, REAL_DRAFT)
    tc = target_config(tshape, tshape["layers"] if smoke else layers)
    target = target_mod.init_target(tc, jax.random.PRNGKey(seed), jnp.bfloat16, stacked=stacked)
    draft = dflash.init_draft(draft_config(dshape, tc, block), jax.random.PRNGKey(seed + 1), jnp.bfloat16)
    return target, draft
