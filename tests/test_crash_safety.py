"""kill -9 at chosen moments of checkpointing, on every training path: the run resumed equals the
uninterrupted one row for row, every checkpoint left behind is complete, and no worker process
outlives the killed trainer.

The moments (MOMENTS):
- `first-save`: while the first checkpoint is being written, before any is complete: the run must
  start again from nothing, past a half-written directory.
- `later-save`: while a later checkpoint is being written: that step never counts, the one before
  it restores.
- `commit`: just after a checkpoint has been committed (the step's directory renamed into place),
  with its writer's threads and the next steps still running.

Each run is killed twice in a row (its resumed run is killed again before it ends), at two of the
moments, after a random delay inside the save. The paths: the host loop (the fast case), MoE with
routing replay, the vision model (its tower frozen), partial rollouts at lag 1 (fused steps, packed
update), LoRA, an agent task with its sandboxed tool workers, and split devices (test-all)."""

import functools
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from runs import ROOT, alive, device_env, read_metrics, without_timing

STEPS, EVERY = 6, 2  # checkpoints at steps 2 and 4: the first save, a later one, and two steps past it
SMALL = ['rollout.prompts_per_step=8', 'algo.group_size=4', 'train.progress=false', 'train.tensorboard=false',
         f'train.steps={STEPS}', f'train.checkpoint_every={EVERY}']
PARTIAL = ['algo.max_lag=1', 'algo.tis_cap=2.0', 'rollout.slots=12']
TIMEOUT_S = 300
MAX_DELAY_S = 0.02  # a save of these models takes 80-120 ms (measured): a kill after at most 20 ms lands inside it


def _config(name):
  return os.path.join(ROOT, 'configs', name)


def _names(workdir) -> set[str]:
  try:
    return set(os.listdir(os.path.join(workdir, 'checkpoints')))
  except FileNotFoundError:
    return set()


def _checkpoints(workdir, stale: frozenset[str] = frozenset()) -> tuple[set[int], set[int]]:
  """(steps whose checkpoint is committed, steps whose checkpoint is being written) in workdir. A
  half-written directory named in `stale` (left by a run killed before) is not a save in progress."""
  names = _names(workdir)
  finished = {int(name) for name in names if name.isdigit()}
  saving = {int(name.split('.')[0]) for name in names - stale
            if '.orbax-checkpoint-tmp' in name and name.split('.')[0].isdigit()}
  return finished, saving


def _children() -> dict[int, list[int]]:
  """Every live process's children, read from /proc."""
  children = {}
  for name in os.listdir('/proc'):
    if name.isdigit():
      try:
        with open(f'/proc/{name}/stat') as f:
          fields = f.read().rsplit(')', 1)[1].split()
      except OSError:
        continue
      children.setdefault(int(fields[1]), []).append(int(name))
  return children


def _descendants(pid: int) -> set[int]:
  children, found, todo = _children(), set(), [pid]
  while todo:
    for child in children.get(todo.pop(), []):
      if child not in found:
        found.add(child)
        todo.append(child)
  return found


def _start(workdir, config, overrides, devices):
  command = [sys.executable, '-m', 'grpo_jax.train', '--config', config, '--workdir', str(workdir)]
  command += [argument for setting in overrides for argument in ('--set', setting)]
  stem = os.path.join(os.path.dirname(str(workdir)), os.path.basename(str(workdir)))
  log = open(next(f'{stem}.{n}.log' for n in range(100) if not os.path.exists(f'{stem}.{n}.log')), 'w')
  process = subprocess.Popen(command, cwd=ROOT, env=device_env(devices), stdout=subprocess.DEVNULL, stderr=log)
  process.log = log
  return process


def _log(process) -> str:
  if not process.log.closed:
    process.log.flush()
  with open(process.log.name) as f:
    return f.read()[-4000:]


def assert_resumed_from_newest(process, workdir, newest: int | None):
  """The run said it resumed from `newest` (the newest whole checkpoint when it started), or, with
  none, that it did not resume: restarting from nothing would equal the uninterrupted run too."""
  said = [line for line in _log(process).splitlines() if line.startswith('resumed from ')]
  expected = [f'resumed from {os.path.join(os.path.abspath(workdir), "checkpoints", str(newest))}'] if newest else []
  assert [line.split(' with a changed config')[0] for line in said] == expected, (said, expected)


