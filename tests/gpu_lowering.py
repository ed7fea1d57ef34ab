"""Lower a function for an NVIDIA H200 on a machine without a GPU.

Pallas' Triton lowering turns a kernel into Triton IR at lowering time, so exporting for the
`cuda` platform under an abstract H200 device catches lowering errors (unsupported primitives,
block shapes, dtypes) on the CPU. Compiling the IR to PTX and running it still needs the GPU.
"""

import jax
from jax import export
from jax._src.mesh import AbstractDevice, AbstractMesh

_H200 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice("NVIDIA H200", 132, "gpu"))
_TRITON = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")


def lower_for_h200(fn, *args, **kwargs) -> str:
    """StableHLO text of jit(fn)(*args) lowered for cuda; args may be jax.ShapeDtypeStruct."""
    with jax.sharding.use_abstract_mesh(_H200):
        exported = export.export(jax.jit(fn, **kwargs), platforms=["cuda"], disabled_checks=[_TRITON])(*args)
    return exported.mlir_module()
