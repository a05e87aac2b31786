"""common.diffusion: per-sample determinism, flow/DDPM objectives, samplers, CFG."""
import math

import pytest
import torch

from common.diffusion import (DDPM, RectifiedFlow, ddim_sample, drop_mask, euler_sample, flow_timesteps,
                              guided, per_sample_rand, per_sample_randn, shift_time)


def test_per_sample_noise_slices_with_seeds():
    seeds = torch.arange(100, 108)
    full = per_sample_randn(seeds, (3, 4, 4), salt=7)
    torch.testing.assert_close(per_sample_randn(seeds[2:5], (3, 4, 4), salt=7), full[2:5], rtol=0, atol=0)
    torch.testing.assert_close(per_sample_randn(seeds, (3, 4, 4), salt=7), full, rtol=0, atol=0)
    assert not torch.allclose(per_sample_randn(seeds, (3, 4, 4), salt=8), full)
    assert not torch.allclose(full[0], full[1])
    u = per_sample_rand(seeds, salt=1)
    assert u.shape == (8,) and torch.equal(per_sample_rand(seeds[5:], salt=1), u[5:])
    m = drop_mask(torch.arange(4000), 0.1)
    assert m.dtype == torch.bool and 0.08 < m.float().mean() < 0.12
    assert torch.equal(drop_mask(torch.arange(10, 20), 0.3), drop_mask(torch.arange(4000), 0.3)[10:20])


def test_flow_interpolation_and_exact_predictor():
    fm = RectifiedFlow()
    x0, eps = torch.randn(3, 2, 4, 4), torch.randn(3, 2, 4, 4)
    torch.testing.assert_close(fm.interpolate(x0, eps, torch.zeros(3)), x0)
    torch.testing.assert_close(fm.interpolate(x0, eps, torch.ones(3)), eps)
    seeds = torch.arange(3)
    noise = per_sample_randn(seeds, x0.shape[1:])

    def exact(x_t, t, cond):  # knows x0 and the noise it was given
        return noise - x0

    loss, per = fm.loss(exact, x0, None, seeds)
    assert per.shape == (3,) and loss.item() == pytest.approx(0.0, abs=1e-10)
    loss_zero, per_zero = fm.loss(lambda x, t, c: torch.zeros_like(x), x0, None, seeds)
    torch.testing.assert_close(per_zero, (noise - x0).pow(2).flatten(1).mean(1))


@pytest.mark.parametrize("s", [0.5, 1.0, 3.0])
def test_shift_is_monotone_bijection(s):
    t = torch.linspace(0, 1, 101, dtype=torch.float64)
    y = shift_time(t, s)
    assert y[0] == 0 and y[-1] == 1 and torch.all(y[1:] > y[:-1])
    if s > 1:
        assert torch.all(y[1:-1] > t[1:-1])  # shift > 1 spends more time near noise


def test_timestep_sampling_and_resolution_shift():
    seeds = torch.arange(2000)
    fm = RectifiedFlow(logit_mean=0.0, logit_std=1.0)
    t = fm.sample_t(seeds)
    assert t.min() > 0 and t.max() < 1 and abs(t.mean().item() - 0.5) < 0.02
    assert fm.shift_for(1024) == pytest.approx(2.0) and fm.shift_for(None) == 1.0
    assert RectifiedFlow(shift=3.0).shift_for(1024) == 3.0
    assert fm.sample_t(seeds, num_tokens=1024).mean() > t.mean()
    tu = RectifiedFlow(timestep_sampling="uniform").sample_t(seeds)
    assert abs(tu.mean().item() - 0.5) < 0.02 and torch.equal(fm.sample_t(seeds[7:9]), t[7:9])


@pytest.mark.parametrize("shift", [1.0, 3.0])
def test_euler_with_exact_velocity_lands_on_x0(shift):
    x0 = torch.randn(2, 3, 4, 4)

    def v_field(x_t, t, cond):  # exact v for the noise implied by x_t: (x_t - x0) / t
        return (x_t - x0) / t.view(-1, 1, 1, 1)

    g = torch.Generator().manual_seed(0)
    out = euler_sample(v_field, x0.shape, num_steps=7, shift=shift, generator=g)
    torch.testing.assert_close(out, x0, atol=1e-5, rtol=1e-5)
    ts = flow_timesteps(7, shift)
    assert ts[0] == 1 and ts[-1] == 0 and torch.all(ts[1:] < ts[:-1])


