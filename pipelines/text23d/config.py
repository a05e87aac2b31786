"""The text23d run configuration: the shared sections from common.config plus this pipeline's.

One pipeline, three stages (`stage`), each its own run:
  points  stage A: rectified flow on coloured point clouds (xyz + rgb per point)
  vae     stage B, part 1: the vector-set shape autoencoder (occupancy + colour fields)
  latent  stage B, part 2: rectified flow on the latent sets of a trained vae run (vae.run)
"""
from __future__ import annotations

from dataclasses import dataclass

from common.config import ConfigError, TextDiffusionSections, TransformerSizeConfig, doc

STAGES = ("points", "vae", "latent")


@dataclass
class ModelConfig(TransformerSizeConfig):
    points: int = doc(0, "stage points: points per cloud, i.e. tokens (0: the preset's, tiny 256); the shards' "
                         "clouds must hold at least this many. Stage latent: the set is vae.latents")


@dataclass
class VAEConfig:
    run: str = doc("", "stage latent: the vae run directory (its latest checkpoint encodes training shapes and "
                       "decodes samples; its weights are saved, frozen, with the latent run)")
    width: int = doc(128, "transformer width")
    heads: int = doc(4, "attention heads")
    latents: int = doc(64, "latent vectors per shape (farthest-point-sampled queries)")
    latent_dim: int = doc(8, "channels per latent vector")
    enc_layers: int = doc(1, "encoder self-attention blocks after the cross-attention")
    dec_layers: int = doc(3, "decoder self-attention blocks before the query cross-attention")
    fourier_freqs: int = doc(8, "sin/cos octaves of xyz")
    surface_points: int = doc(512, "surface points the encoder reads per shape")
    queries: int = doc(1024, "occupancy queries per shape and step: half near the surface, half uniform")
    kl_weight: float = doc(1e-3, "weight of the KL term")
    colour_weight: float = doc(1.0, "weight of the colour MSE at the queries")
    mesh_resolution: int = doc(40, "grid points per side for marching cubes (meshes of samples and reconstructions)")
    latent_scale: float = doc(0.0, "stage latent: latents are divided by this before the flow (0: their std over "
                                   "the first 512 training shapes, measured at start and saved with checkpoints)")


@dataclass
class T3DConfig(TextDiffusionSections):
    stage: str = doc("points", "points | vae | latent (see the module docstring)")
    model: ModelConfig = doc(factory=ModelConfig, help="the flow transformer (stages points and latent)")
    vae: VAEConfig = doc(factory=VAEConfig, help="the shape autoencoder (stage vae) and its run (stage latent)")

    def validate(self) -> None:
        v = self.vae
        self.check(positive={"vae.width": v.width, "vae.heads": v.heads, "vae.latents": v.latents,
                             "vae.latent_dim": v.latent_dim, "vae.surface_points": v.surface_points,
                             "vae.queries": v.queries, "vae.mesh_resolution": v.mesh_resolution},
                   choices={"stage": (self.stage, STAGES), "model.preset": (self.model.preset, ("tiny", "S", "B", "XL"))})
        if v.width % v.heads:
            raise ConfigError(f"vae.width={v.width} is not divisible by vae.heads={v.heads}")
        if v.latents > v.surface_points:
            raise ConfigError(f"vae.latents={v.latents} must be <= vae.surface_points={v.surface_points} "
                              "(the latent queries are a subset of the surface points)")
        if v.queries % 2:
            raise ConfigError(f"vae.queries={v.queries} must be even (half near the surface, half uniform)")
        if self.model.points < 0:
            raise ConfigError(f"model.points={self.model.points} must be >= 0")
        if self.stage == "latent" and not v.run:
            raise ConfigError("stage=latent needs vae.run: the directory of a trained stage=vae run")
