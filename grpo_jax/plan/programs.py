"""A run's compiled programs, for a target that is not attached: the RL step's programs on
abstract shapes (no weights, no data) and each one compiled by the target's compiler, with the
compiler's memory figures and the collectives read from its optimized program (traffic.py).
python -m grpo_jax.plan reports them (plan.py); its advice compiles them again with knobs (advice.py).
"""

import collections
import dataclasses
import functools
import os
import re
import time

import jax
import jax.numpy as jnp
from flax import nnx

from grpo_jax import build, restore
from grpo_jax import config as config_lib
from grpo_jax import sharding
from grpo_jax.build import build_rl_step
from grpo_jax.data.reward_terms import ModelTerm
from grpo_jax.data.task import Scores
from grpo_jax.errors import UserError
from grpo_jax.model import lora
from grpo_jax.model.hf_config import load_hf_config
from grpo_jax.model.loading import abstract_model, check_mesh
from grpo_jax.plan import targets, traffic
from grpo_jax.rl.held import Held, Teacher
from grpo_jax.rl.model_scores import ModelScores, scoring_options
from grpo_jax.rl.state import init_train_state
from grpo_jax.sampler.layout import place_program


def model_architecture(config: config_lib.Config, model_size: str | None, layers: int | None):
  from grpo_jax.model.presets import MODEL_PRESETS, preset
  if model_size is not None:
    if model_size not in MODEL_PRESETS:
      raise UserError(f'--model-size {model_size}: one of {", ".join(MODEL_PRESETS)}')
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
    # A per-layer pattern (Gemma 3's local and global layers) keeps its first `layers` entries.
    layer_types = architecture.layer_types[:layers] if architecture.layer_types else ()
    # The dense layers of a mixture (DeepSeek-V3's first 3) likewise, but one sparse layer stays.
    dense = tuple(i for i in architecture.mlp_only_layers if i < (layers - 1 if architecture.num_experts else layers))
    architecture = dataclasses.replace(architecture, num_hidden_layers=layers, layer_types=layer_types,
                                       mlp_only_layers=dense)
  return architecture


def _abstract(tree, shardings):
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _abstract_scores(config: config_lib.Config, sharding) -> Scores:
  """A step's Scores as ShapeDtypeStructs: a reward (and each reward term) per completion."""
  rows = config.completions_per_step
  row = jax.ShapeDtypeStruct((rows,), jnp.float32, sharding=sharding)
  return Scores(rewards=row, failures=jax.ShapeDtypeStruct((), jnp.int32, sharding=sharding),
                terms={term.label: row for term in config.rewards})


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
  # {'outside' | 'per_decode_step': {link class: {'bytes', 'seconds'}}}: the same collectives by the
  # link their device groups use (targets.Target.link: NVLink or the network between GPU hosts, ICI)
  links: dict = dataclasses.field(default_factory=dict)
  # One decode step's kernels (traffic.Kernels: kernels launched, their operand + result bytes, the
  # bytes written by kernels that only move data); empty for a program without a decode loop.
  decode_step: dict = dataclasses.field(default_factory=dict)
  # The library and kernel calls in the compiled program by target (cuDNN's fused attention,
  # cuBLAS GEMMs, Pallas kernels): {custom_call_target: count}.
  library_calls: dict = dataclasses.field(default_factory=dict)

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
# The vision tower's backward, once per prompt (its rows [P x patches, C]), met another form of it
# ("No supported config found for HLO": no Triton config compiles without autotuning).
_TRITON_GEMM_TILING = ("Couldn't find output tile sizes", 'No supported config found for HLO')
NO_TRITON_GEMM = {'xla_gpu_enable_triton_gemm': False}


def compile_for_target(jitted, args, platform: str):
  """(compiled, note): `jitted` traced on `args` and compiled by the target's compiler."""
  lowered = jitted.trace(*args).lower()
  options = targets.compiler_options(platform)
  try:
    return lowered.compile(compiler_options=options), ''
  except Exception as error:
    if platform != 'gpu' or not any(message in str(error) for message in _TRITON_GEMM_TILING):
      raise
  return (lowered.compile(compiler_options=options | NO_TRITON_GEMM),
          'GEMMs on cuBLAS (no default Triton GEMM tiling fits)')


