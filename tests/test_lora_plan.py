"""grpo_jax.plan with LoRA: the tiny LoRA recipe's RL step planned with bf16 compute, fp32 adapters
and a KL term, against hand counts. The program is compiled by XLA:CPU for this host's first device
standing in for one H100 (the target compilers are test_plan.py's, and slow); the per-device
figures checked here are the plan's own, from the abstract state's shapes and layouts."""

import dataclasses
import os

import jax
import pytest

from grpo_jax import config as config_lib
from grpo_jax.plan import report as plan, targets
from grpo_jax.plan.programs import model_architecture

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _HostTarget(targets.Target):
  """A target's figures, its programs compiled for this host's first CPU."""

  def devices(self):
    return jax.devices()[:1]


@pytest.mark.exhaustive
def test_lora_plan_counts_the_frozen_base_and_keeps_optimizer_state_for_the_adapters_only():
  config = config_lib.load_config(os.path.join(ROOT, 'configs', 'tiny_arith_lora.yaml'),
                                  ['model.dtype=bfloat16', 'algo.kl_beta=0.01', 'train.steps_per_call=1'])
  architecture = model_architecture(config, None, None)
  h100 = targets.parse_target('h100x1')
  target = _HostTarget(**dict(dataclasses.asdict(h100), platform='cpu'))
  report = plan.plan(config, target, architecture)

  # Rank-16 A [in, r] and B [r, out] on all seven projections of both layers.
  d, f, q, kv, rank, layers = 64, 176, 4 * 16, 2 * 16, 16, 2
  adapters = layers * rank * ((d + q) + 2 * (d + kv) + (q + d) + 3 * (d + f))
  base = architecture.num_params()
  assert report['model']['trained'] == adapters and report['model']['lora']['rank'] == rank
  per_device = report['per_device']
  assert per_device['parameters'] == adapters * 4  # fp32 (param_dtype)
  assert per_device['frozen_base'] == base * 2  # bf16 (dtype)
  # AdamW's two moments of the adapters alone (and its step counter), not of the base.
  assert 2 * adapters * 4 <= per_device['optimizer_state'] <= 2 * adapters * 4 + 64
  assert per_device['reference'] == 0  # pi_ref: the base with the adapters off, no copy
  assert per_device['resident_weights'] == (base + adapters) * 2  # the sampler decodes base + adapters
  # The fit check counts the frozen base: it is an argument of the step (donated, so written in place).
  program = report['programs'][0]
  held = per_device['parameters'] + per_device['frozen_base'] + per_device['optimizer_state']
  assert program['arguments'] >= held and program['aliased'] >= held
  assert report['peak'] == program['peak'] >= held and report['fits']
  text = plan.format_report(report)
  assert 'LoRA rank 16 on q,k,v,o,gate,up,down' in text and 'frozen base' in text
