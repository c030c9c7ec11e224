"""Run outputs: metrics.jsonl, TensorBoard events through clu, a live progress bar, a summary table,
a reward-curve PNG, and the FLOP count and matmul peak behind the MFU column.

clu's metric writers import TensorFlow; where it is not installed (e.g. a GPU image without the
extras) the run says so once and writes metrics.jsonl only.
"""

import functools
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp

from grpo_jax import errors

# Columns of the end-of-run summary table: (metric, format).
SUMMARY = (('reward_mean', '{:.3f}'), ('reward_std', '{:.3f}'), ('response_len_mean', '{:.1f}'),
           ('policy_loss', '{:+.4f}'), ('kl', '{:.4f}'), ('entropy', '{:.3f}'), ('grad_norm', '{:.3f}'),
           ('reward_failures', '{:.0f}'), ('eval/pass@1', '{:.3f}'), ('packed_padding_frac', '{:.2f}'),
           ('step_time_s', '{:.3f}'))


def _clu_writer(logdir: str):
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  try:
    with errors.quiet_native_stderr():
      from clu import metric_writers
      writer = metric_writers.AsyncWriter(metric_writers.SummaryWriter(logdir))
  except ImportError as error:
    print(f'note: no TensorBoard events ({error}); install requirements-extras.txt for clu + '
          'TensorFlow. metrics.jsonl is written regardless.', file=sys.stderr)
    return None
  return writer


def _plain(value):
  if value is None:
    return None
  value = float(value)
  return value if math.isfinite(value) else None


class MetricsLog:
  """Appends one JSON object per step to metrics.jsonl and mirrors scalars to TensorBoard.

  On resume from step s, lines for steps after s (written before a crash, and about to be
  recomputed) are dropped, so the file reads as one uninterrupted run.
  """

  def __init__(self, workdir: str, *, resume_step: int = 0, tensorboard: bool = True, name: str = 'metrics.jsonl',
               write: bool = True, trackers=None):
    """write=False (processes other than 0 of a multi-host run): the history is kept in memory
    only, and no file or event is written. `trackers` (grpo_jax/trackers.py Trackers) get each row
    too; whoever opened them closes them."""
    self.path = os.path.join(workdir, name)
    self.trackers = trackers
    self.history: list[dict] = []
    self.file = self.writer = None
    if not write:
      return
    if os.path.exists(self.path):
      with open(self.path) as f:
        lines = [json.loads(line) for line in f if line.strip()]
      self.history = [row for row in lines if row['step'] <= resume_step]
      temporary = self.path + '.tmp'
      with open(temporary, 'w') as f:
        f.writelines(json.dumps(row) + '\n' for row in self.history)
      os.replace(temporary, self.path)
    self.file = open(self.path, 'a')
    self.writer = _clu_writer(os.path.join(workdir, 'tensorboard')) if tensorboard else None

  def write(self, step: int, metrics: dict) -> dict:
    row = {'step': step, **{name: _plain(value) for name, value in metrics.items()}}
    self.history.append(row)
    if self.file is None:
      return row
    self.file.write(json.dumps(row) + '\n')
    self.file.flush()
    if self.writer is not None:
      self.writer.write_scalars(step, {k: v for k, v in row.items() if k != 'step' and v is not None})
    if self.trackers is not None:
      self.trackers.log(step, row)
    return row

  def close(self) -> None:
    if self.file is not None:
      self.file.close()
    if self.writer is not None:
      self.writer.flush()
      self.writer.close()


