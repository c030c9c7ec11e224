"""python -m grpo_jax.train --config configs/X.yaml [--set a.b=c ...] [--workdir DIR]

GRPO on a device mesh: each step (rl/step.py) samples G completions for P prompts from the live
parameters, scores them, computes group advantages and applies the optax update. With a reward
written in JAX (the built-in arithmetic task) `train.steps_per_call` whole steps run inside one
jit; otherwise each step runs jitted rollout -> host reward -> jitted update. This file keeps the
command line, logging and checkpoints around that step. Restarting with the same workdir resumes
from the newest complete checkpoint.
"""

import argparse
import dataclasses
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpo_jax import config as config_lib
from grpo_jax import distributed
from grpo_jax import metrics as metrics_lib
from grpo_jax import sharding
from grpo_jax.build import build_evaluator, build_rl_step, build_task, build_teacher
from grpo_jax.checkpoint import Checkpointer
from grpo_jax.data.task import Task
from grpo_jax.errors import UserError, cli_main
from grpo_jax.model import lora
from grpo_jax.model.hf_config import to_hf_dict
from grpo_jax.rl.held import Held
from grpo_jax.rl.state import TrainState, create_train_state
from grpo_jax.sampler.layout import split_devices
from grpo_jax.snapshots import Snapshots
from grpo_jax.trackers import Trackers, flat_keys


def parse_args(argv):
  parser = argparse.ArgumentParser(prog='python -m grpo_jax.train', description=__doc__.splitlines()[0])
  parser.add_argument('--config', required=True, help='YAML run config (see configs/)')
  parser.add_argument('--set', action='append', default=[], metavar='KEY=VALUE', dest='overrides',
                      help='override one config key, e.g. --set mesh.tensor=2 (repeatable)')
  parser.add_argument('--workdir', help='output directory (default: run.workdir or runs/<name>-<time>)')
  return parser.parse_args(argv)


def check_workdir(workdir: str) -> None:
  """One line if `workdir` cannot hold the run's outputs; creates and changes nothing."""
  path = os.path.abspath(workdir)
  if os.path.exists(path) and not os.path.isdir(path):
    raise UserError(f'workdir {workdir} is a file, not a directory')
  existing = path
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    raise UserError(f'workdir {workdir} lies under {existing}, which is a file')
  if not os.access(existing, os.W_OK | os.X_OK):
    raise UserError(f'workdir {workdir}: {existing} is not writable')


def setup(config: config_lib.Config, config_path: str | None, workdir: str | None, devices=None):
  """Resolves and checks the workdir (writing nothing: Run writes once the run's inputs are all
  validated) and builds the mesh (over `devices`, default every device but the sampler's own)
  and the model."""
  workdir = config_lib.resolve_workdir(config, config_path, workdir)
  check_workdir(workdir)
  split = devices is None and config.rollout.devices
  if devices is None:
    devices = split_devices(jax.devices(), config.rollout.devices)[0]
  try:
    mesh = sharding.make_mesh(config.mesh, devices=devices)
  except UserError as error:
    if not split:
      raise
    raise UserError(f"{error} to the trainer ({config.rollout.devices} of the {len(jax.devices())} devices are the "
                    "sampler's, rollout.devices)") from None
  model = config.model.build(mesh, config.run.seed)
  return workdir, mesh, model


def changed_keys(before: dict, after: dict) -> list[str]:
  """'key: old -> new' for every config key whose value differs between two to_dict() configs. Not
  changes: a key `before` lacks (a setting added since it was written), and a task key `after`
  lacks (another task kind's: checkpoints written before the task section was a tagged union
  stored every kind's keys; a change of kind shows as task.name). An environment's own arguments
  (task.environment_args) are compared both ways: one added or removed is a change."""
  if _architecture_unread(before):  # stored before the config recorded the architecture read from model.path
    before = dict(before, model=dict(before['model'], architecture=after.get('model', {}).get('architecture')))
  old, new = flat_keys(before), flat_keys(after)
  arguments = {key for key in new if key.startswith('task.environment_args.')}
  return [f'{key}: {old.get(key)!r} -> {new.get(key)!r}' for key in sorted(old.keys() | arguments)
          if (key in new or not key.startswith('task.') or key.startswith('task.environment_args.'))
          and old.get(key) != new.get(key)]


