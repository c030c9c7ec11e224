"""A training run's policy read back from its checkpoints (eval, serve, generate, conversion): the
run's config and architecture from a checkpoint's metadata, its parameters (or a LoRA run's
adapters on their base) placed on any mesh. Above the config (it reads a run's config); the
checkpoints themselves are checkpoint.py's."""

import os

import jax

from grpo_jax import config as config_lib
from grpo_jax.checkpoint import Checkpointer
from grpo_jax.errors import UserError
from grpo_jax.model.hf_config import from_hf_dict, load_hf_config


def run_of(checkpoints: str, step: int | None):
  """(config, architecture, step, meta) of a training run's checkpoint `step` (None: the newest),
  reading only its metadata. The architecture is the one stored in the checkpoint (older ones:
  the run's model section)."""
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
  from grpo_jax.model.hf_config import load_hf_config, to_hf_dict

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


def checkpoint_architecture(path: str, what: str):
  """(architecture, the training run's config or None) of any checkpoint a run can read a second
  model from: a Hugging Face directory or grpo_jax checkpoint (its config.json), or a training run
  (its workdir, checkpoints/ or one checkpoints/<step>: the newest checkpoint's metadata). No
  weights are read. `what` names the setting in the one line a missing or unknown path gets."""
  from grpo_jax.checkpoint import locate

  if not os.path.exists(path):
    raise UserError(f'{what}: {path} does not exist')
  if os.path.isfile(os.path.join(path, 'config.json')):
    return load_hf_config(path), None
  training = locate(path)
  if training is None:
    raise UserError(f'{what}: {path} is not a checkpoint (no config.json, nor a training run\'s checkpoints)')
  config, architecture, _, _ = run_of(*training)
  return architecture, config


def load_checkpoint_model(path: str, mesh, options, architecture, run):
  """(graphdef, params) of the model at `path` on `mesh`, with `options` (a ModelOptions without
  adapters: dtypes, attention); `architecture, run`: what checkpoint_architecture read of it. A
  LoRA run's policy comes back merged (W + s A B in the base's place): a model that is never
  trained needs no adapters."""
  from flax import nnx

  from grpo_jax.checkpoint import locate
  from grpo_jax.model import lora
  from grpo_jax.model.loading import abstract_model, from_pretrained

  if run is None:
    return nnx.split(from_pretrained(path, mesh=mesh, options=options))
  graphdef, params, _, _ = restore_policy(*locate(path), mesh, options)
  if run.model.options.lora is None:
    return graphdef, params
  graphdef, _ = nnx.split(abstract_model(architecture, options))
  return graphdef, jax.jit(lora.merged, static_argnums=1)(params, run.model.options.lora)


def checkpoint_tokenizer(path: str, run):
  """The tokenizer of the checkpoint at `path`: the one stored beside it, or for a training run
  (`run`, its config) the run's (task.tokenizer or model.path), or a built-in task's own; None
  when none can be found."""
  from grpo_jax.model.loading import load_tokenizer

  if run is None:
    return load_tokenizer(path)
  directory = run_tokenizer(run)
  if directory is not None:
    return load_tokenizer(directory)
  if run.task.jittable:  # a built-in task's tokenizer is built in its code
    return run.task.kind.build(run).tokenizer
  return None
