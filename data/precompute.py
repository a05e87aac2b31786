"""Precompute VAE latents and/or text-encoder embeddings into new WebDataset shards.

    python -m data.precompute SHARDS --out DIR --vae PATH [--image-size 256] [--text-encoder ...]
    python -m torch.distributed.run --nproc_per_node N -m data.precompute SHARDS --out DIR ...

One output shard per input shard, same relative name, every original member kept (or the image
dropped with --drop-media), plus per sample:

* `latent.npy`   float16 (C, h, w): the VAE posterior *mean* (`encode(x).latent_dist.mean`),
                 UNSCALED (training multiplies by the scaling factor, see
                 pipelines/text2image/components.encode_images). Images go through the training
                 decoder's transform (`ImageDecoder(image_size)`: RGB, shorter side resized,
                 centre crop, [-1, 1]); --image-size 0 keeps the native size.
* `text_emb.npy` float16 (L, W): per-token outputs of the run's frozen text tower (open_clip's,
                 or a Hugging Face folder's with --text-hf-path, SD3's three-encoder stack for an
                 SD3 pipeline folder). Training takes them instead of running the tower when the
                 json's `text_emb.id` (common.nn.text_encoder.text_features_id: the tower's class,
                 weight fingerprint, length, masking) is its own tower's (data.text_features).
* `text_mask.npy` bool (L,): True = real token (SOT/EOT included), as TextEncoder returns it.
* `json`         the original metadata plus `"latent": {"shape", "dtype", "scaling_factor_applied":
                 false, "mode": "mean", "image_size"}` and `"text_emb": {"shape", "dtype", "length",
                 "mask": "text_mask.npy", "config", "id"}`.

Shard i of the (sorted, de-duplicated) input list is handled by rank i % world_size. An output
shard is written to `NAME.tmp` and renamed when complete, so a re-run skips finished shards and
redoes interrupted ones. Samples that cannot be processed (undecodable image, no caption, size not
divisible by the VAE factor) are left out and listed with their reason in the report (JSONL); the
summary line reads `read = N, written = W, skipped = S` with read == written + skipped.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tarfile
import time
from dataclasses import asdict

import numpy as np
import torch
import webdataset as wds
from tqdm import tqdm

IMAGE_EXTS = ("png", "jpg", "jpeg", "webp")
STORE_DTYPE = np.float16


class UsageError(Exception):
    pass


# ------------------------------------------------------------------------------------ shard I/O
def split_member(name: str) -> tuple[str, str]:
    """WebDataset convention: key = path up to the first '.' of the basename, ext = the rest."""
    d, base = os.path.split(name)
    stem, dot, ext = base.partition(".")
    return (os.path.join(d, stem) if d else stem), ext


def read_samples(path: str):
    """Yield (key, {ext: bytes}) in tar order. A read error ends the shard with the exception
    yielded as (None, exc) so the caller can report it."""
    try:
        with tarfile.open(path, "r:*") as tar:
            key, sample = None, {}
            for m in tar:
                if not m.isfile():
                    continue
                k, ext = split_member(m.name)
                if k != key and sample:
                    yield key, sample
                    sample = {}
                key = k
                sample[ext] = tar.extractfile(m).read()
            if sample:
                yield key, sample
    except (tarfile.TarError, OSError, EOFError) as e:
        yield None, e


def _npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


# --------------------------------------------------------------------------------------- models
class Encoders:
    """The VAE and/or text tower plus the per-sample work around them."""

    def __init__(self, a: argparse.Namespace, device: torch.device):
        self.device = device
        self.image_size = a.image_size
        self.vae = self.text = None
        self.factor = 1
        if a.vae:
            if not os.path.isdir(a.vae):
                raise UsageError(f"--vae {a.vae!r} is not a directory (a diffusers AutoencoderKL folder)")
            from diffusers import AutoencoderKL
            self.vae = AutoencoderKL.from_pretrained(a.vae).eval().requires_grad_(False).to(device)
            self.factor = 2 ** (len(self.vae.config.block_out_channels) - 1)
            if a.image_size and a.image_size % self.factor:
                raise UsageError(f"--image-size {a.image_size} is not divisible by the VAE factor {self.factor}")
            from common.data.images import ImageDecoder
            self.decoder = ImageDecoder(a.image_size or 1)
        if a.text_encoder:
            from common.config import ConfigError, TextConfig
            from common.nn.text_encoder import build_text_encoder, text_features_id
            # Built as a training run builds it: a random tower equals the one of a run with
            # run.seed == --seed; a Hugging Face folder (text.hf_path) is the folder's tower,
            # SD3's three-encoder stack for an SD3 pipeline folder.
            cfg = TextConfig(width=a.text_width, layers=a.text_layers, heads=a.text_heads,
                             context_length=a.text_context_length, weights=a.text_weights,
                             layer_scale=a.text_layer_scale, hf_path=a.text_hf_path,
                             hf_padding_mask=not a.text_hf_no_padding_mask, dtype=a.text_dtype)
            if cfg.hf_path and not os.path.isdir(cfg.hf_path):
                raise UsageError(f"--text-hf-path {cfg.hf_path!r} is not a directory")
            try:
                if cfg.hf_path:  # its width is the folder's, whatever --text-width says
                    from common.nn.text_encoder import TEXT_DTYPES, folder_text_encoder
                    self.text = folder_text_encoder(cfg, TEXT_DTYPES[cfg.dtype])
                    cfg.width = self.text.width
                else:
                    self.text = build_text_encoder(cfg, a.seed)
            except ConfigError as e:
                raise UsageError(str(e)) from None
            self.text = self.text.to(device)
            self.text_cfg = {k: v for k, v in asdict(cfg).items() if v != ""}
            self.text_id = text_features_id(self.text)

    def image_tensor(self, raw: bytes) -> torch.Tensor:
        if self.image_size:
            return self.decoder._image(raw)  # exactly the training transform
        from PIL import Image
        with Image.open(io.BytesIO(raw)) as im:
            im.load()
            arr = np.asarray(im.convert("RGB"), dtype=np.uint8).copy()
        x = torch.from_numpy(arr).permute(2, 0, 1).float().div_(127.5).sub_(1.0)
        if x.shape[1] % self.factor or x.shape[2] % self.factor:
            raise ValueError(f"image size {x.shape[2]}x{x.shape[1]} not divisible by the VAE factor "
                             f"{self.factor} (use --image-size)")
        return x

    @torch.no_grad()
    def latents(self, images: list[torch.Tensor]) -> list[np.ndarray]:
        """Posterior means, batched per image shape (native sizes may differ within a batch)."""
        out: list[np.ndarray | None] = [None] * len(images)
        groups: dict[tuple, list[int]] = {}
        for i, x in enumerate(images):
            groups.setdefault(tuple(x.shape), []).append(i)
        for idx in groups.values():
            x = torch.stack([images[i] for i in idx]).to(self.device)
            mean = self.vae.encode(x).latent_dist.mean.float().cpu().numpy()
            for j, i in enumerate(idx):
                out[i] = mean[j].astype(STORE_DTYPE)
        return out

    @torch.no_grad()
    def text_embeddings(self, captions: list[str]) -> tuple[np.ndarray, np.ndarray]:
        tokens, mask = self.text(captions)
        return tokens.float().cpu().numpy().astype(STORE_DTYPE), mask.cpu().numpy().astype(bool)


# ------------------------------------------------------------------------------------ one shard
def process_shard(src: str, dst: str, enc: Encoders, a: argparse.Namespace, report, on_sample=None) -> dict:
    """Write dst (via dst.tmp, renamed at the end); returns {"read", "written", "skipped"}."""
    os.makedirs(os.path.dirname(dst) or ".", exist_ok=True)
    tmp = dst + ".tmp"
    counts = {"read": 0, "written": 0, "skipped": 0}
    pending: list[tuple[str, dict, torch.Tensor | None, str | None]] = []

    def skip(key, reason):
        counts["skipped"] += 1
        report.write(json.dumps({"shard": src, "key": key, "reason": reason}) + "\n")

    def flush(writer):
        if not pending:
            return
        lat = enc.latents([p[2] for p in pending]) if enc.vae is not None else None
        emb = enc.text_embeddings([p[3] for p in pending]) if enc.text is not None else None
        for j, (key, sample, _, _) in enumerate(pending):
            meta = json.loads(sample["json"]) if sample.get("json") else {}
            if lat is not None:
                sample["latent.npy"] = _npy(lat[j])
                meta["latent"] = {"shape": list(lat[j].shape), "dtype": "float16", "scaling_factor_applied": False,
                                  "mode": "mean", "image_size": enc.image_size or None}
                if a.drop_media:
                    for e in IMAGE_EXTS:
                        sample.pop(e, None)
            if emb is not None:
                tokens, mask = emb[0][j], emb[1][j]
                sample["text_emb.npy"] = _npy(tokens)
                sample["text_mask.npy"] = _npy(mask)
                meta["text_emb"] = {"shape": list(tokens.shape), "dtype": "float16", "length": int(mask.sum()),
                                    "mask": "text_mask.npy", "config": enc.text_cfg | {"seed": a.seed},
                                    "id": enc.text_id}
            sample["json"] = json.dumps(meta, sort_keys=True).encode("utf-8")
            writer.write({"__key__": key, **sample})
            counts["written"] += 1
            if on_sample:
                on_sample()
        pending.clear()

    with open(tmp, "wb") as f:
        writer = wds.TarWriter(f, encoder=False, mtime=0.0)
        try:
            for key, sample in read_samples(src):
                if key is None:  # tar read error: the rest of the shard is lost
                    skip(None, f"unreadable shard after {counts['read']} samples: {type(sample).__name__}: {sample}")
                    break
                counts["read"] += 1
                x = caption = None
                try:
                    if enc.vae is not None:
                        raw = next((sample[e] for e in IMAGE_EXTS if e in sample), None)
                        if raw is None:
                            raise ValueError(f"no image (looked for {', '.join(IMAGE_EXTS)})")
                        x = enc.image_tensor(raw)
                    if enc.text is not None:
                        if sample.get("txt") is None:
                            raise ValueError("no txt caption")
                        caption = sample["txt"].decode("utf-8").strip()
                    if sample.get("json"):
                        json.loads(sample["json"])  # bad metadata: skip now, not mid-batch
                except Exception as e:  # any decode failure means this sample is unusable
                    skip(key, f"{type(e).__name__}: {e}")
                    continue
                pending.append((key, sample, x, caption))
                if len(pending) >= a.batch_size:
                    flush(writer)
            flush(writer)
        finally:
            writer.close()
    os.replace(tmp, dst)
    return counts


# ------------------------------------------------------------------------------------ the run
def _dist():
    """(rank, world, initialised_here). A process group (gloo) only when launched by torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        import torch.distributed as dist
        if not dist.is_initialized():
            dist.init_process_group("gloo")
            return dist.get_rank(), dist.get_world_size(), True
        return dist.get_rank(), dist.get_world_size(), False
    return 0, 1, False


