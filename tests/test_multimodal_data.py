"""Vision-language problems (data/multimodal.py) from JSONL and parquet files written here in each
schema, with fresh random PNG images each run: pixels must come back exactly (PNG is lossless)."""

import io
import json

import numpy as np
import pytest
from PIL import Image

from grpo_jax.model.images import ImageSettings
from grpo_jax.data.multimodal import (IMAGE_PAD, VISION_END, VISION_START, VisionProblem, expand_image_tokens,
                                      load_vision_problems, render_user_content, vision_problems)
from grpo_jax.errors import FieldError
from test_math_task import one_line_error

INSTRUCTION = 'Put the final answer in \\boxed{}.'  # what verl's geo3k preprocessing appends


def random_pixels(rng, low: int = 20, high: int = 60) -> np.ndarray:
  height, width = rng.integers(low, high, 2)
  return rng.integers(0, 256, (height, width, 3), dtype=np.uint8)


def png(pixels: np.ndarray) -> bytes:
  buffer = io.BytesIO()
  Image.fromarray(pixels).save(buffer, 'PNG')
  return buffer.getvalue()


def write(path, records) -> str:
  """records as JSON lines or a parquet file, by the name's extension."""
  if path.suffix == '.parquet':
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist(records), str(path))
  else:
    path.write_text(''.join(json.dumps(record) + '\n' for record in records))
  return str(path)


def save(directory, name: str, pixels: np.ndarray) -> str:
  """Writes pixels as PNG at directory/name; returns name (a path relative to directory)."""
  (directory / name).parent.mkdir(parents=True, exist_ok=True)
  (directory / name).write_bytes(png(pixels))
  return name


def record(format: str, question: str, answer, images: list) -> dict:
  """One record in `format`'s own schema."""
  if format == 'geo3k':
    return {'images': images, 'problem': question, 'answer': answer}
  if format == 'verl':
    return {'data_source': 'hiyouga/geometry3k',
            'prompt': [{'role': 'system', 'content': 'You are a helpful assistant.'},
                       {'role': 'user', 'content': f'{question} {INSTRUCTION}'}],
            'images': images, 'ability': 'math', 'reward_model': {'style': 'rule', 'ground_truth': answer}}
  return {'question': question, 'answer': answer, 'images': images}


def assert_problem(problem: VisionProblem, row: int, question: str, answer: str, pixels: list):
  assert (problem.row, problem.question, problem.answer) == (row, question, answer)
  assert len(problem.images) == len(pixels)
  for image, expected in zip(problem.images, pixels):
    assert image.mode == 'RGB'
    np.testing.assert_array_equal(np.asarray(image), expected)


@pytest.mark.parametrize('container', ['jsonl', 'parquet'])
@pytest.mark.parametrize('format', ['geo3k', 'verl', 'vision'])
def test_each_format_from_files(tmp_path, seed, format, container):
  rng = np.random.default_rng(seed)
  pixels = [[random_pixels(rng)], [random_pixels(rng), random_pixels(rng)], [random_pixels(rng)]]
  figure = save(tmp_path, 'figs/c.png', pixels[2][0])
  if container == 'jsonl':  # paths: relative, absolute, and datasets dicts holding only a path
    images = [[save(tmp_path, 'figs/a.png', pixels[0][0])],
              [str(tmp_path / save(tmp_path, 'b0.png', pixels[1][0])),
               {'bytes': None, 'path': save(tmp_path, 'figs/b1.png', pixels[1][1])}],
              [figure]]
  else:  # the hub's parquet layout: {'bytes', 'path'} structs, bytes first, a path-only one resolved
    images = [[{'bytes': png(pixels[0][0]), 'path': 'a.png'}],
              [{'bytes': png(pixels[1][0]), 'path': None}, {'bytes': png(pixels[1][1]), 'path': 'not-read.png'}],
              [{'bytes': None, 'path': figure}]]
  questions = ['<image>Find x.', 'In <image> and <image>, find the angle.', 'Find the area.']
  answers = ['3\\sqrt{3}', '45', '12']
  path = write(tmp_path / f'data.{container}',
               [record(format, q, a, i) for q, a, i in zip(questions, answers, images)])
  problems, skipped = load_vision_problems(path, 'train', format)
  assert skipped == [] and len(problems) == 3
  suffix = f' {INSTRUCTION}' if format == 'verl' else ''
  questions[2] = '<image>\n' + questions[2]  # no marker: one placed in front of the question
  for row, problem in enumerate(problems):
    assert_problem(problem, row, questions[row] + suffix, answers[row], pixels[row])


