"""Building, loading and saving Qwen2 models on a device mesh.

Two on-disk formats:
  * a Hugging Face directory: config.json + model.safetensors[.index.json] (+ tokenizer files);
  * a grpo_jax checkpoint: config.json (Hugging Face spelling) + params/ (an orbax checkpoint of
    the NNX parameter state) + the tokenizer files, copied through.

Parameters are created directly in their final sharding: each device's shard is cut from the
source tensor of one layer at a time, so no host ever holds more than one copy of the model.
"""

import dataclasses
import functools
import json
import math
import os
import shutil
import typing

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from grpo_jax.errors import UserError, checkpoint_read, quiet_abandoned_reads, require, root_cause
from grpo_jax.model import lora, weights
from grpo_jax.model.config import Qwen2Config
from grpo_jax.model.hf_config import load_hf_config, to_hf_dict
from grpo_jax.model.qwen2 import DType, ModelOptions, Qwen2
from grpo_jax.sections import inline
from grpo_jax.sharding import MeshConfig, make_mesh, state_shardings

PARAMS_DIR = 'params'
TOKENIZER_FILES = ('tokenizer.json', 'tokenizer_config.json', 'vocab.json', 'merges.txt',
                   'special_tokens_map.json', 'added_tokens.json', 'chat_template.jinja', 'chat_template.json',
                   'generation_config.json',
                   # a vision-language model's image processor and processor settings
                   'preprocessor_config.json', 'processor_config.json')


def _single_device_mesh() -> Mesh:
  return make_mesh(MeshConfig(data=1, fsdp=1, tensor=1), devices=jax.devices()[:1])


def abstract_model(config: Qwen2Config, options: ModelOptions = ModelOptions()) -> Qwen2:
  """The model with ShapeDtypeStructs in place of arrays."""
  return nnx.eval_shape(lambda: Qwen2(config, options, rngs=nnx.Rngs(0)))


def check_mesh(config: Qwen2Config, mesh: Mesh) -> None:
  """A mixture's experts split evenly over the mesh's 'expert' axis: one that does not divide them
  would leave every expert whole on every device (the rule table skips an axis that does not
  divide its dimension), which is not what a user asking for expert parallelism wants."""
  expert = dict(mesh.shape).get('expert', 1)
  if config.num_experts and expert > 1:
    divisors = [size for size in range(1, config.num_experts + 1) if config.num_experts % size == 0]
    require(config.num_experts % expert == 0, 'mesh.expert',
            f"({expert}) must divide the model's {config.num_experts} experts (num_experts) to split them over "
            f'its devices; choose one of {divisors}')


def _sharded_abstract(config: Qwen2Config, mesh: Mesh, options: ModelOptions):
  check_mesh(config, mesh)
  graphdef, abstract_state = nnx.split(abstract_model(config, options))
  return graphdef, abstract_state, state_shardings(abstract_state, mesh)


def init_model(config: Qwen2Config, *, options: ModelOptions = ModelOptions(), mesh: Mesh | None = None,
               seed: int = 0) -> Qwen2:
  """A randomly initialised model whose parameters are created already sharded on `mesh`."""
  mesh = mesh or _single_device_mesh()
  graphdef, _, shardings = _sharded_abstract(config, mesh, options)

  @functools.partial(jax.jit, out_shardings=shardings)
  def create():
    return nnx.state(Qwen2(config, options, rngs=nnx.Rngs(seed)))

  return nnx.merge(graphdef, create())


def _from_host_slices(abstract_state, shardings, read, layer_stacked):
  """Builds every parameter on its devices from host blocks.

  read(path, index, dtype) returns the numpy block of parameter `path` at `index` (a tuple of
  slices; for layer-stacked parameters, of one layer), so each device's shard comes straight
  from the source. Layer-stacked parameters are written into their device array one layer at a
  time (the array is donated to each update), so beyond the model itself the host never holds
  more than one layer's block.
  """
  flat_shardings = dict(nnx.to_flat_state(shardings))
  leaves = []
  for path, variable in nnx.to_flat_state(abstract_state):
    sharding, dtype = flat_shardings[path], variable.dtype
    if not layer_stacked(path):
      array = jax.make_array_from_callback(
          variable.shape, sharding, lambda index, path=path, dtype=dtype: read(path, index, dtype))
    else:
      layer_sharding = NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec[1:]))
      array = _zeros(variable.shape, dtype, sharding)
      for layer in range(variable.shape[0]):
        block = jax.make_array_from_callback(
            variable.shape[1:], layer_sharding,
            lambda index, path=path, dtype=dtype, layer=layer: read(path, (layer, *index), dtype))
        # Wait for each update: under async dispatch every pending layer block stays alive.
        array = _set_layer(array, block, layer).block_until_ready()
    leaves.append((path, variable.replace(array)))
  return nnx.from_flat_state(leaves)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _zeros(shape, dtype, sharding):
  return jax.lax.with_sharding_constraint(jnp.zeros(shape, dtype), sharding)


