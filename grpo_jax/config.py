"""Run configuration: a run's Config assembled from typed, frozen section dataclasses, loaded from
YAML with `--set a.b=c` overrides.

Each section is defined next to the code it configures and checks its own fields (model: model/
loading.py, mesh: grpo_jax/sharding.py, rollout: sampler/rollout.py, algo: rl/algo.py, optim:
rl/optimizer.py, eval: evaluation.py, rewards: data/reward_terms.py, distributed: distributed.py);
this module defines the run's own sections (run, train), checks the fields that span sections, and
reads and writes the YAML form. A field marked `inline` (sections.py) is a smaller section whose
keys are written in its parent (`rollout.temperature`). The task section and each reward term are
tagged unions (a class with `variants()` and `variant(name)`, data/task.py, data/reward_terms.py):
`name` picks the class, defined beside its kind's code, whose fields it holds. Every field has a
default and a one-line comment. Loading checks every key and type and reports the first mistake in
one sentence naming the key, e.g. `config key 'mesh.tensor' expects int, got 'two'`.
"""

import copy
import dataclasses
import datetime
import math
import os
import types
import typing
from typing import Literal

import yaml

from grpo_jax.data.reward_composer import Combination
from grpo_jax.data.reward_terms import RewardTerm
from grpo_jax.data.arith import ArithSection
from grpo_jax.data.task import TaskSection
from grpo_jax.distributed import DistributedConfig
from grpo_jax.errors import FieldError, UserError, read_text, require
from grpo_jax.evaluation import EvalConfig
from grpo_jax.model.loading import ModelConfig
from grpo_jax.rl.algo import AlgoConfig
from grpo_jax.rl.optimizer import OptimConfig
from grpo_jax.sampler.rollout import RolloutConfig
from grpo_jax.sections import Arguments, is_inline, section
from grpo_jax.sharding import MeshConfig
from grpo_jax.trackers import LOGGERS, TRACKERS

