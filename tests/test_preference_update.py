"""The reward model's update on preference pairs (rl/preference.py): its loss and accuracy equal
NumPy's Bradley-Terry on transformers' scores; the update equals one optax step of the loss's
gradient, whatever the micro-batches, with padded pairs left out; on a mesh it equals one device."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax import nnx

from grpo_jax.model import MeshConfig, from_pretrained, make_mesh
from grpo_jax.rl.preference import PreferenceBatch, bradley_terry_loss, preference_update
from grpo_jax.rl.state import init_train_state

PAIRS, WIDTH, PAD = 8, 12, 0


def preference_batch(seed, vocab=1000, shortest: int = 3, ending_in_pad: float = 0.0) -> PreferenceBatch:
  """8 pairs of `shortest` to 12 tokens, right-padded with the pad id, the last pair padding
  (weight 0); a share `ending_in_pad` of the sides end in the pad id itself (read at the token
  before it)."""
  rng = np.random.default_rng(seed)

  def side():
    tokens = rng.integers(3, vocab, (PAIRS, WIDTH)).astype(np.int32)
    lengths = rng.integers(shortest, WIDTH + 1, PAIRS)
    mask = (np.arange(WIDTH)[None, :] < lengths[:, None]).astype(np.int32)
    if ending_in_pad:
      ends = rng.random(PAIRS) < ending_in_pad
      tokens[np.arange(PAIRS)[ends], lengths[ends] - 1] = PAD
    return np.where(mask == 1, tokens, PAD).astype(np.int32), mask
  (chosen, chosen_mask), (rejected, rejected_mask) = side(), side()
  weights = np.ones(PAIRS, np.float32)
  weights[-1] = 0.0
  return PreferenceBatch(chosen=chosen, chosen_mask=chosen_mask, rejected=rejected, rejected_mask=rejected_mask,
                         weights=weights, margin=rng.uniform(0, 0.5, PAIRS).astype(np.float32))


def _model(seed, make_hf_checkpoint, mesh=None, **fields):
  directory, reference = make_hf_checkpoint(seed, model_type='qwen3', head='score', **fields)
  return from_pretrained(directory, mesh=mesh), reference


def _step(model, batch, micro_batches=1, center_coef=0.01):
  """One jitted update with SGD (the update linear in the gradient: AdamW's first step is about
  the gradient's sign, which rounding flips where an element is near 0)."""
  graphdef, params = nnx.split(model)
  optimizer = optax.sgd(1.0)
  state = init_train_state(params, optimizer, 0)
  step = jax.jit(lambda state, batch: preference_update(state, batch, graphdef=graphdef, optimizer=optimizer,
                                                        schedule=optax.constant_schedule(1e-2),
                                                        micro_batches=micro_batches, center_coef=center_coef))
  return step(state, batch)


def test_loss_and_accuracy_equal_numpy_on_transformers_scores(seed, make_hf_checkpoint):
  model, reference = _model(seed, make_hf_checkpoint)
  batch = preference_batch(seed)
  with torch.no_grad():
    def scores(tokens, mask):
      return reference(input_ids=torch.tensor(tokens, dtype=torch.long),
                       attention_mask=torch.tensor(mask, dtype=torch.long)).logits[:, 0].numpy()
    chosen, rejected = scores(batch.chosen, batch.chosen_mask), scores(batch.rejected, batch.rejected_mask)
  real = batch.weights == 1
  gap = chosen - rejected - batch.margin
  want = np.mean((np.log1p(np.exp(-gap)) + 0.01 * (chosen + rejected) ** 2)[real])
  _, metrics = _step(model, batch)
  np.testing.assert_allclose(float(metrics['loss']), want, rtol=1e-4)
  assert float(metrics['accuracy']) == pytest.approx(np.mean((chosen > rejected)[real]))
  np.testing.assert_allclose(float(metrics['score_gap_mean']), np.mean((chosen - rejected)[real]), atol=1e-4)
  assert int(metrics['pairs']) == PAIRS - 1 and float(metrics['nonfinite']) == 0.0


def test_the_update_is_one_optax_step_of_the_gradient_whatever_the_micro_batches(seed, make_hf_checkpoint):
  model, _ = _model(seed, make_hf_checkpoint)
  batch = preference_batch(seed)
  graphdef, params = nnx.split(model)

  def loss(params):
    scored = nnx.merge(graphdef, params)
    chosen = scored.scores(batch.chosen, segment_ids=batch.chosen_mask)[:, 0]
    rejected = scored.scores(batch.rejected, segment_ids=batch.rejected_mask)[:, 0]
    return bradley_terry_loss(chosen, rejected, jnp.asarray(batch.margin), 0.01, jnp.asarray(batch.weights))
  optimizer = optax.sgd(1.0)
  grads = jax.jit(jax.grad(loss))(params)
  updates, _ = optimizer.update(grads, optimizer.init(params), params)
  want = optax.apply_updates(params, updates)
  moved = max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(params)))
  assert moved > 1e-3
  for micro_batches in (1, 2, 4):
    state, _ = _step(model, batch, micro_batches)
    for got, expected in zip(jax.tree.leaves(state.params), jax.tree.leaves(want)):
      np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-6)
    assert int(state.step) == 1 and int(state.updates) == 1
  # The padded pair (weight 0) is left out: other tokens there give the same update.
  other = batch.replace(chosen=batch.chosen.copy())
  other.chosen[-1] = np.roll(other.chosen[-1], 1)
  state, _ = _step(model, other, 2)
  for got, expected in zip(jax.tree.leaves(state.params), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-6)


@pytest.mark.exhaustive
def test_the_update_on_a_mesh_equals_one_device(seed, make_hf_checkpoint):
  fields = dict(num_attention_heads=4, num_key_value_heads=2)
  model, _ = _model(seed, make_hf_checkpoint, **fields)
  batch = preference_batch(seed)
  want, want_metrics = _step(model, batch, 2)
  mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
  with jax.set_mesh(mesh):
    on_mesh, _ = _model(seed, make_hf_checkpoint, mesh=mesh, **fields)
    got, metrics = _step(on_mesh, batch, 2)
  assert got.params['layers']['q_weight'][...].sharding.mesh.shape == mesh.shape
  np.testing.assert_allclose(float(metrics['loss']), float(want_metrics['loss']), rtol=1e-5)
  for a, b in zip(jax.tree.leaves(got.params), jax.tree.leaves(want.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