def compile_program(name: str, target: targets.Target, devices: list, jitted, *args) -> Program:
  """`jitted` compiled for `target`; `devices`: the program's devices in its device-assignment
  order (the mesh's, flattened), which the collectives' logical device ids index."""
  start = time.perf_counter()
  try:
    compiled, note = compile_for_target(jitted, args, target.platform)
  except UserError:  # the run's settings, refused while tracing: already one line naming the field
    raise
  except Exception as error:  # the target's compiler refused it: say so, in its own words
    message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    raise UserError(f'{name}: the target compiler refused the program: {message}') from error
  seconds = time.perf_counter() - start
  memory = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) and cost else cost
  flops = float(cost['flops']) if cost and 'flops' in cost else None
  text = compiled.as_text()
  found = traffic.collectives(text, len(devices))
  kernels = traffic.decode_step_kernels(text)
  link = functools.cache(lambda group: target.link([devices[i] for i in group]))
  links = {part: traffic.by_link(found, in_loop, link, target.link_bandwidth_of)
           for part, in_loop in (('outside', False), ('per_decode_step', True))}
  return Program(name, seconds, memory.argument_size_in_bytes, memory.output_size_in_bytes,
                 memory.alias_size_in_bytes, memory.temp_size_in_bytes, memory.generated_code_size_in_bytes,
                 flops, note,
                 collectives=dict(outside=traffic.totals(found, False), per_decode_step=traffic.totals(found, True)),
                 interconnect_s={part: sum(entry['seconds'] for entry in by.values()) for part, by in links.items()},
                 links=links, decode_step=dataclasses.asdict(kernels) if kernels.kernels else {},
                 library_calls=dict(collections.Counter(re.findall(r'custom_call_target="([^"]+)"', text))))


@dataclasses.dataclass
class StepPrograms:
  """A run's RL step on abstract shapes over `mesh`: the jitted programs and their arguments."""

  task: object
  state: object
  held: Held  # pi_ref's parameters and a teacher's, abstract (rl/held.py)
  programs: list  # (name, jitted function, abstract arguments)
  layout: object = None  # the sampler's RolloutLayout
  devices: dict = dataclasses.field(default_factory=dict)  # program name -> its devices, where not the mesh's
  model_scores: ModelScores = ModelScores.none()  # the run's reward models, their parameters abstract

  @property
  def resident(self) -> dict:
    """What stays on the devices for the whole step, whichever program runs: the train state's
    parts, pi_ref, a teacher's and the reward models' weights, by the name the report gives them
    per device."""
    return dict(parameters=self.state.params, frozen_base=self.state.frozen, optimizer_state=self.state.opt_state,
                pool=self.state.pool, reference=self.held.reference,
                teacher=None if self.held.teacher is None else self.held.teacher.params,
                reward_models=[scoring.params for scoring in self.model_scores.scorings])


def step_programs(config: config_lib.Config, architecture, mesh, resident: bool = True,
                  sampler_devices=None) -> StepPrograms:
  """The programs a run compiles, on abstract inputs placed on `mesh` (no weights, no data): the
  K-steps-in-one-jit loop for a jittable task, else the sampler and the update (with partial
  rollouts the sampler is the pool's advance). resident False: the sampler decodes in the
  training layout instead of its own (as grpo_jax did before the rollout layout;
  bench/rollout_layout.py compares the two). sampler_devices: split devices (rollout.devices),
  the sampler's own: then the sampler's program on them, the update on `mesh`, and the program
  that lays the weights out for the crossing, on `mesh` too. A run with reward-model terms has
  each model's scoring program between the sampler and the update (`scoring_programs`), its
  parameters abstract from the term's config.json (rl/model_scores.py ModelScores.abstract)."""
  task = config.task.kind.shape(config, architecture)
  if task.vocab_size > architecture.vocab_size:
    raise UserError(f'the task\'s tokenizer has {task.vocab_size} tokens but the model has {architecture.vocab_size}')
  check_mesh(architecture, mesh)
  model = abstract_model(architecture, config.model.options)
  abstract_params = nnx.state(model)
  shardings = sharding.state_shardings(abstract_params, mesh)
  params = sharding.placed_abstract(abstract_params, shardings)
  # The reward models from their config.json alone: build_rl_step would load their weights.
  terms = tuple(term for term in config.rewards if isinstance(term, ModelTerm))
  model_scores = ModelScores.abstract(terms, mesh, task.prompt_length + config.rollout.max_new_tokens,
                                      config.model.options)
  step = build_rl_step(config, model, mesh, task, params=params, resident=resident, sampler_devices=sampler_devices,
                       model_scores=model_scores)
  trained, frozen = lora.split_trainable(params)
  state = _abstract(jax.eval_shape(functools.partial(init_train_state, optimizer=step.optimizer, seed=0), trained,
                                   pool=step.empty_pool, frozen=frozen), step.state_shardings)
  # pi_ref: a copy of the policy; with LoRA the state's own base (adapters off), no copy. A teacher
  # from its config.json (or its run's metadata) alone, laid out as build_teacher lays it out.
  held = Held(reference=params if config.algo.kl_beta > 0 and frozen is None else None,
              teacher=abstract_teacher(config, mesh, task, architecture))
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  if step.host_mode.split:
    return _split_programs(config, task, step, state, held, replicated)
  if task.jittable:
    programs = [(f'{config.train.steps_per_call} RL steps in one jit', step.fused,
                 (state, held, config.train.steps_per_call))]
  else:
    prompts = jax.ShapeDtypeStruct((config.rollout.prompts_per_step, task.prompt_length), jnp.int32, sharding=replicated)
    key = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=replicated)
    bucket = task.vision_bucket  # a vision-language task's images, padded to its bucket
    vision = None if bucket is None else bucket.shapes(config.rollout.prompts_per_step, task.prompt_length,
                                                       architecture.vision, replicated)
    with jax.set_mesh(mesh):
      rollout = jax.eval_shape(step.sampling.sample, state.policy, prompts, prompts, key, vision)
    scores = _abstract_scores(config, replicated)
    rollout = _rows_over_batch(rollout, mesh)
    shown = step.sampling.episodes  # an agent's episodes with images: each row's own, in the update
    if shown is not None and shown.images is not None:
      rows = config.rollout.prompts_per_step * config.algo.group_size
      rollout = dataclasses.replace(rollout, vision=shown.images.bucket.shapes(
          rows, task.prompt_length + config.rollout.max_new_tokens, architecture.vision, replicated))
    version = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
    sampler = (('rollout', step.host_mode.advance, (state.policy, state.pool, version)) if config.algo.max_lag else
               # the group sampler (an agent task's server decodes with the same step)
               ('rollout', jax.jit(step.sampling.sample), (state.policy, prompts, prompts, key, vision)))
    programs = [sampler, *scoring_programs(model_scores, prompts, rollout),
                ('update', step.update_program,
                 (state.replace(pool=None), held, prompts, prompts, rollout, scores, vision))]
  return StepPrograms(task=task, state=state, held=held, programs=programs, layout=step.layout,
                      model_scores=model_scores)


