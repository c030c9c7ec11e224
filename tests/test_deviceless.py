"""Compiling for TPUs and GPUs that are not attached: every Pallas kernel by the real Mosaic and
Triton compilers (the recipes' RL steps: test_plan.py).

The compilers come from requirements-compile.txt, which `make test` installs into .venv/compilers
(GRPO_JAX_COMPILERS names another folder). They run in subprocesses with that folder on
PYTHONPATH, never in the test process: imported there they would try to start their devices.
"""

import json
import os
import subprocess
import sys

import pytest

from grpo_jax.plan import probes, targets
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
  result = _run(platform, ['grpo_jax.plan.targets', 'kernels', target, *extra], timeout=900)
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


def test_deviceless_gpu_compiles_skip_autotuning_unless_the_user_sets_it(monkeypatch):
  """No GPU to time candidates on: XLA:GPU takes its default configs (autotune level 0) instead of
  building every candidate first; a level in the user's XLA_FLAGS is left to XLA."""
  monkeypatch.setenv('XLA_FLAGS', '--xla_backend_optimization_level=0')
  assert targets.compiler_options('gpu') == {'xla_gpu_autotune_level': 0}
  assert targets.compiler_options('tpu') == targets.compiler_options('cpu') == {}
  monkeypatch.setenv('XLA_FLAGS', '--xla_gpu_autotune_level=4')
  assert targets.compiler_options('gpu') == {}


# ---- every Pallas kernel, compiled for its hardware ----

@pytest.mark.exhaustive
@pytest.mark.starts_first
@pytest.mark.parametrize('platform, target', [pytest.param('tpu', 'v5e-4', marks=pytest.mark.long),
                                              pytest.param('tpu', 'v5p-8', marks=pytest.mark.long),
                                              pytest.param('tpu', 'v6e-4', marks=pytest.mark.long)])
def test_logprob_kernels_compile_for_the_hardware(platform, target):
  """Forward and both backward kernels at the 0.5B, 7B and 32B widths, bf16 and fp32, V = 152,064:
  three kernel calls in each lowered program (not the interpreter), compiled by Mosaic (the GPU's:
  test_mosaic_gpu_logprob_kernels_compile_for_an_h100)."""
  code, results = _kernel_results(platform, target)
  assert len(results) == len(probes.KERNEL_WIDTHS) * 2
  for result in results:
    assert result['error'] is None, result
    assert result['kernel_calls'] == 3, result
  assert code == 0


@pytest.mark.exhaustive
@pytest.mark.starts_first
def test_mosaic_gpu_logprob_kernels_compile_for_an_h100():
  """The Mosaic GPU schedule's forward and both backward kernels at the 0.5B, 7B and 32B widths in
  bf16, V = 152,064: three Mosaic GPU calls in each lowered program, compiled for an H100."""
  code, results = _kernel_results('gpu', 'h100x1', '--implementation', 'pallas_mosaic_gpu', '--dtype', 'bfloat16')
  assert len(results) == len(probes.KERNEL_WIDTHS)
  for result in results:
    assert result['error'] is None, result
    assert result['kernel_calls'] == 3, result
  assert code == 0


def _decode_steps(*extra):
  result = _run('gpu', ['grpo_jax.plan.targets', 'decode-step', 'h100x1', *extra], timeout=900)
  lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith('{')]
  assert result.returncode == 0 and len(lines) == 2, result.stderr[-3000:]
  return lines


@pytest.mark.exhaustive
@pytest.mark.starts_first
def test_a_decode_step_is_at_most_12_kernels_per_layer_on_an_h100():
  """The 0.5B recipe's decode step (64 rows reading 512-token prompts, a 1,024-slot cache) compiled
  for one H100 with its attention in one kernel ('pallas' decode attention: Mosaic GPU's, each layer
  writing its new keys first, the MLP's gate and up one matmul): at most 12 kernels per decoder
  layer, the difference between 2 and 3 layers (26 with dense attention), and nothing copied."""
  two, three = _decode_steps('--decode-attention', 'pallas')
  assert three['kernels'] - two['kernels'] <= 12, (two, three)
  assert three['copied'] < 1 << 20, three


@pytest.mark.exhaustive
@pytest.mark.starts_first
def test_the_kernel_cut_moves_no_more_bytes_than_dense_attention():
  """The cut's decode layer reads and writes no more than dense attention's (the kernels' operands
  and results, traffic.decode_step_kernels), at the 0.5B shape and the 7B recipe's (512 rows of
  3,072 slots; at 64 rows XLA's default GEMM configuration splits the 7B output projection's
  contraction and the residual is summed on its own: 13): with the new keys written in place
  before the kernel reads them, no layer's cache is copied."""
  for preset, shape in (('0.5B', []), ('7B', ['--rows', '512', '--new-tokens', '3072'])):
    dense, cut = (_decode_steps('--preset', preset, '--decode-attention', name, *shape) for name in ('dense', 'pallas'))
    per_layer = lambda steps: steps[1]['bytes'] - steps[0]['bytes']  # noqa: E731
    assert cut[1]['kernels'] - cut[0]['kernels'] <= 12 < dense[1]['kernels'] - dense[0]['kernels'], (preset, dense, cut)
    assert per_layer(cut) <= per_layer(dense), (preset, dense, cut)


@pytest.mark.exhaustive
@pytest.mark.starts_first
def test_mosaic_gpu_refuses_blocks_past_shared_memory():
  """The checks are real: tiles too large for an H100's 227 KiB of shared memory per block (256 x 256
  slices of h and W in bf16: 256 KiB) are refused by Mosaic GPU building the kernel for the target,
  not accepted and interpreted."""
  code, results = _kernel_results('gpu', 'h100x1', '--width', '896', '--dtype', 'bfloat16',
                                  '--block', 'block_tokens=256', '--block', 'block_vocab=256',
                                  '--block', 'block_model=256')
  assert code == 1
  assert 'exceeds available shared memory' in results[0]['error']


def test_tpu_compiles_take_the_workaround_flags_unless_set():
  """The plan's XLA:TPU compiles avoid the pinned libtpu's aborting all-reduce emitter
  (targets.TPU_WORKAROUNDS) unless LIBTPU_INIT_ARGS says otherwise; other flags are kept."""
  from grpo_jax.plan.targets import TPU_WORKAROUNDS, with_tpu_workarounds
  assert with_tpu_workarounds('') == ' '.join(TPU_WORKAROUNDS)
  assert with_tpu_workarounds('--xla_other=1').split() == ['--xla_other=1', *TPU_WORKAROUNDS]
  chosen = '--xla_tpu_enable_pincer_short_emitter=true'
  assert with_tpu_workarounds(chosen) == chosen
