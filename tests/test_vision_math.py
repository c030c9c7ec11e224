"""The math task with images (Geometry3K-style problems): prompts hold each image's image tokens,
every batch's images share one bucket, overlong and bad rows are counted, and a run with images
trains and evaluates in-process, on a tiny random Qwen2.5-VL checkpoint and a character-level
tokenizer with a ChatML template that renders image parts as Qwen2.5-VL's does."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from flax import nnx

from grpo_jax import config as config_lib
from grpo_jax import evaluation
from grpo_jax.data import math_task
from grpo_jax.model.images import ImageSettings, load_image, process_image
from grpo_jax.errors import UserError
from grpo_jax.model.vision import image_tokens, patch_bucket
from grpo_jax.testing import TINY_VL_TOKENS, save_random_hf_checkpoint
from runs import read_metrics, train_here
from test_multimodal_data import png, write

pytestmark = pytest.mark.xdist_group('test_vision_math')  # one worker makes the module's checkpoint

IMAGE_PAD_ID = TINY_VL_TOKENS['image_token_id']
SPECIAL = {'<|image_pad|>': IMAGE_PAD_ID, '<|video_pad|>': TINY_VL_TOKENS['video_token_id'],
           '<|vision_start|>': TINY_VL_TOKENS['vision_start_token_id'],
           '<|vision_end|>': TINY_VL_TOKENS['vision_end_token_id']}
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
                 "{% else %}{% for part in m['content'] %}{% if part['type'] == 'image' %}"
                 "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ part['text'] }}{% endif %}{% endfor %}"
                 "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# The checkpoint's processor: one to four merged 2 x 2 blocks of 14-pixel patches per image.
PROCESSOR = dict(min_pixels=28 * 28, max_pixels=56 * 56, patch_size=14, temporal_patch_size=2, merge_size=2)
QUESTION = '<image>Find x.'  # 28 prompt tokens besides the image's pads (ChatML turns, one per character)


def write_tokenizer(directory: str) -> None:
  """One token per printable character, ChatML's turn tokens, and Qwen2.5-VL's vision tokens at the
  tiny checkpoint's ids (990-993); the ids between are fillers, so every id is below 1000."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers
  from transformers import PreTrainedTokenizerFast

  tokens = ['<|endoftext|>', '<|im_start|>', '<|im_end|>', '\n'] + [chr(c) for c in range(32, 127)]
  tokens += [f'<unused{i}>' for i in range(min(SPECIAL.values()) - len(tokens))] + list(SPECIAL)
  vocab = {token: index for index, token in enumerate(tokens)}
  assert all(vocab[token] == index for token, index in SPECIAL.items())
  core = Tokenizer(models.WordLevel(vocab, unk_token='<|endoftext|>'))
  core.pre_tokenizer = pre_tokenizers.Split('', 'isolated')
  core.decoder = decoders.Fuse()
  tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token='<|im_end|>', pad_token='<|endoftext|>',
                                      additional_special_tokens=['<|im_start|>', *SPECIAL])
  tokenizer.chat_template = CHAT_TEMPLATE
  tokenizer.save_pretrained(directory)


@pytest.fixture(scope='module')
def checkpoint(tmp_path_factory) -> str:
  """A tiny random Qwen2.5-VL checkpoint with its tokenizer and preprocessor_config.json."""
  directory = str(tmp_path_factory.mktemp('vl') / 'hf')
  save_random_hf_checkpoint(directory, 0, model_type='qwen2_5_vl')
  write_tokenizer(directory)
  with open(f'{directory}/preprocessor_config.json', 'w') as f:
    json.dump(PROCESSOR, f)
  return directory


def geo3k_records(rng, sides) -> list[dict]:
  """Geometry3K's schema, one random PNG of each (height, width) in `sides`; answer i for row i."""
  return [{'images': [{'bytes': png(rng.integers(0, 256, (*side, 3), dtype=np.uint8)), 'path': None}],
           'problem': QUESTION, 'answer': str(row)} for row, side in enumerate(sides)]


