"""Training checkpoints with orbax's CheckpointManager: state pytree + JSON metadata, saved async.

A checkpoint step directory holds `state` (params, optimizer state, step, PRNG key, counters) and
`meta` (data position, the task's state_dict, resolved config). Orbax writes each step into a
temporary directory and renames it when complete, so a crash or kill -9 mid-save leaves the previous
step as the latest restorable one; `latest_step` only ever reports finished steps.
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
