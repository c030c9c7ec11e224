"""What to change when a run does not fit: the knobs that lower per-device memory without changing
what is learned, each compiled again for the target (python -m grpo_jax.plan's advice); and, when it
fits on GPUs of several hosts without hybrid sharding, the update compiled again with it
(`layout_advice`), to say whether keeping the weights' gathers within each host is faster."""

import dataclasses

from grpo_jax import config as config_lib
from grpo_jax.errors import UserError
from grpo_jax.plan.targets import format_bytes


@dataclasses.dataclass(frozen=True)
class Knob:
  """One change to try: `overrides` (--set assignments) and the programs it can shrink."""

  overrides: tuple[str, ...]
  programs: str  # 'update', 'rollout' or 'both'
  why: str

  @property
  def name(self) -> str:
    return ' '.join(self.overrides)


# Rows of at least this many tokens are offered context parallelism (mesh.context).
LONG_ROWS = 8192


def knobs(config: config_lib.Config, architecture, devices: int, sequence_length: int,
          current_rollout_tensor: int = 1, hybrid: bool = False) -> list[Knob]:
  """The changes that lower per-device memory without changing what is learned, cheapest first:
  rematerialisation; FSDP over every host where the mesh is `hybrid` (laid out by host: the
  parameters and moments replicated per host); smaller gradient-accumulation micro-batches,
  chunked attention (the update);
  fewer decode slots (the rollout: the same samples, fewer held at once); more tensor parallelism
  (both programs: the weights, the optimizer state and the KV cache split further over heads);
  a wider sampler tensor axis than `current_rollout_tensor` (the rollout: fewer resident weights);
  for rows of LONG_ROWS tokens or more, context parallelism (the update: each row split along its
  length, one row per batch shard);
  for a mixture of experts, another size of the 'expert' axis (both; model/expert_parallel.py):
  a wider one gathers fewer experts per layer (E / ep, their D over 'fsdp'), a narrower one has
  smaller all-to-all buffers (ep x tokens x min(k, E / ep) rows received per device), so both ways
  are tried, wider first.
  Micro-batches are tried from half the current one down to one row per data-parallel device
  (padded rows), or down to one packed row of `pack_length` tokens per batch shard (packing:
  micro_batch_tokens). sequence_length: Tp + N."""
  model, algo, mesh = config.model.options, config.algo, config.mesh
  found = []
  if model.remat != 'full':
    found.append(Knob(('model.remat=full',), 'update', 'recompute each layer in the backward pass'))
  if hybrid:
    found.append(Knob(('mesh.hybrid=false',), 'update', 'FSDP over every host\'s devices: the parameters and '
                      'Adam moments sharded across the hosts instead of whole on each (their gathers cross hosts)'))
  minibatch = config.completions_per_step // algo.num_minibatches
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
  rows = config.completions_per_step
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
                        + ('' if architecture.cache_entry[0] % wider == 0 else
                           ' (the latent cache replicated)' if architecture.mla else ' (KV heads and cache replicated)')))
  expert = mesh.expert if mesh.expert > 0 else 1
  context = mesh.context if mesh.context > 0 else 1
  # Context parallelism for long rows: each split along its length over `wider` devices, so that a
  # device holds 1 / wider of a row's activations, with micro-batches of one row per batch shard
  # (more rows would land on each shard and hold as many tokens as before).
  for wider in (2, 4, 8, 16) if sequence_length >= LONG_ROWS else ():
    shards = devices // (tensor * wider)
    if wider > context and devices % (wider * tensor * expert) == 0 and shards >= 1:
      micro = ((f'algo.micro_batch_tokens={shards * (algo.pack_length or sequence_length)}',) if algo.packing else
               (f'algo.micro_batch_size={shards}',) if minibatch % shards == 0 else None)
      if micro is not None:
        found.append(Knob((f'mesh.context={wider}', 'mesh.data=1', 'mesh.fsdp=-1', *micro), 'update',
                          f'context parallelism: each {sequence_length}-token row split along its length over {wider} '
                          'devices (ring attention), one row per batch shard'))
  for wider in (2, 4, 8):
    if (wider > tensor and devices % (wider * expert) == 0
        and (architecture.num_attention_heads if architecture.mla else architecture.num_key_value_heads) % wider == 0):
      found.append(Knob((f'mesh.tensor={wider}', 'mesh.data=1', 'mesh.fsdp=-1'), 'both',
                        f'tensor parallelism over {wider} devices (heads, MLP, vocabulary and KV cache split)'))
  sizes = [size for size in (4, 8, 16) if size > expert] + [size for size in (8, 4, 2) if 1 < size < expert]
  for size in sizes if architecture.num_experts else ():
    if devices % (size * tensor) == 0 and architecture.num_experts % size == 0:
      found.append(Knob((f'mesh.expert={size}', 'mesh.data=1', 'mesh.fsdp=-1'), 'both',
                        f'expert parallelism over {size} devices ({architecture.num_experts // size} experts of '
                        'each sparse layer per device; tokens sent to them by all-to-all)'))
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


