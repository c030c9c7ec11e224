"""python -m grpo_jax.plan --config configs/X.yaml --target v5p-128 [--model-size 32B] [--set a.b=c ...]

Compiles a run's RL step for a TPU slice or GPU cluster that is not attached (targets.py) and
reports the target compiler's own per-device memory: the parameters, the optimizer state, the
reference policy, the KV cache, each compiled program's arguments, outputs and temporaries, and
whether the step fits. Nothing is extrapolated: the program compiled is the run's own, at full
depth and the run's real shapes. With a jittable task that is the K-steps-in-one-jit loop; with a
host-scored task, the sampler and the update (the reward runs on the host between them).

The model's shape comes from --model-size (a Qwen2.5 size: 0.5B ... 72B), else from
model.path's config.json, else from model.architecture; no weights are read. --layers overrides
the depth (to see how memory grows with it).

Needs the target's compiler: `pip install -r requirements-compile.txt` (`make test` puts it in
.venv/compilers: run with PYTHONPATH=.venv/compilers). The host's own devices stay CPUs.
"""

import os

os.environ.setdefault('JAX_PLATFORMS', 'cpu')  # compile for the target; never initialise it here

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

from grpo_jax import targets  # noqa: E402  (imports no jax)

_STARTUP_LOG: list[str] = []
with targets.compiler_log(_STARTUP_LOG):  # the compilers' plugins log as jax loads them
  import jax  # noqa: E402
  import jax.numpy as jnp  # noqa: E402

from grpo_jax import config as config_lib  # noqa: E402
from grpo_jax import metrics as metrics_lib  # noqa: E402
from grpo_jax import traffic  # noqa: E402
from grpo_jax.config import completions_per_step  # noqa: E402
from grpo_jax.data.task import Scores  # noqa: E402
from grpo_jax.errors import UserError, cli_main  # noqa: E402
from grpo_jax.model import sharding  # noqa: E402
from grpo_jax.model.config import load_hf_config  # noqa: E402
from grpo_jax.model.loading import abstract_model, load_tokenizer  # noqa: E402
from grpo_jax.rl.loop import RLStep  # noqa: E402
from grpo_jax.rl.step import init_train_state, learning_rate_schedule, make_optimizer, train_state_shardings  # noqa: E402
from grpo_jax.sampler.layout import resident_bytes_per_device, rollout_layout  # noqa: E402
from grpo_jax.targets import GiB  # noqa: E402


def parse_args(argv):
  parser = argparse.ArgumentParser(prog='python -m grpo_jax.plan', description=__doc__.splitlines()[0])
  parser.add_argument('--config', required=True, help='YAML run config (see configs/)')
  parser.add_argument('--target', required=True, help='v4-N, v5p-N, v5e-N, v6e-N, h100xN, h200xN, h100xHOSTSxGPUS')
  parser.add_argument('--model-size', help='a Qwen2.5 size (0.5B, 1.5B, 3B, 7B, 14B, 32B, 72B) for the model shape')
  parser.add_argument('--layers', type=int, help='override the number of layers')
  parser.add_argument('--set', action='append', default=[], metavar='KEY=VALUE', dest='overrides',
                      help='override one config key, e.g. --set rollout.max_new_tokens=12288 (repeatable)')
  parser.add_argument('--device-memory', help='memory per device to plan for instead of the target\'s, e.g. 40GiB or 16GB')
  parser.add_argument('--no-advice', action='store_true',
                      help='when the run does not fit, do not compile the knobs that might bring it under')
  parser.add_argument('--json', help='also write the report as JSON to this file')
  return parser.parse_args(argv)


@dataclasses.dataclass(frozen=True)
class HostTaskShape:
  """A host-scored task as the compiled programs see it: the prompt width and the special ids.
  Its prompts and rewards come from the host between the compiled sampler and update, so the plan
  has none to give; the ids do not change the programs' shapes or memory."""

  prompt_length: int
  vocab_size: int
  stop_token_ids: tuple[int, ...]
  pad_id: int
  jittable = False
  prompts = None
  reward = None

  def close(self) -> None:
    pass


