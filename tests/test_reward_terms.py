"""Composed rewards (data/reward_terms.py) against plain references, and the evaluation estimators
(grpo_jax/eval.py) against brute-force enumeration."""

import itertools
import math
import sys
import textwrap

import numpy as np
import pytest

from grpo_jax.config import from_dict, load_config, to_dict
from grpo_jax.data.reward_composer import RewardComposer
from grpo_jax.data.reward_terms import CustomTerm, FormatTerm, MathTerm, OverlongTerm, format_reward, overlong_penalty
from grpo_jax.errors import UserError
from grpo_jax.evaluation import final_answer, k_values, majority_correct, pass_at_k, summarize


# ---- overlong ----

def overlong_reference(length: int, stopped: bool, budget: int, buffer: int) -> float:
  """DAPO's piecewise definition, one completion at a time."""
  if not stopped:
    return -1.0
  if length <= budget - buffer:
    return 0.0
  return (budget - buffer - length) / buffer


@pytest.mark.parametrize('budget, buffer', [(64, 16), (20, 20), (512, 1), (32, 0)])
def test_overlong_penalty_matches_the_piecewise_definition(seed, budget, buffer):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, budget + 1, size=200)
  lengths[:4] = [1, max(budget - buffer, 1), budget - buffer + 1 if buffer else budget, budget]
  stopped = rng.random(200) < 0.8
  got = overlong_penalty(lengths, stopped, budget, buffer)
  expected = [overlong_reference(int(n), bool(s), budget, buffer) for n, s in zip(lengths, stopped)]
  assert got.dtype == np.float32
  np.testing.assert_allclose(got, expected, rtol=0, atol=1e-7)
  assert got.min() >= -1.0 and got.max() <= 0.0


def test_overlong_counts_tokens_not_characters():
  """Two answers of the same token count get the same penalty, however long their text."""
  short, long = overlong_penalty(np.array([60, 60]), np.array([True, True]), 64, 8)
  assert short == long == np.float32(-0.5)


# ---- format ----

@pytest.mark.parametrize('text, style, expected', [
    ('so the answer is \\boxed{42}.', 'boxed', 1.0),
    ('\\boxed{}', 'boxed', 0.0),
    ('\\boxed{ 3', 'boxed', 0.0),
    ('the answer is 42', 'boxed', 0.0),
    ('<think>x</think><answer>7</answer>', 'answer_tag', 1.0),
    ('<answer> </answer>', 'answer_tag', 0.0),
    ('<answer>7', 'answer_tag', 0.0),
    ('</answer>7<answer>', 'answer_tag', 0.0),
    ('work...\nAnswer: 12', 'answer_line', 1.0),
    ('work...\n**Answer:** 12', 'answer_line', 1.0),
    ('the answer: 12', 'answer_line', 0.0),
    ('Answer:', 'answer_line', 0.0),
])
def test_format_reward(text, style, expected):
  assert format_reward(text, style) == expected


def test_format_reward_is_linear_on_hostile_text():
  import time
  hostile = '<answer>' * 200_000 + '\\boxed{' * 200_000 + 'Answer' * 100_000
  start = time.perf_counter()
  for style in ('boxed', 'answer_tag', 'answer_line'):
    assert format_reward(hostile, style) == 0.0
  assert time.perf_counter() - start < 5.0  # quadratic scans take minutes here


# ---- composition ----

def brevity(completions, references, lengths):
  """A custom term: 1 for answers under 5 tokens."""
  del completions, references
  return [1.0 if n < 5 else 0.0 for n in lengths]


def flaky(completions, references, lengths):
  raise RuntimeError('boom')


def not_finite(completions, references, lengths):
  return [math.nan] + [1.0] * (len(completions) - 1)


