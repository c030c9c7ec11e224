"""Shared fixtures: tiny random Hugging Face Qwen2 checkpoints built inside the tests (by
grpo_jax.testing, which benchmarks share).

Eight fake CPU devices are configured before jax is imported so mesh tests can run in-process;
single-device tests simply use the first device.
"""

import os
import time

# XLA:CPU's LLVM backend at -O0: the suite's programs are tiny, so compiling them is most of its
# time, and unoptimised machine code halves it (a 24-step CLI run: 31 s of CPU cold, 16.5 s at -O0);
# the HLO passes, and with them every program's numbers and layouts, are unchanged. Subprocesses
# inherit it (tests/runs.py device_env keeps it when it changes the device count).
os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' --xla_backend_optimization_level=0'
                           ' --xla_force_host_platform_device_count=8').strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
# XLA:CPU runs every device's thunks on one shared pool of max(cores, devices) threads, and a
# collective holds its thread until every participant arrives. A device runs up to five ready
# thunks at once (its executor's own limit), so independent collectives of one program (the
# pool's bookkeeping beside the prompts' prefill loop, tests/test_lora_paths.py [partial-vl-mesh])
# can hold all 8 threads while their partners wait in the queue: the rendezvous aborts the process
# after 40 s. It did in 3 of 12 runs of that test on 2 loaded cores, and in none of 10 with 64
# threads (8 devices x 8), which PJRT_NPROC sets. Subprocesses inherit it.
os.environ.setdefault('PJRT_NPROC', '64')

# JAX's persistent compilation cache: the xdist workers and every CLI the tests start inherit it, so
# a program the suite compiled once (the demo's RL step, the tiny model's forward) is read back
# instead of compiled again in each process (a 12-step CLI run: 19.6 s cold, 10.3 s warm). It lives
# under the checkout (.cache/jax-tests, which `make clean` removes), so a second `make test` on the
# same tree reads back what the first compiled; JAX keys every entry by the program, the compile
# options and JAX's own version, so an edit recompiles only what it changed. JAX keeps it under
# 2 GiB, dropping the least recently used. JAX_COMPILATION_CACHE_DIR set outside takes its place
# (a fresh temporary folder measures what a fresh clone costs).
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault('JAX_COMPILATION_CACHE_DIR', os.path.join(ROOT, '.cache', 'jax-tests'))
os.environ.setdefault('JAX_COMPILATION_CACHE_MAX_SIZE', str(2 << 30))
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0.3')

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from grpo_jax.testing import save_random_hf_checkpoint  # noqa: E402


@pytest.fixture
def seed():
  """A fresh seed per test run, printed so a failure can be replayed: TEST_SEED=N pytest ..."""
  value = int(os.environ.get('TEST_SEED') or int.from_bytes(os.urandom(4), 'little'))
  print(f'seed={value}')
  return value


@pytest.fixture
def make_hf_checkpoint(tmp_path):
  """make_hf_checkpoint(seed, name='hf', shard_size=None, **config) -> (directory, torch model)."""

  def make(seed, name='hf', shard_size=None, **overrides):
    directory = str(tmp_path / name)
    return directory, save_random_hf_checkpoint(directory, seed, max_shard_size=shard_size, **overrides)

  return make


def torch_logits(model, tokens, attention_mask=None, position_ids=None):
  import torch
  with torch.no_grad():
    kwargs = {}
    if attention_mask is not None:
      kwargs['attention_mask'] = torch.tensor(np.asarray(attention_mask))
    if position_ids is not None:
      kwargs['position_ids'] = torch.tensor(np.asarray(position_ids))
    return model(torch.tensor(np.asarray(tokens)), **kwargs).logits.float().numpy()


def greedy_answers(model, tokens, mask, steps: int) -> np.ndarray:
  """transformers' greedy `generate` of `steps` tokens after each row of left-padded tokens [B, T]
  (mask: 1 on its tokens), no stop token: [B, steps]."""
  import torch
  with torch.no_grad():
    out = model.generate(torch.tensor(np.asarray(tokens), dtype=torch.long), attention_mask=torch.tensor(np.asarray(mask)),
                         do_sample=False, max_new_tokens=steps, pad_token_id=0, eos_token_id=None)
  return out[:, np.asarray(tokens).shape[1]:].numpy()


# The tiers (tests/README.md). `make test` runs every test not marked `exhaustive`: each feature's
# decisive check, within TIER_BUDGETS['test']. `make test-all` (CI) runs them all. `make test-fast`
# (pytest -m fast) runs the files of unit tests against their references (the maths, the model
# against transformers, the kernels against the naive path, the sampler), none of which starts a CLI,
# trains a run or compiles for an accelerator: under 3 minutes.
FAST_FILES = {'test_adapters', 'test_algo', 'test_api', 'test_attention', 'test_decode_attention', 'test_hf_config',
              'test_launch', 'test_layers', 'test_logprob', 'test_model_parity', 'test_reward_cases',
              'test_reward_terms', 'test_rollout', 'test_sampling', 'test_sharding', 'test_tools'}
