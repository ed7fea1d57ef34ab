"""Sampling: the processed target distribution against an independent numpy reference, greedy
acceptance on hand-made cases, and losslessness of speculative sampling by a chi-square test on
the first emitted tokens of a small Markov target (with wrong rules to show the test has power).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from stats import chi2_test

from jaxspec.ops.sampling import (
    SamplingParams,
    accept,
    draft_distribution,
    greedy_tokens,
    logit_stats,
    processed_draft,
    sample_draft,
    target_distribution,
)

# jitted entry points (eager dispatch of many small ops is slower than one compile on CPU)
_target_distribution = jax.jit(target_distribution, static_argnums=2)
_accept = jax.jit(accept)

# ------------------------------------------------------------------------------ numpy reference


def np_target(logits, temperature, top_k, top_p, max_top_k):
    """One row, float64, written from the spec: -> (probs [k_max], ids [k_max])."""
    logits = np.asarray(logits, np.float64)
    vocab = logits.shape[0]
    k_max = min(max_top_k, vocab)
    order = sorted(range(vocab), key=lambda i: (-logits[i], i))[:k_max]  # ties: lower id first
    ids = np.array(order, np.int64)
    k = k_max if (top_k <= 0 or top_k >= vocab) else min(top_k, k_max)
    probs = np.zeros(k_max)
    if temperature <= 0:
        probs[0] = 1.0
        return probs, ids
    z = logits[ids[:k]] / temperature
    if not np.isfinite(z.max()):
        probs[0] = 1.0
        return probs, ids
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p < 1.0:
        mass, n = 0.0, 0
        while n < k:
            mass += p[n]
            n += 1
            if mass >= top_p:
                break
        # keep the float32 implementation away from an ambiguous boundary
        assert n == k or abs(mass - top_p) > 1e-4 and abs(mass - p[n - 1] - top_p) > 1e-4, "boundary too close"
        p[n:] = 0.0
        p /= p.sum()
    probs[:k] = p
    return probs, ids


def np_target_rows(logits, temperature, top_k, top_p, max_top_k):
    out = [np_target(l, t, k, p, max_top_k) for l, t, k, p in zip(logits, temperature, top_k, top_p)]
    return np.stack([o[0] for o in out]), np.stack([o[1] for o in out])


# ------------------------------------------------------------------------------ target_distribution

VOCAB = 40


def _mixed_rows(rng):
    """Rows that cover ties, -inf, top_k 1 / vocab / 0 / above max, top_p small / 1, temperatures."""
    rows, params = [], []
    temps = [1.0, 0.05, 25.0, 0.0, 0.7]
    top_ks = [0, 1, 5, VOCAB, VOCAB + 3, 12]
    top_ps = [1.0, 0.03, 0.9, 0.5]
    for i in range(24):
        kind = i % 4
        if kind == 0:
            l = rng.standard_normal(VOCAB) * 2.0
        elif kind == 1:  # heavy ties
            l = rng.integers(-2, 3, VOCAB).astype(np.float64)
        elif kind == 2:  # some -inf
            l = rng.standard_normal(VOCAB)
            l[rng.choice(VOCAB, VOCAB // 2, replace=False)] = -np.inf
        else:  # almost all -inf, fewer finite than k
            l = np.full(VOCAB, -np.inf)
            l[[3, 17, 30]] = [0.5, 0.5, -1.0]
        rows.append(l)
        params.append((temps[i % 5], top_ks[i % 6], top_ps[(i // 2) % 4]))
    rows.append(np.full(VOCAB, -np.inf))  # all -inf: one-hot on the first entry
    params.append((1.0, 0, 1.0))
    rows.append(np.zeros(VOCAB))  # all tied
    params.append((1.0, 7, 1.0))
    t, k, p = (np.array(x) for x in zip(*params))
    return np.stack(rows).astype(np.float32), t.astype(np.float32), k.astype(np.int32), p.astype(np.float32)


@pytest.mark.parametrize("max_top_k", [VOCAB, 8, 2 * VOCAB])
def test_target_distribution_matches_reference(max_top_k):
    rng = np.random.default_rng(0)
    logits, t, k, p = _mixed_rows(rng)
    params = SamplingParams(jnp.asarray(t), jnp.asarray(k), jnp.asarray(p))
    probs, ids = _target_distribution(jnp.asarray(logits), params, max_top_k)
    ref_p, ref_ids = np_target_rows(logits, t, k, p, max_top_k)
    k_max = min(max_top_k, VOCAB)
    assert probs.shape == (len(logits), k_max) and probs.dtype == jnp.float32
    assert ids.shape == (len(logits), k_max) and ids.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(ids), ref_ids)
    np.testing.assert_allclose(np.asarray(probs), ref_p, atol=2e-6, rtol=1e-5)
    assert np.all(np.isfinite(np.asarray(probs)))
    np.testing.assert_allclose(np.asarray(probs).sum(-1), 1.0, atol=1e-5)


def test_top_k_ties_lower_id_first():
    logits = jnp.array([[0.0, 2.0, 1.0, 2.0, 2.0, 1.0, 0.0, 2.0], [5.0] * 8], jnp.float32)
    probs, ids = _target_distribution(logits, SamplingParams.create(2, 1.0, 0, 1.0), 8)
    np.testing.assert_array_equal(np.asarray(ids), [[1, 3, 4, 7, 2, 5, 0, 6], list(range(8))])
    np.testing.assert_allclose(np.asarray(probs[1]), 1 / 8, rtol=1e-6)
    # top_k = 2 on four tied maxima keeps the two lowest ids
    probs, ids = _target_distribution(logits, SamplingParams.create(2, 1.0, 2, 1.0), 8)
    np.testing.assert_allclose(np.asarray(probs[:, :2]), 0.5, rtol=1e-6)
    assert not np.asarray(probs[:, 2:]).any()
    # greedy: one-hot on the lowest id of the maxima, same as greedy_tokens
    probs, ids = _target_distribution(logits, SamplingParams.greedy(2), 3)
    np.testing.assert_array_equal(np.asarray(probs), [[1, 0, 0], [1, 0, 0]])
    np.testing.assert_array_equal(np.asarray(ids[:, 0]), [1, 0])
    np.testing.assert_array_equal(np.asarray(greedy_tokens(logits)), [1, 0])
    # bfloat16 logits with ties
    _, ids = _target_distribution(logits.astype(jnp.bfloat16), SamplingParams.create(2, 1.0), 4)
    np.testing.assert_array_equal(np.asarray(ids), [[1, 3, 4, 7], [0, 1, 2, 3]])


def test_target_distribution_block_rows_and_vmap():
    """[B, T, vocab] logits with [B] params equal the flattened [B*T] call; vmap agrees."""
    rng = np.random.default_rng(1)
    B, T = 3, 4
    logits = jnp.asarray(rng.standard_normal((B, T, VOCAB)).astype(np.float32))
    params = SamplingParams.create(B, [0.0, 0.8, 1.3], [0, 5, 9], [1.0, 0.7, 0.95])
    probs, ids = _target_distribution(logits, params, 10)
    flat = SamplingParams(*(jnp.repeat(x, T) for x in (params.temperature, params.top_k, params.top_p)))
    fp, fi = _target_distribution(logits.reshape(B * T, VOCAB), flat, 10)
    np.testing.assert_array_equal(np.asarray(probs).reshape(B * T, -1), np.asarray(fp))
    np.testing.assert_array_equal(np.asarray(ids).reshape(B * T, -1), np.asarray(fi))
    vp, vi = jax.vmap(lambda l, t, k, p: target_distribution(l, SamplingParams(t, k, p), 10))(
        logits,
        params.temperature[:, None].repeat(T, 1),
        params.top_k[:, None].repeat(T, 1),
        params.top_p[:, None].repeat(T, 1),
    )
    np.testing.assert_allclose(np.asarray(vp), np.asarray(probs), atol=1e-7)
    np.testing.assert_array_equal(np.asarray(vi), np.asarray(ids))


def test_draft_distribution_and_sample():
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((2, 3, VOCAB)).astype(np.float32)
    logits[0, 1, [4, 9]] = 10.0  # tie at the argmax
    q = jax.jit(draft_distribution)(jnp.asarray(logits, jnp.bfloat16), jnp.array([0.0, 0.5]))
    logits = np.asarray(jnp.asarray(logits, jnp.bfloat16).astype(jnp.float32))  # what the draft saw
    dense = np.asarray(q.prob_at(jnp.broadcast_to(jnp.arange(VOCAB), (2, 3, VOCAB))))
    assert dense.dtype == np.float32 and q.lse.shape == (2, 3)
    np.testing.assert_array_equal(dense[0], np.eye(VOCAB)[logits[0].argmax(-1)])
    assert dense[0, 1, 4] == 1.0
    z = logits[1].astype(np.float64) / 0.5
    e = np.exp(z - z.max(-1, keepdims=True))
    np.testing.assert_allclose(dense[1], e / e.sum(-1, keepdims=True), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(q.lse[1]), np.log(np.exp(z).sum(-1)), rtol=1e-6)
    # ids outside the vocabulary are clipped (never an out-of-bounds gather)
    np.testing.assert_array_equal(np.asarray(q.prob_at(jnp.full((2, 3, 1), VOCAB + 5))), dense[..., -1:])
    keys = jax.random.split(jax.random.key(0), 2)
    tok = jax.jit(sample_draft)(keys, q)
    assert tok.shape == (2, 3) and tok.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(tok[0]), logits[0].argmax(-1))
    # one key per request: a request's draws do not depend on its batch
    q1 = jax.tree_util.tree_map(lambda a: a[1], q)
    np.testing.assert_array_equal(np.asarray(sample_draft(keys[1], q1)), np.asarray(tok[1]))
    # zero-probability tokens are never drawn; the draws follow q (chi-square, 3 cells). The draft
    # temperature is 0.5 on logits 0.5 log(q), so a sampler that drops or repeats the temperature
    # draws from another distribution.
    q3 = np.array([0.2, 0.3, 0.5])
    qs = draft_distribution(jnp.full((6000, VOCAB), -jnp.inf).at[:, [2, 5, 7]].set(0.5 * jnp.log(q3)), 0.5)

    def p_value(sampler):
        draws = np.asarray(jax.jit(sampler)(jax.random.key(3), qs))
        assert set(np.unique(draws)) == {2, 5, 7}
        return chi2_test([(draws == v).sum() for v in (2, 5, 7)], q3)[2]

    assert p_value(sample_draft) > 1e-3
    # Controls: wrong samplers written here must fail the same check with the same 6000 draws.
    # Measured (2026-12, keys 3..5): chi-square 200-206, 647-693 and 3497-3648 on 2 degrees of
    # freedom (p = 0.0 in float32) for the three; the right sampler p = 0.58, 0.59, 0.93.
    wrong = {
        "temperature ignored": lambda key, q: jax.random.categorical(key, q.logits),  # q ~ sqrt(q3)
        "temperature applied twice": lambda key, q: jax.random.categorical(key, q.scaled() / 0.5),  # ~ q3^2
        "uniform instead of Gumbel noise": lambda key, q: jnp.argmax(
            q.scaled() + jax.random.uniform(key, q.logits.shape), axis=-1
        ),
    }
    for name, sampler in wrong.items():
        assert p_value(sampler) < 1e-3, name


@pytest.mark.parametrize("vocab", [1, 7, 300])
def test_logit_stats_against_float64(vocab):
    """argmax, zmax, ties, rest against a float64 numpy oracle: ties at the maximum, a NaN row, an
    all -inf row, +inf entries, a near-one q_max (rest far below float32's epsilon)."""
    rng = np.random.default_rng(vocab)
    z = (rng.standard_normal((6, vocab)) * 3).astype(np.float32)
    z[1, : min(3, vocab)] = z[1].max() + 1.0  # tied maxima
    z[2, vocab // 2] = np.nan
    z[3] = -np.inf
    z[4, vocab - 1] = np.inf
    z[5] = -60.0
    z[5, 0] = 0.0  # q_max = 1 - 1e-26 in exact arithmetic
    am, zmax, ties, rest = (np.asarray(a) for a in jax.jit(logit_stats)(jnp.asarray(z)))
    np.testing.assert_array_equal(am, np.asarray(jnp.argmax(jnp.asarray(z), axis=-1)))
    for r in range(6):
        row = z[r].astype(np.float64)
        if np.isnan(row).any():
            assert np.isnan(zmax[r]) and ties[r] == 0 and np.isnan(rest[r])
            continue
        m = row.max()
        assert zmax[r] == m and ties[r] == (row == m).sum()
        others = row[row != m]
        want = np.exp(others - m).sum() if len(others) else 0.0
        np.testing.assert_allclose(rest[r], want, rtol=1e-5, atol=0)


# ------------------------------------------------------------------------------ greedy acceptance


def test_greedy_accept_every_length_and_cap():
    """T = 5: for every true match length m in 0..4 and every cap l in 0..4, accepted = min(m, l),
    bonus = argmax of row min(m, l). Rows after the cap are NaN garbage and must not be read."""
    T, V = 5, 12
    argmax = np.array([3, 7, 1, 4, 9])
    cases = [(m, l) for m in range(T) for l in range(T)]
    B = len(cases)
    logits = np.tile(np.arange(V, dtype=np.float32) * 0.01, (B, T, 1))
    for t in range(T):
        logits[:, t, argmax[t]] = 5.0
        logits[:, t, argmax[t] + 1] = 5.0  # tie: the lower id wins
    probs, ids = _target_distribution(jnp.asarray(logits), SamplingParams.greedy(B), 4)
    probs, ids = np.asarray(probs).copy(), np.asarray(ids)
    drafts = np.zeros((B, T - 1), np.int32)
    nv = np.zeros(B, np.int32)
    for b, (m, l) in enumerate(cases):
        drafts[b] = argmax[: T - 1]
        if m < T - 1:
            drafts[b, m] = argmax[m] + 1  # the tied, higher id: a mismatch
        nv[b] = l
        probs[b, l + 1 :] = np.nan  # rows past the cap are garbage
    keys = jax.random.split(jax.random.key(0), B)
    rng = np.random.default_rng(0)
    q = rng.dirichlet(np.ones(V), (B, T - 1)).astype(np.float32)
    for draft_q in (None, _as_distribution(q)):
        a, bonus, emitted = _accept(
            keys, jnp.asarray(probs), jnp.asarray(ids), jnp.asarray(drafts), draft_q, jnp.asarray(nv), jnp.zeros(B)
        )
        a, bonus, emitted = np.asarray(a), np.asarray(bonus), np.asarray(emitted)
        for b, (m, l) in enumerate(cases):
            n = min(m, l)
            assert a[b] == n, (m, l)
            assert bonus[b] == argmax[n], (m, l)
            np.testing.assert_array_equal(emitted[b], list(argmax[:n]) + [argmax[n]] + [-1] * (T - 1 - n))
        assert a.dtype == np.int32 and bonus.dtype == np.int32 and emitted.dtype == np.int32


def _as_distribution(q):
    """A DraftDistribution whose q is the given [..., V] probabilities (softmax of their logs)."""
    return draft_distribution(jnp.log(jnp.asarray(q, jnp.float32)), 1.0)


def test_sampling_accept_edges_and_per_request_keys():
    """p one-hot: sampling acceptance is the greedy rule; rows beyond the cap are garbage;
    each request's result depends only on its own key."""
    T, V, K = 4, 10, 3
    B = 6
    probs = np.zeros((B, T, K), np.float32)
    probs[:, :, 0] = 1.0
    ids = np.tile(np.array([5, 1, 2]), (B, T, 1)).astype(np.int32)
    drafts = np.array([[5, 5, 5], [5, 1, 5], [1, 5, 5], [5, 5, 5], [5, 5, 2], [5, 5, 5]], np.int32)
    nv = np.array([3, 3, 3, 1, 3, 0], np.int32)
    q = np.full((B, T - 1, V), 1.0 / V, np.float32)
    keys = jax.random.split(jax.random.key(1), B)
    a, bonus, emitted = _accept(
        keys,
        jnp.asarray(probs),
        jnp.asarray(ids),
        jnp.asarray(drafts),
        _as_distribution(q),
        jnp.asarray(nv),
        jnp.ones(B),
    )
    np.testing.assert_array_equal(np.asarray(a), [3, 1, 0, 1, 2, 0])
    np.testing.assert_array_equal(np.asarray(bonus), [5] * B)
    assert np.asarray(emitted)[1].tolist() == [5, 5, -1, -1]
    # per-request reproducibility: a random target, then a sub-batch in another order
    rng = np.random.default_rng(3)
    probs = rng.dirichlet(np.ones(K), (B, T)).astype(np.float32)
    ids = np.stack([rng.permutation(V)[:K] for _ in range(B * T)]).reshape(B, T, K).astype(np.int32)
    drafts = ids[:, :-1, 0]
    q = rng.dirichlet(np.ones(V), (B, T - 1)).astype(np.float32)
    nv = np.array([3, 2, 3, 1, 0, 3], np.int32)
    dist = _as_distribution(q)
    full = _accept(keys, *map(jnp.asarray, (probs, ids, drafts)), dist, jnp.asarray(nv), jnp.full(B, 0.9))
    sub = np.array([4, 1, 5])
    part = _accept(
        keys[sub],
        *(jnp.asarray(x[sub]) for x in (probs, ids, drafts)),
        jax.tree_util.tree_map(lambda a: a[sub], dist),
        jnp.asarray(nv[sub]),
        jnp.full(3, 0.9),
    )
    for f, p in zip(full, part):
        np.testing.assert_array_equal(np.asarray(f)[sub], np.asarray(p))
    # vmappable: two halves of the batch under vmap give the same result
    halve = lambda a: jnp.asarray(a).reshape((2, 3) + a.shape[1:])
    halves = jax.vmap(accept)(
        keys.reshape(2, 3),
        *map(halve, (probs, ids, drafts)),
        jax.tree_util.tree_map(halve, dist),
        halve(nv),
        jnp.full((2, 3), 0.9),
    )
    for f, h in zip(full, halves):
        np.testing.assert_array_equal(np.asarray(f), np.asarray(h).reshape(np.asarray(f).shape))


# ------------------------------------------------------------------------------ losslessness

V = 16
T = 4  # anchor + 3 drafts
N_SAMPLES = 50_000
N_TOKENS = 3  # the first 3 emitted tokens are compared with the exact target


def _tables():
    rng = np.random.default_rng(7)
    target = (rng.standard_normal((V, V)) * 1.6).astype(np.float32)
    # a draft that is correlated with the target but clearly different
    draft = (0.6 * target + rng.standard_normal((V, V)) * 1.2).astype(np.float32)
    return target, draft


# Acceptance rules the simulation can run (a traced int): the library's `accept`, a rule written
# here from the spec (a positive control: it must pass the lossless check, so the wrong variants
# below fail for their bug and not for a slip of this re-implementation), and wrong variants of
# it, each a bug that must fail the same check at the same sample size.
LIBRARY = 0
TEST_RULE = 1  # the spec's rule, re-implemented below
BONUS_FROM_P = 2  # after a rejection the bonus is drawn from p instead of the residual
UNNORMALISED = 3  # the residual max(p - q, 0) used without renormalising; its missing mass comes from p
CAP_AS_REJECTION = 4  # off by one at the cap: `a <= cap` taken as a rejection, so a capped bonus is residual
INVERTED_RATIO = 5  # accept with min(1, q / p) instead of min(1, p / q)
GREEDY_MATCH = 6  # accept a draft iff it is the target's argmax (the greedy rule while sampling)
BUGS = {
    "bonus-from-p": BONUS_FROM_P,
    "unnormalised-residual": UNNORMALISED,
    "cap-as-rejection": CAP_AS_REJECTION,
    "inverted-ratio": INVERTED_RATIO,
    "greedy-match": GREEDY_MATCH,
}


def _test_rule_one(rule, key, probs, ids, drafts, q_at_draft, q_at_ids, nv):
    """The sampling rule for one request, written from `accept`'s docstring (temperature > 0):
    probs / ids [T, K], drafts [T-1], q_at_draft [T-1], q_at_ids [T-1, K]; `rule` (traced)
    TEST_RULE or one of the bugs. -> (a, bonus, emitted [T])."""
    key_u, key_bonus = jax.random.split(key)
    p_at_draft = jnp.sum(jnp.where(ids[:-1] == drafts[:, None], probs[:-1], 0.0), axis=-1)
    u = jax.random.uniform(key_u, (T - 1,))
    argmax_tok = ids[jnp.arange(T), jnp.argmax(probs, axis=-1)]
    ok = jnp.select(
        [rule == INVERTED_RATIO, rule == GREEDY_MATCH],
        [u * p_at_draft < q_at_draft, drafts == argmax_tok[:-1]],
        u * q_at_draft < p_at_draft,
    )
    ok = ok & (jnp.arange(T - 1) < nv)
    a = jnp.sum(jnp.cumprod(ok.astype(jnp.int32)))
    p_a, q_a = probs[a], q_at_ids[jnp.minimum(a, T - 2)]
    rejected = jnp.where(rule == CAP_AS_REJECTION, a <= nv, a < nv)
    residual = jnp.maximum(p_a - q_a, 0.0)
    mass = jnp.sum(residual)
    w = jnp.where(mass > 0, residual / mass, p_a)
    w = jnp.where(rule == UNNORMALISED, residual + (1.0 - mass) * p_a, w)
    w = jnp.where(rejected & (rule != BONUS_FROM_P), w, p_a)
    bonus = ids[a, jax.random.categorical(key_bonus, jnp.log(w))]
    emitted = jnp.where(jnp.arange(T) < a, jnp.append(drafts, 0), jnp.where(jnp.arange(T) == a, bonus, -1))
    return a, bonus, emitted


def _accept_rule(rule, keys, probs, ids, drafts, q, nv, temperature):
    """LIBRARY: jaxspec's accept; otherwise `_test_rule_one` with that rule."""

    def test_rule(_):
        if q is None:  # greedy drafts: q is one-hot on the draft token, as accept documents
            q_at_draft = jnp.ones(drafts.shape, jnp.float32)
            q_at_ids = (ids[:, :-1] == drafts[..., None]).astype(jnp.float32)
        else:
            q_at_draft, q_at_ids = q.prob_at(drafts[..., None])[..., 0], q.prob_at(ids[:, :-1])
        return jax.vmap(functools.partial(_test_rule_one, rule))(keys, probs, ids, drafts, q_at_draft, q_at_ids, nv)

    library = lambda _: accept(keys, probs, ids, drafts, q, nv, temperature)
    return jax.lax.cond(rule == LIBRARY, library, test_rule, None)


RANDOM_CAP = -1


@functools.partial(jax.jit, static_argnames=("max_top_k", "greedy_draft", "processed"))
def _simulate(key, target_tab, draft_tab, params, draft_temp, cap, rule, *, max_top_k, greedy_draft, processed=False):
    """N_SAMPLES independent generations from anchor 0 by speculative decoding; -> first N_TOKENS
    emitted tokens [N, N_TOKENS]. The draft samples autoregressively at draft_temp [N]; greedy_draft
    passes q = None (draft_temp must then be 0). cap (traced int): T-1 = verify every draft, 0..T-2 =
    a fixed cap, RANDOM_CAP = a cap drawn uniformly in 0..T-1 per request per step (drawn from its
    own key, independent of the drafts' values). rule (traced int): the acceptance rule, LIBRARY or
    one of the test's rules (`_accept_rule`). processed: the draft draws from its logits under the
    requests' own processing (`processed_draft`: top-k, temperature, top-p), as the engine does."""
    n = N_SAMPLES
    keys = jax.random.split(key, n)

    def draft_step(carry, k):  # k [N] keys, one per request
        if processed:
            q = processed_draft(draft_tab[carry][:, None], params, max_top_k)
            q = jax.tree_util.tree_map(lambda a: a[:, 0], q)
        else:
            q = draft_distribution(draft_tab[carry], draft_temp)
        d = sample_draft(k, q)
        return d, (d, q)

    def spec_step(carry, step):  # each step emits >= 1 token
        anchor, out, count = carry
        step_keys = jax.vmap(lambda k: jax.random.split(jax.random.fold_in(k, step), T + 1))(keys)
        _, (drafts, qs) = jax.lax.scan(draft_step, anchor, jnp.swapaxes(step_keys[:, : T - 1], 0, 1))
        drafts = drafts.T  # [N, T-1]
        q = None if greedy_draft else jax.tree_util.tree_map(lambda a: jnp.swapaxes(a, 0, 1), qs)  # rows [N, T-1]
        window = jnp.concatenate([anchor[:, None], drafts], 1)  # row t conditions on token t
        probs, ids = target_distribution(target_tab[window], params, max_top_k)
        random_nv = jax.vmap(lambda k: jax.random.randint(k, (), 0, T))(step_keys[:, T - 1])
        nv = jnp.where(cap == RANDOM_CAP, random_nv, cap).astype(jnp.int32)
        a, bonus, emitted = _accept_rule(rule, step_keys[:, T], probs, ids, drafts, q, nv, params.temperature)
        pos = count[:, None] + jnp.arange(T)[None]
        pos = jnp.where(emitted >= 0, pos, N_TOKENS + T)  # out of range: dropped
        out = jax.vmap(lambda o, p, e: o.at[p].set(e, mode="drop"))(out, pos, emitted)
        return (bonus, out, count + a + 1), None

    init = (jnp.zeros(n, jnp.int32), jnp.full((n, N_TOKENS + T), -1, jnp.int32), jnp.zeros(n, jnp.int32))
    (_, out, _), _ = jax.lax.scan(spec_step, init, jnp.arange(N_TOKENS))
    return out[:, :N_TOKENS]


def _exact_joint(target_tab, temperature, top_k, top_p, max_top_k):
    """P(x1, x2, x3) of the processed target chain from anchor 0, [V, V, V]."""
    p, ids = np_target_rows(target_tab, [temperature] * V, [top_k] * V, [top_p] * V, max_top_k)
    dense = np.zeros((V, V))
    np.put_along_axis(dense, ids, p, axis=1)
    return dense[0][:, None, None] * dense[:, :, None] * dense[None, :, :]


def _pvalues(tokens, joint):
    tokens = np.asarray(tokens)
    assert tokens.min() >= 0
    c3 = np.zeros((V, V, V))
    np.add.at(c3, (tokens[:, 0], tokens[:, 1], tokens[:, 2]), 1)
    return {
        "joint123": chi2_test(c3, joint)[2],
        "joint12": chi2_test(c3.sum(2), joint.sum(2))[2],
        "x1": chi2_test(c3.sum((1, 2)), joint.sum((1, 2)))[2],
        "x2": chi2_test(c3.sum((0, 2)), joint.sum((0, 2)))[2],
        "x3": chi2_test(c3.sum((0, 1)), joint.sum((0, 1)))[2],
    }


CONFIGS = {
    # name: (temperature, top_k, top_p, max_top_k, cap, greedy_draft)
    "plain": (1.0, 0, 1.0, V, T - 1, False),
    "cap-random": (1.0, 0, 1.0, V, RANDOM_CAP, False),
    "cap1-topk-topp-temp": (0.7, 6, 0.85, 8, 1, False),
    "cap-random-topk-topp-temp": (1.4, 5, 0.9, 8, RANDOM_CAP, False),
    "greedy-draft-cap-random-topp": (0.8, 0, 0.8, V, RANDOM_CAP, True),
}


def _run(name, rule=LIBRARY, seed=0, processed=False):
    temperature, top_k, top_p, max_top_k, cap, greedy_draft = CONFIGS[name]
    target_tab, draft_tab = _tables()
    params = SamplingParams.create(N_SAMPLES, temperature, top_k, top_p)
    draft_temp = jnp.zeros(N_SAMPLES) if greedy_draft else params.temperature
    tokens = _simulate(
        jax.random.key(seed),
        jnp.asarray(target_tab),
        jnp.asarray(draft_tab),
        params,
        draft_temp,
        jnp.int32(cap),
        jnp.int32(rule),
        max_top_k=max_top_k,
        greedy_draft=greedy_draft,
        processed=processed,
    )
    return _pvalues(tokens, _exact_joint(target_tab, temperature, top_k, top_p, max_top_k))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_speculative_sampling_is_lossless(name):
    pv = _run(name)
    assert min(pv.values()) > 1e-3, pv


@pytest.mark.parametrize("name", [n for n, c in CONFIGS.items() if not c[5]])
def test_processed_draft_sampling_is_lossless(name):
    """Drafts drawn from the request's processed draft distribution (the engine's sampled path):
    the emitted chain still follows the processed target exactly (the acceptance reads q at the
    drafts and the target's ids from the q they were drawn from), and the test's own rule agrees;
    test_lossless_harness_detects_a_wrong_rule shows the check's power at this sample size."""
    pv = _run(name, processed=True)
    assert min(pv.values()) > 1e-3, pv
    assert min(_run(name, TEST_RULE, processed=True).values()) > 1e-3


def test_processed_draft_probabilities_and_draws():
    """ProcessedDraft: q at ids equals target_distribution's processing of the draft logits (0 off
    its pairs); draws follow its probabilities (chi-square) and never leave its pairs."""
    rng = np.random.default_rng(5)
    logits = jnp.asarray(rng.standard_normal((6000, 1, V)) * 2.0, jnp.float32)
    params = SamplingParams.create(6000, 0.8, 5, 0.9)
    q = processed_draft(logits, params, 8)
    probs, ids = target_distribution(logits, params, 8)
    np.testing.assert_array_equal(np.asarray(q.probs), np.asarray(probs))
    dense = np.asarray(q.prob_at(jnp.broadcast_to(jnp.arange(V), (6000, 1, V))))
    want = np.zeros((6000, 1, V))
    np.put_along_axis(want, np.asarray(ids), np.asarray(probs), axis=-1)
    np.testing.assert_allclose(dense, want, rtol=0, atol=0)
    row = jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a[:1, 0], (6000,) + a.shape[2:]), q)
    draws = np.asarray(jax.jit(sample_draft)(jax.random.key(4), row))
    kept = np.asarray(probs[0, 0]) > 0
    cells = np.asarray(ids[0, 0])[kept]
    assert set(np.unique(draws)) <= set(cells.tolist())
    assert chi2_test([(draws == c).sum() for c in cells], np.asarray(probs[0, 0])[kept])[2] > 1e-3


