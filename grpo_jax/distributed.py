"""Many hosts on JAX's own runtime: one process per host, `jax.distributed`, one global mesh.

`initialize(config)` starts the multi-controller runtime before anything touches a device:
  - with `distributed.coordinator_address`, `num_processes` and `process_id` from the config (or
    JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID in the environment, which the
    launch scripts set), it connects to that coordinator;
  - under SLURM with several tasks, on a multi-host Cloud TPU slice, or under Open MPI (and
    whenever `distributed.auto` is set, as launch/tpu_pod.sh does), JAX's own cluster detection
    fills all three in;
  - otherwise the run is one process and nothing is started.
On CPUs the cross-process collectives go through gloo, and arrays cross between processes' devices
(split devices, `rollout.devices`, with the sampler on other hosts than the trainer) through JAX's
DCN transfer server, which listens on `distributed.transfer_address` (default: this host, as the
coordinator sees it, on a free port); GPUs and TPUs use their backends' own cross-host transfers.
Every process runs the same program over the global mesh (no Pathways, no parameter server, no RPC
of ours); only process 0 writes logs, metrics, plots and the resolved config, while all processes
take part in each checkpoint.
"""

import dataclasses
import ipaddress
import os
import socket

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from grpo_jax.errors import UserError, require


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
  """How this process joins a multi-host run (all unset: from the environment, else one process)."""

  coordinator_address: str | None = None  # host:port of process 0's coordinator service
  num_processes: int = 0  # processes in the run (one per host); 0: from the environment
  process_id: int = -1  # this process's index; -1: from the environment
  auto: bool = False  # join through JAX's cluster detection (a Cloud TPU pod's metadata, SLURM, MPI)
  initialization_timeout_s: int = 300  # how long to wait for every process to join
  # CPUs: host:port of this process's cross-host transfer server (arrays crossing to another
  # process's devices); None: the address this host reaches the coordinator from, on a free port
  transfer_address: str | None = None

  def __post_init__(self):
    require(self.num_processes >= 0, 'distributed.num_processes', f'must be >= 0, got {self.num_processes}')
    require(self.process_id >= -1, 'distributed.process_id', f'must be >= -1, got {self.process_id}')
    require(self.initialization_timeout_s >= 1, 'distributed.initialization_timeout_s',
            f'must be >= 1, got {self.initialization_timeout_s}')


def _from_environment(config: DistributedConfig) -> tuple[str | None, int, int]:
  address = config.coordinator_address or os.environ.get('JAX_COORDINATOR_ADDRESS') or None
  count = config.num_processes or int(os.environ.get('JAX_NUM_PROCESSES', '0') or 0)
  index = config.process_id if config.process_id >= 0 else int(os.environ.get('JAX_PROCESS_ID', '-1') or -1)
  return address, count, index


def _cluster_detected() -> bool:
  """A launcher JAX can read the process layout from (SLURM, multi-host TPU, Open MPI)."""
  if int(os.environ.get('SLURM_NTASKS', '1') or 1) > 1 and 'SLURM_JOB_ID' in os.environ:
    return True
  if len(os.environ.get('TPU_WORKER_HOSTNAMES', 'localhost').split(',')) > 1:
    return True
  return int(os.environ.get('OMPI_COMM_WORLD_SIZE', '1') or 1) > 1


def initialize(config: DistributedConfig) -> None:
  """Joins the multi-host run described by `config` / the environment (see the module docstring)."""
  address, count, index = _from_environment(config)
  if address is None and count <= 1 and not (config.auto or _cluster_detected()):
    return  # one process
  if jax.distributed.is_initialized():
    return
  if address is not None and (count < 1 or index < 0):
    raise UserError(f'distributed: coordinator {address} needs num_processes and process_id too '
                    f'(got {count} and {index}; set them in the config or JAX_NUM_PROCESSES / JAX_PROCESS_ID)')
  if os.environ.get('JAX_PLATFORMS', '').startswith('cpu'):
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')
    transfer = config.transfer_address or f'{_local_host(address)}:{_free_port()}'
    jax.config.update('jax_cross_host_transfer_socket_address', transfer)
    jax.config.update('jax_cross_host_transport_addresses', f'{transfer.rsplit(":", 1)[0]}:0')
  try:
    if address is None:
      jax.distributed.initialize(initialization_timeout=config.initialization_timeout_s)
    else:
      jax.distributed.initialize(address, num_processes=count, process_id=index,
                                 initialization_timeout=config.initialization_timeout_s)
  except Exception as error:  # a coordinator that never answers, a second process 0, ...
    raise UserError(f'distributed: could not join the run (coordinator {address or "from the cluster"}, '
                    f'{count or "?"} processes, this one {index if index >= 0 else "?"}): '
                    f'{str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__}') from None


