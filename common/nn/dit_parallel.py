"""How the DiT family (common/nn/dit.py: the image and the video DiT) is parallelized.

The mechanisms are common/parallel's; this is the family's plan for them, in torchtitan's order:
tensor parallel (each DiTBlock's own plan) -> context parallel (tokens and RoPE rows sharded at
the first block, gathered before the final layer) -> activation checkpointing -> compile ->
pipeline split (DiTStage) -> data parallel (DDP, or FSDP with each block a unit; under pipeline
parallelism per stage: its blocks, then the stage). Which layouts a model refuses comes from its
`parallel_limits()`, checked with the unbuilt combinations in common/parallel/layouts.py before
any process group is touched.

Why the compositions are exact:
  CP x TP   CP's pre-hook on block 0 runs before TP's sequence-parallel slice (prepend), so TP
            splits this CP rank's contiguous tokens; TP's gather after the last block restores
            the CP shard, CP's gather before the final layer the sequence. Attention sees the
            TP rank's heads over the CP shard, exactly the CP-only computation per head.
  PP x CP   the shard sits on block 0 and the gather on the final layer, whichever stage holds
            them: stage boundaries carry CP-sharded tokens, every stage shards its RoPE rows.
  PP x DP   every stage is fully_shard-ed (blocks, then the stage as the root owning embeddings
            or the final layer); torch.distributed.pipelining turns gradient sync off for all
            microbatches but the last, then reduce-scatters (averages) once and divides by the
            microbatch count: the same mean as grad accumulation in one process. The view
            (what optimizer, EMA and DCP checkpoints see) holds the same modules, hence the
            same dp-sharded DTensor parameters under the DiT's names: checkpoints stay
            layout-independent and common/parallel/grads.py counts each shard once.
Nothing here reads tensor values: a meta-device model parallelizes the same way (the planner's
dry run).
"""
from __future__ import annotations

from torch import nn

from common.dist import DistInfo
from common.parallel.data_parallel import apply_data_parallel, shard_pipeline_stages
from common.parallel.dims import ParallelDims
from common.parallel.layouts import check_layout
from common.parallel.parallel_model import ParallelModel
from common.parallel.pipeline_parallel import PipelineRunner, split_layers, stage_ids


def parallelize_dit(model, cfg, info: DistInfo, *, microbatches: int = 1, criterion=None,
                    name: str | None = None) -> ParallelModel:
    """cfg: the ParallelConfig; microbatches: train.grad_accum; criterion(pred, target) -> loss,
    which the last pipeline stage applies; name: the pipeline, for error messages. Returns what
    the Trainer needs."""
    dims = ParallelDims.from_config(cfg, info.world_size)
    check_layout(dims, cfg, model.parallel_limits(), name or type(model).__name__)
    mc = model.cfg
    dims.check_model(heads=mc.heads, seq_len=mc.num_tokens, layers=mc.depth, microbatches=microbatches)
    mesh = dims.build_mesh(info.device.type)
    grad_hooks = []
    if dims.tp > 1:
        from common.parallel.tensor_parallel import apply_tensor_parallel
        # Embeddings, t_block and the final layer stay replicated; the returned hook sums the
        # partial gradients of TP-replicated parameters each step.
        grad_hooks.append(apply_tensor_parallel(model, mesh["tp"], sequence_parallel=cfg.sequence_parallel))
    if dims.cp > 1:
        apply_context_parallel(model, mesh, dims, mc.num_tokens)
    apply_block_options(model.blocks, cfg)
    if dims.pp > 1:
        return _pipeline(model, dims, mesh, info, microbatches, criterion, grad_hooks, cfg)
    module = apply_data_parallel(model, list(model.blocks), mesh, dims, info, cfg)
    return ParallelModel(module, dims, mesh, grad_hooks=grad_hooks)


def apply_context_parallel(model, mesh, dims: ParallelDims, num_tokens: int) -> None:
    """Shard the token sequence over the CP ranks from the first block to the final layer.

    Self-attention goes through ContextParallel; cross-attention needs nothing (the text is
    replicated, queries stay local) and every other layer is token-wise. The final layer runs on
    the gathered sequence, identically on every CP rank; gather's backward (local slice x cp)
    plus the gradient averaging over dp x cp make every parameter's gradient exact.
    """
    from common.parallel.context_parallel import ContextParallel
    # DiT attention is bidirectional, so contiguous shards already balance the work.
    cp = ContextParallel(mesh["cp"], mode=dims.cp_mode, layout="contiguous",
                         ulysses_degree=dims.cp_ulysses if dims.cp_mode == "hybrid" else None)
    heads = model.blocks[0].attn.heads
    cp.validate(heads, heads, num_tokens)
    first = model.blocks[0]

    def shard_block_inputs(block, args):
        h, t0, ctx, mask, rope = args
        if block is first:
            h = cp.shard(h, 1)
        if rope is not None:  # RoPE rows follow their tokens (a set model has none)
            rope = tuple(cp.shard(r, 0) for r in rope)
        return h, t0, ctx, mask, rope

    for block in model.blocks:
        block.attn.attn_impl = cp.attention
        # prepend: under TP + sequence parallel, block 0 also slices its input over the TP ranks;
        # the CP shard must come first so that TP splits this CP rank's contiguous tokens.
        block.register_forward_pre_hook(shard_block_inputs, prepend=True)
    model.final.register_forward_pre_hook(lambda _, args: (cp.gather(args[0], 1), *args[1:]))


