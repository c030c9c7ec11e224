"""W&B and MLflow as trackers (grpo_jax/trackers.py), offline: each step's scalars under the names
metrics.jsonl uses, the config as the run's parameters, samples and plots; a resumed run continues
the same tracker run; a tracker that cannot start is one line and the run goes on, unless required.

The W&B offline run's records are read from its .wandb files (a LevelDB-style log of the run's
protobuf records: a 7-byte header, then 32 KiB blocks of chunks), MLflow's from its
sqlite store through its client."""

import dataclasses
import glob
import json
import os
import struct

import pytest

from grpo_jax import config as config_lib
from grpo_jax.errors import UserError
from grpo_jax.trackers import Trackers, mlflow_name

from runs import train_here

BLOCK = 32 * 1024


@pytest.fixture
def offline(monkeypatch, tmp_path):
  """W&B with no login and its caches under the test's folder; MLflow's default store."""
  for name in ('WANDB_API_KEY', 'WANDB_MODE', 'MLFLOW_TRACKING_URI'):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setenv('HOME', str(tmp_path / 'home'))
  for name in ('WANDB_CACHE_DIR', 'WANDB_CONFIG_DIR', 'WANDB_DATA_DIR', 'WANDB_ARTIFACT_DIR'):
    monkeypatch.setenv(name, str(tmp_path / 'home' / name.lower()))


def wandb_records(path: str):
  """The protobuf records of one .wandb file."""
  from wandb.proto import wandb_internal_pb2

  data = open(path, 'rb').read()
  assert data[:4] == b':W&B', path
  position, pending = 7, b''
  while position + 7 <= len(data):
    left = BLOCK - position % BLOCK
    if left < 7:
      position += left
      continue
    _, length, kind = struct.unpack('<IHB', data[position:position + 7])  # a CRC-32C, a length, a kind
    if kind == 0:  # the rest of the block is padding
      position += left
      continue
    chunk = data[position + 7:position + 7 + length]
    position += 7 + length
    pending = chunk if kind in (1, 2) else pending + chunk
    if kind in (1, 4):
      record = wandb_internal_pb2.Record()
      record.ParseFromString(pending)
      yield record


