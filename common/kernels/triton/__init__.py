"""Our Triton kernels, each a torch.autograd.Function behind the dispatch in common/kernels/.

Modules here import triton at their top, so nothing imports them until a dispatch function has
resolved to the "triton" backend: `import common.kernels` stays cheap and works without triton.
Kernels: norm (RMSNorm/LayerNorm/adaLN norm+modulate), rope, swiglu, cross_entropy.
flash_attention: FlashAttention-2 forward/backward with GQA, varlen and lse (kernels.attention).
"""
