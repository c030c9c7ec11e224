"""Agents and environments (grpo_jax/agents): the inference server against the jitted group
sampler, requests arriving while others decode, per-request budgets and stop ids; the loss mask of
multi-turn trajectories against the same policy tokens trained turn by turn with the
observations given as prompt; the guess-number environment under hostile turns; and the RL step on
the agent task."""

import asyncio
import json
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from grpo_jax import config as config_lib
from grpo_jax.agents import guess
from grpo_jax.agents.agent import EnvironmentAgent, Problem, Step
from grpo_jax.agents.inference import Completion, InferenceServer, Request
from grpo_jax.agents.trajectory import Episode, Trajectory, collate
from grpo_jax.data.task import Prompts
from grpo_jax.errors import UserError
from grpo_jax.model import from_pretrained
from grpo_jax.rl.held import Held
from grpo_jax.rl.algo import AlgoConfig
from grpo_jax.rl.state import init_train_state
from grpo_jax.rl.step import make_batch
from grpo_jax.rl.batch import Batch
from grpo_jax.rl.update import UpdateSettings, update
from grpo_jax.sampler import DecodeSettings, SamplingConfig
from grpo_jax.sampler.decode import request_keys
from grpo_jax.sampler.rollout import sample_groups
from grpo_jax.testing import left_padded, random_prompts
from runs import read_metrics, train_here, train_learning

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T1 = SamplingConfig(temperature=1.0)


@pytest.fixture
def model(seed, make_hf_checkpoint):
  directory, _ = make_hf_checkpoint(seed)
  return from_pretrained(directory)


def serve(model, requests, *, delays=None, slots=3, chunk=3, max_new_tokens=12, stops=(), images=None):
  """Each request's completion from a fresh server; request i is sent after delays[i] seconds;
  images: the server's image bucket (requests with images)."""
  graphdef, params = nnx.split(model)
  server = InferenceServer(graphdef, settings=DecodeSettings(sampling=T1, max_new_tokens=max_new_tokens,
                                                             stop_token_ids=stops),
                           slots=slots, max_context=64, chunk=chunk, images=images)
  server.bind(params)

  async def one(request, delay):
    await asyncio.sleep(delay)
    return await server.generate(request)

  async def run():
    async with server:
      return await asyncio.gather(*(one(r, d) for r, d in zip(requests, delays or [0.0] * len(requests))))

  return asyncio.run(run()), server.stats


def test_server_tokens_equal_the_group_sampler(seed, model):
  """Seven requests through 3 slots, in chunks of 3 steps, prefilled right-padded in width buckets:
  tokens equal the jitted group sampler's (left-padded, slots refilled inside one jit) for the
  same request keys, log-probs to 1e-5."""
  prompts = random_prompts(seed, [5, 17, 11, 3, 9, 2, 14])
  tokens, mask = left_padded(prompts)
  key = jax.random.key(seed % 1000)
  stops = tuple(range(0, 1000, 37))
  settings = DecodeSettings(sampling=T1, max_new_tokens=12, stop_token_ids=stops)
  reference = sample_groups(model, tokens, mask, key, group_size=1, settings=settings, slots=7)
  keys = request_keys(key, len(prompts))
  results, stats = serve(model, [Request(tokens=tuple(p), max_new_tokens=12, key=keys[i]) for i, p in enumerate(prompts)],
                         stops=stops)
  for row, result in enumerate(results):
    length = int(reference.lengths[row])
    assert list(result.tokens) == np.asarray(reference.tokens[row, :length]).tolist(), f'request {row}'
    np.testing.assert_allclose(result.log_probs, np.asarray(reference.log_probs[row, :length]), rtol=1e-5, atol=1e-5)
    assert result.finish_reason == ('stop' if bool(reference.stopped[row]) else 'length')
  assert stats.requests == 7 and stats.tokens == int(np.asarray(reference.lengths).sum())


