"""grpo_jax.model.images against transformers' Qwen2VLImageProcessorPil, the processor Qwen2.5-VL
uses. Both resize with Pillow's bicubic filter and scale and normalise in the same dtypes, so
pixel values must be equal exactly (no tolerance); images are fresh random ones each run."""

import dataclasses
import io
import json

import numpy as np
import pytest
from PIL import Image

from grpo_jax.model.images import (ImageSettings, image_token_count, load_image, process_image,
                                  process_images, smart_resize)
from grpo_jax.errors import UserError

WHERE = 'task.source data.jsonl row 17 (images[0]: foo.png)'
SMALL = ImageSettings(min_pixels=28 * 28 * 16, max_pixels=28 * 28 * 64)  # below most test images
LARGE_MIN = ImageSettings(min_pixels=28 * 28 * 300, max_pixels=28 * 28 * 400)  # above them


@pytest.fixture(scope='module')
def transformers_qwen():
  from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl
  return image_processing_pil_qwen2_vl


def reference_processor(transformers_qwen, settings: ImageSettings):
  return transformers_qwen.Qwen2VLImageProcessorPil(
      min_pixels=settings.min_pixels, max_pixels=settings.max_pixels, patch_size=settings.patch_size,
      temporal_patch_size=settings.temporal_patch_size, merge_size=settings.merge_size,
      image_mean=list(settings.image_mean), image_std=list(settings.image_std))


def random_image(rng, height: int, width: int, mode: str = 'RGB') -> Image.Image:
  """Uniform random pixels in `mode`; P images get a random palette, 'P+t' one transparent index."""
  def noise(*channels, high=256, dtype=np.uint8):
    return rng.integers(0, high, (height, width, *channels)).astype(dtype)

  if mode == 'RGB':
    return Image.fromarray(noise(3))
  if mode in ('L', 'LA', 'RGBA'):
    return Image.fromarray(noise(*{'L': (), 'LA': (2,), 'RGBA': (4,)}[mode])).convert(mode)
  if mode in ('P', 'P+t'):
    image = Image.frombytes('P', (width, height), noise().tobytes())
    image.putpalette(rng.integers(0, 256, 768).astype(np.uint8).tobytes())
    if mode == 'P+t':
      image.info['transparency'] = int(rng.integers(0, 256))
    return image
  if mode == 'CMYK':
    return Image.frombytes('CMYK', (width, height), noise(4).tobytes())
  if mode == 'I;16':
    return Image.fromarray(noise(high=400, dtype=np.uint16))  # past 255: Pillow clips to RGB
  if mode == '1':
    return Image.fromarray(noise(high=2).astype(bool))
  raise ValueError(mode)


def assert_equal_to_reference(images, settings, reference):
  expected = reference(images=images)
  patches, grids = process_images([load_image(image, WHERE, settings) for image in images], settings)
  assert patches.dtype == np.float32 and grids.dtype == np.int64
  np.testing.assert_array_equal(grids, expected['image_grid_thw'])
  np.testing.assert_array_equal(patches, expected['pixel_values'])


SIZES = [(20, 30),  # below min_pixels: scaled up
         (200, 311), (57, 57), (28 * 5, 28 * 3),  # ordinary, a multiple of 28 already
         (1000, 773),  # above SMALL's max_pixels: scaled down
         (13, 1500), (2000, 11)]  # aspect ratios 115 and 182


@pytest.mark.parametrize('settings', [ImageSettings(), SMALL, LARGE_MIN], ids=['default', 'small', 'large_min'])
@pytest.mark.parametrize('height,width', SIZES)
def test_pixel_values_equal_transformers(seed, transformers_qwen, height, width, settings):
  image = random_image(np.random.default_rng(seed), height, width)
  assert_equal_to_reference([image], settings, reference_processor(transformers_qwen, settings))
  patches, grid = process_image(image, settings)  # without load_image: an RGB image as it is
  expected = reference_processor(transformers_qwen, settings)(images=[image])
  np.testing.assert_array_equal(patches, expected['pixel_values'])
  assert grid == tuple(expected['image_grid_thw'][0])
  assert patches.shape == (grid[1] * grid[2], 3 * 2 * 14 * 14)


@pytest.mark.parametrize('mode', ['L', 'LA', 'RGBA', 'P', 'P+t', 'CMYK', 'I;16', '1'])
def test_modes_convert_as_transformers(seed, transformers_qwen, mode):
  """Transparency (RGBA, LA, a P image's transparent index) is composited onto white, like
  transformers; the other modes take Pillow's conversion."""
  image = random_image(np.random.default_rng(seed), 61, 47, mode)
  assert_equal_to_reference([image], SMALL, reference_processor(transformers_qwen, SMALL))
  expected = reference_processor(transformers_qwen, SMALL)(images=[image])
  np.testing.assert_array_equal(process_image(image, SMALL)[0], expected['pixel_values'])


