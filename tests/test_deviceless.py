"""Compiling for TPUs and GPUs that are not attached: every Pallas kernel by the real Mosaic and
Triton compilers, and the 0.5B recipe's RL step by XLA:TPU and XLA:GPU (grpo_jax.plan).

The compilers come from requirements-compile.txt, which `make test` installs into .venv/compilers
(GRPO_JAX_COMPILERS names another folder). They run in subprocesses with that folder on
PYTHONPATH, never in the test process: imported there they would try to start their devices.
"""

import json
import os
import subprocess
import sys

import pytest

from grpo_jax import targets
from grpo_jax.errors import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMPILERS = os.environ.get('GRPO_JAX_COMPILERS', os.path.join(ROOT, '.venv', 'compilers'))
INSTALLED = dict(tpu=os.path.isfile(os.path.join(COMPILERS, 'libtpu', 'libtpu.so')),
                 gpu=os.path.isdir(os.path.join(COMPILERS, 'jax_plugins', 'xla_cuda12')))


def _compiler_env(platform: str) -> dict:
  if not INSTALLED[platform]:
    pytest.skip(f'the {platform.upper()} compiler is not installed in {COMPILERS} (make test installs '
                'requirements-compile.txt there; its wheels exist for Linux x86_64 only)')
  env = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=os.pathsep.join([COMPILERS, ROOT]),
             TPU_WORKER_HOSTNAMES='localhost')
  # libtpu takes a machine-wide lock unless told that several processes may load it: the test
  # workers compile side by side.
  env['ALLOW_MULTIPLE_LIBTPU_LOAD'] = '1'
  return env


def _run(platform: str, args, timeout: int):
  return subprocess.run([sys.executable, '-m', *args], env=_compiler_env(platform), cwd=ROOT,
                        capture_output=True, text=True, timeout=timeout)


def _kernel_results(platform: str, target: str, *extra):
  result = _run(platform, ['grpo_jax.targets', 'kernels', target, *extra], timeout=900)
  lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith('{')]
  assert lines, result.stderr[-3000:]
  return result.returncode, lines


# ---- target names (no compiler needed) ----

@pytest.mark.parametrize('name, kind, chips, hosts', [
    ('v5p-128', 'v5p', 64, 1), ('v5e-8', 'v5e', 8, 1), ('v6e-256', 'v6e', 256, 1), ('v4-32', 'v4', 16, 1),
    ('h100x8', 'h100', 8, 1), ('h100x64', 'h100', 64, 8), ('h100x8x8', 'h100', 64, 8), ('H200x2x4', 'h200', 8, 2)])
def test_targets_parse_cloud_names(name, kind, chips, hosts):
  target = targets.parse_target(name)
  assert (target.kind, target.chips, target.hosts) == (kind, chips, hosts)
  assert target.hbm_bytes > 10 * targets.GiB and target.peak_flops > 1e14


@pytest.mark.parametrize('name', ['v5p-3', 'v5e-3', 'v7-8', 'h100x12', 'h100x0', 'a100x8', 'v5p'])
def test_unknown_targets_are_refused_by_name(name):
  with pytest.raises(UserError, match='--target'):
    targets.parse_target(name)


# ---- every Pallas kernel, compiled for its hardware ----

@pytest.mark.slow
@pytest.mark.parametrize('platform, target', [('tpu', 'v5e-4'), ('tpu', 'v5p-8'), ('tpu', 'v6e-4'),
                                              ('gpu', 'h100x1')])
def test_logprob_kernels_compile_for_the_hardware(platform, target):
  """Forward and both backward kernels at the 0.5B, 7B and 32B widths, bf16 and fp32, V = 152,064:
  three kernel calls in each lowered program (not the interpreter), compiled by Mosaic / Triton."""
  code, results = _kernel_results(platform, target)
  assert len(results) == len(targets.KERNEL_WIDTHS) * 2
  for result in results:
    assert result['error'] is None, result
    assert result['kernel_calls'] == 3, result
  assert code == 0