@functools.partial(jax.jit, donate_argnums=0)
def _set_layer(stacked, block, layer):
  return jax.lax.dynamic_update_index_in_dim(stacked, block, layer, axis=0)


def _hf_reader(checkpoint: weights.HFCheckpoint, config: Qwen2Config):
  rules = {rule.path: rule for rule in weights.rules_for(config)}

  last = {}  # the most recent (path, layer) tensor: every device's shard of it is cut from one read

  def read(path, index, dtype):
    """index: slices of the whole parameter, or (layer, *slices) for a layer-stacked one."""
    rule = rules[path]
    layer, index = (index[0], index[1:]) if rule.per_layer else (None, index)
    if last.get('key') != (path, layer):
      last.clear()  # drop the previous tensor before reading the next
      last.update(key=(path, layer), tensor=checkpoint.layer_slice(rule, config, layer))
    return last['tensor'][index].astype(dtype, copy=False)

  def layer_stacked(path):
    return rules[path].per_layer

  return read, layer_stacked


def load_hf(directory: str, *, options: ModelOptions = ModelOptions(), mesh: Mesh | None = None) -> Qwen2:
  """Loads a Hugging Face Qwen2 directory onto `mesh`, one tensor at a time."""
  config = load_hf_config(directory)
  checkpoint = weights.HFCheckpoint(directory)
  checkpoint.check(config)
  graphdef, abstract_state, shardings = _sharded_abstract(config, mesh or _single_device_mesh(), options)
  state = _from_host_slices(abstract_state, shardings, *_hf_reader(checkpoint, config))
  return nnx.merge(graphdef, state)


def is_orbax_checkpoint(path: str) -> bool:
  return os.path.isdir(os.path.join(path, PARAMS_DIR))


def load_orbax(directory: str, *, options: ModelOptions = ModelOptions(), mesh: Mesh | None = None) -> Qwen2:
  """Restores a grpo_jax checkpoint straight into the model's shardings on `mesh`."""
  import orbax.checkpoint as ocp

  config = load_hf_config(directory)
  graphdef, abstract_state, shardings = _sharded_abstract(config, mesh or _single_device_mesh(), options)
  # Stored as a plain nested dict of arrays, independent of flax's Variable pytree layout.
  target = jax.tree.map(
      lambda variable, sharding: jax.ShapeDtypeStruct(variable.shape, variable.dtype, sharding=sharding),
      nnx.to_pure_dict(abstract_state), nnx.to_pure_dict(shardings))
  params_dir = os.path.abspath(os.path.join(directory, PARAMS_DIR))
  try:
    with ocp.StandardCheckpointer() as checkpointer:
      stored = checkpointer.metadata(params_dir).item_metadata
      _check_orbax_tree(stored, target, params_dir)
      with checkpoint_read():
        restored = checkpointer.restore(params_dir, target)
  except UserError:
    raise
  except Exception as error:  # orbax and TensorStore raise bare Exceptions for missing or cut files
    quiet_abandoned_reads()
    raise UserError(f'{params_dir} could not be restored (missing or damaged data?): {root_cause(error)}') from None
  nnx.replace_by_pure_dict(abstract_state, restored)
  return nnx.merge(graphdef, abstract_state)


def _check_orbax_tree(stored, target, params_dir: str) -> None:
  """Names the first missing or mis-shaped tensor instead of orbax's tree-structure dump."""
  def flat(tree):
    return {'.'.join(str(key.key) for key in path): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}

  stored_flat = flat(stored)
  for name, leaf in flat(target).items():
    if name not in stored_flat:
      raise UserError(f'{params_dir}: missing tensor {name}')
    found = tuple(stored_flat[name].shape)
    if found != tuple(leaf.shape):
      raise UserError(f'{params_dir}: tensor {name} has shape {list(found)}, expected {list(leaf.shape)}')


def save_orbax(model: Qwen2, directory: str, *, tokenizer_from: str | None = None) -> None:
  """Writes a grpo_jax checkpoint: config.json, params/ (orbax) and the tokenizer files.

  One file per array (no OCDBT, which buffers the whole compressed checkpoint in host memory
  before committing it), and at most the largest array's bytes in flight at once.
  """
  import orbax.checkpoint as ocp

  os.makedirs(directory, exist_ok=True)
  params = nnx.to_pure_dict(nnx.state(model))
  largest = max(leaf.nbytes for leaf in jax.tree.leaves(params))
  # Orbax rejects an array larger than its in-flight budget, so the budget is at least the largest.
  handler = ocp.StandardCheckpointHandler(use_ocdbt=False, save_concurrent_gb=max(1, math.ceil(largest / 1e9)))
  params_dir = os.path.abspath(os.path.join(directory, PARAMS_DIR))
  with ocp.Checkpointer(handler) as checkpointer:
    checkpointer.save(params_dir, args=ocp.args.StandardSave(params), force=True)
  _write_config(model.config, directory, model.param_dtype.name)
  if tokenizer_from:
    copy_tokenizer_files(tokenizer_from, directory)


