"""The sampler's own layout: weights resident on every device, laid out once per rollout.

The trainer keeps its parameters in the training layout (FSDP shards every weight along the model
dimension D). Decoding in that layout would all-gather every layer's weights to every device once
per generated token. Before each rollout the policy's parameters are instead cast to the compute
dtype and laid out once for decoding: tensor-parallel over a sampler tensor axis of t devices
(attention heads and KV heads, MLP columns, vocabulary; the rule table of grpo_jax/sharding.py),
replicated over the other n / t devices, which become the sampler's data groups. The prompts, the
shared prompt cache, the decode slots and their KV cache follow by the same rules: rows over the
data groups, KV heads over the tensor axis. Inside the decode loop only activations move (two
all-reduces of [rows, D] per layer over the t devices of a group, and the logits of the sampled
rows); the resident weights are read from each device's own memory.

Mechanism: a second mesh over the trainer's devices in the trainer mesh's own order, reshaped to
(data = n / t, fsdp = 1, tensor = t). Both meshes then share one device assignment, so one jitted
program holds both layouts: the K-steps-in-one-jit loop changes layout inside the jit (one
reshard of the weights per RL step), and the host path's sampler program does the same at its
start. A tensor group is t consecutive devices of the trainer mesh, which `jax.make_mesh` orders
host by host on GPUs (so t <= devices per host keeps the group on NVLink) and along a ring or a
plane of the torus on TPUs. The trainer's mesh, its FSDP state and its checkpoints do not change.

Split devices (rollout.devices = m > 0): the sampler's mesh is instead over m devices of its own,
apart from the trainer's, and the two run at once (rl/step.py pipelines them). The weights then
cross between device sets once per RL step (`transfer`): cast and laid out for decoding on the
trainer's devices, over a mirror of the sampler's mesh (the same shape), so that the crossing is
a copy of each device's shard to its counterpart, device to device (no host copy; across hosts the
backend's cross-host transfers, which need exactly that: equal shardings on both sides).

A mixture of experts (Qwen3-MoE): the sampler's n / t groups are its mesh's `expert` axis
instead of `data`, (data = 1, fsdp = 1, tensor = t, expert = n / t). The rows, the prompt cache
and the KV cache split over the groups as for a dense model (the rule table's 'batch' includes
'expert'; the KV-cache bytes do not change), the dense weights (attention, router, embeddings)
stay replicated over them (`resident_spec`), and each sparse layer's E experts [Ls, E, D, M] are
split over them (each one's M over the tensor axis, as a dense MLP's F): a device holds E t / n
experts of every sparse layer, t / n of what replicating them would cost. Per decode step the
model's expert parallelism (model/expert_parallel.py) sends each token's rows to the group that
holds its experts and back, inside the tensor position's devices: the collectives are
activation-sized and no expert weight moves inside the decode loop (the plan's per-decode-step
collectives; BENCHMARKS.md, "Mixture of experts"). Laying the experts out moves each one's
weights once per RL step (`place`: D over the groups first, then to E).

When t does not divide the KV heads (e.g. t = 4 with Qwen2.5-0.5B's 2 KV heads) the KV heads, their
projections and the KV cache are replicated over the tensor group instead of split (the rule
table drops an axis that does not divide); the samples are the same, the cache costs t times the
memory per device. The default t (`choose_tensor`) avoids that.
"""

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from grpo_jax.errors import UserError
from grpo_jax.model.layers import FP32_ROUTER_PARAMS
from grpo_jax.model.quantize import CONTRACTED, FORMATS, Quantized, quantize
from grpo_jax.model.qwen2 import Qwen2
from grpo_jax.sharding import MESH_AXES, axis_rules, row_sharding, spec_for, use_mesh

# The rule table while the sampler traces on a mesh with a context axis (rollout.prefill_context):
# decoding takes its devices as more rows (a row's one new token needs no split), and the prompts'
# prefill splits their length over it (PREFILL_RULES: the rule table's 'seq', ring attention). The
# resident weights are replicated over it either way, as over the data groups.
PREFILL_RULES = dict(embed=('fsdp', 'expert'), latent=('fsdp', 'expert'))
DECODE_RULES = dict(PREFILL_RULES, batch=('data', 'fsdp', 'expert', 'context'),
                    tokens=('data', 'fsdp', 'expert', 'context'), seq=None)


