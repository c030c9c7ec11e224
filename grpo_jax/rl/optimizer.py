"""The optimizer and its learning-rate schedule, built by their config section (`optim`)."""

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import optax

from grpo_jax.errors import require
from grpo_jax.sections import section


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
    with section('optim'):
      require(self.learning_rate > 0, 'learning_rate', f'must be > 0, got {self.learning_rate}')
      require(self.warmup_steps >= 0, 'warmup_steps', f'must be >= 0, got {self.warmup_steps}')
      require(self.decay_steps >= 0, 'decay_steps', f'must be >= 0, got {self.decay_steps}')
      require(0 <= self.min_lr_ratio <= 1, 'min_lr_ratio', f'must be in [0, 1], got {self.min_lr_ratio}')
      require(0 <= self.b1 < 1, 'b1', f'must be in [0, 1), got {self.b1}')
      require(0 <= self.b2 < 1, 'b2', f'must be in [0, 1), got {self.b2}')
      require(self.eps > 0, 'eps', f'must be > 0, got {self.eps}')
      require(self.weight_decay >= 0, 'weight_decay', f'must be >= 0, got {self.weight_decay}')
      require(self.max_grad_norm >= 0, 'max_grad_norm', f'must be >= 0 (0 disables clipping), got {self.max_grad_norm}')

  def learning_rate_schedule(self, total_updates: int) -> optax.Schedule:
    """The learning rate of each optimizer update; `total_updates`: the run's (where a cosine decay
    without decay_steps ends)."""
    peak = self.learning_rate
    if self.schedule == 'constant':
      if self.warmup_steps == 0:
        return optax.constant_schedule(peak)
      return optax.join_schedules([optax.linear_schedule(0.0, peak, self.warmup_steps),
                                   optax.constant_schedule(peak)], [self.warmup_steps])
    decay = self.decay_steps or max(total_updates, self.warmup_steps + 1)
    return optax.warmup_cosine_decay_schedule(0.0, peak, self.warmup_steps, decay, end_value=peak * self.min_lr_ratio)

  def build(self, total_updates: int, frozen: tuple[str, ...] = ()) -> tuple[optax.GradientTransformation,
                                                                              optax.Schedule]:
    """(AdamW on the schedule, after global-norm clipping when enabled; the schedule). `frozen`:
    the parameters the optimizer leaves as they are and holds no state for (`freezing`), by path: a
    frozen vision tower, 'visual'; DeepSeekMoE's choice bias, 'layers/router_bias'."""
    schedule = self.learning_rate_schedule(total_updates)
    adamw = optax.adamw(schedule, b1=self.b1, b2=self.b2, eps=self.eps, weight_decay=self.weight_decay)
    optimizer = optax.chain(optax.clip_by_global_norm(self.max_grad_norm), adamw) if self.max_grad_norm > 0 else adamw
    return (freezing(optimizer, frozen) if frozen else optimizer), schedule


def _under(path, names: tuple[str, ...]) -> bool:
  """Whether a parameter's path lies under one of `names` ('visual', 'layers/router_bias')."""
  keys = [str(getattr(key, 'key', getattr(key, 'name', key))) for key in path]
  return any(keys[:len(name.split('/'))] == name.split('/') for name in names)


def freezing(optimizer: optax.GradientTransformation, names: tuple[str, ...]) -> optax.GradientTransformation:
  """`optimizer` on every parameter but those under the paths `names`, which keep their values:
  their updates are zero (no weight decay either), and the optimizer's state holds
  optax.MaskedNode (no array) where their moments would be. Their gradients, zero in the update,
  are left out of its global norm."""
  def trained(params):
    return jax.tree_util.tree_map_with_path(lambda path, _: not _under(path, names), params)

  def update(updates, state, params=None):
    del params
    zeroed = jax.tree_util.tree_map_with_path(lambda path, u: jnp.zeros_like(u) if _under(path, names) else u,
                                              updates)
    return zeroed, state

  # optax.masked passes the masked-out updates through as they came: zeroed after it.
  return optax.chain(optax.masked(optimizer, trained),
                     optax.GradientTransformation(lambda params: optax.EmptyState(), update))
