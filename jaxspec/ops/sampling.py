"""Sampling: the processed target distribution, the draft distribution, chain acceptance.

Target distribution (docs/design.md section 7): top-k on the RAW logits (ties: lower token id first), divide
only the k selected values by the temperature (a positive temperature keeps their order), softmax,
then top-p within those k, renormalise. The result is a sparse distribution: k_max (probability,
token id) pairs per row, sorted by probability descending, zeros beyond the row's cut. Nothing of
vocabulary size is ever built from the logits but the top-k itself. Temperature 0 is greedy: a
one-hot on the argmax (lowest id on ties).

Draft distribution: q = softmax(draft logits / T) is kept as the logits and per-row statistics
(`DraftDistribution`: argmax, max, tie count, the exp-sum of the rest), two passes over the logits
that also give the estimator's feature. The engine draws sampled drafts from the request's processed
distribution of the draft logits (`ProcessedDraft`: the target's top-k / temperature / top-p
processing, k_max pairs a row); acceptance reads q only at the drafted and the target's top-k ids.

Acceptance (docs/design.md sections 7, 8): window row t of a verify holds the target distribution after
[anchor, d_1..d_t]; draft d_{t+1} is judged by row t. Request r verifies its first
ℓ_r = num_verify[r] drafts; greedy rows accept while the draft equals the target argmax, sampling
rows run standard chain rejection sampling; the bonus token comes from row a_r (a_r = accepted
drafts): a residual sample max(p - q, 0) after a rejection, a plain sample from p when all ℓ_r
drafts were accepted. Randomness is per request (one PRNG key per request per step), so a
request's tokens do not depend on which other requests share its batch.

Every function is pure jnp: jittable and vmappable.
"""

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec.ops import tp
from jaxspec.ops.dispatch import use_kernel
from jaxspec.pallas import topk as pallas_topk


@struct.dataclass
class SamplingParams:
    """Per-request sampling parameters, arrays of shape [B].

    temperature [B] float32   0 = greedy; > 0 divides the selected logits
    top_k       [B] int32     0 (or >= vocab) = no top-k cut; always capped by the static max_top_k
    top_p       [B] float32   nucleus mass in (0, 1]; >= 1 = off
    """

    temperature: jnp.ndarray
    top_k: jnp.ndarray
    top_p: jnp.ndarray

    @classmethod
    def create(cls, batch, temperature=0.0, top_k=0, top_p=1.0):
        """Broadcast scalars or [batch] sequences to the three [batch] arrays."""
        return cls(
            temperature=jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (batch,)),
            top_k=jnp.broadcast_to(jnp.asarray(top_k, jnp.int32), (batch,)),
            top_p=jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), (batch,)),
        )

    @classmethod
    def greedy(cls, batch):
        return cls.create(batch)


def _per_row(x, lead):
    """x [lead[:n]] (a prefix of the row dims, e.g. [B] for rows [B, T]) -> x broadcast to lead."""
    x = jnp.asarray(x)
    if x.shape != tuple(lead[: x.ndim]):
        raise ValueError(f"per-request array of shape {x.shape} does not prefix the row shape {tuple(lead)}")
    return jnp.broadcast_to(x.reshape(x.shape + (1,) * (len(lead) - x.ndim)), lead)


# ------------------------------------------------------------------------------ target side


def greedy_tokens(logits, *, impl="auto"):
    """logits [..., vocab] (any float dtype) -> argmax [...] int32, the lowest id on ties.

    No kernel: XLA's fused argmax is already one read of the logits (every impl runs jnp.argmax)."""
    use_kernel("greedy_tokens", impl, None)
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def top_k(logits, k, *, impl="auto"):
    """The k largest logits per row and their ids; the reference is jax.lax.top_k.

    logits [..., vocab] (any float dtype); k: static int in 1..vocab.
    -> (values [..., k] logits.dtype, ids [..., k] int32), sorted descending in the IEEE total order
    (-NaN < -inf < ... < -0.0 < +0.0 < ... < +inf < +NaN), ties: lower id first. A row with fewer
    than k finite logits ends with its -inf entries, lowest unused ids first.
    The kernel (pallas/topk.py: chunk maxima in one read, then an exact selection) covers float32 /
    bfloat16 with k <= 64 and vocab <= 2**20 (`pallas_topk.supports`); impl="auto" runs the reference
    on any other call (slower, never wrong), impl="pallas" raises on it.
    """
    n = tp.size()
    vocab = logits.shape[-1]
    if n > 1 and vocab % n == 0 and k <= vocab // n:
        return _top_k_over_shards(logits, k, n, impl)
    if use_kernel("top_k", impl, lambda: pallas_topk.supports(logits, k)):
        return pallas_topk.top_k(logits, k)
    return jax.lax.top_k(logits, k)


