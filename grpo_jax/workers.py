"""Bounded worker processes: untrusted or fragile work (checking an answer with math-verify,
running a model's tool call) done outside the trainer's process, each item under a deadline and a
memory cap, by processes that die with the trainer.

`WorkerPool(workers, fn)` applies `fn(*args)` (a module-level function: it is sent to spawned
processes) in `workers` processes, one item per process at a time. Items are submitted from any
thread (`submit` returns a concurrent Future, `call` is its `async` form for environments, `map`
waits for a list) and a dispatcher thread hands them to free workers as they finish, so one slow
item never holds back the others. An item's result is `fn`'s return value, or a `Failed` saying
why there is none:
  - 'deadline': it outlived `timeout_s` (a loop in C, a sleep); its process is killed and replaced;
  - 'crashed': its process died (a segfault, os._exit);
  - 'raised': `fn` raised (MemoryError past the cap included); the worker goes on.
Each worker may grow by `memory_bytes` beyond what it holds after start-up (its address space is
capped), ignores Ctrl-C (the trainer's to handle) and ends as soon as the trainer dies, whatever it
is computing (kill -9 included). Before its first item a worker runs `setup()` and `fn(*warmup)`
(imports, grammars) under `start_timeout_s`; a worker that cannot start is one clear error.
"""

import asyncio
import atexit
import collections
import concurrent.futures
import ctypes
import dataclasses
import multiprocessing
import os
import resource
import signal
import sys
import threading
import time
from multiprocessing import connection
from typing import Any, Callable

from grpo_jax.errors import UserError

ITEM_TIMEOUT_S = 10.0
ITEM_MEMORY_BYTES = 2 << 30
START_TIMEOUT_S = 300.0
PR_SET_PDEATHSIG = 1  # linux/prctl.h


@dataclasses.dataclass(frozen=True)
class Failed:
  """Why an item has no result: 'deadline', 'crashed' or 'raised' (with the exception's line)."""

  reason: str
  detail: str = ''

  def __str__(self) -> str:
    return self.reason + (f': {self.detail}' if self.detail else '')


def _die_with_parent(parent_pid: int) -> None:
  """Ends this worker as soon as the trainer dies (kill -9, the OOM killer, pre-emption): the
  kernel's parent-death signal on Linux (it needs no Python thread, so work stuck in C holding the
  GIL dies too), and a watchdog thread on the parent's pid everywhere."""
  if sys.platform.startswith('linux'):
    try:
      ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
      pass
  if os.getppid() != parent_pid:  # the parent died before the signal was armed
    os._exit(1)

  def watch():
    while os.getppid() == parent_pid:
      time.sleep(1.0)
    os._exit(1)

  threading.Thread(target=watch, name='parent-watchdog', daemon=True).start()


def _limit_memory(extra_bytes: int) -> None:
  """Caps this process's address space at its current size plus `extra_bytes`: work that would
  build a huge number fails with MemoryError instead of taking the host's memory."""
  try:
    with open('/proc/self/statm') as f:
      current = int(f.read().split()[0]) * os.sysconf('SC_PAGE_SIZE')
    resource.setrlimit(resource.RLIMIT_AS, (current + extra_bytes, current + extra_bytes))
  except (OSError, ValueError):  # not Linux, or a hard limit already lower: keep what there is
    pass


def _serve(conn, fn, setup, warmup, parent_pid: int, memory_bytes: int) -> None:
  """A worker: set-up and warm-up, 'ready', then ('ok', result) or ('raised', line) per item."""
  _die_with_parent(parent_pid)
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  try:
    if setup is not None:
      setup()
    if warmup is not None:
      fn(*warmup)
  except ImportError as error:
    conn.send(('error', f'{type(error).__name__}: {error}'))
    return
  except Exception:
    pass  # a function that rejects the warm-up input can still do real items
  _limit_memory(memory_bytes)
  try:
    conn.send(('ready', None))
  except OSError:  # the pool was closed while this worker started (it never needed it)
    return
  while True:
    try:
      args = conn.recv()
    except (EOFError, OSError):  # the parent closed the pool or exited
      return
    try:
      result = fn(*args)
    except BaseException as error:  # noqa: BLE001 (MemoryError, SystemExit: the item's failure)
      conn.send(('raised', f'{type(error).__name__}: {str(error)[:200]}'))
      continue
    conn.send(('ok', result))


class _Worker:
  """One process, its end of the pipe, and the item it is working on (with its deadline)."""

  def __init__(self, pool: 'WorkerPool'):
    self.conn, child = pool._context.Pipe()
    self.process = pool._context.Process(
        target=_serve, args=(child, pool.fn, pool.setup, pool.warmup, os.getpid(), pool.memory_bytes),
        name=pool.name, daemon=True)
    self.process.start()
    child.close()
    self.ready = False
    self.item: tuple | None = None  # (args, future)
    self.deadline = time.monotonic() + pool.start_timeout_s

  @property
  def waiting(self) -> bool:
    return not self.ready or self.item is not None

  def stop(self) -> None:
    self.conn.close()
    self.process.kill()
    self.process.join(timeout=5)


