"""Qwen2.5-VL's vision tower in Flax NNX, and the host-side layout of a batch's images.

The tower turns each image's patches (the image processor's rows, model/images.py) into one feature
per m x m block of patches, of the language model's width; those features replace the embeddings of
the prompt's image tokens (`<|image_pad|>`, one per block), in order. Parameters, stacked over the
Lv blocks (letters as in model/config.py's VisionConfig):

  patch_weight   [C, P]          (the Conv3d patch embedding: its stride is its kernel, so a matmul)
  norm1, norm2   [Lv, C]         qkv_weight [Lv, C, 3C]  qkv_bias [Lv, 3C]   proj_weight [Lv, C, C]
  gate_weight, up_weight [Lv, C, I] (+ biases [Lv, I])   down_weight [Lv, I, C]  (+ bias [Lv, C])
  merger_norm    [C]             merger_in_weight [W, W] (+ bias)  merger_out_weight [W, D] (+ bias)

Attention is bidirectional within a segment: the blocks `fullatt_block_indexes` names attend over
their whole image (each frame of it, `FULL_ATTENTION_CHUNK` queries at a time), the others within
windows of `window_size` pixels. As in the reference implementation the patches are in window
order (each window a contiguous run; the host lays them out so, patch_layout), so a windowed
block attends chunk by chunk over neighbouring chunks only; the merged features come out in window
order too, and each image token's placement points at its own.

Images are batched per token row as [B, I, Np, ...]: up to I images per row, each padded to Np
patches (a bucket, so the compiled programs see a bounded set of shapes), padding marked by segment
0 and its features never placed.
"""

import dataclasses
import typing

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpo_jax.errors import UserError
from grpo_jax.model.attention import chunked_attention, grouped_attention
from grpo_jax.model.config import Qwen2Config, VisionConfig
from grpo_jax.model.layers import rms_norm, rotate
from grpo_jax.model.linear import matmul
from grpo_jax.ops import fixed_order
from grpo_jax.sharding import constrain

VISION_NORM_EPS = 1e-6  # fixed in the reference implementation, not a config field
FULL_ATTENTION_CHUNK = 1024  # queries at a time in the full-attention blocks: scores O(chunk x Np) an image


def local_attention(q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array, span: int) -> jax.Array:
  """Bidirectional attention within segments that are contiguous runs of at most `span` tokens
  (the windows, in window order): q, k, v [N, T, h, d], segments [N, T] (0: padding), T a multiple
  of span. Each chunk of `span` queries attends to the keys of its own chunk and the chunks on
  either side (a run of <= span tokens lies within those), under the segment mask: scores
  O(T x 3 span), not O(T^2)."""
  count, length, heads, dim = q.shape
  chunks = length // span

  def split(x):
    return x.reshape((count, chunks, span) + x.shape[2:])

  def around(x):  # [N, C, span, ...] -> [N, C, 3 span, ...]: the chunks before, at and after
    padded = jnp.pad(x, [(0, 0), (1, 1)] + [(0, 0)] * (x.ndim - 2))
    return jnp.concatenate([padded[:, :-2], padded[:, 1:-1], padded[:, 2:]], axis=2)

  query_segments, key_segments = split(segments), around(split(segments))
  mask = (query_segments[..., :, None] == key_segments[..., None, :]) & (key_segments != 0)[..., None, :]
  flat = lambda x: x.reshape((count * chunks,) + x.shape[2:])  # noqa: E731
  out = grouped_attention(flat(split(q)), [(flat(around(split(k))), flat(around(split(v))), flat(mask))])
  return out.reshape(count, length, heads, dim)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Images:
  """The images of a batch of B token rows, each row's own, and where their features go.

  patches [B, I, Np, P]: row b's images (up to I, each up to Np patches: the processor's rows,
  zero past an image's own), coords [B, I, Np, 2] each patch's (row, column) in its image's patch
  grid (the 2D rotary positions), windows / frames [B, I, Np] int32 the attention segments of the
  windowed and the full blocks (0: padding), placement [B, T] int32: for each token, the index of
  its feature among its row's I * Np / m^2 merged features, or -1 for a token that keeps its
  embedding. Every leaf leads with the row axis, so a batch's rows (micro-batches, shuffles, the G
  samples of a prompt) take their images along.
  """

  patches: jax.Array
  coords: jax.Array
  windows: jax.Array
  frames: jax.Array
  placement: jax.Array

  def map_rows(self, fn) -> 'Images':
    return jax.tree.map(fn, self)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Vision:
  """What prompts with images bring besides their tokens [B, T]: the images, the M-RoPE positions
  [B, T, 3] and each row's offset [B] (a token after the prompt sits at its count of real tokens
  before it plus the offset; mrope_positions). Rows lead every leaf."""

  images: Images
  positions: jax.Array
  offsets: jax.Array

  def map_rows(self, fn) -> 'Vision':
    return jax.tree.map(fn, self)