def model_architecture(config: config_lib.Config, model_size: str | None, layers: int | None):
  from grpo_jax.testing import QWEN2_5_PRESETS, preset
  if model_size is not None:
    if model_size not in QWEN2_5_PRESETS:
      raise UserError(f'--model-size {model_size}: one of {", ".join(QWEN2_5_PRESETS)}')
    architecture = preset(model_size)
  elif config.model.path:
    if not os.path.isfile(os.path.join(config.model.path, 'config.json')):
      raise UserError(f'model.path {config.model.path} has no config.json; give --model-size for the shape')
    architecture = load_hf_config(config.model.path)
  else:
    architecture = config.model.architecture
  if layers is not None:
    if layers < 1:
      raise UserError(f'--layers must be >= 1, got {layers}')
    architecture = dataclasses.replace(architecture, num_hidden_layers=layers)
  return architecture


def build_task(config: config_lib.Config, architecture):
  if config.task.name == 'arith':
    from grpo_jax.train import build_task as train_task
    return train_task(config)
  directory = config.task.tokenizer or config.model.path
  tokenizer = load_tokenizer(directory) if directory and os.path.isdir(directory) else None
  if tokenizer is not None:
    from grpo_jax.sampler.special_tokens import special_tokens
    special = special_tokens(tokenizer)
    stop, pad = tuple(special.stop_ids), special.pad_id
  else:
    stop, pad = (architecture.vocab_size - 1,), 0
  return HostTaskShape(config.task.max_prompt_tokens, architecture.vocab_size, stop, pad)


def _abstract(tree, shardings):
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def kv_cache_bytes_per_device(architecture, config: config_lib.Config, prompt_length: int, mesh) -> int:
  """The sampler's K and V caches (sampler/rollout.py): the shared prompt cache [L, P, Tp, K, H]
  and the slots' own rows [L, B, N, K, H] (B = rollout.slots, else P * G), each with its rows
  over the batch axes and KV heads over 'tensor' where they divide (model/sharding.py's rules)."""
  rows = completions_per_step(config.rollout, config.algo)
  slots = min(config.rollout.slots or rows, rows)
  total = 0
  for count, width in ((config.rollout.prompts_per_step, prompt_length), (slots, config.rollout.max_new_tokens)):
    shape = (architecture.num_hidden_layers, count, width, architecture.num_key_value_heads,
             architecture.resolved_head_dim)
    layout = sharding.named_sharding(mesh, shape, ('layers', 'batch', 'cache_seq', 'kv_heads', 'head_dim'))
    total += 2 * math.prod(layout.shard_shape(shape)) * jnp.dtype(config.model.dtype).itemsize
  return total


@dataclasses.dataclass
class Program:
  """One compiled program: the compiler's memory figures, and its collectives per device by kind
  (traffic.py), outside the decode loop (once per run of the program) and per decode step, with
  their interconnect time at the target's link bandwidths."""

  name: str
  compile_s: float
  arguments: int
  outputs: int
  aliased: int
  temporaries: int
  code: int
  flops: float | None
  note: str = ''
  collectives: dict = dataclasses.field(default_factory=dict)  # {'outside' | 'per_decode_step': {kind: bytes}}
  interconnect_s: dict = dataclasses.field(default_factory=dict)  # {'outside' | 'per_decode_step': seconds}

  @property
  def peak(self) -> int:
    """The compiler's per-device total: live arguments, outputs not written over an argument, and
    temporaries."""
    return self.arguments + self.outputs - self.aliased + self.temporaries


# Deviceless, XLA:GPU cannot autotune, so every Triton GEMM fusion gets XLA's default tile config;
# for some fusions of the rematerialised backward that config cannot be nested ("Couldn't find
# output tile sizes that satisfy ..."). On a GPU the autotuner picks among many configs and cuBLAS;
# here the program is compiled again with cuBLAS GEMMs (xla_gpu_enable_triton_gemm=false), which
# the autotuner may also choose, and the report says so.
_TRITON_GEMM_TILING = "Couldn't find output tile sizes"
NO_TRITON_GEMM = {'xla_gpu_enable_triton_gemm': False}


