"""The `impl=` switch shared by every op module.

`"ref"` runs the plain-jnp reference. `"pallas"` demands the kernel where the op has one (on a
machine without a GPU it runs in Pallas interpret mode, which is how the CPU tests hold kernels to
their references) and raises if it does not cover the call; an op with no kernel at all runs its
reference, so a model function called with impl="pallas" runs every kernel there is.
`"auto"` takes the kernel only on a GPU and only where its `supports(...)` predicate covers the
call's shapes and dtypes. An unsupported call is slower, never wrong.
"""

from collections.abc import Callable

import jax

IMPLS = ("auto", "ref", "pallas")


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def use_kernel(op: str, impl: str, kernel_supports: Callable[[], bool] | None) -> bool:
    """Whether `op` should run its Pallas kernel; `kernel_supports` is None when no kernel exists
    (then never, whatever impl says)."""
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}: must be one of {IMPLS}")
    if impl == "ref":
        return False
    if kernel_supports is None:
        return False
    supported = kernel_supports()
    if impl == "pallas" and not supported:
        raise ValueError(f"impl='pallas': no Pallas kernel covers this {op} call")
    return supported and (impl == "pallas" or on_gpu())
