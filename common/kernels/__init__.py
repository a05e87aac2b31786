"""Kernel dispatch: the only path from models to attention, norms, RoPE, SwiGLU and the LM-head
cross-entropy (see backend.py for how a backend is chosen). Triton is imported lazily."""
from .attention import attention, attention_reference
from .backend import AUTO_TRITON_OPS, BACKENDS, resolve_backend, use_backend
from .cross_entropy import cross_entropy, cross_entropy_eager
from .gelu import gelu_tanh
from .norm import layer_norm, modulate, mul_add, norm_modulate, rms_norm, rms_norm_rope
from .rope import apply_rope, rope_frequencies
from .swiglu import swiglu

__all__ = ["attention", "attention_reference", "AUTO_TRITON_OPS", "BACKENDS", "resolve_backend", "use_backend",
           "cross_entropy", "cross_entropy_eager", "gelu_tanh", "layer_norm", "modulate", "mul_add", "norm_modulate", "rms_norm", "rms_norm_rope",
           "apply_rope", "rope_frequencies", "swiglu"]
