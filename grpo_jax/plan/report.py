"""The plan's report: a run's programs compiled for a target (programs.py), the per-device memory
the target compiler gives for each, whether the step fits, the collectives per program and per
decode step (traffic.py), and a roofline estimate of the step's time. `python -m grpo_jax.plan`
prints it (plan/__main__.py).

A mixture of experts is reported with its active parameters beside its total (the FLOPs count the
active ones), where its experts lie in the rollout layout (sharded over the sampler's data groups,
sampler/layout.py), and the bytes of one step's recorded routes (what routing replay carries from
the sampler to the update)."""

import contextlib
import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from grpo_jax import config as config_lib
from grpo_jax import metrics as metrics_lib
from grpo_jax import sharding
from grpo_jax.errors import UserError
from grpo_jax.model.moe import route_dtype
from grpo_jax.model.vision import patch_bucket
from grpo_jax.plan import targets
from grpo_jax.plan.programs import compile_program, step_programs
from grpo_jax.plan.targets import format_bytes
from grpo_jax.sampler.layout import resident_bytes_per_device, split_devices


def cache_entry(architecture, expanded: bool = False) -> tuple[int, tuple[int, ...]]:
  """(heads, the widths each head holds per token and layer) of the sampler's KV cache: GQA's K
  heads of H keys and H values; multi-head latent attention's one latent of R + Hr (its values read
  from it). `expanded`: what an MHA cache of the same model would hold instead (N heads of Hn + Hr
  keys and Hv values)."""
  if expanded and architecture.mla:
    return architecture.num_attention_heads, (architecture.resolved_head_dim, architecture.v_head_dim)
  heads, key, value = architecture.cache_entry
  return heads, tuple(width for width in (key, value) if width)


