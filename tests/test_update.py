"""rl/update.py and rl/loss.py: the jitted GRPO update on a tiny random fp32 Qwen2 — its loss and gradients against
a loss written here on full logits, micro-batch accumulation, on-policy identities, the
non-finite guard, the reference-policy paths and the optimizer-update count; and the config's checks."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from grpo_jax.config import AlgoConfig, Config, OptimConfig, RolloutConfig, TrainConfig
from grpo_jax.data.math_task import MathSection
from grpo_jax.data.sources import DatasetSource
from grpo_jax.errors import UserError
from grpo_jax.model.config import Qwen2Config
from grpo_jax.model.loading import init_model
from grpo_jax.rl.held import Held
from grpo_jax.rl import algo
from grpo_jax.rl.loss import LossInputs, policy_loss
from grpo_jax.rl.state import init_train_state
from grpo_jax.rl.batch import Batch
from grpo_jax.rl.update import UpdateSettings, update
from grpo_jax.testing import random_batch as random_sequences

# V = 1100 makes the XLA log-prob op walk three vocabulary chunks of 512, the last one shifted.
ARCHITECTURE = Qwen2Config(vocab_size=1100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0)
PROMPTS, GROUP = 2, 4
ROWS = PROMPTS * GROUP  # B
PROMPT_LENGTH, COMPLETION_LENGTH = 5, 6  # Tp, N
TEMPERATURE = 0.8
# fp32, as tests/test_logprob.py: rtol 1e-5 plus a floor of 1e-5 of each array's largest magnitude
# (for a scalar loss, of its summands' magnitude), for entries whose summands cancel to near zero.
RTOL, ATOL_SCALE = 1e-5, 1e-5


def assert_close(actual, expected, what='', scale=0.0):
  """scale: the magnitude of the summands behind a scalar that may cancel (its rounding error
  follows them, not the cancelled result), as test_logprob's GRPO-loss check."""
  expected = np.asarray(expected, np.float64)
  np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=RTOL,
                             atol=ATOL_SCALE * max(np.abs(expected).max(), float(scale)), err_msg=what)


def assert_trees_close(actual, expected):
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(expected)):
    assert_close(a, b, what=jax.tree_util.keystr(path))


def assert_trees_equal(actual, expected):
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(expected)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))


@functools.cache
def _initial_model(architecture: Qwen2Config = ARCHITECTURE):
  return nnx.split(init_model(architecture, seed=0))


def random_model(rng, architecture: Qwen2Config = ARCHITECTURE):
  """(graphdef, params): every parameter perturbed by fresh noise, biases and norms included (the
  init leaves biases at 0 and norms at 1, which would hide mistakes in their gradients)."""
  graphdef, params = _initial_model(architecture)
  params = jax.tree.map(lambda p: p + jnp.asarray(0.05 * rng.standard_normal(p.shape), p.dtype), params)
  return graphdef, params


def random_batch(rng, advantages=None) -> Batch:
  """Left-padded prompts with completions of different lengths (one of a single token, one
  filling N), random tokens everywhere, padding included."""
  return random_sequences(rng, ROWS, PROMPT_LENGTH, COMPLETION_LENGTH, ARCHITECTURE.vocab_size, advantages=advantages)


def make_update(algo_config: AlgoConfig, optim: OptimConfig = OptimConfig(learning_rate=1e-3),
                optimizer=None, architecture: Qwen2Config = ARCHITECTURE):
  """The jitted update as rl/step.py builds it (without donation), and its optimizer."""
  built, schedule = optim.build(10 * algo_config.ppo_epochs * algo_config.num_minibatches)
  optimizer = optimizer or built
  run = functools.partial(update, graphdef=_initial_model(architecture)[0], optimizer=optimizer, schedule=schedule,
                          settings=UpdateSettings(algo=algo_config, temperature=TEMPERATURE, rows=ROWS))
  return jax.jit(run), optimizer


def fresh_state(params, optimizer, seed):
  return init_train_state(params, optimizer, seed % (1 << 31))


def delta(new, old):
  return jax.tree.map(lambda a, b: np.asarray(a, np.float64) - np.asarray(b, np.float64), new, old)


# ---- the loss and its gradient against full logits ----

