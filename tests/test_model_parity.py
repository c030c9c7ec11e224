"""Logits of grpo_jax's Qwen model against transformers' PyTorch Qwen2 and Qwen3 on random tiny checkpoints."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import torch_logits
from grpo_jax.model import ModelOptions, from_pretrained

FP32_TOLERANCE = 1e-4
# bf16 compute against the fp32 reference. bf16 keeps 8 mantissa bits (relative rounding 2^-9 per
# op); measured max |dlogits| was 0.024-0.028 over 5 seeds for logits of magnitude ~3, so the
# bound is 0.05.
BF16_TOLERANCE = 0.05

CASES = {
    'tied-mqa': dict(tie_word_embeddings=True, num_key_value_heads=1),
    'untied-gqa-odd-vocab': dict(vocab_size=517, num_key_value_heads=2, num_hidden_layers=3),
    'untied-mha-head-dim': dict(num_attention_heads=4, num_key_value_heads=4, head_dim=24,
                                rope_theta=1_000_000.0),
    # Qwen3 dense: per-head q/k norms, no q/k/v bias, head_dim unrelated to hidden_size / heads.
    'qwen3-tied-gqa': dict(model_type='qwen3', tie_word_embeddings=True, num_key_value_heads=2, head_dim=16),
    'qwen3-untied-gqa4-head-dim': dict(model_type='qwen3', num_attention_heads=8, num_key_value_heads=2, head_dim=24),
    'qwen3-untied-mqa-wide-heads': dict(model_type='qwen3', num_key_value_heads=1, head_dim=128),
}


def jitted(model):
  graphdef, state = nnx.split(model)

  @jax.jit
  def forward(state, tokens, segment_ids=None, positions=None):
    return nnx.merge(graphdef, state)(tokens, segment_ids=segment_ids, positions=positions)

  return lambda *args, **kwargs: np.asarray(forward(state, *args, **kwargs))


@pytest.mark.parametrize('case', sorted(CASES))
def test_logits_match_transformers(case, seed, make_hf_checkpoint):
  directory, reference = make_hf_checkpoint(seed, **CASES[case])
  forward = jitted(from_pretrained(directory))
  vocab = reference.config.vocab_size
  tokens = np.random.default_rng(seed).integers(0, vocab, (2, 300), dtype=np.int32)
  expected = torch_logits(reference, tokens)
  np.testing.assert_allclose(forward(tokens), expected, rtol=0, atol=FP32_TOLERANCE)


def test_padded_batches_match_unpadded_sequences(seed, make_hf_checkpoint):
  """Left- and right-padded rows give every real token the logits of the unpadded sequence."""
  directory, reference = make_hf_checkpoint(seed)
  forward = jitted(from_pretrained(directory))
  rng = np.random.default_rng(seed)
  lengths = [37, 120, 5, 120]
  width = 128
  sequences = [rng.integers(0, 1000, n, dtype=np.int32) for n in lengths]
  for side in ('left', 'right'):
    tokens = np.full((len(lengths), width), 7, np.int32)  # pad id is arbitrary: it must not matter
    mask = np.zeros((len(lengths), width), np.int32)
    for row, sequence in enumerate(sequences):
      where = slice(width - len(sequence), width) if side == 'left' else slice(0, len(sequence))
      tokens[row, where] = sequence
      mask[row, where] = 1
    logits = forward(tokens, segment_ids=mask)
    for row, sequence in enumerate(sequences):
      where = slice(width - len(sequence), width) if side == 'left' else slice(0, len(sequence))
      expected = torch_logits(reference, sequence[None])[0]
      np.testing.assert_allclose(logits[row, where], expected, rtol=0, atol=FP32_TOLERANCE,
                                 err_msg=f'{side}-padded row {row}')


def test_packed_segments_match_separate_sequences(seed, make_hf_checkpoint):
  """Segment ids 1, 2, 3 in one row isolate the sequences; positions restart per segment."""
  directory, reference = make_hf_checkpoint(seed)
  forward = jitted(from_pretrained(directory))
  rng = np.random.default_rng(seed)
  sequences = [rng.integers(0, 1000, n, dtype=np.int32) for n in (40, 17, 63)]
  tokens = np.concatenate(sequences + [np.zeros(8, np.int32)])[None]
  segments = np.concatenate([np.full(len(s), i + 1) for i, s in enumerate(sequences)] + [np.zeros(8)])
  logits = forward(tokens, segment_ids=segments[None].astype(np.int32))[0]
  start = 0
  for sequence in sequences:
    expected = torch_logits(reference, sequence[None])[0]
    np.testing.assert_allclose(logits[start:start + len(sequence)], expected, rtol=0, atol=FP32_TOLERANCE)
    start += len(sequence)


def test_explicit_positions_match_transformers(seed, make_hf_checkpoint):
  directory, reference = make_hf_checkpoint(seed)
  forward = jitted(from_pretrained(directory))
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, 1000, (2, 50), dtype=np.int32)
  positions = np.stack([np.arange(50) + 100, np.arange(50) * 3]).astype(np.int32)
  expected = torch_logits(reference, tokens, position_ids=positions)
  np.testing.assert_allclose(forward(tokens, positions=positions), expected, rtol=0, atol=FP32_TOLERANCE)


def test_bfloat16_within_documented_tolerance(seed, make_hf_checkpoint):
  directory, reference = make_hf_checkpoint(seed, tie_word_embeddings=True)
  model = from_pretrained(directory, dtype='bfloat16')
  assert model.embedding[...].dtype == jnp.bfloat16
  tokens = np.random.default_rng(seed).integers(0, 1000, (2, 200), dtype=np.int32)
  logits = jitted(model)(tokens)
  assert logits.dtype == np.float32
  expected = torch_logits(reference, tokens)
  error = np.abs(logits - expected)
  assert error.max() <= BF16_TOLERANCE, error.max()
  # The bf16 model still ranks tokens like the reference almost everywhere.
  assert np.mean(logits.argmax(-1) == expected.argmax(-1)) > 0.9  # measured 0.97-0.9975


def test_fp32_params_with_bf16_compute(seed, make_hf_checkpoint):
  directory, reference = make_hf_checkpoint(seed)
  model = from_pretrained(directory, options=ModelOptions(dtype='bfloat16', param_dtype='float32'))
  assert model.embedding[...].dtype == jnp.float32
  tokens = np.random.default_rng(seed).integers(0, 1000, (2, 100), dtype=np.int32)
  error = np.abs(jitted(model)(tokens) - torch_logits(reference, tokens))
  assert error.max() <= BF16_TOLERANCE, error.max()


@pytest.mark.exhaustive
def test_unrolled_layers_and_remat_agree_with_scan(seed, make_hf_checkpoint):
  """scan_layers=False and every remat policy compute the same logits and gradients."""
  directory, _ = make_hf_checkpoint(seed, num_hidden_layers=3)
  tokens = np.random.default_rng(seed).integers(0, 1000, (2, 40), dtype=np.int32)

  def loss_and_grad(model):
    graphdef, state = nnx.split(model)

    def loss(state):
      logits = nnx.merge(graphdef, state)(tokens)
      return jax.nn.log_softmax(logits)[:, :-1].max(-1).mean()

    value, grads = jax.jit(jax.value_and_grad(loss))(state)
    return value, jax.tree.leaves(grads)

  base_value, base_grads = loss_and_grad(from_pretrained(directory))
  for options in (ModelOptions(scan_layers=False), ModelOptions(remat='full'), ModelOptions(remat='dots'),
                  ModelOptions(remat='dots_no_batch', scan_layers=False)):
    value, grads = loss_and_grad(from_pretrained(directory, options=options))
    np.testing.assert_allclose(value, base_value, rtol=1e-6, err_msg=str(options))
    for got, want in zip(grads, base_grads):
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7, err_msg=str(options))


def test_scanned_program_size_does_not_grow_with_depth():
  """With scan_layers the lowered program is the same size for 2 or 16 layers; unrolled, it grows."""
  from grpo_jax.model import Qwen2Config
  from grpo_jax.model.loading import abstract_model

  def program_size(layers, scan):
    model = abstract_model(Qwen2Config(num_hidden_layers=layers), ModelOptions(scan_layers=scan))
    graphdef, state = nnx.split(model)
    tokens = jax.ShapeDtypeStruct((2, 16), jnp.int32)
    lowered = jax.jit(lambda state, tokens: nnx.merge(graphdef, state)(tokens)).lower(state, tokens)
    return len(lowered.as_text())

  scanned = program_size(2, True), program_size(16, True)
  unrolled = program_size(2, False), program_size(16, False)
  assert abs(scanned[1] - scanned[0]) < 0.02 * scanned[0], scanned
  assert unrolled[1] > 4 * unrolled[0], unrolled
