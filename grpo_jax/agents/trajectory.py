"""Trajectories: what an agent returns for each episode, and how a step's trajectories become the
arrays the update trains on.

An episode starts from its problem's prompt; after it, its tokens are the policy's turns and the
environment's observations in order. The loss mask is 1 on the policy's tokens only (observation,
tool-result and prompt tokens never enter the loss, the KL or the entropy), and the sampler's
log-probs are kept for the policy's tokens. `Episode` builds one, turn by turn, within a token
budget N (the rollout's max_new_tokens): whatever would run past it is cut and the episode marked
truncated.
"""

import dataclasses

import jax
import numpy as np

from grpo_jax.agents.images import ImageReader, Placed, image_spans, marked
from grpo_jax.agents.inference import Completion, InferenceServer, Request, folded_keys
from grpo_jax.data.task import Scores
from grpo_jax.model.moe import unrecorded_id
from grpo_jax.model.vision import Vision, vision_of
from grpo_jax.sampler.rollout import Rollout

# Per-episode facts, logged as episode/<fact> (their means over a step's episodes)
FACTS = ('turns', 'tool_calls', 'tool_errors', 'truncated', 'failures', 'timeouts')


@dataclasses.dataclass
class Trajectory:
  """One episode after its prompt.

  tokens:     the policy's turns and the environment's observations, in order.
  loss_mask:  1 on the policy's tokens, 0 on the environment's.
  log_probs:  the sampler's log-prob of each policy token; 0 on the environment's.
  reward:     the episode's reward.
  turns, tool_calls, tool_errors: counts; truncated: the budget cut the episode short.
  answer:     the answer it gave (normalised text, for evaluation's vote), if any.
  failures:   1 when its environment failed (a call raised or ran past its deadline), else 0;
  timeouts:   1 when that call ran past its deadline.
  routes:     with routing replay (a mixture of experts): [len(prompt) + len(tokens), Ls, k] the
              experts the server routed each token of the prompt and the trajectory to, when it
              ran the token through the model (a turn's prefill or its decode step);
              `unrecorded` for a token it never ran (the episode's last one). None otherwise.
  images:     the images of the prompt and the trajectory, in order (agents/images.Placed: a
              vision-language policy shown images), each at its context position.
  turns_at:   (start, end) of each policy turn in `tokens`.
  contexts:   with task.turn_context: as_rendered, each turn's context after the prompt as the
              chat template renders the conversation (the first turn's: nothing); else empty.
  """

  tokens: list = dataclasses.field(default_factory=list)
  loss_mask: list = dataclasses.field(default_factory=list)
  log_probs: list = dataclasses.field(default_factory=list)
  reward: float = 0.0
  turns: int = 0
  tool_calls: int = 0
  tool_errors: int = 0
  truncated: bool = False
  answer: str | None = None
  failures: int = 0
  timeouts: int = 0
  routes: np.ndarray | None = None
  images: list = dataclasses.field(default_factory=list)
  turns_at: list = dataclasses.field(default_factory=list)
  contexts: list = dataclasses.field(default_factory=list)

  def fail(self, timed_out: bool) -> None:
    """Ends the episode as its environment failed: no token of it trains (the loss mask all 0;
    its tokens stay as context), its reward is 0 and it gives no answer. Its group's other episodes
    train as usual: the 0 is one more sample of the group's rewards."""
    self.loss_mask = [0] * len(self.tokens)
    self.log_probs = [0.0] * len(self.tokens)
    self.reward, self.answer = 0.0, None
    self.failures, self.timeouts = 1, int(timed_out)


