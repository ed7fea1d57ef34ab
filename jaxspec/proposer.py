"""The draft interface the engine drives, and its DFlash implementation.

A proposer is a static object whose device state is a pytree carried in the engine state:

    taps                      target layers whose output hidden states it consumes
    block_size                B: it proposes B - 1 drafts after each anchor
    init_state(S, max_len)    its state for S slots (slot 0 = null slot)
    observe(state, tokens [R], hidden [R, n_taps, d], positions [R], slots [R], valid [R]) -> state
                              committed tokens enter its context (rows with valid False or slot 0
                              are ignored)
    propose(state, anchors [B], slots [B], ctx_len [B]) -> (logits [B, n, vocab] float32, state)
                              n >= window - 1 (usually B - 1): the engine reads the first window - 1
                              drafts are drawn from these logits by the engine; the returned state
                              is what the step carries on (a draft may keep scratch in it, e.g. its
                              block's K/V past the context, which later observes overwrite)

Both methods are traced inside the engine's jitted step, so they must be pure jnp, and the
proposer itself is a pytree (a flax struct dataclass) passed to the step as an argument, so its
weights are inputs of the compiled step, never constants baked into it.
"""

from flax import struct

from jaxspec import dflash
from jaxspec.dflash import Draft
from jaxspec.target import Target


def dflash_proposer(draft: Draft, target: Target, impl: str = "auto") -> "DFlashProposer":
    """The DFlash proposer of `draft` over `target`, holding only the weights the two share
    (`dflash.shared_head`): the step takes the target as its own argument already, and every
    array of a jit's arguments costs the host ~0.5-2 µs a call (bench/RESULTS.md), which the tiny
    pair's ~1 ms step pays in full."""
    return DFlashProposer(draft, dflash.shared_head(target), impl=impl)


@struct.dataclass
class DFlashProposer:
    """DFlash block diffusion: one parallel forward over [anchor, MASK x (B-1)].

    target: the target, or only its shared weights (`dflash_proposer`); forward_block: None (B =
    the draft's block) or a shorter B (`SpecConfig.trim_draft`): the forward runs only the
    positions a shorter verify window reads."""

    draft: Draft
    target: Target
    impl: str = struct.field(pytree_node=False, default="auto")
    forward_block: int | None = struct.field(pytree_node=False, default=None)

    @property
    def taps(self):
        return self.draft.config.target_layer_ids

    @property
    def block_size(self):
        return self.draft.config.block_size

    def init_state(self, num_slots, max_len):
        return dflash.init_state(self.draft.config, num_slots, max_len, self.target.dtype)

    def observe(self, state, tokens, hidden, positions, slots, valid):
        return dflash.write_context(self.draft, state, hidden, positions, slots, valid)

    def propose(self, state, anchors, slots, ctx_len):
        return dflash.propose(
            self.draft, self.target, state, anchors, slots, ctx_len, block_size=self.forward_block, impl=self.impl
        )
