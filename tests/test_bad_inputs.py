"""Broken and hostile inputs at the command lines: one `error:` line naming the field, file or
tensor, exit status 2, and nothing in an existing workdir or output directory changed."""

import glob
import hashlib
import os
import subprocess
import sys

import pytest

from grpo_jax.config import load_config
from grpo_jax.data.sources import load_records
from grpo_jax.errors import FieldError, UserError
from grpo_jax.model.hf_config import load_hf_config

# Its module-scoped fixtures are built once: the whole file runs on one xdist worker.
pytestmark = pytest.mark.xdist_group('test_bad_inputs')

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ['--config', 'configs/tiny_arith.yaml', '--set', 'train.steps=2', '--set', 'train.steps_per_call=1',
        '--set', 'train.checkpoint_every=1', '--set', 'train.progress=false', '--set', 'train.tensorboard=false']


def run_cli(module, *args, timeout=300):
  return subprocess.run([sys.executable, '-m', module, *args], cwd=ROOT, capture_output=True, text=True,
                        timeout=timeout)


def one_error_line(result, *fragments):
  """Exit status 2, one `error:` line holding `fragments`, and no traceback (not even the abandoned
  reads of a damaged orbax checkpoint)."""
  assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-3000:]
  lines = [line for line in result.stderr.splitlines() if line.strip()]
  errors = [line for line in lines if line.startswith('error: ')]
  assert len(errors) == 1 and 'Traceback' not in result.stderr and 'Exception' not in result.stderr, \
      result.stderr[-3000:]
  for fragment in fragments:
    assert fragment in errors[0], errors[0]


def snapshot(directory) -> dict:
  """relative path -> sha256 of every file under `directory`."""
  files = {}
  for path in sorted(glob.glob(os.path.join(directory, '**'), recursive=True)):
    if os.path.isfile(path):
      with open(path, 'rb') as f:
        files[os.path.relpath(path, directory)] = hashlib.sha256(f.read()).hexdigest()
  return files


@pytest.fixture(scope='module')
def trained_workdir(tmp_path_factory):
  """A finished 2-step run with checkpoints at steps 1 and 2."""
  workdir = tmp_path_factory.mktemp('run') / 'work'
  result = run_cli('grpo_jax.train', *TINY, '--workdir', str(workdir))
  assert result.returncode == 0, result.stderr[-3000:]
  return workdir


# ---- files that are not what they claim ----

def test_non_utf8_config_and_dataset_files_are_named(tmp_path):
  config = tmp_path / 'config.yaml'
  config.write_bytes(b'run:\n  name: \xff\xfe\n')
  with pytest.raises(UserError, match=f'config file {config} is not UTF-8 text'):
    load_config(str(config))
  data = tmp_path / 'data.jsonl'
  data.write_bytes(b'{"prompt": "1+1", "answer": "2"}\n{"prompt": "\xc3\x28"}\n')
  with pytest.raises(UserError, match=f'task.source {data} is not UTF-8 text'):
    load_records(str(data))
  one_error_line(run_cli('grpo_jax.train', '--config', str(config), '--workdir', str(tmp_path / 'w')),
                 str(config), 'not UTF-8')


def test_empty_config_file_is_refused(tmp_path):
  config = tmp_path / 'empty.yaml'
  config.write_text('# nothing but a comment\n')
  with pytest.raises(UserError, match='is empty'):
    load_config(str(config))


@pytest.mark.parametrize('text, kind', [('[1, 2]', 'list'), ('"qwen2"', 'str'), ('7', 'int')])
def test_config_json_that_is_not_an_object(tmp_path, text, kind):
  (tmp_path / 'config.json').write_text(text)
  with pytest.raises(UserError, match=f'must hold a JSON object of config fields, got a {kind}'):
    load_hf_config(str(tmp_path))


@pytest.mark.parametrize('field, value', [('warmup_steps', -1), ('decay_steps', -5), ('min_lr_ratio', 1.5),
                                          ('b1', 1.0), ('b2', -0.1), ('eps', 0.0), ('weight_decay', -0.01),
                                          ('max_grad_norm', -1.0)])
def test_optimizer_ranges(field, value):
  with pytest.raises(FieldError, match=f'optim.{field} must'):
    load_config(None, [f'optim.{field}={value}'])


