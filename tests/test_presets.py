"""The --model-size presets of the families beyond Qwen (grpo_jax/model/presets.py) against the
checkpoints they stand for: each preset's parameter count equals, to the parameter, the total of
the hub checkpoint's tensors (written beside it, from the model card or the sum of the shapes its
config.json implies; Gemma 3 4B-27B: the language model's tensors only), counted three ways that
must agree: the config's formula, the abstract model (nnx.eval_shape, no weights) and
transformers' own model class built on the meta device from the config.json we write."""

import math

import jax
import pytest
import torch
import transformers
from flax import nnx

from grpo_jax.model.config import from_hf_dict, to_hf_dict
from grpo_jax.model.loading import abstract_model
from grpo_jax.model.presets import FAMILY_PRESETS, preset

# Every tensor of the checkpoint, a tied embedding once. Where the model card gives only a rounded
# figure, that figure is in the comment and the exact total is the sum of the config.json's shapes
# (the same sum transformers builds below).
TOTALS = {
    'Llama-3.2-1B': 1_235_814_400,  # the card's safetensors total
    'Llama-3.2-3B': 3_212_749_824,  # the card's safetensors total
    'Llama-3.1-8B': 8_030_261_248,  # the card's safetensors total
    'Llama-3.1-70B': 70_553_706_496,  # card: 70.6B
    'DeepSeek-LLM-7B': 6_910_365_696,  # card: 6.91B (the hub page's 7B)
    'Mistral-7B-v0.3': 7_248_023_552,  # the card's safetensors total
    'Mistral-Nemo-12B': 12_247_782_400,  # card: 12.2B
    'Mistral-Small-24B': 23_572_403_200,  # card: 23.6B
    'GLM-4-9B-0414': 9_400_279_040,  # card: 9.4B
    'GLM-4-32B-0414': 32_566_487_552,  # card: 32.6B
    'Gemma-3-1B': 999_885_952,  # the card's safetensors total
    'Gemma-3-4B': 3_880_263_168,  # text only; card 4.3B with the ~0.42B SigLIP tower and projector
    'Gemma-3-12B': 11_766_034_176,  # text only; card 12.2B with them
    'Gemma-3-27B': 27_009_346_304,  # text only; card 27.4B with them
}


def test_every_family_preset_has_its_total():
  assert sorted(TOTALS) == sorted(FAMILY_PRESETS)


@pytest.mark.parametrize('name', sorted(FAMILY_PRESETS))
def test_family_presets_count_their_checkpoints_parameters(name):
  config = preset(name)
  assert config.num_params() == TOTALS[name]
  # The model as the plan builds it: every parameter of the abstract model.
  state = nnx.state(abstract_model(config), nnx.Param)
  assert sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(state)) == TOTALS[name]
  # transformers' model class of the config.json we write for it, built without memory.
  hf_config = transformers.AutoConfig.for_model(**to_hf_dict(config))
  with torch.device('meta'):
    reference = transformers.AutoModelForCausalLM.from_config(hf_config)
  assert type(reference).__name__ == to_hf_dict(config)['architectures'][0]
  assert sum(p.numel() for p in reference.parameters()) == TOTALS[name]
  assert from_hf_dict(to_hf_dict(config)) == config  # as a config.json writes and reads it