def devices_per_host(devices: Sequence[jax.Device]) -> int:
  """Devices sharing the first device's host (process)."""
  first = devices[0].process_index
  return sum(1 for device in devices if device.process_index == first)


def choose_tensor(devices: Sequence[jax.Device], kv_heads: int) -> int:
  """The default sampler tensor size t: the largest that divides the KV heads and the device count,
  on GPUs within one host's devices (NVLink), 1 on CPUs.

  Decoding reads every resident weight once per token, so splitting the weights over more devices
  shortens the step until the activations exchanged between them dominate. Up to the KV heads the
  KV cache per device does not depend on t (rows over n / t groups, heads over t), and the
  resident weights shrink as 1 / t, so the largest such t both fits best and reads least. CPUs
  (test meshes of one host's cores) gain nothing from splitting a matmul over fake devices.

  Multi-head latent attention's cache has one head (Qwen2Config.cache_entry), replicated over t:
  its callers pass 1, so the rows (and the cache) split over every device by default; the plan
  shows what a larger rollout.tensor trades (resident weights / t against t times the cache)."""
  if devices[0].platform == 'cpu':
    return 1
  limit = devices_per_host(devices) if devices[0].platform == 'gpu' else len(devices)
  return max(t for t in range(1, min(kv_heads, limit) + 1) if kv_heads % t == 0 and len(devices) % t == 0)


