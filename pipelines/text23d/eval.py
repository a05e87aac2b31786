"""Evaluate a text23d run on held-out shapes (compositions never seen in training).

Stages points and latent: each held-out caption is a prompt; the generated shape (stage latent:
points sampled on its marching-cubes mesh) is judged by the deterministic analyser
(data.shape3d_analysis: shape and colour accuracy) and compared with the held-out sample's own
surface at equal point counts (Chamfer distance, F-score@0.05). The "floor" line is the same figure
between two independent samplings of the reference surface: what a perfect model would score.
Stages vae and latent: the autoencoder's reconstructions of the held-out shapes (occupancy IoU at
the held-out queries, Chamfer / F-score of the reconstructed mesh, analyser accuracy).

  python -m pipelines.text23d.eval --run RUN_DIR [--shards SPEC] [--num N] [--steps S] [--cfg W] [--seed K]
         [--save-grid PATH]

Prints the figures and writes eval.json into the run directory.
"""
from __future__ import annotations

import argparse
import io
import os

import numpy as np
import torch

from common.cli import run_cli
from common.config import ConfigError
from common.data.captions import caption_of, read_attributes
from common.data.shards import iter_samples
from common.geometry import chamfer_distance, f_score, occupancy_iou
from common.run import load_run, write_eval
from data.shape3d_analysis import score
from pipelines.text23d import components as C
from pipelines.text23d.spec import SPEC

FSCORE_AT = 0.05


def heldout(shards: str, n: int) -> list[dict]:
    """The first n held-out samples: caption, attributes, surface points (P, 6), occupancy queries."""
    out = []
    for s in iter_samples(shards):
        if len(out) == n:
            break
        occ = np.load(io.BytesIO(s["occ.npy"])).astype(np.float32) if "occ.npy" in s else None
        out.append({"caption": caption_of(s), "attrs": read_attributes(s),
                    "points": np.load(io.BytesIO(s["npy"])).astype(np.float32), "occ": occ})
    return out


def compare(clouds: list[np.ndarray], refs: list[np.ndarray], attrs: list[dict]) -> dict:
    """Analyser accuracy of `clouds` against `attrs` and their mean Chamfer / F-score against the
    reference surfaces `refs`, each reference cut to its cloud's point count. An empty cloud (a
    decoded field with no surface) counts as wrong and is left out of the distance means."""
    kept = [i for i, c in enumerate(clouds) if len(c)]
    result = {"n": len(clouds), "empty": len(clouds) - len(kept)}
    judged = score([clouds[i] for i in kept], [attrs[i] for i in kept]) if kept else {}
    for key in ("shape_acc", "colour_acc", "both_acc", "size_acc", "aspect_acc", "position_acc"):
        result[key] = judged.get(key, 0.0) * len(kept) / max(len(clouds), 1)  # over all n: empties are misses
    result["per_shape"] = judged.get("per_shape", {})
    result["confusion"] = judged.get("confusion", {})  # true shape -> {analysed shape or "none": count}
    ch = [chamfer_distance(clouds[i][:, :3], refs[i][:len(clouds[i]), :3]) for i in kept]
    fs = [f_score(clouds[i][:, :3], refs[i][:len(clouds[i]), :3], FSCORE_AT) for i in kept]
    result["chamfer"] = float(np.mean(ch)) if ch else float("nan")
    result["fscore"] = float(np.mean(fs)) if fs else 0.0
    k = len(clouds[kept[0]]) if kept else 0
    if k and all(len(r) >= 2 * k for r in refs):  # the same surface sampled twice
        result["floor_chamfer"] = float(np.mean([chamfer_distance(r[:k, :3], r[k:2 * k, :3]) for r in refs]))
        result["floor_fscore"] = float(np.mean([f_score(r[:k, :3], r[k:2 * k, :3], FSCORE_AT) for r in refs]))
    return result


