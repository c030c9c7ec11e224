"""Vision-language problems (a question with image markers, its images, the reference answer).

`load_vision_problems(source, split, format)` reads the records of data/sources.py in one of these
schemas, the multimodal counterpart of data/adapters.py:

  geo3k   Geometry3K as on the hub (hiyouga/geometry3k): `problem` (text with <image>), `images`
          (a list), `answer`
  verl    verl's geo3k preprocessing: `prompt` a list of chat messages whose one user message holds
          the question (a system message is dropped: the task's own template applies), `images`,
          `reward_model.ground_truth`
  vision  any other dataset: question_field, answer_field (dotted names read nested fields) and
          images_field (a list, or one image), or a single `image` field when `images` is absent

An image is a file path (a relative one resolves against the data file's directory), encoded bytes,
a Hugging Face datasets Image dict {'bytes', 'path'} or a PIL image (datasets' decoded Image
feature). Inline base64 is refused: a JSONL file names image files, a parquet file carries bytes.

A question holds one IMAGE_MARKER per image, in order; a question with none gets them at its front,
one per line, as verl and Qwen place a geo3k figure.

Images are decoded at load, not lazily: every image of the split is checked before the first step
(a bad one fails the run, or is skipped and reported, up front, not hours in), and a split of a few
thousand figures such as geo3k's fits in host memory decoded (width x height x 3 bytes an image).
A dataset whose decoded images do not fit needs a lazy loader, which this is not.
"""

import dataclasses
import os
from typing import get_args

from PIL import Image

from grpo_jax.data.adapters import VisionFormat, lookup, scalar_text
from grpo_jax.model.images import ImageSettings, load_image
from grpo_jax.data.sources import load_records
from grpo_jax.errors import UserError, require

IMAGE_MARKER = '<image>'
# Qwen2.5-VL's tokens around an image's <|image_pad|> tokens, one pad per merged patch.
VISION_START, IMAGE_PAD, VISION_END = '<|vision_start|>', '<|image_pad|>', '<|vision_end|>'

VISION_FORMATS: tuple[str, ...] = get_args(VisionFormat)

# (question, answer, images) fields of the fixed schemas; `vision` takes the caller's.
_FIELDS = {'geo3k': ('problem', 'answer', 'images'),
           'verl': ('prompt', 'reward_model.ground_truth', 'images')}


@dataclasses.dataclass(frozen=True)
class VisionProblem:
  """One problem of a vision-language dataset.

  question: the user's text with exactly one IMAGE_MARKER per image, in image order.
  images: the decoded RGB images, in order.
  answer: the reference answer the math reward compares with.
  row: the record's index in its source split, for messages.
  """

  question: str
  images: tuple[Image.Image, ...]
  answer: str
  row: int


def load_vision_problems(source: str, split: str = 'train', format: str = 'vision', *,
                         settings: ImageSettings = ImageSettings(), skip_bad_images: bool = False,
                         max_images: int = 4, question_field: str = 'question', answer_field: str = 'answer',
                         images_field: str = 'images') -> tuple[list[VisionProblem], list[str]]:
  """The problems of `split` of `source` (data/sources.py) read in `format`, and one line per row
  skipped for its images (see vision_problems)."""
  return vision_problems(load_records(source, split), source, format, settings=settings,
                         skip_bad_images=skip_bad_images, max_images=max_images, question_field=question_field,
                         answer_field=answer_field, images_field=images_field)


def vision_problems(records: list[dict], source: str, format: str = 'vision', *,
                    settings: ImageSettings = ImageSettings(), skip_bad_images: bool = False,
                    max_images: int = 4, question_field: str = 'question', answer_field: str = 'answer',
                    images_field: str = 'images') -> tuple[list[VisionProblem], list[str]]:
  """The problems of `records`, read from `source` (named in messages; relative image paths resolve
  against its directory when it is a file) in `format`; the three fields are the vision format's.

  A row whose images cannot be used (none, over max_images, markers that do not match them, an
  image that is missing, corrupt or over settings.max_source_pixels) is a one-line UserError naming
  the source and row, or with skip_bad_images is left out and its line returned for the caller to
  count and report. A row without its question or answer is always an error: that is the wrong
  schema, not a bad row."""
  if format not in VISION_FORMATS:
    raise UserError(f'task.format {format!r} of {source} is not one of {", ".join(VISION_FORMATS)}')
  require(isinstance(max_images, int) and not isinstance(max_images, bool) and max_images >= 1,
          'task.max_images', f'must be a positive integer, not {max_images!r}')
  fields = _FIELDS.get(format, (question_field, answer_field, images_field))
  local = not source.startswith(('hf:', 'tfds:'))
  directory = os.path.dirname(os.path.abspath(source)) if local else None
  problems, skipped = [], []
  for row, record in enumerate(records):
    where = f'task.source {source} row {row}'
    question, answer, images = _fields(record, *fields, where)
    try:
      problems.append(_problem(question, answer, images, row, where, directory, settings, max_images))
    except UserError as error:
      if not skip_bad_images:
        raise
      skipped.append(str(error))
  if not records:
    raise UserError(f'task.source {source} has no records')
  if not problems:
    raise UserError(f'all {len(records)} rows of task.source {source} were skipped for their images; '
                    f'the first: {skipped[0]}')
  return problems, skipped


