import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.spec.layout import dense_layout, packed_layout, step_layout, tier_for, tiers, unpack_rows


@pytest.mark.parametrize("num_tiers", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("block", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("batch", [1, 3, 8, 13, 64])
def test_tiers(batch, block, num_tiers):
    tier_tokens, budgets = tiers(batch, block, num_tiers)
    assert len(tier_tokens) == len(budgets) and 1 <= len(tier_tokens) <= num_tiers
    assert all(isinstance(t, int) for t in tier_tokens)
    assert all(a < b for a, b in zip(tier_tokens, tier_tokens[1:])), "strictly increasing"
    assert tier_tokens[-1] == batch * block
    if num_tiers >= 2:
        assert tier_tokens[0] == batch
    # only the exact ends (batch, batch * block) may break the multiple-of-8 rule
    assert all(t % 8 == 0 for t in tier_tokens if t not in (batch, batch * block))
    assert budgets == tuple(t - batch for t in tier_tokens)
    assert budgets[-1] == batch * (block - 1) and all(0 <= n <= batch * (block - 1) for n in budgets)


def test_tiers_values():
    assert tiers(8, 16) == ((8, 24, 56, 128), (0, 16, 48, 120))
    assert tiers(4, 8) == ((4, 8, 16, 32), (0, 4, 12, 28))  # 4 * 8**(1/3) is 8 up to rounding: not 16
    assert tiers(1, 16) == ((1, 8, 16), (0, 7, 15))  # the two middle tiers both round to 8
    assert tiers(3, 2) == ((3, 6), (0, 3))
    assert tiers(4, 8, 1) == ((32,), (28,))
    assert tiers(5, 1) == ((5,), (0,))
    for bad in ((0, 4), (4, 0), (4, 4, 0), (2.0, 4)):
        with pytest.raises(ValueError):
            tiers(*bad)


def test_tier_for():
    tier_tokens, _ = tiers(8, 16)
    for total in range(0, 129):
        i = tier_for(total, tier_tokens)
        assert tier_tokens[i] >= total and (i == 0 or tier_tokens[i - 1] < total)
    assert [tier_for(n, tier_tokens) for n in (8, 9, 24, 25, 56, 57, 128)] == [0, 1, 1, 2, 2, 3, 3]
    with pytest.raises(ValueError):
        tier_for(129, tier_tokens)


def numpy_packed(lengths, anchors, drafts, slots, tier):
    tokens, qsl = [], [0]
    for r in range(len(slots)):
        n = 0 if slots[r] == 0 else 1 + min(max(int(lengths[r]), 0), drafts.shape[1])
        tokens += ([int(anchors[r])] + drafts[r].tolist())[:n]
        qsl.append(qsl[-1] + n)
    assert len(tokens) <= tier
    return np.array(tokens + [0] * (tier - len(tokens)), np.int32), np.array(qsl, np.int32)


@functools.partial(jax.jit, static_argnames="tier")
def packed_jit(lengths, anchors, drafts, slots, tier):
    return packed_layout(lengths, anchors, drafts, slots, tier)


def random_case(rng, b, d):
    lengths = rng.integers(0, d + 1, size=b).astype(np.int32)
    lengths[rng.integers(b)] = d  # the max
    lengths[rng.integers(b)] = 0  # an anchor-only window
    slots = rng.permutation(np.arange(1, b + 1)).astype(np.int32)
    slots[rng.random(b) < 0.3] = 0  # null-slot requests (their lengths need not be 0)
    anchors = rng.integers(1, 1000, size=b).astype(np.int32)
    drafts = rng.integers(1, 1000, size=(b, d)).astype(np.int32)
    return lengths, anchors, drafts, slots


@pytest.mark.parametrize("b,block", [(1, 2), (3, 4), (5, 8), (8, 16)])
def test_packed_layout(b, block):
    rng = np.random.default_rng(b * 100 + block)
    d = block - 1
    tier_tokens, _ = tiers(b, block)
    for case in range(6):
        lengths, anchors, drafts, slots = random_case(rng, b, d)
        need = int(np.where(slots > 0, lengths + 1, 0).sum())
        tier = tier_tokens[tier_for(need, tier_tokens)]
        for t in {tier, tier_tokens[-1]}:  # the smallest tier that holds it, and the largest (more padding)
            tokens, qsl, out_slots = packed_jit(lengths, anchors, drafts, slots, tier=t)
            want_tokens, want_qsl = numpy_packed(lengths, anchors, drafts, slots, t)
            np.testing.assert_array_equal(tokens, want_tokens, f"case {case} tier {t}")
            np.testing.assert_array_equal(qsl, want_qsl)
            np.testing.assert_array_equal(out_slots, slots)
            assert tokens.shape == (t,) and tokens.dtype == jnp.int32 and qsl.dtype == jnp.int32
            # round trip to the fixed acceptance shape
            rows = np.asarray(unpack_rows(tokens, qsl, block))
            assert rows.shape == (b, block)
            for r in range(b):
                n = want_qsl[r + 1] - want_qsl[r]
                np.testing.assert_array_equal(rows[r, :n], ([anchors[r]] + drafts[r].tolist())[:n])
                assert not rows[r, n:].any()


def test_packed_layout_edge_cases():
    anchors = np.array([11, 22, 33], np.int32)
    drafts = np.array([[1, 2, 3], [4, 5, 6], [7, 8, 9]], np.int32)
    slots = np.array([2, 0, 1], np.int32)
    # lengths out of range are clipped; the null slot gets no rows; leftover rows are padding
    tokens, qsl, _ = packed_jit(np.array([5, 3, -1], np.int32), anchors, drafts, slots, tier=8)
    np.testing.assert_array_equal(qsl, [0, 4, 4, 5])
    np.testing.assert_array_equal(tokens, [11, 1, 2, 3, 33, 0, 0, 0])
    # all null: only padding
    tokens, qsl, _ = packed_jit(np.array([3, 3, 3], np.int32), anchors, drafts, np.zeros(3, np.int32), tier=3)
    np.testing.assert_array_equal(qsl, [0, 0, 0, 0])
    assert not np.asarray(tokens).any()
    # exact fit: no padding
    tokens, qsl, _ = packed_jit(np.array([0, 1, 2], np.int32), anchors, drafts, np.array([1, 2, 3], np.int32), tier=6)
    np.testing.assert_array_equal(tokens, [11, 22, 4, 33, 7, 8])
    np.testing.assert_array_equal(qsl, [0, 1, 3, 6])


def test_dense_layout():
    rng = np.random.default_rng(5)
    for b, block in [(1, 2), (3, 4), (8, 16)]:
        d = block - 1
        anchors = rng.integers(1, 1000, size=b).astype(np.int32)
        drafts = rng.integers(1, 1000, size=(b, d)).astype(np.int32)
        slots = np.arange(1, b + 1, dtype=np.int32)
        tokens, qsl, out_slots = jax.jit(dense_layout)(anchors, drafts, slots)
        np.testing.assert_array_equal(tokens, np.concatenate([anchors[:, None], drafts], 1).reshape(-1))
        np.testing.assert_array_equal(qsl, np.arange(b + 1) * block)
        np.testing.assert_array_equal(out_slots, slots)
        # equals the packed layout when every request verifies its whole block at the full tier
        full = np.full(b, d, np.int32)
        for x, y in zip(packed_jit(full, anchors, drafts, slots, tier=b * block), (tokens, qsl, out_slots)):
            np.testing.assert_array_equal(x, y)
        # step_layout picks dense at the full tier (whatever the lengths), packed below it
        lengths = rng.integers(0, d + 1, size=b).astype(np.int32)
        for x, y in zip(step_layout(lengths, anchors, drafts, slots, b * block), (tokens, qsl, out_slots)):
            np.testing.assert_array_equal(x, y)
        tier = tiers(b, block)[0][-2] if len(tiers(b, block)[0]) > 1 else b
        if tier >= int((lengths + 1).sum()):
            for x, y in zip(
                step_layout(lengths, anchors, drafts, slots, tier), packed_layout(lengths, anchors, drafts, slots, tier)
            ):
                np.testing.assert_array_equal(x, y)
        # unpack of the dense layout is a reshape
        np.testing.assert_array_equal(unpack_rows(tokens, qsl, block), np.asarray(tokens).reshape(b, block))


def test_unpack_rows_trailing_dims():
    """Per-row outputs (e.g. logits [tier, V]) come back as [B, block, V] with zero rows past each window."""
    rng = np.random.default_rng(9)
    b, block, v = 4, 5, 3
    lengths = np.array([4, 0, 2, 1], np.int32)
    slots = np.array([1, 2, 0, 3], np.int32)
    _, qsl, _ = packed_layout(lengths, np.zeros(b, np.int32), np.zeros((b, block - 1), np.int32), slots, 16)
    x = rng.standard_normal((16, v)).astype(np.float32)
    rows = np.asarray(jax.jit(unpack_rows, static_argnums=2)(x, qsl, block))
    assert rows.shape == (b, block, v)
    qsl = np.asarray(qsl)
    for r in range(b):
        n = qsl[r + 1] - qsl[r]
        np.testing.assert_array_equal(rows[r, :n], x[qsl[r] : qsl[r + 1]])
        assert not rows[r, n:].any()
