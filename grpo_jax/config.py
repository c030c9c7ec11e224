"""Run configuration: typed, frozen dataclasses loaded from YAML with `--set a.b=c` overrides.

Every field has a default and a one-line comment. Loading checks every key and type and reports the
first mistake in one sentence naming the key, e.g. `config key 'mesh.tensor' expects int, got 'two'`.
"""

import dataclasses
import datetime
import os
import types
import typing
from typing import Literal

import yaml

from grpo_jax.errors import UserError
from grpo_jax.model.config import Qwen2Config
from grpo_jax.model.qwen2 import AttentionImplementation
from grpo_jax.model.sharding import MeshConfig

DType = Literal['float32', 'bfloat16']


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Which model to load and how to run it."""

  path: str | None = None  # Hugging Face dir or grpo_jax checkpoint; None: random init from `architecture`
  architecture: Qwen2Config = Qwen2Config()  # used only when `path` is None
  dtype: DType = 'float32'  # compute dtype of activations and matmuls
  param_dtype: DType = 'float32'  # storage dtype of parameters (fp32 master weights with bf16 compute)
  remat: Literal['none', 'full', 'dots', 'dots_no_batch'] = 'none'  # per-layer rematerialisation
  scan_layers: bool = True  # one lax.scan over layers: compile time independent of depth
  # Training / scoring attention: dense [T, T] scores; chunked (attention_chunk queries at a time,
  # rematerialised: O(chunk x T) memory, for long completions); cudnn (NVIDIA GPUs).
  attention: AttentionImplementation = 'dense'
  attention_chunk: int = 512  # queries per chunk with attention: chunked


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """Identity and reproducibility of a run."""

  name: str = 'run'  # used in the default workdir runs/<name>-<timestamp>
  seed: int = 0  # seeds parameter init, sampling and data order
  workdir: str | None = None  # output directory; None: runs/<name>-<timestamp>


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  """How the policy samples completions (the sampler's settings)."""

  prompts_per_step: int = 16  # P: prompts per RL step; a step scores P * G completions
  max_new_tokens: int = 8  # N_max: completion budget; longer answers end with finish reason 'length'
  temperature: float = 1.0  # T: sampling temperature, also applied to the trainer's log-probs
  top_k: int = 0  # 0 keeps every token
  top_p: float = 1.0  # 1.0 keeps every token


@dataclasses.dataclass(frozen=True)
class AlgoConfig:
  """The GRPO family (rl/algo.py). Symbols follow the papers cited there."""

  group_size: int = 8  # G: completions per prompt
  advantage: Literal['grpo', 'drgrpo', 'rloo'] = 'grpo'  # (r - mean_G)/(std_G + eps) | r - mean_G | leave-one-out
  advantage_epsilon: float = 1e-6  # eps in the GRPO advantage denominator
  epsilon_low: float = 0.2  # eps_low: ratio clipped below at 1 - eps_low
  epsilon_high: float = 0.2  # eps_high: ratio clipped above at 1 + eps_high (DAPO clip-higher: 0.28)
  dual_clip: float = 0.0  # c > 1 bounds the surrogate below by c * A for A < 0; 0 disables
  importance_ratio: Literal['token', 'sequence'] = 'token'  # 'sequence' is GSPO's s_i (use eps ~ 3e-4)
  kl_beta: float = 0.0  # beta: weight of KL(pi || pi_ref); 0 keeps no reference parameters
  kl_estimator: Literal['k1', 'k2', 'k3'] = 'k3'  # per-token KL estimator (Schulman 2020)
  entropy_coef: float = 0.0  # weight of the entropy bonus (subtracted from the loss)
  loss_aggregation: Literal['token-mean', 'seq-mean-token-mean', 'seq-mean-token-sum',
                            'seq-mean-token-sum-norm'] = 'token-mean'  # see algo.aggregation_weights
  ppo_epochs: int = 1  # mu: passes over each batch; > 1 uses pi_old log-probs and clipping
  num_minibatches: int = 1  # optimizer steps per pass; P * G must divide evenly
  micro_batch_size: int = 0  # rows per gradient-accumulation chunk (lax.scan); 0: whole mini-batch
  tis_cap: float = 0.0  # C: truncated importance weight min(pi_old / pi_sampler, C); 0 disables
  logprob_implementation: Literal['auto', 'pallas', 'xla_chunked', 'naive'] = 'auto'  # ops.token_logprobs


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  """AdamW with warmup then cosine decay or constant; counted in optimizer updates."""

  learning_rate: float = 1e-6  # peak learning rate
  schedule: Literal['cosine', 'constant'] = 'constant'  # after warmup
  warmup_steps: int = 0  # linear warmup from 0 over this many optimizer updates
  decay_steps: int = 0  # cosine: updates from the peak to min_lr_ratio * peak; 0: to the run's end
  min_lr_ratio: float = 0.1  # cosine floor as a fraction of the peak
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8
  weight_decay: float = 0.0
  max_grad_norm: float = 1.0  # global-norm clipping; 0 disables


@dataclasses.dataclass(frozen=True)
class TaskConfig:
  """What the policy is asked and how it is scored (data/arith.py, data/math_task.py)."""

  name: Literal['arith', 'math'] = 'arith'  # built-in arithmetic (reward in JAX) | math dataset (host reward)
  max_operand: int = 9  # arith: operands drawn from [0, max_operand]
  operators: str = '+'  # arith: operators drawn uniformly from these characters (+ - *)
  source: str | None = None  # math: .jsonl/.json/.parquet file, hf:<name>[:<config>] or tfds:<name>
  split: str = 'train'  # math: dataset split
  prompt_field: str = 'prompt'  # math: field holding the question
  answer_field: str = 'answer'  # math: field holding the reference answer
  prompt_template: str = '{prompt}'  # math: format string; chat models go through the chat template
  chat_template: bool = True  # math: apply the tokenizer's chat template when it has one
  max_prompt_tokens: int = 512  # math: prompts are left-padded to this; longer prompts are skipped
  reward_workers: int = 4  # math: processes verifying answers with math-verify


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Loop length, checkpointing and guards."""

  steps: int = 100  # RL steps (one rollout + update each)
  steps_per_call: int = 1  # K: RL steps inside one jitted call (jittable rewards only)
  checkpoint_every: int = 50  # RL steps between checkpoints (also saved at the end); 0: only at the end
  max_to_keep: int = 3  # checkpoints kept in workdir/checkpoints
  max_consecutive_skips: int = 5  # stop after this many updates in a row with non-finite loss or grads
  progress: bool = True  # live progress bar on stderr


@dataclasses.dataclass(frozen=True)
class Config:
  run: RunConfig = RunConfig()
  model: ModelConfig = ModelConfig()
  mesh: MeshConfig = MeshConfig()
  task: TaskConfig = TaskConfig()
  rollout: RolloutConfig = RolloutConfig()
  algo: AlgoConfig = AlgoConfig()
  optim: OptimConfig = OptimConfig()
  train: TrainConfig = TrainConfig()


# ---- loading ----

def _type_name(kind) -> str:
  if typing.get_origin(kind) is Literal:
    return ' | '.join(repr(v) for v in typing.get_args(kind))
  if isinstance(kind, type):
    return kind.__name__
  return str(kind).replace('typing.', '')


def _coerce(kind, value, key: str):
  """Checks `value` against the annotation `kind`; returns it converted (lists -> tuples, ...)."""
  origin = typing.get_origin(kind)
  if origin in (typing.Union, types.UnionType):
    options = typing.get_args(kind)
    if value is None and type(None) in options:
      return None
    errors = []
    for option in options:
      if option is type(None):
        continue
      try:
        return _coerce(option, value, key)
      except UserError as error:
        errors.append(error)
    raise UserError(f'config key {key!r} expects {_type_name(kind)}, got {value!r}')
  if origin is Literal:
    if value not in typing.get_args(kind):
      raise UserError(f'config key {key!r} must be one of {_type_name(kind)}, got {value!r}')
    return value
  if origin is tuple:
    if not isinstance(value, (list, tuple)):
      raise UserError(f'config key {key!r} expects a list, got {value!r}')
    (item,) = typing.get_args(kind)[:1]
    return tuple(_coerce(item, v, f'{key}[{i}]') for i, v in enumerate(value))
  if dataclasses.is_dataclass(kind):
    if not isinstance(value, dict):
      raise UserError(f'config key {key!r} expects a mapping of fields, got {value!r}')
    return _build(kind, value, key + '.')
  if kind is bool:
    if not isinstance(value, bool):
      raise UserError(f'config key {key!r} expects true or false, got {value!r}')
    return value
  if kind is int:
    if isinstance(value, bool) or not isinstance(value, int):
      raise UserError(f'config key {key!r} expects int, got {value!r}')
    return value
  if kind is float:
    if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
      try:
        value = float(value)
      except ValueError:
        pass
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise UserError(f'config key {key!r} expects float, got {value!r}')
    return float(value)
  if kind is str:
    if not isinstance(value, str):
      raise UserError(f'config key {key!r} expects a string, got {value!r}')
    return value
  raise TypeError(f'unsupported annotation {kind} for config key {key!r}')


def _build(cls, data: dict, prefix: str = ''):
  hints = typing.get_type_hints(cls)
  names = [field.name for field in dataclasses.fields(cls)]
  for key in data:
    if key not in names:
      raise UserError(f'unknown config key {prefix + str(key)!r} (valid keys here: {", ".join(names)})')
  values = {name: _coerce(hints[name], data[name], prefix + name) for name in names if name in data}
  try:
    return cls(**values)
  except UserError as error:
    raise UserError(f'config section {prefix.rstrip(".") or "top level"}: {error}') from None


def _apply_override(data: dict, assignment: str) -> None:
  if '=' not in assignment:
    raise UserError(f'--set {assignment!r} is not of the form key.path=value')
  key, raw = assignment.split('=', 1)
  parts = key.strip().split('.')
  node = data
  for part in parts[:-1]:
    child = node.setdefault(part, {})
    if not isinstance(child, dict):
      raise UserError(f'--set {key}: {part!r} is a value, not a section')
    node = child
  node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else ''


def load_config(path: str | None, overrides: typing.Sequence[str] = ()) -> Config:
  """Reads a YAML file (or only defaults when `path` is None) and applies `--set` overrides."""
  data = {}
  if path is not None:
    if not os.path.isfile(path):
      raise UserError(f'config file {path} not found')
    try:
      with open(path) as f:
        data = yaml.safe_load(f) or {}
    except yaml.YAMLError as error:
      raise UserError(f'config file {path} is not valid YAML: {str(error).splitlines()[0]}') from None
    if not isinstance(data, dict):
      raise UserError(f'config file {path} must hold a mapping of sections, got {type(data).__name__}')
  for assignment in overrides:
    _apply_override(data, assignment)
  return _build(Config, data)


def to_dict(config) -> dict:
  """Plain nested dict (tuples as lists), the form written to config.yaml."""
  def plain(value):
    if isinstance(value, (tuple, list)):
      return [plain(v) for v in value]
    if isinstance(value, dict):
      return {k: plain(v) for k, v in value.items()}
    return value
  return plain(dataclasses.asdict(config))


def to_yaml(config) -> str:
  return yaml.safe_dump(to_dict(config), sort_keys=False)


def resolve_workdir(config: Config, config_path: str | None, workdir: str | None) -> str:
  """--workdir, else run.workdir, else runs/<name>-<timestamp> (name defaults to the file's stem)."""
  chosen = workdir or config.run.workdir
  if chosen:
    return chosen
  name = config.run.name
  if name == RunConfig.name and config_path:
    name = os.path.splitext(os.path.basename(config_path))[0]
  stamp = datetime.datetime.now().strftime('%Y%m%d-%H%M%S')
  return os.path.join('runs', f'{name}-{stamp}')


def validate(config: Config) -> Config:
  """Cross-field checks that a single key's type cannot express; one sentence per mistake."""
  algo, rollout, train = config.algo, config.rollout, config.train

  def require(condition: bool, message: str):
    if not condition:
      raise UserError(message)

  require(config.model.attention_chunk >= 1, f'model.attention_chunk must be >= 1, got {config.model.attention_chunk}')
  require(algo.group_size >= 2, f'algo.group_size must be >= 2 (a group needs a baseline), got {algo.group_size}')
  require(rollout.prompts_per_step >= 1, f'rollout.prompts_per_step must be >= 1, got {rollout.prompts_per_step}')
  require(rollout.max_new_tokens >= 1, f'rollout.max_new_tokens must be >= 1, got {rollout.max_new_tokens}')
  require(rollout.temperature > 0, f'rollout.temperature must be > 0, got {rollout.temperature}')
  require(rollout.top_k >= 0, f'rollout.top_k must be >= 0, got {rollout.top_k}')
  require(0 < rollout.top_p <= 1, f'rollout.top_p must be in (0, 1], got {rollout.top_p}')
  rows = rollout.prompts_per_step * algo.group_size
  require(algo.num_minibatches >= 1 and rows % algo.num_minibatches == 0,
          f'algo.num_minibatches ({algo.num_minibatches}) must divide prompts_per_step * group_size ({rows})')
  minibatch = rows // algo.num_minibatches
  require(algo.micro_batch_size >= 0 and (algo.micro_batch_size == 0 or minibatch % algo.micro_batch_size == 0),
          f'algo.micro_batch_size ({algo.micro_batch_size}) must divide the mini-batch of {minibatch} rows')
  require(algo.ppo_epochs >= 1, f'algo.ppo_epochs must be >= 1, got {algo.ppo_epochs}')
  require(0 <= algo.epsilon_low < 1, f'algo.epsilon_low must be in [0, 1), got {algo.epsilon_low}')
  require(algo.epsilon_high >= 0, f'algo.epsilon_high must be >= 0, got {algo.epsilon_high}')
  require(algo.dual_clip == 0 or algo.dual_clip > 1, f'algo.dual_clip must be 0 (off) or > 1, got {algo.dual_clip}')
  require(algo.kl_beta >= 0, f'algo.kl_beta must be >= 0, got {algo.kl_beta}')
  require(algo.tis_cap == 0 or algo.tis_cap >= 1, f'algo.tis_cap must be 0 (off) or >= 1, got {algo.tis_cap}')
  require(config.optim.learning_rate > 0, f'optim.learning_rate must be > 0, got {config.optim.learning_rate}')
  require(train.steps >= 1, f'train.steps must be >= 1, got {train.steps}')
  require(train.steps_per_call >= 1, f'train.steps_per_call must be >= 1, got {train.steps_per_call}')
  require(train.checkpoint_every >= 0, f'train.checkpoint_every must be >= 0, got {train.checkpoint_every}')
  require(train.checkpoint_every % train.steps_per_call == 0,
          f'train.checkpoint_every ({train.checkpoint_every}) must be a multiple of train.steps_per_call '
          f'({train.steps_per_call}): checkpoints are taken between jitted calls')
  require(train.max_to_keep >= 1, f'train.max_to_keep must be >= 1, got {train.max_to_keep}')
  require(train.max_consecutive_skips >= 1, f'train.max_consecutive_skips must be >= 1, got {train.max_consecutive_skips}')
  require(config.task.reward_workers >= 1, f'task.reward_workers must be >= 1, got {config.task.reward_workers}')
  require(config.task.max_prompt_tokens >= 1, f'task.max_prompt_tokens must be >= 1, got {config.task.max_prompt_tokens}')
  require(train.steps_per_call == 1 or config.task.name == 'arith',
          f'train.steps_per_call > 1 needs a reward computed in JAX; task {config.task.name!r} scores on the host')
  return config