def test_vision_format_fields(tmp_path, seed):
  rng = np.random.default_rng(seed)
  pixels = [random_pixels(rng), random_pixels(rng)]
  # Parquet with raw bytes in a single `image` column, dotted question and answer fields.
  path = write(tmp_path / 'single.parquet',
               [{'meta': {'text': f'<image> Q{row}'}, 'image': png(p), 'solution': {'final': 7 + row}}
                for row, p in enumerate(pixels)])
  problems, _ = load_vision_problems(path, question_field='meta.text', answer_field='solution.final')
  for row, problem in enumerate(problems):
    assert_problem(problem, row, f'<image> Q{row}', str(7 + row), [pixels[row]])
  # JSON lines whose images field is named by the caller and holds one path.
  figure = save(tmp_path, 'f.png', pixels[0])
  path = write(tmp_path / 'named.jsonl', [{'question': 'Q', 'answer': 2.0, 'figure': figure}])
  (problem,), _ = load_vision_problems(path, images_field='figure')
  assert_problem(problem, 0, '<image>\nQ', '2', [pixels[0]])


def test_hugging_face_image_features(tmp_path, seed, monkeypatch):
  """The hub's geo3k as datasets writes it: read through hf:<directory> (datasets' records keep the
  {'bytes', 'path'} dicts) and as datasets' own decoded rows (PIL images)."""
  datasets = pytest.importorskip('datasets', reason='datasets comes with requirements-extras.txt')
  rng = np.random.default_rng(seed)
  pixels = [[random_pixels(rng)], [random_pixels(rng), random_pixels(rng)]]
  features = datasets.Features({'images': datasets.Sequence(datasets.Image()),
                                'problem': datasets.Value('string'), 'answer': datasets.Value('string')})
  dataset = datasets.Dataset.from_dict(
      {'images': [[Image.fromarray(p) for p in row] for row in pixels],
       'problem': ['<image>Find x.', 'Compare <image> with <image>.'], 'answer': ['1', '2']}, features=features)
  (tmp_path / 'geo3k' / 'data').mkdir(parents=True)
  dataset.to_parquet(str(tmp_path / 'geo3k' / 'data' / 'train-00000-of-00001.parquet'))
  for name in ('HF_DATASETS_OFFLINE', 'HF_HUB_OFFLINE'):  # sources.py sets them; restored after the test
    monkeypatch.setenv(name, '1')
    monkeypatch.setattr(datasets.config, name, True)
  monkeypatch.setattr(datasets.config, 'HF_DATASETS_CACHE', str(tmp_path / 'cache'))
  decoded = [dataset[row] for row in range(len(dataset))]
  assert isinstance(decoded[0]['images'][0], Image.Image)
  for problems, _ in (load_vision_problems(f'hf:{tmp_path / "geo3k"}', 'train', 'geo3k'),
                      vision_problems(decoded, 'hf:hiyouga/geometry3k', 'geo3k')):
    assert_problem(problems[0], 0, '<image>Find x.', '1', pixels[0])
    assert_problem(problems[1], 1, 'Compare <image> with <image>.', '2', pixels[1])


def assert_bad_row(path: str, message: str, **kwargs):
  """Row 1 of the file at path is refused with `message`; with skip_bad_images it is left out and
  its line returned."""
  assert one_line_error(load_vision_problems, path, **kwargs) == message
  problems, skipped = load_vision_problems(path, skip_bad_images=True, **kwargs)
  assert [problem.row for problem in problems] == [0, 2] and skipped == [message]


