"""Partial rollouts (algo.max_lag > 0, sampler/pool.py): groups carried across steps end with
exactly the tokens the group sampler gives them in one call (same keys, unchanged weights), on one
device and on a mesh; no trained token is older than the bound; a cut-off answer goes on under
new weights as if its tokens had been sampled by them; hostile settings are one-line errors."""

import contextlib
import dataclasses
import json
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from grpo_jax.config import load_config
from grpo_jax.errors import UserError
from grpo_jax.model import MeshConfig, from_pretrained, make_mesh
from grpo_jax.sampler import DecodeSettings, SamplingConfig
from grpo_jax.sampler import pool as sampler_pool
from grpo_jax.sampler.rollout import sample_groups
from grpo_jax.testing import left_padded, random_prompts

WIDTH = 9  # prompt width


def decode_settings(seed: int, steps: int = 16, stops: int = 60) -> DecodeSettings:
  # `stops` of the 1,000 ids end an answer: lengths spread from 1 token to the budget.
  stops = tuple(int(t) for t in np.random.default_rng(seed).choice(1000, stops, replace=False))
  return DecodeSettings(max_new_tokens=steps, sampling=SamplingConfig(temperature=1.0), stop_token_ids=stops, pad_id=0)


class Driver:
  """The pool driven as rl/step.py drives it: L batches primed, then each step fills one batch of P
  and advances at version = step, the parameters given per step."""

  def __init__(self, graphdef, prompts_per_step, group_size, max_lag, slots, settings, regenerate=False,
               architecture=None):
    self.count, self.group, self.max_lag = prompts_per_step, group_size, max_lag
    self.pool = sampler_pool.empty_pool((max_lag + 1) * prompts_per_step, group_size, WIDTH, settings,
                                        architecture=architecture)
    self.fill = jax.jit(functools.partial(sampler_pool.fill, answers=None, group_size=group_size, pad_id=0))
    self.advance = jax.jit(lambda params, pool, version: sampler_pool.advance(
        nnx.merge(graphdef, params), pool, version=version, take=prompts_per_step, group_size=group_size,
        settings=settings, slots=slots, max_lag=max_lag, regenerate=regenerate))
    self.batches, self.keys = [], []
    self.one_call = jax.jit(lambda p, t, m, k: sample_groups(nnx.merge(graphdef, p), t, m, k, group_size=group_size,
                                                             settings=settings))

  def join(self, seed, version):
    tokens, mask = left_padded(random_prompts(seed, np.random.default_rng(seed).integers(1, WIDTH + 1, self.count)),
                               width=WIDTH)
    key = jax.random.key(1000 + seed)
    position = len(self.batches) * self.count
    self.batches.append((tokens, mask))
    self.keys.append(key)
    self.pool = self.fill(self.pool, jnp.asarray(tokens), jnp.asarray(mask), version=version, key=key,
                          position=position, prompt_key=jax.random.key_data(key))

  def step(self, params, version):
    self.pool, taken = self.advance(params, self.pool, version)
    return taken


def groups_of(taken, group_size, routes=False):
  """{source: (tokens, log_probs, lengths, versions[, routes])} of each group taken."""
  out = {}
  names = ('tokens', 'log_probs', 'lengths', 'versions') + (('routes',) if routes else ())
  for index, source in enumerate(np.asarray(taken.source)):
    rows = slice(index * group_size, (index + 1) * group_size)
    out[int(source)] = tuple(np.asarray(getattr(taken.rollout, name))[rows] for name in names)
  return out


def reference(params, driver, source):
  """The group of prompt `source` sampled in one call of the group sampler, from the key its
  entry draws from."""
  batch, index = divmod(source, driver.count)
  tokens, mask = driver.batches[batch]
  return driver.one_call(params, jnp.asarray(tokens[index:index + 1]), jnp.asarray(mask[index:index + 1]),
             jax.random.fold_in(driver.keys[batch], index))