def _write_config(config: Qwen2Config, directory: str, dtype: str) -> None:
  with open(os.path.join(directory, 'config.json'), 'w') as f:
    json.dump(to_hf_dict(config, dtype=dtype), f, indent=2)


def copy_tokenizer_files(source: str, destination: str) -> list[str]:
  copied = []
  for name in TOKENIZER_FILES:
    if os.path.isfile(os.path.join(source, name)):
      shutil.copy2(os.path.join(source, name), os.path.join(destination, name))
      copied.append(name)
  return copied


def save_hf(model: Qwen2, directory: str, *, max_shard_bytes: int = 4 << 30) -> None:
  """Writes safetensors (split above `max_shard_bytes`, with an index) and config.json.

  Shards are planned from the tensors' shapes first, then each tensor is produced and written
  one at a time, so host memory holds one tensor beyond the model itself.
  """
  save_hf_params(nnx.state(model), model.config, directory, model.param_dtype.name, max_shard_bytes=max_shard_bytes)


def save_hf_params(state: nnx.State, config, directory: str, dtype: str, *, max_shard_bytes: int = 4 << 30) -> None:
  """`save_hf` of a model's parameter state (device or host arrays, e.g. a training run's policy
  copied to the host) and its Qwen2Config; `dtype` the config.json's torch_dtype."""
  os.makedirs(directory, exist_ok=True)
  params = {path: variable.get_value() for path, variable in nnx.to_flat_state(state)}
  entries = list(weights.hf_tensors(params, config))
  groups: list[list[weights.TensorEntry]] = [[]]
  size = 0
  for entry in entries:
    if groups[-1] and size + entry.nbytes > max_shard_bytes:
      groups.append([])
      size = 0
    groups[-1].append(entry)
    size += entry.nbytes
  if len(groups) == 1:
    names = [weights.SINGLE_FILE]
  else:
    names = [f'model-{i:05d}-of-{len(groups):05d}.safetensors' for i in range(1, len(groups) + 1)]
  for name, group in zip(names, groups):
    weights.write_safetensors(os.path.join(directory, name), group, metadata={'format': 'pt'})
  if len(groups) > 1:
    weight_map = {entry.name: name for name, group in zip(names, groups) for entry in group}
    with open(os.path.join(directory, weights.INDEX_FILE), 'w') as f:
      json.dump({'metadata': {'total_size': sum(e.nbytes for e in entries)}, 'weight_map': weight_map},
                f, indent=2)
  _write_config(config, directory, dtype)


def from_pretrained(path: str, dtype=None, *, mesh: Mesh | None = None,
                    options: ModelOptions | None = None, seed: int = 0) -> Qwen2:
  """Loads a Hugging Face directory or a grpo_jax (orbax) checkpoint as a `Qwen2` module.

  dtype: compute and storage dtype ('float32' when neither it nor `options` is given), a
  shorthand for `options=ModelOptions(dtype=dtype, param_dtype=dtype)`; options: all the model's
  options. With `mesh`, parameters are laid out by the logical-axis table in `sharding.py`;
  without, on the first device. With `options.lora`, the checkpoint is the frozen base (read in the
  compute dtype) and fresh adapters, drawn from `seed`, go on it.
  """
  if not os.path.isdir(path):
    raise UserError(f'model path {path} is not a directory')
  if dtype is not None and options is not None:
    raise ValueError('from_pretrained: pass dtype or options, not both (options has dtype and param_dtype)')
  if options is None:
    # .name turns a dtype object such as jnp.bfloat16 into the option's spelling.
    name = jnp.dtype(dtype or 'float32').name
    options = ModelOptions(dtype=name, param_dtype=name)
  if options.lora is not None:
    base = from_pretrained(path, mesh=mesh, options=frozen_base(options))
    return with_adapters(base, options, mesh or _single_device_mesh(), seed)
  if is_orbax_checkpoint(path):
    return load_orbax(path, options=options, mesh=mesh)
  return load_hf(path, options=options, mesh=mesh)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """The `model` config section: which model to load, and how it computes (the ModelOptions fields,
  written in this section: `model.dtype`, `model.remat`, ...; see model/qwen2.py)."""

  path: str | None = None  # Hugging Face dir or grpo_jax checkpoint; None: random init from `architecture`
  architecture: Qwen2Config = Qwen2Config()  # used only when `path` is None (a run from `path` stores the one read there)
  options: ModelOptions = inline(ModelOptions())

  def __post_init__(self):
    # Training keeps master weights in float32 or bfloat16 (float16 storage is for conversion only).
    require(self.options.param_dtype in typing.get_args(DType), 'model.param_dtype',
            f'must be one of {" | ".join(map(repr, typing.get_args(DType)))} for training, '
            f'got {self.options.param_dtype!r}')

  def build(self, mesh: Mesh | None, seed: int) -> Qwen2:
    """The run's model: the checkpoint at `path`, else random weights for `architecture`, laid out
    over `mesh`."""
    if self.options.attention == 'cudnn' and jax.default_backend() != 'gpu':
      raise UserError(f'model.attention: cudnn runs on NVIDIA GPUs only; this run\'s devices are '
                      f'{jax.default_backend()} (use dense or chunked)')
    if self.path:
      return from_pretrained(self.path, mesh=mesh, options=self.options, seed=seed)
    if self.options.lora is not None:  # the same base weights as without LoRA, the adapters drawn after
      base = init_model(self.architecture, options=frozen_base(self.options), mesh=mesh, seed=seed)
      return with_adapters(base, self.options, mesh or _single_device_mesh(), seed)
    return init_model(self.architecture, options=self.options, mesh=mesh, seed=seed)


