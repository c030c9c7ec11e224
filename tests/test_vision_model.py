"""Qwen2.5-VL against transformers' Qwen2_5_VLForConditionalGeneration on random checkpoints: logits
of batches mixing rows with one image, two images of different sizes and none (left-padded), the
M-RoPE positions and offsets against its get_rope_index, greedy decoding against its generate, and
conversion both ways bit for bit under the hub's tensor names."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from grpo_jax.errors import UserError
from grpo_jax.model import vision
from grpo_jax.model.hf_config import from_hf_dict
from grpo_jax.model.loading import from_pretrained
from grpo_jax.testing import TINY_VL_TOKENS

IMAGE, START, END = TINY_VL_TOKENS['image_token_id'], TINY_VL_TOKENS['vision_start_token_id'], \
    TINY_VL_TOKENS['vision_end_token_id']

# Shapes: the tiny tower (windows of 2 x 2 merged blocks, one full-attention block); a wider head with
# more heads, windows of one block and two full blocks, tied embeddings; an uneven M-RoPE split.
CASES = {
    'windows-2': dict(),
    'tied-windows-1': dict(tie_word_embeddings=True, hidden_size=96, num_attention_heads=6, num_key_value_heads=3,
                           mrope_section=(2, 2, 4),
                           vision_config=dict(hidden_size=48, num_heads=4, window_size=28, depth=4,
                                              fullatt_block_indexes=[0, 3])),
    'one-window': dict(mrope_section=(4, 2, 2), vision_config=dict(window_size=224, fullatt_block_indexes=[])),
}


def image_batch(rng, config, grids_per_row, text_lengths):
  """Left-padded prompts: each row's text, then per image <|vision_start|> its image tokens
  <|vision_end|> and more text. -> tokens, mask [B, T], each row's (patches, grid) pairs."""
  rows, images = [], []
  for row_grids, length in zip(grids_per_row, text_lengths):
    row, own = list(rng.integers(0, 900, length)), []
    for grid in row_grids:
      row += [START] + [IMAGE] * vision.image_tokens(grid, config.vision) + [END] + list(rng.integers(0, 900, 2))
      own.append((rng.normal(size=(int(np.prod(grid)), config.vision.patch_dim)).astype(np.float32), grid))
    rows.append(row)
    images.append(own)
  width = max(map(len, rows))
  tokens, mask = np.zeros((len(rows), width), np.int64), np.zeros((len(rows), width), np.int64)
  for b, row in enumerate(rows):
    tokens[b, width - len(row):], mask[b, width - len(row):] = row, 1
  return tokens, mask, images


def grids_of(images):
  return [[grid for _, grid in row] for row in images]


def transformers_inputs(tokens, mask, images):
  """The same batch as transformers takes it: every image's patches concatenated in row-major order."""
  import torch
  flat = [pair for row in images for pair in row]
  return dict(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask),
              pixel_values=torch.tensor(np.concatenate([patches for patches, _ in flat])),
              image_grid_thw=torch.tensor([grid for _, grid in flat]),
              mm_token_type_ids=torch.tensor((tokens == IMAGE).astype(np.int32)))


@pytest.mark.parametrize('case', [pytest.param(case, marks=pytest.mark.exhaustive if case == 'tied-windows-1' else ())
                                  for case in sorted(CASES)])
