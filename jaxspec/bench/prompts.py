"""Benchmark prompts: windows of the held-out corpus (the tiny byte-level pair), random ids (the
random-weight target)."""

import os
import sys

import numpy as np


def held_out_prompts(count, length, seed, corpus_root=None):
    """`count` windows of `length` tokens at seeded random offsets of the held-out split of
    `jaxspec.train`'s corpus (the held-out stdlib modules of the running interpreter, or of
    `corpus_root`; never a training file). Returns (list of int lists, {"root", "python",
    "held_out_files", "held_out_tokens", "held_out_sha256"})."""
    from jaxspec import train

    root = os.fspath(corpus_root or train.stdlib_root())
    _, files = train.corpus_files(root)
    if not files:
        raise ValueError(f"corpus root {root!r}: no held-out *.py file (modules {train.HELD_OUT_MODULES})")
    held_out = train.Corpus.from_files(root, files)
    rows = held_out.sample(np.random.default_rng(seed), count, length)
    stats = {
        "root": root,
        "python": sys.version.split()[0],
        "held_out_files": len(files),
        "held_out_tokens": int(len(held_out.tokens)),
        "held_out_sha256": held_out.sha256,
    }
    return [list(map(int, row)) for row in rows], stats


def random_prompts(count, length, vocab, seed):
    """`count` prompts of `length` uniformly random ids in [0, vocab - 1) (the last id is the
    draft's mask token)."""
    rng = np.random.default_rng(seed)
    return [list(map(int, row)) for row in rng.integers(0, vocab - 1, (count, length))]
