"""Mixture-of-experts MLP of Qwen3-Next / Qwen3.5-MoE layers (docs/design.md section 2).

For token x [d] with router R [d, E], routed experts (G_e | U_e) = gate_up[e] [d, 2Ie],
D_e = down[e] [Ie, d], the shared expert S and its gate s [d, 1]:

    p = softmax(x R)  (float32)          top = the k largest p_e, ties to the lower expert id
    w_e = p_e / Σ_{j ∈ top} p_j  (norm_topk_prob; else w_e = p_e), e ∈ top
    y = Σ_{e ∈ top} w_e · D_eᵀ(silu(x G_e) ⊙ (x U_e))  +  sigmoid(x s) · S(x)

as transformers' Qwen3NextSparseMoeBlock / Qwen3_5MoeSparseMoeBlock compute it: softmax in
float32 over the router logits (which are in the activation dtype), torch.topk, renormalise in
float32, the weights cast to the activation dtype. Ties: jax.lax.top_k takes the lower expert id
first; torch.topk on the CPU has no fixed rule (tests/test_moe.py says what it does). One choice of
ours: the k weighted expert outputs and the gated shared expert are summed in float32 and rounded
once to the activation dtype (transformers adds them in the activation dtype, expert by expert;
the same thing in float32).

Three implementations of the routed experts, picked by `impl` like every op (ops/dispatch.py):
- `moe_gathered` (impl "auto" / "pallas": always on a GPU, through the kernel; elsewhere when
  3·T·k <= E: decode, small verify windows): each (token, expert) pair times its own expert's
  weights. On a GPU (or impl "pallas") the Pallas grouped products (`jaxspec/pallas/expert_matmul.py`) read each
  hit expert once, in place, for all the tokens that chose it; the jnp form gathers each pair's
  weights (a copy) before batched matrix-vector products. Both read only the experts the tokens
  hit, where XLA's GPU `ragged_dot` computes every expert whatever the routing (measured:
  bench/RESULTS.md, MoE rows).
- `moe_ragged` (without the kernel, above that bound): the T·k (token, expert) pairs sorted by expert id, two
  `jax.lax.ragged_dot` grouped matmuls over the sorted rows, the k results of a token combined in
  float32. No capacity limit: a group is as long as its expert's tokens. Rows with valid = False
  go to a null group past the E real ones (sorted last, outside every group size), so no expert
  computes them, and the combine selects them away (whatever ragged_dot leaves in rows outside its
  groups: zeros on the CPU).
- `moe_reference` (impl "ref", the oracle): every expert on every token, combined through the
  dense [T, E] routing weights.
All select (`where`), never multiply by a zero weight, so a non-finite value in one row (or in an
unselected expert's output) stays in its row; an invalid row's routed output is exactly 0.
"""

import jax
import jax.numpy as jnp

from jaxspec.fused import moe_widths, split_columns
from jaxspec.ops.dispatch import IMPLS, use_kernel
from jaxspec.ops.linear import HIGHEST, dense, swiglu_down, swiglu_mlp
from jaxspec.pallas import expert_matmul as pallas_expert_matmul


def route(x, router, top_k: int, norm_topk_prob: bool):
    """x [T, d], router [d, E] -> (weights [T, k] in x.dtype, experts [T, k] int32).

    Logits x @ router in x.dtype, then `route_logits`.
    """
    return route_logits(dense(x, router), top_k, norm_topk_prob)


