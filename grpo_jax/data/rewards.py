"""Host-side rewards: completions checked against reference answers with math-verify, in a pool
of worker processes that a hanging or crashing check cannot take down.

`math_reward(completion, answer)` is 1.0 when the completion's answer equals the reference
(symbolically or numerically, as math-verify decides: `\\boxed{1/2}` matches `0.5`), else 0.0.
The answer is read from the completion's final text (`final_text`: after a reasoning model's
thinking block): the content of its last complete `\\boxed{...}` when it has one, otherwise
whatever math-verify extracts from that text.

`RewardPool(workers)` scores lists of (completion, answer) pairs in `workers` processes, one item
per process at a time, and returns the rewards in input order. math-verify interrupts its own slow
parses and comparisons with SIGALRM (it must run on a process's main thread, hence processes, not
threads); an item that still outlives `timeout_s` (a loop in C that ignores the alarm, a crash)
gets 0.0 and its process is replaced, so one bad completion never stops a run. Each worker may
also grow by at most `memory_bytes` beyond what it holds after start-up (its address space is
capped), so a check that would build a gigantic number fails with MemoryError; a check that raises
scores 0.0 too, and all three count in `failures`.
"""

import atexit
import collections
import ctypes
import logging
import math
import multiprocessing
import os
import re
import resource
import signal
import sys
import threading
import time
from multiprocessing import connection

from grpo_jax.errors import UserError

VERIFY_TIMEOUT_S = 3  # math-verify's own alarm for each parse and comparison (whole seconds)
ITEM_TIMEOUT_S = 10.0  # hard limit per completion: past it the worker is killed and the reward is 0
ITEM_MEMORY_BYTES = 2 << 30  # address space a worker may add to what it holds after warm-up
START_TIMEOUT_S = 300.0  # a worker imports math-verify (and sympy) before its first item
BOX_COMMANDS = ('\\boxed', '\\fbox')
BOX_PATTERN = '(?:' + '|'.join(re.escape(command) for command in BOX_COMMANDS) + r')\{'


def last_boxed(text: str) -> str | None:
  """The content of the last `\\boxed{...}` (or `\\fbox{...}`) in `text` whose braces close; None if none.

  Linear in len(text): one pass pairs every brace with its match, then the box openings are tried
  from the last one back. (Counting depth afresh from each opening was quadratic: a right answer
  followed by 100,000 unclosed `\\boxed{` outlived the reward deadline.)
  """
  closing, open_braces = {}, []
  for match in re.finditer('[{}]', text):
    if match.group() == '{':
      open_braces.append(match.start())
    elif open_braces:
      closing[open_braces.pop()] = match.start()
  openings = [match.end() - 1 for match in re.finditer(BOX_PATTERN, text)]
  for brace in reversed(openings):
    if brace in closing:
      return text[brace + 1:closing[brace]]
  return None


THINK_OPEN, THINK_CLOSE = '<think>', '</think>'


def final_text(completion: str) -> str:
  """The part of a completion that gives its answer: what follows the last `</think>` of a
  reasoning model (Qwen3's thinking block); nothing when a thinking block opened and never closed
  (the budget ran out before the answer); else the whole completion. A \\boxed{} inside the
  thinking is a draft, not the answer."""
  if THINK_CLOSE in completion:
    return completion.rsplit(THINK_CLOSE, 1)[1]
  return '' if THINK_OPEN in completion else completion


