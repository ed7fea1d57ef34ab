"""Tensor parallelism inside the ops: the `tp` mesh axis and the per-shard call of head-local ops.

Under `jax.set_mesh(mesh)` with a `tp` axis of size N > 1 (jaxspec.parallel builds it), every
head-local op (GDN verify / fold / chunked prefill, conv verify, verify attention) runs under
`jax.shard_map`: each device gets its N-th of the heads (or conv channels) and runs the same
function, kernel or reference, on them with no communication. Everything else (the projections,
norms, sampling) is left to XLA's sharding propagation from the parameter and state shardings.
Without a mesh, or inside a shard_map already, `size()` is 1 and the ops run as they are.
"""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

AXIS = "tp"


def size() -> int:
    """Devices along the `tp` axis of the context mesh that an op still has to split over."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or AXIS not in mesh.shape or AXIS in mesh.manual_axes:
        return 1
    return mesh.shape[AXIS]


def split(ndim: int, axis: int) -> P:
    """The spec of an array of rank `ndim` split over `tp` along `axis` (negative from the end)."""
    spec = [None] * ndim
    spec[axis] = AXIS
    return P(*spec)


def split_like(x, axis: int):
    """`split` for an array or a tuple of arrays (a ring's (hi, lo) parts)."""
    if isinstance(x, (tuple, list)):
        return tuple(split(p.ndim, axis) for p in x)
    return split(x.ndim, axis)


def per_shard(fn, args: tuple, in_specs: tuple, out_specs):
    """fn(*args) with each arg split by its spec (P() = the same on every device), run per device."""
    return jax.shard_map(fn, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)


def per_shard_at_layer(fn, args: tuple, in_specs: tuple, out_specs, layer):
    """`per_shard` of fn(*args, layer=layer) for an op on stacked layers: layer None, or an int /
    int32 scalar that enters as a replicated int32 operand."""
    if layer is None:
        return per_shard(lambda *a: fn(*a, layer=None), args, in_specs, out_specs)
    return per_shard(
        lambda *a: fn(*a[:-1], layer=a[-1]),
        args + (jnp.asarray(layer, jnp.int32),),
        in_specs + (P(),),
        out_specs,
    )
