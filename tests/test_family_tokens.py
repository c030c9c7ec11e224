"""Tokenizers, chat templates, stop ids and pads as each family ships them (Llama 3, Mistral, GLM-4,
Gemma 3, DeepSeek-LLM), on tokenizers built here (tests/family_tokenizers.py): the math task's and
serving's prompts, the agents' text turns, and the stops of generate, serving and the sampler."""

import json

import jax
import numpy as np
import pytest
from flax import nnx

from family_tokenizers import FAMILIES, hand_ids, vocabulary, write_family
from grpo_jax import generate
from grpo_jax.agents.inference import Completion
from grpo_jax.agents.text import TextCodec
from grpo_jax.errors import UserError
from grpo_jax.sampler.special_tokens import checkpoint_eos_ids, special_tokens
from grpo_jax.serve.tokenizer import HFTokenizer
from test_math_task import make_task, write_problems

QUESTION = 'Q: What is 3 plus one?'  # prompt_template 'Q: {prompt}' on write_problems' record 3
# The prompt each family's template renders for QUESTION, as pieces: special tokens and text.
RENDERED = {
    'llama3': ['<|begin_of_text|>', '<|start_header_id|>', 'user', '<|end_header_id|>', '\n\n' + QUESTION, '<|eot_id|>',
               '<|start_header_id|>', 'assistant', '<|end_header_id|>', '\n\n'],
    'mistral': ['<s>', '[INST]', ' ' + QUESTION, '[/INST]'],
    'glm4': ['[gMASK]', '<sop>', '<|user|>', '\n' + QUESTION, '<|assistant|>', '\n'],
    'gemma3': ['<bos>', '<start_of_turn>', 'user\n' + QUESTION, '<end_of_turn>', '\n', '<start_of_turn>', 'model\n'],
    'deepseek': ['<｜begin▁of▁sentence｜>', 'User: ' + QUESTION + '\n\nAssistant:'],
}
# The pad each family gets: its own pad token, else its unk, else the smallest id that is neither a
# stop nor its BOS (the byte '!', id 0, for Llama 3 and DeepSeek, whose specials follow the bytes).
PADS = {'llama3': '!', 'mistral': '<unk>', 'glm4': '<|endoftext|>', 'gemma3': '<pad>', 'deepseek': '!'}
# The stop a turn ends on that the template writes after an assistant's message of the role.
TURN_ENDS = {('llama3', 'user'): '<|eot_id|>', ('mistral', 'user'): '</s>', ('glm4', 'user'): '<|user|>',
             ('glm4', 'tool'): '<|observation|>', ('gemma3', 'user'): '<end_of_turn>',
             ('deepseek', 'user'): '<｜end▁of▁sentence｜>'}


@pytest.mark.parametrize('name', sorted(FAMILIES))
def test_math_prompts_stops_and_pad_follow_the_family(tmp_path, name):
  """The math task's prompts equal the family's template tokenized by hand, its BOS (or GLM-4's
  prefix) once, whether the template (in tokenizer_config.json or chat_template.jinja) writes it
  or the tokenizer adds it to a prompt without a template; its stops are the tokenizer's eos and
  every eos id config.json and generation_config.json list; its pad is never a stop unless the
  tokenizer names it so (GLM-4). Serving's text requests are tokenized alike."""
  family = write_family(str(tmp_path / name), name)
  vocab = vocabulary(family)
  problems = write_problems(tmp_path / 'p.jsonl', 4)
  templated = make_task(str(tmp_path / name), problems, prompt_template='Q: {prompt}', max_prompt_tokens=96)
  plain = make_task(str(tmp_path / name), problems, prompt_template='Q: {prompt}', chat_template=False)
  index = templated.problems.texts.index(next(t for t in templated.problems.texts if QUESTION in t))
  expected = hand_ids(family, RENDERED[name])
  assert templated.use_chat_template and templated.problems.prompt_ids[index].tolist() == expected
  # transformers' own rendering and tokenizing of the conversation agrees.
  assert expected == templated.tokenizer.apply_chat_template([{'role': 'user', 'content': QUESTION}],
                                                             add_generation_prompt=True, return_dict=False)
  assert plain.problems.prompt_ids[index].tolist() == hand_ids(family, [*family.prefix, QUESTION])
  assert plain.problems.prompt_ids[index].tolist() == plain.tokenizer(QUESTION)['input_ids']
  # Serving renders a text request the same way, and leaves a request without the template as sent.
  served, raw = (HFTokenizer(str(tmp_path / name), chat_template=mode) for mode in ('auto', 'never'))
  assert served.token_ids(QUESTION) == expected and raw.token_ids(QUESTION) == hand_ids(family, [*family.prefix, QUESTION])
  first = vocab[family.prefix[0]]
  assert [row.tolist().count(first) for row in (templated.problems.prompt_ids[index], plain.problems.prompt_ids[index])] == [1, 1]

  assert templated.stop_token_ids == tuple(vocab[token] for token in family.stops)
  assert templated.eos_id == vocab[family.eos] and templated.pad_id == vocab[PADS[name]]
  assert (templated.pad_id in templated.stop_token_ids) == (name == 'glm4')
  prompts = templated.prompts(jax.random.key(0), 0, 4)
  tokens, mask = np.asarray(prompts.tokens), np.asarray(prompts.mask)
  assert np.all(tokens[mask == 0] == templated.pad_id) and np.all(mask.sum(1) > len(family.prefix))


