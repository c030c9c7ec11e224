"""A multi-turn game the policy can only win by reading the environment's replies: find a secret
number in [0, n) within `max_turns` guesses, each answered `higher` or `lower`.

Guessing blind, the best a policy can do is max_turns / n (4 / 16 = 25%): each guess finds the
secret with the same chance whatever it heard. Halving the interval left by the replies finds it
whenever it lies in a binary search tree of depth max_turns (15 of 16 numbers with 4 guesses:
93.75%). Each turn is one token: a number token is a guess, any other token an invalid move that
uses up the turn (answered `invalid`). The reward is 1 when the secret is found, else 0. The
vocabulary is its own (a word-level tokenizer built here), for the tiny CPU demo
(configs/tiny_guess.yaml, `make demo-agent`).
"""

import numpy as np
from tokenizers import Tokenizer, models, pre_tokenizers

from grpo_jax.agents.agent import EnvironmentAgent, Problem, Step
from grpo_jax.agents.deadline import OnLoop
from grpo_jax.agents.inference import Completion
from grpo_jax.agents.task import AgentTask
from grpo_jax.errors import require

PAD, EOS, BOS, HIGHER, LOWER, INVALID = '<pad>', '<|endoftext|>', '<bos>', 'higher', 'lower', 'invalid'
WORDS = (PAD, EOS, BOS, HIGHER, LOWER, INVALID)
FIRST_NUMBER = len(WORDS)  # number k is token FIRST_NUMBER + k


def check(task_config) -> None:
  require(2 <= task_config.guess_range <= 1024, 'guess_range', f'must be in [2, 1024], got {task_config.guess_range}')


def vocabulary(n: int) -> tuple[str, ...]:
  return WORDS + tuple(str(k) for k in range(n))


def build_tokenizer(n: int) -> Tokenizer:
  """One token per word: the game's words, then the numbers 0 .. n - 1."""
  tokenizer = Tokenizer(models.WordLevel({word: i for i, word in enumerate(vocabulary(n))}, unk_token=PAD))
  tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  return tokenizer


class GuessNumber:
  """One episode's environment: the secret is the problem's `data`."""

  def __init__(self, n: int, secret: int):
    self.n, self.secret = n, secret

  async def reset(self) -> tuple[int, ...]:
    return ()

  async def step(self, turn: Completion) -> Step:
    guess = turn.tokens[0] - FIRST_NUMBER if turn.tokens else -1
    if not 0 <= guess < self.n:
      return Step(observation=(WORDS.index(INVALID),))
    if guess == self.secret:
      return Step(reward=1.0, done=True, answer=str(guess))
    return Step(observation=(WORDS.index(HIGHER if self.secret > guess else LOWER),), answer=str(guess))


def build(config) -> AgentTask:
  """The game of a run's Config: task.guess_range numbers, task.max_turns guesses; the secrets
  are drawn from (run.seed, the problem's position in the run), so a resumed run replays them."""
  n, turns, seed = config.task.guess_range, config.task.max_turns, config.run.seed
  require(config.rollout.max_new_tokens >= 2 * turns - 1, 'rollout.max_new_tokens',
          f'({config.rollout.max_new_tokens}) cannot hold {turns} guesses and the replies between them '
          f'({2 * turns - 1} tokens)')

  def problems(position: int, count: int) -> list[Problem]:
    return [Problem(prompt=(WORDS.index(BOS),),
                    data=int(np.random.default_rng((seed, position + index)).integers(n)))
            for index in range(count)]

  # One token per turn is the game's own bound; task.max_turns bounds the guesses (agents/task.py).
  # Its steps never block: they run on the episodes' loop (agents/deadline.py).
  agent = EnvironmentAgent(make_environment=lambda problem, episode: GuessNumber(n, problem.data), turn_tokens=1,
                           calls=OnLoop())

  def every_secret() -> list[Problem]:  # evaluation plays each secret once
    return [Problem(prompt=(WORDS.index(BOS),), data=secret) for secret in range(n)]

  return AgentTask(agent, problems, prompt_length=1, vocab_size=len(vocabulary(n)),
                   stop_token_ids=(WORDS.index(EOS),), pad_id=WORDS.index(PAD), tokenizer=build_tokenizer(n),
                   eval_problems=every_secret)
