"""Images in an agent's conversation: what an environment shows the policy besides text.

An environment's `reset` or `step` may answer with an `Observation`: its text (one IMAGE_MARKER,
`<image>`, per image, in order) or its ids (each image's `<|image_pad|>` run already in place), and
its images (anything model/images.load_image reads: a PIL image, a uint8 [H, W, 3] array, encoded
bytes, a path). A problem's prompt may hold images too (agents.agent.Problem.images). Each image is
made into the vision tower's patches once, with the run's image processor (task.min_pixels,
task.max_pixels, model.path's preprocessor_config.json), and stands in the conversation for its
count of image tokens, between <|vision_start|> and <|vision_end|> in text.

The inference server prefills an image through the vision tower in the turn that first brings it
(a kept cache holds it after), and the episode's images travel with its trajectory into the
update, where each row's are laid out to the run's one bucket (`task.max_images` images an episode,
each of up to the patches of task.max_pixels), so the update compiles one shape.
"""

import dataclasses
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from grpo_jax.data.multimodal import IMAGE_MARKER, IMAGE_PAD, VISION_END, VISION_START
from grpo_jax.errors import UserError
from grpo_jax.model.config import Qwen2Config
from grpo_jax.model.images import ImageSettings, load_image, process_image
from grpo_jax.model.vision import ImageBucket, Vision, image_tokens, layout_images, mrope_positions, patch_bucket

Image = tuple[np.ndarray, tuple[int, int, int]]  # (patches [n, C*T*P*P], patch grid (t, h, w))


@dataclasses.dataclass(frozen=True)
class Observation:
  """What an environment shows the policy with images: `content` text with one IMAGE_MARKER per
  image, or ids holding each image's run of image tokens (its patches' count / merge_size^2),
  and `images` in order."""

  content: tuple[int, ...] | str = ()
  images: tuple = ()


@dataclasses.dataclass(frozen=True)
class ImageReader:
  """A run's way from an environment's images to the model's: the architecture (the tower's
  sizes, the image token id), the processor's settings and the bucket every episode's images are
  padded to in the update (`images` per episode, `patches` per image)."""

  architecture: Qwen2Config
  settings: ImageSettings
  bucket: ImageBucket

  def read(self, images, where: str) -> tuple[Image, ...]:
    """Each image as (patches, grid), refused in one line naming `where` when it cannot be
    decoded or has more patches than the bucket's."""
    out = []
    for index, image in enumerate(images):
      label = f'{where} image {index}'
      patches, grid = process_image(load_image(image, label, self.settings), self.settings)
      if len(patches) > self.bucket.patches:
        raise UserError(f'{label}: {len(patches)} patches (grid {list(grid)}), over the {self.bucket.patches} of '
                        f'task.max_pixels ({self.settings.max_pixels} pixels); raise it or show a smaller image')
      out.append((patches, tuple(int(n) for n in grid)))
    return tuple(out)

  def tokens(self, image: Image) -> int:
    """The image tokens standing for `image` ((patches, grid, ...))."""
    return self.count(image[1])

  def count(self, grid) -> int:
    """The image tokens of an image of patch grid (t, h, w)."""
    return image_tokens(tuple(grid), self.architecture.vision)

  def expand(self, text: str, images: tuple[Image, ...], where: str) -> str:
    """`text` with its i-th IMAGE_MARKER replaced by image i's vision block (one line naming
    `where` when the markers and the images differ in number)."""
    pieces = text.split(IMAGE_MARKER)
    if len(pieces) - 1 != len(images):
      raise UserError(f'{where}: the text has {len(pieces) - 1} {IMAGE_MARKER} markers for {len(images)} images')
    return pieces[0] + ''.join(VISION_START + IMAGE_PAD * self.tokens(image) + VISION_END + piece
                               for image, piece in zip(images, pieces[1:]))

  def check(self, ids, images: tuple[Image, ...], where: str) -> None:
    """`ids` hold exactly the image tokens of `images` (a run per image, in order)."""
    token = self.architecture.vision.image_token_id
    found, needed = int(np.sum(np.asarray(ids) == token)), sum(map(self.tokens, images))
    if found != needed:
      raise UserError(f'{where}: {found} image tokens (id {token}) for {len(images)} images of {needed} '
                      f'({[self.tokens(image) for image in images]}); each image needs its run of image tokens '
                      f'({IMAGE_PAD} in text)')