@pytest.mark.parametrize('name, role', sorted(TURN_ENDS))
def test_agent_replies_continue_the_conversation_as_the_template_writes_it(tmp_path, name, role):
  """An environment's reply to a policy turn makes prompt + turn + reply equal transformers'
  rendering of the whole conversation, whether the turn ended on the stop the template writes
  there (Gemma's <end_of_turn> is no eos; GLM-4's next role opens the reply) or ran out of budget;
  a reply spelling the BOS does not write the token. A turn that ended on another stop keeps it and gets the whole
  message after it."""
  family = write_family(str(tmp_path / name), name)
  task = make_task(str(tmp_path / name), write_problems(tmp_path / 'p.jsonl', 1), max_prompt_tokens=96)
  tokenizer, vocab = task.tokenizer, vocabulary(family)
  codec = TextCodec(tokenizer, task.stop_token_ids, True, role=role)
  prompt = [{'role': 'user', 'content': QUESTION}]
  prompt_ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_dict=False)
  answered = prompt + [{'role': 'assistant', 'content': 'x=4'}, {'role': role, 'content': 'check it'}]
  reference = tokenizer.apply_chat_template(answered, add_generation_prompt=True, return_dict=False)
  # What the policy writes after the generation prompt for an answer 'x=4' (DeepSeek's: ' x=4').
  shown = tokenizer.apply_chat_template(answered[:2], tokenize=False)
  written = shown[len(tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)):]
  said = hand_ids(family, [written[:written.index('x=4') + 3]])
  end = vocab[TURN_ENDS[name, role]]
  for tokens, reason in ((said + [end], 'stop'), (said, 'length')):
    turn = codec.turn(Completion(tokens=tuple(tokens), log_probs=(0.0,) * len(tokens), finish_reason=reason))
    assert turn.text.strip() == 'x=4'
    assert prompt_ids + tokens + list(codec.reply('check it', turn)) == reference
    # A reply that spells the BOS writes its characters, never the token: the BOS stays once.
    assert vocab[family.prefix[0]] not in codec.reply(f'check {family.prefix[0]} it', turn)
  other = next((vocab[token] for token in family.stops if vocab[token] != end), None)
  if other is not None:  # e.g. Llama 3's <|eom_id|>: the template does not write it
    turn = codec.turn(Completion(tokens=tuple(said + [other]), log_probs=(0.0,) * (len(said) + 1),
                                finish_reason='stop'))
    assert turn.text.strip() == 'x=4'
    assert list(codec.reply('r', turn))[:2] == reference[len(prompt_ids) + len(said):][:2]


