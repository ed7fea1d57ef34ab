"""jaxspec: speculative decoding for GDN-hybrid LLMs in JAX (public API, DESIGN section 9)."""
from jaxspec.config import CacheConfig, DraftConfig, SpecConfig, TargetConfig
from jaxspec.dflash import load_draft
from jaxspec.engine import Engine
from jaxspec.target import Target, load_target, target_logits

__all__ = ["CacheConfig", "DraftConfig", "Engine", "SpecConfig", "Target", "TargetConfig", "load_draft",
           "load_target", "target_logits"]
