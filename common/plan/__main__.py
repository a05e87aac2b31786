"""python -m common.plan: rank parallel layouts for a model on N GPUs, or dry-run one at full size."""
from __future__ import annotations

import argparse
import sys
import time

from common.config import ConfigError

EPILOG = """\
examples:
  python -m common.plan --model dit-xl --gpus 10240 --gpu h100-80g
  python -m common.plan --pipeline text2image --config pipelines/text2image/configs/xl.yaml --gpus 1024
  python -m common.plan --model llama-7b --gpus 10240 --global-batch 4096 --top 5
  python -m common.plan --model dit-xl --gpus 10240 --dry-run --layout pp=7,cp=2,tp=8 --global-batch 327680

What it prints per layout: degrees (pp, dp_replicate x dp_shard, cp and its mode, tp), the pipeline
schedule, microbatches per step x samples per microbatch, the activation-checkpoint mode; memory per
GPU (fp32 params, fp32 grads, AdamW moments + EMA, activations, buffers); step time (compute,
exposed communication, pipeline bubble), predicted MFU (model FLOPs, no recompute, over the bf16
dense peak) and tokens/s at the given global batch. The model of each term is in
common/plan/layout.py; --detail prints the best layout's collectives one by one.

--dry-run builds the real mesh on torch's fake process group, the full-size model on the meta
device, parallelizes it with the pipeline's own plan as a few sample ranks and prints their shard
shapes, memory and process groups. Without --layout it dry-runs the top-ranked layout.
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line (common/cli.py prints it, exit 2), not argparse's usage block
        raise ConfigError(f"{message} (see python -m common.plan --help)")


def _parser() -> argparse.ArgumentParser:
    from common.plan.hardware import GPUS
    from common.plan.source import MODELS
    p = _Parser(prog="python -m common.plan", description=__doc__.split("\n")[0],
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_argument_group("model")
    src.add_argument("--pipeline", help="a pipeline under pipelines/ (its spec is loaded by name)")
    src.add_argument("--config", help="the pipeline's YAML config")
    src.add_argument("--model", help=f"a preset instead of a pipeline: {', '.join(MODELS)}")
    src.add_argument("overrides", nargs="*", help="config overrides key=value (e.g. model.image_size=512)")
    hw = p.add_argument_group("cluster")
    hw.add_argument("--gpus", type=int, required=True, help="world size")
    hw.add_argument("--gpu", default="h100-80g", help=f"one of {', '.join(GPUS)} (default h100-80g)")
    hw.add_argument("--nodes-of", type=int, default=8, help="GPUs per node: NVLink inside, InfiniBand across (8)")
    hw.add_argument("--nvlink-gbs", type=float, default=0.0,
                    help="NVLink GB/s per GPU, one direction (default: the GPU's, 450 H100/H200, 300 A100)")
    hw.add_argument("--ib-gbs", type=float, default=0.0,
                    help="InfiniBand GB/s per GPU, one direction (default 50: 400 Gb/s NDR; A100 25)")
    run = p.add_argument_group("search")
    run.add_argument("--global-batch", type=int, default=0,
                     help="samples per optimizer step (default: the config's micro_batch x grad_accum per GPU "
                          "of its own layout; presets: 32 per GPU for DiTs, llama-7b 4M tokens or gpus/8 "
                          "sequences, whichever is more)")
    run.add_argument("--top", type=int, default=10, help="layouts printed (10)")
    run.add_argument("--efficiency", type=float, default=0.7, help="achievable fraction of peak in large GEMMs (0.7)")
    run.add_argument("--attn-efficiency", type=float, default=0.5, help="of peak in flash attention (0.5)")
    run.add_argument("--ac", default="none,selective,full", help="activation-checkpoint modes to try")
    run.add_argument("--detail", action="store_true", help="print the best layout's collectives")
    dry = p.add_argument_group("dry run")
    dry.add_argument("--dry-run", action="store_true", help="build and parallelize the model for sample ranks")
    dry.add_argument("--layout", default="", help="pp=8,dp_replicate=1,cp=2,tp=8,cp_mode=ulysses,schedule=1f1b,"
                                                  "microbatches=8,micro_batch=1,ac=full (dp_shard: the rest)")
    dry.add_argument("--ranks", default="", help="comma-separated ranks to dry-run (default: three samples)")
    return p


def parse_layout(text: str, world: int, global_batch: int):
    from common.plan.layout import Layout
    fields = {}
    for item in filter(None, text.split(",")):
        if "=" not in item:
            raise ConfigError(f"--layout: {item!r} is not key=value")
        k, v = item.split("=", 1)
        fields[k.strip()] = v.strip()
    ints = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "microbatches", "micro_batch", "stages_per_rank", "ac_every")
    known = set(ints) | {"cp_mode", "schedule", "ac", "dp_mode"}
    bad = set(fields) - known
    if bad:
        raise ConfigError(f"--layout: unknown keys {sorted(bad)}; known: {', '.join(sorted(known))}")
    try:
        kw = {k: (int(v) if k in ints else v) for k, v in fields.items()}
    except ValueError as e:
        raise ConfigError(f"--layout: {e}") from None
    other = kw.get("pp", 1) * kw.get("dp_replicate", 1) * kw.get("cp", 1) * kw.get("tp", 1)
    if "dp_shard" not in kw:
        if world % other:
            raise ConfigError(f"--layout: pp x dp_replicate x cp x tp = {other} does not divide --gpus {world}")
        kw["dp_shard"] = world // other
    kw.setdefault("schedule", "1f1b")
    kw.setdefault("stages_per_rank", 2 if kw["schedule"] in ("interleaved", "zero_bubble") else 1)
    dp = kw.get("dp_replicate", 1) * kw["dp_shard"]
    kw.setdefault("dp_mode", "fsdp" if dp * kw.get("cp", 1) > 1 else "none")
    if "microbatches" not in kw:
        per_rank = max(1, global_batch // dp) if global_batch else kw.get("pp", 1)
        kw["microbatches"] = max(1, per_rank // kw.get("micro_batch", 1))
    lay = Layout(**kw)
    if lay.world != world:
        raise ConfigError(f"--layout: degrees multiply to {lay.world}, not --gpus {world}")
    return lay


def _gib(x: float) -> str:
    return f"{x / 2**30:5.1f}"


def print_table(desc, res, gpu, top: int, out=print) -> None:
    out(f"{'#':>3} {'pp':>3} {'dpr':>5} {'dps':>5} {'cp':>6} {'tp':>3} {'sched':>6} {'m':>4} {'mb':>4} {'AC':>5} | "
        f"{'param':>5} {'grad':>5} {'opt':>5} {'act':>5} {'buf':>5} {'total':>5} GiB | {'comp':>6} {'comm':>6} "
        f"{'bubble':>6} {'step s':>7} | {'MFU':>5} {'tokens/s':>10}")
    for i, e in enumerate(res.ranked[:top], 1):
        lay, m = e.layout, e.memory
        cp = f"{lay.cp}{'u' if lay.cp_mode == 'ulysses' else 'r'}" if lay.cp > 1 else "1"
        sched = "-" if lay.pp == 1 else ("1f1b" if lay.schedule == "1f1b" else f"int{lay.stages_per_rank}")
        dps = f"{lay.dp_shard}" if lay.dp_mode != "ddp" else "ddp"
        ac = f"sel/{lay.ac_every}" if lay.ac == "selective" else lay.ac
        out(f"{i:>3} {lay.pp:>3} {lay.dp_replicate:>5} {dps:>5} {cp:>6} {lay.tp:>3} {sched:>6} {lay.microbatches:>4} "
            f"{lay.micro_batch:>4} {ac:>5} | {_gib(m['params'])} {_gib(m['grads'])} {_gib(m['optim'])} "
            f"{_gib(m['activations'])} {_gib(m['buffers'])} {_gib(m['total'])}     | {e.compute:6.3f} {e.exposed:6.3f} "
            f"{e.bubble:6.3f} {e.step:7.3f} | {100 * e.mfu:4.1f}% {e.tokens_per_s:10.3g}")


def print_detail(e, out=print) -> None:
    out("collectives of #1 per rank and step (worst stage): buffer bytes, wire bytes (ring), time, exposed")
    for c in e.comm:
        out(f"  {c.name:<40} over {'x'.join(c.dims):<22} ({c.size:>5} ranks) {c.buffer / 2**20:10.1f} MiB "
            f"{c.wire / 2**20:10.1f} MiB {1e3 * c.time:9.2f} ms {1e3 * c.exposed:9.2f} ms")


def main(argv=None) -> int:
    from common.plan.hardware import GPUS, Network
    from common.plan.models import forward_flops
    from common.plan.search import check, search
    from common.plan.source import resolve
    args = _parser().parse_args(argv)
    t0 = time.perf_counter()
    if args.gpus < 1:
        raise ConfigError(f"--gpus {args.gpus}: must be >= 1")
    if args.gpu not in GPUS:
        raise ConfigError(f"--gpu {args.gpu!r}: choose from {', '.join(GPUS)}")
    if args.nodes_of < 1 or args.nvlink_gbs < 0 or args.ib_gbs < 0:
        raise ConfigError("--nodes-of, --nvlink-gbs and --ib-gbs must be positive")
    if not 0 < args.efficiency <= 1 or not 0 < args.attn_efficiency <= 1:
        raise ConfigError("--efficiency and --attn-efficiency are fractions in (0, 1]")
    ac_modes = tuple(filter(None, args.ac.split(",")))
    if not ac_modes or set(ac_modes) - {"none", "selective", "full"}:
        raise ConfigError(f"--ac {args.ac!r}: a comma-separated subset of none, selective, full")
    if args.model and args.pipeline:
        raise ConfigError("give either --model or --pipeline/--config, not both")
    src = resolve(args.pipeline, args.config, args.overrides, args.model)
    desc, gpu = src.desc, GPUS[args.gpu]
    net = Network(args.nodes_of, args.nvlink_gbs * 1e9 or gpu.nvlink, args.ib_gbs * 1e9 or gpu.ib)
    g = args.global_batch
    if g <= 0:
        if desc.kind == "llama" and src.spec is None:
            # 4M tokens (Llama-2's batch), or more on a world whose data-parallel degree it cannot feed
            g = max(4 * 2**20 // desc.tokens, args.gpus // 8)
        else:
            g = int(round((src.default_batch or 32) * args.gpus))
    print(f"{desc.name}: {desc.num_params / 1e6:,.1f}M params, {desc.layers} blocks x {desc.hidden} wide, "
          f"{desc.heads} heads, {desc.tokens} tokens/sample, {forward_flops(desc) / 1e9:,.1f} GFLOP forward/sample"
          + (f" ({desc.note})" if desc.note else ""))
    print(f"{args.gpus} x {gpu.describe()}; {args.nodes_of} per node, NVLink {net.nvlink / 1e9:g} GB/s, "
          f"IB {net.ib / 1e9:g} GB/s per GPU; global batch {g} samples ({g * desc.tokens / 1e6:.2f}M tokens)")
    if args.dry_run:
        from common.plan.dry_run import dry_run
        if args.layout:
            lay = parse_layout(args.layout, args.gpus, g)
            why = check(desc, lay)
            if why:
                raise ConfigError(why)
        else:
            res = search(desc, args.gpus, g, gpu, net, eff=args.efficiency, attn_eff=args.attn_efficiency,
                         ema=src.ema, ac_modes=ac_modes)
            if not res.ranked:
                raise ConfigError("no layout fits; nothing to dry-run")
            lay = res.ranked[0].layout
        ranks = [int(r) for r in args.ranks.split(",")] if args.ranks else None
        if ranks and any(not 0 <= r < args.gpus for r in ranks):
            raise ConfigError(f"--ranks {args.ranks}: ranks must lie in 0..{args.gpus - 1}")
        dry_run(src, lay, ranks)
        print(f"dry run done in {time.perf_counter() - t0:.1f} s")
        return 0
    res = search(desc, args.gpus, g, gpu, net, eff=args.efficiency, attn_eff=args.attn_efficiency, ema=src.ema,
                 ac_modes=ac_modes)
    print(f"{len(res.ranked)} layouts fit, {res.too_big} (mesh, AC) pairs do not fit in memory, "
          f"{res.not_dividing} meshes do not divide the model or the batch ({time.perf_counter() - t0:.1f} s)")
    if not res.ranked and not res.too_big and res.best_unfit is None:
        raise ConfigError(f"no mesh of {args.gpus} GPUs divides {desc.name} ({desc.layers} blocks, {desc.heads} heads, "
                          f"{desc.tokens} tokens) and the global batch of {g} samples over its data-parallel ranks; "
                          "try another --global-batch")
    if not res.ranked:
        hint = ""
        if res.best_unfit is not None:
            u = res.best_unfit
            hint = f"; the smallest needs {u.memory['total'] / 2**30:.1f} GiB ({u.layout.short()})"
        raise ConfigError(f"no layout of {args.gpus} GPUs fits {desc.name} in {gpu.memory / 2**30:.1f} GiB{hint}")
    print_table(desc, res, gpu, args.top)
    if args.detail:
        print_detail(res.ranked[0])
    return 0


if __name__ == "__main__":
    from common.cli import run_cli
    run_cli(main, sys.argv[1:])
