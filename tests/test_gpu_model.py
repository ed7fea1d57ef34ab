"""On the GPU: the model with its Pallas kernels (impl="auto") against the jnp references.

Run through the device tool: `python3 -m pytest tests/test_gpu_model.py -m gpu`.
"""

from pathlib import Path

import jax
import numpy as np
import pytest
from proposers import OracleProposer

import jaxspec
from jaxspec.config import SpecConfig
from jaxspec.engine import Engine

FIXTURE = Path(__file__).parent / "fixtures" / "tiny-qwen3_5"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")]


@pytest.mark.parametrize("fold_policy,ring_dtype", [("every", "float32"), ("lazy", "bfloat16")])
def test_engine_with_kernels_equals_reference(fold_policy, ring_dtype):
    target = jaxspec.load_target(FIXTURE)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(0, 512, n)) for n in (7, 30, 12, 3)]
    spec = SpecConfig(
        verify_mode="static",
        num_slots=3,
        max_len=96,
        fold_policy=fold_policy,
        ring_dtype=ring_dtype,
        ring_len=16 if fold_policy == "every" else 32,
    )
    outs = {}
    for impl in ("ref", "auto"):
        engine = Engine(target, None, spec, proposer=OracleProposer(target=target, block_size=8), impl=impl)
        outs[impl] = engine.generate(prompts, max_new_tokens=24)
    for ref, fast in zip(outs["ref"], outs["auto"]):
        assert fast.tokens == ref.tokens
        assert fast.stats["accepted"] == ref.stats["accepted"]
