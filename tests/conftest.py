"""Shared fixtures: tiny random Hugging Face Qwen2 checkpoints built inside the tests (by
grpo_jax.testing, which benchmarks share).

Eight fake CPU devices are configured before jax is imported so mesh tests can run in-process;
single-device tests simply use the first device.
"""

import os

os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8').strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

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
