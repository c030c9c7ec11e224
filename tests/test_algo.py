"""rl/algo.py: every estimator, ratio, clip and aggregation against a NumPy reference written
here from the papers' formulas (float64), never by calling the code under test."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.rl import algo

# fp32 maths against float64 references on O(1) inputs: a few ulps of the largest term.
RTOL, ATOL = 1e-6, 1e-6


def assert_close(actual, expected, rtol=RTOL, atol=ATOL, what=''):
  np.testing.assert_allclose(np.asarray(actual, np.float64), np.asarray(expected, np.float64),
                             rtol=rtol, atol=atol, err_msg=what)


def random_mask(rng, rows, length):
  """[rows, length] bool completion masks of different lengths: one row of a single token, one
  full row, the rest anywhere in between."""
  lengths = rng.integers(1, length + 1, rows)
  lengths[0], lengths[-1] = 1, length
  rng.shuffle(lengths)
  return np.arange(length)[None, :] < lengths[:, None]


# ---- advantages ----

def numpy_advantages(name, rewards, epsilon):
  r = rewards.astype(np.float64)
  group = r.shape[1]
  if name == 'grpo':  # Shao et al.: (r - mean) / std, sample std (ddof 1)
    centred = r - r.mean(axis=1, keepdims=True)
    return centred / (np.sqrt((centred ** 2).sum(axis=1, keepdims=True) / (group - 1)) + epsilon)
  if name == 'drgrpo':  # Liu et al.: r - mean
    return r - r.mean(axis=1, keepdims=True)
  # RLOO: each sample's baseline is the mean of the other G - 1 rewards of its group.
  others = np.array([[np.delete(row, i).mean() for i in range(group)] for row in r])
  return r - others


def test_registries_hold_the_documented_names():
  assert set(algo.ADVANTAGES) == {'grpo', 'drgrpo', 'rloo'}
  assert set(algo.KL_ESTIMATORS) == {'k1', 'k2', 'k3'}
  assert set(algo.AGGREGATIONS) == {'token-mean', 'seq-mean-token-mean', 'seq-mean-token-sum',
                                    'seq-mean-token-sum-norm'}


@pytest.mark.parametrize('name', ['grpo', 'drgrpo', 'rloo'])
def test_advantages_match_numpy(name, seed):
  rng = np.random.default_rng(seed)
  rewards = rng.normal(0.5, 1.0, (5, 6)).astype(np.float32)
  epsilon = 1e-3  # large enough that a missing or misplaced eps would show
  got = jax.jit(algo.ADVANTAGES[name], static_argnums=1)(rewards, epsilon)
  assert got.shape == rewards.shape and got.dtype == jnp.float32
  assert_close(got, numpy_advantages(name, rewards, epsilon), what=name)


@pytest.mark.parametrize('name', ['grpo', 'drgrpo', 'rloo'])
def test_advantages_of_binary_rewards(name, seed):
  """The usual case: 0/1 rewards, some groups all right or all wrong, which carry no signal."""
  rng = np.random.default_rng(seed)
  rewards = (rng.random((6, 8)) < 0.5).astype(np.float32)
  rewards[0], rewards[1] = 1.0, 0.0
  rewards[2, :2] = [0.0, 1.0]  # at least one mixed group
  got = np.asarray(algo.ADVANTAGES[name](jnp.asarray(rewards), 1e-6))
  assert_close(got, numpy_advantages(name, rewards, 1e-6), what=name)
  equal = np.all(rewards == rewards[:, :1], axis=1)
  np.testing.assert_array_equal(got[equal], 0.0)
  assert np.all(np.abs(got[~equal]) > 0)


# The group mean of G equal fp32 rewards is rounded, so a plain r - mean leaves a few ulps that
# GRPO divides by an equally tiny std + eps (8 rewards of 100.1 gave advantages of 0.83).
@pytest.mark.parametrize('name', ['grpo', 'drgrpo', 'rloo'])
def test_equal_rewards_give_exactly_zero_advantage(name, seed):
  """A group whose G rewards are all the same real number (a reward model's score, a partial
  credit) carries no signal and must give exactly 0 (as it does for 0/1 rewards)."""
  rng = np.random.default_rng(seed)
  values = rng.normal(0.0, 3.0, (64, 1)).astype(np.float32)
  rewards = np.repeat(values, 8, axis=1)
  got = np.asarray(algo.ADVANTAGES[name](jnp.asarray(rewards), 1e-6))
  bad = np.flatnonzero(np.any(got != 0.0, axis=1))
  assert bad.size == 0, (f'{bad.size}/64 constant groups get a non-zero advantage, e.g. reward '
                         f'{values[bad[0], 0]!r} -> {got[bad[0], 0]!r}' if bad.size else '')


# ---- KL estimators (Schulman 2020); log_ratio = log pi - log pi_ref ----

def numpy_kl(name, log_ratio):
  x = log_ratio.astype(np.float64)
  ref_over_pi = np.exp(-x)
  return {'k1': x, 'k2': 0.5 * x ** 2, 'k3': ref_over_pi - 1.0 - np.log(ref_over_pi)}[name]


@pytest.mark.parametrize('name', ['k1', 'k2', 'k3'])
def test_kl_estimators_match_numpy(name, seed):
  rng = np.random.default_rng(seed)
  log_ratio = rng.uniform(-3.0, 3.0, (7, 13)).astype(np.float32)
  got = np.asarray(algo.KL_ESTIMATORS[name](jnp.asarray(log_ratio)))
  expected = numpy_kl(name, log_ratio)
  assert_close(got, expected, what=name)
  if name != 'k1':
    assert np.all(got >= 0.0)


def test_k3_is_non_negative_near_zero(seed):
  """k3 = r - 1 - log r >= 0 with equality only at r = 1. Near r = 1 it is ~x^2/2, computed as
  expm1(-x) + x: two terms of size |x| cancel, so fp32 leaves an absolute error of a few ulp of
  |x| (a relative one of ~1e-7 / |x|), but never a negative value."""
  rng = np.random.default_rng(seed)
  log_ratio = np.concatenate([rng.uniform(-5, 5, 500), rng.uniform(-1e-3, 1e-3, 500)]).astype(np.float32)
  got = np.asarray(algo.kl_k3(jnp.asarray(log_ratio)), np.float64)
  assert np.all(got >= 0.0)
  x = log_ratio.astype(np.float64)
  small = np.abs(x) < 1e-3
  series = x[small] ** 2 / 2 - x[small] ** 3 / 6 + x[small] ** 4 / 24  # truncation < 1e-16 here
  ulp = np.finfo(np.float32).eps
  assert np.all(np.abs(got[small] - series) <= 4 * ulp * np.abs(x[small]))
  assert float(algo.kl_k3(jnp.float32(0.0))) == 0.0


def test_k1_and_k3_estimate_the_kl_of_two_categoricals(seed):
  """E_{y ~ pi}[k(log pi(y) - log pi_ref(y))] = KL(pi || pi_ref) for k1 and k3. Each mean over n
  samples is checked to 5 of its standard errors, computed exactly from pi (false alarm rate
  below 1e-6). The pair (pi, pi_ref) is drawn until the check has power: KL at least 20 standard
  errors from 0, and from E_pi_ref[k1] = -KL(pi_ref || pi), which samples from the wrong policy
  would estimate (a pi_ref far above pi on a rare category can give k3 a standard error of 1/15
  of the KL: seed 4286548771's first pair)."""
  rng = np.random.default_rng(seed)
  categories, samples = 12, 200_000

  def standard_errors(pi, log_ratio_of):  # of each estimator's mean over `samples` draws from pi
    values = {name: numpy_kl(name, log_ratio_of) for name in ('k1', 'k3')}  # per category, float64
    return {name: np.sqrt((np.sum(pi * v ** 2) - np.sum(pi * v) ** 2) / samples) for name, v in values.items()}

  for _ in range(100):
    pi, pi_ref = rng.dirichlet(np.ones(categories)), rng.dirichlet(np.ones(categories))
    kl, reverse = float(np.sum(pi * np.log(pi / pi_ref))), float(np.sum(pi_ref * np.log(pi_ref / pi)))
    log_ratio_of = np.log(pi) - np.log(pi_ref)
    errors = standard_errors(pi, log_ratio_of)
    if all(kl > 20 * error and kl + reverse > 20 * error for error in errors.values()):
      break
  else:
    raise AssertionError(f'seed {seed}: no pair of 100 gives the check power')
  y = rng.choice(categories, size=samples, p=pi)
  log_ratio = jnp.asarray(log_ratio_of[y], jnp.float32)
  for name, error in errors.items():
    estimate = np.mean(np.asarray(algo.KL_ESTIMATORS[name](log_ratio), np.float64))
    # The fp32 estimator is accurate to ~1e-6 relative, negligible next to the standard error.
    assert abs(estimate - kl) <= 5 * error, (name, estimate, kl, error)


# ---- clipped surrogate (PPO, DAPO clip-higher, dual clip) ----

def numpy_surrogate(log_ratio, advantages, eps_low, eps_high, dual_clip):
  """Objective min(r A, clip(r) A) (with dual clip: max(that, c A) for A < 0); loss = -objective."""
  r = np.exp(log_ratio.astype(np.float64))
  a = np.broadcast_to(advantages.astype(np.float64), r.shape)
  clipped_r = np.clip(r, 1 - eps_low, 1 + eps_high)
  objective = np.minimum(r * a, clipped_r * a)
  clip_active = clipped_r * a < r * a  # the clipped term is the one taken: no gradient through r
  if dual_clip:
    dual_active = (a < 0) & (dual_clip * a > objective)
    objective = np.where(dual_active, dual_clip * a, objective)
  else:
    dual_active = np.zeros(r.shape, bool)
  return dict(loss=-objective, ratio=r, clipped_low=clip_active & (a < 0),
              clipped_high=clip_active & (a > 0), no_gradient=clip_active | dual_active)


@pytest.mark.parametrize('dual_clip', [0.0, 3.0])
@pytest.mark.parametrize('advantage_shape', ['per_row', 'per_token'])
def test_clipped_surrogate_matches_numpy(dual_clip, advantage_shape, seed):
  rng = np.random.default_rng(seed)
  rows, length, eps_low, eps_high = 16, 64, 0.2, 0.28
  # Ratios from e^-1.6 = 0.2 to e^1.6 = 5: both clip edges, and past c = 3 for the dual clip.
  log_ratio = rng.uniform(-1.6, 1.6, (rows, length)).astype(np.float32)
  shape = (rows, 1) if advantage_shape == 'per_row' else (rows, length)
  advantages = rng.normal(0.0, 1.0, shape).astype(np.float32)
  advantages[0], advantages[1] = 0.7, -0.9  # both signs, whatever the seed
  log_ratio[0, :3] = [-1.0, 0.0, 1.0]
  log_ratio[1, :3] = [-1.0, 0.0, 1.5]
  expected = numpy_surrogate(log_ratio, advantages, eps_low, eps_high, dual_clip)

  def loss_of(x):
    return algo.clipped_surrogate(x, jnp.asarray(advantages), epsilon_low=eps_low,
                                  epsilon_high=eps_high, dual_clip=dual_clip)

  got = jax.jit(loss_of)(jnp.asarray(log_ratio))
  assert_close(got['loss'], expected['loss'], rtol=2e-6, what='loss')
  assert_close(got['ratio'], expected['ratio'], rtol=2e-6, what='ratio')
  for flag in ('clipped_low', 'clipped_high'):
    np.testing.assert_array_equal(np.asarray(got[flag]), expected[flag], err_msg=flag)
    assert expected[flag].any() and not expected[flag].all(), flag
  # Gradient through r: -A r where neither clip binds, exactly 0 where one does.
  grad = np.asarray(jax.grad(lambda x: jnp.sum(loss_of(x)['loss']))(jnp.asarray(log_ratio)))
  free = ~expected['no_gradient']
  np.testing.assert_array_equal(grad[~free], 0.0)
  a = np.broadcast_to(advantages, log_ratio.shape)
  assert_close(grad[free], -(expected['ratio'] * a)[free], rtol=2e-6)
  if dual_clip:
    dual = (a < 0) & (expected['ratio'] > dual_clip)
    assert dual.any()
    assert_close(got['loss'][dual], -dual_clip * a[dual], rtol=2e-6)
  else:  # without the dual clip the loss of A < 0 grows with r without bound
    assert np.max(np.asarray(got['loss'])[a < 0] / -a[a < 0]) > 3.0


def test_surrogate_at_ratio_one(seed):
  """At pi = pi_old (log_ratio 0) clipping cannot bind: loss = -A exactly, no flags, and the
  gradient is that of the unclipped surrogate, -A."""
  rng = np.random.default_rng(seed)
  advantages = rng.normal(0.0, 1.0, (9, 1)).astype(np.float32)
  zero = jnp.zeros((9, 11), jnp.float32)
  for dual_clip in (0.0, 3.0):
    def loss_of(x):
      return algo.clipped_surrogate(x, jnp.asarray(advantages), epsilon_low=0.2, epsilon_high=0.28,
                                    dual_clip=dual_clip)
    got = loss_of(zero)
    np.testing.assert_array_equal(np.asarray(got['loss']), np.broadcast_to(-advantages, (9, 11)))
    np.testing.assert_array_equal(np.asarray(got['ratio']), 1.0)
    assert not np.any(got['clipped_low']) and not np.any(got['clipped_high'])
    unclipped = -jnp.exp(zero) * advantages
    np.testing.assert_array_equal(np.asarray(got['loss']), np.asarray(unclipped))
    grad = jax.grad(lambda x: jnp.sum(loss_of(x)['loss']))(zero)
    np.testing.assert_array_equal(np.asarray(grad), np.broadcast_to(-advantages, (9, 11)))


# ---- GSPO sequence-level ratio ----

def test_sequence_log_ratio_value_and_gradient(seed):
  """Zheng et al. 2025: s_i = (pi(y_i) / pi_old(y_i))^(1/|y_i|), objective
  1/B sum_i min(s_i A_i, clip(s_i) A_i), so d loss / d log pi(y_i,t) = -s_i A_i / (B |y_i|) on
  the row's tokens when s_i is not clipped, and 0 when it is (and always 0 on padding)."""
  rng = np.random.default_rng(seed)
  rows, length, eps_low, eps_high = 24, 20, 3e-4, 4e-4
  mask = random_mask(rng, rows, length)
  lengths = mask.sum(axis=1)
  log_probs = rng.uniform(-6.0, -0.1, (rows, length)).astype(np.float32)
  # Per-row target log s_i: half well inside (-3e-4, 4e-4), half well outside, both signs.
  inside = rng.uniform(-1.5e-4, 1.5e-4, rows)
  outside = rng.choice([-1.0, 1.0], rows) * rng.uniform(8e-4, 2e-3, rows)
  target = np.where(np.arange(rows) % 2 == 0, inside, outside)
  noise = rng.normal(0.0, 0.05, (rows, length))
  noise -= (noise * mask).sum(axis=1, keepdims=True) / lengths[:, None]  # zero masked mean
  noise[~mask] = rng.normal(0.0, 3.0, (~mask).sum())  # padding: wild values that must not count
  old_log_probs = (log_probs - target[:, None] - noise).astype(np.float32)
  advantages = rng.normal(0.0, 1.0, rows).astype(np.float32)
  advantages[:4] = [1.0, 1.0, -1.0, -1.0]

  diff = log_probs.astype(np.float64) - old_log_probs.astype(np.float64)
  log_s = (diff * mask).sum(axis=1) / lengths
  s = np.exp(log_s)
  clipped = ((advantages > 0) & (s > 1 + eps_high)) | ((advantages < 0) & (s < 1 - eps_low))
  assert clipped.any() and (~clipped).any()

  value = algo.sequence_log_ratio(jnp.asarray(log_probs), jnp.asarray(old_log_probs), jnp.asarray(mask))
  # fp32 sums of |diff| <~ 6 over <= 20 tokens: absolute error ~1e-6.
  assert_close(value, np.broadcast_to(log_s[:, None], (rows, length)), rtol=0, atol=2e-6)

  def loss(lp):
    log_ratio = algo.sequence_log_ratio(lp, jnp.asarray(old_log_probs), jnp.asarray(mask))
    surrogate = algo.clipped_surrogate(log_ratio, jnp.asarray(advantages)[:, None],
                                       epsilon_low=eps_low, epsilon_high=eps_high)
    return algo.aggregate(surrogate['loss'], jnp.asarray(mask), 'seq-mean-token-mean')

  grad = np.asarray(jax.jit(jax.grad(loss))(jnp.asarray(log_probs)))
  expected = -(s * advantages / (rows * lengths))[:, None] * mask * ~clipped[:, None]
  assert_close(grad, expected, rtol=2e-6, atol=0)
  np.testing.assert_array_equal(grad[~mask], 0.0)
  np.testing.assert_array_equal(grad[clipped], 0.0)


def test_token_log_ratio(seed):
  rng = np.random.default_rng(seed)
  log_probs, old = rng.uniform(-8, 0, (2, 5, 7)).astype(np.float32)
  assert_close(algo.token_log_ratio(jnp.asarray(log_probs), jnp.asarray(old)),
               log_probs.astype(np.float64) - old, atol=2e-6)


# ---- truncated importance sampling ----

def test_truncated_importance_weight(seed):
  """TIS (Yao et al. 2025): min(pi_old / pi_sampler, C), a constant for autodiff."""
  rng = np.random.default_rng(seed)
  sampler = rng.uniform(-6, -0.1, (6, 30)).astype(np.float32)
  old = (sampler + rng.uniform(-1.0, 1.5, sampler.shape)).astype(np.float32)
  cap = 2.0
  expected = np.minimum(np.exp(old.astype(np.float64) - sampler), cap)
  assert (expected == cap).any() and (expected < cap).any() and (expected < 1).any()
  got = algo.truncated_importance_weight(jnp.asarray(old), jnp.asarray(sampler), cap)
  assert_close(got, expected, rtol=2e-6)
  grads = jax.grad(lambda o, s: jnp.sum(algo.truncated_importance_weight(o, s, cap) * o), (0, 1))(
      jnp.asarray(old), jnp.asarray(sampler))
  # d/d old of sum(w * old) is w itself when w carries no gradient.
  assert_close(grads[0], expected, rtol=2e-6)
  np.testing.assert_array_equal(np.asarray(grads[1]), 0.0)


# ---- aggregation ----

def numpy_aggregate(loss, mask, mode, max_tokens=None):
  loss, m = loss.astype(np.float64), mask.astype(np.float64)
  rows, length = m.shape
  if mode == 'token-mean':
    return (loss * m).sum() / m.sum()
  if mode == 'seq-mean-token-mean':
    return np.mean((loss * m).sum(axis=1) / m.sum(axis=1))
  if mode == 'seq-mean-token-sum':
    return np.mean((loss * m).sum(axis=1))
  assert mode == 'seq-mean-token-sum-norm'
  return (loss * m).sum() / (rows * (max_tokens or length))


@pytest.mark.parametrize('mode', algo.AGGREGATIONS)
def test_aggregation_matches_numpy_and_splits_into_micro_batches(mode, seed):
  rng = np.random.default_rng(seed)
  rows, length, micro = 16, 24, 4
  mask = random_mask(rng, rows, length)
  loss = rng.normal(0.0, 1.0, (rows, length)).astype(np.float32)
  loss[~mask] = 1e3  # padding loss must not count
  expected = numpy_aggregate(loss, mask, mode)
  got = float(algo.aggregate(jnp.asarray(loss), jnp.asarray(mask), mode))
  assert_close(got, expected, rtol=1e-5, atol=1e-6, what=mode)
  if mode == 'seq-mean-token-sum-norm':
    expected_40 = numpy_aggregate(loss, mask, mode, max_tokens=40)
    assert_close(float(algo.aggregate(jnp.asarray(loss), jnp.asarray(mask), mode, 40)), expected_40,
                 rtol=1e-5, atol=1e-6)
  # Weights of the whole batch, cut into micro-batches: their partial sums add up to the whole.
  weights = np.asarray(algo.aggregation_weights(jnp.asarray(mask), mode))
  np.testing.assert_array_equal(weights[~mask], 0.0)
  parts = [np.sum(weights[i:i + micro].astype(np.float64) * loss[i:i + micro])
           for i in range(0, rows, micro)]
  assert_close(sum(parts), expected, rtol=1e-5, atol=1e-6)


def test_micro_batches_need_whole_batch_weights(seed):
  """The reason weights come from the whole batch: token-mean over micro-batches of different
  token counts is not the mean of the micro-batch token-means."""
  rng = np.random.default_rng(seed)
  mask = np.zeros((8, 10), bool)
  mask[:4, :2] = True
  mask[4:, :] = True
  loss = rng.normal(0.0, 1.0, (8, 10)).astype(np.float32)
  loss[:4] += 5.0
  whole = numpy_aggregate(loss, mask, 'token-mean')
  per_micro = np.mean([numpy_aggregate(loss[:4], mask[:4], 'token-mean'),
                       numpy_aggregate(loss[4:], mask[4:], 'token-mean')])
  assert abs(whole - per_micro) > 1.0
  weights = algo.aggregation_weights(jnp.asarray(mask), 'token-mean')
  parts = [float(jnp.sum(weights[i:i + 4] * loss[i:i + 4])) for i in (0, 4)]
  assert_close(sum(parts), whole, rtol=1e-5, atol=1e-6)


def test_unknown_aggregation_names_the_choices():
  with pytest.raises(ValueError, match='token-mean'):
    algo.aggregation_weights(jnp.ones((2, 3)), 'token-sum')