def _architecture_unread(stored: dict) -> bool:
  """A stored config of a run from model.path whose architecture is the section's unused default
  (written before runs recorded the architecture they read from model.path)."""
  model = stored.get('model', {})
  return bool(model.get('path')) and model.get('architecture') == config_lib.to_dict(config_lib.Config())['model'][
      'architecture']


def base_record(config: config_lib.Config, architecture: dict) -> dict:
  """What a checkpoint records of the weights it was trained on: with LoRA (whose checkpoints hold
  only the adapters) the base's path and a hash of its architecture, and the adapters' settings."""
  options = config.model.options
  if options.lora is None:
    return dict(lora=None)
  return dict(lora=config_lib.to_dict(config)['model']['lora'], path=config.model.path,
              architecture_hash=lora.base_fingerprint(architecture))


def check_base(checkpointer: Checkpointer, step: int, base: dict) -> None:
  """One line when checkpoint `step` was trained with other weights than this run's: LoRA against a
  full-parameter run (either way), another base model, or other adapters."""
  stored = checkpointer.meta(step).get('base', dict(lora=None))
  where = f'checkpoint {checkpointer.directory}/{step}'
  if (stored['lora'] is None) != (base['lora'] is None):
    if base['lora'] is not None:
      raise UserError(f'{where} is from a full-parameter run; model.lora cannot resume from it (train LoRA in a new '
                      'workdir, with that run\'s exported policy as model.path if it is the base you want)')
    raise UserError(f'{where} holds LoRA adapters (model.lora was {stored["lora"]}); set the same model.lora to '
                    'resume, or export it merged (conversion.orbax_to_hf --merge-lora) to train all parameters')
  if base['lora'] is None:
    return
  if stored['architecture_hash'] != base['architecture_hash']:
    raise UserError(f'{where} trained adapters on another base model ({stored["path"]}, architecture hash '
                    f'{stored["architecture_hash"]}) than model.path={base["path"]} (hash {base["architecture_hash"]})')
  if stored['lora'] != base['lora']:
    raise UserError(f'{where} holds adapters of model.lora={stored["lora"]}, this run asks for {base["lora"]}')


def stop_on_skips(checkpointer: Checkpointer, skips: int, limit: int, step: int) -> int:
  """`skips` (updates skipped in a row for a non-finite loss or gradient), after stopping the run in
  one line, naming its last good checkpoint, once there are `limit` (train.max_consecutive_skips)."""
  if skips >= limit:
    checkpointer.wait()
    last = checkpointer.latest_step()
    where = f'the last good checkpoint is step {last}' if last is not None else 'no checkpoint was saved'
    raise UserError(f'{skips} updates in a row had a non-finite loss or gradient (train.max_consecutive_skips='
                    f'{limit}); stopped at step {step}, {where}. Lower optim.learning_rate or check the data.')
  return skips


def to_host(metrics: dict) -> dict:
  return distributed.host_values(dict(metrics))


