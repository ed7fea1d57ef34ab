import functools

import jax
import jax.numpy as jnp
import numpy as np
import oracle
import pytest

from jaxspec.ops.gdn import gating, gdn_chunked, gdn_fold, gdn_recurrent, gdn_verify, l2norm

H, HV, K, V = 2, 6, 16, 8
TOL = 1e-5
TOL_BF16_RING = 1e-4  # the ring holds bf16 keys and a (hi, lo) pair for u

bf16 = jnp.bfloat16


def f32(x):
    return np.asarray(x, np.float32)


def round_bf16(x):
    return np.asarray(x).astype(bf16).astype(np.float32)


def split_hi_lo(u):
    u = np.asarray(u, np.float32)
    hi = u.astype(bf16)
    with np.errstate(invalid="ignore"):  # inf - inf in dead records
        lo = (u - hi.astype(np.float32)).astype(bf16)
    return hi, lo


def decays(rng, shape, decay):
    # "strong": per-token g down to about -20, so a 64-token chunk spans e^-300 or less: any
    # exp(-G_j) that is not masked before the exp overflows float32.
    z = rng.standard_normal(shape)
    if decay == "mild":
        return f32(-0.05 * oracle.softplus(z))
    return f32(-3.0 * oracle.softplus(2 * z + 1))


def tokens(rng, lead, decay="mild"):
    """Normalised q̂, k̂ and v, g, beta with leading shape `lead`."""
    q = f32(oracle.l2n(rng.standard_normal(lead + (H, K))) * K**-0.5)
    k = f32(oracle.l2n(rng.standard_normal(lead + (H, K))))
    v = f32(rng.standard_normal(lead + (HV, V)))
    g = decays(rng, lead + (HV,), decay)
    beta = f32(oracle.sigmoid(rng.standard_normal(lead + (HV,))))
    return q, k, v, g, beta


# ------------------------------------------------------------------------------ small pieces


def test_l2norm():
    x = np.random.default_rng(0).standard_normal((3, 5, K)).astype(np.float32)
    x[0, 0] = 0.0  # eps keeps a zero vector finite
    xd = x.astype(np.float64)
    exp = xd / np.sqrt(np.sum(xd * xd, -1, keepdims=True) + 1e-6)
    oracle.assert_close(l2norm(jnp.asarray(x)), exp, TOL, "l2norm")


def test_gating():
    rng = np.random.default_rng(1)
    a, b = f32(rng.standard_normal((4, 3, HV)) * 3), f32(rng.standard_normal((4, 3, HV)) * 3)
    A_log, dt_bias = f32(rng.standard_normal(HV)), f32(rng.standard_normal(HV))
    g, beta = gating(*map(jnp.asarray, (a, b, A_log, dt_bias)))
    assert g.dtype == jnp.float32 and beta.dtype == jnp.float32
    exp_g = -np.exp(A_log.astype(np.float64)) * oracle.softplus(a.astype(np.float64) + dt_bias)
    oracle.assert_close(g, exp_g, TOL, "g")
    oracle.assert_close(beta, oracle.sigmoid(b.astype(np.float64)), TOL, "beta")
    assert np.all(np.asarray(g) <= 0)


# ------------------------------------------------------------------------------ prefill forms

_recurrent = jax.jit(functools.partial(gdn_recurrent, impl="ref"))
_chunked = jax.jit(functools.partial(gdn_chunked, impl="ref"))


@pytest.mark.parametrize("decay", ["mild", "strong"])
@pytest.mark.parametrize("T", [1, 9])
def test_gdn_recurrent(T, decay):
    rng = np.random.default_rng(100 + T)
    q, k, v, g, beta = tokens(rng, (2, T), decay)
    h0 = f32(rng.standard_normal((2, HV, K, V)) * 0.5)
    o, h = _recurrent(q, k, v, g, beta, h0)
    assert o.shape == (2, T, HV, V) and h.dtype == jnp.float32
    for b in range(2):
        eo, _, eh = oracle.gdn_recurrence(q[b], k[b], v[b], g[b], beta[b], h0[b])
        oracle.assert_close(o[b], eo, TOL, f"o[{b}]")
        oracle.assert_close(h[b], eh, TOL, f"h[{b}]")


