"""Environments that misbehave (grpo_jax/agents/deadline.py): a call that raises or runs past
task.env_timeout_s ends its episode only (its turns masked, scored 0, counted), the other episodes
play as if nothing happened, a call blocking its thread is abandoned and stuck threads are bounded,
and an environment failing on most episodes stops the run with one line. The environments are this
module's `make` (task.environment: test_environment_failures:make): the guessing game, but episode
g of each group misbehaves on its first step when g is in `raising` or `sleeping`."""

import asyncio
import os
import time

import jax
import numpy as np
import pytest
from flax import nnx

from grpo_jax import config as config_lib
from grpo_jax.agents import deadline, guess
from grpo_jax.agents.agent import EnvironmentAgent, Problem
from grpo_jax.agents.deadline import EnvironmentFailed, InThreads, OnLoop
from grpo_jax.agents.agent import Step
from grpo_jax.agents.inference import Completion, InferenceServer
from grpo_jax.errors import UserError
from grpo_jax.model.config import Qwen2Config
from grpo_jax.model.loading import init_model
from grpo_jax.sampler import DecodeSettings, SamplingConfig
from runs import ROOT, train_here

GUESS = os.path.join(ROOT, 'configs', 'tiny_guess.yaml')
# The shapes of test_records.py's agent run (P=4, G=8, N=8), so its compiled programs are reused.
RUN = ('rollout.prompts_per_step=4', 'train.progress=false', 'train.tensorboard=false', 'train.checkpoint_every=0')


class Misbehaving(guess.GuessNumber):
  """The guessing game, whose step `at` raises, or sleeps `sleep_s` (awaiting, or blocking its
  thread), as `how` says."""

  def __init__(self, n: int, secret: int, how: str = '', sleep_s: float = 0.0, at: int = 1):
    super().__init__(n, secret)
    self.how, self.sleep_s, self.at, self.steps = how, sleep_s, at, 0

  async def step(self, turn):
    self.steps += 1
    if self.steps == self.at and self.how == 'raise':
      raise RuntimeError('the service behind this environment is down')
    if self.steps == self.at and self.how == 'sleep':
      await asyncio.sleep(self.sleep_s)
    if self.steps == self.at and self.how == 'block':
      time.sleep(self.sleep_s)
    return await super().step(turn)


def make(config, raising: tuple = (), sleeping: tuple = (), sleep_s: float = 30.0):
  """The guessing game as an environment of one's own (in worker threads, InThreads): episode g
  raises when g is in `raising`, sleeps `sleep_s` when in `sleeping` (every g: 'all')."""
  task = guess.build(config)

  def how(episode: int) -> str:
    chosen = lambda episodes: episodes == 'all' or episode in episodes  # noqa: E731
    return 'raise' if chosen(raising) else 'sleep' if chosen(sleeping) else ''

  agent = EnvironmentAgent(lambda problem, episode: Misbehaving(config.task.guess_range, problem.data, how(episode),
                                                                sleep_s), turn_tokens=1)
  task.agent = agent
  return task


def test_a_failed_episode_trains_nothing_and_the_others_play_as_if_nothing_happened(seed):
  """Episode 0 raises on its second step and episode 1 sleeps past its deadline there: their
  tokens up to then are the clean run's, masked, scored 0 and counted. Episode 2's environment
  cannot be made (its constructor raises) and episode 3's constructor blocks past the deadline:
  they play nothing and are counted. The other episodes equal the clean run's (a slot per episode:
  the runs replay exactly; test_agents.py's shapes)."""
  graphdef, params = nnx.split(init_model(Qwen2Config(vocab_size=1000), seed=seed % 1000))
  server = InferenceServer(graphdef, settings=DecodeSettings(sampling=SamplingConfig(temperature=1.0),
                                                             max_new_tokens=1), slots=4, max_context=16)
  secret = 999  # out of the random policy's likely first guesses: episodes reach their second step

  def episodes(make_environment, calls):
    agent = EnvironmentAgent(make_environment, max_turns=3, turn_tokens=1, calls=calls, timeout_s=1.0)
    server.bind(params)

    async def run():
      async with server:
        return await agent.episodes(server, Problem(prompt=(2,), data=secret), 4, jax.random.key(seed % 1000), 5)
    return asyncio.run(run())

  def making(how):
    def make_environment(problem, episode):
      if how.get(episode) == 'make':
        raise ConnectionError('the service this environment opens is down')
      if how.get(episode) == 'make-block':
        time.sleep(3.0)  # past the deadline and its grace: abandoned, its thread left to finish
      return Misbehaving(1000, secret, how.get(episode, ''), 30.0, at=2)
    return make_environment

  clean = episodes(lambda problem, episode: guess.GuessNumber(1000, secret), OnLoop())
  # A constructor that blocks would stall every episode on the loop (OnLoop is for the built-ins).
  for calls, how in ((InThreads(), {0: 'raise', 1: 'sleep', 2: 'make', 3: 'make-block'}),
                     (OnLoop(), {0: 'raise', 1: 'sleep', 2: 'make'})):
    failed = episodes(making(how), calls)
    for index, (ours, theirs) in enumerate(zip(failed, clean)):
      if how.get(index, '').startswith('make'):  # nothing played: no token, counted
        assert (ours.tokens, ours.reward, ours.answer) == ([], 0.0, None)
        assert (ours.failures, ours.timeouts) == (1, int(how[index] == 'make-block'))
        continue
      if index not in how or theirs.turns < 2:
        assert (ours.tokens, ours.loss_mask, ours.reward, ours.failures) == (theirs.tokens, theirs.loss_mask,
                                                                             theirs.reward, 0)
        continue
      assert ours.tokens == theirs.tokens[:3]  # a guess, the reply, the guess its step failed on
      assert ours.loss_mask == [0, 0, 0] and ours.log_probs == [0.0] * 3 and ours.reward == 0.0
      assert (ours.failures, ours.timeouts, ours.answer) == (1, int(how[index] == 'sleep'), None)


