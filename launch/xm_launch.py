"""XManager launch of python -m grpo_jax.train on a TPU slice or on GPU nodes (Vertex AI).

  python launch/xm_launch.py --config configs/qwen2_5_32b_dapo_aime.yaml --workdir /gcs/bucket/runs/dapo \
      --platform gpu --accelerator H100 --chips-per-host 8 --hosts 8 --coordinator dapo-0:29500 \
      [--set k=v ...] [--dry-run]

One job per host, each running the same train command with the jax.distributed environment
(JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID): host 0's job serves as coordinator at
`--coordinator`. On a TPU slice (--platform tpu) the workers find each other through the slice's
metadata instead (distributed.auto). --workdir must be storage all hosts share. --dry-run prints
each job (module, arguments, environment, resources) and imports nothing from xmanager; the
`xmanager` package is needed only to launch, and the core never imports it.
"""

import argparse
import dataclasses
import json
import sys

TRAIN_MODULE = 'grpo_jax.train'
BASE_IMAGES = {'gpu': 'nvidia/cuda:12.9.1-cudnn-runtime-ubuntu24.04', 'tpu': 'python:3.12-slim'}  # jax 0.12 needs Python 3.12
JAX_EXTRAS = {'gpu': 'jax[cuda12]==0.12.0.1', 'tpu': 'jax[tpu]==0.12.0.1'}  # requirements.txt's jax (tests/test_launch.py)


@dataclasses.dataclass
class HostJob:
  """What one host runs: `python -m module *args` with `env`, on `chips` x `accelerator`."""

  name: str
  module: str
  args: list
  env: dict
  accelerator: str
  chips: int


def jobs(args) -> list[HostJob]:
  train_args = ['--config', args.config, '--workdir', args.workdir]
  for assignment in args.overrides:
    train_args += ['--set', assignment]
  if args.platform == 'tpu':
    train_args += ['--set', 'distributed.auto=true']
  built = []
  for host in range(args.hosts):
    env = {}
    if args.platform == 'gpu' and args.hosts > 1:
      env = dict(JAX_COORDINATOR_ADDRESS=args.coordinator, JAX_NUM_PROCESSES=str(args.hosts), JAX_PROCESS_ID=str(host))
    built.append(HostJob(name=f'{args.name}-{host}', module=TRAIN_MODULE, args=list(train_args), env=env,
                         accelerator=args.accelerator, chips=args.chips_per_host))
  return built


def launch(args, planned: list[HostJob]) -> None:
  from xmanager import xm  # pylint: disable=g-import-not-at-top
  from xmanager import xm_local  # pylint: disable=g-import-not-at-top

  with xm_local.create_experiment(experiment_title=args.name) as experiment:
    [executable] = experiment.package([xm.python_container(
        executor_spec=xm_local.Vertex.Spec(), path='.', base_image=BASE_IMAGES[args.platform],
        entrypoint=xm.ModuleName(TRAIN_MODULE), use_deep_module=True)])
    group = {}
    for job in planned:
      executor = xm_local.Vertex(requirements=xm.JobRequirements(**{job.accelerator: job.chips}))
      group[job.name] = xm.Job(executable=executable, executor=executor, args=job.args, env_vars=job.env)
    experiment.add(xm.JobGroup(**group))


def parse_args(argv):
  parser = argparse.ArgumentParser(prog='launch/xm_launch.py', description=__doc__.splitlines()[0])
  parser.add_argument('--config', required=True)
  parser.add_argument('--workdir', required=True, help='shared by all hosts (e.g. a /gcs/ mount)')
  parser.add_argument('--platform', choices=('tpu', 'gpu'), required=True)
  parser.add_argument('--accelerator', required=True, help="XManager's name: e.g. H100, A100, TPU_V4, TPU_V5_LITEPOD")
  parser.add_argument('--chips-per-host', type=int, default=8)
  parser.add_argument('--hosts', type=int, default=1)
  parser.add_argument('--coordinator', help='host:port of host 0 (GPU runs of several hosts)')
  parser.add_argument('--name', default='grpo-jax')
  parser.add_argument('--set', action='append', default=[], dest='overrides', metavar='KEY=VALUE')
  parser.add_argument('--dry-run', action='store_true', help='print the jobs; launch nothing')
  args = parser.parse_args(argv)
  if args.hosts < 1 or args.chips_per_host < 1:
    parser.error('--hosts and --chips-per-host must be >= 1')
  if args.platform == 'gpu' and args.hosts > 1 and not args.coordinator:
    parser.error('--coordinator host:port is required for GPU runs of several hosts')
  return args


def main(argv=None) -> None:
  args = parse_args(sys.argv[1:] if argv is None else argv)
  planned = jobs(args)
  print(f'# {len(planned)} job(s), image {BASE_IMAGES[args.platform]} + requirements.txt + {JAX_EXTRAS[args.platform]}')
  for job in planned:
    print(json.dumps(dataclasses.asdict(job)))
  if not args.dry_run:
    launch(args, planned)


if __name__ == '__main__':
  main()
