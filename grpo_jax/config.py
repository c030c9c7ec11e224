"""Run configuration: typed, frozen dataclasses loaded from YAML with `--set a.b=c` overrides.

Every field has a default and a one-line comment. Loading checks every key and type and reports the
first mistake in one sentence naming the key, e.g. `config key 'mesh.tensor' expects int, got 'two'`.
"""

import contextlib
import dataclasses
import datetime
import math
import os
import types
import typing
from typing import Literal

import yaml

from grpo_jax.data.adapters import DatasetFormat
from grpo_jax.data.arith import check_arguments as check_arith_arguments
from grpo_jax.data.reward_terms import RewardTerm
from grpo_jax.distributed import DistributedConfig
from grpo_jax.errors import FieldError, UserError, read_text, require
from grpo_jax.model.config import Qwen2Config
from grpo_jax.model.qwen2 import DType, ModelOptions
from grpo_jax.model.sharding import MeshConfig
from grpo_jax.ops import LogprobImplementation
from grpo_jax.rl.algo import Advantage, KLEstimator, LossAggregation
from grpo_jax.sampler.sampling import SamplingConfig


@contextlib.contextmanager
def _section(name: str):
  """Names the fields of a section's own checks as the user writes them: `algo.group_size`."""
  try:
    yield
  except FieldError as error:
    raise error.renamed(f'{name}.{error.field}') from None


@dataclasses.dataclass(frozen=True)
class ModelConfig(ModelOptions):
  """Which model to load, and how to run it (the ModelOptions fields: dtype, param_dtype, remat,
  scan_layers, attention, attention_chunk; see model/qwen2.py)."""

  # Training keeps master weights in float32 or bfloat16 (float16 storage is for conversion only).
  param_dtype: DType = 'float32'
  path: str | None = None  # Hugging Face dir or grpo_jax checkpoint; None: random init from `architecture`
  architecture: Qwen2Config = Qwen2Config()  # used only when `path` is None

  def __post_init__(self):
    with _section('model'):
      super().__post_init__()


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """Identity and reproducibility of a run."""

  name: str = 'run'  # used in the default workdir runs/<name>-<timestamp>
  seed: int = 0  # >= 0; seeds parameter init, sampling and data order
  workdir: str | None = None  # output directory; None: runs/<name>-<timestamp>

  def __post_init__(self):
    with _section('run'):
      require(self.seed >= 0, 'seed', f'must be >= 0, got {self.seed}')


@dataclasses.dataclass(frozen=True)
class RolloutConfig(SamplingConfig):
  """How the policy samples completions: the SamplingConfig fields (greedy, temperature T, which
  the trainer's log-probs also use, top_k, top_p) and the step's shape."""

  prompts_per_step: int = 16  # P: prompts per RL step; a step scores P * G completions
  max_new_tokens: int = 8  # N_max: completion budget; longer answers end with finish reason 'length'
  # B: decode slots (continuous batching, sampler/rollout.py); a slot freed by a finished answer
  # takes the next waiting request. 0: one slot per completion (P * G); fewer bounds the KV cache.
  slots: int = 0
  # t: devices per tensor-parallel group of the sampler's own layout (sampler/layout.py): the
  # weights are resident, split over t devices and replicated over the n / t groups. 0: the largest
  # t dividing the KV heads and the devices, within one host on GPUs (1 on CPUs).
  tensor: int = 0

  def __post_init__(self):
    with _section('rollout'):
      super().__post_init__()
      require(self.tensor >= 0, 'tensor', f'must be >= 0 (0: chosen for the model and devices), got {self.tensor}')
      require(self.prompts_per_step >= 1, 'prompts_per_step', f'must be >= 1, got {self.prompts_per_step}')
      require(self.max_new_tokens >= 1, 'max_new_tokens', f'must be >= 1, got {self.max_new_tokens}')
      require(self.slots >= 0, 'slots', f'must be >= 0 (0: one per completion), got {self.slots}')