def kv_cache_bytes_per_device(architecture, config: config_lib.Config, prompt_length: int, mesh, prompts: int = 0,
                              expanded: bool = False) -> int:
  """The sampler's K and V caches (sampler/rollout.py): the shared prompt cache [L, P, Tp, K, H]
  (`prompts` entries with partial rollouts' pool, else P) and the slots' own rows [L, B, N, K, H]
  (B = rollout.slots, else P * G), each with its rows over the batch axes and KV heads over
  'tensor' where they divide (grpo_jax/sharding.py's rules), in the compute dtype or, with
  rollout.kv_cache 8-bit, a byte per value and 4 per token and head. A sliding-window layer's slot rows
  hold its window only (model/cache.py WindowCache) where the window is shorter than N. Multi-head
  latent attention's cache holds one latent per token, replicated over 'tensor' (`cache_entry`;
  `expanded`: an MHA cache of the same model instead)."""
  rows = config.completions_per_step
  slots = min(config.rollout.slots or rows, rows)
  answer = config.rollout.max_new_tokens
  sliding = sum(architecture.sliding_layers) if (architecture.sliding_window or answer) < answer else 0
  parts = [(architecture.num_hidden_layers, prompts or config.rollout.prompts_per_step, prompt_length),
           (architecture.num_hidden_layers - sliding, slots, answer), (sliding, slots, architecture.sliding_window)]
  heads, widths = cache_entry(architecture, expanded)
  head_axis = None if architecture.mla and not expanded else 'kv_heads'
  options = config.model.options
  total = 0
  for layers, count, width in parts:
    for entry in widths if layers else ():
      shape = (layers, count, width, heads, entry)
      layout = sharding.named_sharding(mesh, shape, ('layers', 'batch', 'cache_seq', head_axis, 'head_dim'))
      elements = math.prod(layout.shard_shape(shape))
      if options.kv_cache == 'compute':
        total += elements * jnp.dtype(options.dtype).itemsize
      else:  # 8-bit values and an fp32 scale per token and head (model/cache.py)
        total += elements + 4 * (elements // entry)
  return total


def _cache_entry_report(architecture, config, prompt_length: int, mesh, prompts: int) -> dict:
  """What one token's cache entry holds per layer (values, in the compute dtype), and with
  multi-head latent attention what an MHA cache of the same model would hold and take per device."""
  heads, widths = cache_entry(architecture)
  entry = dict(values_per_token_layer=heads * sum(widths), latent=architecture.mla)
  if architecture.mla:
    mha_heads, mha_widths = cache_entry(architecture, expanded=True)
    entry.update(mha_values_per_token_layer=mha_heads * sum(mha_widths),
                 mha_kv_cache=kv_cache_bytes_per_device(architecture, config, prompt_length, mesh, prompts,
                                                        expanded=True))
  return entry


def routes_bytes(architecture, rows: int, sequence_length: int) -> int:
  """Bytes of one step's recorded routes (a mixture of experts; 0 for a dense model): each token's
  k expert ids in each of the Ls sparse layers, [rows, Tp + N, Ls, k] of model/moe.route_dtype
  (one byte each up to 255 experts)."""
  if not architecture.num_experts:
    return 0
  itemsize = route_dtype(architecture.num_experts).itemsize
  return rows * sequence_length * architecture.num_sparse_layers * architecture.num_experts_per_tok * itemsize


def plan(config: config_lib.Config, target: targets.Target, architecture, only: set[str] | None = None,
         resident: bool = True) -> dict:
  """The report of `config`'s programs compiled for `target` (those named in `only`, else all);
  `resident` as step_programs takes it."""
  log: list[str] = list(targets.STARTUP_LOG)
  with targets.compiler_log(log):  # the compilers' plugins log as they start, too
    devices = target.devices()
  trainer_devices, sampler_devices = split_devices(devices, config.rollout.devices)
  mesh = sharding.make_mesh(config.mesh, devices=trainer_devices)
  built = step_programs(config, architecture, mesh, resident,
                        sampler_devices=sampler_devices if config.rollout.devices else None)
  task, state, layout = built.task, built.state, built.layout
  ref_params, teacher = built.held.reference, built.held.teacher
  programs, beside = [], {}
  for name, jitted, args in built.programs:
    if only is not None and name not in only:
      continue
    # Split devices: the sampler's program on its own devices and mesh, the rest on the trainer's.
    order, program_mesh = ((built.devices[name], layout.mesh) if name in built.devices
                           else (list(mesh.devices.reshape(-1)), mesh))
    with jax.set_mesh(program_mesh), targets.compiler_log(log):
      programs.append(compile_program(name, target, order, jitted, *args))
    beside[name] = held_beside(args, built.resident, order)

  # The sampler decodes from the whole policy: with LoRA the frozen base and the adapters.
  if layout is not None:
    resident_bytes, decode_mesh = resident_bytes_per_device(state.policy, layout), layout.mesh
    layout_report = dict(tensor=layout.tensor, data_groups=layout.data_groups,
                         experts_per_device=layout.experts_per_device(architecture.num_experts))
  else:  # the training layout: each device reads the whole model, split over 'tensor', every token
    policy_count = sum(math.prod(x.shape) for x in jax.tree.leaves(state.policy))
    resident_bytes = policy_count * jnp.dtype(config.model.options.dtype).itemsize // mesh.shape['tensor']
    decode_mesh, layout_report = mesh, dict(tensor=mesh.shape['tensor'], data_groups=0, experts_per_device=None)
  # With LoRA, `parameters` (what the optimizer updates) are the adapters; the frozen base is an
  # argument of every program (in its compiled peak) and has no optimizer state.
  per_device = dict(parameters=sharding.bytes_per_device(state.params))
  if state.frozen is not None:
    per_device['frozen_base'] = sharding.bytes_per_device(state.frozen)
  per_device.update(optimizer_state=sharding.bytes_per_device(state.opt_state),
                    reference=sharding.bytes_per_device(ref_params) if ref_params is not None else 0,
                    resident_weights=resident_bytes)
  scoring = {model.label: dict(path=model.path,
                               parameters=sum(math.prod(x.shape) for x in jax.tree.leaves(model.params)),
                               bytes=sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
                                         for x in jax.tree.leaves(model.params)),
                               bytes_per_device=sharding.bytes_per_device(model.params))
             for model in built.model_scores.scorings}
  if scoring:  # their weights in the term's dtype, laid out like the policy's, no optimizer state
    per_device['reward_models'] = sum(model['bytes_per_device'] for model in scoring.values())
  teacher_report = None
  if teacher is not None:  # in the student's compute dtype, laid out like it, no optimizer state
    per_device['teacher'] = sharding.bytes_per_device(teacher.params)
    teacher_architecture = nnx.merge(teacher.graphdef, teacher.params).config
    teacher_report = dict(path=teacher.path, parameters=teacher_architecture.num_params(),
                          active_parameters=teacher_architecture.num_params(active=True),
                          bytes=sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
                                    for x in jax.tree.leaves(teacher.params)),
                          bytes_per_device=per_device['teacher'])
    teacher_report['placement'] = teacher_placement(config, teacher_report, mesh, task.prompt_length)
  programs = [dataclasses.asdict(program) | dict(compiled_peak=program.peak, beside=beside[program.name],
                                                 peak=program.peak + sum(beside[program.name].values()))
              for program in programs]
  peak = max(program['peak'] for program in programs)
  pool = getattr(state.pool, 'pool', state.pool)  # partial rollouts: the pool's prompt entries
  # The cache laid out as the sampler lays it out (a context axis holds more rows: layout.DECODE_RULES).
  with layout.active() if layout is not None else contextlib.nullcontext():
    cache_bytes = kv_cache_bytes_per_device(architecture, config, task.prompt_length, decode_mesh,
                                            prompts=0 if pool is None else pool.entries)
    cache_entry = _cache_entry_report(architecture, config, task.prompt_length, decode_mesh,
                                      0 if pool is None else pool.entries)
  report = dict(
      target=target.name, device=target.describe(), devices=len(devices),
      program_devices={program['name']: len(built.devices.get(program['name'], trainer_devices))
                       for program in programs},
      mesh=dict(mesh.shape), rollout_layout=layout_report,
      model=dict(layers=architecture.num_hidden_layers, hidden=architecture.hidden_size,
                 parameters=architecture.num_params(), active_parameters=architecture.num_params(active=True),
                 experts=architecture.num_experts, experts_per_token=architecture.num_experts_per_tok,
                 sparse_layers=architecture.num_sparse_layers,
                 trained=sum(math.prod(x.shape) for x in jax.tree.leaves(state.params)),
                 lora=dataclasses.asdict(config.model.options.lora) if config.model.options.lora else None),
      per_device=per_device | dict(kv_cache=cache_bytes), kv_cache_entry=cache_entry,
      programs=programs, reward_models=scoring, teacher=teacher_report,
      peak=peak, hbm=target.hbm_bytes, fits=peak <= target.hbm_bytes,
      sequence_length=task.prompt_length + config.rollout.max_new_tokens,
      routes_bytes=routes_bytes(architecture, config.completions_per_step,
                                task.prompt_length + config.rollout.max_new_tokens),
      compiler_notes=targets.summarise_compiler_log(log), compiler_log=log)
  if config.rollout.devices:
    report['split'] = crossing(config, target, state.pool, resident_bytes, trainer_devices, sampler_devices)
  report['estimate'] = estimate(config, target, architecture, task.prompt_length, report, task.vision_bucket)
  return report


