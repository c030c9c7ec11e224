# make demo: set up .venv and run the default job. make test: set up .venv (and the deviceless TPU/GPU
# compilers in .venv/compilers) and prove every feature by its decisive test (at most 9 minutes on 2
# cores); make test-all (CI's, .ci/run): the core on the GPU images' JAX (core-smoke) and every test but
# the long ones, which make test-long runs.
# tests/README.md says what each tier holds and how to mark a test for each.
# jax 0.11+ needs Python 3.12 or newer: PYTHON is the first such interpreter found (python3.13,
# python3.12, pyenv's 3.12/3.13, python3), or set it: make test PYTHON=/path/to/python3.12.
NEEDS_PYTHON := import sys, venv; sys.exit(sys.version_info < (3, 12))
# $(call first_python,CANDIDATES): the first candidate interpreter that runs $(NEEDS_PYTHON).
first_python = $(shell for p in $(1); do "$$p" -c '$(NEEDS_PYTHON)' >/dev/null 2>&1 && echo "$$p" && break; done)
PYTHON ?= $(call first_python,$$(command -v python3.13 python3.12) $(HOME)/.pyenv/versions/3.1[23]*/bin/python3.1[23] \
  /root/.pyenv/versions/3.1[23]*/bin/python3.1[23] $$(command -v python3))
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo demo-agent demo-distill demo-math demo-lora demo-moe demo-rm demo-vl demo-vl-agent test test-all test-long test-fast core-smoke sandbox bench clean

