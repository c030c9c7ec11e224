"""QwenEngine (JetStream Engine API) and slot refilling against transformers and the full forward."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest
import torch
from flax import nnx

from engine_driver import generate_groups
from runs import one_local_device
from grpo_jax.model import from_pretrained
from grpo_jax.sampler import DecodeSettings, SamplingConfig
from grpo_jax.serve.engine import QwenEngine
from grpo_jax.serve.tokenizer import pad_prompt
from grpo_jax.testing import left_padded, random_prompts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GREEDY = SamplingConfig(greedy=True)


def transformers_greedy(reference, prompt, max_new_tokens):
  with torch.no_grad():
    out = reference.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens,
                             eos_token_id=None, pad_token_id=0)
  return out[0, len(prompt):].numpy()


def full_forward_log_probs(model, pairs, temperature=1.0):
  """log softmax(logits / T) of each completion token, from one forward over the right-padded
  batch of prompt + completion sequences. pairs: [(prompt, completion)] -> one array per pair."""
  sequences = [list(prompt) + list(completion) for prompt, completion in pairs]
  width = max(map(len, sequences))
  tokens = np.zeros((len(sequences), width), np.int32)
  mask = np.zeros((len(sequences), width), np.int32)
  for row, sequence in enumerate(sequences):
    tokens[row, :len(sequence)], mask[row, :len(sequence)] = sequence, 1
  logits = np.asarray(nnx.jit(lambda m, t, s: m(t, segment_ids=s))(model, tokens, mask), np.float64) / temperature
  results = []
  for row, (prompt, completion) in enumerate(pairs):
    step_logits = logits[row, len(prompt) - 1:len(prompt) + len(completion) - 1]
    step_logits -= step_logits.max(-1, keepdims=True)
    log_softmax = step_logits - np.log(np.exp(step_logits).sum(-1, keepdims=True))
    results.append(np.take_along_axis(log_softmax, np.asarray(completion)[:, None], axis=-1)[:, 0])
  return results


def decode(engine, params, state, steps):
  """Runs `steps` generate calls -> (state, [ResultTokens as numpy] per step)."""
  results = []
  for _ in range(steps):
    state, result = engine.generate(params, state)
    results.append(result.convert_to_numpy())
  return state, results


@pytest.mark.parametrize('family', [pytest.param('qwen2'), *[pytest.param(family, marks=pytest.mark.exhaustive)
                                                              for family in ('llama3', 'mistral', 'glm4', 'gemma3_text')]])
def test_greedy_matches_transformers_and_log_probs_match_full_forward(seed, make_hf_checkpoint, family):
  """The serving engine (JetStream's Engine API) on each family: greedy answers equal transformers',
  its log-probs the full forward's; prompts up to 17 tokens, past the test families' windows of 6-7."""
  from test_families import FAMILIES
  directory, reference = make_hf_checkpoint(seed, **(FAMILIES[family][0] if family != 'qwen2' else {}))
  model = from_pretrained(directory)
  engine = QwenEngine(model, slots=4, max_prefill_length=32,
                      settings=DecodeSettings(max_new_tokens=8, sampling=GREEDY))
  params = engine.load_params()
  state = engine.init_decode_state()
  prompts = random_prompts(seed, [5, 17, 11])
  slots = [3, 0, 2]  # slot 1 stays free
  for prompt, slot in zip(prompts, slots):
    prefix = engine.prefill(params=params, padded_tokens=pad_prompt(prompt, 32), true_length=len(prompt))
    state = engine.insert(prefix, state, slot)
  state, steps = decode(engine, params, state, 9)
  pairs, engine_log_probs = [], []
  for prompt, slot in zip(prompts, slots):
    tokens = np.array([step.get_result_at_slot(slot).tokens[0, 0] for step in steps])
    valid = np.array([step.get_result_at_slot(slot).valid[0, 0] for step in steps])
    lengths = np.array([step.get_result_at_slot(slot).lengths[0] for step in steps])
    np.testing.assert_array_equal(tokens[:8], transformers_greedy(reference, prompt, 8))
    np.testing.assert_array_equal(valid, [1] * 8 + [0])  # max_new_tokens reached: the slot is done
    np.testing.assert_array_equal(lengths, [1, 2, 3, 4, 5, 6, 7, 8, 8])
    pairs.append((prompt, tokens[:8]))
    engine_log_probs.append(np.array([step.log_probs[slot] for step in steps[:8]]))
  assert not any(step.valid[1] for step in steps)
  for actual, expected in zip(engine_log_probs, full_forward_log_probs(model, pairs)):
    np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-4)


@pytest.mark.exhaustive
def test_one_prefill_shared_by_group_equals_separate_prefills(seed, make_hf_checkpoint):
  """A prompt prefilled once and inserted into G slots samples exactly what G prefills would."""
  directory, _ = make_hf_checkpoint(seed)
  model = from_pretrained(directory)
  sampling = SamplingConfig(temperature=1.0, top_k=50)
  prompt = random_prompts(seed, [9])[0]

  def run(shared):
    engine = QwenEngine(model, slots=3, max_prefill_length=16, seed=seed,
                        settings=DecodeSettings(max_new_tokens=6, sampling=sampling))
    params, state = engine.load_params(), engine.init_decode_state()
    prefix = None
    for slot in range(3):
      if prefix is None or not shared:
        prefix = engine.prefill(params=params, padded_tokens=pad_prompt(prompt, 16), true_length=len(prompt))
      state = engine.insert(prefix, state, slot)
    state, results = decode(engine, params, state, 6)
    tokens, log_probs = (np.stack([getattr(r, name) for r in results], 1) for name in ('tokens', 'log_probs'))
    return engine.prefill_count, tokens, log_probs

  shared_count, shared, shared_log_probs = run(shared=True)
  separate_count, separate, _ = run(shared=False)
  assert (shared_count, separate_count) == (1, 3)
  np.testing.assert_array_equal(shared, separate)
  assert len({tuple(row) for row in shared}) > 1  # each slot samples with its own key
  expected = full_forward_log_probs(model, [(prompt, row) for row in shared])
  for row in range(3):
    np.testing.assert_allclose(shared_log_probs[row], expected[row], rtol=0, atol=1e-4)


@pytest.mark.exhaustive
def test_refilling_few_slots_equals_one_slot_per_request(seed, make_hf_checkpoint):
  directory, reference = make_hf_checkpoint(seed)
  model = from_pretrained(directory)
  prompts = random_prompts(seed, [7, 12, 4])

  def run(slots, sampling, stop=()):
    engine = QwenEngine(model, slots=slots, max_prefill_length=16,
                        settings=DecodeSettings(max_new_tokens=10, sampling=sampling, stop_token_ids=stop, pad_id=-1))
    completions = generate_groups(engine, engine.load_params(), prompts, group_size=2,
                                  key=jax.random.key(seed), check_every=3)
    return engine.prefill_count, completions

  count, free = run(8, GREEDY)
  assert count == 3
  for p, prompt in enumerate(prompts):
    for g in range(2):
      np.testing.assert_array_equal(free.tokens[2 * p + g], transformers_greedy(reference, prompt, 10))
  assert free.mask.all() and free.finish_reasons == ['length'] * 6

  stop = int(free.tokens[0, 2])  # ends row 0 early, and others wherever it appears
  count, narrow = run(2, GREEDY, stop=(stop,))  # 6 requests through 2 slots
  assert count == 3
  for row in range(6):
    hits = np.flatnonzero(free.tokens[row] == stop)
    end = hits[0] + 1 if len(hits) else 10
    assert narrow.lengths[row] == end
    assert narrow.finish_reasons[row] == ('stop' if len(hits) else 'length')
    np.testing.assert_array_equal(narrow.tokens[row, :end], free.tokens[row, :end])
    assert (narrow.tokens[row, end:] == -1).all() and not narrow.mask[row, end:].any()
    assert narrow.mask[row, :end].all() and (narrow.log_probs[row, end:] == 0).all()

  sampling = SamplingConfig(temperature=0.8, top_p=0.95)
  _, wide = run(6, sampling)
  _, narrow = run(4, sampling)  # per-request keys: slot placement does not change the samples
  np.testing.assert_array_equal(wide.tokens, narrow.tokens)
  np.testing.assert_allclose(wide.log_probs, narrow.log_probs, rtol=0, atol=1e-5)  # batch size B differs
  expected = full_forward_log_probs(model, [(prompts[row // 2], narrow.tokens[row]) for row in range(6)], 0.8)
  for row in range(6):
    np.testing.assert_allclose(narrow.log_probs[row], expected[row], rtol=0, atol=1e-4)


def test_core_modules_do_not_import_jetstream_or_tensorflow():
  code = ('import sys, grpo_jax, grpo_jax.sampler, grpo_jax.serve.engine, grpo_jax.build, '
          'grpo_jax.serve.tokenizer, grpo_jax.train, grpo_jax.eval, grpo_jax.serve.__main__; '
          'print(sorted({m.split(".")[0] for m in sys.modules} & {"jetstream", "tensorflow", "seqio"}))')
  result = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, JAX_PLATFORMS='cpu'))
  assert result.returncode == 0, result.stderr
  assert result.stdout.strip() == '[]'


@pytest.mark.exhaustive
def test_engine_on_a_mesh_shards_the_decode_state_and_matches_transformers(seed, make_hf_checkpoint):
  from grpo_jax.sharding import MeshConfig, make_mesh
  directory, reference = make_hf_checkpoint(seed)
  mesh = make_mesh(MeshConfig(data=1, fsdp=2, tensor=2), devices=jax.devices()[:4])
  model = from_pretrained(directory, mesh=mesh)
  engine = QwenEngine(model, slots=4, max_prefill_length=16, settings=DecodeSettings(max_new_tokens=6, sampling=GREEDY))
  assert engine.mesh is mesh
  prompts = random_prompts(seed, [3, 10, 8, 5])
  completions = generate_groups(engine, engine.load_params(), prompts)
  state = engine.init_decode_state()
  assert state.cache.k.sharding.spec == jax.sharding.PartitionSpec(None, 'fsdp', None, 'tensor')
  assert state.live.sharding.spec == jax.sharding.PartitionSpec('fsdp')
  for row, prompt in enumerate(prompts):
    np.testing.assert_array_equal(completions.tokens[row], transformers_greedy(reference, prompt, 6))


@pytest.mark.exhaustive
def test_engine_in_the_sampler_layout_matches_transformers(seed, make_hf_checkpoint):
  """serve's layout on the 8 test devices: 4 groups of 2, weights split over each pair (KV heads
  too) and replicated over the groups, which share the slots."""
  from grpo_jax.sampler.layout import serving_mesh
  directory, reference = make_hf_checkpoint(seed)
  mesh = serving_mesh(2, kv_heads=2)
  assert mesh.shape == dict(data=4, fsdp=1, tensor=2, expert=1, context=1)
  model = from_pretrained(directory, mesh=mesh)
  engine = QwenEngine(model, slots=4, max_prefill_length=16, settings=DecodeSettings(max_new_tokens=6, sampling=GREEDY))
  prompts = random_prompts(seed, [3, 10, 8, 5])
  completions = generate_groups(engine, engine.load_params(), prompts)
  state = engine.init_decode_state()
  assert state.cache.k.sharding.spec == jax.sharding.PartitionSpec(None, 'data', None, 'tensor')
  assert model.layers.gate_weight[...].sharding.spec == jax.sharding.PartitionSpec(None, None, 'tensor')
  for row, prompt in enumerate(prompts):
    np.testing.assert_array_equal(completions.tokens[row], transformers_greedy(reference, prompt, 6))


@pytest.mark.parametrize('devices', [8, pytest.param(1, marks=pytest.mark.exhaustive)], ids=['mesh', 'one-device'])
def test_serve_lays_a_mixture_over_the_expert_axis_and_matches_transformers(seed, make_hf_checkpoint, monkeypatch,
                                                                             devices):
  """serve's engine for a Qwen3-MoE checkpoint on the 8 test devices (`--tensor 2`): the trainer's
  sampler layout, tensor pairs with the 8 experts split over the 4 pairs (the expert axis), which
  also split the slots; and on a host of one device. Greedy answers equal transformers'."""
  from grpo_jax.serve.__main__ import build_engine, parse_args
  from test_moe import CASES
  if devices == 1:
    one_local_device(monkeypatch)
  directory, reference = make_hf_checkpoint(seed, **CASES['top2-norm-tied'])
  engine, _ = build_engine(parse_args(['--ckpt', directory, '--port', '0', '--slots', '4', '--tensor',
                                       str(min(devices, 2)), '--dtype', 'float32', '--greedy', '--max-new-tokens', '6',
                                       '--token-ids-only']))  # serve's default dtype is bfloat16
  params = engine.load_params()
  layers = params['layers']
  experts = 4 if devices == 8 else 1
  assert dict(layers['expert_up_weight'][...].sharding.mesh.shape) == dict(data=1, fsdp=1, expert=experts, context=1,
                                                                           tensor=min(devices, 2))
  assert len(layers['expert_up_weight'][...].sharding.device_set) == devices
  if devices > 1:
    assert layers['expert_up_weight'][...].sharding.spec[1] == 'expert'  # [Ls, E, D, M]: the experts split
    assert engine.init_decode_state().cache.k.sharding.spec[1] == 'expert'  # the slots split over the groups
  prompts = random_prompts(seed, [3, 10, 8, 5, 7])
  completions = generate_groups(engine, params, prompts)
  for row, prompt in enumerate(prompts):
    np.testing.assert_array_equal(completions.tokens[row], transformers_greedy(reference, prompt, 6))