def math_config(tmp_path, checkpoint: str, source: str, **sections) -> str:
  """A config file for a math run with images on the tiny checkpoint; `sections` update its own."""
  config = {'run': {'name': 'vision_math', 'seed': 0}, 'model': {'path': checkpoint},
            'task': {'name': 'math', 'source': source, 'format': 'geo3k', 'max_prompt_tokens': 32,
                     'reward_workers': 1},
            'rollout': {'prompts_per_step': 2, 'max_new_tokens': 4},
            'algo': {'group_size': 2}, 'optim': {'learning_rate': 1e-3},
            'train': {'steps': 2, 'checkpoint_every': 0, 'progress': False, 'tensorboard': False}}
  for name, fields in sections.items():
    config[name] = {**config.get(name, {}), **fields}
  path = tmp_path / 'config.yaml'
  path.write_text(yaml.safe_dump(config))
  return str(path)


def test_prompts_hold_each_images_tokens_in_one_bucket(tmp_path, checkpoint, seed, capfd):
  rng = np.random.default_rng(seed)
  # task.max_pixels (3 x 3 blocks) over the checkpoint's 2 x 2: the 84 x 84 image takes 9 image
  # tokens, 37 in all, over max_prompt_tokens (32); the others at most 4.
  sides = [(int(h), int(w)) for h, w in rng.integers(20, 60, (7, 2))] + [(84, 84)]
  records = geo3k_records(rng, sides)
  source = write(tmp_path / 'train.parquet', records)
  config = config_lib.load_config(math_config(tmp_path, checkpoint, source), ['task.max_pixels=7056'])
  task = math_task.build(config)
  try:
    assert f'kept 7 of 8 records; skipped 1 longer than task.max_prompt_tokens=32, 0 for their images' in \
        capfd.readouterr().err
    problems, inputs = task.problems, task.image_inputs
    assert inputs.settings == ImageSettings(**{**PROCESSOR, 'max_pixels': 7056})
    assert sorted(map(int, problems.answers)) == list(range(7))
    vision = inputs.architecture.vision
    largest = 0
    for ids, answer, images, text in zip(problems.prompt_ids, problems.answers, problems.images, problems.texts):
      (patches, grid), = images
      expected, _ = process_image(load_image(records[int(answer)]['images'][0]['bytes'], 'test'), inputs.settings)
      np.testing.assert_array_equal(patches, expected)
      assert np.sum(ids == IMAGE_PAD_ID) == image_tokens(grid, vision) == len(ids) - 28
      assert text == '<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Find x.<|im_end|>\n' \
                     '<|im_start|>assistant\n'
      largest = max(largest, len(patches))
    # The largest image's patches, rounded up to whole attention windows (16 patches here).
    bucket = patch_bucket(largest, vision)
    assert task.vision_bucket == (1, bucket) and largest <= bucket and bucket % 16 == 0
    # The plan's bucket, without the data: 9 image tokens (7056 pixels) of 4 patches each, in windows.
    assert math_task.shape(config, inputs.architecture).vision_bucket == (1, patch_bucket(36, vision)) == (1, 48)
    shapes = set()
    for position in (0, 2, 4, 6, 8):  # across an epoch's end: one shape for every batch
      prompts = task.prompts(jax.random.key(0), position, 2)
      images = prompts.vision.images
      shapes.add(jax.tree.map(lambda x: x.shape, prompts.vision))
      assert images.patches.shape == (2, 1, bucket, vision.patch_dim) and images.patches.dtype == np.float32
      tokens = np.asarray(prompts.tokens)
      placement = np.asarray(images.placement)
      for row, index in enumerate(task.order(position, 2)):
        (patches, grid), = problems.images[index]
        assert np.sum(tokens[row] == IMAGE_PAD_ID) == np.sum(placement[row] >= 0) == image_tokens(grid, vision)
        np.testing.assert_array_equal(np.asarray(images.patches[row, 0, :len(patches)]), patches)
        assert not np.asarray(images.patches[row, 0, len(patches):]).any()
    assert len(shapes) == 1
  finally:
    task.close()
  # bfloat16 compute: the problems' patches are kept in it (the tower casts them to it first).
  config = config_lib.load_config(math_config(tmp_path, checkpoint, source), ['model.dtype=bfloat16'])
  task = math_task.build(config)
  task.close()
  assert task.image_inputs.settings == ImageSettings(**PROCESSOR)
  assert all(patches.dtype == jnp.bfloat16 for row in task.problems.images for patches, _ in row)
  patches = task.prompts(jax.random.key(0), 0, 2).vision.images.patches
  assert patches.dtype == np.float32
  rows = [task.problems.images[index][0][0] for index in task.order(0, 2)]
  for row, expected in enumerate(rows):
    np.testing.assert_array_equal(np.asarray(patches[row, 0, :len(expected)]), expected.astype(np.float32))


