"""python bench/moe.py [--targets v5p-8,h100x1] [--decode-tokens 64] [--update-tokens 4096] [--json FILE]

One Qwen3-30B-A3B sparse layer's experts (E = 128 SwiGLU experts of width M = 768 at D = 2,048, k = 8
a token) against a dense SwiGLU of the same active parameters (width k * M = 6,144), compiled for
targets that are not attached (deviceless, grpo_jax/plan/targets.py), for a decode step (N tokens,
R = N * k rows) and an update micro-batch, forward and forward + backward (gradients of
sum(out^2) / 2 with respect to the input and the weights). Per program, FLOPs and bytes from XLA's
cost analysis of the compiled program:

  grouped   the three grouped matmuls over R rows already sorted by expert (ops/grouped_matmul.py
            `expert_mlp`, routing balanced: R / E rows an expert). On GPU XLA counts the Triton
            kernels as nothing, so their FLOPs and bytes are counted from their tiles
            (`triton_cost`) and added: a model, labelled 'counted'.
  dense     the dense SwiGLU on N tokens.
  routing   model/moe.py's whole `experts_forward` (argsort, gather, gate weighting, scatter-add
            around the same matmuls) less `grouped`: the sort/gather/scatter overhead. Meaningful
            only where experts_forward keeps its matmuls grouped ('dense [E,R]' flags a program
            whose ragged dots XLA expanded over the experts, as XLA:GPU does with ragged_dot).

  replay    the router of one layer (model/moe.py `route`) on the update's tokens, forward and
            backward, routing by its own top-k against replaying recorded experts (the top-k still
            runs, for the re-routed count); and what recording costs the sampler: the routes it
            writes per decode step and holds per RL step (one byte per token, sparse layer and k).

Nothing is timed: these are the compilers' counts, not measurements. Run with the compilers on the
path:

  PYTHONPATH=.venv/compilers:. JAX_PLATFORMS=cpu TPU_WORKER_HOSTNAMES=localhost \\
    ALLOW_MULTIPLE_LIBTPU_LOAD=1 .venv/bin/python bench/moe.py
"""

import argparse
import json
import os
import sys

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from grpo_jax.model import moe  # noqa: E402
from grpo_jax.ops import grouped_matmul as gm  # noqa: E402
from grpo_jax.plan import experts, targets  # noqa: E402

SHAPE = gm.QWEN3_30B_A3B
DTYPE = 'bfloat16'


def parse_args():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
  parser.add_argument('--targets', default='v5p-8,h100x1', help='comma-separated target names')
  parser.add_argument('--decode-tokens', type=int, default=64, help='N of a decode step')
  parser.add_argument('--update-tokens', type=int, default=4096, help='N of an update micro-batch')
  parser.add_argument('--json', help='also write the rows as JSON')
  parser.add_argument('--rollout-rows', type=int, default=1024, help='rows a recipe samples per step (routes held)')
  parser.add_argument('--sequence', type=int, default=12288, help='prompt + completion tokens of a row')
  parser.add_argument('--layers', type=int, default=48, help="sparse layers (Qwen3-30B-A3B's 48)")
  return parser.parse_args()


def loss_gradients(function, argnums):
  def loss(*args):
    out = function(*args).astype(jnp.float32)
    return 0.5 * jnp.sum(out * out)
  return jax.grad(loss, argnums=argnums)


def dense_swiglu(x, gate, up, down):
  """x [N, D]; gate / up [D, F]; down [F, D]."""
  return (jax.nn.silu(x @ gate) * (x @ up)) @ down


def dense_program(tokens: int, backward: bool):
  model, width = SHAPE['model'], SHAPE['top_k'] * SHAPE['hidden']
  shapes = [((tokens, model), DTYPE), ((model, width), DTYPE), ((model, width), DTYPE), ((width, model), DTYPE)]
  return (loss_gradients(dense_swiglu, (0, 1, 2, 3)) if backward else dense_swiglu), shapes


def layer_program(tokens: int, backward: bool):
  """model/moe.py's experts_forward on [1, N, D] tokens routed to k experts each."""
  experts, model, hidden, top_k = SHAPE['experts'], SHAPE['model'], SHAPE['hidden'], SHAPE['top_k']
  shapes = [((1, tokens, model), DTYPE), ((1, tokens, top_k), jnp.int32), ((1, tokens, top_k), DTYPE),
            ((experts, model, hidden), DTYPE), ((experts, model, hidden), DTYPE), ((experts, hidden, model), DTYPE)]
  function = moe.experts_forward
  return (loss_gradients(function, (0, 2, 3, 4, 5)) if backward else function), shapes


def router_program(tokens: int, replay: bool):
  """route() of one layer on [1, N, D] tokens, forward and backward (the router's gradient)."""
  experts, model, top_k = SHAPE['experts'], SHAPE['model'], SHAPE['top_k']

  def gates(h, router, recorded):
    _, gates, probabilities, differs = moe.route(h, router, top_k=top_k, norm_topk_prob=True,
                                                 replay=recorded if replay else None)
    return gates.astype(jnp.float32).sum() + probabilities.sum() + differs.sum()

  shapes = [((1, tokens, model), DTYPE), ((model, experts), DTYPE), ((1, tokens, top_k), jnp.uint8)]
  return jax.grad(gates, argnums=(0, 1)), shapes


def replay_rows(target: str, tokens: int) -> dict:
  own, replayed = (measure(target, *router_program(tokens, replay), tokens) for replay in (False, True))
  return dict(target=target, tokens=tokens, own=own, replayed=replayed)


