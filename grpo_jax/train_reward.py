"""python -m grpo_jax.train_reward --config configs/X.yaml [--set a.b=c ...] [--workdir DIR]

Trains a reward model on preference pairs with the Bradley-Terry loss (rl/preference.py): from a
sequence classifier, from a language model given a fresh score head, or from random weights
(model/score_head.py); every parameter, or with model.lora the adapters and the score head. Each
step is one optimizer update on `preferences.pairs_per_batch` pairs in the run's seeded order
(data/preference_set.py); held-out pairwise accuracy and loss every `eval.every` steps and after the
last. The workdir holds config.yaml, metrics.jsonl, eval.jsonl, checkpoints/ (the trained
parameters, the optimizer state and the data position; restarting with the same workdir resumes
from the newest complete one, exactly) and, once the run ends, reward_model/: the model in the hub's
sequence-classification layout (with LoRA, merged) with its tokenizer, which transformers'
AutoModelForSequenceClassification loads.

A reward-model run shares the RL trainer's run, model, mesh, optim and train sections, its
checkpointer and its metrics log; it has no task, rollout or algo section.
"""

import argparse
import dataclasses
import os
import shutil
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpo_jax import config as config_lib
from grpo_jax import metrics as metrics_lib
from grpo_jax import sharding
from grpo_jax.checkpoint import Checkpointer
from grpo_jax.data.preference_set import PreferenceEvalConfig, PreferencesConfig, PreferenceSet
from grpo_jax.errors import UserError, cli_main, require
from grpo_jax.model import lora
from grpo_jax.model.hf_config import to_hf_dict
from grpo_jax.model.loading import ModelConfig, abstract_model, save_hf
from grpo_jax.model.score_head import build_reward_model
from grpo_jax.rl.optimizer import OptimConfig
from grpo_jax.rl.preference import PreferenceBatch, bradley_terry_terms, pair_scores, preference_update
from grpo_jax.rl.preference_packing import PackedLayout, micro_batch_lengths, padding_fractions, rows_used
from grpo_jax.rl.state import TrainState, create_train_state, train_state_shardings
from grpo_jax.sharding import MeshConfig
from grpo_jax.train import base_record, changed_keys, check_base, check_workdir, stop_on_skips
from grpo_jax.trackers import Trackers

KIND = 'reward_model'  # a checkpoint's meta says which trainer wrote it
EXPORT_DIR = 'reward_model'
SUMMARY = (('loss', '{:.4f}'), ('accuracy', '{:.3f}'), ('score_gap_mean', '{:+.3f}'), ('grad_norm', '{:.3f}'),
           ('eval/accuracy', '{:.3f}'), ('eval/loss', '{:.4f}'), ('step_time_s', '{:.3f}'))


@dataclasses.dataclass(frozen=True)
class RewardModelConfig:
  """A reward-model run's configuration: each section checks its own fields; this class the fields
  that span sections."""

  run: config_lib.RunConfig = config_lib.RunConfig()
  model: ModelConfig = ModelConfig()  # a sequence classifier, a language model (a fresh score head) or none
  mesh: MeshConfig = MeshConfig()
  preferences: PreferencesConfig = PreferencesConfig()  # the pairs and the loss (data/preference_set.py)
  optim: OptimConfig = OptimConfig()
  train: config_lib.TrainConfig = config_lib.TrainConfig()  # steps: optimizer updates
  eval: PreferenceEvalConfig = PreferenceEvalConfig()  # held-out pairs (data/preference_set.py)

  def __post_init__(self):
    require(self.train.steps_per_call == 1, 'train.steps_per_call',
            f'must be 1 for a reward model (one update per call), got {self.train.steps_per_call}')
    require(self.train.export_hf_every == 0, 'train.export_hf_every',
            f'applies to RL runs; a reward model is written in the hub layout at the end ({EXPORT_DIR}/), got '
            f'{self.train.export_hf_every}')


def load_config(path: str | None, overrides=()) -> RewardModelConfig:
  """The run's config from YAML with `--set` overrides (config.py's reader), local paths made
  absolute so the stored config finds them from any directory."""
  config = config_lib.read_sections(path, list(overrides), RewardModelConfig)
  resolved = config_lib.local_path
  preferences, evaluation = config.preferences, config.eval
  return dataclasses.replace(
      config, model=dataclasses.replace(config.model, path=resolved(config.model.path)),
      preferences=dataclasses.replace(preferences, source=resolved(preferences.source),
                                      tokenizer=resolved(preferences.tokenizer)),
      eval=dataclasses.replace(evaluation, source=resolved(evaluation.source)))