def _moment_reached(moment, finished, saving, finished_before) -> int | None:
  """The step whose checkpoint makes this the moment to kill, or None."""
  if moment == 'first-save' and saving and not finished:
    return min(saving)
  if moment == 'later-save' and finished and {s for s in saving if s > max(finished)}:
    return min(s for s in saving if s > max(finished))
  if moment == 'commit' and finished - finished_before:
    return max(finished - finished_before)
  return None


def kill_at(process, workdir, moment: str, rng: random.Random) -> str:
  """SIGKILL `process` (a training run in `workdir`) at `moment` (MOMENTS); asserts the kill landed
  there (a save still unfinished, or a commit that is the newest checkpoint) and that every process
  the run had started dies with it. Returns what was hit, for the messages."""
  finished_before, _ = _checkpoints(workdir)
  # A save the killed run before this one left half-written is not this run's: waiting for a fresh
  # one keeps the kill after this run has restored (a loaded machine can let the last run reach its
  # next save before the commit it was killed at is seen).
  stale = frozenset(_names(workdir))
  deadline = time.time() + TIMEOUT_S
  step = None
  while step is None:
    assert process.poll() is None, f'the run ended (exit {process.returncode}) before the {moment} moment:\n{_log(process)}'
    assert time.time() < deadline, f'no {moment} moment in {TIMEOUT_S} s'
    step = _moment_reached(moment, *_checkpoints(workdir, stale), finished_before)
    if step is None:
      time.sleep(0.001)
  delay = rng.uniform(0, MAX_DELAY_S) if moment.endswith('save') else 0.0
  time.sleep(delay)
  workers = _descendants(process.pid)
  process.send_signal(signal.SIGKILL)
  process.wait()
  process.log.close()
  finished, saving = _checkpoints(workdir, stale)
  hit = f'{moment} of step {step}, {delay * 1000:.0f} ms in, {len(workers)} processes under the run'
  if moment.endswith('save'):
    assert step in saving and step not in finished, f'the save finished before the kill ({hit})'
  else:
    assert max(finished) == step, hit
  deadline = time.time() + 30
  while any(alive(pid) for pid in workers) and time.time() < deadline:
    time.sleep(0.05)
  orphans = sorted(pid for pid in workers if alive(pid))
  assert not orphans, f'processes of the killed run still alive ({hit}): {orphans}'
  return hit


def assert_complete_checkpoints(workdir):
  """Every checkpoint directory left is committed whole (orbax writes commit_success.txt last)."""
  finished, _ = _checkpoints(workdir)
  for step in finished:
    for part in ('', 'state', 'meta'):
      assert os.path.isfile(os.path.join(workdir, 'checkpoints', str(step), part, 'commit_success.txt')), (step, part)


def assert_same_final_state(workdir, reference):
  """The last checkpoint's state (parameters, optimizer moments, step, PRNG key, pools in flight)
  equals the reference run's bit for bit: the metrics cannot show the last update's effect."""
  import jax
  import numpy as np
  import orbax.checkpoint as ocp

  def state(run):
    with ocp.StandardCheckpointer() as checkpointer:
      return jax.tree.flatten_with_path(checkpointer.restore(os.path.join(run, 'checkpoints', str(STEPS), 'state')))[0]

  ours, theirs = state(workdir), state(reference)
  assert ours and [path for path, _ in ours] == [path for path, _ in theirs]
  differ = [jax.tree_util.keystr(path) for (path, a), (_, b) in zip(ours, theirs)
            if not np.array_equal(np.asarray(a), np.asarray(b))]
  assert not differ, differ[:5]