def model_inputs(vision: 'Vision | None') -> dict:
  """The keywords of the model's forwards (Qwen2.hidden_states, extend) for rows with `vision`'s
  images and M-RoPE positions; none for text rows."""
  return {} if vision is None else dict(images=vision.images, positions=vision.positions)


def extended(vision: Vision, prompt_mask: jax.Array, completion_mask: jax.Array) -> Vision:
  """The prompts' Vision [B, Tp] over the rows [B, Tp + N] of prompt and completion, each row
  with its own images (a plain forward's): no completion token takes a feature, and completion
  token j (of those completion_mask marks) sits at the prompt's count of real tokens plus j plus
  the offset on all three components, where the sampler decoded it. Traceable."""
  positions, placement = _over_completions(vision.positions, vision.offsets, vision.images.placement, prompt_mask,
                                           completion_mask)
  return Vision(images=dataclasses.replace(vision.images, placement=placement), positions=positions,
                offsets=vision.offsets)


def _over_completions(positions, offsets, placement, prompt_mask, completion_mask):
  """A prompt's M-RoPE positions [B, Tp, 3] and placements [B, Tp] extended over its completion
  [B, N] (extended's rule). -> ([B, Tp + N, 3], [B, Tp + N])"""
  before = jnp.sum(prompt_mask != 0, axis=1, dtype=jnp.int32)
  running = jnp.maximum(jnp.cumsum(completion_mask != 0, axis=1, dtype=jnp.int32) - 1, 0)
  after = (before + offsets)[:, None] + running
  positions = jnp.concatenate([positions, jnp.broadcast_to(after[..., None], after.shape + (3,))], axis=1)
  placement = jnp.concatenate([placement, jnp.full(completion_mask.shape, -1, jnp.int32)], axis=1)
  return positions, placement


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowImages:
  """Rows [B, T] showing the images of P prompts, a prompt's shown by several rows (the update's:
  the G answers of a prompt share its images, so the tower runs once per prompt and each of the
  rows takes its prompt's features). Rows lead every leaf; the images themselves stay apart.

  prompt     [B] int32  the prompt whose images row b shows, among the P
  placement  [B, T] int32 each token's feature among its prompt's merged features, -1 for a token
             that keeps its embedding
  positions  [B, T, 3] int32 the M-RoPE positions
  """

  prompt: jax.Array
  placement: jax.Array
  positions: jax.Array

  def map_rows(self, fn) -> 'RowImages':
    return jax.tree.map(fn, self)

  @classmethod
  def answering(cls, vision: Vision, group_size: int, prompt_mask: jax.Array,
                completion_mask: jax.Array) -> 'RowImages':
    """The rows [B = P * G, Tp + N] answering the prompts of `vision` [P, Tp], row p * G + g the
    g-th answer to prompt p (prompt_mask [B, Tp], completion_mask [B, N]); positions and
    placements as `extended` gives them. Traceable."""
    prompts = vision.offsets.shape[0]
    repeat = lambda x: jnp.repeat(x, group_size, axis=0)  # noqa: E731
    positions, placement = _over_completions(repeat(vision.positions), repeat(vision.offsets),
                                             repeat(vision.images.placement), prompt_mask, completion_mask)
    return cls(prompt=repeat(jnp.arange(prompts, dtype=jnp.int32)), placement=placement, positions=positions)

  @classmethod
  def own(cls, vision: Vision) -> 'RowImages':
    """Rows [B, T] each showing images of its own (`vision`'s, over the whole row: an agent's
    episode, whose environment showed them): row b shows image row b."""
    rows = vision.positions.shape[0]
    return cls(prompt=jnp.arange(rows, dtype=jnp.int32), placement=vision.images.placement,
               positions=vision.positions)

  def features(self, prompt_features: jax.Array) -> jax.Array:
    """Each row's features [B, F, D]: its prompt's, of the prompts' [P, F, D]; laid out with the rows."""
    return constrain(jnp.take(prompt_features, self.prompt, axis=0), ('batch', None, None))