@pytest.mark.exhaustive
def test_budgets_stops_and_late_requests(seed, model):
  """A request's own budget and stop ids cut its stream where a longer unstopped request with the
  same key is cut by hand; requests sent while others decode (and an episode-like pause between
  them) change nothing."""
  prompts = random_prompts(seed + 1, [6, 13, 4, 9])
  keys = [jax.random.key(seed % 997 + i) for i in range(len(prompts))]
  full, _ = serve(model, [Request(tokens=tuple(p), max_new_tokens=12, key=k) for p, k in zip(prompts, keys)])
  budgets = [3, 12, 7, 1]
  own_stops = [(), (full[1].tokens[4],), (full[2].tokens[2], full[2].tokens[5]), ()]
  cut, stats = serve(model, [Request(tokens=tuple(p), max_new_tokens=b, key=k, stop_token_ids=s)
                             for p, k, b, s in zip(prompts, keys, budgets, own_stops)],
                     delays=[0.0, 0.05, 0.0, 0.2], slots=2, chunk=2)
  for row, (whole, part) in enumerate(zip(full, cut)):
    expected = list(whole.tokens[:budgets[row]])
    hits = [i for i, token in enumerate(expected) if token in own_stops[row]]
    if hits:
      expected = expected[:hits[0] + 1]
    assert list(part.tokens) == expected, f'request {row}'
    np.testing.assert_allclose(part.log_probs, whole.log_probs[:len(expected)], rtol=1e-5, atol=1e-5)
    assert part.finish_reason == ('stop' if hits else 'length')
  assert stats.requests == 4


@pytest.mark.parametrize('request_fields, message', [
    (dict(tokens=()), 'tokens is empty'),
    (dict(max_new_tokens=13), 'max_new_tokens 13 outside [1, 12]'),
    (dict(tokens=tuple(range(61))), '61 context tokens + 4 new exceed'),
    (dict(stop_token_ids=(1, 2, 3, 4, 5)), '5 stop ids, at most 4'),
    (dict(sampling=SamplingConfig(greedy=True)), 'differs from the server'),
    (dict(tokens=(1, 1000, 2)), 'request tokens: token id 1000 at position 1 is outside the vocabulary [0, 1000'),
    (dict(tokens=(1, 2, -1)), 'request tokens: token id -1 at position 2 is outside'),
])
def test_bad_requests_are_one_line_errors(model, request_fields, message):
  fields = dict(dict(tokens=(1, 2, 3), max_new_tokens=4, key=jax.random.key(0)), **request_fields)
  with pytest.raises(UserError, match=message.replace('[', r'\[').replace(']', r'\]').replace('+', r'\+')):
    serve(model, [Request(**fields)])


# ---- trajectories: the loss mask ----

@pytest.mark.exhaustive
def test_episode_budget_truncates_turns_and_observations(model):
  graphdef, params = nnx.split(model)
  server = InferenceServer(graphdef, settings=DecodeSettings(sampling=T1, max_new_tokens=8), slots=2, max_context=32)
  server.bind(params)

  async def run():
    async with server:
      episode = Episode(server, (5, 6, 7), budget=9, key=jax.random.key(3))
      first = await episode.act(4)
      episode.observe([11, 12, 13])
      second = await episode.act(4)  # 2 tokens of room
      episode.observe([14, 15])  # no room
      third = await episode.act(4)
      return episode.trajectory, first, second, third

  trajectory, first, second, third = asyncio.run(run())
  assert len(first.tokens) == 4 and len(second.tokens) == 2 and third is None
  assert trajectory.tokens == list(first.tokens) + [11, 12, 13] + list(second.tokens)
  assert trajectory.loss_mask == [1] * 4 + [0] * 3 + [1] * 2 and trajectory.truncated and trajectory.turns == 2
  assert trajectory.log_probs[4:7] == [0.0] * 3
  # Between rollouts the server holds no KV cache on the devices (the update needs the memory).
  config = model.config
  cache_shape = (config.num_hidden_layers, 2, 32, config.num_key_value_heads, config.resolved_head_dim)
  assert server.stats.requests == 2 and not [array for array in jax.live_arrays() if array.shape == cache_shape]


