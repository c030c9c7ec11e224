"""Run configuration: a run's Config assembled from typed, frozen section dataclasses, loaded from
YAML with `--set a.b=c` overrides.

Each section is defined next to the code it configures and checks its own fields (model: model/
loading.py, mesh: grpo_jax/sharding.py, rollout: sampler/rollout.py, algo: rl/algo.py, optim:
rl/optimizer.py, eval: evaluation.py, rewards: data/reward_terms.py, distributed: distributed.py);
this module defines the run's own sections (run, train), checks the fields that span sections, and
loads a run's Config (config_yaml.py reads and writes the YAML form of any config). A field marked `inline` (sections.py) is a smaller section whose
keys are written in its parent (`rollout.temperature`). The task section and each reward term are
tagged unions (a class with `variants()` and `variant(name)`, data/task.py, data/reward_terms.py):
`name` picks the class, defined beside its kind's code, whose fields it holds. Every field has a
default and a one-line comment. Loading checks every key and type and reports the first mistake in
one sentence naming the key, e.g. `config key 'mesh.tensor' expects int, got 'two'`.
"""

import dataclasses
import datetime
import os
import typing
from typing import Literal

from grpo_jax.data.reward_composer import Combination
from grpo_jax.data.reward_terms import RewardTerm
from grpo_jax.data.arith import ArithSection
from grpo_jax.data.task import TaskSection
from grpo_jax.distributed import DistributedConfig
from grpo_jax.config_yaml import build, read_sections, to_dict, to_yaml, without_other_kinds
from grpo_jax.errors import require
from grpo_jax.evaluation import EvalConfig
from grpo_jax.model.loading import ModelConfig
from grpo_jax.rl.algo import AlgoConfig
from grpo_jax.rl.optimizer import OptimConfig
from grpo_jax.sampler.rollout import RolloutConfig
from grpo_jax.sections import section
from grpo_jax.sharding import MeshConfig
from grpo_jax.trackers import LOGGERS, TRACKERS

__all__ = ['AlgoConfig', 'Config', 'EvalConfig', 'ModelConfig', 'OptimConfig', 'RolloutConfig', 'RunConfig',
           'TaskSection', 'TrainConfig', 'from_dict', 'load_config', 'read_sections', 'to_dict', 'to_yaml']


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
    self._cache_format()
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

  def _cache_format(self) -> None:
    """rollout.kv_cache becomes the model's decode cache format (model.kv_cache), which it may also
    name; two different formats are refused."""
    options, kind = self.model.options, self.rollout.kv_cache
    if kind == 'compute' or options.kv_cache == kind:
      return
    require(options.kv_cache == 'compute', 'rollout.kv_cache',
            f'({kind!r}) and model.kv_cache ({options.kv_cache!r}) name two cache formats; set one')
    require(not self.algo.exact_on_policy, 'rollout.kv_cache',
            f'{kind!r} rounds the cached keys and values, so the sampler computes other log-probs than the trainer: it '
            'cannot be exact with algo.exact_on_policy; use rollout.kv_cache=compute')
    require(options.decode_attention == 'dense', 'model.decode_attention',
            f"({options.decode_attention!r}) must be 'dense' with rollout.kv_cache={kind}: the blockwise and ragged paths "
            'do not apply its scales')
    object.__setattr__(self, 'model', dataclasses.replace(self.model, options=dataclasses.replace(options,
                                                                                                  kv_cache=kind)))

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
    require(self.rollout.prefill_context == 1, 'rollout.prefill_context',
            f'({self.rollout.prefill_context}): ring attention joins a prompt\'s keys block by block, not in the '
            'sequence\'s order; algo.exact_on_policy needs rollout.prefill_context=1')
    require(not self.task.kind.acts, 'algo.exact_on_policy',
            f"is not yet built for agents' rollouts (task.name={self.task.name!r}): their turns' caches and chunked "
            'decode calls are untested for it; set it false')
    object.__setattr__(self, 'model', dataclasses.replace(self.model, options=dataclasses.replace(options, exact=True)))
    object.__setattr__(self, 'algo', dataclasses.replace(algo, logprob_implementation='exact'))


# ---- loading ----

def load_config(path: str | None, overrides: typing.Sequence[str] = ()) -> Config:
  """Reads a YAML file (or only defaults when `path` is None) and applies `--set` overrides."""
  return _with_local_paths_resolved(read_sections(path, overrides, Config))


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


def from_dict(data: dict) -> Config:
  """The Config of a plain nested dict (to_dict's form, as stored in checkpoints), checked as a file
  is, except that the keys of a tagged section's other kinds are dropped whatever their values (a
  checkpoint written before the task section was a tagged union stores every kind's keys)."""
  return build(Config, without_other_kinds(data, [field.name for field in dataclasses.fields(Config)], data, Config))


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