def test_logits_and_positions_match_transformers(case, seed, make_hf_checkpoint):
  import torch

  directory, reference = make_hf_checkpoint(seed, model_type='qwen2_5_vl', **CASES[case])
  model = from_pretrained(directory)
  config = model.config
  rng = np.random.default_rng(seed)
  # One image of 8 x 12 patches (several windows), two of different sizes, none; one row in the middle.
  tokens, mask, images = image_batch(rng, config, [[(1, 8, 12)], [(1, 4, 4), (1, 8, 4)], [], [(1, 6, 2)]],
                                     [3, 1, 9, 2])
  inputs = transformers_inputs(tokens, mask, images)
  with torch.no_grad():
    expected = reference(**inputs).logits.numpy()
    expected_positions, expected_offsets = reference.model.get_rope_index(
        inputs['input_ids'], mm_token_type_ids=inputs['mm_token_type_ids'], image_grid_thw=inputs['image_grid_thw'],
        attention_mask=inputs['attention_mask'])
  positions, offsets = vision.mrope_positions(tokens, mask, grids_of(images), config)
  np.testing.assert_array_equal(positions, expected_positions.numpy().transpose(1, 2, 0) * mask[..., None])
  np.testing.assert_array_equal(offsets, expected_offsets.numpy()[:, 0])
  laid_out = vision.layout_images(images, tokens, mask, config.vision)
  logits = np.asarray(model(jnp.asarray(tokens), positions=jnp.asarray(positions), segment_ids=jnp.asarray(mask),
                            images=laid_out))
  real = mask.astype(bool)
  np.testing.assert_allclose(logits[real], expected[real], rtol=0, atol=1e-4)
  # Padded to a bucket (more patches per image, an extra image slot): the same logits.
  bucketed = vision.layout_images(images, tokens, mask, config.vision, max_patches=128, max_images=3)
  again = np.asarray(model(jnp.asarray(tokens), positions=jnp.asarray(positions), segment_ids=jnp.asarray(mask),
                           images=bucketed))
  np.testing.assert_allclose(again[real], logits[real], rtol=0, atol=1e-5)


@pytest.mark.exhaustive
def test_greedy_decoding_matches_generate(seed, make_hf_checkpoint):
  import torch

  directory, reference = make_hf_checkpoint(seed, model_type='qwen2_5_vl')
  model = from_pretrained(directory)
  tokens, mask, images = image_batch(np.random.default_rng(seed), model.config,
                                     [[(1, 4, 8)], [], [(1, 4, 4), (1, 2, 6)]], [2, 7, 1])
  steps = 8
  with torch.no_grad():
    expected = reference.generate(**transformers_inputs(tokens, mask, images), max_new_tokens=steps,
                                  do_sample=False).numpy()[:, tokens.shape[1]:]
  positions, offsets = vision.mrope_positions(tokens, mask, grids_of(images), model.config)
  cache = model.init_cache(len(tokens), tokens.shape[1] + steps)
  logits, cache = model.extend(jnp.asarray(tokens), cache, positions=jnp.asarray(positions),
                               segment_ids=jnp.asarray(mask),
                               images=vision.layout_images(images, tokens, mask, model.config.vision))
  decoded = [np.asarray(jnp.argmax(logits[:, -1], -1))]
  for _ in range(steps - 1):
    logits, cache = model.extend(jnp.asarray(decoded[-1][:, None]), cache, position_offsets=jnp.asarray(offsets))
    decoded.append(np.asarray(jnp.argmax(logits[:, -1], -1)))
  np.testing.assert_array_equal(np.stack(decoded, axis=1), expected)