def vision_of(images: list[list[tuple[np.ndarray, tuple[int, int, int]]]], tokens: np.ndarray,
              segment_ids: np.ndarray | None, config: Qwen2Config, max_patches: int | None = None,
              max_images: int | None = None) -> Vision:
  """The Vision of a token batch whose row b holds images[b] (layout_images, mrope_positions)."""
  positions, offsets = mrope_positions(tokens, segment_ids, [[grid for _, grid in row] for row in images], config)
  return Vision(images=layout_images(images, tokens, segment_ids, config.vision, max_patches, max_images),
                positions=jnp.asarray(positions), offsets=jnp.asarray(offsets))


class ImageBucket(typing.NamedTuple):
  """What every prompt's images are padded to for a whole run, so its compiled programs see one
  shape: up to `images` images a prompt, each up to `patches` patches (a patch_bucket). A task
  says its own (Task.vision_bucket; None: text prompts)."""

  images: int
  patches: int

  def shapes(self, rows: int, length: int, config: VisionConfig, sharding=None) -> Vision:
    """The shapes of a Vision for `rows` prompts of `length` tokens in this bucket: what the plan
    compiles with and a pool of partial rollouts holds."""
    def shaped(shape, dtype):
      return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    images = (rows, self.images, patch_bucket(self.patches, config))
    return Vision(images=Images(patches=shaped(images + (config.patch_dim,), jnp.float32),
                                coords=shaped(images + (2,), jnp.int32), windows=shaped(images, jnp.int32),
                                frames=shaped(images, jnp.int32), placement=shaped((rows, length), jnp.int32)),
                  positions=shaped((rows, length, 3), jnp.int32), offsets=shaped((rows,), jnp.int32))


