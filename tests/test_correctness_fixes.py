"""Training-correctness fixes of issue 16: layout-independent VAE posterior samples, options that do
nothing refused (or used), and the weight-decay split of the DiT's modulation tables."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from common.config import ConfigError, ParallelConfig
from common.dist import DistInfo
from common.parallel.dims import ParallelDims
from common.parallel.layouts import check_layout


# --------------------------------------------------------------------------- text2image latents
def _tiny_vae():
    from diffusers import AutoencoderKL
    torch.manual_seed(0)
    return AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                         up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
                         latent_channels=4, norm_num_groups=8, sample_size=16).eval().requires_grad_(False)


def _encode_as_ranks(comp, images, positions, world: int) -> torch.Tensor:
    """What `world` data-parallel ranks encode for their rows of the global batch, each with its
    global RNG seeded per rank as the trainer does (common.dist.seed_everything)."""
    from pipelines.text2image.components import encode_images
    parts = []
    for rank, rows in enumerate(torch.arange(len(images)).chunk(world)):
        torch.manual_seed(1000 + rank)
        parts.append(encode_images(comp, {"image": images[rows], "__position__": positions[rows]}, "cpu"))
    return torch.cat(parts)


def test_t2i_vae_latents_do_not_depend_on_the_layout():
    vae = _tiny_vae()
    comp = SimpleNamespace(vae=vae, to_model_space=lambda x: x * 0.5, cfg=SimpleNamespace(run=SimpleNamespace(seed=7)))
    gen = torch.Generator().manual_seed(1)
    images = torch.rand(4, 3, 16, 16, generator=gen) * 2 - 1
    positions = torch.tensor([40, 41, 42, 43])
    single = _encode_as_ranks(comp, images, positions, world=1)
    for world in (2, 4):
        torch.testing.assert_close(_encode_as_ranks(comp, images, positions, world), single, rtol=1e-5, atol=1e-6,
                                   msg=f"world size {world}")
    # A resume replays the same sample (same position) with another global RNG state: same latent.
    torch.manual_seed(99)
    again = _encode_as_ranks(comp, images[2:3], positions[2:3], world=1)
    torch.testing.assert_close(again, single[2:3], rtol=1e-5, atol=1e-6)
    # Still a posterior sample (not the mean), and another position draws other noise.
    mean = vae.encode(images).latent_dist.mode() * 0.5
    assert (single - mean).abs().max() > 1e-3
    moved = _encode_as_ranks(comp, images, positions + 100, world=1)
    assert (moved - single).abs().max() > 1e-3


# --------------------------------------------------------------------------- options that do nothing
def _check(world: int, **kw):
    cfg = ParallelConfig(**kw)
    check_layout(ParallelDims.from_config(cfg, world), cfg, {}, "text2image")


@pytest.mark.parametrize("world,kw,words", [
    (2, dict(dp_mode="ddp", cpu_offload=True), ["parallel.cpu_offload=true", "dp_mode=ddp"]),
    (1, dict(cpu_offload=True), ["parallel.cpu_offload=true", "dp_mode=none"]),
    (2, dict(tp=2, cpu_offload=True), ["parallel.cpu_offload=true", "dp_mode=none"]),
    (2, dict(dp_mode="ddp", reshard_after_forward=False), ["parallel.reshard_after_forward=false", "dp_mode=ddp"]),
    (1, dict(reshard_after_forward=False), ["parallel.reshard_after_forward=false", "dp_mode=none"]),
    (4, dict(pp=2, dp_mode="ddp", reshard_after_forward=False), ["parallel.reshard_after_forward=false", "ddp"]),
])
def test_fsdp_options_without_fsdp_are_refused(world, kw, words):
    with pytest.raises(ConfigError) as e:
        _check(world, **kw)
    msg = str(e.value)
    assert "\n" not in msg and "FSDP" in msg
    for w in words:
        assert w in msg, (w, msg)


@pytest.mark.parametrize("world,kw", [
    (2, dict(dp_mode="fsdp", cpu_offload=True)), (2, dict(dp_mode="fsdp", reshard_after_forward=False)),
    (1, dict(dp_mode="fsdp", cpu_offload=True)), (4, dict(pp=2, dp_shard=2, reshard_after_forward=False)),
    (2, dict(dp_mode="ddp")), (1, dict()),
])
def test_fsdp_options_with_fsdp_are_accepted(world, kw):
    _check(world, **kw)


def test_fsdp_option_refused_by_parallelize_before_any_process_group():
    from common.nn.dit_parallel import parallelize_dit
    from pipelines.text2image.model import DiT, dit_config
    model = DiT(dit_config("tiny", hidden=32, depth=2, heads=2))
    with pytest.raises(ConfigError, match="parallel.cpu_offload"):
        parallelize_dit(model, ParallelConfig(dp_mode="ddp", cpu_offload=True), DistInfo(0, 2, 0, torch.device("cpu")))


def test_run_name_is_shown_in_the_log(synth_data, tmp_path):
    from tests.conftest import run_train
    proc = run_train(str(tmp_path / "run"), synth_data, "run.name=ablation-lr3e-4", "train.steps=1",
                     "sample.num=0", "train.ema_decay=0", "data.micro_batch_size=4")
    first = proc.stdout.splitlines()[0]
    assert first.startswith("ablation-lr3e-4: text2image"), proc.stdout[:500]


# --------------------------------------------------------------------------- weight decay
def test_dit_modulation_tables_norms_and_biases_are_not_decayed():
    from common.config import OptimConfig
    from common.optim import build_optimizer
    from pipelines.text2image.model import DiT, dit_config
    model = DiT(dit_config("tiny", hidden=32, depth=2, heads=2, text_dim=32, text_len=8))
    opt = build_optimizer(model, OptimConfig(weight_decay=0.1))
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    plain = {names[id(p)] for g in opt.param_groups if g["weight_decay"] == 0 for p in g["params"]}
    assert decayed | plain == set(names.values()) and not decayed & plain
    tables = {n for n in names.values() if n.endswith("scale_shift_table")}
    assert tables == {"blocks.0.scale_shift_table", "blocks.1.scale_shift_table", "final.scale_shift_table"}
    assert tables <= plain
    # Exactly the tables, biases and norm gains go undecayed; every matrix / conv kernel is decayed.
    assert plain == tables | {n for n, p in model.named_parameters() if p.ndim < 2}
    assert decayed == {n for n, p in model.named_parameters() if p.ndim >= 2} - tables
    assert {"blocks.0.attn.to_q.weight", "patch_embed.proj.weight", "t_block.1.weight"} <= decayed


def test_modules_declare_their_own_undecayed_matrices_under_wrappers():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from common.optim import declared_no_decay

    class Table(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.offsets = torch.nn.Parameter(torch.zeros(4, 8))
            self.proj = torch.nn.Linear(8, 8)

        def no_weight_decay(self):
            return {"offsets"}

    model = torch.nn.Sequential(Table(), torch.nn.ModuleDict({"inner": checkpoint_wrapper(Table())}))
    declared = declared_no_decay(model)
    names = {n for n, _ in model.named_parameters()}
    assert declared == {"0.offsets", "1.inner._checkpoint_wrapped_module.offsets"} and declared <= names
    assert declared_no_decay(Table()) == {"offsets"}


def test_plain_parameters_take_the_fused_adamw_with_the_foreach_result():
    from common.config import OptimConfig
    from common.optim import build_optimizer
    from pipelines.text2image.model import DiT, dit_config
    torch.manual_seed(0)
    models = [DiT(dit_config("tiny", hidden=32, depth=2, heads=2, text_dim=32, text_len=8)) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    start = {n: p.detach().clone() for n, p in models[0].named_parameters()}
    fused, reference = (build_optimizer(m, OptimConfig(weight_decay=0.1)) for m in models)
    assert all(g["fused"] and not g["foreach"] for g in fused.param_groups)
    for g in reference.param_groups:  # the same groups through the multi-tensor path
        g.update(fused=None, foreach=True)
    for _ in range(3):
        grads = [torch.randn_like(p) for p in models[0].parameters()]
        for m, opt in zip(models, (fused, reference)):
            for p, gr in zip(m.parameters(), grads):
                p.grad = gr.clone()
            opt.step()
    for (n, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=n)
        assert not torch.equal(a, start[n]), n


def test_vlm_refuses_cpu_offload_it_would_ignore():
    from common.nn.vlm_parallel import parallelize_vlm
    with pytest.raises(ConfigError, match="parallel.cpu_offload=true is not built for the vision-language model"):
        parallelize_vlm(object(), ParallelConfig(dp_mode="fsdp", cpu_offload=True),
                        DistInfo(0, 2, 0, torch.device("cpu")), name="vlm")