def test_bad_images_stop_the_load_or_are_skipped(tmp_path, checkpoint, seed, capfd):
  records = geo3k_records(np.random.default_rng(seed), [(30, 30)] * 3)
  records[1]['images'] = [{'bytes': b'not an image', 'path': None}]
  source = write(tmp_path / 'bad.parquet', records)
  path = math_config(tmp_path, checkpoint, source)
  with pytest.raises(UserError) as raised:
    math_task.build(config_lib.load_config(path))
  assert str(raised.value) == f'task.source {source} row 1 (images[0]): not an image format Pillow can read'
  task = math_task.build(config_lib.load_config(path, ['task.skip_bad_images=true']))
  task.close()
  assert sorted(task.answers) == ['0', '2']
  assert ('kept 2 of 3 records; skipped 0 longer than task.max_prompt_tokens=32, 1 for their images (the first: '
          f'task.source {source} row 1 (images[0]): not an image format Pillow can read)') in capfd.readouterr().err


def test_runs_with_images_are_checked(tmp_path):
  base = ['task.name=math', 'task.source=data.parquet', 'task.format=geo3k', 'task.tokenizer=tok']
  with pytest.raises(UserError, match='^model.architecture.vision must describe a vision tower: format geo3k'):
    config_lib.load_config(None, base)
  vision = ['model.architecture.vision={}', 'model.architecture.mrope_section=[2, 3, 3]',
            'model.architecture.vocab_size=152064']
  config_lib.load_config(None, base + vision + ['algo.packing=true', 'algo.max_lag=1', 'algo.tis_cap=2'])
  with pytest.raises(UserError, match='^task.min_pixels .* must not exceed task.max_pixels'):
    config_lib.load_config(None, base + vision + ['task.min_pixels=100', 'task.max_pixels=10'])


def checksum(completions, references, lengths):
  """A reward term that tells a group's (random) answers apart, so the update has a gradient."""
  return [float(sum(map(ord, text)) % 97) for text in completions]


@pytest.mark.exhaustive
def test_a_run_with_images_trains_and_evaluates_pass_at_k(tmp_path, checkpoint, seed, monkeypatch):
  sampled = []  # the images each evaluation batch is sampled with

  class Recording(evaluation.GroupSampler):
    def __call__(self, state, prompts, prompt_mask, key, vision=None):
      sampled.append(np.sum(np.asarray(vision.images.placement) >= 0, axis=1))
      return super().__call__(state, prompts, prompt_mask, key, vision)

  monkeypatch.setattr(evaluation, 'GroupSampler', Recording)
  rng = np.random.default_rng(seed)
  train_source = write(tmp_path / 'train.parquet', geo3k_records(rng, rng.integers(20, 60, (6, 2)).tolist()))
  eval_source = write(tmp_path / 'test.parquet', geo3k_records(rng, rng.integers(20, 60, (3, 2)).tolist()))
  config = math_config(tmp_path, checkpoint, train_source,
                       eval={'source': eval_source, 'split': 'train', 'format': 'geo3k', 'every': 2, 'samples': 2,
                             'k': 2, 'greedy': False, 'batch_prompts': 2})
  history = train_here(tmp_path / 'run', config, 'rewards=[{name: "test_vision_math:checksum"}]')
  assert [row['step'] for row in history] == [1, 2]
  assert all(math.isfinite(row['policy_loss']) and math.isfinite(row['grad_norm']) for row in history)
  assert max(row['grad_norm'] for row in history) > 0
  evaluated = read_metrics(tmp_path / 'run')[-1]
  assert evaluated['eval/problems'] == 3
  assert all(0.0 <= evaluated[f'eval/{name}'] <= 1.0 for name in ('pass@1', 'pass@2', 'maj@2', 'mean@2'))
  with open(tmp_path / 'run' / 'eval' / 'samples_2.jsonl') as f:
    rows = [json.loads(line) for line in f]
  assert [row['reference'] for row in rows] == ['0', '1', '2'] and all(len(row['samples']) == 2 for row in rows)
  assert all('<|image_pad|>' in row['prompt'] for row in rows)
  # Two evaluations (steps 0 and 2) of two batches, each prompt with its image's tokens placed.
  assert len(sampled) == 4 and all(np.all(placed >= 1) for placed in sampled)


