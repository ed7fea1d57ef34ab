"""Independent float64 numpy oracles for jaxspec's reference ops, written from the math in
docs/design.md section 3 and the ops contract (not from jaxspec code), plus comparison helpers.

Everything here is a plain loop in float64: slow, small, obviously correct.
"""

import zlib

import numpy as np


def f64(x):
    return np.asarray(x).astype(np.float64)


def silu(x):
    return x / (1.0 + np.exp(-x))


def softplus(x):
    return np.logaddexp(0.0, x)


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


# ------------------------------------------------------------------------------ norms, rope


def rms_norm(x, weight, eps):
    x = f64(x)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (1.0 + f64(weight))


def gated_rms_norm(x, gate, weight, eps):
    x = f64(x)
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * f64(weight)
    return y * silu(f64(gate))


def rope(x, positions, rotary_dim, theta):
    """x [..., heads, D]; rotates pair (i, i + rd/2) of the first rd dims by pos * theta^(-2i/rd)."""
    x = f64(x)
    out = x.copy()
    half = rotary_dim // 2
    pos = f64(positions)[..., None]  # broadcast over heads
    for i in range(half):
        ang = pos * theta ** (-2.0 * i / rotary_dim)
        c, s = np.cos(ang), np.sin(ang)
        a, b = x[..., i], x[..., i + half]
        out[..., i] = a * c - b * s
        out[..., i + half] = b * c + a * s
    return out


# ------------------------------------------------------------------------------ conv


def causal_conv(x, weight, history=None):
    """Causal depthwise conv + SiLU over time. x [T, C], weight [C, W], history [W-1, C]
    (zeros if None): y[t] = silu(sum_w weight[:, w] * seq[t - W + 1 + w]), seq = [history; x]."""
    x, weight = f64(x), f64(weight)
    W = weight.shape[1]
    hist = np.zeros((W - 1, x.shape[1])) if history is None else f64(history)
    seq = np.concatenate([hist, x], axis=0)
    y = np.zeros_like(x)
    for t in range(x.shape[0]):
        acc = np.zeros(x.shape[1])
        for w in range(W):
            acc += weight[:, w] * seq[t + w]
        y[t] = silu(acc)
    return y


def last_inputs(seq, n):
    """The last n rows of seq, zero-padded at the front when seq is shorter."""
    seq = f64(seq)
    out = np.zeros((n,) + seq.shape[1:])
    m = min(n, seq.shape[0])
    if m:
        out[n - m :] = seq[seq.shape[0] - m :]
    return out


# ------------------------------------------------------------------------------ gated delta rule


