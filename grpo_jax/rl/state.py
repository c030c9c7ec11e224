"""The train state: everything that changes during training and is checkpointed, and its one layout."""

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import NamedSharding, PartitionSpec

from grpo_jax.model import lora
from grpo_jax.sharding import named_sharding


@struct.dataclass
class TrainState:
  """Everything that changes during training (and is checkpointed)."""

  step: jax.Array  # int32 RL steps done: the run's one step counter
  params: nnx.State  # the trained parameters (param_dtype): all of them, or with LoRA the adapters
  opt_state: optax.OptState
  key: jax.Array  # uint32[2] PRNG state for rollouts and mini-batch shuffling
  updates: jax.Array  # int32 optimizer updates applied (drives the learning-rate schedule)
  skips: jax.Array  # int32 consecutive updates skipped for non-finite loss or gradients
  # int32 prompts the run has consumed (the data position): a dataset task's order depends only on
  # it and run.seed; the step advances it by the prompts it draws. Checkpoints keep it in their
  # metadata (`checkpointed` leaves it out of the arrays), as they did before it lived here.
  position: jax.Array | None = None
  # Prompt groups in flight between steps (sampler/pool.Pool) with algo.max_lag > 0; None on-policy.
  pool: object = None
  # With LoRA (model.lora), the frozen base parameters in the compute dtype: an input of every
  # jitted step that passes through it unchanged (donated, so aliased: never copied), and never
  # checkpointed (`checkpointed`); None without LoRA.
  frozen: nnx.State | None = None

  @property
  def policy(self) -> nnx.State:
    """The policy's whole parameter state, the model's graphdef merges with (the same arrays)."""
    return lora.join(self.params, self.frozen)

  def checkpointed(self) -> 'Stored':
    """What a checkpoint's arrays hold: all but the frozen base (which comes from model.path
    again) and the data position (in the checkpoint's metadata)."""
    return Stored(step=self.step, params=self.params, opt_state=self.opt_state, key=self.key, updates=self.updates,
                  skips=self.skips, pool=self.pool)

  @classmethod
  def restored(cls, stored: 'Stored', position: jax.Array, frozen=None) -> 'TrainState':
    """The state a checkpoint's arrays and its data position make, with the frozen base (LoRA)."""
    return cls(step=stored.step, params=stored.params, opt_state=stored.opt_state, key=stored.key,
               updates=stored.updates, skips=stored.skips, position=position, pool=stored.pool, frozen=frozen)


@struct.dataclass
class Stored:
  """A TrainState as a checkpoint's arrays hold it: its fields but the data position, the tree
  every checkpoint has had (so the ones written before the position joined the state resume).
  `frozen` is always None (the base comes from model.path again)."""

  step: jax.Array
  params: nnx.State
  opt_state: optax.OptState
  key: jax.Array
  updates: jax.Array
  skips: jax.Array
  pool: object = None
  frozen: None = None


def init_train_state(params: nnx.State, optimizer: optax.GradientTransformation, seed: int, pool=None,
                     frozen=None) -> TrainState:
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params),
                    key=jax.random.PRNGKey(seed), updates=jnp.zeros((), jnp.int32),
                    skips=jnp.zeros((), jnp.int32), position=jnp.zeros((), jnp.int32), pool=pool, frozen=frozen)


def train_state_shardings(params: nnx.State, optimizer: optax.GradientTransformation, pool=None,
                          frozen=None) -> TrainState:
  """The one layout of a TrainState: the parameters as they lie (the logical-axis rules of
  grpo_jax/sharding.py), every optimizer leaf that mirrors a parameter (AdamW's moments) laid out
  like that parameter, so FSDP shards the optimizer state too (a frozen parameter has none:
  optax.MaskedNode), and the counters and key
  replicated; a partial-rollout pool (arrays or their shapes) by rows over the batch axes. Init, the
  jitted update, the K-step loop and checkpoint restore all use it."""
  param_shardings = jax.tree.map(lambda x: x.sharding, params)
  replicated = NamedSharding(jax.tree.leaves(param_shardings)[0].mesh, PartitionSpec())
  masked = lambda value: isinstance(value, optax.MaskedNode)  # noqa: E731  a frozen parameter's (no array)
  opt_shardings = optax.tree_map_params(optimizer, lambda value, sharding: value if masked(value) else sharding,
                                        jax.eval_shape(optimizer.init, params), param_shardings,
                                        transform_non_params=lambda _: replicated, is_leaf=masked)
  return TrainState(step=replicated, params=param_shardings, opt_state=opt_shardings, key=replicated,
                    updates=replicated, skips=replicated, position=replicated, pool=pool_shardings(pool, replicated.mesh),
                    frozen=jax.tree.map(lambda x: x.sharding, frozen))


def pool_shardings(pool, mesh):
  """A partial-rollout pool's layout on `mesh` (the trainer's, or with split devices the
  sampler's): every array by rows over the batch axes, scalars replicated."""
  return jax.tree.map(lambda x: named_sharding(mesh, x.shape, ('batch',) + (None,) * (len(x.shape) - 1))
                      if len(x.shape) else NamedSharding(mesh, PartitionSpec()), pool)


def create_train_state(params: nnx.State, optimizer: optax.GradientTransformation, seed: int,
                       pool=None, shardings: TrainState | None = None, frozen=None) -> TrainState:
  """A fresh TrainState in `shardings` (default `train_state_shardings`), built on the parameters'
  devices; `pool`: an empty partial-rollout pool (sampler/pool.empty_pool) or None. A pool laid
  out on other devices (the sampler's, split devices) is placed there on its own. `frozen`: a LoRA
  model's base, kept as it lies."""
  shardings = train_state_shardings(params, optimizer, pool, frozen) if shardings is None else shardings
  mesh = jax.tree.leaves(shardings.params)[0].mesh
  apart = pool is not None and jax.tree.leaves(shardings.pool)[0].mesh != mesh
  init = jax.jit(functools.partial(init_train_state, optimizer=optimizer, seed=seed),
                 out_shardings=shardings.replace(pool=None) if apart else shardings)
  if not apart:
    return init(params, pool=pool, frozen=frozen)
  return init(params, frozen=frozen).replace(pool=jax.device_put(pool, shardings.pool))
