"""Packed update (algo.packing): the on-device bin packing against NumPy, the packed layout against
the padded rows it came from, and the packed update against the padded one (fp32, the tolerances of
test_update.py) for every algorithm setting, on one device and on a fake 8-device mesh; the fused
K-step and host-reward RL steps with packing against the padded ones; the config's checks."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from grpo_jax import config as config_lib
from grpo_jax import sharding
from grpo_jax.data import word_problems
from grpo_jax.data.math_task import MathTask
from grpo_jax.errors import UserError
from grpo_jax.model.qwen2 import segment_positions
from grpo_jax.rl.held import Held
from grpo_jax.rl import packing
from grpo_jax.rl.algo import AlgoConfig
from grpo_jax.rl.batch import Batch
from grpo_jax.rl.update import UpdateSettings
from grpo_jax.testing import random_batch
from test_mesh_equivalence import assert_equal_runs, two_steps
from test_update import (ARCHITECTURE, COMPLETION_LENGTH, GROUP, PROMPT_LENGTH, ROWS, assert_close, assert_trees_close,
                         fresh_state, make_update, random_model)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WIDTH = PROMPT_LENGTH + COMPLETION_LENGTH  # W = Tp + N = 11


# ---- the packing itself ----

def numpy_first_fit_decreasing(lengths, row_length):
  """(row, offset, segment) of each sequence: longest first (ties by index), first row with room."""
  fill, placed = [], []
  row, offset, segment = (np.zeros(len(lengths), int) for _ in range(3))
  for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
    target = next((r for r, used in enumerate(fill) if used + lengths[index] <= row_length), len(fill))
    if target == len(fill):
      fill.append(0)
      placed.append(0)
    row[index], offset[index], segment[index] = target, fill[target], placed[target] + 1
    fill[target] += lengths[index]
    placed[target] += 1
  return row, offset, segment


@pytest.mark.parametrize('count, row_length', [(16, 11), (64, 40), (7, 100)])
def test_first_fit_decreasing_against_numpy(seed, count, row_length):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, min(row_length, 12) + 1, count)
  lengths[:2] = row_length, 1  # a full row and a one-token sequence
  got = jax.jit(packing.first_fit_decreasing, static_argnums=(1, 2))(jnp.asarray(lengths, jnp.int32), count,
                                                                     row_length)
  for ours, expected in zip(got, numpy_first_fit_decreasing(lengths, row_length)):
    np.testing.assert_array_equal(np.asarray(ours), expected)


def long_tail_batch(rng, rows=ROWS, prompt_length=PROMPT_LENGTH, completion_length=COMPLETION_LENGTH,
                    shapes=None, advantages=None) -> Batch:
  return random_batch(rng, rows, prompt_length, completion_length, ARCHITECTURE.vocab_size, shapes, advantages)


def exact_fill_batch(rng) -> Batch:
  """Sequences of 11, 8, 7, 5, 4, 4, 3 and 2 tokens in random order, with one-token and
  full-length answers: first-fit decreasing at L = W fills four rows exactly (11 | 8 + 3 |
  7 + 4 | 5 + 4 + 2)."""
  shapes = [(5, 6), (3, 5), (1, 2), (1, 6), (2, 2), (4, 1), (1, 1), (3, 1)]
  rng.shuffle(shapes)
  return long_tail_batch(rng, shapes=shapes)


def test_packed_rows_hold_each_sequence_in_order(seed):
  """Every sequence's real tokens appear once, contiguous and in order, at its (row, column), under
  one segment id with positions 0, 1, ...; rows in use come first and are filled up to L; unpacking
  the packed tokens (shifted as log-probs are) gives back each completion."""
  rng = np.random.default_rng(seed)
  rows, row_length = 32, 16
  batch = long_tail_batch(rng, rows=rows, prompt_length=6, completion_length=10)
  packed = jax.jit(packing.pack, static_argnums=(2, 3, 4))(batch.tokens, batch.segment_ids, 10, row_length, 3)
  tokens, segments = np.asarray(packed.tokens)[0], np.asarray(packed.segment_ids)[0]
  assert tokens.shape == (33, row_length)  # 32 sequences rounded up to micro-batches of 3 rows
  positions = np.asarray(segment_positions(jnp.asarray(segments)))
  source_tokens, source_segments = np.asarray(batch.tokens), np.asarray(batch.segment_ids)
  covered = np.zeros_like(segments, bool)
  for index in range(rows):
    real = source_tokens[index][source_segments[index] != 0]
    prompt = int((source_segments[index, :6] != 0).sum())
    row, start = int(packed.row[0, index]), int(packed.start[0, index])
    first = start - prompt
    np.testing.assert_array_equal(tokens[row, first:first + len(real)], real)
    ids = segments[row, first:first + len(real)]
    assert len(set(ids)) == 1 and ids[0] >= 1
    np.testing.assert_array_equal(positions[row, first:first + len(real)], np.arange(len(real)))
    assert not covered[row, first:first + len(real)].any()
    covered[row, first:first + len(real)] = True
  assert (covered == (segments != 0)).all()  # nothing else in the rows
  used = int(packed.rows_used[0])
  assert covered[:used].any(axis=1).all() and not covered[used:].any()
  assert int(packed.real_tokens) == int((source_segments != 0).sum())
  for row_segments in segments[:used]:  # segments 1, 2, ... in order, then padding
    real = row_segments[row_segments != 0]
    assert (np.diff(real) >= 0).all() and real[0] == 1 and (row_segments[len(real):] == 0).all()
  as_log_probs = jnp.asarray(tokens[None, :, 1:], jnp.float32)
  unpacked = np.asarray(packing.unpack(as_log_probs, packed, 10))
  mask = np.asarray(batch.mask)
  np.testing.assert_array_equal(unpacked[mask], source_tokens[:, 6:][mask])


# ---- the packed update against the padded one ----

def gradient_recorder() -> optax.GradientTransformation:
  """Keeps the sum of the gradients of every update in its state and passes them on unchanged."""
  return optax.GradientTransformation(lambda params: jax.tree.map(jnp.zeros_like, params),
                                      lambda grads, total, params=None: (grads, jax.tree.map(jnp.add, total, grads)))


# Token ratios with every term on (clip-higher, dual clip, TIS, k3 KL, entropy), then each other
# aggregation, estimator and ratio, mini-batches and mu > 1, and micro-batches by rows and by tokens.
SETTINGS = {
    'token-mean, all terms': dict(ppo_epochs=2, epsilon_high=0.28, dual_clip=3.0, tis_cap=1.5, kl_beta=0.05,
                                  entropy_coef=0.01),
    'seq-mean-token-mean, k1': dict(loss_aggregation='seq-mean-token-mean', kl_beta=0.05, kl_estimator='k1'),
    'seq-mean-token-sum, k2, minibatches': dict(loss_aggregation='seq-mean-token-sum', kl_beta=0.05,
                                                kl_estimator='k2', num_minibatches=2, ppo_epochs=2),
    'Dr.GRPO norm, micro-batch rows': dict(loss_aggregation='seq-mean-token-sum-norm', micro_batch_size=2,
                                           entropy_coef=0.01),
    'GSPO sequence ratio': dict(importance_ratio='sequence', epsilon_low=3e-4, epsilon_high=4e-4, ppo_epochs=2,
                                loss_aggregation='seq-mean-token-mean', kl_beta=0.05),
    'on-policy, one row per micro-batch': dict(entropy_coef=0.01, micro_batch_tokens=WIDTH),
    'longer rows, token budget': dict(ppo_epochs=2, num_minibatches=2, tis_cap=2.0, pack_length=24,
                                      micro_batch_tokens=48),
}
PACKING_ONLY = ('pack_length', 'micro_batch_tokens', 'tree_packing')


def run_update(settings: dict, params, batch, seed, packed: bool, ref_params=None, architecture=ARCHITECTURE):
  fields = {name: value for name, value in settings.items() if packed or name not in PACKING_ONLY}
  config = AlgoConfig(group_size=GROUP, logprob_implementation='xla_chunked', packing=packed, **fields)
  # The gradients themselves are compared (their sum over the updates); small clipped SGD steps move
  # the parameters between updates, so later mini-batches and passes see a policy that moved.
  optimizer = optax.chain(gradient_recorder(), optax.clip_by_global_norm(1.0), optax.sgd(1e-2))
  run, optimizer = make_update(config, optimizer=optimizer, architecture=architecture)
  new_state, metrics = run(fresh_state(params, optimizer, seed), batch, Held(reference=ref_params))
  return new_state.opt_state[0], metrics


def assert_packed_equals_padded(padded, packed, batch, skip=()):
  (padded_gradients, padded_metrics), (packed_gradients, packed_metrics) = padded, packed
  assert_trees_close(packed_gradients, padded_gradients)
  # The losses are sums of per-token terms of size ~|A| that can cancel to near 0: their rounding
  # follows the terms, as test_update's rule says (seed 3010453421: policy loss -2.2e-3, 5.6e-8 apart).
  summands = float(np.abs(np.asarray(batch.advantages)).max())
  for name, value in padded_metrics.items():
    if name != 'micro_batches' and name not in skip:
      assert_close(packed_metrics[name], value, name, scale=summands if 'loss' in name else 0.0)
  assert float(padded_metrics['grad_norm']) > 1e-3


@pytest.mark.parametrize('name', [pytest.param(name, marks=() if name == 'token-mean, all terms' else
                                                pytest.mark.exhaustive) for name in sorted(SETTINGS)])
def test_packed_update_equals_padded(seed, name):
  """Every setting on one batch: random lengths for half of them, the exact-fill batch for the rest
  (each setting's compile costs more than its batch, so each runs on one)."""
  rng = np.random.default_rng(seed)
  graphdef, params = random_model(rng)
  _, ref_params = random_model(rng)
  batch = long_tail_batch(rng) if sorted(SETTINGS).index(name) % 2 else exact_fill_batch(rng)
  # pi_ref differs from pi (a KL with a gradient); the sampler differs from both (TIS, the mismatch).
  padded = run_update(SETTINGS[name], params, batch, seed, packed=False, ref_params=ref_params)
  packed = run_update(SETTINGS[name], params, batch, seed, packed=True, ref_params=ref_params)
  assert_packed_equals_padded(padded, packed, batch)
  metrics = packed[1]
  real = int((np.asarray(batch.segment_ids) != 0).sum())
  assert_close(metrics['padding_frac'], 1 - real / batch.segment_ids.size)
  assert_close(metrics['sequence_tokens'], real)
  assert_close(metrics['packed_tokens'], real)  # a pass's rows hold every real token once
  assert 0 <= float(metrics['packed_padding_frac']) < 1 and float(metrics['micro_batches']) >= 1


def test_exact_fill_packs_into_fewer_rows_and_micro_batches(seed):
  """With one packed row per micro-batch, the micro-batch count follows the real tokens: the
  exact-fill batch's 8 sequences fill 4 rows of W exactly, so 4 micro-batches and no padding where
  the padded path runs 8 rows."""
  rng = np.random.default_rng(seed)
  graphdef, params = random_model(rng)
  batch = exact_fill_batch(rng)
  _, metrics = run_update(dict(micro_batch_tokens=WIDTH), params, batch, seed, packed=True)
  assert float(metrics['packed_rows']) == 4 and float(metrics['micro_batches']) == 4
  assert float(metrics['packed_padding_frac']) == 0.0
  assert_close(metrics['padding_frac'], 1 - 4 / 8)


# Qwen3's shape: per-head q/k norms, no q/k/v bias, head_dim 16 where D / N = 8.
QWEN3 = dataclasses.replace(ARCHITECTURE, head_dim=16, qk_norm=True, attention_bias=False)


@pytest.mark.exhaustive
@pytest.mark.parametrize('architecture', [ARCHITECTURE, QWEN3], ids=['qwen2', 'qwen3'])
def test_packed_update_on_a_mesh_equals_one_device(seed, architecture):
  """8 fake devices as (data, fsdp, tensor) = (2, 2, 2): each of the 4 batch groups packs its own
  2 sequences (per group, not across them) and the update equals the padded one on one device."""
  rng = np.random.default_rng(seed)
  graphdef, params = random_model(rng, architecture)
  _, ref_params = random_model(rng, architecture)
  batch = exact_fill_batch(rng)
  settings = SETTINGS['token-mean, all terms']
  padded = run_update(settings, params, batch, seed, packed=False, ref_params=ref_params, architecture=architecture)
  mesh = sharding.make_mesh(sharding.MeshConfig(data=2, fsdp=2, tensor=2), jax.devices()[:8])
  with jax.set_mesh(mesh):
    place = lambda tree: jax.device_put(tree, jax.tree.map(lambda x: sharding.named_sharding(  # noqa: E731
        mesh, x.shape, ('batch',) + (None,) * (x.ndim - 1)), tree))
    shard_params = lambda tree: jax.device_put(tree, sharding.state_shardings(tree, mesh))  # noqa: E731  (FSDP)
    on_mesh = run_update(dict(settings, micro_batch_tokens=WIDTH), shard_params(params), place(batch), seed,
                         packed=True, ref_params=shard_params(ref_params), architecture=architecture)
    packed = jax.jit(packing.pack, static_argnums=(2, 3, 4))(place(batch).tokens, place(batch).segment_ids,
                                                             COMPLETION_LENGTH, WIDTH, 1)
  assert_packed_equals_padded(padded, on_mesh, batch)
  assert packed.tokens.shape == (4, 2, WIDTH)  # 4 groups of 2 rows: no group packs another's sequences
  assert packed.tokens.sharding.shard_shape(packed.tokens.shape)[0] == 1


# ---- the RL step with packing: fused K steps, the host reward, a mesh ----

def rl_steps(tmp_path, name, config_path, overrides, mesh_shape=(1, 1, 1), task=None, fused=False):
  return two_steps(tmp_path, config_path, [*overrides, 'rollout.prompts_per_step=8', 'algo.group_size=4'],
                   mesh_shape, task, name=name, fused=fused)


def assert_packed_run_equals_padded(reference, packed):
  assert_equal_runs(reference, packed)
  for row, packed_row in zip(reference[0], packed[0]):
    np.testing.assert_allclose(packed_row['padding_frac'], row['padding_frac'], rtol=1e-6)
    assert 0 <= packed_row['packed_padding_frac'] < 1 and packed_row['micro_batches'] >= 1


@pytest.mark.exhaustive
@pytest.mark.starts_first
def test_fused_k_steps_with_packing_equal_padded(tmp_path):
  """Two arithmetic RL steps in one jit, packed (rows of 32 tokens, 2 per micro-batch) against padded."""
  config = os.path.join(ROOT, 'configs', 'tiny_arith.yaml')
  common = ['train.steps_per_call=3', 'train.checkpoint_every=0']
  reference = rl_steps(tmp_path, 'padded', config, common, fused=True)
  packed = rl_steps(tmp_path, 'packed', config, [*common, 'algo.packing=true', 'algo.pack_length=32', 'algo.micro_batch_tokens=64'],
                    fused=True)
  assert_packed_run_equals_padded(reference, packed)


@pytest.mark.exhaustive
@pytest.mark.starts_first
def test_host_reward_steps_with_packing_on_a_mesh_equal_padded(tmp_path):
  """The math task (rewards on the host, prompts of different lengths), packed on a (2, 4, 1) mesh
  against padded on one device: each data replica packs and accumulates its own rows (rl/update.py)."""
  files = word_problems.write(str(tmp_path / 'data'))
  config_path = os.path.join(ROOT, 'configs', 'tiny_math.yaml')
  overrides = [f'task.source={files["train"]}', f'task.tokenizer={files["tokenizer"]}', 'eval.every=0',
               'algo.dynamic_sampling=false', 'algo.num_minibatches=2', 'algo.ppo_epochs=2']
  config = config_lib.load_config(config_path, overrides)
  task = MathTask(config.task, None, config.run.seed, config.rewards, config.rollout.max_new_tokens)
  try:
    reference = rl_steps(tmp_path, 'padded', config_path, overrides, task=task)
    length = task.prompt_length + config.rollout.max_new_tokens
    packed = rl_steps(tmp_path, 'packed', config_path, [*overrides, 'algo.packing=true',
                                                        f'algo.micro_batch_tokens={length}'], (2, 4, 1), task)
  finally:
    task.close()
  assert_packed_run_equals_padded(reference, packed)


# ---- config checks ----

@pytest.mark.parametrize('fields, field', [
    (dict(micro_batch_tokens=64), 'algo.micro_batch_tokens'),  # without packing
    (dict(pack_length=64), 'algo.pack_length'),
    (dict(packing=True, pack_length=64, micro_batch_tokens=32), 'algo.micro_batch_tokens'),
    (dict(packing=True, pack_length=-1), 'algo.pack_length'),
    (dict(tree_packing=True), 'algo.tree_packing'),  # without packing
    (dict(packing=True, tree_packing=True, num_minibatches=2), 'algo.shuffle'),  # a group over mini-batches
])
def test_config_refuses_bad_packing_fields(fields, field):
  with pytest.raises(UserError, match=field.replace('.', r'\.')):
    config_lib.Config(algo=AlgoConfig(**fields))


@pytest.mark.parametrize('fields, field', [
    (dict(pack_length=WIDTH - 1), 'algo.pack_length'),  # shorter than prompt + completion
    (dict(micro_batch_tokens=WIDTH - 1), 'algo.micro_batch_tokens'),  # below one packed row of W
])
def test_update_settings_refuse_rows_that_cannot_hold_a_sequence(fields, field):
  with pytest.raises(UserError, match=field.replace('.', r'\.')):
    UpdateSettings(algo=AlgoConfig(packing=True, **fields), temperature=1.0, rows=ROWS, sequence_length=WIDTH)


def test_the_cli_refuses_a_pack_length_below_the_sequence_in_one_line(tmp_path):
  import subprocess
  import sys
  result = subprocess.run([sys.executable, '-m', 'grpo_jax.train', '--config', os.path.join(ROOT, 'configs', 'tiny_arith.yaml'),
                           '--workdir', str(tmp_path), '--set', 'algo.packing=true', '--set', 'algo.pack_length=4'],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert result.returncode != 0
  lines = [line for line in result.stderr.splitlines() if line.strip()]
  assert len(lines) == 1 and 'algo.pack_length' in lines[0], result.stderr
  assert not os.path.exists(tmp_path / 'config.yaml')
