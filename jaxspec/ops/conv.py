"""Causal depthwise conv1d + SiLU over the GDN qkv channels: prefill, packed verify, commit.

Weight layout [C, W]: y[t, c] = silu(sum_w weight[c, w] * x[t - W + 1 + w, c]).
Conv state per slot [W-1, C] holds the raw (pre-conv) inputs of the last W-1 committed tokens.
Verify saves the raw window inputs ("the deduplicated window": one row [state; x_0..x_{T-1}] per
request instead of T windows); commit takes one slice of that row at offset a + 1.
"""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxspec.ops import packing, tp
from jaxspec.ops.dispatch import use_kernel
from jaxspec.pallas import conv as pallas_conv


def _causal_conv(row, weight, t):
    """row [B, W-1+t, C] (history then inputs) -> silu(conv) [B, t, C] in float32."""
    width = weight.shape[1]
    w = weight.astype(jnp.float32)
    acc = sum(row[:, i : i + t, :].astype(jnp.float32) * w[:, i] for i in range(width))
    return jax.nn.silu(acc)


def conv_prefill(x, weight, lengths, *, impl="auto"):
    """x [B, T, C], weight [C, W], lengths [B] -> (y [B, T, C], state [B, W-1, C]).

    No history before t = 0. Rows t >= lengths[b] output 0. state holds x[len-W+1 : len]
    (zeros where that index is negative), in x.dtype.
    """
    use_kernel("conv_prefill", impl, None)
    b, t, c = x.shape
    width = weight.shape[1]
    row = jnp.concatenate([jnp.zeros((b, width - 1, c), x.dtype), x], axis=1)
    valid = jnp.arange(t)[None, :] < lengths[:, None]
    y = jnp.where(valid[..., None], _causal_conv(row, weight, t), 0.0).astype(x.dtype)
    state = jax.vmap(lambda r, n: jax.lax.dynamic_slice_in_dim(r, n, width - 1, axis=0))(row, lengths)
    return y, state


def conv_verify(x, conv_state, conv_window, weight, query_start_loc, slots, *, layer=None, impl="auto"):
    """Packed verify. x [N, C], conv_state [S1, W-1, C], conv_window [S1, T, C], weight [C, W],
    query_start_loc [B+1], slots [B] -> (y [N, C], conv_window').

    Request r continues from conv_state[slots[r]]; conv_window'[slots[r], s] = x of its window
    token s (s < len_r), every other entry unchanged. Padding rows and slot-0 requests output 0.

    layer: None, or an int / int32 scalar (traced is fine) when conv_state and conv_window are
    stacks over the GDN layers ([G, S1, ...]); the returned window is then the stack with that layer's rows written. The
    kernel reads and writes the stacks in place (a per-layer slice handed to a kernel is a copy).
    """
    if tp.size() > 1:
        return tp.per_shard_at_layer(
            lambda *a, layer: conv_verify(*a, layer=layer, impl=impl),
            (x, conv_state, conv_window, weight, query_start_loc, slots),
            (tp.split(2, 1), tp.split(conv_state.ndim, -1), tp.split(conv_window.ndim, -1), tp.split(2, 0), P(), P()),
            (tp.split(2, 1), tp.split(conv_window.ndim, -1)),
            layer,
        )
    if use_kernel(
        "conv_verify",
        impl,
        lambda: pallas_conv.supports_conv_verify(
            x, conv_state, conv_window, weight, query_start_loc, slots, layer=layer
        ),
    ):
        return pallas_conv.conv_verify(x, conv_state, conv_window, weight, query_start_loc, slots, layer=layer)
    if layer is not None:  # the layer's slices (copies), through the kernel where it applies
        y, window = conv_verify(x, conv_state[layer], conv_window[layer], weight, query_start_loc, slots, impl=impl)
        return y, conv_window.at[layer].set(window)
    t_max = conv_window.shape[1]
    xp, valid = packing.to_padded(x, query_start_loc, t_max)  # [B, T, C]
    valid = valid & (slots > 0)[:, None]
    row = jnp.concatenate([conv_state[slots].astype(x.dtype), xp], axis=1)  # [B, W-1+T, C]
    y = jnp.where(valid[..., None], _causal_conv(row, weight, t_max), 0.0).astype(x.dtype)
    saved = jnp.where(valid[..., None], xp.astype(conv_window.dtype), conv_window[slots])
    return packing.to_packed(y, query_start_loc, x.shape[0]), packing.scatter_slots(conv_window, slots, saved)


def conv_commit(conv_state, conv_window, slots, num_accepted, *, impl="auto"):
    """New conv state after a + 1 window tokens (anchor + a accepted drafts) enter.

    conv_state [S1, W-1, C], conv_window [S1, T, C], slots [B], num_accepted [B] -> conv_state'
    with conv_state'[slots[r]] = rows a+1 .. a+W-1 of [conv_state[slots[r]]; conv_window[slots[r]]].
    """
    use_kernel("conv_commit", impl, None)
    width_m1 = conv_state.shape[1]
    row = jnp.concatenate([conv_state[slots], conv_window[slots].astype(conv_state.dtype)], axis=1)
    new = jax.vmap(lambda r, a: jax.lax.dynamic_slice_in_dim(r, a + 1, width_m1, axis=0))(row, num_accepted)
    return packing.scatter_slots(conv_state, slots, new)
