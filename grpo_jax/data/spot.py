"""A built-in vision task: which quadrant of the image holds the mark. Prompts and rewards in JAX.

Each prompt is one image and a question: `<bos><|vision_start|><|image_pad|> x 4<|vision_end|>?`.
The image is noise with a bright square in one of its four quadrants, drawn uniformly; the answer
is that quadrant's digit (1 top left, 2 top right, 3 bottom left, 4 bottom right) followed by
`<|endoftext|>`, and the reward is 1 exactly when the completion starts with both. Only the image
tells the quadrant, so a policy that cannot see scores 1/4 at best: with `task.blank_images` every
image is the same grey square, the control run that must stay at chance.

The image is 2 x 2 merged blocks of the model's vision tower (2 * spatial_merge_size *
patch_size pixels a side), so each image token stands for one quadrant. Images, patches (in the
image processor's order, model/images.py) and the prompt's M-RoPE positions are made in JAX, so
whole RL steps run inside one jit. The tokenizer is built here, as the arithmetic task's is.
"""

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from grpo_jax.model.images import CLIP_MEAN, CLIP_STD
from grpo_jax.data.task import Prompts, Scores, Stateless, TaskSection
from grpo_jax.errors import require
from grpo_jax.model.config import VisionConfig
from grpo_jax.model.vision import ImageBucket, Images, Vision, mrope_positions, patch_layout
from grpo_jax.sampler.rollout import Rollout
from grpo_jax.sections import section

PAD, EOS, BOS = '<pad>', '<|endoftext|>', '<bos>'
VISION_START, IMAGE, VISION_END = '<|vision_start|>', '<|image_pad|>', '<|vision_end|>'
SYMBOLS = (PAD, EOS, BOS, VISION_START, IMAGE, VISION_END, '?', '1', '2', '3', '4')
QUADRANTS = 4


def build_tokenizer() -> Tokenizer:
  """One token per symbol: ids <pad> 0, <|endoftext|> 1, <bos> 2, the vision tokens 3-5, ? 6, 1-4 7-10."""
  tokenizer = Tokenizer(models.WordLevel({s: i for i, s in enumerate(SYMBOLS)}, unk_token=PAD))
  tokenizer.add_special_tokens([VISION_START, IMAGE, VISION_END])
  tokenizer.pre_tokenizer = pre_tokenizers.Split('', 'isolated')
  tokenizer.decoder = decoders.Fuse()
  return tokenizer


@dataclasses.dataclass(frozen=True)
class SpotSection(TaskSection):
  """The `task` section of `task.name: spot`: the image's noise and the blind control. The model
  must be a vision-language one whose vision token ids are the task's (3, 4, 5)."""

  name: Literal['spot'] = 'spot'
  noise: float = 0.3  # std of the background's per-pixel noise (the mark is 1.0 brighter)
  blank_images: bool = False  # every image the same grey square: nothing to see (a control run)

  def __post_init__(self):
    with section('task'):
      require(0.0 <= self.noise <= 1.0, 'noise', f'must be in [0, 1], got {self.noise}')

  def check_run(self, config) -> None:
    vision = config.model.architecture.vision
    require(vision is not None, 'model.architecture.vision',
            "must describe a vision tower: task 'spot' asks about an image")
    for name, symbol in (('vision_start_token_id', VISION_START), ('image_token_id', IMAGE),
                         ('vision_end_token_id', VISION_END)):
      require(getattr(vision, name) == SYMBOLS.index(symbol), f'model.architecture.vision.{name}',
              f"must be {SYMBOLS.index(symbol)}, task 'spot''s {symbol} (got {getattr(vision, name)})")
    require(config.model.architecture.vocab_size >= len(SYMBOLS), 'model.architecture.vocab_size',
            f"must be at least {len(SYMBOLS)}, task 'spot''s vocabulary")


def build(config) -> 'SpotTask':
  task = SpotTask(config.model.architecture, config.task.noise, config.task.blank_images)
  require(config.rollout.max_new_tokens >= 2, 'rollout.max_new_tokens',
          f'({config.rollout.max_new_tokens}) is shorter than the answer with its end token (2)')
  return task


def shape(config, architecture) -> 'SpotTask':
  return SpotTask(architecture, config.task.noise, config.task.blank_images)


