"""Reward models as models: the decoder with a score head of one label (Qwen2, Qwen3 and Llama
sequence classifiers), equal to transformers' scores, converted both ways, laid out on a mesh, and
refused in one line where the checkpoint is not one."""

import json
import os

import jax
import numpy as np
import pytest
import torch

from grpo_jax.errors import UserError
from grpo_jax.model import MeshConfig, from_pretrained, make_mesh
from grpo_jax.testing import left_padded, random_prompts

PAD = 0  # the tiny checkpoints' pad id (random_hf_model, head='score'); random_prompts never draws it
SHAPES = {  # model_type -> extra config fields: several shapes, tied and untied embeddings
    'qwen2': dict(tie_word_embeddings=True),
    'qwen3': dict(num_attention_heads=8, num_key_value_heads=2, head_dim=16),
    'llama': dict(num_hidden_layers=3, num_key_value_heads=4, tie_word_embeddings=False),
}


def _batch(seed):
  """Rows as a reward model sees them: left-padded prompts of several lengths; one row that ends
  in the pad id (a completion closed by an eos that is the pad id: attended, not read), and one
  right-padded row. -> (tokens [B, T], mask [B, T], the position transformers reads in each row)."""
  rows = random_prompts(seed, [7, 12, 3, 9])
  tokens, mask = left_padded(rows, PAD, width=14)
  tokens[1, -2:], mask[1, -2:] = PAD, 1  # ends in the pad id twice, both real tokens of the sequence
  tokens[2], mask[2] = PAD, 0
  tokens[2, :3], mask[2, :3] = rows[2], 1  # right-padded
  return tokens, mask, np.array([13, 11, 2, 13])


def _torch_scores(model, tokens, mask):
  with torch.no_grad():
    return model(input_ids=torch.tensor(tokens, dtype=torch.long),
                 attention_mask=torch.tensor(mask, dtype=torch.long)).logits.float().numpy()


@pytest.mark.parametrize('model_type', list(SHAPES))
def test_scores_equal_transformers_sequence_classifier(model_type, seed, make_hf_checkpoint):
  directory, reference = make_hf_checkpoint(seed, model_type=model_type, head='score', **SHAPES[model_type])
  assert type(reference).__name__.endswith('ForSequenceClassification')
  model = from_pretrained(directory)
  assert model.config.num_labels == 1 and model.config.pad_token_id == PAD and not hasattr(model, 'lm_head')
  tokens, mask, read = _batch(seed)
  want = _torch_scores(reference, tokens, mask)
  got = np.asarray(jax.jit(lambda t, m: model(t, segment_ids=m))(tokens, mask))
  assert got.shape == (4, 1)
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
  # The read position is transformers': reading the last real token instead (the pad id that ends
  # row 1) gives another score.
  hidden = np.asarray(model.hidden_states(tokens, segment_ids=mask))
  at = hidden[np.arange(4), read] @ np.asarray(model.score[...])
  np.testing.assert_allclose(at, want, rtol=0, atol=1e-4)
  wrong = hidden[1, 13] @ np.asarray(model.score[...])
  assert abs(float(wrong[0]) - float(want[1, 0])) > 1e-3


@pytest.mark.exhaustive
def test_scores_on_a_mesh_equal_one_device(seed, make_hf_checkpoint):
  directory, reference = make_hf_checkpoint(seed, model_type='qwen3', head='score', **SHAPES['qwen3'])
  tokens, mask, _ = _batch(seed)
  mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
  model = from_pretrained(directory, mesh=mesh)
  assert model.score[...].sharding.spec[0] == 'fsdp'
  with jax.set_mesh(mesh):
    got = jax.jit(lambda t, m: model(t, segment_ids=m))(tokens, mask)
  np.testing.assert_allclose(np.asarray(got), _torch_scores(reference, tokens, mask), rtol=0, atol=1e-4)