__all__ = ['AlgoConfig', 'Config', 'EvalConfig', 'ModelConfig', 'OptimConfig', 'RolloutConfig', 'RunConfig',
           'TaskSection', 'TrainConfig', 'load_config']


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """Identity and reproducibility of a run."""

  name: str = 'run'  # used in the default workdir runs/<name>-<timestamp>
  seed: int = 0  # >= 0; seeds parameter init, sampling and data order
  workdir: str | None = None  # output directory; None: runs/<name>-<timestamp>

  def __post_init__(self):
    with section('run'):
      require(self.seed >= 0, 'seed', f'must be >= 0, got {self.seed}')


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Loop length, checkpointing and guards."""

  steps: int = 100  # RL steps (one rollout + update each)
  steps_per_call: int = 1  # K: RL steps inside one jitted call (jittable rewards only)
  checkpoint_every: int = 50  # RL steps between checkpoints (also saved at the end); 0: only at the end
  max_to_keep: int = 3  # checkpoints kept in workdir/checkpoints
  max_consecutive_skips: int = 5  # stop after this many updates in a row with non-finite loss or grads
  progress: bool = True  # live progress bar on stderr
  tensorboard: bool = True  # TensorBoard events through clu (importing it loads TensorFlow: about 5 s); false drops
  # 'tensorboard' from loggers
  # What logs each step (grpo_jax/trackers.py): jsonl (metrics.jsonl, always written) | tensorboard | wandb | mlflow
  loggers: tuple[str, ...] = ('jsonl', 'tensorboard')
  required_loggers: tuple[str, ...] = ()  # trackers that must start (else the run stops); others are one line if not
  wandb_project: str = 'grpo_jax'
  wandb_entity: str | None = None  # None: the login's default entity
  wandb_mode: Literal['auto', 'online', 'offline'] = 'auto'  # auto: $WANDB_MODE, else online with an API key, else offline
  mlflow_tracking_uri: str | None = None  # None: $MLFLOW_TRACKING_URI, else sqlite:///<workdir>/mlflow.db
  mlflow_experiment: str | None = None  # None: run.name
  # Hugging Face snapshots of the policy while training (grpo_jax/snapshots.py): every N steps (0: never) into
  # <workdir>/hf/step_<N>, beside the orbax checkpoints, written by a background thread
  export_hf_every: int = 0
  export_hf_lora: Literal['adapters', 'merged'] = 'adapters'  # a LoRA run's snapshot: PEFT adapters, or merged weights
  export_hf_max_to_keep: int = 0  # snapshots kept (the oldest removed first); 0: every one

  def __post_init__(self):
    with section('train'):
      require(self.steps >= 1, 'steps', f'must be >= 1, got {self.steps}')
      require(self.steps_per_call >= 1, 'steps_per_call', f'must be >= 1, got {self.steps_per_call}')
      require(self.checkpoint_every >= 0, 'checkpoint_every', f'must be >= 0, got {self.checkpoint_every}')
      require(self.checkpoint_every % self.steps_per_call == 0, 'checkpoint_every',
              f'({self.checkpoint_every}) must be a multiple of train.steps_per_call ({self.steps_per_call}): '
              'checkpoints are taken between jitted calls')
      require(self.max_to_keep >= 1, 'max_to_keep', f'must be >= 1, got {self.max_to_keep}')
      require(self.max_consecutive_skips >= 1, 'max_consecutive_skips',
              f'must be >= 1, got {self.max_consecutive_skips}')
      unknown = [name for name in self.loggers + self.required_loggers if name not in LOGGERS]
      require(not unknown, 'loggers' if unknown and unknown[0] in self.loggers else 'required_loggers',
              f'{unknown[0] if unknown else ""!r} is not a logger; choose among {", ".join(LOGGERS)}')
      require(len(set(self.loggers)) == len(self.loggers), 'loggers', f'names a logger twice: {list(self.loggers)}')
      missing = [name for name in self.required_loggers if name not in self.loggers]
      require(not missing, 'required_loggers', f'names {missing[0] if missing else ""!r}, which train.loggers does '
              f'not ({list(self.loggers)})')
      require(all(name in TRACKERS for name in self.required_loggers), 'required_loggers',
              f'names trackers ({", ".join(TRACKERS)}); jsonl and tensorboard always start')
      require(self.export_hf_every >= 0, 'export_hf_every', f'must be >= 0, got {self.export_hf_every}')
      require(self.export_hf_every % self.steps_per_call == 0, 'export_hf_every',
              f'({self.export_hf_every}) must be a multiple of train.steps_per_call ({self.steps_per_call}): '
              'snapshots are taken between jitted calls')
      require(self.export_hf_max_to_keep >= 0, 'export_hf_max_to_keep',
              f'must be >= 0, got {self.export_hf_max_to_keep}')

  @property
  def writes_tensorboard(self) -> bool:
    return self.tensorboard and 'tensorboard' in self.loggers


@dataclasses.dataclass(frozen=True)
class Config:
  """A run's configuration: each section checks its own fields; this class the fields that span
  sections."""

  run: RunConfig = RunConfig()
  model: ModelConfig = ModelConfig()
  mesh: MeshConfig = MeshConfig()
  task: TaskSection = ArithSection()  # a tagged union: task.name picks the kind's section (data/task.py)
  rollout: RolloutConfig = RolloutConfig()
  algo: AlgoConfig = AlgoConfig()
  optim: OptimConfig = OptimConfig()
  train: TrainConfig = TrainConfig()
  # Terms of a dataset task's reward (data/reward_terms.py); empty: the math check alone.
  rewards: tuple[RewardTerm, ...] = ()
  # How the terms make the reward (data/reward_composer.py): sum (weighted sum, each term after its
  # own normalize and clip) | normalize_then_sum (GDPO: each term standardised within its group,
  # weighted sum, standardised over the batch).
  reward_combination: Combination = 'sum'
  eval: EvalConfig = EvalConfig()
  distributed: DistributedConfig = DistributedConfig()  # one process per host (grpo_jax/distributed.py)

  @property
  def completions_per_step(self) -> int:
    """B = P * G: the completions one RL step samples, scores and trains on."""
    return self.rollout.prompts_per_step * self.algo.group_size

  def __post_init__(self):
    algo = self.algo
    rows = self.completions_per_step
    require(rows % algo.num_minibatches == 0, 'algo.num_minibatches',
            f'({algo.num_minibatches}) must divide prompts_per_step * group_size ({rows})')
    require(algo.shuffle == 'rows' or self.rollout.prompts_per_step % algo.num_minibatches == 0, 'algo.shuffle',
            f"'groups' deals whole groups: algo.num_minibatches ({algo.num_minibatches}) must divide "
            f'rollout.prompts_per_step ({self.rollout.prompts_per_step})')
    minibatch = rows // algo.num_minibatches
    require(algo.micro_batch_size == 0 or minibatch % algo.micro_batch_size == 0, 'algo.micro_batch_size',
            f'({algo.micro_batch_size}) must divide the mini-batch of {minibatch} rows')
    require(self.train.steps_per_call == 1 or self.task.jittable, 'train.steps_per_call',
            f'> 1 needs a reward computed in JAX; task {self.task.name!r} scores on the host')
    require(self.train.steps_per_call == 1 or not algo.dynamic_sampling, 'train.steps_per_call',
            '> 1 cannot be combined with algo.dynamic_sampling (the host decides how many rounds to sample)')
    require(not self.rewards or self.task.kind.answers, 'rewards',
            f'apply to dataset tasks (task.name=math); task {self.task.name!r} has its own reward')
    for index, term in enumerate(self.rewards):
      with section(f'rewards[{index}]'):
        term.check_run(self)
    if self.reward_combination == 'normalize_then_sum':
      require(self.task.kind.answers, 'reward_combination',
              f'applies to dataset tasks (task.name=math); task {self.task.name!r} has its own reward')
      for index, term in enumerate(self.rewards):  # GDPO's definition has neither
        require(term.normalize == 'none', f'rewards[{index}].normalize',
                f"must be none with reward_combination: normalize_then_sum, which standardises every term within its "
                f"group itself (got {term.normalize!r})")
        require(term.clip is None, f'rewards[{index}].clip',
                'must be unset with reward_combination: normalize_then_sum (a clipped term would leave its '
                "groups' means off 0, and the total no longer the advantage GDPO defines)")
      # Its total is GDPO's advantage already (each group's mean is 0): Dr.GRPO's centring leaves it
      # as it is, where GRPO's division by the group's std would undo the batch standardisation.
      require(self.algo.advantage == 'drgrpo', 'algo.advantage',
              f"must be drgrpo with reward_combination: normalize_then_sum, whose reward is GDPO's advantage "
              f'already (got {self.algo.advantage!r}: it would standardise it again within each group)')
    require(self.eval.dataset.source is None or self.task.kind.answers or self.task.kind.acts, 'eval.source',
            f'needs a dataset or agent task (task.name=math or agent); task {self.task.name!r} has no answers to check')
    require(self.rollout.devices == 0 or algo.max_lag >= 1, 'rollout.devices',
            f'({self.rollout.devices}) needs algo.max_lag >= 1: on devices of its own the sampler decodes the next '
            'step\'s groups under weights one version behind the update')
    self.task.check_run(self)
    if algo.exact_on_policy:
      self._exactly_on_policy()

  def _exactly_on_policy(self) -> None:
    """algo.exact_on_policy: the combinations that cannot be exact refused, one line naming both
    fields; then the policy's numerics and the update's log-prob op set to their fixed-order forms
    (model.exact, algo.logprob_implementation 'exact'), which the resolved config shows."""
    options, algo = self.model.options, self.algo
    same_dtype = self.rollout.weights == 'compute' or (self.rollout.weights == 'bf16' and options.dtype == 'bfloat16')
    require(same_dtype, 'rollout.weights',
            f"{self.rollout.weights!r} samples from other weights than the trainer's ({options.dtype}): it cannot be exact "
            "with algo.exact_on_policy; use rollout.weights=compute")
    require(algo.logprob_implementation in ('auto', 'exact'), 'algo.logprob_implementation',
            f"{algo.logprob_implementation!r} sums the vocabulary in its own order: with algo.exact_on_policy the update "
            "uses the sampler's formula ('exact'); leave it 'auto'")
    require(options.decode_attention == 'dense', 'model.decode_attention',
            f"{options.decode_attention!r} combines the cache's blocks in the cache's order, not the sequence's: with "
            "algo.exact_on_policy use 'dense'")
    require(options.attention != 'cudnn', 'model.attention',
            "'cudnn' orders its own sums: with algo.exact_on_policy use 'dense', 'chunked' or 'auto'")
    require(self.mesh.expert == 1, 'mesh.expert',
            f'({self.mesh.expert}): the expert-parallel layer combines its experts with an all-to-all in arrival order; '
            'algo.exact_on_policy computes them on every device instead: set mesh.expert=1')
    require(self.mesh.context == 1, 'mesh.context',
            f'({self.mesh.context}): ring attention joins a query\'s keys block by block as they pass the ring, not in '
            'the sequence\'s order; algo.exact_on_policy needs mesh.context=1')
    require(not self.task.kind.acts, 'algo.exact_on_policy',
            f"is not yet built for agents' rollouts (task.name={self.task.name!r}): their turns' caches and chunked "
            'decode calls are untested for it; set it false')
    object.__setattr__(self, 'model', dataclasses.replace(self.model, options=dataclasses.replace(options, exact=True)))
    object.__setattr__(self, 'algo', dataclasses.replace(algo, logprob_implementation='exact'))


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
    present = [option for option in options if option is not type(None)]
    if len(present) == 1:  # an optional field: its own error, which names the key inside it
      return _coerce(present[0], value, key)
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
  if origin is dict:  # free keys, values as written (task.environment_args)
    if not isinstance(value, dict):
      raise UserError(f'config key {key!r} expects a mapping, got {value!r}')
    for name in value:
      if not isinstance(name, str):
        raise UserError(f'config key {key!r}: its keys are names, got {name!r}')
    return Arguments(copy.deepcopy(value))
  if origin is tuple:
    if not isinstance(value, (list, tuple)):
      raise UserError(f'config key {key!r} expects a list, got {value!r}')
    (item,) = typing.get_args(kind)[:1]
    return tuple(_coerce(item, v, f'{key}[{i}]') for i, v in enumerate(value))
  if dataclasses.is_dataclass(kind):
    if not isinstance(value, dict):
      raise UserError(f'config key {key!r} expects a mapping of fields, got {value!r}')
    if hasattr(kind, 'variants'):
      kind, value = _variant(kind, value, key)
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


def _keys(cls) -> dict:
  """{key as written: (field name, its inline field or None)} for a section class."""
  keys = {}
  for field in dataclasses.fields(cls):
    if is_inline(field):
      keys.update({inner.name: (inner.name, field) for inner in dataclasses.fields(field.default)})
    else:
      keys[field.name] = (field.name, None)
  return keys


def _default(cls, key: str):
  """The default of key `key` as written in section `cls` (an inline section's keys included)."""
  name, holder = _keys(cls)[key]
  if holder is not None:
    return getattr(holder.default, name)
  field = next(field for field in dataclasses.fields(cls) if field.name == name)
  return field.default_factory() if field.default is dataclasses.MISSING else field.default


def _variant(tagged, data: dict, key: str, stored: bool = False):
  """The class of tagged section `tagged` that `data`'s `name` picks (`tagged.variant`, which names
  the known kinds for an unknown name), and `data` without the keys that belong to another of its
  classes. Those keys are accepted at their defaults: configs written before the section became a
  tagged union hold every kind's keys; any other value is an error naming the kind it applies to
  (`stored`: a checkpoint's config, whose other kinds' keys are dropped whatever they hold)."""
  variants = tagged.variants()
  tag = _coerce(typing.get_type_hints(tagged)['name'], data.get('name', tagged.name), f'{key}.name')
  with section(key):
    chosen = tagged.variant(tag)
  own = _keys(chosen)
  kept = {}
  for name, value in data.items():
    owners = [other for other, cls in variants.items() if other != tag and name in _keys(cls)]
    if name in own or not owners:  # its own key, or unknown to every kind (_build names it)
      kept[name] = value
      continue
    cls = variants[owners[0]]
    field_name, holder = _keys(cls)[name]
    hint = typing.get_type_hints(type(holder.default) if holder is not None else cls)[field_name]
    try:
      is_default = _coerce(hint, value, f'{key}.{name}') == _default(cls, name)
    except UserError:
      is_default = False
    if not (stored or is_default):
      raise UserError(f'config key {key + "." + name!r} applies to {key}.name: {" or ".join(owners)}, not {tag!r}')
  return chosen, kept


def _build(cls, data: dict, prefix: str = ''):
  hints = typing.get_type_hints(cls)
  keys = _keys(cls)
  for key in data:
    if key not in keys:
      raise UserError(f'unknown config key {prefix + str(key)!r} (valid keys here: {", ".join(keys)})')
  values, inlined = {}, {}
  for key, value in data.items():
    name, holder = keys[key]
    if holder is None:
      values[name] = _coerce(hints[name], value, prefix + name)
    else:
      inlined.setdefault(holder, {})[name] = _coerce(typing.get_type_hints(type(holder.default))[name], value,
                                                     prefix + name)
  try:
    for holder, fields in inlined.items():  # the inline section's own checks, its keys named as written
      values[holder.name] = dataclasses.replace(holder.default, **fields)
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
  return _with_local_paths_resolved(read_sections(path, overrides, Config))


def read_sections(path: str | None, overrides: typing.Sequence[str], cls):
  """The top-level config `cls` (a frozen dataclass of sections: Config, or another entry point's)
  read from a YAML file (or only defaults when `path` is None) with `--set` overrides applied, every
  key and type checked."""
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
  switched = {assignment.split('=', 1)[0].strip().split('.')[0] for assignment in overrides
              if assignment.split('=', 1)[0].strip().endswith('.name')}
  if switched:  # --set task.name=... switches the file's kind: the file's keys of its other kinds go
    probe = copy.deepcopy(data)
    for assignment in overrides:
      _apply_override(probe, assignment)
    data = _without_other_kinds(data, switched, probe, cls)
  for assignment in overrides:
    _apply_override(data, assignment)
  return _build(cls, data)


def local_path(path: str | None) -> str | None:
  """`path` made absolute where it names something on this machine; a name that is no local path
  (a hub name, None) as it is."""
  return os.path.abspath(path) if path and os.path.exists(path) else path


def _with_local_paths_resolved(config: Config) -> Config:
  """model.path, the task's tokenizer and the reward terms' models made absolute where they name
  something on this machine, so the run's stored config (checkpoints, config.yaml) finds them from
  any directory and an export names its base by a path that resolves anywhere; a name that is no
  local path (a hub name) stays as written. A checkpoint's stored config is taken as it was stored
  (from_dict)."""
  resolved = local_path
  changes = {}
  if resolved(config.model.path) != config.model.path:
    changes['model'] = dataclasses.replace(config.model, path=resolved(config.model.path))
  tokenizer = config.task.tokenizer_directory
  if resolved(tokenizer) != tokenizer:
    changes['task'] = dataclasses.replace(config.task, tokenizer=resolved(tokenizer))
  terms = tuple(term.with_paths(resolved) for term in config.rewards)  # reward models', judges'
  if terms != config.rewards:
    changes['rewards'] = terms
  return dataclasses.replace(config, **changes) if changes else config


def _without_other_kinds(data: dict, sections, final: dict, cls=None) -> dict:
  """`data` without the keys of tagged `sections` that belong to another kind than the one `final`
  (the same data, overrides applied) picks: a stored config's, or a file's whose kind the command
  line changes. `cls`: the top-level config (default Config)."""
  data = dict(data)
  hints = typing.get_type_hints(cls or Config)
  for name in sections:
    kind = hints.get(name)
    if hasattr(kind, 'variants') and isinstance(data.get(name), dict) and isinstance(final.get(name), dict):
      tag = final[name].get('name', kind.name)
      data[name] = _variant(kind, dict(data[name], name=tag), name, stored=True)[1]
    item = typing.get_args(kind)[0] if typing.get_origin(kind) is tuple else None
    if hasattr(item, 'variants') and isinstance(data.get(name), list):  # a list of tagged sections (rewards)
      data[name] = [_variant(item, entry, f'{name}[{index}]', stored=True)[1] if isinstance(entry, dict) else entry
                    for index, entry in enumerate(data[name])]
  return data


def from_dict(data: dict) -> Config:
  """The Config of a plain nested dict (to_dict's form, as stored in checkpoints), checked as a file
  is, except that the keys of a tagged section's other kinds are dropped whatever their values (a
  checkpoint written before the task section was a tagged union stores every kind's keys)."""
  return _build(Config, _without_other_kinds(data, [field.name for field in dataclasses.fields(Config)], data))


def to_dict(config) -> dict:
  """Plain nested dict (tuples as lists, inline sections' keys in their parent), the form written
  to config.yaml."""
  def plain(value):
    if dataclasses.is_dataclass(value):
      out = {}
      for field in dataclasses.fields(value):
        inner = plain(getattr(value, field.name))
        if is_inline(field):
          out.update(inner)
        else:
          out[field.name] = inner
      return out
    if isinstance(value, (tuple, list)):
      return [plain(v) for v in value]
    if isinstance(value, dict):
      return {k: plain(v) for k, v in value.items()}
    return value
  return plain(config)


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
