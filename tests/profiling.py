"""Where the suite's CPU goes, test by test: `GRPO_JAX_TEST_PROFILE=FILE make test` (or pytest).

Under two workers on two cores a test's wall time counts the other worker's load; its CPU does
not. For every test each worker appends one JSON line to FILE: the CPU of the worker itself and of
the subprocesses the test waited for (a CLI run, a compile for an accelerator, the trainers of a
multi-host run), and what JAX reported in the worker during it (XLA's compile, tracing, lowering
to MLIR, as wall time: a compile's threads and the other worker's load are in it; persistent-cache
hits and misses). At the end the controller prints the totals and the tests that cost most.
Subprocesses' compiles show only as their CPU.
"""

import collections
import json
import os
import resource
import time

import pytest

PATH = os.environ['GRPO_JAX_TEST_PROFILE']  # tests/conftest.py loads this plugin only when it is set
JAX_EVENTS = {'/jax/core/compile/backend_compile_duration': 'compile_s',
              '/jax/core/compile/jaxpr_trace_duration': 'trace_s',
              '/jax/core/compile/jaxpr_to_mlir_module_duration': 'lower_s',
              '/jax/compilation_cache/cache_hits': 'cache_hits',
              '/jax/compilation_cache/cache_misses': 'cache_misses'}
_counts = collections.Counter()


def _record(event: str, amount: float = 1) -> None:
  if event in JAX_EVENTS:
    _counts[JAX_EVENTS[event]] += amount


def _listen():
  import jax.monitoring
  jax.monitoring.register_event_duration_secs_listener(lambda event, duration, **_: _record(event, duration))
  jax.monitoring.register_event_listener(lambda event, **_: _record(event))


def _cpu(who) -> float:
  usage = resource.getrusage(who)
  return usage.ru_utime + usage.ru_stime


def pytest_configure(config):
  _listen()
  if not hasattr(config, 'workerinput') and os.path.exists(PATH) and 'PYTEST_XDIST_WORKER' not in os.environ:
    # The controller (or a run without workers) starts the file afresh; workers append to it. A pytest
    # a test starts (test_rollout_matrix's collection) inherits the variable and leaves the file be.
    os.remove(PATH)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  before = (time.perf_counter(), _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN), dict(_counts))
  yield
  wall, own, children, counts = before
  row = dict(test=item.nodeid, wall_s=time.perf_counter() - wall, cpu_s=_cpu(resource.RUSAGE_SELF) - own,
             children_cpu_s=_cpu(resource.RUSAGE_CHILDREN) - children)
  row.update({name: round(_counts[name] - counts.get(name, 0), 3) for name in JAX_EVENTS.values()})
  with open(PATH, 'a') as f:
    f.write(json.dumps(row) + '\n')


def pytest_terminal_summary(terminalreporter, config):
  if hasattr(config, 'workerinput') or not os.path.exists(PATH):
    return
  with open(PATH) as f:
    rows = [json.loads(line) for line in f]
  for row in rows:
    row['total'] = row['cpu_s'] + row['children_cpu_s']
  write = terminalreporter.write_line
  write(f'CPU by test ({PATH}): {len(rows)} tests, {sum(r["total"] for r in rows):.0f} s of CPU '
        f'({sum(r["cpu_s"] for r in rows):.0f} s in the workers, {sum(r["children_cpu_s"] for r in rows):.0f} s in '
        f'their subprocesses); in the workers, wall time in the XLA compiles {sum(r["compile_s"] for r in rows):.0f} s, in '
        f'tracing and lowering {sum(r["trace_s"] + r["lower_s"] for r in rows):.0f} s')
  files = collections.Counter()
  for row in rows:
    files[row['test'].split('::')[0]] += row['total']
  write('by file: ' + ', '.join(f'{name.removeprefix("tests/")} {seconds:.0f} s' for name, seconds in files.most_common(15)))
  for row in sorted(rows, key=lambda row: -row['total'])[:30]:
    write(f'{row["total"]:7.1f} s CPU ({row["children_cpu_s"]:5.1f} in subprocesses; compiles {row["compile_s"]:5.1f} s wall) '
          f'{row["test"]}')
