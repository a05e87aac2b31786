"""Training step and sampling loop shared by the text-conditioned diffusion pipelines.

A pipeline supplies how a batch becomes model-space inputs (`encode`), how many tokens an input
makes (the flow shift depends on it) and, for sampling, the model-space shape and a decoder back
to pixels; everything else (per-sample seeds, caption dropout for CFG, the objective's training
example, guided sampling with one unconditional caption) is the same for images and videos.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .ddpm import DDPM
from .flow import RectifiedFlow, mse_per_sample
from .noise import drop_captions, mix_seed, sample_seeds


def objective_from_config(d):
    """The objective a `diffusion` config section (common.config.DiffusionConfig) names: rectified
    flow, or DDPM where the section has objective=ddpm (with ddpm_schedule, ddpm_prediction)."""
    if getattr(d, "objective", "flow") == "flow":
        return RectifiedFlow(timestep_sampling=d.timesteps, logit_mean=d.logit_mean, logit_std=d.logit_std,
                             shift=d.shift or None, base_shift=d.base_shift, base_tokens=d.base_tokens)
    return DDPM(schedule=d.ddpm_schedule, prediction=d.ddpm_prediction)


class CachedTextFeatures:
    """A frozen text tower's per-caption features, kept across steps (LRU, bounded in bytes).

    The towers are frozen and each caption's features depend on that caption alone (no
    interaction between the rows of a batch), so a repeated caption (a dataset's templates, the
    empty caption of CFG dropout) is encoded once. Captions not seen before go through the tower
    in calls of exactly `encode_batch` captions, the last call padded with empty captions: a
    row's rounding can depend on the batch shape (the GEMMs a shape selects), and the features
    must not depend on how many new captions a step happened to meet, or a resumed run (empty
    cache) would not repeat the uninterrupted one bit for bit. With the shape fixed, a row's
    features are the same whichever captions share its call (tests/test_text_cache.py). One
    call per caption, as before, was 64 tower calls a step on a GPU whenever captions rarely
    repeat, and starved the model. The result equals the tower's batched output to fp32
    rounding. A tower with a trainable parameter is called every time. Datasets whose captions
    rarely repeat gain nothing from the cache: precompute their text features instead
    (python -m data.precompute --text-encoder) and pass each row's stored features (`stored`):
    those rows skip the tower, once the features are checked to come from this very tower
    (text_features_id); they equal its output to float16 rounding."""

    def __init__(self, text_encoder, max_bytes: int = 256 << 20, encode_batch: int = 16):
        if encode_batch < 1:
            raise ValueError(f"encode_batch must be >= 1, got {encode_batch}")
        self.text_encoder, self.max_bytes, self.encode_batch = text_encoder, max_bytes, encode_batch
        self.rows: OrderedDict[str, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self.bytes = 0
        self.hits = self.misses = self.stored = 0
        self._id: str | None = None

    def _frozen(self) -> bool:
        return not any(p.requires_grad for p in self.text_encoder.parameters())

    def __call__(self, captions: list[str], stored: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """stored[i]: (tokens, mask, id) precomputed for captions[i] (common.data.captions.
        precomputed_text_features), or None: that row goes through the tower (or the cache)."""
        if stored is not None and any(s is not None for s in stored):
            return self._with_stored(captions, stored)
        if not self._frozen() or self.max_bytes <= 0:
            return self.text_encoder(captions)
        missing = list(dict.fromkeys(c for c in captions if c not in self.rows))
        self.misses += len(missing)
        self.hits += len(captions) - len(missing)
        n = self.encode_batch
        for i in range(0, len(missing), n):
            chunk = missing[i:i + n]
            ctx, mask = self.text_encoder(chunk + [""] * (n - len(chunk)))
            for j, c in enumerate(chunk):
                # A copy, so that a cached row does not keep its whole call's output alive.
                self.rows[c] = (ctx[j].clone(), mask[j].clone())
                self.bytes += ctx[j].nbytes + mask[j].nbytes
        rows = [self.rows[c] for c in captions]
        for c in captions:
            self.rows.move_to_end(c)
        out = torch.stack([r for r, _ in rows]), torch.stack([m for _, m in rows])
        while self.bytes > self.max_bytes and len(self.rows) > len(set(captions)):
            _, (row, m) = self.rows.popitem(last=False)
            self.bytes -= row.nbytes + m.nbytes
        return out

    def _with_stored(self, captions: list[str], stored: list) -> tuple[torch.Tensor, torch.Tensor]:
        from common.data.shards import DataError
        from common.nn.text_encoder import text_features_id
        if not self._frozen():
            raise DataError("the shards hold precomputed text features, but this run trains its text tower: "
                            "set data.text_features=false")
        if self._id is None:
            self._id = text_features_id(self.text_encoder)
        for s in stored:
            if s is not None and s[2] != self._id:
                raise DataError(f"the shards' precomputed text features were made by another text tower (id "
                                f"{s[2] or 'missing'}, this run's {self._id}): precompute them again with this run's "
                                "text settings, or set data.text_features=false to run the tower")
        rest = [i for i, s in enumerate(stored) if s is None]
        ctx, mask = self([captions[i] for i in rest]) if rest else (None, None)
        device = (ctx if ctx is not None else next(self.text_encoder.parameters())).device
        rows, masks = [None] * len(captions), [None] * len(captions)
        for j, i in enumerate(rest):
            rows[i], masks[i] = ctx[j], mask[j]
        for i, s in enumerate(stored):
            if s is not None:  # float32, as the towers return their features
                rows[i], masks[i] = s[0].to(device), s[1].to(device)
        self.stored += len(captions) - len(rest)
        return torch.stack(rows), torch.stack(masks)


def diffusion_step_fns(*, encode: Callable[[dict], torch.Tensor], tokens_of: Callable[[torch.Tensor], int],
                       text_encoder, objective, run_seed: int, cfg_dropout: float, device):
    """(prepare, criterion) for common.trainer.Trainer. prepare holds everything without
    trainable weights (text tower, VAE, timesteps, noise) and returns the model's inputs
    (x_t, t, context, mask) and the regression target; criterion is the batch-mean MSE.
    A frozen tower's features are cached per caption (CachedTextFeatures)."""
    text_features = CachedTextFeatures(text_encoder)

    @torch.no_grad()
    def prepare(batch):
        seeds = sample_seeds(run_seed, batch["__position__"])
        captions = drop_captions(batch["caption"], seeds, cfg_dropout)
        # A dropped caption's row is the empty caption's features, from the tower (cached).
        stored = [s if c else None for s, c in zip(batch.get("text_features") or [None] * len(captions), captions)]
        context, mask = text_features(captions, stored)
        x0 = encode(batch)
        x_t, t, target = objective.training_example(x0, seeds, num_tokens=tokens_of(x0))
        return (x_t, t, context.to(device), mask.to(device)), target

    def criterion(pred, target):
        return mse_per_sample(pred, target).mean()

    return prepare, criterion


