"""A run's parts built from its Config, in one place for training (train.py), the plan
(plan/programs.py), evaluation (eval.py) and benchmarks: the task, by name from data/task.py's registry,
the RL step with its optimizer and schedule (the optim section's), the train state's shardings and
the sampler's layout, and the evaluator of the task's held-out problems."""

import dataclasses

import jax
from flax import nnx

from grpo_jax import restore
from grpo_jax.data.reward_terms import ModelTerm
from grpo_jax.data.task import Task
from grpo_jax.errors import UserError, require
from grpo_jax.model import lora
from grpo_jax.model.loading import check_mesh
from grpo_jax.rl.held import Teacher
from grpo_jax.rl.model_scores import ModelScores, scoring_options, tokenizer_difference
from grpo_jax.rl.modes import Acting, GroupSampling, PoolSampling, RolloutMode, Sampling
from grpo_jax.rl.state import pool_shardings, train_state_shardings
from grpo_jax.rl.step import RLStep
from grpo_jax.sampler import pool as sampler_pool
from grpo_jax.sampler.pool import PoolSettings
from grpo_jax.sampler.layout import rollout_layout, split_devices


def build_task(config) -> Task:
  """The run's task from its `task` section (config: a config.Config)."""
  return config.task.kind.build(config)


def total_updates(config) -> int:
  """Optimizer updates in the whole run: the learning-rate schedule's length."""
  return config.train.steps * config.algo.ppo_epochs * config.algo.num_minibatches


def decode_slots(config) -> int:
  """B: the decode slots the sampler fills (rollout.slots, at most one per completion)."""
  rows = config.rollout.prompts_per_step * config.algo.group_size
  return min(config.rollout.slots or rows, rows)


def decode_settings(config, task: Task):
  """The trainer's sampler settings: the task's stop and pad ids; routes recorded for routing replay;
  with a teacher, no id past the task's tokenizer drawn (the teacher's table may end there)."""
  settings = config.rollout.decode_settings(task.stop_token_ids, task.pad_id,
                                            record_routes=config.algo.routing_replay == 'rollout')
  if config.algo.exact_on_policy:  # the sampled tokens' log-probs in the update's formula
    settings = dataclasses.replace(settings, sampling=dataclasses.replace(settings.sampling, exact=True))
  if config.algo.teacher is None or settings.sampling.vocab_limit:
    return settings
  return dataclasses.replace(settings, sampling=dataclasses.replace(settings.sampling, vocab_limit=task.vocab_size))


def pool_settings(config, task: Task) -> PoolSettings | None:
  """The run's pool of partial rollouts (algo.max_lag > 0, sampler/pool.py), derived here once;
  None on-policy."""
  if not config.algo.max_lag:
    return None
  return PoolSettings(take=config.rollout.prompts_per_step, group_size=config.algo.group_size,
                      # Split devices sample one version behind the trainer: the pool holds one lag fewer.
                      lag=config.algo.max_lag - (1 if config.rollout.devices else 0),
                      decode=decode_settings(config, task),
                      slots=decode_slots(config), regenerate=config.algo.stale_groups == 'regenerate',
                      priming=config.algo.max_lag)


def empty_pool(settings: PoolSettings | None, task: Task, prompt_count: int, architecture):
  """The pool holding no groups yet (None on-policy). A jittable task's answers get arrays in it,
  shaped like one batch's; `architecture` (the model's) sizes recorded routes."""
  if settings is None:
    return None
  answers = (jax.eval_shape(lambda key: task.prompts(key, 0, prompt_count), jax.random.PRNGKey(0)).answers
             if task.jittable else None)
  bucket = task.vision_bucket
  vision = None if bucket is None else bucket.shapes(prompt_count, task.prompt_length, architecture.vision)
  return sampler_pool.empty_pool(settings.entries, settings.group_size, task.prompt_length, settings.decode, answers,
                                 architecture, vision)


def rollout_mode(config) -> type[RolloutMode]:
  """The run's rollout mode (rl/modes.py), chosen here once: agents acting for a task whose kind
  acts, the pool with algo.max_lag > 0, else group sampling."""
  if config.task.kind.acts:
    return Acting
  return PoolSampling if config.algo.max_lag else GroupSampling


