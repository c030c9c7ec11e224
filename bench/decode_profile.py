"""python bench/decode_profile.py [--preset qwen2.5-0.5b] [--rows 64] [--trace DIR]

Where a GroupSampler decode step goes on the device at hand. One sampler call (P x G rows, prompt
Tp + N new tokens, no early stop) is timed, then run once under the JAX profiler; the trace's
device kernels are grouped by the HLO instruction they run and printed as a table: launches per
decode step, microseconds each, share of the device's busy time, and the bytes of the
instruction's operands and results (from the compiled program) over its time. The gaps between
kernels (launch latency, host round trips of the loop's condition) are the step's time minus
the kernels' busy time. The static half, kernels per decode step from the compiled program, is
printed on any backend (on the CPU it is all there is):

  python bench/decode_profile.py --preset qwen2.5-0.5b --dtype bfloat16 --rows 64 --trace $OUT/trace
"""

import argparse
import collections
import glob
import os
import re
import statistics
import sys
import tempfile
import time

import harness
from grpo_jax.plan import traffic

PRESETS = harness.presets('small', 'qwen2.5-0.5b', 'qwen2.5-1.5b', 'qwen2.5-7b')


def parse_args():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
  parser.add_argument('--preset', choices=sorted(PRESETS), default='qwen2.5-0.5b')
  parser.add_argument('--layers', type=int, help='overrides the preset')
  parser.add_argument('--rows', type=int, default=64, help='P x G')
  parser.add_argument('--group', type=int, default=8, help='G')
  parser.add_argument('--prompt-length', type=int, default=64)
  parser.add_argument('--new-tokens', type=int, default=64)
  parser.add_argument('--dtype', choices=('float32', 'bfloat16'), default='bfloat16')
  parser.add_argument('--decode-attention', default='dense', help='ModelOptions.decode_attention')
  parser.add_argument('--decode-layers', default='auto', help='ModelOptions.decode_layers: auto | scan | unrolled')
  parser.add_argument('--repeats', type=int, default=5)
  parser.add_argument('--trace', help='keep the profiler trace in this folder (default: a temporary one)')
  parser.add_argument('--top', type=int, default=24, help='rows of the kernel table')
  return parser.parse_args()


def instruction_bytes(text: str) -> dict:
  """Each instruction of an optimized HLO module's text -> the bytes of its result and of its
  operands (written by name; their shapes read from the instructions that define them)."""
  lines = [m for m in map(traffic._INSTRUCTION.match, text.splitlines()) if m]
  shapes = {m.group(1): m.group(2) for m in lines}
  operand_bytes = lambda m: sum(sum(traffic._shape_bytes(shapes.get(name, '')))  # noqa: E731
                                for name in re.findall(r'%([\w.\-]+)', m.group(4).split(')')[0]))
  return {m.group(1): sum(traffic._shape_bytes(m.group(2))) + operand_bytes(m) for m in lines}


def device_events(trace_dir: str):
  """(start_ns, duration_ns, name, hlo_op) of every kernel and copy on the first GPU's streams."""
  from jax.profiler import ProfileData
  paths = glob.glob(os.path.join(trace_dir, '**', '*.xplane.pb'), recursive=True)
  if not paths:
    return [], 'no xplane.pb written'
  data = ProfileData.from_file(max(paths, key=os.path.getmtime))
  planes = [p for p in data.planes if p.name.startswith('/device:GPU') or p.name.startswith('/device:TPU')]
  if not planes:
    return [], 'no device plane: ' + ', '.join(p.name for p in data.planes)
  plane = sorted(planes, key=lambda p: p.name)[0]
  lines = list(plane.lines)
  streams = [line for line in lines if line.name.startswith('Stream')]
  # 'XLA Ops' / 'XLA Modules' / 'Steps' are derived lines over the same time as the streams.
  streams = streams or [line for line in lines if not line.name.startswith(('XLA', 'Steps', 'Framework'))]
  events = []
  for line in streams:
    for event in line.events:
      stats = dict(event.stats)
      op = stats.get('hlo_op') or stats.get('tf_op') or ''
      events.append((event.start_ns, event.duration_ns, event.name, str(op)))
  return events, f'{plane.name}: lines {[line.name for line in lines]}'


