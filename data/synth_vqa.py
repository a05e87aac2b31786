"""Synthetic visual question answering (VQA) mode of the shapes dataset: VLM data out of the box.

    python -m data.synth --vqa --out DIR [--count N --heldout-count N --size 48]   (or generate_vqa)

Each image shows 1 to 3 shapes, each in its own cell of a 3x3 grid (cells are named like
`data.shapes.POSITIONS`: "top left", "top", ..., "centre", ..., "bottom right"), and comes with 2 to
4 question/answer turns, at most one per type:
    colour    "What colour is the circle in the top left?"   -> "red"
    shape     "What shape is in the centre?"                 -> "star"
    count     "How many red circles are there?"              -> "2"
    position  "Where is the blue square?"                    -> "top left"   (only for a unique kind)
Answers are one vocabulary word, a number or a position name, so eval can score exact match.

Sample layout: the one `make_shards conversations` writes (data/sources/conversation.py), plus a
caption, so the CLIP stage and the caption loader read the same shards:
    __key__  "{split}-{index:08d}"
    png      the image (lossless; conversation shards default to jpg, but jpg would blur the
             thin shapes and shift their colours, and the loader reads both)
    txt      a caption of the whole scene ("two red circles and a blue star on a navy background")
    json     {"turns": [{"role": "user" | "assistant", "content": str}, ...], "images": 1,
              "sizes": [[w, h]], "source": "synth",
              "qa": [{"type", "question", "answer", "objects": [indices into objects]}, ...],
              "objects": [{"shape", "colour", "position", "cell", "cx", "cy", "radius",
                           "colour_rgb", "target"}, ...] (reading order),
              "background", "background_rgb", "target": [colour, shape, count],
              "compositions": [[colour, shape, count] per kind in the scene], "heldout", "caption",
              "caption_style", "caption_template", "image_size", "split", "index", "seed"}
The first user turn starts with IMAGE_MARKER and a newline ("<image>\\nWhat colour ..."): where the
image goes in the token stream, as in LLaVA-style conversation data. Turns alternate user,
assistant, ..., and end with an assistant turn.

Held-out rule. A composition is (colour, shape, count): a kind of shape and how many of that kind
the image shows. It is held out iff
  1. its (shape, colour) pair is in `data.shapes.HELDOUT_COMBOS`, at any count: the pairs the image
     and video modes hold out, so one model trained on every mode has one consistent held-out set; or
  2. it is in HELDOUT_COUNTS: a training pair held out at one count (2 or 3, never 1: single shapes
     of every training pair are in the image mode's train split).
Each image has one target kind (the one its count question asks about); every other kind in it is a
training pair shown once, so every composition of a train image is a train composition, and every
held-out image contains exactly one held-out composition, its target.

Questions. The count question asks about the target and comes last; colour, shape and position
questions ask about a target object when they can, else about another one (`qa[i]["objects"]` and
`objects[j]["target"]` tell eval which). No question states the answer of a later one ("Where is the
red circle?" before "What colour is ... in the top left?"), so every answer has to come from the
image. Each question names its object fully, so eval can also ask each one alone
("<image>\\n" + question).

Output is a pure function of the arguments, as in the other modes (per-sample generators, fixed
PNG settings, tar mtime 0).
"""

from __future__ import annotations

import json
import re

import numpy as np

from data import shapes as S
from data.synth_common import SPLIT_CODE, article, check_at_least, encode_png, reuse_or_generate, write_dataset

VQA_FORMAT_VERSION = 1
_VQA_SPLIT_TAG = 2  # image mode seeds with [seed, split, index], video appends 1: keep VQA apart
IMAGE_MARKER = "<image>"
QUESTION_TYPES = ("colour", "shape", "count", "position")
COUNTS = (1, 2, 3)
GRID = 3
CELLS = list(S.POSITIONS)  # row-major 3x3: cell k is row k // 3, column k % 3
# Radius range, fraction of the side. Three cells across leave each shape a third of the image: at
# the default 48 px a cell is 16 px and a shape 10-12 px wide (data.shapes: a star needs ~9 px).
_R_RANGE = (0.10, 0.125)
_MARGIN_PX = 1.5  # pure background around each shape inside its cell: per-cell analysis reads it
MIN_SIZE = 24  # below this a cell cannot hold the smallest shape plus its margins