def test_batch_equals_transformers(seed, transformers_qwen):
  rng = np.random.default_rng(seed)
  images = [random_image(rng, *size, mode) for size, mode in
            zip(SIZES, ['RGB', 'RGBA', 'L', 'P', 'RGB', 'CMYK', 'RGB'], strict=True)]
  for settings in (ImageSettings(), SMALL):
    assert_equal_to_reference(images, settings, reference_processor(transformers_qwen, settings))


def test_image_token_count(seed, transformers_qwen):
  image = random_image(np.random.default_rng(seed), 224, 224)
  _, grid = process_image(image)
  assert grid == (1, 16, 16) and image_token_count(grid, merge_size=2) == 64
  _, grid = process_image(random_image(np.random.default_rng(seed), 311, 200), SMALL)
  patch_count = reference_processor(transformers_qwen, SMALL).get_number_of_image_patches(311, 200)
  assert image_token_count(grid, 2) == patch_count // 4 == grid[1] * grid[2] // 4


def test_smart_resize_equals_transformers(transformers_qwen):
  sides = [1, 2, 5, 13, 27, 28, 29, 42, 55, 56, 57, 100, 199, 333, 1000, 3001, 10007]
  bounds = [(3136, 12845056), (3136, 1003520), (12544, 50176), (200_000, 300_000)]
  for height in sides:
    for width in sides:
      for factor in (28, 32):
        for min_pixels, max_pixels in bounds:
          try:
            expected = transformers_qwen.smart_resize(height, width, factor, min_pixels, max_pixels)
          except ValueError:
            with pytest.raises(UserError, match='aspect ratio') as info:
              smart_resize(height, width, factor, min_pixels, max_pixels)
            assert '\n' not in str(info.value) and f'{width}x{height}' in str(info.value)
            continue
          assert smart_resize(height, width, factor, min_pixels, max_pixels) == expected, (height, width)


def encoded(image: Image.Image, format: str, **options) -> bytes:
  buffer = io.BytesIO()
  image.save(buffer, format=format, **options)
  return buffer.getvalue()


def test_load_image_sources_agree(seed, tmp_path):
  pixels = np.random.default_rng(seed).integers(0, 256, (37, 53, 3), dtype=np.uint8)
  png = encoded(Image.fromarray(pixels), 'PNG')
  jpeg = encoded(Image.fromarray(pixels), 'JPEG', quality=90)
  (tmp_path / 'a.png').write_bytes(png)
  (tmp_path / 'a.jpg').write_bytes(jpeg)
  for data, path in ((png, tmp_path / 'a.png'), (jpeg, tmp_path / 'a.jpg')):
    decoded = np.asarray(Image.open(io.BytesIO(data)).convert('RGB'))
    for source in (data, path, str(path), {'bytes': data, 'path': None}, {'bytes': None, 'path': str(path)},
                   {'bytes': data, 'path': 'elsewhere.png'}):
      image = load_image(source, WHERE)
      assert image.mode == 'RGB'
      np.testing.assert_array_equal(np.asarray(image), decoded)
  np.testing.assert_array_equal(np.asarray(load_image(png, WHERE)), pixels)  # PNG is lossless
  np.testing.assert_array_equal(np.asarray(load_image(pixels, WHERE)), pixels)
  np.testing.assert_array_equal(np.asarray(load_image(Image.fromarray(pixels), WHERE)), pixels)


def test_load_image_turns_exif_orientation_upright_as_datasets(seed):
  datasets_image = pytest.importorskip('datasets.features.image')
  image = random_image(np.random.default_rng(seed), 30, 50)
  exif = Image.Exif()
  exif[0x0112] = 6  # Orientation: rotate 90 degrees clockwise to view
  data = encoded(image, 'PNG', exif=exif)
  loaded = load_image({'bytes': data, 'path': None}, WHERE)
  assert loaded.size == (30, 50)
  expected = datasets_image.Image().decode_example({'bytes': data, 'path': None})
  np.testing.assert_array_equal(np.asarray(loaded), np.asarray(expected.convert('RGB')))


def assert_one_line_error(source, reason: str, settings: ImageSettings = ImageSettings()):
  with pytest.raises(UserError) as info:
    load_image(source, WHERE, settings)
  message = str(info.value)
  assert message.startswith(WHERE) and reason in message and '\n' not in message, message


