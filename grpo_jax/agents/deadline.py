"""An environment's calls (its making, `reset`, `step`) under a deadline: a call that raises or hangs
costs its episode, not the run.

A call that raises or runs past its deadline (`task.env_timeout_s`) raises EnvironmentFailed; the
agent then ends the episode, its turns masked from the loss and its reward 0 (Trajectory.fail), and
the step counts it (episode/failures, episode/timeouts). The first call of a run that raises prints
its traceback, and the first that times out one line; later ones are only counted.

Two ways to run the calls, chosen where the agent is built (EnvironmentAgent.calls):

  InThreads: the default, for environments of your own. Each episode's calls run in a worker
             thread with an event loop of its own. An `async def step` may hold blocking work that
             never awaits (an HTTP client, subprocess.run, a lock): on the episodes' loop it would
             stall every episode and the inference server, and no deadline could fire, since a
             coroutine gives the loop back only where it awaits. In its own thread it blocks only
             itself: at its deadline the episode moves on, the call is cancelled if it awaits, and
             abandoned if it does not end within CANCEL_GRACE_S (its thread is left to finish).
             Abandoned calls still running are bounded (MAX_ABANDONED): past that the run stops with
             one line, so stuck threads cannot pile up. An episode keeps its thread from its
             reset to its end, so an object its calls make on their loop (an asyncio subprocess,
             a client session) serves its later calls; objects bound to one event loop must not be
             shared across episodes. The threads are daemons: a stuck one never holds the process
             at exit.
  OnLoop:    the calls on the episodes' loop, for environments whose calls only await (the
             built-ins): a call past its deadline is cancelled. No thread hop per call (about
             40 us each on 2 cores: some 30% of the guessing demo's step, 2,048 calls).
"""

import asyncio
import contextlib
import sys
import threading
import time
import traceback

from grpo_jax.errors import UserError

MAX_ABANDONED = 4  # calls past their deadline still blocking their threads before the run stops
CANCEL_GRACE_S = 0.5  # how long a call cancelled at its deadline has to end before it is abandoned
IDLE_S = 10.0  # a worker thread no episode has taken for this long ends


LATE = TimeoutError('past its deadline')  # a call's error when its deadline passed


class EnvironmentFailed(Exception):
  """An environment's call raised or ran past its deadline: its episode ends, scored 0."""

  def __init__(self, timed_out: bool):
    super().__init__('ran past its deadline' if timed_out else 'raised')
    self.timed_out = timed_out


def name(environment) -> str:
  """The environment's class (or the function making it), as errors name it."""
  if isinstance(environment, _Making):
    made = environment.make_environment
    return f'{getattr(made, "__module__", "?")}.{getattr(made, "__qualname__", type(made).__qualname__)}'
  return f'{type(environment).__module__}.{type(environment).__qualname__}'


class _Making:
  """make_environment(problem, episode) as a call of its own (`make`), so that a constructor that
  raises or blocks (opening a connection, starting a service) costs its episode like a step would."""

  def __init__(self, make_environment):
    self.make_environment = make_environment

  async def make(self, *args):
    return self.make_environment(*args)


class Session:
  """One episode's calls: `await session.make(make_environment, *args)` makes its environment,
  then `await session('step', turn)` calls it; each is the call's value or EnvironmentFailed."""

  def __init__(self, calls: 'OnLoop', environment, timeout_s: float | None, worker):
    self.calls, self.environment, self.timeout_s, self.worker = calls, environment, timeout_s, worker

  async def make(self, make_environment, *args):
    self.environment = await self.calls._call(_Making(make_environment), 'make', args, self.timeout_s, self.worker)
    return self.environment

  async def __call__(self, method: str, *args):
    return await self.calls._call(self.environment, method, args, self.timeout_s, self.worker)


async def _awaited(function, args, ended):
  """function(*args) awaited inside the worker's task, so a call that raises before it awaits (a
  plain `def`, wrong arguments) fails like any other; `ended(seconds)` once it is over, however it
  ends, with the seconds it took in the worker's thread."""
  start = time.monotonic()
  try:
    return await function(*args)
  finally:
    ended(time.monotonic() - start)


class OnLoop:
  """An environment's calls on the episodes' event loop, each within `timeout_s` (None: no deadline).

  `async with calls.open(environment, timeout_s) as call:` (or `open(None, timeout_s)`, then
  `environment = await call.make(make_environment, problem, episode)`), then
  `await call('step', turn)`: the call's value, or EnvironmentFailed."""

  def __init__(self):
    self._reported: set[bool] = set()  # the kinds of failure printed (timed out or not)

  @contextlib.asynccontextmanager
  async def open(self, environment, timeout_s: float | None):
    yield Session(self, environment, timeout_s, None)

  async def _run(self, environment, method: str, args: tuple, timeout_s, worker) -> tuple:
    """(the call's value, None), or (None, what it raised), or (None, LATE) when its deadline
    passed (it is cancelled). The deadline is a timer on the episode's own task: no task per call."""
    del worker
    deadline = asyncio.timeout(timeout_s)
    try:
      async with deadline:
        return await getattr(environment, method)(*args), None
    except Exception as error:  # noqa: BLE001 - whatever it raised ends its episode, not the run
      return None, LATE if deadline.expired() else error

  async def _call(self, environment, method: str, args: tuple, timeout_s, worker):
    value, error = await self._run(environment, method, args, timeout_s, worker)
    if error is LATE:
      self._report(environment, True, f'{method}() ran past task.env_timeout_s ({timeout_s:g} s)')
      raise EnvironmentFailed(timed_out=True)
    if error is not None:
      self._report(environment, False, f'{method}() raised', error)
      raise EnvironmentFailed(timed_out=False) from error
    return value

  def _report(self, environment, timed_out: bool, what: str, error: BaseException | None = None) -> None:
    if timed_out in self._reported:
      return
    self._reported.add(timed_out)
    counted = 'episode/failures and episode/timeouts' if timed_out else 'episode/failures'
    detail = ':\n' + ''.join(traceback.format_exception(error)).rstrip() if error is not None else ''
    print(f'warning: environment {name(environment)}: {what}; its episode ends, masked from the loss and scored 0 '
          f'(counted in {counted}; later ones are counted, not printed){detail}', file=sys.stderr, flush=True)


