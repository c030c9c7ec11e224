"""A generative judge's template and parse rules (data/judge.py): verdicts read by a bounded rule,
the unparseable ones None; templates without the completion's slot, with unknown slots or with a
reference the config does not show refused in one line."""

import pytest

from grpo_jax.data.judge import ParseRule, check_template, render_judge_prompt
from grpo_jax.errors import UserError

SCORES = [  # (verdict, reward under score 0-10)
    ('The answer is right. Score: 8', 0.8),
    ('score: 7/10', 0.7),  # the number after the marker, not the last number
    ('Score: 3\nOn reflection... **Score:** 9.5', 0.95),  # the last marker wins
    ('Score: (10)', 1.0),
    ('Score: 0', 0.0),
    ('Score: 11', None),  # outside [low, high]
    ('I give it 8 out of 10.', None),  # no marker
    ('Score: high', None),
    ('', None),
]
CHOICES = [  # (verdict, reward under choice correct=1, partly=0.5, incorrect=0)
    ('Verdict: correct', 1.0),
    ('verdict: **Incorrect**.', 0.0),
    ('Verdict: partly\nVerdict: correct!', 1.0),
    ('Verdict: maybe', None),
    ('correct', None),
]


@pytest.mark.parametrize('verdict, reward', SCORES)
def test_a_score_is_the_number_after_the_last_marker_in_its_range(verdict, reward):
  got = ParseRule(kind='score', low=0, high=10)(verdict)
  assert got == (None if reward is None else pytest.approx(reward))


@pytest.mark.parametrize('verdict, reward', CHOICES)
def test_a_choice_is_the_word_after_the_last_marker(verdict, reward):
  assert ParseRule(kind='choice', choices={'correct': 1, 'Partly': 0.5, 'incorrect': 0})(verdict) == reward


def test_a_rule_with_its_own_marker_and_range():
  rule = ParseRule(kind='score', marker='Rating =', low=1, high=5)
  assert rule('Rating = 4') == pytest.approx(0.75) and rule('Score: 4') is None and rule('Rating = 0') is None


def test_templates_and_rules_that_cannot_work_are_refused_in_one_line():
  check_template('Question: {prompt}\nAnswer: {completion}\nGive {{"score": n}}', show_reference=False)
  check_template('{prompt} {completion} {reference}', show_reference=True)
  for template, reference, error in [
      ('Question: {prompt}', False, 'has no {completion} slot'),
      ('{completion} vs {answer}', False, r'has a slot \{answer\}; its slots are'),
      ('{completion} vs {reference}', False, r'sees the reference answer only with show_reference: true'),
      ('{completion} {', False, 'write a literal brace doubled')]:
    with pytest.raises(UserError, match=error):
      check_template(template, reference)
  with pytest.raises(UserError, match='parse.low'):
    ParseRule(kind='score', low=5, high=5)
  with pytest.raises(UserError, match='parse.choices'):
    ParseRule(kind='choice')
  with pytest.raises(UserError, match='must be distinct words'):
    ParseRule(kind='choice', choices={'Yes': 1, 'yes.': 0})
  with pytest.raises(UserError, match="parse.kind"):
    ParseRule(kind='vote')
  assert render_judge_prompt('Q: {prompt} A: {completion} R: {reference}', 'two?', '2', '2') == 'Q: two? A: 2 R: 2'
  assert render_judge_prompt('Q: {prompt} A: {completion}', 'two?', '2') == 'Q: two? A: 2'