def test_load_image_errors_name_where(seed, tmp_path, monkeypatch):
  image = random_image(np.random.default_rng(seed), 40, 40)
  png, jpeg = encoded(image, 'PNG'), encoded(image, 'JPEG')
  missing = tmp_path / 'missing.png'
  assert_one_line_error(missing, f'cannot open {missing} (No such file or directory)')
  assert_one_line_error({'bytes': None, 'path': str(missing)}, str(missing))
  assert_one_line_error(png[:len(png) // 2], 'cannot be decoded')
  assert_one_line_error(jpeg[:len(jpeg) // 2], 'cannot be decoded')
  assert_one_line_error(b'not an image at all', 'not an image format Pillow can read')
  assert_one_line_error(b'', 'not an image format Pillow can read')
  tight = dataclasses.replace(ImageSettings(), max_source_pixels=1599)  # the image has 1600
  for source in (png, image, np.asarray(image)):
    assert_one_line_error(source, 'the image is 40x40 = 1600 pixels, over max_source_pixels (1599)', tight)
  with monkeypatch.context() as patch:  # Pillow's own bomb limit (2 x MAX_IMAGE_PIXELS) also holds
    patch.setattr(Image, 'MAX_IMAGE_PIXELS', 700)
    assert_one_line_error(png, 'refused by Pillow: Image size (1600 pixels) exceeds limit of 1400 pixels')
  assert_one_line_error(encoded(random_image(np.random.default_rng(seed), 1, 300), 'PNG'), 'aspect ratio')
  assert_one_line_error(np.zeros((4, 4), np.uint8), 'must be uint8 [height, width, 3]')
  assert_one_line_error({'bytes': None, 'path': None}, 'neither "bytes" nor "path"')
  assert_one_line_error(12, 'not int')


HUB_CONFIG = {  # Qwen/Qwen2.5-VL-7B-Instruct's preprocessor_config.json
    'min_pixels': 3136, 'max_pixels': 12845056, 'patch_size': 14, 'temporal_patch_size': 2,
    'merge_size': 2, 'image_mean': [0.48145466, 0.4578275, 0.40821073],
    'image_std': [0.26862954, 0.26130258, 0.27577711], 'image_processor_type': 'Qwen2VLImageProcessor',
    'processor_class': 'Qwen2_5_VLProcessor', 'do_convert_rgb': True, 'do_normalize': True,
    'do_rescale': True, 'do_resize': True, 'resample': 3, 'rescale_factor': 0.00392156862745098}


@pytest.mark.parametrize('layout,bounds', [
    ('hub', (3136, 12845056)),
    ('size', (12544, 50176)),
    ('both', (3136, 12845056)),  # top-level min_pixels/max_pixels win over size, as in transformers
    ('neither', (3136, 1003520)),  # transformers' class defaults
])
def test_settings_from_checkpoint(seed, tmp_path, monkeypatch, transformers_qwen, layout, bounds):
  config = dict(HUB_CONFIG)
  if layout in ('size', 'both'):
    config['size'] = {'shortest_edge': 12544, 'longest_edge': 50176}
  if layout in ('size', 'neither'):
    del config['min_pixels'], config['max_pixels']
  (tmp_path / 'preprocessor_config.json').write_text(json.dumps(config))
  settings = ImageSettings.from_checkpoint(str(tmp_path))
  assert (settings.min_pixels, settings.max_pixels) == bounds
  if layout == 'hub':
    assert settings == ImageSettings()
  monkeypatch.setenv('HF_HUB_OFFLINE', '1')
  processor_class = transformers_qwen.Qwen2VLImageProcessorPil
  reference = processor_class.from_pretrained(str(tmp_path))
  assert (reference.size['shortest_edge'], reference.size['longest_edge']) == bounds
  image = random_image(np.random.default_rng(seed), 300, 170, 'RGBA')
  assert_equal_to_reference([image], settings, reference)

  overridden = ImageSettings.from_checkpoint(str(tmp_path), min_pixels=5000, max_pixels=60000)
  reference = processor_class.from_pretrained(str(tmp_path), min_pixels=5000, max_pixels=60000)
  assert (overridden.min_pixels, overridden.max_pixels) == (5000, 60000)
  assert (reference.size['shortest_edge'], reference.size['longest_edge']) == (5000, 60000)


def test_settings_from_checkpoint_errors(tmp_path):
  def assert_refused(config, reason):
    if config is not None:
      (tmp_path / 'preprocessor_config.json').write_text(json.dumps(config))
    with pytest.raises(UserError, match=reason) as info:
      ImageSettings.from_checkpoint(str(tmp_path))
    assert '\n' not in str(info.value)

  assert_refused(None, 'has no preprocessor_config.json')
  assert_refused(dict(HUB_CONFIG, do_normalize=False), 'sets do_normalize to False; only True is implemented')
  assert_refused(dict(HUB_CONFIG, resample=2), 'sets resample to 2')
  assert_refused(dict(HUB_CONFIG, min_pixels=10**8), r'min_pixels \(100000000\) must not exceed max_pixels')
  assert_refused({'size': {'shortest_edge': 3136}}, 'has neither max_pixels nor size.longest_edge')