@pytest.mark.parametrize('assignment, message', [
    ('run.seed=-1', 'run.seed must be >= 0'),
    ('algo.entropy_coef=-0.01', 'algo.entropy_coef must be >= 0'),
    ('algo.advantage_epsilon=-1e-6', 'algo.advantage_epsilon must be >= 0'),
    ('optim.learning_rate=.inf', "'optim.learning_rate' must be a finite number"),
    ('rollout.temperature=.nan', "'rollout.temperature' must be a finite number"),
    ('algo.kl_beta=-.inf', "'algo.kl_beta' must be a finite number"),
    ('mesh.tensor=-2', 'mesh.tensor must be a positive size or -1'),
    ('mesh.data=-1', 'mesh may have at most one axis of -1'),  # fsdp is -1 by default
    ('model.architecture.rms_norm_eps=0', 'rms_norm_eps must be positive'),
    ('model.architecture.rope_theta=-10000', 'rope_theta must be positive'),
    ('model.architecture.head_dim=0', 'head_dim must be positive'),
])
def test_numeric_ranges_outside_the_optimizer(assignment, message):
  """Every numeric option has a range, checked once at load, named as written."""
  with pytest.raises(UserError, match=message):
    load_config(None, [assignment])


@pytest.mark.parametrize('expert', [3, 6])
def test_an_expert_axis_that_does_not_divide_the_experts(expert):
  """The MoE demo's 8 experts over an expert axis of 3 (or 6) devices: the rule table would leave
  every expert whole on every device, silently; the run is refused before anything is built, as
  the plan's compile is (plan/programs.py calls the same check)."""
  import jax

  from grpo_jax.sharding import make_mesh
  config = load_config(os.path.join(ROOT, 'configs/tiny_arith_moe.yaml'), [f'mesh.expert={expert}', 'mesh.fsdp=1'])
  mesh = make_mesh(config.mesh, devices=jax.devices()[:expert])
  with pytest.raises(FieldError, match=rf"mesh.expert \({expert}\) must divide the model's 8 experts .*one of \[1, 2, 4, 8\]"):
    config.model.build(mesh, config.run.seed)


def test_freezing_the_vision_tower_of_a_text_model():
  """model.freeze_vision on the text demo (no vision tower) was silently ignored: refused when the
  run's step is built, where the model's own config says whether it has a tower."""
  import jax

  from grpo_jax.build import build_rl_step, build_task
  from grpo_jax.sharding import make_mesh
  config = load_config(os.path.join(ROOT, 'configs/tiny_arith.yaml'), ['model.freeze_vision=true'])
  mesh = make_mesh(config.mesh, devices=jax.devices()[:1])
  model = config.model.build(mesh, config.run.seed)
  with pytest.raises(FieldError, match=r"model.freeze_vision freezes a vision-language model's vision tower; this "
                                       r'model \(qwen2\) has none'):
    build_rl_step(config, model, mesh, build_task(config))


@pytest.mark.parametrize('assignment, message', [
    ('vision.out_hidden_size=32', r'vision.out_hidden_size \(32\) must equal hidden_size \(64\)'),
    ('vision.image_token_id=40', r'vision.image_token_id \(40\) is outside the vocabulary \[0, 11\)'),
    ('vision.fullatt_block_indexes=[5]', r'vision.fullatt_block_indexes names block 5, outside \[0, 2\)'),
    ('mrope_section=[2,2,2]', r'mrope_section \[2, 2, 2\] must be three sizes summing to head_dim / 2 = 8'),
    ('vision.window_size=6', r'vision.window_size \(6\) must be a multiple of patch_size x spatial_merge_size \(8\)'),
    ('vision.num_heads=3', r'vision.hidden_size \(32\) must split into vision.num_heads \(3\) heads'),
])
def test_vision_language_architecture_fields(assignment, message):
  """The vision demo's architecture with one field that cannot hold: refused at load, naming it."""
  with pytest.raises(UserError, match=message):
    load_config(os.path.join(ROOT, 'configs/tiny_spot.yaml'), [f'model.architecture.{assignment}'])


def test_routing_replay_on_a_dense_model():
  """algo.routing_replay: rollout on the dense demo (no router to replay) is refused when the step
  is built, where the model's config says whether it has sparse layers."""
  import jax

  from grpo_jax.build import build_rl_step, build_task
  from grpo_jax.sharding import make_mesh
  config = load_config(os.path.join(ROOT, 'configs/tiny_arith.yaml'), ['algo.routing_replay=rollout'])
  mesh = make_mesh(config.mesh, devices=jax.devices()[:1])
  model = config.model.build(mesh, config.run.seed)
  with pytest.raises(FieldError, match=r'algo.routing_replay'):
    build_rl_step(config, model, mesh, build_task(config))