def frozen_base(options: ModelOptions) -> ModelOptions:
  """A LoRA model's base: no adapters, held in the compute dtype."""
  return dataclasses.replace(options, lora=None, param_dtype=options.dtype)


def with_adapters(model: Qwen2, options: ModelOptions, mesh: Mesh, seed: int) -> Qwen2:
  """`model` (no adapters; its parameters in the compute dtype) with fresh LoRA factors of
  `options.lora` on it, drawn from `seed` as `init_model` draws them, laid out over `mesh`. The
  base's arrays are used as they are."""
  graphdef, abstract = nnx.split(abstract_model(model.config, options))
  adapter_shardings = state_shardings(lora.split_adapters(abstract)[0], mesh)

  @functools.partial(jax.jit, out_shardings=adapter_shardings)
  def create():  # only the adapters leave: the rest of this init is dead code to XLA
    return lora.split_adapters(nnx.state(Qwen2(model.config, options, rngs=nnx.Rngs(seed))))[0]

  return nnx.merge(graphdef, lora.join(create(), nnx.state(model)))


def load_reward_model(path: str, *, mesh: Mesh | None = None, options: ModelOptions | None = None, seed: int = 0):
  """(the reward model at `path`, its tokenizer): a checkpoint with a score head (model/config.py
  SEQUENCE_CLASSIFIERS) and the tokenizer stored beside it, checked to belong together: the
  tokenizer's ids fit the checkpoint's embedding, and the id it pads with is the checkpoint's
  pad_token_id (the model reads each row at its last token that is not that id). One line for each
  mismatch. `seed`: with options.lora, the fresh adapters' (from_pretrained)."""
  model = from_pretrained(path, mesh=mesh, options=options, seed=seed)
  config = model.config
  if not config.num_labels:
    raise UserError(f'{path} is a language model ({config.architecture}), not a reward model: a reward model is a '
                    'sequence classifier with a score head (e.g. Qwen2ForSequenceClassification)')
  tokenizer = load_tokenizer(path)
  if tokenizer is None:
    raise UserError(f'{path} has no tokenizer (tokenizer.json or vocab.json): a reward model reads the conversation '
                    'through its own tokenizer and chat template')
  if len(tokenizer) > config.vocab_size:
    raise UserError(f'{path}: its tokenizer has {len(tokenizer)} tokens, more than the checkpoint\'s '
                    f'{config.vocab_size} embedding rows: the tokenizer is not this checkpoint\'s')
  if tokenizer.pad_token_id is not None and tokenizer.pad_token_id != config.pad_token_id:
    raise UserError(f'{path}: its tokenizer pads with id {tokenizer.pad_token_id} ({tokenizer.pad_token!r}), but '
                    f'config.json\'s pad_token_id is {config.pad_token_id}: the score would be read at the wrong '
                    'token; make them the same')
  return model, tokenizer


def load_tokenizer(path: str):
  """The Hugging Face tokenizer stored beside the weights, or None when there is none."""
  if not any(os.path.isfile(os.path.join(path, name)) for name in ('tokenizer.json', 'vocab.json')):
    return None
  from transformers import AutoTokenizer
  return AutoTokenizer.from_pretrained(path, local_files_only=True)
