"""A process tree held in a cgroup of its own: its memory (every process's pages, its tmpfs files
and the kernel's memory for it) and its process count bounded together, its peak and the processes
the kernel killed at the bound read back when it is over. The sandbox (sandbox.py) puts each call
in one.

Either cgroup version: v2 (one hierarchy: memory.max, pids.max; memory.peak, memory.events) or v1
(a hierarchy per controller: memory.limit_in_bytes and memory.memsw.limit_in_bytes, pids.max;
memory.max_usage_in_bytes, memory.oom_control), whichever holds the memory controller for this
process. A tree's cgroup is made inside this process's own (/proc/self/cgroup), which only root or
a user the subtree is delegated to (its directory writable by that user) may do; `find()` tries
once and says why not otherwise, and the caller bounds the tree another way.

A process enters its tree's cgroup by writing its pid to the cgroup's `cgroup.procs` before it
executes what the tree runs (`Tree.enter` prefixes a command with the shell that does it), so
everything the command forks starts inside.
"""

import contextlib
import dataclasses
import errno
import itertools
import os
import signal
import threading
import time

ROOT = '/sys/fs/cgroup'
NAME = 'grpo_jax-sandbox'  # a tree's cgroup: NAME-<this process's pid>-<a counter>
REMOVE_TIMEOUT_S = 2.0  # a tree's last processes can take a moment to be reaped once its first is gone
# The first process of a tree: writes its pid into each cgroup named before `--`, then becomes the command.
ENTER = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'


@dataclasses.dataclass(frozen=True)
class Hierarchy:
  """Where trees' cgroups are made: `memory` and `pids` are the directories of this process's own
  cgroup in the hierarchies holding those controllers (the same one in v2; `pids` None where no
  hierarchy holds it)."""

  version: int
  memory: str
  pids: str | None

  def describe(self) -> str:
    held = 'memory and processes' if self.pids else 'memory'
    return f'a cgroup v{self.version} per call ({held}, under {self.memory})'


def _mounts(mountinfo: str = '/proc/self/mountinfo') -> list[tuple[str, str, str, set[str]]]:
  """(mount point, the hierarchy's path mounted there, 'cgroup' or 'cgroup2', its controllers v1)."""
  found = []
  with open(mountinfo) as f:
    for line in f:
      fields = line.split()
      kind = fields[fields.index('-') + 1]
      if kind in ('cgroup', 'cgroup2'):
        options = set(fields[fields.index('-') + 3].split(','))
        found.append((fields[4], fields[3], kind, options))
  return found


def _own() -> dict[str, str]:
  """This process's cgroup path per controller ('' for the v2 hierarchy)."""
  paths = {}
  with open('/proc/self/cgroup') as f:
    for line in f:
      _, controllers, path = line.rstrip('\n').split(':', 2)
      for controller in controllers.split(',') if controllers else ['']:
        paths[controller] = path
  return paths


def _directory(mount_point: str, mount_root: str, path: str) -> str | None:
  """The directory of cgroup `path` where its hierarchy is mounted from `mount_root`, if visible."""
  if mount_root != '/' and not (path == mount_root or path.startswith(mount_root + '/')):
    return None
  inside = path[len(mount_root):] if mount_root != '/' else path
  return os.path.join(mount_point, inside.lstrip('/')).rstrip('/')


def _read(path: str) -> str:
  with open(path) as f:
    return f.read()


def _write(path: str, value: str) -> None:
  with open(path, 'w') as f:
    f.write(value)


def _locate() -> Hierarchy:
  """The hierarchy holding this process's memory controller (v2 first); OSError saying why none."""
  own, mounts = _own(), _mounts()
  for point, root, kind, _ in mounts:
    if kind == 'cgroup2' and '' in own:
      directory = _directory(point, root, own[''])
      available = _read(os.path.join(directory, 'cgroup.controllers')).split() if directory else []
      if 'memory' in available:
        enabled = _read(os.path.join(directory, 'cgroup.subtree_control')).split()
        wanted = [name for name in ('memory', 'pids') if name in available and name not in enabled]
        if wanted:  # refused where this cgroup holds processes itself (v2's rule for inner cgroups)
          _write(os.path.join(directory, 'cgroup.subtree_control'), ' '.join('+' + name for name in wanted))
        pids = 'pids' in _read(os.path.join(directory, 'cgroup.subtree_control')).split()
        return Hierarchy(2, directory, directory if pids else None)
  directories = {}
  for point, root, kind, options in mounts:
    for controller in ('memory', 'pids'):
      if kind == 'cgroup' and controller in options and controller in own and controller not in directories:
        directories[controller] = _directory(point, root, own[controller])
  if not directories.get('memory'):
    raise OSError('no cgroup hierarchy here holds the memory controller for this process')
  return Hierarchy(1, directories['memory'], directories.get('pids'))