@dataclasses.dataclass(frozen=True)
class RolloutLayout:
  """Where the sampler's weights, caches and rows live during a rollout.

  source: the trainer's mesh (data, fsdp, tensor), whose layout the parameters arrive in and the
          rollout is returned in (rows over its batch axes).
  mesh:   the sampler's mesh over the same devices in the same order: (data = n / t, fsdp = 1,
          tensor = t, expert = 1), or for a mixture of experts (1, 1, t, n / t); with
          rollout.prefill_context = c, the data groups as n / (t c) of c along a `context` axis
          (DECODE_RULES, PREFILL_RULES).
  dtype:  the compute dtype the resident weights are cast to.
  weights: rollout.weights: 'compute' (dtype), 'bf16', or 'int8' / 'fp8' (model/quantize.py: the
          projections' weights quantized per output channel, once per layout; the rest in dtype).
  """

  source: Mesh
  mesh: Mesh
  dtype: str
  weights: str = 'compute'

  @property
  def weights_dtype(self) -> str:
    """The dtype of the resident weights that are not quantized."""
    return 'bfloat16' if self.weights == 'bf16' else self.dtype

  def quantizes(self, name: str) -> bool:
    """Whether the resident copy of parameter `name` is 8-bit (model/quantize.py)."""
    return self.weights in FORMATS and name in CONTRACTED

  @property
  def groups_axis(self) -> str:
    """The sampler mesh's axis over its n / t groups: 'expert' for a mixture of experts, else 'data'."""
    return 'expert' if self.mesh.shape['expert'] > 1 else 'data'

  @property
  def split(self) -> bool:
    """The sampler has devices of its own (rollout.devices), apart from the trainer's."""
    return set(self.mesh.devices.flat) != set(self.source.devices.flat)

  @functools.cached_property
  def mirror(self) -> 'RolloutLayout':
    """With split devices: the sampler's layout over the trainer's devices (the same mesh shape
    when the halves are equal, else the trainer's devices grouped by the same tensor size), where
    `transfer` lays the weights out before they cross."""
    devices = list(np.asarray(self.source.devices).reshape(-1))
    return dataclasses.replace(self, mesh=_grouped_mesh(devices, self.tensor, 'rollout.tensor',
                                                        experts=self.groups_axis == 'expert', context=self.context))

  @property
  def tensor(self) -> int:
    return self.mesh.shape['tensor']

  @property
  def group_axes(self) -> str | tuple[str, str]:
    """The sampler mesh's axes over its n / t groups: `groups_axis`, and with a context axis
    (rollout.prefill_context) ('data', 'context')."""
    return ('data', 'context') if self.context > 1 else self.groups_axis

  @property
  def context(self) -> int:
    """c: the data groups a prompt's prefill splits its length over (rollout.prefill_context)."""
    return self.mesh.shape['context']

  @property
  def data_groups(self) -> int:
    """n / t: the groups that each hold all the weights (a mixture's experts: split over them)."""
    return self.mesh.shape[self.groups_axis] * self.context

  def experts_per_device(self, num_experts: int) -> int | None:
    """A mixture's experts each device holds of every sparse layer (`resident_spec`); None for a
    dense model (num_experts 0)."""
    if not num_experts:
      return None
    groups = self.mesh.shape['expert']
    return num_experts // groups if num_experts % groups == 0 else num_experts

  @contextlib.contextmanager
  def active(self):
    """Traces the sampler under the sampler's mesh (model/sharding.constrain reads it), and on a mesh
    with a context axis under DECODE_RULES."""
    with use_mesh(self.mesh), (axis_rules(DECODE_RULES) if self.context > 1 else contextlib.nullcontext()):
      yield

  def shardings(self, params: nnx.State) -> nnx.State:
    """The resident layout of every parameter: NamedShardings on the sampler mesh, one per
    Variable (a Quantized one's: Quantized(values' sharding, scale's))."""
    shape = dict(self.mesh.shape)

    def of(variable):
      value = variable.get_value()
      lay = lambda x: NamedSharding(self.mesh, resident_spec(x.shape, _axes(variable), shape))  # noqa: E731
      return Quantized(lay(value.values), lay(value.scale)) if isinstance(value, Quantized) else lay(variable)
    return jax.tree.map(of, params, is_leaf=lambda x: isinstance(x, nnx.Variable))

  def place(self, params: nnx.State) -> nnx.State:
    """The parameters cast to the compute dtype and laid out for decoding. Traceable (the sampler
    calls it inside its jit), and a no-op on one device when the dtype already matches.

    The cast comes first, on each device's own training shard, so only compute-dtype bytes move.
    The move itself goes in two stages, each one collective XLA partitions directly: first to the
    resident layout with D still split over the sampler's data groups (an all-to-all within each
    tensor group when the trainer shards D over the same devices), then D gathered over the data
    groups. In one stage XLA's partitioner cannot go from D split n ways to columns split t ways
    and replicates the whole weight on every device first. A mixture's experts, E split over the
    groups, take the same first stage with the groups on D, then a third collective moves them from
    D to E (an all-to-all within each tensor position's devices); straight from D over all n devices
    XLA replicates them too."""
    shape = dict(self.mesh.shape)
    source = dict(self.source.shape)
    # Hybrid sharding (data over the hosts, fsdp over each host's t devices, tensor and expert 1)
    # grouped host by host: each device's D slice of the training layout is already its D slice
    # over the sampler's tensor axis, so the first stage is that (no bytes move) and the columns
    # then move within each tensor group (the host). Staged over the groups instead, XLA fetched
    # part of each device's slice from another host's replica (8.57 GiB per GPU per step across
    # the hosts for the 32B recipe on 8 x 8 H100s).
    by_host = (not self.split and source['data'] > 1 and source['fsdp'] == self.tensor
               and source['tensor'] == source['expert'] == 1 and self.groups_axis == 'data')

    def lay_out(value, axes):
      final = resident_spec(value.shape, axes, shape)
      staged = (_with_groups_on_embed(value.shape, axes, final, 'tensor', self.tensor) if by_host else
                _with_groups_on_embed(value.shape, axes, final, self.group_axes, self.data_groups))
      if staged is not None:  # the groups on D first (a mixture's experts: then moved to E)
        value = jax.lax.with_sharding_constraint(value, NamedSharding(self.mesh, staged))
      return jax.lax.with_sharding_constraint(value, NamedSharding(self.mesh, final))

    # DeepSeekMoE's router (a model with a choice bias) stays in fp32, as the trainer computes it.
    kept = FP32_ROUTER_PARAMS if 'layers' in params and 'router_bias' in params['layers'] else ()

    def move(path, variable):
      name = path[-1].key if isinstance(path[-1], jax.tree_util.DictKey) else None
      if self.quantizes(name):  # quantized from the trainer's own precision, then moved as 8 bits
        quantized = quantize(variable[...], CONTRACTED[name], self.weights)
        return variable.replace(Quantized(lay_out(quantized.values, _axes(variable)),
                                          lay_out(quantized.scale, _axes(variable))))
      dtype = jnp.float32 if name in kept else self.weights_dtype
      return variable.replace(lay_out(variable[...].astype(dtype), _axes(variable)))

    return jax.tree_util.tree_map_with_path(move, params, is_leaf=lambda x: isinstance(x, nnx.Variable))

  def transfer(self, params: nnx.State) -> nnx.State:
    """Split devices: the trainer's parameters as the sampler's resident weights on the sampler's
    own devices. `place` runs on the trainer's devices (jitted there, over `mirror`), then each
    device's shard is copied to its counterpart (jax.device_put between equal shardings)."""
    mirror = self.mirror
    placed = place_program(mirror)(params)
    # The same PartitionSpecs on the sampler's mesh (the mirror's shape and axis names).
    return jax.device_put(placed, jax.tree.map(lambda x: NamedSharding(self.mesh, x.sharding.spec), placed))

  def enter(self, tree):
    """Small inputs (prompts, keys) replicated on the sampler's mesh: inside `active()` every array
    must carry the sampler's mesh (JAX checks the meshes of an operation's operands agree)."""
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, PartitionSpec())), tree)

  def rows_to_source(self, tree):
    """Per-row outputs [R, ...] laid out by rows over the trainer mesh's batch axes (a local slice of
    the sampler's row layout), as the update expects them; scalars replicated."""
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, row_sharding(self.source, x.shape)), tree)