class Episode:
  """One episode in progress: its prompt, its trajectory so far, its budget and its key.

  `await episode.act(max_new_tokens, stop_token_ids)` asks the policy for its next turn (the
  context is the prompt and everything so far, its images with it) and appends it (loss mask 1);
  `observe(tokens, images)` appends the environment's answer (loss mask 0). Turn n's request key is
  fold_in(key, n), so an episode's samples depend on its key and what it saw only. Each turn
  continues the last one's cache on the server (prefilling only the last token and the
  observation) while it is kept.
  """

  def __init__(self, llm: InferenceServer, prompt, budget: int, key: jax.Array, images: tuple = (),
               reader: ImageReader | None = None):
    self.llm, self.prompt, self.budget, self.key = llm, tuple(int(t) for t in prompt), budget, key
    self.reader = reader  # how images stand in the tokens, where the episode may hold some
    self.trajectory = Trajectory(images=self._placed(self.prompt, images, 0))
    self._turn_keys = np.zeros((0, 2), np.uint32)
    self._cache_id = None  # the last turn's kept cache on the server, which the next turn continues

  def turn_key(self, turn: int) -> np.ndarray:
    """fold_in(key, turn) as raw key data (folded TURN_BLOCK turns per device call)."""
    while turn >= len(self._turn_keys):
      self._turn_keys = np.concatenate([self._turn_keys, folded_keys(self.key, len(self._turn_keys))])
    return self._turn_keys[turn]

  @property
  def room(self) -> int:
    """Tokens left in the budget."""
    return self.budget - len(self.trajectory.tokens)

  async def act(self, max_new_tokens: int, stop_token_ids: tuple[int, ...] = ()) -> Completion | None:
    """The policy's next turn, or None when the budget has no room for one (the episode is
    marked truncated)."""
    trajectory = self.trajectory
    budget = min(max_new_tokens, self.room)
    if budget < 1:
      trajectory.truncated = True
      return None
    completion = await self.llm.generate(Request(tokens=self.prompt + tuple(trajectory.tokens), max_new_tokens=budget,
                                                 key=self.turn_key(trajectory.turns),
                                                 stop_token_ids=stop_token_ids, continues=self._cache_id,
                                                 images=tuple(trajectory.images)))
    self._cache_id = completion.cache_id
    if completion.routes is not None:
      self._record(completion)
    trajectory.turns_at.append((len(trajectory.tokens), len(trajectory.tokens) + len(completion.tokens)))
    trajectory.tokens += completion.tokens
    trajectory.loss_mask += [1] * len(completion.tokens)
    trajectory.log_probs += completion.log_probs
    trajectory.turns += 1
    if completion.finish_reason == 'length' and budget < max_new_tokens:
      trajectory.truncated = True  # cut by the episode's budget, not the turn's
    return completion

  def _record(self, completion: Completion) -> None:
    """The completion's routes into the trajectory's, at the context positions they belong to
    (positions the server never ran stay `unrecorded`)."""
    routes, trajectory = completion.routes, self.trajectory
    length = len(self.prompt) + len(trajectory.tokens) + len(completion.tokens)
    grown = np.full((length,) + routes.shape[1:], unrecorded_id(routes.dtype), routes.dtype)
    if trajectory.routes is not None:
      grown[:len(trajectory.routes)] = trajectory.routes
    grown[completion.routes_from:completion.routes_from + len(routes)] = routes
    trajectory.routes = grown

  def observe(self, tokens, images: tuple = ()) -> None:
    """Appends the environment's tokens and the images they hold, as many as the budget holds: an
    image whose tokens the budget cuts is left out, with its tokens and all after them."""
    tokens = [int(t) for t in tokens]
    if len(tokens) > self.room:
      cut = self.room
      if images:
        spans = image_spans(tokens, images, self.reader)
        kept = sum(end <= cut for _, end in spans)
        cut = min([cut] + [first for first, _ in spans[kept:]])
        images = images[:kept]
      tokens = tokens[:cut]
      self.trajectory.truncated = True
    self.trajectory.images += self._placed(tokens, images, len(self.prompt) + len(self.trajectory.tokens))
    self.trajectory.tokens += tokens
    self.trajectory.loss_mask += [0] * len(tokens)
    self.trajectory.log_probs += [0.0] * len(tokens)


  def _placed(self, tokens, images, offset: int) -> list[Placed]:
    """`images` (patches, grid), whose image tokens `tokens` hold in order, at their context
    positions (`tokens` start at context position `offset`)."""
    if not images:
      return []
    return [Placed(patches, grid, offset + first)
            for (patches, grid), (first, _) in zip(images, image_spans(tokens, images, self.reader))]


