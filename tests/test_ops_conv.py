import jax.numpy as jnp
import numpy as np
import oracle
import pytest

from jaxspec.ops.conv import conv_commit, conv_prefill, conv_verify

W = 4
TOL = 1e-5


@pytest.mark.parametrize("C", [37, 64])
@pytest.mark.parametrize("lengths", [[9, 1, 2], [5, 0, 9, 3]], ids=["9-1-2", "5-0-9-3"])
def test_conv_prefill(lengths, C):
    rng = np.random.default_rng(10 + C)
    B, T = len(lengths), 9
    x = rng.standard_normal((B, T, C)).astype(np.float32)
    w = (rng.standard_normal((C, W)) * 0.5).astype(np.float32)
    y, state = conv_prefill(jnp.asarray(x), jnp.asarray(w), jnp.asarray(lengths, jnp.int32), impl="ref")
    y, state = np.asarray(y), np.asarray(state)
    assert y.shape == (B, T, C) and state.shape == (B, W - 1, C)
    for b, n in enumerate(lengths):
        if n:
            oracle.assert_close(y[b, :n], oracle.causal_conv(x[b, :n], w), TOL, f"y[{b}]")
        assert not y[b, n:].any(), f"rows >= length of request {b} must be 0"
        # the state is raw inputs: exact
        np.testing.assert_array_equal(state[b], oracle.last_inputs(x[b, :n], W - 1), f"state[{b}]")


# Packed verify layout: (slot, window length, history length). Slot 0 is a padding request,
# slot 2 is not in the batch, history shorter than W-1 means zero-padded state.
REQUESTS = [(3, 3, 10), (0, 2, 0), (1, 0, 2), (4, 5, 1), (5, 1, 0)]
S1, T_MAX, N_PAD = 6, 5, 3


@pytest.mark.parametrize("accept", ["none", "all", "mixed"])
@pytest.mark.parametrize("C", [37, 16])
def test_conv_verify_commit(C, accept):
    rng = np.random.default_rng(20 + C)
    slots = np.array([s for s, _, _ in REQUESTS], np.int32)
    lens = np.array([n for _, n, _ in REQUESTS])
    qsl = oracle.qsl_from_lengths(lens)
    N = qsl[-1] + N_PAD
    w = (rng.standard_normal((C, W)) * 0.5).astype(np.float32)
    x = rng.standard_normal((N, C)).astype(np.float32)
    state = rng.standard_normal((S1, W - 1, C)).astype(np.float32)  # slot 0, 2: garbage
    hist = {}
    for s, _, p in REQUESTS:
        if s:
            hist[s] = rng.standard_normal((p, C)).astype(np.float32)
            state[s] = oracle.last_inputs(hist[s], W - 1)
    window = rng.standard_normal((S1, T_MAX, C)).astype(np.float32)  # stale contents

    y, window2 = conv_verify(
        jnp.asarray(x),
        jnp.asarray(state),
        jnp.asarray(window),
        jnp.asarray(w),
        jnp.asarray(qsl),
        jnp.asarray(slots),
        impl="ref",
    )
    y, window2 = np.asarray(y), np.asarray(window2)

    exp_window = window.copy()
    for r, (s, n, p) in enumerate(REQUESTS):
        rows = slice(qsl[r], qsl[r + 1])
        if s == 0:
            assert not y[rows].any(), "slot-0 request must output 0"
            continue
        exp_window[s, :n] = x[rows]
        if n:
            full = oracle.causal_conv(np.concatenate([hist[s], x[rows]]), w)
            oracle.assert_close(y[rows], full[p:], TOL, f"y of request {r}")
    assert not y[qsl[-1] :].any(), "padding rows must output 0"
    np.testing.assert_array_equal(oracle.bits(window2), oracle.bits(exp_window), "conv_window'")

    # commit: requests with at least the anchor; the slot-0 request too (must write nothing)
    live = [r for r, (s, n, p) in enumerate(REQUESTS) if n > 0]
    acc = {"none": lambda n: 0, "all": lambda n: n - 1, "mixed": lambda n: n // 2}[accept]
    num_acc = np.array([acc(lens[r]) for r in live], np.int32)
    state2 = np.asarray(
        conv_commit(
            jnp.asarray(state), jnp.asarray(window2), jnp.asarray(slots[live]), jnp.asarray(num_acc), impl="ref"
        )
    )
    exp_state = state.copy()
    for r, a in zip(live, num_acc):
        s = slots[r]
        if s:
            accepted = np.concatenate([hist[s], x[qsl[r] : qsl[r] + a + 1]])
            exp_state[s] = oracle.last_inputs(accepted, W - 1)
    np.testing.assert_array_equal(oracle.bits(state2), oracle.bits(exp_state), "conv_state'")