def kernel_cost(rows: int, backward: bool) -> dict:
  """The Triton kernels of `grouped` at balanced routing, counted from their tiles."""
  experts, model, hidden = SHAPE['experts'], SHAPE['model'], SHAPE['hidden']
  sizes = np.full(experts, rows // experts)
  sizes[: rows % experts] += 1
  itemsize = jnp.dtype(DTYPE).itemsize
  calls = [(model, hidden), (model, hidden), (hidden, model)]  # gate, up, down: (inner, outer)
  parts = [gm.triton_cost(sizes, inner, outer, itemsize) for inner, outer in calls]
  if backward:
    parts += [gm.triton_cost(sizes, outer, inner, itemsize) for inner, outer in calls]  # d rows
    parts += [gm.triton_cost(sizes, inner, outer, itemsize, weight_gradient=True) for inner, outer in calls]
  return dict(flops=sum(p['flops'] for p in parts), bytes=sum(p['bytes'] for p in parts))


def measure(target: str, function, shapes, rows: int) -> dict:
  compiled = experts.compile_for(target, function, *shapes)
  summary = experts.program_summary(compiled, SHAPE['experts'], rows)
  return dict(flops=summary['flops'], bytes=summary['bytes_accessed'], temp=summary['temp_bytes'],
              dense=bool(summary['dense_expansion']), calls=sum(summary['custom_calls'].values()))


def row(target: str, phase: str, tokens: int, backward: bool) -> dict:
  rows = tokens * SHAPE['top_k']
  platform = targets.parse_target(target).platform
  grouped = measure(target, experts.expert_mlp_function(backward), experts.expert_mlp_shapes(rows, DTYPE), rows)
  counted = platform == 'gpu'
  if counted:  # XLA's count holds the SwiGLU's elementwise part and the tile map, not the kernels
    kernels = kernel_cost(rows, backward)
    grouped['flops'] += kernels['flops']
    grouped['bytes'] += kernels['bytes']
  dense = measure(target, *dense_program(tokens, backward), rows)
  layer = measure(target, *layer_program(tokens, backward), rows)
  if counted and not layer['dense']:
    layer['flops'] += kernels['flops']
    layer['bytes'] += kernels['bytes']
  return dict(target=target, phase=phase, tokens=tokens, rows=rows, backward=backward, counted=counted,
              grouped=grouped, dense=dense, layer=layer,
              routing=None if layer['dense'] else dict(flops=layer['flops'] - grouped['flops'],
                                                       bytes=layer['bytes'] - grouped['bytes']))


def main():
  args = parse_args()
  rows = []
  for target in args.targets.split(','):
    for phase, tokens in (('decode', args.decode_tokens), ('update', args.update_tokens)):
      for backward in (False, True):
        with targets.compiler_log([]):  # the compilers' own log lines stay out of the table
          rows.append(row(target, phase, tokens, backward))
  print(f'# Qwen3-30B-A3B experts: E={SHAPE["experts"]}, D={SHAPE["model"]}, M={SHAPE["hidden"]}, '
        f'k={SHAPE["top_k"]}, {DTYPE}; dense SwiGLU F={SHAPE["top_k"] * SHAPE["hidden"]}. GFLOP and GB '
        'from XLA cost analysis ("counted": GPU kernels counted from their tiles)')
  print(f'{"target":<8}{"phase":<8}{"pass":<9}{"R":>7}{"grouped GFLOP":>15}{"dense GFLOP":>13}{"ratio":>7}'
        f'{"grouped GB":>12}{"dense GB":>10}{"ratio":>7}{"routing GFLOP":>15}{"routing GB":>12}{"temp MiB":>10}')
  for r in rows:
    g, d, routing = r['grouped'], r['dense'], r['routing']
    extra = (f'{"dense [E,R]":>15}{"":>12}' if routing is None else
             f'{routing["flops"] / 1e9:>15.2f}{routing["bytes"] / 1e9:>12.3f}')
    print(f'{r["target"]:<8}{r["phase"]:<8}{"fwd+bwd" if r["backward"] else "fwd":<9}{r["rows"]:>7}'
          f'{g["flops"] / 1e9:>15.2f}{d["flops"] / 1e9:>13.2f}{g["flops"] / d["flops"]:>7.3f}'
          f'{g["bytes"] / 1e9:>12.3f}{d["bytes"] / 1e9:>10.3f}{g["bytes"] / d["bytes"]:>7.2f}'
          f'{extra}{r["layer"]["temp"] / 2**20:>10.1f}' + ('  counted' if r['counted'] else ''))
  replay = [replay_rows(target, args.update_tokens) for target in args.targets.split(',')]
  print(f'\n# Routing replay: one layer\'s router on {args.update_tokens} tokens, forward + backward, own top-k '
        'against replaying recorded experts')
  print(f'{"target":<8}{"own MFLOP":>11}{"replay MFLOP":>14}{"own MB":>9}{"replay MB":>11}')
  for r in replay:
    print(f'{r["target"]:<8}{r["own"]["flops"] / 1e6:>11.1f}{r["replayed"]["flops"] / 1e6:>14.1f}'
          f'{r["own"]["bytes"] / 1e6:>9.2f}{r["replayed"]["bytes"] / 1e6:>11.2f}')
  per_token = args.layers * SHAPE['top_k']  # uint8 ids: one byte each
  print(f'recording: {per_token} bytes a token ({args.layers} sparse layers x k={SHAPE["top_k"]}); a decode step of '
        f'{args.decode_tokens} rows writes {args.decode_tokens * per_token / 1024:.1f} KiB; an RL step of '
        f'{args.rollout_rows} rows x {args.sequence} tokens holds {args.rollout_rows * args.sequence * per_token / 2**30:.2f} GiB')
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(dict(experts=rows, replay=replay), f, indent=1)


if __name__ == '__main__':
  main()