class Run:
  """A training run on the host: the train state between jitted calls, its checkpoints and logs.
  The RL step itself is rl/step.py's; the step counter is the state's."""

  def __init__(self, config: config_lib.Config, workdir: str, mesh, model, task: Task):
    if config.model.path:  # the architecture trained is the one read there: the printed and stored config say so
      config = dataclasses.replace(config, model=dataclasses.replace(config.model, architecture=model.config))
    self.config, self.mesh, self.task = config, mesh, task
    if task.vocab_size > model.config.vocab_size:
      raise UserError(f'the task\'s tokenizer has {task.vocab_size} tokens but model vocab_size is '
                      f'{model.config.vocab_size}')
    params = nnx.state(model)
    trained, frozen = lora.split_trainable(params)  # with LoRA: the adapters, and the frozen base
    # beta = 0 keeps no reference policy in memory; nor does LoRA, whose pi_ref is its base.
    reference = jax.tree.map(jnp.copy, params) if config.algo.kl_beta > 0 and frozen is None else None
    self.held = Held(reference=reference, teacher=build_teacher(config, mesh, task, model))
    self.rl_step = build_rl_step(config, model, mesh, task)
    with jax.set_mesh(mesh):
      self.state = create_train_state(trained, self.rl_step.optimizer, config.run.seed, pool=self.rl_step.empty_pool,
                                      shardings=self.rl_step.state_shardings, frozen=frozen)
    self.architecture = to_hf_dict(model.config, dtype=config.model.options.param_dtype)  # in each checkpoint, for export
    self.base = base_record(config, self.architecture)
    checkpoints = os.path.join(workdir, 'checkpoints')
    try:  # a new workdir gets its (empty) checkpoints directory; an existing one is not changed
      os.makedirs(checkpoints, exist_ok=True)
    except OSError as error:
      raise UserError(f'workdir {workdir} cannot be created: {error.strerror or error}') from None
    self.checkpointer = Checkpointer(checkpoints, max_to_keep=config.train.max_to_keep)
    self.saved_step = self.checkpointer.latest_step()
    if self.saved_step is not None:
      try:
        check_base(self.checkpointer, self.saved_step, self.base)
        restored, meta = self.checkpointer.restore(self.saved_step, self.state.checkpointed())
        # The data position (prompts consumed) is the checkpoint's metadata's, as it always was, and
        # so is what the task carries between steps (its reward's running statistics).
        self.state = TrainState.restored(restored, distributed.replicated(np.int32(meta['data_position']), mesh),
                                         frozen=self.state.frozen)
        task.load_state_dict(meta.get('task_state', {}))
      except UserError:
        self.checkpointer.close()  # its background threads would otherwise die noisily at exit
        raise
      changes = changed_keys(meta.get('config', {}), config_lib.to_dict(config))
      print(f'resumed from {self.checkpointer.directory}/{self.saved_step}'
            + (f' with a changed config: {"; ".join(changes)}' if changes else ''), file=sys.stderr, flush=True)
    # Every input is validated by now (the task, mesh and model before this object, the
    # checkpoint just above): only from here on is anything in an existing workdir written.
    # Only process 0 of a multi-host run writes logs; every process takes part in the checkpoints.
    self.primary = distributed.is_primary()
    if self.primary:
      resolved = config_lib.to_yaml(config)
      with open(os.path.join(workdir, 'config.yaml'), 'w') as f:
        f.write(resolved)
      print(f'# resolved config (saved to {workdir}/config.yaml)\n{resolved}', flush=True)
    self.trackers = Trackers.open(config.train, config.run.name, config_lib.to_dict(config), workdir, self.step,
                                  self.primary)
    self.log = metrics_lib.MetricsLog(workdir, resume_step=self.step, write=self.primary,
                                      tensorboard=config.train.writes_tensorboard, trackers=self.trackers)
    self.workdir = workdir
    self.snapshots = Snapshots(config, workdir, model, task, self.primary)
    self.num_params = model.config.num_params()
    self.peak_flops = metrics_lib.matmul_peak_flops(config.model.options.dtype)
    adapters = None if frozen is None else sum(x.size for x in jax.tree.leaves(trained))
    # FLOPs (and MFU) count the parameters a token computes with: a mixture's active ones.
    self.step_flops = metrics_lib.model_flops_per_step(model.config.num_params(active=True), task.prompt_length,
                                                       config.rollout, config.algo, adapter_params=adapters)

  @property
  def step(self) -> int:
    return int(distributed.host_value(self.state.step))

  @property
  def data_position(self) -> int:
    """Prompts the run has consumed (the state's; the step advances it)."""
    return int(distributed.host_value(self.state.position))

  # ---- one chunk of steps ----

  def fused_steps(self, count: int) -> list[dict]:
    """`count` RL steps inside one jitted call (a jittable task)."""
    start = time.perf_counter()
    with jax.set_mesh(self.mesh):
      self.state, stacked = self.rl_step.run_steps(self.state, self.held, count)
      stacked = to_host(stacked)
    elapsed = (time.perf_counter() - start) / count
    timing = dict(rollout_s=None, reward_s=None, update_s=None, step_time_s=elapsed)
    return [dict({name: value[i] for name, value in stacked.items()}, **timing) for i in range(count)]

  def host_step(self) -> dict:
    """One RL step with its stages run one by one, the reward on the host; times each stage
    (summed over the sampling rounds of dynamic sampling)."""
    seconds = dict(rollout=0.0, reward=0.0, update=0.0)
    begin = mark = time.perf_counter()

    def observe(stage, value):
      nonlocal mark
      jax.block_until_ready(value)
      now = time.perf_counter()
      seconds[stage] += now - mark
      mark = now

    with jax.set_mesh(self.mesh):
      self.state, metrics = self.rl_step(self.state, self.held, observe)
      metrics = to_host(metrics)
    return dict(metrics, rollout_s=seconds['rollout'], reward_s=seconds['reward'], update_s=seconds['update'],
                step_time_s=mark - begin)

  def record(self, step: int, metrics: dict) -> dict:
    step_time, tokens = metrics['step_time_s'], float(metrics.pop('completion_tokens'))
    metrics['tokens_per_s'] = tokens / step_time
    if metrics.get('rollout_s'):  # the host loop times its stages: the sampler's own rate ...
      metrics['rollout_tokens_per_s'] = tokens / metrics['rollout_s']
    if metrics.get('update_s'):  # ... and the update's, over the real (prompt + completion) tokens it trained on
      metrics['update_tokens_per_s'] = float(metrics['sequence_tokens']) / metrics['update_s']
    metrics['mfu'] = self.step_flops / step_time / self.peak_flops
    return self.log.write(step, metrics)

  def save(self) -> None:
    meta = dict(step=self.step, data_position=self.data_position, task_state=self.task.state_dict(),
                config=config_lib.to_dict(self.config), architecture=self.architecture, base=self.base)
    self.checkpointer.save(self.step, self.state.checkpointed(), meta)
    self.saved_step = self.step

  def check_skips(self) -> int:
    """The updates skipped in a row (non-finite), after stopping the run when there are too many."""
    skips = int(distributed.host_value(self.state.skips))
    return stop_on_skips(self.checkpointer, skips, self.config.train.max_consecutive_skips, self.step)

  def close(self, completed: bool = True) -> None:
    """Ends the run's checkpoints and logs; a completed run's trackers get its plots and files first."""
    self.snapshots.close()
    self.checkpointer.close()
    self.log.close()
    if self.trackers:
      if completed:
        files = plots(self.log.history, self.workdir, self.config.run.name)
        self.trackers.log_files(self.step, files + [os.path.join(self.workdir, name) for name in
                                                    ('eval.jsonl', 'config.yaml')])
      self.trackers.close(failed=not completed)


