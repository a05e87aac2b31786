"""text2video: clip decoding and MP4/GIF writers (fast), layout refusals (fast), and end to end
on a small synthetic video set (slow, subprocesses): run-dir layout with an MP4 sample, the
sample/eval CLIs, exact resume after a kill, a corrupt clip skipped and counted, joint
image-video training with buckets, and context parallelism (Ulysses, ring, FSDP x CP) and
tensor parallelism with factorized attention matching the single-process run step by step."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.conftest import ROOT, assert_same_losses_to_rounding, env, read_metrics, run_module, shared_once

TINY_YAML = os.path.join(ROOT, "pipelines/text2video/configs/tiny.yaml")
# 8 frames of 32 px, patches 2 x 4 x 4 -> 256 tokens; a model that runs a step in well under a second.
SMALL_MODEL = ["model.hidden=32", "model.depth=2", "model.heads=2", "text.width=32", "text.layers=1",
               "text.heads=2", "text.context_length=16", "sample.steps=2", "sample.num=2", "sample.scale=1",
               "train.progress=false", "data.num_workers=0"]


@pytest.fixture(scope="module")
def video_data(tmp_path_factory):
    from data.synth_video import generate_video
    return shared_once(tmp_path_factory, "synth-video", lambda out: generate_video(
        out, count=32, heldout_count=4, size=32, frames=8, shard_size=8, seed=0))


def run_t2v(run_dir: str, data_dir: str, *overrides: str, nproc: int = 1, check: bool = True,
            timeout: int = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pipelines.text2video.train"] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
        "-m", "pipelines.text2video.train"]
    args = cmd + ["--config", TINY_YAML, f"run.dir={run_dir}", f"data.train_shards={data_dir}/train",
                  f"data.eval_shards={data_dir}/heldout", *SMALL_MODEL, *overrides]
    proc = subprocess.run(args, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"train failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


# --------------------------------------------------------------------------- fast
def test_clip_decoder_npy_mp4_and_image():
    from PIL import Image

    from data.sources.video import encode_mp4
    from pipelines.text2video.data import ClipDecoder

    def encode_npy(a):
        buf = io.BytesIO()
        np.save(buf, a, allow_pickle=False)
        return buf.getvalue()
    rng = np.random.default_rng(0)
    frames = np.repeat(rng.integers(0, 256, (8, 8, 8, 3), dtype=np.uint8), 4, axis=1).repeat(4, axis=2)  # 8x32x32
    dec = ClipDecoder(frames=6, size=32)
    out = dec({"npy": encode_npy(frames), "txt": b" a clip "})
    assert out["caption"] == "a clip" and out["video"].shape == (3, 6, 32, 32)  # (C, T, H, W)
    expect = torch.from_numpy(frames[:6]).permute(3, 0, 1, 2).float() / 127.5 - 1
    torch.testing.assert_close(out["video"], expect)  # npy is lossless
    mp4, _ = encode_mp4(list(frames), 8.0)
    v = dec({"mp4": mp4, "txt": b"x"})["video"]
    assert v.shape == (3, 6, 32, 32) and v.min() >= -1 and v.max() <= 1
    assert ClipDecoder(6, 16)({"npy": encode_npy(frames), "txt": b"x"})["video"].shape == (3, 6, 16, 16)
    buf = io.BytesIO()
    Image.fromarray(frames[0]).save(buf, format="PNG")
    img = ClipDecoder(6, 32)({"png": buf.getvalue(), "txt": b"x", "__bucket__": (1, 32, 32)})["video"]
    assert img.shape == (3, 1, 32, 32)
    with pytest.raises(ValueError, match="buckets"):  # an image cannot fill an 8-frame batch
        ClipDecoder(6, 32)({"png": buf.getvalue(), "txt": b"x"})
    with pytest.raises(ValueError):
        dec({"mp4": mp4[:50], "txt": b"x"})  # truncated clip -> corrupt
    with pytest.raises(ValueError, match="no video"):
        dec({"txt": b"x"})


def test_mp4_gif_grid_writers_round_trip(tmp_path):
    from common.data.media import decode_video
    from pipelines.text2video.components import save_video_grid, tile
    clips = torch.zeros(3, 4, 8, 8, 3, dtype=torch.uint8)
    clips[1] = 200
    clips[2] = torch.arange(4, dtype=torch.uint8).mul(60).view(4, 1, 1, 1)  # frames differ (GIF keeps them)
    grid = tile(clips)
    assert grid.shape == (4, 2 * 10 + 2, 2 * 10 + 2, 3) and (grid[:, 2:10, 12:20] == 200).all()
    paths = save_video_grid(clips, str(tmp_path / "g"), fps=8.0, scale=2)
    v = decode_video(open(paths[0], "rb").read(), dtype=torch.uint8)
    assert v.shape == (4, 3, 44, 44)  # T, C, H, W; upscaled x2
    from PIL import Image
    gif = Image.open(paths[1])
    assert gif.n_frames == 4 and gif.size == (44, 44)


def _parallelize_error(*overrides: str, world_size: int) -> str:
    from common.config import ConfigError, build_config
    from common.dist import DistInfo
    from pipelines.text2video import components
    from pipelines.text2video.config import T2VConfig
    from pipelines.text2video.spec import SPEC
    cfg = build_config(T2VConfig, TINY_YAML, [*SMALL_MODEL, *overrides])
    comp = components.build(cfg)
    info = DistInfo(0, world_size, 0, torch.device("cpu"))
    with pytest.raises(ConfigError) as e:
        SPEC.parallelize(comp.model, cfg.parallel, info, name=SPEC.name)
    return str(e.value)


def test_mp4_writer_pads_odd_frame_sizes(tmp_path):
    """H.264 in yuv420p needs even sides: an odd-sized clip gets one white row/column, not an error."""
    from common.data.media import decode_video
    from pipelines.text2video.components import save_mp4
    frames = np.zeros((3, 33, 31, 3), dtype=np.uint8)
    save_mp4(frames, str(tmp_path / "odd.mp4"), fps=8.0)
    v = decode_video(open(tmp_path / "odd.mp4", "rb").read(), dtype=torch.uint8)
    assert v.shape == (3, 3, 34, 32) and int(v[:, :, :33, :31].max()) < 16 and int(v[:, :, 33].min()) > 239


def test_unsupported_layouts_fail_at_start():
    assert "factorized" in _parallelize_error("parallel.cp=2", "model.attention=factorized", world_size=2)
    assert "not supported for text2video" in _parallelize_error("parallel.pp=2", world_size=2)


def test_prepare_builds_clip_flow_examples():
    from common.config import build_config
    from pipelines.text2video import components
    from pipelines.text2video.config import T2VConfig
    cfg = build_config(T2VConfig, TINY_YAML, SMALL_MODEL)
    comp = components.build(cfg)
    prepare, criterion = components.make_step_fns(comp, torch.device("cpu"))
    batch = {"video": torch.rand(2, 3, 8, 32, 32) * 2 - 1, "caption": ["a", "b"], "__position__": torch.tensor([0, 1])}
    (x_t, t, ctx, mask), target = prepare(batch)
    assert x_t.shape == target.shape == (2, 3, 8, 32, 32) and t.shape == (2,) and ctx.shape[:2] == mask.shape
    (x2, t2, _, _), _ = prepare(batch)
    assert torch.equal(x_t, x2) and torch.equal(t, t2)  # seeded by sample position
    loss = criterion(comp.model(x_t, t, ctx, mask), target)
    assert torch.isfinite(loss)


def test_denoise_probe_reads_motion_from_lightly_noised_clips_only(video_data):
    """A fresh VideoDiT predicts v = 0 (zero final layer), so the probe's one-step prediction is
    x_t itself: motion is readable at t = 0.02 and not from pure noise (t = 1)."""
    from common.config import build_config
    from pipelines.text2video import components
    from pipelines.text2video.config import T2VConfig
    from pipelines.text2video.eval import denoise_probe
    comp = components.build(build_config(T2VConfig, TINY_YAML, SMALL_MODEL))
    probe = denoise_probe(comp, comp.model, f"{video_data}/train", 16, [0.02, 1.0])
    assert probe[0.02]["motion_acc"] >= 0.9 and probe[1.0]["motion_acc"] <= 0.5, probe
    # The prediction is the clip itself, whatever the caption says: a reversed caption is not followed.
    assert probe[0.02]["reversed_followed"] <= 0.1, probe


def test_denoise_probe_counts_reversed_captions_a_model_follows(video_data):
    """An oracle that ignores the noisy clip and returns a real clip of the motion its caption names:
    with the caption reversed, its predictions move the reversed way."""
    from types import SimpleNamespace

    from common.data import ShardIndex, expand_shards
    from common.data.captions import read_attributes
    from data.synth_video import MOTIONS
    from pipelines.text2video.data import ClipDecoder
    from pipelines.text2video.eval import denoise_probe
    decoder, index = ClipDecoder(8, (32, 32)), ShardIndex(expand_shards(f"{video_data}/train"))
    by_motion = {}
    for shard, size in enumerate(index.shard_sizes):
        for i in range(size):
            s = index.read(shard, i)
            by_motion.setdefault(read_attributes(s)["motion"], decoder(s)["video"])

    def motion_of(caption: str) -> str:
        return next(m for m, phrases in MOTIONS.items() if any(p in caption for p in phrases))

    def oracle(x_t, t, captions, mask):
        clean = torch.stack([by_motion[motion_of(c)] for c in captions])
        return (x_t - clean) / t.view(-1, 1, 1, 1, 1)  # x_t - t v = clean

    oracle.eval = lambda: None
    comp = SimpleNamespace(vae=None, clip_shape=(3, 8, 32, 32), text_encoder=lambda captions: (captions, None))
    probe = denoise_probe(comp, oracle, f"{video_data}/train", 16, [0.9])
    assert probe[0.9]["motion_acc"] >= 0.9 and probe[0.9]["reversed_followed"] >= 0.9, probe


# --------------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_run_dir_layout_mp4_sample_and_clis(video_data, tmp_path):
    run = str(tmp_path / "run")
    run_t2v(run, video_data, "train.steps=4", "train.ckpt_every=2", "train.log_every=1", "data.micro_batch_size=4")
    for path in ("config.yaml", "metrics.jsonl", "checkpoints/latest", "checkpoints/step_00000004/meta.json",
                 "samples/step_00000004.mp4", "samples/step_00000004.gif", "samples/step_00000004.txt"):
        assert os.path.exists(os.path.join(run, path)), path
    from common.data.media import decode_video
    clip = decode_video(open(os.path.join(run, "samples", "step_00000004.mp4"), "rb").read(), dtype=torch.uint8)
    assert clip.shape == (8, 3, 2 + 34, 2 * 34 + 2)  # 2 samples tiled side by side, 8 frames
    metrics = read_metrics(run)
    assert sorted(metrics) == [1, 2, 3, 4]
    assert all(r["loss"] > 0 and r["samples_per_s"] > 0 for r in metrics.values())

    out = str(tmp_path / "samples")
    proc = run_module("pipelines.text2video.sample", "--run", run, "--prompt", "a red circle moving up", "--num", "2",
                      "--out", out, "--steps", "2", "--frames", "4")
    assert proc.returncode == 0, proc.stderr
    index = [json.loads(line) for line in open(os.path.join(out, "index.jsonl"))]
    assert [r["seed"] for r in index] == [0, 1] and all(r["frames"] == 4 for r in index)
    assert all(os.path.isfile(os.path.join(out, r["file"])) and os.path.isfile(os.path.join(out, r["gif"]))
               for r in index)
    assert os.path.isfile(os.path.join(out, "grid.mp4")) and os.path.isfile(os.path.join(out, "grid.gif"))

    proc = run_module("pipelines.text2video.eval", "--run", run, "--num", "2", "--steps", "2", "--word-probe", "2",
                      "--word-probe-times", "0.5,1")
    assert proc.returncode == 0, proc.stderr
    result = json.load(open(os.path.join(run, "eval.json")))
    assert result["n"] == 2 and 0.0 <= result["motion_acc"] <= 1.0 and "motion accuracy" in proc.stdout
    # The word probe on the real model (its figures are checked with oracles in test_word_probe.py).
    assert result["word_probe"]["n"] == 2 and "word probe on 2 held-out real clips" in proc.stdout
    assert result["word_probe"]["times"] == [0.5, 1.0] and len(result["word_probe"]["motion"]["per_time"]) == 2


@pytest.mark.slow
def test_resume_after_kill_is_exact(video_data, tmp_path):
    full, killed = str(tmp_path / "full"), str(tmp_path / "killed")
    common = ["train.steps=6", "train.ckpt_every=3", "train.log_every=1", "train.sample_every=0", "sample.num=0",
              "data.micro_batch_size=4"]
    run_t2v(full, video_data, *common)
    run_t2v(killed, video_data, *common, "train.stop_after=5")
    assert open(os.path.join(killed, "checkpoints", "latest")).read().strip() == "step_00000003"
    run_t2v(killed, video_data, *common, "run.resume=auto")
    a, b = read_metrics(full), read_metrics(killed)
    for step in range(4, 7):
        assert a[step]["loss"] == b[step]["loss"], (step, a[step]["loss"], b[step]["loss"])
        assert a[step]["grad_norm"] == b[step]["grad_norm"], step


@pytest.mark.slow
def test_trains_on_precomputed_text_features(video_data, tmp_path):
    """text2video takes the clips' precomputed caption features (data.precompute --text-encoder,
    the tiny run's tower): 3 steps' losses equal the tower's run to float16 rounding of the
    features, and not bitwise (the stored rows were used)."""
    from data import precompute
    data = tmp_path / "data"
    assert precompute.main([os.path.join(video_data, "train"), "--out", str(data / "train"), "--device", "cpu",
                            "--no-progress", "--text-encoder", "--text-width", "32", "--text-layers", "1",
                            "--text-heads", "2", "--text-context-length", "16", "--text-layer-scale", "1e-3"]) == 0
    os.symlink(os.path.join(video_data, "heldout"), data / "heldout")
    common = ["train.steps=3", "train.log_every=1", "train.sample_every=0", "sample.num=0", "data.micro_batch_size=4",
              "optim.lr=1e-2", "optim.warmup_steps=1"]
    run_t2v(str(tmp_path / "tower"), video_data, *common)
    run_t2v(str(tmp_path / "stored"), str(data), *common)
    assert_same_losses_to_rounding(str(tmp_path / "tower"), str(tmp_path / "stored"), [1, 2, 3])


@pytest.mark.slow
def test_corrupt_clip_is_skipped_and_counted(video_data, tmp_path):
    import webdataset as wds
    shards = tmp_path / "shards"
    shards.mkdir()
    src = wds.WebDataset(os.path.join(video_data, "train", "shard-000000.tar"), shardshuffle=False)
    with wds.TarWriter(str(shards / "shard-000000.tar")) as sink:
        for i, s in enumerate(src):
            sample = {"__key__": s["__key__"], "mp4": s["mp4"], "txt": s["txt"], "json": s["json"]}
            if i == 3:
                sample["mp4"] = s["mp4"][:60]  # truncated clip
            sink.write(sample)
    run = str(tmp_path / "run")
    run_t2v(run, video_data, f"data.train_shards={shards}", "data.micro_batch_size=8", "train.steps=2",
            "train.log_every=1", "sample.num=0")
    metrics = read_metrics(run)
    assert [metrics[s]["corrupt_samples"] for s in (1, 2)] == [1, 2]  # one epoch of 8 per step


@pytest.mark.slow
def test_joint_image_video_training_with_buckets(video_data, tmp_path):
    """Images (one-frame videos) and clips mixed by source weights, batched by (frames, h, w) bucket."""
    from data.synth import generate
    images = str(tmp_path / "images")
    generate(images, count=16, heldout_count=0, size=32, shard_size=8, seed=0)
    run = str(tmp_path / "run")
    proc = run_t2v(run, video_data, "train.steps=4", "train.log_every=1", "sample.num=1",
                   f"data.sources=[{{path: {video_data}/train, weight: 1.0}}, {{path: {images}/train, weight: 1.0}}]",
                   "data.buckets=[[1,32,32],[8,32,32]]", "data.bucket_target_tokens=1024")
    assert "48 training samples" in proc.stdout
    losses = [m["loss"] for m in read_metrics(run).values()]
    assert len(losses) == 4 and all(np.isfinite(losses))
    # The untrained DiT predicts 0 (zero final layer): step 1's loss is the mean square of the flow
    # targets of the first mixed, bucketed batch, rebuilt here from the run's config.
    from common.config import from_yaml_file
    from common.run import make_loader
    from pipelines.text2video.spec import SPEC
    cfg = from_yaml_file(SPEC.config, os.path.join(run, "config.yaml"))
    comp = SPEC.build(cfg)
    prepare, _ = SPEC.step_fns(comp, torch.device("cpu"))
    _, target = prepare(next(iter(make_loader(SPEC, comp, cfg, dp_rank=0, dp_size=1))))
    assert losses[0] == pytest.approx(target.pow(2).flatten(1).mean(1).mean().item(), rel=1e-5)
    assert os.path.isfile(os.path.join(run, "samples", "step_00000004.mp4"))


@pytest.mark.slow
def test_bucketed_steps_count_their_own_samples_and_flops(video_data, tmp_path):
    """samples/s and MFU come from the batches the loader made: with buckets a step holds
    bucket_target_tokens // tokens(bucket) samples (not data.micro_batch_size), at that bucket's FLOPs."""
    from common.config import build_config
    from data.synth import generate
    from pipelines.text2video import components
    from pipelines.text2video.config import T2VConfig
    images = str(tmp_path / "images")
    generate(images, count=16, heldout_count=0, size=32, shard_size=8, seed=0)
    overrides = ["train.steps=10", "train.log_every=1", "sample.num=0", "data.micro_batch_size=16",
                 f"data.sources=[{{path: {video_data}/train, weight: 1.0}}, {{path: {images}/train, weight: 4.0}}]",
                 "data.buckets=[[1,32,32],[8,32,32]]", "data.bucket_target_tokens=512"]
    run = str(tmp_path / "run")
    run_t2v(run, video_data, *overrides)
    model = components.build(build_config(T2VConfig, TINY_YAML, [*SMALL_MODEL, *overrides])).model
    per_bucket = {}  # samples per step -> training FLOPs of such a step
    for shape in ((1, 32, 32), (8, 32, 32)):
        n = 512 // model.cfg.tokens(*shape)
        per_bucket[n] = 3 * n * model.flops_per_sample(*shape)
    assert sorted(per_bucket) == [2, 8]  # 64 tokens an image, 256 a clip
    metrics = read_metrics(run)
    seen = [0] + [metrics[s]["samples_seen"] for s in range(1, 11)]
    steps = [b - a for a, b in zip(seen, seen[1:])]
    assert set(steps) == {2, 8}, steps  # both buckets drawn, neither at micro_batch_size
    for s, n in zip(range(1, 11), steps):
        assert metrics[s]["step_flops"] == pytest.approx(per_bucket[n], rel=1e-12)