@dataclasses.dataclass(frozen=True)
class AlgoConfig:
  """The GRPO family (rl/algo.py). Symbols follow the papers cited there."""

  group_size: int = 8  # G: completions per prompt
  advantage: Advantage = 'grpo'  # (r - mean_G)/(std_G + eps) | r - mean_G | leave-one-out
  advantage_epsilon: float = 1e-6  # >= 0: eps in the GRPO advantage denominator
  epsilon_low: float = 0.2  # eps_low: ratio clipped below at 1 - eps_low
  epsilon_high: float = 0.2  # eps_high: ratio clipped above at 1 + eps_high (DAPO clip-higher: 0.28)
  dual_clip: float = 0.0  # c > 1 bounds the surrogate below by c * A for A < 0; 0 disables
  importance_ratio: Literal['token', 'sequence'] = 'token'  # 'sequence' is GSPO's s_i (use eps ~ 3e-4)
  kl_beta: float = 0.0  # beta: weight of KL(pi || pi_ref); 0 keeps no reference parameters
  kl_estimator: KLEstimator = 'k3'  # per-token KL estimator (Schulman 2020)
  entropy_coef: float = 0.0  # >= 0: weight of the entropy bonus (subtracted from the loss)
  loss_aggregation: LossAggregation = 'token-mean'  # see algo.aggregation_weights
  ppo_epochs: int = 1  # mu: passes over each batch; > 1 uses pi_old log-probs and clipping
  num_minibatches: int = 1  # optimizer steps per pass; P * G must divide evenly
  micro_batch_size: int = 0  # rows per gradient-accumulation chunk (lax.scan); 0: whole mini-batch
  # Packing (rl/packing.py): each mini-batch's sequences (prompt + completion, padding dropped) are
  # packed into rows of pack_length tokens on the devices, and the pi_old / pi_ref passes and the loss
  # run over packed rows, in micro-batches as many as the real tokens need. Same loss as padded rows.
  packing: bool = False
  pack_length: int = 0  # L: tokens per packed row, >= prompt length + max_new_tokens; 0: exactly that
  # Packed rows per micro-batch on each batch shard (data x fsdp): micro_batch_tokens // pack_length
  # (bounds the activation memory by tokens, whatever the lengths); 0: as micro_batch_size rows would.
  micro_batch_tokens: int = 0
  tis_cap: float = 0.0  # C: truncated importance weight min(pi_old / pi_sampler, C); 0 disables
  logprob_implementation: LogprobImplementation = 'auto'  # ops.token_logprobs
  # DAPO dynamic sampling: groups whose G rewards are all equal are dropped and further rounds of P
  # prompts are sampled until P informative groups are found or max_sampling_rounds rounds are
  # spent; then the step trains on the informative groups found, filled up with the latest dropped
  # (zero-advantage) groups. Every prompt sampled counts as consumed.
  dynamic_sampling: bool = False
  max_sampling_rounds: int = 4  # >= 1: rounds of P prompts per step at most (dynamic_sampling)

  def __post_init__(self):
    with _section('algo'):
      require(self.advantage_epsilon >= 0, 'advantage_epsilon', f'must be >= 0, got {self.advantage_epsilon}')
      require(self.entropy_coef >= 0, 'entropy_coef', f'must be >= 0 (a bonus), got {self.entropy_coef}')
      require(self.group_size >= 2, 'group_size', f'must be >= 2 (a group needs a baseline), got {self.group_size}')
      require(self.num_minibatches >= 1, 'num_minibatches', f'must be >= 1, got {self.num_minibatches}')
      require(self.micro_batch_size >= 0, 'micro_batch_size', f'must be >= 0, got {self.micro_batch_size}')
      require(self.pack_length >= 0, 'pack_length', f'must be >= 0, got {self.pack_length}')
      require(self.micro_batch_tokens >= 0, 'micro_batch_tokens', f'must be >= 0, got {self.micro_batch_tokens}')
      for name in ('pack_length', 'micro_batch_tokens'):
        require(self.packing or not getattr(self, name), name,
                'applies to packed rows: set algo.packing=true (padded rows use micro_batch_size)')
      require(not (self.pack_length and self.micro_batch_tokens) or self.micro_batch_tokens >= self.pack_length,
              'micro_batch_tokens', f'({self.micro_batch_tokens}) must hold at least one packed row of '
              f'pack_length = {self.pack_length} tokens')
      require(self.ppo_epochs >= 1, 'ppo_epochs', f'must be >= 1, got {self.ppo_epochs}')
      require(self.max_sampling_rounds >= 1, 'max_sampling_rounds', f'must be >= 1, got {self.max_sampling_rounds}')
      require(0 <= self.epsilon_low < 1, 'epsilon_low', f'must be in [0, 1), got {self.epsilon_low}')
      require(self.epsilon_high >= 0, 'epsilon_high', f'must be >= 0, got {self.epsilon_high}')
      require(self.dual_clip == 0 or self.dual_clip > 1, 'dual_clip', f'must be 0 (off) or > 1, got {self.dual_clip}')
      require(self.kl_beta >= 0, 'kl_beta', f'must be >= 0, got {self.kl_beta}')
      require(self.tis_cap == 0 or self.tis_cap >= 1, 'tis_cap', f'must be 0 (off) or >= 1, got {self.tis_cap}')


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

  def __post_init__(self):
    with _section('optim'):
      require(self.learning_rate > 0, 'learning_rate', f'must be > 0, got {self.learning_rate}')
      require(self.warmup_steps >= 0, 'warmup_steps', f'must be >= 0, got {self.warmup_steps}')
      require(self.decay_steps >= 0, 'decay_steps', f'must be >= 0, got {self.decay_steps}')
      require(0 <= self.min_lr_ratio <= 1, 'min_lr_ratio', f'must be in [0, 1], got {self.min_lr_ratio}')
      require(0 <= self.b1 < 1, 'b1', f'must be in [0, 1), got {self.b1}')
      require(0 <= self.b2 < 1, 'b2', f'must be in [0, 1), got {self.b2}')
      require(self.eps > 0, 'eps', f'must be > 0, got {self.eps}')
      require(self.weight_decay >= 0, 'weight_decay', f'must be >= 0, got {self.weight_decay}')
      require(self.max_grad_norm >= 0, 'max_grad_norm', f'must be >= 0 (0 disables clipping), got {self.max_grad_norm}')


