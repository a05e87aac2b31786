"""Typed configuration: dataclass schemas, YAML files and dotted `key=value` overrides.

OmegaConf structured configs do the merging and type checking; this module turns their
exceptions into one-line messages that name the key, the value and what was expected, and
prints `--help` from the schema itself so the documentation cannot drift from the code.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import sys
import typing
from dataclasses import dataclass, field
from typing import Any, Union

from omegaconf import MISSING, OmegaConf
from omegaconf import errors as oc_errors

from common.host_memory import MODES as HOST_MALLOC_MODES
from common.stop_signals import parse_signals


class ConfigError(ValueError):
    """A user mistake in a config file or override; printed as one line, no traceback."""


def doc(default: Any = MISSING, help: str = "", factory=None):  # noqa: A002 - mirrors argparse
    """A dataclass field carrying its help text (shown by --help)."""
    if factory is not None:
        return field(default_factory=factory, metadata={"help": help})
    return field(default=default, metadata={"help": help})


# --------------------------------------------------------------------------- shared sections
@dataclass
class RunConfig:
    dir: str = doc("runs/default", "run directory: config.yaml, metrics.jsonl, checkpoints/, tb/, samples/")
    seed: int = doc(0, "global seed; per-sample noise is seeded from (seed, global sample position)")
    resume: str = doc("auto", "auto: latest complete checkpoint in run.dir if any; none: start fresh; or a checkpoint path")
    name: str = doc("", "free-form run name: leads the run's start line in the console log")


@dataclass
class SourceConfig:
    path: str = doc(MISSING, "shards of this source: a directory, brace pattern or glob")
    weight: float = doc(1.0, "mixing weight (normalised over all sources)")


@dataclass
class DataConfig:
    train_shards: str = doc("datasets/synth/train", "training shards: a directory, brace pattern or glob")
    eval_shards: str = doc("datasets/synth/heldout", "held-out shards used by eval.py")
    micro_batch_size: int = doc(32, "samples per rank per forward/backward")
    num_workers: int = doc(2, "loader worker processes per rank (0: load in the training process)")
    shuffle: bool = doc(True, "deterministic per-epoch shuffle of shards and samples")
    shuffle_window: int = doc(8, "shards whose samples are shuffled together (the shuffle-buffer equivalent)")
    prefetch_factor: int = doc(2, "micro-batches prefetched per worker")
    sources: list[SourceConfig] = doc(help="weighted sources [{path, weight}] mixed by a deterministic "
                                      "schedule; empty: train_shards alone", factory=list)
    mix_block: int = doc(1000, "mixing block: each block of positions holds exactly round(weight*block) "
                         "samples of each source")
    mode: str = doc("epoch", "epoch: each sample once per epoch, reshuffled per epoch | resampled: "
                    "seeded draws with replacement, no epoch boundary")
    buckets: list[list[int]] = doc(help="shape buckets [h, w] or [frames, h, w] (empty: no bucketing); "
                                   "a sample goes to the largest bucket that fits it", factory=list)
    bucket_target_tokens: int = doc(0, "per-rank tokens per micro-batch when bucketing: batch = "
                                    "max(1, target // tokens(bucket)); replaces micro_batch_size")
    text_features: bool = doc(True, "text diffusion: take a sample's precomputed caption features (python -m "
                                    "data.precompute --text-encoder) instead of running the frozen text tower; the "
                                    "run stops if they were made by another tower | false: always run the tower")


@dataclass
class OptimConfig:
    lr: float = doc(1e-3, "peak learning rate (AdamW)")
    min_lr_ratio: float = doc(0.1, "final LR as a fraction of the peak (cosine decay)")
    warmup_steps: int = doc(50, "linear warmup steps")
    schedule: str = doc("cosine", "cosine | constant (after warmup)")
    weight_decay: float = doc(0.0, "AdamW decoupled weight decay")
    beta1: float = doc(0.9, "AdamW beta1")
    beta2: float = doc(0.99, "AdamW beta2")
    eps: float = doc(1e-8, "AdamW epsilon")
    grad_clip: float = doc(1.0, "clip the global gradient norm to this value (<= 0: no clipping)")


@dataclass
class TrainConfig:
    steps: int = doc(1000, "optimizer steps in total")
    grad_accum: int = doc(1, "micro-batches per optimizer step")
    log_every: int = doc(10, "steps between metrics lines (JSONL, TensorBoard)")
    ckpt_every: Union[int, str] = doc(200, "steps between checkpoints (the last step is always saved), or auto: "
                                      "Young/Daly interval sqrt(2 x save time x train.mtbf_hours) in steps, from "
                                      "the measured save and step times (first save after 5 steps to measure)")
    ckpt_async: bool = doc(False, "asynchronous checkpoints: the step blocks only while the state is copied to CPU "
                                  "memory; a thread writes it, and the checkpoint becomes `latest` once every rank's "
                                  "write finished")
    mtbf_hours: float = doc(24.0, "mean time between failures of the whole job, for ckpt_every=auto: a node's MTBF "
                                  "divided by the number of nodes (e.g. 1000 h per node / 64 nodes ~ 16 h)")
    hang_timeout_s: float = doc(1800.0, "a step, collective or save without progress for this long dumps every "
                                        "thread's stack (stderr and run.dir/hang_rank<r>.txt) and exits with code 75 "
                                        "so the launcher restarts the job (0: off)")
    straggler_every: int = doc(50, "steps between straggler reports: per-rank rank-local step times (data loading "
                                   "and input preparation) gathered, ranks above straggler_factor x the median "
                                   "logged (0: off)")
    straggler_factor: float = doc(1.2, "a rank slower than this factor x the median rank is a straggler")
    input_warn_frac: float = doc(0.25, "warn (log line and an input_bound event) when waiting for the loader "
                                       "plus preparing batches takes this share of a logged window's time, "
                                       "saying which of the two it was (0: off)")
    keep_last: int = doc(3, "checkpoints kept (older ones are deleted once a newer one is complete)")
    sample_every: int = doc(0, "steps between sample grids (0: only at the end)")
    ema_decay: float = doc(0.999, "EMA decay of the weights used for sampling (0: no EMA)")
    ema_warmup: bool = doc(True, "use min(decay, (1+step)/(10+step)) so early EMA is not stuck at init")
    max_bad_steps: int = doc(5, "consecutive non-finite losses/gradients that stop the run")
    peak_flops: float = doc(0.0, "per-device peak FLOP/s for MFU (0: the published dense peak of the compute dtype "
                                 "for a known GPU, else a large matmul measured at start)")
    progress: bool = doc(True, "console progress bar with ETA")
    stop_after: int = doc(0, "stop (without final save) after this step; tests use it to simulate a kill")
    save_on_signal: str = doc("SIGTERM,SIGUSR1", "signals that stop the run cleanly: the step in flight finishes, "
                                                 "every rank saves a checkpoint, the run exits with 128 + the "
                                                 "signal's number and resumes from there when started again. Later "
                                                 "such signals wait for the save too (SIGKILL or Ctrl-C stop at "
                                                 "once). Schedulers send SIGTERM a grace period before killing "
                                                 "(Kubernetes, torchrun, Slurm at the time limit; Slurm "
                                                 "--signal=USR1@120 warns earlier); none: off")
    signal_grace_s: float = doc(30.0, "the scheduler's grace period between its stop signal and SIGKILL (30 s by "
                                      "default for Kubernetes, torchrun and Slurm's KillWait): a warning once a "
                                      "measured step plus checkpoint write would not fit in it (0: no check)")
    profile_at: int = doc(0, "first step torch.profiler records (0: off), for train.profile_count steps: CPU "
                             "and, on a GPU, CUDA activity; each rank writes run.dir/profile/rank<r>.txt "
                             "(operators by self device time, or CPU time on CPU) and a Chrome trace "
                             "rank<r>.json.gz (Perfetto, chrome://tracing)")
    profile_count: int = doc(3, "steps recorded from train.profile_at on")
    host_malloc: str = doc("auto", "auto | keep | default: glibc malloc in the training process. keep: large "
                                   "buffers come from the heap and freed memory stays mapped, so a step's large "
                                   "activations are not page-faulted in again every step (common/host_memory.py; "
                                   "a CPU DiT-S step 10.4 -> 9.3 s); auto: keep on CPU runs, glibc's default "
                                   "with a GPU; default: glibc as it is. No-op where the C library is not glibc")


@dataclass
class ParallelConfig:
    dp_mode: str = doc("auto", "auto | none | ddp | fsdp. auto: ddp for pure data parallelism, "
                               "fsdp as soon as tp, cp or pp is used")
    dp_replicate: int = doc(1, "HSDP replicate degree (FSDP shards within groups of dp_shard, replicates across)")
    dp_shard: int = doc(-1, "FSDP shard degree; -1 = whatever the world size leaves after the other degrees")
    tp: int = doc(1, "tensor-parallel degree (DTensor plans; innermost mesh dimension)")
    sequence_parallel: bool = doc(True, "with tp > 1: shard activations along the sequence between TP regions")
    cp: int = doc(1, "context-parallel degree (sequence sharded attention)")
    cp_mode: str = doc("ulysses", "ulysses | ring | hybrid (hybrid: cp_ulysses x (cp / cp_ulysses) ring)")
    cp_ulysses: int = doc(2, "hybrid CP: the Ulysses (all-to-all) degree; the ring degree is cp / cp_ulysses")
    pp: int = doc(1, "pipeline-parallel degree (stages across ranks)")
    pp_schedule: str = doc("1f1b", "gpipe | 1f1b | interleaved (interleaved 1F1B) | zero_bubble (ZB-V); "
                                    "train.grad_accum is the number of microbatches")
    pp_stages_per_rank: int = doc(0, "virtual stages per rank; 0 = 1 for gpipe/1f1b, 2 for interleaved/zero_bubble")
    reshard_after_forward: bool = doc(True, "FSDP: True = ZeRO-3, False = ZeRO-2 behaviour")
    cpu_offload: bool = doc(False, "FSDP: keep sharded parameters and optimizer state on the CPU")
    activation_checkpoint: str = doc("none", "none | full | selective (every ac_every-th block) | offload (saved activations to CPU)")
    ac_every: int = doc(2, "selective activation checkpointing: recompute every k-th block")
    compile: bool = doc(False, "torch.compile each block (inductor; needs a C++ compiler on CPU)")


@dataclass
class PrecisionConfig:
    compute: str = doc("auto", "auto | fp32 | bf16: dtype of matmuls and activations; auto = bf16 on CUDA, fp32 on "
                               "CPU (no bf16 units there). Master weights and optimizer state stay fp32")
    reduce: str = doc("fp32", "fp32 | bf16: dtype of the data-parallel gradient reduction")
    fp8: str = doc("none", "none | tensorwise | rowwise: FP8 training of the linears (torchao); a linear stays in "
                           "the compute dtype where the roofline predicts FP8 slower (its rows, K, N)")
    fp8_all_gather: bool = doc(True, "fp8=tensorwise under FSDP: all-gather weights in float8 (half of bf16's bytes)")
    int8: bool = doc(False, "int8 mixed precision for the linears: row-wise dynamic int8 forward and input-grad "
                            "matmuls, weight-grad in the compute dtype")
    convert: str = doc("blocks", "blocks: only linears inside the repeated transformer blocks (a 'blocks.N.' in the "
                                 "name) are candidates; embeddings, conditioning MLPs and the output layer stay in the "
                                 "compute dtype | all: every linear is a candidate")
    roofline: str = doc("auto", "device whose roofline picks the linears to convert: auto (the GPU in use; h100-sxm "
                                "on CPU) | h100-sxm | h200-sxm | a100-sxm | none (convert every linear with "
                                "K, N multiples of 16: numerics studies)")


@dataclass
class TextConfig:
    width: int = doc(128, "open_clip text tower width")
    layers: int = doc(2, "open_clip text tower layers")
    heads: int = doc(4, "open_clip text tower heads")
    context_length: int = doc(32, "caption tokens (longer captions are truncated)")
    weights: str = doc("", "local state-dict file for the text tower (empty: frozen random init from run.seed)")
    layer_scale: float = doc(0.0, "> 0: open_clip LayerScale init on residual branches, which keeps a random tower's "
                                  "token features word-specific; 0: plain CLIP blocks (needed for CLIP weights)")
    hf_path: str = doc("", "local Hugging Face text encoder folder (a CLIPTextModel/CLIPModel or T5EncoderModel "
                           "with its tokenizer, as save_pretrained writes them) used frozen instead of the open_clip "
                           "tower; text.width must equal its hidden size; layers, heads, weights and layer_scale are "
                           "then unused. A Stable Diffusion 3 pipeline folder gives SD3's CLIP-L + CLIP-G + T5 stack "
                           "(text.width = T5's, context_length = T5's tokens) for model.arch=sd3")
    hf_padding_mask: bool = doc(True, "text.hf_path: run the encoder with the padding mask. False: on the padded ids "
                                      "unmasked, as Stable Diffusion 1.x / 2.x computed their CLIP features (their "
                                      "UNets learned the padding positions' features too)")
    dtype: str = doc("fp32", "the frozen tower's weights and compute: fp32 | bf16 (half the memory: T5-XXL's ~19 GB "
                             "become ~9.5 on every GPU; features rounded to bf16, handed on in fp32)")


@dataclass
class TransformerSizeConfig:
    """A model section's sizes: a named preset, overridden field by field where set (> 0)."""
    preset: str = doc("tiny", "tiny | S | B | XL: model size; the fields below override the preset where set (> 0)")
    hidden: int = doc(0, "transformer width (0: preset)")
    depth: int = doc(0, "number of transformer blocks (0: preset)")
    heads: int = doc(0, "attention heads (0: preset)")
    mlp_ratio: float = doc(0.0, "MLP hidden / width (0: preset)")

    size_fields = ("hidden", "depth", "heads", "mlp_ratio")  # class attribute, not a config key

    def size_overrides(self) -> dict:
        """The preset fields this section sets (> 0)."""
        return {k: getattr(self, k) for k in self.size_fields if getattr(self, k)}


