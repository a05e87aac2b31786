"""Builds the pieces of a text23d run from its config: the stage's model (PointDiT or ShapeVAE),
the frozen text tower, the frozen VAE codec of the latent stage, the step functions, the sampler
and the PLY / turntable writers. spec.py hands them to the shared entrypoints."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from common.checkpoint import load_for_inference
from common.config import ConfigError, from_yaml_file
from common.data.captions import first_examples
from common.data.pointclouds import write_ply, write_turntable
from common.diffusion import noise as dnoise
from common.diffusion import text_conditioned as tc
from common.geometry import BOUNDS, grid_points, marching_cubes
from common.nn.text_encoder import build_text_encoder, text_signature
from pipelines.text23d.config import T3DConfig
from pipelines.text23d.data import ShapeDecoder, from_model_space, to_model_space
from pipelines.text23d.model import PointDiT, ShapeVAE, ShapeVAEConfig, point_dit_config

PIPELINE = "text23d"
SAMPLE_POINTS = 2048  # points sampled from a decoded mesh (eval and previews)


def vae_config(cfg: T3DConfig) -> ShapeVAEConfig:
    v = cfg.vae
    return ShapeVAEConfig(width=v.width, heads=v.heads, latents=v.latents, latent_dim=v.latent_dim,
                          enc_layers=v.enc_layers, dec_layers=v.dec_layers, fourier_freqs=v.fourier_freqs)


class LatentCodec(nn.Module):
    """A trained ShapeVAE, frozen, with the scale that makes its latents ~unit variance for the flow.
    Saved with the latent run's checkpoints (the scale as a buffer)."""

    def __init__(self, vae: ShapeVAE):
        super().__init__()
        self.vae = vae.eval().requires_grad_(False)
        self.register_buffer("scale", torch.ones(()))

    @torch.no_grad()
    def encode(self, surface: torch.Tensor) -> torch.Tensor:
        """Model-space surface points (B, S, 6) -> flow-space latents (B, M, d): the posterior mean
        (deterministic, as the video pipeline's VAE latents), scaled."""
        return self.vae.encode(surface)[0] / self.scale

    @torch.no_grad()
    def shapes(self, latents: torch.Tensor, resolution: int) -> list[dict]:
        """Flow-space latents (B, M, d) -> one decoded shape per latent set (see decode_shape)."""
        out = []
        for z in latents * self.scale:
            latent_set = self.vae.latents(z[None])
            out.append(decode_shape(lambda q: self.vae.query(latent_set, q[None])[0], resolution))
        return out


@torch.no_grad()
def decode_shape(field, resolution: int, chunk: int = 32768) -> dict:
    """field(model-space xyz (Q, 3)) -> (Q, 4) occupancy logit + rgb in [-1, 1]: marching cubes on a
    resolution^3 grid over BOUNDS, colours read at the vertices. Returns {"points": (SAMPLE_POINTS, 6)
    float32 xyz + rgb sampled on the surface (empty when the field has no surface), "mesh":
    (vertices, faces, vertex rgb) or None}."""
    import trimesh
    grid = to_model_space(torch.from_numpy(grid_points(resolution, BOUNDS)))
    logits = torch.cat([field(grid[i:i + chunk])[:, 0] for i in range(0, len(grid), chunk)])
    verts, faces = marching_cubes(logits.reshape((resolution,) * 3).cpu().numpy(), level=0.0, bounds=BOUNDS)
    if len(faces) == 0:
        return {"points": np.zeros((0, 6), np.float32), "mesh": None}
    rgb = field(to_model_space(torch.from_numpy(verts).float()))[:, 1:]
    colours = ((rgb.float().cpu().numpy() + 1.0) / 2.0).clip(0.0, 1.0).astype(np.float32)
    mesh = trimesh.Trimesh(verts, faces, process=False)
    pts, face_idx = trimesh.sample.sample_surface(mesh, SAMPLE_POINTS, seed=0)
    cloud = np.concatenate([pts, colours[faces[face_idx]].mean(1)], 1).astype(np.float32)
    return {"points": cloud, "mesh": (verts.astype(np.float32), faces, colours)}


