"""Qwen2.5-VL's vision tower's architecture (model/vision.py builds it; model/config.py's Qwen2Config
holds it as `vision`)."""

import dataclasses

from grpo_jax.errors import UserError

@dataclasses.dataclass(frozen=True)
class VisionConfig:
  """Qwen2.5-VL's vision tower (model/vision.py) and the prompt tokens that hold its features.

  Dimension letters: C = hidden_size (the tower's width), I = intermediate_size, P = in_channels x
  temporal_patch_size x patch_size^2 (one flattened patch), W = C x spatial_merge_size^2 (the
  merger's width); its output is the language model's D = out_hidden_size.
  """

  depth: int = 2  # Lv, transformer blocks
  hidden_size: int = 32  # C
  intermediate_size: int = 64  # I, the blocks' SwiGLU width (with biases)
  num_heads: int = 2
  out_hidden_size: int = 64  # the language model's hidden_size
  in_channels: int = 3
  patch_size: int = 14  # pixels per patch side
  temporal_patch_size: int = 2  # frames per patch (an image is repeated to fill them)
  spatial_merge_size: int = 2  # m: m x m patches merge into one language-model token
  window_size: int = 112  # pixels per side of an attention window (blocks not in fullatt_block_indexes)
  fullatt_block_indexes: tuple[int, ...] = ()  # blocks attending over the whole image
  tokens_per_second: int = 2  # video only: the temporal position step per second
  rope_theta: float = 10000.0  # the tower's 2D rotary base
  image_token_id: int = 151655  # <|image_pad|>: one per merged patch, replaced by its feature
  video_token_id: int = 151656
  vision_start_token_id: int = 151652  # <|vision_start|>
  vision_end_token_id: int = 151653  # <|vision_end|>

  def __post_init__(self):
    for name in ('depth', 'hidden_size', 'intermediate_size', 'num_heads', 'out_hidden_size', 'in_channels',
                 'patch_size', 'temporal_patch_size', 'spatial_merge_size', 'window_size'):
      if getattr(self, name) <= 0:
        raise UserError(f'model architecture field vision.{name} must be positive, got {getattr(self, name)}')
    if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
      raise UserError(f'model architecture field vision.hidden_size ({self.hidden_size}) must split into '
                      f'vision.num_heads ({self.num_heads}) heads of a multiple of 4 (the 2D rotary embedding)')
    if self.window_size % (self.patch_size * self.spatial_merge_size):
      raise UserError(f'model architecture field vision.window_size ({self.window_size}) must be a multiple of '
                      f'patch_size x spatial_merge_size ({self.patch_size * self.spatial_merge_size})')
    bad = [i for i in self.fullatt_block_indexes if not 0 <= i < self.depth]
    if bad:
      raise UserError(f'model architecture field vision.fullatt_block_indexes names block {bad[0]}, outside '
                      f'[0, {self.depth})')

  @property
  def head_dim(self) -> int:
    return self.hidden_size // self.num_heads

  @property
  def patch_dim(self) -> int:
    """P, one flattened patch: channels x frames x pixels."""
    return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

  @property
  def merge_unit(self) -> int:
    """Patches per language-model token (m^2)."""
    return self.spatial_merge_size ** 2

  def num_params(self) -> int:
    c, i, w = self.hidden_size, self.intermediate_size, self.hidden_size * self.merge_unit
    block = 2 * c + (c * 3 * c + 3 * c) + (c * c + c) + 2 * (c * i + i) + (i * c + c)
    return self.patch_dim * c + self.depth * block + c + (w * w + w) + (w * self.out_hidden_size + self.out_hidden_size)

  def image_flops(self, patches: int) -> int:
    """Forward FLOPs (2 per multiply-add) of the tower on one image of `patches` patches, counted
    from the shapes: the patch embedding, each block's projections and MLP, its attention (a full
    block's over the image, a windowed one's over its window), the merger."""
    c, inner, w = self.hidden_size, self.intermediate_size, self.hidden_size * self.merge_unit
    block = 2 * patches * (3 * c * c + c * c + 3 * c * inner)
    full = len(self.fullatt_block_indexes)
    window = (self.window_size // self.patch_size) ** 2
    attention = 4 * patches * c * (full * patches + (self.depth - full) * min(window, patches))
    merger = 2 * (patches // self.merge_unit) * (w * w + w * self.out_hidden_size)
    return 2 * patches * self.patch_dim * c + self.depth * block + attention + merger
