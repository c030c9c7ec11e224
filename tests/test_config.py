"""Run config: YAML + --set overrides, one-line errors naming the key, and the train entry point."""

import dataclasses
import os
import subprocess
import sys

import pytest
import yaml

from grpo_jax.config import Config, from_dict, load_config, to_dict, to_yaml
from grpo_jax.data.sources import DatasetSource
from grpo_jax.errors import UserError
from grpo_jax.model.config import Qwen2Config
from grpo_jax.sampler import SamplingConfig
from runs import device_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write(tmp_path, text):
  path = tmp_path / 'run.yaml'
  path.write_text(text)
  return str(path)


def test_yaml_and_overrides(tmp_path):
  path = write(tmp_path, 'run:\n  seed: 3\nmodel:\n  dtype: bfloat16\n  architecture:\n    num_hidden_layers: 5\n')
  config = load_config(path, ['mesh.tensor=2', 'model.architecture.eos_token_ids=[1, 2]', 'run.seed=9'])
  assert config.run.seed == 9
  assert config.model.options.dtype == 'bfloat16'
  assert config.model.architecture.num_hidden_layers == 5
  assert config.model.architecture.eos_token_ids == (1, 2)
  assert config.mesh.tensor == 2 and config.mesh.fsdp == -1
  assert load_config(None) == Config()


def test_inline_sections_are_written_in_their_parent():
  """The sampling settings, the model options and a dataset are sections of their own in the code,
  written in the section that holds them (rollout.temperature, model.remat, eval.split)."""
  config = load_config(None, ['rollout.temperature=0.7', 'rollout.top_p=0.9', 'model.remat=full',
                              'task.name=math', 'task.source=train.jsonl', 'model.path=m', 'eval.source=test.jsonl'])
  assert config.rollout.sampling == SamplingConfig(temperature=0.7, top_p=0.9)
  assert config.model.options.remat == 'full'
  assert config.task.dataset == DatasetSource('train.jsonl', split='train')
  assert config.eval.dataset == DatasetSource('test.jsonl', split='test')  # each holder's own default
  written = to_dict(config)
  assert written['rollout']['temperature'] == 0.7 and 'sampling' not in written['rollout']
  assert written['model']['remat'] == 'full' and 'options' not in written['model']
  assert (written['task']['source'], written['eval']['split']) == ('train.jsonl', 'test')
  assert from_dict(written) == config


def test_resolved_yaml_reloads_to_the_same_config(tmp_path):
  config = load_config(None, ['model.architecture.head_dim=32', 'model.remat=dots'])
  assert load_config(write(tmp_path, to_yaml(config))) == config


@pytest.mark.parametrize('text, overrides, message', [
    ('model:\n  dtyp: float32\n', [], "unknown config key 'model.dtyp'"),
    ('', ['mesh.tensor=two'], "config key 'mesh.tensor' expects int, got 'two'"),
    ('', ['model.dtype=float64'], "config key 'model.dtype' must be one of 'float32' | 'bfloat16'"),
    ('', ['model.scan_layers=3'], "config key 'model.scan_layers' expects true or false"),
    ('model: 3\n', [], "config key 'model' expects a mapping of fields"),
    ('', ['model.architecture.num_attention_heads=3'], 'must be a multiple of num_key_value_heads'),
    ('', ['mesh.tensor'], 'is not of the form key.path=value'),
    ('run: [1\n', [], 'is not valid YAML'),
    ('', ['model.param_dtype=float16'], "model.param_dtype must be one of 'float32' | 'bfloat16' for training"),
    ('', ['rollout.top_p=1.5'], 'rollout.top_p must be in (0, 1]'),
    ('', ['rollout.sampling.top_p=0.5'], "unknown config key 'rollout.sampling'"),
    ('', ['task.name=math', 'task.source=a.jsonl', 'model.path=m', 'task.mix=[{split: train}]'],
     'task.mix[0].source must name a dataset'),
    ('', ['task.name=math', 'model.path=m'], 'task.source must name the problems for task.name=math'),
    ('', ['algo.shuffle=prompts'], "config key 'algo.shuffle' must be one of 'rows' | 'groups'"),
    ('', ['rollout.prompts_per_step=6', 'algo.group_size=4', 'algo.num_minibatches=4', 'algo.shuffle=groups'],
     "algo.shuffle 'groups' deals whole groups: algo.num_minibatches (4) must divide rollout.prompts_per_step (6)"),
])
def test_mistakes_name_the_key(tmp_path, text, overrides, message):
  with pytest.raises(UserError) as error:
    load_config(write(tmp_path, text), overrides)
  assert message in str(error.value)