def test_terms_are_weighted_summed_and_reported(capsys):
  module = sys.modules[__name__].__name__
  terms = (FormatTerm(weight=0.25), OverlongTerm(weight=2.0, buffer_tokens=4),
           CustomTerm(f'{module}:brevity', weight=-0.5))
  composer = RewardComposer(terms, max_new_tokens=8, workers=1)
  texts = ['\\boxed{1}', 'no box', '\\boxed{2}', '<answer>3</answer>']
  lengths, stopped = np.array([3, 6, 8, 8]), np.array([True, True, True, False])
  composed = composer.score(texts, ['1', '2', '3', '4'], lengths, stopped, group_size=2)
  np.testing.assert_array_equal(composed.terms['format'], [1, 0, 1, 0])
  np.testing.assert_allclose(composed.terms['overlong'], [0, -0.5, -1, -1])
  np.testing.assert_array_equal(composed.terms['brevity'], [1, 0, 0, 0])
  np.testing.assert_allclose(composed.total, 0.25 * composed.terms['format'] + 2.0 * composed.terms['overlong']
                             - 0.5 * composed.terms['brevity'], rtol=1e-6)
  assert composed.failures == 0
  for bad, counted in (('flaky', 4), ('not_finite', 1)):
    composer = RewardComposer((CustomTerm(f'{module}:{bad}'),), max_new_tokens=8, workers=1)
    composed = composer.score(texts, ['1'] * 4, lengths, stopped, group_size=2)
    assert composed.failures == counted and np.all(np.isfinite(composed.total))
    assert 'reported once per run' in capsys.readouterr().err


@pytest.mark.parametrize('yaml, message', [
    ('rewards: [{name: nope}]',
     "rewards[0].name must be one of math, format, overlong, reward_model, judge or <module>:<function>"),
    ('rewards: [{name: overlong, buffer_tokens: -1}]', 'rewards[0].buffer_tokens must be >= 0'),
    ('rewards: [{name: math, buffer_tokens: 4}]',
     "config key 'rewards[0].buffer_tokens' applies to rewards[0].name: overlong, not 'math'"),
    ('rewards: [{name: format}, {name: overlong, style: answer_tag}]',
     "config key 'rewards[1].style' applies to rewards[1].name: format, not 'overlong'"),
    ('rewards: [{name: format, buffer: 4}]',
     "unknown config key 'rewards[0].buffer' (valid keys here: name, weight, normalize, clip, style)"),
    ('rewards: [{name: 3}]', "config key 'rewards[0].name' expects a string, got 3"),
    ('rewards: [{name: overlong, buffer_tokens: 99}]', 'rewards[0].buffer_tokens (99) must be <= rollout.max_new_tokens'),
    ('rewards: [{name: format, style: xml}]', "'rewards[0].style' must be one of"),
    ('task: {name: arith}\nrewards: [{name: math}]', 'rewards apply to dataset tasks'),
])
def test_reward_config_errors(tmp_path, yaml, message):
  path = tmp_path / 'c.yaml'
  path.write_text(yaml + '\n')
  overrides = [] if 'task:' in yaml else ['task.name=math', 'task.source=x.jsonl', 'model.path=m']
  with pytest.raises(UserError, match=message.replace('[', r'\[').replace(']', r'\]').replace('(', r'\(')
                     .replace(')', r'\)')):
    load_config(str(path), overrides)


def test_each_term_is_its_kind_with_its_own_fields():
  """`name` picks a term's class, which holds only its own fields (and writes only them); a stored
  config from when every term held every field reads back with the other kinds' keys dropped."""
  overrides = ['task.name=math', 'task.source=x.jsonl', 'model.path=m', 'rollout.max_new_tokens=16',
               'rewards=[{name: math, weight: 0.9}, {name: format, style: answer_tag}, {name: overlong, '
               'buffer_tokens: 4}, {name: "os.path:join", weight: -1}]']
  config = load_config(None, overrides)
  assert config.rewards == (MathTerm(weight=0.9), FormatTerm(style='answer_tag'), OverlongTerm(buffer_tokens=4),
                            CustomTerm('os.path:join', weight=-1.0))
  assert [term.label for term in config.rewards] == ['math', 'format', 'overlong', 'join']
  stored = to_dict(config)
  assert stored['rewards'][0] == {'name': 'math', 'weight': 0.9, 'normalize': 'none', 'clip': None}
  for term in stored['rewards']:  # what a term of another kind held, at values it ignored
    term.setdefault('style', 'answer_line')
    term.setdefault('buffer_tokens', 8)
  assert stored['rewards'][0] == {'name': 'math', 'weight': 0.9, 'normalize': 'none', 'clip': None,
                                  'style': 'answer_line', 'buffer_tokens': 8}
  assert from_dict(stored).rewards == config.rewards