@torch.no_grad()
def reconstruct(vae: nn.Module, surfaces: torch.Tensor, resolution: int) -> list[dict]:
    """A ShapeVAE's reconstructions (posterior means) of scene-space surface clouds (B, S, 6). Only
    the module's forward is called, so an FSDP-sharded VAE works (every rank must call it)."""
    device = next(vae.parameters()).device
    out = []
    for surface in to_model_space(surfaces.to(device)):
        out.append(decode_shape(lambda q: vae(surface[None], q[None].to(device))[0][0], resolution))
    return out


@dataclass
class Components:
    cfg: Any
    model: nn.Module                      # PointDiT (points, latent) or ShapeVAE (vae)
    text_encoder: nn.Module | None        # frozen caption tower (not used by the vae stage)
    objective: Any                        # RectifiedFlow (flow stages) or None
    codec: LatentCodec | None = None      # latent stage: the frozen VAE

    @property
    def frozen(self) -> dict:
        out = {"text_encoder": self.text_encoder} if self.text_encoder is not None else {}
        return out | ({"codec": self.codec} if self.codec is not None else {})

    def to(self, device) -> None:
        for m in (self.model, self.text_encoder, self.codec):
            if m is not None:
                m.to(device)

    @property
    def num_tokens(self) -> int:
        return self.model.cfg.num_points


# --------------------------------------------------------------------------- build
def _seeded(seed: int, salt: int, make):
    # Models seeded apart from the global RNG: every rank, every resume and sample.py rebuild the same init.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(dnoise.mix_seed(seed, salt))
        return make()


def load_vae_run(run_dir: str) -> tuple[T3DConfig, ShapeVAE]:
    """The config and the weights (EMA when it kept one) of a trained stage=vae run."""
    path = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(path):
        raise ConfigError(f"vae.run={run_dir!r} is not a run directory (no config.yaml)")
    vcfg = from_yaml_file(T3DConfig, path)
    if vcfg.stage != "vae":
        raise ConfigError(f"vae.run={run_dir!r} is a stage={vcfg.stage} run; it must be a stage=vae run")
    comp = build(vcfg)
    load_for_inference(os.path.join(run_dir, "checkpoints"), comp.model, comp.frozen, signature(comp),
                       use_ema=vcfg.train.ema_decay > 0)
    return vcfg, comp.model


def first_shapes(shards: str, n: int, surface_points: int) -> list[dict]:
    """The first n decodable samples of some shards (shard order), each ShapeDecoder's output;
    corrupt ones are skipped as in training."""
    from common.data.shards import iter_samples
    decode, out = ShapeDecoder(surface_points), []
    for s in iter_samples(shards):
        if len(out) == n:
            break
        try:
            out.append(decode(s))
        except ValueError:
            continue
    return out


def measure_latent_scale(comp: Components) -> None:
    """Latent stage, before training (spec.init): the codec's scale = vae.latent_scale, or the std
    of the posterior means of the first 512 training shapes. Sampling and eval skip this: the
    checkpoint restores the scale with the codec."""
    cfg = comp.cfg
    if comp.codec is None:
        return
    scale = cfg.vae.latent_scale
    if not scale:
        surfaces = [d["points"] for d in first_shapes(cfg.data.train_shards, 512, cfg.vae.surface_points)]
        means = torch.cat([comp.codec.vae.encode(to_model_space(torch.stack(surfaces[i:i + 64])))[0]
                           for i in range(0, len(surfaces), 64)])
        scale = float(means.std())
    with torch.no_grad():
        comp.codec.scale.fill_(scale)


