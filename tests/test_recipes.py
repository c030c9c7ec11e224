"""Every recipe in configs/ loads, passes every check, starts with the command that runs it, and its
RL step traces and lowers on abstract shapes (no weights, no data) at reduced depth over 8 CPU
devices: the recipe's mesh, batch, sequence lengths, rewards and algorithm as the run builds them."""

import os

import jax
import pytest

from grpo_jax import config as config_lib
from grpo_jax import sharding
from grpo_jax.plan.programs import model_architecture, step_programs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# recipe -> (model size, a --model-size preset; devices it is traced over here)
RECIPES = {
    'tiny_arith.yaml': (None, 1),
    'tiny_arith_lora.yaml': (None, 1),
    'tiny_arith_moe.yaml': (None, 1),
    'tiny_math.yaml': (None, 1),
    'tiny_guess.yaml': (None, 1),
    'tiny_spot.yaml': (None, 1),
    'tiny_spot_agent.yaml': (None, 1),
    'qwen2_5_3b_gsm8k_tool.yaml': ('3B', 8),
    'qwen2_5_0_5b_gsm8k.yaml': ('0.5B', 1),
    'qwen2_5_0_5b_math.yaml': ('0.5B', 8),
    'qwen2_5_7b_math.yaml': ('7B', 8),
    'qwen2_5_7b_math_lora.yaml': ('7B', 8),
    'qwen2_5_vl_7b_geo3k.yaml': ('Qwen2.5-VL-7B', 8),
    'qwen2_5_math_dapo.yaml': ('7B', 8),
    'qwen2_5_32b_dapo_aime.yaml': ('32B', 8),
    'qwen2_5_32b_dapo_aime_lora.yaml': ('32B', 8),
    'qwen3_8b_math.yaml': ('Qwen3-8B', 8),
    'qwen3_8b_hh_reward_model.yaml': ('Qwen3-8B', 8),
    'qwen3_32b_dapo_aime.yaml': ('Qwen3-32B', 8),
    'qwen3_32b_long_32k.yaml': ('Qwen3-32B', 8),
    'qwen3_32b_long_64k.yaml': ('Qwen3-32B', 8),
    'qwen3_30b_a3b_dapo.yaml': ('Qwen3-30B-A3B', 8),
    'qwen3_235b_a22b_dapo.yaml': ('Qwen3-235B-A22B', 8),
    'deepseek_llm_7b_math.yaml': ('DeepSeek-LLM-7B', 8),
    'llama3_1_8b_math.yaml': ('Llama-3.1-8B', 8),
    'mistral_nemo_12b_math.yaml': ('Mistral-Nemo-12B', 8),
    'glm4_9b_math.yaml': ('GLM-4-9B-0414', 8),
    'gemma3_12b_math.yaml': ('Gemma-3-12B', 8),
    'tiny_rm_grpo.yaml': (None, 1),
    'tiny_arith_distill.yaml': (None, 1),
    'qwen3_1_7b_distill_qwen3_8b.yaml': ('Qwen3-1.7B', 8),
    'tiny_arith_mla.yaml': (None, 1),
    'moonlight_16b_a3b_math.yaml': ('Moonlight-16B-A3B', 8),
    'deepseek_v3_671b_math.yaml': ('DeepSeek-V3-671B', 8),
}
# The reward-model trainer's configs (python -m grpo_jax.train_reward): no RL step to lower.
REWARD_MODEL_CONFIGS = ('tiny_reward_model.yaml',)


def test_every_config_is_listed():
  assert sorted([*RECIPES, *REWARD_MODEL_CONFIGS]) == sorted(
      name for name in os.listdir(os.path.join(ROOT, 'configs')) if name.endswith('.yaml'))


@pytest.mark.parametrize('name', REWARD_MODEL_CONFIGS)
def test_reward_model_config_loads(name):
  from grpo_jax import train_reward
  path = os.path.join(ROOT, 'configs', name)
  with open(path) as f:
    assert f.readline().startswith('# python -m ')  # the command that runs it
  assert train_reward.load_config(path).train.steps > 0


# Lowered in make test-all only: the 671B recipe's 256 experts (Moonlight's lowers the architecture in make test),
# the 32k recipe (the 32B's; its 64k sibling lowers the context axis in make test).
EXHAUSTIVE = ('deepseek_v3_671b_math.yaml', 'qwen3_32b_long_32k.yaml')


@pytest.mark.parametrize('name', [pytest.param(name, marks=pytest.mark.exhaustive) if name in EXHAUSTIVE else name
                                  for name in sorted(RECIPES)])