class InTrainingEval:
  """The `eval` section during training: the task's evaluator on the live parameters every `eval.every`
  steps, after the last step, and once before the first (the untrained baseline); each summary
  goes to eval.jsonl (and the step's metrics row), each problem's samples to eval/samples_<step>.jsonl."""

  def __init__(self, config: config_lib.Config, workdir: str, run: 'Run', task: Task):
    self.every, self.total, self.workdir, self.run = config.eval.every, config.train.steps, workdir, run
    self.evaluator = build_evaluator(config, task, run.rl_step.graphdef, run.state.policy)
    # A run restarted before its first checkpoint evaluates its baseline again: its old row goes.
    self.log = metrics_lib.MetricsLog(workdir, resume_step=run.step or -1, tensorboard=False, name='eval.jsonl',
                                      write=run.primary)

  def due(self, step: int) -> bool:
    return step % self.every == 0 or step == self.total

  def __call__(self) -> dict:
    step = self.run.step
    with jax.set_mesh(self.run.mesh):
      samples = os.path.join(self.workdir, 'eval', f'samples_{step}.jsonl')
    summary = self.evaluator.run(self.run.state.policy, samples)
    self.log.write(step, summary)
    self.run.trackers.log_samples(step, samples)
    shown = ', '.join(f'{name[5:]} {value:.3f}' for name, value in summary.items()
                      if name.count('/') == 1 and isinstance(value, float))
    if self.run.primary:
      print(f'eval at step {step}: {shown}', file=sys.stderr, flush=True)
    return summary

  def close(self) -> None:
    self.evaluator.close()
    self.log.close()


