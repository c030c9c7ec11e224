"""The mixture of experts' kernels compiled for a target that is not attached (its compiler must be
importable: .venv/compilers on PYTHONPATH, JAX_PLATFORMS=cpu, as tests/test_deviceless.py runs
them): the grouped expert MLP on one chip (ops/grouped_matmul.py) and one sparse layer's experts
under a mesh (model/expert_parallel.py). One JSON line each:

  python -m grpo_jax.plan.experts mlp TARGET [--rows R] [--forward-only] [--implementation I]
  python -m grpo_jax.plan.experts layer TARGET [--fsdp 2 --expert 4 --tensor 1] [--tokens T]
"""

import argparse
import functools
import json
import math
import re

import jax
import jax.numpy as jnp

from grpo_jax.model.expert_parallel import WEIGHT_AXES, experts_forward
from grpo_jax.ops.grouped_matmul import IMPLEMENTATIONS, QWEN3_30B_A3B, expert_mlp
from grpo_jax.plan import targets, traffic
from grpo_jax.sharding import LOGICAL_AXIS_RULES, MeshConfig, make_mesh, named_sharding


# ---- the grouped expert MLP on one chip (tests/test_grouped_matmul.py, bench/moe.py) ----

def compile_for(target_name: str, function, *shapes):
  """jit(function) compiled for one chip of a target (grpo_jax/plan/targets.py; its compiler must be
  importable) on arguments of shapes [(shape, dtype), ...], traced under that chip's mesh so that
  `target_platform` sees it."""
  from jax.sharding import NamedSharding, PartitionSpec

  target = targets.parse_target(target_name)
  mesh = jax.sharding.Mesh(target.devices()[:1], ('data',))
  one = NamedSharding(mesh, PartitionSpec())
  with jax.set_mesh(mesh):
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=one) for shape, dtype in shapes]
    return jax.jit(function).trace(*args).lower().compile(compiler_options=targets.compiler_options(target.platform))


def expert_mlp_function(backward: bool, **options):
  """(rows, group_sizes, gate, up, down) -> the expert MLP's output, or with backward the gradients
  of sum(out^2) / 2 with respect to the rows and the three weights. options: grouped_matmul's."""
  forward = functools.partial(expert_mlp, **options)
  if not backward:
    return forward

  def loss(rows, group_sizes, *weights):
    out = forward(rows, group_sizes, *weights).astype(jnp.float32)
    return 0.5 * jnp.sum(out * out)

  return jax.grad(loss, argnums=(0, 2, 3, 4))


def expert_mlp_shapes(rows: int, dtype='bfloat16', experts=QWEN3_30B_A3B['experts'],
                      model=QWEN3_30B_A3B['model'], hidden=QWEN3_30B_A3B['hidden']):
  return [((rows, model), dtype), ((experts,), jnp.int32), ((experts, model, hidden), dtype),
          ((experts, model, hidden), dtype), ((experts, hidden, model), dtype)]


# An array type in HLO text, e.g. bf16[128,4096,2048]: its element type and dimensions.
_ARRAY = r'\b(pred|[suf]\d+|bf16)\[([\d,]*)\]'


def xla_cost(compiled) -> dict:
  """XLA's cost analysis of a compiled program ('flops', 'bytes accessed', ...). XLA:GPU compiled
  deviceless answers None, so its optimized module goes through the same HloCostAnalysis by way of
  the host's CPU client (a private jax entry point). Custom calls, Pallas kernels among them,
  count as nothing in either."""
  cost = compiled.cost_analysis()
  if cost is None:
    from jax._src.lib import _jax
    module = compiled.runtime_executable().hlo_modules()[0]
    cost = _jax.hlo_module_cost_analysis(jax.devices('cpu')[0].client, module)
  return cost[0] if isinstance(cost, (list, tuple)) else cost