def teacher_placement(config: config_lib.Config, teacher: dict, mesh, prompt_length: int) -> dict:
  """Where a teacher can lie, in figures: resident sharded over the trainer's devices (what a run
  does: `resident_bytes_per_device`, and its weights gathered over 'fsdp' once per micro-batch of
  the update's scoring pass, `gathered_bytes_per_update` per device), or on devices of its own
  (not built yet): k devices holding it whole between them (`own_devices_bytes_per_device` for
  each k of 1, 2, 4, 8), with only the batch's tokens going there and its log-probs coming back
  (`own_devices_crossing_bytes`)."""
  rows = config.completions_per_step
  micro_rows = config.algo.micro_batch_size or rows // config.algo.num_minibatches
  micro_batches = max(1, rows // micro_rows)
  fsdp = mesh.shape.get('fsdp', 1)
  length = prompt_length + config.rollout.max_new_tokens
  return dict(resident_bytes_per_device=teacher['bytes_per_device'], scoring_micro_batches=micro_batches,
              gathered_bytes_per_update=micro_batches * teacher['bytes'] // mesh.shape.get('tensor', 1)
              * (fsdp - 1) // fsdp,
              own_devices_bytes_per_device={k: teacher['bytes'] // k for k in (1, 2, 4, 8)},
              own_devices_crossing_bytes=rows * length * 4 + rows * config.rollout.max_new_tokens * 4)


def held_beside(args, resident: dict, devices) -> dict:
  """{name: bytes per device} of the step's resident arrays (programs.StepPrograms.resident: the
  train state's parts, pi_ref, the reward models' weights) that lie on a program's `devices` but are
  not among its `args`: they stay in memory while it runs, beside the compiler's peak for it, which
  counts only what the program itself holds (its arguments, outputs, temporaries). The update takes
  the state and pi_ref, so only the reward models lie beside it; the rollout takes the policy's
  weights, so the optimizer state, pi_ref and the reward models do; a reward model's program takes
  its own weights, so the train state and pi_ref do."""
  taken = {id(leaf) for leaf in jax.tree.leaves(args)}
  devices = set(devices)
  held = {}
  for name, tree in resident.items():
    leaves = [leaf for leaf in jax.tree.leaves(tree) if id(leaf) not in taken and leaf.sharding.device_set & devices]
    if leaves:
      held[name] = sharding.bytes_per_device(leaves)
  return held


def crossing(config: config_lib.Config, target: targets.Target, pipeline, resident_bytes: int, trainer_devices,
             sampler_devices) -> dict:
  """What crosses between split devices per step (rl/modes.py), each array to its counterpart device
  (sampler/layout.cross): to each sampler device its resident weights' shard and the step's P
  prompts (replicated there: tokens, mask, a jittable task's answers); back to the trainer's, the
  P groups made ready (`pipeline.ready`: rows over the trainer's batch axes, each device its share).
  `link`: the link class the crossing uses (the network when the two sides are on other hosts)."""
  nbytes = lambda tree: sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))  # noqa: E731
  pool = pipeline.pool
  entries = pool.prompt_tokens.shape[0]
  prompts = nbytes((pool.prompt_tokens, pool.prompt_mask, pool.answers)) * config.rollout.prompts_per_step // entries
  groups = nbytes(pipeline.ready)
  link = target.link([trainer_devices[0], sampler_devices[0]])
  per_device = resident_bytes + prompts + -(-groups // len(trainer_devices))
  return dict(trainer_devices=len(trainer_devices), sampler_devices=len(sampler_devices),
              transfer_bytes_per_device=resident_bytes, transfer_bytes=resident_bytes * len(sampler_devices),
              prompts_bytes=prompts, groups_bytes=groups, bytes_per_device=per_device,
              bytes=(resident_bytes + prompts) * len(sampler_devices) + groups, link=link,
              crossing_s=per_device / target.link_bandwidth_of(link))


def estimate(config: config_lib.Config, target: targets.Target, architecture, prompt_length: int, report: dict,
             bucket=None) -> dict:
  """Roofline estimate of the step, per program the largest of compute, HBM and interconnect time.

  compute: model FLOPs at the target's peak (the rollout's 2 N per sampled token, the rest the
  update's; N the active parameters, a mixture's k experts of E, without a vision tower's; the
  tower's FLOPs on each prompt's `bucket` of images as metrics.tower_flops_per_step counts them,
  `tower_flops`). HBM: every decode step reads the resident weights and, on average, half of each row's
  KV cache. Interconnect: the compiled collectives (traffic.py), once per program outside the
  decode loop and S times inside it (S = max_new_tokens, the longest answer's decode steps, times
  ceil(P x G / rollout.slots) with fewer slots than answers: each slot then decodes that many
  answers in turn, at worst all of them to the budget), each
  on the link class its device groups use (`links`: NVLink, the network between GPU hosts, ICI);
  `bound` names the largest of compute, HBM and the links. With dynamic sampling each further
  round is another rollout: `dynamic_sampling` gives the step at algo.max_sampling_rounds.

  Split devices (rollout.devices): each program on its own devices; the weights' crossing X is the
  'transfer' program plus each sampler device's resident shard over the link between the halves.
  Serial, a step costs R + U + X (rollout, update, crossing). Pipelined, the sampler's advance for
  step v + 1 needs the weights of update v - 1 and its own last advance, and update v needs
  advance v - 1 and update v - 1, so a step costs max(R, U, (R + U + X) / 2): the two-step cycle
  advance -> update -> crossing -> advance bounds it when neither side dominates.

  A reward model's program (report['reward_models']): one forward over the step's P x G rows of
  Tp + N tokens, 2 N_rm FLOPs per token (N_rm its parameters, the convention of the policy's
  passes), on the trainer's devices; HBM: its gathered weights read once; interconnect: its compiled
  collectives (the weights' FSDP gathers). It runs between the rollout and the update, so the
  step's sum counts it, with split devices it is on the update's side, and with dynamic sampling
  each further round is scored again. `reward_models_s`: its share of the step."""
  rows = config.completions_per_step
  answer = config.rollout.max_new_tokens
  decode_steps = answer * -(-rows // min(config.rollout.slots or rows, rows))
  vision = architecture.vision
  params = architecture.num_params(active=True) - (vision.num_params() if vision is not None else 0)
  adapters = report['model']['trained'] if config.model.options.lora is not None else None
  step_flops = metrics_lib.model_flops_per_step(params, prompt_length, config.rollout, config.algo,
                                                adapter_params=adapters)
  rollout_flops = 2.0 * params * (config.rollout.prompts_per_step * prompt_length + rows * answer)
  tower = dict(rollout=0.0, update=0.0)
  if vision is not None and bucket is not None:
    options = config.model.options
    tower['rollout'], tower['update'] = metrics_lib.tower_flops_per_step(
        bucket.images * vision.image_flops(patch_bucket(bucket.patches, vision)), config.rollout, config.algo,
        trained=not options.freeze_vision and options.lora is None, remat=options.remat != 'none')
    step_flops += tower['rollout'] + tower['update']
    rollout_flops += tower['rollout']
  # A teacher's forward in the update: 2 N_t FLOPs per token the update computes (its scoring pass on
  # the rows pi_old's and pi_ref's score; N_t its active parameters).
  teacher = report.get('teacher')
  computed = config.rollout.prompts_per_step * metrics_lib.update_tokens_per_group(prompt_length, answer, config.algo)
  teacher_flops = (2.0 * teacher['active_parameters'] * computed) if teacher else 0.0
  per_device = report['per_device']
  # A decode step reads the resident weights and, on average over the answer, half the cache.
  decode_bytes = decode_steps * (per_device['resident_weights'] + per_device['kv_cache'] / 2)
  decode_s = decode_bytes / target.hbm_bandwidth
  parts = {}
  scoring = report.get('reward_models', {})
  for program in report['programs']:
    if program['name'] in scoring:
      parts[program['name']] = _scoring_part(config, target, prompt_length, scoring[program['name']], program,
                                             report['program_devices'][program['name']])
      continue
    rollout = program['name'] not in ('update', 'transfer')
    links = {link: entry['seconds'] for link, entry in program['links']['outside'].items()}
    for link, entry in program['links']['per_decode_step'].items() if rollout else ():
      links[link] = links.get(link, 0.0) + decode_steps * entry['seconds']
    if program['name'] == 'transfer':  # no model FLOPs, no decoding: its collectives only
      parts['transfer'] = dict(compute_s=0.0, hbm_s=0.0, interconnect_s=sum(links.values()), links=links)
      continue
    update = program['name'] != 'rollout'
    flops = (rollout_flops if rollout else 0.0) + ((step_flops - rollout_flops + teacher_flops) if update else 0.0)
    devices = report['program_devices'][program['name']]
    parts[program['name']] = dict(flops=flops, compute_s=flops / (devices * target.peak_flops),
                                  hbm_s=decode_s if rollout else 0.0, interconnect_s=sum(links.values()), links=links)
  for part in parts.values():
    part['program_s'] = max(part['compute_s'], part['hbm_s'], part['interconnect_s'])
    part['bound'] = _bound(part)
  scoring_s = sum(part['program_s'] for name, part in parts.items() if name in scoring)
  entry = report.get('kv_cache_entry') or {}
  mha_bytes = (decode_steps * (per_device['resident_weights'] + entry['mha_kv_cache'] / 2)) if 'mha_kv_cache' in entry else None
  result = dict(model_flops=step_flops, tower_flops=tower, teacher_flops=teacher_flops, programs=parts,
                update_tokens=computed, sequence_tokens=rows * (prompt_length + answer),
                decode_hbm_bytes=decode_bytes, mha_decode_hbm_bytes=mha_bytes,
                reward_model_flops=sum(part['flops'] for name, part in parts.items() if name in scoring),
                reward_models_s=scoring_s, step_s=sum(part['program_s'] for part in parts.values()))
  result['step_without_reward_models_s'] = result['step_s'] - scoring_s
  if 'split' in report and {'rollout', 'update', 'transfer'} <= parts.keys():
    rollout_s, update_s = parts['rollout']['program_s'], parts['update']['program_s']
    crossing_s = parts['transfer']['program_s'] + report['split']['crossing_s']
    overlapped = lambda update_s: max(rollout_s, update_s, (rollout_s + update_s + crossing_s) / 2)  # noqa: E731
    result.update(serial_s=rollout_s + update_s + scoring_s + crossing_s, crossing_s=crossing_s,
                  step_s=overlapped(update_s + scoring_s), step_without_reward_models_s=overlapped(update_s))
  if config.algo.dynamic_sampling and 'rollout' in parts:
    # Each further sampling round is another rollout of P prompts; how many a step needs depends on
    # how many groups the data's prompts leave without spread, which no compile can know.
    rounds = config.algo.max_sampling_rounds
    round_s = parts['rollout']['program_s'] + scoring_s
    result['dynamic_sampling'] = dict(max_rounds=rounds, round_s=round_s,
                                      step_max_s=result['step_s'] + (rounds - 1) * round_s)
  return result


def _scoring_part(config: config_lib.Config, target: targets.Target, prompt_length: int, model: dict, program: dict,
                  devices: int) -> dict:
  """A reward model's program in the step's estimate (estimate's docstring)."""
  flops = 2.0 * model['parameters'] * config.completions_per_step * (prompt_length + config.rollout.max_new_tokens)
  links = {link: entry['seconds'] for link, entry in program['links']['outside'].items()}
  return dict(flops=flops, compute_s=flops / (devices * target.peak_flops), hbm_s=model['bytes'] / target.hbm_bandwidth,
              interconnect_s=sum(links.values()), links=links)


def _bound(part: dict) -> str:
  """What bounds a program's estimate: 'compute', 'HBM', or the link class that carries most of
  its interconnect time (targets.LINK_NAMES) when the interconnect does."""
  times = dict(compute=part['compute_s'], HBM=part['hbm_s'], interconnect=part['interconnect_s'])
  bound = max(times, key=times.get)
  if bound == 'interconnect' and part['links']:
    return targets.LINK_NAMES.get(link := max(part['links'], key=part['links'].get), link)
  return bound


def parse_bytes(text: str, field: str) -> int:
  """'80GiB', '16G' (binary), '95GB' (decimal), '1048576' -> bytes."""
  import re
  match = re.fullmatch(r'\s*([0-9]*\.?[0-9]+)\s*(?:([KMGT])(i?)(B?))?\s*', text, re.IGNORECASE)
  if not match or float(match.group(1)) <= 0:
    raise UserError(f'{field} {text!r}: write a positive size such as 80GiB, 95GB or 16G')
  number, unit = float(match.group(1)), (match.group(2) or '').upper()
  decimal = bool(match.group(4)) and not match.group(3)  # GB; GiB and G are binary
  return int(number * (1000 if decimal else 1024) ** ' KMGT'.index(unit or ' '))


def _collective_summary(by_kind: dict) -> str:
  total = sum(by_kind.values())
  parts = ', '.join(f'{kind} {format_bytes(value)}' for kind, value in by_kind.items() if value)
  return f'{format_bytes(total)}' + (f' ({parts})' if parts else '')


def format_report(report: dict) -> str:
  layout = report['rollout_layout']
  model = report['model']
  mixture = (f' ({model["active_parameters"] / 1e9:.2f}B active: {model["experts_per_token"]} of '
             f'{model["experts"]} experts in {model["sparse_layers"]} sparse layers)' if model['experts'] else '')
  experts = (f'; experts sharded over the data groups, {layout["experts_per_device"]} of {model["experts"]} '
             'per device' if layout['experts_per_device'] else '')
  lines = [f'# {report["device"]}', f'mesh {report["mesh"]} over {report["devices"]} devices; model '
           f'{model["parameters"] / 1e9:.2f}B parameters{mixture}, {model["layers"]} layers',
           (f'rollout layout: weights resident, tensor-parallel over {layout["tensor"]} devices x '
            f'{layout["data_groups"]} data groups (rollout.tensor){experts}' if layout['data_groups'] else
            'rollout layout: the training layout (weights gathered for every decoded token)'),
           'per device (the target compiler\'s memory analysis for the programs):']
  lora = report['model']['lora']
  if lora:  # the optimizer's parameters are the adapters; the base is held frozen, in the compute dtype
    lines.insert(2, f'LoRA rank {lora["rank"]} on {",".join(lora["targets"])}: {report["model"]["trained"] / 1e6:.1f}M '
                    'trained parameters (the adapters); the base frozen, without optimizer state or a reference copy')
  for name, value in report['per_device'].items():
    lines.append(f'  {name.replace("_", " "):<18}{format_bytes(value):>12}')
  entry = report.get('kv_cache_entry') or {}
  if entry.get('latent'):
    estimate = report.get('estimate') or {}
    lines.append(f'  the KV cache is latent: {entry["values_per_token_layer"]} values per token and layer, against '
                 f'{entry["mha_values_per_token_layer"]} for an MHA cache of this model '
                 f'({entry["mha_values_per_token_layer"] / entry["values_per_token_layer"]:.1f}x), which would take '
                 f'{format_bytes(entry["mha_kv_cache"])} per device'
                 + (f'; the rollout\'s decode steps read {format_bytes(estimate["decode_hbm_bytes"])} per device, '
                    f'{format_bytes(estimate["mha_decode_hbm_bytes"])} with it' if estimate.get('mha_decode_hbm_bytes')
                    else ''))
  for program in report['programs']:
    lines.append(f'  program "{program["name"]}" (compiled in {program["compile_s"]:.1f} s): arguments '
                 f'{format_bytes(program["arguments"])}, outputs {format_bytes(program["outputs"])} ({format_bytes(program["aliased"])} '
                 f'in place), temporaries {format_bytes(program["temporaries"])} -> peak '
                 f'{format_bytes(program["compiled_peak"])}'
                 + (f'; {program["note"]}' if program['note'] else ''))
    if program['beside']:  # the step's other resident arrays, which this program does not take
      held = ', '.join(f'{name.replace("_", " ")} {format_bytes(value)}' for name, value in program['beside'].items())
      lines.append(f'    held beside it for the step: {held} -> {format_bytes(program["peak"])}')
    collectives = program['collectives']
    decodes = program['name'] not in ('update', 'transfer', *report.get('reward_models', {}))
    lines.append(f'    collectives per device (compiled program): {_collective_summary(collectives["outside"])} '
                 'per run' + (f'; per decode step {_collective_summary(collectives["per_decode_step"])}'
                              if decodes else ''))
    by_link = [(f'{part}: ' if part != 'outside' else '') + ', '.join(
        f'{targets.LINK_NAMES.get(link, link)} {format_bytes(entry["bytes"])}' for link, entry in links.items())
        for part, links in program['links'].items() if links]
    if by_link:
      lines.append(f'    by link: {"; ".join(by_link)}'.replace('per_decode_step: ', 'per decode step '))
    step = program.get('decode_step')
    if step:
      lines.append(f'    per decode step: {step["kernels"]} kernels, {format_bytes(step["bytes"])} of their operands and '
                   f'results, {format_bytes(step["copied"])} written by copies and slices')
  teacher = report.get('teacher')
  if teacher:
    lines.append(f'teacher {teacher["path"]}: {teacher["parameters"] / 1e9:.2f}B parameters, resident sharded over the '
                 f'trainer\'s devices ({format_bytes(teacher["bytes_per_device"])} per device of '
                 f'{format_bytes(teacher["bytes"])}), its forward in the update')
    place = teacher['placement']
    own = ', '.join(f'{k}: {format_bytes(value)}' for k, value in place['own_devices_bytes_per_device'].items())
    lines.append(f'  its FSDP gathers: {format_bytes(place["gathered_bytes_per_update"])} per device per update '
                 f'({place["scoring_micro_batches"]} scoring micro-batches; fewer, larger ones gather less); on '
                 f'devices of its own (not built yet) it would hold per device, by their count, {own}, and only '
                 f'{format_bytes(place["own_devices_crossing_bytes"])} of tokens and log-probs would cross per step')
  if report['routes_bytes']:
    lines.append(f'recorded routes per step: {format_bytes(report["routes_bytes"])} (rows x sequence x '
                 f'{model["sparse_layers"]} sparse layers x top-{model["experts_per_token"]} expert ids)')
  verdict = 'fits' if report['fits'] else 'DOES NOT FIT'
  lines.append(f'peak {format_bytes(report["peak"])} of {format_bytes(report["hbm"])} per device: {verdict}')
  estimate = report['estimate']
  tower = estimate.get('tower_flops', {})
  lines.append(f'estimate (roofline, not measured): {estimate["model_flops"] / 1e15:.1f} PFLOP per step'
               + (f' (the vision tower: rollout {tower["rollout"] / 1e15:.1f}, update {tower["update"] / 1e15:.1f})'
                  if any(tower.values()) else '')
               + (f', and the reward models\' forward {estimate["reward_model_flops"] / 1e15:.1f} PFLOP'
                  if report.get('reward_models') else '')
               + (f', and the teacher\'s forward in the update {estimate["teacher_flops"] / 1e15:.1f} PFLOP'
                  if report.get('teacher') else ''))
  if estimate['update_tokens'] < estimate['sequence_tokens']:
    lines.append(f'tree packing: the update computes {estimate["update_tokens"]:,} tokens a pass of the '
                 f'sequences\' {estimate["sequence_tokens"]:,} ({estimate["sequence_tokens"] / estimate["update_tokens"]:.2f}x '
                 'fewer), each prompt once per packed row its group fills')
  for name, part in estimate['programs'].items():
    links = ', '.join(f'{targets.LINK_NAMES.get(link, link)} {value:.2f} s' for link, value in part['links'].items())
    lines.append(f'  "{name}": {part.get("flops", 0.0) / 1e15:.1f} PFLOP, compute >= {part["compute_s"]:.2f} s, '
                 f'HBM >= {part["hbm_s"]:.2f} s, interconnect >= '
                 f'{part["interconnect_s"]:.2f} s' + (f' ({links})' if len(part['links']) > 1 else '')
                 + f' -> {part["program_s"]:.2f} s, bound by {part["bound"]}')
  if 'split' in report:
    split = report['split']
    lines.insert(2, f'split devices: sampler on {split["sampler_devices"]}, trainer on {split["trainer_devices"]} '
                    f'(rollout.devices); crossing per step over {targets.LINK_NAMES.get(split["link"], split["link"])}: '
                    f'weights {format_bytes(split["transfer_bytes_per_device"])} per sampler device '
                    f'({format_bytes(split["transfer_bytes"])} in all), prompts {format_bytes(split["prompts_bytes"])} '
                    f'to each, groups {format_bytes(split["groups_bytes"])} back; '
                    f'{format_bytes(split["bytes_per_device"])} per device pair')
  if 'serial_s' in estimate:
    lines.append(f'  crossing >= {estimate["crossing_s"]:.2f} s; serial (rollout + update + crossing) >= '
                 f'{estimate["serial_s"]:.2f} s; overlapped >= {estimate["step_s"]:.2f} s')
  one_round = ' with one sampling round' if 'dynamic_sampling' in estimate else ''
  lines.append(f'  step >= {estimate["step_s"]:.2f} s{one_round}'
               + (f'; without the reward models\' programs ({estimate["reward_models_s"]:.2f} s) >= '
                  f'{estimate["step_without_reward_models_s"]:.2f} s' if report.get('reward_models') else ''))
  if 'dynamic_sampling' in estimate:
    rounds = estimate['dynamic_sampling']
    lines.append(f'  dynamic sampling: each further round (up to {rounds["max_rounds"]}) another rollout >= '
                 f'{rounds["round_s"]:.2f} s: step >= {rounds["step_max_s"]:.2f} s at {rounds["max_rounds"]} rounds')
  for note in report.get('compiler_notes', []):
    lines.append(f'compiler: {note}')
  return '\n'.join(lines)


