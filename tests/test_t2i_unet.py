"""text2image with model.arch=unet (pipelines/text2image/unet.py): the diffusers UNet behind the
DiT's interface, its presets, activation checkpointing, the refused layouts, and end to end
through the real entrypoint: training, sampling, exact resume, and DDP / FSDP2 at 2 gloo ranks
equal to one process (loss and grad norm per step, final and EMA weights, rtol 1e-5)."""
from __future__ import annotations

import json
import os

import pytest
import torch
from torch.nn import functional as F

from tests.conftest import (ROOT, assert_same_final_weights, assert_same_training, final_weights, read_metrics,
                            run_checked, run_module, shared_once, train_cmd)

UNET_YAML = os.path.join(ROOT, "pipelines/text2image/configs/tiny_unet.yaml")
# The tiny UNet with a small text tower (its width is the UNet's cross-attention width).
SMALL = ["text.width=32", "text.layers=1", "text.heads=2", "text.context_length=16", "sample.steps=2",
         "sample.num=4", "train.progress=false", "data.num_workers=0"]


def run_unet(run_dir: str, data_dir: str, *overrides: str, nproc: int = 1, check: bool = True):
    return run_checked(train_cmd(nproc) + ["--config", UNET_YAML, f"run.dir={run_dir}",
                                           f"data.train_shards={data_dir}/train",
                                           f"data.eval_shards={data_dir}/heldout", *SMALL, *overrides],
                       check=check)


def small_unet(**overrides):
    from pipelines.text2image.unet import UNet, unet_config
    torch.manual_seed(0)
    model = UNet(unet_config("tiny", text_dim=32, text_len=8, **overrides))
    # The zero-initialised output layers (identity residual branches, zero prediction) would make
    # every comparison below trivially equal: give them small random weights.
    with torch.no_grad():
        for p in model.parameters():
            if not p.any():
                p.normal_(0, 0.05)
    return model.eval()


def inputs(batch: int = 2, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 3, 32, 32, generator=g)
    t = torch.rand(batch, generator=g)
    ctx = torch.randn(batch, 8, 32, generator=g)
    mask = torch.ones(batch, 8, dtype=torch.bool)
    mask[0, 5:] = False
    mask[1, 3:] = False
    return x, t, ctx, mask


# --------------------------------------------------------------------------- the model
def test_untrained_unet_predicts_zero_like_the_dit():
    from pipelines.text2image.unet import UNet, unet_config
    model = UNet(unet_config("tiny", text_dim=32))
    out = model(*inputs())
    assert out.shape == (2, 3, 32, 32) and not out.any()


