"""Kernel dispatch: the only path from models to attention, norms and RoPE (see backend.py)."""
from .attention import attention, attention_reference
from .backend import BACKENDS, resolve_backend, use_backend
from .norm import layer_norm, modulate, norm_modulate, rms_norm
from .rope import apply_rope, rope_frequencies

__all__ = ["attention", "attention_reference", "BACKENDS", "resolve_backend", "use_backend",
           "layer_norm", "modulate", "norm_modulate", "rms_norm", "apply_rope", "rope_frequencies"]