def math_reward(completion: str, answer: str, timeout_s: int = VERIFY_TIMEOUT_S) -> float:
  """1.0 if the completion's final answer equals the reference `answer` per math-verify, else 0.0."""
  from math_verify import parse, verify

  completion = final_text(completion)

  def join_digit_groups(text: str) -> str:
    # math-verify reads juxtaposed numbers as a mixed number or a product, so digits grouped by a
    # thin or plain space became another number ('1\,234' -> 235, '10\,000' -> 0): the right
    # answer scored 0 and a wrong one 1. Comma groupings ('1,234', '1{,}234', '1,\!234') it reads
    # as one number already.
    return re.sub(r'(?<![\d.])\d{1,3}(?:(?:\\,|\\ | )\d{3})+(?!\d)',
                  lambda number: re.sub(r'\\,|\\ | ', '', number.group()), text)

  boxed = last_boxed(completion)
  prediction = parse(completion if boxed is None else '\\boxed{' + join_digit_groups(boxed) + '}',
                     parsing_timeout=timeout_s)
  answer = join_digit_groups(answer)
  # References are bare expressions ('0.5', '\frac{1}{2}', '(1, 2)'): boxed, math-verify reads them
  # as LaTeX, which keeps intervals, tuples and commands intact. An escaped dollar is a currency sign
  # (MATH's '\$18.90'), not a math delimiter: unboxed, such a reference parsed to nothing.
  delimited = any(mark in answer for mark in BOX_COMMANDS) or '$' in answer.replace('\\$', '')
  gold = parse(answer if delimited else '\\boxed{' + answer + '}', parsing_timeout=timeout_s)
  if not gold and not delimited:
    gold = parse(answer, parsing_timeout=timeout_s)
  if not gold or not prediction:
    return 0.0
  return 1.0 if verify(gold, prediction, timeout_seconds=timeout_s) else 0.0


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent(parent_pid: int) -> None:
  """Ends this worker as soon as the trainer dies (kill -9, the OOM killer, pre-emption), whatever
  it is computing: the kernel's parent-death signal on Linux (it needs no Python thread, so a scorer
  stuck in C holding the GIL dies too), and a watchdog thread on the parent's pid everywhere."""
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
  """Caps this process's address space at its current size plus `extra_bytes`: a check that would
  build a huge number or expression fails with MemoryError instead of taking the host's memory."""
  try:
    with open('/proc/self/statm') as f:
      current = int(f.read().split()[0]) * os.sysconf('SC_PAGE_SIZE')
    resource.setrlimit(resource.RLIMIT_AS, (current + extra_bytes, current + extra_bytes))
  except (OSError, ValueError):  # not Linux, or a hard limit already lower: keep what there is
    pass


def _serve(conn, score_fn, parent_pid: int, memory_bytes: int) -> None:
  """A worker: warms `score_fn` up, says 'ready', then answers (completion, answer) with a reward,
  or None when the check raised (MemoryError included): the pool counts that as a failure."""
  _die_with_parent(parent_pid)
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
  logging.getLogger('math_verify').setLevel(logging.CRITICAL)  # its timeout notices, once per item
  try:
    score_fn('\\boxed{1}', '1')  # imports math-verify and its LaTeX grammar before the first deadline
  except ImportError as error:
    conn.send(('error', f'{type(error).__name__}: {error}'))
    return
  except Exception:
    pass  # a scorer that rejects the warm-up input can still score real ones
  _limit_memory(memory_bytes)
  conn.send(('ready', None))
  while True:
    try:
      completion, answer = conn.recv()
    except (EOFError, OSError):  # the parent closed the pool or exited
      return
    try:
      reward = float(score_fn(completion, answer))
    except Exception:
      conn.send(None)
      continue
    conn.send(reward if math.isfinite(reward) else 0.0)


class _Worker:
  """One process, its end of the pipe, and the item it is working on (with its deadline)."""

  def __init__(self, context, score_fn, memory_bytes: int):
    self.conn, child = context.Pipe()
    self.process = context.Process(target=_serve, args=(child, score_fn, os.getpid(), memory_bytes),
                                   name='reward-worker',
                                   daemon=True)
    self.process.start()
    child.close()
    self.ready = False
    self.item = None
    self.deadline = time.monotonic() + START_TIMEOUT_S

  def stop(self) -> None:
    self.conn.close()
    self.process.kill()
    self.process.join(timeout=5)


