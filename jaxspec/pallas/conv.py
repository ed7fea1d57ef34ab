"""Packed conv verify (causal depthwise conv + SiLU over the GDN qkv channels) as a Pallas Triton kernel.

Contract: `jaxspec.ops.conv.conv_verify` (its jnp reference is the semantics; docs/design.md
section 3). x [N, C] packed (request r owns rows query_start_loc[r] : query_start_loc[r+1],
len_r <= T of them), conv_state [S1, W-1, C], conv_window [S1, T, C] (or [G, ...] layer stacks with
a `layer` index), weight [C, W] -> (y [N, C] in x.dtype, conv_window'). With row_r = [state of
slot_r; x_0 .. x_{len_r - 1}] (the deduplicated window: one row a request, not T windows of W):
    y[start_r + t]          = silu(sum_w weight[:, w] * row_r[t + w])      (t < len_r)
    conv_window'[slot_r, t] = x_t                                          (t < len_r, slot_r > 0)
Padding rows (>= query_start_loc[B]) and slot-0 requests output 0. conv_window is aliased to the
second output: donated, every other entry keeps its bits without a copy.

Design. Grid (cdiv(B, rpp), cdiv(C, block_c)): a program owns rpp consecutive requests (1 by
default) and one channel block, and reads each row of its requests once as a [block_c] vector,
coalesced along channels. The op is memory-bound (about 1.5 flop a byte), so the window loop is
unrolled over the static T and every row load of a group of `row_group` rows is issued before the
group's first store: with in-order issue, a load placed after a store that depends on an earlier
load waits for that load, one DRAM latency per token. With rpp > 1, request k+1's loads go out
while request k is computed, and the scalar (start, length, slot) loads are paid once a program.
The padding rows' zeros are split evenly over the programs of each channel block: no zero-fill
pass over y, no extra programs.

Numerics: float32 products in the reference's order (tap 0 first), SiLU in float32, one rounding to
x.dtype; the state is rounded to x.dtype first, as the reference does; the saved row is bit-exact.
The Triton lowering does not mask blocks that overhang an array, so every access is an explicit
masked load/store (channel tail, rows t >= len_r, taps w < W). Timings: bench/RESULTS.md.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxspec.pallas.hardware import NUM_SMS, default_interpret
from jaxspec.pallas.tiles import (
    check_int_fields,
    check_pow2_fields,
    given_fields,
    is_layer_index,
    layer_operand,
    next_pow2,
)

_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
MAX_T = 64  # largest window (conv_window.shape[1]) the unrolled verify kernel accepts
_MINUS_LOG2E = -1.4426950408889634
MAX_WIDTH = 8  # largest conv width (taps); the models use 4
_TARGET_PROGRAMS = 4 * NUM_SMS  # about four programs per SM before the channel block grows


@dataclasses.dataclass(frozen=True)
class ConvVerifyConfig:
    """Tile sizes of the packed conv verify kernel.

    block_c: channels per program (power of two, 16..4096). None: the largest of 512/256/128 that
      still gives about four programs per SM (_TARGET_PROGRAMS), else 64; clipped to the channel
      count. A program's cost is mostly fixed latency (the scalar -> row dependent loads, then the
      rows), so enough small programs must be resident to cover DRAM latency.
    num_warps: warps per program (1, 2, 4, 8 or 16). None: one 8-byte access per thread per row
      (block_c * itemsize / 256, clipped to 1..8); 16-byte accesses double the registers a thread
      holds, so fewer programs stay resident.
    requests_per_program: requests one program handles in turn, software-pipelined (the rows of
      request k+1 are loaded while request k is computed and stored), 1..16. Used only when the
      window fits one row group (T <= row_group); otherwise 1. None: 1 (more are no faster on the
      H200: each live request costs registers, and so resident programs; sweep in docs/journal.md).
    pad_rows: padding rows zeroed per store (power of two, 1..64).
    row_group: window rows whose loads are issued together (1..64); the loads of group g+1 are
      issued before the stores of group g (two groups of rows live). T <= row_group: all rows of
      a request in flight at once.
    """

    block_c: int | None = None
    num_warps: int | None = None
    requests_per_program: int | None = None
    pad_rows: int = 8
    row_group: int = 8

    def __post_init__(self):
        pow2 = (("block_c", 16, 4096), ("num_warps", 1, 16))
        check_pow2_fields(self, [*given_fields(self, pow2), ("pad_rows", 1, 64)])
        check_int_fields(self, [*given_fields(self, (("requests_per_program", 1, 16),)), ("row_group", 1, 64)])

    def resolve(self, num_requests: int, channels: int, itemsize: int, t_max: int = 1) -> tuple[int, int, int]:
        """(block_c, num_warps, requests_per_program) for a call."""
        block_c = self.block_c
        if block_c is None:
            block_c = 64
            for cand in (512, 256, 128):
                if num_requests * pl.cdiv(channels, cand) >= _TARGET_PROGRAMS:
                    block_c = cand
                    break
        block_c = min(block_c, max(16, next_pow2(channels)))
        num_warps = self.num_warps
        if num_warps is None:
            num_warps = min(8, max(1, block_c * itemsize // 256))
        rpp = self.requests_per_program or 1
        if t_max > self.row_group:
            rpp = 1
        return block_c, num_warps, min(rpp, num_requests)


def supports_conv_verify(x, conv_state, conv_window, weight, query_start_loc, slots, layer=None) -> bool:
    """Shapes and dtypes the packed verify kernel covers (see jaxspec.ops.conv.conv_verify); with
    `layer`, conv_state and conv_window are layer stacks and layer indexes both."""
    try:
        if layer is not None:
            if not (
                conv_state.ndim == 4
                and conv_window.ndim == 4
                and conv_state.shape[0] == conv_window.shape[0]
                and is_layer_index(layer, conv_state.shape[0])
            ):
                return False
            conv_state, conv_window = (jax.ShapeDtypeStruct(a.shape[1:], a.dtype) for a in (conv_state, conv_window))
        if x.ndim != 2 or conv_state.ndim != 3 or conv_window.ndim != 3 or weight.ndim != 2:
            return False
        n, c = x.shape
        width = weight.shape[1]
        b = slots.shape[0] if slots.ndim == 1 else -1
        return (
            n >= 1
            and c >= 1
            and b >= 1
            and 2 <= width <= MAX_WIDTH
            and weight.shape[0] == c
            and conv_state.shape[1:] == (width - 1, c)
            and conv_window.shape[0] == conv_state.shape[0]
            and conv_window.shape[2] == c
            and 1 <= conv_window.shape[1] <= MAX_T
            and query_start_loc.shape == (b + 1,)
            and jnp.dtype(x.dtype) in _DTYPES
            and jnp.dtype(conv_state.dtype) in _DTYPES
            and jnp.dtype(conv_window.dtype) in _DTYPES
            and jnp.issubdtype(weight.dtype, jnp.floating)
            and jnp.issubdtype(query_start_loc.dtype, jnp.integer)
            and jnp.issubdtype(slots.dtype, jnp.integer)
        )
    except (AttributeError, TypeError):
        return False


def _conv_verify_kernel(
    layer_ref,
    qsl_ref,
    slots_ref,
    x_ref,
    state_ref,
    weight_ref,
    window_in_ref,
    *refs,
    num_requests,
    t_max,
    width,
    block_c,
    pad_rows,
    row_group,
    rpp,
    stacked,
):
    y_ref, window_ref = refs[-2:]  # refs[:-2]: an optional y buffer aliased to y_ref (tests)
    del window_in_ref  # aliased to window_ref
    f32 = jnp.float32
    p = pl.program_id(0)
    num_programs = pl.cdiv(num_requests, rpp)
    c0 = pl.program_id(1) * block_c
    n_rows, channels = x_ref.shape
    cols = c0 + jnp.arange(block_c)
    cmask = cols < channels
    cs = pl.ds(c0, block_c)
    at_layer = (layer_ref[0],) if stacked else ()  # the index prefix into layer stacks

    # --- this program's share of the padding rows (zeros), before any early exit.
    pad0 = jnp.minimum(qsl_ref[num_requests], n_rows)
    share = pl.cdiv(n_rows - pad0, num_programs)
    lo = pad0 + p * share
    hi = jnp.minimum(lo + share, n_rows)
    zeros = jnp.zeros((pad_rows, block_c), y_ref.dtype)

    def zero_rows(k, carry):
        row0 = lo + k * pad_rows
        rmask = (row0 + jnp.arange(pad_rows)) < hi
        plgpu.store(y_ref.at[pl.ds(row0, pad_rows), cs], zeros, mask=rmask[:, None] & cmask[None, :])
        return carry

    lax.fori_loop(0, pl.cdiv(hi - lo, pad_rows), zero_rows, 0)  # hi < lo: no iteration

    # Program order = issue order: every load of a group is issued before the first store,
    # because a load placed after a store that depends on an earlier load cannot issue before
    # that earlier load returns (in-order issue): T DRAM latencies instead of one.

    def request(r):
        """(start, length, slot) of request r; length 0 past the last request."""
        if rpp == 1:
            return qsl_ref[r], qsl_ref[r + 1] - qsl_ref[r], slots_ref[r]
        rc = jnp.minimum(r, num_requests - 1)
        start = qsl_ref[rc]
        return start, jnp.where(r < num_requests, qsl_ref[rc + 1] - start, 0), slots_ref[rc]

    def load_state(length, slot):
        # The W-1 raw inputs before x_0 (slot 0 or an empty request: nothing is read).
        live = cmask & (slot > 0) & (length > 0)
        return [
            plgpu.load(state_ref.at[at_layer + (slot, jnp.int32(j), cs)], mask=live, other=0) for j in range(width - 1)
        ]

    def load_rows(start, length, slot, group):
        live = cmask & (slot > 0)
        return [plgpu.load(x_ref.at[start + t, cs], mask=live & (t < length), other=0) for t in group]

    def load_taps():
        return [plgpu.load(weight_ref.at[cs, jnp.int32(i)], mask=cmask, other=0).astype(f32) for i in range(width)]

    def compute_rows(start, length, slot, taps, group, xs, hist):
        """Outputs and saved rows of window positions `group`; hist: the W-1 previous rows (f32)."""
        live = cmask & (slot > 0)
        for t, xt in zip(group, xs):
            valid = t < length
            xf = xt.astype(f32)
            acc = hist[0] * taps[0]  # same summation order as the reference
            for i in range(1, width - 1):
                acc = acc + hist[i] * taps[i]
            acc = acc + xf * taps[width - 1]
            # silu(a) = a / (1 + 2^(-a log2 e)): ex2.approx + div.full, fewer instructions an
            # element than the libdevice expf (the kernel must stay memory-bound).
            y = acc / (1.0 + jnp.exp2(acc * _MINUS_LOG2E))
            plgpu.store(y_ref.at[start + t, cs], y.astype(y_ref.dtype), mask=cmask & valid)
            plgpu.store(
                window_ref.at[at_layer + (slot, jnp.int32(t), cs)], xt.astype(window_ref.dtype), mask=live & valid
            )
            hist = hist[1:] + [xf]
        return hist

    def to_hist(state_rows):  # rounded to x.dtype first, as the reference does
        return [h.astype(x_ref.dtype).astype(f32) for h in state_rows]

    if rpp == 1:
        # --- one request per program; windows longer than row_group go in prefetched groups.
        start, length, slot = request(p)

        @pl.when(length > 0)
        def _():
            hist = to_hist(load_state(length, slot))
            groups = [range(g0, min(g0 + row_group, t_max)) for g0 in range(0, t_max, row_group)]
            pending = load_rows(start, length, slot, groups[0])
            taps = load_taps()  # after the first row loads, so their latencies overlap
            for gi, group in enumerate(groups):
                xs = pending
                if gi + 1 < len(groups):  # prefetch: the next group's loads go out before these stores
                    pending = load_rows(start, length, slot, groups[gi + 1])
                if gi == 0:
                    hist = compute_rows(start, length, slot, taps, group, xs, hist)
                else:  # groups past the request's length do no arithmetic
                    hist = lax.cond(
                        group[0] < length,
                        functools.partial(compute_rows, start, length, slot, taps, group),
                        lambda xs, hist: hist,
                        xs,
                        hist,
                    )
    else:
        # --- rpp consecutive requests per program, straight-line and software-pipelined: all their
        # (start, length, slot) scalars load at once; request k+1's state and rows are issued
        # before request k is computed and stored, so one program keeps DRAM busy through its
        # compute and store phases (and pays the scalar -> row dependent latency once).
        window_rows = range(t_max)
        reqs = [request(p * rpp + k) for k in range(rpp)]

        def load_request(k):
            start, length, slot = reqs[k]
            return load_state(length, slot), load_rows(start, length, slot, window_rows)

        pending = load_request(0)
        taps = load_taps()
        for k in range(rpp):
            state_rows, xs = pending
            if k + 1 < rpp:
                pending = load_request(k + 1)
            start, length, slot = reqs[k]
            compute_rows(start, length, slot, taps, window_rows, xs, to_hist(state_rows))


def conv_verify(
    x,
    conv_state,
    conv_window,
    weight,
    query_start_loc,
    slots,
    *,
    config: ConvVerifyConfig | None = None,
    interpret: bool | None = None,
    y_buffer=None,
    layer=None,
):
    """Packed causal conv verify; same contract as jaxspec.ops.conv.conv_verify.

    x [N, C], conv_state [S1, W-1, C], conv_window [S1, T, C] (aliased to the second output: donate
    it), weight [C, W], query_start_loc [B+1], slots [B] -> (y [N, C], conv_window').
    Each request's length must be <= T = conv_window.shape[1].
    layer: None, or an int / int32 scalar (traced is fine: one kernel serves every layer):
      conv_state [G, S1, W-1, C] and conv_window [G, S1, T, C] are layer stacks, read and written in
      place at that layer (the whole window stack is the aliased output).
    y_buffer: optional [N, C] array of x.dtype aliased to y; every element is overwritten (tests
    pass a NaN-filled one to prove it).
    """
    if not supports_conv_verify(x, conv_state, conv_window, weight, query_start_loc, slots, layer=layer):
        raise ValueError(
            "conv_verify kernel: unsupported shapes/dtypes "
            f"x {x.shape} {x.dtype}, conv_state {conv_state.shape} {conv_state.dtype}, "
            f"conv_window {conv_window.shape} {conv_window.dtype}, weight {weight.shape}, "
            f"query_start_loc {query_start_loc.shape}, slots {slots.shape}"
        )
    if interpret is None:
        interpret = default_interpret()
    config = config or ConvVerifyConfig()
    n, c = x.shape
    b = slots.shape[0]
    width = weight.shape[1]
    t_max = conv_window.shape[-2]
    block_c, num_warps, rpp = config.resolve(b, c, jnp.dtype(x.dtype).itemsize, t_max)
    extra, aliases = (), {6: 1}
    if y_buffer is not None:
        if y_buffer.shape != (n, c) or y_buffer.dtype != x.dtype:
            raise ValueError(f"y_buffer: expected {(n, c)} {x.dtype}, got {y_buffer.shape} {y_buffer.dtype}")
        extra, aliases = (y_buffer,), {6: 1, 7: 0}

    kernel = functools.partial(
        _conv_verify_kernel,
        num_requests=b,
        t_max=t_max,
        width=width,
        block_c=block_c,
        pad_rows=config.pad_rows,
        row_group=config.row_group,
        rpp=rpp,
        stacked=layer is not None,
    )
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((n, c), x.dtype), jax.ShapeDtypeStruct(conv_window.shape, conv_window.dtype)),
        grid=(pl.cdiv(b, rpp), pl.cdiv(c, block_c)),
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="conv_verify",
    )(
        layer_operand(layer),
        query_start_loc.astype(jnp.int32),
        slots.astype(jnp.int32),
        x,
        conv_state,
        weight,
        conv_window,
        *extra,
    )