def compile_for_target(jitted, args, platform: str):
  """(compiled, note): `jitted` traced on `args` and compiled by the target's compiler."""
  lowered = jitted.trace(*args).lower()
  try:
    return lowered.compile(), ''
  except Exception as error:
    if platform != 'gpu' or _TRITON_GEMM_TILING not in str(error):
      raise
  return lowered.compile(compiler_options=NO_TRITON_GEMM), 'GEMMs on cuBLAS (no default Triton GEMM tiling fits)'


def compile_program(name: str, target: targets.Target, devices: list, jitted, *args) -> Program:
  """`jitted` compiled for `target`; `devices`: the program's devices in its device-assignment
  order (the mesh's, flattened), which the collectives' logical device ids index."""
  start = time.perf_counter()
  try:
    compiled, note = compile_for_target(jitted, args, target.platform)
  except Exception as error:  # the target's compiler refused it: say so, in its own words
    message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    raise UserError(f'{name}: the target compiler refused the program: {message}') from error
  seconds = time.perf_counter() - start
  memory = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) and cost else cost
  flops = float(cost['flops']) if cost and 'flops' in cost else None
  found = traffic.collectives(compiled.as_text(), len(devices))
  bandwidth = functools.lru_cache(maxsize=None)(
      lambda group: target.group_bandwidth([devices[i] for i in group if i < len(devices)] or devices[:1]))
  return Program(name, seconds, memory.argument_size_in_bytes, memory.output_size_in_bytes,
                 memory.alias_size_in_bytes, memory.temp_size_in_bytes, memory.generated_code_size_in_bytes,
                 flops, note,
                 collectives=dict(outside=traffic.totals(found, False), per_decode_step=traffic.totals(found, True)),
                 interconnect_s=dict(outside=traffic.seconds(found, False, bandwidth),
                                     per_decode_step=traffic.seconds(found, True, bandwidth)))


@dataclasses.dataclass
class StepPrograms:
  """A run's RL step on abstract shapes over `mesh`: the jitted programs and their arguments."""

  task: object
  state: object
  ref_params: object
  programs: list  # (name, jitted function, abstract arguments)
  layout: object = None  # the sampler's RolloutLayout


def step_programs(config: config_lib.Config, architecture, mesh, resident: bool = True) -> StepPrograms:
  """The programs a run compiles, on abstract inputs placed on `mesh` (no weights, no data): the
  K-steps-in-one-jit loop for a jittable task, else the sampler and the update. resident False:
  the sampler decodes in the training layout instead of its own (as grpo_jax did before the
  rollout layout; bench/rollout_layout.py compares the two)."""
  task = build_task(config, architecture)
  if task.vocab_size > architecture.vocab_size:
    raise UserError(f'the task\'s tokenizer has {task.vocab_size} tokens but the model has {architecture.vocab_size}')
  model = abstract_model(architecture, config.model)
  from flax import nnx
  graphdef, abstract_params = nnx.split(model)
  shardings = sharding.state_shardings(abstract_params, mesh)
  params = jax.tree.map(lambda variable, s: variable.replace(jax.ShapeDtypeStruct(variable.shape, variable.dtype, sharding=s)),
                        abstract_params, shardings, is_leaf=lambda x: isinstance(x, nnx.Variable))
  algo = config.algo
  schedule = learning_rate_schedule(config.optim, config.train.steps * algo.ppo_epochs * algo.num_minibatches)
  optimizer = make_optimizer(config.optim, schedule)
  state_shardings = train_state_shardings(params, optimizer)
  state = _abstract(jax.eval_shape(functools.partial(init_train_state, optimizer=optimizer, seed=0), params),
                    state_shardings)
  ref_params = params if algo.kl_beta > 0 else None
  layout = rollout_layout(model, mesh, config.rollout.tensor)
  step = RLStep(graphdef, task, config.rollout, algo, optimizer, schedule, state_shardings,
                layout=layout if resident else None)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  if task.jittable:
    programs = [(f'{config.train.steps_per_call} RL steps in one jit', step.run_steps,
                 (state, ref_params, 0, config.train.steps_per_call))]
  else:
    prompts = jax.ShapeDtypeStruct((config.rollout.prompts_per_step, task.prompt_length), jnp.int32, sharding=replicated)
    key = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=replicated)
    with jax.set_mesh(mesh):
      rollout = jax.eval_shape(step._sample_body, state.params, prompts, prompts, key)
    rows = completions_per_step(config.rollout, algo)
    terms = {term.label: jax.ShapeDtypeStruct((rows,), jnp.float32, sharding=replicated) for term in config.rewards}
    scores = Scores(rewards=jax.ShapeDtypeStruct((rows,), jnp.float32, sharding=replicated),
                    failures=jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated), terms=terms)
    rollout = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), rollout)
    programs = [('rollout', step.sample, (state.params, prompts, prompts, key)),
                ('update', step.learn, (state, ref_params, prompts, prompts, rollout, scores))]
  return StepPrograms(task=task, state=state, ref_params=ref_params, programs=programs,
                      layout=layout if resident else None)