class _Worker:
  """A daemon thread running an event loop of its own; `busy` while a call runs on it; `leaving`:
  it stops when that call ends (abandoned, or its episode was cancelled while it ran)."""

  def __init__(self):
    self.loop = asyncio.new_event_loop()
    self.busy = self.abandoned = self.leaving = False
    self.seconds = 0.0  # how long its last call took, in its own thread
    self.takes = 0  # how often an episode took it: an idle timer set before the last take is stale
    threading.Thread(target=self._serve, name='environment', daemon=True).start()

  def _serve(self) -> None:
    asyncio.set_event_loop(self.loop)
    try:
      self.loop.run_forever()
    finally:
      self.loop.close()

  def stop(self) -> None:
    self.loop.call_soon_threadsafe(self.loop.stop)


class InThreads(OnLoop):
  """An environment's calls in worker threads, each episode's in one thread with its own event loop
  (see the module's docstring for why), each within `timeout_s`."""

  def __init__(self):
    super().__init__()
    self._lock = threading.Lock()
    self._idle: list[_Worker] = []
    self._abandoned = 0  # calls abandoned past their deadline whose threads are still in them

  @property
  def abandoned(self) -> int:
    """Calls abandoned past their deadline whose threads are still in them."""
    with self._lock:
      return self._abandoned

  @contextlib.asynccontextmanager
  async def open(self, environment, timeout_s: float | None):
    worker = self._take()
    try:
      yield Session(self, environment, timeout_s, worker)
    finally:
      self._give_back(worker)

  def _take(self) -> _Worker:
    with self._lock:
      worker = self._idle.pop() if self._idle else _Worker()
      worker.takes += 1
    return worker

  def _give_back(self, worker: _Worker) -> None:
    with self._lock:
      if worker.busy:  # abandoned, or its episode was cancelled mid-call: it stops when the call ends
        worker.leaving = True
        return
      self._idle.append(worker)
      takes = worker.takes
    worker.loop.call_soon_threadsafe(worker.loop.call_later, IDLE_S, self._retire, worker, takes)

  def _retire(self, worker: _Worker, takes: int) -> None:
    """In the worker's thread, IDLE_S after an episode gave it back: it ends unless taken since."""
    with self._lock:
      if worker.takes != takes or worker not in self._idle:
        return
      self._idle.remove(worker)
    worker.loop.stop()

  def _ended(self, worker: _Worker, loop: asyncio.AbstractEventLoop, ended: asyncio.Future, seconds: float) -> None:
    """In the worker's thread, as a call ends: a worker leaving stops, an abandoned call frees its count."""
    with self._lock:
      worker.busy, worker.seconds = False, seconds
      if worker.abandoned:
        self._abandoned, worker.abandoned = self._abandoned - 1, False
      if worker.leaving:
        worker.loop.stop()
    with contextlib.suppress(RuntimeError):  # the episodes' loop is gone: nobody waits on the call
      loop.call_soon_threadsafe(lambda: ended.done() or ended.set_result(None))

  async def _run(self, environment, method: str, args: tuple, timeout_s, worker: _Worker) -> tuple:
    loop = asyncio.get_running_loop()
    ended = loop.create_future()
    with self._lock:
      worker.busy = True
    call = asyncio.run_coroutine_threadsafe(
        _awaited(getattr(environment, method), args, lambda seconds: self._ended(worker, loop, ended, seconds)),
        worker.loop)
    result = asyncio.wrap_future(call)
    try:
      await asyncio.wait((result,), timeout=timeout_s)
      # A call that took longer than its deadline in its own thread is late even when this loop, held
      # up meanwhile (a compile in the inference server), only looked after it had ended.
      with self._lock:
        overran = result.done() and timeout_s is not None and worker.seconds > timeout_s
      if result.done() and not overran:
        error = result.exception()
        return (None, error) if error is not None else (result.result(), None)
      if overran:
        return None, LATE
      call.cancel()  # a call that awaits ends at once; one blocking in its thread gets the grace to end
      await asyncio.wait((ended,), timeout=CANCEL_GRACE_S)
    except asyncio.CancelledError:  # the episode itself is cancelled (another's error ended the rollout)
      call.cancel()
      raise
    self._abandon(environment, worker, timeout_s)
    return None, LATE

  def _abandon(self, environment, worker: _Worker, timeout_s) -> None:
    """Leaves a call that ignored its deadline to its thread; past MAX_ABANDONED such calls still
    running, the run stops."""
    with self._lock:
      if not worker.busy:  # it ended within the grace
        return
      worker.abandoned = True
      self._abandoned += 1
      abandoned = self._abandoned
    if abandoned > MAX_ABANDONED:
      raise UserError(f'environment {name(environment)}: {abandoned} calls ran past task.env_timeout_s '
                      f'({timeout_s:g} s) and still block their threads (blocking code in async def reset/step or '
                      'in making the environment, which no deadline interrupts); the run stops rather than leave '
                      'more threads stuck')
