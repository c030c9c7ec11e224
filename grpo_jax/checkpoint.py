"""Training checkpoints with orbax's CheckpointManager: state pytree + JSON metadata, saved async.

A checkpoint step directory holds `state` (params, optimizer state, step, PRNG key, counters) and
`meta` (data position, resolved config). Orbax writes each step into a temporary directory and
renames it when complete, so a crash or kill -9 mid-save leaves the previous step as the latest
restorable one; `latest_step` only ever reports finished steps.
"""

import os

import jax
import orbax.checkpoint as ocp

from grpo_jax import distributed
from grpo_jax.errors import UserError, checkpoint_read, quiet_abandoned_reads, root_cause


class Checkpointer:
  def __init__(self, directory: str, *, max_to_keep: int, asynchronous: bool = True):
    self.directory = os.path.abspath(directory)
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                           enable_async_checkpointing=asynchronous)
    self.manager = ocp.CheckpointManager(
        self.directory, options=options, item_names=('state', 'meta'),
        item_handlers={'state': ocp.StandardCheckpointHandler(), 'meta': ocp.JsonCheckpointHandler()})

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state, meta: dict) -> None:
    """Starts saving (returns before the write finishes when asynchronous)."""
    self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(distributed.writable(state)),
                                                     meta=ocp.args.JsonSave(meta)))

  def restore(self, step: int, abstract_state):
    """(state placed like `abstract_state`'s shardings, meta dict). A checkpoint whose files are
    missing or cut short is one UserError naming it and the earlier steps to resume from instead."""
    try:
      self._check_shapes(step, abstract_state)
      target = distributed.readable(jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state))
      with checkpoint_read():
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
      state = distributed.placed(restored.state, abstract_state)
    except UserError:
      raise
    except Exception as error:  # orbax and TensorStore raise bare Exceptions for missing or cut files
      earlier = [s for s in self.manager.all_steps() if s < step]
      way_out = (f'move it aside to resume from step {max(earlier)}' if earlier
                 else 'no earlier checkpoint to resume from')
      quiet_abandoned_reads()
      raise UserError(f'checkpoint {self.directory}/{step} cannot be restored (missing or damaged data?): '
                      f'{root_cause(error)}; {way_out}') from None
    return state, restored.meta

  def meta(self, step: int) -> dict:
    """The step's metadata (data position, resolved config) alone."""
    return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta

  def restore_params(self, step: int, abstract_params):
    """Only the parameters of the step's state, placed like `abstract_params`' shardings; the
    optimizer state is not read (exporting a 32B policy needs no room for its AdamW moments)."""
    from flax import nnx
    # The state is stored as nested dicts, each parameter as {'value': array} (its Variable's pytree).
    target = dict(params=jax.tree.map(lambda leaf: dict(value=ocp.utils.to_shape_dtype_struct(leaf)),
                                      nnx.to_pure_dict(abstract_params)))
    try:
      # The PyTree handler (which the standard one wraps) can read a part of the stored tree.
      with ocp.CheckpointManager(self.directory, item_names=('state',),
                                 item_handlers={'state': ocp.PyTreeCheckpointHandler()}) as reader:
        with checkpoint_read():
          restored = reader.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
              item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True)))
    except Exception as error:  # orbax and TensorStore raise bare Exceptions for missing or cut files
      quiet_abandoned_reads()
      raise UserError(f'checkpoint {self.directory}/{step}: its parameters cannot be restored '
                      f'(missing or damaged data, or another model?): {root_cause(error)}') from None
    values = jax.tree.map(lambda node: node['value'], restored.state['params'],
                          is_leaf=lambda node: isinstance(node, dict) and set(node) == {'value'})
    params = jax.tree.map(lambda x: x, abstract_params)  # a copy to fill in
    nnx.replace_by_pure_dict(params, values)
    return params

  def _check_shapes(self, step: int, abstract_state) -> None:
    """One sentence naming the first tensor whose stored shape differs from this run's."""
    stored = {_name(path): leaf.shape for path, leaf in
              jax.tree_util.tree_leaves_with_path(self.manager.item_metadata(step)['state'])}
    where = f'checkpoint {self.directory}/{step} does not match this run'
    for path, leaf in jax.tree_util.tree_leaves_with_path(abstract_state):
      name = _name(path)
      if name not in stored:
        raise UserError(f'{where}: it has no tensor {name} (model or optimizer changed?)')
      if tuple(stored[name]) != tuple(leaf.shape):
        raise UserError(f'{where}: {name} is {tuple(stored[name])} there and {tuple(leaf.shape)} here '
                        '(model or optimizer changed?)')

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