def test_a_call_past_its_deadline_is_late_though_the_loop_was_held_up_past_its_end():
  """A step that blocks its thread for 1 s against a 0.2 s deadline, while the episodes' loop is
  itself held up for 1.5 s (as a compile in the inference server holds it): when the loop looks
  again the call has ended, and it is still late, timed in its own thread. A quick call on a loop
  held up alike is on time."""
  calls = InThreads()
  guess_lower = Completion(tokens=(guess.FIRST_NUMBER + 5,), log_probs=(0.0,), finish_reason='length')

  async def step(how: str):
    async with calls.open(Misbehaving(16, 3, how, 1.0), 0.2) as call:
      pending = asyncio.ensure_future(call('step', guess_lower))
      await asyncio.sleep(0.05)  # the call starts in its thread
      time.sleep(1.5)  # the loop held up past the call's end
      try:
        return await pending
      except EnvironmentFailed as failed:
        return failed.timed_out

  assert asyncio.run(step('block')) is True
  assert asyncio.run(step('')) == Step(observation=(guess.WORDS.index('lower'),), answer='5')


def test_a_blocking_call_is_abandoned_and_stuck_threads_are_bounded(capfd):
  """A step that blocks its thread past the deadline is abandoned (its episode fails), one that
  awaits is cancelled and frees its thread; past MAX_ABANDONED blocked threads the run stops with
  one line. The first failure of each kind is printed once."""
  calls = InThreads()

  lower = Step(observation=(guess.WORDS.index('lower'),), answer='5')

  async def step(how: str, sleep_s: float = 2.0):
    async with calls.open(Misbehaving(16, 3, how, sleep_s), 0.1) as call:
      return await call('step', Completion(tokens=(guess.FIRST_NUMBER + 5,), log_probs=(0.0,), finish_reason='length'))

  async def outcomes(*hows):
    results = await asyncio.gather(*(step(how) for how in hows), return_exceptions=True)
    for result in results:
      if isinstance(result, UserError):
        raise result
    return [result.timed_out if isinstance(result, EnvironmentFailed) else result for result in results]

  assert asyncio.run(outcomes('', 'sleep', 'raise', 'raise')) == [lower, True, False, False]
  assert calls.abandoned == 0  # the sleeping call was cancelled within the grace
  assert asyncio.run(outcomes(*['block'] * deadline.MAX_ABANDONED)) == [True] * deadline.MAX_ABANDONED
  assert calls.abandoned == deadline.MAX_ABANDONED  # their threads still sleep; the episodes went on
  with pytest.raises(UserError) as error:
    asyncio.run(outcomes('block'))
  assert str(error.value) == (f'environment {__name__}.Misbehaving: {deadline.MAX_ABANDONED + 1} calls ran past '
                              'task.env_timeout_s (0.1 s) and still block their threads (blocking code in async def '
                              'reset/step or in making the environment, which no deadline interrupts); the run stops '
                              'rather than leave more threads stuck')
  ends = time.monotonic() + 5.0
  while calls.abandoned and time.monotonic() < ends:  # the sleeps end: their threads are free again
    time.sleep(0.05)
  assert calls.abandoned == 0
  assert asyncio.run(outcomes('')) == [lower]
  printed = capfd.readouterr().err
  assert printed.count('Traceback') == 1 and printed.count('ran past task.env_timeout_s (0.1 s); its episode') == 1


def test_a_run_goes_on_past_failing_episodes_and_stops_when_most_fail(tmp_path, capfd):
  """Episode 0 of each group raises and episode 1 sleeps past task.env_timeout_s: two RL steps
  train, counting a quarter of the episodes failed and an eighth timed out; an environment that
  always raises stops the run at its first step with one line."""
  environment = f'task.environment={__name__}:make'
  history = train_here(tmp_path / 'flaky', GUESS, *RUN, 'train.steps=2', environment, 'task.env_timeout_s=1',
                       'task.environment_args.raising=[0]', 'task.environment_args.sleeping=[1]',
                       'task.max_env_failure_frac=0.25')
  assert [(row['episode/failures'], row['episode/timeouts']) for row in history] == [(0.25, 0.125)] * 2
  assert all(np.isfinite(row['loss']) and row['episode/turns'] >= 1 for row in history)
  printed = capfd.readouterr().err
  assert printed.count('Traceback') == 1 and 'the service behind this environment is down' in printed
  with pytest.raises(UserError) as error:
    train_here(tmp_path / 'broken', GUESS, *RUN, 'train.steps=2', environment, 'task.environment_args.raising=all')
  assert str(error.value) == (f'environment {__name__}:make: 32 of the step\'s 32 episodes failed (a call raised or '
                              'ran past task.env_timeout_s; the first of each is printed above), more than '
                              'task.max_env_failure_frac (0.25) allows')


@pytest.mark.parametrize('field, value, message', [
    ('env_timeout_s', '0', 'task.env_timeout_s must be > 0, got 0.0'),
    ('max_env_failure_frac', '1.5', 'task.max_env_failure_frac must be in [0, 1], got 1.5'),
])
def test_bad_failure_settings_are_one_line_errors(field, value, message):
  with pytest.raises(UserError) as error:
    config_lib.load_config(GUESS, [f'task.{field}={value}'])
  assert str(error.value) == message
