"""The weights the RL step holds beside the policy: the reference policy's and a teacher's.

Both are resident on the trainer's mesh for the whole run, laid out by the logical-axis table
like the policy (FSDP over `fsdp`, tensor-parallel over `tensor`), never trained and never
checkpointed (each comes back from where it was read). The update scores the batch's tokens under
each with the same log-prob pass that gives pi_old (rl/update.py `_score`): no [T, V] logits held.

  reference  pi_ref's parameter state, the policy's own graph (algo.kl_beta > 0 without LoRA;
             with LoRA pi_ref is the state's base with the adapters off, and this is None)
  teacher    a Teacher (algo.teacher): its own graph and parameters, any architecture and size
             the project loads, sharing the student's tokenizer. Its log-probs of the student's
             sampled tokens give on-policy distillation's per-token advantage
             (rl/algo.distilled_advantages).
"""

from typing import Any

from flax import nnx, struct


@struct.dataclass
class Teacher:
  """A teacher's graph (static) and parameters [compute dtype, laid out like the policy's]; `path`
  names where it was read (static, for messages). A vision-language student's teacher has a vision
  tower of its own, which the update runs on the same images."""

  graphdef: Any = struct.field(pytree_node=False)
  params: nnx.State
  path: str = struct.field(pytree_node=False, default='')


@struct.dataclass
class Held:
  """The step's second sets of weights (module docstring); each None when the run has none."""

  reference: nnx.State | None = None
  teacher: Teacher | None = None
