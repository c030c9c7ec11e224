"""python bench/sandbox.py [--calls 64] [--workers 2] [--repeats 3]

The cost of running each Python tool call in a sandbox of its own (grpo_jax/sandbox.py) against
running it inside the tool worker (`task.sandbox: none`), through the same two-worker pool the
tool-use environment uses, on three scripts: a print, a loop of pure Python, and an import of
NumPy. Per call: wall time of `--calls` calls submitted at once / calls, median of `--repeats`.
Both ways must print the same text (asserted).
"""

import argparse
import functools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from grpo_jax import sandbox  # noqa: E402
from grpo_jax.agents import tools  # noqa: E402
from grpo_jax.workers import WorkerPool  # noqa: E402

SCRIPTS = {'print': 'print(6 * 7)',
           'loop 1e6': 'print(sum(i * i for i in range(1_000_000)))',
           'import numpy': 'import numpy as np\nprint(int(np.arange(100).sum()))'}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
  parser.add_argument('--calls', type=int, default=64)
  parser.add_argument('--workers', type=int, default=2)
  parser.add_argument('--repeats', type=int, default=3)
  args = parser.parse_args()
  sandbox.check()
  pools = {way: WorkerPool(args.workers, tools.work, setup=functools.partial(tools.worker_setup, way, sandbox.Limits()),
                           timeout_s=30.0, name=f'tool worker ({way})') for way in ('none', 'bwrap')}
  rows = {}
  for name, code in SCRIPTS.items():
    times = {way: [] for way in pools}
    outputs = {}
    for _ in range(args.repeats + 1):  # the first round warms the page cache and the workers
      for way, pool in pools.items():  # interleaved: drift in load hits both alike
        start = time.perf_counter()
        outputs[way] = pool.map([('python', code)] * args.calls)
        times[way].append((time.perf_counter() - start) / args.calls)
    assert outputs['none'] == outputs['bwrap'], (name, outputs['none'][0], outputs['bwrap'][0])
    rows[name] = {way: statistics.median(values[1:]) for way, values in times.items()}
  for pool in pools.values():
    pool.close()
  print(f'\n{args.calls} calls at once through {args.workers} tool workers, {os.cpu_count()} cores, median of '
        f'{args.repeats}; per call (wall / calls)')
  print(f'{"script":<14} {"in the worker ms":>16} {"sandboxed ms":>13} {"sandbox costs ms":>17} {"ratio":>7}')
  for name, row in rows.items():
    print(f'{name:<14} {row["none"] * 1e3:>16.1f} {row["bwrap"] * 1e3:>13.1f} '
          f'{(row["bwrap"] - row["none"]) * 1e3:>17.1f} {row["bwrap"] / row["none"]:>6.1f}x')
  return 0


if __name__ == '__main__':
  sys.exit(main())