# (colour, shape, count): training pairs held out at one count. Each colour once, each shape at
# most twice, counts 2 and 3 four times each; none of the pairs is in S.HELDOUT_COMBOS.
HELDOUT_COUNTS: list[tuple[str, str, int]] = [
    ("red", "circle", 2),
    ("green", "square", 3),
    ("blue", "star", 2),
    ("yellow", "diamond", 3),
    ("magenta", "triangle", 2),
    ("cyan", "cross", 3),
    ("orange", "triangle", 3),
    ("white", "star", 2),
]
HELDOUT_COMPOSITIONS: list[tuple[str, str, int]] = [
    (c, s, n) for s, c in S.HELDOUT_COMBOS for n in COUNTS
] + HELDOUT_COUNTS
_HELDOUT = frozenset(HELDOUT_COMPOSITIONS)
_TRAIN_PAIRS = S.train_combos()  # (shape, colour): the only kinds distractors are drawn from
TRAIN_COMPOSITIONS: list[tuple[str, str, int]] = [
    (c, s, n) for s in S.SHAPES for c in S.COLOURS for n in COUNTS if (c, s, n) not in _HELDOUT
]

# Colour and shape questions mostly name the object by its position only, so that they give away
# no other question's answer (see _ask); one template each also names the shape / colour.
QUESTIONS: dict[str, list[str]] = {
    "colour": ["What colour is the shape {where}?", "What is the colour of the object {where}?",
               "What colour is the {shape} {where}?"],
    "shape": ["What shape is {where}?", "Which shape is drawn {where}?", "What is the {colour} shape {where}?"],
    "count": ["How many {colour} {shapes} are there?", "How many {colour} {shapes} are in the image?",
              "Count the {colour} {shapes}."],
    "position": ["Where is the {colour} {shape}?", "Where in the image is the {colour} {shape}?",
                 "In which part of the image is the {colour} {shape}?"],
}  # fmt: skip
# Scene captions; {objects} lists the kinds with counts, or every object with its position.
CAPTIONS: list[str] = [
    "{objects} on a {background} background",
    "{objects}",
    "an image of {objects}",
    "{background} background with {objects}",
]
_NUMBER = {2: "two", 3: "three"}

assert all(n > 1 and (s, c) in _TRAIN_PAIRS for c, s, n in HELDOUT_COUNTS), "HELDOUT_COUNTS: see rule 2"
assert CELLS[0] == "top left" and CELLS[4] == "centre" and len(CELLS) == GRID * GRID


def is_heldout(colour: str, shape: str, count: int) -> bool:
    return (colour, shape, count) in _HELDOUT


def plural(shape: str) -> str:
    return shape + ("es" if shape.endswith(("s", "x")) else "s")  # cross -> crosses


