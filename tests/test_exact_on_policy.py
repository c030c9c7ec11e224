"""algo.exact_on_policy (ops/fixed_order.py): the folds against NumPy; each fixed-order op the same
for a row whatever the batch, the columns or the padding around it; the sampler's log-probs
(prefill, decode, select) and the trainer's recomputation (padded rows, packed rows, other batch
compositions) bitwise equal for a dense model and a mixture with replayed routes, and not equal
when one fixed order is left out; RL runs whose sampler_gap_max is exactly 0 on every path (a run
in the fast tier, the others in test-all); and the combinations that cannot be exact refused."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from grpo_jax import config as config_lib
from grpo_jax.errors import UserError
from grpo_jax.model.config import Qwen2Config
from grpo_jax.model.loading import init_model
from grpo_jax.model.options import ModelOptions
from grpo_jax.ops import fixed_order, token_logprobs
from grpo_jax.sampler.sampling import SamplingConfig, select
from runs import ROOT, learning_env, read_metrics, train_here

DENSE = Qwen2Config(vocab_size=80, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, rope_theta=10000.0, attention_bias=True)
MIXTURE = dataclasses.replace(DENSE, attention_bias=False, qk_norm=True, num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=24, norm_topk_prob=True)
TEMPERATURE = 0.8


# ---- the folds against NumPy ----

def numpy_parts(x: np.ndarray) -> list[np.ndarray]:
  x = x.astype(np.float32)
  high = (x.view(np.uint32) & np.uint32(0xFFFFF000)).view(np.float32)
  return [high, (x - high).astype(np.float32)]


def numpy_fold_matmul(x: np.ndarray, w: np.ndarray) -> np.ndarray:
  """Each output a left-to-right fold over k of the parts' products, in fp32, as the docstring says."""
  xs, ws = numpy_parts(x), numpy_parts(w)
  acc = np.zeros((x.shape[0], w.shape[1]), np.float32)
  for k in range(x.shape[1]):
    term = None
    for a in xs:
      for b in ws:
        product = (a[:, k:k + 1] * b[k:k + 1, :]).astype(np.float32)  # exact: 12 x 12 bits
        term = product if term is None else (term + product).astype(np.float32)
    acc = (acc + term).astype(np.float32)
  return acc


def test_folds_equal_numpy_bitwise(seed):
  rng = np.random.default_rng(seed)
  for rows, inner, cols in ((5, 24, 7), (9, 150, 11)):  # written out, and the loop over blocks (zero-padded)
    x, w = rng.standard_normal((rows, inner)).astype(np.float32), rng.standard_normal((inner, cols)).astype(np.float32)
    ours = np.asarray(jax.jit(fixed_order.fold_matmul)(x, w))
    np.testing.assert_array_equal(ours, numpy_fold_matmul(x, w))
    np.testing.assert_allclose(ours, x.astype(np.float64) @ w.astype(np.float64), rtol=1e-5, atol=1e-5)
  terms = rng.standard_normal((3, 90)).astype(np.float32)
  expected = np.zeros(3, np.float32)
  for index in range(terms.shape[1]):
    expected = (expected + terms[:, index]).astype(np.float32)
  np.testing.assert_array_equal(np.asarray(jax.jit(fixed_order.fold_sum)(terms)), expected)
  logits = rng.standard_normal((4, 33)).astype(np.float32) * 3
  targets = rng.integers(0, 33, 4)
  ours = np.asarray(jax.jit(fixed_order.token_log_probs, static_argnums=2)(logits, targets, TEMPERATURE))
  scaled = logits.astype(np.float64) / TEMPERATURE
  reference = scaled[np.arange(4), targets] - np.log(np.exp(scaled).sum(-1))
  np.testing.assert_allclose(ours, reference, rtol=1e-6, atol=1e-6)