def _top_k_over_shards(logits, k, n, impl):
    """top_k of vocabulary-split logits: each device's k best of its V/n ids, then the k best of the
    n*k candidates (shard order is id order, so ties still go to the lower id)."""
    local = logits.shape[-1] // n

    def shard_top_k(x):
        values, ids = top_k(x, k, impl=impl)
        return values, ids + jax.lax.axis_index(tp.AXIS) * local

    spec = tp.split(logits.ndim, -1)
    values, ids = tp.per_shard(shard_top_k, (logits,), (spec,), (spec, spec))
    best, pick = jax.lax.top_k(values, k)
    return best, jnp.take_along_axis(ids, pick, axis=-1)


def target_distribution(logits, params, max_top_k, *, impl="auto"):
    """The processed target distribution as k_max (probability, token id) pairs per row.

    logits [..., vocab] (any float dtype; usually [R, vocab] or [B, T, vocab]);
    params: SamplingParams whose [B] fields prefix the row dims (shape [R] for [R, vocab] logits,
      [B] for [B, T, vocab]: one request's parameters apply to all its rows);
    max_top_k: static int; k_max = min(max_top_k, vocab).
    -> (probs [..., k_max] float32, token_ids [..., k_max] int32), sorted by raw logit descending
    (ties: lower id first). Per row: k = min(top_k if 0 < top_k < vocab else vocab, k_max); the first
    k entries get softmax(logit / temperature); top-p keeps the shortest prefix of them whose mass
    is >= top_p (at least one token); the kept mass is renormalised; every other entry is 0.
    Greedy rows (temperature <= 0): probs = [1, 0, ...] on the argmax (lowest id on ties).
    A row whose selected logits are all -inf falls back to the one-hot on its first entry.
    """
    lead, vocab = logits.shape[:-1], logits.shape[-1]
    if not isinstance(max_top_k, int) or max_top_k < 1:
        raise ValueError(f"max_top_k={max_top_k!r}: must be a positive Python int (it is a static shape)")
    k_max = min(max_top_k, vocab)
    temperature = _per_row(params.temperature, lead).astype(jnp.float32)
    row_top_k = _per_row(params.top_k, lead).astype(jnp.int32)
    top_p = _per_row(params.top_p, lead).astype(jnp.float32)

    vals, ids = top_k(logits, k_max, impl=impl)  # stable: lower id first on ties
    vals = vals.astype(jnp.float32)
    pos = jnp.arange(k_max, dtype=jnp.int32)
    k_row = jnp.where((row_top_k <= 0) | (row_top_k >= vocab), k_max, jnp.minimum(row_top_k, k_max))
    in_k = pos < k_row[..., None]

    greedy = temperature <= 0.0
    top = vals[..., :1]  # the row max (order is kept)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    scaled = (vals - top) / jnp.where(greedy, 1.0, temperature)[..., None]
    scaled = jnp.where(in_k, scaled, -jnp.inf)
    e = jnp.exp(scaled)  # <= 1, exp(-inf) = 0
    probs = e / jnp.maximum(jnp.sum(e, axis=-1, keepdims=True), jnp.finfo(jnp.float32).tiny)

    mass_before = jnp.cumsum(probs, axis=-1) - probs  # exclusive prefix mass
    keep = (mass_before < top_p[..., None]) | (top_p[..., None] >= 1.0) | (pos == 0)
    probs = jnp.where(keep, probs, 0.0)
    total = jnp.sum(probs, axis=-1, keepdims=True)
    one_hot = (pos == 0).astype(jnp.float32)
    probs = jnp.where((total > 0) & ~greedy[..., None], probs / jnp.where(total > 0, total, 1.0), one_hot)
    return probs, ids.astype(jnp.int32)


