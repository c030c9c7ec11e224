"""Experiment trackers beside metrics.jsonl: Weights & Biases and MLflow (`train.loggers`).

Each tracker gets every step's scalars under the names metrics.jsonl uses, with the RL step as its
x-axis; the run's resolved config as the run's parameters; each in-training evaluation's samples as
a table (W&B) or an artifact (MLflow); and, at the end, the reward plot, eval.jsonl and config.yaml.

A tracker's run id is stored in the workdir (trackers.json), so a resumed run continues the same
tracker run. W&B offline writes a new `wandb/offline-run-*` folder under the same id at each start
(`wandb sync` joins them); steps a crash makes the run compute again (those after its last
checkpoint) are logged again with the same values, as resume is exact: W&B keeps a step's first
record, and the MLflow tracker skips the steps its run already holds.

Only process 0 of a multi-host run logs. A tracker whose package is missing, or which fails to start
(a login, a server), is one line on stderr and the run goes on with the others, unless
`train.required_loggers` names it: then the run stops in one line before any step. The packages are
optional (requirements-trackers.txt) and imported only when a tracker is named.
"""

import json
import math
import os
import re
import sys
import time

from grpo_jax.errors import UserError

TRACKERS = ('wandb', 'mlflow')
LOGGERS = ('jsonl', 'tensorboard') + TRACKERS
STATE_FILE = 'trackers.json'
SAMPLE_ROWS = 256  # rows of an evaluation's samples file a W&B table holds