def build(cfg: T3DConfig) -> Components:
    seed = cfg.run.seed
    if cfg.stage == "vae":
        return Components(cfg, _seeded(seed, 301, lambda: ShapeVAE(vae_config(cfg))), None, None)
    text = build_text_encoder(cfg.text, seed)
    objective = tc.objective_from_config(cfg.diffusion)
    common = dict(text_dim=cfg.text.width, text_len=cfg.text.context_length, **cfg.model.size_overrides())
    if cfg.stage == "points":
        geometry = {"num_points": cfg.model.points} if cfg.model.points else {}
        model = _seeded(seed, 302, lambda: PointDiT(point_dit_config(cfg.model.preset, in_channels=6, **geometry,
                                                                     **common)))
        return Components(cfg, model, text, objective)
    vcfg, vae = load_vae_run(cfg.vae.run)
    codec = LatentCodec(vae)  # its scale: measure_latent_scale before training, the checkpoint after
    # The VAE's architecture and inputs are the vae run's: recorded in this run's config.yaml too.
    cfg.vae = dataclasses.replace(vcfg.vae, run=cfg.vae.run, latent_scale=cfg.vae.latent_scale,
                                  mesh_resolution=cfg.vae.mesh_resolution)
    model = _seeded(seed, 303, lambda: PointDiT(point_dit_config(
        cfg.model.preset, num_points=vcfg.vae.latents, in_channels=vcfg.vae.latent_dim, **common)))
    return Components(cfg, model, text, objective, codec)


def signature(comp: Components) -> dict:
    """What must match for a checkpoint to load into this run (checked before any tensor is read)."""
    cfg = comp.cfg
    out = {"pipeline": PIPELINE, "stage": cfg.stage, "model": dataclasses.asdict(comp.model.cfg)}
    if comp.text_encoder is not None:
        out["text"] = text_signature(cfg.text)
    if cfg.stage == "vae":
        out["inputs"] = [cfg.vae.surface_points, cfg.vae.queries]
    return out


def decoder(comp: Components) -> ShapeDecoder:
    cfg = comp.cfg
    if cfg.data.buckets:
        raise ConfigError("data.buckets: text23d trains on fixed-size point sets; buckets are for images and videos")
    if cfg.stage == "points":
        return ShapeDecoder(comp.num_tokens)
    return ShapeDecoder(cfg.vae.surface_points, cfg.vae.queries if cfg.stage == "vae" else 0)


# --------------------------------------------------------------------------- training step
def make_step_fns(comp: Components, device):
    """(prepare, criterion) for the Trainer."""
    cfg = comp.cfg
    if cfg.stage == "vae":
        return _vae_step_fns(comp, device)
    if cfg.stage == "points":
        def encode(batch):
            return to_model_space(batch["points"].to(device))
    else:
        def encode(batch):
            return comp.codec.encode(to_model_space(batch["points"].to(device)))
    return tc.diffusion_step_fns(encode=encode, tokens_of=lambda x0: x0.shape[1], text_encoder=comp.text_encoder,
                                 objective=comp.objective, run_seed=cfg.run.seed,
                                 cfg_dropout=cfg.diffusion.cfg_dropout, device=device)


def _vae_step_fns(comp: Components, device):
    cfg = comp.cfg
    latent_shape = (cfg.vae.latents, cfg.vae.latent_dim)

    @torch.no_grad()
    def prepare(batch):
        seeds = dnoise.sample_seeds(cfg.run.seed, batch["__position__"])
        occ = batch["occ"].to(device)
        eps = dnoise.per_sample_randn(seeds, latent_shape, dnoise.SALT_NOISE, device=device)
        inputs = (to_model_space(batch["points"].to(device)), to_model_space(occ[..., :3]), eps)
        return inputs, (occ[..., 3], occ[..., 4:7] * 2.0 - 1.0)

    def criterion(pred, target):
        (out, kl), (inside, rgb) = pred, target
        occupancy = F.binary_cross_entropy_with_logits(out[..., 0].float(), inside.float())
        colour = (out[..., 1:].float() - rgb.float()).pow(2).mean()
        return occupancy + cfg.vae.colour_weight * colour + cfg.vae.kl_weight * kl.float().mean()

    return prepare, criterion


def flops(comp: Components, inputs: tuple) -> float:
    """Forward FLOPs of a prepared micro-batch."""
    if comp.cfg.stage == "vae":
        surface, queries, _ = inputs
        return comp.model.flops_per_sample(surface.shape[1], queries.shape[1]) * len(surface)
    return comp.model.flops_per_sample() * len(inputs[0])


