"""The step's model scores: what the models the run holds beside the policy (reward models, a
generative judge) make of an RL round's completions, in the trainer's mesh, between the rollout and
the host stage of the task's reward.

    prompts [P, Tp] + rollout [P*G, N] --(ModelScores: each model's program)--> {label: [P*G] fp32}
                                        --> the task's reward (the host terms and their sum)

A reward term of kind `reward_model` or `judge` (data/reward_terms.py) names its model; the run
loads it once (`ModelScores.load`), its weights resident on the trainer's devices in the term's
dtype and laid out by the model's logical-axis table like the policy's (sharding.py: FSDP over
`fsdp`, tensor-parallel over `tensor`), computing as the policy does (its attention, chunk and
layer loop: `scoring_options`), and the step calls `scores(prompts, rollout)` every round. The
plan builds the reward models abstract from their config.json (`ModelScores.abstract`) and
compiles their programs (plan/programs.py).
The host term then reads the values by its label and shapes them like any other term's. A run
without model terms has no models (`ModelScores.none()`): the stage gives {} and compiles nothing.

  RewardModelScoring  one jitted forward over the round's rows, laid out along the mesh's batch
                      axes (rl/reward_model.py score_completions), reading the policy's tokens as
                      they are: for a reward model whose tokenizer (the same ids for the same
                      strings, `tokenizer_difference`) and chat template are the policy's.
  RenderedScoring     any other reward model: each completion decoded on the host, its
                      conversation (the prompt's messages, then the completion as the assistant's
                      reply) rendered through the reward model's own chat template and tokenizer,
                      right-padded with its pad id to the term's max_length, scored by one jitted
                      forward; NaN for a conversation longer than that (the term scores it 0 and
                      counts it: a cut conversation is another one).
  JudgeScoring        the completions decoded on the host, each rendered with its question (and
                      reference, when shown) through the judge's template and chat template, the
                      verdicts decoded greedily by the group sampler on the judge's resident
                      weights (data/judge.py Judge, compiled once), read by the parse rule; NaN
                      where no verdict could be read (the term scores it 0 and counts it).
"""

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpo_jax import sharding
from grpo_jax.data.judge import Judge
from grpo_jax.data.reward_terms import JudgeTerm, RewardModelTerm
from grpo_jax.data.task import Prompts
from grpo_jax.errors import UserError
from grpo_jax.model.hf_config import load_hf_config
from grpo_jax.model.loading import abstract_model, check_mesh, from_pretrained, load_reward_model, load_tokenizer
from grpo_jax.model.qwen2 import ModelOptions
from grpo_jax.rl.reward_model import check_reward_model_length, score_completions
from grpo_jax.sampler.rollout import Rollout
from grpo_jax.sampler.special_tokens import checkpoint_eos_ids, special_tokens, tokenizer_size


def scoring_options(policy: ModelOptions, dtype: str) -> ModelOptions:
  """How a scoring model computes: as the policy does (its attention implementation and chunk, its
  layer loop), in the term's `dtype`, without adapters or rematerialisation (it is never trained
  here)."""
  return dataclasses.replace(policy, dtype=dtype, param_dtype=dtype, lora=None, remat='none', freeze_vision=False)


def tokenizer_difference(first, second) -> str | None:
  """None when two tokenizers (transformers' or `tokenizers`') map every id to the same string
  and have the same size; else one clause saying how they differ (the sizes, or the first id whose
  strings differ)."""
  sizes = tokenizer_size(first), tokenizer_size(second)
  if sizes[0] != sizes[1]:
    return f'{sizes[0]} tokens against {sizes[1]}'
  strings = [{index: token for token, index in tokenizer.get_vocab().items()} for tokenizer in (first, second)]
  for index in range(sizes[0]):
    if strings[0].get(index) != strings[1].get(index):
      return f'id {index} is {strings[0].get(index)!r} in one and {strings[1].get(index)!r} in the other'
  return None


@dataclasses.dataclass(frozen=True)
class RewardModelScoring:
  """A reward model's scores of a round's rows: its graph, its resident parameters, and its
  program (jitted once, or traced inside the caller's jit)."""

  label: str
  path: str
  graphdef: Any
  params: Any
  host: bool = True

  def traced(self) -> 'RewardModelScoring':
    return dataclasses.replace(self, host=False)

  @property
  def program(self):
    """(graphdef, params, prompt tokens, prompt mask, completions, completion mask) -> [P*G] fp32:
    jitted once for every reward model (the plan compiles it), or the traced function."""
    return _REWARD_MODEL_PROGRAM if self.host else _reward_model_scores

  def __call__(self, prompts: Prompts, rollout: Rollout) -> jax.Array:
    return self.program(self.graphdef, self.params, prompts.tokens, prompts.mask, rollout.tokens, rollout.mask)


