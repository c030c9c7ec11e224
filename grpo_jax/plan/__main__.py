"""python -m grpo_jax.plan --config configs/X.yaml --target v5p-128 [--model-size 32B] [--set a.b=c ...]

Compiles a run's RL step for a TPU slice or GPU cluster that is not attached (plan/targets.py) and
reports the target compiler's own per-device memory: the parameters, the optimizer state, the
reference policy, the reward models' weights, the KV cache, each compiled program's arguments,
outputs and temporaries (and the step's resident arrays held beside the programs that do not take
them), and whether the step fits. Nothing is extrapolated: the program compiled is the run's own, at full
depth and the run's real shapes. With a jittable task that is the K-steps-in-one-jit loop; with a
host-scored task, the sampler and the update (the reward runs on the host between them), and
between them each reward model's forward over the step's rows (a reward term of kind
reward_model, its architecture read from the term's config.json: no weights).

The model's shape comes from --model-size (a preset of grpo_jax/model/presets.py: 0.5B ... 72B,
Qwen3-8B, Llama-3.1-8B, Gemma-3-12B, ...), else from model.path's config.json, else from
model.architecture; no weights are read. --layers overrides the depth (to see how memory grows
with it; a per-layer pattern keeps its first layers).

The programs come from programs.py; when the run does not fit, advice.py compiles them again
with each knob that lowers memory; when it fits on GPUs of several hosts without hybrid sharding,
it compiles the update again with mesh.hybrid=true and says whether the step is faster. Needs the target's compiler: `pip install -r requirements-compile.txt` (`make test` puts it in
.venv/compilers: run with PYTHONPATH=.venv/compilers). The host's own devices stay CPUs.
"""

import os

os.environ.setdefault('JAX_PLATFORMS', 'cpu')  # compile for the target; never initialise it here

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

from grpo_jax.plan import targets  # noqa: E402  (imports no jax)

with targets.compiler_log(targets.STARTUP_LOG):  # the compilers' plugins log as jax loads them
  import jax  # noqa: E402, F401

from grpo_jax import config as config_lib  # noqa: E402
from grpo_jax.errors import cli_main  # noqa: E402
from grpo_jax.plan.advice import advise, format_advice, format_layout_advice, layout_advice  # noqa: E402
from grpo_jax.plan.programs import model_architecture  # noqa: E402
from grpo_jax.plan.report import format_report, parse_bytes, plan  # noqa: E402


def parse_args(argv):
  parser = argparse.ArgumentParser(prog='python -m grpo_jax.plan', description=__doc__.splitlines()[0])
  parser.add_argument('--config', required=True, help='YAML run config (see configs/)')
  parser.add_argument('--target', required=True, help='v4-N, v5p-N, v5e-N, v6e-N, h100xN, h200xN, h100xHOSTSxGPUS')
  parser.add_argument('--model-size', help='a model preset for the shape: a Qwen2.5 size (0.5B ... 72B), Qwen3-8B, '
                      'Llama-3.1-8B, Gemma-3-12B, ... (grpo_jax/model/presets.py)')
  parser.add_argument('--layers', type=int, help='override the number of layers')
  parser.add_argument('--set', action='append', default=[], metavar='KEY=VALUE', dest='overrides',
                      help='override one config key, e.g. --set rollout.max_new_tokens=12288 (repeatable)')
  parser.add_argument('--device-memory', help='memory per device to plan for instead of the target\'s, e.g. 40GiB or 16GB')
  parser.add_argument('--no-advice', action='store_true',
                      help='when the run does not fit, do not compile the knobs that might bring it under')
  parser.add_argument('--json', help='also write the report as JSON to this file')
  return parser.parse_args(argv)


@cli_main
def main(argv=None) -> int:
  args = parse_args(sys.argv[1:] if argv is None else argv)
  target = targets.parse_target(args.target)
  if args.device_memory:
    target = dataclasses.replace(target, hbm_bytes=parse_bytes(args.device_memory, '--device-memory'))
  config = config_lib.load_config(args.config, args.overrides)
  architecture = model_architecture(config, args.model_size, args.layers)
  report = plan(config, target, architecture)
  print(format_report(report), flush=True)
  if not report['fits'] and not args.no_advice:
    print('trying the knobs that lower memory without changing what is learned (each compiled for the target):',
          flush=True)
    peaks = {program['name']: program['peak'] for program in report['programs']}
    report['advice'] = advise(lambda extra: config_lib.load_config(args.config, [*args.overrides, *extra]),
                              lambda config, only: plan(config, target, architecture, only=only), architecture,
                              report, on_result=lambda row: print(format_advice(row, peaks), flush=True))
    fitting = [row['knob'] for row in report['advice'] if row['fits']]
    print(f'brings it under: {" | ".join(fitting)}' if fitting else
          'no knob brings it under: more devices, a larger memory, or a smaller recipe (rows, sequence length)',
          flush=True)
    report['advice_fits'] = fitting
  if report['fits'] and not args.no_advice:
    row = layout_advice(lambda extra: config_lib.load_config(args.config, [*args.overrides, *extra]),
                        lambda config, only: plan(config, target, architecture, only=only), report, target)
    if row is not None:
      print(format_layout_advice(row), flush=True)
      report['layout_advice'] = row
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(report, f, indent=1, default=float)
  return 0 if report['fits'] else 1


if __name__ == '__main__':
  sys.exit(main())