def program_summary(compiled, groups: int, rows: int) -> dict:
  """What a compiled program holds: its kernel custom calls by target, the arrays whose shape has
  both a `groups` and a `rows` dimension (a dense [E, R, *] expansion), its largest array, the
  compiler's temporary bytes and cost analysis (FLOPs and bytes accessed; XLA counts nothing
  inside a Triton custom call)."""
  import math
  import re
  text = compiled.as_text()
  calls = re.findall(r'custom_call_target="([^"]+)"', text)
  arrays = set()
  for dtype, dims in re.findall(_ARRAY, text):
    arrays.add((dtype, tuple(int(d) for d in dims.split(',') if d)))

  def size(array):
    dtype, dims = array
    bits = 1 if dtype == 'pred' else int(dtype.lstrip('subf') or 16)
    return max(1, bits // 8) * math.prod(dims)

  largest = max(arrays, key=size)
  cost = xla_cost(compiled)
  return dict(custom_calls={name: calls.count(name) for name in sorted(set(calls))},
              dense_expansion=sorted(f'{d}[{",".join(map(str, s))}]' for d, s in arrays
                                     if groups in s and rows in s),
              largest_array=f'{largest[0]}[{",".join(map(str, largest[1]))}]', largest_bytes=size(largest),
              temp_bytes=compiled.memory_analysis().temp_size_in_bytes,
              flops=float(cost.get('flops', 0.0)), bytes_accessed=float(cost.get('bytes accessed', 0.0)))



# ---- one sparse layer's experts under a mesh (tests/test_expert_parallel.py) ----

def compile_layer(target_name: str, mesh_shape: dict, tokens_per_device: int = 512, dtype='bfloat16', *,
                  experts: int = 128, model: int = 2048, hidden: int = 768, top_k: int = 8):
  """One sparse layer's experts, forward and the gradients of sum(out^2) / 2 with respect to x,
  gates and the three weights, compiled for `target_name` under a mesh of `mesh_shape` (sizes by
  axis name, the rest 1) laid out by the rule table, one row of `tokens_per_device` tokens a
  device. Defaults: Qwen3-30B-A3B's shapes. -> (compiled, mesh)."""
  config = MeshConfig(**{'fsdp': 1, **mesh_shape})
  target = targets.parse_target(target_name)
  mesh = make_mesh(config, target.devices()[:math.prod(config.shape)])
  rows = math.prod(dict(mesh.shape)[axis] for axis in dict(LOGICAL_AXIS_RULES)['batch'])
  shapes = [((rows, tokens_per_device, model), dtype, ('batch', 'seq', 'act_embed')),
            ((rows, tokens_per_device, top_k), jnp.int32, ('batch', 'seq', None)),
            ((rows, tokens_per_device, top_k), dtype, ('batch', 'seq', None)),
            ((experts, model, hidden), dtype, WEIGHT_AXES), ((experts, model, hidden), dtype, WEIGHT_AXES),
            ((experts, hidden, model), dtype, ('experts', 'mlp', 'embed'))]

  def loss(x, routes, gates, *weights):
    out = experts_forward(x, routes, gates, *weights).astype(jnp.float32)
    return 0.5 * jnp.sum(out * out)

  with jax.set_mesh(mesh):
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=named_sharding(mesh, shape, axes))
            for shape, dtype, axes in shapes]
    lowered = jax.jit(jax.grad(loss, argnums=(0, 2, 3, 4, 5))).trace(*args).lower()
    return lowered.compile(compiler_options=targets.compiler_options(target.platform)), mesh



def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog='python -m grpo_jax.plan.experts')
  commands = parser.add_subparsers(dest='command', required=True)
  mlp = commands.add_parser('mlp', help='the grouped expert MLP (Qwen3-30B-A3B shapes) on one chip')
  mlp.add_argument('target', help='e.g. h100x1, v5p-8 (grpo_jax/plan/targets.py)')
  mlp.add_argument('--rows', type=int, default=4096, help='R, (token, expert) rows')
  mlp.add_argument('--forward-only', action='store_true')
  mlp.add_argument('--implementation', default='auto', choices=IMPLEMENTATIONS)
  layer = commands.add_parser('layer', help="one sparse layer's experts under a mesh: its collectives")
  layer.add_argument('target', help='e.g. v5p-16, h100x8 (grpo_jax/plan/targets.py)')
  layer.add_argument('--fsdp', type=int, default=2)
  layer.add_argument('--expert', type=int, default=4)
  layer.add_argument('--tensor', type=int, default=1)
  layer.add_argument('--tokens', type=int, default=512, help='tokens per device')
  args = parser.parse_args(argv)
  if args.command == 'mlp':
    function = expert_mlp_function(not args.forward_only, implementation=args.implementation)
    compiled = compile_for(args.target, function, *expert_mlp_shapes(args.rows))
    print(json.dumps(dict(target=args.target, rows=args.rows, backward=not args.forward_only,
                          **program_summary(compiled, QWEN3_30B_A3B['experts'], args.rows))))
    return 0
  compiled, mesh = compile_layer(args.target, dict(fsdp=args.fsdp, expert=args.expert, tensor=args.tensor),
                                 args.tokens)
  text = compiled.as_text()
  found = traffic.collectives(text, mesh.size)
  calls = re.findall(r'custom_call_target="([^"]+)"', text)
  print(json.dumps(dict(
      target=args.target, mesh=dict(mesh.shape),
      ragged_all_to_all=len(re.findall(r' ragged-all-to-all(?:-start)?\(', text)),
      custom_calls={name: calls.count(name) for name in sorted(set(calls))},
      bytes_by_kind=traffic.totals(found, in_loop=False),
      collectives=[dict(kind=c.kind, bytes=c.bytes, count=c.count, groups=c.groups, where=c.where[-80:])
                   for c in found])))
  return 0


if __name__ == '__main__':
  raise SystemExit(main())
