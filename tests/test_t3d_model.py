"""text23d models and decoder: permutation equivariance, the VAE's query independence and KL, mesh
extraction of a decoded field, and the decoder's reasons for bad samples."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from common.geometry import BOUNDS
from pipelines.text23d.components import decode_shape
from pipelines.text23d.data import ShapeDecoder, from_model_space, to_model_space
from pipelines.text23d.model import PointDiT, ShapeVAE, ShapeVAEConfig, point_dit_config


def _randomised(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    # Zero-initialised gates and final layers would make any model trivially equivariant.
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def test_point_dit_is_permutation_equivariant():
    torch.manual_seed(0)
    model = _randomised(PointDiT(point_dit_config("tiny", hidden=64, depth=2, heads=4, text_dim=32, num_points=64)))
    x, t = torch.randn(2, 64, 6), torch.rand(2)
    ctx, mask = torch.randn(2, 5, 32), torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    perm = torch.randperm(64)
    out, out_perm = model(x, t, ctx, mask), model(x[:, perm], t, ctx, mask)
    torch.testing.assert_close(out_perm, out[:, perm], rtol=1e-5, atol=1e-5)
    # ...and it is not trivially so: the output depends on the other points (attention mixes them).
    x2 = x.clone()
    x2[:, 1:] += 0.5
    assert (model(x2, t, ctx, mask)[:, 0] - out[:, 0]).abs().max() > 1e-3


def test_point_dit_flops_scale_with_tokens():
    m = PointDiT(point_dit_config("tiny", num_points=128))
    # Attention is quadratic in the tokens, everything else linear: doubling the tokens more than doubles.
    assert m.flops_per_sample(256) > 2 * m.flops_per_sample(128)


def test_vae_queries_are_independent_and_kl_of_the_prior_is_zero():
    torch.manual_seed(0)
    vae = _randomised(ShapeVAE(ShapeVAEConfig(width=32, heads=2, latents=16, latent_dim=4, dec_layers=1)))
    surface, queries = torch.rand(2, 64, 6) * 2 - 1, torch.rand(2, 40, 3) * 2 - 1
    out, kl = vae(surface, queries)
    assert out.shape == (2, 40, 4) and kl.shape == (2,)
    # A query's output does not depend on which other points are queried with it.
    part, _ = vae(surface, queries[:, 10:17])
    torch.testing.assert_close(part, out[:, 10:17], rtol=1e-5, atol=1e-5)
    # Sampling with noise changes the output; eps = 0 is the mean.
    noisy, _ = vae(surface, queries, torch.randn(2, 16, 4))
    assert (noisy - out).abs().max() > 1e-4
    torch.testing.assert_close(vae(surface, queries, torch.zeros(2, 16, 4))[0], out)
    # KL(N(0, 1) || N(0, 1)) = 0, and it grows with the mean.
    with torch.no_grad():
        vae.to_moments[1].weight.zero_()
        vae.to_moments[1].bias.zero_()
        assert vae(surface, queries)[1].abs().max() < 1e-7
        vae.to_moments[1].bias[:4] = 1.0
        assert vae(surface, queries)[1].min() > 0.1


def test_model_space_round_trip():
    pts = torch.rand(5, 6) - torch.tensor([0.5, 0.5, 0.5, 0, 0, 0])
    x = to_model_space(pts)
    assert x.min() >= -1 and x.max() <= 1
    torch.testing.assert_close(from_model_space(x), pts)


def test_decoded_sphere_gives_a_watertight_coloured_mesh():
    import trimesh
    radius = 0.3

    def field(q):  # model-space queries -> (logit: inside > 0, a constant red)
        xyz = q / 2.0
        logit = (radius - xyz.norm(dim=-1)) * 50.0
        rgb = torch.tensor([1.0, -1.0, -1.0]).expand(len(q), 3)
        return torch.cat([logit[:, None], rgb], 1)

    shape = decode_shape(field, 32)
    verts, faces, colours = shape["mesh"]
    mesh = trimesh.Trimesh(verts, faces, process=False)
    assert mesh.is_watertight
    assert abs(mesh.volume - 4 / 3 * np.pi * radius ** 3) / (4 / 3 * np.pi * radius ** 3) < 0.05
    pts = shape["points"]
    assert pts.shape == (2048, 6)
    assert np.abs(np.linalg.norm(pts[:, :3], axis=1) - radius).max() < 0.03
    np.testing.assert_allclose(pts[:, 3:], np.tile([1.0, 0.0, 0.0], (2048, 1)), atol=1e-6)
    assert (np.abs(verts) <= BOUNDS[1] + 1e-6).all()
    # A field with no surface gives an empty shape, not an exception.
    empty = decode_shape(lambda q: torch.full((len(q), 4), -5.0), 16)
    assert empty["mesh"] is None and empty["points"].shape == (0, 6)


def _npy(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def _sample(points=None, occ=None, caption="a red sphere"):
    s = {"__key__": "k", "txt": caption.encode()}
    if points is not None:
        s["npy"] = _npy(points)
    if occ is not None:
        s["occ.npy"] = _npy(occ)
    return s


def test_decoder_takes_the_prefix_and_both_query_halves():
    rng = np.random.default_rng(0)
    pts = rng.uniform(-0.5, 0.5, (100, 6)).astype(np.float16)
    occ = np.concatenate([np.full((10, 7), 1.0), np.full((10, 7), 0.0)]).astype(np.float16)
    occ[:, 0] = np.arange(20)
    out = ShapeDecoder(32, queries=8)(_sample(pts, occ))
    torch.testing.assert_close(out["points"], torch.from_numpy(pts[:32].astype(np.float32)))
    assert out["occ"][:, 0].tolist() == [0, 1, 2, 3, 10, 11, 12, 13]
    assert out["caption"] == "a red sphere"


@pytest.mark.parametrize("sample, reason", [
    (_sample(np.zeros((64, 3), np.float16)), "missing colour"),
    (_sample(np.full((64, 6), np.nan, np.float16)), "NaN"),
    (_sample(np.zeros((8, 6), np.float16)), "fewer than"),
    (_sample(None), "no point cloud"),
    ({"__key__": "k", "npy": b"not an array", "txt": b"x"}, "not a readable"),
    (_sample(np.zeros((64, 6), np.float16)), "no occupancy"),
])
def test_decoder_names_what_is_wrong(sample, reason):
    decode = ShapeDecoder(32, queries=8 if reason == "no occupancy" else 0)
    with pytest.raises(ValueError, match=reason):
        decode(sample)