@pytest.mark.exhaustive
def test_train_cli_saves_resolved_config_and_trains(tmp_path):
  workdir = tmp_path / 'run'
  result = subprocess.run(
      [sys.executable, '-m', 'grpo_jax.train', '--config', 'configs/tiny_arith.yaml',
       '--set', 'run.seed=5', '--set', 'train.steps=2', '--set', 'train.steps_per_call=1',
       '--set', 'optim.learning_rate=2e-4', '--set', 'train.tensorboard=false', '--workdir', str(workdir)],
      cwd=ROOT, capture_output=True, text=True, timeout=300, env=device_env(1))
  assert result.returncode == 0, result.stderr
  saved = yaml.safe_load((workdir / 'config.yaml').read_text())
  assert saved['run']['seed'] == 5 and saved['train']['steps'] == 2
  assert saved['optim']['learning_rate'] == 2e-4  # '2e-4' (a string to YAML 1.1) read as a float
  assert saved['model']['architecture']['vocab_size'] == 17
  assert 'resolved config' in result.stdout and 'mean reward: first 2 steps' in result.stdout
  assert len((workdir / 'metrics.jsonl').read_text().splitlines()) == 2


def test_train_cli_bad_key_is_one_line(tmp_path):
  result = subprocess.run(
      [sys.executable, '-m', 'grpo_jax.train', '--config', 'configs/tiny_arith.yaml',
       '--set', 'optimiser.lr=1', '--workdir', str(tmp_path / 'run')],
      cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert result.returncode == 2
  assert result.stderr.strip() == \
      ("error: unknown config key 'optimiser' (valid keys here: run, model, mesh, task, rollout, algo, "
       "optim, train, rewards, reward_combination, eval, distributed)")


def test_a_key_added_since_a_checkpoint_was_written_is_not_a_change():
  """Resuming names the keys whose values changed; a key the checkpoint's stored config lacks (a
  setting this code added, e.g. train.tensorboard) is not one of them, a removed or changed one is."""
  from grpo_jax.train import changed_keys
  stored = to_dict(load_config(os.path.join(ROOT, 'configs', 'tiny_arith.yaml'), []))
  del stored['train']['tensorboard']
  stored['algo']['retired_knob'] = 3
  current = to_dict(load_config(os.path.join(ROOT, 'configs', 'tiny_arith.yaml'), ['train.steps=7']))
  assert changed_keys(stored, current) == ['algo.retired_knob: 3 -> None', f'train.steps: {stored["train"]["steps"]} -> 7']


# ---- the task section, a tagged union ----

TASK_CONFIGS = {'arith': 'tiny_arith.yaml', 'math': 'tiny_math.yaml', 'agent': 'tiny_guess.yaml'}
# What each kind's section held before it was a tagged union: every kind's keys, in one section.
# (tiny_math.yaml names files under data/, which are not read to build a config.)
# The task section's keys when it was one class for every kind; environment_args came after.
OLD_SECTION_KEYS = {'name', 'max_operand', 'operators', 'source', 'split', 'format', 'prompt_field', 'answer_field',
                    'mix', 'prompt_template', 'chat_template', 'enable_thinking', 'tokenizer', 'max_prompt_tokens',
                    'reward_workers', 'environment', 'max_turns', 'turn_tokens', 'tools', 'tool_timeout_s',
                    'guess_range'}
EVERY_KIND_KEYS = OLD_SECTION_KEYS | {'environment_args', 'sandbox', 'images_field', 'max_images', 'min_pixels',
                                       'max_pixels', 'skip_bad_images', 'env_timeout_s', 'max_env_failure_frac',
                                       'blank_images', 'turn_context'}


def kind_keys():
  """{kind: its section's keys as written}, from three configs' resolved YAML."""
  return {kind: set(to_dict(load_config(os.path.join(ROOT, 'configs', path)))['task'])
          for kind, path in TASK_CONFIGS.items()}


def test_each_task_kind_holds_its_own_fields():
  from grpo_jax.agents.task import AgentSection
  from grpo_jax.data.arith import ArithSection
  from grpo_jax.data.math_task import MathSection
  keys = kind_keys()
  assert set().union(*keys.values()) == EVERY_KIND_KEYS  # no key of the old section is lost
  assert keys['arith'] == {'name', 'max_operand', 'operators'}
  assert 'max_turns' not in keys['math'] and 'max_operand' not in keys['agent'] and 'source' in keys['agent']
  for kind, cls in (('arith', ArithSection), ('math', MathSection), ('agent', AgentSection)):
    config = load_config(os.path.join(ROOT, 'configs', TASK_CONFIGS[kind]))
    assert type(config.task) is cls and config.task.kind.section is cls
    assert from_dict(to_dict(config)) == config
  # Every --set path of a kind's keys works on a run of that kind (each set to a value of its own).
  values = dict(max_operand=12, operators='+-', source='x.jsonl', split='test', format='gsm8k', prompt_field='q',
                answer_field='a', mix=[], prompt_template='Q: {prompt}', chat_template=False, enable_thinking=True,
                tokenizer='tok', max_prompt_tokens=40, reward_workers=3, environment='my_env:make',
                environment_args={'rounds': 2, 'words': ['a', 'b']}, max_turns=3, turn_tokens=5, sandbox='none',
                tools=['python'], tool_timeout_s=2.0, guess_range=8, images_field='figures', max_images=2,
                min_pixels=100, max_pixels=5000, skip_bad_images=True, env_timeout_s=30.0, max_env_failure_frac=0.5,
                blank_images=True, turn_context='as_rendered')
  for kind, path in TASK_CONFIGS.items():
    sets = [f'task.{key}={yaml.safe_dump(values[key], default_flow_style=True).strip().removesuffix("...").strip()}'
            for key in sorted(keys[kind] - {'name'})]
    task = to_dict(load_config(os.path.join(ROOT, 'configs', path), sets))['task']
    assert {key: task[key] for key in keys[kind] - {'name'}} == {key: values[key] for key in keys[kind] - {'name'}}


def test_another_kinds_key_is_accepted_at_its_default_and_refused_otherwise(tmp_path):
  from grpo_jax.data.arith import ArithSection
  path = os.path.join(ROOT, 'configs', 'tiny_arith.yaml')
  # A file written before the tagged union, holding every key at its default, still loads.
  assert load_config(path, ['task.max_turns=4', 'task.source=null', 'task.tools=[python, calculator]']) == \
      load_config(path)
  with pytest.raises(UserError) as error:
    load_config(path, ['task.max_turns=2'])
  assert str(error.value) == "config key 'task.max_turns' applies to task.name: agent, not 'arith'"
  with pytest.raises(UserError, match="config key 'task.reward_workers' applies to task.name: math or agent, not "):
    load_config(path, ['task.reward_workers=2'])
  with pytest.raises(UserError, match="config key 'task.max_operand' applies to task.name: arith, not 'agent'"):
    load_config(os.path.join(ROOT, 'configs', 'tiny_guess.yaml'), ['task.max_operand=5'])
  with pytest.raises(UserError) as error:
    load_config(path, ['task.max_turn=2'])
  assert str(error.value) == "unknown config key 'task.max_turn' (valid keys here: name, max_operand, operators)"
  # --set task.name switches a file's kind: the file's keys of its other kinds go (a guessing-game
  # file as arithmetic), but a key of another kind set on the same command line is still refused.
  guess = os.path.join(ROOT, 'configs', 'tiny_guess.yaml')
  assert load_config(guess, ['task.name=arith', 'task.max_operand=5']).task == ArithSection(max_operand=5)
  with pytest.raises(UserError, match="'task.max_turns' applies to task.name: agent, not 'arith'"):
    load_config(guess, ['task.name=arith', 'task.max_turns=2'])


@pytest.mark.parametrize('kind', sorted(TASK_CONFIGS))
def test_a_checkpoints_config_from_before_the_tagged_union_still_loads(kind, tmp_path):
  """A checkpoint's stored config from before held every kind's keys in the task section, some at
  values this kind never read: it loads as the same config, and resuming names no task key as changed."""
  from grpo_jax.train import changed_keys
  config = load_config(os.path.join(ROOT, 'configs', TASK_CONFIGS[kind]))
  current = to_dict(config)
  others = {'max_operand': 9, 'operators': '+-', 'source': None, 'split': 'train', 'format': 'custom',
            'prompt_field': 'prompt', 'answer_field': 'answer', 'mix': [], 'prompt_template': '{prompt}',
            'chat_template': True, 'enable_thinking': None, 'tokenizer': None, 'max_prompt_tokens': 512,
            'reward_workers': 4, 'environment': 'guess_number', 'max_turns': 7, 'turn_tokens': 0,
            'tools': ['calculator'], 'tool_timeout_s': 10.0, 'guess_range': 16}
  stored = dict(current, task=dict(others, **current['task']))
  assert set(stored['task']) == OLD_SECTION_KEYS | set(current['task'])
  assert from_dict(stored) == config
  assert changed_keys(stored, current) == []
  # The same keys in a file are checked: another kind's key at a value of its own is a mistake there.
  with pytest.raises(UserError, match="config key 'task.(max_turns|operators)' applies to task.name: (agent|arith), "):
    load_config(write(tmp_path, yaml.safe_dump(stored)))


def test_local_model_and_tokenizer_paths_are_stored_absolute(tmp_path, monkeypatch):
  """A relative model.path or task.tokenizer that exists here is stored absolute (checkpoints and
  exports then find the base from any directory); a name that is no local path stays as written."""
  (tmp_path / 'base').mkdir()
  (tmp_path / 'tok').mkdir()
  monkeypatch.chdir(tmp_path)
  config = load_config(os.path.join(ROOT, 'configs', 'tiny_math.yaml'), ['model.path=base', 'task.tokenizer=./tok'])
  assert (config.model.path, config.task.tokenizer) == (str(tmp_path / 'base'), str(tmp_path / 'tok'))
  assert to_dict(config)['model']['path'] == str(tmp_path / 'base')
  named = load_config(os.path.join(ROOT, 'configs', 'tiny_math.yaml'), ['model.path=Qwen/Qwen2.5-0.5B'])
  assert (named.model.path, named.task.tokenizer) == ('Qwen/Qwen2.5-0.5B', 'data/tiny_math/tokenizer')
  assert from_dict(dict(to_dict(named), model=dict(to_dict(named)['model'], path='base'))).model.path == 'base'


def test_a_run_from_model_path_compares_the_architecture_it_read():
  """Configs stored before runs recorded the architecture read from model.path hold the section's
  unused default: resuming names no architecture key as changed. Stored since, a change of base shows."""
  from grpo_jax.train import changed_keys
  config = load_config(os.path.join(ROOT, 'configs', 'tiny_math.yaml'), ['model.path=/some/base'])
  read = dataclasses.replace(config.model.architecture, hidden_size=96, num_hidden_layers=3)
  after = to_dict(dataclasses.replace(config, model=dataclasses.replace(config.model, architecture=read)))
  old = to_dict(dataclasses.replace(config, model=dataclasses.replace(config.model, architecture=Qwen2Config())))
  assert changed_keys(old, after) == []
  other = to_dict(dataclasses.replace(config, model=dataclasses.replace(
      config.model, architecture=dataclasses.replace(read, hidden_size=128))))
  assert changed_keys(other, after) == ['model.architecture.hidden_size: 128 -> 96']