def test_checkpoint_eos_ids_read_both_files_and_refuse_a_bad_one(tmp_path):
  """config.json's id (or text_config's, Gemma 3 4B-27B) and generation_config.json's list, in
  order without repeats; a value that is no id names the file."""
  (tmp_path / 'config.json').write_text(json.dumps({'text_config': {'eos_token_id': 106}}))
  (tmp_path / 'generation_config.json').write_text(json.dumps({'eos_token_id': [1, 106, 7]}))
  assert checkpoint_eos_ids(str(tmp_path), None, str(tmp_path / 'missing')) == (106, 1, 7)
  (tmp_path / 'generation_config.json').write_text(json.dumps({'eos_token_id': ['<eos>']}))
  with pytest.raises(UserError, match=r'generation_config.json: eos_token_id must be a token id or a list'):
    checkpoint_eos_ids(str(tmp_path))


def test_generate_serving_and_the_sampler_stop_on_every_listed_eos(seed, make_hf_checkpoint, capsys):
  """A Llama 3 checkpoint whose generation_config.json lists a stop the tokenizer does not name:
  generate ends the completion right after the model first emits it, serving's engine stops on it,
  and the sampler's mask and lengths come from where it stopped, not from comparing with the pad
  (here set to a token the model emits before it)."""
  import torch
  from grpo_jax.sampler.decode import DecodeSettings
  from grpo_jax.sampler.rollout import GroupSampler
  from grpo_jax.sampler.sampling import SamplingConfig
  from grpo_jax.serve.__main__ import build_engine, parse_args
  from grpo_jax.model.loading import from_pretrained, load_tokenizer
  family = FAMILIES['llama3']
  listed = {vocabulary(family)[token] for token in family.stops}

  def answer(text):
    """(prompt, greedy answer, the first position from 1 on whose token the answer has not shown
    before) for a prompt whose answer holds none of the family's own stops, else None."""
    prompt = hand_ids(family, ['<|begin_of_text|>', text])
    with torch.no_grad():
      greedy = reference.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=10, eos_token_id=None,
                                  pad_token_id=0)[0, len(prompt):].tolist()
    at = next((k for k in range(1, 10) if greedy[k] not in greedy[:k]), None)
    return None if at is None or listed & set(greedy[:at + 1]) else (prompt, greedy, at)

  # The first new token of a greedy answer becomes a stop that generation_config.json alone lists. A
  # random model may answer every prompt with one token repeated: then another is drawn (at most 4).
  texts = [f'{a} plus {b}' for a in ('one', 'two', 'six', 'nine') for b in ('two', 'ten', 'five', 'zero')]
  for attempt in range(4):
    directory, reference = make_hf_checkpoint(seed + attempt, name=f'hf{attempt}')
    write_family(directory, 'llama3')
    found = next(filter(None, map(answer, texts)), None)
    if found is not None:
      break
  assert found is not None, f'seed {seed}: every greedy answer of 4 random models repeats one token or holds a stop'
  prompt, greedy, at = found
  stop = greedy[at]
  with open(f'{directory}/generation_config.json', 'w') as f:
    json.dump({'eos_token_id': [vocabulary(family)['<|end_of_text|>'], stop]}, f)

  assert generate.main(['--ckpt', directory, '--prompt-ids', ' '.join(map(str, prompt)), '--greedy',
                        '--max-new-tokens', '10', '--tensor', '1', '--json']) is None
  output = json.loads(capsys.readouterr().out)
  assert output['token_ids'] == [greedy[:at + 1]] and output['finish_reason'] == ['stop']

  engine, _ = build_engine(parse_args(['--ckpt', directory, '--port', '0', '--slots', '1']))
  assert stop in engine.stop_token_ids and engine.pad_id not in engine.stop_token_ids

  special = special_tokens(load_tokenizer(directory), checkpoint_eos_ids(directory))
  assert stop in special.stop_ids and greedy[at - 1] not in special.stop_ids
  model = from_pretrained(directory)
  settings = DecodeSettings(sampling=SamplingConfig(greedy=True), max_new_tokens=10,
                            stop_token_ids=special.stop_ids, pad_id=greedy[at - 1])
  rollout = jax.device_get(GroupSampler(model, group_size=1, settings=settings)(
      nnx.state(model), np.array([prompt], np.int32), np.ones((1, len(prompt)), np.int32), jax.random.key(0)))
  assert rollout.tokens[0, :at + 1].tolist() == greedy[:at + 1] and int(rollout.lengths[0]) == at + 1
  assert rollout.mask[0].tolist() == [True] * (at + 1) + [False] * (9 - at) and bool(rollout.stopped[0])