def test_split_devices_an_agent_task_cannot_take():
  """rollout.devices needs partial rollouts (max_lag >= 1), which agent episodes do not have."""
  with pytest.raises(FieldError, match=r'algo.max_lag applies to single-turn tasks .*inference server'):
    load_config(os.path.join(ROOT, 'configs/tiny_guess.yaml'),
                ['rollout.devices=4', 'algo.max_lag=1', 'algo.tis_cap=2.0'])


def test_split_devices_on_a_host_of_one_device(tmp_path):
  """rollout.devices on one device (the split rows' one-device side, tests/rollout_matrix.py): the
  run stops at start in one line naming the field, and writes no checkpoint."""
  from runs import device_env
  result = subprocess.run([sys.executable, '-m', 'grpo_jax.train', *TINY, '--workdir', str(tmp_path / 'run'),
                           '--set', 'rollout.devices=1', '--set', 'algo.max_lag=1', '--set', 'algo.tis_cap=2.0'],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=device_env(1))
  one_error_line(result, 'rollout.devices=1 leaves none of the 1 devices to the trainer: give the sampler fewer')
  assert not os.path.exists(tmp_path / 'run' / 'checkpoints')


def test_a_trainer_mesh_the_split_leaves_too_few_devices_for(tmp_path):
  """mesh.fsdp=2 with rollout.devices=7 of the suite's 8: one device is the trainer's, and the
  message says why there is only one."""
  from grpo_jax import train
  config = load_config(os.path.join(ROOT, 'configs/tiny_arith.yaml'),
                       ['rollout.devices=7', 'algo.max_lag=1', 'algo.tis_cap=2.0', 'mesh.fsdp=2'])
  with pytest.raises(UserError, match=r"= 2 devices, but 1 are available to the trainer \(7 of the 8 devices are "
                                      r"the sampler's, rollout.devices\)$"):
    train.setup(config, None, str(tmp_path / 'work'))


# ---- workdirs ----

def test_workdir_that_is_a_file_or_lies_under_one(tmp_path):
  blocker = tmp_path / 'a_file'
  blocker.write_text('keep me\n')
  one_error_line(run_cli('grpo_jax.train', *TINY, '--workdir', str(blocker)), str(blocker), 'is a file')
  one_error_line(run_cli('grpo_jax.train', *TINY, '--workdir', str(blocker / 'run')),
                 f'lies under {blocker}, which is a file')
  assert blocker.read_text() == 'keep me\n'


@pytest.mark.skipif(os.geteuid() == 0, reason='root writes into read-only directories')
def test_workdir_that_is_not_writable(tmp_path):
  locked = tmp_path / 'locked'
  locked.mkdir()
  locked.chmod(0o555)
  try:
    one_error_line(run_cli('grpo_jax.train', *TINY, '--workdir', str(locked / 'run')),
                   f'{locked} is not writable')
    assert not (locked / 'run').exists()
  finally:
    locked.chmod(0o755)


@pytest.mark.exhaustive
def test_failed_run_changes_nothing_in_the_workdir(trained_workdir, tmp_path):
  """A bad mesh, a model of another shape (its checkpoint does not match) and a missing dataset
  all fail before anything in the existing workdir is written."""
  before = snapshot(trained_workdir)
  one_error_line(run_cli('grpo_jax.train', *TINY, '--set', 'mesh.data=3', '--workdir', str(trained_workdir)), 'mesh')
  one_error_line(run_cli('grpo_jax.train', *TINY, '--set', 'model.architecture.hidden_size=32',
                         '--workdir', str(trained_workdir)), 'does not match this run')
  one_error_line(run_cli('grpo_jax.train', *TINY, '--set', 'task.name=math', '--set',
                         f'task.source={tmp_path / "missing.jsonl"}', '--set', f'model.path={tmp_path}',
                         '--workdir', str(trained_workdir)))
  assert snapshot(trained_workdir) == before


