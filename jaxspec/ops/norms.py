"""RMSNorm variants of the Qwen3.5 / Qwen3-Next family (float32 math, cast back)."""

import jax
import jax.numpy as jnp

from jaxspec.ops.dispatch import use_kernel


def _normalize(x, eps):
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


def rms_norm(x, weight, eps, *, impl="auto"):
    """x / rms(x) * (1 + weight): the zero-centred weight used everywhere but the GDN output."""
    use_kernel("rms_norm", impl, None)
    return (_normalize(x, eps) * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


def gated_rms_norm(x, gate, weight, eps, *, impl="auto"):
    """(x / rms(x) * weight) * silu(gate): the GDN output norm (plain weight)."""
    use_kernel("gated_rms_norm", impl, None)
    y = _normalize(x, eps) * weight.astype(jnp.float32)
    return (y * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)


def rms_norm_plain(x, weight, eps, *, impl="auto"):
    """x / rms(x) * weight: the plain-weight RMSNorm of Qwen3-style layers (the DFlash draft)."""
    use_kernel("rms_norm_plain", impl, None)
    return (_normalize(x, eps) * weight.astype(jnp.float32)).astype(x.dtype)
