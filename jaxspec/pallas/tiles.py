"""Helpers shared by the Pallas kernels: tile-size arithmetic and the bf16 hi/lo split."""

import jax.numpy as jnp


def is_pow2(v) -> bool:
    """Whether v is a positive int power of two (bools are not sizes)."""
    return isinstance(v, int) and not isinstance(v, bool) and v > 0 and v & (v - 1) == 0


def _check_fields(config, ranges, ok, kind) -> None:
    for name, lo, hi in ranges:
        val = getattr(config, name)
        if not ok(val) or val < lo or (hi is not None and val > hi):
            bounds = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
            raise ValueError(f"{type(config).__name__}.{name}={val!r}: must be {kind} {bounds}")


def check_pow2_fields(config, ranges) -> None:
    """ValueError naming the field unless every (name, lo, hi) field of the config dataclass is a
    power of two in [lo, hi]; hi None: no upper bound."""
    _check_fields(config, ranges, is_pow2, "a power of two")


def check_int_fields(config, ranges) -> None:
    """ValueError naming the field unless every (name, lo, hi) field of the config dataclass is an
    int (not a bool) in [lo, hi]; hi None: no upper bound."""
    _check_fields(config, ranges, lambda v: isinstance(v, int) and not isinstance(v, bool), "an int")


def given_fields(config, ranges) -> list:
    """The (name, lo, hi) of `ranges` whose config field is not None (None: chosen per call)."""
    return [r for r in ranges if getattr(config, r[0]) is not None]


def next_pow2(v) -> int:
    """The smallest power of two >= v (1 for v <= 1); v any integer (numpy ones too)."""
    return 1 << max(0, (int(v) - 1).bit_length())


def gqa_row_map(i, rep, t_max, g):
    """(window token, q head, in-window flag) of the rows i = t * rep + j of kv head g's stacked
    query tile: the verify attention kernels stack a request's window tokens t and the rep q
    heads j of a GQA group as the rows of one tile."""
    return i // rep, g * rep + i % rep, i < t_max * rep


def split_bf16(x):
    """float32 -> (hi, lo) bfloat16 with x ~= hi + lo (residual ~2^-17 |x|): the operand split
    that gives float32-accurate products on the bf16 tensor cores."""
    hi = x.astype(jnp.bfloat16)
    return hi, (x - hi.astype(jnp.float32)).astype(jnp.bfloat16)


def is_layer_index(layer, num_layers) -> bool:
    """Whether `layer` can index a stack of `num_layers` layers: a Python int in range, or an integer
    scalar array (traced under jit or scan: its range is the caller's contract)."""
    if isinstance(layer, bool):
        return False
    if isinstance(layer, int):
        return 0 <= layer < num_layers
    return getattr(layer, "shape", None) == () and jnp.issubdtype(getattr(layer, "dtype", None), jnp.integer)


def layer_operand(layer):
    """The kernels' first operand: the layer index as an int32 [1] array (0 without a stack). It is
    data, not a constant, so one compiled kernel serves every layer of a stack."""
    return jnp.reshape(jnp.asarray(0 if layer is None else layer, jnp.int32), (1,))