def build_model_scores(config, mesh: jax.sharding.Mesh, task: Task) -> ModelScores:
  """The run's models that score completions in the mesh (its reward terms of kind reward_model and
  judge), loaded over `mesh` and checked against the task (a dataset task: its tokenizer, its decode
  and its rows); none without such terms."""
  terms = tuple(term for term in config.rewards if isinstance(term, ModelTerm))
  if not terms:
    return ModelScores.none()
  return ModelScores.load(terms, mesh, task, task.prompt_length + config.rollout.max_new_tokens, config.model.options)


def check_teacher_architecture(path: str, architecture, vocab_size: int, student, mesh: jax.sharding.Mesh) -> None:
  """The checks of a teacher that its architecture alone answers, each one line naming
  algo.teacher: a language model, not a reward model; an embedding table holding every id the
  student samples (`vocab_size`, its task's tokenizer's); for a vision-language student a tower
  reading images as the student's does; heads that divide over the mesh's tensor axis."""
  if architecture.num_labels:
    raise UserError(f'algo.teacher: {path} is a reward model (a sequence classifier); a teacher is a language model '
                    'whose log-probs the student learns from')
  if architecture.vocab_size < vocab_size:
    raise UserError(f'algo.teacher: {path} has {architecture.vocab_size} embedding rows, fewer than the student\'s '
                    f'{vocab_size} token ids (its tokenizer\'s): the teacher cannot score every sampled token')
  if student.vision is not None:
    mine, theirs = student.vision, architecture.vision
    if theirs is None:
      raise UserError(f'algo.teacher: {path} has no vision tower, and the student\'s prompts show images: the teacher '
                      'must see them too (a vision-language teacher)')
    reads = ('patch_size', 'temporal_patch_size', 'spatial_merge_size', 'image_token_id')
    differing = [name for name in reads if getattr(mine, name) != getattr(theirs, name)]
    if differing:
      raise UserError(f'algo.teacher: {path} reads images otherwise than the student ({", ".join(differing)} '
                      'differ): its image tokens would not be the student\'s')
  check_mesh(architecture, mesh)


def check_teacher(config, mesh: jax.sharding.Mesh, task: Task, student) -> tuple:
  """check_teacher_architecture, then its tokenizer: the student's (the same size, every id the
  same string), found beside the checkpoint or from its training run. `student`: the student's
  model. Nothing is compiled and no weights are read. -> (the teacher's architecture, its
  training run's config or None), restore.checkpoint_architecture's."""
  path = config.algo.teacher
  architecture, run = restore.checkpoint_architecture(path, 'algo.teacher')
  check_teacher_architecture(path, architecture, task.vocab_size, student.config, mesh)
  teacher_tokenizer = restore.checkpoint_tokenizer(path, run)
  if teacher_tokenizer is None:
    raise UserError(f'algo.teacher: {path} has no tokenizer (tokenizer.json or vocab.json beside it, or its run\'s) to '
                    'check against the student\'s')
  difference = tokenizer_difference(task.tokenizer, teacher_tokenizer)
  if difference is not None:
    raise UserError(f'algo.teacher: {path} has another tokenizer than the student ({difference}); on-policy '
                    'distillation scores the student\'s token ids under the teacher, so they must mean the same')
  return architecture, run


def build_teacher(config, mesh: jax.sharding.Mesh, task: Task, student) -> Teacher | None:
  """The run's teacher (algo.teacher; None without one), checked against the task and the student
  (check_teacher) before its weights are read, then resident over `mesh` in the student's compute
  dtype, laid out like the student, computing as it does (rl/model_scores.scoring_options)."""
  if config.algo.teacher is None:
    return None
  architecture, run = check_teacher(config, mesh, task, student)
  options = scoring_options(config.model.options, config.model.options.dtype)
  graphdef, params = restore.load_checkpoint_model(config.algo.teacher, mesh, options, architecture, run)
  return Teacher(graphdef=graphdef, params=params, path=config.algo.teacher)


