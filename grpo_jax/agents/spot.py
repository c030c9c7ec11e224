"""An environment that shows the policy images: each turn, a picture and the question which of its
quadrants holds the mark (`task.environment: spot`, configs/tiny_spot_agent.yaml).

The episode starts from `<bos>`; the environment's reset shows the first image, `<|vision_start|>`,
its image tokens, `<|vision_end|>?` (an Observation, agents/images.py), and the policy answers
with one token, a quadrant's digit (1 top left, 2 top right, 3 bottom left, 4 bottom right). Each
answer earns 1 / task.max_turns when right, and every turn but the last is answered with the next
image, so an episode's images arrive in later turns, each prefilled over the cache the server
kept of the turns before. The images are the spot task's (data/spot.py): noise around 0.3 with a
bright square in one quadrant. Only the images tell the quadrant: a policy that cannot see scores
1/4 at best, and `task.blank_images` (every image the same grey square) is the control run that
must stay there.
"""

import numpy as np

from grpo_jax.agents.agent import EnvironmentAgent, Problem, Step
from grpo_jax.agents.deadline import OnLoop
from grpo_jax.agents.images import Observation
from grpo_jax.agents.inference import Completion
from grpo_jax.agents.task import AgentTask
from grpo_jax.data.spot import BOS, EOS, IMAGE, PAD, QUADRANTS, SYMBOLS, VISION_END, VISION_START, build_tokenizer
from grpo_jax.errors import require

NOISE = 0.3  # std of the background's per-pixel noise (the mark is 1.0 brighter)


def check(task_config) -> None:
  require(task_config.max_images >= task_config.max_turns, 'max_images',
          f'({task_config.max_images}) must make room for an image each turn (task.max_turns: {task_config.max_turns})')


def image(rng: np.random.Generator, quadrant: int, side: int, blank: bool) -> np.ndarray:
  """uint8 [side, side, 3]: noise with a bright square inside `quadrant` (grey when `blank`)."""
  if blank:
    return np.full((side, side, 3), 128, np.uint8)
  half = side // 2
  size = max(1, half // 2)
  pixels = 0.3 + NOISE * rng.standard_normal((side, side, 3))
  row, column = rng.integers(0, half - size + 1, size=2) + np.array([quadrant // 2, quadrant % 2]) * half
  pixels[row:row + size, column:column + size] += 1.0
  return np.round(np.clip(pixels, 0.0, 1.0) * 255).astype(np.uint8)


class Spot:
  """One episode: `turns` images, each with its quadrant drawn from `rng`."""

  def __init__(self, rng: np.random.Generator, turns: int, side: int, blank: bool):
    self.rng, self.turns, self.side, self.blank = rng, turns, side, blank
    self.quadrants: list[int] = []
    self.block = tuple(SYMBOLS.index(s) for s in [VISION_START] + [IMAGE] * QUADRANTS + [VISION_END, '?'])

  def show(self) -> Observation:
    quadrant = int(self.rng.integers(QUADRANTS))
    self.quadrants.append(quadrant)
    return Observation(self.block, images=(image(self.rng, quadrant, self.side, self.blank),))

  async def reset(self) -> Observation:
    return self.show()

  async def step(self, turn: Completion) -> Step:
    answer = turn.tokens[0] - SYMBOLS.index('1') if turn.tokens else -1
    right = answer == self.quadrants[-1]
    done = len(self.quadrants) == self.turns
    return Step(observation=() if done else self.show(), reward=float(right) / self.turns, done=done,
                answer=str(answer + 1))


def build(config) -> AgentTask:
  """The game of a run's Config: task.max_turns images an episode, drawn from (run.seed, the
  problem's position, the episode), so a resumed run replays them. The model must be a
  vision-language one whose vision token ids are the spot vocabulary's (3, 4, 5), whose images are
  2 x 2 merged blocks (one image token a quadrant)."""
  architecture, task, seed = config.model.architecture, config.task, config.run.seed
  vision = architecture.vision
  require(vision is not None, 'model.architecture.vision', "must describe a vision tower: environment 'spot' shows "
          'images')
  for name, symbol in (('vision_start_token_id', VISION_START), ('image_token_id', IMAGE),
                       ('vision_end_token_id', VISION_END)):
    require(getattr(vision, name) == SYMBOLS.index(symbol), f'model.architecture.vision.{name}',
            f"must be {SYMBOLS.index(symbol)}, environment 'spot''s {symbol} (got {getattr(vision, name)})")
  side = 2 * vision.spatial_merge_size * vision.patch_size
  require(task.max_pixels == side * side and task.min_pixels == side * side, 'max_pixels',
          f"and task.min_pixels must be {side * side}: environment 'spot' shows {side} x {side} images, one image "
          'token a quadrant')
  turns = task.max_turns
  require(config.rollout.max_new_tokens >= turns * 8, 'rollout.max_new_tokens',
          f'({config.rollout.max_new_tokens}) cannot hold {turns} images with their questions and answers '
          f'({turns * 8} tokens)')

  def problems(position: int, count: int) -> list[Problem]:
    return [Problem(prompt=(SYMBOLS.index(BOS),), data=(seed, position + index)) for index in range(count)]

  def environment(problem: Problem, episode: int) -> Spot:
    return Spot(np.random.default_rng((*problem.data, episode)), turns, side, task.blank_images)

  # One token per turn: the digit; its steps never block: they run on the episodes' loop.
  agent = EnvironmentAgent(make_environment=environment, turn_tokens=1, calls=OnLoop())
  return AgentTask(agent, problems, prompt_length=1, vocab_size=len(SYMBOLS), stop_token_ids=(SYMBOLS.index(EOS),),
                   pad_id=SYMBOLS.index(PAD), tokenizer=build_tokenizer())