def run_resident(graphdef, params: nnx.State, inputs, sample: Callable, *, layout: RolloutLayout | None):
  """sample(model, inputs) on the model of `params` (of `graphdef`) in the sampler's own layout: the
  weights cast and laid out once (`place`), the inputs entered replicated on the sampler's mesh,
  the sampling traced under that mesh, and what it returns laid out by rows over the source mesh's
  batch axes, as the update expects it. The one wrapper of rollout.sample_resident and
  pool.advance_resident. layout None: the model of `params` in their own layout. Traceable."""
  if layout is None:
    return sample(nnx.merge(graphdef, params), inputs)
  resident = layout.place(params)
  inputs = layout.enter(inputs)
  with layout.active():
    out = sample(nnx.merge(graphdef, resident), inputs)
  return layout.rows_to_source(out)


def cross(tree, shardings):
  """`tree`'s arrays onto `shardings` (a tree like it, or one sharding for every leaf) on another
  set of devices (split devices: the trainer's and the sampler's). Each array is first laid out on
  its own devices as it will lie on the target's, over a mirror mesh (the target mesh's shape and
  axis names over the source's devices, in order), and then each device's shard is copied to its
  counterpart: jax.device_put between equal shardings, device to device, and across processes the
  backend's cross-host transfer, which takes nothing else. Host values are placed on the target
  directly; with unequal device counts (one process only) device_put copies as it can."""
  leaves, treedef = jax.tree.flatten(tree)
  targets = ([shardings] * len(leaves) if isinstance(shardings, jax.sharding.Sharding) else
             treedef.flatten_up_to(shardings))
  staged = {}  # mirror mesh -> [(leaf index, its sharding there)]
  out = list(leaves)
  for index, (leaf, target) in enumerate(zip(leaves, targets)):
    if not isinstance(leaf, jax.Array):
      value = np.asarray(leaf)
      value = value.astype(jax.dtypes.canonicalize_dtype(value.dtype))  # a Python int: int32 unless x64
      out[index] = jax.make_array_from_callback(value.shape, target, lambda where, value=value: value[where],
                                                dtype=value.dtype)
      continue
    source = _ordered_devices(leaf.sharding)
    if set(source) != set(target.device_set) and len(source) == target.mesh.size:
      mirror = Mesh(np.asarray(source).reshape(target.mesh.devices.shape), target.mesh.axis_names,
                    axis_types=target.mesh.axis_types)
      staged.setdefault(mirror, []).append((index, NamedSharding(mirror, target.spec)))
  for mirror, entries in staged.items():
    with jax.set_mesh(mirror):  # whatever mesh the caller traces under
      laid = _identity(tuple(sharding for _, sharding in entries))([out[index] for index, _ in entries])
    for (index, _), value in zip(entries, laid):
      out[index] = value
  moved = [index for index, leaf in enumerate(leaves) if isinstance(leaf, jax.Array)]
  placed = jax.device_put([out[index] for index in moved], [targets[index] for index in moved])
  for index, value in zip(moved, placed):
    out[index] = value
  return jax.tree.unflatten(treedef, out)


