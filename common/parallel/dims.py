"""ParallelDims: the degrees of every parallelism, checked once, and the one DeviceMesh built from them.

Mesh order (outermost first): pp, dp_replicate, dp_shard, cp, tp. TP is innermost so its
collectives (several per layer) stay inside a node; PP is outermost because it only sends
activations between neighbours. Derived (flattened) meshes:
  dp          = dp_replicate x dp_shard   the data loader splits by this rank
  dp_shard_cp = dp_shard x cp             FSDP shards parameters over it (CP ranks hold the same
                                          weights, so they share the shards and average gradients)
  dp_cp       = dp x cp                   every rank holding a distinct part of the batch
"""
from __future__ import annotations

from dataclasses import dataclass

from common.config import ConfigError

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# The flattened meshes (module docstring): name -> the mesh dims it spans, outermost first.
FLATTENED = {"dp": ("dp_replicate", "dp_shard"), "dp_shard_cp": ("dp_shard", "cp"),
             "dp_cp": ("dp_replicate", "dp_shard", "cp")}
CP_MODES = ("ulysses", "ring", "hybrid")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble")
DP_MODES = ("auto", "none", "ddp", "fsdp")


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    world_size: int
    dp_mode: str = "none"           # resolved: none | ddp | fsdp
    cp_mode: str = "ulysses"
    cp_ulysses: int = 1             # Ulysses degree inside cp (cp itself for ulysses, 1 for ring)
    pp_schedule: str = "1f1b"
    pp_stages_per_rank: int = 1

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_config(cls, cfg, world_size: int) -> "ParallelDims":
        """Resolve -1/auto values against the world size and check every degree (ConfigError)."""
        for name in ("dp_replicate", "tp", "cp", "pp"):
            if getattr(cfg, name) < 1:
                raise ConfigError(f"parallel.{name}={getattr(cfg, name)} must be >= 1")
        dp_shard = cfg.dp_shard
        others = cfg.dp_replicate * cfg.tp * cfg.cp * cfg.pp
        if dp_shard == -1:
            if world_size % others:
                raise ConfigError(_product_message(cfg, "-1", world_size,
                                                   f"the world size is not divisible by {others}"))
            dp_shard = world_size // others
        elif dp_shard < 1:
            raise ConfigError(f"parallel.dp_shard={dp_shard} must be >= 1 (or -1 for the rest of the world size)")
        if dp_shard * others != world_size:
            raise ConfigError(_product_message(cfg, str(dp_shard), world_size,
                                               f"their product is {dp_shard * others}, not the world size"))
        if cfg.cp_mode not in CP_MODES:
            raise ConfigError(f"parallel.cp_mode={cfg.cp_mode!r} is not one of {', '.join(CP_MODES)}")
        if cfg.pp_schedule not in PP_SCHEDULES:
            raise ConfigError(f"parallel.pp_schedule={cfg.pp_schedule!r} is not one of {', '.join(PP_SCHEDULES)}")
        ulysses = {"ulysses": cfg.cp, "ring": 1, "hybrid": cfg.cp_ulysses}[cfg.cp_mode]
        if cfg.cp > 1 and cfg.cp_mode == "hybrid" and (ulysses < 2 or cfg.cp % ulysses or cfg.cp // ulysses < 2):
            raise ConfigError(f"parallel.cp_mode=hybrid needs cp = cp_ulysses x ring with both >= 2; "
                              f"got cp={cfg.cp}, cp_ulysses={cfg.cp_ulysses}")
        stages = cfg.pp_stages_per_rank or (2 if cfg.pp_schedule in ("interleaved", "zero_bubble") else 1)
        if cfg.pp_schedule in ("gpipe", "1f1b") and stages != 1:
            raise ConfigError(f"parallel.pp_schedule={cfg.pp_schedule} runs one stage per rank; "
                              f"pp_stages_per_rank={stages} needs pp_schedule=interleaved")
        if cfg.pp_schedule == "zero_bubble" and stages != 2:
            raise ConfigError(f"parallel.pp_schedule=zero_bubble (ZB-V) runs exactly 2 stages per rank, "
                              f"not pp_stages_per_rank={stages}")
        if cfg.pp_schedule in ("interleaved",) and stages < 2:
            raise ConfigError("parallel.pp_schedule=interleaved needs pp_stages_per_rank >= 2")
        dp_mode = _resolve_dp_mode(cfg.dp_mode, cfg.dp_replicate, dp_shard, cfg.cp, cfg.tp, cfg.pp)
        return cls(cfg.dp_replicate, dp_shard, cfg.cp, cfg.tp, cfg.pp, world_size, dp_mode,
                   cfg.cp_mode, ulysses if cfg.cp > 1 else 1, cfg.pp_schedule, stages if cfg.pp > 1 else 1)

    # ------------------------------------------------------------------ derived degrees
    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def describe(self) -> str:
        parts = [f"{n}={getattr(self, n)}" for n in MESH_DIMS if getattr(self, n) > 1]
        extra = []
        if self.cp > 1:
            extra.append(f"cp_mode={self.cp_mode}")
        if self.pp > 1:
            extra.append(f"pp_schedule={self.pp_schedule}")
        return (" x ".join(parts) or "single process") + f" (dp_mode={self.dp_mode}" + \
            "".join(", " + e for e in extra) + ")"

    def check_model(self, *, heads: int, kv_heads: int | None = None, seq_len: int | None = None,
                    layers: int | None = None, microbatches: int | None = None) -> None:
        """Model-dependent checks, run before any weight is touched, so a bad layout fails at start
        with the numbers instead of a shape error (or a hang) mid-training."""
        kv_heads = kv_heads or heads
        if self.tp > 1 and (heads % self.tp or kv_heads % self.tp):
            raise ConfigError(f"parallel.tp={self.tp}: the model has {heads} attention heads"
                              + (f" and {kv_heads} kv heads" if kv_heads != heads else "")
                              + f", not divisible by {self.tp}")
        if self.cp > 1 and self.cp_ulysses > 1:
            local = heads // self.tp
            if local % self.cp_ulysses or (kv_heads // self.tp) % self.cp_ulysses:
                raise ConfigError(f"parallel.cp={self.cp} ({self.cp_mode}, Ulysses degree {self.cp_ulysses}): "
                                  f"{local} heads per tensor-parallel rank are not divisible by {self.cp_ulysses}; "
                                  f"use parallel.cp_mode=ring or fewer Ulysses ranks")
        if seq_len is not None:
            if self.cp > 1 and seq_len % self.cp:
                raise ConfigError(f"parallel.cp={self.cp}: the sequence of {seq_len} tokens does not split into "
                                  f"{self.cp} equal shards (choose an image size / patch size giving a multiple of {self.cp})")
            if self.tp > 1 and seq_len % (self.tp * self.cp):
                raise ConfigError(f"parallel.tp={self.tp} with sequence parallel: {seq_len} tokens "
                                  f"(per CP shard {seq_len // self.cp}) do not split into {self.tp} equal shards")
        if self.pp > 1 and layers is not None:
            stages = self.pp * self.pp_stages_per_rank
            if layers < stages or layers % stages:
                raise ConfigError(f"parallel.pp={self.pp} x {self.pp_stages_per_rank} stage(s) per rank = {stages} "
                                  f"pipeline stages: the model's {layers} blocks do not split evenly into them")
            if microbatches is not None and (microbatches < self.pp or microbatches % self.pp):
                raise ConfigError(f"parallel.pp={self.pp}: train.grad_accum={microbatches} microbatches; the "
                                  f"{self.pp_schedule} schedule needs a multiple of the pipeline degree ({self.pp})")

    # ------------------------------------------------------------------ mesh
    def build_mesh(self, device_type: str):
        """The world DeviceMesh with named dims plus flattened dp, dp_shard_cp and dp_cp; None for one
        process, unless it asked for DDP or FSDP by name (FSDP's mixed precision or CPU offload on one
        GPU; a one-rank smoke test of the sharded path): that gets a one-process group and mesh."""
        if self.world_size == 1:
            if self.dp_mode == "none":
                return None
            _init_single_process_group(device_type)
        from torch.distributed.device_mesh import init_device_mesh
        shape = tuple(getattr(self, n) for n in MESH_DIMS)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)
        # DeviceMesh._flatten is how torch itself builds multi-dim sub-meshes (HSDP, FSDP x CP).
        for name, spans in FLATTENED.items():
            mesh[spans]._flatten(name)
        return mesh


def submesh(mesh, name: str):
    """mesh[name] for a dim or a flattened mesh (FLATTENED) of build_mesh's mesh. A flattened one
    is the mesh DeviceMesh._flatten registered (it returns it again), not a slice of the root by
    the flattened name: torch deprecates that since 2.11 ("Slicing a flattened dim from root mesh")."""
    if name in FLATTENED:
        return mesh[FLATTENED[name]]._flatten(name)
    return mesh[name]


def _init_single_process_group(device_type: str) -> None:
    import torch
    import torch.distributed as dist

    from common.dist import init_process_group_on
    if not dist.is_initialized():
        dev = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
        init_process_group_on(dev, store=dist.HashStore(), rank=0, world_size=1)


def _product_message(cfg, dp_shard: str, world_size: int, why: str) -> str:
    return (f"parallel degrees dp_replicate={cfg.dp_replicate} x dp_shard={dp_shard} x cp={cfg.cp} x tp={cfg.tp} "
            f"x pp={cfg.pp} do not fit world size {world_size}: {why}")


def _resolve_dp_mode(mode: str, dp_replicate: int, dp_shard: int, cp: int, tp: int, pp: int) -> str:
    if mode not in DP_MODES:
        raise ConfigError(f"parallel.dp_mode={mode!r} is not one of {', '.join(DP_MODES)}")
    dp = dp_replicate * dp_shard
    model_parallel = cp > 1 or tp > 1 or pp > 1
    if mode == "auto":
        if dp_replicate > 1 and dp_shard > 1:
            return "fsdp"  # HSDP
        if model_parallel:
            return "fsdp" if dp * cp > 1 else "none"
        return "ddp" if dp > 1 else "none"
    if mode == "none" and dp * cp > 1:
        raise ConfigError(f"parallel.dp_mode=none but {dp * cp} ranks hold copies of the weights "
                          f"(dp={dp}, cp={cp}): their gradients must be reduced; use fsdp (or ddp for pure data parallel)")
    if mode == "ddp" and (cp > 1 or tp > 1):
        # With pp alone each stage is replicated over dp (common/parallel/data_parallel.py,
        # shard_pipeline_stages); TP/CP peers would need FSDP's multi-dim mesh anyway.
        raise ConfigError(f"parallel.dp_mode=ddp supports data and pipeline parallelism only; with tp={tp}, "
                          f"cp={cp} use dp_mode=fsdp (or auto)")
    if mode == "ddp" and dp_replicate > 1 and dp_shard > 1:
        raise ConfigError("parallel.dp_mode=ddp replicates everything: dp_replicate > 1 with dp_shard > 1 is HSDP, "
                          "use dp_mode=fsdp")
    if mode == "fsdp" and dp_replicate > 1 and dp_shard == 1:
        raise ConfigError(f"parallel.dp_mode=fsdp with dp_replicate={dp_replicate} and dp_shard=1 shards nothing; "
                          "use dp_mode=ddp, or dp_shard > 1 for HSDP")
    return mode