def train(config: config_lib.Config, workdir: str, mesh, model) -> list[dict]:
  """Runs (or resumes) the loop to `train.steps`; returns the metrics history."""
  task = build_task(config)
  evaluation = None
  try:
    run = Run(config, workdir, mesh, model, task)
    completed = False
    try:
      total, every = config.train.steps, config.train.checkpoint_every
      if config.eval.every:
        evaluation = InTrainingEval(config, workdir, run, task)
        if run.step == 0:
          evaluation()
      # The rollout mode says how many steps one call may run (split devices: one, from the host).
      chunk = run.rl_step.host_mode.steps_per_call(config.train.steps_per_call)
      progress = metrics_lib.ProgressBar(total, start=run.step, enabled=config.train.progress and run.primary)
      # The step is read from the state once (a host read; with split devices across processes,
      # an all-gather) and then counted here: each call runs len(rows) steps.
      step = run.step
      while step < total:
        first = step
        rows = run.fused_steps(min(chunk, total - first)) if chunk > 1 else [run.host_step()]
        step = first + len(rows)
        if evaluation is not None and evaluation.due(step):
          rows[-1].update(evaluation())
        if run.snapshots.due(step, last=step == total):  # the wait: the policy's copy to the host
          rows[-1]['export_hf_s'] = run.snapshots.take(step, run.state)
        for offset, row in enumerate(rows, start=1):
          written = run.record(first + offset, row)
        progress.update(step, written['reward_mean'])
        skips = run.check_skips()
        # A step whose update was skipped adds nothing worth keeping: checkpoints stay good ones.
        if every and step % every == 0 and step < total and skips == 0:
          run.save()
      if run.saved_step != run.step:
        run.save()
      completed = True
    finally:
      if evaluation is not None:
        evaluation.close()
      run.close(completed)
  finally:
    task.close()  # the math task's reward worker processes
  return run.log.history


def plots(history: list[dict], workdir: str, name: str) -> list[str]:
  """The run's reward plots written into the workdir (reward.png; reward_terms.png with two terms or
  more): their paths, none without matplotlib."""
  plot = metrics_lib.plot_rewards(history, os.path.join(workdir, 'reward.png'), f'{name}: mean reward per step')
  terms = metrics_lib.plot_reward_terms(history, os.path.join(workdir, 'reward_terms.png'),
                                        f'{name}: each reward term (raw) per step')
  return [path for path in (plot, terms) if path]


def report(history: list[dict], workdir: str, name: str) -> None:
  print('\n' + metrics_lib.summary_table(history))
  written = plots(history, workdir, name)
  plot, terms = (any(path.endswith(f'/{file}') for path in written) for file in ('reward.png', 'reward_terms.png'))
  first = [row['reward_mean'] for row in history[:10]]
  last = [row['reward_mean'] for row in history[-10:]]
  print(f'\nmean reward: first {len(first)} steps {sum(first) / len(first):.3f}, '
        f'last {len(last)} steps {sum(last) / len(last):.3f}')
  logs = ''.join(f', {name}' for name in ('tensorboard/', 'wandb/', 'mlflow.db')
                 if os.path.exists(os.path.join(workdir, name.rstrip('/'))))
  print(f'outputs: {workdir} (config.yaml, metrics.jsonl{logs}, checkpoints/'
        f'{", reward.png" if plot else ""}{", reward_terms.png" if terms else ""})')


@cli_main
def main(argv=None):
  args = parse_args(sys.argv[1:] if argv is None else argv)
  config = config_lib.load_config(args.config, args.overrides)
  distributed.initialize(config.distributed)
  if jax.process_count() > 1:
    if not (args.workdir or config.run.workdir):
      raise UserError('a multi-host run needs one --workdir (or run.workdir) shared by every process')
    if not config.task.jittable and config.rollout.prompts_per_step % jax.process_count():
      # Each process scores whole groups of its own rows: the prompts must split evenly.
      raise UserError(f'rollout.prompts_per_step={config.rollout.prompts_per_step} must be a multiple of the '
                      f'{jax.process_count()} processes when the reward is scored on the hosts (task {config.task.name!r})')
  workdir, mesh, model = setup(config, args.config, args.workdir)
  primary = distributed.is_primary()
  if primary:
    print(f'mesh: {sharding.describe(mesh)} over {jax.process_count()} process(es); model: '
          f'{model.config.num_params() / 1e6:.2f}M parameters, '
          f'{sharding.bytes_per_device(nnx.state(model)) / 2**20:.1f} MiB on the fullest device', flush=True)
  history = train(config, workdir, mesh, model)
  if primary:
    report(history, workdir, config.run.name)


if __name__ == '__main__':
  main()
