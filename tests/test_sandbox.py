"""Containment of model-written code (grpo_jax/sandbox.py): each escape a policy could try is run
inside the sandbox and shown to fail, with the trainer (this process) and its files unaffected.
Network escapes aim only at a listener this test opens on the host's 127.0.0.1."""

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from grpo_jax import sandbox as sandbox_lib
from grpo_jax.sandbox import Limits, Sandbox, SandboxUnavailable

pytestmark = pytest.mark.xdist_group('test_sandbox')  # a trainer that is not root shares its uid's process count

LIMITS = Limits(timeout_s=8.0, cpu_s=8, processes=16, tmp_bytes=8 << 20, file_bytes=4 << 20, memory_bytes=1 << 30)


@pytest.fixture(scope='module')
def box():
  return Sandbox(LIMITS)


def run(box, code: str, **names):
  """The sandbox's Result for `code`, with `names` as literals in front of it."""
  prelude = ''.join(f'{name} = {value!r}\n' for name, value in names.items())
  return box.run(prelude + textwrap.dedent(code))


def processes_matching(text: str) -> list[int]:
  """Host pids whose command line holds `text`."""
  found = []
  for name in os.listdir('/proc'):
    if name.isdigit():
      try:
        with open(f'/proc/{name}/cmdline', 'rb') as f:
          if text.encode() in f.read().replace(b'\0', b' '):
            found.append(int(name))
      except OSError:
        pass
  return found


def processes_of(uid: int) -> list[int]:
  found = []
  for name in os.listdir('/proc'):
    try:
      with open(f'/proc/{name}/status') as f:
        if any(line.startswith('Uid:') and int(line.split()[1]) == uid for line in f):
          found.append(int(name))
    except (OSError, ValueError):
      pass
  return found


def test_no_variable_and_no_process_of_the_trainer_is_visible(box, monkeypatch):
  secret = f'hf_{os.urandom(8).hex()}'
  monkeypatch.setenv('HF_TOKEN', secret)
  result = run(box, '''
      import os
      print(sorted(os.environ))
      print(os.getuid(), os.geteuid(), os.getgid(), os.getegid(), os.getgroups())
      print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))
      for path in (f'/proc/{trainer}/environ', '/proc/1/environ'):
        try:
          print(path, open(path, 'rb').read())
        except OSError as error:
          print(path, type(error).__name__)
      ''', trainer=os.getpid())
  assert result.returncode == 0, result.output
  # Only the sandbox's own variables; never root (its own uid when the trainer is root); a PID
  # namespace holding bwrap's init and the call; the trainer's environment not there to read
  # (bwrap's init: root's where the trainer is root, else the user's own, started with nothing in it).
  uid = sandbox_lib.UID_BASE + os.getpid() * sandbox_lib.CALLS_PER_PROCESS if os.geteuid() == 0 else os.getuid()
  gid = uid if os.geteuid() == 0 else os.getgid()
  assert result.output.splitlines() == [
      "['HOME', 'LANG', 'PATH', 'PWD', 'PYTHONDONTWRITEBYTECODE']", f'{uid} {uid} {gid} {gid} []', '[1, 2]',
      f'/proc/{os.getpid()}/environ FileNotFoundError',
      '/proc/1/environ PermissionError' if os.geteuid() == 0 else "/proc/1/environ b''"]
  assert uid != 0
  assert secret not in result.output


def test_no_file_of_the_trainer_is_readable_or_writable(box, tmp_path):
  token = tmp_path / 'token'
  token.write_text('secret-token')
  checkpoint = tmp_path / 'checkpoints' / '7'
  checkpoint.mkdir(parents=True)
  (checkpoint / 'meta.json').write_text('{}')
  site = box.paths[0]
  result = run(box, '''
      import os
      for path in (token, checkpoint, readme, '/etc/passwd', '/etc/shadow', os.path.expanduser('~root') + '/.ssh',
                   '/root/.cache/huggingface/token'):
        try:
          print(path, 'READ', open(path).read()[:20] if os.path.isfile(path) else os.listdir(path))
        except OSError as error:
          print(path, type(error).__name__)
      os.symlink(token, '/tmp/link')  # a link resolves inside the sandbox
      try:
        print('link READ', open('/tmp/link').read())
      except OSError as error:
        print('link', type(error).__name__)
      for path in ('/usr/evil', site + '/evil.py', '/evil', str(checkpoint) + '/evil'):
        try:
          open(path, 'w').write('x')
          print(path, 'WROTE')
        except OSError as error:
          print(path, type(error).__name__)
      ''', token=str(token), checkpoint=str(checkpoint), readme=os.path.abspath(__file__), site=site)
  assert result.returncode == 0, result.output
  assert 'READ' not in result.output and 'WROTE' not in result.output, result.output
  assert 'secret-token' not in result.output
  assert token.read_text() == 'secret-token' and sorted(os.listdir(checkpoint)) == ['meta.json']
  assert not os.path.exists(os.path.join(site, 'evil.py')) and not os.path.exists('/usr/evil')


