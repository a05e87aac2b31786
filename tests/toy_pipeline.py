"""A whole pipeline in one spec: an MLP velocity model on random vectors, conditioned on an
"up"/"down" caption. The proof that a new workload costs a spec (tests/test_pipeline_contract.py
trains, resumes and samples it through common/run.py). Run: python tests/toy_pipeline.py train|sample ARGS."""
import io
import sys
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from common.config import RunSections, SampleConfig, check_run_config, doc
from common.data.captions import caption_of
from common.diffusion.flow import RectifiedFlow, mse_per_sample
from common.diffusion.noise import sample_seeds
from common.parallel.parallel_model import parallelize_data_only
from common.pipeline import PipelineSpec


@dataclass
class ToyConfig(RunSections):
    sample: SampleConfig = doc(factory=SampleConfig)
    dim: int = doc(8, "vector size")

    def validate(self):
        check_run_config(self, positive={"dim": self.dim}, choices={})


class Denoiser(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim + 2, 64), nn.SiLU(), nn.Linear(64, dim))

    def forward(self, x, t, up):
        return self.net(torch.cat([x, t[:, None], up[:, None]], 1))


@dataclass
class Toy:
    cfg: ToyConfig
    model: Denoiser
    frozen = {}
    flow = RectifiedFlow(timestep_sampling="uniform")

    def to(self, device):
        self.model.to(device)


def build(cfg):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.run.seed)
        return Toy(cfg, Denoiser(cfg.dim))


def step_fns(toy, device):
    def prepare(batch):
        x_t, t, target = toy.flow.training_example(batch["x"], sample_seeds(toy.cfg.run.seed, batch["__position__"]))
        return (x_t, t, torch.tensor([c == "up" for c in batch["caption"]]).float()), target
    return prepare, lambda pred, target: mse_per_sample(pred, target).mean()


def decode(sample):
    return {"x": torch.from_numpy(np.load(io.BytesIO(sample["npy"]))), "caption": caption_of(sample)}


def generate(toy, model, prompts, seeds, *, steps, guidance, device):
    noise = torch.stack([torch.randn(toy.cfg.dim, generator=torch.Generator().manual_seed(s)) for s in seeds])
    up = torch.tensor([p == "up" for p in prompts]).float()
    with torch.no_grad():
        return toy.flow.sample(lambda x, t, c: model(x, t, c), noise, cond=up, num_steps=steps)


def save(array, path):
    np.save(path, array.numpy())
    return path


SPEC = PipelineSpec(
    name="toy", description="Train the toy vector denoiser.", config=ToyConfig, build=build, step_fns=step_fns,
    parallelize=parallelize_data_only, decoder=lambda toy: decode, signature=lambda toy: {"dim": toy.cfg.dim},
    generate=generate, write_grid=lambda media, stem, toy, opts: [save(media, stem + ".npy")],
    write_item=lambda item, stem, toy, opts: ({"file": save(item, stem + ".npy").rsplit("/", 1)[1]}, {}))

if __name__ == "__main__":
    from common import run
    from common.cli import run_cli
    command, argv = sys.argv[1], sys.argv[2:]
    run_cli(lambda a: run.train(SPEC, a) if command == "train" else run.sample(SPEC, a), argv)
