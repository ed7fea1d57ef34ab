"""Random-weight models of real GDN-hybrid shapes (and tiny ones of the same structure): their
configs and a builder. MODELS names them: "qwen3.5-27b" (dense, the default), "qwen3.5-35b-a3b"
and "qwen3-next-80b-a3b" (mixture of experts).

target: hidden 5120, intermediate 17408, layer i full attention iff (i+1) % 4 == 0, attention 24
query / 4 KV heads of dim 256 with a quarter rotary and theta 1e7, GDN 16 key / 48 value heads of
dim 128 and conv width 4, vocab 248320, untied lm_head; cut to its first `layers` layers.
draft: DFlash, 5 layers (hidden 5120, intermediate 17408, 32 query / 8 KV heads of dim 128), 5
taps spread over the kept layers (`train.default_taps`), mask id vocab - 1.
Qwen3.5-35B-A3B: hidden 2048, 40 layers (full attention every 4th, 16 query / 2 KV heads of 256),
GDN 16 key / 32 value heads of 128, every layer 256 experts top-8 of width 512 plus a shared expert
of width 512, vocab 248320. Qwen3-Next-80B-A3B: the same with 48 layers, 512 experts top-10, vocab
151936. Their drafts: DFlash, 5 layers of hidden 2048 (intermediate 6144, 16 / 4 heads of 128).
SMOKE_*: the same structures at toy size (2 target layers: one GDN, one attention), for CPU runs.
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
QWEN3_5_35B_A3B = dict(
    REAL_TARGET,
    layout="qwen3_5_moe_text",
    vocab=248320,
    hidden=2048,
    intermediate=0,
    layers=40,
    heads=16,
    kv_heads=2,
    gdn_v_heads=32,
    experts=256,
    top_k=8,
    expert_width=512,
    shared_width=512,
)
QWEN3_NEXT_80B_A3B = dict(QWEN3_5_35B_A3B, layout="qwen3_next", vocab=151936, layers=48, experts=512, top_k=10)
MOE_DRAFT = dict(layers=5, hidden=2048, intermediate=6144, heads=16, kv_heads=4, head_dim=128, taps=5)
SMOKE_MOE_TARGET = dict(
    SMOKE_TARGET, layout="qwen3_5_moe_text", intermediate=0, experts=8, top_k=2, expert_width=32, shared_width=32
)
# name -> (target shape, draft shape, smoke target shape, smoke draft shape)
MODELS = {
    "qwen3.5-27b": (REAL_TARGET, REAL_DRAFT, SMOKE_TARGET, SMOKE_DRAFT),
    "qwen3.5-35b-a3b": (QWEN3_5_35B_A3B, MOE_DRAFT, SMOKE_MOE_TARGET, SMOKE_DRAFT),
    "qwen3-next-80b-a3b": (QWEN3_NEXT_80B_A3B, MOE_DRAFT, dict(SMOKE_MOE_TARGET, layout="qwen3_next"), SMOKE_DRAFT),
}


def shapes_of(model, smoke=False):
    """(target shape, draft shape) of MODELS[model] (its SMOKE shapes with smoke=True)."""
    if model not in MODELS:
        raise ValueError(f"model: {model!r} is not one of {sorted(MODELS)}")
    target, draft, smoke_target, smoke_draft = MODELS[model]
    return (smoke_target, smoke_draft) if smoke else (target, draft)


def target_config(shape, layers):
    """The TargetConfig of `shape` (a MODELS target shape) cut to its first `layers` layers; a shape
    with experts makes every layer mixture-of-experts."""
    from jaxspec.config import TargetConfig

    s = shape
    moe = "experts" in s
    return TargetConfig(
        layout=s.get("layout", "qwen3_5_text"),
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
        num_experts=s["experts"] if moe else 0,
        num_experts_per_tok=s["top_k"] if moe else 0,
        moe_intermediate_size=s["expert_width"] if moe else 0,
        shared_expert_intermediate_size=s["shared_width"] if moe else 0,
        moe_layers=tuple(range(layers)) if moe else (),
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


def build(layers, block, *, model="qwen3.5-27b", smoke=False, seed=0, stacked=False, fused=True):
    """(target, draft) with random bf16 weights: MODELS[model]'s shapes (its SMOKE shapes with
    smoke=True, whose layer count is its own), the target cut to `layers` layers, the draft proposing blocks of
    `block`; the target's layers a per-layer list, unrolled (stacked=True: stacked groups run by one
    scan, `target.stack_layers`), with fused same-input projections as `load_target` gives them
    (fused=False: separate, `jaxspec.fused`). `init_target` makes one leaf at a time, so only the
    bf16 tree and one leaf's float32 temporaries (or stacked copy) are alive at once."""
    import jax
    import jax.numpy as jnp

    from jaxspec import dflash
    from jaxspec import target as target_mod

    tshape, dshape = shapes_of(model, smoke)
    tc = target_config(tshape, tshape["layers"] if smoke else layers)
    target = target_mod.init_target(tc, jax.random.PRNGKey(seed), jnp.bfloat16, stacked=stacked, fused=fused)
    draft = dflash.init_draft(draft_config(dshape, tc, block), jax.random.PRNGKey(seed + 1), jnp.bfloat16)
    return target, draft