@pytest.mark.parametrize('max_lag, slots, mesh_shape, steps, family', [
    pytest.param(1, 8, None, 16, None, id='lag1'),
    pytest.param(2, 5, None, 80, None, id='lag2-odd-slots-chunked', marks=pytest.mark.exhaustive),
    pytest.param(1, 8, (2, 2, 2), 16, None, id='lag1-mesh', marks=pytest.mark.exhaustive),
    pytest.param(2, 5, None, 80, 'gemma3_text', id='lag2-sliding-window', marks=pytest.mark.exhaustive),
    pytest.param(1, 8, None, 16, 'moe', id='lag1-moe-routes')])
def test_carried_groups_equal_one_call(seed, make_hf_checkpoint, max_lag, slots, mesh_shape, steps, family):
  """N = 80: answers carried over are prefilled again in chunks of 40 tokens; a family: its
  checkpoint (tests/test_families.py; Gemma 3's local layers keep a ring of 6 entries, which the
  chunks of 40 run past); 'moe': a Qwen3-MoE recording its routes (routing replay), the carried
  groups' routes (prefilled again with the answers) equal one call's on every token fed."""
  if family is None:
    directory, _ = make_hf_checkpoint(seed)
  elif family == 'moe':
    from test_moe import CASES
    directory, _ = make_hf_checkpoint(seed, **CASES['top2-norm-tied'])
  else:
    from test_families import FAMILIES
    directory, _ = make_hf_checkpoint(seed, **FAMILIES[family][0])
  settings = decode_settings(seed, steps, stops=60 if steps <= 16 else 12)
  routes = family == 'moe'
  if routes:
    settings = dataclasses.replace(settings, record_routes=True)
  count, group = 4, 4
  mesh = make_mesh(MeshConfig(*mesh_shape)) if mesh_shape else None
  with jax.set_mesh(mesh) if mesh else contextlib.nullcontext():
    model = from_pretrained(directory, mesh=mesh)
    graphdef, params = nnx.split(model)
    driver = Driver(graphdef, count, group, max_lag, slots, settings, architecture=model.config)
    for index in range(max_lag):
      driver.join(seed + index, 0)
    taken_groups, carried, lags = {}, 0, []
    for step in range(5):
      driver.join(seed + max_lag + step, step)
      taken = driver.step(params, step)
      carried += int(taken.metrics['carried_requests'])
      versions, mask = np.asarray(taken.rollout.versions), np.asarray(taken.rollout.mask)
      lags.append(int(np.max(np.where(mask, step - versions, 0))))
      taken_groups.update(groups_of(taken, group, routes))
    assert carried > 0, 'no answer was ever cut off: the test would not test carrying'
    assert 1 <= max(lags) <= max_lag, lags
    spanning = [int(row_length) for _, _, lengths, versions, *_ in taken_groups.values()
                for row_length, row in zip(lengths, versions) if len(set(row[:row_length].tolist())) > 1]
    if steps > 64:  # some answer was carried over with more than one chunk of tokens
      assert max(spanning) > sampler_pool._chunk(steps), spanning
    for source, (tokens, log_probs, lengths, versions, *recorded) in taken_groups.items():
      want = reference(params, driver, source)
      if routes:  # every token fed (each answer's last is not) routed as one call routed it
        want_routes = np.asarray(want.routes)
        fed = want_routes[..., 0, 0] != 255
        assert fed.any() and (np.asarray(recorded[0])[..., 0, 0] != 255).tolist() == fed.tolist()
        np.testing.assert_array_equal(np.sort(recorded[0], -1)[fed], np.sort(want_routes, -1)[fed],
                                      err_msg=f'group {source}')
      np.testing.assert_array_equal(tokens, np.asarray(want.tokens), err_msg=f'group {source}')
      np.testing.assert_array_equal(lengths, np.asarray(want.lengths), err_msg=f'group {source}')
      np.testing.assert_allclose(log_probs, np.asarray(want.log_probs), rtol=1e-5, atol=1e-5, err_msg=f'group {source}')
      assert np.all((versions >= 0) == (np.arange(settings.max_new_tokens) < lengths[:, None]))


