"""Probes: small programs compiled deviceless for a target (plan/targets.py) to measure one thing
each: the Pallas log-prob kernels, the ragged decode-attention kernel, one decode step's kernels at
several depths, and the link each mesh axis's collectives use. Their command line is
`python -m grpo_jax.plan.targets WHAT TARGET ...` (`main`).
"""

import os

from grpo_jax.errors import UserError
from grpo_jax.plan.targets import Target, compiler_options, parse_target

# The Qwen2.5 hidden widths the kernels are compiled at: 0.5B, 7B, 14B/32B.
KERNEL_WIDTHS = (896, 3584, 5120)
# The log-prob kernels' custom call: Mosaic on TPUs, Mosaic GPU on GPUs (ops/logprob.py).
KERNEL_CALLS = {'tpu': 'tpu_custom_call', 'gpu': 'mosaic_gpu_v2'}
# The ragged decode-attention kernel's: Mosaic on TPUs, Mosaic GPU on GPUs (ops/decode_attention.py).
DECODE_KERNEL_CALLS = {'tpu': 'tpu_custom_call', 'gpu': 'mosaic_gpu_v2'}


def compile_logprob_kernels(target: Target, widths=KERNEL_WIDTHS, dtypes=None,
                            tokens: int = 2048, vocab: int = 152064, implementation: str | None = None,
                            **blocks) -> list[dict]:
  """Compiles the fused log-prob op's forward and backward Pallas kernels (ops/logprob.py) for one
  chip of `target` at each width and dtype; one dict per compile: width, dtype, kernel calls in
  the lowered program, seconds, and the compiler's error if it refused. `blocks` overrides the tile
  sizes (block_tokens, block_vocab, block_model). implementation: the kernels to compile, by default
  'pallas_mosaic_gpu' on GPUs and 'pallas_mosaic' on TPUs. dtypes: by default bfloat16 and float32,
  bfloat16 alone for 'pallas_mosaic_gpu' (its kernels take 16-bit h and W on a GPU)."""
  import time

  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec

  from grpo_jax.ops import token_logprobs

  device = target.devices()[0]
  mesh = jax.sharding.Mesh([device], ('data',))
  one = NamedSharding(mesh, PartitionSpec())
  implementation = implementation or ('pallas_mosaic_gpu' if target.platform == 'gpu' else 'pallas_mosaic')
  dtypes = dtypes or (('bfloat16',) if implementation == 'pallas_mosaic_gpu' else ('bfloat16', 'float32'))
  call = KERNEL_CALLS[target.platform]
  results = []
  for width in widths:
    for dtype in dtypes:
      def loss(h, w, y):
        return token_logprobs(h, w, y, implementation=implementation, return_entropy=True, **blocks)[0].sum()

      args = (jax.ShapeDtypeStruct((tokens, width), dtype, sharding=one),
              jax.ShapeDtypeStruct((width, vocab), dtype, sharding=one),
              jax.ShapeDtypeStruct((tokens,), jnp.int32, sharding=one))
      start = time.perf_counter()
      result = dict(target=target.name, width=width, dtype=dtype, kernel_calls=0, error=None)
      try:
        with jax.set_mesh(mesh):
          lowered = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).trace(*args).lower()
        result['kernel_calls'] = lowered.as_text().count(f'@{call}')
        lowered.compile(compiler_options=compiler_options(target.platform))
      except Exception as error:  # reported, not raised: the caller decides what a refusal means
        result['error'] = f'{type(error).__name__}: {str(error).strip()[:500]}'
      result['seconds'] = round(time.perf_counter() - start, 2)
      results.append(result)
  return results


# Qwen2.5 attention shapes the decode-attention kernel is compiled at: 0.5B, 7B, 32B.
DECODE_ATTENTION_HEADS = {'0.5B': dict(heads=14, kv_heads=2, head_dim=64),
                          '7B': dict(heads=28, kv_heads=4, head_dim=128),
                          '32B': dict(heads=40, kv_heads=8, head_dim=128)}