def route_logits(logits, top_k: int, norm_topk_prob: bool):
    """Router logits [T, E] (the activations' dtype) -> (weights [T, k] in that dtype, experts [T, k]
    int32): softmax in float32, the top k (descending, ties to the lower expert id), divided by
    their sum if norm_topk_prob, then cast back."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)  # [T, E]
    weights, experts = jax.lax.top_k(probs, top_k)  # [T, k]
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights.astype(logits.dtype), experts.astype(jnp.int32)


def _ragged_dot(x, w, group_sizes):
    """Grouped x [M, a] @ w [G, a, b] -> [M, b] in x.dtype, precision as `linear.dense`."""
    if jnp.dtype(x.dtype) == jnp.dtype(jnp.float32):
        y = jax.lax.ragged_dot(x, w, group_sizes, precision=HIGHEST, preferred_element_type=jnp.float32)
    else:
        y = jax.lax.ragged_dot(x, w.astype(x.dtype), group_sizes, preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


def _swiglu(h, dtype):
    """[..., 2Ie] -> silu(gate) * up [..., Ie] in `dtype` (float32 arithmetic)."""
    gate, up = jnp.split(h.astype(jnp.float32), 2, axis=-1)
    return (jax.nn.silu(gate) * up).astype(dtype)


def moe_ragged(x, weights, experts, gate_up, down, valid):
    """Routed experts by grouped matmuls over expert-sorted rows.

    x [T, d], weights [T, k], experts [T, k] int32 in [0, E), gate_up [E, d, 2Ie], down [E, Ie, d],
    valid [T] bool -> [T, d] in x.dtype: Σ_j weights[t, j] · expert_{experts[t, j]}(x[t]) for valid
    rows, 0 for the others.
    """
    t, k = experts.shape
    n_experts = gate_up.shape[0]
    keep = jnp.repeat(valid, k)  # [T*k]
    ids = jnp.where(keep, experts.reshape(-1), n_experts)  # [T*k]; E = the null group
    order = jnp.argsort(ids, stable=True)  # [T*k] pair index by expert
    group_sizes = jnp.zeros(n_experts, jnp.int32).at[ids].add(1, mode="drop")  # [E]
    rows = x[order // k]  # [T*k, d]
    act = _swiglu(_ragged_dot(rows, gate_up, group_sizes), x.dtype)  # [T*k, Ie]
    y = _ragged_dot(act, down, group_sizes)  # [T*k, d], null-group rows 0
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(t * k, dtype=order.dtype))
    y = y[inverse].reshape(t, k, -1).astype(jnp.float32)  # [T, k, d], pair order again
    w = weights.astype(jnp.float32)[..., None]  # [T, k, 1]
    out = jnp.sum(jnp.where(keep.reshape(t, k, 1), w * y, 0.0), axis=1)
    return out.astype(x.dtype)


def _dense_precision(dtype):
    """(precision, preferred_element_type) as `linear.dense`: float32 at HIGHEST, else bf16 products."""
    return (HIGHEST, jnp.float32) if jnp.dtype(dtype) == jnp.dtype(jnp.float32) else (None, None)


def _gathered_products(x, ids, live, w, rows_div: int, kernel: bool, config=None):
    """Pair p's row x[p // rows_div] times its expert's w[ids[p]]: [P, N] rounded to x.dtype (dead
    pairs: 0 from the kernel, whatever the product is from the jnp form; the caller selects them away)."""
    if kernel:
        return pallas_expert_matmul.expert_matmul(x, ids, live, w, rows_div=rows_div, config=config).astype(x.dtype)
    prec, acc = _dense_precision(x.dtype)
    rows = x if rows_div == 1 else jnp.repeat(x, rows_div, axis=0)  # [P, K]
    y = jnp.einsum("pk,pkn->pn", rows, w[ids].astype(x.dtype), precision=prec, preferred_element_type=acc)
    return y.astype(x.dtype)


def moe_gathered(x, weights, experts, gate_up, down, valid, *, kernel: bool = False, config=None):
    """Routed experts by each (token, expert) pair's own weights. Same arguments and result as
    `moe_ragged` (each product rounded to x.dtype, the k outputs combined in float32).

    kernel=False: the pair's weights gathered (a copy), then batched products; kernel=True: the
    Pallas grouped products (`jaxspec.pallas.expert_matmul`), which read each hit expert once, in
    place; config: its ExpertMatmulConfig (None: the default).
    """
    t, k = experts.shape
    pairs = experts.reshape(-1)  # [T*k]
    live = jnp.repeat(valid, k)  # [T*k]
    h = _gathered_products(x, pairs, live, gate_up, k, kernel, config)  # [T*k, 2Ie]
    act = _swiglu(h, x.dtype)  # [T*k, Ie]
    y = _gathered_products(act, pairs, live, down, 1, kernel, config)  # [T*k, d]
    y = y.astype(jnp.float32).reshape(t, k, -1)  # [T, k, d]
    w = weights.astype(jnp.float32)[..., None]  # [T, k, 1]
    return jnp.sum(jnp.where(valid[:, None, None], w * y, 0.0), axis=1).astype(x.dtype)


def moe_reference(x, weights, experts, gate_up, down, valid):
    """Routed experts, dense one-hot reference: every expert on every token.

    Same arguments and result as `moe_ragged`. With sel [T, E] = (e in experts[t]) and c [T, E]
    the routing weight of e for t (0 if unselected): Σ_e where(sel, c · expert_e(x[t]), 0).
    """
    n_experts = gate_up.shape[0]
    one_hot = experts[..., None] == jnp.arange(n_experts)  # [T, k, E]
    sel = jnp.any(one_hot, axis=1) & valid[:, None]  # [T, E]
    c = jnp.sum(jnp.where(one_hot, weights.astype(jnp.float32)[..., None], 0.0), axis=1)  # [T, E]
    prec, acc = _dense_precision(x.dtype)
    h = jnp.einsum("td,edi->tei", x, gate_up.astype(x.dtype), precision=prec, preferred_element_type=acc)
    act = _swiglu(h, x.dtype)  # [T, E, Ie]
    y = jnp.einsum("tei,eid->ted", act, down.astype(x.dtype), precision=prec, preferred_element_type=acc)
    y = y.astype(x.dtype).astype(jnp.float32)  # [T, E, d], rounded as the ragged path rounds
    return jnp.sum(jnp.where(sel[..., None], c[..., None] * y, 0.0), axis=1).astype(x.dtype)


def moe_experts(x, weights, experts, gate_up, down, valid, *, impl="auto"):
    """The routed experts (module doc): impl "ref" runs `moe_reference`. "auto" / "pallas" run
    `moe_gathered` through the grouped kernel wherever the kernel runs (a GPU, or impl "pallas");
    else its jnp form when 3·T·k <= E (a gather and a product read fewer bytes than every expert);
    else `moe_ragged`."""
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}: must be one of {IMPLS}")
    if impl == "ref":
        return moe_reference(x, weights, experts, gate_up, down, valid)
    pairs = jax.ShapeDtypeStruct((experts.size,), experts.dtype)  # shapes only: moe_gathered builds them
    live = jax.ShapeDtypeStruct((experts.size,), jnp.bool_)
    act = jax.ShapeDtypeStruct((experts.size, down.shape[1]), x.dtype)  # [T*k, Ie]
    kernel = use_kernel(
        "moe_gathered",
        impl,
        lambda: (
            pallas_expert_matmul.supports(x, pairs, live, gate_up, experts.shape[1])
            and pallas_expert_matmul.supports(act, pairs, live, down)
        ),
    )
    if kernel:
        return moe_gathered(x, weights, experts, gate_up, down, valid, kernel=True)
    if 3 * experts.size <= gate_up.shape[0]:
        return moe_gathered(x, weights, experts, gate_up, down, valid)
    return moe_ragged(x, weights, experts, gate_up, down, valid)


def sparse_moe_block(p, x, valid, *, top_k: int, norm_topk_prob: bool, impl="auto"):
    """The whole sparse block (module doc equation). x [..., d], valid [...] bool -> [..., d] in x.dtype.

    p = {"router": [d, E], "gate_up": [E, d, 2Ie], "down": [E, Ie, d],
         "shared": {"gate": [d, Is], "up": [d, Is], "down": [Is, d]}, "shared_gate": [d, 1]},
    or with the four products of x as one (jaxspec.fused): {"in_proj": [d, E + 1 + 2 Is] =
    [router | shared_gate | shared gate | shared up], "gate_up", "down", "shared": {"down"}}.
    Invalid rows (padding, the null slot) route to no expert; their output is the shared expert's
    alone and is meant to be discarded.
    """
    lead = x.shape[:-1]
    xf = x.reshape(-1, x.shape[-1])  # [T, d]
    if "in_proj" in p:
        logits, gate_logit, gate, up = split_columns(dense(xf, p["in_proj"]), moe_widths(p))
        shared = swiglu_down(gate, up, p["shared"]["down"], x.dtype)
    else:
        logits, gate_logit = dense(xf, p["router"]), dense(xf, p["shared_gate"])
        shared = swiglu_mlp(p["shared"], xf)
    weights, experts = route_logits(logits, top_k, norm_topk_prob)  # [T, k]
    routed = moe_experts(xf, weights, experts, p["gate_up"], p["down"], valid.reshape(-1), impl=impl)
    shared = jax.nn.sigmoid(gate_logit.astype(jnp.float32)) * shared.astype(jnp.float32)  # [T, d]
    return (routed.astype(jnp.float32) + shared).astype(x.dtype).reshape(lead + (x.shape[-1],))
