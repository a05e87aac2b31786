"""vlm data: shard sample -> (token ids, loss mask, tiles), and micro-batches of packed rows.

Images become tiles of the vision tower's input size (dynamic resolution): an image no larger
than one tile is one tile; a larger one is a thumbnail (the whole image resized to one tile) plus
up to `max_tiles` tiles of the image resized to the grid of tiles that best keeps its aspect ratio.
Each tile is a fixed number of image tokens in the conversation, at the image marker.

Bad samples raise ValueError in the decoder, which the loader counts as corrupt and replaces by
another sample of the micro-batch (nothing stops mid-run): an image missing from the sample, a
conversation without an assistant turn, an unknown role, a sample longer than packing.row_len.
"""
from __future__ import annotations

import io
import json
import math

import numpy as np
import torch
from open_clip.constants import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD
from PIL import Image

from common.data.chat import ChatTokenizer
from common.data.images import IMAGE_EXTS
from common.data.packing import IGNORE_INDEX, pack_samples, pad_batch



def tile_grid(width: int, height: int, tile: int, max_tiles: int) -> tuple[int, int]:
    """(columns, rows) of tiles for an image: (0, 0) when it fits one tile (no extra tiles),
    else the grid with at most max_tiles tiles whose aspect ratio is closest to the image's
    (ties: more tiles, then more columns) and no larger than the image needs."""
    if max_tiles < 1 or (width <= tile and height <= tile):
        return 0, 0
    want_c, want_r = math.ceil(width / tile), math.ceil(height / tile)
    aspect = width / height
    best = None
    for r in range(1, max_tiles + 1):
        for c in range(1, max_tiles // r + 1):
            if c * r < 2 or c > want_c or r > want_r:
                continue
            key = (abs(math.log(c / r / aspect)), -c * r, -c)
            if best is None or key < best[0]:
                best = (key, (c, r))
    return best[1] if best else (0, 0)


def tile_count(width: int, height: int, tile: int, max_tiles: int) -> int:
    c, r = tile_grid(width, height, tile, max_tiles)
    return 1 + c * r


def _normalise(img: Image.Image) -> torch.Tensor:
    x = torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0).permute(2, 0, 1)
    mean = torch.tensor(OPENAI_DATASET_MEAN).view(3, 1, 1)  # what the CLIP stage trained with
    std = torch.tensor(OPENAI_DATASET_STD).view(3, 1, 1)
    return (x - mean) / std


def image_tiles(img: Image.Image, tile: int, max_tiles: int) -> torch.Tensor:
    """(1 + c * r, 3, tile, tile): the thumbnail first, then the grid tiles in row-major order."""
    img = img.convert("RGB")
    thumb = img if img.size == (tile, tile) else img.resize((tile, tile), Image.BICUBIC)
    out = [_normalise(thumb)]
    c, r = tile_grid(*img.size, tile, max_tiles)
    if c:
        big = img.resize((c * tile, r * tile), Image.BICUBIC)
        for j in range(r):
            for i in range(c):
                out.append(_normalise(big.crop((i * tile, j * tile, (i + 1) * tile, (j + 1) * tile))))
    return torch.stack(out)


def _images(sample: dict, n: int) -> list[Image.Image]:
    def get(stem: str):
        for e in IMAGE_EXTS:
            key = f"{stem}.{e}" if stem else e
            if key in sample:
                img = Image.open(io.BytesIO(sample[key]))
                img.load()
                return img
        return None
    if n == 1:
        img = get("") or get("0")
        if img is None:
            raise ValueError("the conversation has an image marker but the sample holds no image")
        return [img]
    imgs = [get(str(k)) for k in range(n)]
    missing = [k for k, im in enumerate(imgs) if im is None]
    if missing:
        raise ValueError(f"image(s) {missing} of {n} missing from the sample")
    return imgs