# ------------------------------------------------------------------------------ draft side


def scaled_logits(logits, temperature):
    """z = logits / T in float32 [..., vocab]; temperature of a shape that prefixes the row dims (or a
    scalar); rows with T <= 0 (greedy) use T = 1."""
    t = _per_row(jnp.asarray(temperature, jnp.float32), logits.shape[:-1])
    return logits.astype(jnp.float32) / jnp.where(t > 0, t, 1.0)[..., None]


def logit_stats(z):
    """Row statistics of softmax(z) in two passes over z [..., vocab] float32 (an argmax, then one
    exp-sum that XLA fuses with the tie count):
    -> argmax [...] int32 (lowest id on ties, the first NaN if any), zmax [...] = z[argmax],
       ties [...] = #{i : z_i == zmax} float32, rest [...] = sum_{i : z_i != zmax} e^{z_i - zmax}.
    Then logsumexp(z) = zmax + log(rest + ties) and logit(q_max) = -log(rest + (ties - 1)), the
    latter without the cancellation of 1 - q_max when q_max rounds to 1. A row holding a NaN gets
    zmax NaN, ties 0, rest NaN; an all -inf row zmax -inf, ties = vocab, rest 0."""
    argmax = jnp.argmax(z, axis=-1).astype(jnp.int32)
    zmax = jnp.take_along_axis(z, argmax[..., None], axis=-1)
    is_max = z == zmax
    ties = jnp.sum(is_max, axis=-1).astype(jnp.float32)
    rest = jnp.sum(jnp.where(is_max, 0.0, jnp.exp(z - zmax)), axis=-1)
    return argmax, zmax[..., 0], ties, rest


@struct.dataclass
class DraftDistribution:
    """The distribution each draft row is drawn from, q = softmax(logits / T), kept as the logits
    and per-row statistics: nothing of vocabulary size is built (a [B, T-1, vocab] float32 q at batch
    128 x 7 x 248,320 would be 890 MB written and read back in every sampled step).

    logits      [..., vocab] the draft logits as given (any float dtype)
    temperature [...] float32 per row; T <= 0: greedy, q = one-hot on the argmax
    argmax, zmax, ties, rest [...]: `logit_stats` of z = logits / T (T <= 0 rows: T = 1)
    """

    logits: jnp.ndarray
    temperature: jnp.ndarray
    argmax: jnp.ndarray
    zmax: jnp.ndarray
    ties: jnp.ndarray
    rest: jnp.ndarray

    @property
    def lse(self):
        """logsumexp of z per row [...]."""
        return self.zmax + jnp.log(self.rest + self.ties)

    def scaled(self):
        return scaled_logits(self.logits, self.temperature)

    def prob_at(self, ids):
        """q at token ids [..., n] int32 (clipped to the vocabulary) -> [..., n] float32."""
        ids = jnp.clip(ids, 0, self.logits.shape[-1] - 1)
        z = scaled_logits(jnp.take_along_axis(self.logits, ids, axis=-1), self.temperature)
        soft = jnp.exp(z - self.lse[..., None])
        return jnp.where(self.temperature[..., None] > 0, soft, (ids == self.argmax[..., None]).astype(jnp.float32))


def draft_distribution(draft_logits, temperature):
    """q = softmax(draft_logits / temperature) over the full vocabulary, as a `DraftDistribution`.

    draft_logits [..., vocab] (any float dtype); temperature f32 of a shape that prefixes the row
    dims (e.g. [B] for [B, T-1, vocab]), or a scalar. Greedy rows (temperature <= 0): one-hot on the
    argmax (lowest id on ties). `prob_at(ids)` gives q at token ids; `sample_draft` draws from it.
    """
    lead = draft_logits.shape[:-1]
    t = _per_row(jnp.asarray(temperature, jnp.float32), lead)
    return DraftDistribution(draft_logits, t, *logit_stats(scaled_logits(draft_logits, t)))


