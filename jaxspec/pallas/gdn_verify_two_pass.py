"""GDN replay verify in two Pallas (Triton) kernels: the window's coefficients, then one streaming
pass over the checkpoint (VerifyConfig(group="two_pass"); reached through `gdn_verify.gdn_verify`).

Contract and math: `jaxspec.ops.gdn.gdn_verify` and the `gdn_verify` module docstring. Everything
with a V axis is linear in three V-axis inputs,
    Z = X h0 [2T, V] (X = [k_0..k_T; q_0..q_T], the checkpoint product), V [T, V], U_hist [L, V]:
    U = D V - e^{G_m} D E Z_k - D E Hc_k U_hist            D = (I + A)^{-1} diag(beta), E = diag(e^G)
    O = P D V - e^{G_m} P D E Z_k + e^{G_m} E Z_q + (E Hc_q - P D E Hc_k) U_hist
with Hc = X K_hist^T diag(c), c_j = e^{G_m - G_j}. So [U; O] = M [Z; V] + M_h U_hist with small
matrices M [2ts, 4ts] and M_h [2ts, L] that need no V-axis data (ts = max(8, next_pow2(t_max))).

Why two kernels: the one-kernel verify keeps its serial work (Gram products, forward
substitution) in the same program as the checkpoint read, so its SMs hold too few checkpoint
bytes in flight (3 programs of ~143 registers per SM). Here

  coefficients: grid (HV / heads_per_program, B): a program computes the Gram products of the
      window's keys and queries (and the history keys' dots with them), then for each of its value
      heads (1, or the r heads of the key head at large batch) builds M (and M_h when the slot has
      history) from the head's g/beta and history gates, and writes the window's ring_g and ring_k
      records. No checkpoint traffic. Its tiles are [T, T]: one warp (VerifyConfig.coeff_warps)
      runs it with no cross-warp barrier.
  apply: grid (V // block_v, HV, B + 1): streams ckpt[slot, hv, :, vblk] once in K chunks into
      Z^T = h0^T X^T [block_v, 2ts] (M = block_v: warpgroup MMA), then
      [U; O]^T = [Z; V; 0]^T M^T (+ U_hist^T M_h^T only if write_pos > 0), two dots over the Z and
      the V columns of M, and writes o and the ring_u records. Row z = B writes the zero rows of
      the padding tokens.

M and M_h are float32 scratch outputs of the first kernel, [B, HV, 2ts, 4ts] and [B, HV, 2ts, L]
(2 KB + 1 KB per (request, value head) at T 8, L 16: ~6 % of the bf16 checkpoint's bytes).

Causality by selection, as in the one-kernel verify: every block of M and M_h is exactly 0 where a
row's token precedes a column's token (built with `where`, the operands of the compositions made
finite first), and W, U_hist are made finite before the dots, so a non-finite input at token t
reaches no output or record of an earlier token, bit for bit.
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxspec.pallas.gdn_window_math import (dot_f32, finite_or_zero, load_window_rows, request_window,
                                            unit_lower_inverse, zero_padding_rows)
from jaxspec.pallas.tiles import split_bf16

F32, BF16 = jnp.float32, jnp.bfloat16
# Programs of the coefficient kernel the H200 runs at once: 132 SMs x 16 one-warp programs (~123
# registers a thread). Up to this many, one value head per program: the chain of a program (its
# latency) is what the kernel costs; beyond, programs share a key head's Gram products.
ONE_WAVE = 132 * 16


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


def _coeff_kernel(qsl_ref, slots_ref, wpos_ref, q_ref, k_ref, g_ref, beta_ref, rk_in, rg_in,
                  m_ref, mh_ref, rk_out, rg_out, *, t_max, tt, ts, ratio, heads_per_program, block_k, layer):
    n_tok, _, kd = q_ref.shape
    ring_len = rg_in.shape[-1]
    lay = () if layer is None else (jnp.int32(layer),)
    prog, b = pl.program_id(0), pl.program_id(1)
    hv0 = prog * heads_per_program                     # this program's value heads: hv0 ..
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
            return load_window_rows(k_ref, q_ref, start, n, kh, ts, cols).astype(F32)     # [2ts, BK]

        def chunk(i):
            return i * block_k + jnp.arange(block_k, dtype=jnp.int32)[None, :]

        def gram_step(i, s_acc):
            x = load_x(chunk(i))
            return s_acc + dot_f32(x, x, trans_b=True)

        s_win = jax.lax.fori_loop(0, kd // block_k, gram_step, jnp.zeros((2 * ts, 2 * ts), F32))
        kk, qk = _window_blocks(s_win, ts, tt)                                          # [T, T]

        jh = jnp.arange(ring_len, dtype=jnp.int32)
        live = jh < m

        def history_gram():                              # [L, 2ts]: k_hist_j . x
            def step(i, acc):
                xh = plgpu.load(rk_in.at[(*lay, slot, kh, jnp.where(live, jh, 0)[:, None], chunk(i))],
                                mask=live[:, None], other=0.0)
                return acc + dot_f32(xh.astype(F32), load_x(chunk(i)), trans_b=True)
            return jax.lax.fori_loop(0, kd // block_k, step, jnp.zeros((ring_len, 2 * ts), F32))

        s_hist = jax.lax.cond(m > 0, history_gram, lambda: jnp.zeros((ring_len, 2 * ts), F32))
        hk_t, hq_t = _key_query_columns(finite_or_zero(s_hist), ts, tt)                 # [L, T]
        row, col = t[:, None], t[None, :]
        incl, strict = col <= row, col < row
        zero = jnp.zeros((tt, tt), F32)
        ti = jnp.arange(ts, dtype=jnp.int32)
        top = (lambda x: jnp.split(x, tt // ts, axis=0)[0]) if ts < tt else (lambda x: x)   # rows < ts

        def head(j, carry):
            hv = hv0 + j
            g = plgpu.load(g_ref.at[rows, hv], mask=valid, other=0.0).astype(F32)
            beta = plgpu.load(beta_ref.at[rows, hv], mask=valid, other=0.0).astype(F32)
            G = jnp.sum(jnp.where(incl, g[None, :], 0.0), axis=1)                      # inclusive cumsum
            decay = jnp.exp(jnp.where(incl, G[:, None] - G[None, :], -jnp.inf))         # masked before exp
            a = jnp.where(strict, beta[:, None] * kk * decay, 0.0)
            p = jnp.where(incl, qk * decay, 0.0)
            t_inv = unit_lower_inverse(a.T, t, t_max)
            eG = jnp.exp(G)
            d = jnp.where(incl, t_inv * beta[None, :], 0.0)                             # D = Tinv diag(beta)
            de = jnp.where(incl, d * eG[None, :], 0.0)                                  # D E
            pd = dot_f32(p, finite_or_zero(d))
            pde = jnp.where(incl, pd * eG[None, :], 0.0)                                # P D E

            # History: e^{G_m} scales the checkpoint columns; c_j = e^{G_m - G_j} = e^{sum_{j<l<m} g_l}.
            hg = plgpu.load(rg_in.at[(*lay, slot, hv, jnp.where(live, jh, 0))], mask=live, other=0.0).astype(F32)
            e_gm = jnp.exp(jnp.sum(hg))

            # M [2ts, 4ts]: rows U then O (ts each), columns Z_k, Z_q, V, 0 (ts each). The first ts
            # rows of each [tt, tt] block go to their place through a store masked to columns < ts.
            diag_e = jnp.where(row == col, e_gm * eG[None, :], 0.0)
            blocks = ((0, 0, -e_gm * de), (0, 1, zero), (0, 2, d), (0, 3, zero),
                      (1, 0, -e_gm * pde), (1, 1, diag_e), (1, 2, pd), (1, 3, zero))
            for bi, bj, blk in blocks:
                plgpu.store(m_ref.at[b, hv, (bi * ts + ti)[:, None], (bj * ts + t)[None, :]], top(blk),
                            mask=(t < ts)[None, :])

            @pl.when(m > 0)
            def _history():                               # M_h [2ts, L] with Hc = X K_hist^T diag(c)
                suffix = jnp.sum(jnp.where(jh[None, :] > jh[:, None], hg[None, :], 0.0), axis=1)
                c = jnp.where(live, jnp.exp(suffix), 0.0)[:, None]
                hck_t, hcq_t = c * hk_t, c * hq_t                                      # Hc^T [L, T]
                mh_u = -dot_f32(finite_or_zero(de), hck_t, trans_b=True)               # [T, L]
                mh_o = eG[:, None] * hcq_t.T - dot_f32(finite_or_zero(pde), hck_t, trans_b=True)
                plgpu.store(mh_ref.at[b, hv, ti[:, None], jh[None, :]], top(mh_u))
                plgpu.store(mh_ref.at[b, hv, (ts + ti)[:, None], jh[None, :]], top(mh_o))

            plgpu.store(rg_out.at[(*lay, slot, hv, pos)], g, mask=rec)
            return carry

        jax.lax.fori_loop(0, heads_per_program, head, 0)

        def key_records(i, carry):                         # in K chunks: small register tiles
            xk = plgpu.load(k_ref.at[rows[:, None], kh, chunk(i)], mask=valid[:, None], other=0.0)
            plgpu.store(rk_out.at[(*lay, slot, kh, pos[:, None], chunk(i))], xk.astype(rk_out.dtype),
                        mask=rec[:, None])
            return carry

        @pl.when(hv0 % ratio == 0)
        def _keys():                                       # one writer per key head
            jax.lax.fori_loop(0, kd // block_k, key_records, 0)


# ---------------------------------------------------------------------------------------------
# Kernel 2: the checkpoint pass


def _apply_kernel(qsl_ref, slots_ref, wpos_ref, q_ref, k_ref, v_ref, ckpt_ref, m_ref, mh_ref, *refs,
                  num_requests, t_max, ts, hilo, ratio, block_v, block_k, pad_rows, layer):
    n_u = 2 if hilo else 1
    ru_in, o_ref, ru_out = refs[:n_u], refs[n_u], refs[n_u + 1:]
    n_tok, _, kd = q_ref.shape
    ring_len = mh_ref.shape[-1]
    lay = () if layer is None else (jnp.int32(layer),)
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
            plgpu.store(o_ref.at[rows[:, None], hv, vcols[None, :]], jnp.zeros((ts, block_v), F32),
                        mask=valid[:, None])

        @pl.when((slot > 0) & (n > 0))
        def _verify():
            m = jnp.clip(wpos_ref[slot], 0, ring_len)
            # X rows: [k_0..k_ts; q_0..q_ts] (Z = X h0); the V columns of M take v_0..v_ts (ts zeros after).
            def k_step(i, zt):
                cols = i * block_k + jnp.arange(block_k, dtype=jnp.int32)[None, :]
                x = load_window_rows(k_ref, q_ref, start, n, kh, ts, cols)               # [2ts, BK]
                x = x if x.dtype == BF16 else x.astype(F32)
                h0 = ckpt_ref[(*lay, slot, hv, pl.ds(i * block_k, block_k), pl.ds(vb * block_v, block_v))]
                h0 = h0 if h0.dtype == BF16 else h0.astype(F32)                         # [BK, BV]
                return zt + dot_f32(h0, x, trans_a=True, trans_b=True)                  # [BV, 2ts]

            zt = jax.lax.fori_loop(0, kd // block_k, k_step, jnp.zeros((block_v, 2 * ts), F32))
            r = jnp.arange(2 * ts, dtype=jnp.int32)
            v_ok = (r < ts) & (r < n)
            vt = plgpu.load(v_ref.at[jnp.where(v_ok, start + r, 0)[None, :], hv, vcols[:, None]],
                            mask=v_ok[None, :], other=0.0)                              # [BV, 2ts]
            vt = vt if vt.dtype == BF16 else vt.astype(F32)
            m_z = m_ref[bi, hv, :, pl.ds(0, 2 * ts)]                                    # [2ts, 2ts]
            m_v = m_ref[bi, hv, :, pl.ds(2 * ts, 2 * ts)]                               # [2ts, 2ts], cols >= ts: 0
            yt = (dot_f32(finite_or_zero(zt), m_z, trans_b=True)
                  + dot_f32(finite_or_zero(vt), m_v, trans_b=True))                     # [BV, 2ts]

            def history():
                jh = jnp.arange(ring_len, dtype=jnp.int32)
                ok = jh < m
                at = (*lay, slot, hv, jnp.where(ok, jh, 0)[:, None], vcols[None, :])
                parts = [plgpu.load(p.at[at], mask=ok[:, None], other=0.0) for p in ru_in]    # [L, BV]
                if not hilo:
                    parts = list(split_bf16(parts[0]))
                mh_hi, mh_lo = split_bf16(mh_ref[bi, hv, :, :])                              # [2ts, L]
                mm = functools.partial(plgpu.dot, trans_a=True, trans_b=True)
                return mm(parts[1], mh_hi) + mm(parts[0], mh_lo) + mm(parts[0], mh_hi)

            yt += jax.lax.cond(m > 0, history, lambda: jnp.zeros((block_v, 2 * ts), F32))
            ut, ot = jnp.split(yt, 2, axis=1)                                           # [BV, ts]
            plgpu.store(o_ref.at[rows[None, :], hv, vcols[:, None]], ot, mask=valid[None, :])
            pos = m + t
            rec = valid & (pos < ring_len)
            for ref, part in zip(ru_out, split_bf16(ut) if hilo else (ut,)):
                plgpu.store(ref.at[(*lay, slot, hv, pos[None, :], vcols[:, None])], part, mask=rec[None, :])


# ---------------------------------------------------------------------------------------------
# Wrapper


def coefficients(q, k, g, beta, ring_k, ring_g, write_pos, query_start_loc, slots, t_max, *, block_k,
                 num_warps, interpret, layer, heads_per_program=None):
    """Kernel 1: (M [B, HV, 2ts, 4ts], M_h [B, HV, 2ts, L], ring_k', ring_g') float32, the window's
    key and gate records written. Rows of requests with slot 0 or no tokens (and M_h of requests
    without history) are left unwritten: the apply kernel does not read them.

    heads_per_program: value heads per program, 1 or r = HV / H (the Gram products are then shared
    by the r heads of a key head). Default: 1 while B * HV one-warp programs fit in one wave on the
    H200 (ONE_WAVE), r beyond. Each head's arithmetic is the same either way: M is bit-identical."""
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
    kernel = functools.partial(_coeff_kernel, t_max=t_max, tt=tt, ts=ts, ratio=ratio,
                               heads_per_program=heads_per_program, block_k=block_k, layer=layer)
    return pl.pallas_call(
        kernel,
        grid=(hv // heads_per_program, num_requests),
        out_shape=(jax.ShapeDtypeStruct((num_requests, hv, 2 * ts, 4 * ts), F32),
                   jax.ShapeDtypeStruct((num_requests, hv, 2 * ts, ring_len), F32),
                   jax.ShapeDtypeStruct(ring_k.shape, ring_k.dtype),
                   jax.ShapeDtypeStruct(ring_g.shape, ring_g.dtype)),
        input_output_aliases={7: 2, 8: 3},
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        name="gdn_verify_coefficients",
    )(i32(query_start_loc), i32(slots), i32(write_pos), q, k, g, beta, ring_k, ring_g)


def apply(q, k, v, ckpt, mat, mat_h, parts, write_pos, query_start_loc, slots, t_max, *, block_v, block_k,
          num_warps, num_stages, pad_rows, interpret, layer):
    """Kernel 2: (o [N, HV, V] float32, ring_u parts') from the checkpoint and the coefficients."""
    n_tok, h, kd = q.shape
    _, hv, vd = v.shape
    num_requests = slots.shape[0]
    i32 = lambda x: jnp.asarray(x).astype(jnp.int32)
    kernel = functools.partial(_apply_kernel, num_requests=num_requests, t_max=t_max, ts=window_tile(t_max),
                               hilo=len(parts) == 2, ratio=hv // h, block_v=block_v, block_k=block_k,
                               pad_rows=pad_rows, layer=layer)
    first_ring = 9
    o, *new_parts = pl.pallas_call(
        kernel,
        grid=(vd // block_v, hv, num_requests + 1),
        out_shape=(jax.ShapeDtypeStruct((n_tok, hv, vd), F32),
                   *(jax.ShapeDtypeStruct(p.shape, p.dtype) for p in parts)),
        input_output_aliases={first_ring + i: 1 + i for i in range(len(parts))},
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="gdn_verify_apply",
    )(i32(query_start_loc), i32(slots), i32(write_pos), q, k, v, ckpt, mat, mat_h, *parts)
    return o, tuple(new_parts)


def gdn_verify_two_pass(q, k, v, g, beta, ckpt, ring_k, parts, ring_g, write_pos, query_start_loc, slots,
                        t_max, *, block_v, block_k, num_warps, num_stages, coeff_warps, pad_rows, interpret, layer):
    """The two kernels; arguments as `gdn_verify.gdn_verify` with ring_u given as its tuple of
    parts. Returns (o, ring_k', parts', ring_g')."""
    mat, mat_h, ring_k, ring_g = coefficients(q, k, g, beta, ring_k, ring_g, write_pos, query_start_loc, slots,
                                              t_max, block_k=block_k, num_warps=coeff_warps, interpret=interpret,
                                              layer=layer)
    o, parts = apply(q, k, v, ckpt, mat, mat_h, parts, write_pos, query_start_loc, slots, t_max, block_v=block_v,
                     block_k=block_k, num_warps=num_warps, num_stages=num_stages, pad_rows=pad_rows,
                     interpret=interpret, layer=layer)
    return o, ring_k, parts, ring_g