def _join(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def scene_caption(attrs: dict, style: int, template: int) -> str:
    """Style 0 counts each kind ("two red circles and a blue star"); style 1 places each object
    ("a red circle in the top left, a blue star in the centre and a red circle at the bottom")."""
    objs = attrs["objects"]
    if style == 0:
        kinds: dict[tuple[str, str], int] = {}
        for o in objs:  # reading order of first appearance
            kinds[(o["colour"], o["shape"])] = kinds.get((o["colour"], o["shape"]), 0) + 1
        parts = [article(c) + " " + s if n == 1 else f"{_NUMBER[n]} {c} {plural(s)}" for (c, s), n in kinds.items()]
    else:
        parts = [f"{article(o['colour'])} {o['shape']} {S.POSITIONS[o['position']][2]}" for o in objs]
    return CAPTIONS[template].format(objects=_join(parts), background=attrs["background"])


def _place(rng: np.random.Generator, cell: int, size_px: int) -> tuple[float, float, float]:
    """(cx, cy, r) inside `cell` with _MARGIN_PX of background to the cell's edges."""
    m = _MARGIN_PX / size_px
    r = rng.uniform(_R_RANGE[0], min(_R_RANGE[1], 0.5 / GRID - m))
    row, col = divmod(cell, GRID)
    cx = rng.uniform(col / GRID + r + m, (col + 1) / GRID - r - m)
    cy = rng.uniform(row / GRID + r + m, (row + 1) / GRID - r - m)
    return cx, cy, r


def _ask(rng: np.random.Generator, qtype: str, objects: list[dict], targets: list[int], unique: list[int],
         count: int, asked: list[str]) -> dict | None:  # fmt: skip
    """A `qtype` question about a target object if it can, else another (position: only objects alone
    of their kind), or None.

    Skips an object whose answer an earlier question of the conversation already states ("Where is
    the red circle?" before "What colour is the circle in the top left?"): the model could copy it
    from the context instead of reading the image.
    """
    template = QUESTIONS[qtype][rng.integers(len(QUESTIONS[qtype]))]
    if qtype == "count":
        o = objects[targets[0]]
        q = template.format(colour=o["colour"], shapes=plural(o["shape"]))
        return {"type": qtype, "question": q, "answer": str(count), "objects": targets}
    others = [int(i) for i in rng.permutation(len(objects)) if i not in targets]
    cands = [int(i) for i in rng.permutation(targets)] + others
    if qtype == "position":
        cands = [i for i in cands if i in unique]
    for i in cands:
        o = objects[i]
        answer = o[qtype]
        if any(re.search(rf"\b{re.escape(answer)}\b", q) for q in asked):
            continue
        q = template.format(colour=o["colour"], shape=o["shape"], where=S.POSITIONS[o["position"]][2])
        return {"type": qtype, "question": q, "answer": answer, "objects": [i]}
    return None


def vqa_attrs(split: str, index: int, seed: int, size_px: int = 48) -> dict:
    """Scene, questions, turns and caption of sample `index` of `split`; a pure function of the
    arguments (so a sample does not depend on the count, and a larger dataset extends a smaller one).
    """
    rng = np.random.default_rng([seed, SPLIT_CODE[split], index, _VQA_SPLIT_TAG])
    pool = HELDOUT_COMPOSITIONS if split == "heldout" else TRAIN_COMPOSITIONS
    colour, shape, count = pool[rng.integers(len(pool))]
    kinds = [(colour, shape, True)] * count
    used = {(shape, colour)}
    for _ in range(int(rng.integers(GRID - count + 1))):  # up to 3 objects in all
        cands = [p for p in _TRAIN_PAIRS if p not in used]
        # Half the distractors share the target's colour or shape: otherwise "how many red circles"
        # could be answered by counting red things, or circles, alone.
        if rng.random() < 0.5:
            cands = [p for p in cands if p[0] == shape or p[1] == colour] or cands
        s2, c2 = cands[rng.integers(len(cands))]
        used.add((s2, c2))
        kinds.append((c2, s2, False))
    background = list(S.BACKGROUNDS)[rng.integers(len(S.BACKGROUNDS))]
    objects = []
    for (c, s, is_target), cell in zip(kinds, rng.permutation(GRID * GRID)[: len(kinds)]):
        cx, cy, r = _place(rng, int(cell), size_px)
        objects.append({
            "shape": s, "colour": c, "position": CELLS[cell], "cell": int(cell),
            "cx": round(float(cx), 6), "cy": round(float(cy), 6), "radius": round(float(r), 6),
            "colour_rgb": list(S.COLOURS[c]), "target": is_target,
        })  # fmt: skip
    objects.sort(key=lambda o: o["cell"])
    targets = [i for i, o in enumerate(objects) if o["target"]]
    n_kind = {}
    for o in objects:
        n_kind[(o["colour"], o["shape"])] = n_kind.get((o["colour"], o["shape"]), 0) + 1
    unique = [i for i, o in enumerate(objects) if n_kind[(o["colour"], o["shape"])] == 1]

    # Position is asked only about an object alone of its kind ("where is the red circle" has no
    # single answer when there are two).
    types = [t for t in QUESTION_TYPES if t != "position" or unique]
    chosen = [types[j] for j in rng.permutation(len(types))[: int(rng.integers(2, len(types) + 1))]]
    # Count goes last: its question names the target's colour and shape, the answers of the others.
    chosen = [t for t in chosen if t != "count"] + ["count"] * ("count" in chosen)
    qa: list[dict] = []
    for qtype in chosen:
        item = _ask(rng, qtype, objects, targets, unique, count, [x["question"] for x in qa])
        if item is not None:
            qa.append(item)
    if len(qa) < 2:  # questions dropped as leaked; a count answer never leaks (questions have no digits)
        qa.append(_ask(rng, "count", objects, targets, unique, count, []))
    turns = []
    for j, item in enumerate(qa):
        turns.append({"role": "user", "content": (IMAGE_MARKER + "\n" if j == 0 else "") + item["question"]})
        turns.append({"role": "assistant", "content": item["answer"]})
    attrs = {
        "turns": turns, "images": 1, "sizes": [[size_px, size_px]], "source": "synth", "qa": qa,
        "objects": objects, "background": background, "background_rgb": list(S.BACKGROUNDS[background]),
        "target": [colour, shape, count], "compositions": [[c, s, n] for (c, s), n in n_kind.items()],
        "heldout": is_heldout(colour, shape, count), "image_size": size_px,
        "split": split, "index": index, "seed": seed,
    }  # fmt: skip
    attrs["caption_style"] = int(rng.integers(2))
    attrs["caption_template"] = int(rng.integers(len(CAPTIONS)))
    attrs["caption"] = scene_caption(attrs, attrs["caption_style"], attrs["caption_template"])
    return attrs


def render_vqa(attrs: dict) -> np.ndarray:
    """The scene, uint8 HxWx3: each shape blended over the background as `data.shapes.render` does
    (shapes never overlap, so a lone shape renders to the same pixels as there)."""
    n = attrs["image_size"]
    out = np.broadcast_to(np.asarray(attrs["background_rgb"], np.float32), (n, n, 3))
    for o in attrs["objects"]:
        alpha = S.render_mask(o["shape"], o["cx"], o["cy"], o["radius"], n)[..., None]
        out = out * (1.0 - alpha) + np.asarray(o["colour_rgb"], np.float32) * alpha
    return np.clip(np.rint(out), 0, 255).astype(np.uint8)


def make_vqa_sample(split: str, index: int, seed: int, size_px: int = 48) -> dict:
    """One WebDataset sample: `png`, `txt` caption and `json` (turns, qa, scene)."""
    attrs = vqa_attrs(split, index, seed, size_px)
    return {
        "__key__": f"{split}-{index:08d}",
        "png": encode_png(render_vqa(attrs)),
        "txt": attrs["caption"],
        "json": json.dumps(attrs, sort_keys=True).encode("utf-8"),
    }


def generate_vqa(
    out: str,
    count: int = 20000,
    heldout_count: int = 512,
    size: int = 48,
    shard_size: int = 1000,
    seed: int = 0,
    progress: bool = False,
) -> dict:
    """Write the VQA dataset to `out`; return the summary (also written to out/manifest.json)."""
    check_at_least(("count", count, 0), ("heldout_count", heldout_count, 0), ("size", size, MIN_SIZE),
                   ("shard_size", shard_size, 1))

    def make(split, i):
        return make_vqa_sample(split, i, seed, size)

    manifest = {
        "format_version": VQA_FORMAT_VERSION,
        "mode": "vqa",
        "args": {"count": count, "heldout_count": heldout_count, "size": size,
                 "shard_size": shard_size, "seed": seed},  # fmt: skip
        "heldout_combos": [list(c) for c in S.HELDOUT_COMBOS],
        "heldout_counts": [list(c) for c in HELDOUT_COUNTS],
        "heldout_compositions": [list(c) for c in HELDOUT_COMPOSITIONS],
        "image_marker": IMAGE_MARKER,
        "vocabulary": {
            "shapes": S.SHAPES,
            "colours": {k: list(v) for k, v in S.COLOURS.items()},
            "backgrounds": {k: list(v) for k, v in S.BACKGROUNDS.items()},
            "positions": CELLS,
            "counts": list(COUNTS),
            "question_types": list(QUESTION_TYPES),
            "questions": QUESTIONS,
            "captions": CAPTIONS,
        },
    }
    return write_dataset(out, count, heldout_count, shard_size, make, manifest, progress)


def ensure_vqa(out: str, **kwargs) -> dict:
    """`ensure` for VQA mode: generate unless a complete VQA dataset with these args is there."""
    defaults = {"count": 20000, "heldout_count": 512, "size": 48, "shard_size": 1000, "seed": 0}
    return reuse_or_generate(out, defaults, kwargs, generate_vqa, format_version=VQA_FORMAT_VERSION, mode="vqa")