def compile_decode_attention_kernels(target: Target, models=tuple(DECODE_ATTENTION_HEADS), dtypes=('bfloat16',),
                                     batch: int = 64, slots: int = 4096, layers: int = 2, tokens: int = 1,
                                     block: int = 256, mesh_shape: dict | None = None) -> list[dict]:
  """Compiles the ragged decode-attention kernel (ops/decode_attention.py) for one chip of `target`
  at each model's head shapes and dtype, reading a stacked [layers, batch, slots, K, H] cache; one
  dict per compile, as compile_logprob_kernels gives them, plus the compiled program's temporary
  bytes and one layer's cache bytes per device: temporaries that large would be a copy of the cache.
  mesh_shape (e.g. {'data': 2, 'tensor': 4}): on that mesh over the target's first devices instead,
  the inputs laid out as the sampler lays them out (rows over the batch axes, kv heads over tensor),
  so the kernel runs inside its shard_map.

  The caches are pinned to the row-major layout the kernel reads. Left to itself, XLA:TPU lays a
  [L, B, S, 2, 64] bf16 parameter (the 0.5B shape) out with S minor, and then copies both whole
  stacked caches into the kernel's layout on every call."""
  import math
  import time

  import jax
  import jax.numpy as jnp
  from jax.experimental.layout import Format, Layout

  from grpo_jax.ops.decode_attention import ragged_cache_attention
  from grpo_jax.sharding import MeshConfig, make_mesh, named_sharding

  devices = target.devices()
  sizes = {'fsdp': 1, **(mesh_shape or {})}
  mesh = make_mesh(MeshConfig(**sizes), devices[:math.prod(sizes.values())])
  results = []
  for model, dtype in ((model, dtype) for model in models for dtype in dtypes):
    heads = DECODE_ATTENTION_HEADS[model]
    shape = (layers, batch, slots, heads['kv_heads'], heads['head_dim'])
    layout = named_sharding(mesh, shape, ('layers', 'batch', 'cache_seq', 'kv_heads', 'head_dim'))
    cache = jax.ShapeDtypeStruct(shape, dtype, sharding=Format(Layout(tuple(range(len(shape)))), layout))
    rows = jax.ShapeDtypeStruct((batch, tokens), jnp.int32, sharding=named_sharding(mesh, (batch, tokens), ('batch', None)))
    q_shape = (batch, tokens, heads['heads'], heads['head_dim'])
    args = (jax.ShapeDtypeStruct(q_shape, dtype, sharding=named_sharding(mesh, q_shape, ('batch', None, 'q_heads', None))),
            cache, cache, jax.ShapeDtypeStruct((), jnp.int32, sharding=named_sharding(mesh, (), ())),
            jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=named_sharding(mesh, (batch,), ('batch',))),
            jax.ShapeDtypeStruct((batch, slots), jnp.int32, sharding=named_sharding(mesh, (batch, slots), ('batch', None))),
            rows, rows)
    start = time.perf_counter()
    result = dict(target=target.name, model=model, dtype=dtype, block=block, kernel_calls=0, error=None,
                  mesh=dict(mesh.shape), temp_bytes=None,
                  layer_cache_bytes=math.prod(layout.shard_shape(shape)) // layers * jnp.dtype(dtype).itemsize)
    try:
      with jax.set_mesh(mesh):
        lowered = jax.jit(lambda *a: ragged_cache_attention(*a, block=block)).trace(*args).lower()
      result['kernel_calls'] = lowered.as_text().count(f'@{DECODE_KERNEL_CALLS[target.platform]}')
      compiled = lowered.compile(compiler_options=compiler_options(target.platform))
      result['temp_bytes'] = compiled.memory_analysis().temp_size_in_bytes
    except Exception as error:  # reported, not raised: the caller decides what a refusal means
      result['error'] = f'{type(error).__name__}: {str(error).strip()[:500]}'
    result['seconds'] = round(time.perf_counter() - start, 2)
    results.append(result)
  return results


def compile_decode_step(target: Target, preset: str = '0.5B', layers: tuple[int, ...] = (2, 3), decode_attention: str = 'dense',
                        rows: int = 64, group: int = 8, prompt: int = 512, new_tokens: int = 1024,
                        dtype: str = 'bfloat16') -> list[dict]:
  """The group sampler's program for a model `preset` (model/presets.py) at each depth in `layers`,
  compiled for one chip of `target`: P = rows / group prompts of `prompt` tokens, `new_tokens` to
  decode (the 0.5B recipe's shape by default), `decode_attention` (ModelOptions'). -> one dict per
  depth: the kernels of one decode step (traffic.decode_step_kernels) and their operands' bytes; the
  kernels per layer are the difference between two depths (the rest of a step, sampling and the
  head, is the same at every depth)."""
  import time

  import jax
  import jax.numpy as jnp
  from flax import nnx

  from grpo_jax.model import ModelOptions, presets
  from grpo_jax.model.loading import abstract_model
  from grpo_jax.plan import traffic
  from grpo_jax.sampler import DecodeSettings, GroupSampler, SamplingConfig
  from grpo_jax.sharding import MeshConfig, make_mesh, placed_abstract, state_shardings

  mesh = make_mesh(MeshConfig(fsdp=1), target.devices()[:1])
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  options = ModelOptions(dtype=dtype, param_dtype=dtype, decode_attention=decode_attention)
  prompts = jax.ShapeDtypeStruct((rows // group, prompt), jnp.int32, sharding=replicated)
  key = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=replicated)
  settings = DecodeSettings(max_new_tokens=new_tokens, stop_token_ids=(0,), pad_id=0,
                            sampling=SamplingConfig(temperature=1.0, top_k=0, top_p=1.0))
  results = []
  for depth in layers:
    model = abstract_model(presets.preset(preset, num_hidden_layers=depth), options)
    state = nnx.state(model)
    state = placed_abstract(state, state_shardings(state, mesh))
    sampler = GroupSampler(model, group_size=group, settings=settings)
    start = time.perf_counter()
    with jax.set_mesh(mesh):
      compiled = jax.jit(sampler.__call__).trace(state, prompts, prompts, key).lower().compile(
          compiler_options=compiler_options(target.platform))
    kernels = traffic.decode_step_kernels(compiled.as_text())
    results.append(dict(target=target.name, preset=preset, layers=depth, decode_attention=decode_attention,
                        kernels=kernels.kernels, bytes=kernels.bytes, copied=kernels.copied,
                        seconds=round(time.perf_counter() - start, 2)))
  return results


def probe_links(target: Target, mesh_shape: dict, megabytes: int = 4) -> list[dict]:
  """Which link each mesh axis's collectives use on `target`: a program over a mesh of `mesh_shape`
  (make_mesh's order) that all-reduces a `megabytes` MiB fp32 array over each axis of size > 1 in
  turn, compiled by the target's compiler and read back as the plan reads its programs (traffic.py).
  -> one dict per axis: its size, the link classes and bytes per device found (what a hand count
  says: the axis's own bytes, on 'network' when its groups span GPU hosts)."""
  import functools

  import jax
  import jax.numpy as jnp
  from jax.sharding import PartitionSpec

  from grpo_jax.plan import traffic
  from grpo_jax.sharding import MeshConfig, make_mesh

  devices = target.devices()
  mesh = make_mesh(MeshConfig(**mesh_shape), devices)
  order = list(mesh.devices.reshape(-1))
  link = functools.cache(lambda group: target.link([order[i] for i in group]))
  results = []
  for axis, size in mesh.shape.items():
    if size == 1:
      continue
    x = jax.ShapeDtypeStruct((size, megabytes << 18), jnp.float32,
                             sharding=jax.sharding.NamedSharding(mesh, PartitionSpec(axis)))
    reduce = jax.shard_map(lambda x, axis=axis: jax.lax.psum(x, axis), mesh=mesh, in_specs=PartitionSpec(axis),
                           out_specs=PartitionSpec(axis))
    hlo = jax.jit(reduce).trace(x).lower().compile(compiler_options=compiler_options(target.platform)).as_text()
    found = traffic.by_link(traffic.collectives(hlo, len(order)), False, link, target.link_bandwidth_of)
    results.append(dict(target=target.name, axis=axis, size=size,
                        links={name: entry['bytes'] for name, entry in found.items()}))
  return results


def _mesh_flag(text: str) -> dict:
  """--mesh data=8,fsdp=8 (or hybrid=true|false|auto) -> MeshConfig fields."""
  shape = {}
  for item in text.split(','):
    name, _, value = (part.strip() for part in item.partition('='))
    if name == 'hybrid' and value in ('true', 'false', 'auto'):
      shape[name] = value if value == 'auto' else value == 'true'
    elif value.lstrip('-').isdigit():
      shape[name] = int(value)
    else:
      raise UserError(f'--mesh {text!r}: write axis=size pairs, e.g. data=8,fsdp=8 (or hybrid=true|auto)')
  return shape


def main(argv=None) -> int:
  """python -m grpo_jax.plan.targets kernels TARGET [--width D ...]: compiles the Pallas log-prob kernels
  for TARGET and prints one JSON line per compile (exit 1 if any was refused);
  python -m grpo_jax.plan.targets decode-attention TARGET [--block block=SIZE] [--tokens T]: the same for
  the ragged decode-attention kernel (T query tokens per row); python -m grpo_jax.plan.targets decode-step
  TARGET [--preset NAME] [--layers N ...] [--decode-attention pallas]: one decode step's kernels at each
  depth (compile_decode_step); python -m grpo_jax.plan.targets links TARGET --mesh data=8,fsdp=8: the link
  each mesh axis's collectives use (probe_links), one JSON line per axis."""
  import argparse
  import json
  parser = argparse.ArgumentParser(prog='python -m grpo_jax.plan.targets')
  parser.add_argument('what', choices=['kernels', 'decode-attention', 'decode-step', 'links'])
  parser.add_argument('target')
  parser.add_argument('--width', type=int, action='append', help='hidden width(s) (default: 896, 3584, 5120)')
  parser.add_argument('--dtype', action='append', choices=['bfloat16', 'float32'])
  parser.add_argument('--implementation', choices=['pallas_mosaic', 'pallas_mosaic_gpu'],
                      help='kernels: whose kernels (default: pallas_mosaic_gpu on GPUs, pallas_mosaic on TPUs)')
  parser.add_argument('--block', action='append', default=[], metavar='NAME=SIZE',
                      help='tile size override, e.g. block_tokens=256 (repeatable)')
  parser.add_argument('--tokens', type=int, default=1,
                      help='decode-attention: query tokens per row (1: a decode step; more: a prefill chunk)')
  parser.add_argument('--preset', default='0.5B', help='decode-step: the model preset (model/presets.py)')
  parser.add_argument('--layers', type=int, action='append', help='decode-step: depths to compile (default: 2, 3)')
  parser.add_argument('--decode-attention', default='dense', help='decode-step: model.decode_attention')
  parser.add_argument('--rows', type=int, default=64, help='decode-step: P x G rows')
  parser.add_argument('--prompt-length', type=int, default=512, help='decode-step: prompt tokens')
  parser.add_argument('--new-tokens', type=int, default=1024, help='decode-step: tokens to decode (the cache\'s slots)')
  parser.add_argument('--mesh', help='links: the mesh (default fsdp=-1), e.g. data=8,fsdp=8 or hybrid=true; '
                      'decode-attention: compile under this mesh, e.g. data=2,tensor=4 (default: one chip)')
  args = parser.parse_args(argv)
  os.environ.setdefault('JAX_PLATFORMS', 'cpu')
  blocks = {name: int(size) for name, size in (item.split('=', 1) for item in args.block)}
  if args.what == 'links':
    shape = _mesh_flag(args.mesh or 'fsdp=-1')
    for result in probe_links(parse_target(args.target), {'fsdp': -1 if 'hybrid' in shape else 1, **shape}):
      print(json.dumps(result), flush=True)
    return 0
  if args.what == 'decode-step':
    for result in compile_decode_step(parse_target(args.target), args.preset, tuple(args.layers or (2, 3)),
                                      args.decode_attention, rows=args.rows, prompt=args.prompt_length,
                                      new_tokens=args.new_tokens):
      print(json.dumps(result), flush=True)
    return 0
  if args.what == 'decode-attention':
    results = compile_decode_attention_kernels(parse_target(args.target), dtypes=tuple(args.dtype or ('bfloat16',)),
                                               tokens=args.tokens,
                                               mesh_shape=_mesh_flag(args.mesh) if args.mesh else None, **blocks)
  else:
    results = compile_logprob_kernels(parse_target(args.target), tuple(args.width or KERNEL_WIDTHS),
                                      tuple(args.dtype or ()), implementation=args.implementation, **blocks)
  for result in results:
    print(json.dumps(result), flush=True)
  return 1 if any(result['error'] for result in results) else 0