def collate(trajectories: list[Trajectory], budget: int, pad_id: int, prompt_lengths: list[int] | None = None,
            prompt_width: int = 0, routes_like: np.ndarray | None = None, prompts=None,
            images: ImageReader | None = None, turn_rows: int = 0) -> tuple[Rollout, Scores, dict]:
  """A step's P * G trajectories (row p * G + g: episode g of problem p) -> the Rollout the update
  trains on ([P*G, N], N = budget: tokens right-padded with `pad_id`, mask = the loss mask,
  context = every token of the episode, lengths = the policy's tokens, stopped = not truncated),
  the Scores (the episodes' rewards) and the facts {name: [P*G]} (FACTS), all NumPy.

  Trajectories with routes (routing replay) give the Rollout's routes [P*G, Tp + N, Ls, k]: each
  row's prompt's (prompt_lengths[row] tokens) at the end of the Tp = prompt_width columns, as the
  prompts are left-padded, then its trajectory's; `unrecorded` elsewhere. routes_like [Ls, k]: the
  routes' shape and dtype where the update replays them, so a step none of whose episodes recorded
  any (every environment failed first) still has routes, all `unrecorded`.

  With `images` (the run's ImageReader: its episodes may hold images), the Rollout's vision over
  [P*G, Tp + N]: each row's images (Trajectory.images) laid out to the run's bucket and the M-RoPE
  positions of its prompt and trajectory, which `prompts` (tokens, mask) [P*G, Tp] give; every
  step has it, images or not, so the update compiles one shape.

  With `turn_rows` K (task.turn_context: as_rendered), a row per turn instead: K * P * G rows,
  turn-major (row k * P*G + e: episode e's turn k, or nothing where it had fewer), each the turn's
  context after the prompt as the chat template renders it (Trajectory.contexts, outside the loss)
  and then the turn's tokens; the rewards, the facts and `stopped` stay the episode's, each row
  with its episode's reward. A turn whose rendered context and tokens do not fit the N columns (the
  template, or its text tokenized again, lengthened the history) trains nothing: the share of each
  episode's turns cut so is the fact `unrendered` (episode/unrendered)."""
  if turn_rows:
    return _turn_rows(trajectories, budget, pad_id, turn_rows)
  rows = len(trajectories)
  tokens = np.full((rows, budget), pad_id, np.int32)
  log_probs = np.zeros((rows, budget), np.float32)
  mask = np.zeros((rows, budget), bool)
  context = np.zeros((rows, budget), bool)
  for row, trajectory in enumerate(trajectories):
    count = len(trajectory.tokens)
    if count > budget or len(trajectory.loss_mask) != count or len(trajectory.log_probs) != count:
      raise ValueError(f'trajectory {row}: {count} tokens, {len(trajectory.loss_mask)} mask entries and '
                       f'{len(trajectory.log_probs)} log-probs; the budget is {budget}')
    tokens[row, :count] = trajectory.tokens
    log_probs[row, :count] = trajectory.log_probs
    mask[row, :count] = np.asarray(trajectory.loss_mask, bool)
    context[row, :count] = True
  rollout = Rollout(tokens=tokens, log_probs=np.where(mask, log_probs, 0.0).astype(np.float32), mask=mask,
                    lengths=mask.sum(axis=1).astype(np.int32),
                    stopped=np.asarray([not t.truncated for t in trajectories]), context=context,
                    routes=_collated_routes(trajectories, budget, prompt_lengths, prompt_width, routes_like),
                    vision=None if images is None else _collated_vision(trajectories, tokens, context, prompts, images))
  scores = Scores(rewards=np.asarray([t.reward for t in trajectories], np.float32), failures=np.int32(0))
  facts = {name: np.asarray([float(getattr(t, name)) for t in trajectories], np.float32) for name in FACTS}
  return rollout, scores, facts