def test_a_reward_model_converts_both_ways_and_transformers_scores_it_the_same(seed, make_hf_checkpoint, tmp_path):
  from transformers import AutoModelForSequenceClassification

  from test_conversion import convert_both_ways
  from grpo_jax.model.weights import HFCheckpoint
  hf_dir, reference = make_hf_checkpoint(seed, model_type='llama', head='score', shard_size='200KB')
  orbax_dir, back_dir = convert_both_ways(hf_dir, tmp_path)
  original, restored = HFCheckpoint(hf_dir), HFCheckpoint(back_dir)
  assert sorted(restored.names()) == sorted(original.names()) and 'score.weight' in original.names()
  for name in original.names():
    assert np.array_equal(restored.tensor(name), original.tensor(name)), name
  with open(os.path.join(back_dir, 'config.json')) as f:
    written = json.load(f)
  assert written['architectures'] == ['LlamaForSequenceClassification']
  assert written['pad_token_id'] == PAD and written['num_labels'] == 1
  reloaded = AutoModelForSequenceClassification.from_pretrained(back_dir).eval()
  assert type(reloaded) is type(reference)
  tokens, mask, _ = _batch(seed)
  np.testing.assert_array_equal(_torch_scores(reloaded, tokens, mask), _torch_scores(reference, tokens, mask))
  np.testing.assert_allclose(np.asarray(from_pretrained(orbax_dir)(tokens, segment_ids=mask)),
                             _torch_scores(reference, tokens, mask), rtol=0, atol=1e-4)


def _edit_config(directory, **changes):
  path = os.path.join(directory, 'config.json')
  with open(path) as f:
    config = json.load(f)
  config.update(changes)
  for key, value in changes.items():
    if value is None:
      config.pop(key)
  with open(path, 'w') as f:
    json.dump(config, f)


def test_a_reward_model_checkpoint_that_is_not_one_is_refused_in_one_line(seed, make_hf_checkpoint):
  directory, _ = make_hf_checkpoint(seed, head='score')
  _edit_config(directory, id2label={'0': 'bad', '1': 'good'}, label2id=None, num_labels=None)
  with pytest.raises(UserError, match=r'config.json: a score head of 2 labels \(id2label\); a reward model has one'):
    from_pretrained(directory)
  _edit_config(directory, id2label={'0': 'LABEL_0'}, architectures=['MistralForSequenceClassification'])
  with pytest.raises(UserError, match='unsupported architecture MistralForSequenceClassification'):
    from_pretrained(directory)
  _edit_config(directory, architectures=['Qwen2ForSequenceClassification'], pad_token_id=None)
  model = from_pretrained(directory)
  tokens, mask, _ = _batch(seed)
  assert np.asarray(model(tokens[:1], segment_ids=mask[:1])).shape == (1, 1)  # one row: its last position
  with pytest.raises(UserError, match='without pad_token_id scores one row at a time, got 4'):
    model(tokens, segment_ids=mask)
  with pytest.raises(UserError, match='has no lm_head'):
    model.lm_head_weight()


def test_a_reward_model_and_its_tokenizer_are_checked_to_belong_together(seed, make_hf_checkpoint, tmp_path):
  import shutil

  from test_math_task import chat_tokenizer_dir
  from grpo_jax.model import load_reward_model
  tokens = chat_tokenizer_dir(tmp_path / 'tok')  # 302 ids, padding with <|endoftext|> = 0
  directory, _ = make_hf_checkpoint(seed, model_type='qwen3', head='score', vocab_size=320)
  with pytest.raises(UserError, match='has no tokenizer'):
    load_reward_model(directory)
  for name in os.listdir(tokens):
    shutil.copy(os.path.join(tokens, name), directory)
  model, tokenizer = load_reward_model(directory)
  assert model.config.num_labels == 1 and tokenizer.pad_token_id == model.config.pad_token_id == 0
  _edit_config(directory, pad_token_id=301)
  with pytest.raises(UserError, match=r"tokenizer pads with id 0 \('<\|endoftext\|>'\), but config.json's "
                                      r'pad_token_id is 301: the score would be read at the wrong token'):
    load_reward_model(directory)
  small, _ = make_hf_checkpoint(seed, name='small', model_type='qwen3', head='score', vocab_size=256)
  for name in os.listdir(tokens):
    shutil.copy(os.path.join(tokens, name), small)
  with pytest.raises(UserError, match="tokenizer has 302 tokens, more than the checkpoint's 256 embedding rows"):
    load_reward_model(small)
  language_model, _ = make_hf_checkpoint(seed, name='lm', vocab_size=320)
  with pytest.raises(UserError, match=r'is a language model \(Qwen2ForCausalLM\), not a reward model'):
    load_reward_model(language_model)


