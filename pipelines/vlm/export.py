"""Export a vlm run for Hugging Face transformers.

  python -m pipelines.vlm.export --run RUN_DIR --out OUT_DIR

  OUT/lm   the language model as a LlamaForCausalLM folder (save_pretrained layout: config.json,
           generation_config.json, model.safetensors) with the run's tokenizer and chat template:
           transformers.AutoModelForCausalLM.from_pretrained(OUT/lm) and
           AutoTokenizer.from_pretrained(OUT/lm) load it; <|end|> is its eos token.
  OUT/vlm  the whole model (vision tower, projector, LM) as model.safetensors under this
           project's names, with the run's config.yaml and the tokenizer: what
           pipelines.vlm loads back. transformers has no class for this architecture (open_clip
           ViT tokens -> pixel shuffle -> LayerNorm/MLP projector, InternVL-style; LLaVA's class
           has no token merge and no projector norm), so no LLaVA folder is written.

RUN_DIR is a stage's directory or a staged run's top directory (its last VLM stage is exported).
Weights are the checkpoint's EMA weights when the run kept them.
"""
from __future__ import annotations

import argparse
import os
import shutil

from common.cli import run_cli
from common.config import ConfigError
from common.nn.llama_hf import save_hf_lm
from common.run import load_run
from pipelines.vlm.eval import last_vlm_stage
from pipelines.vlm.spec import SPEC


def export(run: str, out: str) -> dict[str, str]:
    stage = last_vlm_stage(run)
    comp, meta = load_run(SPEC, stage)
    tok_dir = comp.cfg.tokenizer.path
    if not tok_dir or not os.path.isfile(os.path.join(tok_dir, "tokenizer.json")):
        raise ConfigError(f"the run's tokenizer folder {tok_dir!r} is missing")
    lm_dir = os.path.join(out, "lm")
    save_hf_lm(comp.model.lm, lm_dir, arch="llama", tokenizer_dir=tok_dir, eos_token_id=comp.tokenizer.end_id,
               pad_token_id=comp.tokenizer.pad_id)
    from safetensors.torch import save_file
    vlm_dir = os.path.join(out, "vlm")
    os.makedirs(vlm_dir, exist_ok=True)
    sd = {k: v.detach().cpu().contiguous() for k, v in comp.model.state_dict().items()}
    save_file(sd, os.path.join(vlm_dir, "model.safetensors"), metadata={"format": "pt", "step": str(meta["step"])})
    shutil.copy(os.path.join(stage, "config.yaml"), os.path.join(vlm_dir, "config.yaml"))
    shutil.copytree(tok_dir, os.path.join(vlm_dir, "tokenizer"), dirs_exist_ok=True)
    return {"lm": lm_dir, "vlm": vlm_dir, "checkpoint": meta["path"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipelines.vlm.export", description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, help="run directory (a stage's, or a staged run's top directory)")
    p.add_argument("--out", required=True, help="output directory (gets lm/ and vlm/)")
    args = p.parse_args(argv)
    paths = export(args.run, args.out)
    print(f"exported {paths['checkpoint']}: language model -> {paths['lm']} (AutoModelForCausalLM / AutoTokenizer), "
          f"whole model -> {paths['vlm']}")
    return 0


if __name__ == "__main__":
    run_cli(main)
