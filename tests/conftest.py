"""Shared fixtures: tiny random Hugging Face Qwen2 checkpoints built inside the tests (by
grpo_jax.testing, which benchmarks share).

Eight fake CPU devices are configured before jax is imported so mesh tests can run in-process;
single-device tests simply use the first device.
"""

import atexit
import os
import shutil
import tempfile

# XLA:CPU's LLVM backend at -O0: the suite's programs are tiny, so compiling them is most of its
# time, and unoptimised machine code halves it (a 24-step CLI run: 31 s of CPU cold, 16.5 s at -O0);
# the HLO passes, and with them every program's numbers and layouts, are unchanged. Subprocesses
# inherit it (tests/runs.py device_env keeps it when it changes the device count).
os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' --xla_backend_optimization_level=0'
                           ' --xla_force_host_platform_device_count=8').strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

# JAX's persistent compilation cache, one per run of the suite: the xdist workers and every CLI the
# tests start inherit it, so a program the suite compiled once (the demo's RL step, the tiny
# model's forward) is read back instead of compiled again in each process (a 12-step CLI run: 19.6
# s cold, 10.3 s warm). A run's own folder, so what a fresh clone measures is what CI measures;
# JAX_COMPILATION_CACHE_DIR set outside keeps a cache across runs.
if 'JAX_COMPILATION_CACHE_DIR' not in os.environ:
  _CACHE = tempfile.mkdtemp(prefix='grpo_jax-compile-cache-')
  os.environ['JAX_COMPILATION_CACHE_DIR'] = _CACHE
  atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)  # the controller made it: it removes it
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0.3')

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from grpo_jax.testing import save_random_hf_checkpoint  # noqa: E402


@pytest.fixture
def seed():
  """A fresh seed per test run, printed so a failure can be replayed: TEST_SEED=N pytest ..."""
  value = int(os.environ.get('TEST_SEED') or int.from_bytes(os.urandom(4), 'little'))
  print(f'seed={value}')
  return value


@pytest.fixture
def make_hf_checkpoint(tmp_path):
  """make_hf_checkpoint(seed, name='hf', shard_size=None, **config) -> (directory, torch model)."""

  def make(seed, name='hf', shard_size=None, **overrides):
    directory = str(tmp_path / name)
    return directory, save_random_hf_checkpoint(directory, seed, max_shard_size=shard_size, **overrides)

  return make


def torch_logits(model, tokens, attention_mask=None, position_ids=None):
  import torch
  with torch.no_grad():
    kwargs = {}
    if attention_mask is not None:
      kwargs['attention_mask'] = torch.tensor(np.asarray(attention_mask))
    if position_ids is not None:
      kwargs['position_ids'] = torch.tensor(np.asarray(position_ids))
    return model(torch.tensor(np.asarray(tokens)), **kwargs).logits.float().numpy()


# `make test-fast` (pytest -m fast): the files of unit tests against their references (the maths,
# the model against transformers, the kernels against the naive path, the sampler), none of which
# starts a CLI, trains a run or compiles for an accelerator: under 3 minutes (test_update.py, 2.5
# minutes of CPU alone, stays with the whole suite).
FAST_FILES = {'test_adapters', 'test_algo', 'test_api', 'test_attention', 'test_decode_attention', 'test_hf_config',
              'test_launch', 'test_logprob', 'test_model_parity', 'test_reward_cases', 'test_reward_terms',
              'test_rollout', 'test_sampling', 'test_sharding', 'test_tools'}


def pytest_configure(config):
  if os.environ.get('GRPO_JAX_TEST_PROFILE'):  # CPU by test, subprocesses included (tests/profiling.py)
    import profiling
    config.pluginmanager.register(profiling)  # pytest calls its pytest_configure on registering it


def pytest_collection_modifyitems(config, items):
  """Marks the fast files' tests `fast`; puts the longest tests (marked slow) first: xdist hands
  tests out in this order, so the two workers do not end with one still running a long test alone."""
  for item in items:
    if item.path.stem in FAST_FILES and item.get_closest_marker('slow') is None:
      item.add_marker(pytest.mark.fast)
  items.sort(key=lambda item: item.get_closest_marker('slow') is None)
