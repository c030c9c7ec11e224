"""Normalised and combined reward terms (data/reward_terms.py: normalize, clip, reward_combination)
against NumPy transcriptions of their definitions, their config errors, and the running statistics
carried through a checkpoint and a resume."""

import json
import os
import sys

import jax
import numpy as np
import pytest

from grpo_jax import config as config_lib
from grpo_jax import train
from grpo_jax.data import word_problems
from grpo_jax.data.reward_composer import RewardComposer
from grpo_jax.data.reward_terms import CustomTerm
from grpo_jax.errors import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULE = sys.modules[__name__].__name__
EPS = 1e-6
# The values each custom term below gives for the next step's completions, set by the tests.
VALUES = {}


def term_a(completions, references, lengths):
  return VALUES['a']


def term_b(completions, references, lengths):
  return VALUES['b']


def term_c(completions, references, lengths):
  return VALUES['c']


def composer(*terms, combination='sum'):
  return RewardComposer(tuple(terms), max_new_tokens=8, workers=1, combination=combination)


def score(composer_, values: dict, group_size: int):
  VALUES.clear()
  VALUES.update({label: [float(v) for v in column] for label, column in values.items()})
  size = len(next(iter(values.values())))
  return composer_.score(['x'] * size, ['y'] * size, np.full(size, 3), np.ones(size, bool), group_size)


def group_reference(x: np.ndarray, group_size: int) -> np.ndarray:
  """(x - mean_G) / (std_G + eps) per group, std the population one (np.std's default ddof=0)."""
  groups = np.asarray(x, np.float64).reshape(-1, group_size)
  return ((groups - groups.mean(axis=1, keepdims=True)) / (groups.std(axis=1, keepdims=True) + EPS)).reshape(-1)


def random_terms(rng, prompts: int, group: int, labels='abc') -> dict:
  """Terms of unlike scales and offsets, one group of equal (non-zero) values in the first."""
  size = prompts * group
  values = {label: rng.normal(rng.uniform(-3, 3), rng.uniform(0.1, 5), size) for label in labels}
  values[labels[0]][:group] = rng.uniform(0.5, 2)
  return {label: column.astype(np.float32).astype(np.float64) for label, column in values.items()}  # as terms give


def test_group_normalization_matches_its_definition(seed):
  rng = np.random.default_rng(seed)
  prompts, group = int(rng.integers(2, 6)), int(rng.integers(2, 9))
  values = random_terms(rng, prompts, group, 'ab')
  weights = rng.uniform(-2, 2, 2)
  composed = score(composer(CustomTerm(f'{MODULE}:term_a', weight=weights[0], normalize='group'),
                            CustomTerm(f'{MODULE}:term_b', weight=weights[1])), values, group)
  normalized = group_reference(values['a'], group)
  np.testing.assert_allclose(composed.total, weights[0] * normalized + weights[1] * values['b'], rtol=1e-5, atol=1e-5)
  # A group of equal values standardises to exactly 0 (not 0 / eps noise); the logged term is raw.
  assert np.all(composed.total[:group] == np.float32(weights[1]) * np.float32(values['b'][:group]))
  np.testing.assert_array_equal(composed.terms['term_a'], np.float32(values['a']))


def test_running_normalization_over_steps_matches_the_history(seed):
  """Each step's values standardised by the mean and population std of every value seen so far,
  the step's own included."""
  rng = np.random.default_rng(seed)
  scorer = composer(CustomTerm(f'{MODULE}:term_a', weight=1.5, normalize='running'))
  history = []
  for step in range(5):
    size = int(rng.integers(2, 7)) * 4
    # The distribution drifts step to step; values a term can give (float32: terms are scored in it).
    values = rng.normal(rng.uniform(-5, 5), rng.uniform(0.1, 10), size).astype(np.float32).astype(np.float64)
    history.append(values)
    seen = np.concatenate(history)
    composed = score(scorer, {'a': values}, 4)
    expected = 1.5 * (values - seen.mean()) / (seen.std() + EPS)
    np.testing.assert_allclose(composed.total, expected, rtol=1e-5, atol=1e-5, err_msg=f'step {step}')
    stats = scorer.running['term_a']
    assert stats.count == seen.size
    np.testing.assert_allclose([stats.mean, stats.std], [seen.mean(), seen.std()], rtol=1e-12)


