"""Ops: each module holds the plain-jnp reference of one op family and dispatches by `impl=`.

Model code (`jaxspec.target`, `jaxspec.dflash`) calls only these functions, never a kernel.
"""
