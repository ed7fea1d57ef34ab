"""jaxspec: speculative decoding for GDN-hybrid LLMs in JAX (the public API of docs/design.md section 9)."""

from jaxspec.config import SpecConfig
from jaxspec.dflash import load_draft
from jaxspec.engine import Engine
from jaxspec.target import load_target, target_logits

__all__ = ["Engine", "SpecConfig", "load_draft", "load_target", "target_logits"]
