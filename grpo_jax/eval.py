"""python -m grpo_jax.eval --config X.yaml --ckpt DIR [--data SOURCE] [--split S] [--k K] [--samples N]

Evaluates a policy (a model directory or a training checkpoint) on held-out math problems: the
config's `eval` section, or --data. n sampled answers per problem (n >= k) and, optionally, one
greedy answer, each checked with math-verify against the reference; pass@k, mean@k, maj@k and
greedy accuracy, overall and per data source (grpo_jax/evaluation.py). Per-problem samples and
scores go to a JSONL file. For an agent task (task.name: agent), whole episodes against its
environment on its held-out problems (grpo_jax/agents/evaluation.py).
"""

import argparse
import os
import sys

import jax
from flax import nnx

from grpo_jax import config as config_lib
from grpo_jax.build import build_evaluator, build_task
from grpo_jax.data.image_problems import image_inputs
from grpo_jax.data.math_task import MathTask
from grpo_jax.errors import UserError, cli_main


# ---- command line ----

def parse_args(argv):
  parser = argparse.ArgumentParser(prog='python -m grpo_jax.eval', description=__doc__.splitlines()[0])
  parser.add_argument('--config', required=True, help='the run config (model, task rendering, eval section)')
  parser.add_argument('--ckpt', required=True,
                      help='a model (Hugging Face dir or grpo_jax checkpoint) or a training workdir / its '
                           'checkpoints/<step> directory')
  parser.add_argument('--set', action='append', default=[], metavar='KEY=VALUE', dest='overrides')
  parser.add_argument('--data', help='held-out problems (overrides eval.source)')
  parser.add_argument('--split', help='overrides eval.split')
  parser.add_argument('--format', help='overrides eval.format')
  parser.add_argument('--k', type=int, help='overrides eval.k')
  parser.add_argument('--samples', type=int, help='n, answers per problem (overrides eval.samples)')
  parser.add_argument('--out', help='per-problem JSONL (default: eval_samples.jsonl beside --ckpt)')
  return parser.parse_args(argv)


def load_params(config: config_lib.Config, ckpt: str, mesh):
  """(graphdef, params) of --ckpt: a model directory, or the newest / named training checkpoint
  (its policy's parameters alone, in this config's dtypes)."""
  from grpo_jax.checkpoint import locate
  from grpo_jax.restore import restore_policy
  from grpo_jax.model.loading import from_pretrained

  ckpt = os.path.abspath(ckpt)
  if not os.path.isdir(ckpt):
    raise UserError(f'--ckpt {ckpt} is not a directory')
  training = locate(ckpt)  # a workdir, its checkpoints/ or one checkpoints/<step>
  if training is None:
    return nnx.split(from_pretrained(ckpt, mesh=mesh, options=config.model.options))  # a model directory
  graphdef, params, _, step = restore_policy(*training, mesh, options=config.model.options)
  print(f'eval: parameters of {training[0]}/{step}', file=sys.stderr, flush=True)
  return graphdef, params


@cli_main
def main(argv=None):
  from grpo_jax import sharding

  args = parse_args(sys.argv[1:] if argv is None else argv)
  overrides = list(args.overrides)
  for flag, key in (('data', 'source'), ('split', 'split'), ('format', 'format'), ('k', 'k'), ('samples', 'samples')):
    value = getattr(args, flag)
    if value is not None:
      overrides.append(f'eval.{key}={value}')
  if args.k is not None and args.samples is None:  # --k alone: at least k samples, else the config's
    samples = config_lib.load_config(args.config, [o for o in overrides if not o.startswith('eval.k=')]).eval.samples
    overrides.append(f'eval.samples={max(args.k, samples)}')
  config = config_lib.load_config(args.config, overrides)
  if not (config.task.kind.answers or config.task.kind.acts):
    raise UserError(f'evaluation checks answers or episodes: task.name must be math or agent, got {config.task.name!r}')
  mesh = sharding.make_mesh(config.mesh)
  graphdef, params = load_params(config, args.ckpt, mesh)
  task = MathTask(config.task, config.model.path, config.run.seed, problems=False, images=image_inputs(config)) \
      if config.task.kind.answers else build_task(config)
  evaluator = build_evaluator(config, task, graphdef, params)
  out = args.out or os.path.join(os.path.abspath(args.ckpt), 'eval_samples.jsonl')
  try:
    with jax.set_mesh(mesh):
      summary = evaluator.run(params, out, progress=True)
  finally:
    evaluator.close()
    task.close()
  width = max(map(len, summary))
  for name, value in summary.items():
    print(f'{name:<{width}}  {value:.4f}' if isinstance(value, float) else f'{name:<{width}}  {value}')
  print(f'per-problem samples: {out}')
  return summary


if __name__ == '__main__':
  main()