def _collated_routes(trajectories: list[Trajectory], budget: int, prompt_lengths, prompt_width: int, routes_like):
  """collate's routes [P*G, Tp + N, Ls, k], or None when no trajectory has any and none is asked for."""
  recorded = [t.routes[0] for t in trajectories if t.routes is not None and len(t.routes)]
  like = recorded[0] if recorded else routes_like
  if like is None:
    return None
  if recorded and prompt_lengths is None:
    raise ValueError('collate: trajectories with routes need their prompt lengths')
  dtype, shape = like.dtype, like.shape
  routes = np.full((len(trajectories), prompt_width + budget) + shape, unrecorded_id(dtype), dtype)
  for row, (trajectory, prompt) in enumerate(zip(trajectories, prompt_lengths)):
    if trajectory.routes is None:
      continue
    count = min(len(trajectory.routes), prompt + len(trajectory.tokens))
    start = prompt_width - prompt  # the prompt's first column (left padding)
    routes[row, start:start + count] = trajectory.routes[:count]
  return routes


def _collated_vision(trajectories: list[Trajectory], tokens: np.ndarray, context: np.ndarray, prompts,
                     images: ImageReader) -> Vision:
  """The rows' Vision over [P*G, Tp + N] (collate), made on the host's CPU."""
  if prompts is None:
    raise ValueError('collate: trajectories with images need their prompts (tokens, mask)')
  prompt_tokens, prompt_mask = (np.asarray(x) for x in prompts)
  real = np.concatenate([prompt_mask != 0, context], axis=1).astype(np.int32)
  width = prompt_tokens.shape[1]
  rows = np.stack([marked(row, t.images, images.architecture.vision.image_token_id, images.count,
                          shift=width - int(np.sum(prompt_mask[index] != 0)))
                   for index, (row, t) in enumerate(zip(np.concatenate([prompt_tokens, tokens], axis=1),
                                                        trajectories))])
  count, patches = images.bucket
  with jax.default_device(jax.local_devices(backend='cpu')[0]):
    return vision_of([[(image.patches, image.grid) for image in t.images] for t in trajectories], rows, real,
                     images.architecture, max_patches=patches, max_images=count)


def _turn_rows(trajectories: list[Trajectory], budget: int, pad_id: int, turns: int) -> tuple[Rollout, Scores, dict]:
  """collate's rows per turn (task.turn_context: as_rendered)."""
  episodes = len(trajectories)
  rows, unrendered = [], np.zeros(episodes, np.float32)
  for k in range(turns):
    for e, trajectory in enumerate(trajectories):
      if k >= len(trajectory.turns_at):
        rows.append(Trajectory())
        continue
      (start, end), context = trajectory.turns_at[k], list(trajectory.contexts[k])
      if len(context) + end - start > budget:  # rendered longer than sampled (text re-tokenized, a longer template)
        unrendered[e] += 1
        rows.append(Trajectory())
        continue
      rows.append(Trajectory(tokens=context + trajectory.tokens[start:end],
                             loss_mask=[0] * len(context) + trajectory.loss_mask[start:end],
                             log_probs=[0.0] * len(context) + trajectory.log_probs[start:end]))
  rollout, _, _ = collate(rows, budget, pad_id)
  _, scores, facts = collate([dataclasses.replace(t, tokens=[], loss_mask=[], log_probs=[]) for t in trajectories],
                             budget, pad_id)
  facts['unrendered'] = unrendered / np.maximum([len(t.turns_at) for t in trajectories], 1)
  stopped = np.tile([not t.truncated for t in trajectories], turns)
  rollout = dataclasses.replace(rollout, stopped=stopped)
  scores = dataclasses.replace(scores, rewards=np.tile(scores.rewards, turns))
  return rollout, scores, facts
