"""Hardware facts the kernels size their grids by, and the interpret default, in one place."""

import jax

NUM_SMS = 132  # streaming multiprocessors of the H200 the kernels are tuned for


def default_interpret() -> bool:
    """Pallas interpret mode off the GPU: CPU tests run the kernels' Python semantics."""
    return jax.default_backend() != "gpu"