def _name(path) -> str:
  """'params.layers.q_weight.value' from a pytree key path (dict keys, indices, attributes)."""
  return '.'.join(str(getattr(key, 'key', getattr(key, 'idx', getattr(key, 'name', key)))) for key in path)


def locate(path: str) -> tuple[str, int | None] | None:
  """(checkpoints directory, step) when `path` is a training workdir, its checkpoints/ directory
  (step None: the newest) or one checkpoints/<step>; None when it is none of these."""
  path = os.path.abspath(path)
  if os.path.isdir(os.path.join(path, 'checkpoints')):
    path = os.path.join(path, 'checkpoints')
  if os.path.isdir(os.path.join(path, 'state')) and os.path.basename(path).isdigit():
    return os.path.dirname(path), int(os.path.basename(path))
  if os.path.isdir(path) and any(name.isdigit() and os.path.isdir(os.path.join(path, name, 'state'))
                                 for name in os.listdir(path)):
    return path, None
  return None


def run_of(checkpoints: str, step: int | None):
  """(config, architecture, step, meta) of a training run's checkpoint `step` (None: the newest),
  reading only its metadata. The architecture is the one stored in the checkpoint (older ones:
  the run's model section)."""
  from grpo_jax import config as config_lib
  from grpo_jax.model.config import from_hf_dict, load_hf_config

  checkpointer = Checkpointer(checkpoints, max_to_keep=1, asynchronous=False)
  try:
    step = checkpointer.latest_step() if step is None else step
    if step is None or step not in checkpointer.manager.all_steps():
      raise UserError(f'{checkpoints} holds no complete checkpoint' + (f' of step {step}' if step is not None else ''))
    meta = checkpointer.meta(step)
  finally:
    checkpointer.close()
  config = config_lib.from_dict(meta['config'])
  if 'architecture' in meta:
    architecture = from_hf_dict(meta['architecture'], f'{checkpoints}/{step}/meta')
  elif config.model.path and os.path.isfile(os.path.join(config.model.path, 'config.json')):
    architecture = load_hf_config(config.model.path)
  elif config.model.path:
    raise UserError(f'{checkpoints}/{step} does not store its architecture and the run\'s model.path '
                    f'{config.model.path} (where it was read from) is gone')
  else:
    architecture = config.model.architecture
  return config, architecture, step, meta


def restore_policy(checkpoints: str, step: int | None, mesh, options=None):
  """(graphdef, params, config, step) of a training run's policy at `step` (None: the newest):
  the parameters alone, placed on `mesh` whatever mesh and number of processes wrote them;
  a LoRA run's adapters on its base (read again from its model.path). `options` (a ModelOptions;
  default the run's own) sets the dtypes and the attention; a LoRA run keeps its own adapters."""
  config, architecture, step, meta = run_of(checkpoints, step)
  options = options if options is not None else config.model.options
  checkpointer = Checkpointer(checkpoints, max_to_keep=1, asynchronous=False)
  try:
    if config.model.options.lora is not None:
      graphdef, params = _lora_policy(checkpointer, step, meta, config, architecture, options, mesh)
      return graphdef, params, config, step
    graphdef, target = _restore_target(architecture, options, mesh)
    params = checkpointer.restore_params(step, target)
  finally:
    checkpointer.close()
  return graphdef, params, config, step