@pytest.mark.slow
def test_triton_compiler_refuses_blocks_past_shared_memory():
  """The checks are real: tiles too large for an H100's 227 KiB of shared memory per block are
  refused by the Triton compilation, not accepted and interpreted."""
  code, results = _kernel_results('gpu', 'h100x1', '--width', '896', '--dtype', 'float32',
                                  '--block', 'block_tokens=256', '--block', 'block_vocab=256',
                                  '--block', 'block_model=256')
  assert code == 1
  assert 'Shared memory size limit exceeded' in results[0]['error']


# ---- the 0.5B recipe's RL step, compiled by the target's XLA ----

@pytest.mark.slow
@pytest.mark.parametrize('platform, target', [('tpu', 'v5e-8'), ('gpu', 'h100x8')])
def test_plan_compiles_the_small_recipe_for_the_target(platform, target, tmp_path):
  report_path = tmp_path / 'plan.json'
  result = _run(platform, ['grpo_jax.plan', '--config', 'configs/qwen2_5_0_5b_math.yaml', '--model-size', '0.5B',
                           '--target', target, '--json', str(report_path)], timeout=900)
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
  report = json.loads(report_path.read_text())
  assert 'fits' in result.stdout and report['fits'] and report['devices'] == 8
  assert report['mesh'] == {'data': 1, 'fsdp': 8, 'tensor': 1}
  assert [program['name'] for program in report['programs']] == ['rollout', 'update']
  # FSDP: each device holds an eighth of the fp32 parameters and of each AdamW moment (plus the
  # few tensors too small to split: biases and norms of width D / 8 or less).
  total = report['model']['parameters'] * 4
  per_device = report['per_device']
  assert total / 8 <= per_device['parameters'] <= total / 8 * 1.01
  assert 2 * total / 8 <= per_device['optimizer_state'] <= 2 * total / 8 * 1.01
  # K and V of 24 layers x 256 rows x 1,536 tokens x 2 heads x 64, bf16, rows split 8 ways.
  assert per_device['kv_cache'] == 2 * 24 * 256 * 1536 * 2 * 64 * 2 // 8
  update = report['programs'][1]
  assert update['arguments'] >= per_device['parameters'] + per_device['optimizer_state']
  assert update['aliased'] >= per_device['parameters'] + per_device['optimizer_state']  # donated state
  assert 0 < update['temporaries'] and report['peak'] <= report['hbm']


@pytest.mark.slow
def test_plan_names_the_knob_that_brings_a_run_under_the_device_memory(tmp_path):
  """The 0.5B recipe's shapes at 2 layers on 8 H100s told they have 1.4 GiB each (the update needs
  1.65): the plan says it does not fit, compiles the knobs, and one it names fits when planned again."""
  def plan(*extra):
    report_path = tmp_path / f'plan{len(extra)}.json'
    result = _run('gpu', ['grpo_jax.plan', '--config', 'configs/qwen2_5_0_5b_math.yaml', '--model-size', '0.5B',
                          '--layers', '2', '--target', 'h100x8', '--device-memory', '1.4GiB', '--json', str(report_path),
                          *extra], timeout=900)
    assert report_path.exists(), result.stdout[-2000:] + result.stderr[-3000:]
    return result, json.loads(report_path.read_text())

  result, report = plan()
  assert result.returncode == 1 and 'DOES NOT FIT' in result.stdout
  assert report['hbm'] == int(1.4 * 2**30) and not report['fits']
  update = {program['name']: program['peak'] for program in report['programs']}['update']
  assert update > report['hbm']
  fitting = [row for row in report['advice'] if row['fits']]
  assert fitting and f'brings it under: {fitting[0]["knob"]}' in result.stdout
  assert all(max(row['peaks'].values()) <= report['hbm'] for row in fitting)
  halved = next(row for row in report['advice'] if row['knob'] == 'algo.micro_batch_size=16')
  assert halved['peaks']['update'] < update  # half the micro-batch, fewer activations
  again, replanned = plan(*[arg for assignment in fitting[0]['knob'].split() for arg in ('--set', assignment)])
  assert again.returncode == 0 and replanned['fits'] and 'advice' not in replanned