@dataclass
class ModelSizeConfig(TransformerSizeConfig):
    """TransformerSizeConfig plus the patch size of a patchified (image or video) model."""
    patch_size: int = doc(0, "(spatial) patch size in model-input pixels or latents (0: preset)")

    size_fields = TransformerSizeConfig.size_fields + ("patch_size",)


@dataclass
class DiffusionConfig:
    timesteps: str = doc("logit_normal", "flow: logit_normal | uniform")
    logit_mean: float = doc(0.0, "flow: logit-normal mean")
    logit_std: float = doc(1.0, "flow: logit-normal std")
    shift: float = doc(0.0, "flow: fixed timestep shift (0: dependent on the token count, "
                            "base_shift * sqrt(tokens / base_tokens); a video's tokens are T*H*W patches)")
    base_shift: float = doc(1.0, "flow: shift at base_tokens")
    base_tokens: int = doc(256, "flow: token count where the shift equals base_shift")
    cfg_dropout: float = doc(0.1, "probability of replacing a caption by the empty caption (classifier-free guidance)")


@dataclass
class SampleConfig:
    steps: int = doc(30, "sampler steps")
    cfg: float = doc(3.0, "classifier-free guidance weight (1: no guidance)")
    num: int = doc(16, "samples in the training-time grid (captions from data.eval_shards)")
    seed: int = doc(1234, "seed of the sample grid's noise")


