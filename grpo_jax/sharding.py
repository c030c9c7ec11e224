"""The device mesh and the one table that maps logical axis names to mesh axes.

Every parameter carries its logical axes as metadata (`logical_axes=('vocab', 'embed')`); key
activations are constrained with the same names. This table is the whole tensor/FSDP/data/expert
parallelism plan: Megatron's column/row-parallel split falls out of sharding heads and the MLP
hidden dimension over `tensor`, ZeRO-3-style parameter sharding out of `embed` over `fsdp`, and
expert parallelism out of a mixture's experts over `expert` (the fourth axis, used by mixtures of
experts only). The `expert` devices take rows of the batch like `fsdp` ones and, in a dense
weight, share its ZeRO shards: an expert weight's E dimension claims `expert` first, so its D
dimension is split over `fsdp` (and `context`) alone. The `context` axis (context parallelism, the fifth) splits
each of the update's rows along its length ('seq'); its devices share the ZeRO shards too.

A dimension whose size is not divisible by its mesh axes is replicated along them instead (for
example Qwen2.5-0.5B's two KV heads on a tensor axis of 4), so every Qwen2.5 size lays out on
every mesh; `spec_for` reports which axes were dropped.
"""

import contextlib
import dataclasses
import math
import threading
from collections.abc import Sequence
from typing import Literal

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from grpo_jax.errors import UserError, require

MESH_AXES = ('data', 'fsdp', 'tensor', 'expert', 'context')

# logical axis -> mesh axes (None: replicated). Suffix-free names; the dim letters are in docstrings.
LOGICAL_AXIS_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ('batch', ('data', 'fsdp', 'expert')),  # B
    # T: the update's sequences split along their length over `context` (context parallelism: ring
    # attention, model/ring_attention.py); every other op is per token and stays local.
    ('seq', 'context'),
    # B x T flattened (the expert-parallel layer's token rows): the rows' axes, then the length's.
    ('tokens', ('data', 'fsdp', 'expert', 'context')),
    ('cache_seq', None),  # S
    ('vocab', 'tensor'),  # V
    # D, parameters: FSDP shards weights along D, over the devices that split the rows (fsdp, expert)
    # and those that split each row's tokens (context), as ZeRO shards over data x context parallelism.
    ('embed', ('fsdp', 'expert', 'context')),
    # R, a latent's rank (multi-head latent attention's q_lora_rank, kv_lora_rank): the input of an
    # up-projection that has no D, so FSDP shards it there (else a 671B model's q_b and kv_b, 12.4
    # GiB in fp32, lie whole on every device).
    ('latent', ('fsdp', 'expert', 'context')),
    ('act_embed', None),  # D, activations
    ('q_heads', 'tensor'),  # N
    ('kv_heads', 'tensor'),  # K
    ('head_dim', None),  # H
    ('mlp', 'tensor'),  # F (and M, an expert's width)
    ('experts', 'expert'),  # E
    ('layers', None),  # L, the scanned layer axis
    # r, a LoRA factor's rank: FSDP shards it where the factor's other axes leave 'fsdp' unused (B
    # of q/k/v/gate/up, A of o/down), so no factor lies whole on every device.
    ('lora_rank', 'fsdp'),
)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Device mesh shape; one axis may be -1 to take the remaining devices.

  hybrid true lays the mesh out by host (hybrid sharding, HSDP): `data` is the number of hosts
  (processes) and `fsdp` each host's devices over tensor x expert, so parameters, gradients and
  optimizer moments are sharded within a host and replicated across hosts; the weights' gathers
  stay on the host's links (NVLink) and only the gradients' reduction, once per optimizer update,
  crosses the network. 'auto': true for GPUs on more than one host, false on TPUs (a slice's ICI
  joins its hosts: FSDP over the whole slice). data and fsdp are then left as they are by default."""

  data: int = 1  # pure data parallelism (replicated parameters)
  fsdp: int = -1  # data parallelism with parameters sharded along the embed dimension
  tensor: int = 1  # tensor parallelism over heads, MLP hidden and vocab
  expert: int = 1  # expert parallelism: a mixture's experts split over these devices (rows too)
  context: int = 1  # context parallelism: the update's sequences split along their length (ring attention)
  hybrid: bool | Literal['auto'] = False  # true, false or 'auto' (above)

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(getattr(self, name) for name in MESH_AXES)

  def __post_init__(self):
    shape = self.shape
    for name, size in zip(MESH_AXES, shape):
      require(size >= 1 or size == -1, f'mesh.{name}', f'must be a positive size or -1, got {size}')
    require(shape.count(-1) <= 1, 'mesh', f'may have at most one axis of -1, got {_sizes(shape)}')
    require(self.hybrid in (True, False, 'auto'), 'mesh.hybrid', f"must be true, false or 'auto', got {self.hybrid!r}")
    if self.hybrid is not False:
      require(self.data == 1 and self.fsdp == -1 and self.tensor >= 1 and self.expert >= 1, 'mesh.hybrid',
              f'({str(self.hybrid).lower()}) sets data (the hosts) and fsdp (each host\'s devices): leave '
              f'mesh.data at 1 and mesh.fsdp at -1, and give tensor and expert sizes, got {_sizes(shape)}')


def _sizes(shape) -> str:
  return ' '.join(f'{name}={size}' for name, size in zip(MESH_AXES, shape))


def make_mesh(config: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Builds a ('data', 'fsdp', 'tensor', 'expert', 'context') mesh over `devices` (default: all
  devices). On a TPU slice each axis must be a product of the torus' dimensions (jax.make_mesh's
  rule): one that is not is refused in one line."""
  devices = list(devices) if devices is not None else jax.devices()
  if is_hybrid(config, devices):
    return _hybrid_mesh(config, devices)
  shape = list(config.shape)  # sizes checked by MeshConfig
  known = math.prod(size for size in shape if size != -1)
  if -1 in shape:
    if len(devices) % known:
      raise UserError(f'mesh: {len(devices)} devices cannot be split into {_sizes(shape).replace(" ", " x ")}')
    shape[shape.index(-1)] = len(devices) // known
  if math.prod(shape) != len(devices):
    raise UserError(f'mesh: {_sizes(shape).replace(" ", " x ")} = {math.prod(shape)} devices, '
                    f'but {len(devices)} are available')
  try:
    return jax.make_mesh(tuple(shape), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)
  except NotImplementedError as error:  # a TPU torus that the axes' sizes do not factor
    raise UserError(f'mesh: {_sizes(shape).replace(" ", " x ")} does not lay out on these {len(devices)} '
                    f'devices\' torus: {str(error).split(". ")[0]}') from None


