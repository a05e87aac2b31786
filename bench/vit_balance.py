"""ViT work per data-parallel rank on a mixed-resolution image stream, with and without
common.parallel.balance (tiles spread evenly over the DP group before the vision encoder).

Dynamic-resolution tiling (InternVL style): an image that fits in one tile is one tile; a larger
one is cut into ceil(h/t) x ceil(w/t) tiles (the grid shrunk along its longer side until it holds
at most --max-tiles) plus one thumbnail tile. Every tile has the same size, so every tile costs the
same ViT FLOPs, and a rank's ViT work is its tile count times the per-tile FLOPs below. Samples are
drawn from a fixed mix of resolutions (squares, wide, tall, and text-only samples with no image);
each of D ranks takes B samples per step, for --steps steps.

Per (D, B) the table prints, side by side, the slowest rank's ViT FLOPs over the mean, without
balancing (each rank encodes its own samples' tiles) and with balancing (shares from
balance.plan). "sum" is sum over steps of the slowest rank / sum of the mean: the step-time
overhead of waiting for the slowest rank, over the whole run; "worst" is the worst single step.
"moved" is the fraction of tiles that leave their rank (each also comes back as an embedding).

--processes also runs the real balanced_apply on 2 gloo processes with a tiny ViT (width 128,
4 layers, 36 tokens per 48 px tile), forward + backward, alternating plain and balanced steps on
the same tiles, and prints the measured tiles per rank and wall time per step.

`tile_count` lives here for now; the VLM pipeline's data code is its eventual home.

  python bench/vit_balance.py [--steps N] [--batch 2 4 8] [--ranks 2 4 8] [--max-tiles 6]
                              [--processes] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.parallel.balance import imbalance, moved, plan, shares  # noqa: E402
from pipelines.vlm.data import tile_count as vlm_tile_count  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TILE = 48
VIT = dict(width=128, layers=4, heads=4, patch=8, mlp_ratio=4)

# (height, width) px of one sample's image (None: a text-only sample), and its weight in the mix.
RESOLUTIONS = [(None, 0.10), ((48, 48), 0.20), ((96, 96), 0.15), ((144, 144), 0.10), ((48, 144), 0.08),
               ((144, 48), 0.08), ((96, 192), 0.08), ((240, 96), 0.06), ((64, 80), 0.10), ((32, 40), 0.05)]


def tile_count(h: int, w: int, tile: int = TILE, max_tiles: int = 6) -> int:
    """Tiles of one h x w image under the vlm pipeline's dynamic tiling (pipelines/vlm/data.py):
    1 when it fits one tile, else a thumbnail plus the aspect-matched grid of at most max_tiles."""
    return vlm_tile_count(w, h, tile, max_tiles)


def vit_flops_per_tile(tile: int = TILE, width: int = VIT["width"], layers: int = VIT["layers"],
                       patch: int = VIT["patch"], mlp_ratio: int = VIT["mlp_ratio"], train: bool = True) -> int:
    """2 * params * tokens for the matmuls (patch embed, qkv + out proj 4w^2, MLP 2*r*w^2 per layer)
    plus attention scores and weighted sum (2 * 2 * tokens^2 * w per layer); x3 for fwd + bwd."""
    tokens = (tile // patch) ** 2
    params = 3 * patch * patch * width + layers * (4 + 2 * mlp_ratio) * width * width
    fwd = 2 * params * tokens + layers * 4 * tokens * tokens * width
    return 3 * fwd if train else fwd


def sample_tiles(rng: random.Random, max_tiles: int) -> int:
    res = rng.choices([r for r, _ in RESOLUTIONS], weights=[w for _, w in RESOLUTIONS])[0]
    return 0 if res is None else tile_count(*res, max_tiles=max_tiles)


def simulate(ranks: int, batch: int, steps: int, max_tiles: int, seed: int) -> dict:
    rng = random.Random(seed)
    f = vit_flops_per_tile()
    sums = {"plain": [0.0, 0.0], "balanced": [0.0, 0.0]}  # [sum of max, sum of mean]
    worst = {"plain": 1.0, "balanced": 1.0}
    tiles = moved_tiles = 0
    for _ in range(steps):
        counts = [sum(sample_tiles(rng, max_tiles) for _ in range(batch)) for _ in range(ranks)]
        share = shares(counts)
        assert [sum(b - a for _, a, b in s) for s in plan(counts)] == share
        for kind, work in (("plain", counts), ("balanced", share)):
            flops = [c * f for c in work]
            sums[kind][0] += max(flops)
            sums[kind][1] += sum(flops) / ranks
            worst[kind] = max(worst[kind], imbalance(flops))
        tiles += sum(counts)
        moved_tiles += moved(counts)
    row = {"ranks": ranks, "batch": batch, "tiles_per_rank": tiles / steps / ranks,
           "moved": moved_tiles / max(tiles, 1)}
    for kind, (mx, mean) in sums.items():
        row[kind] = {"sum": mx / mean if mean else 1.0, "worst": worst[kind]}
    return row


def stream_stats(max_tiles: int) -> str:
    def tiles(res):
        return 0 if res is None else tile_count(*res, max_tiles=max_tiles)

    parts = [f"{'text' if r is None else f'{r[0]}x{r[1]}'}:{tiles(r)}({w:.0%})" for r, w in RESOLUTIONS]
    mean = sum(w * tiles(r) for r, w in RESOLUTIONS)
    return f"mix h x w:tiles(weight): {' '.join(parts)}; mean {mean:.2f} tiles/sample"


# ----------------------------------------------------------------------------- real processes
def _tiny_vit():
    import torch
    from torch import nn

    from common.nn.attention import SelfAttention
    from common.nn.mlp import MLP
    from common.nn.norm import LayerNorm

    w, p = VIT["width"], VIT["patch"]

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.n1, self.attn = LayerNorm(w), SelfAttention(w, VIT["heads"], qk_norm=False)
            self.n2, self.mlp = LayerNorm(w), MLP(w, VIT["mlp_ratio"] * w)

        def forward(self, x):
            x = x + self.attn(self.n1(x))
            return x + self.mlp(self.n2(x))

    class TinyViT(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Conv2d(3, w, p, stride=p)
            self.pos = nn.Parameter(torch.randn((TILE // p) ** 2, w) * 0.02)
            self.blocks = nn.ModuleList(Block() for _ in range(VIT["layers"]))
            self.norm = LayerNorm(w)

        def forward(self, tiles):  # (N, 3, T, T) -> (N, tokens, w)
            x = self.embed(tiles).flatten(2).transpose(1, 2) + self.pos
            for b in self.blocks:
                x = b(x)
            return self.norm(x)

    torch.manual_seed(0)
    return TinyViT()


def _rank(rank, world, port, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    from common.parallel.balance import balanced_apply
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = _tiny_vit()
        rng = random.Random(args.seed)
        marks = {}
        # ViT compute time on this rank, excluding waits in collectives: fn's forward, plus its
        # backward from the moment the embeddings' gradient exists (hook on fn's output) to the
        # moment the first layer's weight gradient is accumulated (the last one backward reaches).
        model.embed.weight.register_post_accumulate_grad_hook(lambda _: marks.__setitem__("b1", time.perf_counter()))
        out = {k: {"items": [], "vit": [], "step": []} for k in ("plain", "balanced")}
        for step in range(args.proc_steps + 1):
            # Every rank draws all ranks' counts from the same stream and keeps its own.
            counts = [sum(sample_tiles(rng, args.max_tiles) for _ in range(args.proc_batch)) for _ in range(world)]
            x = torch.randn(counts[rank], 3, TILE, TILE, generator=torch.Generator().manual_seed(step * world + rank))
            for kind in ("plain", "balanced"):
                seen = []

                def fn(t):
                    seen.append(t.shape[0])
                    f0 = time.perf_counter()
                    y = model(t)
                    marks["fwd"] = time.perf_counter() - f0
                    y.register_hook(lambda g: marks.__setitem__("b0", time.perf_counter()))
                    return y

                dist.barrier()
                t0 = time.perf_counter()
                y = fn(x) if kind == "plain" else balanced_apply(fn, x, None)
                y.square().mean(dim=(1, 2)).sum().backward()
                # stand-in for the DP gradient reduction: every rank waits for the slowest
                dist.all_reduce(torch.zeros(1))
                total = time.perf_counter() - t0
                model.zero_grad(set_to_none=True)
                if step:  # step 0 warms up
                    out[kind]["items"].append(seen[0])
                    out[kind]["vit"].append(marks["fwd"] + marks["b1"] - marks["b0"])
                    out[kind]["step"].append(total)
        queue.put((rank, out))
    finally:
        dist.destroy_process_group()


def run_processes(args) -> dict:
    import torch.multiprocessing as mp
    world = 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, port, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    per_rank = dict(queue.get(timeout=600) for _ in range(world))
    for p in procs:
        p.join()
    res = {}
    for kind in ("plain", "balanced"):
        items = [per_rank[r][kind]["items"] for r in range(world)]
        vit = [per_rank[r][kind]["vit"] for r in range(world)]
        steps = len(items[0])
        step_s = sorted(max(per_rank[r][kind]["step"][i] for r in range(world)) for i in range(steps))
        res[kind] = {"items_per_rank": [sum(i) for i in items],
                     "items_max_over_mean": sum(max(i[s] for i in items) for s in range(steps))
                     / (sum(sum(i) for i in items) / world),
                     "vit_s_max_over_mean": sum(max(v[s] for v in vit) for s in range(steps))
                     / (sum(sum(v) for v in vit) / world),
                     "step_s_median": step_s[len(step_s) // 2], "step_s_mean": sum(step_s) / steps}
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2000, help="simulated steps per (ranks, batch)")
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8], help="DP degrees D")
    p.add_argument("--batch", type=int, nargs="+", default=[2, 4, 8], help="samples per rank per step B")
    p.add_argument("--max-tiles", type=int, default=6, help="tile cap per image (plus the thumbnail)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--processes", action="store_true", help="also run balanced_apply on 2 gloo processes")
    p.add_argument("--proc-steps", type=int, default=30, help="timed steps per mode with --processes")
    p.add_argument("--proc-batch", type=int, default=4, help="samples per rank per step with --processes")
    p.add_argument("--json", default=os.path.join(ROOT, "bench", "results", "vit_balance.json"))
    args = p.parse_args()

    print(f"ViT {VIT}, {TILE} px tiles, {(TILE // VIT['patch']) ** 2} tokens, "
          f"{vit_flops_per_tile() / 1e6:.1f} MFLOP per tile (fwd+bwd); {args.steps} steps per row")
    print(stream_stats(args.max_tiles))
    rows = [simulate(d, b, args.steps, args.max_tiles, args.seed + 1000 * d + b)
            for d in args.ranks for b in args.batch]
    print("\nslowest rank / mean ViT FLOPs (sum over steps; worst step)")
    print(f"{'D':>3} {'B':>3} {'tiles/rank':>10}   {'plain sum':>9} {'worst':>6}   {'balanced sum':>12} {'worst':>6}"
          f" {'moved':>6}  {'<=1.10':>6}")
    for r in rows:
        ok = "yes" if r["balanced"]["sum"] <= 1.10 else "no"
        print(f"{r['ranks']:3d} {r['batch']:3d} {r['tiles_per_rank']:10.1f}   {r['plain']['sum']:9.3f} "
              f"{r['plain']['worst']:6.2f}   {r['balanced']['sum']:12.3f} {r['balanced']['worst']:6.2f} "
              f"{r['moved']:6.1%}  {ok:>6}")
    out = {"vit": VIT, "tile": TILE, "max_tiles": args.max_tiles, "steps": args.steps,
           "flops_per_tile": vit_flops_per_tile(), "rows": rows}

    if args.processes:
        print(f"\n2 gloo processes, 1 thread each, tiny ViT fwd+bwd, B={args.proc_batch} samples per rank, "
              f"{args.proc_steps} timed steps per mode (alternating, same tiles)")
        res = run_processes(args)
        print(f"{'mode':9} {'tiles r0/r1':>12} {'tiles max/mean':>15} {'ViT s max/mean':>15} {'step s median':>14}"
              f" {'step s mean':>12}")
        for kind, r in res.items():
            its = "/".join(map(str, r["items_per_rank"]))
            print(f"{kind:9} {its:>12} {r['items_max_over_mean']:15.3f} {r['vit_s_max_over_mean']:15.3f} "
                  f"{r['step_s_median']:14.4f} {r['step_s_mean']:12.4f}")
        print("ViT s = measured time in the ViT's forward and backward on a rank (no collective waits), slowest "
              "rank over the mean per step, summed; step = start to after the gradient sync (the slowest rank)")
        out["processes"] = res

    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
