"""jaxspec: speculative decoding for GDN-hybrid LLMs in JAX (public API, DESIGN section 9)."""
from jaxspec.config import CacheConfig, TargetConfig
from jaxspec.target import Target, load_target, target_logits

__all__ = ["CacheConfig", "Target", "TargetConfig", "load_target", "target_logits"]