def frozen_parameters(config, architecture) -> tuple[str, ...]:
  """The parameters the run's optimizer leaves as they are (rl/optimizer.freezing): a frozen vision
  tower; DeepSeekMoE's choice bias, which no gradient reaches and which RL keeps as the checkpoint
  has it (no weight decay either), as verl's and slime's Megatron recipes do (bias update rate 0)."""
  return ((('visual',) if config.model.options.freeze_vision else ())
          + (('layers/router_bias',) if architecture.router_scoring == 'sigmoid' else ()))


def build_rl_step(config, model, mesh: jax.sharding.Mesh, task: Task, params=None, resident: bool = True,
                  sampler_devices=None, model_scores: ModelScores | None = None) -> RLStep:
  """The run's RL step for `model` (its parameters laid out over `mesh`; `params`: their state,
  or abstract arrays with their shardings, as the plan compiles them; None: the model's own).
  model_scores: the run's scoring models (build_model_scores, which a run without them need not call).
  A host-scored task is adapted to the mesh (rl/host_task.py). resident False: the sampler decodes
  in the training layout instead of its own (bench/rollout_layout.py compares the two).
  sampler_devices: with rollout.devices, the sampler's own devices (default: the last
  rollout.devices of jax.devices(), which `mesh` must leave out)."""
  graphdef, own = nnx.split(model)
  params = own if params is None else params
  require(config.algo.routing_replay == 'none' or model.config.num_sparse_layers, 'algo.routing_replay',
          f"'{config.algo.routing_replay}' replays the experts of a mixture of experts; this model "
          f'({model.config.model_type}) is dense: set algo.routing_replay=none')
  require(not config.model.options.freeze_vision or model.config.vision is not None, 'model.freeze_vision',
          f'freezes a vision-language model\'s vision tower; this model ({model.config.model_type}) has none: '
          'leave it false')
  optimizer, schedule = config.optim.build(total_updates(config), frozen=frozen_parameters(config, model.config))
  if config.rollout.devices and sampler_devices is None:
    sampler_devices = split_devices(jax.devices(), config.rollout.devices)[1]
  layout = (rollout_layout(model, mesh, config.rollout.tensor, sampler_devices, weights=config.rollout.weights,
                           context=config.rollout.prefill_context) if resident else None)
  mode = rollout_mode(config)
  settings = pool_settings(config, task)
  episodes = None
  if config.task.kind.acts:  # the agents package only for an acting run
    from grpo_jax.agents.stage import EpisodeRows
    episodes = EpisodeRows.of(config)
  sampling = Sampling(graphdef=graphdef, task=mode.step_task(task, mesh), group_size=config.algo.group_size,
                      prompts_per_step=config.rollout.prompts_per_step,
                      decode=decode_settings(config, task),
                      slots=decode_slots(config), layout=layout, mesh=mesh, rollout=config.rollout,
                      pool=settings, episodes=episodes,
                      model_scores=build_model_scores(config, mesh, task) if model_scores is None else model_scores)
  pool = empty_pool(settings, task, config.rollout.prompts_per_step, model.config)
  trained, frozen = lora.split_trainable(params)  # with LoRA the optimizer sees the adapters only
  shardings = train_state_shardings(trained, optimizer, pool, frozen)
  if sampling.split and pool is not None:  # the pool and the groups ready on the sampler
    pool = sampler_pool.empty_pipeline(graphdef, params, pool, layout, settings)
    shardings = shardings.replace(pool=pool_shardings(pool, layout.mesh))
  return RLStep(graphdef, mode, sampling, config.algo, optimizer, schedule, shardings,
                sequence_length=task.prompt_length + config.rollout.max_new_tokens, empty_pool=pool)


def build_evaluator(config, task, graphdef, params):
  """The `eval` section's evaluator for `task`: answers sampled and checked for a dataset task
  (evaluation.Evaluator), whole episodes for an agent task (agents/evaluation.py)."""
  if config.task.kind.acts:
    from grpo_jax.agents.evaluation import EpisodeEvaluator
    return EpisodeEvaluator(config, task, graphdef, params)
  from grpo_jax.evaluation import Evaluator
  return Evaluator(config, task, graphdef, params)