@pytest.mark.exhaustive
def test_a_cut_off_answer_goes_on_under_the_new_weights(seed, make_hf_checkpoint):
  """Each step has its own weights: every token a group holds equals what the weights of the
  version recorded for it sample after the tokens before it (a teacher-forced reference per
  token), so carried answers are prefilled again, not decoded from a stale cache."""
  directory, _ = make_hf_checkpoint(seed)
  settings = decode_settings(seed, steps=12)
  model = from_pretrained(directory)
  graphdef, params = nnx.split(model)
  rng = np.random.default_rng(seed)
  weights = [jax.tree.map(lambda x: x + 0.05 * jnp.asarray(rng.standard_normal(x.shape), x.dtype), params)
             for _ in range(5)]
  driver = Driver(graphdef, 2, 4, 1, 4, settings)
  driver.join(seed, 0)
  taken_groups = {}
  for step in range(5):
    driver.join(seed + 1 + step, step)
    taken_groups.update(groups_of(driver.step(weights[step], step), 4))
  width = WIDTH + settings.max_new_tokens
  forward = jax.jit(lambda p, t: jax.nn.log_softmax(nnx.merge(graphdef, p)(t)[0].astype(jnp.float32), axis=-1))
  mixed = 0
  for source, (tokens, log_probs, lengths, versions) in taken_groups.items():
    batch, index = divmod(source, driver.count)
    prompt_tokens, prompt_mask = driver.batches[batch]
    prompt = [int(t) for t, m in zip(prompt_tokens[index], prompt_mask[index]) if m]
    for row in range(4):
      used = sorted(set(versions[row, :lengths[row]].tolist()))
      mixed += len(used) > 1
      for version in used:
        sequence = prompt + tokens[row, :lengths[row]].tolist()
        # Right padding: causal attention keeps it out of every real position's log-probs.
        expected = forward(weights[version], jnp.asarray([sequence + [0] * (width - len(sequence))]))
        expected = expected[len(prompt) - 1:len(sequence) - 1]
        at = np.flatnonzero(versions[row, :lengths[row]] == version)
        np.testing.assert_allclose(log_probs[row, at], np.asarray(expected)[at, tokens[row, at]], atol=2e-5,
                                   err_msg=f'group {source} row {row} version {version}')
  assert mixed > 0, 'no answer spans two versions: the test would not test the in-flight update'


@pytest.mark.exhaustive
def test_regenerate_restarts_groups_past_the_bound(seed, make_hf_checkpoint):
  """stale_groups: regenerate takes the first P complete groups and restarts a group that would
  pass the bound: with long-tailed answers and 4 slots some restart (within 80 steps), and no trained token is
  older than max_lag."""
  directory, _ = make_hf_checkpoint(seed)
  settings = decode_settings(seed, steps=12)
  model = from_pretrained(directory)
  graphdef, params = nnx.split(model)
  driver = Driver(graphdef, 2, 2, 1, 4, settings, regenerate=True)
  driver.join(seed, 0)
  regenerated, lags = 0, []
  for step in range(80):
    if regenerated and step >= 4:
      break
    driver.join(seed + 1 + step, step)
    taken = driver.step(params, step)
    regenerated += int(taken.metrics['groups_regenerated'])
    versions, mask = np.asarray(taken.rollout.versions), np.asarray(taken.rollout.mask)
    lags.append(int(np.max(np.where(mask, step - versions, 0))))
  assert max(lags) <= 1 and regenerated > 0, (lags, regenerated)


@pytest.mark.parametrize('override, field', [
    ('algo.max_lag=-1', 'algo.max_lag'), ('algo.max_lag=1', 'algo.tis_cap'),
    ('algo.stale_groups=drop', 'algo.stale_groups')])