def test_markers_and_image_counts(tmp_path, seed):
  rng = np.random.default_rng(seed)
  name = save(tmp_path, 'a.png', random_pixels(rng))
  good = {'question': 'Q', 'answer': '1', 'images': [name, name]}
  path = write(tmp_path / 'data.jsonl', [good, {**good, 'question': '<image> and <image> <image>'}, good])
  assert_bad_row(path, f'task.source {path} row 1: the question has 3 <image> markers for 2 images')
  problems, _ = load_vision_problems(path, skip_bad_images=True)
  assert problems[0].question == '<image>\n<image>\nQ'
  path = write(tmp_path / 'many.jsonl', [good, {**good, 'images': [name] * 3}, good])
  assert_bad_row(path, f'task.source {path} row 1 has 3 images, over task.max_images (2)', max_images=2)
  assert len(load_vision_problems(path, max_images=3)[0]) == 3
  assert one_line_error(load_vision_problems, path, max_images=0).startswith('task.max_images must be a positive')
  with pytest.raises(FieldError):
    load_vision_problems(path, max_images=True)
  path = write(tmp_path / 'none.jsonl', [good, {**good, 'images': []}, good])
  assert_bad_row(path, f'task.source {path} row 1 has no images')
  path = write(tmp_path / 'tokens.jsonl', [good, {**good, 'question': f'<image>{IMAGE_PAD}<image>'}, good])
  assert_bad_row(path, f'task.source {path} row 1: the question holds {IMAGE_PAD}, a token only the prompt '
                       f'renderer may place')


