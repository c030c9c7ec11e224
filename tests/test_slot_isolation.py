"""One request never changes another's answer.

A decode slot's cache keeps whatever its last occupant (or nobody) wrote past the current
request's entries; masked attention must give those entries exactly no weight. The model writes
only finite keys and values (a request whose activations overflow leaves zeros, not NaN: 0 x NaN
is NaN), so what an occupant can leave is any finite value, however large. One poisoning test for
every path that admits requests into slots: the JetStream engine's insert, the group sampler's
refills (each decode attention), the pool of partial rollouts and the inference server's kept
caches. Every KV cache a path allocates starts as large garbage (up to the dtype's largest finite
value) instead of zeros, and each request's tokens and log-probs must equal a clean run's bit for
bit. Bad ids are refused at the doors that take them, before they reach a slot.
"""

import asyncio
import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from engine_driver import generate_groups
from test_partial import Driver, decode_settings
from grpo_jax.agents.inference import InferenceServer, Request
from grpo_jax.model import ModelOptions, from_pretrained
from grpo_jax.model.qwen2 import Qwen2
from grpo_jax.model.token_ids import TokenIdError, check_token_ids
from grpo_jax.sampler import DecodeSettings, SamplingConfig
from grpo_jax.sampler.rollout import sample_groups
from grpo_jax.serve.engine import QwenEngine
from grpo_jax.serve.tokenizer import pad_prompt
from grpo_jax.testing import left_padded, random_prompts

T1 = SamplingConfig(temperature=1.0)


@contextlib.contextmanager
def poisoned_caches():
  """While active, Qwen2.init_cache fills keys and values with large finite garbage (cycling along
  the cache slots and heads) instead of zeros: what a slot's last occupant might have left there."""
  original = Qwen2.init_cache

  def init_cache(self, batch_size, max_length, layered=False, windowed=False):
    def garbage(x):  # [..., B, S, K, H]
      big = float(jnp.finfo(x.dtype).max)
      index = sum(jax.lax.broadcasted_iota(jnp.int32, x.shape, axis) for axis in range(x.ndim - 4, x.ndim - 1))
      return jnp.asarray((big, -big, 3e4, -3e4), x.dtype)[index % 4]

    cache = original(self, batch_size, max_length, layered, windowed)
    window = cache.window  # a sliding layer's ring (model/cache.py WindowCache): poisoned as well
    if window is not None:
      each = lambda x: tuple(map(garbage, x)) if isinstance(x, tuple) else garbage(x)  # noqa: E731
      window = dataclasses.replace(window, k=each(window.k), v=each(window.v))
    return dataclasses.replace(dataclasses.replace(cache, window=None).map_layers(garbage), window=window)

  Qwen2.init_cache = init_cache
  try:
    yield
  finally:
    Qwen2.init_cache = original


def clean_and_poisoned(run):
  """run() once with zeroed caches and once with poisoned ones -> both results on the host."""
  clean = jax.device_get(run())
  with poisoned_caches():
    poisoned = jax.device_get(run())
  return clean, poisoned


def assert_same(clean, poisoned, fields=('tokens', 'log_probs', 'lengths')):
  for name in fields:
    want, got = np.asarray(getattr(clean, name)), np.asarray(getattr(poisoned, name))
    assert np.isfinite(got).all() if got.dtype.kind == 'f' else True, name
    np.testing.assert_array_equal(got, want, err_msg=name)


@pytest.fixture
def directory(seed, make_hf_checkpoint):
  return make_hf_checkpoint(seed)[0]


@pytest.fixture
def windowed_directory(seed, make_hf_checkpoint):
  """Gemma 3's local and global layers (tests/test_families.py), a window of 6 tokens: the slots'
  local layers keep rings of 6 entries, cleared between requests."""
  from test_families import FAMILIES
  return make_hf_checkpoint(seed, **FAMILIES['gemma3_text'][0])[0]


