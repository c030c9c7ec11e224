"""The --model-size presets of the families beyond Qwen (grpo_jax/model/presets.py) against the
checkpoints they stand for: each preset's parameter count equals, to the parameter, the total of
the hub checkpoint's tensors (written beside it, from the model card or the sum of the shapes its
config.json implies; Gemma 3 4B-27B: the language model's tensors only), counted three ways that
must agree: the config's formula, the abstract model (nnx.eval_shape, no weights) and
transformers' own model class built on the meta device from the config.json we write. The
presets whose hub config.json tests/test_families.py writes out by hand read back from that file,
and each family's recipe is planned for 8 H100s (make test-all)."""

import math

import jax
import pytest
import torch
import transformers
from flax import nnx

from grpo_jax.model.hf_config import from_hf_dict, to_hf_dict
from grpo_jax.model.loading import abstract_model
from grpo_jax.model.presets import FAMILY_PRESETS, preset

# Every tensor of the checkpoint, a tied embedding once. "exact": the published safetensors total.
# "rounded": only a rounded figure was at hand (the hub page's parameter count, recalled without
# network access: ROUNDED, which the total must round to); the exact figure is then the sum of the
# config.json's shapes, which transformers' count below confirms for that config. Gemma 3 4B-27B's
# rounded figures count the SigLIP tower and projector too, so they are not checked.
TOTALS = {
    'Llama-3.2-1B': 1_235_814_400,  # exact
    'Llama-3.2-3B': 3_212_749_824,  # exact
    'Llama-3.1-8B': 8_030_261_248,  # exact
    'Llama-3.1-70B': 70_553_706_496,  # rounded: 70.6B
    'DeepSeek-LLM-7B': 6_910_365_696,  # rounded: 6.91B
    'Mistral-7B-v0.3': 7_248_023_552,  # exact
    'Mistral-Nemo-12B': 12_247_782_400,  # rounded: 12.2B
    'Mistral-Small-24B': 23_572_403_200,  # rounded: 23.6B
    'GLM-4-9B-0414': 9_400_279_040,  # rounded: 9.4B
    'GLM-4-32B-0414': 32_566_487_552,  # rounded: 32.6B
    'Gemma-3-1B': 999_885_952,  # exact
    'Gemma-3-4B': 3_880_263_168,  # rounded: 4.3B with the ~0.42B SigLIP tower and projector not counted here
    'Gemma-3-12B': 11_766_034_176,  # rounded: 12.2B with them
    'Gemma-3-27B': 27_009_346_304,  # rounded: 27.4B with them
    # The main model's tensors, its choice biases included; the multi-token-prediction layer's 14B not.
    'DeepSeek-V3-671B': 671_026_419_200,  # rounded: 671.0B (the card's 671B; 685B with that layer)
    'Moonlight-16B-A3B': 15_960_110_208,  # rounded: 16.0B (the card's 16B)
}
# Activated per token: the k routed experts of each sparse layer, its shared experts and router.
ACTIVE = {'DeepSeek-V3-671B': 37_552_297_472,  # the card's 37B
          'Moonlight-16B-A3B': 2_914_776_192}  # the card's 3B
ROUNDED = {'Llama-3.1-70B': '70.6', 'DeepSeek-LLM-7B': '6.91', 'Mistral-Nemo-12B': '12.2',
           'Mistral-Small-24B': '23.6', 'GLM-4-9B-0414': '9.4', 'GLM-4-32B-0414': '32.6', 'DeepSeek-V3-671B': '671.0',
           'Moonlight-16B-A3B': '16.0'}


def test_every_family_preset_has_its_total():
  assert sorted(TOTALS) == sorted(FAMILY_PRESETS)
  for name, billions in ROUNDED.items():
    decimals = len(billions.split('.')[1])
    assert f'{TOTALS[name] / 1e9:.{decimals}f}' == billions, name


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
  # DeepSeekMoE's choice bias is a buffer there, a tensor of the checkpoint all the same.
  biases = sum(b.numel() for n, b in reference.named_buffers() if n.endswith('e_score_correction_bias'))
  assert sum(p.numel() for p in reference.parameters()) + biases == TOTALS[name]
  assert from_hf_dict(to_hf_dict(config)) == config  # as a config.json writes and reads it
  if name in ACTIVE:  # transformers' total less the E - k routed experts a token does not use, layer by layer
    idle = sum((config.num_experts - config.num_experts_per_tok) * (m.gate_up_proj[0].numel() + m.down_proj[0].numel())
               for n, m in reference.named_modules() if n.endswith('mlp.experts'))
    assert config.num_params(active=True) == TOTALS[name] - idle == ACTIVE[name]


