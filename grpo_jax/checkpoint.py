"""Training checkpoints with orbax's CheckpointManager: state pytree + JSON metadata, saved async.

A checkpoint step directory holds `state` (params, optimizer state, step, PRNG key, counters) and
`meta` (data position, resolved config). Orbax writes each step into a temporary directory and
renames it when complete, so a crash or kill -9 mid-save leaves the previous step as the latest
restorable one; `latest_step` only ever reports finished steps.
"""

import os

import jax
import orbax.checkpoint as ocp

from grpo_jax.errors import UserError, quiet_abandoned_reads, root_cause


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
    self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                     meta=ocp.args.JsonSave(meta)))

  def restore(self, step: int, abstract_state):
    """(state placed like `abstract_state`'s shardings, meta dict). A checkpoint whose files are
    missing or cut short is one UserError naming it and the earlier steps to resume from instead."""
    try:
      self._check_shapes(step, abstract_state)
      target = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
      restored = self.manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
    except UserError:
      raise
    except Exception as error:  # orbax and TensorStore raise bare Exceptions for missing or cut files
      earlier = [s for s in self.manager.all_steps() if s < step]
      way_out = (f'move it aside to resume from step {max(earlier)}' if earlier
                 else 'no earlier checkpoint to resume from')
      quiet_abandoned_reads()
      raise UserError(f'checkpoint {self.directory}/{step} cannot be restored (missing or damaged data?): '
                      f'{root_cause(error)}; {way_out}') from None
    return restored.state, restored.meta

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