class WorkerPool:
  """`workers` processes applying `fn(*args)`, each item within `timeout_s` and `memory_bytes`."""

  def __init__(self, workers: int, fn: Callable, *, warmup: tuple | None = None, setup: Callable | None = None,
               timeout_s: float = ITEM_TIMEOUT_S, memory_bytes: int = ITEM_MEMORY_BYTES,
               start_timeout_s: float = START_TIMEOUT_S, name: str = 'worker'):
    if workers < 1:
      raise ValueError(f'a worker pool needs at least one worker, got {workers}')
    # spawn, not fork: forking a process that runs JAX's threads can deadlock the child.
    self._context = multiprocessing.get_context('spawn')
    self.fn, self.setup, self.warmup, self.name = fn, setup, warmup, name
    self.timeout_s, self.memory_bytes, self.start_timeout_s = timeout_s, memory_bytes, start_timeout_s
    self.failures = 0  # items that came back Failed
    self._lock = threading.Lock()
    self._queue: collections.deque = collections.deque()
    self._broken: Exception | None = None
    self._closed = False
    self._wake_read, self._wake_write = self._context.Pipe(duplex=False)
    self._workers = [_Worker(self) for _ in range(workers)]
    self._thread = threading.Thread(target=self._dispatch, name=f'{name}-dispatcher', daemon=True)
    self._thread.start()
    atexit.register(self.close)

  # ---- submitting ----

  def submit(self, *args) -> concurrent.futures.Future:
    """The future result of fn(*args): its value or a Failed."""
    future = concurrent.futures.Future()
    with self._lock:
      if self._closed:
        raise RuntimeError(f'the {self.name} pool is closed')
      if self._broken is not None:
        raise self._broken
      self._queue.append((args, future))
    self._wake()
    return future

  async def call(self, *args) -> Any:
    """fn(*args) awaited from an event loop: other coroutines run while a worker computes."""
    return await asyncio.wrap_future(self.submit(*args))

  def map(self, items: list[tuple]) -> list:
    """fn(*args) for each args tuple of `items`, in order (values or Failed)."""
    return [future.result() for future in [self.submit(*args) for args in items]]

  def _wake(self) -> None:
    try:
      self._wake_write.send_bytes(b'.')
    except OSError:
      pass

  # ---- the dispatcher thread ----

  def _dispatch(self) -> None:
    try:
      while not self._closed:
        self._assign()
        waiting = [worker for worker in self._workers if worker.waiting]
        wait_s = max(0.0, min(worker.deadline for worker in waiting) - time.monotonic()) if waiting else None
        answered = connection.wait([self._wake_read] + [worker.conn for worker in waiting], timeout=wait_s)
        if self._wake_read in answered:
          while self._wake_read.poll():
            self._wake_read.recv_bytes()
        for worker in waiting:
          if worker.conn in answered:
            self._receive(worker)
        now = time.monotonic()
        for slot, worker in enumerate(self._workers):
          if worker.waiting and now > worker.deadline:
            if not worker.ready:
              raise UserError(f'a {self.name} process did not start within {self.start_timeout_s:.0f} s')
            self._finish(worker, Failed('deadline', f'past {self.timeout_s:g} s'))
            self._replace(slot)
    except Exception as error:  # noqa: BLE001 (every pending item learns why)
      if self._closed:
        return
      self._fail_all(error if isinstance(error, UserError) else RuntimeError(f'the {self.name} pool failed: {error!r}'))

  def _assign(self) -> None:
    for slot, worker in enumerate(self._workers):
      if not (worker.ready and worker.item is None):
        continue
      with self._lock:
        if not self._queue:
          return
        args, future = self._queue.popleft()
      if not (future.running() or future.set_running_or_notify_cancel()):  # running: requeued below
        continue
      try:
        worker.conn.send(args)
      except OSError:  # it died while idle: the item goes to a fresh worker
        with self._lock:
          self._queue.appendleft((args, future))
        self._replace(slot)
        continue
      worker.item, worker.deadline = (args, future), time.monotonic() + self.timeout_s

  def _receive(self, worker: _Worker) -> None:
    try:
      message = worker.conn.recv()
    except (EOFError, OSError):  # the process died
      if not worker.ready:
        raise UserError(f'a {self.name} process exited while starting (see its traceback above)') from None
      self._finish(worker, Failed('crashed', f'exit code {worker.process.exitcode}'))
      self._replace(self._workers.index(worker))
      return
    kind, value = message
    if kind == 'ready':
      worker.ready = True
    elif kind == 'error':
      raise UserError(f'a {self.name} process could not start: {value}')
    else:
      self._finish(worker, value if kind == 'ok' else Failed('raised', value))

  def _finish(self, worker: _Worker, result) -> None:
    _, future = worker.item
    worker.item = None
    if isinstance(result, Failed):
      self.failures += 1
    if not future.done():
      future.set_result(result)

  def _replace(self, slot: int) -> None:
    self._workers[slot].stop()
    self._workers[slot] = _Worker(self)

  def _fail_all(self, error: Exception) -> None:
    with self._lock:
      self._broken = error
      pending = [future for _, future in self._queue] + [worker.item[1] for worker in self._workers if worker.item]
      self._queue.clear()
    for future in pending:
      if not future.done():
        future.set_exception(error)

  # ---- closing ----

  def close(self) -> None:
    """Ends the worker processes; items not yet done fail with RuntimeError."""
    with self._lock:
      if self._closed:
        return
      self._closed = True
    self._wake()
    self._thread.join(timeout=10)
    self._fail_all(RuntimeError(f'the {self.name} pool is closed'))
    for worker in self._workers:
      worker.conn.close()
    for worker in self._workers:
      worker.process.join(timeout=2)
      if worker.process.is_alive():
        worker.process.kill()
        worker.process.join(timeout=5)
    self._wake_read.close()
    self._wake_write.close()
    atexit.unregister(self.close)

  def __enter__(self):
    return self

  def __exit__(self, *exc_info):
    self.close()