def _say(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


def flat_keys(tree: dict, prefix: str = '') -> dict:
  """A nested config dict as {'a.b.c': value} (an empty section has no keys): MLflow's parameters,
  and what train.changed_keys compares."""
  flat = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      flat.update(flat_keys(value, f'{prefix}{key}.'))
    else:
      flat[f'{prefix}{key}'] = value
  return flat


def _read_state(workdir: str) -> dict:
  path = os.path.join(workdir, STATE_FILE)
  if not os.path.exists(path):
    return {}
  try:
    with open(path) as f:
      state = json.load(f)
  except (OSError, ValueError) as error:
    raise UserError(f'{path} cannot be read as JSON ({error}); it holds the tracker runs this workdir continues: '
                    'fix it, or delete it to start new tracker runs') from None
  return state if isinstance(state, dict) else {}


def _write_state(workdir: str, state: dict) -> None:
  path = os.path.join(workdir, STATE_FILE)
  temporary = path + '.tmp'
  with open(temporary, 'w') as f:
    json.dump(state, f, indent=2)
  os.replace(temporary, path)


class WandbTracker:
  """A W&B run: offline unless an API key is there (train.wandb_mode: auto) or online is asked for."""

  name = 'wandb'

  def __init__(self, train, run_name: str, config: dict, workdir: str, run_id: str | None, resume_step: int):
    import wandb

    self.wandb = wandb
    mode, why = self._mode(train.wandb_mode)
    settings = wandb.Settings(console='off', silent=True, disable_code=True, init_timeout=120)
    self.run = wandb.init(project=train.wandb_project, entity=train.wandb_entity, name=run_name, dir=workdir,
                          id=run_id, resume='allow' if run_id else None, config=config, mode=mode,
                          settings=settings)
    if run_id:  # a resumed run: the config may have changed (train.py prints how)
      self.run.config.update(config, allow_val_change=True)
    self.id = self.run.id
    where = (f'files in {self.run.dir.removesuffix("/files")} (upload: wandb sync {workdir}/wandb/offline-run-*)'
             if mode == 'offline' else self.run.url or '')
    verb = f'resumed run {self.id} at step {resume_step}' if run_id else f'run {self.id}'
    _say(f'wandb: {mode} ({why}), {verb}; {where}')

  @staticmethod
  def _mode(setting: str) -> tuple[str, str]:
    if setting != 'auto':
      return setting, f'train.wandb_mode={setting}'
    environment = os.environ.get('WANDB_MODE')
    if environment:
      return ('offline' if environment in ('offline', 'dryrun') else environment), f'WANDB_MODE={environment}'
    if os.environ.get('WANDB_API_KEY'):
      return 'online', 'WANDB_API_KEY is set'
    netrc = os.path.join(os.path.expanduser('~'), '.netrc')
    if os.path.exists(netrc):
      with open(netrc, errors='replace') as f:
        if 'api.wandb.ai' in f.read():
          return 'online', '~/.netrc has a wandb login'
    return 'offline', 'no WANDB_API_KEY or wandb login here'

  def log(self, step: int, scalars: dict) -> None:
    self.run.log(scalars, step=step)

  def log_samples(self, step: int, path: str) -> None:
    rows = _read_rows(path, SAMPLE_ROWS)
    if not rows:
      return
    columns = sorted({key for row in rows for key in row})
    table = self.wandb.Table(columns=columns, data=[[_cell(row.get(c)) for c in columns] for row in rows])
    self.run.log({'eval/samples': table}, step=step)

  def log_files(self, step: int, paths: list[str]) -> None:
    """The plots as images, eval.jsonl as a table; config.yaml is the run's config already."""
    images = {f'plots/{os.path.splitext(os.path.basename(p))[0]}': self.wandb.Image(p) for p in paths
              if p.endswith('.png')}
    if images:
      self.run.log(images, step=step)
    for path in paths:
      if path.endswith('.jsonl'):  # eval.jsonl: the evaluation table
        rows = _read_rows(path, None)
        if rows:
          columns = list(dict.fromkeys(key for row in rows for key in row))
          self.run.summary['eval/table'] = self.wandb.Table(columns=columns,
                                                            data=[[_cell(row.get(c)) for c in columns] for row in rows])

  def close(self, failed: bool) -> None:
    self.run.finish(exit_code=1 if failed else 0)


class MlflowTracker:
  """An MLflow run in `train.mlflow_tracking_uri` (else $MLFLOW_TRACKING_URI, else a sqlite store
  in the workdir), experiment `train.mlflow_experiment` (else run.name)."""

  name = 'mlflow'
  BATCH = 100  # MLflow's limit on params (and on tags) in one log_batch
  VALUE_CHARS = 6000  # MLflow's limit on a param's value

  def __init__(self, train, run_name: str, config: dict, workdir: str, run_id: str | None, resume_step: int):
    import logging

    from mlflow.entities import Metric, Param, RunTag
    from mlflow.tracking import MlflowClient

    logging.getLogger('mlflow').setLevel(logging.WARNING)  # its table-creation notes on a new store
    logging.getLogger('alembic').setLevel(logging.WARNING)
    self.Metric, self.Param, self.RunTag = Metric, Param, RunTag
    uri = train.mlflow_tracking_uri or os.environ.get('MLFLOW_TRACKING_URI')
    # The default store is the workdir's, and so are its artifacts: MLflow would put them in the
    # working directory's ./mlruns. A given store keeps its own (a server's artifact root).
    artifacts = None if uri else 'file://' + os.path.join(os.path.abspath(workdir), 'mlflow-artifacts')
    uri = uri or 'sqlite:///' + os.path.join(os.path.abspath(workdir), 'mlflow.db')
    self.client = MlflowClient(tracking_uri=uri)
    experiment_name = train.mlflow_experiment or run_name
    if run_id:
      run = self.client.get_run(run_id)
      self.client.update_run(run_id, status='RUNNING')
      held = self.client.get_metric_history(run_id, 'reward_mean')
      self.logged = max((m.step for m in held), default=-1)
    else:
      experiment = self.client.get_experiment_by_name(experiment_name)
      experiment_id = (experiment.experiment_id if experiment is not None
                       else self.client.create_experiment(experiment_name, artifact_location=artifacts))
      run = self.client.create_run(experiment_id, run_name=run_name, tags={'mlflow.source.name': 'grpo_jax.train'})
      self.logged = -1
    self.id = run.info.run_id
    self._log_params(config, dict(run.data.params) if run_id else {}, resume_step)
    verb = f'resumed run {self.id} at step {resume_step}' if run_id else f'run {self.id}'
    _say(f'mlflow: {verb} in experiment {experiment_name!r} at {uri}')

  def _log_params(self, config: dict, held: dict, step: int) -> None:
    """The config as params; on resume, keys already held with another value (MLflow params are
    written once) as tags `config_at_step_<step>.<key>`."""
    params, tags = [], []
    for key, value in flat_keys(config).items():
      text = json.dumps(value) if isinstance(value, (list, dict)) else str(value)
      text = text if len(text) <= self.VALUE_CHARS else text[:self.VALUE_CHARS - 3] + '...'
      if key not in held:
        params.append(self.Param(key, text))
      elif held[key] != text:
        tags.append(self.RunTag(f'config_at_step_{step}.{key}', text))
    for start in range(0, len(params), self.BATCH):
      self.client.log_batch(self.id, params=params[start:start + self.BATCH])
    for start in range(0, len(tags), self.BATCH):
      self.client.log_batch(self.id, tags=tags[start:start + self.BATCH])

  def log(self, step: int, scalars: dict) -> None:
    if step <= self.logged:  # a step this run holds already (a resume after a crash computes it again)
      return
    now = int(time.time() * 1000)
    metrics = [self.Metric(mlflow_name(name), value, now, step) for name, value in scalars.items()]
    for start in range(0, len(metrics), 1000):  # MLflow's limit on metrics in one log_batch
      self.client.log_batch(self.id, metrics=metrics[start:start + 1000])

  def log_samples(self, step: int, path: str) -> None:
    if os.path.exists(path):
      self.client.log_artifact(self.id, path, artifact_path='eval')

  def log_files(self, step: int, paths: list[str]) -> None:
    for path in paths:
      self.client.log_artifact(self.id, path)

  def close(self, failed: bool) -> None:
    self.client.set_terminated(self.id, status='FAILED' if failed else 'FINISHED')


def mlflow_name(name: str) -> str:
  """A metric name as MLflow takes it: its letters, digits and `_-. /:` kept, '@' written '_at_'
  (eval/pass@1 -> eval/pass_at_1), anything else '_'."""
  return re.sub(r'[^A-Za-z0-9_\-. /:]', '_', name.replace('@', '_at_'))


def _read_rows(path: str, limit: int | None) -> list[dict]:
  if not os.path.exists(path):
    return []
  rows = []
  with open(path) as f:
    for line in f:
      if line.strip():
        rows.append(json.loads(line))
        if limit is not None and len(rows) >= limit:
          break
  return rows


def _cell(value):
  if isinstance(value, (dict, list)):
    return json.dumps(value)
  return value


class Trackers:
  """The run's trackers, each called through a guard: one that raises mid-run is one line on
  stderr and is dropped (the run and the other loggers go on), unless it is required."""

  def __init__(self, trackers: list, required: tuple[str, ...]):
    self.trackers, self.required = trackers, required
    self.samples: list[tuple[int, str]] = []  # evaluations' samples waiting for their step's row

  @classmethod
  def open(cls, train, run_name: str, config: dict, workdir: str, resume_step: int, primary: bool) -> 'Trackers':
    """The trackers `train.loggers` names (none on a process other than 0). A new run forgets the
    tracker runs of a workdir's earlier attempt that saved no checkpoint (resume_step 0)."""
    named = [name for name in train.loggers if name in TRACKERS]
    if not primary or not named:
      return cls([], train.required_loggers)
    state = _read_state(workdir) if resume_step > 0 else {}
    opened = []
    for name in named:
      kind = WandbTracker if name == 'wandb' else MlflowTracker
      try:
        opened.append(kind(train, run_name, config, workdir, state.get(name), resume_step))
      except ImportError as error:
        cls._failed(name, f'its package is not installed ({error}); pip install -r requirements-trackers.txt',
                    train.required_loggers, opened)
      except Exception as error:  # a login, a server, a store: the tracker's own errors
        cls._failed(name, f'it did not start: {type(error).__name__}: {_first_line(error)}', train.required_loggers,
                    opened)
    state.update({tracker.name: tracker.id for tracker in opened})
    if opened:
      _write_state(workdir, state)
    return cls(opened, train.required_loggers)

  @staticmethod
  def _failed(name: str, why: str, required: tuple[str, ...], opened: list) -> None:
    if name in required:
      for tracker in opened:
        tracker.close(failed=True)
      raise UserError(f'train.loggers: {name}: {why} (train.required_loggers names it)')
    _say(f'note: train.loggers: {name} is off for this run: {why}; the other loggers go on')

  def __bool__(self) -> bool:
    return bool(self.trackers)

  def _each(self, method: str, *args) -> None:
    for tracker in list(self.trackers):
      try:
        getattr(tracker, method)(*args)
      except Exception as error:
        if tracker.name in self.required:
          raise UserError(f'train.loggers: {tracker.name} failed ({type(error).__name__}: {_first_line(error)}) '
                          '(train.required_loggers names it)') from error
        _say(f'note: train.loggers: {tracker.name} failed ({type(error).__name__}: {_first_line(error)}); '
             'it is off for the rest of the run, the other loggers go on')
        self.trackers.remove(tracker)

  def log(self, step: int, row: dict) -> None:
    if self.trackers:
      self._flush_samples(before=step)
      scalars = {k: v for k, v in row.items() if k != 'step' and v is not None}  # MetricsLog made NaN None
      self._each('log', step, scalars)
      self._flush_samples(before=step + 1)

  def log_samples(self, step: int, path: str) -> None:
    """An evaluation's samples at `step`, logged once the step's row is: a fused call evaluates
    after its last step, before its K rows are logged, and W&B drops a step logged after a later one."""
    if self.trackers:
      self.samples.append((step, path))

  def _flush_samples(self, before: int) -> None:
    due = [(step, path) for step, path in self.samples if step < before]
    self.samples = [(step, path) for step, path in self.samples if step >= before]
    for step, path in due:
      self._each('log_samples', step, path)

  def log_files(self, step: int, paths: list[str]) -> None:
    paths = [p for p in paths if p and os.path.exists(p)]
    if paths:
      self._each('log_files', step, paths)

  def close(self, failed: bool) -> None:
    self._flush_samples(before=math.inf)
    self._each('close', failed)
    self.trackers = []


def _first_line(error: BaseException) -> str:
  text = str(error).strip()
  return text.splitlines()[0] if text else '(no message)'