@pytest.mark.exhaustive
def test_prefill_skips_the_bos_placeholder_and_continues_an_existing_prefix(seed, make_hf_checkpoint):
  """JetStream prepends bos_id (-1 for Qwen) to token requests; a prefix can be extended by a
  second prefill. Both must decode as the plain concatenated prompt."""
  directory, reference = make_hf_checkpoint(seed)
  model = from_pretrained(directory)
  engine = QwenEngine(model, slots=3, max_prefill_length=32, settings=DecodeSettings(max_new_tokens=6, sampling=GREEDY))
  params, state = engine.load_params(), engine.init_decode_state()
  rejected = engine.prefill(params=params, padded_tokens=np.full(16, -1), true_length=1)  # no real token
  state = engine.insert(rejected, state, 2)
  first, second = random_prompts(seed, [5, 7])
  with_bos = pad_prompt([-1] + first, 16)
  prefix = engine.prefill(params=params, padded_tokens=with_bos, true_length=len(first) + 1)
  state = engine.insert(prefix, state, 0)
  longer = engine.prefill(params=params, existing_prefix=prefix, padded_tokens=pad_prompt(second, 16),
                          true_length=len(second))
  state = engine.insert(longer, state, 1)
  steps = []
  for _ in range(6):
    state, result = engine.generate(params, state)
    steps.append(np.asarray(result.tokens))
    assert list(np.asarray(result.valid)) == [True, True, False]  # the empty request finishes at once
  steps = np.stack(steps, 1)
  np.testing.assert_array_equal(steps[0], transformers_greedy(reference, first, 6))
  np.testing.assert_array_equal(steps[1], transformers_greedy(reference, first + second, 6))


