"""Images to Qwen2.5-VL vision patches, with numpy and Pillow only.

The same numbers as transformers' `Qwen2VLImageProcessorPil` (Qwen2.5-VL uses Qwen2-VL's
processor), without torch or transformers: the GPU images have no torchvision, and the
torchvision-backed processor cannot be installed beside our torch pin.

  load_image(source, where, settings)  bytes, path, PIL image, array or HF datasets dict -> RGB image
  process_image(image, settings)       -> patches [N, C*T*P*P] float32, grid (t, h, w)
  process_images(images, settings)     several images: patches concatenated, grids [I, 3]
  image_token_count(grid, merge_size)  how many <|image_pad|> tokens stand for the image

Each image is resized (bicubic, Pillow) so both sides are multiples of patch_size * merge_size and
its area lies in [min_pixels, max_pixels], scaled to [0, 1], normalised with the CLIP mean and std,
and cut into patch_size x patch_size patches ordered merge block by merge block; each patch is
repeated temporal_patch_size times, as a still image is a video of identical frames.
"""

import dataclasses
import io
import math
import os
import struct

import numpy as np
from PIL import Image, ImageOps

from grpo_jax.errors import FieldError, UserError, read_json_object, require, root_cause

# OpenAI CLIP's per-channel statistics, which Qwen2-VL and Qwen2.5-VL normalise with.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

# transformers' smart_resize refuses images whose long side is over 200 times the short one.
MAX_ASPECT_RATIO = 200

# transformers' class defaults (size = {shortest_edge: 56*56, longest_edge: 28*28*1280}): used,
# as transformers does, for a preprocessor_config.json that names neither bound. The hub's
# Qwen2.5-VL file names both (3136 and 12845056), which are ImageSettings' own defaults.
_PROCESSOR_SIZE = {'shortest_edge': 56 * 56, 'longest_edge': 28 * 28 * 1280}

_RESCALE = 1 / 255

# The steps process_image implements; a preprocessor_config.json asking for another is refused.
_FIXED_STEPS = {'do_resize': True, 'resample': int(Image.Resampling.BICUBIC), 'do_rescale': True,
                'rescale_factor': _RESCALE, 'do_normalize': True, 'do_convert_rgb': True}

# What Pillow raises on bytes it cannot decode (UnidentifiedImageError is an OSError).
_DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, IndexError, struct.error)


@dataclasses.dataclass(frozen=True)
class ImageSettings:
  """How images become patches; defaults are Qwen2.5-VL's hub preprocessor_config.json."""

  min_pixels: int = 56 * 56  # smallest resized area (smaller images are scaled up)
  max_pixels: int = 28 * 28 * 16384  # largest resized area, 12845056 (transformers' class: 1003520)
  patch_size: int = 14  # P: side of a vision patch, in pixels
  temporal_patch_size: int = 2  # T: frames per patch; a still image repeats its one frame
  merge_size: int = 2  # side of the block of patches the merger folds into one LLM token
  image_mean: tuple[float, ...] = CLIP_MEAN  # per-channel mean subtracted after scaling to [0, 1]
  image_std: tuple[float, ...] = CLIP_STD  # per-channel std divided by after the mean
  # Largest decoded image accepted, checked from the header before decoding, so a decompression
  # bomb or a huge scan is refused: 64 MP holds 8K frames (33 MP) and camera photos (up to ~61 MP)
  # and stays under Pillow's own warning limit (89.5 MP); decoded RGBA it is 256 MB.
  max_source_pixels: int = 64_000_000

  def __post_init__(self):
    for name in ('min_pixels', 'max_pixels', 'patch_size', 'temporal_patch_size', 'merge_size',
                 'max_source_pixels'):
      value = getattr(self, name)
      require(isinstance(value, int) and not isinstance(value, bool) and value >= 1, name,
              f'must be a positive integer, not {value!r}')
    require(self.min_pixels <= self.max_pixels, 'min_pixels',
            f'({self.min_pixels}) must not exceed max_pixels ({self.max_pixels})')
    for name in ('image_mean', 'image_std'):
      value = getattr(self, name)
      require(isinstance(value, (tuple, list)) and len(value) == 3
              and all(isinstance(v, (int, float)) for v in value), name,
              f'must be three numbers (R, G, B), not {value!r}')
      object.__setattr__(self, name, tuple(float(v) for v in value))
    require(all(v > 0 for v in self.image_std), 'image_std', f'must be positive, not {self.image_std}')

  @property
  def factor(self) -> int:
    """What both resized sides are multiples of: one merge block of patches."""
    return self.patch_size * self.merge_size

  @classmethod
  def from_checkpoint(cls, directory: str, min_pixels: int | None = None,
                      max_pixels: int | None = None) -> 'ImageSettings':
    """The settings of `directory`/preprocessor_config.json, read as transformers reads them:
    top-level `min_pixels`/`max_pixels` (older files) win over `size: {shortest_edge,
    longest_edge}` (newer ones), a file with neither gets transformers' class defaults, and the
    caller's min_pixels/max_pixels win over the file (max_source_pixels: dataclasses.replace)."""
    path = os.path.join(directory, 'preprocessor_config.json')
    if not os.path.isfile(path):
      raise UserError(f'checkpoint {directory} has no preprocessor_config.json (a vision-language '
                      f'checkpoint comes with one)')
    config = read_json_object(path, 'preprocessor config', 'image processor settings')
    for key, value in _FIXED_STEPS.items():
      if key in config and config[key] != value:
        raise UserError(f'preprocessor config {path} sets {key} to {config[key]!r}; only {value!r} '
                        f'is implemented')
    size = config.get('size', _PROCESSOR_SIZE)
    if not isinstance(size, dict):
      raise UserError(f'preprocessor config {path}: size must be an object, not {size!r}')
    bounds = {}
    for name, key, override in (('min_pixels', 'shortest_edge', min_pixels),
                                ('max_pixels', 'longest_edge', max_pixels)):
      bounds[name] = next((v for v in (override, config.get(name), size.get(key)) if v is not None), None)
      if bounds[name] is None:
        raise UserError(f'preprocessor config {path} has neither {name} nor size.{key}')
    fields = {name: config[name] for name in ('patch_size', 'temporal_patch_size', 'merge_size',
                                               'image_mean', 'image_std') if name in config}
    try:
      return cls(**fields, **bounds)
    except FieldError as error:
      raise UserError(f'preprocessor config {path}: {error}') from None