def test_the_network_is_its_own_loopback(box):
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
    listener.bind(('127.0.0.1', 0))
    listener.listen(4)
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    result = run(box, '''
        import _socket, socket
        for address in (('127.0.0.1', port), ('10.1.2.3', 80)):
          for make in (lambda: _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM), socket.socket):
            s = make()
            s.settimeout(2)
            try:
              s.connect(address)
              print(address, 'CONNECTED')
            except OSError as error:
              print(address, type(error).__name__, error.errno)
        ''', port=port)
    with pytest.raises(socket.timeout):
      listener.accept()  # nothing reached the host's listener
  assert result.returncode == 0, result.output
  assert 'CONNECTED' not in result.output
  # The sandbox's own loopback, with nothing listening on it; no route anywhere else.
  assert result.output.splitlines() == [f"('127.0.0.1', {port}) ConnectionRefusedError 111"] * 2 + \
      ["('10.1.2.3', 80) OSError 101"] * 2


def test_signals_reach_no_process_of_the_trainer(box):
  sentinel = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])
  try:
    result = run(box, '''
        import ctypes, os, signal
        libc = ctypes.CDLL(None, use_errno=True)
        for pid in (trainer, sentinel, -1):
          print(pid, libc.kill(pid, signal.SIGKILL), ctypes.get_errno())
        try:
          os.kill(sentinel, signal.SIGKILL)
        except OSError as error:
          print('os.kill', type(error).__name__)
        ''', trainer=os.getpid(), sentinel=sentinel.pid)
    time.sleep(0.2)
    assert sentinel.poll() is None, 'the sandbox killed a process of the trainer'
    assert 'os.kill ProcessLookupError' in result.output
  finally:
    sentinel.kill()
    sentinel.wait()


def test_nothing_it_starts_outlives_the_call_or_reaches_the_next(box):
  marker = f'{time.time() % 1000:.6f}'
  result = run(box, '''
      import os, subprocess
      subprocess.Popen(['/bin/sleep', marker], start_new_session=True)
      if os.fork() == 0:  # a daemon, double-forked
        os.setsid()
        if os.fork() == 0:
          os.execv('/bin/sleep', ['/bin/sleep', marker])
        os._exit(0)
      open('/tmp/note', 'w').write('left behind')
      print('started')
      ''', marker=marker)
  assert result.output.strip() == 'started', result.output
  deadline = time.monotonic() + 5
  while processes_matching(f'sleep {marker}') and time.monotonic() < deadline:
    time.sleep(0.05)
  assert processes_matching(f'sleep {marker}') == []
  after = run(box, '''
      import os
      print(os.listdir('/tmp'), os.path.exists('/tmp/note'))
      ''')
  assert after.output.strip() == '[] False'


# A fork flood: children that sleep `hold` s, until fork fails; prints "uid forks N Error", then
# lingers `linger` s holding them.
FLOOD = '''
    import os, time
    children = 0
    try:
      while True:
        if os.fork() == 0:
          time.sleep(hold)
          os._exit(0)
        children += 1
    except OSError as error:
      print(os.getuid(), 'forks', children, type(error).__name__)
    time.sleep(linger)
    '''


def test_floods_are_bounded_and_the_host_is_unaffected(box):
  start = time.monotonic()
  forks = run(box, FLOOD, hold=30, linger=0)
  assert time.monotonic() - start < LIMITS.timeout_s + 3
  assert 'forks' in forks.output and 'BlockingIOError' in forks.output, forks.output
  assert int(forks.output.split()[2]) < LIMITS.processes
  if os.geteuid() == 0:  # the call's uid holds no process once the call is over
    time.sleep(0.2)
    assert processes_of(sandbox_lib.UID_BASE + os.getpid() * sandbox_lib.CALLS_PER_PROCESS) == []
  # A file stops at the file-size limit (EFBIG), the private /tmp at its size (ENOSPC).
  disk = run(box, '''
      for name, megabytes in (('/tmp/big', 6), ('/tmp/a', 3), ('/tmp/b', 3)):
        try:
          with open(name, 'wb') as f:
            for _ in range(megabytes):
              f.write(b'x' * (1 << 20))
          print(name, 'written')
        except OSError as error:
          print(name, error.errno)
      ''')
  assert disk.output.splitlines() == ['/tmp/big 27', '/tmp/a written', '/tmp/b 28']
  memory = run(box, 'x = bytearray(4 << 30)')
  assert memory.failed and 'MemoryError' in memory.output
  cpu = Sandbox(Limits(timeout_s=20.0, cpu_s=1))
  start = time.monotonic()
  spin = cpu.python('while True:\n  pass')
  assert spin[1] and 'stopped' in spin[0] and time.monotonic() - start < 10


