"""python -m grpo_jax.train --config configs/X.yaml [--set a.b=c ...] [--workdir DIR]

GRPO on a device mesh: each step samples G completions for P prompts from the live parameters,
scores them, computes group advantages and applies the optax update. With a reward written in JAX
(the built-in arithmetic task) `train.steps_per_call` whole steps run inside one jit; otherwise
each step is jitted rollout -> host reward -> jitted update. Restarting with the same workdir
resumes from the newest complete checkpoint.
"""

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx

from grpo_jax import config as config_lib
from grpo_jax import metrics as metrics_lib
from grpo_jax.checkpoint import Checkpointer
from grpo_jax.errors import UserError, cli_main
from grpo_jax.model import sharding
from grpo_jax.model.loading import from_pretrained, init_model
from grpo_jax.rl.loop import Trainer, matmul_peak_flops, model_flops_per_step, rollout_metrics, to_host
from grpo_jax.rl.step import init_train_state


def parse_args(argv):
  parser = argparse.ArgumentParser(prog='python -m grpo_jax.train', description=__doc__.splitlines()[0])
  parser.add_argument('--config', required=True, help='YAML run config (see configs/)')
  parser.add_argument('--set', action='append', default=[], metavar='KEY=VALUE', dest='overrides',
                      help='override one config key, e.g. --set mesh.tensor=2 (repeatable)')
  parser.add_argument('--workdir', help='output directory (default: run.workdir or runs/<name>-<time>)')
  return parser.parse_args(argv)


def build_task(config: config_lib.Config):
  task = config.task
  if task.name == 'arith':
    from grpo_jax.data.arith import ArithmeticTask
    try:
      built = ArithmeticTask(task.max_operand, task.operators)
    except ValueError as error:
      raise UserError(f'task: {error}') from None
    if config.rollout.max_new_tokens < built.answer_length:
      raise UserError(f'rollout.max_new_tokens ({config.rollout.max_new_tokens}) is shorter than the '
                      f'longest answer with its end token ({built.answer_length})')
    return built
  from grpo_jax.data.math_task import MathTask
  return MathTask(task, config)


def build_model(config: config_lib.Config, mesh):
  if config.model.attention == 'cudnn' and jax.default_backend() != 'gpu':
    raise UserError(f'model.attention: cudnn runs on NVIDIA GPUs only; this run\'s devices are '
                    f'{jax.default_backend()} (use dense or chunked)')
  options = dict(dtype=config.model.dtype, param_dtype=config.model.param_dtype,
                 remat=config.model.remat, scan_layers=config.model.scan_layers,
                 attention=config.model.attention, attention_chunk=config.model.attention_chunk)
  if config.model.path:
    return from_pretrained(config.model.path, mesh=mesh, **options)
  return init_model(config.model.architecture, mesh=mesh, seed=config.run.seed, **options)


def setup(config: config_lib.Config, config_path: str | None, workdir: str | None):
  """Writes the resolved config to the workdir and builds the mesh and the model."""
  workdir = config_lib.resolve_workdir(config, config_path, workdir)
  os.makedirs(workdir, exist_ok=True)
  resolved = config_lib.to_yaml(config)
  with open(os.path.join(workdir, 'config.yaml'), 'w') as f:
    f.write(resolved)
  print(f'# resolved config (saved to {workdir}/config.yaml)\n{resolved}', flush=True)
  mesh = sharding.make_mesh(config.mesh)
  model = build_model(config, mesh)
  return workdir, mesh, model


