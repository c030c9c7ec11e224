"""python bench/lora.py [--presets small,mid] [--ranks 16,64] [--batch 64] [--cache 1024] [--dtype float32]
   python bench/lora.py --demo [--demo-steps 200] [--demo-repeats 2]
   PYTHONPATH=.venv/compilers:. JAX_PLATFORMS=cpu python bench/lora.py --target h100x1 --presets qwen2.5-0.5b
       --dtype bfloat16

LoRA decoding: one decode step (the model's `extend` of one token per row over a KV cache half
full, jitted) of the base model, of the LoRA model with its adapters applied unmerged
(y = x W + s (x A) B) and of the merged model (W + s A B precomputed), side by side in one process;
then the merge itself (`lora.merged`, jitted), which a merged sampler would run once per RL step,
in decode steps: merging pays off when an RL step decodes more steps than merge / (unmerged -
merged). Every target adapted; the merged copy's bytes are those of every adapted weight once
more, resident beside the base (which stays frozen: the trainer and pi_ref read it). Also what
the merged weights, stored in W's dtype, lose of s A B (bf16 rounds small updates away).

--demo: the CPU demo's seconds per RL step with and without LoRA (`python -m grpo_jax.train` of
configs/tiny_arith.yaml and configs/tiny_arith_lora.yaml, in turns), the median over the steps
after the first chunk of train.steps_per_call (which compiles).

--target: the decode step compiled for an accelerator without one (grpo_jax.plan.targets), base and
unmerged: the kernels one step launches and the bytes XLA's concatenations write per step (XLA:GPU
joins dots that share an input, such as x W and x A, into one matmul over [W | A], a copy of W).
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

import harness

PRESETS = harness.presets('small', 'mid', 'qwen2.5-0.5b', 'qwen2.5-7b')  # 7B: --target only (fp32 28 GB)
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..')
CHUNK = 10  # the demos' train.steps_per_call: steps per jitted call, the first of which compiles
DEMOS = {'base': 'configs/tiny_arith.yaml', 'lora': 'configs/tiny_arith_lora.yaml'}


def parse_args():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[5])
  parser.add_argument('--presets', default='small,mid', help=f'comma-separated, of {", ".join(PRESETS)}')
  parser.add_argument('--ranks', default='16,64', help='comma-separated LoRA ranks')
  parser.add_argument('--batch', type=int, default=64, help='B, rows decoded per step')
  parser.add_argument('--cache', type=int, default=1024, help='S, slots per cache row (half of them full)')
  parser.add_argument('--dtype', choices=('float32', 'bfloat16'), default='float32',
                      help='compute dtype and the frozen base (the adapters stay float32, as trained)')
  parser.add_argument('--threads', type=int, default=os.cpu_count())
  parser.add_argument('--repeats', type=int, default=10)
  parser.add_argument('--b-std', type=float, default=0.02,
                      help='std of the B factors drawn (they start at zero): how far the adapters move the model')
  parser.add_argument('--demo', action='store_true', help='time the CPU demo with and without LoRA instead')
  parser.add_argument('--demo-steps', type=int, default=200)
  parser.add_argument('--demo-repeats', type=int, default=2, help='runs of each config, in turns')
  parser.add_argument('--target', help='compile the decode step for this accelerator instead (grpo_jax.plan.targets '
                      'names, e.g. h100x1; run with PYTHONPATH=.venv/compilers:. JAX_PLATFORMS=cpu)')
  return parser.parse_args()


args = parse_args()
harness.limit_threads(args.threads)


class OtherLoad:
  """Cores kept busy by other processes while the bench runs: all busy CPU time (/proc/stat)
  less this process's and its children's, over the wall time."""

  def __enter__(self):
    self.start = (self._busy(), self._own(), time.perf_counter())
    return self

  def __exit__(self, *_):
    busy, own, wall = (now - then for now, then in zip((self._busy(), self._own(), time.perf_counter()), self.start))
    self.cores = max(0.0, (busy - own) / wall)

  @staticmethod
  def _busy() -> float:
    with open('/proc/stat') as f:
      user, nice, system, idle, iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    return (user + nice + system + irq + softirq) / os.sysconf('SC_CLK_TCK')

  @staticmethod
  def _own() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


# ---- decoding ----

def decode_table(preset: str, ranks: list[int]) -> None:
  import dataclasses

  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  from grpo_jax.model import ModelOptions, Qwen2Config, init_model, lora
  from grpo_jax.model.loading import abstract_model

  config = Qwen2Config(**PRESETS[preset])
  B, S = args.batch, args.cache
  written = S // 2 - 1  # the step writes one more
  rng = np.random.default_rng(0)
  plain = ModelOptions(dtype=args.dtype, param_dtype=args.dtype)
  base_graphdef = nnx.graphdef(abstract_model(config, plain))
  cache = abstract_model(config, plain).init_cache(B, S)
  cache = dataclasses.replace(
      cache, k=jnp.asarray(rng.standard_normal(cache.k.shape), cache.k.dtype),
      v=jnp.asarray(rng.standard_normal(cache.v.shape), cache.v.dtype),
      segment_ids=jnp.asarray(np.arange(S)[None].repeat(B, 0) < written, jnp.int32),
      length=jnp.full((B,), written, jnp.int32))
  tokens = jnp.asarray(rng.integers(0, config.vocab_size, (B, 1)), jnp.int32)

  def decode_step(graphdef):
    @jax.jit
    def step(state, tokens, cache):
      logits, cache = nnx.merge(graphdef, state).extend(tokens, cache)
      return logits, cache.length
    return step

  rows, load = [], OtherLoad()
  with load:
    for rank in ranks:
      settings = lora.LoraConfig(rank=rank, alpha=2.0 * rank, targets=tuple(lora.TARGETS))
      model = init_model(config, options=dataclasses.replace(plain, param_dtype='float32', lora=settings))
      graphdef, state = nnx.split(model)
      adapters, base = lora.split_trainable(state)

      # B starts at zero; drawn here so that the merged and unmerged logits differ from the base's.
      def draw_b(path, variable):
        if not str(path[-1]).endswith('_lora_b'):
          return variable
        return variable.replace(jnp.asarray(rng.standard_normal(variable.shape) * args.b_std, variable.dtype))
      adapters = nnx.map_state(draw_b, adapters)
      state = lora.join(adapters, base)
      merge_state = jax.jit(lambda state: lora.merged(state, settings))
      merged = merge_state(state)
      # The merged weights alone, as a sampler would build them: jit copies every leaf it returns,
      # so lora.merged's whole state out also copies the unadapted ones (embedding, lm_head, norms).
      merge = jax.jit(lambda state: [lora.merged(state, settings)['layers'][lora.TARGETS[t][0]][...]
                                     for t in settings.targets])
      states = {'base': (base_graphdef, base), 'unmerged': (graphdef, state), 'merged': (base_graphdef, merged)}
      steps, outputs = {}, {}
      for name, (definition, weights) in states.items():
        step = decode_step(definition)

        def run(name=name, step=step, weights=weights):
          outputs[name] = jax.block_until_ready(step(weights, tokens, cache))[0]
        steps[name] = run
      steps['merge'] = lambda: jax.block_until_ready(merge(state))
      steps['merged()'] = lambda: jax.block_until_ready(merge_state(state))
      results = {name: median for name, (_, median) in harness.interleaved(steps, args.repeats).items()}

      got, want = (np.asarray(outputs[name], np.float64) for name in ('merged', 'unmerged'))
      relative = np.linalg.norm(got - want) / np.linalg.norm(want)
      moved = np.linalg.norm(want - np.asarray(outputs['base'], np.float64)) / np.linalg.norm(want)
      # What the merged weights keep of s A B: stored in W's dtype, a bf16 W drops updates below its rounding step.
      lost = kept = 0.0
      for target in settings.targets:
        weight = lora.TARGETS[target][0]
        w, a, b = (np.asarray(state['layers'][name][...], np.float64) for name in (weight, *lora.adapter_names(target)))
        delta = settings.scale * np.einsum('lir,lro->lio', a.reshape(len(a), -1, rank), b.reshape(len(b), rank, -1))
        stored = np.asarray(merged['layers'][weight][...], np.float64)
        error = stored.reshape(delta.shape) - w.reshape(delta.shape) - delta
        lost, kept = lost + np.sum(error ** 2), kept + np.sum(delta ** 2)
      assert moved > 1e-3, f'the adapters do not change the logits (relative change {moved:.1e})'
      assert args.dtype != 'float32' or relative < 1e-5, f'merged vs unmerged logits: {relative:.2e}'
      adapted = sum(state['layers'][lora.TARGETS[t][0]][...].nbytes for t in settings.targets)
      adapter_bytes = sum(v.nbytes for v in jax.tree.leaves(adapters))
      rows.append((rank, results, adapted, adapter_bytes, relative, np.sqrt(lost / kept)))

  total = sum(v.nbytes for v in jax.tree.leaves(base))
  print(f'\n{preset}: {config.num_params() / 1e6:.0f}M params (base {total / 2**20:.0f} MiB), every projection '
        f'adapted ({adapted / 2**20:.0f} MiB of adapted weights), {B} rows, cache {S} slots half full, {args.dtype} '
        f'(adapters float32), {jax.default_backend()}, {args.threads} threads, median of {args.repeats}; '
        f'other processes kept {load.cores:.1f} cores busy')
  print(f'{"rank":>4} {"base ms":>8} {"unmerged ms":>12} {"/ base":>7} {"merged ms":>10} {"/ base":>7} '
        f'{"merge ms":>9} {"merged() ms":>12} {"merge in steps":>15} {"merged copy MiB":>16} {"adapters MiB":>13} '
        f'{"merged vs unmerged":>19} {"merged sAB error":>17}')
  for rank, t, adapted, adapter_bytes, relative, delta_error in rows:
    gain = t['unmerged'] - t['merged']
    pays = f'{t["merge"] / gain:.1f}' if gain > 0 else 'never'
    print(f'{rank:>4} {t["base"] * 1e3:>8.2f} {t["unmerged"] * 1e3:>12.2f} {t["unmerged"] / t["base"]:>6.2f}x '
          f'{t["merged"] * 1e3:>10.2f} {t["merged"] / t["base"]:>6.2f}x {t["merge"] * 1e3:>9.2f} '
          f'{t["merged()"] * 1e3:>12.2f} {pays:>15} '
          f'{adapted / 2**20:>16.1f} {adapter_bytes / 2**20:>13.1f} {relative:>19.1e} {delta_error:>17.1e}')
  print('merge: the adapted weights W + s A B alone; merged(): jitted lora.merged, whole state out (copies the '
        'unadapted leaves too). merge in steps: decode steps per RL step above which merging once per step is '
        'cheaper than applying the adapters unmerged, merge / (unmerged - merged). merged vs unmerged: their '
        'logits\' relative distance; merged sAB error: |merged W - W - s A B| / |s A B| over the adapted weights, '
        'what storing the merge in W\'s dtype loses of the adapters (B drawn at std --b-std)')


# ---- the CPU demo ----

def children_cpu() -> float:
  t = os.times()
  return t.children_user + t.children_system


def demo() -> None:
  times = {name: [] for name in DEMOS}
  walls = {name: [] for name in DEMOS}
  cpus = {name: [] for name in DEMOS}
  load = OtherLoad()
  with load, tempfile.TemporaryDirectory(prefix='bench_lora_') as scratch:
    for repeat in range(args.demo_repeats):
      for name, config in DEMOS.items():  # in turns, so drift in the machine's load hits both alike
        workdir = os.path.join(scratch, f'{name}{repeat}')
        command = [sys.executable, '-m', 'grpo_jax.train', '--config', config, '--workdir', workdir,
                   '--set', f'train.steps={args.demo_steps}', '--set', 'train.checkpoint_every=0',
                   '--set', 'train.progress=false', '--set', f'train.steps_per_call={CHUNK}']
        start, cpu = time.perf_counter(), children_cpu()
        subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        walls[name].append(time.perf_counter() - start)
        cpus[name].append(children_cpu() - cpu)
        with open(os.path.join(workdir, 'metrics.jsonl')) as f:
          records = [json.loads(line) for line in f]
        times[name] += [r['step_time_s'] for r in records[CHUNK:]]
  print(f'CPU demo, {args.demo_steps} steps x {args.demo_repeats} runs each, in turns; median step time after the '
        f'first (compiling) chunk, medians of the runs\' wall and CPU seconds (compiles included); {args.threads} '
        f'threads; other processes kept {load.cores:.1f} cores busy')
  print(f'{"config":<30} {"s/step":>8} {"run wall s":>11} {"run CPU s":>10}')
  for name, config in DEMOS.items():
    print(f'{config:<30} {statistics.median(times[name]):>8.4f} {statistics.median(walls[name]):>11.1f} '
          f'{statistics.median(cpus[name]):>10.1f}')
  ratios = [statistics.median(series['lora']) / statistics.median(series['base']) for series in (times, walls, cpus)]
  print(f'{"lora / base":<30} {ratios[0]:>7.2f}x {ratios[1]:>10.2f}x {ratios[2]:>9.2f}x')


# ---- compiled for an accelerator, deviceless ----

def compiled_table(preset: str, ranks: list[int]) -> None:
  """The decode step compiled for --target (no device needed): kernels it launches and the bytes of
  the concatenations XLA inserts, for the base model (the merged model's program is the same one,
  on other weights) and the LoRA model unmerged."""
  import dataclasses
  import re

  import jax
  import jax.numpy as jnp
  from flax import nnx
  from jax.sharding import NamedSharding, PartitionSpec

  from grpo_jax.plan import targets
  from grpo_jax.model import ModelOptions, Qwen2Config, lora
  from grpo_jax.model.loading import abstract_model

  target = targets.parse_target(args.target)
  one = NamedSharding(jax.sharding.Mesh(target.devices()[:1], ('data',)), PartitionSpec())
  config = Qwen2Config(**PRESETS[preset])
  B, S = args.batch, args.cache
  plain = ModelOptions(dtype=args.dtype, param_dtype=args.dtype)  # layers scanned, as the configs run them
  itemsize = dict(f32=4, bf16=2, s32=4, pred=1)
  trivial = ('parameter', 'bitcast', 'get-tuple-element', 'tuple', 'constant', 'while')

  def program(options):
    """(kernels one step launches, MiB its concatenations write, temporaries MiB), counting the
    layer loop's body once per layer."""
    model = abstract_model(config, options)
    graphdef, state = nnx.split(model)
    placed = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one)  # noqa: E731
    state, cache = jax.tree.map(placed, (state, jax.eval_shape(lambda: model.init_cache(B, S))))

    def step(state, tokens, cache):
      return nnx.merge(graphdef, state).extend(tokens, cache)
    with jax.set_mesh(one.mesh):
      compiled = jax.jit(step, donate_argnums=2).trace(
          state, jax.ShapeDtypeStruct((B, 1), jnp.int32, sharding=one), cache).lower().compile()
    text = compiled.as_text()
    computations = {name: (bool(entry), body) for entry, name, body in
                    re.findall(r'\n(ENTRY )?(%\S+) [^\n]*\{\n(.*?)\n\}', text, re.S)}
    entry = next(body for is_entry, body in computations.values() if is_entry)
    loops = re.findall(r'while\([^\n]*body=(%[\w.-]+)', entry)
    kernels, concatenated = 0, 0
    for body, times in [(entry, 1)] + [(computations[loop][1], config.num_hidden_layers) for loop in loops]:
      for name, shape, op in re.findall(r'\n\s*(?:ROOT )?(%\S+) = (\(.*?\)|\S+) ([\w-]+)\(', '\n' + body):
        if op in trivial:
          continue
        kernels += times
        size = sum(itemsize.get(dtype, 4) * math.prod(int(d) for d in dims.split(',') if d)
                   for dtype, dims in re.findall(r'(\w+)\[([\d,]*)\]', shape))
        concatenated += size * times if '_concatenate_fusion' in name else 0
    return kernels, concatenated / 2**20, compiled.memory_analysis().temp_size_in_bytes / 2**20

  rows = [('base (= merged)', program(plain))]
  for rank in ranks:
    settings = lora.LoraConfig(rank=rank, alpha=2.0 * rank, targets=tuple(lora.TARGETS))
    rows.append((f'unmerged, rank {rank}', program(dataclasses.replace(plain, param_dtype='float32', lora=settings))))
  state = nnx.state(abstract_model(config, plain))
  weights = sum(v.size * jnp.dtype(args.dtype).itemsize for v in jax.tree.leaves(state))
  adapted = sum(state['layers'][lora.TARGETS[t][0]].size * jnp.dtype(args.dtype).itemsize for t in lora.TARGETS)
  print(f'\n{preset}, one decode step compiled for {args.target} (deviceless, {jax.__version__}), {B} rows, cache {S} '
        f'slots, {args.dtype}; base weights {weights / 2**20:.0f} MiB, of which adapted (a merged '
        f'copy) {adapted / 2**20:.0f} MiB; '
        f'XLA_FLAGS={os.environ.get("XLA_FLAGS", "")!r}')
  print(f'{"program":<20} {"kernels":>8} {"concatenations MiB":>19} {"temporaries MiB":>16}')
  for name, (kernels, concatenated, temporaries) in rows:
    print(f'{name:<20} {kernels:>8} {concatenated:>19.0f} {temporaries:>16.0f}')
  print('per step, the layer loop counted once per layer: kernels launched; MiB written by concatenation fusions '
        '(XLA:GPU\'s dot merger joins x W and x A into one matmul over [W | A], a copy of W)')


def main():
  if args.demo:
    demo()
    return 0
  if args.target:
    for preset in args.presets.split(','):
      compiled_table(preset, [int(r) for r in args.ranks.split(',')])
    return 0
  for preset in args.presets.split(','):
    decode_table(preset, [int(r) for r in args.ranks.split(',')])
  return 0


if __name__ == '__main__':
  sys.exit(main())
