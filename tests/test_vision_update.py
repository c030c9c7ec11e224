"""The update's vision tower once per prompt: P prompts' images through the tower once, their
features shared by each prompt's G rows, give the loss and the step that each row's own plain
forward (its images through the tower) gives, for a trained and a frozen tower, in padded and
packed rows, with micro-batches that split a group; a frozen tower holds no optimizer moments."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from grpo_jax import config as config_lib
from grpo_jax.model import vision
from grpo_jax.model.loading import init_model
from grpo_jax.model.options import ModelOptions
from grpo_jax.rl.held import Held
from grpo_jax.rl.algo import AlgoConfig
from grpo_jax.rl.batch import Batch
from grpo_jax.rl.optimizer import OptimConfig, freezing
from grpo_jax.rl.state import init_train_state
from grpo_jax.rl.update import UpdateSettings, update
from test_update import assert_close, assert_trees_close

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARCHITECTURE = config_lib.load_config(os.path.join(ROOT, 'configs', 'tiny_spot.yaml')).model.architecture
PROMPTS, GROUP, STEPS = 3, 2, 3  # P, G, N
ROWS = PROMPTS * GROUP
# Prompt 0 one image, prompt 1 two of different sizes, prompt 2 none.
GRIDS = [[(1, 4, 4)], [(1, 2, 4), (1, 4, 2)], []]
BETA = 0.05
# SGD's rate: large, so the step's change of a parameter near 1 is far above its fp32 spacing.
RATE = 1e4


@functools.cache
def model_parts(freeze: bool):
  """(graphdef, params, ref_params): random weights, biases and norms perturbed too."""
  graphdef, params = nnx.split(init_model(ARCHITECTURE, options=ModelOptions(freeze_vision=freeze), seed=0))
  rng = np.random.default_rng(7)
  noisy = lambda: jax.tree.map(lambda p: p + jnp.asarray(0.05 * rng.standard_normal(p.shape), p.dtype), params)  # noqa: E731
  return graphdef, noisy(), noisy()


def image_batch(seed: int):
  """(Batch of P x G rows whose prompts hold GRIDS' images, the rows' own Vision [B, Tp + N] for
  their plain forward)."""
  v = ARCHITECTURE.vision
  rng = np.random.default_rng(seed)
  rows, images = [], []
  for grids in GRIDS:
    row, own = list(rng.integers(6, 11, rng.integers(1, 4))), []
    for grid in grids:
      own.append((rng.normal(size=(int(np.prod(grid)), v.patch_dim)).astype(np.float32), grid))
      row += [v.vision_start_token_id] + [v.image_token_id] * vision.image_tokens(grid, v) + [v.vision_end_token_id]
    rows.append(row + [6])
    images.append(own)
  width = max(map(len, rows))
  prompts, prompt_mask = np.zeros((PROMPTS, width), np.int32), np.zeros((PROMPTS, width), np.int32)
  for p, row in enumerate(rows):
    prompts[p, width - len(row):], prompt_mask[p, width - len(row):] = row, 1
  prompt_vision = vision.vision_of(images, prompts, prompt_mask, ARCHITECTURE, max_images=2, max_patches=16)
  lengths = rng.integers(1, STEPS + 1, ROWS)
  lengths[0] = STEPS
  mask = jnp.asarray(np.arange(STEPS)[None, :] < lengths[:, None])
  row_mask = jnp.asarray(np.repeat(prompt_mask, GROUP, axis=0))
  tokens = np.concatenate([np.repeat(prompts, GROUP, axis=0), rng.integers(6, 11, (ROWS, STEPS))], axis=1)
  batch = Batch.of_sequences(
      tokens=jnp.asarray(tokens, jnp.int32), segment_ids=jnp.concatenate([row_mask, mask.astype(jnp.int32)], axis=1),
      mask=mask, advantages=jnp.asarray(rng.standard_normal(ROWS), jnp.float32),
      sampler_log_probs=jnp.asarray(rng.uniform(-3.0, -0.5, mask.shape), jnp.float32),
      images=prompt_vision.images, vision=vision.RowImages.answering(prompt_vision, GROUP, row_mask, mask))
  own = vision.extended(jax.tree.map(lambda x: jnp.repeat(x, GROUP, axis=0), prompt_vision), row_mask, mask)
  return batch, own


def plain_loss(params, graphdef, ref_params, batch: Batch, own: vision.Vision):
  """The on-policy GRPO loss (ratio 1, token-mean, k3 KL) from each row's plain forward: its own
  images through the tower, full logits."""
  def log_probs(params):
    logits = nnx.merge(graphdef, params)(batch.tokens, segment_ids=batch.segment_ids, **vision.model_inputs(own))
    log_softmax = jax.nn.log_softmax(logits[:, -STEPS - 1:-1], axis=-1)
    return jnp.take_along_axis(log_softmax, batch.tokens[:, -STEPS:, None], axis=-1)[..., 0]
  log_pi, log_ref = log_probs(params), jax.lax.stop_gradient(log_probs(ref_params))
  weights = batch.mask / jnp.sum(batch.mask)
  surrogate = -batch.advantages[:, None] * jnp.exp(log_pi - jax.lax.stop_gradient(log_pi))
  k3 = jnp.exp(log_ref - log_pi) - (log_ref - log_pi) - 1.0
  return jnp.sum((surrogate + BETA * k3) * weights)


def one_update(freeze: bool, packed: bool, seed: int, batch: Batch):
  """(params after one SGD step of RATE, the update's metrics)."""
  graphdef, params, ref_params = model_parts(freeze)
  # 3 rows a padded micro-batch, one packed row of two sequences' length: micro-batches split the groups.
  length = 2 * batch.tokens.shape[1]
  layout = dict(pack_length=length, micro_batch_tokens=length) if packed else dict(micro_batch_size=3)
  config = AlgoConfig(group_size=GROUP, kl_beta=BETA, kl_estimator='k3', loss_aggregation='token-mean',
                      logprob_implementation='xla_chunked', packing=packed, **layout)
  optimizer = freezing(optax.sgd(RATE), ('visual',)) if freeze else optax.sgd(RATE)
  run = jax.jit(functools.partial(update, graphdef=graphdef, optimizer=optimizer, schedule=optax.constant_schedule(1.0),
                                  settings=UpdateSettings(algo=config, temperature=1.0, rows=ROWS)))
  state, metrics = run(init_train_state(params, optimizer, seed), batch, Held(reference=ref_params))
  return state.params, metrics


@pytest.mark.parametrize('freeze, packed', [
    (False, False),
    pytest.param(False, True, marks=pytest.mark.exhaustive),
    pytest.param(True, False, marks=pytest.mark.exhaustive),
    pytest.param(True, True, marks=pytest.mark.exhaustive)])
def test_the_tower_once_per_prompt_gives_each_rows_own_loss_and_step(seed, freeze, packed):
  """The update's loss, gradient norm and one SGD step (every parameter, the tower's included)
  equal those of each row's plain forward with its own images (fp32, rtol 1e-5): a trained tower's
  gradient gathers the G rows' through the shared features, a frozen tower stays as it was."""
  batch, own = image_batch(seed)
  graphdef, params, ref_params = model_parts(freeze)
  loss, grads = jax.jit(jax.value_and_grad(plain_loss), static_argnums=1)(params, graphdef, ref_params, batch, own)
  new_params, metrics = one_update(freeze, packed, seed, batch)
  assert_close(metrics['loss'], loss, 'loss', scale=float(jnp.abs(batch.advantages).max()) / ROWS)
  assert_close(metrics['grad_norm'], optax.tree.norm(grads), 'grad_norm')
  for (path, new), old, grad in zip(jax.tree_util.tree_leaves_with_path(new_params), jax.tree.leaves(params),
                                    jax.tree.leaves(grads)):
    name = jax.tree_util.keystr(path)
    assert_close((np.asarray(new, np.float64) - np.asarray(old, np.float64)) / RATE, -np.asarray(grad), name)
    if 'visual' in name:
      assert np.array_equal(new, old) == freeze, name
  assert float(metrics['micro_batches']) > 1


def test_a_frozen_tower_holds_no_moments_and_the_rest_trains_as_before(tmp_path):
  """model.freeze_vision's AdamW (OptimConfig.build(frozen=('visual',))): no optimizer leaf for a
  tower parameter, the state laid out by train_state_shardings and saved and restored by the
  run's checkpointer; over steps of random gradients (the tower's zero, as the update gives them)
  the tower stays as it was and every other parameter moves exactly as the whole model's AdamW
  moves it."""
  from grpo_jax.checkpoint import Checkpointer
  from grpo_jax.rl.state import create_train_state, train_state_shardings
  from grpo_jax.sharding import MESH_AXES, state_shardings

  _, params, _ = model_parts(True)
  mesh = jax.make_mesh((1, 1, 1, 1, 1), MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 5, devices=jax.devices()[:1])
  settings = OptimConfig(learning_rate=1e-2, weight_decay=0.1, max_grad_norm=1.0)
  frozen, _ = settings.build(10, frozen=('visual',))
  whole, _ = settings.build(10)
  with jax.set_mesh(mesh):
    params = jax.device_put(params, state_shardings(params, mesh))
    state = create_train_state(params, frozen, 0)
    shardings = train_state_shardings(params, frozen)
  tower = lambda path: 'visual' in jax.tree_util.keystr(path)  # noqa: E731
  moments = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(state.opt_state)]
  assert moments and not [name for name in moments if 'visual' in name]
  assert jax.tree.structure(shardings.opt_state) == jax.tree.structure(state.opt_state)
  tower_size = sum(x.size for path, x in jax.tree_util.tree_leaves_with_path(params) if tower(path))
  whole_state = whole.init(params)
  assert sum(x.size for x in jax.tree.leaves(whole_state)) - sum(x.size for x in jax.tree.leaves(state.opt_state)) \
      == 2 * tower_size  # AdamW's two moments

  checkpointer = Checkpointer(str(tmp_path), max_to_keep=1, asynchronous=False)
  checkpointer.save(0, state.checkpointed(), {'data_position': 0})
  restored, _ = checkpointer.restore(0, state.checkpointed())
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state.checkpointed())):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  rng = np.random.default_rng(0)
  ours, theirs, opt_state, whole_state = params, params, restored.opt_state, whole_state
  for _ in range(3):
    grads = jax.tree_util.tree_map_with_path(
        lambda path, p: jnp.zeros_like(p) if tower(path) else jnp.asarray(rng.standard_normal(p.shape), p.dtype),
        params)
    updates, opt_state = frozen.update(grads, opt_state, ours)
    ours = optax.apply_updates(ours, updates)
    updates, whole_state = whole.update(grads, whole_state, theirs)
    theirs = optax.apply_updates(theirs, updates)
  for (path, a), b, start in zip(jax.tree_util.tree_leaves_with_path(ours), jax.tree.leaves(theirs),
                                 jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(start if tower(path) else b),
                                  err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize('shown', ['whole-groups', 'own-rows'])
def test_each_mini_batch_runs_the_tower_on_its_own_prompts_only(seed, monkeypatch, shown):
  """Three mini-batches a pass over two passes, a trained tower: with whole groups (`algo.shuffle:
  groups`) each mini-batch runs the tower on its one prompt's images; with rows that show images of
  their own (an agent's episodes, rows shuffled one by one) on its two rows'. Parameters and
  metrics equal the update that runs the tower on every prompt's images in every mini-batch (fp32),
  and the compiled update does fewer FLOPs."""
  from grpo_jax.rl import update as update_module
  batch, own = image_batch(seed)
  if shown == 'own-rows':
    batch = batch.replace(images=own.images, vision=vision.RowImages.own(own))
  graphdef, params, _ = model_parts(False)
  config = AlgoConfig(group_size=GROUP, num_minibatches=3, ppo_epochs=2,
                      shuffle='groups' if shown == 'whole-groups' else 'rows', loss_aggregation='token-mean',
                      logprob_implementation='xla_chunked')
  settings = UpdateSettings(algo=config, temperature=1.0, rows=ROWS)
  optimizer = optax.sgd(0.1)

  def compiled():
    run = jax.jit(functools.partial(update, graphdef=graphdef, optimizer=optimizer,
                                    schedule=optax.constant_schedule(1.0), settings=settings))
    return run.lower(init_train_state(params, optimizer, seed), batch, Held()).compile()

  ours = compiled()
  with monkeypatch.context() as patch:  # the reference: every prompt's images in every mini-batch
    patch.setattr(update_module, '_image_owners', lambda orders, owners, settings: jnp.broadcast_to(
        jnp.arange(owners, dtype=orders.dtype), (orders.shape[0], owners)))
    everyone = compiled()
  state = init_train_state(params, optimizer, seed)
  (got, metrics), (want, expected) = ours(state, batch, Held()), everyone(state, batch, Held())
  if shown == 'whole-groups':  # each mini-batch's rows are one whole group
    orders = np.asarray(update_module._orders(jax.random.split(state.key)[1], settings))
    assert all(len(set(row // GROUP)) == 1 for row in orders), orders
  for name in ('loss', 'grad_norm'):
    assert_close(metrics[name], expected[name], name)
  assert_trees_close(got.params, want.params)
  moved = max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(got.params['visual']),
                                                          jax.tree.leaves(params['visual'])))
  assert moved > 1e-3  # the tower trained
  flops = lambda program: program.cost_analysis()['flops']  # noqa: E731
  assert flops(ours) < 0.9 * flops(everyone), (flops(ours), flops(everyone))