def wandb_runs(workdir: str) -> list[dict]:
  """Each offline-run folder: its run id, config, and history {step: {name: value}}."""
  runs = []
  for path in sorted(glob.glob(os.path.join(workdir, 'wandb', 'offline-run-*', 'run-*.wandb'))):
    run = dict(id=None, config={}, history={}, tables=[])
    for record in wandb_records(path):
      kind = record.WhichOneof('record_type')
      if kind == 'run':
        run['id'] = record.run.run_id
        run['config'].update({item.key: json.loads(item.value_json) for item in record.run.config.update})
      elif kind == 'config':
        run['config'].update({item.key: json.loads(item.value_json) for item in record.config.update})
      elif kind == 'history':
        items = {item.key or '/'.join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
        step = items.pop('_step')
        tables = sorted({name.removesuffix('/_type') for name, value in items.items()
                         if name.endswith('/_type') and value == 'table-file'})
        run['tables'] += [(step, table) for table in tables]
        run['history'][step] = {name: value for name, value in items.items() if not name.startswith('_')
                                and not any(name.startswith(table + '/') for table in tables)}
    runs.append(run)
  return runs


def mlflow_run(workdir: str, run_id: str):
  from mlflow.tracking import MlflowClient

  client = MlflowClient(tracking_uri='sqlite:///' + os.path.join(workdir, 'mlflow.db'))
  return client, client.get_run(run_id)


def _train(loggers=('jsonl', 'wandb', 'mlflow'), **fields):
  return dataclasses.replace(config_lib.TrainConfig(), loggers=tuple(loggers), **fields)


def _rows(steps, seed=0):
  import numpy as np
  rng = np.random.default_rng(seed)
  return {step: {'step': step, 'reward_mean': float(rng.random()), 'eval/pass@1': float(rng.random()), 'kl': None}
          for step in steps}


def test_scalars_config_samples_and_resume_into_the_same_runs(offline, tmp_path):
  """Steps 1-4 logged, then a 'crash' after the checkpoint of step 2: the resumed run logs 3-6 (3
  and 4 again, with equal values: resume is exact) into the same W&B and MLflow runs, with a
  changed config. W&B: two offline folders under one id, every step's scalars, the config, the
  samples table; MLflow: each step once, '@' spelled '_at_', the config as params and its change as
  a tag, the samples and files as artifacts, the run FINISHED."""
  workdir = str(tmp_path / 'run')
  os.makedirs(workdir)
  config = config_lib.to_dict(config_lib.Config())
  rows = _rows(range(1, 7))
  samples = os.path.join(workdir, 'eval', 'samples_4.jsonl')
  os.makedirs(os.path.dirname(samples))
  with open(samples, 'w') as f:
    f.writelines(json.dumps(dict(prompt=f'{i}+1=', completion=str(i + 1), correct=True)) + '\n' for i in range(3))

  first = Trackers.open(_train(), 'trial', config, workdir, resume_step=0, primary=True)
  assert [tracker.name for tracker in first.trackers] == ['wandb', 'mlflow']
  for step in range(1, 3):
    first.log(step, rows[step])
  first.log_samples(4, samples)  # as a fused call of steps 3-4 evaluates after step 4, before logging its rows
  for step in range(3, 5):
    first.log(step, rows[step])
  first.close(failed=True)  # the process died after step 4; its checkpoint is step 2's
  stored = json.load(open(os.path.join(workdir, 'trackers.json')))

  changed = dict(config, algo=dict(config['algo'], group_size=16))
  second = Trackers.open(_train(), 'trial', changed, workdir, resume_step=2, primary=True)
  assert {tracker.name: tracker.id for tracker in second.trackers} == stored
  for step in range(3, 7):
    second.log(step, rows[step])
  with open(os.path.join(workdir, 'config.yaml'), 'w') as f:
    f.write('run: {name: trial}\n')
  second.log_files(6, [os.path.join(workdir, 'config.yaml')])
  second.close(failed=False)

  folders = wandb_runs(workdir)
  assert [run['id'] for run in folders] == [stored['wandb']] * 2
  assert sorted(folders[0]['history']) == [1, 2, 3, 4] and sorted(folders[1]['history']) == [3, 4, 5, 6]
  for run in folders:
    for step, logged in run['history'].items():
      expected = {k: v for k, v in rows[step].items() if k != 'step' and v is not None}
      assert logged == expected, step
  assert folders[0]['config']['algo']['group_size'] == config['algo']['group_size']
  assert folders[1]['config']['algo']['group_size'] == 16
  assert folders[0]['tables'] == [(4, 'eval/samples')]

  client, run = mlflow_run(workdir, stored['mlflow'])
  for name in ('reward_mean', 'eval/pass@1'):
    history = client.get_metric_history(run.info.run_id, mlflow_name(name))
    assert sorted((m.step, m.value) for m in history) == [(s, rows[s][name]) for s in range(1, 7)], name
  assert mlflow_name('eval/pass@1') == 'eval/pass_at_1' and 'kl' not in run.data.metrics
  assert run.data.params['algo.group_size'] == str(config['algo']['group_size'])
  assert run.data.tags['config_at_step_2.algo.group_size'] == '16'
  assert run.info.status == 'FINISHED'
  artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
  assert artifacts == {'eval', 'config.yaml'}
  assert [a.path for a in client.list_artifacts(run.info.run_id, 'eval')] == ['eval/samples_4.jsonl']
  assert os.path.isfile(os.path.join(workdir, 'mlflow-artifacts', run.info.run_id, 'artifacts', 'config.yaml'))
  assert not os.path.exists('mlruns')  # nothing in the working directory


def test_a_tracker_that_cannot_start_is_one_line_unless_required(offline, tmp_path, monkeypatch, capsys):
  """MLflow at a store it cannot open, W&B without its package: one line each and no tracker (the
  run goes on); named in train.required_loggers, the run stops in one line. Bad names are refused
  by the config."""
  workdir = str(tmp_path)
  bad_store = dict(mlflow_tracking_uri='nothing://here')
  trackers = Trackers.open(_train(['jsonl', 'mlflow'], **bad_store), 'trial', {}, workdir, 0, primary=True)
  assert not trackers
  note = capsys.readouterr().err.strip().splitlines()
  assert len(note) == 1 and note[0].startswith('note: train.loggers: mlflow is off for this run: it did not start')
  with pytest.raises(UserError, match=r'^train.loggers: mlflow: it did not start: .*\(train.required_loggers names it\)$'):
    Trackers.open(_train(['jsonl', 'mlflow'], required_loggers=('mlflow',), **bad_store), 'trial', {}, workdir, 0,
                  primary=True)

  monkeypatch.setitem(__import__('sys').modules, 'wandb', None)  # `import wandb` raises ImportError
  assert not Trackers.open(_train(['wandb']), 'trial', {}, workdir, 0, primary=True)
  assert 'wandb is off for this run: its package is not installed' in capsys.readouterr().err
  assert not Trackers.open(_train(['wandb', 'mlflow']), 'trial', {}, workdir, 0, primary=False)  # not process 0

  for fields, message in [(dict(loggers=('jsonl', 'neptune')), "train.loggers 'neptune' is not a logger"),
                          (dict(loggers=('jsonl',), required_loggers=('wandb',)),
                           "train.required_loggers names 'wandb', which train.loggers does not"),
                          (dict(loggers=('tensorboard', 'tensorboard')), 'train.loggers names a logger twice')]:
    with pytest.raises(UserError, match=message):
      config_lib.TrainConfig(**fields)


@pytest.mark.exhaustive
def test_a_training_run_logs_every_step_and_resumes_into_the_same_runs(offline, tmp_path):
  """The arith demo for 4 steps with both trackers, then resumed to 6: the trackers hold every
  step's metrics.jsonl scalars (MLflow each step once), the reward plot and the config."""
  workdir = tmp_path / 'run'
  common = ['train.steps_per_call=1', 'train.checkpoint_every=2', 'train.progress=false',
            'train.loggers=[jsonl, wandb, mlflow]']
  train_here(workdir, 'configs/tiny_arith.yaml', 'train.steps=4', *common)
  history = train_here(workdir, 'configs/tiny_arith.yaml', 'train.steps=6', *common)
  stored = json.load(open(workdir / 'trackers.json'))
  folders = wandb_runs(str(workdir))
  assert [run['id'] for run in folders] == [stored['wandb']] * 2
  logged = {step: values for run in folders for step, values in run['history'].items()}
  client, run = mlflow_run(str(workdir), stored['mlflow'])
  assert [row['step'] for row in history] == list(range(1, 7))
  for row in history:
    scalars = {k: v for k, v in row.items() if k != 'step' and v is not None}
    assert {k: logged[row['step']][k] for k in scalars} == pytest.approx(scalars, rel=1e-6), row['step']
  for name in ('reward_mean', 'policy_loss', 'tokens_per_s'):
    values = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, mlflow_name(name)))
    assert values == [(row['step'], pytest.approx(row[name])) for row in history if row.get(name) is not None], name
  assert {a.path for a in client.list_artifacts(run.info.run_id)} == {'reward.png', 'config.yaml'}
  assert run.info.status == 'FINISHED'