def plan(config: config_lib.Config, target: targets.Target, architecture, only: set[str] | None = None,
         resident: bool = True) -> dict:
  """The report of `config`'s programs compiled for `target` (those named in `only`, else all);
  `resident` as step_programs takes it."""
  log: list[str] = list(_STARTUP_LOG)
  with targets.compiler_log(log):  # the compilers' plugins log as they start, too
    devices = target.devices()
  mesh = sharding.make_mesh(config.mesh, devices=devices)
  built = step_programs(config, architecture, mesh, resident)
  task, state, ref_params, layout = built.task, built.state, built.ref_params, built.layout
  order = list(mesh.devices.reshape(-1))
  with jax.set_mesh(mesh), targets.compiler_log(log):
    programs = [compile_program(name, target, order, jitted, *args) for name, jitted, args in built.programs
                if only is None or name in only]

  params_bytes = sharding.bytes_per_device(state.params)
  opt_bytes = sharding.bytes_per_device(state.opt_state)
  if layout is not None:
    resident_bytes, decode_mesh = resident_bytes_per_device(state.params, layout), layout.mesh
    layout_report = dict(tensor=layout.tensor, data_groups=layout.data_groups)
  else:  # the training layout: each device reads the whole model, split over 'tensor', every token
    resident_bytes = architecture.num_params() * jnp.dtype(config.model.dtype).itemsize // mesh.shape['tensor']
    decode_mesh, layout_report = mesh, dict(tensor=mesh.shape['tensor'], data_groups=0)
  peak = max(program.peak for program in programs)
  report = dict(
      target=target.name, device=target.describe(), devices=len(devices),
      mesh=dict(mesh.shape), rollout_layout=layout_report,
      model=dict(layers=architecture.num_hidden_layers, hidden=architecture.hidden_size,
                 parameters=architecture.num_params()),
      per_device=dict(parameters=params_bytes, optimizer_state=opt_bytes,
                      reference=sharding.bytes_per_device(ref_params) if ref_params is not None else 0,
                      resident_weights=resident_bytes,
                      kv_cache=kv_cache_bytes_per_device(architecture, config, task.prompt_length, decode_mesh)),
      programs=[dataclasses.asdict(program) | dict(peak=program.peak) for program in programs],
      peak=peak, hbm=target.hbm_bytes, fits=peak <= target.hbm_bytes,
      sequence_length=task.prompt_length + config.rollout.max_new_tokens,
      compiler_notes=targets.summarise_compiler_log(log), compiler_log=log)
  report['estimate'] = estimate(config, target, architecture, task.prompt_length, report)
  return report


def estimate(config: config_lib.Config, target: targets.Target, architecture, prompt_length: int, report: dict) -> dict:
  """Roofline estimate of the step, per program the largest of compute, HBM and interconnect time.

  compute: model FLOPs at the target's peak (the rollout's 2 N per sampled token, the rest the
  update's). HBM: every decode step reads the resident weights and, on average, half of each row's
  KV cache. Interconnect: the compiled collectives (traffic.py), once per program outside the
  decode loop and N times inside it (N = max_new_tokens: the longest answer's decode steps)."""
  devices, steps = report['devices'], config.rollout.max_new_tokens
  params = architecture.num_params()
  step_flops = metrics_lib.model_flops_per_step(params, prompt_length, config.rollout, config.algo)
  rows = completions_per_step(config.rollout, config.algo)
  rollout_flops = 2.0 * params * (config.rollout.prompts_per_step * prompt_length + rows * steps)
  per_device = report['per_device']
  decode_s = steps * (per_device['resident_weights'] + per_device['kv_cache'] / 2) / target.hbm_bandwidth
  parts = {}
  for program in report['programs']:
    rollout = program['name'] != 'update'
    update = program['name'] != 'rollout'
    flops = (rollout_flops if rollout else 0.0) + ((step_flops - rollout_flops) if update else 0.0)
    link = program['interconnect_s']
    parts[program['name']] = dict(compute_s=flops / (devices * target.peak_flops), hbm_s=decode_s if rollout else 0.0,
                                  interconnect_s=link['outside'] + (steps * link['per_decode_step'] if rollout else 0.0))
  for part in parts.values():
    part['program_s'] = max(part['compute_s'], part['hbm_s'], part['interconnect_s'])
  return dict(model_flops=step_flops, programs=parts, step_s=sum(part['program_s'] for part in parts.values()))


