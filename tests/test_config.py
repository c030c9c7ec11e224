"""Run config: YAML + --set overrides, one-line errors naming the key, and the train entry point."""

import os
import subprocess
import sys

import pytest
import yaml

from grpo_jax.config import Config, from_dict, load_config, to_dict, to_yaml
from grpo_jax.data.sources import DatasetSource
from grpo_jax.errors import UserError
from grpo_jax.sampler import SamplingConfig

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
])
def test_mistakes_name_the_key(tmp_path, text, overrides, message):
  with pytest.raises(UserError) as error:
    load_config(write(tmp_path, text), overrides)
  assert message in str(error.value)


def test_train_cli_saves_resolved_config_and_trains(tmp_path):
  workdir = tmp_path / 'run'
  result = subprocess.run(
      [sys.executable, '-m', 'grpo_jax.train', '--config', 'configs/tiny_arith.yaml',
       '--set', 'run.seed=5', '--set', 'train.steps=2', '--set', 'train.steps_per_call=1',
       '--set', 'optim.learning_rate=2e-4', '--workdir', str(workdir)],
      cwd=ROOT, capture_output=True, text=True, timeout=300)
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
       "optim, train, rewards, eval, distributed)")


def test_a_key_added_since_a_checkpoint_was_written_is_not_a_change():
  """Resuming names the keys whose values changed; a key the checkpoint's stored config lacks (a
  setting this code added, e.g. train.tensorboard) is not one of them, a removed or changed one is."""
  from grpo_jax.train import changed_keys
  stored = to_dict(load_config(os.path.join(ROOT, 'configs', 'tiny_arith.yaml'), []))
  del stored['train']['tensorboard']
  stored['algo']['retired_knob'] = 3
  current = to_dict(load_config(os.path.join(ROOT, 'configs', 'tiny_arith.yaml'), ['train.steps=7']))
  assert changed_keys(stored, current) == ['algo.retired_knob: 3 -> None', f'train.steps: {stored["train"]["steps"]} -> 7']
