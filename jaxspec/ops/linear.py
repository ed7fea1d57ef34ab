"""Linear layers of the target and the draft: x @ W, the SwiGLU MLP and the output head.

Precision by operand dtype: float32 operands multiply at precision=HIGHEST (IEEE float32: the
tests hold the model to float64 oracles and transformers at float32); bfloat16 operands use the
default precision (bf16 products, float32 accumulation on the tensor cores) with a bfloat16
result. HIGHEST on bf16 operands buys nothing and is slow where few rows are multiplied: a batch-1
MLP then takes well over its weight-read time (bench/skinny_gemm.py, bench/RESULTS.md).
"""

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST


def _precision(x):
    return HIGHEST if jnp.dtype(x.dtype) == jnp.dtype(jnp.float32) else None


def dense(x, w):
    """x [..., d_in] @ w [d_in, d_out] -> [..., d_out] in x.dtype (float32 accumulation)."""
    if _precision(x) is None:
        return jnp.dot(x, w.astype(x.dtype))
    return jnp.dot(x, w, precision=HIGHEST, preferred_element_type=jnp.float32).astype(x.dtype)


def swiglu_mlp(p, x):
    """down(silu(x @ gate) * (x @ up)); p = {"gate": [d, I], "up": [d, I], "down": [I, d]}, or
    {"gate_up": [d, 2I] = [gate | up], "down"} (one product for both: jaxspec.fused)."""
    if "gate_up" in p:
        gate, up = jnp.split(dense(x, p["gate_up"]), 2, axis=-1)
    else:
        gate, up = dense(x, p["gate"]), dense(x, p["up"])
    return swiglu_down(gate, up, p["down"], x.dtype)


def swiglu_down(gate, up, down, dtype):
    """down(silu(gate) * up) -> [..., d] in dtype; gate, up [..., I] (silu and product in float32)."""
    act = jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)
    return dense(act.astype(dtype), down)


def head_logits(x, w):
    """x [..., d] @ w [d, vocab] -> float32 logits [..., vocab]."""
    return jnp.dot(x, w, precision=_precision(x), preferred_element_type=jnp.float32)