class VisionTower(nnx.Module):
  """Images -> each row's merged features [B, I * Np / m^2, D]."""

  def __init__(self, config: VisionConfig, initializer_range: float, param_dtype, rngs: nnx.Rngs):
    self.config = config
    c = config
    L, C, I, P = c.depth, c.hidden_size, c.intermediate_size, c.patch_dim
    W, D = C * c.merge_unit, c.out_hidden_size
    normal = nnx.initializers.normal(initializer_range)

    def weight(shape, axes):
      return nnx.Param(normal(rngs.params(), shape, param_dtype), logical_axes=axes)

    def constant(value, shape, axes):
      return nnx.Param(jnp.full(shape, value, param_dtype), logical_axes=axes)

    self.patch_weight = weight((C, P), ('embed', None))
    self.norm1 = constant(1.0, (L, C), ('layers', None))
    self.norm2 = constant(1.0, (L, C), ('layers', None))
    self.qkv_weight = weight((L, C, 3 * C), ('layers', 'embed', None))
    self.qkv_bias = constant(0.0, (L, 3 * C), ('layers', None))
    self.proj_weight = weight((L, C, C), ('layers', None, 'embed'))
    self.proj_bias = constant(0.0, (L, C), ('layers', None))
    self.gate_weight = weight((L, C, I), ('layers', 'embed', 'mlp'))
    self.gate_bias = constant(0.0, (L, I), ('layers', 'mlp'))
    self.up_weight = weight((L, C, I), ('layers', 'embed', 'mlp'))
    self.up_bias = constant(0.0, (L, I), ('layers', 'mlp'))
    self.down_weight = weight((L, I, C), ('layers', 'mlp', 'embed'))
    self.down_bias = constant(0.0, (L, C), ('layers', None))
    self.merger_norm = constant(1.0, (C,), (None,))
    self.merger_in_weight = weight((W, W), ('embed', 'mlp'))
    self.merger_in_bias = constant(0.0, (W,), ('mlp',))
    self.merger_out_weight = weight((W, D), ('mlp', 'embed'))
    self.merger_out_bias = constant(0.0, (D,), (None,))

  def __call__(self, images: Images, dtype, checkpoint=None) -> jax.Array:
    """checkpoint: how each block is rematerialised under autodiff (jax.checkpoint with the model's
    policy), or None."""
    c = self.config
    rows, per_row, length, _ = images.patches.shape
    count = rows * per_row
    flat = lambda x: x.reshape((count,) + x.shape[2:])  # noqa: E731  every image of every row, one axis
    heads, head_dim = c.num_heads, c.head_dim
    if fixed_order.exact('matmul'):
      x = matmul(flat(images.patches).astype(dtype), self.patch_weight[...].astype(dtype).T)
    else:
      x = jnp.einsum('inp,cp->inc', flat(images.patches).astype(dtype), self.patch_weight[...].astype(dtype))
    # 2D rotary: head_dim / 4 frequencies, rotated by the row over the first half of each half-split
    # pair and by the column over the second.
    inverse_frequency = 1.0 / (c.rope_theta ** (jnp.arange(0, head_dim // 2, 2, dtype=jnp.float32) / (head_dim // 2)))
    coords = flat(images.coords).astype(jnp.float32)
    angles = jnp.concatenate([coords[..., 0:1] * inverse_frequency, coords[..., 1:2] * inverse_frequency], axis=-1)

    windows, frames = flat(images.windows), flat(images.frames)
    full = jnp.asarray([i in c.fullatt_block_indexes for i in range(c.depth)])

    def attend(full_attention, q, k, v):
      return jax.lax.cond(full_attention,
                          lambda q, k, v: chunked_attention(q, k, v, slots=jnp.zeros_like(frames), segments=frames,
                                                            chunk=FULL_ATTENTION_CHUNK),
                          lambda q, k, v: local_attention(q, k, v, windows, window_span(c)), q, k, v)
    stacked = {name: getattr(self, name)[...].astype(dtype) for name in (
        'norm1', 'norm2', 'qkv_weight', 'qkv_bias', 'proj_weight', 'proj_bias', 'gate_weight', 'gate_bias',
        'up_weight', 'up_bias', 'down_weight', 'down_bias')}

    settle = fixed_order.settle  # under exact numerics each value materialised on its own; else a no-op

    def block(x, inputs):
      p, full_attention = inputs
      h = rms_norm(x, p['norm1'], VISION_NORM_EPS)
      qkv = settle(matmul(h, p['qkv_weight']) + p['qkv_bias']).reshape(count, length, 3, heads, head_dim)
      q, k, v = settle((rotate(qkv[:, :, 0], angles), rotate(qkv[:, :, 1], angles), qkv[:, :, 2]))
      out = attend(full_attention, q, k, v).reshape(count, length, c.hidden_size)
      x = settle(x + matmul(out, p['proj_weight']) + p['proj_bias'])
      h = rms_norm(x, p['norm2'], VISION_NORM_EPS)
      gate = settle(jax.nn.silu(settle(matmul(h, p['gate_weight']) + p['gate_bias'])))
      hidden = settle(gate * settle(matmul(h, p['up_weight']) + p['up_bias']))
      x = settle(x + matmul(hidden, p['down_weight']) + p['down_bias'])
      return x, None

    if checkpoint is not None:
      block = checkpoint(block)
    x = constrain(x, ('batch', None, None))  # the images lie with their rows
    x, _ = jax.lax.scan(block, x, (stacked, full))
    x = rms_norm(x, self.merger_norm[...].astype(dtype), VISION_NORM_EPS)
    x = x.reshape(count, length // c.merge_unit, c.hidden_size * c.merge_unit)
    x = fixed_order.settle(matmul(x, self.merger_in_weight[...].astype(dtype)) + self.merger_in_bias[...].astype(dtype))
    x = fixed_order.settle(jax.nn.gelu(x, approximate=False))
    x = fixed_order.settle(matmul(x, self.merger_out_weight[...].astype(dtype)) + self.merger_out_bias[...].astype(dtype))
    return x.reshape(rows, per_row * x.shape[1], x.shape[2])


def place(embeddings: jax.Array, features: jax.Array, placement: jax.Array) -> jax.Array:
  """embeddings [B, T, D] with each token whose placement >= 0 replaced by that feature of its
  row's merged features [B, F, D]."""
  taken = jnp.take_along_axis(features.astype(embeddings.dtype), jnp.maximum(placement, 0)[..., None], axis=1)
  return jnp.where((placement >= 0)[..., None], taken, embeddings)


def place_any(embeddings: jax.Array, features: jax.Array, placement: jax.Array) -> jax.Array:
  """`place` for a placement [B, T] (each row its own features), `place_from` for [B', T, 2]."""
  return (place if placement.ndim == 2 else place_from)(embeddings, features, placement)


def place_from(embeddings: jax.Array, features: jax.Array, placement: jax.Array) -> jax.Array:
  """embeddings [B', T, D] with each token whose placement [B', T, 2] = (b, f) names a feature
  replaced by feature f of row b of features [B, F, D] (packed rows, whose tokens come from several
  of the batch's rows); (-1, -1) keeps the embedding."""
  rows, index = placement[..., 0], placement[..., 1]
  flat = features.reshape(-1, features.shape[-1]).astype(embeddings.dtype)
  taken = jnp.take(flat, jnp.maximum(rows, 0) * features.shape[1] + jnp.maximum(index, 0), axis=0)
  return jnp.where((rows >= 0)[..., None], taken, embeddings)


# ---- the host side: a batch's images laid out for the tower, and M-RoPE positions ----

def image_tokens(grid: tuple[int, int, int], config: VisionConfig) -> int:
  """How many image tokens (merged features) an image of patch grid (t, h, w) has."""
  t, h, w = grid
  return t * h * w // config.merge_unit


def check_processor(settings, config: VisionConfig, where: str) -> None:
  """An image processor's settings (model/images.py ImageSettings) cut patches the tower reads:
  the same patch side, frames per patch and merge size, else one line naming `where`."""
  for ours, theirs in (('patch_size', 'patch_size'), ('temporal_patch_size', 'temporal_patch_size'),
                       ('merge_size', 'spatial_merge_size')):
    if getattr(settings, ours) != getattr(config, theirs):
      raise UserError(f'{where}: the image processor\'s {ours} is {getattr(settings, ours)} but the vision tower\'s '
                      f'{theirs} is {getattr(config, theirs)}')


def window_span(config: VisionConfig) -> int:
  """Patches in one attention window (window_size / patch_size squared): the windowed blocks
  attend in chunks of this many patches."""
  return (config.window_size // config.patch_size) ** 2


def patch_bucket(patches: int, config: VisionConfig) -> int:
  """The patches an image is padded to for a bucket of at least `patches`: a multiple of the
  window span (and so of m^2)."""
  span = max(window_span(config), config.merge_unit)
  return -(-patches // span) * span


def patch_layout(grid: tuple[int, int, int], config: VisionConfig):
  """How an image of patch grid (t, h, w) enters the tower, its patches in window order: frame by
  frame, window by window (row-major), and within a window in the processor's order (block of m x m
  patches by block, row-major within). -> (order [n]: the processor's patch at each position,
  coords [n, 2] each patch's (row, column), windows [n] its window (1-based), frames [n] its frame
  (1-based), merged [n / m^2]: where each merged block of the processor's order lands). A window
  is a contiguous run of at most window_span patches, and each m x m block stays whole, so the
  merger's blocks are the processor's, in window order."""
  t, h, w = grid
  m = config.spatial_merge_size
  if h % m or w % m:
    raise UserError(f'an image of {h} x {w} patches does not split into {m} x {m} blocks (vision.spatial_merge_size)')
  rows, columns = np.meshgrid(np.arange(h), np.arange(w), indexing='ij')
  blocked = lambda a: a.reshape(h // m, m, w // m, m).transpose(0, 2, 1, 3).reshape(-1)  # noqa: E731
  rows, columns = np.tile(blocked(rows), t), np.tile(blocked(columns), t)
  side = config.window_size // config.spatial_merge_size // config.patch_size  # blocks per window side
  across = -(-(w // m) // side)
  frame = np.repeat(np.arange(t), h * w)
  window = frame * (-(-(h // m) // side) * across) + (rows // m // side) * across + (columns // m // side)
  order = np.lexsort((np.arange(len(window)), window))  # stable: the processor's order within a window
  merged = np.argsort(order[::config.merge_unit] // config.merge_unit)
  return (order, np.stack([rows, columns], axis=-1)[order], window[order] + 1, frame[order] + 1, merged)


def layout_images(images: list[list[tuple[np.ndarray, tuple[int, int, int]]]], tokens: np.ndarray,
                  segment_ids: np.ndarray | None, config: VisionConfig, max_patches: int | None = None,
                  max_images: int | None = None) -> Images:
  """The Images of a token batch [B, T] whose row b's image tokens hold, in order, the features of
  images[b]: (patches [n, P] in the processor's order, patch grid (t, h, w)) pairs, each laid out
  in window order (patch_layout). Each image is padded to `max_patches` (default: the largest;
  rounded up by patch_bucket), each row's images to `max_images` (default: the most a row has): a
  bucket, so a compiled program sees one shape. A row whose count of image tokens differs from its
  images' features is an error naming the row and both counts."""
  if len(images) != len(tokens):
    raise ValueError(f'images for {len(images)} rows, tokens for {len(tokens)}')
  for b, row in enumerate(images):
    for j, (rows, grid) in enumerate(row):
      if rows.shape != (int(np.prod(grid)), config.patch_dim):
        raise UserError(f'row {b} image {j}: patches of shape {list(rows.shape)}, but its grid {list(grid)} needs '
                        f'[{int(np.prod(grid))}, {config.patch_dim}]')
  longest = max((len(rows) for row in images for rows, _ in row), default=config.merge_unit)
  most = max((len(row) for row in images), default=0)
  length, count = patch_bucket(max_patches or longest, config), max_images or max(most, 1)
  if longest > length or most > count:
    raise UserError(f'a row of {most} images of up to {longest} patches exceeds the bucket of {count} images of '
                    f'{length} patches per row')
  real = np.ones(tokens.shape, bool) if segment_ids is None else np.asarray(segment_ids) != 0
  shape = (len(tokens), count, length)
  out = dict(patches=np.zeros(shape + (config.patch_dim,), np.float32), coords=np.zeros(shape + (2,), np.int32),
             windows=np.zeros(shape, np.int32), frames=np.zeros(shape, np.int32))
  placement = np.full(tokens.shape, -1, np.int32)
  merged = length // config.merge_unit
  for b, row in enumerate(images):
    counts = [image_tokens(tuple(grid), config) for _, grid in row]
    where = np.flatnonzero((np.asarray(tokens[b]) == config.image_token_id) & real[b])
    if len(where) != sum(counts):
      raise UserError(f'row {b}: the prompt holds {len(where)} image tokens but its {len(row)} images have '
                      f'{sum(counts)} features ({counts}): each image needs exactly its t*h*w/{config.merge_unit} '
                      'image tokens')
    features = []
    for j, (rows, grid) in enumerate(row):
      order, coords, windows, frames, position = patch_layout(tuple(grid), config)
      n = len(rows)
      out['patches'][b, j, :n], out['coords'][b, j, :n], out['windows'][b, j, :n], out['frames'][b, j, :n] = (
          rows[order], coords, windows, frames)
      features.append(j * merged + position)
    if row:
      placement[b, where] = np.concatenate(features)
  return Images(**{name: jnp.asarray(value) for name, value in out.items()}, placement=jnp.asarray(placement))


def mrope_positions(tokens: np.ndarray, segment_ids: np.ndarray | None, grids: list[list[tuple[int, int, int]]],
                    config: Qwen2Config) -> tuple[np.ndarray, np.ndarray]:
  """M-RoPE positions [B, T, 3] (temporal, row, column) of a token batch whose row b's image tokens
  hold the images of grids[b] in order, and each row's offset [B]: the position of the token
  after its last, minus its count of real tokens (a decoded token's position is the count of real
  tokens before it plus this offset). Text tokens count on from the previous token's largest
  position on all three; an image's block of tokens starts there, its row and column positions
  the block's, and the text after it goes on from the start plus the larger of its two sides in
  blocks. Padding (segment 0) gets 0."""
  v = config.vision
  tokens = np.asarray(tokens)
  real = np.ones(tokens.shape, bool) if segment_ids is None else np.asarray(segment_ids) != 0
  positions = np.zeros(tokens.shape + (3,), np.int32)
  offsets = np.zeros(tokens.shape[0], np.int32)
  for b in range(tokens.shape[0]):
    remaining = list(grids[b])
    columns = np.flatnonzero(real[b])
    row = tokens[b, columns]
    current, i, out = 0, 0, np.zeros((len(columns), 3), np.int32)
    images = np.flatnonzero(row == v.image_token_id) if v is not None else np.zeros(0, int)
    while i < len(row):
      # The text up to the next image token (a run at a time: a step's prompts hold ~10^5 tokens).
      start = int(images[np.searchsorted(images, i)]) if np.searchsorted(images, i) < len(images) else len(row)
      out[i:start] = (current + np.arange(start - i))[:, None]
      current, i = current + start - i, start
      if i == len(row):
        break
      if not remaining:
        raise UserError(f'row {b} holds more images than its {len(grids[b])} grids')
      t, h, w = remaining.pop(0)
      m = v.spatial_merge_size
      frames, hs, ws = np.meshgrid(np.arange(t), np.arange(h // m), np.arange(w // m), indexing='ij')
      block = np.stack([frames, hs, ws], axis=-1).reshape(-1, 3) + current
      if i + len(block) > len(row) or np.any(row[i:i + len(block)] != v.image_token_id):
        raise UserError(f'row {b}: an image of grid {[t, h, w]} needs {len(block)} consecutive image tokens')
      out[i:i + len(block)] = block
      current, i = current + max(h, w) // m, i + len(block)
    if remaining:
      raise UserError(f'row {b}: {len(remaining)} of its {len(grids[b])} images have no image tokens')
    positions[b, columns] = out
    offsets[b] = current - len(columns)
  return positions, offsets
