"""The model's own jnp reference code evaluated in float64: the yardstick of its float32 precision.

`float64_call(fn, *args)` runs fn (a function of `jaxspec.target` or an op of `jaxspec.ops`)
under jax's x64 mode with its floating arguments cast to float64 and every `jnp.float32` the code
names read as `jnp.float64` (the modules' `jnp` is swapped for a namespace that differs only
there), so the same operations run end to end in float64; it asserts that the traced computation
holds no floating value of another dtype. `float64_logits(target, ids)` is that evaluation of
`jaxspec.target_logits`. The difference between a float32 result and its float64 evaluation is
the float32 rounding of our code alone, not a difference of formulas (tests/oracle.py and
transformers' logits check the formulas).

`random_target(layout, seed, path)` builds the random checkpoints the precision tests use.
"""

import contextlib
import types

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np

from jaxspec import target as tgt
from jaxspec.config import TargetConfig
from jaxspec.ops import attention, conv, gdn, linear, moe, norms, packing, rope
from jaxspec.weights import load_params, save_params

_MODULES = (tgt, attention, conv, gdn, linear, moe, norms, packing, rope)


class _Float64Names(types.ModuleType):
    """jax.numpy with float32 spelled float64."""

    float32 = jnp.float64

    def __getattr__(self, name):
        return getattr(jnp, name)


@contextlib.contextmanager
def float64_code():
    """Inside: x64 mode, and jaxspec's model and op modules read `jnp.float32` as float64."""
    saved = [m.jnp for m in _MODULES]
    names = _Float64Names("jnp_float64")
    try:
        for m in _MODULES:
            m.jnp = names
        with jax.enable_x64(True):
            yield
    finally:
        for m, jnp_module in zip(_MODULES, saved):
            m.jnp = jnp_module


def _float_dtypes(jaxpr):
    """Every floating dtype of a value in the jaxpr, sub-jaxprs (scan and loop bodies) included."""
    found = set()
    for eqn in jaxpr.eqns:
        for var in list(eqn.invars) + list(eqn.outvars):
            dtype = getattr(getattr(var, "aval", None), "dtype", None)
            if dtype is not None and jnp.issubdtype(dtype, jnp.floating):
                found.add(jnp.dtype(dtype))
        for sub in jex.core.jaxprs_in_params(eqn.params):
            found |= _float_dtypes(sub)
    return found


def float64_call(fn, *args):
    """fn(*args) run in float64 under `float64_code`, jitted: floating leaves of the args (pytrees)
    are cast to float64, the results come back as float64 numpy arrays. Asserts that the traced
    computation holds no floating value of another dtype."""
    with float64_code():
        cast = lambda x: (
            jnp.asarray(np.asarray(x, np.float64))
            if jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)
            else jnp.asarray(x)
        )
        args = jax.tree_util.tree_map(cast, args)
        dtypes = _float_dtypes(jax.make_jaxpr(fn)(*args).jaxpr)
        assert dtypes <= {jnp.dtype(jnp.float64)}, f"the float64 evaluation computes in {sorted(map(str, dtypes))}"
        return jax.tree_util.tree_map(np.asarray, jax.jit(fn)(*args))


def _logits(target, ids):
    logits, *_ = tgt.prefill_layers(target, ids[None], jnp.array([ids.shape[0]], jnp.int32), (), "ref")
    return logits[0]


def float64_logits(target: tgt.Target, ids) -> np.ndarray:
    """Causal logits [len(ids), vocab] float64 of `target_logits`' computation run in float64."""
    return float64_call(_logits, target, np.asarray(ids, np.int32))


def random_config(layout: str) -> TargetConfig:
    """8 layers (GDN, GDN, GDN, attention) x 2; GDN 2 key / 4 value heads of 32 / 24 dims."""
    return TargetConfig(
        layout=layout,
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        layer_types=("linear_attention",) * 3 + ("full_attention",) + ("linear_attention",) * 3 + ("full_attention",),
        rms_norm_eps=1e-6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        partial_rotary_factor=0.25,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=24,
        linear_conv_kernel_dim=4,
        tie_word_embeddings=False,
        max_position_embeddings=4096,
        eos_token_id=(),
    )


def extreme_gates(params: dict, config: TargetConfig, rng) -> dict:
    """params with GDN gates spanning what a model can reach: per value head A = e^A_log spread over
    1e-2..8, dt_bias uniform in -8..4 and the `a` projection 4x wider, so the per-token log decay
    g = -A softplus(a + dt_bias) runs from ~-1e-9 (no decay) to ~-100 inside one sequence: a chunk
    mixes decays near 1 with ones near 0. Numpy leaves, changed in place and returned."""
    hv = config.linear_num_value_heads
    for layer in params["layers"]:
        if "gdn" in layer:
            p = layer["gdn"]
            p["A_log"] = np.log(np.geomspace(1e-2, 8.0, hv))[rng.permutation(hv)].astype(np.float32)
            p["dt_bias"] = rng.uniform(-8.0, 4.0, hv).astype(np.float32)
            p["a"] = p["a"] * np.float32(4.0)
    return params


def random_target(layout: str, seed: int, path) -> tgt.Target:
    """A random target of `random_config(layout)` with `extreme_gates`, written to `path` in that
    layout and loaded back in float32 (each HF layout's reader is in the path)."""
    config = random_config(layout)
    params = jax.tree_util.tree_map(np.asarray, tgt.init_target(config, jax.random.PRNGKey(seed)).params)
    save_params(path, extreme_gates(params, config, np.random.default_rng(seed)), config)
    return tgt.Target(params=load_params(path, config), config=config)


def relative_error(got, want) -> np.ndarray:
    """Per position max|got - want| / max|want| (over the whole of want)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.abs(got - want).max(axis=-1) / np.abs(want).max()
