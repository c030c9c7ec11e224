"""Next-token selection: greedy, temperature, top-k and top-p (nucleus), as pure jittable functions.

The log-prob returned with each token is log softmax(logits / temperature)[token], the
distribution before top-k / top-p truncation. That is the quantity the trainer recomputes from
its own parameters (at the same temperature), so their ratio is the honest importance weight;
truncation only changes which tokens can be drawn.
"""

import argparse
import dataclasses
import math

import jax
import jax.numpy as jnp

from grpo_jax.errors import FieldError, UserError, require
from grpo_jax.ops import fixed_order


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """How each next token is chosen."""

  greedy: bool = False  # argmax; temperature, top_k and top_p are ignored
  temperature: float = 1.0  # T in softmax(logits / T); must be > 0 unless greedy
  top_k: int = 0  # keep the k most likely tokens; 0 keeps all
  top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches p; 1.0 keeps all
  # Ids at or above this are never drawn (an embedding table padded past its tokenizer); 0: none
  # excluded. A run with a teacher sets it to the tokenizer's size (the teacher's table may stop there).
  vocab_limit: int = 0
  # The log-prob returned with each token in fixed order (ops/fixed_order.token_log_probs: the
  # trainer's exact log-prob op's formula); what algo.exact_on_policy sets.
  exact: bool = False

  def __post_init__(self):
    require(self.greedy or self.temperature > 0, 'temperature', f'must be > 0, got {self.temperature}')
    require(self.top_k >= 0, 'top_k', f'must be >= 0, got {self.top_k}')
    require(0 < self.top_p <= 1, 'top_p', f'must be in (0, 1], got {self.top_p}')
    require(self.vocab_limit >= 0, 'vocab_limit', f'must be >= 0 (0: every id), got {self.vocab_limit}')


def add_sampling_flags(parser: argparse.ArgumentParser) -> None:
  """--greedy, --temperature, --top-k, --top-p: the command-line spelling of SamplingConfig."""
  parser.add_argument('--greedy', action='store_true', help='argmax decoding')
  parser.add_argument('--temperature', type=float, default=1.0)
  parser.add_argument('--top-p', type=float, default=1.0)
  parser.add_argument('--top-k', type=int, default=0)


def sampling_from_flags(args: argparse.Namespace) -> SamplingConfig:
  try:
    return SamplingConfig(greedy=args.greedy, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
  except FieldError as error:
    raise UserError(str(error.renamed('--' + error.field.replace('_', '-')))) from None


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


def block_log_masses(scaled: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
  """scaled [B, V] -> (grouped [B, V/block, block] padded with -inf, block log-masses [B, V/block]).

  Each block's log-mass is its own max plus the log-sum-exp below it, so every block keeps fp32
  relative precision however far it sits below the row's best token (no underflow to 0 at
  max - 87 as a row-wide shift would give); a block with no kept token gets -inf.
  """
  batch, vocab = scaled.shape
  pad = -vocab % block
  grouped = jnp.pad(scaled, ((0, 0), (0, pad)), constant_values=-jnp.inf).reshape(batch, -1, block)
  block_max = jnp.max(grouped, axis=-1)
  finite_max = jnp.where(jnp.isfinite(block_max), block_max, 0.0)
  mass = jnp.sum(jnp.exp(grouped - finite_max[..., None]), axis=-1)
  return grouped, jnp.where(mass > 0, finite_max + jnp.log(mass), -jnp.inf)


def draw(key: jax.Array, scaled: jax.Array) -> jax.Array:
  """One token per row from softmax(scaled) [B, V] (-inf marks excluded tokens) -> [B] int32.

  Exact, in two stages: a block of ~sqrt(V) tokens with probability proportional to its mass,
  then a token within it in proportion to its own probability; P(block) P(token | block) is the
  token's probability. Each stage is Gumbel-max (`jax.random.categorical`), so only ~2 sqrt(V)
  random numbers are drawn per row instead of V: on XLA:CPU the [B, V] threefry bits and the
  Gumbel transform cost more than the model step of a small model (measured in BENCHMARKS.md).
  """
  block = math.isqrt(scaled.shape[-1] - 1) + 1  # ceil(sqrt(V)): both stages draw ~sqrt(V) numbers
  grouped, block_logits = block_log_masses(scaled, block)
  block_key, token_key = jax.random.split(key)
  chosen = jax.random.categorical(block_key, block_logits, axis=-1)
  within = jnp.take_along_axis(grouped, chosen[:, None, None], axis=1)[:, 0]  # [B, block]
  offset = jax.random.categorical(token_key, within, axis=-1)
  return (chosen * block + offset).astype(jnp.int32)


def limited(scaled: jax.Array, vocab_limit: int) -> jax.Array:
  """scaled logits [B, V] with ids >= vocab_limit at -inf (vocab_limit 0: unchanged)."""
  if 0 < vocab_limit < scaled.shape[-1]:
    return jnp.where(jnp.arange(scaled.shape[-1]) < vocab_limit, scaled, -jnp.inf)
  return scaled


def select(logits: jax.Array, key: jax.Array, config: SamplingConfig) -> tuple[jax.Array, jax.Array]:
  """logits [B, V] -> (tokens [B] int32, log-probs [B] fp32 under softmax(logits / T)). Ids past
  config.vocab_limit are never drawn; like top-k / top-p they leave the log-prob's softmax whole."""
  logits = logits.astype(jnp.float32)
  if config.greedy:
    tokens = jnp.argmax(limited(logits, config.vocab_limit), axis=-1).astype(jnp.int32)
  else:
    tokens = draw(key, truncated_logits(limited(logits / config.temperature, config.vocab_limit), config.top_k,
                                        config.top_p))
  temperature = 1.0 if config.greedy else config.temperature
  if config.exact:
    return tokens, fixed_order.token_log_probs(logits, tokens, temperature)
  log_probs = jax.nn.log_softmax(logits if config.greedy else logits / temperature, axis=-1)
  return tokens, jnp.take_along_axis(log_probs, tokens[:, None], axis=-1)[:, 0]
