"""A reward model as a reward term (data/reward_terms.py RewardModelTerm, rl/model_scores.py): an RL
step's completions scored in the mesh by a reward model that shares the policy's tokenizer, composed
with the run's other terms on the host, equal to transformers scoring each conversation; a reward
model with another tokenizer, or one that reads fewer tokens than the step's rows, refused in one
line when the run is built."""

import dataclasses
import json
import os
import shutil
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from grpo_jax.rl.held import Held
from grpo_jax import config as config_lib
from grpo_jax.build import build_rl_step, build_task
from grpo_jax.data import word_problems
from grpo_jax.errors import UserError
from grpo_jax.model import lora, make_mesh
from grpo_jax.rl.state import create_train_state
from grpo_jax.testing import save_random_hf_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULE = sys.modules[__name__].__name__
WEIGHTS = (0.7, 0.3)  # the reward model's term, the length term's


def length_term(completions, references, lengths):
  """A rule term beside the reward model's: a tenth of each completion's length in tokens."""
  return [0.1 * float(length) for length in lengths]


def reward_model_dir(tmp_path, seed: int, tokenizer: str, name: str = 'rm', **overrides) -> tuple[str, object]:
  """A random Qwen2 reward model (one label, pad id 0: the word problems' <|endoftext|>) with the
  tokenizer at `tokenizer` stored beside it; (directory, the torch model)."""
  directory = str(tmp_path / name)
  model = save_random_hf_checkpoint(directory, seed, head='score', vocab_size=64, **overrides)
  for file in os.listdir(tokenizer):
    shutil.copy(os.path.join(tokenizer, file), directory)
  return directory, model


def run_config(files: dict, reward_model: str, *overrides) -> config_lib.Config:
  return config_lib.load_config(os.path.join(ROOT, 'configs', 'tiny_math.yaml'), [
      f'task.source={files["train"]}', f'task.tokenizer={files["tokenizer"]}', 'task.reward_workers=1',
      'rollout.prompts_per_step=4', 'algo.group_size=3', 'rollout.max_new_tokens=4', 'algo.dynamic_sampling=false',
      'train.progress=false', 'train.tensorboard=false', 'eval.every=0',
      f'rewards=[{{name: reward_model, path: "{reward_model}", dtype: float32, weight: {WEIGHTS[0]}}}, '
      f'{{name: "{MODULE}:length_term", weight: {WEIGHTS[1]}}}]', *overrides])


def one_step(config, devices) -> dict:
  """One RL step of `config` on `devices`: what its update was given (prompts, rollout, scores) and
  the step's metrics, as NumPy."""
  mesh = make_mesh(config.mesh, devices=devices)
  model = config.model.build(mesh, config.run.seed)
  task = build_task(config)
  try:
    rl_step = build_rl_step(config, model, mesh, task)
    trained, frozen = lora.split_trainable(nnx.state(model))
    state = create_train_state(trained, rl_step.optimizer, config.run.seed, pool=rl_step.empty_pool,
                               shardings=rl_step.state_shardings, frozen=frozen)
    learned, learn = [], rl_step.learn

    def recording(state, ref_params, prompt_tokens, prompt_mask, rollout, scores, vision=None):
      learned.append(jax.device_get((prompt_tokens, prompt_mask, rollout, scores)))
      return learn(state, ref_params, prompt_tokens, prompt_mask, rollout, scores, vision)

    rl_step.learn = recording
    with jax.set_mesh(mesh):
      _, metrics = rl_step(state, Held())
  finally:
    task.close()
  prompt_tokens, prompt_mask, rollout, scores = learned[0]
  return dict(prompt_tokens=prompt_tokens, prompt_mask=prompt_mask, rollout=rollout, scores=scores,
              metrics=jax.device_get(metrics))