def _local_host(coordinator: str | None) -> str:
  """The address other processes reach this one at: loopback when the coordinator is on it, else
  the interface this host routes to the coordinator (or its name's address) through."""
  host = (coordinator or '').rsplit(':', 1)[0].strip('[]')
  try:
    if host and ipaddress.ip_address(socket.gethostbyname(host)).is_loopback:
      return '127.0.0.1'
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # no packet is sent
      probe.connect((host or '8.8.8.8', 9))
      return probe.getsockname()[0]
  except OSError:
    return socket.gethostbyname(socket.gethostname())


def _free_port() -> int:
  with socket.socket() as sock:
    sock.bind(('', 0))
    return sock.getsockname()[1]


def is_primary() -> bool:
  """True on the process that writes logs, metrics and plots (process 0)."""
  return jax.process_index() == 0


# ---- host values and global arrays ----
# A jitted program over a multi-host mesh takes and returns global arrays, of which each process
# holds only the shards on its own devices. The host parts of a run (a dataset's prompts, the
# reward of a host-scored task, evaluation) cross that boundary through these.


def replicated(value, mesh: jax.sharding.Mesh) -> jax.Array:
  """A host value every process holds identically (or an array, read as `host_value`), as a global
  array replicated over `mesh`."""
  value = host_value(value)
  return jax.make_array_from_callback(value.shape, NamedSharding(mesh, PartitionSpec()), lambda index: value[index],
                                      dtype=value.dtype)


def host_value(array) -> np.ndarray:
  """The whole of `array` on this host: a copy from the local devices, or (when its shards span
  processes, or lie on other processes' devices only) collectives every process must join."""
  return host_values([array])[0]


def host_values(tree):
  """`host_value` of every leaf of `tree`, the leaves that lie on some processes' devices only
  (split devices across processes: the trainer's state on one host, the sampler's on another) sent
  to every process in one all-gather from the first process holding each."""
  leaves, treedef = jax.tree.flatten(tree)
  out, apart = [], []
  for index, leaf in enumerate(leaves):
    if not isinstance(leaf, jax.Array) or jax.process_count() == 1:
      out.append(np.asarray(leaf))
      continue
    # Decided alike on every process (from the devices, not from what this one holds): the
    # collectives below must be joined by all of them.
    holders = sorted({device.process_index for device in leaf.sharding.device_set})
    held = jax.process_index() in holders
    value = None
    if leaf.is_fully_addressable or (held and leaf.is_fully_replicated):
      value = np.asarray(leaf.addressable_data(0) if leaf.is_fully_replicated else leaf)
    elif held:  # replicated over its own devices, a program its holders join
      value = np.asarray(_replicate(leaf).addressable_data(0))
    if len(holders) < jax.process_count():
      apart.append((index, holders[0]))
    out.append(value if held else np.zeros(leaf.shape, leaf.dtype))
  _from_holders(out, apart)
  return jax.tree.unflatten(treedef, out)


def writable(tree):
  """`tree` as orbax can write it from every process of a run: orbax refuses an array that lies
  wholly on one process's devices when there are several (split devices across processes: the
  trainer on one host, the sampler on another). Such leaves become host arrays, which process 0
  writes: its own copied from its devices, another process's sent to it (every process joins; the
  others pass zeros, which orbax does not write). Arrays that span processes stay as they are."""
  if jax.process_count() == 1:
    return tree
  leaves, treedef = jax.tree.flatten(tree)
  out, elsewhere = list(leaves), []
  for index, leaf in enumerate(leaves):
    if not isinstance(leaf, jax.Array) or not _held_by_one(leaf):
      continue
    (holder,) = {device.process_index for device in leaf.sharding.device_set}
    mine = np.asarray(leaf) if holder == jax.process_index() else np.zeros(leaf.shape, leaf.dtype)
    out[index] = mine
    if holder != 0:
      elsewhere.append((index, holder))
  _from_holders(out, elsewhere)
  return jax.tree.unflatten(treedef, out)


def _from_holders(values: list, entries: list[tuple[int, int]]) -> None:
  """values[index] replaced, on every process, by process `holder`'s, for each (index, holder) of
  `entries`: one host all-gather that every process joins (the others pass zeros of the shape)."""
  if entries:
    gathered = multihost_utils.process_allgather([values[index] for index, _ in entries])
    for (index, holder), stacked in zip(entries, gathered):
      values[index] = np.asarray(stacked[holder])


