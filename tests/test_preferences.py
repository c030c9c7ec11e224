"""Preference pairs read from HH-RLHF transcripts and the chat-message form (JSONL and parquet), bad
rows refused in one line naming the record, and the Bradley-Terry loss and pairwise accuracy
against NumPy."""

import json

import numpy as np
import pytest

from grpo_jax.data.preferences import adapt_preferences
from grpo_jax.data.sources import load_records
from grpo_jax.errors import UserError
from grpo_jax.rl.preference import bradley_terry_loss, pairwise_accuracy


def _user(text):
  return {'role': 'user', 'content': text}


def _assistant(text):
  return {'role': 'assistant', 'content': text}


HH = [
    {'chosen': '\n\nHuman: How do I boil an egg?\n\nAssistant: Put it in boiling water for 9 minutes.',
     'rejected': '\n\nHuman: How do I boil an egg?\n\nAssistant: Eggs are round.'},
    {'chosen': '\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: Name a prime.\n\nAssistant: 7',
     'rejected': '\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: Name a prime.\n\nAssistant: 8'},
    {'chosen': '\n\nHuman: Same?\n\nAssistant: Yes.', 'rejected': '\n\nHuman: Same?\n\nAssistant: Yes.'},
    {'chosen': '\n\nHuman: Empty?\n\nAssistant:', 'rejected': '\n\nHuman: Empty?\n\nAssistant: No.'},
]


def test_hh_rlhf_transcripts_become_a_conversation_and_two_replies():
  adapted = adapt_preferences(HH, 'hh_rlhf', 'hh.jsonl')
  assert adapted.skipped == {'identical': 1, 'empty reply': 1}
  first, second = adapted.pairs
  assert first.prompt == (_user('How do I boil an egg?'),)
  assert first.chosen == (_assistant('Put it in boiling water for 9 minutes.'),)
  assert first.rejected == (_assistant('Eggs are round.'),)
  assert second.prompt == (_user('Hi'), _assistant('Hello!'), _user('Name a prime.'))
  assert (second.chosen, second.rejected) == ((_assistant('7'),), (_assistant('8'),))
  assert second.conversations()[0] == second.prompt + (_assistant('7'),)
  assert first.data_source == 'hh.jsonl'


def test_chat_messages_with_and_without_a_prompt_field_from_jsonl_and_parquet(tmp_path):
  import pandas as pd
  conversation = [_user('2+2?')]
  records = [
      # UltraFeedback-binarized: the prompt as text, chosen / rejected repeating it
      {'prompt': '2+2?', 'chosen': conversation + [_assistant('4')], 'rejected': conversation + [_assistant('5')],
       'data_source': 'ultrafeedback'},
      # TRL's conversational form: the prompt as messages, the replies without it
      {'prompt': [{'role': 'system', 'content': 'Be brief.'}, _user('Capital of France?')],
       'chosen': [_assistant('Paris')], 'rejected': [_assistant('Lyon')]},
      # no prompt field: the shared start up to the last shared user message
      {'chosen': conversation + [_assistant('4'), _user('Sure?'), _assistant('Yes')],
       'rejected': conversation + [_assistant('4'), _user('Sure?'), _assistant('No')]},
      # a reply as plain text
      {'prompt': 'Say hi', 'chosen': 'hi', 'rejected': 'bye'},
  ]
  prompts = [(_user('2+2?'),), ({'role': 'system', 'content': 'Be brief.'}, _user('Capital of France?')),
             (_user('2+2?'), _assistant('4'), _user('Sure?')), (_user('Say hi'),)]
  replies = [((_assistant('4'),), (_assistant('5'),)), ((_assistant('Paris'),), (_assistant('Lyon'),)),
             ((_assistant('Yes'),), (_assistant('No'),)), ((_assistant('hi'),), (_assistant('bye'),))]
  jsonl = tmp_path / 'prefs.jsonl'
  jsonl.write_text('\n'.join(json.dumps(record) for record in records))
  pairs = adapt_preferences(load_records(str(jsonl)), 'messages', str(jsonl)).pairs
  assert [p.prompt for p in pairs] == prompts and [(p.chosen, p.rejected) for p in pairs] == replies
  assert pairs[0].data_source == 'ultrafeedback' and pairs[1].data_source == str(jsonl)
  # A parquet column holds one type: UltraFeedback's (prompt text, message lists; a null prompt in
  # the other row), read back with every message's keys and nulls for a missing prompt.
  parquet = tmp_path / 'prefs.parquet'
  pd.DataFrame([records[0], {**records[2], 'prompt': None, 'data_source': None}]).to_parquet(parquet)
  pairs = adapt_preferences(load_records(str(parquet)), 'messages', str(parquet)).pairs
  assert [p.prompt for p in pairs] == [prompts[0], prompts[2]]
  assert [(p.chosen, p.rejected) for p in pairs] == [replies[0], replies[2]]


