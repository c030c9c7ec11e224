"""Problems with images: how a run's images reach its model, each image made into patches once, and
the one bucket a run's prompts carry their images in.

A dataset of format geo3k, verl or vision (data/multimodal.py) needs a vision-language model. Each
image is decoded and turned into patches once, at load (model/images.py, with model.path's
preprocessor_config.json and task.min_pixels / task.max_pixels); the question goes through the chat
template with an image part per image, each image's <|image_pad|> repeated to its token count, and
task.max_prompt_tokens counts those tokens. A step's prompts carry their images as a Vision
(model/vision.py) padded to one bucket for the whole run: as many images per prompt as the most any
problem has, each as many patches as the largest image (both at most what task.max_images, the
pixel bound and task.max_prompt_tokens allow), so the compiled programs see one shape.

An image is kept as (patches [n, C*T*P*P], grid (t, h, w)); a problem's images are a tuple of them,
() for a text problem.
"""

import dataclasses
import os

import jax
import numpy as np

from grpo_jax.data.multimodal import IMAGE_PAD, VISION_FORMATS, load_vision_problems
from grpo_jax.data.sources import DatasetSource
from grpo_jax.errors import UserError
from grpo_jax.model.config import Qwen2Config, VisionConfig
from grpo_jax.model.hf_config import load_hf_config
from grpo_jax.model.images import ImageSettings, process_image
from grpo_jax.model.vision import ImageBucket, Vision, check_processor, image_tokens, patch_bucket, vision_of
from grpo_jax.sections import section


@dataclasses.dataclass(frozen=True)
class ImageInputs:
  """How a run's images reach its model: the model's architecture (its vision tower's token ids,
  patch and merge sizes), the image processor's settings, the task's image keys, and the dtype the
  problems' patches are kept in on the host: the model's compute dtype, which the tower casts them
  to first (bfloat16: the same numbers in half the memory; a step's Vision holds them as float32)."""

  architecture: Qwen2Config
  settings: ImageSettings
  max_images: int
  skip_bad_images: bool
  dtype: str


def image_dataset(datasets) -> DatasetSource | None:
  """The first of `datasets` whose format has images, or None."""
  return next((data for data in datasets if data.source and data.format in VISION_FORMATS), None)


def image_inputs(config) -> ImageInputs | None:
  """The ImageInputs of a run (a Config) one of whose datasets (task.source, task.mix, eval.source)
  has images, else None. The architecture is model.path's config.json (else model.architecture);
  the processor's settings are image_settings'."""
  task, model = config.task, config.model
  data = image_dataset((task.dataset, *task.mix, config.eval.dataset))
  if data is None:
    return None
  architecture = load_hf_config(model.path) if model.path else model.architecture
  where = f'model.path {model.path}' if model.path else 'model.architecture'
  vision = architecture.vision
  if vision is None:
    raise UserError(f'format {data.format} of {data.source} has images, but {where} has no vision tower '
                    '(a vision-language model such as Qwen2.5-VL reads them)')
  return ImageInputs(architecture=architecture, settings=image_settings(config, vision), max_images=task.max_images,
                     skip_bad_images=task.skip_bad_images, dtype=model.options.dtype)


def image_settings(config, vision: VisionConfig) -> ImageSettings:
  """The image processor's settings of a run whose model has the tower `vision`: model.path's
  preprocessor_config.json when model.path is a directory here (checked against the tower), else
  the tower's patch sizes with Qwen2.5-VL's pixel bounds; task.min_pixels / task.max_pixels over
  either."""
  task, path = config.task, config.model.path
  if path and os.path.isdir(path):
    settings = ImageSettings.from_checkpoint(path, task.min_pixels, task.max_pixels)
    check_processor(settings, vision, f'model.path {path}')
    return settings
  bounds = {name: getattr(task, name) for name in ('min_pixels', 'max_pixels') if getattr(task, name) is not None}
  with section('task'):
    return ImageSettings(patch_size=vision.patch_size, temporal_patch_size=vision.temporal_patch_size,
                         merge_size=vision.spatial_merge_size, **bounds)