def test_sampler_determinism_and_cfg():
    def model(x, t, cond):
        return 0.3 * x + cond[0] * cond[1][:, :, None, None].float()

    cond = (torch.randn(2, 3, 4, 4), torch.ones(2, 1, dtype=torch.bool))
    uncond = (torch.zeros(2, 3, 4, 4), torch.zeros(2, 1, dtype=torch.bool))
    x, t = torch.randn(2, 3, 4, 4), torch.rand(2)
    torch.testing.assert_close(guided(model, x, t, cond, uncond, 1.0), model(x, t, cond), atol=1e-6, rtol=1e-6)
    g3 = guided(model, x, t, cond, uncond, 3.0)
    torch.testing.assert_close(g3, model(x, t, uncond) + 3 * (model(x, t, cond) - model(x, t, uncond)))
    a = euler_sample(model, (2, 3, 4, 4), cond, uncond=uncond, guidance=4.0, num_steps=5,
                     generator=torch.Generator().manual_seed(1))
    b = euler_sample(model, (2, 3, 4, 4), cond, uncond=uncond, guidance=4.0, num_steps=5,
                     generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b)


def _alpha_bar_ref(schedule, T):
    if schedule == "linear":
        return torch.cumprod(1 - torch.linspace(1e-4, 0.02, T, dtype=torch.float64), 0)
    f = lambda u: math.cos((u + 0.008) / 1.008 * math.pi / 2) ** 2  # noqa: E731
    return torch.tensor([f((i + 1) / T) / f(0) for i in range(T)], dtype=torch.float64)


