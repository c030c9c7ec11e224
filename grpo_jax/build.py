"""A run's parts built from its Config, in one place for training (train.py), the plan
(plan/programs.py), evaluation (eval.py) and benchmarks: the task, by name from data/task.py's registry,
the RL step with its optimizer and schedule (the optim section's), the train state's shardings and
the sampler's layout, and the evaluator of the task's held-out problems."""

import jax
from flax import nnx

from grpo_jax.data.task import TASKS, Task
from grpo_jax.model import lora
from grpo_jax.rl.host_task import HostTask
from grpo_jax.rl.state import train_state_shardings
from grpo_jax.rl.step import RLStep
from grpo_jax.sampler import pool as sampler_pool
from grpo_jax.sampler.layout import rollout_layout, split_devices


def build_task(config) -> Task:
  """The run's task from its `task` section (config: a config.Config)."""
  return TASKS[config.task.name].build(config)


def total_updates(config) -> int:
  """Optimizer updates in the whole run: the learning-rate schedule's length."""
  return config.train.steps * config.algo.ppo_epochs * config.algo.num_minibatches


def empty_pool(config, task: Task):
  """The run's partial-rollout pool (algo.max_lag > 0, sampler/pool.py) holding no groups yet;
  None on-policy. A jittable task's answers get arrays in it, shaped like one batch's."""
  if not config.algo.max_lag:
    return None
  count = config.rollout.prompts_per_step
  answers = (jax.eval_shape(lambda key: task.prompts(key, 0, count), jax.random.PRNGKey(0)).answers
             if task.jittable else None)
  # Split devices sample one version behind the trainer: the pool itself holds one lag fewer.
  lags = config.algo.max_lag - (1 if config.rollout.devices else 0)
  return sampler_pool.empty_pool((lags + 1) * count, config.algo.group_size, task.prompt_length,
                            config.rollout.decode_settings(task.stop_token_ids, task.pad_id), answers)


def build_rl_step(config, model, mesh: jax.sharding.Mesh, task: Task, params=None, resident: bool = True,
                  sampler_devices=None) -> RLStep:
  """The run's RL step for `model` (its parameters laid out over `mesh`; `params`: their state,
  or abstract arrays with their shardings, as the plan compiles them; None: the model's own).
  A host-scored task is adapted to the mesh (rl/host_task.py). resident False: the sampler decodes
  in the training layout instead of its own (bench/rollout_layout.py compares the two).
  sampler_devices: with rollout.devices, the sampler's own devices (default: the last
  rollout.devices of jax.devices(), which `mesh` must leave out)."""
  graphdef, own = nnx.split(model)
  params = own if params is None else params
  optimizer, schedule = config.optim.build(total_updates(config))
  if config.rollout.devices and sampler_devices is None:
    sampler_devices = split_devices(jax.devices(), config.rollout.devices)[1]
  layout = rollout_layout(model, mesh, config.rollout.tensor, sampler_devices) if resident else None
  # A host-scored task is adapted to the mesh; an agent task's acting stage places its own arrays.
  acts = config.task.kind.acts  # the acting rollout mode: episodes on the inference server
  step_task = task if task.jittable or acts else HostTask(task, mesh)
  pool = empty_pool(config, task)
  trained, frozen = lora.split_trainable(params)  # with LoRA the optimizer sees the adapters only
  return RLStep(graphdef, step_task, config.rollout, config.algo, optimizer, schedule,
                train_state_shardings(trained, optimizer, pool, frozen), layout=layout, empty_pool=pool, params=params,
                acts=acts)


def build_evaluator(config, task, graphdef, params):
  """The `eval` section's evaluator for `task`: answers sampled and checked for a dataset task
  (evaluation.Evaluator), whole episodes for an agent task (agents/evaluation.py)."""
  if config.task.kind.acts:
    from grpo_jax.agents.evaluation import EpisodeEvaluator
    return EpisodeEvaluator(config, task, graphdef, params)
  from grpo_jax.evaluation import Evaluator
  return Evaluator(config, task, graphdef, params)
