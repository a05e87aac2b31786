"""Config: typed overrides, clear one-line errors, --help and --print-config."""
from __future__ import annotations

import pytest

from common.config import ConfigError, build_config, help_text, parse_cli
from pipelines.text2image.config import T2IConfig
from tests.conftest import TINY_YAML, run_module


def test_yaml_then_overrides_typed():
    cfg = build_config(T2IConfig, TINY_YAML, ["optim.lr=3e-4", "train.steps=7", "data.shuffle=false"])
    assert cfg.optim.lr == pytest.approx(3e-4) and isinstance(cfg.optim.lr, float)
    assert cfg.train.steps == 7 and cfg.data.shuffle is False
    assert cfg.model.preset == "tiny"  # from the file, untouched by overrides


def test_unknown_key_names_it_and_the_closest():
    with pytest.raises(ConfigError) as e:
        build_config(T2IConfig, None, ["optim.lrr=1"])
    assert "optim.lrr" in str(e.value) and "optim.lr" in str(e.value)


def test_wrong_type_names_key_value_and_type():
    with pytest.raises(ConfigError) as e:
        build_config(T2IConfig, None, ["train.steps=many"])
    msg = str(e.value)
    assert "train.steps" in msg and "many" in msg and "int" in msg


def test_bad_values_and_forms():
    with pytest.raises(ConfigError, match="not of the form key=value"):
        build_config(T2IConfig, None, ["optim.lr"])
    with pytest.raises(ConfigError, match="must be > 0"):
        build_config(T2IConfig, None, ["data.micro_batch_size=0"])
    with pytest.raises(ConfigError, match="diffusion.objective"):
        build_config(T2IConfig, None, ["diffusion.objective=gan"])
    with pytest.raises(ConfigError, match="config file not found"):
        build_config(T2IConfig, "/nonexistent.yaml", [])
    with pytest.raises(ConfigError, match="unknown option"):
        parse_cli(T2IConfig, ["--lr", "3"], "prog", "")


def test_unknown_key_in_yaml_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("optim:\n  learning_rate: 0.1\n")
    with pytest.raises(ConfigError) as e:
        build_config(T2IConfig, str(p), [])
    assert "optim.learning_rate" in str(e.value) and str(p) in str(e.value)


def test_help_lists_every_key_with_type_and_help():
    text = help_text(T2IConfig, "prog", "desc")
    for key in ("optim.lr (float", "data.train_shards (str", "train.grad_accum (int", "parallel.dp_mode (str"):
        assert key in text


def test_cli_errors_are_one_line_without_traceback():
    proc = run_module("pipelines.text2image.train", "--config", TINY_YAML, "optim.lrr=1")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "optim.lr" in proc.stderr


def test_cli_print_config_and_help():
    proc = run_module("pipelines.text2image.train", "--config", TINY_YAML, "optim.lr=0.5", "--print-config")
    assert proc.returncode == 0 and "lr: 0.5" in proc.stdout
    proc = run_module("pipelines.text2image.train", "--help")
    assert proc.returncode == 0 and "optim.warmup_steps" in proc.stdout


@pytest.mark.parametrize("name", ["tiny", "base", "xl"])
def test_shipped_configs_parse_and_build_their_model_config(name):
    import os

    from pipelines.text2image.components import model_overrides
    from pipelines.text2image.model import dit_config
    from tests.conftest import ROOT
    cfg = build_config(T2IConfig, os.path.join(ROOT, f"pipelines/text2image/configs/{name}.yaml"), [])
    dcfg = dit_config(cfg.model.preset, **model_overrides(cfg))
    assert dcfg.hidden % dcfg.heads == 0


def test_sd15_finetune_config_is_sd_fine_tuning():
    """The shipped SD fine-tuning config parses and asks for what an SD1.x UNet was trained with
    (its architecture is read from model.init_from when the run is built: tests/test_t2i_sd_folder.py)."""
    import os

    from common.diffusion import DDPM
    from common.diffusion.text_conditioned import objective_from_config
    from tests.conftest import ROOT
    cfg = build_config(T2IConfig, os.path.join(ROOT, "pipelines/text2image/configs/sd15_finetune.yaml"), [])
    assert (cfg.model.arch, cfg.model.preset, cfg.text.width, cfg.text.context_length) == ("unet", "folder", 768, 77)
    assert not cfg.text.hf_padding_mask
    objective = objective_from_config(cfg.diffusion)
    assert isinstance(objective, DDPM) and objective.prediction == "eps"
    assert abs(objective.betas[0].item() - 0.00085) < 1e-12 and abs(objective.betas[-1].item() - 0.012) < 1e-12


def test_sd3_finetune_config_is_sd3_fine_tuning():
    """The shipped SD3 fine-tuning config parses and asks for what SD3 was trained with: its three
    text encoders from the pipeline folder (T5-XXL's width, 256 T5 tokens), rectified flow with
    logit-normal timesteps shifted by 3 at any token count (tests/test_t2i_sd3.py builds the rest)."""
    import os

    from common.diffusion import RectifiedFlow
    from common.diffusion.text_conditioned import objective_from_config
    from tests.conftest import ROOT
    cfg = build_config(T2IConfig, os.path.join(ROOT, "pipelines/text2image/configs/sd3_finetune.yaml"), [])
    assert (cfg.model.arch, cfg.model.preset, cfg.text.width, cfg.text.context_length) == ("sd3", "folder", 4096, 256)
    assert cfg.text.hf_path == cfg.model.init_from  # the pipeline folder: its three encoders
    assert cfg.text.dtype == "bf16"  # the frozen encoders in bf16, as diffusers' SD3 training holds them
    objective = objective_from_config(cfg.diffusion)
    assert isinstance(objective, RectifiedFlow) and objective.shift_for(4096) == objective.shift_for(256) == 3.0


def test_pixart_finetune_config_is_pixart_fine_tuning():
    """The shipped PixArt fine-tuning config parses and asks for what PixArt-alpha was trained with:
    T5-XXL features of 120 tokens with the padding mask, eps on linear betas 1e-4..0.02 (its
    architecture is read from model.init_from when the run is built: tests/test_t2i_pixart.py)."""
    import os

    from common.diffusion import DDPM
    from common.diffusion.text_conditioned import objective_from_config
    from tests.conftest import ROOT
    cfg = build_config(T2IConfig, os.path.join(ROOT, "pipelines/text2image/configs/pixart_finetune.yaml"), [])
    assert (cfg.model.arch, cfg.model.preset, cfg.text.width, cfg.text.context_length) == ("pixart", "folder", 4096, 120)
    assert cfg.text.hf_padding_mask and cfg.text.dtype == "bf16"
    objective = objective_from_config(cfg.diffusion)
    assert isinstance(objective, DDPM) and objective.prediction == "eps"
    assert abs(objective.betas[0].item() - 1e-4) < 1e-12 and abs(objective.betas[-1].item() - 0.02) < 1e-12
