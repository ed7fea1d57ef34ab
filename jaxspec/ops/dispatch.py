"""The `impl=` switch shared by every op module.

`"ref"` runs the plain-jnp reference, `"pallas"` demands a kernel, `"auto"` takes a kernel only
where its `supports(...)` predicate covers the call. An unsupported call is slower, never wrong.
"""
from typing import Callable

IMPLS = ("auto", "ref", "pallas")


def use_kernel(op: str, impl: str, kernel_supports: Callable[[], bool] | None) -> bool:
    """Whether `op` should run its Pallas kernel; `kernel_supports` is None when no kernel exists."""
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}: must be one of {IMPLS}")
    if impl == "ref":
        return False
    supported = kernel_supports is not None and kernel_supports()
    if impl == "pallas" and not supported:
        raise ValueError(f"impl='pallas': no Pallas kernel covers this {op} call")
    return supported