class Run:
  """The state of one training run between jitted calls: what the host logs and checkpoints."""

  def __init__(self, config: config_lib.Config, workdir: str, mesh, model, task):
    self.config, self.workdir, self.mesh, self.task = config, workdir, mesh, task
    if task.vocab_size > model.config.vocab_size:
      raise UserError(f'the task\'s tokenizer has {task.vocab_size} tokens but model vocab_size is '
                      f'{model.config.vocab_size}')
    graphdef, params = nnx.split(model)
    # beta = 0 keeps no reference policy in memory.
    self.ref_params = jax.tree.map(jnp.copy, params) if config.algo.kl_beta > 0 else None
    self.trainer = Trainer(config, graphdef, task, config.train.steps)
    with jax.set_mesh(mesh):
      self.state = jax.jit(lambda p: init_train_state(p, self.trainer.optimizer, config.run.seed))(params)
    self.trainer.pin_shardings(self.state, mesh)
    self.checkpointer = Checkpointer(os.path.join(workdir, 'checkpoints'), max_to_keep=config.train.max_to_keep)
    self.step = 0
    self.data_position = 0
    latest = self.checkpointer.latest_step()
    if latest is not None:
      self.state, meta = self.checkpointer.restore(latest, self.state)
      self.step, self.data_position = int(meta['step']), int(meta['data_position'])
      print(f'resumed from {self.checkpointer.directory}/{latest}', file=sys.stderr, flush=True)
    self.log = metrics_lib.MetricsLog(workdir, resume_step=self.step)
    self.num_params = model.config.num_params()
    self.peak_flops = matmul_peak_flops(config.model.dtype)
    self.step_flops = model_flops_per_step(self.num_params, config, task.prompt_length)
    self.saved_step = latest

  # ---- one chunk of steps ----

  def fused_steps(self, count: int) -> list[dict]:
    """`count` RL steps inside one jitted call (reward in JAX)."""
    start = time.perf_counter()
    with jax.set_mesh(self.mesh):
      self.state, stacked = self.trainer.run_steps(self.state, self.ref_params, count)
      stacked = to_host(stacked)
    elapsed = (time.perf_counter() - start) / count
    self.data_position += count * self.config.rollout.prompts_per_step
    timing = dict(rollout_s=None, reward_s=None, update_s=None, step_time_s=elapsed)
    return [dict({name: value[i] for name, value in stacked.items()}, **timing) for i in range(count)]

  def host_step(self) -> dict:
    """One RL step as jitted rollout -> reward -> jitted update, timing each part."""
    trainer, task = self.trainer, self.task
    begin = time.perf_counter()
    with jax.set_mesh(self.mesh):
      self.state, prompt_key, sample_key = trainer.split_key(self.state)
      prompts = task.batch(prompt_key, self.config.rollout.prompts_per_step, self.data_position)
      rollout = jax.block_until_ready(trainer.rollout(self.state.params, prompts.tokens, prompts.mask, sample_key))
      rolled = time.perf_counter()
      rewards = task.score(rollout, prompts, self.config.algo.group_size)
      scored = time.perf_counter()
      batch = trainer.make_batch(prompts.tokens, prompts.mask, rollout, rewards)
      self.state, update_metrics = trainer.update(self.state, batch, self.ref_params)
      metrics = to_host(dict(rollout_metrics(rollout, rewards, self.config.algo.group_size), **update_metrics))
    end = time.perf_counter()
    self.data_position += self.config.rollout.prompts_per_step
    return dict(metrics, rollout_s=rolled - begin, reward_s=scored - rolled, update_s=end - scored,
                step_time_s=end - begin)

  def record(self, metrics: dict) -> dict:
    self.step += 1
    step_time = metrics['step_time_s']
    metrics['tokens_per_s'] = float(metrics.pop('completion_tokens')) / step_time
    metrics['mfu'] = self.step_flops / step_time / self.peak_flops
    return self.log.write(self.step, metrics)

  def save(self) -> None:
    meta = dict(step=self.step, data_position=self.data_position, config=config_lib.to_dict(self.config))
    self.checkpointer.save(self.step, self.state, meta)
    self.saved_step = self.step

  def check_skips(self) -> None:
    skips = int(self.state.skips)
    limit = self.config.train.max_consecutive_skips
    if skips >= limit:
      self.checkpointer.wait()
      last = self.checkpointer.latest_step()
      where = f'the last good checkpoint is step {last}' if last is not None else 'no checkpoint was saved'
      raise UserError(f'{skips} updates in a row had a non-finite loss or gradient (train.max_consecutive_skips='
                      f'{limit}); stopped at step {self.step}, {where}. Lower optim.learning_rate or check the data.')


def train(config: config_lib.Config, workdir: str, mesh, model) -> list[dict]:
  """Runs (or resumes) the loop to `train.steps`; returns the metrics history."""
  task = build_task(config)
  run = Run(config, workdir, mesh, model, task)
  total, every = config.train.steps, config.train.checkpoint_every
  chunk = config.train.steps_per_call if task.jittable else 1
  progress = metrics_lib.ProgressBar(total, start=run.step, enabled=config.train.progress)
  try:
    while run.step < total:
      if task.jittable and chunk > 1:
        rows = run.fused_steps(min(chunk, total - run.step))
      else:
        rows = [run.host_step()]
      for row in rows:
        written = run.record(row)
      progress.update(run.step, written['reward_mean'])
      run.check_skips()
      # A step whose update was skipped adds nothing worth keeping: checkpoints stay good ones.
      if every and run.step % every == 0 and run.step < total and int(run.state.skips) == 0:
        run.save()
    if run.saved_step != run.step:
      run.save()
  finally:
    run.checkpointer.close()
    run.log.close()
    getattr(task, 'close', lambda: None)()  # the math task's reward worker processes
  return run.log.history


def report(history: list[dict], workdir: str, name: str) -> None:
  print('\n' + metrics_lib.summary_table(history))
  plot = metrics_lib.plot_rewards(history, os.path.join(workdir, 'reward.png'), f'{name}: mean reward per step')
  first = [row['reward_mean'] for row in history[:10]]
  last = [row['reward_mean'] for row in history[-10:]]
  print(f'\nmean reward: first {len(first)} steps {sum(first) / len(first):.3f}, '
        f'last {len(last)} steps {sum(last) / len(last):.3f}')
  print(f'outputs: {workdir} (config.yaml, metrics.jsonl, tensorboard/, checkpoints/'
        f'{", reward.png" if plot else ""})')


@cli_main
def main(argv=None):
  args = parse_args(sys.argv[1:] if argv is None else argv)
  config = config_lib.validate(config_lib.load_config(args.config, args.overrides))
  workdir, mesh, model = setup(config, args.config, args.workdir)
  print(f'mesh: {sharding.describe(mesh)}; model: {model.config.num_params() / 1e6:.2f}M parameters, '
        f'{sharding.bytes_per_device(nnx.state(model)) / 2**20:.1f} MiB on the fullest device', flush=True)
  history = train(config, workdir, mesh, model)
  report(history, workdir, config.run.name)


if __name__ == '__main__':
  main()