def test_scaled_linear_matches_stable_diffusion_scheduler():
    # diffusers' DDPMScheduler as SD's scheduler_config.json sets it: the betas an SD UNet learned.
    from diffusers import DDPMScheduler
    sd = DDPMScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear")
    ours = DDPM(1000, "scaled_linear", "eps")
    torch.testing.assert_close(ours.alphas_cumprod, sd.alphas_cumprod.double(), rtol=1e-6, atol=1e-7)
    assert not torch.allclose(DDPM(1000, "linear").alphas_cumprod, ours.alphas_cumprod, rtol=1e-3)


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_ddpm_schedule_and_conversions(schedule):
    T = 1000
    ref = _alpha_bar_ref(schedule, T)
    d_eps, d_v = DDPM(T, schedule, "eps"), DDPM(T, schedule, "v")
    # cosine betas are clipped at 0.999, which only touches the last step
    torch.testing.assert_close(d_eps.alphas_cumprod[:-1], ref[:-1], rtol=1e-9, atol=1e-12)
    x0, eps = torch.randn(4, 2, 3, 3, dtype=torch.float64), torch.randn(4, 2, 3, 3, dtype=torch.float64)
    t = torch.tensor([0, 10, 500, 998])
    ab = ref[t].view(-1, 1, 1, 1)
    x_t = d_eps.q_sample(x0, eps, t)
    torch.testing.assert_close(x_t, ab.sqrt() * x0 + (1 - ab).sqrt() * eps)
    v = d_v.target(x0, eps, t)
    torch.testing.assert_close(v, ab.sqrt() * eps - (1 - ab).sqrt() * x0)
    for d, out in ((d_eps, eps), (d_v, v)):
        x0_hat, eps_hat = d.to_x0_eps(x_t, t, out)
        torch.testing.assert_close(x0_hat, x0, atol=1e-8, rtol=1e-6)
        torch.testing.assert_close(eps_hat, eps, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("prediction", ["eps", "v"])
def test_ddpm_loss_and_ddim_exact_model(prediction):
    d = DDPM(1000, "cosine", prediction)
    x0 = torch.randn(2, 3, 4, 4)
    seeds = torch.tensor([5, 9])

    def exact(x_t, t_norm, cond):  # the ideal predictor for a dataset of one point x0
        t = (t_norm * d.num_timesteps).round().long()
        a, s = d.coefs(t, x_t)
        eps = (x_t - a * x0) / s
        return eps if prediction == "eps" else a * eps - s * x0

    loss, per = d.loss(exact, x0, None, seeds)
    assert per.shape == (2,) and loss.item() < 1e-8
    out = ddim_sample(exact, d, x0.shape, num_steps=10, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(out, x0, atol=1e-4, rtol=1e-4)


class _OneHotTower(torch.nn.Module):
    """A stand-in text tower: caption -> one-hot row over a fixed caption list (one position)."""

    def __init__(self, captions):
        super().__init__()
        self.index = {c: i for i, c in enumerate(captions)}

    def forward(self, captions):
        ctx = torch.zeros(len(captions), 1, len(self.index))
        ctx[torch.arange(len(captions)), 0, torch.tensor([self.index[c] for c in captions])] = 1
        return ctx, torch.ones(len(captions), 1, dtype=torch.bool)


class _OracleDenoiser(torch.nn.Module):
    """Knows the clean image each caption names (`clean[caption row]`) and predicts the objective's
    exact target for it: error 0 under the right caption, > 0 under any other."""

    def __init__(self, objective, clean):
        super().__init__()
        self.objective, self.clean = objective, clean

    def forward(self, x_t, t, ctx, mask):
        x0 = self.clean[ctx[:, 0].argmax(1)]
        if isinstance(self.objective, RectifiedFlow):
            tb = t.view(-1, 1, 1, 1)
            return (x_t - (1 - tb) * x0) / tb - x0
        step = (t * self.objective.num_timesteps).round().long()
        a, s = self.objective.coefs(step, x0)
        return self.objective.target(x0, (x_t - a * x0) / s, step)


@pytest.mark.parametrize("objective", [RectifiedFlow(), DDPM(prediction="eps"), DDPM(prediction="v")],
                         ids=["flow", "ddpm-eps", "ddpm-v"])
def test_caption_errors_pick_the_caption_an_oracle_denoiser_was_given(objective):
    from common.diffusion.text_conditioned import PROBE_TIMES, caption_errors
    words = ["circle", "square", "star", "cross"]
    clean = torch.randn(len(words), 3, 8, 8, generator=torch.Generator().manual_seed(0))
    truth = [2, 0, 3, 1, 1]
    x0 = clean[truth]
    choices = [[f"a red {w}" for w in words] for _ in truth]
    model = _OracleDenoiser(objective, clean).train()
    errors = caption_errors(model, _OneHotTower(choices[0]), objective, x0, choices, seed=3, noises=2, batch_size=5)
    assert errors.shape == (len(truth), len(words), len(PROBE_TIMES))
    assert model.training  # restored
    right = errors[torch.arange(len(truth)), truth]
    assert right.max() < 1e-8, right
    wrong = errors.clone()
    wrong[torch.arange(len(truth)), truth] = float("inf")
    assert wrong.min() > 1e-4, wrong  # eps prediction near t = 1 barely sees x0: small, yet far above 0
    assert errors.mean(2).argmin(1).tolist() == truth


def test_caption_errors_give_every_caption_the_same_noise():
    """A caption-blind model's error must not depend on the caption at all (same draws for every
    candidate), while the draws differ between items and between seeds."""
    from common.diffusion.text_conditioned import caption_errors

    class Blind(torch.nn.Module):
        def forward(self, x_t, t, ctx, mask):
            return 0.5 * x_t + t.view(-1, 1, 1, 1)

    x0 = torch.zeros(3, 3, 4, 4)  # identical items: any difference between them is the noise
    choices = [["a", "b", "c"]] * 3
    tower = _OneHotTower(["a", "b", "c"])
    errors = caption_errors(Blind(), tower, RectifiedFlow(), x0, choices, seed=0, noises=2, batch_size=4)
    assert torch.equal(errors, errors[:, :1].expand_as(errors))
    assert not torch.allclose(errors[0], errors[1])
    again = caption_errors(Blind(), tower, RectifiedFlow(), x0, choices, seed=0, noises=2)
    other = caption_errors(Blind(), tower, RectifiedFlow(), x0, choices, seed=1, noises=2)
    assert torch.equal(errors, again) and not torch.allclose(errors, other)
    with pytest.raises(ValueError, match="one list of 3 captions per item"):
        caption_errors(Blind(), tower, RectifiedFlow(), x0, choices[:2], noises=2)


def test_ddpm_example_at_maps_noise_fractions_to_timesteps():
    ddpm = DDPM(num_timesteps=1000)
    x0, eps = torch.randn(3, 2), torch.randn(3, 2)
    x_t, t, target = ddpm.example_at(x0, eps, torch.tensor([0.0, 0.5, 1.0]))
    steps = torch.tensor([0, 500, 999])  # round(t * 999)
    assert torch.equal(t, ddpm.model_time(steps))
    assert torch.equal(x_t, ddpm.q_sample(x0, eps, steps)) and torch.equal(target, eps)
