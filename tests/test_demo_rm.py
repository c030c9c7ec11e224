"""The CPU demo of rewards from models (make demo-rm) shows it working: a tiny reward model trained
on preference pairs labelled by Bradley-Terry from a hidden property (the share of colour words,
data/synthetic_preferences.py) learns the property's order on held-out pairs, and GRPO against it
moves the policy's samples at least halfway from their start to the optimum of the property it
never sees; the run draws each term and the proxy / gold picture."""

import os

import jax
import pytest

from grpo_jax import train, train_reward
from grpo_jax.data import synthetic_preferences
from runs import ROOT, read_metrics, train_here


@pytest.mark.exhaustive
@pytest.mark.starts_first
@pytest.mark.long
def test_a_reward_model_learns_the_hidden_property_and_grpo_against_it_raises_it(tmp_path):
  paths = synthetic_preferences.write(str(tmp_path / 'data'))
  config_path = os.path.join(ROOT, 'configs', 'tiny_reward_model.yaml')
  config = train_reward.load_config(config_path, [
      f'preferences.source={paths["pairs"]}', f'preferences.tokenizer={paths["tokenizer"]}',
      f'eval.source={paths["held_out"]}', 'train.progress=false'])
  workdir, mesh = train_reward.setup(config, config_path, str(tmp_path / 'rm'), devices=jax.devices()[:1])
  train_reward.train(config, workdir, mesh)
  evaluations = read_metrics(workdir, 'eval.jsonl')
  first, last = evaluations[0]['eval/accuracy'], evaluations[-1]['eval/accuracy']
  print(f'held-out accuracy against the property: {first:.3f} -> {last:.3f}')
  assert first < 0.7 and last >= 0.9

  reward_model = os.path.join(workdir, 'reward_model')
  history = train_here(tmp_path / 'rl', 'configs/tiny_rm_grpo.yaml', f'task.source={paths["prompts"]}',
                       f'task.tokenizer={paths["tokenizer"]}', 'train.progress=false', 'train.tensorboard=false',
                       f'rewards=[{{name: reward_model, path: "{reward_model}", dtype: float32}}, '
                       '{name: "grpo_jax.data.synthetic_preferences:chosen_share", weight: 0.0}]')
  gold = [row['reward/chosen_share'] for row in history]
  start, end = sum(gold[:5]) / 5, sum(gold[-10:]) / 10
  print(f'the policy\'s share of colour words: {start:.3f} -> {end:.3f} (optimum 1)')
  assert 1.0 - end <= (1.0 - start) / 2
  proxy = [row['reward/reward_model'] for row in history]
  assert sum(proxy[-10:]) / 10 > sum(proxy[:5]) / 5  # the reward model's score rose with it
  train.report(history, str(tmp_path / 'rl'), 'tiny_rm_grpo')
  assert os.path.isfile(tmp_path / 'rl' / 'reward_terms.png')
  assert synthetic_preferences.plot_proxy_and_gold(history, str(tmp_path / 'rl' / 'proxy_gold.png'))