def _reward_model_scores(graphdef, params, prompt_tokens, prompt_mask, completions, completion_mask) -> jax.Array:
  return score_completions(nnx.merge(graphdef, params), prompt_tokens, prompt_mask, completions,
                           completion_mask).astype(jnp.float32)


_REWARD_MODEL_PROGRAM = jax.jit(_reward_model_scores, static_argnums=0)


def reward_model_scoring(term: RewardModelTerm, mesh: jax.sharding.Mesh, task, row_length: int,
                         options: ModelOptions):
  """The term's reward model over `mesh`, reading the policy's tokens (a RewardModelScoring) when
  its tokenizer and chat template are the task's, else through its own (a RenderedScoring); the
  step's rows are `row_length` tokens (the prompt width + rollout.max_new_tokens); `options`: its
  scoring_options."""
  model, tokenizer = load_reward_model(term.path, mesh=mesh, options=options)
  policy_template = task.tokenizer.chat_template if task.use_chat_template else None
  if tokenizer_difference(tokenizer, task.tokenizer) is None and tokenizer.chat_template == policy_template:
    check_reward_model_length(model.config, row_length, 0, term.path)
    graphdef, params = nnx.split(model)
    return RewardModelScoring(term.label, term.path, graphdef, params)
  if not getattr(tokenizer, 'chat_template', None):
    raise UserError(f'reward term {term.name!r}: the reward model {term.path} has another tokenizer or chat template '
                    "than the policy and no chat template of its own to read the conversation with")
  length = term.max_length or min(row_length + row_length // 2, model.config.max_position_embeddings)
  if length > model.config.max_position_embeddings:
    raise UserError(f'reward term {term.name!r}: max_length {length} is more than the reward model {term.path} '
                    f'reads (its max_position_embeddings, {model.config.max_position_embeddings})')
  return RenderedScoring(term.label, term.path, model, tokenizer, task.decode, length)


class RenderedScoring:
  """A reward model reading each conversation through its own chat template and tokenizer (module
  docstring): `decode` (the task's) turns completion rows into text, each prompt's reference
  (Prompts.answers, a math task's References) gives its messages."""

  def __init__(self, label: str, path: str, model, tokenizer, decode, max_length: int):
    self.label, self.path, self.tokenizer, self.decode, self.max_length = label, path, tokenizer, decode, max_length
    self.graphdef, self.params = nnx.split(model)
    self.pad_id = model.config.pad_token_id

  def traced(self) -> 'RenderedScoring':
    """Itself: it reads text on the host, and a run with it is never traced (a dataset task)."""
    return self

  def rows(self, prompts: Prompts, rollout: Rollout) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, mask) [P*G, max_length] of each conversation through the reward model's template,
    right-padded with its pad id, and [P*G] whether it fits (a longer one is left out)."""
    completions = self.decode(*jax.device_get((rollout.tokens, rollout.mask)))
    group = len(completions) // len(prompts.answers)
    tokens = np.full((len(completions), self.max_length), self.pad_id, np.int32)
    mask = np.zeros((len(completions), self.max_length), np.int32)
    fits = np.zeros(len(completions), bool)
    for row, completion in enumerate(completions):
      messages = [*prompts.answers[row // group].messages, {'role': 'assistant', 'content': completion}]
      ids = list(self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=False,
                                                    return_dict=False))
      fits[row] = len(ids) <= self.max_length
      if fits[row]:
        tokens[row, :len(ids)], mask[row, :len(ids)] = ids, 1
    return tokens, mask, fits

  def __call__(self, prompts: Prompts, rollout: Rollout) -> jax.Array:
    tokens, mask, fits = self.rows(prompts, rollout)
    scores = _RENDERED_PROGRAM(self.graphdef, self.params, jnp.asarray(tokens), jnp.asarray(mask))
    return jnp.where(jnp.asarray(fits), scores, jnp.nan)


def _rendered_scores(graphdef, params, tokens, mask) -> jax.Array:
  tokens, mask = sharding.constrain(tokens, ('batch', 'seq')), sharding.constrain(mask, ('batch', 'seq'))
  return nnx.merge(graphdef, params).scores(tokens, segment_ids=mask)[:, 0].astype(jnp.float32)


_RENDERED_PROGRAM = jax.jit(_rendered_scores, static_argnums=0)


class JudgeScoring:
  """A generative judge's verdicts on a round's completions (module docstring): the task's
  `decode` turns completion rows into text, and each prompt's reference (Prompts.answers, a math
  task's References) gives the question and the reference answer."""

  def __init__(self, term: JudgeTerm, mesh: jax.sharding.Mesh, decode, options: ModelOptions):
    if jax.process_count() > 1:
      raise UserError(f"reward term 'judge': a judge reads every completion on one host; this run has "
                      f'{jax.process_count()} processes')
    tokenizer = load_tokenizer(term.path)
    if tokenizer is None:
      raise UserError(f'reward term {term.name!r}: the judge {term.path} has no tokenizer (tokenizer.json or '
                      'vocab.json): it reads its template through its own tokenizer and chat template')
    if not getattr(tokenizer, 'chat_template', None):
      raise UserError(f'reward term {term.name!r}: the judge {term.path} has no chat template; a judge reads its '
                      'template as a user message')
    model = from_pretrained(term.path, mesh=mesh, options=options)
    if model.config.num_labels:
      raise UserError(f'reward term {term.name!r}: {term.path} is a reward model (a sequence classifier); a judge '
                      'is a language model that writes its verdict (use name: reward_model for it)')
    special = special_tokens(tokenizer, checkpoint_eos_ids(term.path))
    self.label, self.path, self.decode = term.label, term.path, decode
    self.judge = Judge(model, tokenizer, term.template, term.parse, max_new_tokens=term.max_new_tokens,
                       max_prompt_tokens=term.max_prompt_tokens, stop_token_ids=special.stop_ids,
                       pad_id=special.pad_id, show_reference=term.show_reference)

  def traced(self) -> 'JudgeScoring':
    """Itself: the judge reads text on the host, and a run with one is never traced (its task, a
    dataset task, scores on the host: train.steps_per_call is 1)."""
    return self

  def __call__(self, prompts: Prompts, rollout: Rollout) -> jax.Array:
    completions = self.decode(*jax.device_get((rollout.tokens, rollout.mask)))
    group = len(completions) // len(prompts.answers)
    rows = [(reference.question, completion, reference.answer or None)
            for reference, start in zip(prompts.answers, range(0, len(completions), group))
            for completion in completions[start:start + group]]
    judged = self.judge(rows)
    return jnp.asarray(np.where(judged.parsed, judged.rewards, np.nan), jnp.float32)