@pytest.mark.exhaustive
@pytest.mark.parametrize('adapters', [[], ['model.lora.rank=4', 'model.lora.targets=[q, v, gate]']],
                         ids=['full', 'lora'])
def test_split_devices_sample_image_prompts_as_their_versions(tmp_path, checkpoint, seed, adapters):
  """A math run with images on split devices (4 sampler, 4 trainer devices, max_lag 1), its
  parameters trained in full or LoRA's adapters (each version's adapters cross to the sampler and
  join the base there): the prompts' images cross to the sampler's devices and back with their
  groups, and each token's recorded log-prob is what the weights of its version give with the
  images (the tower included), after the prompt and the tokens before it."""
  from test_split import split_steps

  from grpo_jax.model.vision import extended, model_inputs
  from grpo_jax.rl.loss import completion_log_probs

  rng = np.random.default_rng(seed)
  source = write(tmp_path / 'train.parquet', geo3k_records(rng, rng.integers(20, 60, (8, 2)).tolist()))
  path = math_config(tmp_path, checkpoint, source, rollout={'devices': 4, 'max_new_tokens': 6},
                     algo={'group_size': 2, 'max_lag': 1, 'tis_cap': 2, 'entropy_coef': 0.5},
                     optim={'learning_rate': 0.05, 'warmup_steps': 0})
  run = split_steps(config_lib.load_config(path, ['rewards=[{name: "test_vision_math:checksum"}]',
                                                  f'run.seed={seed}', *adapters]), 4)
  assert (run['state'].frozen is not None) == bool(adapters)
  graphdef, temperature = run['graphdef'], run['rl_step'].update_settings.temperature

  @jax.jit
  def log_probs(params, tokens, segments, vision):
    return completion_log_probs(nnx.merge(graphdef, params), tokens, segments, 6, temperature=temperature,
                                implementation='auto', **model_inputs(vision))[0]

  checked, versions_seen = 0, set()
  with jax.set_mesh(run['mesh']):
    for step, (tokens, mask, rollout, vision) in enumerate(run['learned']):
      rows = np.repeat(np.arange(len(tokens)), rollout.tokens.shape[0] // len(tokens))
      assert np.all(np.sum(vision.images.placement >= 0, axis=1) >= 1)  # every prompt's image tokens placed
      full = np.concatenate([tokens[rows], rollout.tokens], axis=1)
      segments = np.concatenate([mask[rows], rollout.sequence_mask], axis=1).astype(np.int32)
      rows_vision = extended(jax.tree.map(lambda x: x[rows], vision), mask[rows], rollout.sequence_mask)
      for version in np.unique(rollout.versions[rollout.mask]):
        at = (rollout.versions == version) & rollout.mask
        expected = np.asarray(log_probs(run['weights'][version], full, segments, rows_vision))
        np.testing.assert_allclose(rollout.log_probs[at], expected[at], atol=2e-5,
                                   err_msg=f'step {step} version {version}')
        checked += int(at.sum())
        versions_seen.add((step, int(version)))
  assert checked > 0 and any(version < step for step, version in versions_seen)  # trained a version behind