def kill_twice_and_resume(tmp_path, config, overrides, moments, devices=1, seed=None):
  """An uninterrupted run; the same run killed at moments[0], resumed and killed at moments[1],
  resumed to its end: the metrics of every step and the last checkpoint's state equal the
  uninterrupted run's, and the checkpoints left are whole. The random delay's seed is drawn fresh and named on failure."""
  seed = random.randrange(2**32) if seed is None else seed
  rng = random.Random(seed)
  start = functools.partial(_start, config=config, overrides=[*SMALL, *overrides], devices=devices)
  reference = start(tmp_path / 'whole')
  assert reference.wait(timeout=TIMEOUT_S) == 0, _log(reference)
  hits, killed = [], tmp_path / 'killed'
  newest = lambda: max(_checkpoints(killed)[0], default=None)  # noqa: E731
  for moment in moments:
    before = newest()
    victim = start(killed)
    hits.append(kill_at(victim, killed, moment, rng))
    assert_resumed_from_newest(victim, killed, before)
    assert_complete_checkpoints(killed)
  before = newest()
  resumed = start(killed)
  assert resumed.wait(timeout=TIMEOUT_S) == 0, f'{hits} (seed {seed}):\n{_log(resumed)}'
  assert_resumed_from_newest(resumed, killed, before)
  assert_complete_checkpoints(killed)
  assert without_timing(read_metrics(killed)) == without_timing(read_metrics(tmp_path / 'whole')), \
      f'{hits} (seed {seed})'
  assert_same_final_state(killed, tmp_path / 'whole')
  return hits


@pytest.mark.starts_first
def test_host_loop_killed_mid_first_save_then_after_a_commit_resumes_exactly(tmp_path):
  """The fast tier's case: the demo's host loop, killed while its first checkpoint is written (the
  resumed run starts again from nothing) and again just after the second run's first commit."""
  kill_twice_and_resume(tmp_path, _config('tiny_arith.yaml'), ['train.steps_per_call=1'], ('first-save', 'commit'))


@pytest.fixture
def tool_run(tmp_path, make_hf_checkpoint):
  """The tool-use recipe at reduced size (test_tool_use.py's CPU run): a random 2-layer Qwen2, the
  tool chat template, GSM8K-format records; python calls in bwrap sandboxes on its
  one worker (task.reward_workers)."""
  from test_tool_use import tool_tokenizer_dir, write_gsm8k
  directory, _ = make_hf_checkpoint(5)
  tool_tokenizer_dir(directory)
  return [f'model.path={directory}', f'task.source={write_gsm8k(tmp_path / "g.jsonl", 8)}', 'task.reward_workers=1',
          'task.max_prompt_tokens=1024', 'model.dtype=float32', 'model.attention=dense', 'rollout.max_new_tokens=24',
          'task.turn_tokens=8', 'algo.num_minibatches=1', 'algo.micro_batch_size=4', 'mesh.fsdp=1', 'eval.every=0',
          'rollout.prompts_per_step=2', 'algo.group_size=2']


MATRIX = [  # (id, config, settings, devices, moments)
    ('moe-routing-replay', 'tiny_arith_moe.yaml', ['train.steps_per_call=1'], 1, ('first-save', 'commit')),
    # A frozen tower: its optimizer state holds optax.MaskedNode where the tower's moments would be.
    ('vision-frozen-tower', 'tiny_spot.yaml', ['train.steps_per_call=1', 'model.freeze_vision=true'], 1,
     ('commit', 'later-save')),
    ('partial-lag1-fused-packed', 'tiny_arith.yaml', [*PARTIAL, 'train.steps_per_call=2', 'algo.packing=true',
                                                      'algo.micro_batch_tokens=18'], 1, ('commit', 'later-save')),
    ('lora', 'tiny_arith_lora.yaml', ['train.steps_per_call=1'], 1, ('first-save', 'later-save')),
    ('split-devices', 'tiny_arith.yaml', [*PARTIAL, 'rollout.devices=1', 'train.steps_per_call=1'], 2,
     ('first-save', 'later-save')),
]


@pytest.mark.exhaustive
@pytest.mark.starts_first
@pytest.mark.parametrize('config, settings, devices, moments',
                         [pytest.param(*case[1:], id=case[0]) for case in MATRIX])
@pytest.mark.long
def test_killed_twice_resumes_exactly(tmp_path, config, settings, devices, moments):
  kill_twice_and_resume(tmp_path, _config(config), settings, moments, devices=devices)


@pytest.mark.exhaustive
@pytest.mark.starts_first
@pytest.mark.long
def test_agent_with_tool_workers_killed_twice_resumes_exactly_and_leaves_no_worker(tmp_path, tool_run):
  """The tool workers (and each call's sandbox) die with the trainer: kill_at asserts that no
  process the run started outlives it, and here there are some at each kill."""
  hits = kill_twice_and_resume(tmp_path, _config('qwen2_5_3b_gsm8k_tool.yaml'), tool_run, ('first-save', 'commit'))
  assert all(not hit.endswith(' 0 processes under the run') for hit in hits), hits
