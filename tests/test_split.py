"""Split devices (rollout.devices): the sampler decodes on devices of its own while the trainer
trains on the others. Each step trains on groups the sampler drew under weights one or more
versions behind, and every token equals what the weights of its recorded version give after the
tokens before it (teacher-forced per version); the weights cross to the sampler's devices in its
own layout, shard for shard; hostile settings are one-line errors."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from grpo_jax.rl.held import Held
from grpo_jax.build import build_rl_step, build_task
from grpo_jax.config import load_config
from grpo_jax.errors import UserError
from grpo_jax.model import lora, make_mesh
from grpo_jax.rl.loss import lag_means, mismatch_by_lag
from grpo_jax.rl.state import create_train_state
from grpo_jax.sampler.layout import split_devices

# Its module-scoped fixtures are built once: the whole file runs on one xdist worker.
pytestmark = pytest.mark.xdist_group('test_split')

MAX_LAG = 2


def split_steps(config, steps: int, sampler_devices: int = 4) -> dict:
  """`steps` RL steps of `config` with the last `sampler_devices` devices sampling, recording the
  weights of every version and what each step's update was given (prompt tokens, mask, rollout and
  the prompts' images, numpy)."""
  trainer, sampler = split_devices(jax.devices(), sampler_devices)
  mesh = make_mesh(config.mesh, devices=trainer)
  model = config.model.build(mesh, config.run.seed)
  task = build_task(config)
  rl_step = build_rl_step(config, model, mesh, task)
  trained, frozen = lora.split_trainable(nnx.state(model))  # with LoRA, the optimizer sees the adapters only
  state = create_train_state(trained, rl_step.optimizer, config.run.seed, pool=rl_step.empty_pool,
                             shardings=rl_step.state_shardings, frozen=frozen)
  copy = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree))
  learned, weights, metrics = [], [], []
  learn = rl_step.learn

  def recording(state, ref_params, prompt_tokens, prompt_mask, rollout, scores, vision=None):
    learned.append(jax.device_get((prompt_tokens, prompt_mask, rollout, vision)))
    return learn(state, ref_params, prompt_tokens, prompt_mask, rollout, scores, vision)

  rl_step.learn = recording
  with jax.set_mesh(mesh):
    for _ in range(steps):  # the first step primes the pool (its groups sampled under these weights)
      weights.append(copy(state.policy))  # with LoRA, the adapters joined with the frozen base
      state, row = rl_step(state, Held())
      metrics.append(jax.device_get(row))
  return dict(rl_step=rl_step, mesh=mesh, sampler=sampler, state=state, learned=learned, weights=weights,
              metrics=metrics, graphdef=nnx.graphdef(model))


@pytest.fixture(scope='module')
def split_run():
  """Six steps of tiny_arith with 4 sampler and 4 trainer devices at max_lag 2."""
  seed = int(np.random.default_rng().integers(1 << 16))
  print(f'seed={seed}')
  config = load_config('configs/tiny_arith.yaml', [
      'rollout.devices=4', f'algo.max_lag={MAX_LAG}', 'algo.tis_cap=2', 'rollout.prompts_per_step=4',
      'algo.group_size=4', 'rollout.slots=4', 'optim.learning_rate=0.05', 'optim.warmup_steps=0',
      'algo.entropy_coef=0.5',  # a gradient at every step, rewarded or not: every version's weights differ
      f'run.seed={seed}'])
  return split_steps(config, 6)


def test_split_steps_train_on_groups_sampled_behind(split_run):
  """Step v trains on tokens of versions v - 2 .. v - 1 (step 0 on version 0's), the metrics say
  so, and some answers span two versions (cut off at one step, finished under the next weights)."""
  spanning = 0
  for step, ((_, _, rollout, _), metrics) in enumerate(zip(split_run['learned'], split_run['metrics'])):
    versions = rollout.versions[rollout.mask]
    newest = max(step - 1, 0)
    assert versions.max() == newest and versions.min() >= step - MAX_LAG, (step, np.unique(versions))
    lags = step - versions
    assert metrics['lag_max'] == lags.max() and metrics['lag_mean'] == pytest.approx(lags.mean(), rel=1e-6)
    for row in range(rollout.tokens.shape[0]):
      spanning += len(set(rollout.versions[row, :rollout.lengths[row]].tolist())) > 1
  assert spanning > 0, 'no answer spans two versions: the test would not test carrying across the split'
  mode = split_run['rl_step'].host_mode  # the sampler apart: one step a call (train.steps_per_call 10)
  assert mode.split and mode.steps_per_call(10) == 1