def test_a_flood_stops_at_its_process_limit_whatever_else_its_user_runs(box):
  """The process-limit arithmetic: the call's code and its children are `processes` at most (its
  cgroup's, or the rlimit's without one), however many processes the trainer's uid holds besides
  (a trainer that is not root shares its uid with the sandbox)."""
  if os.geteuid() != 0 and not sandbox_lib.USER_NAMESPACE_COUNTS:
    pytest.skip('before Linux 5.14 an unprivileged sandbox shares its process count with its uid')
  expected = LIMITS.processes if box.hierarchy is not None else sandbox_lib.split(LIMITS.memory_bytes,
                                                                                  LIMITS.processes)[1]
  sleepers = [subprocess.Popen(['/bin/sleep', '30']) for _ in range(6)]
  try:
    forks = run(box, FLOOD, hold=5, linger=0)
  finally:
    for sleeper in sleepers:
      sleeper.kill()
      sleeper.wait()
  assert forks.output.split()[1:] == ['forks', str(expected - 1), 'BlockingIOError'], forks.output


# One call's tree asking for more than its budget together: six children each holding 200 MB, which
# one process's limit allows (each process names itself `marker`: the host's sampler finds them).
SIX_CHILDREN = '''
    import ctypes, os, time
    ctypes.CDLL(None).prctl(15, marker.encode())  # PR_SET_NAME
    children, refused = [], None
    for _ in range(6):
      try:
        pid = os.fork()
      except OSError as error:  # the children started so far still take their memory
        refused = error
        break
      if pid == 0:
        held = b'x' * (200 << 20)
        time.sleep(hold)
        os._exit(0)
      children.append(pid)
    print(sorted(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children))
    if refused:
      raise refused
    '''
BUDGET = 512 << 20


class TreeMemory:
  """The most memory a call's processes (those named `marker`) held at once, sampled from the host
  every 10 ms: the sum of their proportional set sizes (a page shared after fork counted once) where
  no cgroup measures the tree."""

  def __init__(self, marker: str):
    import threading
    self.marker, self.peak, self._done = marker, 0, threading.Event()
    self._thread = threading.Thread(target=self._sample, daemon=True)
    self._thread.start()

  def _sample(self):
    while not self._done.wait(0.01):
      total = 0
      for name in os.listdir('/proc'):
        try:
          with open(f'/proc/{name}/comm') as f:
            if f.read().strip() != self.marker:
              continue
          with open(f'/proc/{name}/smaps_rollup') as f:
            total += next(int(line.split()[1]) << 10 for line in f if line.startswith('Pss:'))
        except (OSError, StopIteration, ValueError):
          pass
      self.peak = max(self.peak, total)

  def stop(self) -> int:
    self._done.set()
    self._thread.join()
    return self.peak


@pytest.fixture(params=['cgroup', 'rlimits'])
def bounded_box(request, monkeypatch):
  """A sandbox of BUDGET bytes for a call's processes together, held by a cgroup per call or, with
  making one refused (as a trainer neither root nor delegated a subtree is), by the rlimits."""
  if request.param == 'rlimits':
    mkdir = os.mkdir

    def refuse(path, *args, **kwargs):
      if str(path).startswith(sandbox_lib.cgroups.ROOT):
        raise PermissionError(13, 'Permission denied', str(path))
      return mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, 'mkdir', refuse)
  bounded = Sandbox(Limits(timeout_s=15.0, cpu_s=15, processes=16, memory_bytes=BUDGET))
  if request.param == 'cgroup' and bounded.hierarchy is None:
    pytest.skip(bounded.memory_bound)
  assert (bounded.hierarchy is None) == (request.param == 'rlimits')
  return bounded


