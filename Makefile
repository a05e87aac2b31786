# Two entry points (README quickstart): `make demo` and `make test`. Both create the venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
RUN ?= runs/tiny
DATA ?= datasets/synth
# Extra train overrides, e.g. make demo DEMO_ARGS="train.steps=3000" (longer training).
DEMO_ARGS ?=

.PHONY: setup demo demo-dit vlm-demo text23d-demo test test-fast bench clean

setup: $(VENV)/.installed

# Every package pinned in requirements.lock (the whole environment, transitive ones included);
# torch 2.14.1 / torchvision 0.29.1 come from the machine's local wheel cache when present.
$(VENV)/.installed: pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements.lock
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

# The text2image demo: the tiny Stable-Diffusion-style UNet (tiny_unet.yaml); demo-dit trains the
# tiny DiT (tiny.yaml) on the same data into runs/tiny-dit. Both: data, training, eval.
# $(call t2i_demo,CONFIG,RUN_DIR)
define t2i_demo
	$(PY) -m data.synth --out $(DATA)
	$(PY) -m pipelines.text2image.train --config pipelines/text2image/configs/$(1) run.dir=$(2) \
		data.train_shards=$(DATA)/train data.eval_shards=$(DATA)/heldout $(DEMO_ARGS)
	$(PY) -m pipelines.text2image.eval --run $(2) --save-grid $(2)/eval_grid.png
endef

demo: setup
	$(call t2i_demo,tiny_unet.yaml,$(RUN))

DIT_RUN ?= runs/tiny-dit
demo-dit: setup
	$(call t2i_demo,tiny.yaml,$(DIT_RUN))

# The vision-language pipeline on synthetic VQA: CLIP, align and instruct stages, then eval.
VLM_RUN ?= runs/vlm-tiny
VQA_DATA ?= datasets/vqa
VLM_ARGS ?=
vlm-demo: setup
	$(PY) -m data.synth --vqa --out $(VQA_DATA)
	$(PY) -m pipelines.vlm.train --config pipelines/vlm/configs/tiny.yaml run.dir=$(VLM_RUN) \
		data.train_shards=$(VQA_DATA)/train data.eval_shards=$(VQA_DATA)/heldout $(VLM_ARGS)
	$(PY) -m pipelines.vlm.eval --run $(VLM_RUN)

# Text-to-3D on synthetic primitives: stage A (point-cloud flow), then stage B (shape VAE, then a
# latent flow on its latents), each evaluated on held-out compositions.
T3D_RUN ?= runs/t3d
T3D_DATA ?= datasets/synth3d
T3D_ARGS ?=
T3D_SHARDS = data.train_shards=$(T3D_DATA)/train data.eval_shards=$(T3D_DATA)/heldout
text23d-demo: setup
	$(PY) -m data.synth --3d --out $(T3D_DATA)
	$(PY) -m pipelines.text23d.train --config pipelines/text23d/configs/tiny_points.yaml run.dir=$(T3D_RUN)/points \
		$(T3D_SHARDS) $(T3D_ARGS)
	$(PY) -m pipelines.text23d.eval --run $(T3D_RUN)/points --save-grid $(T3D_RUN)/points/eval_grid
	$(PY) -m pipelines.text23d.train --config pipelines/text23d/configs/tiny_vae.yaml run.dir=$(T3D_RUN)/vae \
		$(T3D_SHARDS) $(T3D_ARGS)
	$(PY) -m pipelines.text23d.train --config pipelines/text23d/configs/tiny_latent.yaml run.dir=$(T3D_RUN)/latent \
		vae.run=$(T3D_RUN)/vae $(T3D_SHARDS) $(T3D_ARGS)
	$(PY) -m pipelines.text23d.eval --run $(T3D_RUN)/latent --save-grid $(T3D_RUN)/latent/eval_grid

# Two pytest workers (pytest-xdist): multi-rank runs spend much of their time waiting on each
# other (gloo), so two workers on 2 cores finish sooner than one. worksteal: a worker that runs
# out takes pending tests from the other, so the multi-minute tests do not leave one idle at the
# end. TEST_JOBS=0 runs in-process.
TEST_JOBS ?= 2
test: setup
	$(PY) -m pytest -q -n $(TEST_JOBS) $(if $(filter 0,$(TEST_JOBS)),,--dist worksteal)

test-fast: setup
	$(PY) -m pytest -q -n $(TEST_JOBS) -m "not slow"

bench: setup
	$(PY) bench/t2i_cpu.py

clean:
	rm -rf $(RUN) $(DIT_RUN) $(DATA) $(VLM_RUN) $(VQA_DATA) $(T3D_RUN) $(T3D_DATA)
