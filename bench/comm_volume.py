"""Bytes moved by collectives in one text2image training step, per parallel layout, beside the
analytical values.

    python bench/comm_volume.py [--layouts fsdp2-zero3,tp2,...] [--json bench/results/comm_volume.json]

What is counted. A TorchDispatchMode (`CommCounter`) sees every communication op that reaches
the dispatcher, whoever issues it: c10d ops (`torch.ops.c10d.*`: FSDP2's all-gather and
reduce-scatter, torch.distributed.all_reduce / all_to_all_single / all_gather, and isend / irecv /
batch_isend_irecv, which arrive as c10d.send / c10d.recv_) and functional collectives
(`torch.ops._c10d_functional.*`: DTensor redistributions in tensor/sequence parallelism). A mode
is popped while its op runs, so a functional collective's inner c10d call is not counted twice.
torch 2.14's CommDebugMode is not used: it counts calls, not bytes, and ignores send/recv.
An unrecognised op in a c10d namespace is reported as `other:<name>` so nothing is dropped.

Groups are named by the mesh dim whose process group carried the op. A flattened dim whose other
factors are 1 is the same group as the remaining dim, so FSDP over dp_shard_cp shows as "cp" in
the CP-only layouts.

Conventions (per rank, fp32):
  buffer bytes  the size of the logical collective: all-gather = its output (the full tensor),
                reduce-scatter = its input, all-reduce = the tensor, all-to-all = the local input,
                send / recv = the message.
  wire bytes    what one rank sends under a bandwidth-optimal (ring) algorithm: all-gather and
                reduce-scatter (N-1)/N x buffer, all-reduce 2 (N-1)/N x buffer, all-to-all the
                part of the input that leaves the rank ((N-1)/N x buffer for even splits),
                send = buffer, recv = 0 (its bytes are some other rank's send).
The step is forward + backward + the parallel model's grad hooks (TP's partial-gradient sync),
the second step of the run (the first is a warm-up; one-time set-up traffic such as DTensor's
parameter scatter at parallelize time is never counted); the optimizer step, gradient-norm and
loss-logging reductions are not part of it.

Model: the text2image DiT from `components.build` with hidden 256, depth 4, heads 8 (head dim 32),
32 px pixels, patch 2 (L = 256 tokens), text tower width 64 and 16 tokens (L_t = 16); batch
B = 4 per data-parallel rank (per TP/CP group for TP/CP). Loss: MSE against a random target.

Analytical values (D = 256, N = group size; see `analytical()` for the exact expressions):
  FSDP     (fully_shard on every block, then the root): per unit, one all-gather of its flat padded
           parameters (each tensor's dim 0 padded to N x ceil(d0/N) rows) per forward, ZeRO-3 again
           in backward, and one reduce-scatter of the padded gradients. apply_fsdp passes
           reshard_after_forward explicitly, and torch 2.14 keeps the root unsharded after forward
           only for reshard_after_forward=None, so under ZeRO-3 the root is re-gathered too:
           all-gather = 2 x params, ZeRO-2 = 1 x params; reduce-scatter = 1 x grads.
  TP       3 regions per DiT block (self-attn, cross-attn, MLP). Plain TP: forward 3 all-reduces of
           (B, L, D); backward 3 all-reduces of (B, L, D) for the region inputs plus 1 of the text
           context (B, L_t, D) (replicated into the cross-attention k/v); plus one flat all-reduce of
           the partial gradients (QK-norm weights). SP: each all-reduce of (B, L, D) becomes an
           all-gather + reduce-scatter pair (forward: AG entering, RS leaving each region; backward
           the reverse), the stack boundary adds one all-gather in forward (output) and one in
           backward (input gradient), the t0 conditioning adds one (B, 6D) all-reduce per block in
           backward, and the partial-gradient sync covers every plain block parameter.
  Ulysses  4 all-to-alls (q, k, v, out) of the local (B, L/cp, D) per self-attention forward, 4 in
           backward; cross-attention needs none (text is replicated). Plus one all-gather of the
           (B, L, D) block output before the final layer (parallelize._apply_cp; its backward is
           a local slice) and FSDP over the cp ranks (dp_mode auto gives fsdp, ZeRO-3).
  ring     K and V travel as one stacked (2, B, H, L/cp, hd) message: forward cp-1 sends per
           self-attention, backward cp-1 K/V sends plus cp dK/dV accumulator sends (the last one
           returns each block's gradient home). Plus the final gather and FSDP as for Ulysses.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import torch  # noqa: E402

from common.parallel.dims import submesh  # noqa: E402

MODEL = ["model.preset=tiny", "model.image_size=32", "model.patch_size=2", "model.hidden=256", "model.depth=4",
         "model.heads=8", "model.mlp_ratio=4.0", "text.width=64", "text.layers=1", "text.heads=2",
         "text.context_length=16"]
BATCH = 4

# name: (world size, overrides)
LAYOUTS = {
    "fsdp2-zero3": (2, ["parallel.dp_mode=fsdp", "parallel.reshard_after_forward=true"]),
    "fsdp2-zero2": (2, ["parallel.dp_mode=fsdp", "parallel.reshard_after_forward=false"]),
    "tp2": (2, ["parallel.tp=2", "parallel.sequence_parallel=false"]),
    "tp2-sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "cp2-ulysses": (2, ["parallel.cp=2", "parallel.cp_mode=ulysses"]),
    "cp2-ring": (2, ["parallel.cp=2", "parallel.cp_mode=ring"]),
    "fsdp4-zero3": (4, ["parallel.dp_mode=fsdp", "parallel.reshard_after_forward=true"]),
    "fsdp4-zero2": (4, ["parallel.dp_mode=fsdp", "parallel.reshard_after_forward=false"]),
}
# Mesh dims in the order used to name a process group (flattened dims may share a group).
GROUP_LABELS = ("tp", "cp", "dp_shard_cp", "dp_shard", "dp", "dp_cp", "dp_replicate", "pp")


# ----------------------------------------------------------------------------- counting
def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


def _pg(obj):
    import torch.distributed as dist
    return dist.ProcessGroup.unbox(obj) if isinstance(obj, torch.ScriptObject) else obj


def _named_pg(name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group
    return _resolve_process_group(name)


def _classify(ns: str, op: str, args, kwargs):
    """(kind, group, buffer bytes, wire bytes) of one communication op, or None if it moves
    nothing (wait_tensor, barriers, autograd wrappers)."""
    import torch.distributed as dist
    if ns == "c10d":
        pg = next((_pg(a) for a in args if isinstance(a, (torch.ScriptObject, dist.ProcessGroup))), None)
        n = pg.size() if pg is not None else 1
        if op in ("barrier", "monitored_barrier_"):
            return None
        if op == "_allgather_base_":  # (output, input, ...)
            out, inp = _nbytes(args[0]), _nbytes(args[1])
            return "all_gather", pg, out, out - inp
        if op in ("allgather_", "allgather_coalesced_", "allgather_into_tensor_coalesced_"):
            out, inp = _nbytes(args[0]), _nbytes(args[1])
            return "all_gather", pg, out, out - inp
        if op == "_reduce_scatter_base_":  # (output, input, ...)
            out, inp = _nbytes(args[0]), _nbytes(args[1])
            return "reduce_scatter", pg, inp, inp - out
        if op in ("reduce_scatter_", "reduce_scatter_tensor_coalesced_"):
            out, inp = _nbytes(args[0]), _nbytes(args[1])
            return "reduce_scatter", pg, inp, inp - out
        if op in ("allreduce_", "allreduce_coalesced_"):
            b = _nbytes(args[0])
            return "all_reduce", pg, b, 2 * (n - 1) * b / n
        if op == "alltoall_base_":  # (output, input, pg, output_splits, input_splits, ...)
            inp = args[1]
            splits = list(args[4]) if len(args) > 4 and args[4] else None
            rows = inp.shape[0] if inp.dim() else 1
            own_rows = splits[dist.get_rank(pg)] if splits else rows / n
            b = _nbytes(inp)
            return "all_to_all", pg, b, b * (1 - own_rows / max(rows, 1))
        if op == "alltoall_":  # (output_tensors, input_tensors, pg, ...)
            b = _nbytes(args[1])
            return "all_to_all", pg, b, b - _nbytes(args[1][dist.get_rank(pg)])
        if op == "send":
            b = _nbytes(args[0])
            return "send", pg, b, b
        if op in ("recv_", "recv_any_source_"):
            return "recv", pg, _nbytes(args[0]), 0
        if op == "broadcast_":
            b = _nbytes(args[0])
            return "broadcast", pg, b, b * (n - 1) / n
        return f"other:{op}", pg, _nbytes(list(args)), _nbytes(list(args))
    # functional collectives: group given by name (last string argument)
    if op in ("wait_tensor", "_wrap_tensor_autograd"):
        return None
    name = next((a for a in reversed(args) if isinstance(a, str)), kwargs.get("group_name"))
    pg = _named_pg(name) if name else None
    n = pg.size() if pg is not None else 1
    base = op.removesuffix("_")
    if base in ("all_gather_into_tensor", "all_gather_into_tensor_out", "all_gather_into_tensor_coalesced"):
        inp = _nbytes(args[0])
        return "all_gather", pg, inp * n, inp * (n - 1)
    if base in ("reduce_scatter_tensor", "reduce_scatter_tensor_coalesced"):
        inp = _nbytes(args[0])
        return "reduce_scatter", pg, inp, inp * (n - 1) / n
    if base in ("all_reduce", "all_reduce_coalesced"):
        b = _nbytes(args[0])
        return "all_reduce", pg, b, 2 * (n - 1) * b / n
    if base == "all_to_all_single":  # (input, output_split_sizes, input_split_sizes, group_name)
        inp = args[0]
        splits = list(args[2]) if len(args) > 2 and args[2] else None
        rows = inp.shape[0] if inp.dim() else 1
        own_rows = splits[dist.get_rank(pg)] if splits else rows / n
        b = _nbytes(inp)
        return "all_to_all", pg, b, b * (1 - own_rows / max(rows, 1))
    if base == "broadcast":
        b = _nbytes(args[0])
        return "broadcast", pg, b, b * (n - 1) / n
    return f"other:{op}", pg, _nbytes(list(args)), _nbytes(list(args))


def _make_counter():
    from torch.utils._python_dispatch import TorchDispatchMode

    class CommCounter(TorchDispatchMode):
        """Adds up (kind, group) -> calls, buffer bytes, wire bytes for every collective op."""

        def __init__(self):
            super().__init__()
            self.records: dict[tuple[str, str], list] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            ns = func.namespace
            if ns in ("c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd"):
                got = _classify("c10d" if ns == "c10d" else "funcol", func._opname, args, kwargs)
                if got is not None:
                    kind, pg, buf, wire = got
                    key = (kind, pg.group_name if pg is not None else "?")
                    rec = self.records.setdefault(key, [0, 0, 0.0])
                    rec[0] += 1
                    rec[1] += buf
                    rec[2] += wire
            return func(*args, **kwargs)

    return CommCounter()


# ----------------------------------------------------------------------------- one rank
def _group_labels(mesh) -> dict[str, str]:
    labels: dict[str, str] = {}
    if mesh is None:
        return labels
    for dim in GROUP_LABELS:
        try:
            m = submesh(mesh, dim)
        except Exception:  # noqa: BLE001 - a dim this mesh lacks
            continue
        if m.size() > 1:
            labels.setdefault(m.get_group().group_name, dim)
    return labels


def _model_facts(model, cfg) -> dict:
    """Shapes the analytical values need, read before parallelize changes the parameters."""
    from torch import nn
    blocks = {id(p) for p in model.blocks.parameters()}
    block0 = model.blocks[0]
    regions = ("attn", "cross_attn", "mlp")
    plain_in_region = plain_all = 0
    for mod_name, mod in block0.named_modules():
        if isinstance(mod, nn.Linear):
            continue  # split (or replicated) as DTensors by the TP plan
        for _, p in mod.named_parameters(recurse=False):
            plain_all += p.numel()
            if any(mod_name == r or mod_name.startswith(r + ".") for r in regions):
                plain_in_region += p.numel()
    mc = model.cfg
    return {"block_shapes": [list(p.shape) for p in block0.parameters()],
            "root_shapes": [list(p.shape) for p in model.parameters() if id(p) not in blocks],
            "depth": mc.depth, "hidden": mc.hidden, "heads": mc.heads, "tokens": mc.num_tokens,
            "text_len": cfg.text.context_length, "batch": BATCH, "elem": 4,
            "tp_plain_in_region": plain_in_region, "tp_plain_all": plain_all,
            "params": sum(p.numel() for p in model.parameters())}


def _rank(rank, world_size, names):
    import torch.nn.functional as F

    from common.config import build_config
    from common.dist import DistInfo
    from pipelines.text2image import components
    from pipelines.text2image.config import T2IConfig
    from common.nn.dit_parallel import parallelize_dit as parallelize

    info = DistInfo(rank, world_size, rank, torch.device("cpu"))
    out = {}
    for name in names:
        _, overrides = LAYOUTS[name]
        cfg = build_config(T2IConfig, None, MODEL + overrides)
        comp = components.build(cfg)
        facts = _model_facts(comp.model, cfg)
        t0 = time.time()
        try:
            pm = parallelize(comp.model, cfg.parallel, info, criterion=F.mse_loss)
        except NotImplementedError as e:
            out[name] = {"status": "not available", "error": f"NotImplementedError {e}".strip(), "facts": facts}
            continue
        g = torch.Generator().manual_seed(0)  # the same batch on every rank (TP/CP need it; DP does not care)
        c, s = comp.latent_channels, comp.latent_size
        x, target = torch.randn(BATCH, c, s, s, generator=g), torch.randn(BATCH, c, s, s, generator=g)
        t = torch.rand(BATCH, generator=g)
        ctx = torch.randn(BATCH, cfg.text.context_length, cfg.text.width, generator=g)
        mask = torch.ones(BATCH, cfg.text.context_length, dtype=torch.bool)
        steps = []
        for _ in range(2):
            counter = _make_counter()
            with counter:
                loss = F.mse_loss(pm.module(x, t, ctx, mask), target)
                loss.backward()
                for hook in pm.grad_hooks:
                    hook()
            pm.module.zero_grad(set_to_none=True)
            labels = _group_labels(pm.mesh)
            steps.append({f"{kind}|{labels.get(group, group)}": rec for (kind, group), rec in counter.records.items()})
        out[name] = {"status": "ok", "dims": pm.dims.describe, "facts": facts, "step1": steps[0], "step2": steps[1],
                     "seconds": time.time() - t0}
        del pm, comp
    return out


# ----------------------------------------------------------------------------- analytical
def _fsdp_bytes(shapes, n, elem):
    """(padded, unpadded) bytes of a unit's parameters as FSDP2 all-gathers them."""
    padded = unpadded = 0
    for shape in shapes:
        d0 = shape[0] if shape else 1
        row = math.prod(shape[1:]) * elem
        padded += n * -(-d0 // n) * row
        unpadded += d0 * row
    return padded, unpadded


def analytical(name: str, world: int, f: dict) -> dict[str, dict]:
    """kind -> {"buffer", "wire", "formula"} for one step of this layout (per rank)."""
    e, depth, d, b, lt = f["elem"], f["depth"], f["hidden"], f["batch"], f["text_len"]
    L = f["tokens"]
    rows: dict[str, dict] = {}

    def add(kind, buf, wire, formula):
        r = rows.setdefault(kind, {"buffer": 0, "wire": 0.0, "formula": []})
        r["buffer"] += buf
        r["wire"] += wire
        r["formula"].append(formula)

    def fsdp(n, zero3):
        blk, blk_raw = _fsdp_bytes(f["block_shapes"], n, e)
        root, root_raw = _fsdp_bytes(f["root_shapes"], n, e)
        params = depth * blk + root
        gathers = 2 if zero3 else 1
        add("all_gather", gathers * params, gathers * params * (n - 1) / n,
            f"FSDP {gathers} x params ({depth} blocks x {blk} + root {root} B, padded; unpadded "
            f"{depth * blk_raw + root_raw} B) [FSDP: dp_shard_cp]")
        add("reduce_scatter", params, params * (n - 1) / n, f"FSDP 1 x grads ({params} B padded) [FSDP: dp_shard_cp]")

    bld, bltd = b * L * d * e, b * lt * d * e
    if name.startswith("fsdp"):
        fsdp(world, "zero3" in name)
    elif name.startswith("tp"):
        n = world  # these layouts put every rank in the one TP / CP group
        sp = name.endswith("-sp")
        if not sp:
            ar = depth * (6 * bld + bltd) + depth * f["tp_plain_in_region"] * e
            add("all_reduce", ar, 2 * (n - 1) / n * ar,
                f"{depth} blocks x (3 fwd + 3 bwd) x B*L*D ({bld} B) + {depth} x context grad B*Lt*D ({bltd} B) "
                f"+ partial-grad sync {depth} x {f['tp_plain_in_region']} params [tp]")
        else:
            ag = depth * 6 * bld + 2 * bld
            rs = depth * 6 * bld
            ar = depth * (bltd + b * 6 * d * e) + depth * f["tp_plain_all"] * e
            add("all_gather", ag, ag * (n - 1) / n,
                f"{depth} blocks x (3 fwd + 3 bwd) x B*L*D + 2 stack boundaries (fwd output, bwd input) [tp]")
            add("reduce_scatter", rs, rs * (n - 1) / n, f"{depth} blocks x (3 fwd + 3 bwd) x B*L*D [tp]")
            add("all_reduce", ar, 2 * (n - 1) / n * ar,
                f"{depth} x (context grad B*Lt*D {bltd} B + t0 grad B*6D {b * 6 * d * e} B) "
                f"+ partial-grad sync {depth} x {f['tp_plain_all']} params [tp]")
    elif name.startswith("cp"):
        n = world  # these layouts put every rank in the one TP / CP group
        local = bld // n
        if "ulysses" in name:
            a2a = depth * 8 * local
            add("all_to_all", a2a, a2a * (n - 1) / n, f"{depth} self-attn x (4 fwd + 4 bwd) x B*L/cp*D ({local} B) [cp]")
        else:
            sends = depth * ((n - 1) + (n - 1) + n) * 2 * local
            add("send", sends, sends, f"{depth} self-attn x ({n - 1} fwd K/V + {n - 1} bwd K/V + {n} bwd dK/dV) "
                                      f"x 2*B*L/cp*D ({2 * local} B) [cp]")
            add("recv", sends, 0, "= sends of the ring neighbour (wire counted at the sender) [cp]")
        add("all_gather", bld, bld * (n - 1) / n, "CP gather of the block output B*L*D before the final layer [cp]")
        fsdp(n, True)
    for r in rows.values():
        r["formula"] = "; ".join(r["formula"])
    return rows


# ----------------------------------------------------------------------------- report
def _fmt(x) -> str:
    return "-" if x is None else f"{x / 2**20:9.3f}"


def report(results: dict, world_of: dict) -> dict:
    table = []
    print("\nbytes per rank per training step (forward + backward + grad hooks), MiB; wire = ring-algorithm bytes sent")
    print(f"{'layout':<13} {'collective':<15} {'group':<12} {'calls':>5} {'buffer':>9} {'analyt.':>9} "
          f"{'wire':>9} {'analyt.':>9} {'ratio':>6}")
    for name, res in results.items():
        if res["status"] != "ok":
            print(f"{name:<13} not available ({res['error'][:90]})")
            table.append({"layout": name, "status": "not available", "error": res["error"]})
            continue
        ana = analytical(name, world_of[name], res["facts"])
        measured: dict[str, dict] = {}
        for key, (calls, buf, wire) in res["step2"].items():
            kind, group = key.split("|", 1)
            m = measured.setdefault(kind, {"calls": 0, "buffer": 0, "wire": 0.0, "groups": {}})
            m["calls"] += calls
            m["buffer"] += buf
            m["wire"] += wire
            m["groups"][group] = m["groups"].get(group, 0) + buf
        for kind in sorted(set(measured) | set(ana)):
            m, a = measured.get(kind), ana.get(kind)
            ratio = (m["wire"] / a["wire"]) if m and a and a["wire"] else (
                (m["buffer"] / a["buffer"]) if m and a and a["buffer"] else None)
            groups = ",".join(sorted(m["groups"])) if m else "-"
            print(f"{name:<13} {kind:<15} {groups:<12} {m['calls'] if m else 0:>5} {_fmt(m and m['buffer'])} "
                  f"{_fmt(a and a['buffer'])} {_fmt(m and m['wire'])} {_fmt(a and a['wire'])} "
                  f"{'-' if ratio is None else f'{ratio:6.3f}'}")
            table.append({"layout": name, "dims": res["dims"], "collective": kind, "groups": m["groups"] if m else {},
                          "calls": m["calls"] if m else 0,
                          "measured_buffer_bytes": m["buffer"] if m else 0, "measured_wire_bytes": m["wire"] if m else 0,
                          "analytical_buffer_bytes": a["buffer"] if a else 0,
                          "analytical_wire_bytes": a["wire"] if a else 0,
                          "ratio": ratio, "formula": a["formula"] if a else "not expected"})
        if res["step1"] != res["step2"]:
            print(f"{'':<13} (first step differed: {res['step1']})")
    return {"table": table}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--json", default=os.path.join(ROOT, "bench/results/comm_volume.json"))
    args = ap.parse_args()
    names = [n for n in args.layouts.split(",") if n]
    bad = [n for n in names if n not in LAYOUTS]
    if bad:
        raise SystemExit(f"unknown layouts {bad}; choose from {list(LAYOUTS)}")
    from dist_harness import run_ranks

    start = time.time()
    results: dict = {}
    world_of = {n: LAYOUTS[n][0] for n in names}
    # One launch per world size: process start-up is paid once, each layout builds its own mesh.
    for world in sorted(set(world_of.values())):
        group = [n for n in names if world_of[n] == world]
        per_rank = run_ranks(_rank, world, (group,), timeout=600)
        for n in group:
            res = per_rank[0][n]
            if res["status"] == "ok":
                res["ranks_agree"] = all(r[n]["step2"] == res["step2"] for r in per_rank)
                if not res["ranks_agree"]:
                    print(f"note: {n}: ranks moved different byte counts; rank 0 shown")
            results[n] = res
    out = report({n: results[n] for n in names}, world_of)
    facts = next(iter(results.values()))["facts"]
    out.update({"model": MODEL, "batch": BATCH, "params": facts["params"], "dtype": "float32",
                "torch": torch.__version__, "seconds": time.time() - start,
                "per_layout": {n: {k: v for k, v in r.items() if k != "facts"} for n, r in results.items()}})
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as fh:
        json.dump(out, fh, indent=1, default=str)
    print(f"\n{len(names)} layouts in {time.time() - start:.0f} s; wrote {os.path.relpath(args.json, ROOT)}")


if __name__ == "__main__":
    main()