def gdn_recurrence(q, k, v, g, beta, h0):
    """The per-token gated delta rule in float64.
    q, k [T, H, K] (already normalised), v [T, HV, V], g, beta [T, HV], h0 [HV, K, V].
    Returns (o [T, HV, V], u [T, HV, V], h [HV, K, V])."""
    q, k, v, g, beta = map(f64, (q, k, v, g, beta))
    h = f64(h0).copy()
    T, H = k.shape[:2]
    HV = v.shape[1]
    r = HV // H
    o = np.zeros((T,) + v.shape[1:])
    u = np.zeros_like(o)
    for t in range(T):
        for hv in range(HV):
            kh, qh = k[t, hv // r], q[t, hv // r]
            h[hv] = np.exp(g[t, hv]) * h[hv]
            u[t, hv] = beta[t, hv] * (v[t, hv] - h[hv].T @ kh)
            h[hv] = h[hv] + np.outer(kh, u[t, hv])
            o[t, hv] = h[hv].T @ qh
    return o, u, h


def gdn_fold(h0, rk, ru, rg, m):
    """Fold the first m ring records into the checkpoint, one record at a time.
    h0 [HV, K, V], rk [H, L, K], ru [HV, L, V], rg [HV, L]. Records j >= m are never read."""
    h = f64(h0).copy()
    HV, H = h.shape[0], rk.shape[0]
    r = HV // H
    for j in range(m):
        for hv in range(HV):
            h[hv] = np.exp(f64(rg[hv, j])) * h[hv] + np.outer(f64(rk[hv // r, j]), f64(ru[hv, j]))
    return h


# ------------------------------------------------------------------------------ attention


def attention(q, k, v, q_pos):
    """q [Tq, Hq, D], k, v [Tk, KVH, D]; query i attends to keys 0..q_pos[i] inclusive."""
    q, k, v = f64(q), f64(k), f64(v)
    Tq, Hq, D = q.shape
    grp = Hq // k.shape[1]
    o = np.zeros_like(q)
    for i in range(Tq):
        n = q_pos[i] + 1
        for h in range(Hq):
            s = k[:n, h // grp] @ q[i, h] / np.sqrt(D)
            p = np.exp(s - s.max())
            o[i, h] = (p / p.sum()) @ v[:n, h // grp]
    return o


# ------------------------------------------------------------------------------ helpers


def seed_of(*case):
    """A reproducible seed for a test case: crc32 of its repr (Python's hash() of a str is salted
    per process, so a failure seeded from it could not be rerun)."""
    return zlib.crc32(repr(case).encode())


def qsl_from_lengths(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def l2n(x):
    x = f64(x)
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True))


def bits(x):
    """Raw bit pattern, for bitwise comparisons that also hold for NaN."""
    x = np.asarray(x)
    return x.view(f"u{x.dtype.itemsize}")


def assert_close(got, expected, tol, name=""):
    """max|got - expected| <= tol * max|expected| (and got finite)."""
    got, expected = f64(got), f64(expected)
    assert got.shape == expected.shape, f"{name}: shape {got.shape} != {expected.shape}"
    assert np.all(np.isfinite(got)), f"{name}: non-finite values in result"
    scale = max(np.abs(expected).max(initial=0.0), 1e-30)
    err = np.abs(got - expected).max(initial=0.0) / scale
    assert err <= tol, f"{name}: max-abs error / max|expected| = {err:.3g} > {tol:g}"


def check_verify_poison(args, clean, field, bad, fn, request, token):
    """A non-finite value in one window token of one request stays inside it: GDN verify args
    (q, k, v, g, beta, ckpt, ring_k, ring_u, ring_g, write_pos, query_start_loc, slots, ...) with
    `field` of token `token` of request `request` set to `bad`, run by fn(*args) -> (o, ring_k,
    ring_u (an array or a tuple), ring_g). Outputs of earlier tokens and of other requests, and
    ring records of other slots and earlier tokens, equal `clean` (the same four, unpoisoned) bit
    for bit; the request's records before the token stay finite."""

    def as_np(out):
        o, rk, ru, rg = out
        ru = tuple(np.asarray(x) for x in ru) if isinstance(ru, (tuple, list)) else (np.asarray(ru),)
        return np.asarray(o), np.asarray(rk), ru, np.asarray(rg)

    i = "q k v g beta".split().index(field)
    qsl, slots, write_pos = (np.asarray(x) for x in (args[10], args[11], args[9]))
    row = qsl[request] + token
    x = np.array(args[i])
    x[row] = bad
    o, rk, ru, rg = as_np(fn(*args[:i], x, *args[i + 1 :]))
    o0, rk0, ru0, rg0 = as_np(clean)
    ok_rows = np.ones(len(o), bool)
    ok_rows[row : qsl[request + 1]] = False
    assert np.all(np.isfinite(o[ok_rows]))
    np.testing.assert_array_equal(
        bits(o[ok_rows]), bits(o0[ok_rows]), "outputs before the poisoned token / of other requests"
    )
    s = slots[request]
    ok_pos = np.ones(rg.shape[::2], bool)  # [slots, ring positions]
    ok_pos[s, write_pos[s] + token :] = False
    for new, old, name in ((rk, rk0, "ring_k"), *((a, b, "ring_u") for a, b in zip(ru, ru0)), (rg, rg0, "ring_g")):
        sel = np.broadcast_to(ok_pos[:, None, :], new.shape[:3])
        np.testing.assert_array_equal(
            bits(new)[sel], bits(old)[sel], f"{name} records before the poisoned token / of other slots"
        )
    before = slice(write_pos[s], write_pos[s] + token)
    for new, name in ((rk, "ring_k"), *((a, "ring_u") for a in ru), (rg, "ring_g")):
        assert np.all(np.isfinite(new[s, :, before])), f"{name} records before the poisoned token"
