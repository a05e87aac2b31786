"""data.precompute: VAE latents / text embeddings into shards, exact values, resumable, readable
by plain webdataset and by the text2image decoder, and split over ranks under torchrun."""

import glob
import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import webdataset as wds

from data import precompute
from data.synth import generate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = ["--text-encoder", "--text-width", "32", "--text-layers", "1", "--text-heads", "2",
        "--text-context-length", "16", "--seed", "3"]


@pytest.fixture(scope="module")
def vae_dir(tmp_path_factory):
    from diffusers import AutoencoderKL
    torch.manual_seed(0)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16),
                        layers_per_block=1, latent_channels=4, norm_num_groups=8, sample_size=32)
    d = str(tmp_path_factory.mktemp("vae"))
    vae.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """3 train shards of 4 samples (32 px) + one extra shard with a corrupt and a captionless sample."""
    out = str(tmp_path_factory.mktemp("synth"))
    generate(out, count=12, heldout_count=0, size=32, shard_size=4, seed=0)
    bad = os.path.join(out, "train", "shard-000003.tar")
    with wds.TarWriter(bad, mtime=0.0) as w:
        w.write({"__key__": "bad-0", "png": b"not a png", "txt": "a red circle", "json": b"{}"})
        good = next(iter(wds.WebDataset(os.path.join(out, "train", "shard-000000.tar"), shardshuffle=False)))
        w.write({"__key__": "nocap-0", "png": good["png"], "json": b"{}"})
        w.write({"__key__": "good-0", "png": good["png"], "txt": "a blue square", "json": b"{}"})
    return os.path.join(out, "train")


def _samples(path):
    return list(wds.WebDataset(path, shardshuffle=False))


def _vae(vae_dir):
    from diffusers import AutoencoderKL
    return AutoencoderKL.from_pretrained(vae_dir).eval()


def test_latents_text_resume_and_decoders(shards, vae_dir, tmp_path, capsys):
    out = str(tmp_path / "out")
    args = [shards, "--out", out, "--vae", vae_dir, "--image-size", "32", "--batch-size", "3",
            "--device", "cpu", "--no-progress", *TEXT]
    assert precompute.main(args) == 0
    text = capsys.readouterr().out
    assert "read = 15, written = 13, skipped = 2" in text
    assert "4 done, 0 skipped as complete" in text
    outs = sorted(os.path.basename(p) for p in glob.glob(os.path.join(out, "*.tar")))
    assert outs == [f"shard-{i:06d}.tar" for i in range(4)]
    assert not glob.glob(os.path.join(out, "*.tmp"))
    report = [json.loads(line) for line in open(os.path.join(out, "precompute_report.jsonl"))]
    reasons = {r["key"]: r["reason"] for r in report}
    assert set(reasons) == {"bad-0", "nocap-0"} and "caption" in reasons["nocap-0"]

    # Values: the posterior mean of the VAE on the training transform, stored as float16.
    from common.data.images import ImageDecoder
    from common.nn.text_encoder import TextEncoder, TextEncoderConfig, text_features_id
    from common.diffusion.noise import mix_seed
    vae, dec = _vae(vae_dir), ImageDecoder(32)
    with torch.random.fork_rng(devices=[]):  # the tower a run with run.seed=3 builds
        torch.manual_seed(mix_seed(3, 101))
        te = TextEncoder(TextEncoderConfig(width=32, layers=1, heads=2, context_length=16))
    src = _samples(os.path.join(shards, "shard-000001.tar"))
    got = _samples(os.path.join(out, "shard-000001.tar"))  # plain WebDataset reads the output
    assert [s["__key__"] for s in got] == [s["__key__"] for s in src]
    x = torch.stack([dec._image(s["png"]) for s in src])
    with torch.no_grad():
        want = vae.encode(x).latent_dist.mean.numpy()
    tok, mask = te([s["txt"].decode() for s in src])
    for j, s in enumerate(got):
        assert s["png"] == src[j]["png"] and s["txt"] == src[j]["txt"]  # originals kept
        lat = np.load(io.BytesIO(s["latent.npy"]))
        emb = np.load(io.BytesIO(s["text_emb.npy"]))
        m = np.load(io.BytesIO(s["text_mask.npy"]))
        assert lat.dtype == np.float16 and emb.dtype == np.float16 and m.dtype == bool
        np.testing.assert_allclose(lat.astype(np.float32), want[j], rtol=1e-3, atol=1e-3)
        np.testing.assert_allclose(emb.astype(np.float32), tok[j].numpy(), rtol=1e-3, atol=2e-3)
        assert (m == mask[j].numpy()).all()
        meta = json.loads(s["json"])
        orig = json.loads(src[j]["json"])
        assert {k: meta[k] for k in orig} == orig
        assert meta["latent"] == {"shape": list(lat.shape), "dtype": "float16", "scaling_factor_applied": False,
                                  "mode": "mean", "image_size": 32}
        assert list(lat.shape) == [4, 16, 16]
        assert meta["text_emb"]["shape"] == [16, 32] and meta["text_emb"]["length"] == int(m.sum())
        assert meta["text_emb"]["id"] == text_features_id(te)
        out_dec = ImageDecoder(32, use_latents=True, text_features=True)(s)
        assert out_dec["latent"].shape == (4, 16, 16) and "image" not in out_dec
        tokens, stored_mask, stored_id = out_dec["text_features"]
        assert torch.equal(tokens, torch.from_numpy(emb.astype(np.float32))) and stored_id == meta["text_emb"]["id"]
        assert torch.equal(stored_mask, torch.from_numpy(m))
        assert ImageDecoder(32, text_features=True)(src[j])["text_features"] is None  # not precomputed

    # Resume: delete one output, leave a stale tmp; only that shard is redone.
    os.remove(os.path.join(out, "shard-000002.tar"))
    open(os.path.join(out, "shard-000002.tar.tmp"), "wb").write(b"partial")
    before = os.path.getmtime(os.path.join(out, "shard-000000.tar"))
    assert precompute.main(args) == 0
    text = capsys.readouterr().out
    assert "1 done, 3 skipped as complete" in text and "read = 4, written = 4, skipped = 0" in text
    assert os.path.getmtime(os.path.join(out, "shard-000000.tar")) == before
    assert len(_samples(os.path.join(out, "shard-000002.tar"))) == 4
    assert not glob.glob(os.path.join(out, "*.tmp"))