def largest_bucket(config, vision: VisionConfig) -> ImageBucket:
  """The largest bucket a run's settings allow, without reading its problems (the plan's):
  task.max_images images of the patches of max_pixels, or of max_prompt_tokens image tokens when
  fewer (a run pads to its data's largest, at most this)."""
  task, settings = config.task, image_settings(config, vision)
  tokens = min(settings.max_pixels // settings.factor ** 2, task.max_prompt_tokens)
  return ImageBucket(task.max_images, patch_bucket(tokens * vision.merge_unit, vision))


def read_image_problems(data: DatasetSource, section: str, inputs: ImageInputs | None, render, tokenize):
  """(texts, token ids, (answer, data source), images, records read, what was skipped) of the
  dataset `data` (read for config section `section`, named in messages), whose format has images:
  each image's patches made once, here, and its <|image_pad|> repeated to the image's token count in
  the ids (the texts show one per image).

  render(question, counts, where) -> (the text shown, the text the model reads) of a question whose
  i-th image marker stands for counts[i] image tokens; tokenize(texts) -> their token ids."""
  if inputs is None:
    raise UserError(f'{section}.format {data.format} ({data.source}) has images, which only task.name=math '
                    'gives a vision-language model')
  problems, bad = load_vision_problems(
      data.source, data.split, data.format, settings=inputs.settings, skip_bad_images=inputs.skip_bad_images,
      max_images=inputs.max_images, question_field=data.prompt_field, answer_field=data.answer_field,
      images_field=data.images_field)
  vision = inputs.architecture.vision
  texts, expanded, images, tokens = [], [], [], []
  for problem in problems:
    processed = tuple((patches.astype(inputs.dtype), grid)
                      for patches, grid in (process_image(image, inputs.settings) for image in problem.images))
    counts = [image_tokens(grid, vision) for _, grid in processed]
    text, full = render(problem.question, counts, f'{section}: {data.source} row {problem.row}')
    texts.append(text)
    expanded.append(full)
    images.append(processed)
    tokens.append(sum(counts))
  ids = tokenize(expanded)
  for problem, row, expected in zip(problems, ids, tokens):
    found = int(np.sum(np.asarray(row) == vision.image_token_id))
    if found != expected:
      raise UserError(f'{section}: {data.source} row {problem.row}: the tokenizer gives {found} tokens of id '
                      f'{vision.image_token_id} (the model\'s vision.image_token_id) for its {expected} image '
                      f'tokens: it must encode {IMAGE_PAD} as that id')
  skipped = f'{len(bad)} for their images' + (f' (the first: {bad[0]})' if bad else '')
  answers = [(problem.answer, data.source) for problem in problems]
  return texts, ids, answers, images, len(problems) + len(bad), skipped


def problems_bucket(images: list, inputs: ImageInputs | None) -> ImageBucket | None:
  """(images per prompt, patches per image) that every batch of problems with `images` (each
  problem's tuple of (patches, grid)) is padded to: the most of them; None when none has images
  (then `inputs` may be None)."""
  if not any(images):
    return None
  longest = max(len(patches) for row in images for patches, _ in row)
  return ImageBucket(max(map(len, images)), patch_bucket(longest, inputs.architecture.vision))


def batch_vision(images: list, tokens: np.ndarray, mask: np.ndarray, inputs: ImageInputs,
                 bucket: ImageBucket) -> Vision:
  """The Vision of prompts tokens / mask [B, Tp] (left-padded) whose images are `images` (each
  prompt's tuple of (patches, grid)), padded to `bucket`: made on the host's CPU, not on the first
  accelerator (the caller places them, as it places the tokens)."""
  count, length = bucket
  with jax.default_device(jax.local_devices(backend='cpu')[0]):
    return vision_of(images, tokens, mask, inputs.architecture, max_patches=length, max_images=count)