def test_each_op_gives_a_row_the_same_bits_whatever_surrounds_it(seed):
  """Rows of a matmul against fewer rows and a slice of the columns; attention over the same keys
  with masked keys before them, split into parts; the exact log-prob op over other token blocks."""
  rng = np.random.default_rng(seed)
  x, w = rng.standard_normal((40, 70)).astype(np.float32), rng.standard_normal((70, 24)).astype(np.float32)
  full = np.asarray(jax.jit(fixed_order.fold_matmul)(x, w))
  for rows, cols in ((1, slice(None)), (7, slice(3, 17)), (33, slice(8, None))):
    np.testing.assert_array_equal(np.asarray(jax.jit(fixed_order.fold_matmul)(x[-rows:], w[:, cols])),
                                  full[-rows:, cols])
  batch, length, heads, kv_heads, dim = 3, 9, 4, 2, 8
  q, k, v = (rng.standard_normal((batch, length, n, dim)).astype(np.float32) for n in (heads, kv_heads, kv_heads))
  causal = np.broadcast_to(np.tril(np.ones((length, length), bool)), (batch, length, length))
  attend = jax.jit(fixed_order.fixed_attention)
  alone = np.asarray(attend(q, k, v, causal))
  for pad in (1, 20, 75):  # masked keys (a cache's empty slots) before the sequence's
    noise = rng.standard_normal((2, batch, pad, kv_heads, dim)).astype(np.float32)
    padded = attend(q, np.concatenate([noise[0], k], 1), np.concatenate([noise[1], v], 1),
                    np.concatenate([np.zeros((batch, length, pad), bool), causal], 2))
    np.testing.assert_array_equal(np.asarray(padded), alone)
  np.testing.assert_array_equal(np.asarray(attend(q[:1], k[:1], v[:1], causal[:1])), alone[:1])
  h, lm = rng.standard_normal((300, 24)).astype(np.float32), rng.standard_normal((24, 50)).astype(np.float32)
  y = rng.integers(0, 50, 300)
  op = jax.jit(lambda h, y: token_logprobs(h, lm, y, temperature=TEMPERATURE, implementation='exact'))
  whole = np.asarray(op(h, y))
  np.testing.assert_array_equal(np.asarray(op(h[13:20], y[13:20])), whole[13:20])
  logits = np.asarray(jax.jit(fixed_order.fold_matmul)(h[13:20], lm))
  _, sampled = select(jnp.asarray(logits), jax.random.key(0), SamplingConfig(temperature=TEMPERATURE, exact=True))
  picked = np.asarray(fixed_order.token_log_probs(jnp.asarray(logits), jnp.asarray(y[13:20]), TEMPERATURE))
  np.testing.assert_array_equal(picked, whole[13:20])
  assert np.isfinite(np.asarray(sampled)).all()


# ---- the sampler's log-probs and the trainer's, on a model ----

def random_exact_model(architecture: Qwen2Config, seed: int, dtype: str = 'float32'):
  model = init_model(architecture, options=ModelOptions(exact=True, dtype=dtype, param_dtype='float32'), seed=0)
  graphdef, params = nnx.split(model)
  rng = np.random.default_rng(seed)
  params = jax.tree.map(lambda p: p + jnp.asarray(0.05 * rng.standard_normal(p.shape), p.dtype), params)
  return graphdef, params


PROMPTS, NEW = (5, 3, 7, 6), 4  # prompt lengths (left-padded to 7), new tokens per row


def sample(graphdef, params, prompts: np.ndarray, seed: int):
  """The sampler's path for rows of left-padded prompts: a prefill, then NEW decode steps, each
  token drawn by `select` with its log-prob. -> (tokens [B, NEW], log-probs [B, NEW], routes)."""
  out = jax.jit(lambda params, prompts: _sample(graphdef, params, prompts, seed))(params, jnp.asarray(prompts))
  return np.asarray(out[0]), np.asarray(out[1]), out[2]


