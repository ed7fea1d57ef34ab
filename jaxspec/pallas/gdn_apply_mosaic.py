"""Mosaic GPU (TMA + wgmma on SMEM tiles) version of the two-pass replay verify's apply kernel.

Contract: `gdn_verify_two_pass.apply` (the Triton kernel) for a bf16 checkpoint, one float32
ring_u part, no layer stacks and t_max <= 8: o [N, HV, V] float32 and ring_u with the window's U
records written; the math is in the `gdn_verify_two_pass` docstring:
    [U; O] = M [Z; V] + M_h U_hist,   Z = [k rows; q rows] h0.
Reached only through `apply_mosaic` (tests, bench/gdn_verify_kernel.py): impl="auto" keeps the
Triton apply, which the H200 runs 3x faster (bench/RESULTS.md, 2026-12-01 second session: ~315
against ~82 us at batch 128). This kernel needs 192-224 KB of shared memory, so one program runs per
SM, and each program is a serial chain of TMA waits, register passes and wgmma groups (~7 us) with
no other program's loads in flight.

Why the layout is what it is: in jax 0.11.2 Mosaic gives register tiles of fewer than 64 rows
strided layouts that cannot be stored into the swizzled SMEM a wgmma operand needs, so every
register pass here works on a 64- or 128-row tile and the small operands are row slices of those
tiles or come straight from TMA (probes: transposed views of whole tiles and of row slices, row
slices as B operands, TMA into row slices, all lower for the H200 and match in GPU interpret mode).
Per program (request b, value head hd), one warpgroup:
  X = [k; q] rows f32 -> SMEM [64, K] (TMA, rows 0..15) -> bf16 hi / lo [64, K]; that f32 tile
      then takes the U_hist rows and at last Y (K = V), to stay within the 227 KB of shared memory
  Z^T [V, 16] = h0^T X^T (A: h0 SMEM [K, V] transposed view; B: X rows 0..15, transposed view),
      columns of tokens >= n and non-finite values zeroed (causality by selection), split hi / lo
  V rows -> SMEM [64, V] (TMA rows 0..7) -> rows >= n and non-finite zeroed -> bf16 hi (/ lo)
  U_hist rows (TMA only if m = write_pos > 0) -> rows >= m, non-finite zeroed -> bf16 hi / lo
  M [16, 32], M_h [16, L] f32 -> SMEM 64-row tiles (TMA rows 0..15) -> bf16 hi / lo A tiles
  Y [64, V] = M_z Z + M_v V + M_h U_hist (hi/lo products: float32-accurate), rows 0..7 U, 8..15 O
  o rows i < n by one-row TMA stores; U rows to a compact [B, HV, 8, V] output, which the wrapper
  scatters into ring_u (plgpu.kernel has no input_output_aliases in 0.11.2: no in-place ring).
Rows of requests on the null slot and the padding tokens after the last request get zeros.
"""
import jax
import jax.numpy as jnp
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from jaxspec.pallas.gdn_window_math import finite_or_zero
from jaxspec.pallas.tiles import split_bf16

F32, BF16 = jnp.float32, jnp.bfloat16
TS = 8                  # window rows: t_max <= 8 (window_tile(t_max) == 8)
ROWS = 64               # rows of every register-pass tile (see the module docstring)


def supports(q, k, v, ckpt, ring_u_parts, t_max, layer) -> bool:
    """bf16 checkpoint [S1, HV, K, V] with K = V in {64, 128}, one float32 ring_u part [S1, HV, L, V]
    with L in {16, 32, 48, 64}, t_max <= 8, no layer stacks, q / k float32 [N, H, K], HV % H == 0."""
    try:
        if layer is not None or len(ring_u_parts) != 1 or not (1 <= t_max <= TS):
            return False
        (ring_u,) = ring_u_parts
        _, hv, kd, vd = ckpt.shape
        return bool(ckpt.dtype == BF16 and kd == vd and kd in (64, 128)
                    and ring_u.dtype == F32 and ring_u.shape[-1] == vd and ring_u.shape[-2] in (16, 32, 48, 64)
                    and q.dtype == F32 and k.dtype == F32 and q.shape == k.shape and q.shape[-1] == kd
                    and v.shape[1:] == (hv, vd) and hv % q.shape[1] == 0)
    except (AttributeError, TypeError, ValueError):
        return False


def _row_iota(cols):
    return jax.lax.broadcasted_iota(jnp.int32, (ROWS, cols), 0)


