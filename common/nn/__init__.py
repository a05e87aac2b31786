"""Shared neural-network blocks; all attention/norm/RoPE math goes through common.kernels."""
from .attention import CrossAttention, SelfAttention
from .dit_block import DiTBlock, FinalLayer
from .embed import (CaptionProjection, PatchEmbed2d, TimestepEmbedder, patchify,
                    sincos_2d, sinusoidal_embedding, unpatchify)
from .llama import Llama, LlamaAttention, LlamaBlock, LlamaConfig
from .mlp import MLP, SwiGLU
from .norm import LayerNorm, RMSNorm

__all__ = ["CrossAttention", "SelfAttention", "DiTBlock", "FinalLayer", "CaptionProjection",
           "PatchEmbed2d", "TimestepEmbedder", "patchify", "sincos_2d", "sinusoidal_embedding", "unpatchify",
           "MLP", "SwiGLU", "LayerNorm", "RMSNorm",
           "Llama", "LlamaAttention", "LlamaBlock", "LlamaConfig"]