@torch.no_grad()
def reconstruction(vae, examples: list[dict], surface_points: int, resolution: int) -> dict:
    """The VAE on held-out shapes: occupancy IoU at the stored queries, mesh Chamfer / F-score, analyser."""
    surfaces = torch.from_numpy(np.stack([e["points"][:surface_points] for e in examples]))
    ious = []
    for e, surface in zip(examples, surfaces):
        if e["occ"] is None:
            continue
        occ = torch.from_numpy(e["occ"])
        logits = vae(C.to_model_space(surface)[None], C.to_model_space(occ[None, :, :3]))[0][0, :, 0]
        ious.append(occupancy_iou(logits > 0, occ[:, 3] > 0.5))
    shapes = C.reconstruct(vae, surfaces, resolution)
    out = compare([s["points"] for s in shapes], [e["points"] for e in examples], [e["attrs"] for e in examples])
    out["iou"] = float(np.mean(ious)) if ious else float("nan")
    return out, shapes


def _line(name: str, r: dict) -> str:
    floor = f" (floor {r['floor_chamfer']:.4f} / {r['floor_fscore']:.3f})" if "floor_chamfer" in r else ""
    iou = f", occupancy IoU {r['iou']:.3f}" if "iou" in r else ""
    empty = f", {r['empty']} empty" if r["empty"] else ""
    return (f"{name}: shape accuracy {r['shape_acc']:.1%}, colour accuracy {r['colour_acc']:.1%}, both "
            f"{r['both_acc']:.1%} (size {r['size_acc']:.1%}, position {r['position_acc']:.1%}); Chamfer "
            f"{r['chamfer']:.4f}, F-score@{FSCORE_AT} {r['fscore']:.3f}{floor}{iou}{empty}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipelines.text23d.eval", description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, help="run directory")
    p.add_argument("--shards", default=None, help="held-out shards (default: the run's data.eval_shards)")
    p.add_argument("--num", type=int, default=112, help="held-out shapes (default 112: 16 per held-out composition)")
    p.add_argument("--steps", type=int, default=None, help="sampler steps (default: the run's sample.steps)")
    p.add_argument("--cfg", type=float, default=None, help="guidance weight (default: the run's sample.cfg)")
    p.add_argument("--seed", type=int, default=0, help="seed of the first shape; shape i uses seed + i")
    p.add_argument("--save-grid", default=None, help="also write a turntable (PNG + GIF) of the first 16 shapes "
                                                     "at this path stem")
    args = p.parse_args(argv)
    if args.num < 1:
        raise ConfigError("--num must be >= 1")
    comp, meta = load_run(SPEC, args.run)
    cfg = comp.cfg
    examples = heldout(args.shards or cfg.data.eval_shards, args.num)
    if not examples or "shape" not in examples[0]["attrs"]:
        raise ConfigError("the held-out shards carry no shape attributes (json); eval needs data.synth --3d shards")
    result = {"step": meta["step"], "checkpoint": meta["path"], "stage": cfg.stage}
    lines, shown = [], None
    if cfg.stage != "vae":
        steps = args.steps or cfg.sample.steps
        guidance = cfg.sample.cfg if args.cfg is None else args.cfg
        shapes = C.generate(comp, comp.model, [e["caption"] for e in examples],
                            [args.seed + i for i in range(len(examples))], steps=steps, guidance=guidance)
        result["samples"] = compare([s["points"] for s in shapes], [e["points"] for e in examples],
                                    [e["attrs"] for e in examples])
        result.update(steps=steps, cfg=guidance)
        lines.append(_line(f"samples of {len(shapes)} held-out captions", result["samples"]))
        shown = shapes
    if cfg.stage != "points":
        vae = comp.model if cfg.stage == "vae" else comp.codec.vae
        result["reconstruction"], recon = reconstruction(vae, examples, cfg.vae.surface_points,
                                                         cfg.vae.mesh_resolution)
        lines.append(_line(f"VAE reconstructions of {len(examples)} held-out shapes", result["reconstruction"]))
        shown = shown or recon
    write_eval(args.run, result)
    if args.save_grid:
        stem, ext = os.path.splitext(args.save_grid)
        C.write_grid(shown[:16], stem if ext in (".png", ".gif") else args.save_grid, comp, {})
    print(f"eval of {args.run} (stage {cfg.stage}, step {meta['step']}):")
    for line in lines:
        print("  " + line)
    return 0


if __name__ == "__main__":
    run_cli(main)
