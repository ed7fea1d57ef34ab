"""GDN replay verify as two Pallas Triton kernels (docs/design.md section 3).

Contract: `jaxspec.ops.gdn.gdn_verify` (its jnp reference, `impl="ref"`, is the semantics):
q, k [N, H, K], v [N, HV, V], g, beta [N, HV] packed; ckpt [S1, HV, K, V] (read only); ring_k
[S1, H, L, K], ring_u [S1, HV, L, V] (float32 or a (hi, lo) bf16 pair), ring_g [S1, HV, L], aliased
and written at write_pos + t (or [G, ...] stacks with a `layer` index) -> (o [N, HV, V] float32,
rings'). With X = [k_0..k_{ts-1}; q_0..q_{ts-1}] the window's key and query rows, h0 the slot's
checkpoint and U_hist the m = write_pos[slot] history records of the ring (h_m = h0 advanced
through them is never materialised), everything with a V axis is linear in three V-axis inputs,
    Z = X h0 [2ts, V],   V [ts, V],   U_hist [L, V]:
    U = D V - e^{G_m} D E Z_k - D E Hc_k U_hist            D = (I + A)^{-1} diag(beta), E = diag(e^G)
    O = P D V - e^{G_m} P D E Z_k + e^{G_m} E Z_q + (E Hc_q - P D E Hc_k) U_hist
with A = strict_lower(diag(beta)(K K^T * e^{G_i - G_j})), P = incl_lower(Q K^T * e^{G_i - G_j}),
Hc = X K_hist^T diag(c), c_j = e^{G_m - G_j}. So [U; O] = M [Z; V] + M_h U_hist with small matrices
M [2ts, 4ts] and M_h [2ts, L] that need no V-axis data (ts = max(8, next_pow2(t_max))).

Two kernels, so that the checkpoint stream is not slowed by serial work in the same program:
  coefficients: grid (HV / heads_per_program, B). The window's Gram products (and the history
      keys' dots with X), the forward substitution, M and M_h (float32 scratch [B, HV, 2ts, 4ts],
      [B, HV, 2ts, L]) per value head; writes the window's ring_k and ring_g records. Tiles are
      [T, T]: one warp runs it without cross-warp barriers. No checkpoint traffic.
  apply: grid (V // block_v, HV, B + 1). Streams ckpt[slot, hv, :, vblk] once in K chunks into
      Z^T = h0^T X^T [block_v, 2ts] (M = block_v: Hopper's warpgroup MMA), then
      [U; O]^T = [Z; V]^T M^T (+ U_hist^T M_h^T only when write_pos > 0); writes o and the ring_u
      records. The extra row z = B writes the padding tokens' zeros: every row of o is written once.

Causality by selection: every block of M and M_h is exactly 0 where a row's token precedes a
column's (built with `where`, operands made finite first), so a non-finite input at token t reaches
no output or record of an earlier token, bit for bit. Precision: bf16 tensor-core products with
hi/lo splits (a.b ~ a_hi.b_hi + a_hi.b_lo + a_lo.b_hi); a bf16 operand (checkpoint, ring keys, the
stored (hi, lo) ring pair) is exact and needs no lo part.

Assumed (the packed layout guarantees it): query_start_loc[0] == 0, non-decreasing, every length
<= t_max, query_start_loc[B] <= N; real requests have distinct slots. Slot-0 requests write zero
rows of `o` and nothing else. Timings: bench/RESULTS.md.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxspec.pallas.gdn_window_math import (
    dot_f32,
    finite_or_zero,
    load_window_rows,
    request_window,
    unit_lower_inverse,
    zero_padding_rows,
)
from jaxspec.pallas.hardware import NUM_SMS, default_interpret
from jaxspec.pallas.tiles import check_int_fields, check_pow2_fields, is_layer_index, is_pow2, layer_operand, split_bf16

F32, BF16 = jnp.float32, jnp.bfloat16
MAX_T = 32  # window tile <= 32: the forward substitution is unrolled and lives in registers
# Coefficient programs the GPU runs at once: 16 one-warp programs per SM (register-bound). Up to
# this many, one value head per program (a program's latency is the kernel's cost); beyond, the r
# value heads of a key head share its Gram products.
ONE_WAVE = NUM_SMS * 16


@dataclasses.dataclass(frozen=True)
class VerifyConfig:
    """Tile sizes and launch parameters.

    block_v: V columns per apply program (power of two >= 16; tl.dot needs >= 16 on every axis).
    block_k: K rows per step of the passes over K (power of two >= 16): small dot operands and
      checkpoint slices keep registers free for more programs per SM.
    num_warps, num_stages: the apply kernel's warps (4 = one warpgroup, the unit of Hopper's
      warpgroup MMA) and Triton software-pipelining depth.
    coeff_warps: warps of the coefficient kernel (its tiles are [T, T]: one warp keeps the forward
      substitution's reductions inside the warp, with no shared-memory barrier).
    pad_rows: rows per step of the padding programs' zero-fill loop.
    """

    block_v: int = 128
    block_k: int = 32
    num_warps: int = 4
    num_stages: int = 1
    pad_rows: int = 64
    coeff_warps: int = 1

    def __post_init__(self):
        # block_v / block_k >= 16: the tensor-core dot tile
        check_pow2_fields(
            self,
            (
                ("block_v", 16, None),
                ("block_k", 16, None),
                ("num_warps", 1, 16),
                ("pad_rows", 1, None),
                ("coeff_warps", 1, 16),
            ),
        )
        check_int_fields(self, (("num_stages", 1, None),))


def default_config(ckpt_dtype, v_dim) -> VerifyConfig:
    """The fastest on the H200 (`bench/gdn_verify_kernel.py --sweep`; bench/RESULTS.md): 128-wide
    V blocks and a 3-stage pipeline over K chunks of 32 for a bf16 checkpoint, 64-wide blocks
    without pipelining for float32 (same bytes per tile)."""
    if jnp.dtype(ckpt_dtype) == jnp.float32:
        return VerifyConfig(block_v=min(64, v_dim), block_k=32)
    return VerifyConfig(block_v=min(128, v_dim), block_k=32, num_stages=3)


def _parts(ring_u):
    return tuple(ring_u) if isinstance(ring_u, (tuple, list)) else (ring_u,)


def supports(
    q, k, v, g, beta, ckpt, ring_k, ring_u, ring_g, write_pos, query_start_loc, slots, t_max, config=None, layer=None
) -> bool:
    """Shapes and dtypes this kernel covers (the GPU check is dispatch's job). With `layer`, the
    checkpoint and rings are stacks over layers: their per-layer shapes are checked."""
    try:
        if layer is not None:
            stacks = (ckpt, ring_k, *_parts(ring_u), ring_g)
            if not (len({x.shape[0] for x in stacks}) == 1 and is_layer_index(layer, ckpt.shape[0])):
                return False
            one = lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
            ckpt, ring_k, ring_g = one(ckpt), one(ring_k), one(ring_g)
            ring_u = tuple(map(one, _parts(ring_u)))
        n, h, kd = q.shape
        _, hv, vd = v.shape
        s1 = ckpt.shape[0]
        ring_len = ring_g.shape[-1]
        parts = _parts(ring_u)
        cfg = config or default_config(ckpt.dtype, vd)
        ok = (
            k.shape == q.shape
            and g.shape == (n, hv)
            and beta.shape == (n, hv)
            and ckpt.shape == (s1, hv, kd, vd)
            and ring_k.shape == (s1, h, ring_len, kd)
            and ring_g.shape == (s1, hv, ring_len)
            and all(p.shape == (s1, hv, ring_len, vd) for p in parts)
            and write_pos.shape == (s1,)
            and slots.ndim == 1
            and query_start_loc.shape == (slots.shape[0] + 1,)
            and hv % h == 0
            and is_pow2(kd)
            and kd >= 16
            and is_pow2(vd)
            and vd >= 16
            and is_pow2(ring_len)
            and ring_len >= 16
            and isinstance(t_max, int)
            and 1 <= t_max <= MAX_T
            and vd % min(cfg.block_v, vd) == 0
            and kd % min(cfg.block_k, kd) == 0
            and jnp.dtype(ckpt.dtype) in (jnp.dtype(F32), jnp.dtype(BF16))
            and jnp.dtype(ring_k.dtype) in (jnp.dtype(F32), jnp.dtype(BF16))
            and jnp.dtype(ring_g.dtype) == jnp.dtype(F32)
            and all(jnp.issubdtype(x.dtype, jnp.floating) for x in (q, k, v, g, beta))
        )
        if len(parts) == 1:
            ok = ok and jnp.dtype(parts[0].dtype) == jnp.dtype(F32)
        else:
            ok = ok and len(parts) == 2 and all(jnp.dtype(p.dtype) == jnp.dtype(BF16) for p in parts)
        return bool(ok)
    except (AttributeError, TypeError, ValueError, IndexError):
        return False


def window_tile(t_max) -> int:
    """ts: token rows per window block of M (>= 8 so that 2 ts >= 16, the tensor-core minimum)."""
    return max(8, pl.next_power_of_2(t_max))


# ---------------------------------------------------------------------------------------------
# Kernel 1: the window's coefficients


def _shift(tt, ts):
    """[tt, tt] bf16 0/1 matrix with S[i, i + ts] = 1: S @ X moves rows ts.. of X to the top."""
    i = jnp.arange(tt, dtype=jnp.int32)
    return jnp.where(i[None, :] == i[:, None] + ts, 1.0, 0.0).astype(BF16)


def _window_blocks(s, ts, tt):
    """K K^T and Q K^T as [tt, tt] tiles (zero outside the window's ts x ts block) from the Gram
    matrix s [2ts, 2ts] of X = [k_0..k_ts; q_0..q_ts]. With ts < tt (= 2 ts) the Q K^T block is
    moved up by a 0/1 matrix product on finite values (a non-finite entry stays in its token's
    row or column: it is zeroed, which only changes rows that already depend on that token)."""
    if ts == tt:
        return (jnp.split(x, 2, axis=1)[0] for x in jnp.split(s, 2, axis=0))
    i = jnp.arange(tt, dtype=jnp.int32)
    in_block = (i[:, None] < ts) & (i[None, :] < ts)
    qk = dot_f32(_shift(tt, ts), finite_or_zero(s))
    return jnp.where(in_block, s, 0.0), jnp.where(in_block, qk, 0.0)


def _key_query_columns(x, ts, tt):
    """The key and query columns of x [L, 2ts] (finite) as [L, tt] tiles, zero beyond ts."""
    if ts == tt:
        return tuple(jnp.split(x, 2, axis=1))
    col = jnp.arange(tt, dtype=jnp.int32)[None, :]
    return jnp.where(col < ts, x, 0.0), jnp.where(col < ts, dot_f32(x, _shift(tt, ts), trans_b=True), 0.0)


def _coeff_kernel(
    layer_ref,
    qsl_ref,
    slots_ref,
    wpos_ref,
    q_ref,
    k_ref,
    g_ref,
    beta_ref,
    rk_in,
    rg_in,
    m_ref,
    mh_ref,
    rk_out,
    rg_out,
    *,
    t_max,
    tt,
    ts,
    ratio,
    heads_per_program,
    block_k,
    stacked,
):
    n_tok, _, kd = q_ref.shape
    ring_len = rg_in.shape[-1]
    lay = (layer_ref[0],) if stacked else ()
    prog, b = pl.program_id(0), pl.program_id(1)
    hv0 = prog * heads_per_program  # this program's value heads: hv0 ..
    kh = hv0 // ratio
    t = jnp.arange(tt, dtype=jnp.int32)
    _, start, n, slot, rows, valid = request_window(qsl_ref, slots_ref, b, slots_ref.shape[0], t_max, t, n_tok)

    @pl.when((slot > 0) & (n > 0))
    def _request():
        m = jnp.clip(wpos_ref[slot], 0, ring_len)
        pos = m + t
        rec = valid & (pos < ring_len)

        # Key-head part, once for the r value heads: the Gram matrix of X = [k_0..k_ts; q_0..q_ts]
        # (2 ts rows: no padding rows for T <= 8) and the history keys' dots with X.
        def load_x(cols):
            return load_window_rows(k_ref, q_ref, start, n, kh, ts, cols).astype(F32)  # [2ts, BK]

        def chunk(i):
            return i * block_k + jnp.arange(block_k, dtype=jnp.int32)[None, :]

        def gram_step(i, s_acc):
            x = load_x(chunk(i))
            return s_acc + dot_f32(x, x, trans_b=True)

        s_win = jax.lax.fori_loop(0, kd // block_k, gram_step, jnp.zeros((2 * ts, 2 * ts), F32))
        kk, qk = _window_blocks(s_win, ts, tt)  # [T, T]

        jh = jnp.arange(ring_len, dtype=jnp.int32)
        live = jh < m

        def history_gram():  # [L, 2ts]: k_hist_j . x
            def step(i, acc):
                xh = plgpu.load(
                    rk_in.at[(*lay, slot, kh, jnp.where(live, jh, 0)[:, None], chunk(i))], mask=live[:, None], other=0.0
                )
                return acc + dot_f32(xh.astype(F32), load_x(chunk(i)), trans_b=True)

            return jax.lax.fori_loop(0, kd // block_k, step, jnp.zeros((ring_len, 2 * ts), F32))

        s_hist = jax.lax.cond(m > 0, history_gram, lambda: jnp.zeros((ring_len, 2 * ts), F32))
        hk_t, hq_t = _key_query_columns(finite_or_zero(s_hist), ts, tt)  # [L, T]
        row, col = t[:, None], t[None, :]
        incl, strict = col <= row, col < row
        zero = jnp.zeros((tt, tt), F32)
        ti = jnp.arange(ts, dtype=jnp.int32)
        top = (lambda x: jnp.split(x, tt // ts, axis=0)[0]) if ts < tt else (lambda x: x)  # rows < ts

        def head(j, carry):
            hv = hv0 + j
            g = plgpu.load(g_ref.at[rows, hv], mask=valid, other=0.0).astype(F32)
            beta = plgpu.load(beta_ref.at[rows, hv], mask=valid, other=0.0).astype(F32)
            G = jnp.sum(jnp.where(incl, g[None, :], 0.0), axis=1)  # inclusive cumsum
            decay = jnp.exp(jnp.where(incl, G[:, None] - G[None, :], -jnp.inf))  # masked before exp
            a = jnp.where(strict, beta[:, None] * kk * decay, 0.0)
            p = jnp.where(incl, qk * decay, 0.0)
            t_inv = unit_lower_inverse(a.T, t, t_max)
            eG = jnp.exp(G)
            d = jnp.where(incl, t_inv * beta[None, :], 0.0)  # D = Tinv diag(beta)
            de = jnp.where(incl, d * eG[None, :], 0.0)  # D E
            pd = dot_f32(p, finite_or_zero(d))
            pde = jnp.where(incl, pd * eG[None, :], 0.0)  # P D E

            # History: e^{G_m} scales the checkpoint columns; c_j = e^{G_m - G_j} = e^{sum_{j<l<m} g_l}.
            hg = plgpu.load(rg_in.at[(*lay, slot, hv, jnp.where(live, jh, 0))], mask=live, other=0.0).astype(F32)
            e_gm = jnp.exp(jnp.sum(hg))

            # M [2ts, 4ts]: rows U then O (ts each), columns Z_k, Z_q, V, 0 (ts each). The first ts
            # rows of each [tt, tt] block go to their place through a store masked to columns < ts.
            diag_e = jnp.where(row == col, e_gm * eG[None, :], 0.0)
            blocks = (
                (0, 0, -e_gm * de),
                (0, 1, zero),
                (0, 2, d),
                (0, 3, zero),
                (1, 0, -e_gm * pde),
                (1, 1, diag_e),
                (1, 2, pd),
                (1, 3, zero),
            )
            for bi, bj, blk in blocks:
                plgpu.store(
                    m_ref.at[b, hv, (bi * ts + ti)[:, None], (bj * ts + t)[None, :]], top(blk), mask=(t < ts)[None, :]
                )

            @pl.when(m > 0)
            def _history():  # M_h [2ts, L] with Hc = X K_hist^T diag(c)
                suffix = jnp.sum(jnp.where(jh[None, :] > jh[:, None], hg[None, :], 0.0), axis=1)
                c = jnp.where(live, jnp.exp(suffix), 0.0)[:, None]
                hck_t, hcq_t = c * hk_t, c * hq_t  # Hc^T [L, T]
                mh_u = -dot_f32(finite_or_zero(de), hck_t, trans_b=True)  # [T, L]
                mh_o = eG[:, None] * hcq_t.T - dot_f32(finite_or_zero(pde), hck_t, trans_b=True)
                plgpu.store(mh_ref.at[b, hv, ti[:, None], jh[None, :]], top(mh_u))
                plgpu.store(mh_ref.at[b, hv, (ts + ti)[:, None], jh[None, :]], top(mh_o))

            plgpu.store(rg_out.at[(*lay, slot, hv, pos)], g, mask=rec)
            return carry

        jax.lax.fori_loop(0, heads_per_program, head, 0)

        def key_records(i, carry):  # in K chunks: small register tiles
            xk = plgpu.load(k_ref.at[rows[:, None], kh, chunk(i)], mask=valid[:, None], other=0.0)
            plgpu.store(rk_out.at[(*lay, slot, kh, pos[:, None], chunk(i))], xk.astype(rk_out.dtype), mask=rec[:, None])
            return carry

        @pl.when(hv0 % ratio == 0)
        def _keys():  # one writer per key head
            jax.lax.fori_loop(0, kd // block_k, key_records, 0)


# ---------------------------------------------------------------------------------------------
# Kernel 2: the checkpoint pass


def _apply_kernel(
    layer_ref,
    qsl_ref,
    slots_ref,
    wpos_ref,
    q_ref,
    k_ref,
    v_ref,
    ckpt_ref,
    m_ref,
    mh_ref,
    *refs,
    num_requests,
    t_max,
    ts,
    hilo,
    ratio,
    block_v,
    block_k,
    pad_rows,
    stacked,
):
    n_u = 2 if hilo else 1
    ru_in, o_ref, ru_out = refs[:n_u], refs[n_u], refs[n_u + 1 :]
    n_tok, _, kd = q_ref.shape
    ring_len = mh_ref.shape[-1]
    lay = (layer_ref[0],) if stacked else ()
    vb, hv, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    kh = hv // ratio
    vcols = vb * block_v + jnp.arange(block_v, dtype=jnp.int32)
    t = jnp.arange(ts, dtype=jnp.int32)

    @pl.when(b == num_requests)
    def _padding_rows():
        zero_padding_rows(o_ref, qsl_ref, num_requests, [hv], vcols, pad_rows)

    @pl.when(b < num_requests)
    def _request():
        bi, start, n, slot, rows, valid = request_window(qsl_ref, slots_ref, b, num_requests, t_max, t, n_tok)

        @pl.when((slot <= 0) & (n > 0))
        def _null_slot():
            plgpu.store(o_ref.at[rows[:, None], hv, vcols[None, :]], jnp.zeros((ts, block_v), F32), mask=valid[:, None])

        @pl.when((slot > 0) & (n > 0))
        def _verify():
            m = jnp.clip(wpos_ref[slot], 0, ring_len)

            # X rows: [k_0..k_ts; q_0..q_ts] (Z = X h0); the V columns of M take v_0..v_ts (ts zeros after).
            def k_step(i, zt):
                cols = i * block_k + jnp.arange(block_k, dtype=jnp.int32)[None, :]
                x = load_window_rows(k_ref, q_ref, start, n, kh, ts, cols)  # [2ts, BK]
                x = x if x.dtype == BF16 else x.astype(F32)
                h0 = ckpt_ref[(*lay, slot, hv, pl.ds(i * block_k, block_k), pl.ds(vb * block_v, block_v))]
                h0 = h0 if h0.dtype == BF16 else h0.astype(F32)  # [BK, BV]
                return zt + dot_f32(h0, x, trans_a=True, trans_b=True)  # [BV, 2ts]

            zt = jax.lax.fori_loop(0, kd // block_k, k_step, jnp.zeros((block_v, 2 * ts), F32))
            r = jnp.arange(2 * ts, dtype=jnp.int32)
            v_ok = (r < ts) & (r < n)
            vt = plgpu.load(
                v_ref.at[jnp.where(v_ok, start + r, 0)[None, :], hv, vcols[:, None]], mask=v_ok[None, :], other=0.0
            )  # [BV, 2ts]
            vt = vt if vt.dtype == BF16 else vt.astype(F32)
            m_z = m_ref[bi, hv, :, pl.ds(0, 2 * ts)]  # [2ts, 2ts]
            m_v = m_ref[bi, hv, :, pl.ds(2 * ts, 2 * ts)]  # [2ts, 2ts], cols >= ts: 0
            yt = dot_f32(finite_or_zero(zt), m_z, trans_b=True) + dot_f32(
                finite_or_zero(vt), m_v, trans_b=True
            )  # [BV, 2ts]

            def history():
                jh = jnp.arange(ring_len, dtype=jnp.int32)
                ok = jh < m
                at = (*lay, slot, hv, jnp.where(ok, jh, 0)[:, None], vcols[None, :])
                parts = [plgpu.load(p.at[at], mask=ok[:, None], other=0.0) for p in ru_in]  # [L, BV]
                if not hilo:
                    parts = list(split_bf16(parts[0]))
                mh_hi, mh_lo = split_bf16(mh_ref[bi, hv, :, :])  # [2ts, L]
                mm = functools.partial(plgpu.dot, trans_a=True, trans_b=True)
                return mm(parts[1], mh_hi) + mm(parts[0], mh_lo) + mm(parts[0], mh_hi)

            yt += jax.lax.cond(m > 0, history, lambda: jnp.zeros((block_v, 2 * ts), F32))
            ut, ot = jnp.split(yt, 2, axis=1)  # [BV, ts]
            plgpu.store(o_ref.at[rows[None, :], hv, vcols[:, None]], ot, mask=valid[None, :])
            pos = m + t
            rec = valid & (pos < ring_len)
            for ref, part in zip(ru_out, split_bf16(ut) if hilo else (ut,)):
                plgpu.store(ref.at[(*lay, slot, hv, pos[None, :], vcols[:, None])], part, mask=rec[None, :])


# ---------------------------------------------------------------------------------------------
# Wrapper


def coefficients(
    q,
    k,
    g,
    beta,
    ring_k,
    ring_g,
    write_pos,
    query_start_loc,
    slots,
    t_max,
    *,
    block_k,
    num_warps,
    interpret,
    layer,
    heads_per_program=None,
):
    """Kernel 1: (M [B, HV, 2ts, 4ts], M_h [B, HV, 2ts, L], ring_k', ring_g') float32, the window's
    key and gate records written. Rows of requests with slot 0 or no tokens (and M_h of requests
    without history) are left unwritten: the apply kernel does not read them.

    heads_per_program: value heads per program, 1 or r = HV / H (the Gram products are then shared
    by the r heads of a key head). Default: 1 while B * HV one-warp programs fit in one wave on the
    GPU (ONE_WAVE), r beyond. Each head's arithmetic is the same either way: M is bit-identical."""
    n_tok, h, kd = q.shape
    hv = g.shape[1]
    num_requests = slots.shape[0]
    ring_len = ring_g.shape[-1]
    ts = window_tile(t_max)
    tt = max(16, ts)
    i32 = lambda x: jnp.asarray(x).astype(jnp.int32)
    ratio = hv // h
    if heads_per_program is None:
        heads_per_program = 1 if num_requests * hv <= ONE_WAVE else ratio
    if heads_per_program not in (1, ratio):
        raise ValueError(f"heads_per_program={heads_per_program}: must be 1 or HV / H = {ratio}")
    kernel = functools.partial(
        _coeff_kernel,
        t_max=t_max,
        tt=tt,
        ts=ts,
        ratio=ratio,
        heads_per_program=heads_per_program,
        block_k=block_k,
        stacked=layer is not None,
    )
    return pl.pallas_call(
        kernel,
        grid=(hv // heads_per_program, num_requests),
        out_shape=(
            jax.ShapeDtypeStruct((num_requests, hv, 2 * ts, 4 * ts), F32),
            jax.ShapeDtypeStruct((num_requests, hv, 2 * ts, ring_len), F32),
            jax.ShapeDtypeStruct(ring_k.shape, ring_k.dtype),
            jax.ShapeDtypeStruct(ring_g.shape, ring_g.dtype),
        ),
        input_output_aliases={8: 2, 9: 3},
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        name="gdn_verify_coefficients",
    )(layer_operand(layer), i32(query_start_loc), i32(slots), i32(write_pos), q, k, g, beta, ring_k, ring_g)


def apply(
    q,
    k,
    v,
    ckpt,
    mat,
    mat_h,
    parts,
    write_pos,
    query_start_loc,
    slots,
    t_max,
    *,
    block_v,
    block_k,
    num_warps,
    num_stages,
    pad_rows,
    interpret,
    layer,
):
    """Kernel 2: (o [N, HV, V] float32, ring_u parts') from the checkpoint and the coefficients."""
    n_tok, h, kd = q.shape
    _, hv, vd = v.shape
    num_requests = slots.shape[0]
    i32 = lambda x: jnp.asarray(x).astype(jnp.int32)
    kernel = functools.partial(
        _apply_kernel,
        num_requests=num_requests,
        t_max=t_max,
        ts=window_tile(t_max),
        hilo=len(parts) == 2,
        ratio=hv // h,
        block_v=block_v,
        block_k=block_k,
        pad_rows=pad_rows,
        stacked=layer is not None,
    )
    first_ring = 10
    o, *new_parts = pl.pallas_call(
        kernel,
        grid=(vd // block_v, hv, num_requests + 1),
        out_shape=(
            jax.ShapeDtypeStruct((n_tok, hv, vd), F32),
            *(jax.ShapeDtypeStruct(p.shape, p.dtype) for p in parts),
        ),
        input_output_aliases={first_ring + i: 1 + i for i in range(len(parts))},
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="gdn_verify_apply",
    )(layer_operand(layer), i32(query_start_loc), i32(slots), i32(write_pos), q, k, v, ckpt, mat, mat_h, *parts)
    return o, tuple(new_parts)


def gdn_verify(
    q,
    k,
    v,
    g,
    beta,
    ckpt,
    ring_k,
    ring_u,
    ring_g,
    write_pos,
    query_start_loc,
    slots,
    t_max,
    *,
    config: VerifyConfig | None = None,
    interpret: bool | None = None,
    layer: int | None = None,
):
    """Kernel version of `jaxspec.ops.gdn.gdn_verify` (same arguments and results, `layer` included).

    The ring arrays are aliased to the outputs (updated in place when the caller donates them;
    entries other than the window's records are untouched). With `layer` the checkpoint and rings
    are layer stacks, read and written in place at that layer.
    """
    if interpret is None:
        interpret = default_interpret()
    kd, vd = q.shape[-1], v.shape[-1]
    cfg = config or default_config(ckpt.dtype, vd)
    block_k = min(cfg.block_k, kd)
    parts = _parts(ring_u)
    mat, mat_h, ring_k, ring_g = coefficients(
        q,
        k,
        g,
        beta,
        ring_k,
        ring_g,
        write_pos,
        query_start_loc,
        slots,
        t_max,
        block_k=block_k,
        num_warps=cfg.coeff_warps,
        interpret=interpret,
        layer=layer,
    )
    o, new_parts = apply(
        q,
        k,
        v,
        ckpt,
        mat,
        mat_h,
        parts,
        write_pos,
        query_start_loc,
        slots,
        t_max,
        block_v=min(cfg.block_v, vd),
        block_k=block_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        pad_rows=cfg.pad_rows,
        interpret=interpret,
        layer=layer,
    )
    return o, ring_k, new_parts if len(parts) == 2 else new_parts[0], ring_g
