"""The public Python API: from_pretrained on HF and grpo_jax directories, tokenizer loading."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import torch_logits
from grpo_jax.errors import UserError
from grpo_jax.model import Qwen2, from_pretrained, load_tokenizer, save_orbax


def write_tokenizer(directory, special=()):
  """A byte-level BPE tokenizer like Qwen's, trained here with the `tokenizers` library; `special`:
  more special tokens, ids 1, 2, ... after <|endoftext|>'s 0."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=['<|endoftext|>', *special],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  words = ['one', 'two', 'three', 'four', 'five', 'six', 'seven', 'eight', 'nine', 'ten']
  corpus = [f'{a} plus {b} is {c}' for a in words for b in words for c in words]
  tokenizer.train_from_iterator(corpus, trainer)
  tokenizer.save(os.path.join(directory, 'tokenizer.json'))
  with open(os.path.join(directory, 'tokenizer_config.json'), 'w') as f:
    json.dump({'tokenizer_class': 'Qwen2Tokenizer', 'eos_token': '<|endoftext|>',
               'pad_token': '<|endoftext|>'}, f)
  return tokenizer


def test_from_pretrained_hf_and_orbax_with_tokenizer(seed, make_hf_checkpoint, tmp_path):
  hf_dir, reference = make_hf_checkpoint(seed)
  built = write_tokenizer(hf_dir)
  model = from_pretrained(hf_dir, dtype=jnp.float32)
  assert isinstance(model, Qwen2)
  tokenizer = load_tokenizer(hf_dir)
  text = 'seven plus two is nine'
  ids = tokenizer(text)['input_ids']
  assert ids == built.encode(text).ids and len(ids) > 3
  assert tokenizer.decode(ids) == text
  tokens = np.array([ids], np.int32)
  logits = np.asarray(model(tokens))
  assert logits.shape == (1, len(ids), 1000)
  np.testing.assert_allclose(logits, torch_logits(reference, tokens), rtol=0, atol=1e-4)

  orbax_dir = str(tmp_path / 'ckpt')
  save_orbax(model, orbax_dir, tokenizer_from=hf_dir)
  assert load_tokenizer(orbax_dir)(text)['input_ids'] == ids
  np.testing.assert_array_equal(np.asarray(from_pretrained(orbax_dir)(tokens)), logits)


def test_directory_without_tokenizer_and_bad_paths(seed, make_hf_checkpoint, tmp_path):
  hf_dir, _ = make_hf_checkpoint(seed)
  assert load_tokenizer(hf_dir) is None
  with pytest.raises(UserError, match='is not a directory'):
    from_pretrained(str(tmp_path / 'nowhere'))
