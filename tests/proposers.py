"""Test drafts: a random DFlash draft, and an oracle proposer that knows the target's greedy
continuation (so every accepted length occurs)."""

import jax
import jax.numpy as jnp
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
        keys = jax.vmap(lambda s, n: jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(0), s), n))(
            slots, ctx_len
        )
        where = jax.vmap(lambda k: jax.random.randint(k, (), 0, self.block_size))(keys)  # block-1 = none
        bad = (drafts + 1 + jnp.arange(self.block_size - 1)[None, :]) % self.target.config.vocab_size
        drafts = jnp.where(jnp.arange(self.block_size - 1)[None, :] == where[:, None], bad, drafts)
        return jax.nn.one_hot(drafts, self.target.config.vocab_size) * 30.0, history


def random_draft(model, block_size, seed=0):
    config = DraftConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=model.config.vocab_size,
        block_size=block_size,
        target_layer_ids=(1, 3),
        mask_token_id=511,
        target_hidden_size=64,
    )
    return dflash.init_draft(config, jax.random.PRNGKey(seed))