def _fields(record: dict, question_field: str, answer_field: str, images_field: str,
            where: str) -> tuple[str, str, list[tuple[str, object]]]:
  """The question text, the answer and the (label, value) of each image of `record`."""
  def missing(what: str, *fields: str) -> UserError:
    return UserError(f'{where} has no {what} in field {" or ".join(map(repr, fields))} (missing, null or '
                     f'blank; its fields: {", ".join(map(str, record))})')

  question = lookup(record, question_field)
  if isinstance(question, (list, tuple)):
    question = _user_content(question, question_field, where)
  if question is not None and not isinstance(question, str):
    raise UserError(f'{where} field {question_field!r} is a {type(question).__name__}, not question text')
  if question is None or not question.strip():
    raise missing('question', question_field)
  answer = scalar_text(lookup(record, answer_field))
  if answer is None:
    raise missing('answer', answer_field)
  names = (images_field, 'image') if images_field == 'images' else (images_field,)
  field = next((name for name in names if lookup(record, name) is not None), None)
  if field is None:
    raise missing('images', *names)
  value = lookup(record, field)
  if isinstance(value, (list, tuple)):
    return question, answer, [(f'{field}[{index}]', item) for index, item in enumerate(value)]
  return question, answer, [(field, value)]


def _user_content(messages, field: str, where: str) -> str:
  """The content of the one user message of chat `messages` (verl's `prompt`)."""
  users = [m for m in messages if isinstance(m, dict) and m.get('role') == 'user']
  if len(users) != 1 or not isinstance(users[0].get('content'), str):
    raise UserError(f'{where} field {field!r} must hold exactly one user message with text content, '
                    f'not {len(users)}')
  return users[0]['content']


def _problem(question: str, answer: str, images: list[tuple[str, object]], row: int, where: str,
             directory: str | None, settings: ImageSettings, max_images: int) -> VisionProblem:
  """The problem of one row, its markers checked (or placed) before any image is decoded."""
  if not images:
    raise UserError(f'{where} has no images')
  if len(images) > max_images:
    raise UserError(f'{where} has {len(images)} images, over task.max_images ({max_images})')
  for token in (VISION_START, IMAGE_PAD, VISION_END):
    if token in question:
      raise UserError(f'{where}: the question holds {token}, a token only the prompt renderer may place')
  markers = question.count(IMAGE_MARKER)
  if markers == 0:
    question = f'{IMAGE_MARKER}\n' * len(images) + question
  elif markers != len(images):
    raise UserError(f'{where}: the question has {markers} {IMAGE_MARKER} markers for {len(images)} images')
  decoded = tuple(_image(value, f'{where} ({label}{_named(value)})', directory, settings)
                  for label, value in images)
  return VisionProblem(question=question, images=decoded, answer=answer, row=row)


def _named(value) -> str:
  """': <path>' for an image given by path (a datasets dict's path too), for messages; else ''."""
  path = value.get('path') if isinstance(value, dict) else value
  if not isinstance(path, str):
    return ''
  return f': {path}' if len(path) <= 120 else f': {path[:120]}...'


def _image(value, where: str, directory: str | None, settings: ImageSettings) -> Image.Image:
  """load_image of `value`, a relative path resolved against `directory` (None: as it is)."""
  path = value.get('path') if isinstance(value, dict) and value.get('bytes') is None else value
  if isinstance(path, str):
    if path.startswith('data:'):
      raise UserError(f'{where}: inline (data: URI) images are not read; give a file path, or the '
                      f'bytes in a parquet file')
    value = os.path.join(directory, path) if directory is not None else path
  return load_image(value, where, settings)


def render_user_content(question: str) -> list[dict]:
  """`question` as chat content parts, {'type': 'image'} at each marker and {'type': 'text', 'text':
  ...} between (empty text left out): the user content Qwen2.5-VL's chat template takes."""
  parts = []
  for index, text in enumerate(question.split(IMAGE_MARKER)):
    if index:
      parts.append({'type': 'image'})
    if text:
      parts.append({'type': 'text', 'text': text})
  return parts


def expand_image_tokens(question: str, counts: list[int]) -> str:
  """`question` with its i-th marker replaced by <|vision_start|>, counts[i] <|image_pad|> and
  <|vision_end|> (images.image_token_count): Qwen2.5-VL's prompt text for a plain-string prompt."""
  pieces = question.split(IMAGE_MARKER)
  if len(pieces) - 1 != len(counts):
    raise ValueError(f'the question has {len(pieces) - 1} {IMAGE_MARKER} markers for {len(counts)} images')
  if any(count < 1 for count in counts):
    raise ValueError(f'image token counts must be positive, not {list(counts)}')
  return pieces[0] + ''.join(VISION_START + IMAGE_PAD * count + VISION_END + piece
                             for count, piece in zip(counts, pieces[1:]))
