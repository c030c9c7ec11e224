"""The update's batch: a scored rollout beside the prompts it answers, one row per completion.

A Batch holds the sampler's Rollout itself rather than a copy of its fields: every per-token field
the rollout carries (log-probs, masks, versions, routes, and any added later) reaches the update
and travels with its rows through the update's shuffles, mini-batches, micro-batches and data
replicas, whose row operations map over every leaf but the prompts' images (`map_rows`). The
padded sequences the model reads, `tokens` and `segment_ids` [B, Tp + N], are the prompt joined
with the completion. A prompt's images are held once, not once per row: the update runs the vision
tower once per prompt and its G rows take the features (`vision.prompt` names each row's).
"""

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from grpo_jax.model.vision import Images, RowImages
from grpo_jax.sampler.rollout import Rollout


@struct.dataclass
class Batch:
  """A scored rollout ready for the update; B = P * G rows, Tp prompt tokens, N completion tokens.

  prompt_tokens  [B, Tp] int32      each row's left-padded prompt
  prompt_mask    [B, Tp] int32      1 on real prompt tokens
  rollout        Rollout of the B rows, decode_steps None (a count of the loop, not a row's: every
                 leaf here leads with the rows): the completions [B, N], their mask
                 (the stop token included), the sampler's log pi(y_t) (for the TIS correction), and
                 every other per-row field it recorded (sampler/rollout.py)
  advantages     [B] fp32
  lags           [B, N] int32 or None versions between each token's sampler and this policy (partial rollouts)
  images         Images of the P prompts [P, ...] (model/vision.py), each prompt's once, or None
                 (text): the one field that does not lead with the rows (map_rows leaves it)
  vision         RowImages [B, Tp + N] or None: each row's prompt among the P, its tokens' feature
                 placements and M-RoPE positions
  """

  prompt_tokens: jax.Array
  prompt_mask: jax.Array
  rollout: Rollout
  advantages: jax.Array
  lags: jax.Array | None = None
  images: Images | None = None
  vision: RowImages | None = None

  @classmethod
  def of_sequences(cls, tokens: jax.Array, segment_ids: jax.Array, mask: jax.Array, advantages: jax.Array,
                   sampler_log_probs: jax.Array, lags: jax.Array | None = None, routes: jax.Array | None = None,
                   images: Images | None = None, vision: RowImages | None = None) -> 'Batch':
    """The batch of padded sequences tokens [B, Tp + N] (segment_ids 1 on their real tokens), whose
    last N = mask.shape[1] tokens are the completions (mask [B, N] the trained ones among them);
    routes [B, Tp + N, Ls, k] the sampler's experts of every token; images [P, ...] the prompts'
    that `vision` [B, Tp + N] shows."""
    prompt_length = tokens.shape[1] - mask.shape[1]
    completion = segment_ids[:, prompt_length:] != 0
    rollout = Rollout(tokens=tokens[:, prompt_length:], log_probs=sampler_log_probs, mask=mask,
                      lengths=jnp.sum(mask, axis=1, dtype=jnp.int32), stopped=jnp.zeros(mask.shape[:1], bool),
                      context=completion, routes=routes)
    return cls(prompt_tokens=tokens[:, :prompt_length], prompt_mask=segment_ids[:, :prompt_length], rollout=rollout,
               advantages=advantages, lags=lags, images=images, vision=vision)

  @property
  def tokens(self) -> jax.Array:
    """[B, Tp + N] int32 the left-padded prompt followed by the completion."""
    return jnp.concatenate([self.prompt_tokens, self.rollout.tokens], axis=1)

  @property
  def segment_ids(self) -> jax.Array:
    """[B, Tp + N] int32 1 on real prompt tokens and on the completion's sequence, 0 on padding."""
    return jnp.concatenate([self.prompt_mask.astype(jnp.int32), self.rollout.sequence_mask.astype(jnp.int32)], axis=1)

  @property
  def mask(self) -> jax.Array:
    """[B, N] bool the trained completion tokens."""
    return self.rollout.mask

  @property
  def sampler_log_probs(self) -> jax.Array:
    """[B, N] fp32 the sampler's log pi(y_t)."""
    return self.rollout.log_probs

  @property
  def routes(self) -> jax.Array | None:
    """[B, Tp + N, Ls, k] the sampler's experts of every token (routing replay), or None."""
    return self.rollout.routes

  @property
  def completion_length(self) -> int:
    return self.rollout.mask.shape[1]

  @property
  def size(self) -> int:
    """B, the rows."""
    return self.advantages.shape[0]

  def map_rows(self, fn) -> 'Batch':
    """fn applied to every leaf that leads with the rows (all but the prompts' images): a field
    added later travels too."""
    return jax.tree.map(fn, self.replace(images=None)).replace(images=self.images)

  def without_images(self) -> 'Batch':
    """The rows without the prompts' images (once their features are computed)."""
    return self.replace(images=None)

  def with_rollout(self, **changes) -> 'Batch':
    """The batch with the rollout's fields `changes` replaced (e.g. log_probs, routes)."""
    return self.replace(rollout=dataclasses.replace(self.rollout, **changes))

  def masked(self, keep: jax.Array) -> 'Batch':
    """The batch with only the tokens `keep` [B, N] (or [B, 1]) marks among its trained ones."""
    return self.with_rollout(mask=self.rollout.mask & keep)

  def without_routes(self) -> 'Batch':
    """The batch without the sampler's experts: the model routes every token by its own router."""
    return self.with_rollout(routes=None)
