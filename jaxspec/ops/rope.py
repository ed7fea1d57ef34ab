"""Partial rotary position embedding (rotate-half) on the first `rotary_dim` dims of each head."""

import jax.numpy as jnp

from jaxspec.ops.dispatch import use_kernel


def apply_rope(x, positions, rotary_dim, theta, *, impl="auto"):
    """x [..., heads, D], positions [...] int -> same shape and dtype.

    inv_freq = theta^(-2i/rotary_dim); dims >= rotary_dim pass through unchanged.
    """
    use_kernel("apply_rope", impl, None)
    inv_freq = theta ** (-jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim)
    angle = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., rd/2]
    angle = jnp.concatenate([angle, angle], axis=-1)[..., None, :]  # [..., 1, rd]
    xf = x.astype(jnp.float32)
    rot, rest = xf[..., :rotary_dim], xf[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = jnp.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    rot = rot * jnp.cos(angle) + rotated * jnp.sin(angle)
    return jnp.concatenate([rot, rest], axis=-1).astype(x.dtype)