def test_custom_terms_that_cannot_be_loaded():
  with pytest.raises(UserError, match="module no_such_module cannot be imported"):
    RewardComposer((CustomTerm('no_such_module:f'),), 8, 1)
  with pytest.raises(UserError, match='has no function missing'):
    RewardComposer((CustomTerm('math:missing'),), 8, 1)
  with pytest.raises(UserError, match="'format' is listed twice"):
    RewardComposer((FormatTerm(), FormatTerm(style='answer_tag')), 8, 1)


# ---- evaluation estimators ----

def brute_pass_at_k(correct: list[bool], k: int) -> float:
  subsets = list(itertools.combinations(range(len(correct)), k))
  return sum(any(correct[i] for i in subset) for subset in subsets) / len(subsets)


def test_pass_at_k_equals_enumeration(seed):
  rng = np.random.default_rng(seed)
  for _ in range(40):
    n = int(rng.integers(1, 11))
    correct = list(rng.random(n) < rng.random())
    for k in range(1, n + 1):
      assert pass_at_k(n, sum(correct), k) == pytest.approx(brute_pass_at_k(correct, k), abs=1e-12)
  assert pass_at_k(1000, 1, 1) == pytest.approx(0.001) and pass_at_k(1000, 0, 32) == 0.0
  with pytest.raises(ValueError):
    pass_at_k(4, 1, 8)


def test_majority_vote_and_its_ties():
  # 3 votes for '5' (wrong) beat 2 for '4' (right), whatever the order.
  assert not majority_correct(['4', '5', '5', '4', '5'], [True, False, False, True, False], 5)
  # Only the first k samples vote.
  assert majority_correct(['4', '4', '5', '5', '5'], [True, True, False, False, False], 3)
  # A tie goes to the answer seen first.
  assert majority_correct(['4', '5', '5', '4'], [True, False, False, True], 4)
  assert not majority_correct(['5', '4', '4', '5'], [False, True, True, False], 4)
  # Samples without an answer do not vote; none at all scores False.
  assert majority_correct([None, None, '4'], [False, False, True], 3)
  assert not majority_correct([None, None], [False, False], 2)


def test_final_answer_normalises_votes():
  assert final_answer('so \\boxed{1,234}') == final_answer('it is 1234') == '1234'
  assert final_answer('\\boxed{\\frac{1}{2}}') == '\\frac{1}{2}'
  assert final_answer('x = \\boxed{ 3 } then 9') == '3'
  assert final_answer('no answer here') is None


def test_summary_overall_and_per_source():
  results = [dict(data_source='a', correct=[True, False, False, False], answers=['1', '2', '2', None],
                  greedy_correct=True),
             dict(data_source='b', correct=[False] * 4, answers=['3'] * 4, greedy_correct=False)]
  summary = summarize(results, 4)
  assert k_values(4) == [1, 2, 4] and k_values(6) == [1, 2, 4, 6]
  assert summary['eval/pass@1'] == pytest.approx((0.25 + 0) / 2)
  assert summary['eval/pass@4'] == pytest.approx(0.5) and summary['eval/a/pass@4'] == 1.0
  assert summary['eval/maj@4'] == 0.0 and summary['eval/a/maj@1'] == 1.0
  assert summary['eval/mean@4'] == pytest.approx(0.125) and summary['eval/greedy'] == 0.5
  assert summary['eval/b/greedy'] == 0.0 and summary['eval/problems'] == 2
