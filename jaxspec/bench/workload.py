"""The two workloads of `jaxspec bench`: the shipped tiny pair with real acceptance, and the
Qwen3.5-27B-shaped random-weight pair whose acceptance is simulated (`calibrate`); their models,
prompts and requests."""

import dataclasses

import numpy as np

from jaxspec.bench.client import Request


@dataclasses.dataclass
class Workload:
    """key: names the workload's cost tables; prompts: one per request index (requests cycle
    through them); state_dtype: SpecConfig.state_dtype; simulated: acceptance is simulated (its
    settings come from `calibrate.settings`); info: what results.json records about it."""

    key: str
    target: object
    draft: object
    prompts: list
    state_dtype: str
    simulated: bool
    info: dict


def tiny(target_dir, draft_dir, *, count, prompt_len, seed) -> Workload:
    """The shipped tiny target and DFlash draft (or others of the same kind) on `count` windows of
    `prompt_len` bytes of held-out stdlib code."""
    from jaxspec.bench.prompts import held_out_prompts
    from jaxspec.dflash import load_draft
    from jaxspec.target import load_target

    target = load_target(target_dir)
    draft = load_draft(draft_dir, target)
    prompts, corpus = held_out_prompts(count, prompt_len, seed)
    info = {
        "name": "tiny",
        "target": target_dir,
        "draft": draft_dir,
        "dtype": str(np.dtype(target.dtype)),
        "target_layers": target.config.num_hidden_layers,
        "draft_block": draft.config.block_size,
        "prompts": "held-out stdlib code windows",
        "corpus": corpus,
        "acceptance": "real",
    }
    return Workload("tiny", target, draft, prompts, "float32", False, info)


def real_shape(layers, block, *, count, prompt_len, seed, model="qwen3.5-27b", smoke=False, fused=True) -> Workload:
    """The `model`-shaped target (`shapes.MODELS`) cut to `layers` layers and its 5-layer DFlash draft
    of block `block` (`shapes.build`, random bf16 weights; SMOKE shapes with smoke=True; fused
    same-input projections unless fused=False) on random ids."""
    import jax

    from jaxspec.bench import shapes
    from jaxspec.bench.prompts import random_prompts

    target, draft = shapes.build(layers, block, model=model, smoke=smoke, seed=seed, fused=fused)
    jax.block_until_ready((target, draft))
    tc = target.config
    prompts = random_prompts(count, prompt_len, tc.vocab_size, seed)
    info = {
        "name": "real-shape",
        "model": model,
        "smoke_shapes": smoke,
        "target_layers": tc.num_hidden_layers,
        "target_hidden": tc.hidden_size,
        "vocab": tc.vocab_size,
        "draft_layers": draft.config.num_hidden_layers,
        "draft_block": draft.config.block_size,
        "dtype": "bfloat16",
        "prompts": "uniform random ids",
        "acceptance": "SIMULATED: each drafted position accepted with probability sigmoid(a * x + b) of the "
        "draft feature x (logit of the draft's max probability); draft and verify costs are real",
    }
    key = f"real-shape-{model}-L{tc.num_hidden_layers}" + ("-smoke" if smoke else "")
    return Workload(key, target, draft, prompts, "bfloat16", True, info)


def requests(workload, count, output_len, seed) -> list[Request]:
    """`count` requests: prompt i (cycled), an output length drawn uniformly from
    [ceil(output_len / 2), output_len] (seeded: requests finish at different steps, so slots free
    one at a time rather than in waves), seed i."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers((output_len + 1) // 2, output_len + 1, count)
    return [Request(workload.prompts[i % len(workload.prompts)], int(lengths[i]), i) for i in range(count)]