class ModelScores:
  """The stage (prompts, rollout) -> {label: [P*G] fp32} of a run's scoring models."""

  def __init__(self, scorings: tuple = ()):
    self.scorings = scorings

  @classmethod
  def none(cls) -> 'ModelScores':
    """The stage of a run without model terms: {} each round."""
    return cls(())

  @classmethod
  def load(cls, terms, mesh: jax.sharding.Mesh, task, row_length: int, policy: ModelOptions) -> 'ModelScores':
    """The models of the run's model terms, loaded over `mesh`; `task` is the run's dataset task
    (its tokenizer and its decode of completion rows), `row_length` its rows' (prompt width +
    rollout.max_new_tokens), `policy` the policy's options (the models compute as it does)."""
    scorings = []
    for term in terms:
      options = scoring_options(policy, term.dtype)
      if isinstance(term, JudgeTerm):
        scorings.append(JudgeScoring(term, mesh, task.decode, options))
      else:
        scorings.append(reward_model_scoring(term, mesh, task, row_length, options))
    return cls(tuple(scorings))

  @classmethod
  def abstract(cls, terms, mesh: jax.sharding.Mesh, row_length: int, policy: ModelOptions) -> 'ModelScores':
    """The run's reward models as `load` lays them out over `mesh`, their parameters
    ShapeDtypeStructs placed by the model's logical-axis table in the term's dtype: the
    architecture from each term's config.json alone, no weights or tokenizer read (the plan's).
    The policy's tokens are taken to be what they read (rows of `row_length`), which the plan
    cannot check without the tokenizers. Refused as `load` refuses: a language model in place of a
    reward model, rows longer than it reads. A judge is not planned yet: refused in one line."""
    scorings = []
    for term in terms:
      if isinstance(term, JudgeTerm):
        raise UserError("reward term 'judge': the plan does not count a judge's sampling yet; plan the run without "
                        'it (--set rewards=...)')
      if not os.path.isfile(os.path.join(term.path, 'config.json')):
        raise UserError(f'reward term {term.name!r}: path {term.path} has no config.json (the reward model\'s '
                        'architecture, which the plan reads without its weights)')
      config = load_hf_config(term.path)
      if not config.num_labels:
        raise UserError(f'reward term {term.name!r}: {term.path} is a language model ({config.architecture}), not a '
                        'reward model: a reward model is a sequence classifier with a score head')
      check_reward_model_length(config, row_length, 0, term.path)
      check_mesh(config, mesh)
      graphdef, state = nnx.split(abstract_model(config, scoring_options(policy, term.dtype)))
      params = sharding.placed_abstract(state, sharding.state_shardings(state, mesh))
      scorings.append(RewardModelScoring(term.label, term.path, graphdef, params))
    return cls(tuple(scorings))

  def traced(self) -> 'ModelScores':
    """The same models, their programs traced inside the caller's jit (the K-steps loop)."""
    return ModelScores(tuple(scoring.traced() for scoring in self.scorings))

  def __call__(self, prompts: Prompts, rollout: Rollout) -> dict:
    return {scoring.label: scoring(prompts, rollout) for scoring in self.scorings}
