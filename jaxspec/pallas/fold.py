"""GDN fold (Pallas, Triton): every slot's live ring records into its checkpoint, all GDN layers at once.

Contract: `jaxspec.ops.gdn.gdn_fold` (its jnp reference `_fold_state` is the semantics;
docs/design.md section 3). ckpt [G, S1, HV, K, V] or [S1, HV, K, V], float32 or bfloat16, updated
in place (aliased); ring_k [.., S1, H, L, K]; ring_u [.., S1, HV, L, V] float32 or a (hi, lo)
bfloat16 pair; ring_g [.., S1, HV, L] float32; num_records [S1] int32. Per (layer, slot, value
head), with the m = num_records[slot] live records j = 1..m and G the inclusive cumsum of their gates:

    h0 <- e^{G_m} h0 + sum_{j=1..m} e^{G_m - G_j} k_j u_j^T

Design (memory-bound: each checkpoint tile is read once and written once; the records are small
next to it, and the [K x L] . [L x V] product is cheap):
* Grid (HV / heads * V / block_v, S1, G). Axis 0, the fastest-launched CUDA axis, walks the
  [K, block_v] tiles of one slot, so neighbouring programs share key heads in L2 (value head hv
  reads key head hv // r). A program owns `heads` consecutive tiles of one (layer, slot); with
  heads > 1, tile t+1's loads are issued before tile t's math and store. The time over the byte
  floor is latency (the checkpoint read waits on the num_records load; loads land in registers,
  which bounds the bytes an SM keeps in flight).
* m = 0 (the null slot, idle slots): the program returns before any load or store; the aliased
  checkpoint keeps its bits and the slot costs no memory traffic.
* Causality by selection: records j > m are masked at the load (`other=0`), so a NaN or inf in a
  dead record never enters arithmetic; G_m - G_j is formed directly as a masked sum of the later
  gates (no cumsum, no difference of large partial sums).
* float32 accuracy on the tensor cores: the decay goes onto the updates, w_j = e^{G_m - G_j} u_j,
  split into three bfloat16 terms (a hi/lo pair keeps ~16 bits, short of the float32 reference).
  bfloat16 keys are exact, so k^T w is three bf16 MMAs with float32 accumulation; float32 keys are
  split too, and products below 2^-24 are dropped. Triton's f32 dot would be TF32, and its "ieee"
  f32 dot runs on the FMA pipes, too slow to hide under the memory stream.
* Records are consumed `chunk` at a time (a power of two dividing L); the loop runs ceil(m / chunk)
  times, and with L == chunk (the usual ring of 16) there is no loop.
Timings against the byte floor: bench/RESULTS.md.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxspec.pallas.hardware import default_interpret
from jaxspec.pallas.tiles import check_int_fields, check_pow2_fields, is_pow2

_FLOATS = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


@dataclasses.dataclass(frozen=True)
class FoldConfig:
    """Tile sizes of the fold kernel.

    block_v: value columns per checkpoint tile (clipped to V). 64 with 4 warps: a [128, 64] float32
      accumulator is 64 registers per thread, leaving room for ~3 programs per SM.
    heads: value heads (tiles) per program, walked in order with the next tile's loads issued
      before the current tile's math and store. Clipped to the largest power of two that divides
      HV. 1 is fastest on the H200 (tile sweep: docs/journal.md).
    chunk: records per MMA step; 16 is the bf16 MMA's reduction depth.
    num_warps / num_stages: Triton launch parameters (stages only matter for rings longer than chunk).
    """

    block_v: int = 64
    heads: int = 1
    chunk: int = 16
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        check_pow2_fields(self, (("block_v", 16, 512), ("heads", 1, 64), ("chunk", 16, 256), ("num_warps", 1, 16)))
        check_int_fields(self, (("num_stages", 1, 8),))


def default_config(ckpt_dtype, ring_len: int) -> FoldConfig:
    """The tuned configuration (static: checkpoint dtype and ring length, never the batch, so a
    request's state never depends on the batch it ran in). One config is fastest on the H200 for
    both checkpoint dtypes at ring 16 (tile sweep: docs/journal.md); longer rings loop over record chunks with
    the same tiles."""
    del ckpt_dtype, ring_len
    return FoldConfig()


def _parts(ring_u):
    return tuple(ring_u) if isinstance(ring_u, (tuple, list)) else (ring_u,)


def supports(ckpt, ring_k, ring_u, ring_g, num_records) -> bool:
    """Whether the kernel covers these shapes and dtypes (arrays or ShapeDtypeStructs)."""
    try:
        parts = _parts(ring_u)
        nd = ckpt.ndim
        if nd not in (4, 5) or ring_k.ndim != nd or ring_g.ndim != nd - 1 or num_records.ndim != 1:
            return False
        lead = ckpt.shape[:-4]
        s1, hv, kd, vd = ckpt.shape[-4:]
        h, ring_len = ring_k.shape[-3], ring_k.shape[-2]
        if ring_k.shape != lead + (s1, h, ring_len, kd) or ring_g.shape != lead + (s1, hv, ring_len):
            return False
        if num_records.shape != (s1,) or num_records.dtype != jnp.int32:
            return False
        if len(parts) == 1:
            if parts[0].dtype != jnp.float32:
                return False
        elif len(parts) != 2 or any(p.dtype != jnp.bfloat16 for p in parts):
            return False
        if any(p.shape != lead + (s1, hv, ring_len, vd) for p in parts):
            return False
        if ckpt.dtype not in _FLOATS or ring_k.dtype not in _FLOATS or ring_g.dtype != jnp.float32:
            return False
        if h == 0 or hv % h:
            return False
        # Power-of-two blocks (Triton); >= 16 for the MMA; K <= 256 bounds the accumulator tile.
        return (
            is_pow2(kd)
            and 16 <= kd <= 256
            and is_pow2(vd)
            and vd >= 16
            and is_pow2(ring_len)
            and 16 <= ring_len <= 4096
            and all(d > 0 for d in lead + (s1,))
        )
    except (AttributeError, TypeError, ValueError):
        return False


def _split3(x):
    """float32 -> three bfloat16 terms with x = t0 + t1 + t2 to float32 accuracy (~2^-24 relative).

    Two terms are not enough: bf16 keeps 8 significant bits, so hi + lo carries only ~16 bits
    (1.5e-5 relative), above the float32 reference's level that the state is held to."""
    terms = []
    for _ in range(3):
        t = x.astype(jnp.bfloat16)
        terms.append(t)
        x = x - t.astype(jnp.float32)
    return terms


def _tdot(a, b):
    """a [C, M]^T . b [C, N] -> [M, N], bf16 operands, float32 accumulation (tensor cores)."""
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _fold_kernel(nr_ref, k_ref, *refs, n_u, chunk, ring_len, heads, nvb, r):
    """One program: `heads` consecutive [K, block_v] tiles (value heads) of one (layer, slot)."""
    u_refs, (g_ref, ckpt_ref, out_ref) = refs[:n_u], refs[n_u:]
    m = jnp.minimum(nr_ref[0], ring_len)
    hv0 = (pl.program_id(0) // nvb) * heads
    pos = lax.broadcasted_iota(jnp.int32, (ring_len,), 0)

    def load_records(t, start):
        # Records [start, start + chunk) of tile t; dead ones (j >= m) masked at the load, so a
        # NaN/inf there is never read into a register (causality by selection).
        rows = start + lax.broadcasted_iota(jnp.int32, (chunk,), 0)
        live = rows[:, None]
        rec = pl.ds(start, chunk)
        us = [
            plgpu.load(u_ref.at[t, rec, :], mask=jnp.broadcast_to(live < m, (chunk, u_ref.shape[-1])), other=0)
            for u_ref in u_refs
        ]
        kh = (hv0 + t) // r  # key head of value head hv0 + t
        k = plgpu.load(k_ref.at[kh, rec, :], mask=jnp.broadcast_to(live < m, (chunk, k_ref.shape[-1])), other=0)
        return rows, us, k

    def issue(t):
        t = jnp.int32(t)  # a static int index is not accepted by masked ref loads
        # The checkpoint tile is the bulk of the traffic, streamed once: evict it first from L2.
        h0 = plgpu.load(ckpt_ref.at[t], eviction_policy="evict_first")
        g = plgpu.load(g_ref.at[t], mask=pos < m, other=0.0)  # live gates, 0 beyond m
        return h0, g, (load_records(t, 0) if ring_len == chunk else None)

    def finish(t, loaded):
        t = jnp.int32(t)
        h0, g, first = loaded

        def step(c, acc, recs=None):
            start = c * chunk
            if not isinstance(start, int):
                start = pl.multiple_of(start, chunk)
            rows, us, k = recs if recs is not None else load_records(t, start)
            # e^{G_m - G_j} = exp(sum_{j < i < m} g_i); g is already 0 for i >= m.
            after = lax.broadcasted_iota(jnp.int32, (chunk, ring_len), 1) > rows[:, None]
            coef = jnp.exp(jnp.sum(jnp.where(after, g[None, :], 0.0), axis=1))  # [chunk]
            u = us[0].astype(jnp.float32)
            for part in us[1:]:  # (hi, lo) pair: u = hi + lo
                u = u + part.astype(jnp.float32)
            ws = _split3(coef[:, None] * u)
            ks = [k] if k.dtype == jnp.bfloat16 else _split3(k.astype(jnp.float32))  # bf16 keys: exact
            for a, k_part in enumerate(ks):
                for b, w_part in enumerate(ws):
                    if a + b <= 2:  # terms of order 2^-24 and below are dropped
                        acc = acc + _tdot(k_part, w_part)
            return acc

        acc = jnp.zeros(h0.shape, jnp.float32)
        if ring_len == chunk:
            acc = step(0, acc, first)
        else:
            acc = lax.fori_loop(0, pl.cdiv(m, chunk), step, acc)
        out = jnp.exp(jnp.sum(g)) * h0.astype(jnp.float32) + acc
        plgpu.store(out_ref.at[t], out.astype(out_ref.dtype), eviction_policy="evict_first")

    def fold_tiles():
        # Software pipelining by hand (straight-line code): tile t+1's loads are issued before
        # tile t's math and store.
        loaded = issue(0)
        for t in range(heads):
            nxt = issue(t + 1) if t + 1 < heads else None
            finish(t, loaded)
            loaded = nxt

    # m = 0: nothing is loaded or stored; the aliased checkpoint keeps its bits.
    pl.when(m > 0)(fold_tiles)


def gdn_fold(
    ckpt, ring_k, ring_u, ring_g, num_records, *, config: FoldConfig | None = None, interpret: bool | None = None
):
    """Pallas fold; arguments and result as `jaxspec.ops.gdn.gdn_fold` (ckpt is aliased in place)."""
    if not supports(ckpt, ring_k, ring_u, ring_g, num_records):
        raise ValueError("pallas gdn_fold: shapes/dtypes not supported (see fold.supports)")
    if interpret is None:
        interpret = default_interpret()
    parts = _parts(ring_u)
    squeeze = ckpt.ndim == 4
    if squeeze:
        ckpt, ring_k, ring_g = ckpt[None], ring_k[None], ring_g[None]
        parts = tuple(p[None] for p in parts)
    n_layers, s1, hv, kd, vd = ckpt.shape
    h, ring_len = ring_k.shape[2], ring_k.shape[3]
    config = config or default_config(ckpt.dtype, ring_len)
    r = hv // h
    block_v = min(config.block_v, vd)
    chunk = min(config.chunk, ring_len)
    heads = config.heads
    while hv % heads:
        heads //= 2
    nvb = vd // block_v
    tile = lambda i, s, l: (l, s, i // nvb, 0, i % nvb)  # (heads, K or L, block_v) blocks

    kernel = functools.partial(_fold_kernel, n_u=len(parts), chunk=chunk, ring_len=ring_len, heads=heads, nvb=nvb, r=r)
    in_specs = (
        [
            pl.BlockSpec((1,), lambda i, s, l: (s,)),  # num_records
            pl.BlockSpec((None, None, h, ring_len, kd), lambda i, s, l: (l, s, 0, 0, 0)),
        ]  # all key heads
        + [pl.BlockSpec((None, None, heads, ring_len, block_v), tile) for _ in parts]
        + [
            pl.BlockSpec((None, None, heads, ring_len), lambda i, s, l: (l, s, i // nvb, 0)),
            pl.BlockSpec((None, None, heads, kd, block_v), tile),
        ]
    )
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(ckpt.shape, ckpt.dtype),
        grid=(hv // heads * nvb, s1, n_layers),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, None, heads, kd, block_v), tile),
        input_output_aliases={len(in_specs) - 1: 0},
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        name="gdn_fold",
    )(num_records, ring_k, *parts, ring_g, ckpt)
    return out[0] if squeeze else out
