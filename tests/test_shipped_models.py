"""The trained tiny models shipped under models/: they load, decode losslessly, and the draft earns
its keep (models/README.md has the recipe and the full acceptance table)."""

import json
import os

import numpy as np
import pytest

from jaxspec import cli
from jaxspec.config import SpecConfig
from jaxspec.dflash import load_draft
from jaxspec.engine import Engine
from jaxspec.target import load_target
from jaxspec.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def models():
    target = load_target(cli.DEFAULT_TARGET)
    return target, load_draft(cli.DEFAULT_DRAFT, target), load_tokenizer(cli.DEFAULT_TARGET)


def _prompt(module_file, size=300):
    with open(os.path.join(os.path.dirname(json.__file__), module_file), encoding="utf-8") as f:
        return f.read()[:size]


def test_shipped_checkpoints_are_bf16_and_small():
    sizes = [os.path.getsize(os.path.join(d, "model.safetensors")) for d in (cli.DEFAULT_TARGET, cli.DEFAULT_DRAFT)]
    assert sum(sizes) <= 25 * 2**20
    for d in (cli.DEFAULT_TARGET, cli.DEFAULT_DRAFT):
        with open(os.path.join(d, "model.safetensors"), "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}, d


@pytest.mark.parametrize("module_file", ["decoder.py", "encoder.py"], ids=["json-decoder", "json-encoder"])
def test_greedy_static_equals_none_and_accepts(models, module_file):
    """64 greedy tokens after a held-out prompt (the json package is held out of training): the
    same tokens with and without speculation, and more than 1.5 tokens per verify step."""
    target, draft, tokenizer = models
    prompt = tokenizer.encode(_prompt(module_file))
    spec = dict(num_slots=1, max_len=512)
    plain = Engine(target, None, SpecConfig(verify_mode="none", **spec)).generate([prompt], max_new_tokens=64)[0]
    fast = Engine(target, draft, SpecConfig(verify_mode="static", block_size=8, **spec)).generate(
        [prompt], max_new_tokens=64
    )[0]
    assert plain.error is None and fast.error is None
    assert len(fast.tokens) == 64
    np.testing.assert_array_equal(fast.tokens, plain.tokens)
    assert fast.stats["accept_length"] > 1.5, fast.stats