@struct.dataclass
class ProcessedDraft:
    """The distribution sampled drafts are drawn from: the request's own processing (top-k on the raw
    draft logits, temperature, top-p: `target_distribution`) applied to the draft logits, as k_max
    (probability, token id) pairs per row. Drawing from the head the target keeps, not from the full
    softmax whose tail past the target's top-k / top-p is always rejected, raises the acceptance of
    truncated sampling; chain rejection sampling stays exact for any q it is given (the ratio and the
    residual read this q).

    probs [..., k_max] float32 (zeros past a row's cut), ids [..., k_max] int32
    """

    probs: jnp.ndarray
    ids: jnp.ndarray

    def prob_at(self, ids):
        """q at token ids [..., n] int32 -> [..., n] float32 (0 off the row's pairs)."""
        hit = self.ids[..., None, :] == ids[..., :, None]  # [..., n, k]
        return jnp.sum(jnp.where(hit, self.probs[..., None, :], 0.0), axis=-1)


def processed_draft(draft_logits, params, max_top_k, *, impl="auto") -> ProcessedDraft:
    """`ProcessedDraft` of draft_logits [B, P, vocab] under the requests' SamplingParams ([B] fields):
    `target_distribution`'s processing with the same static max_top_k (greedy rows: one-hot on the
    argmax)."""
    return ProcessedDraft(*target_distribution(draft_logits, params, max_top_k, impl=impl))


def sample_draft(key, q: DraftDistribution | ProcessedDraft):
    """Draw one token per row of q (a `DraftDistribution` or a `ProcessedDraft`).

    key: one PRNG key (typed key or raw uint32 [2]) for the whole q, or a batch of keys whose batch
    shape prefixes q's rows (e.g. keys [B] for q of [B, T-1, vocab] logits: one key per request, so
    a request's draws do not depend on its batch). -> tokens [...] int32: a Gumbel-max draw over
    z = logits / T (the same draw as over log q, which differs from z by a constant a row; one read
    of the logits), the argmax on greedy rows. Zero-probability (-inf logit) tokens are never drawn.
    """
    key_shape = key.shape if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key.shape[:-1]
    if key_shape:
        return jax.vmap(sample_draft)(key, q)
    if isinstance(q, ProcessedDraft):  # a draw over the row's pairs (zero-probability pairs never)
        pick = jax.random.categorical(key, jnp.log(q.probs), axis=-1)
        return jnp.take_along_axis(q.ids, pick[..., None], axis=-1)[..., 0].astype(jnp.int32)
    drawn = jax.random.categorical(key, q.scaled(), axis=-1).astype(jnp.int32)
    return jnp.where(q.temperature > 0, drawn, q.argmax)


# ------------------------------------------------------------------------------ acceptance