def _ordered_devices(sharding) -> list:
  if isinstance(sharding, NamedSharding):
    return list(sharding.mesh.devices.flat)
  return sorted(sharding.device_set, key=lambda device: device.id)


@functools.cache
def _identity(shardings: tuple):
  return jax.jit(lambda leaves: leaves, out_shardings=list(shardings))


@functools.cache
def place_program(layout: RolloutLayout):
  """`layout.place` jitted on its own (split devices: the trainer's half of the crossing)."""
  return jax.jit(layout.place)


def _axes(variable) -> tuple:
  return getattr(variable, 'logical_axes', None) or (None,) * len(variable.shape)


def resident_spec(shape, axes, mesh_shape: dict) -> PartitionSpec:
  """A parameter's resident PartitionSpec on the sampler mesh: the rule table's, where the 'expert'
  axis (a mixture's groups) splits the experts' E and nothing else: every other weight is
  replicated over it (the rule table would also split a weight's D over it). A context axis
  (rollout.prefill_context) holds more groups: every weight is replicated over it."""
  mesh_shape = dict(mesh_shape, context=1)
  if 'experts' not in axes:
    mesh_shape = dict(mesh_shape, expert=1)
  return spec_for(shape, axes, mesh_shape)


def _with_groups_on_embed(shape, axes, final: PartitionSpec, groups_axis: str | tuple[str, ...],
                          groups: int) -> PartitionSpec | None:
  """`final` with the sampler's groups (`groups_axis`, one mesh axis or several) on the dimension
  FSDP splits in training (logical 'embed', or 'latent' for a weight without D) instead of where it has them (a mixture's
  experts E), or None when there is no such dimension or the groups do not divide it."""
  dim = next((list(axes).index(name) for name in ('embed', 'latent') if name in axes), None)
  if groups == 1 or dim is None:
    return None
  spec = [None if entry == groups_axis else entry for entry in list(final) + [None] * (len(shape) - len(final))]
  if spec[dim] is not None or shape[dim] % groups:
    return None
  spec[dim] = groups_axis
  return PartitionSpec(*spec)


