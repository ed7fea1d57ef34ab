"""Packed (ragged) <-> padded layouts of a verify step.

Packed: the tokens of request r are rows query_start_loc[r] : query_start_loc[r+1] of an [N, ...]
array; rows >= query_start_loc[B] are padding. Padded: [B, t_max, ...] with a validity mask.
"""

import jax.numpy as jnp


def padded_index(query_start_loc, t_max):
    """Row of the packed array for each (request, window position), and its validity. [B, t_max]."""
    starts = query_start_loc[:-1, None]
    lengths = query_start_loc[1:, None] - starts
    pos = jnp.arange(t_max)[None, :]
    return starts + pos, pos < lengths


def packed_index(query_start_loc, n):
    """Request and window position of each packed row, and its validity. Each [N]."""
    rows = jnp.arange(n)
    request = jnp.clip(jnp.searchsorted(query_start_loc[1:], rows, side="right"), 0, query_start_loc.shape[0] - 2)
    pos = rows - query_start_loc[request]
    return request, pos, rows < query_start_loc[-1]


def _mask(x, valid):
    return jnp.where(valid.reshape(valid.shape + (1,) * (x.ndim - valid.ndim)), x, jnp.zeros((), x.dtype))


def to_padded(x, query_start_loc, t_max):
    """x [N, ...] -> (xp [B, t_max, ...], valid [B, t_max]); invalid entries are 0."""
    idx, valid = padded_index(query_start_loc, t_max)
    xp = x[jnp.clip(idx, 0, x.shape[0] - 1)]
    return _mask(xp, valid), valid


def to_packed(xp, query_start_loc, n):
    """xp [B, t_max, ...] -> x [n, ...]; padding rows are 0."""
    request, pos, valid = packed_index(query_start_loc, n)
    x = xp[request, jnp.clip(pos, 0, xp.shape[1] - 1)]
    return _mask(x, valid)


def scatter_slots(dest, slots, values, layer=None):
    """dest[slots[r]] = values[r] for real slots; slot 0 (the null slot) is never written. With
    `layer`, dest is a per-layer stack [G, S1, ...] written at dest[layer, slots[r]] in place."""
    at = jnp.where(slots > 0, slots, dest.shape[0 if layer is None else 1])
    return dest.at[at if layer is None else (layer, at)].set(values.astype(dest.dtype), mode="drop")
