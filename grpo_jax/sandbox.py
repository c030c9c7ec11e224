"""Model-written code in an OS-level sandbox: every call in a fresh bubblewrap (`bwrap`) sandbox.

The policy's Python tool calls (agents/tool_use.py), and any custom environment's code that uses a
`Sandbox`, run as a new process tree that cannot reach the trainer:

- namespaces: PID, network (its own loopback only), mount, IPC, UTS and cgroup, all new; the tree
  ends with the call (bwrap's PID namespace dies with its first process) and with the trainer
  (`--die-with-parent`); `--new-session` keeps it off the terminal.
- files: a root of its own holding, read-only, /usr (and /bin, /lib... as the host links them),
  the loader's cache, the interpreter's prefix and the site-packages the interpreter imports
  from; a fresh /proc of its own PID namespace, a minimal /dev and a private tmpfs /tmp of
  `Limits.tmp_bytes` (its working directory and HOME). Not the trainer's files, checkpoints,
  home directory, tokens or keys; nothing one call writes is seen by the next.
- environment: empty (`--clearenv`), then PATH, HOME and LANG of its own.
- never uid 0: a trainer running as root starts bwrap privileged and the code runs as an
  unprivileged uid of its own call (from the calling process's pid and a per-process call index,
  so no two calls running at once on the host share one, and a fork flood in one call cannot
  starve another's processes: the process limit counts per uid), with no capabilities and
  no_new_privs; any other trainer runs it as its own uid in a new user namespace that cannot
  create further ones (`--disable-userns`). There the process limit counts the namespace's own
  processes (Linux 5.14 and newer; bwrap's init among them); an older kernel counts the uid's on
  the whole host, so the limit is the uid's count at the start plus `Limits.processes`, shared with
  whatever else that user starts meanwhile.
- memory: `Limits.memory_bytes` bounds the call's whole tree. Where this process may make a
  cgroup (grpo_jax/cgroups.py: v2 or v1, as root or in a subtree delegated to its user) each call
  runs in one of its own, which holds the tree's memory and its processes (pids.max); a single
  process also stops at that much address space (a MemoryError rather than the kernel's kill).
  Where none can be made, each process's address space is capped so that the cap times the
  processes the tree may hold is at most the budget: as many processes as get MIN_PROCESS_BYTES
  each, up to `Limits.processes`. `check()` says which bound is in force.
- limits: CPU seconds, address space, processes, file size, open files and core dumps (rlimits set
  before the model's code starts, hard and soft), the tmpfs size, and a wall-clock deadline after
  which the whole tree is killed. Output is read up to `Limits.output_chars`.

`check()` starts one sandbox and says in one line why it cannot (bwrap missing, user namespaces
off, AppArmor's restriction on them), or returns the line saying what bounds a call's memory; tool
use refuses to run without one unless the config says `task.sandbox: none`. The math reward's
answer checks (math-verify, which runs no model code) stay in their bounded worker pool.
"""

import contextlib
import dataclasses
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
import time

from grpo_jax import cgroups
from grpo_jax.errors import UserError

SANDBOXES = ('bwrap', 'none')
UID_BASE = 0x5A000  # 368640 and up: no login or system account's uid
# Linux 5.14 and newer count RLIMIT_NPROC per user namespace: the sandbox's namespace holds only its call's.
USER_NAMESPACE_COUNTS = tuple(map(int, re.match(r'(\d+)\.(\d+)', os.uname().release).groups())) >= (5, 14)
CALLS_PER_PROCESS = 256  # a process's calls at once, each its own uid: UID_BASE + pid * 256 + index
# Without a cgroup, the least address space a process of the tree gets (Python importing NumPy
# reaches 130 MB): a budget buys fewer processes rather than processes that cannot start.
MIN_PROCESS_BYTES = 256 << 20
BWRAP_PROCESSES = 2  # in a call's cgroup beside the model's: bwrap and the init of its PID namespace
INSTALL = ('install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; Fedora: dnf install bubblewrap), '
           'or set task.sandbox: none to run model-written code unsandboxed as the trainer\'s user')