def full_logits_log_probs(graphdef, params, batch):
  """log pi(y_t) [B, N] and entropy [B, N] at TEMPERATURE from the model's full logits."""
  model = nnx.merge(graphdef, params)
  logits = model(batch.tokens, segment_ids=batch.segment_ids)  # [B, Tp + N, V]
  logits = logits[:, PROMPT_LENGTH - 1:-1] / TEMPERATURE  # position Tp + t - 1 predicts token t
  log_softmax = jax.nn.log_softmax(logits, axis=-1)
  completion = batch.tokens[:, PROMPT_LENGTH:]
  log_probs = jnp.take_along_axis(log_softmax, completion[..., None], axis=-1)[..., 0]
  entropy = -jnp.sum(jnp.exp(log_softmax) * log_softmax, axis=-1)
  return log_probs, entropy


GRADIENT_CASES = {
    # Token ratios with every term on: clip-higher, dual clip, TIS, k3 KL, entropy bonus.
    'token': AlgoConfig(group_size=GROUP, ppo_epochs=2, epsilon_low=0.2, epsilon_high=0.28,
                        dual_clip=3.0, tis_cap=1.5, kl_beta=0.05, kl_estimator='k3', entropy_coef=0.01,
                        loss_aggregation='token-mean', logprob_implementation='xla_chunked'),
    # GSPO: one clipped ratio per sequence; seq-mean-token-mean makes it GSPO's sequence objective.
    'sequence': AlgoConfig(group_size=GROUP, ppo_epochs=2, importance_ratio='sequence',
                           epsilon_low=0.04, epsilon_high=0.05, kl_beta=0.05, kl_estimator='k2',
                           entropy_coef=0.01, loss_aggregation='seq-mean-token-mean',
                           logprob_implementation='xla_chunked'),
}


def reference_loss(params, graphdef, batch, old, ref, config: AlgoConfig):
  """The GRPO loss written out from the papers on full logits: plain JAX autodiff, no rl.algo."""
  log_probs, entropy = full_logits_log_probs(graphdef, params, batch)
  mask = batch.mask.astype(jnp.float32)
  lengths = mask.sum(axis=1)
  advantages = batch.advantages
  low, high = 1.0 - config.epsilon_low, 1.0 + config.epsilon_high
  if config.importance_ratio == 'sequence':
    # GSPO: s_i = exp(mean_t log(pi / pi_old)), J = 1/B sum_i min(s_i A_i, clip(s_i) A_i).
    s = jnp.exp(jnp.sum((log_probs - old) * mask, axis=1) / lengths)
    per_row = -jnp.minimum(s * advantages, jnp.clip(s, low, high) * advantages)
    policy = jnp.mean(per_row)
    policy_scale = jnp.mean(jnp.abs(per_row))
    token_terms = jnp.zeros_like(log_probs)
  else:
    ratio = jnp.exp(log_probs - old)
    a = advantages[:, None]
    objective = jnp.minimum(ratio * a, jnp.clip(ratio, low, high) * a)
    objective = jnp.where(a < 0, jnp.maximum(objective, config.dual_clip * a), objective)
    tis = jnp.minimum(jnp.exp(old - batch.sampler_log_probs), config.tis_cap)
    policy = policy_scale = 0.0
    token_terms = -objective * tis
  x = log_probs - ref
  kl = {'k1': x, 'k2': 0.5 * x ** 2, 'k3': jnp.exp(-x) - 1.0 + x}[config.kl_estimator]
  token_terms = token_terms + config.kl_beta * kl - config.entropy_coef * entropy
  if config.loss_aggregation == 'token-mean':
    aggregate = lambda terms: jnp.sum(terms * mask) / jnp.sum(mask)  # noqa: E731
  else:
    assert config.loss_aggregation == 'seq-mean-token-mean'
    aggregate = lambda terms: jnp.mean(jnp.sum(terms * mask, axis=1) / lengths)  # noqa: E731
  summand_scale = jax.lax.stop_gradient(policy_scale + aggregate(jnp.abs(token_terms)))
  return policy + aggregate(token_terms), (jnp.sum(kl * mask) / jnp.sum(mask),
                                           jnp.sum(entropy * mask) / jnp.sum(mask), summand_scale)


@pytest.mark.parametrize('case', [pytest.param(case, marks=() if case == 'token' else pytest.mark.exhaustive)
                                  for case in sorted(GRADIENT_CASES)])
