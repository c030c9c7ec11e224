"""Shared fixtures: tiny random Hugging Face Qwen2 checkpoints built inside the tests.

Eight fake CPU devices are configured before jax is imported so mesh tests can run in-process;
single-device tests simply use the first device.
"""

import os

os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8').strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import numpy as np  # noqa: E402
import pytest  # noqa: E402


def random_hf_model(seed: int, **overrides):
  """A transformers Qwen2ForCausalLM with every parameter random, biases and norms included
  (the default init leaves biases at 0 and norms at 1, which would hide layout mistakes)."""
  import torch
  from transformers import Qwen2Config, Qwen2ForCausalLM

  fields = dict(vocab_size=1000, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0,
                max_position_embeddings=1024, tie_word_embeddings=False)
  fields.update(overrides)
  torch.manual_seed(seed)
  model = Qwen2ForCausalLM(Qwen2Config(**fields)).eval()
  generator = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, parameter in model.named_parameters():
      noise = torch.randn(parameter.shape, generator=generator)
      if name.endswith('norm.weight'):
        parameter.copy_(1.0 + 0.2 * noise)
      elif name.endswith('bias'):
        parameter.copy_(0.5 * noise)
      else:
        parameter.copy_(0.08 * noise)
  return model


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
    model = random_hf_model(seed, **overrides)
    directory = tmp_path / name
    kwargs = {'max_shard_size': shard_size} if shard_size else {}
    model.save_pretrained(directory, **kwargs)
    return str(directory), model

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