@pytest.mark.parametrize("name", list(CONFIGS))
def test_lossless_harness_detects_a_wrong_rule(name):
    """Every configuration (greedy drafts, fixed and random caps included): the rule re-implemented
    here passes the lossless check, and each wrong variant fails it at the same sample size.
    Measured (2026-12, seeds 0..2): the test's rule gives the library's p-values exactly (its draws
    are the same); every bug gives p = 0.0 on every configuration, except the cap off-by-one under
    "plain", which is not run: with the cap at T-1 the capped bonus is the 4th token, past the 3
    compared."""
    assert min(_run(name, TEST_RULE).values()) > 1e-3
    cap = CONFIGS[name][4]
    for bug, rule in BUGS.items():
        if rule == CAP_AS_REJECTION and cap == T - 1:
            continue
        pv = _run(name, rule)
        assert min(pv.values()) < 1e-3, (bug, pv)


def test_greedy_target_emits_the_greedy_chain():
    """Temperature 0 with a draft sampled at temperature 1: every sample emits the greedy chain."""
    target_tab, draft_tab = _tables()
    params = SamplingParams.greedy(N_SAMPLES)
    tokens = np.asarray(
        _simulate(
            jax.random.key(5),
            jnp.asarray(target_tab),
            jnp.asarray(draft_tab),
            params,
            jnp.ones(N_SAMPLES),
            jnp.int32(RANDOM_CAP),
            jnp.int32(LIBRARY),
            max_top_k=V,
            greedy_draft=False,
        )
    )
    chain, x = [], 0
    for _ in range(N_TOKENS):
        x = int(np.argmax(target_tab[x]))
        chain.append(x)
    assert (tokens == np.array(chain)).all()