@pytest.mark.exhaustive
@pytest.mark.parametrize('mode', ['a slot each', 'taking turns on one slot', 'racing for half the slots'])
def test_turns_that_reuse_kept_caches_sample_from_the_right_distribution(seed, make_hf_checkpoint, mode):
  """Episodes of 4 turns with observations between them. With a slot per episode every later turn
  continues its kept cache; episodes taking turns on one slot evict each other's, so every turn
  prefills afresh; racing for half the slots (observations at random times) mixes both. Every
  policy token's sampler log-prob equals transformers' on the whole episode so far."""
  from conftest import torch_logits
  directory, reference = make_hf_checkpoint(seed)
  graphdef, params = nnx.split(from_pretrained(directory))
  rng = np.random.default_rng(seed)
  slots = {'a slot each': 6, 'taking turns on one slot': 1, 'racing for half the slots': 3}[mode]
  server = InferenceServer(graphdef, settings=DecodeSettings(sampling=T1, max_new_tokens=5), slots=slots,
                           max_context=48, chunk=2)
  server.bind(params)
  prompts = random_prompts(seed, rng.integers(2, 7, 6).tolist())
  observations = [[rng.integers(1, 1000, rng.integers(1, 4)).tolist() for _ in range(3)] for _ in prompts]
  budgets = rng.integers(1, 6, (len(prompts), 4))
  delays = rng.random((len(prompts), 3)) * 0.05
  episodes = [Episode(server, prompt, 40, jax.random.key(seed % 1000 + index)) for index, prompt in enumerate(prompts)]

  async def turn(index, number):
    await episodes[index].act(int(budgets[index, number]))
    if number < 3:
      if mode == 'racing for half the slots':
        await asyncio.sleep(delays[index, number])
      episodes[index].observe(observations[index][number])

  async def run():
    async with server:
      if mode == 'taking turns on one slot':
        for number in range(4):
          for index in range(len(prompts)):
            await turn(index, number)
      else:
        async def episode(index):
          for number in range(4):
            await turn(index, number)
        await asyncio.gather(*(episode(index) for index in range(len(prompts))))

  asyncio.run(run())
  trajectories = [episode.trajectory for episode in episodes]
  assert server.stats.requests == 24
  whole = sum(len(p) * 4 + len(t.tokens) * 3 for p, t in zip(prompts, trajectories))  # an upper bound
  if mode == 'a slot each':  # each later turn prefills the last turn's final token and the observation only
    assert server.stats.reused == 18
    assert server.stats.prefilled_tokens == sum(len(p) + sum(1 + len(o) for o in obs)
                                                for p, obs in zip(prompts, observations))
  elif mode == 'taking turns on one slot':  # every turn's whole context
    contexts = 0
    for prompt, trajectory in zip(prompts, trajectories):
      mask = trajectory.loss_mask
      starts = [i for i, (m, previous) in enumerate(zip(mask, [0] + mask)) if m and not previous]
      contexts += sum(len(prompt) + start for start in starts)
    assert server.stats.reused == 0 and server.stats.prefilled_tokens == contexts < whole
  for prompt, trajectory in zip(prompts, trajectories):
    logits = torch_logits(reference, [list(prompt) + trajectory.tokens])[0].astype(np.float64)
    top = logits.max(-1, keepdims=True)
    log_softmax = logits - top - np.log(np.sum(np.exp(logits - top), -1, keepdims=True))
    policy = zip(trajectory.tokens, trajectory.loss_mask, trajectory.log_probs)
    for offset, (token, mask, log_prob) in enumerate(policy):
      if mask:
        position = len(prompt) + offset - 1  # the logits that predicted it
        np.testing.assert_allclose(log_prob, log_softmax[position, token], rtol=1e-4, atol=1e-4)