@dataclass
class RunSections:
    """The sections every pipeline's config has (a pipeline's config class extends it)."""
    run: RunConfig = doc(factory=RunConfig, help="run directory, seed, resume")
    data: DataConfig = doc(factory=DataConfig, help="shards and loader")
    optim: OptimConfig = doc(factory=OptimConfig, help="AdamW and LR schedule")
    train: TrainConfig = doc(factory=TrainConfig, help="loop length, logging, checkpoints, EMA")
    parallel: ParallelConfig = doc(factory=ParallelConfig, help="the parallel layout")
    precision: PrecisionConfig = doc(factory=PrecisionConfig, help="dtypes, fp8 / int8 training")


@dataclass
class TextDiffusionSections(RunSections):
    """RunSections plus what every text-conditioned diffusion pipeline has."""
    text: TextConfig = doc(factory=TextConfig, help="the frozen open_clip text tower")
    diffusion: DiffusionConfig = doc(factory=DiffusionConfig, help="training objective")
    sample: SampleConfig = doc(factory=SampleConfig, help="samples during training")

    def check(self, positive: dict, choices: dict) -> None:
        """check_run_config with the text, diffusion and sample checks such pipelines share added."""
        check_run_config(self, positive={"sample.steps": self.sample.steps,
                                         "text.context_length": self.text.context_length, **positive},
                         choices={"diffusion.timesteps": (self.diffusion.timesteps, ("logit_normal", "uniform")),
                                  **choices})
        if not 0.0 <= self.diffusion.cfg_dropout < 1.0:
            raise ConfigError(f"diffusion.cfg_dropout={self.diffusion.cfg_dropout} must be in [0, 1)")


