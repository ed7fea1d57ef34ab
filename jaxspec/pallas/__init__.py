"""Pallas GPU kernels, one module per kernel family, each with `supports(...)`.

Reached only through jaxspec.ops (impl="auto" | "pallas"). Kernels use the Triton lowering
(`pl.pallas_call`); it does not mask blocks that overhang an array, so every partial block is
padded or masked explicitly. Off the GPU the wrappers run in interpret mode.
"""