# ---- what to change when a run does not fit ----

@dataclasses.dataclass(frozen=True)
class Knob:
  """One change to try: `overrides` (--set assignments) and the programs it can shrink."""

  overrides: tuple[str, ...]
  programs: str  # 'update', 'rollout' or 'both'
  why: str

  @property
  def name(self) -> str:
    return ' '.join(self.overrides)


def knobs(config: config_lib.Config, architecture, devices: int, sequence_length: int,
          current_rollout_tensor: int = 1) -> list[Knob]:
  """The changes that lower per-device memory without changing what is learned, cheapest first:
  rematerialisation, smaller gradient-accumulation micro-batches, chunked attention (the update);
  fewer decode slots (the rollout: the same samples, fewer held at once); more tensor parallelism
  (both programs: the weights, the optimizer state and the KV cache split further over heads);
  a wider sampler tensor axis than `current_rollout_tensor` (the rollout: fewer resident weights).
  Micro-batches are tried from half the current one down to one row per data-parallel device
  (padded rows), or down to one packed row of `pack_length` tokens per batch shard (packing:
  micro_batch_tokens). sequence_length: Tp + N."""
  model, algo, mesh = config.model, config.algo, config.mesh
  found = []
  if model.remat != 'full':
    found.append(Knob(('model.remat=full',), 'update', 'recompute each layer in the backward pass'))
  minibatch = completions_per_step(config.rollout, algo) // algo.num_minibatches
  size = algo.micro_batch_size or minibatch
  tensor = mesh.tensor if mesh.tensor > 0 else 1
  if algo.packing:
    row = algo.pack_length or sequence_length
    rows = algo.micro_batch_tokens // row if algo.micro_batch_tokens else max(1, size // (devices // tensor))
    while rows // 2 >= 1:
      rows //= 2
      found.append(Knob((f'algo.micro_batch_tokens={rows * row}',), 'update',
                        f'packed micro-batches of {rows} row(s) of {row} tokens per batch shard'))
  while not algo.packing and size % 2 == 0 and size // 2 >= devices // tensor:  # one row per data-parallel device
    size //= 2
    found.append(Knob((f'algo.micro_batch_size={size}',), 'update',
                      f'accumulate gradients over {minibatch // size} micro-batches'))
  if model.attention == 'dense':
    found.append(Knob(('model.attention=chunked',), 'update', 'attention in query chunks, no [T, T] scores'))
  rows = completions_per_step(config.rollout, algo)
  slots = min(config.rollout.slots or rows, rows)
  while slots % 2 == 0 and slots // 2 >= devices // tensor and len([k for k in found if k.programs == 'rollout']) < 3:
    slots //= 2
    found.append(Knob((f'rollout.slots={slots}',), 'rollout', f'continuous batching: {slots} decode slots hold the '
                      f'{rows} requests in turn (the KV cache holds {slots} rows)'))
  sampler_tensor = config.rollout.tensor or current_rollout_tensor
  for wider in (2, 4, 8, 16):
    if wider > sampler_tensor and devices % wider == 0:
      found.append(Knob((f'rollout.tensor={wider}',), 'rollout',
                        f'the sampler\'s resident weights split over {wider} devices'
                        + ('' if architecture.num_key_value_heads % wider == 0 else ' (KV heads and cache replicated)')))
  for wider in (2, 4, 8):
    if wider > tensor and devices % wider == 0 and architecture.num_key_value_heads % wider == 0:
      found.append(Knob((f'mesh.tensor={wider}', 'mesh.data=1', 'mesh.fsdp=-1'), 'both',
                        f'tensor parallelism over {wider} devices (heads, MLP, vocabulary and KV cache split)'))
  return found