class RewardPool:
  """`workers` processes applying `score_fn(completion, answer) -> float` with a per-item deadline.

  score_fn must be importable by name (a module-level function): it is sent to spawned processes.
  """

  def __init__(self, workers: int, score_fn=math_reward, timeout_s: float = ITEM_TIMEOUT_S,
               memory_bytes: int = ITEM_MEMORY_BYTES):
    if workers < 1:
      raise ValueError(f'a reward pool needs at least one worker, got {workers}')
    # spawn, not fork: forking a process that runs JAX's threads can deadlock the child.
    self._context = multiprocessing.get_context('spawn')
    self.score_fn, self.timeout_s, self.memory_bytes = score_fn, timeout_s, memory_bytes
    self._workers = [_Worker(self._context, score_fn, memory_bytes) for _ in range(workers)]
    self.failures = 0  # items that got 0.0: past the deadline, the worker died, or the check raised
    atexit.register(self.close)

  def map(self, completions: list[str], answers: list[str]) -> list[float]:
    """Rewards of each (completion, answer) pair, in order."""
    if len(completions) != len(answers):
      raise ValueError(f'{len(completions)} completions but {len(answers)} answers')
    if self._workers is None:
      raise RuntimeError('the reward pool is closed')
    rewards = [0.0] * len(completions)
    queue = collections.deque(range(len(completions)))
    while queue or any(worker.item is not None for worker in self._workers):
      for slot, worker in enumerate(self._workers):
        if worker.ready and worker.item is None and queue:
          index = queue.popleft()
          try:
            worker.conn.send((completions[index], answers[index]))
          except OSError:  # it died while idle: retry the item on a fresh worker
            queue.appendleft(index)
            self._replace(slot)
            continue
          worker.item, worker.deadline = index, time.monotonic() + self.timeout_s
      waiting = [worker for worker in self._workers if not worker.ready or worker.item is not None]
      wait_s = max(0.0, min(worker.deadline for worker in waiting) - time.monotonic())
      answered = connection.wait([worker.conn for worker in waiting], timeout=wait_s)
      for worker in waiting:
        if worker.conn in answered:
          self._receive(worker, rewards)
      now = time.monotonic()
      for slot, worker in enumerate(self._workers):
        if (not worker.ready or worker.item is not None) and now > worker.deadline:
          if not worker.ready:
            raise UserError(f'a reward worker did not start within {START_TIMEOUT_S:.0f} s')
          self.failures += 1  # its reward stays 0.0
          self._replace(slot)
    return rewards

  def _receive(self, worker: _Worker, rewards: list[float]) -> None:
    try:
      message = worker.conn.recv()
    except (EOFError, OSError):  # the process died (a crash inside the scorer)
      if not worker.ready:
        raise UserError('a reward worker exited while starting (see its traceback above)') from None
      self.failures += 1
      self._replace(self._workers.index(worker))
      return
    if worker.ready:
      if message is None:  # the check raised (MemoryError past the memory limit included)
        self.failures += 1
      rewards[worker.item] = message or 0.0
      worker.item = None
    elif message[0] == 'ready':
      worker.ready = True
    else:
      raise UserError(f'a reward worker could not start: {message[1]} (math-verify==0.9.0 is in requirements.txt)')

  def _replace(self, slot: int) -> None:
    self._workers[slot].stop()
    self._workers[slot] = _Worker(self._context, self.score_fn, self.memory_bytes)

  def close(self) -> None:
    """Ends the worker processes (they exit on their own when the pipe closes)."""
    if self._workers is None:
      return
    for worker in self._workers:
      worker.conn.close()
    for worker in self._workers:
      worker.process.join(timeout=2)
      if worker.process.is_alive():
        worker.process.kill()
        worker.process.join(timeout=5)
    self._workers = None
    atexit.unregister(self.close)

  def __enter__(self):
    return self

  def __exit__(self, *exc_info):
    self.close()