def is_hybrid(config: MeshConfig, devices: Sequence[jax.Device]) -> bool:
  """Whether `config.hybrid` lays the mesh out by host on these devices."""
  if config.hybrid == 'auto':
    return len({device.process_index for device in devices}) > 1 and devices[0].platform in ('gpu', 'cuda', 'rocm')
  return config.hybrid is True


def _hybrid_mesh(config: MeshConfig, devices: Sequence[jax.Device]) -> Mesh:
  """data over the hosts (processes, in order), fsdp x tensor x expert over each host's devices."""
  hosts: dict[int, list] = {}
  for device in devices:
    hosts.setdefault(device.process_index, []).append(device)
  counts = sorted({len(held) for held in hosts.values()})
  if len(counts) > 1:
    raise UserError(f'mesh.hybrid: the hosts hold different numbers of devices ({", ".join(map(str, counts))})')
  inner = config.tensor * config.expert * config.context
  if counts[0] % inner:
    raise UserError(f'mesh.hybrid: {counts[0]} devices per host do not split into tensor={config.tensor} x '
                    f'expert={config.expert} x context={config.context}')
  grid = np.array([sorted(hosts[index], key=lambda device: device.id) for index in sorted(hosts)], dtype=object)
  return Mesh(grid.reshape(len(hosts), counts[0] // inner, config.tensor, config.expert, config.context), MESH_AXES,
              axis_types=(AxisType.Auto,) * len(MESH_AXES))


_RULES = threading.local()  # the rule table `axis_rules` entered, if any


@contextlib.contextmanager
def axis_rules(changes: dict[str, str | tuple[str, ...] | None]):
  """Traces with LOGICAL_AXIS_RULES' entries for the logical axes in `changes` replaced (the others
  kept as the table has them, whatever an outer `axis_rules` changed): one program's part that lays
  its arrays out otherwise (the sampler's, whose context axis holds more rows while decoding and
  splits the prompts' length while they are prefilled)."""
  previous = getattr(_RULES, 'table', LOGICAL_AXIS_RULES)
  _RULES.table = tuple((name, changes.get(name, target)) for name, target in LOGICAL_AXIS_RULES)
  try:
    yield
  finally:
    _RULES.table = previous


def _mesh_axes_for(logical: str | None) -> tuple[str, ...]:
  if logical is None:
    return ()
  for name, target in getattr(_RULES, 'table', LOGICAL_AXIS_RULES):
    if name == logical:
      if target is None:
        return ()
      return (target,) if isinstance(target, str) else tuple(target)
  raise ValueError(f'logical axis {logical!r} has no rule in LOGICAL_AXIS_RULES')


def spec_for(shape: Sequence[int], logical_axes: Sequence[str | None], mesh_shape: dict[str, int]) -> PartitionSpec:
  """PartitionSpec for an array of `shape` whose dimensions carry `logical_axes`.

  Mesh axes that do not divide their dimension, are of size 1, or were already used by an
  earlier dimension are dropped, so the result is always a valid sharding for `shape`.
  """
  if len(shape) != len(logical_axes):
    raise ValueError(f'shape {tuple(shape)} and logical axes {tuple(logical_axes)} differ in rank')
  used: set[str] = set()
  spec = []
  for size, logical in zip(shape, logical_axes):
    kept = []
    for axis in _mesh_axes_for(logical):
      axis_size = mesh_shape.get(axis, 1)
      divisor = math.prod(mesh_shape[a] for a in kept) * axis_size
      if axis in used or axis_size == 1 or size % divisor:
        continue
      kept.append(axis)
    used.update(kept)
    spec.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
  while spec and spec[-1] is None:
    spec.pop()
  return PartitionSpec(*spec)


def split_axes(size: int, logical: str, mesh_shape: dict) -> tuple[str, ...]:
  """The mesh axes (spec_for's) that split a dimension of `size` carrying `logical`, in order."""
  spec = spec_for((size,), (logical,), mesh_shape)
  first = spec[0] if len(spec) else None
  return () if first is None else (first,) if isinstance(first, str) else tuple(first)


def row_and_length_axes(rows: int, length: int, mesh_shape: dict) -> tuple[tuple[str, ...], tuple[str, ...]]:
  """(the mesh axes that split a [B, T] array's rows by the 'batch' rule, those left that split its
  length by the 'seq' rule: context parallelism's), as the flattened B x T tokens lie over them."""
  row_axes = split_axes(rows, 'batch', mesh_shape)
  return row_axes, split_axes(length, 'seq', {name: size for name, size in mesh_shape.items() if name not in row_axes})


_ENTERED = threading.local()  # the meshes `use_mesh` entered, innermost last


@contextlib.contextmanager
def use_mesh(mesh: Mesh):
  """Traces under `mesh` inside a jit (the sampler's own layout): its abstract mesh for the sharding
  constraints, and the mesh itself for `current_mesh` (a shard_map given only the abstract mesh
  lowers with the device ids of the mesh set outside the jit, the trainer's)."""
  entered = _ENTERED.__dict__.setdefault('meshes', [])
  entered.append(mesh)
  try:
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      yield
  finally:
    entered.pop()


def current_mesh():
  """The mesh being traced under, for shard_map: the one `use_mesh` entered when it is the current
  abstract mesh, else the abstract mesh itself (that of jax.set_mesh outside the jit)."""
  abstract = jax.sharding.get_abstract_mesh()
  for mesh in reversed(_ENTERED.__dict__.get('meshes', [])):
    if mesh.abstract_mesh == abstract:
      return mesh
  return abstract


def auto_shape(mesh) -> dict[str, int]:
  """The sizes of `mesh`'s axes that a sharding may name where it is traced: all of them, except
  inside a shard_map, whose manual axes are left out (each device already holds only its own part
  along them: the update's replicas, rl/update.py)."""
  manual = set(getattr(mesh, 'manual_axes', ()))
  return {name: size for name, size in mesh.shape.items() if name not in manual}


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
  """Pins an activation's sharding when tracing under a mesh (`jax.set_mesh`); a no-op otherwise."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  return jax.lax.with_sharding_constraint(x, spec_for(x.shape, logical_axes, auto_shape(mesh)))


def batch_axes() -> tuple[str, ...]:
  """The mesh axes that split a batch's rows (the 'batch' rule), in order."""
  return _mesh_axes_for('batch')


def length_axes() -> tuple[str, ...]:
  """The mesh axes that split a row's length (the 'seq' rule: context parallelism's), in order."""
  return _mesh_axes_for('seq')


def batch_groups(rows: int, *others: int) -> int:
  """n: how many groups the mesh's batch axes split `rows` (and every one of `others`) into, evenly
  (1 outside a mesh). Work split this way (the sampler's slots, the update's packing) stays on the
  devices that hold its rows."""
  mesh = jax.sharding.get_abstract_mesh()
  axes = batch_axes()
  shards = 1 if mesh.empty else math.prod(size for name, size in auto_shape(mesh).items() if name in axes)
  for count in (rows, *others):
    shards = math.gcd(shards, count)
  return shards


def grouped(x: jax.Array, groups: int) -> jax.Array:
  """[n * m, ...] -> [n, m, ...], the group axis laid out over the batch axes."""
  x = x.reshape((groups, x.shape[0] // groups) + x.shape[1:])
  return constrain(x, ('batch',) + (None,) * (x.ndim - 1))


def state_shardings(state: nnx.State, mesh: Mesh) -> nnx.State:
  """NamedShardings for every variable in `state`, from its `logical_axes` metadata."""

  def sharding(variable):
    axes = getattr(variable, 'logical_axes', None) or (None,) * len(variable.shape)
    return NamedSharding(mesh, spec_for(variable.shape, axes, dict(mesh.shape)))

  return jax.tree.map(sharding, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def placed_abstract(variables: nnx.State, shardings: nnx.State) -> nnx.State:
  """nnx Variables holding ShapeDtypeStructs placed by `shardings` (a State of NamedShardings, as
  state_shardings gives): parameters as a program is compiled on them, no array made (the plan's)."""
  place = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)  # noqa: E731
  # A Quantized value (the sampler's 8-bit weights) has a sharding for each of its arrays.
  return jax.tree.map(lambda variable, s: variable.replace(jax.tree.map(place, variable.get_value(), s)),
                      variables, shardings, is_leaf=lambda x: isinstance(x, nnx.Variable))


def named_sharding(mesh: Mesh, shape: Sequence[int], logical_axes: Sequence[str | None]) -> NamedSharding:
  """Sharding of an input or output array from its logical axes, e.g. tokens ('batch', 'seq')."""
  return NamedSharding(mesh, spec_for(shape, logical_axes, dict(mesh.shape)))


def row_sharding(mesh: Mesh, shape: Sequence[int]) -> NamedSharding:
  """An array of rows [R, ...] laid out by its rows over the mesh's batch axes, as the update takes
  a rollout's fields (the sampler's hand-over, a host task's rewards, the plan); a scalar replicated."""
  if not len(shape):
    return NamedSharding(mesh, PartitionSpec())
  return named_sharding(mesh, shape, ('batch',) + (None,) * (len(shape) - 1))


def bytes_per_device(tree) -> int:
  """Bytes the fullest device holds of a tree of sharded arrays or of ShapeDtypeStructs with
  shardings (a plan for devices that are not attached): each leaf's largest shard."""
  total = 0
  for leaf in jax.tree.leaves(tree):
    shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
    total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
  return total


def describe(mesh: Mesh) -> str:
  return ' x '.join(f'{name}={size}' for name, size in mesh.shape.items()) + f' ({np.prod(list(mesh.shape.values()))} devices)'