# Wall time on the 2-core machine the project develops on (seconds); a new feature adds at most 60 s
# to `test` and 3 minutes to `test-all`.
TIER_BUDGETS = {'test': 15 * 60, 'test-all': 40 * 60, 'test-long': 30 * 60, 'test-fast': 3 * 60}


_STARTED = pytest.StashKey[float]()  # when the run began: the tier's wall time


def pytest_addoption(parser):
  parser.addoption('--tier', choices=sorted(TIER_BUDGETS), help='the Makefile target running the suite: the '
                   'summary gives its wall time against its budget (tests/README.md)')


def pytest_configure(config):
  config.stash[_STARTED] = time.monotonic()
  _check_xdist_groups(config)
  if os.environ.get('GRPO_JAX_TEST_PROFILE'):  # CPU by test, subprocesses included (tests/profiling.py)
    import profiling
    config.pluginmanager.register(profiling)  # pytest calls its pytest_configure on registering it



# A test still running after TEST_TIMEOUT_S seconds (default 600; the longest take about 130 s here)
# has every thread's stack written to the worker's stderr, the processes it started killed (a CLI
# run, a multi-process run's trainers: left alone they would hold the two cores) and its worker
# ended: xdist reports the test as the one its worker crashed on, and a fresh worker takes the rest.
# A hang (a collective's partner that never arrives, a child that never answers) so costs one test,
# not the run. faulthandler's own watchdog, 60 s later, ends a worker whose threads cannot run.
TEST_TIMEOUT_S = float(os.environ.get('TEST_TIMEOUT_S', 600))


def _kill_children_and_exit(name: str) -> None:
  import faulthandler
  import signal
  import sys
  sys.__stderr__.write(f'\n{name} ran past TEST_TIMEOUT_S={TEST_TIMEOUT_S:.0f} s: its stacks, then its worker ends\n')
  faulthandler.dump_traceback(file=sys.__stderr__, all_threads=True)
  me = os.getpid()
  for entry in os.listdir('/proc'):
    if entry.isdigit():
      try:
        with open(f'/proc/{entry}/stat') as f:
          parent = int(f.read().rsplit(')', 1)[1].split()[1])
        if parent == me:
          os.killpg(os.getpgid(int(entry)), signal.SIGKILL) if os.getpgid(int(entry)) != os.getpgid(me) else \
              os.kill(int(entry), signal.SIGKILL)
      except (OSError, ValueError, IndexError):
        pass
  sys.__stderr__.flush()
  os._exit(1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  import faulthandler
  import sys
  import threading
  timer = threading.Timer(TEST_TIMEOUT_S, _kill_children_and_exit, (item.nodeid,))
  timer.daemon = True
  timer.start()
  faulthandler.dump_traceback_later(TEST_TIMEOUT_S + 60, exit=True, file=sys.__stderr__)
  try:
    yield
  finally:
    timer.cancel()
    faulthandler.cancel_dump_traceback_later()


def pytest_collection_modifyitems(config, items):
  """Marks the fast files' tests `fast`; puts the long tests (marked starts_first) first: xdist
  hands tests out in this order, so the two workers do not end with one still running a long test
  alone."""
  for item in items:
    if item.get_closest_marker('long') and not item.get_closest_marker('exhaustive'):
      raise pytest.UsageError(f'{item.nodeid} is marked long but not exhaustive: make test would run it (tests/README.md)')
    if item.path.stem in FAST_FILES and not any(item.get_closest_marker(name) for name in ('exhaustive', 'starts_first')):
      item.add_marker(pytest.mark.fast)
  items.sort(key=lambda item: item.get_closest_marker('starts_first') is None)


def _check_xdist_groups(config):
  """A file's module fixtures are built once only if its xdist_group keeps its tests on one worker.
  pytest-xdist 3.8 marks a group by suffixing each test's node id (Node._nodeid), which pytest 9.2
  no longer keeps: the groups would be ignored without a word, each module fixture built again on
  every worker and every time a worker comes back to the file."""
  from _pytest import nodes
  if config.getoption('dist', 'no') == 'loadgroup' and '_nodeid' not in getattr(nodes.Node, '__slots__', ()):
    raise pytest.UsageError(f'pytest {pytest.__version__} does not let pytest-xdist apply xdist_group (the tests '
                            'marked with it would spread over the workers): install the pytest that '
                            'requirements-test.txt names')


def pytest_terminal_summary(terminalreporter, config):
  tier = config.getoption('--tier')
  if tier is None or hasattr(config, 'workerinput'):
    return
  passed = len(terminalreporter.stats.get('passed', []))
  seconds = time.monotonic() - config.stash[_STARTED]
  budget = TIER_BUDGETS[tier]
  verdict = 'within' if seconds <= budget else 'OVER'
  terminalreporter.write_line(f'make {tier}: {passed} tests passed in {seconds / 60:.1f} minutes of wall time, '
                              f'{verdict} its budget of {budget // 60} minutes on 2 cores (tests/README.md)')