@pytest.mark.parametrize("decay", ["mild", "strong"])
@pytest.mark.parametrize("T", [1, 63, 64, 65, 200])
def test_gdn_chunked(T, decay):
    rng = np.random.default_rng(200 + T)
    lengths = np.array([T, 2 * T // 3], np.int32)  # T=1 gives an empty request
    q, k, v, g, beta = tokens(rng, (2, T), decay)
    h0 = f32(rng.standard_normal((2, HV, K, V)) * 0.5)
    o, h = _chunked(q, k, v, g, beta, h0, lengths)
    o, h = np.asarray(o), np.asarray(h)
    # The chunk form takes decays as differences G_i - G_j of f32 cumulative sums: with strong
    # decay |G| reaches ~300 within a chunk, so a difference carries ~|G| * 2^-24 ~ 2e-5 absolute
    # error, which a token with g ~ 0 passes on at full weight. Inherent to the formula, hence 1e-4.
    tol = TOL if decay == "mild" else 1e-4
    for b, n in enumerate(lengths):
        eo, _, eh = oracle.gdn_recurrence(q[b, :n], k[b, :n], v[b, :n], g[b, :n], beta[b, :n], h0[b])
        if n:
            oracle.assert_close(o[b, :n], eo, tol, f"o[{b}]")
        assert not o[b, n:].any(), f"o of request {b} past its length must be 0"
        oracle.assert_close(h[b], eh, tol, f"h[{b}]")


def test_gdn_chunked_no_lengths():
    rng = np.random.default_rng(300)
    q, k, v, g, beta = tokens(rng, (2, 70))
    h0 = f32(rng.standard_normal((2, HV, K, V)) * 0.5)
    o, h = gdn_chunked(q, k, v, g, beta, h0, None, impl="ref")
    for b in range(2):
        eo, _, eh = oracle.gdn_recurrence(q[b], k[b], v[b], g[b], beta[b], h0[b])
        oracle.assert_close(o[b], eo, TOL, f"o[{b}]")
        oracle.assert_close(h[b], eh, TOL, f"h[{b}]")


# ------------------------------------------------------------------------------ fold

S1_FOLD, L = 5, 16
NUM_RECORDS = np.array([0, 0, 5, L, 1], np.int32)  # slot 0 (null), empty, partial, full, one


def fold_case(rng, ring, layers):
    lead = () if layers is None else (layers,)
    ckpt = f32(rng.standard_normal(lead + (S1_FOLD, HV, K, V)))
    rk = f32(oracle.l2n(rng.standard_normal(lead + (S1_FOLD, H, L, K))))
    ru = f32(rng.standard_normal(lead + (S1_FOLD, HV, L, V)))
    rg = f32(-oracle.softplus(rng.standard_normal(lead + (S1_FOLD, HV, L))))
    dead = np.arange(L) >= NUM_RECORDS[:, None]  # [S1, L]: records j >= m
    dead_rec = dead[:, None, :, None]
    rk, ru = np.where(dead_rec, np.nan, rk), np.where(dead_rec, np.inf, ru)
    rg = np.where(dead[:, None, :], np.nan, rg)
    if ring == "f32":
        return ckpt, rk, ru, ru, rg
    rk = rk.astype(bf16)
    hi, lo = split_hi_lo(ru)
    hi, lo = np.where(dead_rec, np.nan, hi).astype(bf16), np.where(dead_rec, np.nan, lo).astype(bf16)
    u_exact = hi.astype(np.float64) + lo.astype(np.float64)
    return ckpt, rk, (hi, lo), u_exact, rg


_fold = jax.jit(functools.partial(gdn_fold, impl="ref"))


@pytest.mark.parametrize("layers", [None, 3], ids=["no-layer-axis", "3-layers"])
@pytest.mark.parametrize(
    "ring,ckpt_dtype",
    [("f32", "f32"), ("bf16-hilo", "f32"), ("bf16-hilo", "bf16")],
    ids=["f32-ring", "hilo-ring", "hilo-ring-bf16-ckpt"],
)
def test_gdn_fold(ring, ckpt_dtype, layers):
    rng = np.random.default_rng(400)
    ckpt, rk, ru, u_exact, rg = fold_case(rng, ring, layers)
    if ckpt_dtype == "bf16":
        ckpt = ckpt.astype(bf16)
    out = np.asarray(_fold(ckpt, rk, ru, rg, NUM_RECORDS))
    assert out.dtype == ckpt.dtype and out.shape == ckpt.shape
    # bf16 out: one rounding (2^-8 relative) of the folded state
    tol = {"f32": TOL, "bf16-hilo": TOL_BF16_RING}[ring] if ckpt_dtype == "f32" else 5e-3
    for idx in np.ndindex(ckpt.shape[:-4]):
        for s, m in enumerate(NUM_RECORDS):
            at = idx + (s,)
            if m == 0:
                np.testing.assert_array_equal(
                    oracle.bits(out[at]), oracle.bits(ckpt[at]), f"slot {at} with no records must be unchanged"
                )
                continue
            exp = oracle.gdn_fold(ckpt[at], rk[at], u_exact[at], rg[at], m)
            oracle.assert_close(out[at], exp, tol, f"ckpt' {at}")


@pytest.mark.parametrize("ring", ["f32", "bf16-hilo"], ids=["f32-ring", "hilo-ring"])
def test_gdn_fold_max_records(ring):
    """A static bound on the counts (fold policy `every`: at most one window) folds from the first
    max_records ring positions exactly what the float64 fold of those records gives."""
    rng = np.random.default_rng(401)
    ckpt, rk, ru, u_exact, rg = fold_case(rng, ring, 3)
    bound = 5
    counts = np.minimum(NUM_RECORDS, bound).astype(np.int32)
    out = np.asarray(jax.jit(functools.partial(gdn_fold, max_records=bound, impl="ref"))(ckpt, rk, ru, rg, counts))
    tol = {"f32": TOL, "bf16-hilo": TOL_BF16_RING}[ring]
    for idx in np.ndindex(ckpt.shape[:-4]):
        for s, m in enumerate(counts):
            at = idx + (s,)
            exp = ckpt[at] if m == 0 else oracle.gdn_fold(ckpt[at], rk[at], u_exact[at], rg[at], m)
            oracle.assert_close(out[at], exp, tol, f"ckpt' {at} with {m} records")


# ------------------------------------------------------------------------------ replay verify

# (slot, window length): slot 0 is a padding request, slot 2 is not in the batch.
REQUESTS = [(3, 5), (0, 3), (1, 2), (5, 0), (4, 1)]
S1, T_MAX, N_PAD = 6, 5, 2
WRITE_POS = {
    "empty": [0, 0, 0, 0, 0, 0],
    "partial": [4, 3, 9, 7, 1, 6],
    "full": [L - T_MAX] * S1,
    "mixed": [2, 0, 5, L - T_MAX, 6, 3],
}


def verify_case(seed, hist, ring, decay="mild"):
    """Random packed window on top of consistent ring histories: records (k̂, u, g) made by the
    oracle recurrence from each slot's checkpoint, NaN in the dead records past write_pos."""
    rng = np.random.default_rng(seed)
    slots = np.array([s for s, _ in REQUESTS], np.int32)
    qsl = oracle.qsl_from_lengths([n for _, n in REQUESTS])
    write_pos = np.array(WRITE_POS[hist], np.int32)
    N = qsl[-1] + N_PAD
    q, k, v, g, beta = tokens(rng, (N,), decay)
    ckpt = f32(rng.standard_normal((S1, HV, K, V)) * 0.5)
    rk = f32(oracle.l2n(rng.standard_normal((S1, H, L, K))))
    ru = f32(rng.standard_normal((S1, HV, L, V)))
    rg = f32(-oracle.softplus(rng.standard_normal((S1, HV, L))))
    if ring == "bf16-hilo":
        k, rk = round_bf16(k), round_bf16(rk)
    for s in set(range(1, S1)) - {2}:
        m = write_pos[s]
        _, hk, hv_, hg, hb = tokens(rng, (m,), decay)
        if ring == "bf16-hilo":
            hk = round_bf16(hk)
        _, hu, _ = oracle.gdn_recurrence(np.zeros_like(hk), hk, hv_, hg, hb, ckpt[s])
        rk[s, :, :m], ru[s, :, :m], rg[s, :, :m] = hk.transpose(1, 0, 2), hu.transpose(1, 0, 2), hg.T
        rk[s, :, m:], ru[s, :, m:], rg[s, :, m:] = np.nan, np.inf, np.nan
    if ring == "f32":
        ring_u, u_exact = ru, ru.astype(np.float64)
    else:
        rk = rk.astype(bf16)
        ring_u = split_hi_lo(ru)
        u_exact = ring_u[0].astype(np.float64) + ring_u[1].astype(np.float64)
    args = (q, k, v, g, beta, ckpt, rk, ring_u, rg, write_pos, qsl, slots)
    return args, u_exact


_verify = jax.jit(lambda *a: gdn_verify(*a, T_MAX, impl="ref"))


def run_verify(args):
    o, rk, ru, rg = _verify(*args)
    return np.asarray(o), np.asarray(rk), jax.tree.map(np.asarray, ru), np.asarray(rg)


@pytest.mark.parametrize("ring", ["f32", "bf16-hilo"])
@pytest.mark.parametrize(
    "hist,decay", [(h, "mild") for h in WRITE_POS] + [("mixed", "strong")], ids=list(WRITE_POS) + ["mixed-strong"]
)
def test_gdn_verify(hist, decay, ring):
    args, u_exact = verify_case(500, hist, ring, decay)
    q, k, v, g, beta, ckpt, rk, ring_u, rg, write_pos, qsl, slots = args
    o, rk2, ru2, rg2 = run_verify(args)
    assert o.dtype == np.float32 and o.shape == (qsl[-1] + N_PAD, HV, V)
    tol = TOL if ring == "f32" else TOL_BF16_RING
    u2 = ru2.astype(np.float64) if ring == "f32" else ru2[0].astype(np.float64) + ru2[1].astype(np.float64)

    exp_rk, exp_rg = rk.copy(), rg.copy()
    written = np.zeros((S1, L), bool)
    for r, (s, n) in enumerate(REQUESTS):
        rows = slice(qsl[r], qsl[r + 1])
        if s == 0:
            assert not o[rows].any(), "slot-0 request must output 0"
            continue
        if n == 0:
            continue
        m = write_pos[s]
        h = oracle.gdn_fold(ckpt[s], rk[s], u_exact[s], rg[s], m)
        eo, eu, _ = oracle.gdn_recurrence(q[rows], k[rows], v[rows], g[rows], beta[rows], h)
        oracle.assert_close(o[rows], eo, tol, f"o of request {r}")
        pos = slice(m, m + n)
        exp_rk[s, :, pos] = k[rows].transpose(1, 0, 2)
        exp_rg[s, :, pos] = g[rows].T
        written[s, pos] = True
        oracle.assert_close(u2[s, :, pos], eu.transpose(1, 0, 2), tol, f"ring_u' of request {r}")
    assert not o[qsl[-1] :].any(), "padding rows must output 0"

    # keys and gates are copies (exact); u elsewhere than the new records is bit-identical
    np.testing.assert_array_equal(oracle.bits(rk2), oracle.bits(exp_rk), "ring_k'")
    np.testing.assert_array_equal(oracle.bits(rg2), oracle.bits(exp_rg), "ring_g'")
    keep = ~written[:, None, :]
    if ring == "f32":
        np.testing.assert_array_equal(
            oracle.bits(ru2)[np.broadcast_to(keep, ru2.shape[:3])],
            oracle.bits(ring_u)[np.broadcast_to(keep, ru2.shape[:3])],
            "ring_u' outside the new records",
        )
    else:
        hi, lo = ru2
        sel = np.broadcast_to(keep, hi.shape[:3])
        for new, old, name in ((hi, ring_u[0], "hi"), (lo, ring_u[1], "lo")):
            np.testing.assert_array_equal(
                oracle.bits(new)[sel], oracle.bits(old)[sel], f"ring_u' {name} outside the new records"
            )
        # a compensated pair: lo is the bf16 residual of hi
        w = np.broadcast_to(written[:, None, :, None], hi.shape)
        hi64, lo64 = hi.astype(np.float64)[w], lo.astype(np.float64)[w]
        assert np.all(np.abs(lo64) <= 2.0**-8 * np.abs(hi64) + 1e-30), "lo is not a residual of hi"


POISON_REQ, POISON_T = 0, 2  # request 0 (slot 3, 5 tokens): poison its window token 2


@pytest.fixture(scope="module")
def clean_verify():
    args, _ = verify_case(600, "partial", "f32")
    return args, run_verify(args)


@pytest.mark.parametrize("bad", [np.nan, np.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("field", ["q", "k", "v", "g", "beta"])
def test_gdn_verify_nan_containment(clean_verify, field, bad):
    """A non-finite input at a rejected token leaves every earlier output and record bit-identical."""
    args, clean = clean_verify
    oracle.check_verify_poison(tuple(args), clean, field, bad, lambda *a: run_verify(a), POISON_REQ, POISON_T)


# ------------------------------------------------------------------------------ chained steps

CHAIN_T, CHAIN_STEPS = 4, 64


@pytest.mark.parametrize(
    "ring,policy,promise",
    [("f32", "lazy", False), ("bf16-hilo", "every", False), ("f32", "every", True), ("bf16-hilo", "every", True)],
    ids=["f32-lazy", "hilo-every", "f32-every-promised", "hilo-every-promised"],
)
def test_gdn_verify_fold_chained(ring, policy, promise):
    """64 verify -> accept -> fold steps for two requests; drafts past the accepted prefix are
    random and sometimes NaN. The committed state (ckpt folded with the live records) must track
    a float64 recurrence over the accepted tokens, with an error that does not grow. promise:
    the calls target.verify / commit make under fold policy `every` (the verify reads no ring
    history, the fold reads one window's positions)."""
    rng = np.random.default_rng(700)
    slots = np.array([1, 2], np.int32)
    ckpt = jnp.asarray(f32(rng.standard_normal((3, HV, K, V)) * 0.5))
    h_exact = {s: np.asarray(ckpt[s], np.float64) for s in (1, 2)}
    rk = jnp.zeros((3, H, L, K), jnp.float32 if ring == "f32" else bf16)
    ru = jnp.zeros((3, HV, L, V), jnp.float32)
    if ring != "f32":
        ru = (ru.astype(bf16), ru.astype(bf16))
    rg = jnp.zeros((3, HV, L), jnp.float32)
    write_pos = np.zeros(3, np.int32)
    verify = jax.jit(lambda *a: gdn_verify(*a, CHAIN_T, ring_empty=promise, impl="ref"))
    fold = jax.jit(functools.partial(gdn_fold, max_records=CHAIN_T if promise else None, impl="ref"))
    tol = TOL if ring == "f32" else TOL_BF16_RING
    errs = []
    for step in range(CHAIN_STEPS):
        lens = rng.integers(1, CHAIN_T + 1, 2)
        qsl = oracle.qsl_from_lengths(lens)
        q, k, v, g, beta = tokens(rng, (2 * CHAIN_T + 1,))  # fixed N: one compile
        if ring != "f32":
            k = round_bf16(k)
        acc = [int(rng.integers(0, n)) for n in lens]
        clean = (q, k, v, g, beta)
        v_in = v.copy()
        for r, n in enumerate(lens):
            if acc[r] + 1 < n and rng.random() < 0.3:  # poison a rejected draft
                v_in[qsl[r] + acc[r] + 1] = np.nan
        o, rk, ru, rg = verify(q, k, v_in, g, beta, ckpt, rk, ru, rg, write_pos, qsl, slots)
        o = np.asarray(o)
        for r, s in enumerate(slots):
            rows = slice(qsl[r], qsl[r] + acc[r] + 1)
            eo, _, h_exact[s] = oracle.gdn_recurrence(*(x[rows] for x in clean), h_exact[s])
            oracle.assert_close(o[rows], eo, tol, f"step {step} o of request {r}")
            write_pos[s] += acc[r] + 1
        fold_now = write_pos + 2 * CHAIN_T > L if policy == "lazy" else write_pos > 0
        if fold_now.any():
            ckpt = fold(ckpt, rk, ru, rg, np.where(fold_now, write_pos, 0).astype(np.int32))
            write_pos = np.where(fold_now, 0, write_pos).astype(np.int32)
        u = np.asarray(ru, np.float64) if ring == "f32" else sum(np.asarray(x, np.float64) for x in ru)
        for s in slots:
            h = oracle.gdn_fold(np.asarray(ckpt[s]), np.asarray(rk[s]), u[s], np.asarray(rg[s]), write_pos[s])
            errs.append(np.abs(h - h_exact[s]).max() / np.abs(h_exact[s]).max())
    errs = np.array(errs)
    assert errs.max() <= tol, f"committed state error {errs.max():.3g}"
    # no drift: the last quarter is no worse than a few times the first quarter
    q4 = len(errs) // 4
    assert errs[-q4:].max() <= 4 * errs[:q4].max() + 1e-7, (errs[:q4].max(), errs[-q4:].max())