# --------------------------------------------------------------------------- validation
def check_run_config(cfg, positive: dict, choices: dict) -> None:
    """The checks every pipeline's run config shares (data, train, optim sections), then the
    pipeline's own: `positive` maps "section.key" -> value that must be > 0, `choices` maps
    "section.key" -> (value, allowed values). Raises ConfigError naming the first bad key."""
    tc = cfg.train
    if isinstance(tc.ckpt_every, str) and tc.ckpt_every != "auto":
        raise ConfigError(f"train.ckpt_every={tc.ckpt_every!r} must be a number of steps or auto")
    if not 0 <= cfg.run.seed < 2**63:  # torch.Generator and the per-sample seeds take 63 bits
        raise ConfigError(f"run.seed={cfg.run.seed} must be in [0, 2^63)")
    positive = {"data.micro_batch_size": cfg.data.micro_batch_size, "train.steps": tc.steps,
                "train.grad_accum": tc.grad_accum, "train.log_every": tc.log_every,
                "train.mtbf_hours": tc.mtbf_hours, "train.profile_count": tc.profile_count, **positive}
    if tc.ckpt_every != "auto":
        positive["train.ckpt_every"] = tc.ckpt_every
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{key}={value} must be > 0")
    for key, value in {"train.hang_timeout_s": tc.hang_timeout_s, "train.straggler_every": tc.straggler_every,
                       "train.profile_at": tc.profile_at, "train.signal_grace_s": tc.signal_grace_s}.items():
        if value < 0:
            raise ConfigError(f"{key}={value} must be >= 0 (0: off)")
    if not 0.0 <= tc.input_warn_frac <= 1.0:
        raise ConfigError(f"train.input_warn_frac={tc.input_warn_frac} must be in [0, 1] (0: off)")
    try:
        parse_signals(tc.save_on_signal)
    except ValueError as e:
        raise ConfigError(f"train.save_on_signal={tc.save_on_signal!r}: {e}") from None
    if tc.straggler_factor <= 1.0:
        raise ConfigError(f"train.straggler_factor={tc.straggler_factor} must be > 1")
    if cfg.data.num_workers < 0:
        raise ConfigError(f"data.num_workers={cfg.data.num_workers} must be >= 0")
    choices = {"optim.schedule": (cfg.optim.schedule, ("cosine", "constant")),
               "precision.compute": (cfg.precision.compute, ("auto", "fp32", "bf16")),
               "precision.reduce": (cfg.precision.reduce, ("fp32", "bf16")),
               "precision.fp8": (cfg.precision.fp8, ("none", "tensorwise", "rowwise")),
               "precision.convert": (cfg.precision.convert, ("blocks", "all")),
               "precision.roofline": (cfg.precision.roofline, ("auto", "h100-sxm", "h200-sxm", "a100-sxm", "none")),
               "train.host_malloc": (tc.host_malloc, HOST_MALLOC_MODES),
               **choices}
    for key, (value, allowed) in choices.items():
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not one of {', '.join(allowed)}")
    if cfg.precision.fp8 != "none" and cfg.precision.int8:
        raise ConfigError("precision.fp8 and precision.int8 both set; pick one low-precision recipe")


