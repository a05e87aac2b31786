"""The text2video run configuration: the shared sections from common.config plus this pipeline's.

The text tower section is the shared one (common.config.TextConfig); the diffusion section is
rectified flow only; the model, video, vae and sample sections are video specific. Training runs
in pixel space (vae.path empty) or in the latent space of a frozen diffusers video VAE (vae.path
set; see pipelines/text2video/vae.py): model.frames / image_size / image_width then give the PIXEL clip
the loader decodes, and the VideoDiT sees the VAE's latent shape.
"""
from __future__ import annotations

from dataclasses import dataclass

from common.config import ConfigError, ModelSizeConfig, SampleConfig, TextDiffusionSections, doc


@dataclass
class ModelConfig(ModelSizeConfig):
    frames: int = doc(8, "PIXEL frames per training clip (with vae.path and a causal video VAE: 1 + k * its "
                         "temporal factor, e.g. 5, 9, 17, ... 129 for 4x, giving 1 + k latent frames)")
    image_size: int = doc(32, "PIXEL frame height (with vae.path: divisible by the VAE's spatial factor; the model "
                              "sees image_size / factor latents)")
    image_width: int = doc(0, "PIXEL frame width (0: image_size, square frames)")
    temporal_patch: int = doc(0, "temporal patch size (0: preset)")
    attention: str = doc("full", "full (all T*H*W tokens; context parallel capable) | factorized (spatial / "
                                 "temporal blocks alternating; one device only)")
    abs_pos: str = doc("spatial", "absolute position table added to the tokens: spatial (2-D sin-cos per frame; "
                                  "time only through RoPE) | 3d (sin-cos over t, h, w: tokens know their frame "
                                  "index) | none (RoPE only)")
    in_channels: int = doc(3, "model input channels: 3 = RGB pixel space; with vae.path the VAE's latent "
                              "channels are used (a value other than 3 is then checked against them, e.g. 16)")


@dataclass
class VideoDataConfig:
    source: str = doc("auto", "auto: npy frames when a sample has them, else mp4 | mp4 | npy")
    images: bool = doc(True, "decode png/jpg samples as one-frame videos (joint image-video training needs "
                             "data.buckets with a [1, h, w] bucket)")


@dataclass
class VideoVaeConfig:
    path: str = doc("", "local diffusers VAE folder (save_pretrained layout); empty: train in pixel space. Checked "
                        "when the run is built, not when the config is parsed")
    kind: str = doc("auto", "auto (the folder's config.json _class_name) | wan (AutoencoderKLWan) | cogvideox "
                            "(AutoencoderKLCogVideoX) | image (AutoencoderKL, applied frame by frame)")
    scaling_factor: float = doc(0.0, "latent scale (0: the VAE's own normalisation: Wan per-channel "
                                     "(z - latents_mean) / latents_std, others (z - shift_factor) * scaling_factor); "
                                     "> 0: this scalar replaces the scale, the shift is kept")


@dataclass
class T2VSampleConfig(SampleConfig):
    num: int = doc(4, "clips in the training-time sample grid (captions from data.eval_shards)")
    fps: float = doc(8.0, "frame rate of written MP4/GIF files")
    scale: int = doc(4, "nearest-neighbour upscale of written videos (tiny clips are 32 px)")


@dataclass
class T2VConfig(TextDiffusionSections):
    sample: T2VSampleConfig = doc(factory=T2VSampleConfig, help="sample videos")
    model: ModelConfig = doc(factory=ModelConfig, help="the VideoDiT")
    video: VideoDataConfig = doc(factory=VideoDataConfig, help="clip decoding")
    vae: VideoVaeConfig = doc(factory=VideoVaeConfig, help="optional latent space (a frozen video VAE)")

    def validate(self) -> None:
        self.check(positive={
            "model.image_size": self.model.image_size, "model.frames": self.model.frames,
            "model.in_channels": self.model.in_channels, "sample.fps": self.sample.fps, "sample.scale": self.sample.scale,
        }, choices={
            "model.preset": (self.model.preset, ("tiny", "S", "B", "XL")),
            "model.attention": (self.model.attention, ("full", "factorized")),
            "model.abs_pos": (self.model.abs_pos, ("spatial", "3d", "none")),
            "video.source": (self.video.source, ("auto", "mp4", "npy")),
            "vae.kind": (self.vae.kind, ("auto", "wan", "cogvideox", "image")),
        })
        if self.vae.scaling_factor < 0:
            raise ConfigError(f"vae.scaling_factor={self.vae.scaling_factor} must be >= 0 (0: the VAE's own)")
        if self.model.image_width < 0:
            raise ConfigError(f"model.image_width={self.model.image_width} must be >= 0")
        for b in self.data.buckets:
            if len(b) != 3:
                raise ConfigError(f"data.buckets: text2video buckets are [frames, height, width], got {list(b)}")