def test_conversion_both_ways_is_bit_exact_under_the_hub_names(seed, make_hf_checkpoint, tmp_path):
  import transformers

  from conversion import hf_to_orbax, orbax_to_hf

  directory, _ = make_hf_checkpoint(seed, model_type='qwen2_5_vl', **CASES['tied-windows-1'])
  processor = {'min_pixels': 3136, 'max_pixels': 50176, 'patch_size': 14, 'merge_size': 2, 'temporal_patch_size': 2}
  with open(os.path.join(directory, 'preprocessor_config.json'), 'w') as f:
    json.dump(processor, f)
  hf_to_orbax.main(['--hf', directory, '--out', str(tmp_path / 'orbax')])
  orbax_to_hf.main(['--ckpt', str(tmp_path / 'orbax'), '--out', str(tmp_path / 'back')])
  original, back = load_file(os.path.join(directory, 'model.safetensors')), load_file(tmp_path / 'back' / 'model.safetensors')
  assert {'visual.blocks.3.attn.qkv.weight', 'visual.patch_embed.proj.weight', 'model.layers.1.mlp.up_proj.weight',
          'visual.merger.mlp.2.bias'} <= set(back)
  assert set(back) == set(original)
  for name, tensor in original.items():
    np.testing.assert_array_equal(back[name], tensor, err_msg=name)
  assert json.loads((tmp_path / 'back' / 'preprocessor_config.json').read_text()) == processor
  raw = json.loads((tmp_path / 'back' / 'config.json').read_text())
  assert from_hf_dict(raw) == from_pretrained(directory).config
  read = transformers.AutoConfig.from_pretrained(tmp_path / 'back')
  assert read.text_config.rope_parameters['mrope_section'] == [2, 2, 4]
  assert (read.vision_config.depth, read.vision_config.fullatt_block_indexes, read.image_token_id) == (4, [0, 3], IMAGE)


def test_the_hubs_config_layout_is_read_as_transformers_5_writes_it(make_hf_checkpoint, tmp_path):
  """The hub's Qwen2.5-VL config.json (text fields at the top, rope_scaling.mrope_section, in_chans)
  and transformers 5.x's (text_config, rope_parameters) describe the same model."""
  directory, _ = make_hf_checkpoint(0, model_type='qwen2_5_vl')
  nested = json.loads(open(os.path.join(directory, 'config.json')).read())
  text, vision_config = nested['text_config'], dict(nested['vision_config'])
  vision_config['in_chans'] = vision_config.pop('in_channels')
  vision_config['spatial_patch_size'] = vision_config.pop('patch_size')
  hub = {**{k: v for k, v in text.items() if k != 'rope_parameters'}, 'model_type': 'qwen2_5_vl',
         'architectures': ['Qwen2_5_VLForConditionalGeneration'], 'rope_theta': text['rope_parameters']['rope_theta'],
         'rope_scaling': {'type': 'mrope', 'mrope_section': text['rope_parameters']['mrope_section']},
         'vision_config': vision_config, **TINY_VL_TOKENS}
  assert from_hf_dict(hub) == from_hf_dict(nested)
  assert from_hf_dict(nested).vision.fullatt_block_indexes == (1,)


def test_image_token_count_mismatch_is_one_line(seed, make_hf_checkpoint):
  directory, _ = make_hf_checkpoint(seed, model_type='qwen2_5_vl')
  config = from_pretrained(directory).config
  tokens, mask, images = image_batch(np.random.default_rng(seed), config, [[(1, 4, 4)]], [3])
  fewer = np.delete(tokens, int(np.flatnonzero(tokens[0] == IMAGE)[0]), axis=1)  # 3 image tokens for 4 features
  with pytest.raises(UserError, match=r'^row 0: the prompt holds 3 image tokens but its 1 images have 4 features'):
    vision.layout_images(images, fewer, np.ones_like(fewer), config.vision)
  with pytest.raises(UserError, match='needs 4 consecutive image tokens'):
    vision.mrope_positions(fewer, np.ones_like(fewer), grids_of(images), config)


def test_presets_count_the_model_cards_parameters():
  """--model-size Qwen2.5-VL-*: the hub configs' shapes, totals as the model cards give them."""
  from grpo_jax.model.presets import preset

  totals = {size: round(preset(f'Qwen2.5-VL-{size}').num_params() / 1e9, 2) for size in ('3B', '7B', '72B')}
  assert totals == {'3B': 3.75, '7B': 8.29, '72B': 73.41}
  tower = preset('Qwen2.5-VL-7B').vision
  assert (tower.depth, tower.hidden_size, tower.fullatt_block_indexes, tower.out_hidden_size) == (32, 1280, (7, 15, 23, 31),
                                                                                                   3584)