def describe(comp: Components) -> str:
    cfg = comp.cfg
    if cfg.stage == "vae":
        return (f"stage vae: ShapeVAE, {cfg.vae.surface_points} surface points -> {cfg.vae.latents} x "
                f"{cfg.vae.latent_dim} latents, {cfg.vae.queries} queries/shape")
    what = "points (xyz + rgb)" if cfg.stage == "points" else f"latents of {cfg.vae.run} (scale {float(comp.codec.scale):.3g})"
    return f"stage {cfg.stage}: PointDiT, {comp.num_tokens} {what}/sample"


# --------------------------------------------------------------------------- sampling
@torch.no_grad()
def generate(comp: Components, model: nn.Module, prompts: list[str], seeds: list[int], *, steps: int,
             guidance: float, device=torch.device("cpu"), batch_size: int = 32) -> list[dict]:
    """One {"points": (N, 6) float32 xyz + rgb, "mesh": (vertices, faces, vertex rgb) or None} per
    prompt; sample i depends only on (prompts[i], seeds[i])."""
    if comp.cfg.stage == "vae":
        raise ConfigError("a stage=vae run generates nothing from text; eval.py reports its reconstructions")
    shape = (comp.num_tokens, model.cfg.in_channels)
    out = tc.generate(model, comp.text_encoder, comp.objective, prompts, seeds, shape=shape,
                      num_tokens=comp.num_tokens, steps=steps, guidance=guidance, device=device,
                      batch_size=batch_size)
    if comp.cfg.stage == "points":
        return [{"points": from_model_space(x).numpy(), "mesh": None} for chunk in out for x in chunk]
    return [s for chunk in out for s in comp.codec.shapes(chunk.to(device), comp.cfg.vae.mesh_resolution)]


def write_grid(media: list[dict], stem: str, comp: Components, options: dict) -> list[str]:
    return write_turntable([m["points"] for m in media], stem)


def write_item(item: dict, stem: str, comp: Components, options: dict) -> tuple[dict, dict]:
    name = os.path.basename(stem)
    write_ply(stem + ".ply", item["points"][:, :3], item["points"][:, 3:])
    files, extra = {"file": name + ".ply"}, {"points": len(item["points"])}
    if item["mesh"] is not None:
        verts, faces, colours = item["mesh"]
        write_ply(stem + "_mesh.ply", verts, colours, faces)
        files["mesh"] = name + "_mesh.ply"
        extra["faces"] = len(faces)
    return files, extra


def sample_hook(comp: Components, model: nn.Module, step: int, info) -> None:
    """In-training samples: turntables of the first held-out captions (flow stages) or of the VAE's
    reconstructions of the first held-out shapes (vae stage), in samples/step_N.{png,gif,txt}."""
    cfg = comp.cfg
    if not cfg.data.eval_shards or not cfg.sample.num:
        return
    if cfg.stage == "vae":
        heldout = first_shapes(cfg.data.eval_shards, cfg.sample.num, cfg.vae.surface_points)
        shapes, captions = [d["points"] for d in heldout], [d["caption"] for d in heldout]
        was_training = model.training
        model.eval()
        media = reconstruct(model, torch.stack(shapes), cfg.vae.mesh_resolution)
        model.train(was_training)
    else:
        captions = [c for c, _ in first_examples(cfg.data.eval_shards, cfg.sample.num)]
        media = generate(comp, model, captions, [cfg.sample.seed + i for i in range(len(captions))],
                         steps=cfg.sample.steps, guidance=cfg.sample.cfg, device=info.device)
    if info.is_main:
        stem = os.path.join(cfg.run.dir, "samples", f"step_{step:08d}")
        os.makedirs(os.path.dirname(stem), exist_ok=True)
        write_grid(media, stem, comp, {})
        with open(stem + ".txt", "w") as f:
            f.write("\n".join(captions) + "\n")
