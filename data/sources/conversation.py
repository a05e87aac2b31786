"""Image conversations (VLM instruction data) for `make_shards conversations`.

Input: a JSONL file, one conversation per line:
    {"image": "a.jpg" | ["a.jpg", "b.jpg"]   (or "images"; paths relative to the JSONL's folder),
     "conversations" | "turns": [{"from" | "role": "human" | "user" | "gpt" | "assistant" | "system",
                                  "value" | "content": "..."}, ...],
     "id": optional}
Sample format:
    __key__  "{line index:09d}"
    jpg      the image, resized like `images` (one image); 0.jpg, 1.jpg, ... (several images)
    json     {"turns": [{"role": "user" | "assistant" | "system", "content": str}], "images": n,
              "image_sources", "original_sizes", "sizes", "id", "source"}
Rows that are not JSON objects, have no image, an unreadable image, no turns, an unknown role, a
non-string content or no user/assistant turn are skipped with the reason.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

from data.sources.common import InputError, Item
from data.sources.image import ImageOpts, process_image

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


def _turns(row: dict) -> list[dict]:
    raw = row.get("conversations", row.get("turns"))
    if not isinstance(raw, list) or not raw:
        raise ValueError("empty or missing turns")
    out = []
    for t in raw:
        if not isinstance(t, dict):
            raise ValueError("turn is not an object")
        role = t.get("from", t.get("role"))
        content = t.get("value", t.get("content"))
        if role not in ROLES:
            raise ValueError(f"bad role {role!r}")
        if not isinstance(content, str):
            raise ValueError("turn content is not a string")
        out.append({"role": ROLES[role], "content": content})
    if not any(t["role"] == "assistant" for t in out) or not any(t["role"] == "user" for t in out):
        raise ValueError("needs a user and an assistant turn")
    return out


def conversation_items(path: str) -> Iterator[Item]:
    if not os.path.isfile(path):
        raise InputError(f"input path {path} does not exist" if not os.path.exists(path)
                         else f"input {path} is not a .jsonl file")  # fmt: skip
    base = os.path.dirname(path)
    with open(path, encoding="utf-8", errors="replace") as f:
        for i, line in enumerate(f):
            where = f"{path}:{i + 1}"
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise ValueError("not an object")
            except ValueError as e:
                yield Item(i, where, error=f"malformed row: {e}")
                continue
            imgs = row.get("image", row.get("images"))
            imgs = [imgs] if isinstance(imgs, str) else imgs
            if not imgs or not isinstance(imgs, list) or not all(isinstance(x, str) and x for x in imgs):
                yield Item(i, where, error="malformed row: no image path")
                continue
            try:
                turns = _turns(row)
            except ValueError as e:
                yield Item(i, where, error=f"malformed row: {e}")
                continue
            paths = [os.path.join(base, x) for x in imgs]
            yield Item(i, where, extra={"images": paths, "turns": turns, "id": row.get("id")})


def process_conversation(item: Item, image_opts: ImageOpts) -> tuple[Item, dict | None]:
    """Resize/re-encode every image like `images`, keep the normalised turns."""
    if item.error:
        return item, None
    paths = item.extra["images"]
    sample = {"__key__": f"{item.index:09d}"}
    orig, sizes = [], []
    for k, p in enumerate(paths):
        sub, smp = process_image(Item(item.index, p, "-"), image_opts)
        if smp is None:
            item.error = f"image {k} ({p}): {sub.error}"
            return item, None
        meta = json.loads(smp["json"])
        orig.append(meta["original_size"])
        sizes.append(meta["size"])
        ext = image_opts.fmt
        sample[ext if len(paths) == 1 else f"{k}.{ext}"] = smp[ext]
    meta = {"turns": item.extra["turns"], "images": len(paths), "image_sources": paths, "original_sizes": orig,
            "sizes": sizes, "id": item.extra.get("id"), "source": item.source}  # fmt: skip
    sample["json"] = json.dumps(meta, sort_keys=True)
    return item, sample


class ConversationWork:
    def __init__(self, opts: ImageOpts):
        self.opts = opts

    def __call__(self, item: Item):
        return process_conversation(item, self.opts)