def test_every_token_is_its_versions_sample(split_run):
  """Teacher-forced on one device's forward: each token's recorded log-prob is the log-softmax of
  the logits the weights of its version give after the prompt and the tokens before it."""
  assert_tokens_are_their_versions_samples(split_run)


@pytest.mark.exhaustive
def test_a_mixture_on_split_devices_samples_each_version_and_records_its_routes(seed):
  """tiny_arith_moe with routing replay, the sampler on 4 devices of its own (its experts over the
  expert axis of its groups): every token is its version's sample, teacher-forced, and every fed
  token's routes are recorded for the update to replay."""
  config = load_config('configs/tiny_arith_moe.yaml', [
      'rollout.devices=4', 'algo.max_lag=1', 'algo.tis_cap=2', 'rollout.prompts_per_step=4', 'algo.group_size=4',
      'rollout.slots=4',
      'optim.learning_rate=0.05', 'optim.warmup_steps=0', 'algo.entropy_coef=0.5', f'run.seed={seed % 1000}'])
  run = split_steps(config, 4)
  assert_tokens_are_their_versions_samples(run)
  for prompt_tokens, prompt_mask, rollout, _ in run['learned']:
    routes = rollout.routes  # [B, Tp + N, Ls, k]
    group = rollout.tokens.shape[0] // prompt_tokens.shape[0]
    answer = np.arange(rollout.tokens.shape[1])[None] < rollout.lengths[:, None]
    fed = np.concatenate([np.repeat(prompt_mask, group, axis=0).astype(bool), answer], axis=1)
    fed[np.arange(len(fed)), prompt_tokens.shape[1] + rollout.lengths - 1] = False  # each answer's last
    assert (routes[fed] < 8).all() and (routes[~fed] == 255).all()
  assert all('routing_replay_rerouted_frac' in row for row in run['metrics'])  # the update replayed them


@pytest.mark.exhaustive
@pytest.mark.parametrize('kind', ['dense', 'moe'])
def test_lora_on_split_devices_samples_each_version(seed, kind):
  """LoRA with the sampler on 4 devices of its own (tiny_arith_lora; tiny_arith_moe with attention
  adapters and routing replay, its experts over the sampler's expert axis): the frozen base crosses
  once, each version's adapters every step, and every token is its version's sample (the adapters
  joined with the base), teacher-forced."""
  config, adapters = {'dense': ('configs/tiny_arith_lora.yaml', []),
                      'moe': ('configs/tiny_arith_moe.yaml', ['model.lora.rank=4', 'model.lora.targets=[q, v]'])}[kind]
  config = load_config(config, [
      *adapters, 'rollout.devices=4', 'algo.max_lag=1', 'algo.tis_cap=2', 'rollout.prompts_per_step=4', 'algo.group_size=4',
      'rollout.slots=4', 'optim.learning_rate=0.05', 'optim.warmup_steps=0', 'algo.entropy_coef=0.5',
      f'run.seed={seed % 1000}'])
  run = split_steps(config, 4)
  assert run['state'].frozen is not None
  assert_tokens_are_their_versions_samples(run)