def test_policy_loss_gradient_matches_full_logits(case, seed):
  config = GRADIENT_CASES[case]
  rng = np.random.default_rng(seed)
  graphdef, params = random_model(rng)
  batch = random_batch(rng)
  log_probs, _ = jax.jit(full_logits_log_probs, static_argnums=0)(graphdef, params, batch)
  log_probs = np.asarray(log_probs)
  # pi_old 0.15 away per token, so that about a quarter of the token ratios leave the clip range
  # (and, for GSPO, some rows' mean does); pi_ref and the sampler elsewhere again.
  old = (log_probs + 0.15 * rng.standard_normal(log_probs.shape)).astype(np.float32)
  ref = (log_probs + 0.2 * rng.standard_normal(log_probs.shape)).astype(np.float32)
  # Every branch, whatever the seed (token 0 of each row is a completion token): A > 0 clipped
  # above; A < 0 clipped below, and past the dual clip c = 3. GSPO: row 0 clipped, row 1 not.
  advantages = np.asarray(batch.advantages).copy()
  advantages[:3] = np.abs(advantages[:3]) * [1, -1, -1]
  if case == 'token':
    old[:3, 0] = log_probs[:3, 0] - [0.5, -0.5, 1.3]
  else:
    advantages[1] = abs(advantages[1])
    old[0], old[1] = log_probs[0] - 0.2, log_probs[1] + 1e-3
  batch = batch.replace(advantages=jnp.asarray(advantages)).with_rollout(
      log_probs=jnp.asarray(old + 0.4 * rng.standard_normal(old.shape), jnp.float32))
  mask = np.asarray(batch.mask)
  if case == 'token':
    ratio, a = np.exp(log_probs - old), advantages[:, None]
    assert np.any(mask & (ratio > 1.28) & (a > 0)) and np.any(mask & (ratio < 0.8) & (a < 0))
    assert np.any(mask & (ratio > 3) & (a < 0))
  else:
    s = np.exp(((log_probs - old) * mask).sum(1) / mask.sum(1))
    clipped = ((s > 1.05) & (advantages > 0)) | ((s < 0.96) & (advantages < 0))
    assert clipped.any() and not clipped.all()

  weights = algo.aggregation_weights(batch.mask, config.loss_aggregation, COMPLETION_LENGTH)
  micro = LossInputs(batch=batch, old_log_probs=jnp.asarray(old), ref_log_probs=jnp.asarray(ref), weights=weights,
                     token_weights=algo.aggregation_weights(batch.mask, 'token-mean'))
  ours = jax.jit(jax.value_and_grad(policy_loss, has_aux=True), static_argnums=(1, 3, 4, 5))
  (loss, metrics), grads = ours(params, graphdef, micro, config, TEMPERATURE, False)
  theirs = jax.jit(jax.value_and_grad(reference_loss, has_aux=True), static_argnums=(1, 5))
  (loss_ref, (kl_ref, entropy_ref, summand_scale)), grads_ref = theirs(params, graphdef, batch, old, ref, config)
  assert_close(loss, loss_ref, 'loss', scale=summand_scale)
  assert_close(metrics['kl'], kl_ref, 'kl')
  assert_close(metrics['entropy'], entropy_ref, 'entropy')
  assert_trees_close(grads, grads_ref)
  assert np.abs(np.asarray(grads['lm_head'])).max() > 1e-4  # a real gradient, not zeros on both sides


# ---- micro-batch accumulation ----

