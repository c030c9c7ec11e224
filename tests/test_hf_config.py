"""Reading config.json in both transformers spellings, for every Qwen2.5 size."""

import dataclasses
import math

import jax
import numpy as np
import pytest
from flax import nnx

from grpo_jax.errors import UserError
from grpo_jax.model import ModelOptions, from_hf_dict, to_hf_dict
from grpo_jax.model.loading import abstract_model
from grpo_jax.model.presets import QWEN2_5_PRESETS, QWEN3_PRESETS, preset
from grpo_jax.sharding import spec_for

# The parameter counts on the Qwen2.5 model cards, in billions.
PUBLISHED_BILLIONS = {'0.5B': 0.49, '1.5B': 1.54, '3B': 3.09, '7B': 7.61, '14B': 14.7, '32B': 32.5, '72B': 72.7}


def hub_v4(shape: dict) -> dict:
  """A config.json as the hub ships it for transformers 4.x, `shape` a QWEN2_5_PRESETS entry."""
  return {'architectures': ['Qwen2ForCausalLM'], 'model_type': 'qwen2', 'hidden_act': 'silu',
          'rope_theta': 1000000.0, 'rms_norm_eps': 1e-06, 'torch_dtype': 'bfloat16',
          'use_sliding_window': False, 'sliding_window': 131072, 'max_window_layers': 21,
          'max_position_embeddings': 32768, 'bos_token_id': 151643, 'eos_token_id': 151645,
          'rope_scaling': None, 'attention_dropout': 0.0, 'use_cache': True, **shape}


def as_v5(raw: dict) -> dict:
  """The same config in transformers-5.x spelling."""
  raw = dict(raw)
  raw['rope_parameters'] = {'rope_type': 'default', 'rope_theta': raw.pop('rope_theta')}
  raw['dtype'] = raw.pop('torch_dtype')
  raw.pop('rope_scaling')
  return raw


@pytest.mark.parametrize('size', sorted(QWEN2_5_PRESETS))
def test_every_qwen2_5_size(size):
  shape, published_billions = QWEN2_5_PRESETS[size], PUBLISHED_BILLIONS[size]
  config = from_hf_dict(hub_v4(shape))
  assert from_hf_dict(as_v5(hub_v4(shape))) == config
  assert config.rope_theta == 1e6 and config.checkpoint_dtype == 'bfloat16'
  assert config.eos_token_ids == (151645,)
  # Model cards give three significant digits, some rounded and some truncated (14.77B -> '14.7B').
  assert abs(config.num_params() / 1e9 - published_billions) <= 0.01 * published_billions

  # The module built for this config (abstractly: no memory) has exactly that many parameters.
  model = abstract_model(config, ModelOptions(param_dtype='bfloat16'))
  leaves = jax.tree.leaves(nnx.state(model))
  assert sum(math.prod(leaf.shape) for leaf in leaves) == config.num_params()

  # On a 64-device fsdp x tensor mesh every device holds about 1/64 of the model when the tensor
  # axis divides the heads (14B, 32B, 72B); otherwise heads are replicated over it, and FSDP
  # alone still bounds a device's share by about 1/8.
  mesh = {'data': 1, 'fsdp': 8, 'tensor': 8}
  flat = nnx.to_flat_state(nnx.state(model))
  per_device = 0
  for _, variable in flat:
    spec = spec_for(variable.shape, variable.logical_axes, mesh)
    split = math.prod(math.prod(mesh[a] for a in ((axis,) if isinstance(axis, str) else axis))
                      for axis in spec if axis is not None)
    per_device += math.prod(variable.shape) // split
  heads_divide = config.num_attention_heads % 8 == 0 and config.num_key_value_heads % 8 == 0
  assert per_device <= 1.1 * config.num_params() / (64 if heads_divide else 8)


# The Qwen3 model cards' counts in billions: (all parameters, non-embedding parameters).
QWEN3_PUBLISHED = {'0.6B': (0.6, 0.44), '1.7B': (1.7, 1.4), '4B': (4.0, 3.6), '8B': (8.2, 6.95),
                   '14B': (14.8, 13.2), '32B': (32.8, 31.2)}