class ProgressBar:
  """`step 40/200 [#####-----] 20% reward 0.41 | 12s elapsed, ETA 48s` on a terminal; on a pipe
  (CI, logs) the same text as a plain line about every 10% of the run."""

  def __init__(self, total: int, start: int = 0, stream=None, enabled: bool = True, noun: str = 'step',
               metric: str = 'reward'):
    self.total, self.start, self.enabled, self.noun, self.metric = total, start, enabled, noun, metric
    self.stream = stream or sys.stderr
    self.started = time.perf_counter()
    self.tty = getattr(self.stream, 'isatty', lambda: False)()
    self.last_line = -1

  def update(self, step: int, reward: float | None) -> None:
    if not self.enabled:
      return
    elapsed = time.perf_counter() - self.started
    done = max(step - self.start, 1)
    eta = elapsed / done * (self.total - step)
    width = 24
    filled = int(width * step / max(self.total, 1))
    reward_text = '-' if reward is None else f'{reward:.3f}'
    text = (f'{self.noun} {step}/{self.total} [{"#" * filled}{"-" * (width - filled)}] '
            f'{100 * step / max(self.total, 1):3.0f}% {self.metric} {reward_text} | '
            f'{elapsed:.0f}s elapsed, ETA {eta:.0f}s')
    if self.tty:
      self.stream.write('\r' + text)
      if step >= self.total:
        self.stream.write('\n')
    else:
      bucket = 10 * step // max(self.total, 1)
      if bucket == self.last_line and step < self.total:
        return
      self.last_line = bucket
      self.stream.write(text + '\n')
    self.stream.flush()


def summary_table(history: list[dict], rows: int = 8, summary=SUMMARY) -> str:
  """Evenly spaced steps of the run (first and last included) as an aligned text table of the
  `summary` columns ((name, format) pairs) the rows have."""
  if not history:
    return '(no steps)'
  picks = sorted({round(i * (len(history) - 1) / max(rows - 1, 1)) for i in range(rows)})
  columns = [(name, fmt) for name, fmt in summary if any(row.get(name) is not None for row in history)]
  header = ['step'] + [name for name, _ in columns]
  table = [header]
  for index in picks:
    row = history[index]
    table.append([str(row['step'])] + ['-' if row.get(name) is None else fmt.format(row[name])
                                       for name, fmt in columns])
  widths = [max(len(r[c]) for r in table) for c in range(len(header))]
  return '\n'.join('  '.join(cell.rjust(w) for cell, w in zip(r, widths)) for r in table)


def plot_rewards(history: list[dict], path: str, title: str) -> str | None:
  """Mean reward per step (and its 10-step running mean) as a PNG; None without matplotlib."""
  try:
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
  except ImportError:
    return None
  steps = [row['step'] for row in history]
  rewards = [row.get('reward_mean') for row in history]
  figure, axes = plt.subplots(figsize=(7, 4))
  axes.plot(steps, rewards, color='tab:blue', alpha=0.35, label='reward_mean')
  window = 10
  smooth = [sum(rewards[max(0, i - window + 1):i + 1]) / len(rewards[max(0, i - window + 1):i + 1])
            for i in range(len(rewards))]
  axes.plot(steps, smooth, color='tab:blue', label=f'{window}-step mean')
  axes.set_xlabel('RL step')
  axes.set_ylabel('mean reward')
  if all(0.0 <= value <= 1.0 for value in rewards if value is not None):  # a 0/1 check's scale; else the data's
    axes.set_ylim(-0.02, 1.02)
  axes.grid(alpha=0.3)
  axes.legend(loc='lower right')
  axes.set_title(title)
  figure.tight_layout()
  figure.savefig(path, dpi=100)
  plt.close(figure)
  return path


def plot_reward_terms(history: list[dict], path: str, title: str) -> str | None:
  """Each reward term's raw mean per step (reward/<label>), one panel a term on its own scale (a
  reward model's score beside a 0/1 check; the demo's proxy beside its gold), with a 10-step running
  mean, as a PNG; None without matplotlib or with fewer than two terms."""
  labels = sorted({name for row in history for name in row if name.startswith('reward/')})
  if len(labels) < 2:
    return None
  try:
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
  except ImportError:
    return None
  figure, panels = plt.subplots(len(labels), 1, figsize=(7, 2.2 * len(labels) + 0.6), sharex=True, squeeze=False)
  window = 10
  for axes, label in zip(panels[:, 0], labels):
    rows = [row for row in history if row.get(label) is not None]
    steps, values = [row['step'] for row in rows], [row[label] for row in rows]
    smooth = [sum(values[max(0, i - window + 1):i + 1]) / len(values[max(0, i - window + 1):i + 1])
              for i in range(len(values))]
    axes.plot(steps, values, color='tab:green', alpha=0.35)
    axes.plot(steps, smooth, color='tab:green')
    axes.set_ylabel(label.removeprefix('reward/'))
    axes.grid(alpha=0.3)
  panels[-1, 0].set_xlabel('RL step')
  panels[0, 0].set_title(title)
  figure.tight_layout()
  figure.savefig(path, dpi=100)
  plt.close(figure)
  return path