def random_episode(rng, vocab, turns):
  """A trajectory of `turns` policy turns with observations between them, random lengths and tokens."""
  trajectory, turn_spans = Trajectory(), []
  for turn in range(turns):
    length = int(rng.integers(1, 4))
    turn_spans.append((len(trajectory.tokens), length))
    trajectory.tokens += rng.integers(1, vocab, length).tolist()
    trajectory.loss_mask += [1] * length
    trajectory.log_probs += (-rng.random(length) * 3).tolist()
    if turn < turns - 1:
      observed = int(rng.integers(1, 4))
      trajectory.tokens += rng.integers(1, vocab, observed).tolist()
      trajectory.loss_mask += [0] * observed
      trajectory.log_probs += [0.0] * observed
  trajectory.reward = float(rng.random())
  return trajectory, turn_spans


def recorded_update(graphdef, params, ref_params, batch: Batch, algo_config: AlgoConfig):
  record = optax.GradientTransformation(lambda p: jax.tree.map(jnp.zeros_like, p),
                                        lambda g, total, params=None: (g, jax.tree.map(jnp.add, total, g)))
  optimizer = optax.chain(record, optax.sgd(0.0))
  run = functools.partial(update, graphdef=graphdef, optimizer=optimizer, schedule=optax.constant_schedule(0.0),
                          settings=UpdateSettings(algo=algo_config, temperature=0.9, rows=batch.tokens.shape[0]))
  state, metrics = jax.jit(run)(init_train_state(params, optimizer, 0), batch, Held(reference=ref_params))
  return state.opt_state[0], metrics