# 'unrolled': the GPU's decode step, its cache one array per layer (KVCache.layered).
@pytest.mark.parametrize('layers', ['scan', pytest.param('unrolled', marks=pytest.mark.exhaustive)])
def test_engine_insert(seed, directory, layers):
  """Two slots, six requests of three prompts: slots are refilled after other requests."""
  model = from_pretrained(directory, options=ModelOptions(decode_layers=layers))
  prompts = random_prompts(seed, [3, 9, 5])

  def run():
    engine = QwenEngine(model, slots=2, max_prefill_length=16, settings=decode_settings(seed, 10, stops=30), seed=seed % 1000)
    assert engine.init_decode_state().cache.layered == (layers == 'unrolled')
    return generate_groups(engine, engine.load_params(), prompts, group_size=2, check_every=2)

  assert_same(*clean_and_poisoned(run))


# 'unrolled': the GPU's decode loop, whose dense attention reads a cache of one array per layer,
# here with each prompt read once for its rows (ModelOptions.prompt_reads).
@pytest.mark.parametrize('implementation, block, layers, windowed', [
    ('dense', 4, 'scan', False), ('blockwise', 4, 'unrolled', True),
    *(pytest.param(*case, marks=pytest.mark.exhaustive)
      for case in [('dense', 4, 'unrolled', False), ('blockwise', 4, 'scan', False), ('pallas', 128, 'scan', False),
                   ('dense', 4, 'scan', True)])])
def test_group_sampler_refills(seed, request, directory, implementation, block, layers, windowed):
  """windowed: a model with sliding layers, whose slots keep their window ring."""
  if windowed:
    directory = request.getfixturevalue('windowed_directory')
  model = from_pretrained(directory, options=ModelOptions(decode_attention=implementation, decode_block=block,
                                                          decode_layers=layers,
                                                          prompt_reads='once' if layers == 'unrolled' else 'copy'))
  graphdef, params = nnx.split(model)
  tokens, mask = left_padded(random_prompts(seed, [4, 11, 7]))

  def run():  # traced anew for each run: the poisoned one must not reuse the clean one's program
    return jax.jit(lambda params, tokens, mask: sample_groups(
        nnx.merge(graphdef, params), tokens, mask, jax.random.key(seed % 1000), group_size=3,
        settings=decode_settings(seed, 12, stops=30), slots=4))(params, tokens, mask)

  assert_same(*clean_and_poisoned(run))


@pytest.mark.exhaustive
@pytest.mark.parametrize('windowed', [False, True])
def test_pool_of_partial_rollouts(seed, request, directory, windowed):
  """Answers cut off at one step go on at the next, prefilled again into refilled slots (with
  `windowed`, into the rings of a sliding-window model's local layers)."""
  model = from_pretrained(request.getfixturevalue('windowed_directory') if windowed else directory)
  graphdef, params = nnx.split(model)

  def run():
    driver = Driver(graphdef, prompts_per_step=3, group_size=3, max_lag=1, slots=5, settings=decode_settings(seed))
    driver.join(seed, 0)
    taken = []
    for step in range(3):
      driver.join(seed + 1 + step, step)
      taken.append(driver.step(params, step).rollout)
    return taken

  clean, poisoned = clean_and_poisoned(run)
  for clean_rollout, poisoned_rollout in zip(clean, poisoned):
    assert_same(clean_rollout, poisoned_rollout)