def _host(tree) -> dict:
  return {name: float(value) for name, value in jax.device_get(tree).items()}


class RewardRun:
  """A reward-model run on the host: the train state between jitted updates, the pairs, the
  checkpoints and the logs. The step counter is the state's."""

  def __init__(self, config: RewardModelConfig, workdir: str, mesh):
    model, self.tokenizer = build_reward_model(config.model, mesh, config.run.seed, config.preferences.tokenizer)
    # The architecture trained is the one built: the printed and stored config say so.
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, architecture=model.config))
    self.config, self.mesh, self.workdir = config, mesh, workdir
    self.data = PreferenceSet(config.preferences, config.eval, self.tokenizer, model.config.pad_token_id,
                              config.run.seed)
    self.graphdef, params = nnx.split(model)
    trained, frozen = lora.split_trainable(params)  # with LoRA: the adapters and the score head
    optimizer, schedule = config.optim.build(config.train.steps)
    shardings = train_state_shardings(trained, optimizer, frozen=frozen)
    with jax.set_mesh(mesh):
      self.state = create_train_state(trained, optimizer, config.run.seed, shardings=shardings, frozen=frozen)
    preferences = config.preferences
    self.packed = self.held_out_packed = self.fill = None
    if preferences.packing:
      self._lay_out_packing()
    update = lambda state, batch: preference_update(  # noqa: E731
        state, batch, graphdef=self.graphdef, optimizer=optimizer, schedule=schedule,
        micro_batches=preferences.micro_batches, center_coef=preferences.center_coef, packed=self.packed)
    self.update = jax.jit(update, out_shardings=(shardings, None), donate_argnums=0)
    self.evaluate_batch = jax.jit(self._evaluate_batch)
    self.architecture = to_hf_dict(model.config, dtype=config.model.options.param_dtype)
    self.base = base_record(config, self.architecture)
    self._open_checkpoints()
    with open(os.path.join(workdir, 'config.yaml'), 'w') as f:
      f.write(config_lib.to_yaml(config))
    self.trackers = Trackers.open(config.train, config.run.name, config_lib.to_dict(config), workdir, self.step,
                                  primary=True)
    self.log = metrics_lib.MetricsLog(workdir, resume_step=self.step, tensorboard=config.train.writes_tensorboard,
                                      trackers=self.trackers)
    # A run that starts from nothing evaluates its untrained model again: a baseline row left by a run
    # killed before its first checkpoint goes, as the steps it logged do.
    self.eval_log = metrics_lib.MetricsLog(workdir, resume_step=self.step or -1, tensorboard=False, name='eval.jsonl')

  def _lay_out_packing(self) -> None:
    """The packed rows of the run's micro-batches and of the held-out batches: as many per batch
    group as the fullest group of any batch fills (rl/preference_packing.py), found by packing
    every batch of the run's order now; per step, the padding of both layouts."""
    preferences, length = self.config.preferences, self.config.preferences.row_length
    micro, pairs = preferences.micro_batches, preferences.pairs_per_batch
    with jax.set_mesh(self.mesh):
      groups, held_out_groups = sharding.batch_groups(2 * pairs // micro), sharding.batch_groups(2 * pairs)
    lengths = self.data.pair_lengths(self.config.train.steps)
    rows = rows_used(micro_batch_lengths(lengths, micro), groups, length).reshape(len(lengths), micro, groups)
    self.packed = PackedLayout(rows=int(rows.max()), row_length=length)
    self.fill = padding_fractions(lengths, rows, self.packed, self.data.width)
    held_out = rows_used(micro_batch_lengths(self.data.held_out_lengths(), 1), held_out_groups, length)
    self.held_out_packed = PackedLayout(rows=int(held_out.max()), row_length=length)
    self.data.report.update(packed_rows=self.packed.rows * groups * micro, row_length=length,
                            padded_fill=round(1 - float(self.fill['padding_frac'].mean()), 3),
                            packed_fill=round(1 - float(self.fill['packed_padding_frac'].mean()), 3))

  def _open_checkpoints(self) -> None:
    """The checkpointer of workdir/checkpoints, and the state restored from its newest checkpoint."""
    checkpoints = os.path.join(self.workdir, 'checkpoints')
    try:
      os.makedirs(checkpoints, exist_ok=True)
    except OSError as error:
      raise UserError(f'workdir {self.workdir} cannot be created: {error.strerror or error}') from None
    self.checkpointer = Checkpointer(checkpoints, max_to_keep=self.config.train.max_to_keep)
    self.saved_step = self.checkpointer.latest_step()
    if self.saved_step is None:
      return
    where = f'checkpoint {self.checkpointer.directory}/{self.saved_step}'
    try:
      meta = self.checkpointer.meta(self.saved_step)
      if meta.get('kind') != KIND:
        raise UserError(f'{where} is not a reward-model run\'s (an RL run\'s, python -m grpo_jax.train?): use '
                        'a new workdir')
      if meta['pairs'] != len(self.data.train):
        raise UserError(f'{where} was trained on {meta["pairs"]} pairs, preferences.source now gives '
                        f'{len(self.data.train)}: the order would differ; resume with the same data or use a new '
                        'workdir')
      check_base(self.checkpointer, self.saved_step, self.base)
      restored, _ = self.checkpointer.restore(self.saved_step, self.state.checkpointed())
    except UserError:
      self.checkpointer.close()
      raise
    self.state = TrainState.restored(restored, self.state.position, frozen=self.state.frozen)
    changes = changed_keys(meta.get('config', {}), config_lib.to_dict(self.config))
    print(f'resumed from {self.checkpointer.directory}/{self.saved_step}'
          + (f' with a changed config: {"; ".join(changes)}' if changes else ''), file=sys.stderr, flush=True)

  @property
  def step(self) -> int:
    return int(jax.device_get(self.state.step))

  def _evaluate_batch(self, params, batch: PreferenceBatch) -> dict:
    """Sums over one batch of held-out pairs: correct pairs, loss terms, score gaps, real pairs."""
    chosen, rejected = pair_scores(nnx.merge(self.graphdef, params), batch, self.held_out_packed)
    weights = batch.weights
    terms = bradley_terry_terms(chosen, rejected, batch.margin, self.config.preferences.center_coef)
    return dict(correct=jnp.sum((chosen > rejected) * weights), loss=jnp.sum(terms * weights),
                gap=jnp.sum((chosen - rejected) * weights), pairs=jnp.sum(weights))

  def evaluate(self, step: int) -> dict:
    """Held-out pairwise accuracy, loss and mean score gap on the live parameters (those of step
    `step`), to eval.jsonl."""
    totals = dict(correct=0.0, loss=0.0, gap=0.0, pairs=0.0)
    with jax.set_mesh(self.mesh):
      for fields in self.data.held_out_batches():
        sums = _host(self.evaluate_batch(self.state.policy, PreferenceBatch(**fields)))
        totals = {name: totals[name] + sums[name] for name in totals}
    summary = {'eval/accuracy': totals['correct'] / totals['pairs'], 'eval/loss': totals['loss'] / totals['pairs'],
               'eval/score_gap_mean': totals['gap'] / totals['pairs'], 'eval/pairs': totals['pairs']}
    self.eval_log.write(step, summary)
    print(f'eval at step {step}: accuracy {summary["eval/accuracy"]:.3f}, loss {summary["eval/loss"]:.4f} '
          f'({int(totals["pairs"])} held-out pairs)', file=sys.stderr, flush=True)
    return summary

  def train_step(self, step: int) -> dict:
    """One update on the pairs of step `step` (0-based: the state's step, which the update counts);
    its metrics, timed."""
    where = self.data.position(step)
    batch = PreferenceBatch(**self.data.batch(step))
    start = time.perf_counter()
    with jax.set_mesh(self.mesh):
      self.state, metrics = self.update(self.state, batch)
      metrics = _host(metrics)
    if self.fill is not None:
      metrics.update({name: float(values[step]) for name, values in self.fill.items()})
    return dict(metrics, epoch=where['epoch'], step_time_s=time.perf_counter() - start)

  def save(self) -> None:
    step = self.step
    meta = dict(kind=KIND, step=step, data_position=self.data.position(step), pairs=len(self.data.train),
                config=config_lib.to_dict(self.config), architecture=self.architecture, base=self.base)
    self.checkpointer.save(step, self.state.checkpointed(), meta)
    self.saved_step = step

  def check_skips(self, step: int) -> int:
    """The updates skipped in a row (non-finite) by step `step`, after stopping the run when there
    are too many."""
    skips = int(jax.device_get(self.state.skips))
    return stop_on_skips(self.checkpointer, skips, self.config.train.max_consecutive_skips, step)

  def export(self) -> str:
    """workdir/reward_model: the trained model in the hub's sequence-classification layout (with
    LoRA, the adapters merged into the base), safetensors and config.json, with its tokenizer;
    written beside and renamed into place whole."""
    model = nnx.merge(self.graphdef, self.state.policy)
    settings = model.options.lora
    if settings is not None:
      plain = dataclasses.replace(model.options, lora=None, param_dtype=model.options.dtype)
      model = nnx.merge(nnx.graphdef(abstract_model(model.config, plain)), lora.merged(nnx.state(model), settings))
    out = os.path.join(self.workdir, EXPORT_DIR)
    staging = out + '.partial'
    shutil.rmtree(staging, ignore_errors=True)
    save_hf(model, staging)
    self.tokenizer.save_pretrained(staging)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(staging, out)
    return out

  def close(self, completed: bool = True) -> None:
    self.checkpointer.close()
    self.log.close()
    self.eval_log.close()
    if completed:
      self.trackers.log_files(self.step, [os.path.join(self.workdir, name) for name in ('eval.jsonl', 'config.yaml')])
    self.trackers.close(failed=not completed)


def train(config: RewardModelConfig, workdir: str, mesh) -> list[dict]:
  """Runs (or resumes) the loop to `train.steps`, then exports; returns the metrics history."""
  run = RewardRun(config, workdir, mesh)
  completed = False
  try:
    total, every, evaluate_every = config.train.steps, config.train.checkpoint_every, config.eval.every
    print(f'pairs: {run.data.report}', file=sys.stderr, flush=True)
    # The step is read from the state once and then counted here: each train_step is one update.
    step = run.step
    if evaluate_every and step == 0:
      run.evaluate(step)
    progress = metrics_lib.ProgressBar(total, start=step, enabled=config.train.progress, metric='accuracy')
    while step < total:
      row = run.train_step(step)
      step += 1
      if (evaluate_every and step % evaluate_every == 0) or step == total:
        row.update(run.evaluate(step))
      run.log.write(step, row)
      progress.update(step, row['accuracy'])
      skips = run.check_skips(step)
      if every and step % every == 0 and step < total and skips == 0:
        run.save()
    if run.saved_step != run.step:
      run.save()
    run.checkpointer.wait()
    exported = run.export()
    print(f'outputs: {workdir} (config.yaml, metrics.jsonl, eval.jsonl, checkpoints/, {EXPORT_DIR}/ = {exported})',
          file=sys.stderr, flush=True)
    completed = True
  finally:
    run.close(completed)
  return run.log.history


def setup(config: RewardModelConfig, config_path: str | None, workdir: str | None, devices=None):
  """(workdir, mesh): the workdir resolved and checked (nothing written yet), the mesh over `devices`."""
  workdir = config_lib.resolve_workdir(config, config_path, workdir)
  check_workdir(workdir)
  return workdir, sharding.make_mesh(config.mesh, devices=devices or jax.devices())


@cli_main
def main(argv=None):
  parser = argparse.ArgumentParser(prog='python -m grpo_jax.train_reward', description=__doc__.splitlines()[0])
  parser.add_argument('--config', required=True, help='YAML reward-model config (see configs/tiny_reward_model.yaml)')
  parser.add_argument('--set', action='append', default=[], metavar='KEY=VALUE', dest='overrides',
                      help='override one config key, e.g. --set preferences.pairs_per_batch=32 (repeatable)')
  parser.add_argument('--workdir', help='output directory (default: run.workdir or runs/<name>-<time>)')
  args = parser.parse_args(sys.argv[1:] if argv is None else argv)
  config = load_config(args.config, args.overrides)
  workdir, mesh = setup(config, args.config, args.workdir)
  history = train(config, workdir, mesh)
  if history:
    print('\n' + metrics_lib.summary_table(history, summary=SUMMARY))
    last = [row['accuracy'] for row in history[-10:]]
    held = [row['eval/accuracy'] for row in history if row.get('eval/accuracy') is not None]
    print(f'\ntraining accuracy over the last {len(last)} steps {np.mean(last):.3f}'
          + (f'; held-out accuracy {held[-1]:.3f}' if held else ''))


if __name__ == '__main__':
  main()