@torch.no_grad()
def generate(model, text_encoder, objective, prompts: list[str], seeds: list[int], *, shape: tuple[int, ...],
             num_tokens: int, steps: int, guidance: float, device, batch_size: int,
             decode: Callable[[torch.Tensor], torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Model-space noise of `shape` per prompt (seeded by seeds[i] alone), sampled with
    classifier-free guidance against the empty caption, decoded by `decode` (e.g. a VAE); one
    tensor per chunk of batch_size prompts, on the CPU. Output i depends only on (prompts[i], seeds[i])."""
    was_training = model.training
    model.eval()
    out = []
    empty_ctx, empty_mask = text_encoder([""])  # the unconditional caption, encoded once
    for i in range(0, len(prompts), batch_size):
        chunk, chunk_seeds = prompts[i:i + batch_size], seeds[i:i + batch_size]
        ctx, mask = text_encoder(chunk)
        uctx, umask = empty_ctx.expand(len(chunk), -1, -1), empty_mask.expand(len(chunk), -1)
        noise = torch.stack([torch.randn(shape, generator=torch.Generator().manual_seed(int(s))) for s in chunk_seeds])

        def model_fn(x, t, cond):
            return model(x, t, cond[0].to(device), cond[1].to(device))

        x = objective.sample(model_fn, noise, cond=(ctx, mask), uncond=(uctx, umask) if guidance != 1.0 else None,
                             guidance=guidance, num_steps=steps, num_tokens=num_tokens, device=device)
        out.append((decode(x) if decode is not None else x).float().cpu())
    model.train(was_training)
    return out


PROBE_TIMES = (0.2, 0.35, 0.5, 0.65, 0.8)


@torch.no_grad()
def caption_errors(model, text_encoder, objective, x0: torch.Tensor, choices: list[list[str]], *, seed: int = 0,
                   times=PROBE_TIMES, noises: int = 4, device=torch.device("cpu"), batch_size: int = 128) -> torch.Tensor:
    """(N, K, len(times)) denoising error of item x0[i] under each of its K candidate captions
    choices[i], averaged over `noises` draws per time. All K captions of an item see the very same
    (time, noise) draws, so the caption is the only thing that differs between them: the argmin
    over K is the model's zero-shot reading of the item (a diffusion classifier, Li et al. 2023).
    It tells whether a word reaches the denoiser, apart from whether the sampler can draw it.
    Times are noise fractions (0 data, 1 noise); the error is the objective's training MSE."""
    n, k = len(x0), len(choices[0])
    if len(choices) != n or any(len(c) != k for c in choices):
        raise ValueError(f"choices: one list of {k} captions per item ({n} items) expected")
    if noises < 1 or not times:
        raise ValueError("caption_errors needs at least one time and one noise")
    was_training = model.training
    model.eval()
    unique = list(dict.fromkeys(c for row in choices for c in row))
    ctx, mask = text_encoder(unique)
    row_of = {c: i for i, c in enumerate(unique)}
    t = torch.tensor(times, dtype=torch.float32).repeat_interleave(noises)  # (D,) draws per item
    out = torch.empty(n, k, len(t))
    for i in range(n):
        eps = torch.randn((len(t), *x0.shape[1:]), generator=torch.Generator().manual_seed(mix_seed(seed, i)))
        x_t, model_t, target = objective.example_at(x0[i:i + 1].cpu().float().expand_as(eps), eps, t)
        rows = torch.tensor([row_of[c] for c in choices[i]]).repeat_interleave(len(t))  # (K * D,) caption major
        draws = torch.arange(len(t)).repeat(k)
        errors = []
        for j in range(0, len(rows), batch_size):
            r, d = rows[j:j + batch_size], draws[j:j + batch_size]
            pred = model(x_t[d].to(device), model_t[d].to(device), ctx[r].to(device), mask[r].to(device))
            errors.append(mse_per_sample(pred, target[d].to(device)).cpu())
        out[i] = torch.cat(errors).view(k, len(t))
    model.train(was_training)
    return out.view(n, k, len(times), noises).mean(3)


def word_probe(model, text_encoder, objective, x0: torch.Tensor, attrs: list[dict], captions: list[str],
               words: dict[str, tuple[list[str], Callable[[dict, str], str]]], *, seed: int = 0,
               times=PROBE_TIMES, noises: int = 4, noun: str = "items") -> tuple[dict, str]:
    """Does each attribute word reach the denoiser? words[word] = (its vocabulary, rewrite(item's
    attributes, another word) -> the item's caption with that word instead of its own). For each
    word, every item is scored under each word of the vocabulary (caption_errors); the figure is
    the share of items whose own word gives the lowest error, overall (errors averaged over times)
    and per probe time. Returns (the figures, a one-line summary)."""
    probe: dict = {"n": len(attrs), "times": list(times), "noises": noises}
    parts = []
    for word, (vocabulary, rewrite) in words.items():
        choices = [[rewrite(a, w) for w in vocabulary] for a in attrs]
        truth = torch.tensor([vocabulary.index(a[word]) for a in attrs])
        for row, i, caption in zip(choices, truth.tolist(), captions):
            if row[i] != caption:  # else the probe would score captions the model was not trained on
                raise ValueError(f"word probe: rewriting {word} to its own value gives {row[i]!r}, not the item's "
                                 f"caption {caption!r}")
        errors = caption_errors(model, text_encoder, objective, x0, choices, seed=seed, times=times, noises=noises)
        per_t = (errors.argmin(1) == truth[:, None]).float().mean(0)
        probe[word] = {"accuracy": float((errors.mean(2).argmin(1) == truth).float().mean()),
                       "chance": 1 / len(vocabulary), "per_time": [round(float(v), 4) for v in per_t]}
        parts.append(f"{word} {probe[word]['accuracy']:.1%} (chance {1 / len(vocabulary):.1%}; per t "
                     + " / ".join(f"{v:.0%}" for v in per_t) + ")")
    line = (f"word probe on {len(attrs)} held-out real {noun} (lowest denoising error among swapped words, t = "
            + "/".join(f"{t:g}" for t in times) + f", {noises} noises each): " + ", ".join(parts))
    return probe, line


def to_uint8(x: torch.Tensor) -> torch.Tensor:
    """[-1, 1] floats -> uint8 with channels moved last ((B, C, ...) -> (B, ..., C))."""
    x = ((x.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return x.permute(0, *range(2, x.dim()), 1).cpu()


@dataclass
class TextDiffusionComponents:
    """What a text-conditioned diffusion run is built from (the `components` of a PipelineSpec)."""
    cfg: Any
    model: torch.nn.Module
    text_encoder: torch.nn.Module
    objective: Any               # RectifiedFlow | DDPM: training_example / loss / sample alike
    vae: Any                     # frozen latent codec with .to(device), or None for pixel space

    @property
    def frozen(self) -> dict:
        """Frozen modules of checkpoints (the VAE is not one: run.vae.path names it; a text tower
        loaded from text.hf_path is fingerprinted, not saved: common.frozen_weights.FrozenModules)."""
        return {"text_encoder": self.text_encoder}

    def to(self, device) -> None:
        for m in (self.model, self.text_encoder, self.vae):
            if m is not None:
                m.to(device)


def text_diffusion_spec(components, **fields):
    """The PipelineSpec of a text-conditioned diffusion pipeline whose `components` module has
    build, make_step_fns, signature(cfg, comp), generate and flops; `fields` give the rest
    (name, config, parallelize, decoder, writers, ...)."""
    from common.pipeline import PipelineSpec
    return PipelineSpec(build=components.build, step_fns=components.make_step_fns,
                        signature=lambda comp: components.signature(comp.cfg, comp),
                        generate=components.generate, flops=components.flops, **fields)