@pytest.mark.parametrize('layers', ['scan', pytest.param('unrolled', marks=pytest.mark.exhaustive)])
def test_inference_server_kept_caches(seed, directory, layers):
  """Conversations taking turns on two slots: a turn continues its kept cache or lands in a slot
  another conversation's longer context left behind."""
  model = from_pretrained(directory, options=ModelOptions(decode_layers=layers))
  graphdef, params = nnx.split(model)
  prompts = random_prompts(seed, [9, 2, 6])

  def run():
    server = InferenceServer(graphdef, settings=DecodeSettings(sampling=T1, max_new_tokens=4), slots=2,
                             max_context=40, chunk=2)
    server.bind(params)
    observations = np.random.default_rng(seed).integers(1, 1000, (9, 2))

    async def conversations():
      contexts, kept, answers = [list(p) for p in prompts], [None] * 3, []
      async with server:
        # Conversation 0 keeps its slot; 1 and 2 evict each other from the other one.
        for turn, index in enumerate((0, 1, 0, 2, 0, 1, 2, 1, 2)):
          answer = await server.generate(Request(tokens=tuple(contexts[index]), max_new_tokens=4,
                                                 key=jax.random.key(seed % 1000 + turn), continues=kept[index]))
          kept[index] = answer.cache_id
          answers.append(answer)
          contexts[index] += list(answer.tokens) + observations[turn].tolist()
      return answers

    answers = asyncio.run(conversations())
    return answers, server.stats.reused

  (clean, reused), (poisoned, _) = clean_and_poisoned(run)
  assert 0 < reused < 8  # some turns went on from a kept cache, others prefilled into another's slot
  for want, got in zip(clean, poisoned):
    assert got.tokens == want.tokens and got.log_probs == want.log_probs
    assert np.isfinite(got.log_probs).all()


def test_bad_ids_are_refused_at_the_engine_and_the_model(seed, directory):
  model = from_pretrained(directory)
  engine = QwenEngine(model, slots=1, max_prefill_length=16, settings=decode_settings(seed, 10, stops=30))
  params = engine.load_params()
  for ids, position, bad in (([5, 1000, 6], 1, 1000), ([5, 6, -5], 2, -5), ([-1, -1, 4], 1, -1)):
    with pytest.raises(TokenIdError, match=rf'token id {bad} at position {position} is outside the vocabulary'):
      engine.prefill(params=params, padded_tokens=pad_prompt(ids, 16), true_length=len(ids))
  # The leading -1 (JetStream's BOS placeholder) is skipped; padding past true_length is not read.
  engine.prefill(params=params, padded_tokens=pad_prompt([-1, 5, 6], 16, pad_id=99999), true_length=3)
  tokens = np.random.default_rng(seed).integers(0, 1000, (2, 6))
  tokens[1, 4] = 1000 + seed % 50
  with pytest.raises(TokenIdError, match=rf'model input: token id {tokens[1, 4]} at position 10 is outside'):
    model(tokens)
  assert check_token_ids([0, 999], 1000).tolist() == [0, 999]
  with pytest.raises(TokenIdError, match='token id 2.5 at position 1'):
    check_token_ids([1.0, 2.5], 1000)


def test_non_finite_keys_and_values_are_written_as_zeros(seed, directory):
  """A request whose activations overflow leaves zeros in its cache row, never NaN or inf, and the
  other rows' logits do not change; on a stacked cache and on a layered one (KVCache)."""
  model, poisoned = from_pretrained(directory), from_pretrained(directory)
  bad = 3 + seed % 900
  poisoned.embedding.set_value(poisoned.embedding[...].at[bad].set(jnp.inf))  # its RMS norm is NaN in every layer
  tokens = np.asarray(random_prompts(seed, [7, 7]), np.int32)
  tokens[tokens == bad] = bad + 1
  tokens[0, 3] = bad
  for layered in (False, True):
    logits, cache = poisoned.extend(tokens, poisoned.init_cache(2, 12, layered=layered))
    clean_logits, _ = model.extend(tokens, model.init_cache(2, 12, layered=layered))
    keys = np.stack(cache.k) if layered else np.asarray(cache.k)
    values = np.stack(cache.v) if layered else np.asarray(cache.v)
    assert np.isfinite(keys).all() and np.isfinite(values).all()
    np.testing.assert_array_equal(keys[:, 0, 3], 0)  # the bad token's own entries
    np.testing.assert_array_equal(values[:, 0, 3], 0)
    assert not np.isfinite(np.asarray(logits[0, 3:])).all()  # its own row's outputs are what they are
    np.testing.assert_array_equal(np.asarray(logits[1]), np.asarray(clean_logits[1]))