def _grouped_mesh(devices: Sequence[jax.Device], tensor: int, field: str, experts: bool = False,
                  context: int = 1) -> Mesh:
  """(data = n / t, fsdp = 1, tensor = t, expert = 1) over `devices` in their order, or for a
  mixture of experts (1, 1, t, n / t): either way each tensor group is t consecutive devices.
  context c > 1 (rollout.prefill_context): the n / t groups as (data = n / (t c), context = c),
  c consecutive groups along the context axis."""
  if tensor < 1 or len(devices) % tensor:
    raise UserError(f'{field}={tensor} must divide the {len(devices)} devices of the mesh')
  if context > 1:
    groups = len(devices) // tensor
    if experts:
      raise UserError(f"rollout.prefill_context={context} splits the sampler's data groups; a mixture of experts "
                      'has its groups on the expert axis: set rollout.prefill_context=1')
    if groups % context:
      raise UserError(f"rollout.prefill_context={context} must divide the sampler's {groups} data groups "
                      f'({len(devices)} devices / {field}={tensor})')
    grid = np.asarray(devices).reshape(groups // context, context, 1, tensor, 1)
    return Mesh(grid, ('data', 'context', 'fsdp', 'tensor', 'expert'),
                axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))
  # The axes of a mixture's mesh are named in another order, the groups before the tensor axis: the
  # devices keep their order (one device assignment with the trainer's mesh, so one program can hold
  # both layouts) and each tensor group stays t consecutive devices.
  names = ('data', 'fsdp', 'expert', 'tensor', 'context') if experts else MESH_AXES
  grid = np.asarray(devices).reshape(1, 1, len(devices) // tensor, tensor, 1) if experts else \
      np.asarray(devices).reshape(len(devices) // tensor, 1, tensor, 1, 1)
  return Mesh(grid, names, axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


def rollout_mesh(source: Mesh, tensor: int) -> Mesh:
  """(data = n / t, fsdp = 1, tensor = t) over `source`'s devices in `source`'s order."""
  return _grouped_mesh(list(np.asarray(source.devices).reshape(-1)), tensor, 'rollout.tensor')


def split_devices(devices: Sequence[jax.Device], sampler: int) -> tuple[list, list]:
  """(the trainer's devices, the sampler's): the last `sampler` (rollout.devices) of `devices` are
  the sampler's; 0: both share all of them."""
  devices = list(devices)
  if not sampler:
    return devices, devices
  if sampler >= len(devices):
    raise UserError(f'rollout.devices={sampler} leaves none of the {len(devices)} devices to the trainer: '
                    f'give the sampler fewer')
  if jax.process_count() > 1 and 2 * sampler != len(devices):
    raise UserError(f'rollout.devices={sampler}: across hosts the weights cross between equal halves; '
                    f'give the sampler {len(devices) // 2} of the {len(devices)} devices')
  return devices[:-sampler], devices[-sampler:]


def serving_mesh(tensor: int, kv_heads: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """The sampler's layout for a model that only samples (python -m grpo_jax.generate, serve): the
  host's devices (default: this process's) in groups of t, weights split over each group and
  replicated over the groups, which share the rows. tensor 0: choose_tensor."""
  devices = list(devices) if devices is not None else jax.local_devices()
  return _grouped_mesh(devices, tensor or choose_tensor(devices, kv_heads), '--tensor')


def serving_read_mesh(architecture, tensor: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Where a model that only samples (generate, serve) is read: for a dense model the serving
  mesh itself (serving_mesh); for a mixture of experts FSDP over the host's devices, from which
  rollout_layout(model, mesh, tensor) lays it out as training's sampler does, its experts over the
  groups (the expert axis)."""
  devices = list(devices) if devices is not None else jax.local_devices()
  if not architecture.num_sparse_layers:
    return serving_mesh(tensor, architecture.cache_entry[0], devices)
  return Mesh(np.asarray(devices).reshape(1, len(devices), 1, 1, 1), MESH_AXES,
              axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


def rollout_layout(model: Qwen2, source: Mesh, tensor: int = 0, devices: Sequence[jax.Device] | None = None,
                   weights: str = 'compute', context: int = 1) -> RolloutLayout:
  """The layout of `source`'s devices (or, split, of the sampler's own `devices`) for decoding
  `model` (its KV heads and compute dtype) with `tensor` devices per group (0: choose_tensor), its
  resident weights as `weights` says (rollout.weights) and its prompts prefilled split along their
  length over `context` data groups (rollout.prefill_context)."""
  devices = list(np.asarray(source.devices).reshape(-1)) if devices is None else list(devices)
  tensor = tensor or choose_tensor(devices, model.config.cache_entry[0])
  if context > 1 and model.config.mla:
    raise UserError(f"rollout.prefill_context={context}: multi-head latent attention's cache holds its latent, "
                    'which the split prefill does not keep; set rollout.prefill_context=1')
  mesh = _grouped_mesh(devices, tensor, 'rollout.tensor', experts=model.config.num_sparse_layers > 0,
                       context=context)
  return RolloutLayout(source=source, mesh=mesh, dtype=model.options.dtype, weights=weights)


def resident_bytes_per_device(params, layout: RolloutLayout) -> int:
  """Bytes of the resident weights on the fullest device (params: arrays or ShapeDtypeStructs of
  the parameters' shapes): 8-bit values and fp32 scales where `layout` quantizes, else its dtype."""
  total = 0
  leaves = jax.tree_util.tree_leaves_with_path(params, is_leaf=lambda x: isinstance(x, nnx.Variable))
  for (path, variable), target in zip(leaves, jax.tree.leaves(layout.shardings(params))):
    elements = math.prod(target.shard_shape(variable.shape))
    if layout.quantizes(path[-1].key if isinstance(path[-1], jax.tree_util.DictKey) else None):
      contracted = math.prod(variable.shape[axis] for axis in CONTRACTED[path[-1].key])
      total += elements + 4 * -(-elements // contracted)  # the values, and a scale per output (at least)
    else:
      total += elements * np.dtype(layout.weights_dtype).itemsize
  return total