def test_a_calls_processes_hold_its_memory_budget_together(bounded_box):
  """Six children each taking 200 MB (1.2 GB at once unbounded) are stopped within the budget, the
  answer says so, and the next call runs as usual; so does a single process asking for more."""
  marker = f'six{os.getpid() % 1_000_000}'
  sampler = TreeMemory(marker)
  result = run(bounded_box, SIX_CHILDREN, marker=marker, hold=1.5)
  sampled = sampler.stop()
  text, failed = bounded_box.answer(result)
  assert failed and sampled > 200 << 20, (sampled, text)  # the sampler saw at least one child's 200 MB
  if bounded_box.hierarchy is not None:  # the kernel killed some at the cgroup's bound, its peak the tree's
    # (the host's sampler reads one process after another, so it may add a child killed meanwhile to the next)
    assert 0 < result.peak_bytes <= BUDGET and result.memory_killed >= 1, result
    assert text.endswith(f'error: the python call\'s processes passed its 512 MiB memory limit together '
                         f'({result.memory_killed} killed)'), text
  else:  # two processes of 256 MiB each: the second child cannot start
    assert sampled <= BUDGET and (result.peak_bytes, result.memory_killed) == (0, 0), (sampled, result)
    assert text == '[0]\nBlockingIOError: [Errno 11] Resource temporarily unavailable', text
  assert bounded_box.python('x = b"x" * (600 << 20)') == ('MemoryError:', True)
  assert bounded_box.python('print(6 * 7)') == ('42', False)


def test_check_says_what_bounds_a_calls_memory(bounded_box):
  said = sandbox_lib.check(bounded_box.limits)
  assert '\n' not in said and said.startswith("a call's processes hold 512 MiB together: ")
  if bounded_box.hierarchy is not None:
    assert f'a cgroup v{bounded_box.hierarchy.version} per call' in said
  else:
    assert 'no cgroup can be made here (Permission denied' in said
    assert said.endswith('so each of its at most 2 processes gets 256 MiB of address space')
  assert sandbox_lib.split(BUDGET, 16) == (256 << 20, 2) and sandbox_lib.split(100 << 20, 16) == (100 << 20, 1)
  assert sandbox_lib.split(8 << 30, 16) == (512 << 20, 16)


@pytest.mark.skipif(os.geteuid() != 0, reason='calls get uids of their own only where the trainer is root')
def test_a_flood_in_one_call_leaves_a_call_beside_it_its_processes(box):
  """Two calls at once (an environment's threads): the first holds every process its limit allows,
  the second still starts its own, as a uid of its own."""
  import concurrent.futures
  beside = '''
      import os, subprocess
      children = [subprocess.Popen(['/bin/true']) for _ in range(8)]
      print(os.getuid(), 'started', sum(child.wait() == 0 for child in children))
      '''
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    first = pool.submit(run, box, FLOOD, hold=4, linger=3)
    time.sleep(1.5)
    second = pool.submit(run, box, beside)
    first, second = first.result().output.split(), second.result().output.split()
  assert first[1:] == ['forks', str(int(first[2])), 'BlockingIOError'] and int(first[2]) >= LIMITS.processes - 4
  assert second[1:] == ['started', '8'], second
  assert first[0] != second[0] and int(second[0]) >= sandbox_lib.UID_BASE


def test_one_line_when_the_sandbox_cannot_start(monkeypatch, tmp_path):
  monkeypatch.setattr(sandbox_lib, 'bwrap', lambda: None)
  with pytest.raises(SandboxUnavailable) as error:
    sandbox_lib.check()
  assert 'bubblewrap (bwrap) is not installed' in str(error.value) and 'task.sandbox: none' in str(error.value)
  monkeypatch.undo()
  # A bwrap that cannot make namespaces (a container without them, AppArmor's restriction).
  fake = tmp_path / 'bwrap'
  fake.write_text('#!/bin/sh\necho "bwrap: No permissions to create a new namespace, likely because the kernel '
                  'does not allow non-privileged user namespaces." >&2\nexit 1\n')
  fake.chmod(0o755)
  monkeypatch.setenv('PATH', f'{tmp_path}:{os.environ["PATH"]}')
  with pytest.raises(SandboxUnavailable) as error:
    sandbox_lib.check()
  message = str(error.value)
  assert '\n' not in message and 'No permissions to create a new namespace' in message
  assert 'user.max_user_namespaces' in message and 'task.sandbox: none' in message