@dataclasses.dataclass(frozen=True)
class DataSource:
  """One more dataset a math task trains on (task.mix), read like task.source."""

  source: str = ''  # .jsonl/.json/.parquet file, hf:<name>[:<config>] or tfds:<name>
  split: str = 'train'
  format: DatasetFormat = 'custom'  # dataset schema (data/adapters.py)
  prompt_field: str = 'prompt'  # format custom: field holding the question
  answer_field: str = 'answer'  # format custom: field holding the reference answer

  def __post_init__(self):
    require(bool(self.source), 'source', 'must name a dataset')


@dataclasses.dataclass(frozen=True)
class TaskConfig:
  """What the policy is asked and how it is scored (data/arith.py, data/math_task.py)."""

  name: Literal['arith', 'math'] = 'arith'  # built-in arithmetic (reward in JAX) | math dataset (host reward)
  max_operand: int = 9  # arith: operands drawn from [0, max_operand]
  operators: str = '+'  # arith: operators drawn uniformly from these characters (+ - *)
  source: str | None = None  # math: .jsonl/.json/.parquet file, hf:<name>[:<config>] or tfds:<name>
  split: str = 'train'  # math: dataset split
  format: DatasetFormat = 'custom'  # math: dataset schema (data/adapters.py): custom uses the two fields below
  prompt_field: str = 'prompt'  # math, format custom: field holding the question (or chat messages)
  answer_field: str = 'answer'  # math, format custom: field holding the reference answer
  mix: tuple[DataSource, ...] = ()  # math: more datasets, shuffled into one stream with task.source
  prompt_template: str = '{prompt}'  # math: format string; chat models go through the chat template
  chat_template: bool = True  # math: apply the tokenizer's chat template when it has one
  tokenizer: str | None = None  # math: directory of the Hugging Face tokenizer; None: model.path's
  max_prompt_tokens: int = 512  # math: prompts are left-padded to this; longer prompts are skipped
  reward_workers: int = 4  # math: processes verifying answers with math-verify

  def __post_init__(self):
    with _section('task'):
      if self.name == 'arith':
        check_arith_arguments(self.max_operand, self.operators)
      require(self.reward_workers >= 1, 'reward_workers', f'must be >= 1, got {self.reward_workers}')
      require(self.max_prompt_tokens >= 1, 'max_prompt_tokens', f'must be >= 1, got {self.max_prompt_tokens}')


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """Held-out evaluation: `python -m grpo_jax.eval`, and every `every` steps of training. Prompts
  are rendered like the task's (template, chat template, max_prompt_tokens)."""

  source: str | None = None  # problems: .jsonl/.json/.parquet, hf:<name>[:<config>] or tfds:<name>; None: none
  split: str = 'test'
  format: DatasetFormat = 'custom'  # dataset schema (data/adapters.py)
  prompt_field: str = 'prompt'  # format custom: field holding the question
  answer_field: str = 'answer'  # format custom: field holding the reference answer
  every: int = 0  # RL steps between evaluations during training (and after the last); 0: never
  samples: int = 8  # n: answers sampled per problem, n >= k
  k: int = 8  # pass@k, mean@k and maj@k are reported for k' = 1, 2, 4, ... up to k
  temperature: float = 1.0  # sampling temperature of the n answers
  greedy: bool = True  # also decode one greedy answer per problem (greedy accuracy)
  max_problems: int = 0  # the first this many problems of the set; 0: all
  batch_prompts: int = 8  # problems per sampler call (each with its n answers)
  max_new_tokens: int = 0  # answer budget; 0: rollout.max_new_tokens

  def __post_init__(self):
    with _section('eval'):
      require(self.every >= 0, 'every', f'must be >= 0, got {self.every}')
      require(self.k >= 1, 'k', f'must be >= 1, got {self.k}')
      require(self.samples >= self.k, 'samples', f'({self.samples}) must be >= k ({self.k})')
      require(self.temperature > 0, 'temperature', f'must be > 0, got {self.temperature}')
      require(self.max_problems >= 0, 'max_problems', f'must be >= 0, got {self.max_problems}')
      require(self.batch_prompts >= 1, 'batch_prompts', f'must be >= 1, got {self.batch_prompts}')
      require(self.max_new_tokens >= 0, 'max_new_tokens', f'must be >= 0, got {self.max_new_tokens}')


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Loop length, checkpointing and guards."""

  steps: int = 100  # RL steps (one rollout + update each)
  steps_per_call: int = 1  # K: RL steps inside one jitted call (jittable rewards only)
  checkpoint_every: int = 50  # RL steps between checkpoints (also saved at the end); 0: only at the end
  max_to_keep: int = 3  # checkpoints kept in workdir/checkpoints
  max_consecutive_skips: int = 5  # stop after this many updates in a row with non-finite loss or grads
  progress: bool = True  # live progress bar on stderr

  def __post_init__(self):
    with _section('train'):
      require(self.steps >= 1, 'steps', f'must be >= 1, got {self.steps}')
      require(self.steps_per_call >= 1, 'steps_per_call', f'must be >= 1, got {self.steps_per_call}')
      require(self.checkpoint_every >= 0, 'checkpoint_every', f'must be >= 0, got {self.checkpoint_every}')
      require(self.checkpoint_every % self.steps_per_call == 0, 'checkpoint_every',
              f'({self.checkpoint_every}) must be a multiple of train.steps_per_call ({self.steps_per_call}): '
              'checkpoints are taken between jitted calls')
      require(self.max_to_keep >= 1, 'max_to_keep', f'must be >= 1, got {self.max_to_keep}')
      require(self.max_consecutive_skips >= 1, 'max_consecutive_skips',
              f'must be >= 1, got {self.max_consecutive_skips}')


def completions_per_step(rollout: RolloutConfig, algo: AlgoConfig) -> int:
  """B = P * G: the completions one RL step samples, scores and trains on."""
  return rollout.prompts_per_step * algo.group_size


@dataclasses.dataclass(frozen=True)
class Config:
  """A run's configuration: each section checks its own fields; this class the fields that span
  sections."""

  run: RunConfig = RunConfig()
  model: ModelConfig = ModelConfig()
  mesh: MeshConfig = MeshConfig()
  task: TaskConfig = TaskConfig()
  rollout: RolloutConfig = RolloutConfig()
  algo: AlgoConfig = AlgoConfig()
  optim: OptimConfig = OptimConfig()
  train: TrainConfig = TrainConfig()
  # Terms of a dataset task's reward (data/reward_terms.py); empty: the math check alone.
  rewards: tuple[RewardTerm, ...] = ()
  eval: EvalConfig = EvalConfig()
  distributed: DistributedConfig = DistributedConfig()  # one process per host (grpo_jax/distributed.py)

  def __post_init__(self):
    algo = self.algo
    rows = completions_per_step(self.rollout, algo)
    require(rows % algo.num_minibatches == 0, 'algo.num_minibatches',
            f'({algo.num_minibatches}) must divide prompts_per_step * group_size ({rows})')
    minibatch = rows // algo.num_minibatches
    require(algo.micro_batch_size == 0 or minibatch % algo.micro_batch_size == 0, 'algo.micro_batch_size',
            f'({algo.micro_batch_size}) must divide the mini-batch of {minibatch} rows')
    require(self.train.steps_per_call == 1 or self.task.name == 'arith', 'train.steps_per_call',
            f'> 1 needs a reward computed in JAX; task {self.task.name!r} scores on the host')
    require(self.task.name != 'math' or bool(self.task.source), 'task.source',
            'must name the problems for task.name=math (a .jsonl/.json/.parquet file, hf:<name>[:<config>] '
            'or tfds:<name>)')
    require(self.train.steps_per_call == 1 or not algo.dynamic_sampling, 'train.steps_per_call',
            '> 1 cannot be combined with algo.dynamic_sampling (the host decides how many rounds to sample)')
    require(not self.rewards or self.task.name == 'math', 'rewards',
            f'apply to dataset tasks (task.name=math); task {self.task.name!r} has its own reward')
    for index, term in enumerate(self.rewards):
      require(term.buffer_tokens <= self.rollout.max_new_tokens, f'rewards[{index}].buffer_tokens',
              f'({term.buffer_tokens}) must be <= rollout.max_new_tokens ({self.rollout.max_new_tokens})')
    require(self.eval.source is None or self.task.name == 'math', 'eval.source',
            f'needs a dataset task (task.name=math); task {self.task.name!r} has no text answers to check')
    require(self.task.name != 'math' or bool(self.model.path or self.task.tokenizer), 'model.path',
            'or task.tokenizer must be set for task.name=math: the tokenizer is read from that directory')


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
    if not math.isfinite(value):
      raise UserError(f'config key {key!r} must be a finite number, got {value!r}')
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
  except FieldError as error:  # a section's own check: name the field as the user writes it
    if prefix and not error.field.startswith(prefix.split('.')[0]):
      raise error.renamed(prefix + error.field) from None
    raise
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
    text = read_text(path, 'config file')
    try:
      data = yaml.safe_load(text)
    except yaml.YAMLError as error:
      raise UserError(f'config file {path} is not valid YAML: {str(error).splitlines()[0]}') from None
    if data is None and not overrides:  # an empty file and no --set: not a silent default run
      raise UserError(f'config file {path} is empty (write at least one section, e.g. from configs/)')
    data = data or {}
    if not isinstance(data, dict):
      raise UserError(f'config file {path} must hold a mapping of sections, got {type(data).__name__}')
  for assignment in overrides:
    _apply_override(data, assignment)
  return _build(Config, data)


def from_dict(data: dict) -> Config:
  """The Config of a plain nested dict (to_dict's form, as stored in checkpoints), checked as a file is."""
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
