"""Mosaic GPU (TMA + wgmma, warp-specialised) split kernel of verify attention, for the short splits.

Contract: the split phase of `attention_verify.attention_verify` (bf16, num_splits > 1): per
(request r, kv head g, split s) the normalised partial o and its log2-sum-exp over the split's keys,
merged by the Triton combine kernel of that module. Semantics and the split plan (keys [s * chunk,
min((s + 1) * chunk, n)), n and chunk from `attention_verify.split_range`, which the wrapper
passes in `info`) are the Triton kernel's; this module changes how one split is computed, not what.

Why a second kernel: at batch 1 / 1k-4k and batch 8 / 1k the Triton split kernel runs one
warpgroup a program that waits for each K/V block, multiplies, does the softmax, multiplies again:
~2 us a block with the SM mostly idle (bench/RESULTS.md, 2026-12-02 fifth session). Here a CTA
holds three warpgroups (flash-attention-3's split of roles): warpgroup 2 issues the TMA copies of
the split's K and V blocks into a ring of `stages` shared-memory slots, and warpgroups 0 and 1
each own every other key block (block b -> warpgroup b % 2, slot b % stages), so one multiplies
or exponentiates while the other waits for its data. Each keeps its own m, l and accumulator; at
the end the two are merged in the CTA (the (m, l) pairs through shared memory, warpgroup 1's
weighted accumulator handed to warpgroup 0 in [64, 64] chunks), so one partial a split leaves it.

Measured (H200, bench/RESULTS.md 2026-12-03, second session): correct on the GPU; the whole path
(info, q gather, split, combine) 1.2-1.35x the Triton path's GPU time at every split shape (1 x 4k
17.5 against 14.1 us, 8 x 1k 25.7 against 20.3, 1 x 32k 53.0 against 44.7), the split kernel alone
1.1-1.2x Triton's. So it is opt-in (`AttentionVerifyConfig(split_kernel="mosaic")`), not the
default. Its first version spilled (3 warpgroups share 64K registers: 168 a thread, the consumers'
[64, 256] float32 accumulator is 128); setmaxnreg (232 / 40) and making the masks' iotas inside
the loop took it from 1.5-1.9x to this. ptxas still spills a few values in the key loop.

Rows: as in the Triton kernel, row i = t * rep + j (window token t, q head g * rep + j) of a
[64, D] tile (wgmma M = 64). Mosaic's TMA into a wgmma (swizzled) tile needs a row offset it can
prove a multiple of 8, which a request's start in q is not (nor are the per-token destination
rows t * rep), so a small Triton kernel gathers q into [B, KVH, 64, D] tiles (rows past the
window zero); each request's scalars come as one 16-byte TMA row of `info`. For the same reason
the caches are viewed as [.., M / 64, 64, KVH, D] (free) so that a key block is one integer index:
M must be a multiple of 64.

Masks: scores of keys >= the split end or past the row's position (causal) are -inf, m starts at a
finite -1e30. TMA reads whole blocks, so the block that holds the request's last key also brings
keys past it (possibly never written: NaN in the tests' poisoned caches); their V rows are zeroed
in shared memory before the P V product (0 * NaN would poison the row), their scores masked.

Layouts: q [N, Hq, D] bf16; caches [S1, M, KVH, D] (or layer stacks [A, S1, M, KVH, D]) bf16;
info [B, 4] int32 = (n keys, slot, seq_len, chunk) with n = 0 for slot-0 and empty requests;
query_start_loc [B+1] int32
  -> opart [B, KVH, S, 64, D] float32, lse [B, KVH, S, 64] float32 (m + log2 l, log2 units;
     -1e30 where no key was visible). CTAs whose split is empty (and those of slot-0 or empty
     requests) write lse = -1e30 alone: the combine weighs them 0 and selects their o away.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
from jax.experimental.pallas import triton as pltriton
from jaxspec.ops import packing
from jaxspec.pallas.tiles import gqa_row_map, next_pow2

F32, BF16 = jnp.float32, jnp.bfloat16
ROWS = 64                 # wgmma M: the Q tile, scores and accumulator of a warpgroup
WARPGROUPS = 2            # consumer warpgroups a CTA
NEG = -1e30
LOG2E = 1.4426950408889634
OUT_COLS = 64             # the f32 partial leaves through shared memory in [64, 64] column chunks
# Registers a thread (setmaxnreg): 3 warpgroups share 64K, 168 each by default, and a consumer's
# [64, 256] float32 accumulator alone is 128 of them, so without the split the consumers spilled
# (ncu, 2026-12-03: ~1.6M local loads + stores a call at 1 x 32k). 2 x 232 + 40 = 504 <= 512.
CONSUMER_REGISTERS, PRODUCER_REGISTERS = 232, 40


def supports(q, k_cache, t_max, block_k, stages) -> bool:
    """bf16 q and caches; D a multiple of 64 up to 256; t_max * Hq / KVH <= 64 rows; block_k 64 and
    M a multiple of it (the blocked cache view); an even number of slots (each warpgroup owns every
    other slot)."""
    try:
        d, hq, kvh, m = q.shape[-1], q.shape[-2], k_cache.shape[-2], k_cache.shape[-3]
        return bool(q.dtype == BF16 and k_cache.dtype == BF16 and d % 64 == 0 and d <= 256
                    and hq % kvh == 0 and isinstance(t_max, int) and 1 <= t_max * (hq // kvh) <= ROWS
                    and block_k == 64 and m % block_k == 0 and stages % 2 == 0 and stages >= 2)
    except (AttributeError, TypeError, IndexError):
        return False


def _accumulate(acc, a, b_ref, a_ref=None):
    """acc + a @ b_ref, acc kept in the wgmma accumulator registers and a (registers) the A operand.
    Mosaic's GPU interpret mode takes A only from shared memory and has no rule for run_state (an
    accumulator initialised from registers): given a_ref (interpret mode), a goes through a_ref and
    the product to a fresh accumulator, then is added: the same sum."""
    if a_ref is not None:
        a_ref[...] = a
        plgpu.commit_smem()

        def product(acc_ref):
            plgpu.wgmma(acc_ref, a_ref, b_ref)
            return acc_ref[...]
        return acc + pl.run_scoped(product, plgpu.ACC(acc.shape, F32))

    def accumulate(acc_ref):
        plgpu.wgmma(acc_ref, a, b_ref)
    return pl.run_state(accumulate)(plgpu.ACC.init(acc))


def _kernel(info_ref, q_ref, k_ref, v_ref, opart_ref, lse_ref, info_s, q_s, k_s, v_s, o_s, lse_s, ml_s, *refs,
            rep, block_k, stages, scale, layer, interpret):
    p_s = refs[0] if interpret else None
    info_bar, q_bar, k_bar, v_bar, k_free, v_free, ml_bar, chunk_ready, chunk_taken = refs[-9:]
    r, g, s = jax.lax.axis_index("r"), jax.lax.axis_index("g"), jax.lax.axis_index("s")
    wg = jax.lax.axis_index("wg")
    d = k_ref.shape[-1]
    lay = () if layer is None else (layer,)

    @pl.when(wg == 2)
    def _request():
        plgpu.copy_gmem_to_smem(info_ref.at[r], info_s, info_bar.at[0])

    plgpu.barrier_wait(info_bar.at[0])
    n, slot, seq_len, chunk = info_s[0], info_s[1], info_s[2], info_s[3]    # n = 0: slot-0 or empty request
    lo = s * chunk
    hi = jnp.minimum(lo + chunk, n)
    blocks = jnp.where(lo < n, pl.cdiv(hi - lo, block_k), 0)

    @pl.when((blocks == 0) & (wg == 0))
    def _empty_split():         # lse -1e30 says so to the combine (which reads no key range of its own)
        lse_s[...] = plgpu.layout_cast(jnp.full((ROWS,), NEG, F32), plgpu.Layout.WGMMA.reduce(1))
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(lse_s, lse_ref.at[r, g, s])
        plgpu.wait_smem_to_gmem(0)

    @pl.when((blocks > 0) & (wg == 2))
    def _producer():
        if not interpret:
            plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
        plgpu.copy_gmem_to_smem(q_ref.at[r, g], q_s, q_bar.at[0])

        def fetch(b, wait_free):
            at, st = (*lay, slot, lo // block_k + b, slice(None), g), b % stages
            for ref, buf, ready, free in ((k_ref, k_s, k_bar, k_free), (v_ref, v_s, v_bar, v_free)):
                if wait_free:           # K of the next block streams in while this one's P V runs
                    plgpu.barrier_wait(free.at[st])
                plgpu.copy_gmem_to_smem(ref.at[at], buf.at[st], ready.at[st])

        for b in range(stages):
            pl.when(b < blocks)(lambda b=b: fetch(b, False))

        @pl.loop(stages, jnp.maximum(blocks, stages))
        def _refill(b):
            fetch(b, True)

        for st in range(stages):        # the last release of each used slot: every phase observed
            @pl.when(st < blocks)
            def _drain():
                plgpu.barrier_wait(k_free.at[st])
                plgpu.barrier_wait(v_free.at[st])

    @pl.when((blocks > 0) & (wg < 2))
    def _consumer():
        if not interpret:
            plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
        plgpu.barrier_wait(q_bar.at[0])
        wgmma = plgpu.Layout.WGMMA
        # The masks' iotas are made where they are used: hoisted [64, 64] and [64, D] int32 tiles
        # would hold ~200 registers a thread through the loop (ptxas spilled them, ncu 2026-12-03).
        pos = seq_len + plgpu.broadcasted_iota(jnp.int32, (ROWS,), 0, layout=wgmma.reduce(1)) // rep   # [64]

        def body(i, carry):
            acc, m, l = carry
            b = 2 * i + wg
            st = b % stages
            k0 = lo + b * block_k
            plgpu.barrier_wait(k_bar.at[st])

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_s, k_s.at[st].transpose((1, 0)))
                return acc_ref[...]

            sc = pl.run_scoped(qk, plgpu.ACC((ROWS, block_k), F32))
            plgpu.barrier_arrive(k_free.at[st])
            last = jnp.minimum(pos, hi - 1) - k0                          # [64] each row's last key, in the block
            col = plgpu.broadcasted_iota(jnp.int32, (ROWS, block_k), 1, layout=wgmma)
            sc = jnp.where(col <= jax.lax.broadcast_in_dim(last, sc.shape, [0]), sc * scale, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(sc, axis=1))
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(sc - jax.lax.broadcast_in_dim(m_new, sc.shape, [0]))
            l = l * alpha + jnp.sum(p, axis=1)
            acc = acc * jax.lax.broadcast_in_dim(alpha, acc.shape, [0])
            plgpu.barrier_wait(v_bar.at[st])

            @pl.when(k0 + block_k > hi)                   # keys past the split end: zero their V rows
            def _zero_tail():
                key_row = plgpu.broadcasted_iota(jnp.int32, (block_k, d), 0, layout=wgmma)
                v_s[st] = jnp.where(key_row < hi - k0, v_s[st], jnp.zeros((block_k, d), BF16))
                plgpu.commit_smem()

            acc = _accumulate(acc, p.astype(BF16), v_s.at[st], p_s.at[wg] if interpret else None)
            plgpu.barrier_arrive(v_free.at[st])
            return acc, m_new, l

        row_vec = lambda x: plgpu.layout_cast(jnp.full((ROWS,), x, F32), wgmma.reduce(1))
        init = (plgpu.layout_cast(jnp.zeros((ROWS, d), F32), wgmma), row_vec(NEG), row_vec(0.0))
        acc, m, l = jax.lax.fori_loop(0, (blocks - wg + 1) // 2, body, init)
        # Merge the two warpgroups' partials here (one partial a split leaves the CTA): both publish
        # (m, l) and weigh their accumulator by 2^(m - m_all) / l_all; warpgroup 1 hands its weighted
        # accumulator over in [64, 64] chunks through o_s[1], warpgroup 0 adds its own and stores.
        ml_s[wg, 0] = m
        ml_s[wg, 1] = l
        plgpu.barrier_arrive(ml_bar.at[0])
        plgpu.barrier_wait(ml_bar.at[0])
        m_other, l_other = ml_s[1 - wg, 0], ml_s[1 - wg, 1]
        m_all = jnp.maximum(m, m_other)
        w_self, w_other = jnp.exp2(m - m_all), jnp.exp2(m_other - m_all)      # 0 for a warpgroup with no key
        l_all = l * w_self + l_other * w_other
        live = l_all > 0
        o = acc * jax.lax.broadcast_in_dim(w_self / jnp.where(live, l_all, 1.0), acc.shape, [0])
        for c in range(d // OUT_COLS):
            part = o[:, c * OUT_COLS:(c + 1) * OUT_COLS]

            @pl.when(wg == 1)
            def _hand_over():
                o_s[1] = part
                plgpu.barrier_arrive(chunk_ready.at[c])
                plgpu.barrier_wait(chunk_taken.at[c])      # o_s[1] is free again

            @pl.when(wg == 0)
            def _store():
                plgpu.barrier_wait(chunk_ready.at[c])
                total = part + o_s[1]
                plgpu.barrier_arrive(chunk_taken.at[c])
                if c:
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                o_s[0] = total
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_s.at[0], opart_ref.at[r, g, s, :, pl.ds(c * OUT_COLS, OUT_COLS)])

        @pl.when(wg == 0)
        def _store_lse():
            lse_s[...] = jnp.where(live, m_all + jnp.log2(jnp.where(live, l_all, 1.0)), NEG)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(lse_s, lse_ref.at[r, g, s])
            plgpu.wait_smem_to_gmem(0)


def _gather_kernel(qsl_ref, q_ref, tiles_ref, *, rep, t_max, d_pad):
    """Tile (r, g) of the query tiles (Triton lowering): its 64 rows gathered from q by one masked
    [64, d_pad] load and stored whole (zeros past the window)."""
    r, g = pl.program_id(0), pl.program_id(1)
    start = qsl_ref[r]
    row = jnp.arange(ROWS, dtype=jnp.int32)
    tok, head, in_win = gqa_row_map(row, rep, t_max, g)
    valid = in_win & (tok < qsl_ref[r + 1] - start)
    cols = jnp.arange(d_pad, dtype=jnp.int32)
    cmask = cols < q_ref.shape[-1]
    rows_q = jnp.where(valid, start + tok, 0)
    x = pltriton.load(q_ref.at[rows_q[:, None], head[:, None], cols[None, :]],
                      mask=valid[:, None] & cmask[None, :], other=0)
    pltriton.store(tiles_ref.at[r, g, row[:, None], cols[None, :]], x, mask=cmask[None, :])


def gather_queries_reference(q, query_start_loc, t_max, kv_heads):
    """gather_queries in jnp (XLA: a gather, transpose and pad fusion)."""
    _, hq, d = q.shape
    rep = hq // kv_heads
    rows, _ = packing.to_padded(q, query_start_loc, t_max)                          # [B, T, Hq, D]
    rows = rows.reshape(-1, t_max, kv_heads, rep, d).transpose(0, 2, 1, 3, 4).reshape(-1, kv_heads, t_max * rep, d)
    return jnp.pad(rows, ((0, 0), (0, 0), (0, ROWS - t_max * rep), (0, 0)))


def gather_queries(q, query_start_loc, t_max, kv_heads, interpret=False):
    """q tiles [B, KVH, 64, D]: row t * rep + j of tile (r, g) is q[start_r + t, g * rep + j], zero
    past the request's length and past t_max * rep. A Pallas (Triton) kernel: XLA's fusion of the
    same gather, transpose and pad took 2.4 us at batch 1 and 7.0 us at batch 8 (H200, 2026-12-03)."""
    _, hq, d = q.shape
    b = query_start_loc.shape[0] - 1
    kernel = functools.partial(_gather_kernel, rep=hq // kv_heads, t_max=t_max, d_pad=next_pow2(d))
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((b, kv_heads, ROWS, d), q.dtype), grid=(b, kv_heads),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1), interpret=interpret,
        name="attention_verify_gather_q",
    )(query_start_loc, q)


def split_partials(q, k_cache, v_cache, info, query_start_loc, t_max, *, num_splits, block_k=64, stages=2,
                   layer=None, interpret=False):
    """(opart [B, KVH, num_splits, 64, D] f32, lse [B, KVH, num_splits, 64] f32); see the module
    docstring for info [B, 4] int32."""
    if not supports(q, k_cache, t_max, block_k, stages):
        raise ValueError(f"attention_verify_mosaic: unsupported q {q.shape} {q.dtype}, k_cache {k_cache.shape} "
                         f"{k_cache.dtype}, t_max {t_max}, block_k {block_k}, stages {stages}")
    d = q.shape[-1]
    max_len, kvh = k_cache.shape[-3:-1]
    b = info.shape[0]
    rep = q.shape[1] // kvh
    # Interpret mode takes XLA's gather: the Triton-interpreted gather in the same jit as the
    # Mosaic-interpreted split kernel left the latter's warpgroup threads waiting at a barrier
    # forever (jax 0.11.2, CPU; each alone passes its tests)
    q_tiles = (gather_queries_reference if interpret else gather_queries)(q, query_start_loc, t_max, kvh)
    blocked = lambda c: c.reshape(*c.shape[:-3], max_len // block_k, block_k, *c.shape[-2:])
    # wgmma operands in 128-byte swizzled 8 x 64 tiles (flash-attention-3's layout; Mosaic's inference
    # picks the same, stated here)
    swizzled = dict(transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)))
    scratch = [
        plgpu.SMEM((4,), jnp.int32),
        plgpu.SMEM((ROWS, d), BF16, **swizzled),
        plgpu.SMEM((stages, block_k, d), BF16, **swizzled),
        plgpu.SMEM((stages, block_k, d), BF16, **swizzled),
        plgpu.SMEM((WARPGROUPS, ROWS, OUT_COLS), F32),
        plgpu.SMEM((ROWS,), F32),
        plgpu.SMEM((WARPGROUPS, 2, ROWS), F32),
        *([plgpu.SMEM((WARPGROUPS, ROWS, block_k), BF16, **swizzled)] if interpret else []),   # P (interpret mode only)
        plgpu.Barrier(num_barriers=1),
        plgpu.Barrier(num_barriers=1),
        *(plgpu.Barrier(num_barriers=stages) for _ in range(4)),
        plgpu.Barrier(num_arrivals=WARPGROUPS, num_barriers=1),
        plgpu.Barrier(num_barriers=d // OUT_COLS),
        plgpu.Barrier(num_barriers=d // OUT_COLS),
    ]
    kernel = plgpu.kernel(
        lambda *refs: _kernel(*refs, rep=rep, block_k=block_k, stages=stages,
                              scale=d ** -0.5 * LOG2E, layer=layer, interpret=interpret),
        out_type=(jax.ShapeDtypeStruct((b, kvh, num_splits, ROWS, d), F32),
                  jax.ShapeDtypeStruct((b, kvh, num_splits, ROWS), F32)),
        scratch_types=scratch, grid=(b, kvh, num_splits), grid_names=("r", "g", "s"),
        num_threads=WARPGROUPS + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    return kernel(info, q_tiles, blocked(k_cache), blocked(v_cache))