@pytest.mark.exhaustive
def test_resume_names_the_changed_keys(trained_workdir, tmp_path):
  copy = tmp_path / 'copy'
  subprocess.run(['cp', '-r', str(trained_workdir), str(copy)], check=True)
  result = run_cli('grpo_jax.train', *TINY, '--set', 'train.steps=3', '--set', 'optim.learning_rate=0.002',
                   '--workdir', str(copy))
  assert result.returncode == 0, result.stderr[-3000:]
  resumed = [line for line in result.stderr.splitlines() if line.startswith('resumed from')]
  assert len(resumed) == 1 and 'train.steps: 2 -> 3' in resumed[0], result.stderr[-2000:]
  assert 'optim.learning_rate: 0.001 -> 0.002' in resumed[0]


# ---- damaged orbax checkpoints ----

def _damage(directory, how):
  """Cuts short or removes the largest data file of an orbax checkpoint (a chunk file, or an OCDBT
  data file under d/), never its metadata."""
  data = [path for path in glob.glob(os.path.join(directory, '**', '*'), recursive=True)
          if os.path.isfile(path) and not os.path.basename(path).startswith(('_', 'manifest', 'commit'))
          and 'array_metadatas' not in path]
  victim = max(data, key=os.path.getsize)
  if how == 'truncated':
    with open(victim, 'r+b') as f:
      f.truncate(os.path.getsize(victim) // 2)
  else:
    os.remove(victim)
  return victim


@pytest.mark.exhaustive
@pytest.mark.parametrize('how', ['truncated', 'missing'])
def test_damaged_training_checkpoint_on_resume(trained_workdir, tmp_path, how):
  copy = tmp_path / 'copy'
  subprocess.run(['cp', '-r', str(trained_workdir), str(copy)], check=True)
  _damage(copy / 'checkpoints' / '2' / 'state', how)
  before = snapshot(copy)
  result = run_cli('grpo_jax.train', *TINY, '--set', 'train.steps=3', '--workdir', str(copy))
  one_error_line(result, f'checkpoint {copy}/checkpoints/2 cannot be restored',
                 'move it aside to resume from step 1')
  assert snapshot(copy) == before


@pytest.mark.parametrize('how', ['truncated', pytest.param('missing', marks=pytest.mark.exhaustive)])
def test_damaged_model_checkpoint_in_conversion_and_generate(seed, make_hf_checkpoint, tmp_path, how):
  hf_dir, _ = make_hf_checkpoint(seed)
  ckpt = tmp_path / 'orbax'
  converted = run_cli('conversion.hf_to_orbax', '--hf', hf_dir, '--out', str(ckpt))
  assert converted.returncode == 0, converted.stderr[-3000:]
  victim = _damage(ckpt / 'params', how)
  tensor = os.path.basename(os.path.dirname(victim))  # one directory of chunks per tensor
  out = tmp_path / 'hf_out'
  one_error_line(run_cli('conversion.orbax_to_hf', '--ckpt', str(ckpt), '--out', str(out)),
                 f'{ckpt}/params could not be restored', tensor)
  assert not out.exists()
  one_error_line(run_cli('grpo_jax.generate', '--ckpt', str(ckpt), '--prompt-ids', '1 2 3'),
                 f'{ckpt}/params could not be restored', tensor)


def test_orbax_to_hf_shard_size_must_be_positive(tmp_path):
  one_error_line(run_cli('conversion.orbax_to_hf', '--ckpt', str(tmp_path), '--out', str(tmp_path / 'o'),
                         '--max-shard-gb', '0'), '--max-shard-gb must be > 0')


@pytest.mark.exhaustive
@pytest.mark.parametrize('flags, message', [
    (['--peft'], 'is from a full-parameter run (no model.lora): it holds no adapters'),
    (['--merge-lora'], 'is from a full-parameter run (no model.lora): it holds no adapters'),
    (['--step', '7'], 'holds no complete checkpoint of step 7'),
    (['--like', 'WORKDIR'], 'config.json not found'),
], ids=['peft', 'merge-lora', 'step', 'like'])
def test_exporting_a_run_the_flags_do_not_fit(trained_workdir, tmp_path, flags, message):
  """The export of a training run (full-parameter, steps 1 and 2) asked for adapters it does not
  hold, a step it never saved, or the extra keys of a directory that is no model: one line, and
  nothing written."""
  out = tmp_path / 'out'
  flags = [str(trained_workdir) if flag == 'WORKDIR' else flag for flag in flags]
  one_error_line(run_cli('conversion.orbax_to_hf', '--ckpt', str(trained_workdir), '--out', str(out), *flags), message)
  assert not out.exists() or not any(out.iterdir())