# --------------------------------------------------------------------------- context parallel
CP_COMMON = ["train.steps=5", "train.log_every=1", "train.ckpt_every=100", "train.sample_every=0", "sample.num=0",
             "train.ema_decay=0.9"]


@pytest.fixture(scope="module")
def cp_reference(video_data, tmp_path_factory):
    return shared_once(tmp_path_factory, "t2v-single", lambda run: run_t2v(
        run, video_data, *CP_COMMON, "data.micro_batch_size=8"))


@pytest.fixture(scope="module")
def factorized_reference(video_data, tmp_path_factory):
    return shared_once(tmp_path_factory, "t2v-factorized", lambda run: run_t2v(
        run, video_data, *CP_COMMON, "data.micro_batch_size=8", "model.attention=factorized"))


@pytest.mark.slow
@pytest.mark.dist
def test_factorized_attention_tensor_parallel_matches_single_process(factorized_reference, video_data, tmp_path):
    run = str(tmp_path / "run")
    run_t2v(run, video_data, *CP_COMMON, "data.micro_batch_size=8", "model.attention=factorized", "parallel.tp=2",
            "parallel.sequence_parallel=true", nproc=2)
    ref, par = read_metrics(factorized_reference), read_metrics(run)
    for step in range(1, 6):
        assert par[step]["loss"] == pytest.approx(ref[step]["loss"], rel=1e-5), (step, par[step], ref[step])
        assert par[step]["grad_norm"] == pytest.approx(ref[step]["grad_norm"], rel=1e-5), (step, par[step], ref[step])


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("layout", ["cp2-ulysses", "cp2-ring", "fsdp2xcp2"])
def test_context_parallel_matches_single_process(cp_reference, video_data, tmp_path, layout):
    nproc, overrides = {"cp2-ulysses": (2, ["data.micro_batch_size=8", "parallel.cp=2", "parallel.cp_mode=ulysses"]),
                        "cp2-ring": (2, ["data.micro_batch_size=8", "parallel.cp=2", "parallel.cp_mode=ring"]),
                        "fsdp2xcp2": (4, ["data.micro_batch_size=4", "parallel.dp_shard=2", "parallel.cp=2",
                                          "parallel.cp_mode=ring"])}[layout]
    run = str(tmp_path / "run")
    run_t2v(run, video_data, *CP_COMMON, *overrides, nproc=nproc)
    ref, par = read_metrics(cp_reference), read_metrics(run)
    for step in range(1, 6):
        assert par[step]["loss"] == pytest.approx(ref[step]["loss"], rel=1e-5), (step, par[step], ref[step])
        assert par[step]["grad_norm"] == pytest.approx(ref[step]["grad_norm"], rel=1e-5), (step, par[step], ref[step])