# The presets whose hub config.json tests/test_families.py writes out by hand (a base checkpoint's
# file where the preset names the family's instruct one: the architecture is the same).
HUB_FILES = {'Llama-3.2-1B': 'Llama-3.2-1B', 'DeepSeek-LLM-7B': 'deepseek-llm-7b-base',
             'Mistral-Nemo-12B': 'Mistral-Nemo-Base-2407', 'GLM-4-9B-0414': 'GLM-4-9B-0414',
             'Gemma-3-1B': 'gemma-3-1b-pt', 'Gemma-3-4B': 'gemma-3-4b-pt'}


@pytest.mark.parametrize('name', sorted(HUB_FILES))
def test_presets_are_their_hub_config_files(name):
  """The preset is the architecture the checkpoint's own config.json reads as, to every field but
  the token ids and the stored dtype (which the plan does not use)."""
  import dataclasses

  from test_families import HUB_CONFIGS
  read = from_hf_dict(HUB_CONFIGS[HUB_FILES[name]])
  assert dataclasses.replace(read, bos_token_id=None, eos_token_ids=(), checkpoint_dtype='float32') == preset(name)


# The recipes of the families that bring weights and attention of their own (GLM-4's extra norms
# and partial rotary, Gemma 3's sliding layers), planned at 2 layers for 8 H100s by XLA:GPU: the
# full-depth figures of all five are BENCHMARKS.md's, minutes each on 2 cores. Llama's and
# Mistral's programs are Qwen's with other sizes (test_plan.py's), 29 s each here.
FAMILY_RECIPES = {'glm4': ('glm4_9b_math.yaml', 'GLM-4-9B-0414'),
                  'gemma3_text': ('gemma3_12b_math.yaml', 'Gemma-3-12B')}


@pytest.mark.exhaustive
@pytest.mark.parametrize('family', sorted(FAMILY_RECIPES))
@pytest.mark.long
def test_family_recipe_plans_for_eight_h100s(family, tmp_path):
  """The family's recipe compiled for h100x8: it fits, the parameters are the preset's at 2 layers,
  FSDP splits them and Adam's moments 8 ways, the sampler's tensor groups span the KV heads, and
  the KV cache is the hand count of the recipe's lengths (every layer holds the whole sequence:
  a sliding layer's cache is not yet cut to its window)."""
  import dataclasses
  import json

  from grpo_jax.config import load_config
  from test_deviceless import _run
  recipe, size = FAMILY_RECIPES[family]
  report_path = tmp_path / 'plan.json'
  result = _run('gpu', ['grpo_jax.plan', '--config', f'configs/{recipe}', '--model-size', size, '--layers', '2',
                        '--target', 'h100x8', '--no-advice', '--json', str(report_path)], timeout=900)
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
  report = json.loads(report_path.read_text())
  config, architecture = load_config(f'configs/{recipe}'), preset(size)
  layers = 2
  small = dataclasses.replace(architecture, num_hidden_layers=layers, layer_types=architecture.layer_types[:layers])
  assert report['fits'] and report['devices'] == 8 and report['model']['parameters'] == small.num_params()
  total = small.num_params() * 4  # fp32
  per_device = report['per_device']
  assert total / 8 <= per_device['parameters'] <= total / 8 * 1.01
  assert 2 * total / 8 <= per_device['optimizer_state'] <= 2 * total / 8 * 1.01
  tensor = min(8, architecture.num_key_value_heads)
  assert report['rollout_layout']['tensor'] == tensor and report['rollout_layout']['data_groups'] == 8 // tensor
  rollout = config.rollout
  slots = rollout.slots or rollout.prompts_per_step * config.algo.group_size
  # Each layer's rows: the shared prompts', then the slots' (a sliding layer's: its window, where shorter).
  answer = [min(rollout.max_new_tokens, architecture.sliding_window or rollout.max_new_tokens) if sliding
            else rollout.max_new_tokens for sliding in small.sliding_layers]
  tokens = sum(rollout.prompts_per_step * config.task.max_prompt_tokens + slots * width for width in answer)
  kv_bytes = 2 * tokens * architecture.num_key_value_heads * architecture.resolved_head_dim * 2  # K, V bf16
  assert per_device['kv_cache'] == kv_bytes // 8