def _kernel(info_ref, q_ref, k_ref, v_ref, ckpt_ref, mat_ref, math_ref, ring_ref, zeros_ref, o_ref, rec_ref,
            info_s, h_s, xf, xh, xl, zh, zl, vs, vh, vl, uh, ul, mf, mhf, azh, azl, avh, avl, ahh, ahl,
            bar, *, ratio, ring_len, split_v):
    b, hd = jax.lax.axis_index("b"), jax.lax.axis_index("h")
    num_requests = rec_ref.shape[0]
    kd, vd = h_s.shape
    plgpu.copy_gmem_to_smem(info_ref.at[b], info_s, bar.at[0])
    y_s = xf            # one f32 [64, K = V] tile holds the X rows, then U_hist, then Y (shared memory)
    plgpu.copy_gmem_to_smem(zeros_ref, y_s.at[pl.ds(0, TS)], bar.at[1])      # zero rows for null / padding
    plgpu.barrier_wait(bar.at[0])
    plgpu.barrier_wait(bar.at[1])
    start, n, slot, m = info_s[0], info_s[1], info_s[2], info_s[3]

    def zero_rows():
        def row(i, carry):
            plgpu.copy_smem_to_gmem(y_s.at[pl.ds(0, 1)], o_ref.at[pl.ds(start + i, 1), hd])
            return carry
        jax.lax.fori_loop(0, n, row, 0)
        plgpu.wait_smem_to_gmem(0)

    @pl.when((b == num_requests) | (slot <= 0))      # the padding tokens; requests on the null slot
    def _zeros():
        zero_rows()

    @pl.when((b < num_requests) & (slot > 0) & (n > 0))
    def _verify():
        kh = hd // ratio
        plgpu.copy_gmem_to_smem(ckpt_ref.at[slot, hd], h_s, bar.at[2])
        plgpu.copy_gmem_to_smem(k_ref.at[pl.ds(start, TS), kh], xf.at[pl.ds(0, TS)], bar.at[3])
        plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(start, TS), kh], xf.at[pl.ds(TS, TS)], bar.at[4])
        plgpu.copy_gmem_to_smem(v_ref.at[pl.ds(start, TS), hd], vs.at[pl.ds(0, TS)], bar.at[5])
        plgpu.copy_gmem_to_smem(mat_ref.at[b, hd], mf.at[pl.ds(0, 2 * TS)], bar.at[6])
        plgpu.copy_gmem_to_smem(math_ref.at[b, hd], mhf.at[pl.ds(0, 2 * TS)], bar.at[7])

        for i in range(3, 8):
            plgpu.barrier_wait(bar.at[i])
        x_hi, x_lo = split_bf16(xf[...])                       # rows >= 16 are never read as operands
        xh[...] = x_hi
        xl[...] = x_lo
        vv = vs[...].astype(F32)
        v_hi, v_lo = split_bf16(finite_or_zero(jnp.where(_row_iota(vd) < n, vv, 0.0)))
        vh[...] = v_hi
        if split_v:
            vl[...] = v_lo
        # M_h is left unwritten by the coefficient kernel when the slot has no history: select it off
        for src, dst_hi, dst_lo, live in ((mf.at[:, pl.ds(0, 2 * TS)], azh, azl, True),
                                          (mf.at[:, pl.ds(2 * TS, 2 * TS)], avh, avl, True),
                                          (mhf, ahh, ahl, m > 0)):
            cols = src.shape[1]
            hi, lo = split_bf16(jnp.where((_row_iota(cols) < 2 * TS) & live, src[...], 0.0))
            dst_hi[...] = hi
            dst_lo[...] = lo

        @pl.when(m > 0)       # the history rows into the X tile, now free (read only when m > 0)
        def _history_rows():
            plgpu.copy_gmem_to_smem(ring_ref.at[slot, hd], xf.at[pl.ds(0, ring_len)], bar.at[8])
            plgpu.barrier_wait(bar.at[8])

        uu = xf[...]                                        # rows >= m (all of them when m = 0): off
        u_hi, u_lo = split_bf16(finite_or_zero(jnp.where(_row_iota(vd) < m, uu, 0.0)))
        uh[...] = u_hi
        ul[...] = u_lo
        plgpu.commit_smem()
        plgpu.barrier_wait(bar.at[2])

        def z_product(acc):
            ht = h_s.transpose((1, 0))
            plgpu.wgmma(acc, ht, xh.at[pl.ds(0, 2 * TS)].transpose((1, 0)))
            plgpu.wgmma(acc, ht, xl.at[pl.ds(0, 2 * TS)].transpose((1, 0)))
            return acc[...]
        zt = pl.run_scoped(z_product, plgpu.ACC((vd, 2 * TS), F32))           # [V, 16]: k rows, q rows
        col = jax.lax.broadcasted_iota(jnp.int32, (vd, 2 * TS), 1)
        z_hi, z_lo = split_bf16(finite_or_zero(jnp.where((col % TS) < n, zt, 0.0)))
        zh[...] = z_hi
        zl[...] = z_lo
        plgpu.commit_smem()

        def y_product(acc):
            zht, zlt = zh.transpose((1, 0)), zl.transpose((1, 0))                # [16, V]
            plgpu.wgmma(acc, azh, zht)
            plgpu.wgmma(acc, azh, zlt)
            plgpu.wgmma(acc, azl, zht)
            vrows = vh.at[pl.ds(0, 2 * TS)]
            plgpu.wgmma(acc, avh, vrows)
            plgpu.wgmma(acc, avl, vrows)
            if split_v:                     # float32 v: its low half too (bf16 v is exact)
                plgpu.wgmma(acc, avh, vl.at[pl.ds(0, 2 * TS)])
            urows_hi, urows_lo = uh.at[pl.ds(0, ring_len)], ul.at[pl.ds(0, ring_len)]
            plgpu.wgmma(acc, ahh, urows_hi)
            plgpu.wgmma(acc, ahh, urows_lo)
            plgpu.wgmma(acc, ahl, urows_hi)
            return acc[...]
        y_s[...] = pl.run_scoped(y_product, plgpu.ACC((ROWS, vd), F32))      # rows 0..7 U, 8..15 O
        plgpu.commit_smem()
        for i in range(TS):
            @pl.when(i < n)
            def _row():
                plgpu.copy_smem_to_gmem(y_s.at[pl.ds(TS + i, 1)], o_ref.at[pl.ds(start + i, 1), hd])
        plgpu.copy_smem_to_gmem(y_s.at[pl.ds(0, TS)], rec_ref.at[b, hd])
        plgpu.wait_smem_to_gmem(0)


