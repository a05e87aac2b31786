"""Shared neural-network blocks; all attention/norm/RoPE math goes through common.kernels."""
from .attention import CrossAttention, SelfAttention
from .dit_block import DiTBlock, FinalLayer, reset_dit_parameters
from .embed import (CaptionProjection, PatchEmbed2d, TimestepEmbedder, VideoPatchEmbed, grid_positions,
                    patchify, patchify3d, sincos_2d, sincos_nd, sinusoidal_embedding, unpatchify, unpatchify3d)
from .llama import Llama, LlamaAttention, LlamaBlock, LlamaConfig
from .mlp import MLP, SwiGLU
from .norm import LayerNorm, RMSNorm

__all__ = ["CrossAttention", "SelfAttention", "DiTBlock", "FinalLayer", "reset_dit_parameters", "CaptionProjection",
           "PatchEmbed2d", "TimestepEmbedder", "patchify", "sincos_2d", "sinusoidal_embedding", "unpatchify",
           "VideoPatchEmbed", "grid_positions", "patchify3d", "sincos_nd", "unpatchify3d",
           "MLP", "SwiGLU", "LayerNorm", "RMSNorm",
           "Llama", "LlamaAttention", "LlamaBlock", "LlamaConfig"]