def abstract_teacher(config: config_lib.Config, mesh, task, student) -> Teacher | None:
  """The run's teacher (algo.teacher) as build_teacher lays it out over `mesh`, its parameters
  ShapeDtypeStructs in the student's compute dtype: the architecture from the teacher's config.json
  or its training run's metadata, no weights read. Refused as a run refuses it where no tokenizer is
  needed to tell (a reward model, too few embedding rows for the student's ids, images read
  otherwise, heads that do not divide over the mesh). `task`: the run's task shape; `student` its
  architecture."""
  if config.algo.teacher is None:
    return None
  architecture, _ = restore.checkpoint_architecture(config.algo.teacher, 'algo.teacher')
  build.check_teacher_architecture(config.algo.teacher, architecture, task.vocab_size, student, mesh)
  options = scoring_options(config.model.options, config.model.options.dtype)
  graphdef, state = nnx.split(abstract_model(architecture, options))
  return Teacher(graphdef=graphdef, params=sharding.placed_abstract(state, sharding.state_shardings(state, mesh)),
                 path=config.algo.teacher)


def scoring_programs(model_scores: ModelScores, prompts, rollout) -> list:
  """Each reward model's program (rl/model_scores.py) on the step's abstract rows as the run hands
  them over: the prompts [P, Tp] replicated (host_task.HostTask.prompts), the completions [P*G, N]
  and their mask laid out by rows over the mesh's batch axes, as the sampler returns them
  (sampler/layout.run_resident). Named by the label of the term it serves."""
  def by_rows(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding.named_sharding(
        prompts.sharding.mesh, x.shape, ('batch',) + (None,) * (x.ndim - 1)))
  return [(scoring.label, scoring.program,
           (scoring.graphdef, scoring.params, prompts, prompts, by_rows(rollout.tokens), by_rows(rollout.mask)))
          for scoring in model_scores.scorings]


def _rows_over_batch(tree, mesh):
  """A rollout's arrays as the update takes them: rows over the trainer mesh's batch axes (as the
  sampler hands them over, sampler/layout.rows_to_source, and a host task's reward places them),
  scalars replicated. Replicated instead, a mixture's recorded routes alone would count once per
  device whole (10.9 GiB for the 671B recipe)."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding.row_sharding(mesh, x.shape)),
                      tree)


def _split_programs(config, task, step, state, held, replicated) -> StepPrograms:
  """Split devices' three programs: 'rollout' (the pool's advance on the sampler's devices, from
  the resident weights), 'transfer' (the weights cast and laid out on the trainer's devices as the
  sampler's layout, before each shard crosses) and 'update' (on the trainer's)."""
  layout = step.layout
  resident = jax.eval_shape(layout.mirror.place, state.policy)
  resident = sharding.placed_abstract(resident, layout.shardings(resident))
  on_sampler = jax.sharding.NamedSharding(layout.mesh, jax.sharding.PartitionSpec())
  version = jax.ShapeDtypeStruct((), jnp.int32, sharding=on_sampler)
  ready = state.pool.ready
  prompts = jax.ShapeDtypeStruct(ready.prompt_tokens.shape, jnp.int32, sharding=replicated)
  scores = _abstract_scores(config, replicated)
  rollout = _rows_over_batch(ready.rollout, replicated.mesh)
  model_scores = step.sampling.model_scores  # on the trainer's devices, before the update
  programs = [('rollout', step.host_mode.sampler_program, (resident, state.pool.pool, version)),
              ('transfer', place_program(layout.mirror), (state.policy,)),
              *scoring_programs(model_scores, prompts, rollout),
              ('update', step.update_program, (state.replace(pool=None), held, prompts, prompts, rollout, scores))]
  return StepPrograms(task=task, state=state, held=held, programs=programs, layout=layout,
                      devices=dict(rollout=list(layout.mesh.devices.reshape(-1))), model_scores=model_scores)