def update_tokens_per_group(prompt_length: int, completion_length: int, algo) -> int:
  """Tokens the update computes for one group of G sequences of Tp + N tokens: G (Tp + N); with
  tree packing (rl/packing.py) the prompt but its last token once per row its tree is in, and each
  sequence's last prompt token and completion: k = (L - Tp + 1) // (N + 1) branches fit a row of
  L = algo.pack_length tokens, so ceil(G / k) copies of the root (G of them, no saving, when a row
  holds one sequence: L = Tp + N). Full-length answers; shorter ones share more."""
  flat = algo.group_size * (prompt_length + completion_length)
  if not (algo.packing and algo.tree_packing) or prompt_length < 2:
    return flat
  root, branch = prompt_length - 1, completion_length + 1
  per_row = ((algo.pack_length or prompt_length + completion_length) - root) // branch
  return -(-algo.group_size // per_row) * root + algo.group_size * branch


def model_flops_per_step(active_params: int, prompt_length: int, rollout, algo, adapter_params: int | None = None) -> float:
  """Approximate model FLOPs of one RL step (the run's `rollout` and `algo` config sections): 2 N
  per sampled token, 6 N per trained token (plus 2 N per token for each extra scoring pass: pi_old
  when mu > 1 or several mini-batches, pi_ref). N = `active_params`, the parameters one token
  computes with (Qwen2Config.num_params(active=True): a mixture of experts counts the k experts a
  token is routed to, not all E). With LoRA (`adapter_params` A): the frozen N need no weight
  gradients, so 4 N + 6 A per trained token, and every pass also runs the adapters. The update's
  tokens per group: update_tokens_per_group (fewer with tree packing)."""
  rows = rollout.prompts_per_step * algo.group_size
  sampled = rollout.prompts_per_step * prompt_length + rows * rollout.max_new_tokens
  computed = rollout.prompts_per_step * update_tokens_per_group(prompt_length, rollout.max_new_tokens, algo)
  trained = computed * algo.ppo_epochs
  scoring_passes = (algo.ppo_epochs > 1 or algo.num_minibatches > 1) + (algo.kl_beta > 0)
  forward = active_params + (adapter_params or 0)
  per_trained = 6.0 * active_params if adapter_params is None else 4.0 * active_params + 6.0 * adapter_params
  return 2.0 * forward * sampled + per_trained * trained + 2.0 * forward * computed * scoring_passes


def tower_flops_per_step(prompt_flops: float, rollout, algo, trained: bool, remat: bool) -> tuple[float, float]:
  """(the sampler's, the update's) FLOPs of a vision tower in one RL step, `prompt_flops` the
  tower's forward FLOPs on one prompt's images (its bucket, padding included). The prefill runs it
  once per prompt. The update runs it once per prompt (rl/update.py): for pi_ref (beta > 0); a
  frozen tower once more for every other pass; a trained one once for pi_old (when scored), and in
  each of the mu x M mini-batches forward and backward (2x forward, 3x with `remat`: the blocks'
  forward again) on all P prompts, or on its P / M with whole groups (`algo.shuffle: groups`)."""
  prompts = rollout.prompts_per_step * prompt_flops
  scored = algo.ppo_epochs > 1 or algo.num_minibatches > 1
  if not trained:
    return prompts, prompts * (1 + (algo.kl_beta > 0))
  minibatches = algo.ppo_epochs * (algo.num_minibatches if algo.shuffle == 'rows' else 1)
  return prompts, prompts * (scored + (algo.kl_beta > 0) + minibatches * (3 + remat))


@functools.cache
def matmul_peak_flops(dtype: str = 'float32', size: int = 1024, repeats: int = 5) -> float:
  """Measured FLOP/s of a square jitted matmul on the default device (the MFU denominator)."""
  x = jnp.ones((size, size), dtype) * 0.5
  matmul = jax.jit(lambda a: a @ a)
  matmul(x).block_until_ready()
  best = float('inf')
  for _ in range(repeats):
    start = time.perf_counter()
    matmul(x).block_until_ready()
    best = min(best, time.perf_counter() - start)
  return 2.0 * size ** 3 / best
