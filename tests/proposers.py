"""Test drafts: a random DFlash draft, and an oracle proposer that knows the target's greedy
continuation (so every accepted length occurs)."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxspec import dflash
from jaxspec import target as target_mod
from jaxspec.config import DraftConfig


@struct.dataclass
class OracleProposer:
    """Proposes the target's own greedy continuation (cache-free forwards over the slot's token
    history) and corrupts one random draft position per step, or none: every accepted length
    0..B-1 becomes likely. Randomness comes from (slot, context length), so runs are reproducible.
    With soft=True it instead returns the target's own logits along its greedy continuation: the
    first draft is then drawn from exactly the target's distribution (a near-perfect draft)."""

    target: target_mod.Target
    block_size: int = struct.field(pytree_node=False)
    soft: bool = struct.field(pytree_node=False, default=False)
    taps = ()

    def init_state(self, num_slots, max_len):
        return jnp.zeros((num_slots + 1, max_len), jnp.int32)

    def observe(self, history, tokens, hidden, positions, slots, valid):
        rows = jnp.where(valid & (slots > 0), slots, history.shape[0])
        return history.at[rows, positions].set(tokens, mode="drop")

    def propose(self, history, anchors, slots, ctx_len):
        rows = jnp.arange(slots.shape[0])
        seq = history[slots].at[rows, ctx_len].set(anchors)

        def greedy_next(i, carry):  # one cache-free forward per draft position
            seq, drafts, soft = carry
            length = ctx_len + 1 + i
            logits, *_ = target_mod.prefill_layers(self.target, seq, length, (), "ref")
            last = jnp.take_along_axis(logits, (length - 1)[:, None, None], axis=1)[:, 0]
            nxt = jnp.argmax(last, -1)
            return seq.at[rows, length].set(nxt), drafts.at[:, i].set(nxt), soft.at[:, i].set(last)

        vocab = self.target.config.vocab_size
        drafts = jnp.zeros((slots.shape[0], self.block_size - 1), jnp.int32)
        soft = jnp.zeros((slots.shape[0], self.block_size - 1, vocab), jnp.float32)
        _, drafts, soft = jax.lax.fori_loop(0, self.block_size - 1, greedy_next, (seq, drafts, soft))
        if self.soft:
            return soft, history
        return _corrupted_logits(drafts, slots, ctx_len, self.target.config.vocab_size), history


def _corrupted_logits(drafts, slots, ctx_len, vocab, scale=30.0):
    """Draft logits of the greedy drafts [S, B-1] with one random position corrupted, or none
    (randomness from (slot, context length)): every accepted length 0..B-1 becomes likely.
    The drafted token's logit is `scale`, every other one 0."""
    block = drafts.shape[1] + 1
    keys = jax.vmap(lambda s, n: jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(0), s), n))(slots, ctx_len)
    where = jax.vmap(lambda k: jax.random.randint(k, (), 0, block))(keys)  # block-1 = none
    bad = (drafts + 1 + jnp.arange(block - 1)[None, :]) % vocab
    drafts = jnp.where(jnp.arange(block - 1)[None, :] == where[:, None], bad, drafts)
    return jax.nn.one_hot(drafts, vocab) * scale


@struct.dataclass
class LookupProposer:
    """OracleProposer's greedy drafts without its model passes: the target's greedy continuation
    is looked up in `sequences` [R, L] (each request's prompt followed by its greedy reference
    output, computed once; -1 pads), by matching the slot's token history and anchor against
    their prefixes. The same position is corrupted as OracleProposer corrupts (same randomness).
    A context that matches no sequence (a sampled continuation, a run past the reference) gets
    the chain chain[anchor], chain[chain[anchor]], ... (`chain` [vocab]: the target's greedy next
    token after each token alone), or token 0 without one. The drafted token's logit is `scale`
    (OracleProposer's 30 by default), every other one 0."""

    sequences: jax.Array
    vocab_size: int = struct.field(pytree_node=False)
    block_size: int = struct.field(pytree_node=False)
    chain: jax.Array | None = None
    scale: float = struct.field(pytree_node=False, default=30.0)
    taps = ()

    init_state = OracleProposer.init_state
    observe = OracleProposer.observe

    def propose(self, history, anchors, slots, ctx_len):
        rows = jnp.arange(slots.shape[0])
        seq = history[slots].at[rows, ctx_len].set(anchors)  # [S, M]
        width = min(seq.shape[1], self.sequences.shape[1])
        known = jnp.arange(width)[None, :] <= ctx_len[:, None]  # [S, W]
        same = (seq[:, None, :width] == self.sequences[None, :, :width]) | ~known[:, None]  # [S, R, W]
        match = jnp.all(same, axis=-1) & (ctx_len[:, None] < width)
        where = jnp.clip(
            ctx_len[:, None] + 1 + jnp.arange(self.block_size - 1)[None, :], 0, self.sequences.shape[1] - 1
        )
        drafts = self.sequences[jnp.argmax(match, axis=1)[:, None], where]  # [S, B-1]
        fallback, tok = [], anchors
        for _ in range(self.block_size - 1):
            tok = jnp.zeros_like(tok) if self.chain is None else self.chain[tok]
            fallback.append(tok)
        drafts = jnp.where(jnp.any(match, axis=1)[:, None], jnp.maximum(drafts, 0), jnp.stack(fallback, axis=1))
        return _corrupted_logits(drafts, slots, ctx_len, self.vocab_size, self.scale), history


def lookup_proposer(target, prompts, continuations, block_size, chain=False, scale=30.0):
    """A LookupProposer over prompts [list of ids] and their greedy continuations (lists of ids);
    chain=True computes its fallback chain (one jitted cache-free forward of every token)."""
    sequences = [list(p) + list(c) for p, c in zip(prompts, continuations)]
    table = np.full((len(sequences), max(map(len, sequences))), -1, np.int32)
    for row, sequence in zip(table, sequences):
        row[: len(sequence)] = sequence
    vocab = target.config.vocab_size
    nexts = None
    if chain:
        forward = jax.jit(
            lambda ids: target_mod.prefill_layers(target, ids, jnp.ones((vocab,), jnp.int32), (), "ref")[0]
        )
        nexts = jnp.argmax(forward(jnp.arange(vocab)[:, None])[:, 0], -1).astype(jnp.int32)
    return LookupProposer(jnp.asarray(table), vocab, block_size, nexts, scale)


def random_draft(model, block_size, seed=0, taps=(1, 3)):
    """A random 1-layer DFlash draft (hidden 64) reading the target's layers `taps`."""
    config = DraftConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=model.config.vocab_size,
        block_size=block_size,
        target_layer_ids=taps,
        mask_token_id=model.config.vocab_size - 1,
        target_hidden_size=model.config.hidden_size,
    )
    return dflash.init_draft(config, jax.random.PRNGKey(seed))