@dataclasses.dataclass(frozen=True)
class Limits:
  """What one call may use: `timeout_s` of wall-clock time and `cpu_s` of CPU, `memory_bytes` for
  its processes together (the module's docstring says how it is held), `processes` at once, files
  up to `file_bytes` in a `tmp_bytes` tmpfs, `open_files` descriptors; `output_chars` of its output
  are kept."""

  timeout_s: float = 10.0
  cpu_s: int = 10
  memory_bytes: int = 1 << 30
  processes: int = 32
  file_bytes: int = 16 << 20
  tmp_bytes: int = 64 << 20
  open_files: int = 256
  output_chars: int = 1000


@dataclasses.dataclass(frozen=True)
class Result:
  """A call's output (stdout and stderr as one stream, cut to the limit), its exit status (negative:
  the signal that ended it), whether the deadline killed it, and, where a cgroup held it, how many
  of its processes the memory bound killed and the most memory the tree held at once."""

  output: str
  returncode: int
  timed_out: bool = False
  cut: int = 0  # characters of output past the limit
  memory_killed: int = 0
  peak_bytes: int = 0  # 0: no cgroup measured it

  @property
  def failed(self) -> bool:
    return self.timed_out or self.returncode != 0 or self.memory_killed > 0


# The first code the sandboxed interpreter runs: the limits (hard and soft, so the model's code cannot
# raise them), then the model's code from stdin as __main__; an exception ends it with its last line.
RUNNER = r'''
import resource, sys
for name, value in LIMITS:
  resource.setrlimit(getattr(resource, name), (value, value))
sys.path[:0] = PATHS
code = sys.stdin.read()
sys.stdin.close()
del name, value
try:
  exec(compile(code, '<tool>', 'exec'), {'__name__': '__main__', '__builtins__': __builtins__})
except SystemExit:
  raise
except BaseException as error:
  sys.stdout.flush()
  print(f'{type(error).__name__}: {str(error)[:200]}', file=sys.stderr)
  sys.exit(1)
'''


def bwrap() -> str | None:
  return shutil.which('bwrap')


def _interpreter() -> tuple[str, list[str], list[str]]:
  """(the interpreter to run, the directories it needs read-only, the import paths it adds): the
  base interpreter of this environment (a venv's python is a link to it), its prefix, and this
  environment's site-packages (installed packages only: an editable install's source is not there)."""
  executable = os.path.realpath(getattr(sys, '_base_executable', sys.executable))
  prefixes = {os.path.realpath(sys.base_prefix), os.path.realpath(sys.base_exec_prefix)}
  paths = [os.path.realpath(sysconfig.get_paths()[name]) for name in ('purelib', 'platlib')]
  paths = [path for path in dict.fromkeys(paths) if os.path.isdir(path)]
  return executable, sorted(prefixes), paths


def _parents(path: str) -> list[str]:
  parts = path.strip('/').split('/')[:-1]
  return ['/' + '/'.join(parts[:i + 1]) for i in range(len(parts))]


def _filesystem(directories) -> list[str]:
  """bwrap's arguments for the sandbox's root: the system's /usr and its links, the loader's cache,
  `directories` read-only at their own paths (parents made traversable), /proc, /dev, /tmp."""
  args = ['--ro-bind', '/usr', '/usr']
  for name in ('/bin', '/sbin', '/lib', '/lib32', '/lib64', '/libx32'):
    if os.path.islink(name):
      args += ['--symlink', os.readlink(name), name]
    elif os.path.isdir(name):
      args += ['--ro-bind', name, name]
  if os.path.isfile('/etc/ld.so.cache'):
    args += ['--ro-bind', '/etc/ld.so.cache', '/etc/ld.so.cache']
  made = {'/usr', '/etc', '/tmp', '/proc', '/dev'}
  for directory in sorted(set(directories)):
    if directory == '/usr' or directory.startswith('/usr/'):
      continue
    for parent in _parents(directory):
      if parent not in made:
        args += ['--perms', '0755', '--dir', parent]
        made.add(parent)
    args += ['--ro-bind', directory, directory]
  return args + ['--proc', '/proc', '--dev', '/dev']