def assert_tokens_are_their_versions_samples(split_run):
  graphdef, mesh = split_run['graphdef'], split_run['mesh']
  forward = jax.jit(lambda params, tokens: jax.nn.log_softmax(nnx.merge(graphdef, params)(tokens).astype(jnp.float32)))
  weights = [jax.device_get(params) for params in split_run['weights']]
  for before, after in zip(weights, weights[1:]):
    assert max(np.abs(a - b).max() for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after))) > 1e-3
  checked = 0
  with jax.set_mesh(mesh):
    for step, (prompt_tokens, prompt_mask, rollout, _) in enumerate(split_run['learned']):
      group = rollout.tokens.shape[0] // prompt_tokens.shape[0]
      width = prompt_tokens.shape[1] + rollout.tokens.shape[1]
      for version in np.unique(rollout.versions[rollout.mask]):
        rows = [row for row in range(rollout.tokens.shape[0]) if (rollout.versions[row] == version).any()]
        sequences, prompts = [], []
        for row in rows:
          prompt = prompt_tokens[row // group][prompt_mask[row // group].astype(bool)].tolist()
          sequence = prompt + rollout.tokens[row, :rollout.lengths[row]].tolist()
          sequences.append(sequence + [0] * (width - len(sequence)))  # causal: right padding is never seen
          prompts.append(len(prompt))
        expected = np.asarray(forward(split_run['weights'][version], jnp.asarray(sequences)))
        for index, row in enumerate(rows):
          at = np.flatnonzero(rollout.versions[row] == version)
          predicted = expected[index, prompts[index] - 1 + at, rollout.tokens[row, at]]
          np.testing.assert_allclose(rollout.log_probs[row, at], predicted, atol=2e-5,
                                     err_msg=f'step {step} row {row} version {version}')
          checked += len(at)
  assert checked > 0


@pytest.mark.exhaustive
def test_the_pipeline_lives_on_the_sampler_and_weights_cross_shard_for_shard(split_run):
  """The pool and the groups ready for the next step lie on the sampler's devices only; the
  weights arrive there cast to the compute dtype, equal to the trainer's, laid out on the
  sampler's mesh exactly as the mirror layout laid them out on the trainer's (a copy per shard)."""
  rl_step, state, sampler = split_run['rl_step'], split_run['state'], set(split_run['sampler'])
  assert all(set(leaf.devices()) <= sampler for leaf in jax.tree.leaves(state.pool))
  assert all(not set(leaf.devices()) & sampler for leaf in jax.tree.leaves(state.params))
  layout = rl_step.layout
  resident = layout.transfer(state.params)
  placed = jax.jit(layout.mirror.place)(state.params)
  for value, source, mirrored in zip(jax.tree.leaves(resident), jax.tree.leaves(state.params), jax.tree.leaves(placed)):
    assert set(value.devices()) == sampler and value.dtype == jnp.dtype(layout.dtype)
    assert value.sharding.spec == mirrored.sharding.spec
    assert dict(value.sharding.mesh.shape) == dict(mirrored.sharding.mesh.shape)
    np.testing.assert_array_equal(np.asarray(value), np.asarray(source).astype(layout.dtype))


def test_lag_metrics_equal_numpy(seed):
  """sampler_gap_mean/lag_l, lag_frac/l, lag_mean and lag_max against NumPy on random tokens."""
  rng = np.random.default_rng(seed)
  shape = (6, 9)
  trainer, sampler = rng.normal(size=shape).astype(np.float32), rng.normal(size=shape).astype(np.float32)
  mask, lags = rng.random(shape) < 0.7, rng.integers(0, 3, shape)
  lags[mask & (lags == 2)] = 1  # no token at lag 2: lag_max must say 1
  metrics = jax.device_get(lag_means(mismatch_by_lag(jnp.asarray(trainer), jnp.asarray(sampler), jnp.asarray(mask),
                                                     jnp.asarray(lags), 2), 2))
  gap = np.abs(trainer - sampler)
  for lag in range(3):
    at = mask & (lags == lag)
    assert metrics[f'lag_frac/{lag}'] == pytest.approx(at.sum() / mask.sum(), rel=1e-6)
    assert metrics[f'sampler_gap_mean/lag_{lag}'] == pytest.approx(gap[at].mean() if at.any() else 0.0, rel=1e-5)
  assert metrics['lag_mean'] == pytest.approx(lags[mask].mean(), rel=1e-6)
  assert metrics['lag_max'] == 1


@pytest.mark.parametrize('overrides, field', [
    (['rollout.devices=-1'], 'rollout.devices'),
    (['rollout.devices=4'], 'rollout.devices'),  # on-policy: the sampler would be a version behind
])
def test_hostile_split_settings_are_one_line_errors(overrides, field):
  with pytest.raises(UserError) as error:
    load_config('configs/tiny_arith.yaml', overrides)
  assert field in str(error.value) and '\n' not in str(error.value)


def test_a_sampler_with_every_device_is_refused():
  with pytest.raises(UserError) as error:
    split_devices(jax.devices(), len(jax.devices()))
  assert 'rollout.devices' in str(error.value) and '\n' not in str(error.value)
