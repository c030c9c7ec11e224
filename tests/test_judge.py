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
  with pytest.raises(UserError, match='low must be below high'):
    ParseRule(kind='score', low=5, high=5)
  with pytest.raises(UserError, match='choices must'):
    ParseRule(kind='choice')
  with pytest.raises(UserError, match='must be distinct words'):
    ParseRule(kind='choice', choices={'Yes': 1, 'yes.': 0})
  with pytest.raises(UserError, match="kind must be 'score' or 'choice'"):
    ParseRule(kind='vote')
  assert render_judge_prompt('Q: {prompt} A: {completion} R: {reference}', 'two?', '2', '2') == 'Q: two? A: 2 R: 2'
  assert render_judge_prompt('Q: {prompt} A: {completion}', 'two?', '2') == 'Q: two? A: 2'


@pytest.mark.exhaustive  # 20-30 s: the sampler's and the forward's compiles
def test_a_judge_model_gives_its_greedy_verdicts_read_by_the_rule(seed, make_hf_checkpoint, tmp_path):
  """The verdicts are the judge's greedy continuation of its chat-template rendering (a full
  forward per token, no cache), decoded to their stop token; rewards are the rule's, 0 and counted
  where it cannot read one (a random judge's verdicts); a template with the reference's slot is
  refused unless the reference is shown."""
  import os
  import shutil

  import jax
  import numpy as np

  from test_math_task import chat_tokenizer_dir
  from grpo_jax.data.judge import Judge, judge_prompt_ids
  from grpo_jax.model import from_pretrained
  from grpo_jax.model.loading import load_tokenizer
  tokens_dir = chat_tokenizer_dir(tmp_path / 'tok')
  directory, _ = make_hf_checkpoint(seed, vocab_size=320)
  for name in os.listdir(tokens_dir):
    shutil.copy(os.path.join(tokens_dir, name), directory)
  model, tokenizer = from_pretrained(directory), load_tokenizer(directory)
  stop = tokenizer.convert_tokens_to_ids('<|im_end|>')
  rows = [('What is 2+2?', 'It is 4.', '4'), ('Name a colour.', 'Blue', None), ('Hi', 'Hello!', 'hi')]
  template = 'Question: {prompt}\nAnswer: {completion}\nGive "Score: n" from 0 to 10.'
  rule = ParseRule(kind='score', low=0, high=10)
  width = max(len(judge_prompt_ids(tokenizer, template, False, *row)) for row in rows)  # the longest row's
  judged = Judge(model, tokenizer, template, rule, max_new_tokens=6, max_prompt_tokens=width, stop_token_ids=(stop,),
                 pad_id=0)(rows)
  forward = jax.jit(lambda ids: model(ids)[0, -1])
  for (prompt, completion, _), verdict in zip(rows, judged.verdicts):
    message = template.format(prompt=prompt, completion=completion)
    ids = list(tokenizer.apply_chat_template([{'role': 'user', 'content': message}], tokenize=True,
                                             add_generation_prompt=True, return_dict=False))
    answer = []
    for _ in range(6):
      token = int(np.argmax(np.asarray(forward(np.asarray([ids + answer], np.int32)))))
      if token == stop:
        break
      answer.append(token)
    assert verdict == tokenizer.decode(answer, skip_special_tokens=True)
  want = [rule(verdict) for verdict in judged.verdicts]
  np.testing.assert_array_equal(judged.rewards, [0.0 if value is None else value for value in want])
  assert judged.unparsed == sum(value is None for value in want)
  with pytest.raises(UserError, match='show_reference: true'):
    Judge(model, tokenizer, template + ' {reference}', rule, max_new_tokens=2, max_prompt_tokens=width,
          stop_token_ids=(stop,), pad_id=0)