def find() -> tuple[Hierarchy | None, str]:
  """Where this process may make trees' cgroups, tried by making one; else None and why not.
  The cgroups a process that died mid-call left behind (a tool worker killed at its deadline, a
  trainer killed) go first."""
  try:
    hierarchy = _locate()
    _remove_orphans(hierarchy)
    Tree(hierarchy, 1 << 20, 1).remove()
  except OSError as error:
    return None, f'{error.strerror or error}' + (f' ({error.filename})' if error.filename else '')
  return hierarchy, hierarchy.describe()


def _remove_orphans(hierarchy: Hierarchy) -> None:
  """Removes the trees' cgroups whose process (the pid in their name) is gone; their trees died
  with it (bwrap's --die-with-parent), so they are empty or about to be."""
  for parent in dict.fromkeys(filter(None, (hierarchy.memory, hierarchy.pids))):
    for entry in os.listdir(parent):
      if not entry.startswith(NAME + '-'):
        continue
      try:
        os.kill(int(entry.split('-')[-2]), 0)
      except ProcessLookupError:
        with contextlib.suppress(OSError):  # once: still busy, or another user's, it waits for the next
          os.rmdir(os.path.join(parent, entry))
      except (ValueError, OSError):  # not a name of ours, or a live process of another user
        pass


_counter = itertools.count()
_counter_lock = threading.Lock()


class Tree:
  """One tree's cgroup (in each hierarchy of `hierarchy`), its memory bounded at `memory_bytes`
  and its processes at `processes`; made on construction (OSError where it cannot be)."""

  def __init__(self, hierarchy: Hierarchy, memory_bytes: int, processes: int):
    with _counter_lock:
      name = f'{NAME}-{os.getpid()}-{next(_counter)}'
    self.version = hierarchy.version
    self.directories = [os.path.join(hierarchy.memory, name)]
    if hierarchy.pids and hierarchy.pids != hierarchy.memory:
      self.directories.append(os.path.join(hierarchy.pids, name))
    made = []
    try:
      for directory in self.directories:
        os.mkdir(directory)
        made.append(directory)
      memory = self.directories[0]
      if self.version == 2:
        _write(os.path.join(memory, 'memory.max'), str(memory_bytes))
        if os.path.exists(os.path.join(memory, 'memory.swap.max')):
          _write(os.path.join(memory, 'memory.swap.max'), '0')
      else:  # memsw (memory and swap) may only be set at or above the memory limit, so after it
        _write(os.path.join(memory, 'memory.limit_in_bytes'), str(memory_bytes))
        if os.path.exists(os.path.join(memory, 'memory.memsw.limit_in_bytes')):
          _write(os.path.join(memory, 'memory.memsw.limit_in_bytes'), str(memory_bytes))
      if hierarchy.pids:
        _write(os.path.join(self.directories[-1], 'pids.max'), str(processes))
    except OSError:
      for directory in reversed(made):
        _remove(directory)
      raise

  def enter(self, command: list[str]) -> list[str]:
    """`command` started inside this cgroup (every hierarchy's)."""
    procs = [os.path.join(directory, 'cgroup.procs') for directory in self.directories]
    return ['/bin/sh', '-c', ENTER, 'cgroup', *procs, '--', *command]

  def peak_bytes(self) -> int:
    """The most memory the tree held at once (0 where the kernel does not say: v2 before 5.19)."""
    name = 'memory.peak' if self.version == 2 else 'memory.max_usage_in_bytes'
    try:
      return int(_read(os.path.join(self.directories[0], name)))
    except (OSError, ValueError):
      return 0

  def memory_kills(self) -> int:
    """The tree's processes the kernel killed at its memory bound."""
    name = 'memory.events' if self.version == 2 else 'memory.oom_control'
    try:
      fields = dict(line.split() for line in _read(os.path.join(self.directories[0], name)).splitlines())
      return int(fields.get('oom_kill', 0))
    except (OSError, ValueError):
      return 0

  def remove(self) -> None:
    """The cgroup gone, once its processes are (any left past REMOVE_TIMEOUT_S is killed)."""
    for directory in self.directories:
      _remove(directory)


def _remove(directory: str) -> None:
  """rmdir, waiting for the tree's last processes; past REMOVE_TIMEOUT_S they are killed, and past
  twice that the empty cgroup is left behind rather than the caller held."""
  start = time.monotonic()
  killed = False
  while True:
    try:
      os.rmdir(directory)
      return
    except FileNotFoundError:
      return
    except OSError as error:
      if error.errno != errno.EBUSY:  # not this process's to remove: left as it is
        return
      waited = time.monotonic() - start
      if waited > 2 * REMOVE_TIMEOUT_S:
        return
      if waited > REMOVE_TIMEOUT_S and not killed:
        killed = True
        try:
          for pid in _read(os.path.join(directory, 'cgroup.procs')).split():
            with contextlib.suppress(ProcessLookupError):
              os.kill(int(pid), signal.SIGKILL)
        except OSError:
          pass
      time.sleep(0.01)