# --------------------------------------------------------------------------- loading
def _all_keys(node, prefix: str = "") -> list[str]:
    keys = []
    for k in node.keys() if OmegaConf.is_dict(node) else []:
        full = f"{prefix}{k}"
        keys.append(full)
        child = node._get_node(k)
        if OmegaConf.is_dict(child):
            keys.extend(_all_keys(child, full + "."))
    return keys


def _unknown_key_message(schema, bad_key: str) -> str:
    valid = _all_keys(schema)
    close = difflib.get_close_matches(bad_key, valid, n=3, cutoff=0.5)
    leaf = bad_key.rsplit(".", 1)[-1]
    close += [k for k in valid if k.rsplit(".", 1)[-1] == leaf and k not in close][:3]
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return f"unknown config key '{bad_key}'{hint}"


def _translate(err: Exception, schema, origin: str) -> ConfigError:
    key = getattr(err, "full_key", None) or ""
    if isinstance(err, (oc_errors.ConfigKeyError, oc_errors.ConfigAttributeError)):
        return ConfigError(f"{origin}: " + _unknown_key_message(schema, key or str(err)))
    if isinstance(err, oc_errors.ValidationError):
        msg = str(err).splitlines()[0]
        expected = _expected_type(schema, key)
        return ConfigError(f"{origin}: config key '{key}': {msg}" + (f"; expected {expected}" if expected else ""))
    return ConfigError(f"{origin}: {str(err).splitlines()[0]}")