@pytest.mark.parametrize('aggregation', ['token-mean', pytest.param('seq-mean-token-mean', marks=pytest.mark.exhaustive)])
def test_micro_batches_accumulate_to_the_whole_batch(aggregation, seed):
  """micro_batch_size = B / 4 against the whole batch at once. Plain SGD makes the parameter
  change the (negated, scaled) gradient itself, so the comparison is as tight as the gradients'
  (AdamW's first step, ~lr * sign(g), would hide errors in |g|). The rate 2^13 is exact and makes
  the change dwarf the parameters, so rounding p - lr g costs ~1e-7 of the change, not an ulp of
  the norm weights (~1.0). Completions of different lengths put different token counts in each
  micro-batch, so token-mean weights normalised per micro-batch fail."""
  rng = np.random.default_rng(seed)
  graphdef, params = random_model(rng)
  batch = random_batch(rng)
  outcomes = []
  for micro_batch_size in (ROWS // 4, 0):
    config = AlgoConfig(group_size=GROUP, micro_batch_size=micro_batch_size, loss_aggregation=aggregation,
                        entropy_coef=0.01, logprob_implementation='xla_chunked')
    run, optimizer = make_update(config, optimizer=optax.sgd(2.0 ** 13))
    new_state, metrics = run(fresh_state(params, optimizer, seed), batch, Held())
    outcomes.append((delta(new_state.params, params), metrics))
  (micro_delta, micro_metrics), (whole_delta, whole_metrics) = outcomes
  assert_trees_close(micro_delta, whole_delta)
  # The losses are sums of per-token terms of size ~|A| (on-policy ratio 1) that can cancel to near 0:
  # their rounding follows the terms (seed 401315368: policy loss 3.3e-5, 7e-9 apart).
  summands = float(np.abs(np.asarray(batch.advantages)).max())
  for name in ('loss', 'policy_loss', 'entropy', 'grad_norm'):
    assert_close(micro_metrics[name], whole_metrics[name], name, scale=summands if 'loss' in name else 0.0)
  assert float(whole_metrics['grad_norm']) > 1e-3


def test_replicas_reduce_their_gradients_once_per_update(seed):
  """Hybrid sharding's contract, on a data 2 x fsdp 2 mesh (the data axis over hosts): each replica
  accumulates its own rows' gradients over its micro-batches and the replicas sum them once per
  optimizer update. The bytes the compiled update sends over the data axis' groups ({i, i + 2})
  are the same with 2 micro-batches as with 1 (each micro-batch reduced over data sent twice as
  much), and the update equals one device's."""
  from grpo_jax import sharding
  from grpo_jax.plan import traffic

  mesh = jax.make_mesh((2, 2, 1, 1, 1), sharding.MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 5,
                       devices=jax.devices()[:4])
  rng = np.random.default_rng(seed)
  graphdef, params = random_model(rng)
  batch = random_batch(rng)
  config = AlgoConfig(group_size=GROUP, micro_batch_size=ROWS // 2, entropy_coef=0.01,
                      logprob_implementation='xla_chunked')
  run, optimizer = make_update(config, optimizer=optax.sgd(2.0 ** 13))
  expected = run(fresh_state(params, optimizer, seed), batch, Held())
  on_mesh = jax.device_put(params, sharding.state_shardings(params, mesh))
  replicated = jax.device_put(batch, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  across = {}
  with jax.set_mesh(mesh):
    actual = run(fresh_state(on_mesh, optimizer, seed), replicated, Held())
    whole, _ = make_update(dataclasses.replace(config, micro_batch_size=0), optimizer=optax.sgd(2.0 ** 13))
    for micro_batch_size, jitted in ((ROWS // 2, run), (0, whole)):
      hlo = jitted.lower(fresh_state(on_mesh, optimizer, seed), replicated, Held()).compile().as_text()
      found = traffic.collectives(hlo, 4)
      across[micro_batch_size] = sum(c.bytes * c.count for c in found
                                     if any(len({device // 2 for device in group}) > 1 for group in c.groups))
  assert_trees_close(delta(actual[0].params, params), delta(expected[0].params, params))
  assert_close(actual[1]['grad_norm'], expected[1]['grad_norm'], 'grad_norm')
  # The gradients' sum is over the parameters' fsdp halves; the few bytes more are the metrics' sums.
  parameter_bytes = sum(leaf.size * 4 for leaf in jax.tree.leaves(params))
  assert across[ROWS // 2] < 1.1 * across[0] and 0 < across[0] < 1.1 * parameter_bytes / 2, across


# ---- on-policy identities ----

def test_on_policy_ratio_is_one_and_equal_rewards_change_nothing(seed):
  """mu = 1 with one mini-batch: pi_old is the live policy, so every ratio is 1 and nothing clips.
  Groups of equal rewards have zero advantages; without KL, entropy bonus or weight decay, the
  gradient is zero and AdamW's update m / (sqrt(v) + eps) is exactly zero."""
  rng = np.random.default_rng(seed)
  graphdef, params = random_model(rng)
  config = AlgoConfig(group_size=GROUP, logprob_implementation='xla_chunked')
  run, optimizer = make_update(config, OptimConfig(learning_rate=1e-2, weight_decay=0.0))
  state = fresh_state(params, optimizer, seed)

  new_state, metrics = run(state, random_batch(rng), Held())
  # The metric sums B * N token weights of 1 / (tokens): fp32 rounding only.
  assert abs(float(metrics['ratio_mean']) - 1.0) <= 1e-6
  assert float(metrics['clip_frac_low']) == 0.0 and float(metrics['clip_frac_high']) == 0.0
  assert int(new_state.updates) == 1
  assert max(np.abs(d).max() for d in jax.tree.leaves(delta(new_state.params, params))) > 1e-3

  rewards = np.repeat(rng.integers(0, 2, (PROMPTS, 1)), GROUP, axis=1).astype(np.float32)
  advantages = algo.ADVANTAGES['grpo'](jnp.asarray(rewards)).reshape(-1)
  np.testing.assert_array_equal(np.asarray(advantages), 0.0)
  # From fresh moments: after a real step, momentum alone would move the parameters.
  unchanged, metrics = run(state, random_batch(rng, advantages=advantages), Held())
  assert float(metrics['grad_norm']) == 0.0 and float(metrics['nonfinite']) == 0.0
  assert int(unchanged.updates) == 1
  assert_trees_equal(unchanged.params, params)


# ---- the non-finite guard ----

def test_nonfinite_batch_is_skipped(seed):
  rng = np.random.default_rng(seed)
  graphdef, params = random_model(rng)
  config = AlgoConfig(group_size=GROUP, logprob_implementation='xla_chunked')
  run, optimizer = make_update(config)
  state, _ = run(fresh_state(params, optimizer, seed), random_batch(rng), Held())  # non-trivial moments
  assert int(state.updates) == 1 and int(state.skips) == 0

  poisoned = random_batch(rng)
  poisoned = poisoned.replace(advantages=poisoned.advantages.at[3].set(jnp.nan))
  skipped, metrics = run(state, poisoned, Held())
  assert float(metrics['nonfinite']) == 1.0
  assert int(skipped.skips) == 1 and int(skipped.updates) == 1
  assert_trees_equal(skipped.params, state.params)
  assert_trees_equal(skipped.opt_state, state.opt_state)
  skipped, _ = run(skipped, poisoned, Held())
  assert int(skipped.skips) == 2 and int(skipped.updates) == 1

  recovered, metrics = run(skipped, random_batch(rng), Held())
  assert float(metrics['nonfinite']) == 0.0
  assert int(recovered.skips) == 0 and int(recovered.updates) == 2
  assert max(np.abs(d).max() for d in jax.tree.leaves(delta(recovered.params, state.params))) > 1e-5


# ---- the reference policy ----

@pytest.mark.exhaustive
def test_kl_paths(seed):
  rng = np.random.default_rng(seed)
  graphdef, params = random_model(rng)
  batch = random_batch(rng)
  # kl_beta = 0 keeps no reference parameters: none held must do.
  run, optimizer = make_update(AlgoConfig(group_size=GROUP, logprob_implementation='xla_chunked'))
  state, metrics = run(fresh_state(params, optimizer, seed), batch, Held())
  assert float(metrics['kl']) == 0.0 and int(state.updates) == 1

  run, optimizer = make_update(AlgoConfig(group_size=GROUP, kl_beta=0.1, kl_estimator='k3',
                                          logprob_implementation='xla_chunked'))
  # pi_ref = pi at the first step: log-probs from two compilations of the same fp32 forward agree
  # to ~1e-6, and k3 ~ x^2 / 2 of that is far below 1e-9.
  _, metrics = run(fresh_state(params, optimizer, seed), batch, Held(reference=params))
  assert 0.0 <= float(metrics['kl']) <= 1e-9
  # A different reference is seen (the check above can fail).
  _, other = random_model(rng)
  _, metrics = run(fresh_state(params, optimizer, seed), batch, Held(reference=other))
  assert float(metrics['kl']) > 1e-3


# ---- several epochs and mini-batches ----

@pytest.mark.exhaustive
def test_epochs_times_minibatches_optimizer_updates(seed):
  """mu = 2 passes of 2 mini-batches: 4 optimizer updates, all against the frozen pi_old, so the
  later ones see ratios away from 1 (pi_old recomputed per mini-batch would keep them at 1)."""
  rng = np.random.default_rng(seed)
  graphdef, params = random_model(rng)
  config = AlgoConfig(group_size=GROUP, ppo_epochs=2, num_minibatches=2, logprob_implementation='xla_chunked')
  run, optimizer = make_update(config, OptimConfig(learning_rate=1e-2))
  state, metrics = run(fresh_state(params, optimizer, seed), random_batch(rng), Held())
  assert int(state.updates) == 4 and int(state.skips) == 0
  assert float(metrics['nonfinite']) == 0.0
  assert all(np.isfinite(float(value)) for value in metrics.values())
  assert abs(float(metrics['ratio_mean']) - 1.0) > 1e-4
  assert max(np.abs(d).max() for d in jax.tree.leaves(delta(state.params, params))) > 1e-3


# ---- config checks ----

VALID = Config(rollout=RolloutConfig(prompts_per_step=4), algo=AlgoConfig(group_size=4),
               train=TrainConfig(steps=10, checkpoint_every=4))


def replace(config, **sections):
  """`config` with the named sections' fields replaced (a dict), or a section replaced whole (the
  task section of another kind: each kind is its own class)."""
  return dataclasses.replace(config, **{
      name: fields if dataclasses.is_dataclass(fields) else dataclasses.replace(getattr(config, name), **fields)
      for name, fields in sections.items()})


@pytest.mark.parametrize('sections, field', [
    (dict(algo=dict(group_size=1)), 'algo.group_size'),
    (dict(algo=dict(num_minibatches=3)), 'algo.num_minibatches'),  # 16 rows
    (dict(algo=dict(num_minibatches=2, micro_batch_size=3)), 'algo.micro_batch_size'),  # of 8
    (dict(task=MathSection(dataset=DatasetSource('x.jsonl')), train=dict(steps_per_call=2)), 'train.steps_per_call'),
    (dict(train=dict(steps_per_call=3)), 'train.checkpoint_every'),  # 4 is not a multiple of 3
])
def test_validate_names_the_field(sections, field):
  assert replace(VALID) == VALID
  with pytest.raises(UserError, match=field.replace('.', r'\.')):
    replace(VALID, **sections)


# ---- the sampler <-> trainer log-prob mismatch ----

@pytest.mark.exhaustive
@pytest.mark.parametrize('epochs, minibatches', [(1, 1), (2, 2)])
def test_sampler_mismatch_metrics_against_numpy(seed, epochs, minibatches):
  """The sampler's log-probs are the trainer's (full logits, before any update) moved by a known
  gap per token: some small, some beyond log 2 either way. The update reports the gap's mean and
  max over completion tokens and the share outside the ratio band [0.5, 2] — from pi_old over the
  whole batch when it is scored (mu = 2), else from the first mini-batch (mu = 1, one mini-batch)."""
  rng = np.random.default_rng(seed)
  graphdef, params = random_model(rng)
  batch = random_batch(rng)
  trainer, _ = full_logits_log_probs(graphdef, params, batch)
  # |gap| in [0, 0.5] or [1, 2]: far from log 2 = 0.69, so fp32 rounding cannot move a token across.
  size = rng.uniform(0.0, 0.5, trainer.shape) + rng.integers(0, 2, trainer.shape) * 1.0
  gap = size * rng.choice([-1.0, 1.0], trainer.shape)
  batch = batch.with_rollout(log_probs=jnp.asarray(np.asarray(trainer) + gap, jnp.float32))
  config = AlgoConfig(group_size=GROUP, ppo_epochs=epochs, num_minibatches=minibatches,
                      logprob_implementation='xla_chunked')
  run, optimizer = make_update(config)
  _, metrics = run(fresh_state(params, optimizer, seed), batch, Held())
  mask = np.asarray(batch.mask)
  assert_close(metrics['sampler_gap_mean'], np.abs(gap)[mask].mean(), 'mean')
  assert_close(metrics['sampler_gap_max'], np.abs(gap)[mask].max(), 'max')
  assert_close(metrics['sampler_ratio_outside'], (np.abs(gap)[mask] > np.log(2)).mean(), 'outside')
