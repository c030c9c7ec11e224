# make demo: set up .venv and run the default job; make test: set up .venv (and the deviceless TPU/GPU
# compilers in .venv/compilers), check the core on the GPU images' JAX (core-smoke), run every test.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo demo-agent demo-math test core-smoke bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.runtime: requirements.txt pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -r requirements.txt
	$(BIN)/pip install --quiet --no-deps -e .
	touch $@

# TensorFlow-backed extras: clu's TensorBoard writer, JetStream serving, tfds / HF datasets.
$(VENV)/.extras: requirements-extras.txt $(VENV)/.runtime
	$(BIN)/pip install --quiet -r requirements-extras.txt
	touch $@

$(VENV)/.test: requirements-test.txt $(VENV)/.extras
	$(BIN)/pip install --quiet -r requirements-test.txt
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

demo-math: $(VENV)/.extras
	$(BIN)/python -m grpo_jax.data.word_problems --out data/tiny_math
	$(BIN)/python -m grpo_jax.train --config configs/tiny_math.yaml

# The core on the GPU images' JAX (requirements-gpu-image.txt), checked on the CPU in an environment of
# its own; those packages need Python 3.12. Where no python3.12 is found, it skips and says so.
PYTHON_GPU_IMAGE ?= $(shell for p in $(HOME)/.pyenv/versions/3.12*/bin/python3.12 /root/.pyenv/versions/3.12*/bin/python3.12 \
  $$(command -v python3.12); do "$$p" -c 'import venv' >/dev/null 2>&1 && echo "$$p" && break; done)
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
	$(GPU_IMAGE_VENV)/bin/python tests/core_smoke.py
endif

test: $(VENV)/.test $(VENV)/.compilers core-smoke
	$(BIN)/python -m pytest -n 2 --dist loadfile -q

bench: $(VENV)/.test
	$(BIN)/python bench/forward.py

clean:
	rm -rf $(VENV) $(GPU_IMAGE_VENV) runs data/tiny_math