@pytest.mark.parametrize('size', sorted(QWEN3_PRESETS))
def test_every_qwen3_size(size):
  """A Qwen3 config.json as the hub ships it reads as the preset, with the model card's counts; the
  module built for it has exactly that many parameters, the per-head norms [L, H] among them."""
  shape = QWEN3_PRESETS[size]
  raw = dict(hub_v4({name: value for name, value in shape.items() if name != 'qk_norm'}),
             architectures=['Qwen3ForCausalLM'], model_type='qwen3', max_position_embeddings=40960)
  config = from_hf_dict(raw)
  assert config == preset(f'Qwen3-{size}', bos_token_id=151643, eos_token_ids=(151645,), checkpoint_dtype='bfloat16')
  total, non_embedding = QWEN3_PUBLISHED[size]
  embedding = config.vocab_size * config.hidden_size * (1 if config.tie_word_embeddings else 2)
  assert abs(config.num_params() / 1e9 - total) <= 0.02 * total  # cards round to two digits ('0.6B')
  assert abs((config.num_params() - embedding) / 1e9 - non_embedding) <= 0.01 * non_embedding
  state = nnx.state(abstract_model(config, ModelOptions(param_dtype='bfloat16')))
  assert sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(state)) == config.num_params()
  assert state['layers']['q_norm'].shape == (config.num_hidden_layers, 128)
  assert 'q_bias' not in state['layers']


def test_round_trip_through_hf_dict():
  config = from_hf_dict(hub_v4(QWEN2_5_PRESETS['7B']))
  assert from_hf_dict(to_hf_dict(config)) == config
  qwen3 = dataclasses.replace(config, attention_bias=False, qk_norm=True, head_dim=128)
  written = to_hf_dict(qwen3)
  assert (written['model_type'], written['architectures'], written['attention_bias']) == ('qwen3', ['Qwen3ForCausalLM'], False)
  assert from_hf_dict(written) == qwen3


@pytest.mark.parametrize('change, message', [
    (dict(use_sliding_window=True), 'use_sliding_window=true is not supported'),
    (dict(architectures=['Gemma2ForCausalLM'], model_type='gemma2'), 'unsupported architecture Gemma2ForCausalLM'),
    (dict(rope_scaling={'type': 'dynamic', 'factor': 4.0}), "rope type 'dynamic' is not supported"),
    (dict(hidden_act='gelu'), "hidden_act='gelu' is not supported"),
    (dict(num_key_value_heads=3), 'must be a multiple of num_key_value_heads (3)'),
    (dict(hidden_size=None), 'missing field hidden_size'),
    (dict(architectures=['Qwen2MoeForCausalLM'], model_type='qwen2_moe'),
     "unsupported architecture Qwen2MoeForCausalLM (model_type 'qwen2_moe')"),
    (dict(architectures=['Qwen3ForCausalLM'], model_type='qwen3', attention_bias=True),
     'attention_bias=true is not supported for qwen3'),
])
def test_refusals_are_clear(change, message):
  raw = hub_v4(QWEN2_5_PRESETS['0.5B'])
  raw.update(change)
  if raw.get('hidden_size') is None:
    raw.pop('hidden_size')
  with pytest.raises(UserError) as error:
    from_hf_dict(raw)
  assert message in str(error.value)


def test_rope_theta_from_checkpoint_changes_logits():
  """rope_theta is read, not assumed: two thetas give different logits for the same weights."""
  from grpo_jax.model import Qwen2Config, init_model
  import dataclasses
  tokens = np.random.default_rng(0).integers(0, 256, (1, 40), dtype=np.int32)
  base = Qwen2Config(rope_theta=10000.0)
  a = init_model(base, seed=3)
  b = init_model(dataclasses.replace(base, rope_theta=1e6), seed=3)
  assert not np.allclose(np.asarray(a(tokens)), np.asarray(b(tokens)), atol=1e-4)