@pytest.mark.parametrize('case', ['missing', 'unreadable', 'truncated', 'oversized', 'data_uri'])
def test_bad_images(tmp_path, seed, case):
  rng = np.random.default_rng(seed)
  good = [random_pixels(rng) for _ in range(3)]
  settings = ImageSettings(max_source_pixels=60 * 60)
  if case == 'truncated':  # bytes in parquet: the label has no path
    data = png(random_pixels(rng, 40, 60))
    images = [[{'bytes': png(p), 'path': None}] * 2 for p in good]
    images[1][1] = {'bytes': data[:len(data) // 2], 'path': None}
    path = write(tmp_path / 'data.parquet', [{'question': 'Q', 'answer': '1', 'images': i} for i in images])
    label, reason = 'images[1]', 'the image cannot be decoded ('
  else:
    images = [[save(tmp_path, f'figs/{row}.png', p)] * 2 for row, p in enumerate(good)]
    bad = 'figs/bad.png'
    if case == 'unreadable':
      (tmp_path / bad).write_bytes(b'not an image at all')
      reason = 'not an image format Pillow can read'
    elif case == 'oversized':
      save(tmp_path, bad, rng.integers(0, 256, (61, 60, 3), dtype=np.uint8))
      reason = 'the image is 60x61 = 3660 pixels, over max_source_pixels (3600)'
    elif case == 'data_uri':
      bad = 'data:image/png;base64,' + 'A' * 200
      reason = 'inline (data: URI) images are not read'
    else:
      reason = f'cannot open {tmp_path / bad} ('
    images[1][1] = bad
    path = write(tmp_path / 'data.jsonl', [{'question': 'Q', 'answer': '1', 'images': i} for i in images])
    label = f'images[1]: {bad if len(bad) <= 120 else bad[:120] + "..."}'
  message = one_line_error(load_vision_problems, path, settings=settings)
  assert message.startswith(f'task.source {path} row 1 ({label}): {reason}'), message
  problems, skipped = load_vision_problems(path, settings=settings, skip_bad_images=True)
  assert [problem.row for problem in problems] == [0, 2] and skipped == [message]
  for problem, pixels in zip(problems, (good[0], good[2])):
    assert_problem(problem, problem.row, '<image>\n<image>\nQ', '1', [pixels, pixels])


def test_missing_fields_are_errors_even_when_skipping(tmp_path, seed):
  rng = np.random.default_rng(seed)
  good = {'question': 'Q', 'answer': '1', 'images': [save(tmp_path, 'a.png', random_pixels(rng))]}
  cases = [({'question': 'Q', 'images': good['images']}, "has no answer in field 'answer'", {}),
           ({**good, 'answer': None}, "has no answer in field 'answer'", {}),
           ({**good, 'answer': '  '}, "has no answer in field 'answer'", {}),
           ({**good, 'question': ''}, "has no question in field 'question'", {}),
           ({**good, 'question': 3}, "field 'question' is a int, not question text", {}),
           ({'question': 'Q', 'answer': '1'}, "has no images in field 'images' or 'image'", {}),
           ({**good, 'figure': None}, "has no images in field 'figure'", {'images_field': 'figure'}),
           ({'problem': 'Q', 'images': good['images']}, "has no answer in field 'answer'", {'format': 'geo3k'}),
           ({'prompt': [{'role': 'user', 'content': 'Q'}], 'images': good['images']},
            "has no answer in field 'reward_model.ground_truth'", {'format': 'verl'}),
           ({'prompt': [{'role': 'user', 'content': 'a'}, {'role': 'user', 'content': 'b'}],
             'images': good['images'], 'reward_model': {'ground_truth': '1'}},
            "field 'prompt' must hold exactly one user message with text content, not 2", {'format': 'verl'})]
  for index, (bad, message, kwargs) in enumerate(cases):
    fine = {**record(kwargs.get('format', 'vision'), 'Q', '1', good['images']), 'figure': good['images']}
    path = write(tmp_path / f'data{index}.jsonl', [fine, bad, fine])
    for skip in (False, True):
      assert one_line_error(load_vision_problems, path, skip_bad_images=skip, **kwargs).startswith(
          f'task.source {path} row 1 {message}')


def test_source_level_errors(tmp_path, seed):
  rng = np.random.default_rng(seed)
  path = write(tmp_path / 'data.jsonl', [{'question': 'Q', 'answer': '1', 'images': ['missing.png']}] * 2)
  assert one_line_error(load_vision_problems, path, format='gsm8k') == (
      f"task.format 'gsm8k' of {path} is not one of geo3k, verl, vision")
  message = one_line_error(load_vision_problems, path, skip_bad_images=True)
  assert message.startswith(f'all 2 rows of task.source {path} were skipped for their images; the first: '
                            f'task.source {path} row 0 (images[0]: missing.png): cannot open')
  good = save(tmp_path, 'a.png', random_pixels(rng))
  path = write(tmp_path / 'verl.parquet', [record('verl', 'Q', '1', [good])])
  (problem,), _ = load_vision_problems(path, format='verl', question_field='ignored', answer_field='ignored')
  assert problem.question == f'<image>\nQ {INSTRUCTION}'


def test_chat_content_parts_and_image_tokens():
  question = '<image>\nFind x in <image>.'
  assert render_user_content(question) == [
      {'type': 'image'}, {'type': 'text', 'text': '\nFind x in '}, {'type': 'image'}, {'type': 'text', 'text': '.'}]
  assert render_user_content('<image><image>') == [{'type': 'image'}, {'type': 'image'}]
  assert render_user_content('no images') == [{'type': 'text', 'text': 'no images'}]
  assert VISION_START == '<|vision_start|>' and IMAGE_PAD == '<|image_pad|>' and VISION_END == '<|vision_end|>'
  assert expand_image_tokens(question, [4, 1]) == (
      '<|vision_start|>' + '<|image_pad|>' * 4 + '<|vision_end|>\nFind x in '
      '<|vision_start|><|image_pad|><|vision_end|>.')
  assert expand_image_tokens('text only', []) == 'text only'
  with pytest.raises(ValueError, match='2 <image> markers for 1 images'):
    expand_image_tokens(question, [4])
  with pytest.raises(ValueError, match='positive'):
    expand_image_tokens(question, [4, 0])