def test_recipe_loads_and_its_step_lowers(name, tmp_path):
  path = os.path.join(ROOT, 'configs', name)
  with open(path) as f:
    assert f.readline().startswith('# python -m ')  # the command that runs it
  config = config_lib.load_config(path)
  size, count = RECIPES[name]
  if name == 'tiny_math.yaml':  # its tokenizer is written by the word-problem generator
    from grpo_jax.data import word_problems
    files = word_problems.write(str(tmp_path / 'data'))
    config = config_lib.load_config(path, [f'task.tokenizer={files["tokenizer"]}'])
  if name == 'tiny_rm_grpo.yaml':  # its tokenizer and reward model come from the demo's first steps
    from grpo_jax.data import synthetic_preferences
    from grpo_jax.testing import save_random_hf_checkpoint
    files = synthetic_preferences.write(str(tmp_path / 'data'), pairs=4, held_out=2)
    save_random_hf_checkpoint(str(tmp_path / 'rm'), 0, head='score', vocab_size=64)
    config = config_lib.load_config(path, [
        f'task.tokenizer={files["tokenizer"]}', f'task.source={files["prompts"]}',
        f'rewards=[{{name: reward_model, path: "{tmp_path / "rm"}", dtype: float32}}]'])
  if name == 'tiny_arith_distill.yaml':  # its teacher is the one make demo-distill trains: its config.json here
    import json

    from grpo_jax.model.hf_config import to_hf_dict
    teacher = config_lib.load_config(os.path.join(ROOT, 'configs', 'tiny_arith.yaml')).model.architecture
    (tmp_path / 'teacher').mkdir()
    (tmp_path / 'teacher' / 'config.json').write_text(json.dumps(to_hf_dict(teacher, dtype='float32')))
    config = config_lib.load_config(path, [f'algo.teacher={tmp_path / "teacher"}'])
  architecture = model_architecture(config, size, layers=2)
  mesh = sharding.make_mesh(config.mesh, jax.devices()[:count])
  built = step_programs(config, architecture, mesh)
  with jax.set_mesh(mesh):
    for _, jitted, args in built.programs:
      jitted.trace(*args).lower()
  built.task.close()


def test_the_headline_recipe_is_the_megatron_one():
  """Qwen2.5-32B on DAPO-Math-17k, 64 x 16 per step, lr 1e-6, beta 0, clip 0.2 / 0.28, ~12k tokens,
  AIME 2024 pass@32 during training."""
  config = config_lib.load_config(os.path.join(ROOT, 'configs', 'qwen2_5_32b_dapo_aime.yaml'))
  assert (config.rollout.prompts_per_step, config.algo.group_size) == (64, 16)
  assert config.optim.learning_rate == 1e-6 and config.algo.kl_beta == 0
  assert (config.algo.epsilon_low, config.algo.epsilon_high) == (0.2, 0.28)
  assert config.task.max_prompt_tokens + config.rollout.max_new_tokens == 12288
  assert config.task.dataset.format == 'dapo_processed' and config.algo.dynamic_sampling
  assert (config.eval.dataset.format, config.eval.k, config.eval.samples) == ('aime', 32, 32)
  assert [term.name for term in config.rewards] == ['math', 'overlong']


@pytest.mark.parametrize('name', ['qwen3_8b_math.yaml', 'qwen3_32b_dapo_aime.yaml'])
def test_the_qwen3_recipes_are_their_qwen2_5_recipes_moved(name):
  """Each Qwen3 recipe is a Qwen2.5 one with the model and the thinking switch changed: the same
  data, rewards, batch, budgets, algorithm, optimizer and evaluation."""
  load = lambda recipe: config_lib.to_dict(config_lib.load_config(os.path.join(ROOT, 'configs', recipe)))  # noqa: E731
  qwen3 = load(name)
  qwen2_5 = load(name.replace('qwen3_8b', 'qwen2_5_7b').replace('qwen3_32b', 'qwen2_5_32b'))
  thinking = qwen3['task'].pop('enable_thinking')
  assert thinking is (name == 'qwen3_32b_dapo_aime.yaml')  # the 32B's 10,240-token budget holds a thinking trace
  assert qwen3['run'].pop('name') == name[:-len('.yaml')]
  assert 'Qwen3' in qwen3['model'].pop('path')
  assert qwen2_5['task'].pop('enable_thinking') is None  # Qwen2.5's templates have no switch
  del qwen2_5['run']['name'], qwen2_5['model']['path']
  assert qwen3 == qwen2_5


@pytest.mark.parametrize('name, changed', [
    ('qwen2_5_7b_math_lora.yaml', {'rollout': {'slots': 128}, 'eval': {'batch_prompts': 32}}),
    ('qwen2_5_32b_dapo_aime_lora.yaml', {'rollout': {'slots': 128}, 'algo': {'micro_batch_size': 8}}),
])
def test_the_lora_recipes_are_their_full_recipes_through_adapters(name, changed):
  """Each LoRA recipe is its full-parameter recipe with rank-64 adapters on every linear layer, 10x
  the learning rate, and only the knobs that fit it on fewer devices changed (decode slots,
  micro-batches, eval batch: the same samples and gradients)."""
  load = lambda recipe: config_lib.to_dict(config_lib.load_config(os.path.join(ROOT, 'configs', recipe)))  # noqa: E731
  lora, full = load(name), load(name.replace('_lora', ''))
  assert lora['model'].pop('lora') == dict(rank=64, alpha=32.0, targets=['q', 'k', 'v', 'o', 'gate', 'up', 'down'],
                                           rslora=False, dropout=0.0)
  assert lora['optim'].pop('learning_rate') == pytest.approx(10 * full['optim'].pop('learning_rate'))
  assert lora['run'].pop('name') == name[:-len('.yaml')]
  del full['run']['name'], full['model']['lora']
  for section, fields in changed.items():
    for field, value in fields.items():
      assert lora[section].pop(field) == value and full[section].pop(field) != value
  assert lora == full