$(BIN)/python:
	@test -n "$(PYTHON)" || { echo "no Python 3.12 or newer found (jax 0.12 needs it): make ... PYTHON=/path/to/python3.12"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.runtime: requirements.txt pyproject.toml | $(BIN)/python
	@$(BIN)/python -c '$(NEEDS_PYTHON)' || { echo "$(VENV) is older than Python 3.12, which jax 0.12 needs: make clean, then again"; exit 1; }
	$(BIN)/pip install --quiet -r requirements.txt
	$(BIN)/pip install --quiet --no-deps -e .
	touch $@

# TensorFlow-backed extras: clu's TensorBoard writer, JetStream serving, tfds / HF datasets.
$(VENV)/.extras: requirements-extras.txt $(VENV)/.runtime
	$(BIN)/pip install --quiet -r requirements-extras.txt
	touch $@

# On Python 3.12 PyPI's torch is its CUDA build, which brings the `triton` package; the tests use
# torch on the CPU only (as its CPU build, without triton, did), and triton's native library
# crashed a test process that had already loaded jaxlib's own Triton lowering (a segfault on
# importing triton from transformers). So it is removed.
$(VENV)/.test: requirements-test.txt requirements-trackers.txt $(VENV)/.extras
	$(BIN)/pip install --quiet -r requirements-test.txt
	$(BIN)/pip uninstall --quiet --yes triton
	touch $@

# The TPU and GPU compilers for deviceless compiles, in a folder of their own (requirements-compile.txt).
# Where their wheels cannot be installed, the compile tests skip and say so.
$(VENV)/.compilers: requirements-compile.txt | $(BIN)/python
	rm -rf $(VENV)/compilers
	$(BIN)/pip install --quiet --no-deps --target $(VENV)/compilers -r requirements-compile.txt \
	  || (rm -rf $(VENV)/compilers; echo "the TPU/GPU compilers could not be installed: compile tests will skip")
	touch $@

demo: $(VENV)/.extras
	$(BIN)/python -m grpo_jax.train --config configs/tiny_arith.yaml

demo-agent: $(VENV)/.extras
	$(BIN)/python -m grpo_jax.train --config configs/tiny_guess.yaml

demo-lora: $(VENV)/.extras
	$(BIN)/python -m grpo_jax.train --config configs/tiny_arith_lora.yaml

demo-moe: $(VENV)/.extras
	$(BIN)/python -m grpo_jax.train --config configs/tiny_arith_moe.yaml

demo-vl: $(VENV)/.extras
	$(BIN)/python -m grpo_jax.train --config configs/tiny_spot.yaml

demo-vl-agent: $(VENV)/.extras
	$(BIN)/python -m grpo_jax.train --config configs/tiny_spot_agent.yaml

demo-math: $(VENV)/.extras
	$(BIN)/python -m grpo_jax.data.word_problems --out data/tiny_math
	$(BIN)/python -m grpo_jax.train --config configs/tiny_math.yaml

# Rewards from models: preference pairs labelled by a hidden property, a reward model trained on
# them, GRPO against it, and the proxy / gold picture (runs/tiny_rm_grpo/proxy_gold.png).
demo-rm: $(VENV)/.extras
	$(BIN)/python -m grpo_jax.data.synthetic_preferences --out data/tiny_rm
	$(BIN)/python -m grpo_jax.train_reward --config configs/tiny_reward_model.yaml
	$(BIN)/python -m grpo_jax.train --config configs/tiny_rm_grpo.yaml
	$(BIN)/python -m grpo_jax.data.synthetic_preferences --plot runs/tiny_rm_grpo

# On-policy distillation: the arith demo's model (run.seed=1) as the teacher, made first when absent,
# then a smaller fresh student learning from its per-token log-probs.
demo-distill: $(VENV)/.extras
	test -n "$$(ls runs/tiny_arith_teacher/checkpoints 2>/dev/null)" || $(BIN)/python -m grpo_jax.train \
	  --config configs/tiny_arith.yaml --set run.seed=1 --workdir runs/tiny_arith_teacher
	$(BIN)/python -m grpo_jax.train --config configs/tiny_arith_distill.yaml

# The core on the GPU images' JAX (requirements-gpu-image.txt), checked on the CPU in an environment of
# its own; those packages need Python 3.12. Where no python3.12 is found, it skips and says so.
PYTHON_GPU_IMAGE ?= $(call first_python,$(HOME)/.pyenv/versions/3.12*/bin/python3.12 \
  /root/.pyenv/versions/3.12*/bin/python3.12 $$(command -v python3.12))
GPU_IMAGE_VENV := .venv-gpu-image

$(GPU_IMAGE_VENV)/.installed: requirements-gpu-image.txt
	rm -rf $(GPU_IMAGE_VENV)
	$(PYTHON_GPU_IMAGE) -m venv $(GPU_IMAGE_VENV)
	$(GPU_IMAGE_VENV)/bin/pip install --quiet --upgrade pip
	$(GPU_IMAGE_VENV)/bin/pip install --quiet -r requirements-gpu-image.txt
	touch $@

core-smoke:
ifeq ($(strip $(PYTHON_GPU_IMAGE)),)
	@echo "core-smoke: no python3.12 here, so the GPU images' JAX was not checked"
else
	$(MAKE) $(GPU_IMAGE_VENV)/.installed
	JAX_COMPILATION_CACHE_DIR=$(CURDIR)/.cache/jax-core-smoke $(GPU_IMAGE_VENV)/bin/python tests/core_smoke.py
endif

# Two workers; a file whose module fixtures are costly runs whole on one (its xdist_group), every
# other test goes to whichever worker is free, the long ones (marked starts_first) first
# (tests/conftest.py). Every run ends with its 30 slowest tests and the tier's total against its
# budget; GRPO_JAX_TEST_PROFILE=FILE make test adds each test's CPU, its subprocesses' included, and
# its compiles (tests/profiling.py). The compiled programs stay in .cache/jax-tests for the next run.
PYTEST := $(BIN)/python -m pytest -n 2 --dist loadgroup -q --durations=30

# The fast tier: every test not marked exhaustive.
test: $(VENV)/.test $(VENV)/.compilers sandbox
	$(PYTEST) -m 'not exhaustive' --tier=test

# What CI runs: every test but the long ones, and the core on the GPU images' JAX.
test-all: $(VENV)/.test $(VENV)/.compilers core-smoke sandbox
	$(PYTEST) -m 'not long' --tier=test-all

# The long tests alone (marked long: the demos' learning curves, the two-process runs, the kill -9
# matrix, the recipes' plans, the docs' commands), which CI's 90 minutes on 2 cores cannot hold beside
# test-all: run it when a change touches what they cover (tests/README.md). test-all and test-long
# together are every test.
test-long: $(VENV)/.test $(VENV)/.compilers sandbox
	$(PYTEST) -m long --tier=test-long

# The sandbox of model-written code (grpo_jax/sandbox.py) is bubblewrap, a system package, beyond
# what .venv holds: as root it is installed with apt-get (Debian, Ubuntu) or dnf (Fedora); otherwise
# one line says how, and make stops.
sandbox:
	@command -v bwrap >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing bubblewrap (apt-get) for the tool sandbox"; \
	    apt-get install -y -qq bubblewrap >/dev/null 2>&1 || { apt-get update -qq >/dev/null && apt-get install -y -qq bubblewrap >/dev/null; }; \
	  elif [ "$$(id -u)" = 0 ] && command -v dnf >/dev/null 2>&1; then \
	    echo "installing bubblewrap (dnf) for the tool sandbox"; dnf install -y -q bubblewrap; \
	  else \
	    echo "the tool sandbox needs bubblewrap: sudo apt-get install bubblewrap (or dnf install bubblewrap), then make test again"; exit 1; \
	  fi; }

# The edit loop: the unit tests (no CLI run, no learning run, no deviceless compile), under 3 minutes.
test-fast: $(VENV)/.test
	$(PYTEST) -m fast --tier=test-fast

bench: $(VENV)/.test
	$(BIN)/python bench/forward.py

clean:
	rm -rf $(VENV) $(GPU_IMAGE_VENV) .cache runs data/tiny_math data/tiny_rm