def test_the_sandbox_dies_with_its_caller(tmp_path):
  """A caller killed with -9 (the trainer or its tool worker, pre-empted) takes the sandbox's whole
  tree with it."""
  marker = f'{time.time() % 1000:.6f}'
  caller = subprocess.Popen([sys.executable, '-c', textwrap.dedent(f'''
      from grpo_jax.sandbox import Sandbox, Limits
      Sandbox(Limits(timeout_s=60.0, cpu_s=60)).run("import subprocess\\nsubprocess.Popen(['/bin/sleep', '{marker}'], "
                                                    "start_new_session=True)\\nimport time\\ntime.sleep(60)")
      ''')], env=dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
  deadline = time.monotonic() + 30
  while not processes_matching(f'sleep {marker}') and time.monotonic() < deadline:
    time.sleep(0.05)
  assert processes_matching(f'sleep {marker}'), 'the sandboxed call never started'
  caller.kill()
  caller.wait()
  deadline = time.monotonic() + 5
  while processes_matching(f'sleep {marker}') and time.monotonic() < deadline:
    time.sleep(0.05)
  assert processes_matching(f'sleep {marker}') == []
  # The call's cgroup, left behind by its killed caller, goes when a sandbox is next made (once its
  # last processes are reaped).
  hierarchy, deadline = Sandbox(LIMITS).hierarchy, time.monotonic() + 5
  name = f'{sandbox_lib.cgroups.NAME}-{caller.pid}-'
  while hierarchy is not None and [entry for directory in {hierarchy.memory, hierarchy.pids} - {None}
                                   for entry in os.listdir(directory) if entry.startswith(name)]:
    assert time.monotonic() < deadline, f'the cgroup of a call whose caller died is still there: {name}*'
    time.sleep(0.1)
    Sandbox(LIMITS)


@pytest.mark.parametrize('code', ['print(6 * 7)', 'import sys\nprint("a"); print("b", file=sys.stderr)',
                                  'print(1)\n1 / 0', 'raise SystemExit(0)', 'print("x" * 100_000)',
                                  'import math, fractions\nprint(math.comb(30, 7), fractions.Fraction(3, 9))'])
def test_a_benign_call_answers_as_it_does_unsandboxed(box, code):
  from grpo_jax.agents import tools
  assert box.python(code) == tools._python(code)


# The tests of this file run again as an unprivileged user (the path a trainer that is not root
# takes: its own uid in a user namespace, no cgroup of its own); where the suite runs as root.
NOBODY = 65534
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readable_view() -> list[str]:
  """bwrap's arguments (run as root) for the host as it is, but with what the run needs within the
  unprivileged user's reach: each directory above the checkout or the interpreter it may not pass
  (a clone in /root, an interpreter under ~/.pyenv) becomes an empty tmpfs it may, with those
  bound back in. The run writes only to /tmp."""
  import sysconfig
  needed = {os.path.realpath(path) for path in (ROOT, sys.prefix, sys.base_prefix, sys.exec_prefix,
                                                 *sysconfig.get_paths().values()) if os.path.isdir(path)}
  closed = sorted({parent for path in needed for parent in sandbox_lib._parents(path + '/')
                   if not os.stat(parent).st_mode & 0o001})  # o+x: what a user of no group may pass
  closed = [path for path in closed if not any(path.startswith(other + '/') for other in closed)]
  args = ['--dev-bind', '/', '/']
  for path in closed:
    args += ['--perms', '0755', '--tmpfs', path]
  made = set(closed)
  for path in sorted(needed):
    if any(path.startswith(other + '/') for other in closed) and not any(path.startswith(other + '/') for other in needed):
      for parent in sandbox_lib._parents(path):  # bwrap would make them 0700
        if parent not in made and any(parent.startswith(other + '/') for other in closed):
          args += ['--perms', '0755', '--dir', parent]
          made.add(parent)
      args += ['--ro-bind', path, path]
  return args


def as_nobody(*pytest_args: str) -> subprocess.CompletedProcess:
  """This file's tests selected by `pytest_args`, run as nobody (no conftest: the sandbox needs none)."""
  command = [sandbox_lib.bwrap(), *readable_view(), '--', '/usr/bin/setpriv', f'--reuid={NOBODY}',
             f'--regid={NOBODY}', '--clear-groups', sys.executable, '-m', 'pytest', os.path.abspath(__file__),
             '--noconftest', '-p', 'no:cacheprovider', '-p', 'no:randomly', '-q', '-rs', *pytest_args]
  env = {'PATH': os.environ.get('PATH', '/usr/bin:/bin'), 'HOME': '/tmp', 'LANG': 'C.UTF-8', 'PYTHONPATH': ROOT,
         'PYTHONDONTWRITEBYTECODE': '1'}
  return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd='/tmp')


@pytest.mark.skipif(os.geteuid() != 0, reason='switching to an unprivileged user needs root')
def test_every_sandbox_test_passes_as_an_unprivileged_user():
  """The path of a trainer that is not root, proven beside root's: the process limit's arithmetic
  in a user namespace, the memory budget without a cgroup, every escape held."""
  done = as_nobody()
  assert done.returncode == 0 and ' passed' in done.stdout, done.stdout[-3000:] + done.stderr[-2000:]