class SpotTask(Stateless):
  """Which quadrant holds the mark (a jittable Task); `architecture` a Qwen2Config with vision."""

  jittable = True

  def __init__(self, architecture, noise: float = 0.3, blank_images: bool = False):
    self.architecture, self.noise, self.blank_images = architecture, noise, blank_images
    self.vision_config: VisionConfig = architecture.vision
    v = self.vision_config
    self.tokenizer = build_tokenizer()
    self.vocab_size = len(SYMBOLS)
    self.pad_id, self.eos_id, self.bos_id = 0, 1, 2
    self.stop_token_ids = (self.eos_id,)
    self.grid = (1, 2 * v.spatial_merge_size, 2 * v.spatial_merge_size)  # patches: 2 x 2 merged blocks
    self.side = self.grid[1] * v.patch_size  # pixels
    row = [BOS, VISION_START] + [IMAGE] * QUADRANTS + [VISION_END, '?']
    self.prompt = np.asarray([SYMBOLS.index(s) for s in row], np.int32)
    self.prompt_length = len(row)
    self.vision_bucket = ImageBucket(images=1, patches=int(np.prod(self.grid)))
    positions, offsets = mrope_positions(self.prompt[None], None, [[self.grid]], architecture)
    # The tower takes patches in window order (model/vision.py patch_layout); each image token its own block's feature.
    self.order, coords, windows, frames, merged = patch_layout(self.grid, v)
    image = self.prompt == SYMBOLS.index(IMAGE)
    placement = np.full(self.prompt.shape, -1, np.int32)
    placement[image] = merged
    self._layout = dict(positions=positions[0], offset=offsets[0], coords=coords, windows=windows, frames=frames,
                        placement=placement)

  def images(self, key: jax.Array, quadrant: jax.Array) -> jax.Array:
    """[P, side, side, 3] in [0, 1]: noise around 0.3 with a square of 1.0 inside the quadrant."""
    count, side, half = quadrant.shape[0], self.side, self.side // 2
    if self.blank_images:
      return jnp.full((count, side, side, 3), 0.5, jnp.float32)
    noise_key, spot_key = jax.random.split(key)
    image = 0.3 + self.noise * jax.random.normal(noise_key, (count, side, side, 3))
    size = max(1, half // 2)
    corner = jax.random.randint(spot_key, (count, 2), 0, half - size + 1)
    corner = corner + jnp.stack([quadrant // 2, quadrant % 2], axis=1) * half
    rows, columns = jnp.arange(side)[None, :, None], jnp.arange(side)[None, None, :]
    inside = ((rows >= corner[:, 0, None, None]) & (rows < corner[:, 0, None, None] + size)
              & (columns >= corner[:, 1, None, None]) & (columns < corner[:, 1, None, None] + size))
    return jnp.clip(jnp.where(inside[..., None], image + 1.0, image), 0.0, 1.0)

  def patches(self, images: jax.Array) -> jax.Array:
    """Images [P, S, S, 3] in [0, 1] -> the processor's patch rows [P, h * w, C * T * p * p] (in its
    order; the tower's window order is taken from them by `order`):
    normalised with CLIP's statistics, ordered by merged block, each patch repeated over T frames."""
    v = self.vision_config
    count, (_, h, w), p, m = images.shape[0], self.grid, v.patch_size, v.spatial_merge_size
    x = (images - jnp.asarray(CLIP_MEAN)) / jnp.asarray(CLIP_STD)
    x = jnp.moveaxis(x, -1, 1).reshape(count, 3, h // m, m, p, w // m, m, p)
    x = x.transpose(0, 2, 5, 3, 6, 1, 4, 7)  # [P, hb, wb, mh, mw, C, p, p]
    x = jnp.broadcast_to(x[:, :, :, :, :, :, None], x.shape[:6] + (v.temporal_patch_size, p, p))
    return x.reshape(count, h * w, v.patch_dim)

  def prompts(self, key: jax.Array, position, count: int) -> Prompts:
    """`count` images and their question, drawn from `key`. Jittable."""
    del position
    quadrant_key, image_key = jax.random.split(key)
    quadrant = jax.random.randint(quadrant_key, (count,), 0, QUADRANTS)
    layout = {name: jnp.asarray(value) for name, value in self._layout.items()}
    rows = lambda x: jnp.broadcast_to(x, (count,) + x.shape)  # noqa: E731
    images = Images(patches=self.patches(self.images(image_key, quadrant))[:, self.order][:, None],
                    coords=rows(layout['coords'])[:, None], windows=rows(layout['windows'])[:, None],
                    frames=rows(layout['frames'])[:, None], placement=rows(layout['placement']))
    vision = Vision(images=images, positions=rows(layout['positions']), offsets=rows(layout['offset']))
    answers = jnp.stack([quadrant + SYMBOLS.index('1'), jnp.full_like(quadrant, self.eos_id)], axis=1)
    tokens = rows(jnp.asarray(self.prompt))
    return Prompts(tokens=tokens, mask=jnp.ones_like(tokens), answers=answers.astype(jnp.int32), vision=vision)

  def reward(self, rollout: Rollout, prompts: Prompts, group_size: int, model_scores: dict) -> Scores:
    """1.0 where a completion starts with its quadrant's digit and the end token, else 0.0. Jittable."""
    del model_scores  # its reward is its own (a run's reward terms are for dataset tasks)
    answers = jnp.repeat(prompts.answers, group_size, axis=0)
    rewards = jnp.all(rollout.tokens[:, :2] == answers, axis=1).astype(jnp.float32)
    return Scores(rewards=rewards, failures=jnp.zeros((), jnp.int32))

  def close(self) -> None:
    pass

  def decode(self, ids) -> str:
    return self.tokenizer.decode([int(i) for i in np.asarray(ids) if i != self.pad_id], skip_special_tokens=False)