def test_trajectory_loss_and_gradient_equal_turns_given_their_history_as_prompt(seed, model):
  """Two problems x two episodes of 2-3 turns: the update on the trajectories (one row each,
  observations inside the row, outside the mask) and on their turns (one row per turn, whose
  prompt is the problem's prompt and everything before the turn) give the same loss, KL, entropy
  and gradient: observation tokens are read, never trained on, and each policy token sees exactly
  its history. Token-mean: both batches weigh every policy token alike."""
  rng = np.random.default_rng(seed)
  graphdef, params = nnx.split(model)
  params = jax.tree.map(lambda p: p + jnp.asarray(0.05 * rng.standard_normal(p.shape), p.dtype), params)
  ref_params = jax.tree.map(lambda p: p + jnp.asarray(0.05 * rng.standard_normal(p.shape), p.dtype), params)
  vocab, budget, group = 1000, 16, 2
  problem_prompts = [rng.integers(1, vocab, int(n)).tolist() for n in (4, 6)]
  episodes = [random_episode(rng, vocab, turns) for turns in (2, 3, 3, 2)]
  rollout, scores, _ = collate([e for e, _ in episodes], budget, pad_id=0)
  tokens, mask = left_padded(problem_prompts)
  algo_config = AlgoConfig(group_size=group, kl_beta=0.05, entropy_coef=0.01, logprob_implementation='xla_chunked')
  whole = make_batch(Prompts(tokens=jnp.asarray(tokens), mask=jnp.asarray(mask), answers=None),
                     jax.tree.map(jnp.asarray, rollout), jax.tree.map(jnp.asarray, scores), algo_config)

  # Turn by turn: prompt = problem prompt + the episode's tokens before the turn; completion = the turn.
  rows, width = [], max(len(problem_prompts[i // group]) + len(e.tokens) for i, (e, _) in enumerate(episodes))
  for index, (episode, spans) in enumerate(episodes):
    for start, length in spans:
      rows.append((problem_prompts[index // group] + episode.tokens[:start], episode.tokens[start:start + length],
                   episode.log_probs[start:start + length], float(whole.advantages[index])))
  turn_length = max(len(turn) for _, turn, _, _ in rows)
  history, history_mask = left_padded([h for h, _, _, _ in rows], width=width)
  completion = np.zeros((len(rows), turn_length), np.int32)
  completion_mask = np.zeros((len(rows), turn_length), bool)
  sampler = np.zeros((len(rows), turn_length), np.float32)
  for row, (_, turn, log_probs, _) in enumerate(rows):
    completion[row, :len(turn)], completion_mask[row, :len(turn)], sampler[row, :len(turn)] = turn, True, log_probs
  turns = Batch.of_sequences(
      tokens=jnp.asarray(np.concatenate([history, completion], 1)),
      segment_ids=jnp.asarray(np.concatenate([history_mask, completion_mask], 1).astype(np.int32)),
      mask=jnp.asarray(completion_mask), advantages=jnp.asarray([r[3] for r in rows], jnp.float32),
      sampler_log_probs=jnp.asarray(sampler))
  whole_gradients, whole_metrics = recorded_update(graphdef, params, ref_params, whole, algo_config)
  turn_gradients, turn_metrics = recorded_update(graphdef, params, ref_params, turns, algo_config)
  for name in ('policy_loss', 'kl', 'entropy', 'sampler_gap_mean'):
    np.testing.assert_allclose(float(turn_metrics[name]), float(whole_metrics[name]), rtol=1e-5, atol=1e-6, err_msg=name)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-7),
               whole_gradients, turn_gradients)
  assert float(optax.tree.norm(whole_gradients)) > 1e-3


# ---- the guess-number environment ----

def test_guess_number_answers_hostile_turns():
  environment = guess.GuessNumber(16, secret=9)
  number = lambda k: guess.FIRST_NUMBER + k  # noqa: E731
  words = guess.WORDS

  def step(tokens):
    return asyncio.run(environment.step(Completion(tokens=tuple(tokens), log_probs=(0.0,) * len(tokens),
                                                   finish_reason='length')))

  assert step([number(3)]).observation == (words.index('higher'),)
  assert step([number(15)]).observation == (words.index('lower'),)
  assert step([number(9)]).reward == 1.0 and step([number(9)]).done
  for hostile in ([], [words.index('<|endoftext|>')], [words.index('higher')], [0], [10_000], [-5]):
    answer = step(hostile)
    assert answer.observation == (words.index('invalid'),) and answer.reward == 0.0 and not answer.done


@pytest.mark.parametrize('fields, message', [
    (['task.guess_range=1'], 'task.guess_range'),
    (['task.max_turns=0'], 'task.max_turns'),
    (['task.environment=nonsense'], 'task.environment'),
    (['rollout.max_new_tokens=5'], 'rollout.max_new_tokens'),
])
def test_bad_agent_configs_are_one_line_errors(fields, message):
  from grpo_jax.build import build_task
  with pytest.raises(UserError, match=message):
    build_task(config_lib.load_config(os.path.join(ROOT, 'configs', 'tiny_guess.yaml'), fields))


def test_environment_agent_plays_a_scripted_policy_by_the_rules(seed, model):
  """Episodes end on the right guess (reward 1), else after max_turns; observations are between
  the turns, the last turn is not answered; episode g's requests draw from fold_in(key, g)."""
  graphdef, params = nnx.split(model)
  server = InferenceServer(graphdef, settings=DecodeSettings(sampling=T1, max_new_tokens=1), slots=4, max_context=16)
  server.bind(params)
  agent = EnvironmentAgent(make_environment=lambda problem, episode: guess.GuessNumber(1000, problem.data),
                           max_turns=3, turn_tokens=1)

  async def run():
    async with server:
      return await agent.episodes(server, Problem(prompt=(2,), data=seed % 994 + 6), 6, jax.random.key(seed % 1000), 5)

  trajectories = asyncio.run(run())
  for trajectory in trajectories:
    guesses = [t - guess.FIRST_NUMBER for t, m in zip(trajectory.tokens, trajectory.loss_mask) if m]
    found = (seed % 994 + 6) in guesses
    assert trajectory.reward == float(found)
    assert trajectory.turns == len(guesses) == (guesses.index(seed % 994 + 6) + 1 if found else 3)
    assert trajectory.loss_mask == [1, 0] * (trajectory.turns - 1) + [1]


class BadObservations:
  """An environment with a bug: its second answer holds an id past the vocabulary."""

  def __init__(self):
    self.turns = 0

  async def reset(self):
    return (3,)

  async def step(self, turn):
    self.turns += 1
    return Step(observation=(4, 5) if self.turns == 1 else (6, 1000, 7))


def test_an_environment_answering_an_id_outside_the_vocabulary_stops_with_one_line(seed, model):
  graphdef, params = nnx.split(model)
  server = InferenceServer(graphdef, settings=DecodeSettings(sampling=T1, max_new_tokens=2), slots=2, max_context=24)
  server.bind(params)
  agent = EnvironmentAgent(make_environment=lambda problem, episode: BadObservations(), max_turns=4, turn_tokens=2)

  async def run():
    async with server:
      return await agent.episodes(server, Problem(prompt=(2,), data=None), 2, jax.random.key(seed % 1000), 16)

  with pytest.raises(UserError) as error:
    asyncio.run(run())
  assert str(error.value) == (f'environment {__name__}.BadObservations: step() returned an observation: token id '
                              '1000 at position 1 is outside the vocabulary [0, 1000) (a bug in the environment)')


# ---- the RL step on the agent task ----

GUESS = os.path.join(ROOT, 'configs', 'tiny_guess.yaml')


@pytest.mark.exhaustive
@pytest.mark.starts_first
def test_agent_steps_on_a_mesh_equal_one_device(tmp_path):
  """Two RL steps of the guess-number task on 8 devices, FSDP with the sampler in tensor groups of
  8 and a (2,2,2) cube (groups of 4), equal one device's: the episodes, rewards, losses and
  parameters. At test_mesh_equivalence's learning rate (1e-3) Adam turns the order of a
  cross-device sum in this model's near-zero gradients into parameter differences of ~1e-5; at 1e-4
  the parameters still move and the comparison holds at its 1e-5."""
  from test_mesh_equivalence import assert_equal_runs, two_steps
  overrides = ['rollout.prompts_per_step=8', 'algo.group_size=4', 'optim.learning_rate=1e-4']
  reference = two_steps(tmp_path, GUESS, overrides, (1, 1, 1))
  assert reference[0][0]['episode/turns'] > 1
  for mesh_shape in [(1, 8, 1), (2, 2, 2)]:
    other = two_steps(tmp_path, GUESS, overrides, mesh_shape)
    assert_equal_runs(reference, other)
    for row, other_row in zip(reference[0], other[0]):
      assert other_row['episode/turns'] == row['episode/turns']


@pytest.mark.exhaustive
@pytest.mark.starts_first
@pytest.mark.parametrize('kind, steps', [('dense', 120), ('moe', 160)])
@pytest.mark.long
def test_the_agent_demo_learns_from_the_replies(tmp_path, kind, steps):
  """configs/tiny_guess.yaml: the reward passes what any policy deaf to the replies can reach (4
  guesses of 16 numbers: 0.25), and episodes get shorter. Dense, 120 steps (measured with the
  config's entropy bonus: 0.17 over the first 10 steps, 0.38 over steps 111-120, 0.44 over 141-150;
  make demo-agent runs its 600). On a mixture of 8 experts (top 2) replaying the server's routes, 160
  steps (measured before the bonus, over steps 111-120 at seeds 0-3: 0.37, 0.38, 0.41, 0.40; over
  151-160 at seeds 0 and 3: 0.44 and 0.45; with it the test passes)."""
  from test_agents_moe import MOE_GUESS
  train_learning(tmp_path, GUESS, *(MOE_GUESS if kind == 'moe' else ()), f'train.steps={steps}',
                 'train.progress=false', 'train.tensorboard=false', 'train.checkpoint_every=0')
  rows = read_metrics(tmp_path)
  first, last = rows[:10], rows[-10:]
  mean = lambda rows, name: sum(row[name] for row in rows) / len(rows)  # noqa: E731
  assert mean(first, 'reward_mean') <= 0.3 and mean(last, 'reward_mean') >= 0.35
  assert mean(last, 'episode/turns') < mean(first, 'episode/turns')


def test_an_episode_that_fails_ends_the_rollout_and_the_server_starts_afresh(seed, model):
  """An environment that raises: the error reaches the caller, no request is left waiting, and
  the same server then serves the next rollout as a fresh one would."""
  graphdef, params = nnx.split(model)
  server = InferenceServer(graphdef, settings=DecodeSettings(sampling=T1, max_new_tokens=6), slots=2, max_context=32)
  server.bind(params)
  prompts = random_prompts(seed, [5, 7, 3])
  keys = [jax.random.key(seed % 1000 + i) for i in range(3)]

  async def broken():
    async with server:
      async def one(index):
        if index == 1:
          await asyncio.sleep(0.01)
          raise RuntimeError('the environment crashed')
        return await server.generate(Request(tokens=tuple(prompts[index]), max_new_tokens=6, key=keys[index]))
      return await asyncio.gather(*(one(i) for i in range(3)))

  with pytest.raises(RuntimeError, match='the environment crashed'):
    asyncio.run(broken())
  again, _ = serve(model, [Request(tokens=tuple(p), max_new_tokens=6, key=k) for p, k in zip(prompts, keys)],
                   slots=2, max_new_tokens=6)

  server.bind(params)  # each rollout binds its parameters

  async def after():
    async with server:
      return await asyncio.gather(*(server.generate(Request(tokens=tuple(p), max_new_tokens=6, key=k))
                                    for p, k in zip(prompts, keys)))

  assert [c.tokens for c in asyncio.run(after())] == [c.tokens for c in again]


@pytest.mark.exhaustive
@pytest.mark.long
def test_episode_evaluation_plays_every_secret(tmp_path):
  """eval during training on the guessing game: every secret once, n episodes each and a greedy
  one; an episode counts as solved exactly when its last guess is the secret (read here from its
  tokens), and pass@k and the facts summarise the samples file."""
  train_here(tmp_path, GUESS, 'train.steps=1', 'train.progress=false', 'train.tensorboard=false',
             'train.checkpoint_every=0', 'eval.every=1', 'eval.samples=3', 'eval.k=2', 'eval.batch_prompts=8',
             'rollout.prompts_per_step=4')
  with open(tmp_path / 'eval.jsonl') as f:
    summaries = [json.loads(line) for line in f]
  with open(tmp_path / 'eval' / 'samples_1.jsonl') as f:
    rows = [json.loads(line) for line in f]
  assert [row['reference'] for row in rows] == [str(secret) for secret in range(16)]
  turns = []
  for row in rows:
    for text, right, answer in zip(row['samples'], row['correct'], row['answers']):
      guesses = [word for word in text.split() if word.isdigit()]
      assert len(guesses) <= 4 and right == (guesses[-1:] == [row['reference']]) and answer == (guesses[-1] if guesses
                                                                                                 else None)
      turns.append((len(text.split()) + 1) // 2)  # guesses and the replies between them
    assert row['greedy_correct'] == (row['greedy'].split()[-1:] == [row['reference']])
  pass1 = np.mean([np.mean(row['correct']) for row in rows])
  pass2 = np.mean([1 - (row['correct'].count(False) * (row['correct'].count(False) - 1)) / 6 for row in rows])
  summary = summaries[-1]
  assert summary['step'] == 1 and summary['eval/problems'] == 16
  np.testing.assert_allclose([summary['eval/pass@1'], summary['eval/pass@2'], summary['eval/episode/turns']],
                             [pass1, pass2, np.mean(turns)], rtol=1e-6)
  # python -m grpo_jax.eval on the saved checkpoint: the same episodes, so the same summary.
  from grpo_jax import eval as eval_cli
  again = eval_cli.main(['--config', GUESS, '--ckpt', str(tmp_path), '--samples', '3', '--k', '2',
                         '--out', str(tmp_path / 'again.jsonl')])
  assert {name: value for name, value in again.items()} == {name: value for name, value in summary.items()
                                                            if name.startswith('eval/')}