def _expected_type(schema, key: str) -> str:
    node = schema
    try:
        for part in key.split("."):
            node = node._get_node(part)
        return _type_name(node._metadata.ref_type)
    except Exception:
        return ""


def _parse_override(item: str) -> tuple[str, str]:
    if "=" not in item or item.startswith("="):
        raise ConfigError(f"override '{item}' is not of the form key=value (e.g. optim.lr=3e-4)")
    key, value = item.split("=", 1)
    return key.strip(), value


def build_config(schema_cls, config_file: str | None = None, overrides: typing.Sequence[str] = ()):
    """Schema defaults <- YAML file <- overrides, type-checked; returns the dataclass instance."""
    schema = OmegaConf.structured(schema_cls)
    cfg = schema
    if config_file:
        if not os.path.isfile(config_file):
            raise ConfigError(f"config file not found: {config_file}")
        try:
            file_cfg = OmegaConf.load(config_file)
        except Exception as e:  # yaml syntax errors are long; keep the first line
            raise ConfigError(f"{config_file}: cannot parse YAML: {str(e).splitlines()[0]}") from None
        try:
            cfg = OmegaConf.merge(cfg, file_cfg)
        except Exception as e:
            raise _translate(e, schema, config_file) from None
    for item in overrides:
        key, value = _parse_override(item)
        try:
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([f"{key}={value}"]))
        except Exception as e:
            if not getattr(e, "full_key", None):
                e.full_key = key  # type: ignore[attr-defined]
            raise _translate(e, schema, f"override '{item}'") from None
    try:
        missing = OmegaConf.missing_keys(cfg)
        if missing:
            raise ConfigError(f"config keys without a value: {', '.join(sorted(missing))}")
        obj = OmegaConf.to_object(cfg)
    except ConfigError:
        raise
    except Exception as e:
        raise _translate(e, schema, "config") from None
    validate = getattr(obj, "validate", None)
    if callable(validate):
        validate()
    return obj


def to_yaml(cfg) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def from_yaml_file(schema_cls, path: str):
    """Load a resolved config.yaml written by a run (sample/eval read the run's own config)."""
    return build_config(schema_cls, path, ())


def _type_name(tp) -> str:
    if typing.get_origin(tp) is Union:
        return " | ".join(_type_name(t) for t in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp)).replace("typing.", "")


def help_text(schema_cls, prog: str, description: str) -> str:
    lines = [f"usage: {prog} --config FILE [key=value ...] [--print-config] [--help]", "", description, "",
             "Every key below can be set in the YAML file or overridden after it as section.key=value.", ""]

    def walk(cls, prefix):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            if dataclasses.is_dataclass(tp):
                lines.append(f"[{prefix}{f.name}]")
                walk(tp, f"{prefix}{f.name}.")
                continue
            default = f.default if f.default is not dataclasses.MISSING else (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else "")
            lines.append(f"  {prefix}{f.name} ({_type_name(tp)}, default {default!r}): {f.metadata.get('help', '')}")

    walk(schema_cls, "")
    return "\n".join(lines)


def parse_cli(schema_cls, argv: typing.Sequence[str] | None, prog: str, description: str):
    """Parse `--config FILE [key=value ...] [--print-config]`; `--help` prints every key."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(help_text(schema_cls, prog, description))
        raise SystemExit(0)
    print_only = "--print-config" in argv
    argv = [a for a in argv if a != "--print-config"]
    config_file = None
    overrides = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--config":
            if i + 1 >= len(argv):
                raise ConfigError("--config needs a file path")
            config_file = argv[i + 1]
            i += 2
            continue
        if a.startswith("--config="):
            config_file = a.split("=", 1)[1]
        elif a.startswith("-"):
            raise ConfigError(f"unknown option '{a}' (options: --config FILE, --print-config, --help; settings are key=value)")
        else:
            overrides.append(a)
        i += 1
    cfg = build_config(schema_cls, config_file, overrides)
    if print_only:
        print(to_yaml(cfg), end="")
        raise SystemExit(0)
    return cfg