def test_a_steps_completions_score_as_transformers_scores_each_conversation(seed, make_hf_checkpoint):
  from grpo_jax.rl.reward_model import check_reward_model_length, score_completions
  directory, reference = make_hf_checkpoint(seed, head='score')
  model = from_pretrained(directory)
  rng, group, policy_pad = np.random.default_rng(seed), 2, 7  # the policy pads with another id than the reward model
  prompts = random_prompts(seed, [5, 9, 3])
  prompt_tokens, prompt_mask = left_padded(prompts, policy_pad)
  lengths = np.array([6, 2, 4, 1, 6, 3])
  completions = np.full((6, 6), policy_pad, np.int32)
  completion_mask = (np.arange(6)[None, :] < lengths[:, None]).astype(np.int32)
  for row, length in enumerate(lengths):
    completions[row, :length] = rng.integers(3, 1000, length)
  completions[2, 3] = PAD  # ends in an eos that is the reward model's pad id: read at the token before it
  got = np.asarray(jax.jit(score_completions)(model, prompt_tokens, prompt_mask, completions, completion_mask))
  want = []
  for row in range(6):
    sequence = prompts[row // group] + completions[row, :lengths[row]].tolist()
    with torch.no_grad():
      want.append(float(reference(input_ids=torch.tensor([sequence])).logits[0, 0]))
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
  # Six different conversations score differently (transformers' scores distinct and spread past the
  # tolerance), so the row-by-row match says each row scored its own; two of them may lie closer than
  # 1e-4 (2.4e-5 apart at seed 3874948277), which rounding to 4 places would merge.
  assert len(set(np.asarray(want, np.float32).tolist())) == 6 and np.ptp(want) > 100 * 1e-4
  check_reward_model_length(model.config, 1000, 24, 'rm')
  with pytest.raises(UserError, match=r'the reward model rm reads at most 1024 tokens .* rows of 1032'):
    check_reward_model_length(model.config, 1000, 32, 'rm')


@pytest.mark.exhaustive
def test_a_steps_completions_score_on_a_mesh_as_on_one_device(seed, make_hf_checkpoint):
  from grpo_jax.rl.reward_model import score_completions
  directory, _ = make_hf_checkpoint(seed, model_type='llama', head='score', **SHAPES['llama'])
  rng = np.random.default_rng(seed)
  prompt_tokens, prompt_mask = left_padded(random_prompts(seed, [5, 9, 3, 7]), PAD)
  lengths = rng.integers(1, 7, 8)
  completion_mask = (np.arange(6)[None, :] < lengths[:, None]).astype(np.int32)
  completions = np.where(completion_mask == 1, rng.integers(3, 1000, (8, 6)), PAD).astype(np.int32)
  args = (prompt_tokens, prompt_mask, completions, completion_mask)
  want = np.asarray(jax.jit(score_completions)(from_pretrained(directory), *args))
  mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
  model = from_pretrained(directory, mesh=mesh)
  with jax.set_mesh(mesh):
    got = jax.jit(score_completions)(model, *args)
  assert len(got.sharding.device_set) == 8
  np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-4)