def main():
  args = parse_args()
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  from grpo_jax.model import ModelOptions, Qwen2Config, init_model
  from grpo_jax.sampler import DecodeSettings, GroupSampler, SamplingConfig

  overrides = {'num_hidden_layers': args.layers} if args.layers else {}
  config = Qwen2Config(**{**PRESETS[args.preset], **overrides})
  model = init_model(config, options=ModelOptions(dtype=args.dtype, param_dtype=args.dtype,
                                                  decode_attention=args.decode_attention,
                                                  decode_layers=args.decode_layers))
  P, G, Tp, N = args.rows // args.group, args.group, args.prompt_length, args.new_tokens
  sampler = GroupSampler(model, group_size=G, settings=DecodeSettings(
      max_new_tokens=N, stop_token_ids=(), pad_id=0, sampling=SamplingConfig(temperature=1.0, top_k=0, top_p=1.0)))
  state = nnx.state(model)
  prompts = jax.device_put(np.random.default_rng(0).integers(1, config.vocab_size, (P, Tp), dtype=np.int32))
  mask = jax.device_put(np.ones((P, Tp), np.int32))
  key = jax.random.key(0)
  flags = os.environ.get('XLA_FLAGS', '')
  print(f'{args.preset} ({config.num_hidden_layers} layers), {args.rows} rows, prompt {Tp} + {N} new tokens, '
        f'{args.dtype}, decode attention {args.decode_attention}, layers {args.decode_layers}, {jax.devices()[0].device_kind}, jax '
        f'{jax.__version__}, XLA_FLAGS={flags!r}')

  compiled = sampler._run.lower(state, prompts, mask, key).compile()
  text = compiled.as_text()
  static = traffic.decode_step_kernels(text)  # the plan's count of one token-loop iteration
  sizes = instruction_bytes(text)
  print(f'compiled: {static.kernels} kernels per decode step, {static.bytes / 2**20:.1f} MiB of their operands '
        f'and results, {static.copied / 2**20:.1f} MiB written by copies and slices')

  def call():
    return jax.block_until_ready(sampler(state, prompts, mask, key))
  start = time.perf_counter(); call(); first = time.perf_counter() - start
  times = []
  for _ in range(args.repeats):
    start = time.perf_counter(); out = call(); times.append(time.perf_counter() - start)
  assert int(out.lengths.min()) == N, 'every row must decode N tokens'
  total = statistics.median(times)
  print(f'sampler call: first {first:.2f} s, median {total * 1e3:.2f} ms over {args.repeats} '
        f'({total / N * 1e3:.3f} ms per token step, prefill included)')
  if jax.default_backend() == 'cpu':
    return 0

  trace = args.trace or tempfile.mkdtemp(prefix='decode_profile_')
  with jax.profiler.trace(trace):
    call()
  events, where = device_events(trace)
  print(f'trace: {trace}; {where}')
  if not events:
    print('no device kernels in the trace (the profiler could not read the device): static table only')
    return 0
  events.sort()
  window = events[-1][0] + events[-1][1] - events[0][0]
  busy, end = 0, events[0][0]
  gaps = []
  for start_ns, duration, _, _ in events:  # union of busy intervals over all streams
    if start_ns > end:
      gaps.append(start_ns - end)
    busy += max(0, start_ns + duration - max(start_ns, end))
    end = max(end, start_ns + duration)
  groups = collections.defaultdict(list)
  for _, duration, name, op in events:
    groups[(op or name)[:60], name[:40]].append(duration)
  print(f'device window {window / 1e6:.2f} ms, kernels busy {busy / 1e6:.2f} ms ({busy / window:.0%}), '
        f'{len(events)} kernels = {len(events) / N:.1f} per token step; gaps {len(gaps)}, '
        f'{sum(gaps) / 1e6:.2f} ms in all, {sum(g for g in gaps if g > 20_000) / 1e6:.2f} ms in '
        f'{sum(g > 20_000 for g in gaps)} gaps over 20 us, largest {max(gaps, default=0) / 1e3:.0f} us')
  print(f'{"hlo op":<40} {"kernel":<32} {"per step":>8} {"us each":>8} {"share":>6} {"MiB":>8} {"GB/s":>7}')
  rows = sorted(groups.items(), key=lambda item: -sum(item[1]))
  for (op, name), durations in rows[:args.top]:
    mean = sum(durations) / len(durations)
    size = sizes.get(op.lstrip('%'))
    rate = f'{size / mean:>7.0f}' if size else f'{"-":>7}'  # bytes / ns = GB/s
    mib = f'{size / 2**20:>8.2f}' if size else f'{"-":>8}'
    print(f'{op[:40]:<40} {name[:32]:<32} {len(durations) / N:>8.1f} {mean / 1e3:>8.1f} '
          f'{sum(durations) / busy:>6.1%} {mib} {rate}')
  print(f'({len(rows) - args.top} more groups; MiB: operands + results of the HLO instruction, an upper '
        f'bound for in-place updates)' if len(rows) > args.top else '')
  return 0


if __name__ == '__main__':
  sys.exit(main())