def _shape_problem(height: int, width: int) -> str | None:
  """Why an image of this size cannot be resized for the model, or None."""
  if min(height, width) < 1:
    return f'the image is empty ({width}x{height} pixels)'
  if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
    return (f'the image is {width}x{height} pixels, a side over {MAX_ASPECT_RATIO} times the other '
            f'(Qwen2-VL resizing refuses such aspect ratios)')
  return None


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
  """(height, width) rounded to multiples of `factor` with the area in [min_pixels, max_pixels] and
  the aspect ratio kept as closely as possible; transformers' rule, rounding included."""
  if (problem := _shape_problem(height, width)) is not None:
    raise UserError(problem)
  resized_height, resized_width = round(height / factor) * factor, round(width / factor) * factor
  if resized_height * resized_width > max_pixels:
    beta = math.sqrt(height * width / max_pixels)
    resized_height = max(factor, math.floor(height / beta / factor) * factor)
    resized_width = max(factor, math.floor(width / beta / factor) * factor)
  elif resized_height * resized_width < min_pixels:
    beta = math.sqrt(min_pixels / (height * width))
    resized_height = math.ceil(height * beta / factor) * factor
    resized_width = math.ceil(width * beta / factor) * factor
  return resized_height, resized_width


def to_rgb(image: Image.Image) -> Image.Image:
  """`image` in mode RGB, transparency composited onto white as transformers' processor does
  (other modes: Pillow's own conversion)."""
  if 'A' in image.getbands() or image.info.get('transparency') is not None:
    background = Image.new('RGBA', image.size, (255, 255, 255, 255))
    return Image.alpha_composite(background, image.convert('RGBA')).convert('RGB')
  return image if image.mode == 'RGB' else image.convert('RGB')