def recipe_knobs(config: config_lib.Config) -> list[Knob]:
  """Last resorts, which change the recipe: fewer prompts per step (the same data over more steps),
  keeping each mini-batch's micro-batch within it."""
  algo, prompts = config.algo, config.rollout.prompts_per_step
  found = []
  while prompts % 2 == 0 and prompts > 1 and len(found) < 2:
    prompts //= 2
    minibatch = prompts * algo.group_size // algo.num_minibatches
    overrides = (f'rollout.prompts_per_step={prompts}',)
    if algo.micro_batch_size > minibatch:
      overrides += (f'algo.micro_batch_size={minibatch}',)
    found.append(Knob(overrides, 'both', f'changes the recipe: {prompts} prompts per step'))
  return found


def advise(load, target: targets.Target, architecture, report: dict, on_result=None) -> list[dict]:
  """Compiles `report`'s run with each knob: first each alone (only the programs it can change;
  micro-batches and slots from large to small, stopping at the first that fits), then, when none was enough,
  all the update knobs together, alone and with each mesh. `load(overrides)` is the run's config with extra --set assignments.
  Returns one row per trial: knob, per-program peaks, fits."""
  hbm, peaks = report['hbm'], {program['name']: program['peak'] for program in report['programs']}
  over = {name for name, peak in peaks.items() if peak > hbm}
  fused = any(name not in ('rollout', 'update') for name in peaks)
  config = load(())
  candidates = knobs(config, architecture, report['devices'], report['sequence_length'],
                     report['rollout_layout']['tensor'])
  update_knobs = [knob for knob in candidates if knob.programs == 'update']
  micro = [knob for knob in update_knobs if knob.overrides[0].startswith(('algo.micro_batch_size', 'algo.micro_batch_tokens'))]
  chosen = [knob for knob in update_knobs if knob not in micro] + micro[-1:]  # the smallest micro-batch
  combined = tuple(o for knob in chosen for o in knob.overrides)
  together = [Knob(combined, 'update', 'all of the above for the update')] if len(chosen) > 1 else []
  together += [Knob(combined + knob.overrides, 'both', 'with the update knobs above')
               for knob in candidates if knob.programs == 'both' and combined]
  rows, fitted_series, seen = [], set(), set()
  series = lambda knob: knob.overrides[0].split('=')[0] if len(knob.overrides) == 1 else None  # noqa: E731
  for knob in candidates + [None] + together + [None] + recipe_knobs(config):
    if knob is None:  # the knobs together only when none is enough alone, the recipe's last
      if any(row['fits'] for row in rows):
        break
      continue
    if frozenset(knob.overrides) in seen:
      continue
    seen.add(frozenset(knob.overrides))
    programs = None if fused or knob.programs == 'both' else {knob.programs}
    if programs is not None and not programs & over:
      continue  # it cannot change what does not fit
    if series(knob) in fitted_series:
      continue  # a smaller micro-batch or fewer slots than one that fits are not needed
    try:
      trial = plan(load(knob.overrides), target, architecture, only=programs)
    except UserError as error:  # the knob is not valid for this run, or the compiler refused it
      row = dict(knob=knob.name, why=knob.why, error=str(error), fits=False)
    else:
      new_peaks = dict(peaks, **{program['name']: program['peak'] for program in trial['programs']})
      row = dict(knob=knob.name, why=knob.why, peaks=new_peaks, fits=max(new_peaks.values()) <= hbm)
      if row['fits'] and series(knob):
        fitted_series.add(series(knob))
    rows.append(row)
    if on_result is not None:
      on_result(row)
  return rows


def format_advice(row: dict, peaks: dict) -> str:
  if 'error' in row:
    return f'  {row["knob"]}: not possible here ({row["error"]})'
  changes = ', '.join(f'{name} {_size(peaks[name])} -> {_size(value)}' for name, value in row['peaks'].items()
                      if value != peaks[name])
  return f'  {row["knob"]} ({row["why"]}): {changes or "no change"}: {"fits" if row["fits"] else "still over"}'