def test_forward_shape_and_time_scale():
    model = small_unet()
    x, t, ctx, mask = inputs()
    with torch.no_grad():
        out = model(x, t, ctx, mask)
        assert out.shape == x.shape
        # t in [0, 1] reaches diffusers as t * 1000 (and the input as 2x2 space-to-depth).
        pooled = (ctx * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        direct = model.unet(F.pixel_unshuffle(x, 2), t * 1000, encoder_hidden_states=ctx, encoder_attention_mask=mask,
                            class_labels=pooled, return_dict=False)[0]
        torch.testing.assert_close(out, F.pixel_shuffle(direct, 2), rtol=1e-5, atol=1e-6)
        # ... and the time matters: t and 1 - t give different predictions.
        assert (model(x, 1 - t, ctx, mask) - out).abs().max() > 1e-3
    with pytest.raises(ValueError, match="not divisible by its downsampling factor 8"):
        model(torch.zeros(1, 3, 36, 36), t[:1], ctx[:1], mask[:1])


def test_masked_caption_tokens_change_nothing():
    model = small_unet()
    x, t, ctx, mask = inputs()
    with torch.no_grad():
        ref = model(x, t, ctx, mask)
        # Masked positions get other values: the output is bitwise the same (their attention
        # weight underflows to exactly 0 and the pooled mean skips them).
        other = torch.where(mask[..., None], ctx, 100 * torch.randn_like(ctx))
        assert torch.equal(model(x, t, other, mask), ref)
        # A real token changed does change the output (the comparison above is not vacuous).
        real = ctx.clone()
        real[:, 0] += 1.0
        assert (model(x, t, real, mask) - ref).abs().max() > 1e-4
        # No mask = every token real: the masked values now count.
        assert (model(x, t, other, None) - ref).abs().max() > 1e-3


def test_presets_on_the_meta_device_have_the_published_sizes():
    from pipelines.text2image.unet import UNet, unet_config

    def params(name, **kw):
        with torch.device("meta"):
            m = UNet(unet_config(name, **kw))
        return m, sum(p.numel() for p in m.parameters())

    # SD1.5 UNet: 859,520,964 parameters (CompVis/stable-diffusion-v1-5 unet), text width 768.
    sd15, n = params("sd15")
    assert n == 859_520_964 and sd15.unet.config.cross_attention_dim == 768
    # SDXL base UNet: 2,567,463,684 with its pooled-text + size/crop embedding (2816 -> 1280); here
    # the pooled text alone (2048 -> 1280), 983,040 fewer. Text width 2048.
    sdxl, n = params("sdxl")
    assert n == 2_567_463_684 - (2816 - 2048) * 1280 and sdxl.unet.config.cross_attention_dim == 2048
    tiny, n = params("tiny", text_dim=128)
    assert 3e5 <= n <= 2.5e6, n
    # FLOPs: SD1.5 at 64x64 latents with 77 tokens. Published MAC counts (~339 GMACs, BK-SDM) leave
    # out the attention score and value products, 4 N^2 C FLOPs per self-attention (N positions,
    # C channels, 5 transformers per level; cross-attention's 4 N 77 C besides).
    counted = sd15.flops_per_sample()
    attention = sum(5 * (4 * n * n * c + 4 * n * 77 * c) for n, c in ((64 * 64, 320), (32 * 32, 640), (16 * 16, 1280)))
    attention += 4 * 8 * 8 * 8 * 8 * 1280 + 4 * 8 * 8 * 77 * 1280  # the mid block's transformer
    assert (counted - attention) / 2 == pytest.approx(339e9, rel=0.01), counted  # 338.6e9 counted


def test_activation_checkpointing_keeps_gradients_and_saves_activations():
    from common.config import ParallelConfig
    from common.dist import DistInfo
    from common.parallel.activation_checkpoint import SavedTensorMeter
    from pipelines.text2image.spec import SPEC
    x, t, ctx, mask = inputs(batch=4)
    grads, saved = {}, {}
    for mode in ("none", "full"):
        model = small_unet().train()
        pm = SPEC.parallelize(model, ParallelConfig(activation_checkpoint=mode), DistInfo(0, 1, 0, torch.device("cpu")))
        with SavedTensorMeter(model) as meter:
            loss = pm.forward(x, t, ctx, mask).square().mean()
        loss.backward()
        grads[mode] = {n: p.grad.clone() for n, p in model.named_parameters()}
        saved[mode] = meter.device_bytes
    for name, g in grads["none"].items():
        assert torch.equal(grads["full"][name], g), name  # the recompute is the same computation
    # Only the inputs of the 7 checkpointed blocks (and what runs outside them) are kept.
    assert saved["full"] < 0.5 * saved["none"], saved


@pytest.mark.parametrize("objective", ["flow", "ddpm-eps", "ddpm-v"])
def test_objectives_train_the_unet(synth_data, objective):
    """The pipeline's step functions (text tower, objective, per-sample noise) around the UNet:
    a few AdamW steps on one batch lower its loss; DDPM's model time t / T reaches the UNet as
    its integer timestep."""
    from common.config import parse_cli
    from common.optim import build_optimizer
    from common.run import make_loader
    from pipelines.text2image.spec import SPEC
    kind, _, prediction = objective.partition("-")
    cfg = parse_cli(SPEC.config, ["--config", UNET_YAML, *SMALL, f"data.train_shards={synth_data}/train",
                                  "data.micro_batch_size=8", f"diffusion.objective={kind}",
                                  f"diffusion.ddpm_prediction={prediction or 'eps'}", "optim.warmup_steps=0",
                                  "optim.lr=1e-3"], "train", "")
    comp = SPEC.build(cfg)
    prepare, criterion = SPEC.step_fns(comp, torch.device("cpu"))
    inputs, target = prepare(next(iter(make_loader(SPEC, comp, cfg, dp_rank=0, dp_size=1))))
    if kind == "ddpm":
        steps = inputs[1] * 1000
        torch.testing.assert_close(steps, steps.round(), rtol=0, atol=1e-3)
    opt = build_optimizer(comp.model, cfg.optim)
    losses = []
    for _ in range(8):
        loss = criterion(comp.model(*inputs), target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    # Step 1: the untrained UNet predicts 0, so the loss is the targets' mean square.
    assert losses[0] == pytest.approx(target.square().mean().item(), rel=1e-6)
    assert losses[-1] < 0.9 * losses[0], losses


@pytest.mark.parametrize("dim", ["tp", "cp", "pp"])
def test_unsupported_layouts_are_refused(dim):
    from common.config import ConfigError, ParallelConfig, parse_cli
    from common.dist import DistInfo
    from pipelines.text2image.spec import SPEC
    model = small_unet()
    with pytest.raises(ConfigError, match=f"parallel.{dim}=2 is not supported for text2image with model.arch=unet: "):
        SPEC.parallelize(model, ParallelConfig(**{dim: 2}), DistInfo(0, 2, 0, torch.device("cpu")), name=SPEC.name)
    # The config refuses it already, before any process starts, with the same reason.
    with pytest.raises(ConfigError, match=f"parallel.{dim}=2 is not supported for text2image with model.arch=unet"):
        parse_cli(SPEC.config, ["--config", UNET_YAML, f"parallel.{dim}=2"], "train", "")


def test_unet_config_errors():
    from common.config import ConfigError, parse_cli
    from pipelines.text2image.spec import SPEC
    for override, needle in (("model.preset=XL", "not a unet preset; choose from tiny, sd15, sdxl"),
                             ("model.hidden=64", "model.hidden=64 sizes the DiT"),
                             ("model.arch=convnet", "model.arch='convnet' is not one of dit, unet")):
        with pytest.raises(ConfigError, match=needle):
            parse_cli(SPEC.config, ["--config", UNET_YAML, override], "train", "")


# --------------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_trains_samples_and_resumes_exactly(synth_data, tmp_path):
    full, killed = str(tmp_path / "full"), str(tmp_path / "killed")
    common = ["data.micro_batch_size=8", "optim.warmup_steps=2", "train.steps=16", "train.log_every=1", "train.ckpt_every=8",
              "train.sample_every=16"]
    run_unet(full, synth_data, *common)
    losses = [read_metrics(full)[s]["loss"] for s in range(1, 17)]
    assert sum(losses[-4:]) < 0.8 * sum(losses[:4]), losses
    # The in-training sample grid: 4 images of 32 px at scale 4, two columns at least.
    import numpy as np
    from PIL import Image
    grid = Image.open(os.path.join(full, "samples", "step_00000016.png"))
    assert grid.size[0] >= 2 * 32 * 4 and grid.size[1] >= 32 * 4
    out = str(tmp_path / "samples")
    proc = run_module("pipelines.text2image.sample", "--run", full, "--prompt", "a red circle", "--num", "2",
                      "--out", out, "--steps", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    index = [json.loads(line) for line in open(os.path.join(out, "index.jsonl"))]
    images = [torch.from_numpy(np.array(Image.open(os.path.join(out, r["file"])))) for r in index]
    assert [tuple(i.shape) for i in images] == [(32, 32, 3)] * 2
    assert not torch.equal(images[0], images[1]) and images[0].float().std() > 1.0  # seeds differ, not blank

    # Killed after step 10 (newest checkpoint: step 8), resumed: steps 9-16 as uninterrupted.
    run_unet(killed, synth_data, *common, "train.stop_after=10")
    assert open(os.path.join(killed, "checkpoints", "latest")).read().strip() == "step_00000008"
    run_unet(killed, synth_data, *common, "run.resume=auto")
    a, b = read_metrics(full), read_metrics(killed)
    for step in range(9, 17):
        assert a[step]["loss"] == b[step]["loss"] and a[step]["grad_norm"] == b[step]["grad_norm"], step


@pytest.mark.slow
def test_refused_layout_is_one_line_at_the_command_line(synth_data, tmp_path):
    proc = run_unet(str(tmp_path / "run"), synth_data, "parallel.pp=2", check=False)
    err = proc.stderr.strip()
    assert proc.returncode == 2 and "Traceback" not in err and err.count("\n") == 0, err[-3000:]
    assert err.startswith("error: parallel.pp=2 is not supported for text2image with model.arch=unet: pipeline "
                          "stages are not built for the UNet"), err


# Data parallelism equals one process: 5 steps, global batch 8, EMA on (its weights compared too),
# the yaml's LR warmup as in tests/test_parallel_grid.py. (With a 2-step warmup, lr 1e-3 at step 1,
# a few weights of conv1 in the zero-initialised residual branches, whose gradients are near
# AdamW's eps, end up to ~1e-5 apart: fp32 reduction-order noise amplified by m / (sqrt(v) + eps).)
STEPS = 5
EQUIV = [f"train.steps={STEPS}", "train.log_every=1", "train.ckpt_every=100", "train.sample_every=0", "sample.num=0",
         "train.ema_decay=0.9"]
LAYOUTS = {
    "ddp": ["data.micro_batch_size=4", "parallel.dp_mode=ddp"],
    "fsdp": ["data.micro_batch_size=4", "parallel.dp_mode=fsdp"],
    "fsdp-zero2-ac-full": ["data.micro_batch_size=4", "parallel.dp_mode=fsdp", "parallel.reshard_after_forward=false",
                           "parallel.activation_checkpoint=full"],
}


@pytest.fixture(scope="module")
def single_unet_run(synth_data, tmp_path_factory):
    return shared_once(tmp_path_factory, "unet-single", lambda run: run_unet(
        run, synth_data, *EQUIV, "data.micro_batch_size=8"))


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_data_parallel_matches_single_process(single_unet_run, synth_data, tmp_path, layout):
    from pipelines.text2image.spec import SPEC
    run = str(tmp_path / "run")
    run_unet(run, synth_data, *EQUIV, *LAYOUTS[layout], nproc=2)
    assert_same_training(single_unet_run, run, range(1, STEPS + 1))
    assert_same_final_weights(SPEC, single_unet_run, run, STEPS)
    w, ema = final_weights(SPEC, single_unet_run, STEPS), final_weights(SPEC, single_unet_run, STEPS, True)
    assert max((w[n] - ema[n]).abs().max().item() for n in w) > 1e-5  # EMA compared apart from the weights
