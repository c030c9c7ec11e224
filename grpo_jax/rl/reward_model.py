"""A reward model scoring an RL step's completions in the mesh: the program that turns the step's
prompts [P, Tp] and sampled completions [P*G, N] into one score per completion [P*G], jitted and
batched over the step, with the reward model's weights resident on the devices like the policy's.

This is the path where the reward model reads the policy's tokens as they are: its tokenizer is the
policy's, and the conversation is the prompt as the policy's chat template rendered it followed by
the completion. Each row is the prompt's real tokens, then the completion's, every other position
the reward model's pad id, and the score is read where transformers reads it: the row's rightmost
token that is not the pad id (model/qwen2.py score_positions), so a completion that ends in an eos
that is the pad id is read at the token before it, as transformers reads the same text.

Length: a row is Tp + N tokens, and a reward model reads at most its `max_position_embeddings`; a run
whose rows can be longer is refused at start (`check_reward_model_length`) rather than cut, since a
cut prompt is another conversation and a cut completion another answer.
"""

import jax
import jax.numpy as jnp

from grpo_jax.errors import UserError
from grpo_jax.model.config import Qwen2Config
from grpo_jax.sharding import constrain


def check_reward_model_length(config: Qwen2Config, prompt_length: int, max_new_tokens: int, path: str) -> None:
  """One line when a step's rows (prompt_length + max_new_tokens) can be longer than the reward
  model reads (its max_position_embeddings)."""
  rows = prompt_length + max_new_tokens
  if rows > config.max_position_embeddings:
    raise UserError(f'the reward model {path} reads at most {config.max_position_embeddings} tokens (its '
                    f'max_position_embeddings), but a prompt of up to {prompt_length} tokens with '
                    f'rollout.max_new_tokens {max_new_tokens} makes rows of {rows}; lower one of them')


def completion_rows(prompt_tokens: jax.Array, prompt_mask: jax.Array, completions: jax.Array,
                    completion_mask: jax.Array, pad_id: int) -> tuple[jax.Array, jax.Array]:
  """(tokens, mask) [P*G, Tp + N]: each of the P prompts' G completions after its prompt, every
  position that is neither (the prompt's left padding, what follows the completion) the reward
  model's `pad_id`; mask 1 on the prompt's and the completion's tokens."""
  rows = completions.shape[0]
  group = rows // prompt_tokens.shape[0]
  prompts, prompt_masks = jnp.repeat(prompt_tokens, group, axis=0), jnp.repeat(prompt_mask, group, axis=0)
  mask = jnp.concatenate([prompt_masks, completion_mask], axis=1).astype(jnp.int32)
  tokens = jnp.where(mask == 1, jnp.concatenate([prompts, completions], axis=1), pad_id).astype(jnp.int32)
  return tokens, mask


def score_completions(model, prompt_tokens: jax.Array, prompt_mask: jax.Array, completions: jax.Array,
                      completion_mask: jax.Array) -> jax.Array:
  """The reward model's score [P*G] fp32 of each completion after its prompt (module docstring).
  Traceable: the step jits it, with the rows laid out along the mesh's batch axes."""
  c = model.config
  if not c.num_labels or c.pad_token_id is None:
    raise UserError('scoring completions needs a reward model with a pad_token_id (a sequence classifier)')
  tokens, mask = completion_rows(prompt_tokens, prompt_mask, completions, completion_mask, c.pad_token_id)
  tokens, mask = constrain(tokens, ('batch', 'seq')), constrain(mask, ('batch', 'seq'))
  return model.scores(tokens, segment_ids=mask)[:, 0]
