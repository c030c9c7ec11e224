"""The launch scripts' dry runs: the exact commands for a given config, with no cloud access."""

import json
import os
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = 'configs/qwen2_5_32b_dapo_aime.yaml'
with open(os.path.join(ROOT, 'requirements.txt')) as _f:  # the pods install the jax the checkout pins
  JAX = next(line.split('==')[1].split()[0] for line in _f if line.startswith('jax=='))


def run(*command, env=None):
  result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, **(env or {})))
  return result


def commands(stdout):
  return [shlex.split(line) for line in stdout.splitlines() if line and not line.startswith('#')]


def test_tpu_pod_dry_run():
  result = run('bash', 'launch/tpu_pod.sh', '--project', 'my-proj', '--zone', 'us-east5-a', '--name', 'pod1',
               '--accelerator-type', 'v5p-128', '--config', CONFIG, '--workdir', '/mnt/shared/runs/a',
               '--set', 'model.path=/mnt/shared/Qwen2.5-32B', '--set', 'run.name=two words', '--delete', '--dry-run')
  assert result.returncode == 0, result.stderr
  create, copy, install, train, delete = commands(result.stdout)
  where = ['--project=my-proj', '--zone=us-east5-a']
  assert create == ['gcloud', 'compute', 'tpus', 'tpu-vm', 'create', 'pod1', *where, '--accelerator-type=v5p-128',
                    '--version=v2-alpha-tpuv5']
  assert copy[:8] == ['gcloud', 'compute', 'tpus', 'tpu-vm', 'scp', '--recurse', '--worker=all', *where[:1]]
  assert copy[-1] == 'pod1:grpo_jax/' and 'grpo_jax' in copy and 'requirements.txt' in copy
  assert install[4:7] == ['ssh', 'pod1', '--worker=all']
  assert f"requirements.txt 'jax[tpu]=={JAX}'" in install[-1]
  assert train[4:7] == ['ssh', 'pod1', '--worker=all']
  remote = shlex.split(train[-1].removeprefix('--command='))
  assert remote[:3] == ['cd', 'grpo_jax', '&&']
  assert remote[3:] == ['python3', '-m', 'grpo_jax.train', '--config', CONFIG, '--workdir', '/mnt/shared/runs/a',
                        '--set', 'distributed.auto=true', '--set', 'model.path=/mnt/shared/Qwen2.5-32B',
                        '--set', 'run.name=two words']
  assert delete == ['gcloud', 'compute', 'tpus', 'tpu-vm', 'delete', 'pod1', *where, '--quiet']


def test_tpu_pod_queued_resource_and_missing_flags():
  result = run('bash', 'launch/tpu_pod.sh', '--project', 'p', '--zone', 'z', '--name', 'n', '--accelerator-type',
               'v6e-256', '--config', CONFIG, '--workdir', '/w', '--queued', '--spot', '--delete', '--dry-run')
  assert result.returncode == 0, result.stderr
  lines = commands(result.stdout)
  assert lines[0][:5] == ['gcloud', 'compute', 'tpus', 'queued-resources', 'create']
  assert '--node-id=n' in lines[0] and '--accelerator-type=v6e-256' in lines[0] and '--spot' in lines[0]
  assert lines[-1][:6] == ['gcloud', 'compute', 'tpus', 'queued-resources', 'delete', 'n-qr']
  missing = run('bash', 'launch/tpu_pod.sh', '--project', 'p', '--dry-run')
  assert missing.returncode == 2 and 'error: --zone is required' in missing.stderr


def test_slurm_dry_run_one_process_per_node_and_per_gpu():
  env = dict(SLURM_NNODES='8', SLURM_JOB_NODELIST='gpu-a,gpu-b,gpu-c,gpu-d,gpu-e,gpu-f,gpu-g,gpu-h',
             SLURM_GPUS_ON_NODE='8', PATH='/usr/bin:/bin')  # no scontrol: outside an allocation
  result = run('bash', 'launch/slurm.sbatch', '--dry-run', '--config', CONFIG, '--workdir', '/shared/w',
               '--set', 'model.path=/shared/m', env=env)
  assert result.returncode == 0, result.stderr
  [command] = commands(result.stdout)
  assert command[:5] == ['srun', '--nodes=8', '--ntasks=8', '--ntasks-per-node=1', '--kill-on-bad-exit=1']
  assert command[5:8] == ['env', 'JAX_COORDINATOR_ADDRESS=gpu-a:29500', 'JAX_NUM_PROCESSES=8']
  assert command[8:10] == ['bash', '-c'] and 'JAX_PROCESS_ID=$SLURM_PROCID' in command[10]
  assert command[12:] == ['python3', '-m', 'grpo_jax.train', '--config', CONFIG, '--workdir', '/shared/w',
                          '--set', 'model.path=/shared/m']
  per_gpu = run('bash', 'launch/slurm.sbatch', '--dry-run', '--per-gpu', '--port', '1234', '--config', CONFIG,
                '--workdir', '/shared/w', env=env)
  [command] = commands(per_gpu.stdout)
  assert '--ntasks=64' in command and '--ntasks-per-node=8' in command
  assert 'JAX_COORDINATOR_ADDRESS=gpu-a:1234' in command and 'JAX_NUM_PROCESSES=64' in command
  assert 'CUDA_VISIBLE_DEVICES=$SLURM_LOCALID' in command[10]
  # The #SBATCH header asks for one task per node with all its GPUs.
  with open(os.path.join(ROOT, 'launch', 'slurm.sbatch')) as f:
    header = f.read()
  assert '#SBATCH --ntasks-per-node=1' in header and '#SBATCH --gpus-per-node=8' in header


def test_xmanager_dry_run_gpu_nodes_and_tpu_slice():
  result = run(sys.executable, 'launch/xm_launch.py', '--config', CONFIG, '--workdir', '/gcs/b/w', '--platform', 'gpu',
               '--accelerator', 'H100', '--hosts', '8', '--coordinator', 'dapo-0:29500', '--set', 'model.path=/gcs/m',
               '--dry-run')
  assert result.returncode == 0, result.stderr
  jobs = [json.loads(line) for line in result.stdout.splitlines() if not line.startswith('#')]
  assert f'jax[cuda12]=={JAX}' in result.stdout.splitlines()[0]
  assert [job['name'] for job in jobs] == [f'grpo-jax-{i}' for i in range(8)]
  for index, job in enumerate(jobs):
    assert job['module'] == 'grpo_jax.train' and (job['accelerator'], job['chips']) == ('H100', 8)
    assert job['args'] == ['--config', CONFIG, '--workdir', '/gcs/b/w', '--set', 'model.path=/gcs/m']
    assert job['env'] == dict(JAX_COORDINATOR_ADDRESS='dapo-0:29500', JAX_NUM_PROCESSES='8', JAX_PROCESS_ID=str(index))
  tpu = run(sys.executable, 'launch/xm_launch.py', '--config', CONFIG, '--workdir', '/gcs/b/w', '--platform', 'tpu',
            '--accelerator', 'TPU_V4', '--chips-per-host', '4', '--hosts', '16', '--dry-run')
  jobs = [json.loads(line) for line in tpu.stdout.splitlines() if not line.startswith('#')]
  assert len(jobs) == 16 and all(job['env'] == {} and job['args'][-2:] == ['--set', 'distributed.auto=true']
                                 for job in jobs)
  missing = run(sys.executable, 'launch/xm_launch.py', '--config', CONFIG, '--workdir', '/w', '--platform', 'gpu',
                '--accelerator', 'H100', '--hosts', '2', '--dry-run')
  assert missing.returncode == 2 and '--coordinator' in missing.stderr