def load_image(source, where: str, settings: ImageSettings = ImageSettings()) -> Image.Image:
  """An RGB image from `source`: encoded bytes, a file path, a PIL image, a uint8 [H, W, 3] array,
  or a Hugging Face datasets Image dict {'bytes', 'path'} (bytes first, as datasets decodes it).
  Decoded files are turned upright by their EXIF orientation, as datasets and transformers do.

  A missing file, undecodable bytes, or an image over settings.max_source_pixels or too narrow to
  resize is a UserError naming `where` (e.g. "task.source data.jsonl row 17 (images[0])")."""
  if isinstance(source, dict):
    if source.get('bytes') is not None:
      source = source['bytes']
    elif source.get('path') is not None:
      source = source['path']
    else:
      raise UserError(f'{where}: the image dict has neither "bytes" nor "path"')
  if isinstance(source, Image.Image):
    return _checked_rgb(source, where, settings, upright=False)
  if isinstance(source, np.ndarray):
    if source.dtype != np.uint8 or source.ndim != 3 or source.shape[-1] != 3:
      raise UserError(f'{where}: an image array must be uint8 [height, width, 3], not '
                      f'{source.dtype} {list(source.shape)}')
    _check_size(source.shape[0], source.shape[1], where, settings)
    return Image.fromarray(source)
  if isinstance(source, (bytes, bytearray, memoryview)):
    file = io.BytesIO(source)
  elif isinstance(source, (str, os.PathLike)):
    try:
      file = open(source, 'rb')
    except OSError as error:
      raise UserError(f'{where}: cannot open {os.fspath(source)} ({error.strerror or error})') from None
  else:
    raise UserError(f'{where}: an image must be bytes, a path, a PIL image, a uint8 array or a dict '
                    f'with "bytes" or "path", not {type(source).__name__}')
  with file:
    try:
      with Image.open(file) as image:
        return _checked_rgb(image, where, settings, upright=True)
    except Image.UnidentifiedImageError:
      raise UserError(f'{where}: not an image format Pillow can read') from None
    except Image.DecompressionBombError as error:
      raise UserError(f'{where}: refused by Pillow: {root_cause(error)}') from None
    except _DECODE_ERRORS as error:
      raise UserError(f'{where}: the image cannot be decoded ({root_cause(error)})') from None


def _check_size(height: int, width: int, where: str, settings: ImageSettings) -> None:
  if height * width > settings.max_source_pixels:
    raise UserError(f'{where}: the image is {width}x{height} = {height * width} pixels, over '
                    f'max_source_pixels ({settings.max_source_pixels})')
  if (problem := _shape_problem(height, width)) is not None:
    raise UserError(f'{where}: {problem}')


def _checked_rgb(image: Image.Image, where: str, settings: ImageSettings, upright: bool) -> Image.Image:
  """`image` size-checked (from its header, before decoding), decoded and in RGB."""
  _check_size(image.height, image.width, where, settings)
  image.load()
  rgb = to_rgb(ImageOps.exif_transpose(image) if upright else image)
  return rgb.copy() if rgb is image else rgb  # never the caller's own object, which it may change


def process_image(image: Image.Image,
                  settings: ImageSettings = ImageSettings()) -> tuple[np.ndarray, tuple[int, int, int]]:
  """One image's vision patches and grid, equal to transformers' pixel_values and image_grid_thw.

  Returns patches float32 [t*h*w, C*T*P*P] (each row channel-major, then frame, row, column; rows
  ordered merge block by merge block) and grid (t, h, w) = (1, height / P, width / P)."""
  image = to_rgb(image)
  height, width = smart_resize(image.height, image.width, settings.factor, settings.min_pixels,
                               settings.max_pixels)
  # transformers resizes even when the size is unchanged; Pillow then returns a copy, so skipping
  # it would be equal, but one path is simpler to trust.
  resized = image.resize((width, height), Image.Resampling.BICUBIC)
  # float64 scaling then float32 normalising, in transformers' order, so the numbers are identical.
  pixels = (np.asarray(resized).astype(np.float64) * _RESCALE).astype(np.float32)  # [H, W, C]
  pixels = (pixels - np.asarray(settings.image_mean, np.float32)) / np.asarray(settings.image_std, np.float32)
  p, m, t = settings.patch_size, settings.merge_size, settings.temporal_patch_size
  grid_h, grid_w, channels = height // p, width // p, pixels.shape[-1]
  # [block row, row in block, patch row, block column, column in block, patch column, channel]
  blocks = pixels.reshape(grid_h // m, m, p, grid_w // m, m, p, channels)
  blocks = blocks.transpose(0, 3, 1, 4, 6, 2, 5)  # [.., .., row in block, column in block, C, P, P]
  frames = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], t, p, p))
  return frames.reshape(grid_h * grid_w, channels * t * p * p), (1, grid_h, grid_w)


def process_images(images: list[Image.Image],
                   settings: ImageSettings = ImageSettings()) -> tuple[np.ndarray, np.ndarray]:
  """Several images as transformers' processor batches them: patches float32 [sum of t*h*w,
  C*T*P*P] in image order, grids int64 [images, 3]."""
  if not images:
    raise ValueError('process_images needs at least one image')
  processed = [process_image(image, settings) for image in images]
  return (np.concatenate([patches for patches, _ in processed]),
          np.array([grid for _, grid in processed], dtype=np.int64))


def image_token_count(grid: tuple[int, int, int], merge_size: int) -> int:
  """How many <|image_pad|> tokens the prompt holds for an image of this grid: the vision merger
  folds each merge_size x merge_size block of patches into one token."""
  t, h, w = (int(n) for n in grid)
  return t * h * w // merge_size**2