def restore_adapters(checkpoints: str, step: int | None, mesh):
  """(adapters, config, step) of a LoRA run's checkpoint at `step` (None: the newest): the adapters'
  state alone (lora.split_trainable's), read without the base's weights, so they can be exported
  where the base is not. Where the base's config.json is still at model.path, the adapters must have
  been trained on its architecture."""
  from grpo_jax.model import lora

  config, architecture, step, meta = run_of(checkpoints, step)
  checkpointer = Checkpointer(checkpoints, max_to_keep=1, asynchronous=False)
  try:
    _check_base_architecture(f'{checkpointer.directory}/{step}', config, architecture, meta)
    _, target = _restore_target(architecture, config.model.options, mesh)
    adapters = checkpointer.restore_params(step, lora.split_trainable(target)[0])
  finally:
    checkpointer.close()
  return adapters, config, step


def _restore_target(architecture, options, mesh):
  """(graphdef, the state's abstract arrays placed on `mesh`) of a model: what orbax restores into."""
  from flax import nnx

  from grpo_jax.model.loading import abstract_model
  from grpo_jax.sharding import state_shardings

  graphdef, abstract = nnx.split(abstract_model(architecture, options))
  return graphdef, jax.tree.map(lambda variable, sharding: variable.replace(
      jax.ShapeDtypeStruct(variable.shape, variable.dtype, sharding=sharding)),
      abstract, state_shardings(abstract, mesh), is_leaf=lambda x: isinstance(x, nnx.Variable))


def _check_base_architecture(where: str, config, architecture, meta: dict) -> None:
  """One line when the base at a LoRA run's model.path no longer has the architecture its adapters
  were trained on (a base not there is not checked: the stored architecture would only compare with
  itself)."""
  from grpo_jax.model import lora
  from grpo_jax.model.config import load_hf_config, to_hf_dict

  path = config.model.path
  stored = meta.get('base') or {}
  current = load_hf_config(path) if path and os.path.isfile(os.path.join(path, 'config.json')) else architecture
  here = lora.base_fingerprint(to_hf_dict(current, dtype=config.model.options.param_dtype))
  if stored.get('architecture_hash') not in (None, here):
    raise UserError(f'{where}: its base model ({path}) no longer has the architecture the adapters were trained on '
                    f'(hash {stored["architecture_hash"]}, now {here})')


def run_tokenizer(config) -> str | None:
  """The directory holding a training run's tokenizer (its task.tokenizer or model.path), if any
  still does."""
  return next((path for path in (config.task.tokenizer_directory, config.model.path)
               if path and any(os.path.isfile(os.path.join(path, name)) for name in ('tokenizer.json', 'vocab.json'))),
              None)


def _lora_policy(checkpointer: Checkpointer, step: int, meta: dict, config, architecture, options, mesh):
  """(graphdef, params) of a LoRA run's policy: its base read again from the run's model.path (or,
  for a random base, drawn again from run.seed) with the checkpoint's adapters on it."""
  import dataclasses

  from flax import nnx

  from grpo_jax.model import lora
  from grpo_jax.model.loading import ModelConfig

  where = f'{checkpointer.directory}/{step}'
  path = config.model.path
  if path and not os.path.exists(path):
    raise UserError(f'{where} holds LoRA adapters of the base model.path={path}, which is gone: the base weights are '
                    'not in the checkpoint')
  _check_base_architecture(where, config, architecture, meta)
  options = dataclasses.replace(options, lora=config.model.options.lora)
  model = ModelConfig(path=path, architecture=architecture, options=options).build(mesh, config.run.seed)
  graphdef, state = nnx.split(model)
  trained, frozen = lora.split_trainable(state)
  return graphdef, lora.join(checkpointer.restore_params(step, trained), frozen)
