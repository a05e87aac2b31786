"""The vlm run configuration: the shared sections from common.config plus this pipeline's.

One config describes one stage (`stage.name`) or, with `stages` set, the whole schedule that
`python -m pipelines.vlm.train` runs stage after stage in sub-directories of run.dir:
  clip      contrastive image-text pretraining of an open_clip model (section `clip`); its vision
            tower is the VLM's
  align     projector only (vision tower and LM frozen): image features learn to speak the LM's
            input language on captions
  instruct  projector + LM on conversations (vision tower frozen)
  full      everything trainable
"""
from __future__ import annotations

from dataclasses import dataclass

from common.config import ConfigError, RunSections, check_run_config, doc
from pipelines.vlm.clip import ClipConfig

STAGES = ("clip", "align", "instruct", "full")


@dataclass
class LMConfig:
    dim: int = doc(128, "LM width")
    n_layers: int = doc(4, "LM decoder blocks")
    n_heads: int = doc(4, "attention heads")
    n_kv_heads: int = doc(2, "key/value heads (GQA; equal to n_heads: plain multi-head attention)")
    ffn_hidden: int = doc(0, "SwiGLU hidden size (0: the Llama rule, 8/3 x dim rounded up to 64)")
    max_seq_len: int = doc(512, "longest sequence (one sample) the LM takes")
    rope_theta: float = doc(10000.0, "RoPE base")
    hf_path: str = doc("", "local Hugging Face Llama/Qwen2-style checkpoint folder to start the LM from (its "
                           "sizes replace the fields above; its tokenizer is used when tokenizer.path is empty)")
    backend: str = doc("native", "native (common.nn.llama) | megatron (megatron-core GPTModel, CUDA only)")


@dataclass
class VisionLanguageConfig:
    pixel_shuffle: int = doc(2, "merge s x s neighbouring patch tokens into one (s^2 x width channels); 1: off")
    projector_hidden: int = doc(0, "projector MLP hidden size (0: the LM width)")
    max_tiles: int = doc(4, "dynamic resolution: an image larger than one tile becomes a thumbnail plus up to "
                            "this many tiles of clip.image_size (0: thumbnail only)")


@dataclass
class TokenizerConfig:
    path: str = doc("", "local Hugging Face tokenizer folder (tokenizer.json); empty: the LM's (lm.hf_path) or a "
                        "byte-level BPE trained on data.train_shards into RUN/tokenizer")
    vocab_size: int = doc(512, "BPE vocabulary when the tokenizer is trained here")


@dataclass
class PackingConfig:
    enabled: bool = doc(True, "pack conversations into rows with varlen attention (false: one sample per padded row)")
    row_len: int = doc(256, "tokens per packed row; a longer sample is skipped and counted")
    rows: int = doc(0, "rows per micro-batch (0: as many as the samples need; pipeline parallelism needs a fixed "
                       "number: samples that do not fit are skipped and counted)")
    loss_average: str = doc("token", "token: mean over the micro-batch's assistant tokens | sample: mean over "
                                     "samples of each sample's mean token loss")


@dataclass
class StageConfig:
    name: str = doc("instruct", "clip | align | instruct | full (what this run trains)")
    init: str = doc("", "run directory of the previous stage to start from (its latest checkpoint): a clip run gives the "
                        "vision tower, a VLM run the whole model")
    caption_prompt: str = doc("Describe the image.", "align: the user turn asking for the caption")


@dataclass
class StagePlan:
    name: str = doc("align", "clip | align | instruct | full")
    steps: int = doc(100, "optimizer steps of this stage")
    lr: float = doc(1e-3, "peak learning rate of this stage")
    micro_batch_size: int = doc(0, "samples per rank per micro-batch (0: data.micro_batch_size)")
    warmup_steps: int = doc(-1, "LR warmup steps (-1: optim.warmup_steps)")


@dataclass
class VLMSampleConfig:
    num: int = doc(8, "held-out questions answered at each sample point (written to samples/step_N.jsonl)")
    max_new_tokens: int = doc(16, "longest answer")


@dataclass
class VLMConfig(RunSections):
    stage: StageConfig = doc(factory=StageConfig, help="which stage this run trains")
    stages: list[StagePlan] = doc(help="a schedule of stages run one after another in run.dir/<name>, each "
                                       "starting from the previous one (empty: the single stage above)",
                                  factory=list)
    clip: ClipConfig = doc(factory=ClipConfig, help="stage 0: the open_clip model whose vision tower the VLM uses")
    lm: LMConfig = doc(factory=LMConfig, help="the Llama-style language model")
    model: VisionLanguageConfig = doc(factory=VisionLanguageConfig, help="vision-to-language connection")
    tokenizer: TokenizerConfig = doc(factory=TokenizerConfig, help="text tokenizer and chat template")
    packing: PackingConfig = doc(factory=PackingConfig, help="conversation packing")
    sample: VLMSampleConfig = doc(factory=VLMSampleConfig, help="answers written during training")

    def validate(self) -> None:
        check_run_config(self, positive={"lm.dim": self.lm.dim, "lm.n_layers": self.lm.n_layers,
                                         "lm.n_heads": self.lm.n_heads, "lm.n_kv_heads": self.lm.n_kv_heads,
                                         "model.pixel_shuffle": self.model.pixel_shuffle,
                                         "packing.row_len": self.packing.row_len,
                                         "tokenizer.vocab_size": self.tokenizer.vocab_size},
                         choices={"stage.name": (self.stage.name, STAGES),
                                  "lm.backend": (self.lm.backend, ("native", "megatron")),
                                  "packing.loss_average": (self.packing.loss_average, ("token", "sample"))})
        for i, plan in enumerate(self.stages):
            if plan.name not in STAGES:
                raise ConfigError(f"stages[{i}].name={plan.name!r} is not one of {', '.join(STAGES)}")
            if plan.steps < 1:
                raise ConfigError(f"stages[{i}].steps={plan.steps} must be >= 1")
        names = [p.name for p in self.stages]
        if len(set(names)) != len(names):
            raise ConfigError(f"stages: each stage may appear once (its run directory is run.dir/<name>), got {names}")
        if self.lm.dim % self.lm.n_heads:
            raise ConfigError(f"lm.dim={self.lm.dim} is not divisible by lm.n_heads={self.lm.n_heads}")
        if self.lm.n_heads % self.lm.n_kv_heads:
            raise ConfigError(f"lm.n_heads={self.lm.n_heads} is not a multiple of lm.n_kv_heads={self.lm.n_kv_heads}")
        if self.model.max_tiles < 0:
            raise ConfigError(f"model.max_tiles={self.model.max_tiles} must be >= 0")
        grid = self.clip.image_size // self.clip.patch_size
        if grid % self.model.pixel_shuffle:
            raise ConfigError(f"model.pixel_shuffle={self.model.pixel_shuffle} does not divide the {grid} x {grid} "
                              f"patch grid of a clip.image_size={self.clip.image_size} tile")
        if self.packing.rows < 0:
            raise ConfigError(f"packing.rows={self.packing.rows} must be >= 0")
        if self.parallel.pp > 1 and self.packing.rows == 0:
            raise ConfigError("parallel.pp > 1 needs a fixed number of rows per micro-batch: set packing.rows "
                              "(e.g. to data.micro_batch_size)")
        self.clip.validate()