@pytest.mark.exhaustive
def test_group_sampler_and_engine_give_the_same_samples_for_the_same_key(seed, make_hf_checkpoint):
  """One prefill, one decode step, one PRNG policy: the trainer's jitted group sampler (left-padded
  batch, P x G rows in one loop) and the engine's slot refilling (right-padded prompts, 4 slots)
  draw the same tokens for request p * G + g from the same key."""
  from grpo_jax.sampler.rollout import GroupSampler
  directory, _ = make_hf_checkpoint(seed)
  model = from_pretrained(directory)
  prompts = random_prompts(seed, [7, 12, 3])
  sampling = SamplingConfig(temperature=1.0, top_k=50)
  free = DecodeSettings(max_new_tokens=10, sampling=sampling)
  first = generate_groups(QwenEngine(model, slots=4, max_prefill_length=16, settings=free), nnx.state(model),
                          prompts, group_size=3, key=jax.random.key(seed))
  stop = int(first.tokens[1, 4])  # ends some rows early on both paths
  settings = DecodeSettings(max_new_tokens=10, sampling=sampling, stop_token_ids=(stop,), pad_id=-1)
  tokens, mask = left_padded(prompts)
  grouped = jax.device_get(GroupSampler(model, group_size=3, settings=settings)(
      nnx.state(model), tokens, mask, jax.random.key(seed)))
  engine = generate_groups(QwenEngine(model, slots=4, max_prefill_length=16, settings=settings), nnx.state(model),
                           prompts, group_size=3, key=jax.random.key(seed))
  assert len({tuple(row) for row in engine.tokens}) > 3  # the requests really sample
  assert 0 < int(np.sum(engine.stopped)) < 9
  np.testing.assert_array_equal(grouped.tokens, engine.tokens)
  np.testing.assert_array_equal(grouped.lengths, engine.lengths)
  assert grouped.finish_reasons == engine.finish_reasons
  np.testing.assert_allclose(grouped.log_probs, engine.log_probs, rtol=0, atol=1e-5)