class Sandbox:
  """Runs Python code, one fresh bwrap sandbox per call (the module's docstring says what it holds);
  calls from several threads at once each get their own uid when the trainer is root."""

  def __init__(self, limits: Limits = Limits()):
    self.limits = limits
    self.executable, prefixes, self.paths = _interpreter()
    self.root = os.geteuid() == 0
    self._args = ['--unshare-ipc', '--unshare-pid', '--unshare-net', '--unshare-uts', '--unshare-cgroup-try',
                  '--die-with-parent', '--new-session', '--clearenv',
                  '--setenv', 'PATH', '/usr/local/bin:/usr/bin:/bin', '--setenv', 'HOME', '/tmp',
                  '--setenv', 'LANG', 'C.UTF-8', '--setenv', 'PYTHONDONTWRITEBYTECODE', '1',
                  '--hostname', 'sandbox', *_filesystem([*prefixes, *self.paths]),
                  '--size', str(limits.tmp_bytes), '--perms', '01777', '--tmpfs', '/tmp', '--chdir', '/tmp',
                  # bwrap's root is a tmpfs of no size limit, the user's own where the trainer is not root
                  '--remount-ro', '/']
    if self.root:  # no user namespace (its uid map would hold only root): bwrap keeps what switching uid
      # needs, then setpriv drops it and every other capability
      self._args += ['--cap-drop', 'ALL', '--cap-add', 'CAP_SETUID', '--cap-add', 'CAP_SETGID']
    else:
      self._args += ['--unshare-user', '--disable-userns']
    self.hierarchy, said = cgroups.find()
    budget = _size(limits.memory_bytes)
    if self.hierarchy is not None:
      self.memory_bound = f'a call\'s processes hold {budget} together: {said}'
    else:
      each, processes = split(limits.memory_bytes, limits.processes)
      self.memory_bound = (f'a call\'s processes hold {budget} together: no cgroup can be made here ({said}), so '
                           f'each of its at most {processes} processes gets {_size(each)} of address space')

  def command(self, uid: int, processes: int, memory_bytes: int) -> list[str]:
    """The command line of one call as `uid` (switched to where the trainer is root), each process
    capped at `memory_bytes` of address space, the rlimit on processes `processes`."""
    limits = self.limits
    rlimits = [('RLIMIT_CPU', limits.cpu_s), ('RLIMIT_AS', memory_bytes), ('RLIMIT_NPROC', processes),
               ('RLIMIT_FSIZE', limits.file_bytes), ('RLIMIT_NOFILE', limits.open_files), ('RLIMIT_CORE', 0)]
    runner = RUNNER.replace('LIMITS', repr(rlimits)).replace('PATHS', repr(self.paths))
    python = [self.executable, '-I', '-S', '-B', '-u', '-c', runner]  # -u: output in the order written
    if self.root:
      python = ['/usr/bin/setpriv', f'--reuid={uid}', f'--regid={uid}', '--clear-groups',
                '--inh-caps=-all', '--bounding-set=-all', '--no-new-privs', '--', *python]
    return [bwrap() or 'bwrap', *self._args, *python]

  def run(self, code: str) -> Result:
    """Runs `code` in a new sandbox; blocking (an async environment awaits asyncio.to_thread)."""
    limits = self.limits
    with _call_uid() if self.root else _trainer_uid() as uid:
      tree = self._tree()
      try:
        if tree is not None:  # the cgroup holds the tree; a process alone may take the whole budget
          command = tree.enter(self.command(uid, self._process_limit(uid, limits.processes), limits.memory_bytes))
        else:
          each, processes = split(limits.memory_bytes, limits.processes)
          command = self.command(uid, self._process_limit(uid, processes), each)
        deadline = time.monotonic() + limits.timeout_s
        try:
          process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     env={}, start_new_session=True, close_fds=True)
        except OSError as error:
          raise SandboxUnavailable(f'the sandbox cannot start: {error.strerror or error}; {INSTALL}') from None
        result = self._finish(process, code, deadline)
        if tree is not None:
          result = dataclasses.replace(result, memory_killed=tree.memory_kills(), peak_bytes=tree.peak_bytes())
        return result
      finally:
        if tree is not None:
          tree.remove()

  def _tree(self) -> cgroups.Tree | None:
    """This call's cgroup; None where none can be made now (the rlimits alone bound the tree)."""
    if self.hierarchy is None:
      return None
    try:
      return cgroups.Tree(self.hierarchy, self.limits.memory_bytes, self.limits.processes + BWRAP_PROCESSES)
    except OSError:
      return None

  def _process_limit(self, uid: int, processes: int) -> int:
    """RLIMIT_NPROC for a tree of `processes`: the call's own uid counts them alone where the
    trainer is root; in bwrap's user namespace the kernel counts that namespace's (bwrap's init
    too) from Linux 5.14, and before it the uid's on the whole host."""
    if self.root:
      return processes
    return processes + 1 if USER_NAMESPACE_COUNTS else _tasks_of(uid) + processes

  def _finish(self, process, code: str, deadline: float) -> Result:
    """`code` given to the started `process`; its Result once its output closes or the deadline
    passes, its whole tree gone."""
    limits = self.limits
    try:
      try:
        process.stdin.write(code.encode('utf-8', 'replace'))
        process.stdin.close()
      except BrokenPipeError:  # it ended before reading (a setup failure): its output says why
        pass
      output, cut, timed_out = _read(process, deadline, limits.output_chars)
    finally:
      if process.poll() is None:
        _kill(process)
      process.wait()
    return Result(output, process.returncode, timed_out, cut)

  def python(self, code: str) -> tuple[str, bool]:
    """What the Python tool answers for `code`: `answer` of its Result."""
    return self.answer(self.run(code))

  def answer(self, result: Result) -> tuple[str, bool]:
    """What the Python tool answers for a call's Result: the code's output (and its exception's
    last line), a note of the characters cut, or why it was stopped; and whether it failed."""
    text = result.output.strip()
    if result.cut:
      text += f'\n... ({result.cut} more characters cut)'
    if result.timed_out:
      return f'error: the python call ran past its {self.limits.timeout_s:g} s limit', True
    if result.memory_killed:
      return (text + ('\n' if text else '') + f'error: the python call\'s processes passed its '
              f'{_size(self.limits.memory_bytes)} memory limit together ({result.memory_killed} killed)'), True
    number = -result.returncode if result.returncode < 0 else result.returncode - 128  # bwrap: 128 + the signal
    if number > 0 and number in signal.valid_signals():
      name = signal.Signals(number).name
      reason = {'SIGXCPU': f'past its {self.limits.cpu_s} s of CPU time', 'SIGKILL': 'killed'}.get(name, name)
      return (text + ('\n' if text else '') + f'error: the python process was stopped ({reason})').strip(), True
    return text, result.returncode != 0