def transformers_scores(model, prompt_tokens, prompt_mask, rollout, group_size: int) -> np.ndarray:
  """The reward model's score of each conversation alone, unpadded: its prompt's real tokens, then
  its completion's (transformers reads it at its rightmost id that is not the pad id)."""
  import torch
  scores = []
  for row in range(rollout.tokens.shape[0]):
    prompt = prompt_tokens[row // group_size][prompt_mask[row // group_size] == 1]
    completion = rollout.tokens[row][np.asarray(rollout.mask[row], bool)]
    ids = torch.tensor(np.concatenate([prompt, completion])[None].astype(np.int64))
    with torch.no_grad():
      scores.append(float(model(ids).logits[0, 0]))
  return np.asarray(scores, np.float32)


@pytest.fixture(scope='module')
def word_files(tmp_path_factory):
  return word_problems.write(str(tmp_path_factory.mktemp('words')))


def test_a_reward_model_scores_a_steps_completions_as_transformers_and_composes(word_files, tmp_path, seed):
  rm_dir, reference = reward_model_dir(tmp_path, seed, word_files['tokenizer'])
  config = run_config(word_files, rm_dir, f'run.seed={seed % 1000}')
  step = one_step(config, jax.devices()[:1])
  rollout, scores, group = step['rollout'], step['scores'], config.algo.group_size
  want = transformers_scores(reference, step['prompt_tokens'], step['prompt_mask'], rollout, group)
  np.testing.assert_allclose(scores.terms['reward_model'], want, rtol=0, atol=1e-4)
  assert np.ptp(want) > 1e-3  # the completions score differently: a row mixed up would show
  lengths = 0.1 * np.asarray(rollout.lengths, np.float32)
  np.testing.assert_allclose(scores.terms['length_term'], lengths, rtol=0, atol=1e-6)
  np.testing.assert_allclose(scores.rewards, WEIGHTS[0] * want + WEIGHTS[1] * lengths, rtol=0, atol=1e-4)
  assert step['metrics']['reward/reward_model'] == pytest.approx(float(want.mean()), abs=1e-4)


@pytest.mark.exhaustive
def test_a_reward_model_on_a_mesh_scores_as_on_one_device(word_files, tmp_path, seed):
  """data 2 x fsdp 2 x tensor 2 (the reward model's weights laid out like the policy's) against one
  device: the same completions (the sampler's mesh equality) score alike."""
  rm_dir, reference = reward_model_dir(tmp_path, seed, word_files['tokenizer'])
  config = run_config(word_files, rm_dir, f'run.seed={seed % 1000}', 'mesh.data=2', 'mesh.fsdp=2', 'mesh.tensor=2')
  step = one_step(config, jax.devices()[:8])
  group = config.algo.group_size
  want = transformers_scores(reference, step['prompt_tokens'], step['prompt_mask'], step['rollout'], group)
  np.testing.assert_allclose(step['scores'].terms['reward_model'], want, rtol=0, atol=1e-4)


@pytest.mark.exhaustive
def test_partial_rollouts_score_the_groups_they_take(word_files, tmp_path, seed):
  """With the pool of partial rollouts the reward model scores the groups that leave it, after their
  own prompts."""
  rm_dir, reference = reward_model_dir(tmp_path, seed, word_files['tokenizer'])
  config = run_config(word_files, rm_dir, f'run.seed={seed % 1000}', 'algo.max_lag=1', 'algo.tis_cap=2')
  step = one_step(config, jax.devices()[:1])
  group = config.algo.group_size
  want = transformers_scores(reference, step['prompt_tokens'], step['prompt_mask'], step['rollout'], group)
  np.testing.assert_allclose(step['scores'].terms['reward_model'], want, rtol=0, atol=1e-4)


def _swapped_tokenizer(source: str, destination: str) -> tuple[str, str]:
  """The tokenizer at `source` with two words' ids swapped, saved at `destination`; the words."""
  os.makedirs(destination)
  for file in os.listdir(source):
    shutil.copy(os.path.join(source, file), destination)
  path = os.path.join(destination, 'tokenizer.json')
  with open(path) as f:
    data = json.load(f)
  vocab = data['model']['vocab']
  by_id = sorted(vocab, key=vocab.get)
  first, second = by_id[10], by_id[11]
  vocab[first], vocab[second] = vocab[second], vocab[first]
  with open(path, 'w') as f:
    json.dump(data, f)
  return first, second


def rendered_scores(model, tokenizer, policy_tokenizer, references, rollout, group_size: int):
  """transformers' score of each conversation as the reward model's card reads it: the prompt's
  messages, then the completion's text as the assistant's reply, through the reward model's own
  chat template and tokenizer; and each conversation's length in its tokens."""
  import torch
  scores, lengths = [], []
  for row in range(rollout.tokens.shape[0]):
    ids = rollout.tokens[row][np.asarray(rollout.mask[row], bool) & (rollout.tokens[row] < len(policy_tokenizer))]
    text = policy_tokenizer.decode(ids, skip_special_tokens=True)
    messages = [*references[row // group_size].messages, {'role': 'assistant', 'content': text}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=False, return_dict=False)
    with torch.no_grad():
      scores.append(float(model(torch.tensor([list(rendered)])).logits[0, 0]))
    lengths.append(len(rendered))
  return np.asarray(scores, np.float32), np.asarray(lengths)


def test_a_reward_model_of_another_tokenizer_reads_the_conversation_through_its_own(word_files, tmp_path, seed):
  """Its tokenizer maps two words to each other's ids: each completion is decoded, its conversation
  rendered through the reward model's template and tokenizer and scored as transformers scores it;
  a conversation longer than max_length is not scored (0, counted in reward_failures)."""
  from transformers import AutoTokenizer
  from grpo_jax.build import build_model_scores
  from grpo_jax.data.task import Prompts
  swapped = str(tmp_path / 'swapped')
  _swapped_tokenizer(word_files['tokenizer'], swapped)
  rm_dir, reference = reward_model_dir(tmp_path, seed, swapped)
  config = run_config(word_files, rm_dir, f'run.seed={seed % 1000}')
  step = one_step(config, jax.devices()[:1])
  task = build_task(config)
  try:
    references = task.prompts(None, 0, config.rollout.prompts_per_step).answers  # the step's prompts
    rm_tokenizer, group = AutoTokenizer.from_pretrained(rm_dir), config.algo.group_size
    want, lengths = rendered_scores(reference, rm_tokenizer, task.tokenizer, references, step['rollout'], group)
    np.testing.assert_allclose(step['scores'].terms['reward_model'], want, rtol=0, atol=1e-4)
    assert int(step['scores'].failures) == 0
    # The policy's tokens read as they are would give other scores.
    as_sampled = transformers_scores(reference, step['prompt_tokens'], step['prompt_mask'], step['rollout'], group)
    assert np.abs(as_sampled - want).max() > 1e-2
    limit = int(np.median(lengths))
    assert (lengths > limit).any() and (lengths <= limit).any()
    shorter = run_config(word_files, rm_dir, f'run.seed={seed % 1000}', 'rewards=[{name: reward_model, path: '
                         f'"{rm_dir}", dtype: float32, max_length: {limit}}}]')
    mesh = make_mesh(shorter.mesh, devices=jax.devices()[:1])
    scoring = build_model_scores(shorter, mesh, task)
    prompts = Prompts(tokens=step['prompt_tokens'], mask=step['prompt_mask'], answers=references)
    with jax.set_mesh(mesh):
      got = np.asarray(scoring(prompts, step['rollout'])['reward_model'])
    np.testing.assert_allclose(got[lengths <= limit], want[lengths <= limit], rtol=0, atol=1e-4)
    assert np.isnan(got[lengths > limit]).all()
    values, failed = shorter.rewards[0].scorer(None)(dataclasses.replace(
        _completions(len(got)), model_scores={'reward_model': got}))
    assert failed == int((lengths > limit).sum()) and (values[lengths > limit] == 0).all()
  finally:
    task.close()


def _completions(rows: int):
  from grpo_jax.data.reward_terms import Completions
  return Completions(texts=[''] * rows, references=[''] * rows, lengths=np.ones(rows), stopped=np.ones(rows, bool))


def test_reward_models_that_cannot_read_the_step_are_refused(word_files, tmp_path, seed):
  config = run_config(word_files, 'unused')
  mesh = make_mesh(config.mesh, devices=jax.devices()[:1])
  model = config.model.build(mesh, 0)
  task = build_task(config)
  try:
    short, _ = reward_model_dir(tmp_path, seed, word_files['tokenizer'], name='short', max_position_embeddings=24)
    with pytest.raises(UserError, match=rf'the reward model {short} reads at most 24 tokens .* makes rows of 32'):
      build_rl_step(run_config(word_files, short), model, mesh, task)
    bare = str(tmp_path / 'bare')
    _swapped_tokenizer(word_files['tokenizer'], bare)
    with open(os.path.join(bare, 'tokenizer_config.json')) as f:
      settings = json.load(f)
    settings.pop('chat_template', None)
    with open(os.path.join(bare, 'tokenizer_config.json'), 'w') as f:
      json.dump(settings, f)
    for name in ('chat_template.jinja',):
      if os.path.exists(os.path.join(bare, name)):
        os.remove(os.path.join(bare, name))
    untemplated, _ = reward_model_dir(tmp_path, seed, bare, name='untemplated')
    with pytest.raises(UserError, match=rf'the reward model {untemplated} has another tokenizer or chat template than '
                                        'the policy and no chat template of its own'):
      build_rl_step(run_config(word_files, untemplated), model, mesh, task)
  finally:
    task.close()
  with pytest.raises(UserError, match=r'rewards\[0\].path must name the reward model'):
    config_lib.load_config(None, ['task.name=math', 'task.source=x.jsonl', 'model.path=m',
                                  'rewards=[{name: reward_model}]'])


@pytest.mark.parametrize('overrides, message', [
    ([], r'rewards cannot score x.jsonl \(format prompts: no reference answers\): its default term \(math\) checks'),
    (['rewards=[{name: reward_model, path: rm}, {name: math}]'], r"its term 'math' checks answers against references"),
    (['rewards=[{name: reward_model, path: rm}]', 'eval.source=y.jsonl', 'eval.format=prompts'],
     'eval.format cannot be prompts: evaluation checks answers against the reference answers of y.jsonl'),
])
def test_prompts_alone_need_terms_that_read_no_reference(overrides, message):
  with pytest.raises(UserError, match=message):
    config_lib.load_config(None, ['task.name=math', 'task.source=x.jsonl', 'task.format=prompts', 'model.path=m',
                                  *overrides])
  config_lib.load_config(None, ['task.name=math', 'task.source=x.jsonl', 'task.format=prompts', 'model.path=m',
                                'rewards=[{name: reward_model, path: rm}, {name: format}]'])


def judge_dir(tmp_path, seed: int, tokenizer: str) -> str:
  """A random Qwen2 language model (the judge) with the tokenizer at `tokenizer` beside it."""
  directory = str(tmp_path / 'judge')
  save_random_hf_checkpoint(directory, seed, vocab_size=64)
  for file in os.listdir(tokenizer):
    shutil.copy(os.path.join(tokenizer, file), directory)
  return directory


@pytest.mark.exhaustive  # 8 s: the judge's sampler compiles
def test_a_judge_term_judges_each_completion_with_its_question(word_files, tmp_path, seed, monkeypatch):
  """The judge is shown each completion as the policy wrote it, after the question it answers (the
  reference only when the config shows it), its greedy verdicts are the Judge's (data/judge.py,
  tested against a full-forward decode in tests/test_judge.py), read by the rule: an unread
  verdict scores 0 and counts in reward_failures."""
  from grpo_jax.data.judge import Judge, judge_prompt_ids
  judge_path = judge_dir(tmp_path, seed, word_files['tokenizer'])
  calls = []
  judge_call = Judge.__call__

  def recording(self, rows, key=None):
    judged = judge_call(self, rows, key)
    calls.append((self, rows, judged))
    return judged

  monkeypatch.setattr(Judge, '__call__', recording)
  template = 'Q : {prompt} A : {completion} R : {reference}'
  config = config_lib.load_config(os.path.join(ROOT, 'configs', 'tiny_math.yaml'), [
      f'task.source={word_files["train"]}', f'task.tokenizer={word_files["tokenizer"]}', 'task.reward_workers=1',
      'rollout.prompts_per_step=2', 'algo.group_size=3', 'rollout.max_new_tokens=4', 'algo.dynamic_sampling=false',
      'train.progress=false', 'train.tensorboard=false', 'eval.every=0', f'run.seed={seed % 1000}',
      f'rewards=[{{name: judge, path: "{judge_path}", template: "{template}", show_reference: true, dtype: float32, '
      'max_new_tokens: 3, max_prompt_tokens: 64, parse: {kind: choice, marker: ".", choices: {How: 1.0, is: 0.5}}}, '
      f'{{name: "{MODULE}:length_term", weight: {WEIGHTS[1]}}}]'])
  step = one_step(config, jax.devices()[:1])
  [(judge, rows, judged)] = calls
  task = build_task(config)
  try:
    completions = task.decode(step['rollout'].tokens, step['rollout'].mask)
    references = task.prompts(None, 0, 2).answers  # the step's first prompts
  finally:
    task.close()
  assert rows == [(reference.question, completion, reference.answer) for reference, group in
                  zip(references, (completions[:3], completions[3:])) for completion in group]
  assert all(len(judge_prompt_ids(judge.tokenizer, template, True, *row)) <= 64 for row in rows)
  scores = step['scores']
  np.testing.assert_array_equal(scores.terms['judge'], np.where(judged.parsed, judged.rewards, 0.0))
  assert int(scores.failures) == judged.unparsed == int((~judged.parsed).sum())
  lengths = 0.1 * np.asarray(step['rollout'].lengths, np.float32)
  np.testing.assert_allclose(scores.rewards, scores.terms['judge'] + WEIGHTS[1] * lengths, rtol=0, atol=1e-6)


def test_judge_terms_that_cannot_work_are_refused_in_one_line():
  base = ['task.name=math', 'task.source=x.jsonl', 'model.path=m']
  for term, message in [
      ('{name: judge, path: j, template: "Q {prompt}"}', r'rewards\[0\].template has no \{completion\} slot'),
      ('{name: judge, path: j, template: "{completion} {reference}"}',
       r'rewards\[0\].template has a \{reference\} slot, but the judge sees the reference answer only with'),
      ('{name: judge, template: "{completion}"}', r'rewards\[0\].path must name the judge'),
      ('{name: judge, path: j, template: "{completion}", parse: {kind: vote}}',
       r"config key 'rewards\[0\].parse.kind' must be one of 'score' \| 'choice', got 'vote'"),
      ('{name: judge, path: j, template: "{completion}", parse: {kind: score, low: 3, high: 1}}',
       r'rewards\[0\].parse.low must be below high \(1.0\), got 3.0')]:
    with pytest.raises(UserError, match=message):
      config_lib.load_config(None, [*base, f'rewards=[{term}]'])
