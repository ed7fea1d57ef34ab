"""Tiers and layouts of a confidence-scheduled verify step (docs/design.md section 7).

A step of `batch` requests verifies, per request r, a window [anchor_r, drafts_r[:l_r]] of
1 + l_r tokens. The jitted verify is compiled for a few total token counts (tiers); a step
packs its windows contiguously (`packed_layout`, the layout `target.verify` takes: tokens [N],
query_start_loc [B+1], slots [B]) and pads them up to the smallest tier that holds them. The
full-block tier uses the uniform `dense_layout` instead. `unpack_rows` brings per-row outputs
back to a fixed [B, block, ...] shape for acceptance.
"""

from __future__ import annotations

import bisect
import math

import jax.numpy as jnp

from jaxspec.ops import packing

TIER_MULTIPLE = 8


def tiers(batch: int, block: int, num_tiers: int = 4) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The tier ladder of a step and the draft budgets it realises: (tier_tokens, admissible_budgets).

    tier_tokens (strictly increasing): the smallest is `batch` (anchors only), the largest
    `batch * block` (every request verifies its whole block: anchor + block - 1 drafts); the
    num_tiers - 2 between them are spaced geometrically (batch * block**(i / (num_tiers - 1)))
    and rounded up to a multiple of 8. Why 8: the packed token axis is the M dimension of every
    matmul in the verify; multiples of 8 fill GPU tiles / sublanes without ragged remainders and
    keep the number of distinct compiled shapes small. The two ends stay exact (they need not be
    multiples of 8): `batch` is the least a step can verify, and `batch * block` must equal the
    dense layout's shape. Intermediate tiers that round onto a neighbour (or onto/past the top)
    are dropped, so there are at most num_tiers tiers. num_tiers == 1 gives the full block only;
    block == 1 gives (batch,) only.

    admissible_budgets[i] = tier_tokens[i] - batch: the draft budget that fills tier i.
    """
    for name, v in (("batch", batch), ("block", block), ("num_tiers", num_tiers)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"tiers: {name}={v!r} must be a positive int")
    top = batch * block
    if num_tiers == 1:
        ladder = [top]
    else:
        ladder = [batch]
        for i in range(1, num_tiers - 1):
            x = batch * block ** (i / (num_tiers - 1))
            t = math.ceil(x / TIER_MULTIPLE - 1e-9) * TIER_MULTIPLE  # tolerance: 4 * 8**(1/3) is 8.000000000000002
            if ladder[-1] < t < top:
                ladder.append(t)
        if top > ladder[-1]:
            ladder.append(top)
    tier_tokens = tuple(ladder)
    return tier_tokens, tuple(t - batch for t in tier_tokens)


def tier_for(total_tokens: int, tier_tokens) -> int:
    """Index of the smallest tier holding `total_tokens` tokens (host). ValueError past the largest."""
    i = bisect.bisect_left(list(tier_tokens), total_tokens)
    if i == len(tier_tokens):
        raise ValueError(f"tier_for: {total_tokens} tokens exceed the largest tier {tier_tokens[-1]}")
    return i


def packed_layout(lengths, anchors, drafts, slots, tier_tokens: int):
    """Pack each request's window [anchor_r, drafts_r[:lengths_r]] contiguously (jittable; tier_tokens static).

    lengths [B] int32: drafts to verify per request (clipped to 0..D); anchors [B]; drafts [B, D];
    slots [B] (0 = the null slot: such a request gets an empty window, no rows at all).
    Returns (tokens [tier_tokens] int32, query_start_loc [B+1] int32, slots [B]); rows at and past
    query_start_loc[B] are padding with token 0 (target.verify writes nothing for them).
    Precondition: sum over real requests of (1 + lengths_r) <= tier_tokens (the planner's budget
    guarantees it); otherwise query_start_loc is clipped to tier_tokens, which cuts the windows
    at the end of the batch.
    """
    drafts = jnp.asarray(drafts, jnp.int32)
    anchors = jnp.asarray(anchors, jnp.int32)
    slots = jnp.asarray(slots, jnp.int32)
    b, d = drafts.shape
    window = jnp.where(slots > 0, jnp.clip(jnp.asarray(lengths, jnp.int32), 0, d) + 1, 0)
    query_start_loc = jnp.minimum(
        jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(window, dtype=jnp.int32)]), tier_tokens
    )
    block_tokens = jnp.concatenate([anchors[:, None], drafts], axis=1)  # [B, D+1]
    tokens = packing.to_packed(block_tokens, query_start_loc, tier_tokens)
    return tokens.astype(jnp.int32), query_start_loc, slots


def dense_layout(anchors, drafts, slots):
    """The full-block tier without packing: every request (null slots included) gets block = D+1
    rows; tokens [B*block] = concat(anchor, drafts) row by row, query_start_loc = arange(B+1) * block."""
    drafts = jnp.asarray(drafts, jnp.int32)
    anchors = jnp.asarray(anchors, jnp.int32)
    b, d = drafts.shape
    tokens = jnp.concatenate([anchors[:, None], drafts], axis=1).reshape(-1)
    return tokens, jnp.arange(b + 1, dtype=jnp.int32) * (d + 1), jnp.asarray(slots, jnp.int32)


def step_layout(lengths, anchors, drafts, slots, tier_tokens: int):
    """`dense_layout` when tier_tokens is the full block (B * (D+1)), else `packed_layout`.
    Under the dense layout every draft is verified; acceptance still caps at `lengths`."""
    b, d = jnp.shape(drafts)
    if tier_tokens == b * (d + 1):
        return dense_layout(anchors, drafts, slots)
    return packed_layout(lengths, anchors, drafts, slots, tier_tokens)


def unpack_rows(x, query_start_loc, block: int):
    """x [tier, ...] packed rows -> [B, block, ...]: request r's window rows, padded to `block`;
    rows past its window are 0 (a window longer than block is cut). `packing.to_padded` also
    returns the validity mask."""
    return packing.to_padded(x, query_start_loc, block)[0]