def _accept_one(key, probs, ids, drafts, q_at_draft, q_at_ids, num_verify, temperature):
    """One request. probs/ids [T, K], drafts [T-1], q_at_draft [T-1], q_at_ids [T-1, K],
    num_verify and temperature scalars -> (num_accepted, bonus, emitted [T])."""
    t_len = probs.shape[0]
    key_u, key_bonus = jax.random.split(key)
    steps = jnp.arange(t_len - 1)
    verified = steps < num_verify

    # greedy: the target argmax of every row (probs are sorted, but do not rely on it)
    argmax_tok = jnp.take_along_axis(ids, jnp.argmax(probs, axis=-1)[:, None], axis=-1)[:, 0]
    ok_greedy = drafts == argmax_tok[:-1]
    # sampling: accept d with probability min(1, p(d) / q(d)), i.e. u * q(d) < p(d), u ~ U[0, 1)
    p_at_draft = jnp.sum(jnp.where(ids[:-1] == drafts[:, None], probs[:-1], 0.0), axis=-1)
    u = jax.random.uniform(key_u, (t_len - 1,), jnp.float32)
    ok_sample = u * q_at_draft < p_at_draft
    greedy = temperature <= 0.0
    ok = jnp.where(greedy, ok_greedy, ok_sample) & verified  # NaN garbage rows compare False
    a = jnp.sum(jnp.cumprod(ok.astype(jnp.int32))).astype(jnp.int32)

    # bonus from row a: residual after a rejection (a < num_verify), else a plain sample from p_a
    p_a = probs[a]
    q_a = q_at_ids[jnp.minimum(a, t_len - 2)]
    rejected = a < num_verify
    residual = jnp.maximum(p_a - q_a, 0.0)
    residual_ok = jnp.sum(residual) > 0.0  # p == q exactly: fall back to p
    w = jnp.where(rejected & residual_ok, residual, p_a)
    idx = jax.random.categorical(key_bonus, jnp.log(w))
    sampled = ids[a, idx]
    bonus = jnp.where(greedy, argmax_tok[a], sampled).astype(jnp.int32)

    pos = jnp.arange(t_len)
    drafts_pad = jnp.concatenate([drafts, jnp.zeros((1,), drafts.dtype)])
    emitted = jnp.where(pos < a, drafts_pad, jnp.where(pos == a, bonus, -1)).astype(jnp.int32)
    return a, bonus, emitted


def accept(keys, target_probs, target_ids, draft_tokens, draft_q, num_verify, temperature):
    """Chain acceptance for one step of B requests, each with its own verify cap.

    keys          [B] PRNG keys (typed keys [B] or raw uint32 [B, 2]): one per request per step
    target_probs  [B, T, K] float32  from target_distribution; row t = after [anchor, d_1..d_t]
    target_ids    [B, T, K] int32
    draft_tokens  [B, T-1] int32     d_1..d_{T-1}
    draft_q       the DraftDistribution (rows [B, T-1]) each draft was drawn from; None for
                  deterministic (greedy) drafts, i.e. q = one-hot on the draft token
    num_verify    [B] int32          drafts actually verified, ℓ in 0..T-1 (clipped to it)
    temperature   [B] float32 (or a scalar)   <= 0 = greedy rule, > 0 = rejection sampling
    -> (num_accepted [B] int32 in 0..ℓ, bonus [B] int32,
        emitted [B, T] int32: the accepted drafts, then the bonus, then -1 padding)

    Only rows 0..ℓ of the target and rows 0..ℓ-1 of drafts / q are read (the rest may be garbage).
    Greedy: accept while d_{t+1} == argmax row t; bonus = argmax of row a. Sampling: accept d_{t+1}
    with probability min(1, p_t(d) / q_t(d)); on the first rejection (row a) the bonus is drawn from
    max(p_a - q_a, 0) normalised (p on its k support, q at those ids); if all ℓ drafts are accepted
    the bonus is drawn from p_ℓ.
    """
    b, t_len, _ = target_probs.shape
    if draft_tokens.shape != (b, t_len - 1):
        raise ValueError(f"draft_tokens {draft_tokens.shape}: expected {(b, t_len - 1)}")
    num_verify = jnp.clip(num_verify.astype(jnp.int32), 0, t_len - 1)
    drafts = draft_tokens.astype(jnp.int32)
    if t_len == 1:  # no drafts: q is never read
        q_at_draft = jnp.ones((b, 0), jnp.float32)
        q_at_ids = jnp.zeros((b, 1) + target_ids.shape[2:], jnp.float32)
    elif draft_q is None:  # deterministic draft: q = one-hot
        q_at_draft = jnp.ones((b, t_len - 1), jnp.float32)
        q_at_ids = (target_ids[:, :-1] == drafts[..., None]).astype(jnp.float32)
    else:
        q_at_draft = draft_q.prob_at(drafts[..., None])[..., 0]
        q_at_ids = draft_q.prob_at(target_ids[:, :-1])
    return jax.vmap(_accept_one)(
        keys,
        target_probs.astype(jnp.float32),
        target_ids.astype(jnp.int32),
        drafts,
        q_at_draft,
        q_at_ids,
        num_verify,
        jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (b,)),
    )
