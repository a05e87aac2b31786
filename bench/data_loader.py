"""Data-loader throughput (decode + transform, samples/s) against the training step's consumption.

Builds small shard sets in a temp dir, then for each kind measures
  - decode/worker: the decoder alone in this process over pre-read samples, on one torch thread
    as in a loader worker (one worker's ceiling),
  - loader w=1 and w=D: StreamingLoader end to end (shard reads, decode, collate, IPC) with one
    worker and with DataConfig's default num_workers D; per worker = total / workers,
and the text2image training step's samples/s (bench/t2i_cpu.py's method: batches made up in
memory, text tower included) for the tiny config and the base config (at its model size, a few
small-batch steps; `--base S` uses t2i_cpu's "S" preset as a cheaper proxy). It prints
loader / consumption for the pairs where the data kind matches the config; the target is >= 5x
with the default worker count.

Data kinds: synth32 (data.synth PNG, 32 px: what tiny trains on), synth64 (PNG, 64 px: base.yaml's
data), jpg256 (256 px JPEG q95 -> ImageDecoder(256)), latent (float16 (4, 32, 32) latent.npy ->
ImageDecoder(use_latents=True)), video (16-frame 256 px H.264 clips from `make_shards videos` ->
VideoDecoder(16, 256)).

  python bench/data_loader.py [--seconds 3] [--kinds synth32,jpg256,latent,video,synth64]
                              [--base full|S|none] [--json OUT]
"""
from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from fractions import Fraction

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from common.config import DataConfig  # noqa: E402
from common.data import ShardIndex, StreamingLoader, expand_shards  # noqa: E402
from common.data.media import VideoDecoder  # noqa: E402
from common.data.images import ImageDecoder  # noqa: E402

KINDS = ("synth32", "synth64", "jpg256", "latent", "video")
# Which data each config consumes (kind -> config); base.yaml trains on 64 px pixels, and at scale
# on 256 px images or their precomputed latents, so all three are compared against it.
PAIRS = {"tiny": ("synth32",), "base": ("synth64", "jpg256", "latent")}
TARGET_RATIO = 5.0
BASE_OVERRIDES = {  # base.yaml's model and text tower on top of tiny.yaml (what t2i_cpu loads)
    "full": ["model.preset=B", "model.image_size=64", "model.patch_size=4", "text.width=512",
             "text.layers=12", "text.heads=8", "text.context_length=77"],
}