def test_clip_bounds_the_raw_or_the_normalized_value(seed):
  rng = np.random.default_rng(seed)
  group = 4
  values = random_terms(rng, 6, group, 'ab')
  raw_clip = tuple(sorted(np.quantile(values['a'], [0.2, 0.8])))
  composed = score(composer(CustomTerm(f'{MODULE}:term_a', clip=raw_clip),
                            CustomTerm(f'{MODULE}:term_b', weight=0.5, normalize='group', clip=(-0.75, 1.0))),
                   values, group)
  clipped_a = np.clip(values['a'], *raw_clip)
  normalized_b = group_reference(values['b'], group)
  clipped_b = np.clip(normalized_b, -0.75, 1.0)
  assert (values['a'] < raw_clip[0]).any() and (values['a'] > raw_clip[1]).any()  # the bounds bite
  assert (normalized_b < -0.75).any() and (normalized_b > 1.0).any()
  np.testing.assert_allclose(composed.total, clipped_a + 0.5 * clipped_b, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(composed.terms['term_b'], np.float32(values['b']))


def test_normalize_then_sum_is_gdpo(seed):
  """GDPO: A_k = each term standardised in its group, S = sum_k w_k A_k, total = S standardised
  over the step's batch."""
  rng = np.random.default_rng(seed)
  prompts, group = int(rng.integers(2, 6)), int(rng.integers(2, 9))
  values = random_terms(rng, prompts, group)
  weights = rng.uniform(0.1, 2, 3)
  terms = (CustomTerm(f'{MODULE}:term_a', weight=weights[0]), CustomTerm(f'{MODULE}:term_b', weight=weights[1]),
           CustomTerm(f'{MODULE}:term_c', weight=weights[2]))
  composed = score(composer(*terms, combination='normalize_then_sum'), values, group)
  advantages = [group_reference(values[label], group) for label in 'abc']
  summed = sum(weight * advantage for weight, advantage in zip(weights, advantages))
  expected = (summed - summed.mean()) / (summed.std() + EPS)
  np.testing.assert_allclose(composed.total, expected, rtol=1e-5, atol=1e-5)
  # GDPO's total is an advantage already: each group's mean is 0 (up to rounding), Dr.GRPO's centring keeps it.
  np.testing.assert_allclose(composed.total.reshape(prompts, group).mean(axis=1), 0, atol=1e-5)


def test_running_statistics_survive_a_json_round_trip_exactly(seed):
  """A composer given another's state_dict (through JSON, as checkpoints store it) scores the next
  steps bit for bit as the uninterrupted one."""
  rng = np.random.default_rng(seed)
  steps = [random_terms(rng, 3, 4, 'ab') for _ in range(6)]
  terms = (CustomTerm(f'{MODULE}:term_a', normalize='running'), CustomTerm(f'{MODULE}:term_b', normalize='running',
                                                                            weight=0.3, clip=(-2.0, 2.0)))
  uninterrupted, first = composer(*terms), composer(*terms)
  expected = [score(uninterrupted, values, 4).total for values in steps]
  for values in steps[:3]:
    score(first, values, 4)
  resumed, fresh = composer(*terms), composer(*terms)
  resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
  for index, values in enumerate(steps[3:], start=3):
    np.testing.assert_array_equal(score(resumed, values, 4).total, expected[index])
  assert not np.array_equal(score(fresh, steps[3], 4).total, expected[3])  # the statistics matter


@pytest.mark.parametrize('overrides, message', [
    (['rewards=[{name: format, normalize: batch}]'],
     "config key 'rewards[0].normalize' must be one of 'none' | 'group' | 'running', got 'batch'"),
    (['rewards=[{name: format, clip: [1.0, 1.0]}]'], r'rewards\[0\].clip low \(1.0\) must be < high \(1.0\)'),
    (['rewards=[{name: format}, {name: math, clip: [2, -1]}]'], r'rewards\[1\].clip low \(2.0\) must be < high'),
    (['rewards=[{name: format, clip: [0, 1, 2]}]'], r'rewards\[0\].clip must be \[low, high\], got \[0.0, 1.0, 2.0\]'),
    (['rewards=[{name: format, clip: 1}]'], r"config key 'rewards\[0\].clip' expects a list, got 1"),
    (['reward_combination=product'],
     "config key 'reward_combination' must be one of 'sum' | 'normalize_then_sum', got 'product'"),
    (['reward_combination=normalize_then_sum', 'algo.advantage=drgrpo',
      'rewards=[{name: math}, {name: format, normalize: running}]'],
     r'rewards\[1\].normalize must be none with reward_combination: normalize_then_sum'),
    (['reward_combination=normalize_then_sum', 'algo.advantage=drgrpo', 'rewards=[{name: format, clip: [0, 1]}]'],
     r'rewards\[0\].clip must be unset with reward_combination: normalize_then_sum'),
    (['reward_combination=normalize_then_sum', 'algo.advantage=grpo'],
     r"algo.advantage must be drgrpo with reward_combination: normalize_then_sum"),
])
def test_normalization_config_errors(overrides, message):
  with pytest.raises(UserError, match=message):
    config_lib.load_config(None, ['task.name=math', 'task.source=x.jsonl', 'model.path=m', *overrides])


def test_normalization_config_errors_outside_a_config():
  with pytest.raises(UserError, match='normalize must be one of none, group, running'):
    CustomTerm(f'{MODULE}:term_a', normalize='batch')
  with pytest.raises(UserError, match=r'reward_combination applies to dataset tasks'):
    config_lib.load_config(None, ['reward_combination=normalize_then_sum', 'algo.advantage=drgrpo'])
  config = config_lib.load_config(None, ['task.name=math', 'task.source=x.jsonl', 'model.path=m',
                                         'reward_combination=normalize_then_sum', 'algo.advantage=drgrpo',
                                         'rewards=[{name: format}, {name: math, weight: 2}]'])
  assert config.reward_combination == 'normalize_then_sum'
  config = config_lib.load_config(None, ['task.name=math', 'task.source=x.jsonl', 'model.path=m',
                                         'rewards=[{name: format, normalize: running, clip: [-1, 2.5]}]'])
  assert config.rewards[0].clip == (-1.0, 2.5) and config.rewards[0].normalize == 'running'
  assert config_lib.from_dict(config_lib.to_dict(config)) == config


def test_run_checkpoints_and_restores_the_running_statistics(tmp_path, seed):
  """A run's checkpoint records its reward's running statistics (Run.save) and a run restarted on
  the workdir takes them back (Run.__init__): its next step's rewards are the uninterrupted run's."""
  rng = np.random.default_rng(seed)
  files = word_problems.write(str(tmp_path / 'data'))
  path = os.path.join(ROOT, 'configs', 'tiny_math.yaml')
  config = config_lib.load_config(path, [
      f'task.source={files["train"]}', f'task.tokenizer={files["tokenizer"]}', 'train.progress=false',
      'train.tensorboard=false', 'algo.dynamic_sampling=false',
      f'rewards=[{{name: "{MODULE}:term_a", normalize: running}}, {{name: format, weight: 0.5}}]'])
  workdir = str(tmp_path / 'work')
  steps = [random_terms(rng, 2, 4, 'a') for _ in range(4)]

  def start():
    task = train.build_task(config)
    _, mesh, model = train.setup(config, path, workdir, devices=jax.devices()[:1])
    return task, train.Run(config, workdir, mesh, model, task)

  task, run = start()
  try:
    expected = [score(task.composer, values, 4).total for values in steps]
    task.composer.load_state_dict({})  # back to no statistics: replay the first two steps, then save
    for values in steps[:2]:
      score(task.composer, values, 4)
    run.save()
  finally:
    run.close()
    task.close()
  task, run = start()
  try:
    assert run.step == 0 and run.saved_step == 0
    for index in (2, 3):
      np.testing.assert_array_equal(score(task.composer, steps[index], 4).total, expected[index])
  finally:
    run.close()
    task.close()


def test_whole_step_normalizations_refuse_several_processes(monkeypatch):
  """Each process of a multi-host run scores its own groups: statistics over the whole step would
  differ from process to process."""
  monkeypatch.setattr(jax, 'process_count', lambda: 2)
  with pytest.raises(UserError, match='normalize: running needs every completion of a step in one process'):
    composer(CustomTerm(f'{MODULE}:term_a', normalize='running'))
  with pytest.raises(UserError, match='normalize_then_sum needs every completion of a step in one process'):
    composer(CustomTerm(f'{MODULE}:term_a'), combination='normalize_then_sum')
  composer(CustomTerm(f'{MODULE}:term_a', normalize='group'))  # whole groups lie on one process