def apply_block_options(blocks: nn.ModuleList, cfg) -> None:
    """Activation checkpointing, then per-block compile (both keep parameter names)."""
    if cfg.activation_checkpoint != "none":
        from common.parallel.activation_checkpoint import apply_activation_checkpointing
        apply_activation_checkpointing(blocks, cfg.activation_checkpoint, cfg.ac_every)
    if cfg.compile:
        from common.parallel.compile import compile_blocks
        compile_blocks(blocks)


class DiTStage(nn.Module):
    """The part of a DiT that one pipeline stage runs, under the DiT's own parameter names.

    The conditioning (t0, timestep embedding, projected text) is computed once by the first
    stage and passed on with the tokens, so every stage's blocks see it and its gradient flows
    back to the first stage. First stage: (x, t, context, mask) -> (tokens, t0, temb, text, mask);
    middle stages pass that tuple on; the last returns the prediction. The mask travels as a
    float (it carries no gradient).
    """

    def __init__(self, dit, block_ids, first: bool, last: bool, grid: tuple[int, ...]):
        super().__init__()
        self.first, self.last, self.grid = first, last, grid
        self._dit = [dit]  # a list, so the whole DiT is not registered as a submodule
        if first:
            for name in dit.EMBED_MODULES:
                setattr(self, name, getattr(dit, name))
        self.blocks = nn.ModuleDict({str(i): dit.blocks[i] for i in block_ids})
        if last:
            self.final = dit.final

    def forward(self, *args):
        dit = self._dit[0]
        if self.first:
            x, t, context, mask = args
            h, t0, temb, ctx = dit.embed(x, t, context, mask)
            mask_f = mask.float()
        else:
            h, t0, temb, ctx, mask_f = args
        rope = dit.rope(*self.grid, h.device)
        # run_blocks trims the text keys once for this stage's blocks (compiled ones too); the
        # full-length ctx and mask travel on, so stage I/O shapes stay fixed.
        h = dit.run_blocks(h, t0, ctx, mask_f > 0.5, rope, self.blocks.values())
        if self.last:
            return dit.head(h, temb, self.grid)
        # gloo sends only contiguous tensors
        return tuple(t.contiguous() for t in (h, t0, temb, ctx, mask_f))


def _pipeline(model, dims: ParallelDims, mesh, info: DistInfo, microbatches: int, criterion,
              grad_hooks, cfg) -> ParallelModel:
    num_stages = dims.pp * dims.pp_stages_per_rank
    layers = split_layers(model.cfg.depth, num_stages)
    pp_rank = mesh["pp"].get_local_rank()
    mine = stage_ids(pp_rank, dims.pp, dims.pp_stages_per_rank, dims.pp_schedule)
    grid = model.default_grid()
    stages = {s: DiTStage(model, layers[s], s == 0, s == num_stages - 1, grid) for s in mine}
    # One view over all of this rank's stages: what the optimizer, EMA and checkpoints see.
    owned = [i for s in mine for i in layers[s]]
    view = DiTStage(model, owned, 0 in mine, num_stages - 1 in mine, grid)
    # Blocks of other ranks' stages are dropped so their memory is freed.
    for i in range(model.cfg.depth):
        if i not in owned:
            model.blocks[i] = nn.Identity()
    if 0 not in mine:
        for name in model.EMBED_MODULES:
            setattr(model, name, None)
    if num_stages - 1 not in mine:
        model.final = None

    # Data parallelism per stage; the view shares the stages' modules, so it sees the same
    # (dp-sharded DTensor) parameters the stages train, under the DiT's names.
    shard_pipeline_stages(stages.values(), lambda stage: list(stage.blocks.values()), mesh, dims, info, cfg)
    runner = PipelineRunner(stages, num_stages, mesh["pp"].get_group(), info.device, dims.pp_schedule,
                            microbatches, criterion)
    return ParallelModel(view, dims, mesh, pipeline=runner, grad_hooks=grad_hooks)