class VLMDecoder:
    """Picklable shard-sample decoder. task: "caption" (align: user asks `caption_prompt`, the
    assistant answers the sample's txt caption) or "chat" (the json turns; a sample without turns
    falls back to its caption)."""

    def __init__(self, tokenizer: ChatTokenizer, *, tile: int, max_tiles: int, tokens_per_tile: int,
                 row_len: int, task: str = "chat", caption_prompt: str = "Describe the image."):
        self.tok, self.tile, self.max_tiles = tokenizer, tile, max_tiles
        self.tokens_per_tile, self.row_len, self.task, self.caption_prompt = tokens_per_tile, row_len, task, caption_prompt

    def _turns(self, sample: dict, meta: dict) -> list[dict]:
        caption = sample["txt"].decode("utf-8").strip() if "txt" in sample else meta.get("caption")
        if self.task == "chat" and meta.get("turns"):
            return meta["turns"]
        if not caption:
            raise ValueError("the sample has neither conversation turns nor a caption")
        return [{"role": "user", "content": f"<image>\n{self.caption_prompt}"},
                {"role": "assistant", "content": caption}]

    def __call__(self, sample: dict) -> dict:
        meta = json.loads(sample["json"]) if "json" in sample else {}
        turns = self._turns(sample, meta)
        n_images = sum(t.get("content", "").count("<image>") for t in turns if isinstance(t, dict)
                       and isinstance(t.get("content"), str))
        declared = meta.get("images") if isinstance(meta.get("images"), int) else 0
        if n_images == 0 and declared:
            # Images without markers (make_shards keeps the rows' text as given): they go before the
            # first user turn's text, LLaVA's convention.
            first = next((i for i, t in enumerate(turns) if isinstance(t, dict) and t.get("role") == "user"), None)
            if first is not None and isinstance(turns[first].get("content"), str):
                turns = [dict(t) for t in turns]
                turns[first]["content"] = "<image>\n" * declared + turns[first]["content"]
                n_images = declared
        tiles = [image_tiles(im, self.tile, self.max_tiles) for im in _images(sample, n_images)] if n_images else []
        enc = self.tok.encode_conversation(turns, [len(t) * self.tokens_per_tile for t in tiles])
        if len(enc.ids) > self.row_len:
            raise ValueError(f"sample of {len(enc.ids)} tokens is longer than packing.row_len={self.row_len}")
        tiles_t = torch.cat(tiles) if tiles else torch.zeros(0, 3, self.tile, self.tile)
        return {"ids": torch.tensor(enc.ids, dtype=torch.long), "loss_mask": torch.tensor(enc.loss_mask),
                "tiles": tiles_t}


class PackCollate:
    """Decoded samples -> one micro-batch of rows (picklable, runs in the loader workers):
    tokens, targets, positions (R, L); tiles (R, K, 3, S, S) with tile_mask (R, K), each row's
    tiles in the order of its image placeholders; counts for logging. rows > 0 fixes R (samples
    that do not fit are dropped and counted in `dropped`); tiles_per_row > 0 fixes K (pipeline
    parallelism concatenates micro-batches, so their shapes must agree)."""

    def __init__(self, row_len: int, pad_id: int, packed: bool = True, rows: int = 0, tiles_per_row: int = 0):
        self.row_len, self.pad_id, self.packed, self.rows = row_len, pad_id, packed, rows
        self.tiles_per_row = tiles_per_row

    def __call__(self, samples: list[dict]) -> dict:
        pairs = [(s["ids"], s["loss_mask"]) for s in samples]
        batch = (pack_samples(pairs, self.row_len, pad_id=self.pad_id) if self.packed
                 else pad_batch(pairs, self.row_len, pad_id=self.pad_id))
        tokens, targets, positions, index = batch.tokens, batch.targets, batch.positions, batch.sample_index
        if self.packed:
            # A row's padding tail is one segment: positions run 0.. through it, so the model's
            # segments (restarts at 0) are exactly the packer's cu_seqlens.
            for r in range(tokens.shape[0]):
                pad = (index[r] < 0).nonzero()
                if pad.numel():
                    start = int(pad[0])
                    positions[r, start:] = torch.arange(tokens.shape[1] - start)
        dropped = batch.num_skipped
        if self.rows:
            if tokens.shape[0] > self.rows:
                keep = self.rows
                dropped += len(set(index[keep:].flatten().tolist()) - {-1})
                tokens, targets, positions, index = tokens[:keep], targets[:keep], positions[:keep], index[:keep]
            extra = self.rows - tokens.shape[0]
            if extra:
                L = tokens.shape[1] or self.row_len
                tokens = torch.cat([tokens, torch.full((extra, L), self.pad_id, dtype=torch.long)])
                targets = torch.cat([targets, torch.full((extra, L), IGNORE_INDEX, dtype=torch.long)])
                positions = torch.cat([positions, torch.arange(L).expand(extra, L)])
                index = torch.cat([index, torch.full((extra, L), -1, dtype=torch.long)])
        row_tiles = []
        for r in range(tokens.shape[0]):
            order = []
            for i in index[r].tolist():
                if i >= 0 and (not order or order[-1] != i):
                    order.append(i)
            row_tiles.append([samples[i]["tiles"] for i in order if samples[i]["tiles"].shape[0]])
        k = max((sum(t.shape[0] for t in ts) for ts in row_tiles), default=0)
        if self.tiles_per_row:
            if k > self.tiles_per_row:
                raise ValueError(f"a row holds {k} tiles, more than tiles_per_row={self.tiles_per_row}")
            k = self.tiles_per_row
        shape = samples[0]["tiles"].shape[1:]
        tiles = torch.zeros((tokens.shape[0], k, *shape))
        tile_mask = torch.zeros((tokens.shape[0], k), dtype=torch.bool)
        for r, ts in enumerate(row_tiles):
            if ts:
                t = torch.cat(ts)
                tiles[r, :len(t)] = t
                tile_mask[r, :len(t)] = True
        n_loss = int((targets != IGNORE_INDEX).sum())
        return {"tokens": tokens, "targets": targets, "positions": positions, "tiles": tiles,
                "tile_mask": tile_mask, "num_tokens": int((index >= 0).sum()), "num_loss_tokens": n_loss,
                "dropped": dropped, "num_rows": tokens.shape[0]}