def reader(config) -> ImageReader | None:
  """The run's ImageReader when its agent task may show images (task.max_images > 0), else None;
  a model without a vision tower is refused in one line."""
  from grpo_jax.data.image_problems import image_settings  # the processor's settings, as the math task's
  from grpo_jax.model.hf_config import load_hf_config
  task, model = config.task, config.model
  if not task.max_images:
    return None
  architecture = load_hf_config(model.path) if model.path else model.architecture
  vision = architecture.vision
  if vision is None:
    raise UserError(f'task.max_images ({task.max_images}) lets the environment show images, but the model '
                    f'({architecture.model_type}) has no vision tower: leave it 0, or train a vision-language model')
  settings = image_settings(config, vision)
  patches = settings.max_pixels // settings.factor ** 2 * vision.merge_unit
  return ImageReader(architecture, settings, ImageBucket(task.max_images, patch_bucket(patches, vision)))


def image_spans(tokens, images, reader: ImageReader) -> list[tuple[int, int]]:
  """(first, end) of each image's image tokens in `tokens`, which hold its images' tokens in order."""
  where = np.flatnonzero(np.asarray(tokens, np.int64) == reader.architecture.vision.image_token_id)
  counts = [reader.tokens(image) for image in images]
  ends = np.cumsum(counts, dtype=np.int64)
  return [(int(where[end - count]), int(where[end - 1]) + 1) for end, count in zip(ends, counts)]


class Placed(NamedTuple):
  """An image of a conversation: its patches [n, C*T*P*P] and grid (t, h, w), and the context
  position of its first image token (its tokens follow it). A token of the image token's id
  elsewhere (one the policy sampled) is text."""

  patches: np.ndarray
  grid: tuple[int, int, int]
  start: int


def marked(tokens, images, image_token_id: int, count_of, shift: int = 0) -> np.ndarray:
  """`tokens` as the image layout reads them: the image token's id only where an image's tokens
  are (each of `images` from its start + shift, count_of(grid) tokens), -1 anywhere else it
  appears (a sampled token, which is text)."""
  tokens = np.array(tokens, np.int64)
  own = np.zeros(tokens.shape, bool)
  for image in images:
    own[image.start + shift:image.start + shift + count_of(image.grid)] = True
  return np.where((tokens == image_token_id) & ~own, -1, tokens)


# ---- the inference server's side: a request's images checked, a prefill batch's laid out ----

def check_request_images(tokens, images, bucket: ImageBucket | None, architecture: Qwen2Config | None) -> None:
  """An inference request's images (Placed) fit the server's bucket, and `tokens` hold each one's
  image tokens from its start, in order; one line saying what does not."""
  count = len(images)
  if bucket is None:
    raise UserError(f'inference request: {count} images, but the server takes none (its `images` bucket is None)')
  if count > bucket.images:
    raise UserError(f'inference request: {count} images, over the server\'s {bucket.images}')
  if architecture is None:  # checked again once the server is bound
    return
  vision, tokens, end = architecture.vision, np.asarray(tokens), 0
  for index, (patches, grid, start) in enumerate(images):
    if np.shape(patches) != (int(np.prod(grid)), vision.patch_dim) or len(patches) > bucket.patches:
      raise UserError(f'inference request: image {index} has patches {list(np.shape(patches))} for grid '
                      f'{list(grid)}; at most {bucket.patches} patches of {vision.patch_dim} values')
    needed = image_tokens(tuple(grid), vision)
    span = tokens[start:start + needed]
    if start < end or len(span) < needed or np.any(span != vision.image_token_id):
      raise UserError(f'inference request: image {index} of grid {list(grid)} needs its {needed} image tokens '
                      f'(id {vision.image_token_id}) from context position {start}, after the image before it')
    end = start + needed


def prefill_vision(rows, tokens: np.ndarray, real: np.ndarray, bucket: ImageBucket, architecture: Qwen2Config):
  """A prefill batch's Vision. rows: each prefilled row's (context tokens, its images (Placed),
  where the row's prefill starts in the context); tokens / real [R, W]: what the rows prefill.
  Each row's M-RoPE positions are the whole context's from its start, its offset the context's,
  and its images those among the tokens it prefills (images None when no row has any: the tower
  does not run)."""
  vision = architecture.vision
  positions = np.zeros(tokens.shape + (3,), np.int32)
  offsets = np.zeros(tokens.shape[:1], np.int32)
  shown = [[] for _ in range(len(tokens))]
  laid = np.array(tokens)
  count = lambda grid: image_tokens(tuple(grid), vision)  # noqa: E731
  for row, (context, images, start) in enumerate(rows):
    seen = marked(context, images, vision.image_token_id, count)
    whole, offset = mrope_positions(seen[None], None, [[tuple(image[1]) for image in images]], architecture)
    length = len(context) - start
    positions[row, :length], offsets[row] = whole[0, start:], offset[0]
    laid[row, :length] = seen[start:]
    shown[row] = [(image[0], tuple(image[1])) for image in images if image[2] >= start]
  laid_out = None
  if any(shown):
    laid_out = layout_images(shown, laid, real, vision, max_patches=bucket.patches, max_images=bucket.images)
  return Vision(images=laid_out, positions=jnp.asarray(positions), offsets=jnp.asarray(offsets))