def _held_by_one(leaf) -> bool:
  """An array (or abstract one) that lies wholly on one process's devices in a run of several."""
  sharding = getattr(leaf, 'sharding', None)
  return (jax.process_count() > 1 and sharding is not None
          and len({device.process_index for device in sharding.device_set}) == 1)


def readable(abstract):
  """The restore target orbax can read into on every process (the counterpart of `writable`): a
  leaf that lies wholly on one process's devices is read as a host array by every process, then
  placed by `placed`."""
  return jax.tree.map(lambda leaf: np.empty(leaf.shape, leaf.dtype) if _held_by_one(leaf) else leaf, abstract)


def placed(restored, abstract):
  """`restored` (read into `readable(abstract)`) with its host arrays placed as `abstract` says."""
  return jax.tree.map(
      lambda value, leaf: jax.make_array_from_callback(leaf.shape, leaf.sharding, lambda where: value[where],
                                                       dtype=leaf.dtype) if _held_by_one(leaf) else value,
      restored, abstract)


def _replicate(array: jax.Array) -> jax.Array:
  """`array` replicated over its own devices."""
  sharding = array.sharding
  target = (sharding.update(spec=PartitionSpec()) if isinstance(sharding, NamedSharding) else
            NamedSharding(jax.sharding.Mesh(np.asarray(sorted(sharding.device_set, key=lambda d: d.id)), ('all',)),
                          PartitionSpec()))
  return jax.jit(lambda x: x, out_shardings=target)(array)


def on_this_host():
  """A context whose arrays (a host task's jnp.asarray) lie on this process's first device, not
  over the caller's mesh: with split devices across processes, a mesh of another process's
  devices would leave this one no shard of what it computed."""
  return jax.set_mesh(jax.sharding.Mesh(np.asarray(jax.local_devices()[:1]), ('host',)))


def owned_groups(array: jax.Array, group_size: int) -> np.ndarray:
  """The groups (runs of `group_size` rows along axis 0) of `array` this process works on: each
  group goes to exactly one process that holds all of its rows, spread round-robin over the
  processes that do (a replicated array splits evenly; a row-sharded one stays where it lies)."""
  rows = array.shape[0]
  groups = rows // group_size
  held = {}
  for device, index in array.sharding.devices_indices_map(array.shape).items():
    mask = held.setdefault(device.process_index, np.zeros(rows, bool))
    mask[index[0] if index else slice(None)] = True
  holders = [[process for process in sorted(held) if held[process][g * group_size:(g + 1) * group_size].all()]
             for g in range(groups)]
  if not all(holders):
    split = next(g for g, found in enumerate(holders) if not found)
    raise UserError(f'group {split} of the rollout ({group_size} rows) is split over processes by the mesh layout; '
                    'make rollout.prompts_per_step a multiple of the number of processes')
  return np.asarray([g for g, found in enumerate(holders) if found[g % len(found)] == jax.process_index()], np.int64)


def local_rows(array, rows: np.ndarray) -> np.ndarray:
  """Rows `rows` (along axis 0) of `array`, read from this process's own shards only."""
  if not isinstance(array, jax.Array) or array.is_fully_addressable:
    return np.asarray(array)[rows]
  out = np.empty((len(rows), *array.shape[1:]), array.dtype)
  filled = np.zeros(len(rows), bool)
  for shard in array.addressable_shards:
    index = shard.index
    if any(part != slice(None) and part.indices(size) != (0, size, 1) for part, size in zip(index[1:], array.shape[1:])):
      raise ValueError(f'local_rows: a shard of shape {shard.data.shape} splits more than the rows')
    start, stop, _ = index[0].indices(array.shape[0]) if index else (0, array.shape[0], 1)
    wanted = ~filled & (rows >= start) & (rows < stop)
    if wanted.any():
      out[wanted] = np.asarray(shard.data)[rows[wanted] - start]
      filled |= wanted
  if not filled.all():
    raise ValueError(f'local_rows: rows {rows[~filled][:4].tolist()} are not on this process')
  return out


def sum_over_processes(tree):
  """Each leaf summed over all processes (a host all-gather; the tree itself on one process)."""
  if jax.process_count() == 1:
    return tree
  gathered = multihost_utils.process_allgather(tree)
  return jax.tree.map(lambda leaf: np.asarray(leaf).sum(axis=0, dtype=np.asarray(leaf).dtype), gathered)
