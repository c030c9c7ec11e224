"""The step's model scores: the program that scores an RL step's completions with the models the run
holds beside the policy (reward models), in the trainer's mesh, between the rollout and the host
stage of the task's reward.

    prompts [P, Tp] + rollout [P*G, N] --(ModelScores, one jit per model)--> {label: [P*G] fp32}
                                        --> the task's reward (the host terms and their sum)

A reward term of kind `reward_model` (data/reward_terms.py RewardModelTerm) names the model; the
run loads it once (`ModelScores.load`), its weights resident on the trainer's devices in the term's
dtype and laid out by the model's logical-axis table like the policy's (sharding.py: FSDP over
`fsdp`, tensor-parallel over `tensor`), and the step calls `scores(prompt_tokens, prompt_mask,
rollout)` every round: one forward over the round's rows, laid out along the mesh's batch axes
(rl/reward_model.py score_completions); the plan builds the same models abstract from their
config.json (`ModelScores.abstract`) and compiles their programs. The host term then reads the
values by its label and shapes them like any other term's. A run without model terms has no models
(`ModelScores.none()`): the stage gives {} and compiles nothing.

The reward model reads the policy's tokens as they are, so its tokenizer must be the policy's: the
same ids for the same strings, checked when the run is built (`tokenizer_difference`), one line
naming the first id that differs.
"""

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from grpo_jax import sharding
from grpo_jax.errors import UserError
from grpo_jax.model.hf_config import load_hf_config
from grpo_jax.model.loading import abstract_model, check_mesh, load_reward_model
from grpo_jax.model.qwen2 import ModelOptions
from grpo_jax.rl.reward_model import check_reward_model_length, score_completions
from grpo_jax.sampler.rollout import Rollout


def tokenizer_difference(first, second) -> str | None:
  """None when two tokenizers map every id to the same string and have the same size; else one
  clause saying how they differ (the sizes, or the first id whose strings differ)."""
  if len(first) != len(second):
    return f'{len(first)} tokens against {len(second)}'
  strings = [{index: token for token, index in tokenizer.get_vocab().items()} for tokenizer in (first, second)]
  for index in range(len(first)):
    if strings[0].get(index) != strings[1].get(index):
      return f'id {index} is {strings[0].get(index)!r} in one and {strings[1].get(index)!r} in the other'
  return None


@dataclasses.dataclass(frozen=True)
class ScoringModel:
  """One model the step scores with: the label of the term it serves, where it was read from, its
  graph and its parameters (arrays resident on the trainer's mesh, or the plan's abstract ones)."""

  label: str
  path: str
  graphdef: Any
  params: Any


class ModelScores:
  """The stage (prompt_tokens [P, Tp], prompt_mask [P, Tp], rollout) -> {label: [P*G] fp32} of a
  run's models, each model's program jitted once (`host`), or traced inside the caller's jit."""

  def __init__(self, models: tuple[ScoringModel, ...], host: bool = True):
    self.models = models
    self.programs = {model.label: (jax.jit(_scores, static_argnums=0) if host else _scores) for model in models}

  @classmethod
  def none(cls) -> 'ModelScores':
    """The stage of a run without model terms: {} each round."""
    return cls(())

  @classmethod
  def load(cls, terms, mesh: jax.sharding.Mesh, tokenizer, row_length: int) -> 'ModelScores':
    """The models of the run's model terms (RewardModelTerms), loaded over `mesh` and checked
    against the policy's `tokenizer` and the step's rows of `row_length` tokens (prompt width +
    rollout.max_new_tokens)."""
    models = []
    for term in terms:
      options = ModelOptions(dtype=term.dtype, param_dtype=term.dtype)
      model, own_tokenizer = load_reward_model(term.path, mesh=mesh, options=options)
      difference = tokenizer_difference(own_tokenizer, tokenizer)
      if difference is not None:
        raise UserError(f'reward term {term.name!r}: the reward model {term.path} has another tokenizer than the '
                        f"policy ({difference}); scoring through the reward model's own tokenizer and chat template "
                        'is not built: use a reward model trained on the policy\'s tokenizer')
      check_reward_model_length(model.config, row_length, 0, term.path)
      graphdef, params = nnx.split(model)
      models.append(ScoringModel(term.label, term.path, graphdef, params))
    return cls(tuple(models))

  @classmethod
  def abstract(cls, terms, mesh: jax.sharding.Mesh, row_length: int) -> 'ModelScores':
    """The models of the run's model terms as `load` lays them out over `mesh`, their parameters
    ShapeDtypeStructs placed by the model's logical-axis table in the term's dtype: the
    architecture from each term's config.json alone, no weights or tokenizer read (the plan's).
    Refused as `load` refuses: a language model in place of a reward model, rows longer than it reads."""
    models = []
    for term in terms:
      if not os.path.isfile(os.path.join(term.path, 'config.json')):
        raise UserError(f'reward term {term.name!r}: path {term.path} has no config.json (the reward model\'s '
                        'architecture, which the plan reads without its weights)')
      config = load_hf_config(term.path)
      if not config.num_labels:
        raise UserError(f'reward term {term.name!r}: {term.path} is a language model ({config.architecture}), not a '
                        'reward model: a reward model is a sequence classifier with a score head')
      check_reward_model_length(config, row_length, 0, term.path)
      check_mesh(config, mesh)
      graphdef, state = nnx.split(abstract_model(config, ModelOptions(dtype=term.dtype, param_dtype=term.dtype)))
      params = sharding.placed_abstract(state, sharding.state_shardings(state, mesh))
      models.append(ScoringModel(term.label, term.path, graphdef, params))
    return cls(tuple(models))

  def traced(self) -> 'ModelScores':
    """The same models, their programs traced inside the caller's jit (the K-steps loop)."""
    return ModelScores(self.models, host=False)

  def __call__(self, prompt_tokens: jax.Array, prompt_mask: jax.Array, rollout: Rollout) -> dict:
    return {model.label: self.programs[model.label](model.graphdef, model.params, prompt_tokens, prompt_mask,
                                                    rollout.tokens, rollout.mask)
            for model in self.models}


def _scores(graphdef, params, prompt_tokens, prompt_mask, completions, completion_mask) -> jax.Array:
  return score_completions(nnx.merge(graphdef, params), prompt_tokens, prompt_mask, completions,
                           completion_mask).astype(jnp.float32)
