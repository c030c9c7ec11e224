"""Next-token selection: greedy, temperature, top-k and top-p (nucleus), as pure jittable functions.

The log-prob returned with each token is log softmax(logits / temperature)[token], the
distribution before top-k / top-p truncation. That is the quantity the trainer recomputes from
its own parameters (at the same temperature), so their ratio is the honest importance weight;
truncation only changes which tokens can be drawn.
"""

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """How each next token is chosen."""

  greedy: bool = False  # argmax; temperature, top_k and top_p are ignored
  temperature: float = 1.0  # T in softmax(logits / T); must be > 0 unless greedy
  top_k: int = 0  # keep the k most likely tokens; 0 keeps all
  top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches p; 1.0 keeps all

  def __post_init__(self):
    if not self.greedy and not self.temperature > 0:
      raise ValueError(f'temperature must be positive, got {self.temperature}')
    if self.top_k < 0:
      raise ValueError(f'top_k must be >= 0, got {self.top_k}')
    if not 0 < self.top_p <= 1:
      raise ValueError(f'top_p must be in (0, 1], got {self.top_p}')


def truncated_logits(scaled: jax.Array, top_k: int, top_p: float) -> jax.Array:
  """scaled logits [B, V] with tokens outside the top-k / top-p set at -inf.

  Ties at the top-k boundary keep every tied token; the top-p set always holds the most likely
  token and is cut where the cumulative probability of the tokens before a token reaches p.
  """
  if top_k > 0 and top_k < scaled.shape[-1]:
    kth = jax.lax.top_k(scaled, top_k)[0][:, -1:]
    scaled = jnp.where(scaled >= kth, scaled, -jnp.inf)
  if top_p < 1.0:
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # probability mass strictly ahead of each token
    keep_sorted = before < top_p
    keep = jnp.zeros_like(keep_sorted).at[jnp.arange(scaled.shape[0])[:, None], order].set(keep_sorted)
    scaled = jnp.where(keep, scaled, -jnp.inf)
  return scaled


def select(logits: jax.Array, key: jax.Array, config: SamplingConfig) -> tuple[jax.Array, jax.Array]:
  """logits [B, V] -> (tokens [B] int32, log-probs [B] fp32 under softmax(logits / T))."""
  logits = logits.astype(jnp.float32)
  if config.greedy:
    tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
  else:
    scaled = logits / config.temperature
    log_probs = jax.nn.log_softmax(scaled, axis=-1)
    tokens = jax.random.categorical(key, truncated_logits(scaled, config.top_k, config.top_p),
                                    axis=-1).astype(jnp.int32)
  return tokens, jnp.take_along_axis(log_probs, tokens[:, None], axis=-1)[:, 0]