def _device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and "LOCAL_RANK" in os.environ:
        return torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    return torch.device(name)


def plan(inputs: list[str], out: str) -> list[tuple[str, str]]:
    """(input, output) pairs; outputs keep the path relative to the inputs' common folder."""
    inputs = sorted(dict.fromkeys(os.path.abspath(p) for p in inputs))
    root = os.path.commonpath([os.path.dirname(p) for p in inputs])
    pairs = [(p, os.path.join(out, os.path.relpath(p, root))) for p in inputs]
    for src, dst in pairs:
        if os.path.abspath(dst) == src:
            raise UsageError(f"--out {out} would overwrite the input shard {src}")
    return pairs


def run(a: argparse.Namespace) -> dict:
    """Process this rank's shards and return the summary (the summed counts on rank 0). Under
    torchrun the gloo group it starts stays up after success (the process exit ends it; see
    __main__) and is destroyed on failure."""
    from common.data.shards import expand_shards
    rank, world, own_pg = _dist()
    try:
        pairs = plan(expand_shards(a.shards), a.out)
        mine = [p for i, p in enumerate(pairs) if i % world == rank]
        enc = Encoders(a, _device(a.device))
        os.makedirs(a.out, exist_ok=True)
        report_path = a.report or os.path.join(a.out, "precompute_report.jsonl")
        part = report_path + (f".rank{rank}" if world > 1 else "")
        s = {"shards": len(mine), "done": 0, "complete_skipped": 0, "read": 0, "written": 0, "skipped": 0}
        t0 = time.perf_counter()
        bar = tqdm(total=len(mine), unit="shard", disable=rank != 0 or a.no_progress,
                   desc=f"rank 0/{world}" if world > 1 else "precompute")
        with open(part, "w") as rep:
            for src, dst in mine:
                if os.path.exists(dst):  # only complete shards ever get the final name
                    s["complete_skipped"] += 1
                    rep.write(json.dumps({"shard": src, "status": "skipped: output complete", "output": dst}) + "\n")
                else:
                    c = process_shard(src, dst, enc, a, rep)
                    for k in ("read", "written", "skipped"):
                        s[k] += c[k]
                    s["done"] += 1
                bar.update(1)
                bar.set_postfix(samples=s["written"], skipped=s["skipped"])
        bar.close()
        s["seconds"] = round(time.perf_counter() - t0, 3)
        if world > 1:  # gather counts, merge the report parts
            import torch.distributed as dist
            every = [None] * world
            dist.all_gather_object(every, s)
            if rank == 0:
                s = {k: sum(e[k] for e in every) if k != "seconds" else max(e[k] for e in every) for k in s}
                with open(report_path, "w") as rep:
                    for r in range(world):
                        p = f"{report_path}.rank{r}"
                        with open(p) as f:
                            rep.write(f.read())
                        os.remove(p)
            dist.barrier()
        s["report"] = report_path
        s["rank"], s["world"] = rank, world
        return s
    except BaseException:
        if own_pg:
            import torch.distributed as dist
            dist.destroy_process_group()
        raise


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m data.precompute",
        description="Run a VAE and/or the text encoder over WebDataset shards and write shards with "
        "latent.npy (unscaled VAE posterior mean, float16), text_emb.npy (float16 (L, W)) and "
        "text_mask.npy (bool (L,)); shapes/dtypes recorded in each sample's json. Resumable; "
        "under torchrun input shard i goes to rank i %% world_size.",
    )
    p.add_argument("shards", nargs="+", help="input shards: folder, brace pattern, glob or files")
    p.add_argument("--out", required=True, help="output folder (one shard per input shard, same name)")
    p.add_argument("--vae", default="", help="diffusers AutoencoderKL folder: write latent.npy")
    p.add_argument("--image-size", type=int, default=256,
                   help="resize + centre-crop to this square size as the training decoder does "
                   "(0: native size, must be divisible by the VAE factor) (default 256)")
    p.add_argument("--drop-media", action="store_true", help="drop the jpg/png/webp members (needs --vae)")
    t = p.add_argument_group("text encoder (as the run's `text` section builds it)")
    t.add_argument("--text-encoder", action="store_true", help="write text_emb.npy and text_mask.npy")
    t.add_argument("--text-width", type=int, default=128)
    t.add_argument("--text-layers", type=int, default=2)
    t.add_argument("--text-heads", type=int, default=4)
    t.add_argument("--text-context-length", type=int, default=32)
    t.add_argument("--text-layer-scale", type=float, default=0.0, help="> 0: LayerScale init (as text.layer_scale)")
    t.add_argument("--text-weights", default="", help="state-dict file; empty: random tower seeded by --seed")
    t.add_argument("--seed", type=int, default=0,
                   help="run.seed of the training run whose random text tower to reproduce (default 0)")
    t.add_argument("--text-hf-path", default="",
                   help="a local Hugging Face CLIP/T5 text encoder folder, or a Stable Diffusion 3 pipeline folder "
                   "(its CLIP-L + CLIP-G + T5 stack), as the run's text.hf_path; its width is the folder's and "
                   "--text-width/--text-layers/--text-heads are unused")
    t.add_argument("--text-dtype", default="fp32", choices=["fp32", "bf16"],
                   help="the tower's weights and compute, as the run's text.dtype (default fp32)")
    t.add_argument("--text-hf-no-padding-mask", action="store_true",
                   help="as text.hf_padding_mask=false: the encoder runs on the padded ids unmasked (SD 1.x/2.x)")
    p.add_argument("--batch-size", type=int, default=32, help="samples per forward pass (default 32)")
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (under torchrun: cuda:LOCAL_RANK)")
    p.add_argument("--report", default=None,
                   help="JSONL of skipped samples/shards (default OUT/precompute_report.jsonl)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    from common.data.shards import DataError
    a = _parser().parse_args(argv)
    if not a.vae and not a.text_encoder:
        print("error: nothing to do: give --vae PATH and/or --text-encoder", file=sys.stderr)
        return 2
    if a.drop_media and not a.vae:
        print("error: --drop-media needs --vae (the media would be lost without latents)", file=sys.stderr)
        return 2
    if a.batch_size < 1 or a.image_size < 0:
        print("error: --batch-size must be >= 1 and --image-size >= 0", file=sys.stderr)
        return 2
    try:
        s = run(a)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except DataError as e:  # bad shard spec
        print(f"error: {e}", file=sys.stderr)
        return 2
    if s["rank"] == 0:
        print(f"shards: {s['done']} done, {s['complete_skipped']} skipped as complete "
              f"(world size {s['world']}); report: {s['report']}")
        print(f"read = {s['read']}, written = {s['written']}, skipped = {s['skipped']}")
    return 0


if __name__ == "__main__":
    code = main()
    if torch.distributed.is_initialized():
        # A finished torchrun rank: its shards and the merged report are on disk and every rank has
        # passed the final barrier. Tearing gloo down from here (destroy_process_group, then the
        # interpreter's exit) has aborted such a rank in C++ ("terminate called without an active
        # exception", SIGABRT), turning a complete run into a failed job, so leave without it.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