@pytest.mark.parametrize('format, record, error', [
    ('hh_rlhf', {'chosen': 'no turns here', 'rejected': '\n\nHuman: a\n\nAssistant: b'},
     r"record 1 of d.jsonl \(format hh_rlhf\): field 'chosen' is not a .* transcript"),
    ('hh_rlhf', {'chosen': '\n\nHuman: a\n\nAssistant: b'},
     r"record 1 of d.jsonl \(format hh_rlhf\): no field 'rejected'"),
    ('messages', {'chosen': [{'role': 'user'}], 'rejected': [_assistant('x')]},
     r"record 1 of d.jsonl \(format messages\): field 'chosen' holds a chat message that is not"),
    ('messages', {'prompt': 'q', 'chosen': [_assistant('a'), _user('b')], 'rejected': [_assistant('c')]},
     r'record 1 of d.jsonl \(format messages\): the chosen reply does not end with an assistant message'),
    ('messages', {'chosen': [_assistant('a')], 'rejected': [_assistant('b')]},
     r'record 1 of d.jsonl \(format messages\): the chosen and rejected conversations share no user message'),
])
def test_a_bad_record_is_one_error_naming_it(format, record, error):
  good = {'hh_rlhf': HH[0], 'messages': {'prompt': 'q', 'chosen': 'a', 'rejected': 'b'}}[format]
  with pytest.raises(UserError, match=error):
    adapt_preferences([good, record], format, 'd.jsonl')
  with pytest.raises(UserError, match="preference format 'csv' of d.jsonl is not one of hh_rlhf, messages"):
    adapt_preferences([good], 'csv', 'd.jsonl')
  with pytest.raises(UserError, match=r'none of the 1 records of d.jsonl .* is a usable preference pair'):
    adapt_preferences([HH[2]], 'hh_rlhf', 'd.jsonl')


def test_bradley_terry_loss_and_accuracy_equal_numpy(seed):
  rng = np.random.default_rng(seed)
  chosen, rejected, margin = rng.normal(size=12), rng.normal(size=12), rng.uniform(0, 1, 12)
  weights = (rng.uniform(size=12) < 0.75).astype(np.float32)
  weights[0] = 1.0
  rejected[3] = chosen[3]  # a tie counts as wrong

  def numpy_loss(margin=0.0, center=0.0):
    gap = chosen - rejected - margin
    per_pair = np.log1p(np.exp(-gap)) + center * (chosen + rejected) ** 2
    return np.sum(per_pair * weights) / np.sum(weights)

  f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
  np.testing.assert_allclose(bradley_terry_loss(f32(chosen), f32(rejected), weights=f32(weights)), numpy_loss(),
                             rtol=1e-5)
  np.testing.assert_allclose(bradley_terry_loss(f32(chosen), f32(rejected), f32(margin), center_coef=0.01,
                                                weights=f32(weights)), numpy_loss(margin, 0.01), rtol=1e-5)
  np.testing.assert_allclose(pairwise_accuracy(f32(chosen), f32(rejected), f32(weights)),
                             np.sum((chosen > rejected) * weights) / np.sum(weights), rtol=1e-6)
  # Far-apart scores stay finite (log-sigmoid, not log of a rounded sigmoid).
  assert np.isfinite(float(bradley_terry_loss(f32([-200.0]), f32([200.0]))))
  np.testing.assert_allclose(float(bradley_terry_loss(f32([-200.0]), f32([200.0]))), 400.0, rtol=1e-6)


def test_pairs_render_with_the_reward_models_template_and_long_ones_are_left_out(tmp_path):
  from test_math_task import chat_tokenizer_dir
  from grpo_jax.data.preferences import encode_pairs
  from grpo_jax.model.loading import load_tokenizer
  tokenizer = load_tokenizer(chat_tokenizer_dir(tmp_path / 'tok'))
  pad = tokenizer.convert_tokens_to_ids('<|im_end|>')  # a template whose reply ends in the pad id
  records = [{'prompt': 'Capital of France?', 'chosen': 'Paris', 'rejected': 'Lyon'},
             {'prompt': 'Tell a story.', 'chosen': 'Once ' * 40, 'rejected': 'No.'},
             {'prompt': 'Hi', 'chosen': 'Hello there', 'rejected': 'Go away'}]
  pairs = adapt_preferences(records, 'messages', 'd.jsonl').pairs
  encoded = encode_pairs(tokenizer, pairs, 48, pad)  # the long story is 232 tokens, the others 29-42
  assert encoded.too_long == 1 and encoded.kept.tolist() == [0, 2]
  assert encoded.chosen.shape == encoded.rejected_mask.shape == (2, 48)
  for row, (question, chosen, rejected) in enumerate([('Capital of France?', 'Paris', 'Lyon'),
                                                      ('Hi', 'Hello there', 'Go away')]):
    for tokens, mask, reply in ((encoded.chosen, encoded.chosen_mask, chosen),
                                (encoded.rejected, encoded.rejected_mask, rejected)):
      length = int(mask[row].sum())
      assert mask[row, :length].all() and not mask[row, length:].any()  # right-padded
      assert (tokens[row, length:] == pad).all()
      assert tokenizer.decode(tokens[row, :length].tolist()) == (
          f'<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n{reply}<|im_end|>\n')
  with pytest.raises(UserError, match='max_length must be positive'):
    encode_pairs(tokenizer, pairs, 0, pad)


def test_a_margin_field_is_read_per_pair_and_must_be_a_number():
  records = [{'prompt': 'q', 'chosen': 'a', 'rejected': 'b', 'rating': {'gap': 2}},
             {'prompt': 'r', 'chosen': 'c', 'rejected': 'c'},  # identical: skipped, its margin never read
             {'prompt': 's', 'chosen': 'd', 'rejected': 'e', 'rating': {'gap': 0.5}}]
  adapted = adapt_preferences(records, 'messages', 'd.jsonl', margin_field='rating.gap')
  assert [pair.margin for pair in adapted.pairs] == [2.0, 0.5] and adapted.skipped == {'identical': 1}
  assert all(pair.margin is None for pair in adapt_preferences(records, 'messages', 'd.jsonl').pairs)
  for bad in ('high', None, float('nan'), True):
    with pytest.raises(UserError, match=r"^record 0 of d.jsonl \(format messages\): margin field 'rating.gap' is "):
      adapt_preferences([dict(records[0], rating={'gap': bad})], 'messages', 'd.jsonl', margin_field='rating.gap')