def test_hostile_settings_are_one_line_errors(override, field):
  with pytest.raises(UserError) as error:
    load_config('configs/tiny_arith.yaml', [override])
  assert field in str(error.value) and '\n' not in str(error.value)


@pytest.mark.parametrize('config, extra', [('tiny_arith', ['algo.dynamic_sampling=true']), ('tiny_guess', [])],
                         ids=['dynamic-sampling', 'agent'])
def test_lag_with_dynamic_sampling_or_agents_is_refused(config, extra):
  with pytest.raises(UserError) as error:
    load_config(f'configs/{config}.yaml', ['algo.max_lag=1', 'algo.tis_cap=2', *extra])
  assert 'algo.max_lag' in str(error.value) and '\n' not in str(error.value)


def test_answer_book_draws_missing_answers_again():
  """A host task's answers for groups still in the pool: a resumed run's empty book draws them
  from the task with the batch position and prompt key the pool recorded, as the first draw gave."""
  import types

  from grpo_jax.data.task import Prompts
  from grpo_jax.rl.modes import AnswerBook

  class Task:
    def prompts(self, key, position, count):
      return Prompts(tokens=None, mask=None, answers=[f'{position + i}:{int(np.asarray(key)[1])}' for i in range(count)])

  task, count = Task(), 3
  book, resumed = AnswerBook(task, count), AnswerBook(task, count)
  for position, key in ((0, 11), (3, 12)):
    book.record(position, task.prompts(jnp.asarray([0, key], jnp.uint32), position, count).answers)
  taken = types.SimpleNamespace(source=np.asarray([4, 1, 5]), batch_position=np.asarray([3, 0, 3]),
                                batch_key=np.asarray([[0, 12], [0, 11], [0, 12]], np.uint32))
  assert resumed.take(taken) == book.take(taken) == ['4:12', '1:11', '5:12']
  assert 1 not in book.by_source and 0 in book.by_source  # taken answers leave the book


@pytest.mark.exhaustive
@pytest.mark.starts_first
def test_a_resumed_math_run_equals_the_uninterrupted_one(tmp_path, make_hf_checkpoint, seed):
  """A host-scored dataset task with partial rollouts: 3 steps, then a resume to 6, equal 6 steps."""
  from test_math_task import chat_tokenizer_dir, write_problems
  from test_train import without_timing

  from grpo_jax import train
  model_path, _ = make_hf_checkpoint(seed)
  chat_tokenizer_dir(model_path)
  source = write_problems(tmp_path / 'problems.jsonl', 12)
  config = tmp_path / 'math.yaml'
  config.write_text(f"""
model: {{path: {model_path}}}
task: {{name: math, source: {source}, prompt_field: problem, answer_field: solution, max_prompt_tokens: 64,
       reward_workers: 2}}
rollout: {{prompts_per_step: 2, max_new_tokens: 6, slots: 3}}
algo: {{group_size: 2, max_lag: 1, tis_cap: 2.0}}
optim: {{learning_rate: 1.0e-3}}
train: {{steps: 6, checkpoint_every: 3, progress: false, tensorboard: false}}
""")
  rows = {}
  for name, stops in (('whole', [6]), ('resumed', [3, 6])):
    for steps in stops:
      train.main(['--config', str(config), '--workdir', str(tmp_path / name), '--set', f'train.steps={steps}'])
    with open(tmp_path / name / 'metrics.jsonl') as f:
      rows[name] = without_timing([json.loads(line) for line in f])
  assert [row['step'] for row in rows['resumed']] == list(range(1, 7))
  # Groups stay in the pool across the checkpoint (their answers drawn again from the data). Whether
  # an answer is also cut off depends on the random model stopping early at all (answers of equal
  # length finish together); the kill/resume test of test_train carries requests on tiny_arith.
  assert min(row['carried_groups'] for row in rows['whole']) > 0
  assert rows['resumed'] == rows['whole']