def parse_bytes(text: str, field: str) -> int:
  """'80GiB', '16G' (binary), '95GB' (decimal), '1048576' -> bytes."""
  import re
  match = re.fullmatch(r'\s*([0-9]*\.?[0-9]+)\s*(?:([KMGT])(i?)(B?))?\s*', text, re.IGNORECASE)
  if not match or float(match.group(1)) <= 0:
    raise UserError(f'{field} {text!r}: write a positive size such as 80GiB, 95GB or 16G')
  number, unit = float(match.group(1)), (match.group(2) or '').upper()
  decimal = bool(match.group(4)) and not match.group(3)  # GB; GiB and G are binary
  return int(number * (1000 if decimal else 1024) ** ' KMGT'.index(unit or ' '))


def _size(value: int) -> str:
  return f'{value / GiB:.2f} GiB' if value >= GiB / 4 else f'{value / (1 << 20):.1f} MiB'


def _collective_summary(by_kind: dict) -> str:
  total = sum(by_kind.values())
  parts = ', '.join(f'{kind} {_size(value)}' for kind, value in by_kind.items() if value)
  return f'{_size(total)}' + (f' ({parts})' if parts else '')


def format_report(report: dict) -> str:
  layout = report['rollout_layout']
  lines = [f'# {report["device"]}', f'mesh {report["mesh"]} over {report["devices"]} devices; model '
           f'{report["model"]["parameters"] / 1e9:.2f}B parameters, {report["model"]["layers"]} layers',
           (f'rollout layout: weights resident, tensor-parallel over {layout["tensor"]} devices x '
            f'{layout["data_groups"]} data groups (rollout.tensor)' if layout['data_groups'] else
            'rollout layout: the training layout (weights gathered for every decoded token)'),
           'per device (the target compiler\'s memory analysis for the programs):']
  for name, value in report['per_device'].items():
    lines.append(f'  {name.replace("_", " "):<18}{_size(value):>12}')
  for program in report['programs']:
    lines.append(f'  program "{program["name"]}" (compiled in {program["compile_s"]:.1f} s): arguments '
                 f'{_size(program["arguments"])}, outputs {_size(program["outputs"])} ({_size(program["aliased"])} '
                 f'in place), temporaries {_size(program["temporaries"])} -> peak {_size(program["peak"])}'
                 + (f'; {program["note"]}' if program['note'] else ''))
    collectives = program['collectives']
    lines.append(f'    collectives per device (compiled program): {_collective_summary(collectives["outside"])} '
                 'per run' + (f'; per decode step {_collective_summary(collectives["per_decode_step"])}'
                              if program['name'] != 'update' else ''))
  verdict = 'fits' if report['fits'] else 'DOES NOT FIT'
  lines.append(f'peak {_size(report["peak"])} of {_size(report["hbm"])} per device: {verdict}')
  estimate = report['estimate']
  lines.append(f'estimate (roofline, not measured): {estimate["model_flops"] / 1e15:.1f} PFLOP per step')
  for name, part in estimate['programs'].items():
    lines.append(f'  "{name}": compute >= {part["compute_s"]:.2f} s, HBM >= {part["hbm_s"]:.2f} s, interconnect >= '
                 f'{part["interconnect_s"]:.2f} s -> {part["program_s"]:.2f} s')
  lines.append(f'  step >= {estimate["step_s"]:.2f} s')
  for note in report.get('compiler_notes', []):
    lines.append(f'compiler: {note}')
  return '\n'.join(lines)


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
                              target, architecture, report,
                              on_result=lambda row: print(format_advice(row, peaks), flush=True))
    fitting = [row['knob'] for row in report['advice'] if row['fits']]
    print(f'brings it under: {" | ".join(fitting)}' if fitting else
          'no knob brings it under: more devices, a larger memory, or a smaller recipe (rows, sequence length)',
          flush=True)
    report['advice_fits'] = fitting
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(report, f, indent=1, default=float)
  return 0 if report['fits'] else 1


if __name__ == '__main__':
  sys.exit(main())