def split(memory_bytes: int, processes: int) -> tuple[int, int]:
  """(each process's address space, the processes) of a tree bounded without a cgroup: their
  product at most `memory_bytes`, as many processes as get MIN_PROCESS_BYTES, up to `processes`."""
  count = max(1, min(processes, memory_bytes // MIN_PROCESS_BYTES))
  return memory_bytes // count, count


def _size(count: int) -> str:
  return f'{count / (1 << 30):g} GiB' if count >= 1 << 30 else f'{count / (1 << 20):g} MiB'


def _read(process, deadline: float, limit: int) -> tuple[str, int, bool]:
  """The process's output until it closes or the deadline: the first `limit` characters, the
  count of the rest (read and dropped, so a flood fills no memory), whether the deadline came."""
  kept, dropped = bytearray(), 0
  with selectors.DefaultSelector() as selector:
    selector.register(process.stdout, selectors.EVENT_READ)
    while True:
      left = deadline - time.monotonic()
      if left <= 0:
        return _text(kept, dropped, limit) + (True,)
      if not selector.select(timeout=min(left, 0.5)):
        continue
      chunk = os.read(process.stdout.fileno(), 65536)
      if not chunk:
        return _text(kept, dropped, limit) + (False,)
      room = 4 * limit - len(kept)  # bytes: UTF-8 holds a character in at most 4
      kept += chunk[:max(room, 0)]
      dropped += max(0, len(chunk) - max(room, 0))


def _text(kept: bytes, dropped: int, limit: int) -> tuple[str, int]:
  text = kept.decode('utf-8', 'replace')
  return text[:limit], max(0, len(text) - limit) + dropped


def _kill(process) -> None:
  """The whole tree: bwrap's session (its PID namespace then dies with its first process)."""
  try:
    os.killpg(process.pid, signal.SIGKILL)
  except ProcessLookupError:
    pass


_in_use: set[int] = set()  # this process's call indices now running
_in_use_lock = threading.Lock()


@contextlib.contextmanager
def _call_uid():
  """A uid no other call running now on the host holds: this process's pid and the lowest free
  index of its calls (pids are unique among live processes)."""
  with _in_use_lock:
    index = next((i for i in range(CALLS_PER_PROCESS) if i not in _in_use), None)
    if index is None:
      raise SandboxUnavailable(f'more than {CALLS_PER_PROCESS} sandboxed calls at once in one process')
    _in_use.add(index)
  try:
    yield UID_BASE + os.getpid() * CALLS_PER_PROCESS + index
  finally:
    with _in_use_lock:
      _in_use.discard(index)


@contextlib.contextmanager
def _trainer_uid():
  yield os.getuid()


def _tasks_of(uid: int) -> int:
  """Threads the kernel counts against `uid`'s process limit now (every process's, the trainer's
  included): a trainer that is not root shares its uid with the sandbox."""
  count = 0
  for name in os.listdir('/proc'):
    if not name.isdigit():
      continue
    try:
      with open(f'/proc/{name}/status') as f:
        status = dict(line.split(':', 1) for line in f if ':' in line)
    except OSError:
      continue
    if int(status.get('Uid', '-1').split()[0]) == uid:
      count += int(status.get('Threads', '1'))
  return count


class SandboxUnavailable(UserError):
  """The sandbox cannot start here: one line saying why and what to do."""


def check(limits: Limits = Limits()) -> str:
  """Starts one sandbox; SandboxUnavailable saying why when it cannot, else the line saying what
  bounds a call's memory here (a cgroup per call, or the rlimits without one)."""
  if bwrap() is None:
    raise SandboxUnavailable(f'task.sandbox: bwrap, but bubblewrap (bwrap) is not installed; {INSTALL}')
  if not os.path.isfile('/usr/bin/setpriv') and os.geteuid() == 0:
    raise SandboxUnavailable('task.sandbox: bwrap needs /usr/bin/setpriv (util-linux) to drop root in the sandbox; '
                             'install util-linux')
  box = Sandbox(limits)
  result = box.run('print("ok")')
  if result.returncode == 0 and result.output.strip() == 'ok':
    return box.memory_bound
  said = result.output.strip().splitlines()[-1] if result.output.strip() else f'exit status {result.returncode}'
  hint = ''
  if 'Unknown option' in said:
    hint = ' (this bubblewrap is too old: the sandbox needs 0.6 or newer, for --size and --disable-userns)'
  elif 'namespace' in said or 'uid map' in said or 'Operation not permitted' in said or 'Permission denied' in said:
    hint = (' (user namespaces are off or restricted here: sysctl user.max_user_namespaces must be above 0; '
            'kernel.unprivileged_userns_clone=1 on older Debian kernels; Ubuntu 24.04\'s AppArmor needs '
            'kernel.apparmor_restrict_unprivileged_userns=0 or a bwrap profile; in a container, run it with '
            'user namespaces allowed)')
  raise SandboxUnavailable(f'task.sandbox: bwrap cannot start a sandbox here: {said}{hint}; or set task.sandbox: '
                           'none to run model-written code unsandboxed')