def test_drop_media_native_size_and_errors(shards, vae_dir, tmp_path, capsys):
    out = str(tmp_path / "o")
    assert precompute.main([os.path.join(shards, "shard-000000.tar"), "--out", out, "--vae", vae_dir,
                            "--image-size", "0", "--drop-media", "--device", "cpu", "--no-progress"]) == 0
    got = _samples(os.path.join(out, "shard-000000.tar"))
    assert len(got) == 4 and all("png" not in s and "text_emb.npy" not in s for s in got)
    assert all(json.loads(s["json"])["latent"]["shape"] == [4, 16, 16] for s in got)
    assert precompute.main([shards, "--out", out, "--no-progress"]) == 2  # nothing to do
    assert precompute.main([shards, "--out", shards, "--vae", vae_dir, "--no-progress"]) == 2  # in place
    capsys.readouterr()


def test_help():
    r = subprocess.run([sys.executable, "-m", "data.precompute", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0 and "--vae" in r.stdout and "--text-encoder" in r.stdout


@pytest.mark.slow
def test_two_ranks(shards, vae_dir, tmp_path):
    out = str(tmp_path / "dist")
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "data.precompute", shards, "--out", out, "--vae", vae_dir, "--image-size", "32",
           "--device", "cpu", "--batch-size", "4"]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "read = 15, written = 14, skipped = 1" in r.stdout  # no text encoder: captionless is fine
    assert "4 done, 0 skipped as complete (world size 2)" in r.stdout
    assert len(glob.glob(os.path.join(out, "*.tar"))) == 4
    assert not glob.glob(os.path.join(out, "*.rank*"))
    report = [json.loads(line) for line in open(os.path.join(out, "precompute_report.jsonl"))]
    assert [r["key"] for r in report] == ["bad-0"]
    # Same bytes as a single-process run of one shard.
    single = str(tmp_path / "single")
    assert precompute.main([os.path.join(shards, "shard-000001.tar"), "--out", single, "--vae", vae_dir,
                            "--image-size", "32", "--device", "cpu", "--no-progress"]) == 0
    a = _samples(os.path.join(out, "shard-000001.tar"))
    b = _samples(os.path.join(single, "shard-000001.tar"))
    np.testing.assert_allclose(*(np.load(io.BytesIO(s[0]["latent.npy"])).astype(np.float32) for s in (a, b)),
                               rtol=1e-3, atol=1e-3)


def test_hugging_face_text_encoder_features(shards, tmp_path, capsys):
    """--text-hf-path: a T5 folder's features (its width, whatever --text-width says), with the id
    of the tower a run with text.hf_path builds."""
    from common.nn.text_encoder import HFTextEncoder, text_features_id
    from tests.test_t2i_diffusers import make_t5
    t5, out = str(tmp_path / "t5"), str(tmp_path / "out")
    make_t5(t5, width=48)
    args = [os.path.join(shards, "shard-000000.tar"), "--out", out, "--device", "cpu", "--no-progress",
            "--text-encoder", "--text-hf-path", t5, "--text-context-length", "12"]
    assert precompute.main(args) == 0
    tower = HFTextEncoder(t5, 12)
    got = _samples(os.path.join(out, "shard-000000.tar"))
    ref, ref_mask = tower([s["txt"].decode() for s in got])
    for j, s in enumerate(got):
        emb = np.load(io.BytesIO(s["text_emb.npy"]))
        assert emb.shape == (12, 48)
        np.testing.assert_allclose(emb.astype(np.float32), ref[j].numpy(), rtol=1e-3, atol=2e-3)
        assert (np.load(io.BytesIO(s["text_mask.npy"])) == ref_mask[j].numpy()).all()
        meta = json.loads(s["json"])["text_emb"]
        assert meta["id"] == text_features_id(tower) and meta["config"]["hf_path"] == t5
    assert precompute.main([*args[:-4], "--text-hf-path", str(tmp_path / "none")]) == 2
    assert "is not a directory" in capsys.readouterr().err


TOWER = ["--text-encoder", "--text-width", "32", "--text-layers", "1", "--text-heads", "2",
         "--text-context-length", "16", "--text-layer-scale", "1e-3"]  # tests.conftest's tiny run's tower


def test_training_takes_precomputed_text_features(synth_data, tmp_path):
    """A run on shards with its own tower's precomputed features trains as one that runs the tower,
    to float16 rounding of the features (losses within 1e-4 relative, but not equal: the stored rows
    were used); features of another tower (another seed's) stop the run in one line, unless
    data.text_features=false, which runs the tower as if they were absent."""
    from tests.conftest import assert_same_losses_to_rounding, read_metrics, run_train
    data, other = tmp_path / "data", tmp_path / "other"
    for out, seed in ((data, "0"), (other, "5")):
        assert precompute.main([os.path.join(synth_data, "train"), "--out", str(out / "train"), "--device", "cpu",
                                "--no-progress", *TOWER, "--seed", seed]) == 0
        os.symlink(os.path.join(synth_data, "heldout"), out / "heldout")
    common = ["train.steps=3", "train.log_every=1", "sample.num=0", "optim.lr=1e-2", "optim.warmup_steps=1",
              "data.micro_batch_size=8"]
    run_train(str(tmp_path / "tower"), synth_data, *common)
    run_train(str(tmp_path / "stored"), str(data), *common)
    assert_same_losses_to_rounding(str(tmp_path / "tower"), str(tmp_path / "stored"), [1, 2, 3])
    tower = read_metrics(str(tmp_path / "tower"))
    run_train(str(tmp_path / "off"), str(other), *common, "data.text_features=false")
    off = read_metrics(str(tmp_path / "off"))  # the other tower's features ignored: the tower's run exactly
    assert {s: r["loss"] for s, r in off.items()} == {s: r["loss"] for s, r in tower.items()}
    proc = run_train(str(tmp_path / "refused"), str(other), *common, check=False)
    assert proc.returncode != 0 and "another text tower" in proc.stderr and "Traceback" not in proc.stderr, \
        proc.stderr[-2000:]