def apply_mosaic(q, k, v, ckpt, mat, mat_h, ring_u, write_pos, query_start_loc, slots, t_max, *,
                 interpret=None):
    """(o [N, HV, V] float32, ring_u') like `gdn_verify_two_pass.apply` with parts = (ring_u,)."""
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    if not supports(q, k, v, ckpt, (ring_u,), t_max, None):
        raise ValueError("apply_mosaic: unsupported shapes / dtypes (see gdn_apply_mosaic.supports)")
    n_tok, h, kd = q.shape
    _, hv, vd = v.shape
    num_requests = slots.shape[0]
    ring_len = ring_u.shape[-2]
    i32 = lambda x: jnp.asarray(x).astype(jnp.int32)
    qsl, slots, write_pos = i32(query_start_loc), i32(slots), i32(write_pos)
    start = qsl[:-1]
    n = jnp.clip(qsl[1:] - start, 0, t_max)
    m = jnp.clip(write_pos[jnp.maximum(slots, 0)], 0, ring_len)
    pad = jnp.stack([qsl[-1], jnp.int32(n_tok) - qsl[-1], jnp.int32(-1), jnp.int32(0)])
    info = jnp.concatenate([jnp.stack([start, n, slots, m], axis=1), pad[None]], axis=0)     # [B + 1, 4]
    split_v = v.dtype != BF16
    scratch = [
        plgpu.SMEM((4,), jnp.int32),
        plgpu.SMEM((kd, vd), BF16),                                              # h0
        plgpu.SMEM((ROWS, kd), F32), plgpu.SMEM((ROWS, kd), BF16), plgpu.SMEM((ROWS, kd), BF16),   # X
        plgpu.SMEM((vd, 2 * TS), BF16), plgpu.SMEM((vd, 2 * TS), BF16),          # Z^T hi / lo
        plgpu.SMEM((ROWS, vd), v.dtype), plgpu.SMEM((ROWS, vd), BF16),                             # V
        plgpu.SMEM((ROWS, vd) if split_v else (8, 64), BF16),                                  # V lo (f32 v)
        plgpu.SMEM((ROWS, vd), BF16), plgpu.SMEM((ROWS, vd), BF16),                            # U_hist
        plgpu.SMEM((ROWS, 4 * TS), F32), plgpu.SMEM((ROWS, ring_len), F32),       # M, M_h
        *(plgpu.SMEM((ROWS, 2 * TS), BF16) for _ in range(4)),                   # M_z, M_v hi / lo
        plgpu.SMEM((ROWS, ring_len), BF16), plgpu.SMEM((ROWS, ring_len), BF16),   # M_h hi / lo
        plgpu.Barrier(num_barriers=9),
    ]
    kernel = plgpu.kernel(
        lambda *refs: _kernel(*refs, ratio=hv // h, ring_len=ring_len, split_v=split_v),
        out_type=(jax.ShapeDtypeStruct((n_tok, hv, vd), F32),
                  jax.ShapeDtypeStruct((num_requests, hv, TS, vd), F32)),
        scratch_types=scratch, grid=(num_requests + 1, hv), grid_names=("b", "h"),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    o, rec = kernel(info, q, k, v, ckpt, mat, mat_h, ring_u, jnp.zeros((TS, vd), F32))
    # the window's U records into the ring: (slot, hv, m + i) for i < n, m + i < L, live slots
    t = jnp.arange(TS, dtype=jnp.int32)
    keep = (t[None, :] < n[:, None]) & (slots[:, None] > 0) & (m[:, None] + t[None, :] < ring_len)
    dest_slot = jnp.where(keep, slots[:, None], ring_u.shape[0])                    # out of range: dropped
    ring_u = ring_u.at[dest_slot[..., None], jnp.arange(hv)[None, None, :], (m[:, None] + t[None, :])[..., None]].set(
        jnp.swapaxes(rec, 1, 2), mode="drop")
    return o, ring_u