def advise(load, compile_plan, architecture, report: dict, on_result=None) -> list[dict]:
  """Compiles `report`'s run with each knob: first each alone (only the programs it can change;
  micro-batches and slots from large to small, stopping at the first that fits), then, when none was
  enough, all the update knobs together, alone and with each mesh. `load(overrides)` is the run's
  config with extra --set assignments; `compile_plan(config, only)` its report (plan.plan), with
  only the programs named in `only` compiled (None: all).
  Returns one row per trial: knob, per-program peaks, fits."""
  hbm, peaks = report['hbm'], {program['name']: program['peak'] for program in report['programs']}
  over = {name for name, peak in peaks.items() if peak > hbm}
  fused = any(name not in ('rollout', 'update') for name in peaks)
  config = load(())
  candidates = knobs(config, architecture, report['devices'], report['sequence_length'],
                     report['rollout_layout']['tensor'],
                     hybrid=config.mesh.hybrid is not False and report['mesh']['data'] > 1)
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
      trial = compile_plan(load(knob.overrides), programs)
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
  changes = ', '.join(f'{name} {format_bytes(peaks[name])} -> {format_bytes(value)}' for name, value in row['peaks'].items()
                      if value != peaks[name])
  return f'  {row["knob"]} ({row["why"]}): {changes or "no change"}: {"fits" if row["fits"] else "still over"}'


def layout_advice(load, compile_plan, report: dict, target) -> dict | None:
  """For a run that fits on GPUs of more than one host whose mesh is not laid out by host: its
  update compiled again with mesh.hybrid=true (`load`, `compile_plan` as `advise` takes them), and
  the step estimated with that update beside the rollout as planned. -> {knob, update_s, bound,
  step_s, peak, fits, faster}, or None where it does not apply (TPUs, one host, hybrid already, or
  a mesh whose data and fsdp sizes were chosen by hand)."""
  config = load(())
  mesh = config.mesh
  if target.platform != 'gpu' or target.hosts < 2 or mesh.hybrid is not False or (mesh.data, mesh.fsdp) != (1, -1):
    return None
  knob = 'mesh.hybrid=true'
  try:
    trial = compile_plan(load((knob,)), {'update'})
  except UserError as error:
    return dict(knob=knob, error=str(error), faster=False, fits=False)
  update = trial['estimate']['programs']['update']
  before = report['estimate']['programs']['update']['program_s']
  step = report['estimate']['step_s'] - before + update['program_s']
  peak = max([program['peak'] for program in trial['programs'] if program['name'] == 'update']
             + [program['peak'] for program in report['programs'] if program['name'] != 'update'])
  return dict(knob=knob, update_s=update['program_s'], bound=update['bound'], update_before_s=before,
              step_s=step, step_before_s=report['estimate']['step_s'], peak=peak, fits=peak <= report['hbm'],
              faster=step < report['estimate']['step_s'] and peak <= report['hbm'])


def format_layout_advice(row: dict) -> str:
  if 'error' in row:
    return f'hybrid sharding ({row["knob"]}): not possible here ({row["error"]})'
  verdict = ('faster: set mesh.hybrid: auto (or true)' if row['faster'] else
             'does not fit' if not row['fits'] else 'not faster')
  return (f'hybrid sharding ({row["knob"]}: fsdp within each host, data over the hosts): update >= '
          f'{row["update_s"]:.2f} s, bound by {row["bound"]} (now {row["update_before_s"]:.2f} s); step >= '
          f'{row["step_s"]:.2f} s (now {row["step_before_s"]:.2f} s); peak {format_bytes(row["peak"])}: {verdict}')