def _sample(graphdef, params, prompts, seed: int):
  model = nnx.merge(graphdef, params)
  rows, width = prompts.shape
  segments = (prompts != 0).astype(jnp.int32)
  cache = model.init_cache(rows, width + NEW)
  out = model.extend(prompts, cache, segment_ids=segments, return_hidden=True,
                     return_routing=bool(model.config.num_experts))
  hidden, cache = out[:2]
  routes = [out[2].experts] if model.config.num_experts else []
  settings = SamplingConfig(temperature=TEMPERATURE, exact=True)
  tokens, log_probs = [], []
  key = jax.random.key(seed)
  for step in range(NEW):
    token, log_prob = select(model.project(hidden[:, -1:])[:, 0], jax.random.fold_in(key, step), settings)
    tokens.append(token)
    log_probs.append(log_prob)
    if step < NEW - 1:
      out = model.extend(token[:, None], cache, return_hidden=True, return_routing=bool(model.config.num_experts))
      hidden, cache = out[:2]
      if model.config.num_experts:
        routes.append(out[2].experts)
  routes = jnp.concatenate(routes, axis=1) if routes else None
  return jnp.stack(tokens, 1), jnp.stack(log_probs, 1), routes


def trainer_padded(graphdef, params, sequences: np.ndarray, segments: np.ndarray, routes, order):
  """The update's recomputation of padded rows (another order of the rows, the routes replayed)."""
  rows = jnp.asarray(sequences[order])
  replay = None if routes is None else jnp.pad(routes[order], ((0, 0), (0, 1), (0, 0), (0, 0)),
                                               constant_values=np.iinfo(np.asarray(routes).dtype).max)

  @jax.jit
  def recompute(params, rows, segments, replay):
    model = nnx.merge(graphdef, params)
    hidden = model.hidden_states(rows, segment_ids=segments, routes=replay)[:, -NEW - 1:-1]
    return token_logprobs(hidden, model.lm_head_weight(), rows[:, -NEW:], temperature=TEMPERATURE,
                          implementation='exact')
  return np.asarray(recompute(params, rows, jnp.asarray(segments[order]), replay))[np.argsort(order)]


