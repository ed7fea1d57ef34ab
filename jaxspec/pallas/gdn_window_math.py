"""In-kernel pieces of the GDN verify kernels (`gdn_verify`): the float32-accurate tensor-core dot,
selection-based finiteness, the unit-lower-triangular inverse, the window rows, a request's window
and the zero rows of the padding tokens. Plain jnp on register tiles, lowered by Triton."""

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

from jaxspec.pallas.tiles import split_bf16

F32 = jnp.float32


def dot_f32(a, b, trans_a=False, trans_b=False):
    """op(a) @ op(b) to about float32 accuracy on the bf16 tensor cores (f32 accumulation).

    A bfloat16 operand is exact and is not split; the small terms are summed first."""
    a_hi, a_lo = split_bf16(a) if a.dtype == F32 else (a, None)
    b_hi, b_lo = split_bf16(b) if b.dtype == F32 else (b, None)
    mm = functools.partial(plgpu.dot, trans_a=trans_a, trans_b=trans_b)
    acc = None
    for x, y in ((a_lo, b_hi), (a_hi, b_lo)):
        if x is not None and y is not None:
            acc = mm(x, y) if acc is None else acc + mm(x, y)
    main = mm(a_hi, b_hi)
    return main if acc is None else acc + main


def finite_or_zero(x):
    """Non-finite entries -> 0, by selection (NaN < inf is False)."""
    return jnp.where(jnp.abs(x) < jnp.inf, x, 0.0)


def unit_lower_inverse(a_t, t, n_rows):
    """(I + A)^{-1} for strictly lower A, given a_t = A^T [T, T]; rows >= n_rows of A are zero.

    Forward substitution row by row, in registers: row i = e_i - sum_{j<i} A_ij row_j. Row i
    reads rows < i only, each through a `where`, so a non-finite row of A reaches no earlier row.
    """
    col = t[None, :]
    row = t[:, None]
    inv = jnp.where(row == col, 1.0, 0.0).astype(F32)
    for i in range(1, n_rows):
        a_i = jnp.sum(jnp.where(col == i, a_t, 0.0), axis=1)  # A[i, j], indexed by j
        contrib = jnp.sum(jnp.where(row < i, a_i[:, None] * inv, 0.0), axis=0)  # sum_{j<i} A_ij inv[j, :]
        inv = jnp.where(row == i, jnp.where(col == i, 1.0, -contrib[None, :]), inv)
    return inv


def load_window_rows(k_ref, q_ref, start, n, kh, ts, cols):
    """Rows [k_0..k_ts; q_0..q_ts] of key head kh at columns `cols` ([1, C]): [2 ts, C] in the
    inputs' dtype, zero rows for tokens >= n (masked loads: no traffic for them)."""
    r = jnp.arange(2 * ts, dtype=jnp.int32)
    is_k = r < ts
    tok = r % ts
    rows = (start + jnp.where(tok < n, tok, 0))[:, None]
    xk = plgpu.load(k_ref.at[rows, kh, cols], mask=(is_k & (tok < n))[:, None], other=0.0)
    xq = plgpu.load(q_ref.at[rows, kh, cols], mask=(~is_k & (tok < n))[:, None], other=0.0)
    return jnp.where(is_k[:, None], xk, xq)


def request_window(qsl_ref, slots_ref, b, num_requests, t_max, t, n_tok):
    """(bi, start, n, slot, rows, valid) of request b (clamped to a real index): its first packed
    row, its length (clipped to t_max), its slot, and the token rows start + t with their mask."""
    bi = jnp.minimum(b, num_requests - 1)
    start = qsl_ref[bi]
    n = jnp.clip(qsl_ref[bi + 1] - start, 0, t_max)
    rows = start + t
    return bi, start, n, slots_ref[bi], rows, (t < n) & (rows < n_tok)


def zero_padding_rows(o_ref, qsl_ref, num_requests, heads, vcols, pad_rows):
    """Write zeros to o[rows >= query_start_loc[B], head, vcols] for each head, pad_rows at a time
    (the padding tokens after the last request; every row of o is then written exactly once)."""
    n_tok = o_ref.shape[0]
    first = qsl_ref[num_requests]
    steps = (n_tok - first + pad_rows - 1) // pad_rows
    zeros = jnp.zeros((pad_rows, vcols.shape[0]), F32)

    def body(i, carry):
        rows = first + i * pad_rows + jnp.arange(pad_rows, dtype=jnp.int32)
        for h in heads:
            plgpu.store(o_ref.at[rows[:, None], h, vcols[None, :]], zeros, mask=(rows < n_tok)[:, None])
        return carry

    jax.lax.fori_loop(0, jnp.maximum(steps, 0), body, 0)