# ------------------------------------------------------------------------------------ data sets
def _smooth_image(rng: np.random.Generator, size: int) -> np.ndarray:
    """Photo-like content (JPEG cost depends on it): upsampled low-res noise plus fine noise."""
    from PIL import Image
    low = rng.integers(0, 256, (size // 16, size // 16, 3), dtype=np.uint8)
    img = np.asarray(Image.fromarray(low).resize((size, size), Image.BICUBIC), dtype=np.int16)
    img = img + rng.integers(-12, 13, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def make_jpg(out: str, n: int, size: int = 256, shard_size: int = 64) -> None:
    import webdataset as wds
    from PIL import Image
    rng = np.random.default_rng(0)
    os.makedirs(out, exist_ok=True)
    w = None
    for i in range(n):
        if i % shard_size == 0:
            w and w.close()
            w = wds.TarWriter(os.path.join(out, f"shard-{i // shard_size:06d}.tar"))
        buf = io.BytesIO()
        Image.fromarray(_smooth_image(rng, size)).save(buf, format="JPEG", quality=95, subsampling=0)
        w.write({"__key__": f"{i:09d}", "jpg": buf.getvalue(), "txt": f"synthetic image {i}"})
    w.close()


def make_latent(out: str, n: int, shard_size: int = 256) -> None:
    import webdataset as wds
    rng = np.random.default_rng(0)
    os.makedirs(out, exist_ok=True)
    w = None
    for i in range(n):
        if i % shard_size == 0:
            w and w.close()
            w = wds.TarWriter(os.path.join(out, f"shard-{i // shard_size:06d}.tar"))
        buf = io.BytesIO()
        np.save(buf, rng.standard_normal((4, 32, 32)).astype(np.float16))
        w.write({"__key__": f"{i:09d}", "latent.npy": buf.getvalue(), "txt": f"latent {i}"})
    w.close()


def make_source_videos(out: str, n: int, frames: int, fps: int = 8, h: int = 288, w: int = 352) -> None:
    """Short moving-pattern videos (sidecar .txt captions) for `make_shards videos`."""
    import av
    os.makedirs(out, exist_ok=True)
    codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
    rng = np.random.default_rng(0)
    for i in range(n):
        base = _smooth_image(rng, max(h, w) * 2)
        with av.open(os.path.join(out, f"v{i:04d}.mp4"), "w") as c:
            st = c.add_stream(codec, rate=Fraction(fps))
            st.height, st.width, st.pix_fmt = h, w, "yuv420p"
            st.codec_context.thread_count = 1
            for t in range(frames):
                dy, dx = 5 * t % h, 7 * t % w  # a pan: real motion, realistic P-frames
                arr = np.ascontiguousarray(base[dy:dy + h, dx:dx + w])
                for pkt in st.encode(av.VideoFrame.from_ndarray(arr, format="rgb24")):
                    c.mux(pkt)
            for pkt in st.encode():
                c.mux(pkt)
        with open(os.path.join(out, f"v{i:04d}.txt"), "w") as f:
            f.write(f"a panning video {i}\n")


def make_video(out: str, n: int, frames: int, size: int, tmp: str) -> None:
    src = os.path.join(tmp, "video_src")
    make_source_videos(src, n, frames + 4)
    cmd = [sys.executable, "-m", "data.make_shards", "videos", "--input", src, "--out", out,
           "--frames", str(frames), "--size", str(size), "--workers", "1", "--no-progress"]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)


def make_data(kind: str, tmp: str, args) -> tuple[str, object, int]:
    """(shard dir, decoder, micro-batch size) for one kind."""
    out = os.path.join(tmp, kind)
    if kind in ("synth32", "synth64"):
        from data.synth import generate
        size = int(kind[5:])
        generate(out, count=args.images, heldout_count=8, size=size, shard_size=256, seed=0,
                 progress=False)
        return os.path.join(out, "train"), ImageDecoder(size), 32
    if kind == "jpg256":
        make_jpg(out, args.images)
        return out, ImageDecoder(256), 16
    if kind == "latent":
        make_latent(out, args.images)
        return out, ImageDecoder(256, use_latents=True), 32
    if kind == "video":
        make_video(out, args.videos, args.frames, args.video_size, tmp)
        return out, VideoDecoder(args.frames, args.video_size), 4
    raise ValueError(kind)


# ---------------------------------------------------------------------------------- measurement
def decode_rate(shards: str, decode, seconds: float) -> float:
    """The decoder alone, in this process, over samples already read from the shards."""
    index = ShardIndex(expand_shards(shards))
    raw = [index.read(s, i) for s in range(len(index.shard_sizes))
           for i in range(min(index.shard_sizes[s], 64))][:128]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in a loader worker (torch sets 1 thread there)
    try:
        decode(raw[0])
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            decode(raw[n % len(raw)])
            n += 1
        return n / (time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)


def loader_rate(shards: str, decode, batch: int, workers: int, seconds: float) -> float:
    """End-to-end StreamingLoader samples/s after the first batch (worker start-up excluded)."""
    ld = StreamingLoader(shards, decode, micro_batch_size=batch, num_workers=workers, seed=0,
                         prefetch_factor=2)
    it = iter(ld)
    next(it)
    for _ in range(workers):  # let every worker deliver once: all started and indexed
        next(it)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds or n < 2 * batch:
        b = next(it)
        n += len(b["__key__"])
    rate = n / (time.perf_counter() - t0)
    del it
    return rate


def consumption(base_mode: str, tiny_batch: int, tiny_steps: int, base_batch: int,
                base_steps: int) -> dict:
    from bench.t2i_cpu import CONFIGS, bench
    out = {"tiny": bench("tiny", CONFIGS["tiny"], tiny_batch, tiny_steps, 1.0)}
    if base_mode != "none":
        ov = BASE_OVERRIDES["full"] if base_mode == "full" else CONFIGS["S"]
        out["base"] = bench("base" if base_mode == "full" else "base~S", ov, base_batch, base_steps, 1.0)
    for r in out.values():
        for k in ("mfu", "peak_gflops"):  # peak not measured here (would cost time)
            r.pop(k, None)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--kinds", default=",".join(KINDS), help=f"data kinds (default all: {','.join(KINDS)})")
    p.add_argument("--seconds", type=float, default=3.0, help="timed seconds per loader measurement")
    p.add_argument("--images", type=int, default=256, help="samples per image/latent data set")
    p.add_argument("--videos", type=int, default=16, help="source videos (one 16-frame clip each)")
    p.add_argument("--frames", type=int, default=16, help="frames per clip")
    p.add_argument("--video-size", type=int, default=256, help="clip side in pixels")
    p.add_argument("--workers", type=int, default=None,
                   help="the 'default' worker count (default: DataConfig.num_workers)")
    p.add_argument("--base", choices=("full", "S", "none"), default="full",
                   help="base consumption: base.yaml's model size (few small-batch steps), "
                        "t2i_cpu's S preset as a proxy, or skip")
    p.add_argument("--tiny-batch", type=int, default=32)
    p.add_argument("--tiny-steps", type=int, default=5)
    p.add_argument("--base-batch", type=int, default=4, help="base step batch (samples/s is per sample)")
    p.add_argument("--base-steps", type=int, default=1)
    p.add_argument("--json", default=os.path.join(ROOT, "bench", "results", "data_loader.json"))
    args = p.parse_args()
    default_workers = args.workers if args.workers is not None else DataConfig().num_workers
    torch.manual_seed(0)
    t_start = time.perf_counter()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"cores {os.cpu_count()}, torch threads {torch.get_num_threads()}, load avg {load:.2f}, "
          f"default num_workers {default_workers}")

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_data_") as tmp:
        for kind in args.kinds.split(","):
            t0 = time.perf_counter()
            shards, dec, batch = make_data(kind, tmp, args)
            made = time.perf_counter() - t0
            r = {"kind": kind, "batch": batch, "make_s": made,
                 "decode_per_worker": decode_rate(shards, dec, args.seconds / 2),
                 "loader_w1": loader_rate(shards, dec, batch, 1, args.seconds),
                 "workers": default_workers,
                 "loader_default": loader_rate(shards, dec, batch, default_workers, args.seconds)}
            r["loader_default_per_worker"] = r["loader_default"] / max(1, default_workers)
            rows.append(r)
            print(f"  {kind:8} made in {made:.1f}s: decode {r['decode_per_worker']:.0f}/s, loader w=1 "
                  f"{r['loader_w1']:.0f}/s, w={default_workers} {r['loader_default']:.0f}/s", flush=True)

    print("measuring training-step consumption ...", flush=True)
    cons = consumption(args.base, args.tiny_batch, args.tiny_steps, args.base_batch, args.base_steps)

    print(f"\n{'kind':8} {'batch':>5} {'decode/worker':>13} {'loader w=1':>10} "
          f"{'loader w=' + str(default_workers):>10} {'per worker':>10}   (samples/s)")
    for r in rows:
        print(f"{r['kind']:8} {r['batch']:5d} {r['decode_per_worker']:13.1f} {r['loader_w1']:10.1f} "
              f"{r['loader_default']:10.1f} {r['loader_default_per_worker']:10.1f}")
    print(f"\n{'config':8} {'params':>8} {'tokens':>6} {'batch':>5} {'step s':>8} {'samples/s':>10}")
    for name, c in cons.items():
        print(f"{c['config']:8} {c['params_m']:7.2f}M {c['tokens']:6d} {c['batch']:5d} "
              f"{c['step_s']:8.3f} {c['samples_per_s']:10.2f}")

    ratios = []
    by_kind = {r["kind"]: r for r in rows}
    print(f"\n{'config':8} {'data':8} {'consume/s':>10} {'loader w=' + str(default_workers) + '/s':>13} "
          f"{'ratio':>8} {'w=1 ratio':>9}  target >= {TARGET_RATIO:g}x")
    for cfg, kinds in PAIRS.items():
        if cfg not in cons:
            continue
        c = cons[cfg]["samples_per_s"]
        for k in kinds:
            if k not in by_kind:
                continue
            r = by_kind[k]
            ratio, ratio1 = r["loader_default"] / c, r["loader_w1"] / c
            ok = ratio >= TARGET_RATIO
            ratios.append({"config": cons[cfg]["config"], "kind": k, "consumption": c,
                           "loader_default": r["loader_default"], "ratio": ratio,
                           "ratio_w1": ratio1, "ok": ok})
            print(f"{cons[cfg]['config']:8} {k:8} {c:10.2f} {r['loader_default']:13.1f} {ratio:7.1f}x "
                  f"{ratio1:8.1f}x  {'ok' if ok else 'BELOW TARGET'}")
    total = time.perf_counter() - t_start
    print(f"\ntotal {total:.0f}s. Caveat: loader workers and the measuring process share "
          f"{os.cpu_count()} cores with whatever else runs (load avg at start {load:.2f}); in "
          "training the step competes with the workers for the same cores.")
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                   "load_avg_start": load, "default_workers": default_workers,
                   "seconds": args.seconds, "loader": rows, "consumption": cons, "ratios": ratios,
                   "target_ratio": TARGET_RATIO, "total_s": total}, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