def trainer_packed(graphdef, params, sequences: np.ndarray, segments: np.ndarray, routes, offset: int):
  """The update's recomputation with the sequences packed two to a row, unpadded, after `offset`
  pad tokens: each sequence at another place in its row than in the sampler's."""
  real = [row[segment != 0] for row, segment in zip(sequences, segments)]
  real_routes = None if routes is None else [np.asarray(r)[s[:-1] != 0] for r, s in zip(routes, segments)]
  width = offset + max(len(real[i]) + len(real[i + 1]) for i in range(0, len(real), 2))
  packed = np.zeros((len(real) // 2, width), np.int32)
  packed_segments = np.zeros_like(packed)
  packed_routes = None
  if routes is not None:
    packed_routes = np.full((len(real) // 2, width) + np.asarray(routes).shape[2:], np.iinfo(np.asarray(routes).dtype).max,
                            np.asarray(routes).dtype)
  spans = []
  for index, sequence in enumerate(real):
    row, start = index // 2, offset + (len(real[index - 1]) if index % 2 else 0)
    packed[row, start:start + len(sequence)] = sequence
    packed_segments[row, start:start + len(sequence)] = 1 + index % 2
    if routes is not None:
      packed_routes[row, start:start + len(sequence) - 1] = real_routes[index]
    spans.append((row, start + len(sequence) - NEW))
  @jax.jit
  def recompute(params, packed, packed_segments, packed_routes):
    model = nnx.merge(graphdef, params)
    hidden = model.hidden_states(packed, segment_ids=packed_segments, routes=packed_routes)
    return token_logprobs(hidden[:, :-1], model.lm_head_weight(), packed[:, 1:], temperature=TEMPERATURE,
                          implementation='exact')
  out = np.asarray(recompute(params, jnp.asarray(packed), jnp.asarray(packed_segments),
                             None if routes is None else jnp.asarray(packed_routes)))
  return np.stack([out[row, start - 1:start - 1 + NEW] for row, start in spans])


def sampler_and_trainer_gaps(architecture: Qwen2Config, seed: int, dtype: str = 'float32') -> list[float]:
  """max |sampler - trainer| over the sampled tokens, for each of the trainer's layouts."""
  graphdef, params = random_exact_model(architecture, seed, dtype)
  rng = np.random.default_rng(seed)
  width = max(PROMPTS)
  prompts = np.zeros((len(PROMPTS), width), np.int32)
  for row, length in enumerate(PROMPTS):
    prompts[row, width - length:] = rng.integers(1, architecture.vocab_size, length)
  tokens, sampled, routes = sample(graphdef, params, prompts, seed)
  sequences = np.concatenate([prompts, tokens], axis=1)
  segments = (sequences != 0).astype(np.int32)
  segments[:, width:] = 1
  layouts = [trainer_padded(graphdef, params, sequences, segments, routes, np.arange(len(PROMPTS))),
             trainer_padded(graphdef, params, sequences[:2], segments[:2], None if routes is None else routes[:2],
                            np.array([1, 0])),
             trainer_packed(graphdef, params, sequences, segments, routes, offset=3)]
  gaps = [float(np.abs(layouts[0] - sampled).max()), float(np.abs(layouts[1] - sampled[:2]).max()),
          float(np.abs(layouts[2] - sampled).max())]
  assert np.isfinite(sampled).all() and (sampled < 0).all()
  return gaps


@pytest.mark.parametrize('architecture', [DENSE, pytest.param(MIXTURE, marks=pytest.mark.exhaustive)],
                         ids=['dense', 'mixture, replayed'])
def test_sampler_and_trainer_log_probs_are_bitwise_equal(seed, architecture):
  """Padded rows in the sampler's order, two rows alone and reversed, and rows packed two at a time
  after 3 pads: max |log p_sampler - log p_trainer| == 0 on each."""
  assert sampler_and_trainer_gaps(architecture, seed) == [0.0, 0.0, 0.0]


# The vocabulary of test_update's model: its log-softmax's library sum differs by batch here.
WIDE_VOCABULARY = dataclasses.replace(DENSE, vocab_size=1100)


@pytest.mark.exhaustive  # 15 s each
@pytest.mark.parametrize('left_out', ['matmul', 'attention', 'settle'])
def test_each_fixed_order_is_needed(seed, left_out):
  """With one op given back its library order, some layout's log-probs differ from the sampler's.
  Not 'sum' (the norms' mean of squares, the router's softmax) nor 'log_softmax' (the vocabulary's
  sum): XLA:CPU's own row reductions came out batch-invariant at every shape tried (V 80 to 1,100),
  so leaving either out breaks nothing here; both stay folded so that no backend's reduction
  strategy decides, which is measured on CPU only."""
  with fixed_order.leave_out(left_out):
    gaps = [max(sampler_and_trainer_gaps(WIDE_VOCABULARY, seed + offset)) for offset in range(2)]
  assert max(gaps) > 0, (left_out, gaps)


# ---- RL runs ----

RUN = ('train.steps=2', 'train.steps_per_call=1', 'train.checkpoint_every=0', 'train.tensorboard=false', 'eval.every=0',
       'algo.exact_on_policy=true')


def assert_exact(rows, lag_zero_only=False):
  assert len(rows) == 2
  for row in rows:
    name = 'sampler_gap_mean/lag_0' if lag_zero_only else 'sampler_gap_max'
    assert row[name] == 0.0, (row['step'], name, row[name])


PATHS = {
    'packed in micro-batches, 2 devices': ('configs/tiny_arith.yaml', ('algo.packing=true',
                                                                     'algo.micro_batch_tokens=256'), 2),
    # Each group's prompt once per row, its completions branches after it (rows of 4 sequences' width).
    'tree-packed, 2 devices': ('configs/tiny_arith.yaml', ('algo.packing=true', 'algo.tree_packing=true',
                                                          'algo.pack_length=36', 'algo.micro_batch_tokens=256'), 2),
    # The sampler's tensor-parallel layout against the trainer's FSDP one, which has a tensor axis too.
    'micro-batches, 8 devices, both tensor-parallel': ('configs/tiny_arith.yaml', (
        'rollout.tensor=2', 'mesh.tensor=2', 'algo.micro_batch_size=64'), 8),
    'bf16 compute': ('configs/tiny_arith.yaml', ('model.dtype=bfloat16',), 1),
    'mixture, routing replay': ('configs/tiny_arith_moe.yaml', (), 2),
    'vision-language': ('configs/tiny_spot.yaml', (), 1),
}


@pytest.mark.exhaustive  # 20-55 s each
@pytest.mark.parametrize('name', PATHS)
def test_exact_runs_log_no_gap_on_every_path(tmp_path, name):
  config, overrides, devices = PATHS[name]
  rows = train_here(tmp_path, config, *RUN, *overrides, devices=devices)
  assert_exact(rows)
  if 'algo.tree_packing=true' in overrides:  # the prompts were shared
    assert all(row['packed_tokens'] < row['sequence_tokens'] for row in rows)


@pytest.mark.exhaustive  # 30 s
def test_partial_rollouts_sampled_under_the_update_s_weights_log_no_gap(tmp_path):
  """At max_lag 1 the tokens sampled under the weights being trained (lag 0) are exact."""
  rows = train_here(tmp_path, 'configs/tiny_arith.yaml', *RUN, 'algo.max_lag=1', 'algo.tis_cap=2.0')
  assert_exact(rows, lag_zero_only=True)
  assert all(row['lag_frac/0'] > 0 for row in rows)


@pytest.mark.exhaustive  # 60 s: a subprocess compiling at XLA's default level, as users run
@pytest.mark.long
def test_an_exact_run_at_the_default_optimisation_level_logs_no_gap(tmp_path):
  import subprocess
  import sys
  command = [sys.executable, '-m', 'grpo_jax.train', '--config', f'{ROOT}/configs/tiny_arith_moe.yaml', '--workdir',
             str(tmp_path)]
  command += [part for override in RUN + ('algo.micro_batch_size=64',) for part in ('--set', override)]
  result = subprocess.run(command, cwd=ROOT, env=learning_env(2), capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  assert_exact(read_metrics(tmp_path))


# ---- what cannot be exact ----

REFUSED = {
    'rollout.weights=int8': r"^rollout\.weights 'int8' samples from other weights .* algo\.exact_on_policy",
    'rollout.kv_cache=fp8': r"^rollout\.kv_cache 'fp8' rounds the cached keys .* algo\.exact_on_policy",
    'algo.logprob_implementation=xla_chunked': r'^algo\.logprob_implementation .*algo\.exact_on_policy',
    'model.decode_attention=blockwise': r'^model\.decode_attention .*algo\.exact_on_policy',
    'model.attention=cudnn': r'^model\.attention .*algo\.exact_on_policy',
    'mesh.expert=2': r'^mesh\.expert \(2\).*algo\.exact_on_policy',
    'mesh.context=2': r'^mesh\.context \(2\): ring attention .*algo\.exact_on_policy',
}


@pytest.mark.parametrize('override', REFUSED)
def test_what_cannot_be_exact_is_refused_in_one_line(override):
  with pytest.raises(UserError, match=REFUSED[override]) as error:
    config_lib.load_config(f'{ROOT}/configs/tiny_arith.yaml', ['algo.exact_on_policy=true', override])
  assert '\n' not in str(error.value)


def test_the_option_sets_the_policy_s_numerics_and_leaves_them_alone_without_it():
  on = config_lib.load_config(f'{ROOT}/configs/tiny_arith.yaml', ['algo.exact_on_policy=true'])
  off = config_lib.load_config(f'{ROOT}/configs/tiny_arith.yaml', [])
  assert on.model.options.exact and on.algo.logprob_implementation == 'exact'
  assert not off.model.options.exact and off.algo.logprob_implementation == 'auto'
