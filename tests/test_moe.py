"""Qwen3-MoE: logits, routes and the load-balancing loss against transformers' Qwen3MoeForCausalLM on
random tiny checkpoints (greedy decoding against its `generate`: test_rollout.py); conversion both ways; the sampler's
recorded routes and their replay in the trainer (model/moe.py)."""

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import load_file

from grpo_jax.errors import UserError
from grpo_jax.model import ModelOptions, from_pretrained
from grpo_jax.model.config import Qwen2Config
from grpo_jax.model.hf_config import from_hf_dict
from grpo_jax.model.lora import LoraConfig
from grpo_jax.model.moe import route_dtype
from grpo_jax.model.qwen2 import Qwen2
from grpo_jax.rl import algo
from grpo_jax.rl.algo import AlgoConfig
from grpo_jax.rl.loss import LossInputs, log_probs_of, policy_loss
from grpo_jax.sampler.decode import DecodeSettings
from grpo_jax.sampler.rollout import GroupSampler
from grpo_jax.sampler.sampling import SamplingConfig
from grpo_jax.testing import left_padded, random_prompts

FP32_TOLERANCE = 1e-4
MOE = dict(model_type='qwen3_moe', num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, head_dim=16)
CASES = {  # top-k 1, 2 and 8; dense layers mixed in by mlp_only_layers and decoder_sparse_step
    'top1-mlp-only-layer': dict(MOE, num_experts_per_tok=1, mlp_only_layers=[1]),
    'top2-norm-tied': dict(MOE, norm_topk_prob=True, tie_word_embeddings=True),
    'top8-of-16-sparse-step-2': dict(MOE, num_experts=16, num_experts_per_tok=8, decoder_sparse_step=2,
                                     num_hidden_layers=4),
}


def reference_routes(reference, tokens, mask) -> tuple[np.ndarray, np.ndarray, float]:
  """transformers' logits [B, T, V], each sparse layer's top-k experts [B, T, Ls, k] (as sets: sorted)
  and its load-balancing loss over the real tokens."""
  with torch.no_grad():
    out = reference(torch.tensor(tokens, dtype=torch.long), attention_mask=torch.tensor(mask),
                    output_router_logits=True)
  k = reference.config.num_experts_per_tok
  experts = [torch.topk(torch.softmax(logits.float(), -1), k, dim=-1).indices.numpy() for logits in out.router_logits]
  routes = np.sort(np.stack(experts, axis=1).reshape(tokens.shape + (len(experts), k)), axis=-1)
  return out.logits.numpy(), routes, float(out.aux_loss)


@pytest.mark.parametrize('case', sorted(CASES))
def test_logits_routes_and_aux_loss_match_transformers(case, seed, make_hf_checkpoint):
  """Left-padded batches: three lengths, and three tokens in rows of 23 (with 3 * k < E, some
  experts receive no token). The routes are compared first, so the logits' parity never hinges on
  a near-tie."""
  directory, reference = make_hf_checkpoint(seed, **CASES[case])
  model = from_pretrained(directory)
  config = model.config
  assert config.num_params() == sum(p.numel() for p in reference.parameters())
  graphdef, state = nnx.split(model)

  @jax.jit
  def forward(state, tokens, mask):
    model = nnx.merge(graphdef, state)
    hidden, routing = model.hidden_states(tokens, segment_ids=mask, return_routing=True)
    return model.project(hidden), routing

  for lengths in ([7, 23, 3], [1, 2]):
    tokens, mask = left_padded(random_prompts(seed, lengths), width=23)
    expected_logits, expected_routes, expected_aux = reference_routes(reference, tokens, mask)
    logits, routing = forward(state, tokens, mask)
    real = mask.astype(bool)
    assert routing.experts.dtype == route_dtype(config.num_experts)
    np.testing.assert_array_equal(np.sort(np.asarray(routing.experts), axis=-1)[real], expected_routes[real])
    np.testing.assert_allclose(np.asarray(logits)[real], expected_logits[real], rtol=0, atol=FP32_TOLERANCE)
    np.testing.assert_allclose(float(routing.aux_loss()), expected_aux, rtol=1e-5)
    load = np.asarray(routing.load)
    np.testing.assert_array_equal(load.sum(axis=1), real.sum() * config.num_experts_per_tok)
    if real.sum() * config.num_experts_per_tok < config.num_experts:
      assert (load == 0).any()


def test_conversion_both_ways_is_bit_exact_with_per_expert_names(seed, make_hf_checkpoint, tmp_path):
  """hf -> orbax -> hf writes every tensor of transformers' save_pretrained, by name and bit for bit
  (the experts one tensor each, mlp.experts.{e}.gate_proj.weight), and a config transformers reads back."""
  import transformers

  from conversion import hf_to_orbax, orbax_to_hf

  directory, reference = make_hf_checkpoint(seed, **CASES['top1-mlp-only-layer'])
  hf_to_orbax.main(['--hf', str(directory), '--out', str(tmp_path / 'orbax')])
  orbax_to_hf.main(['--ckpt', str(tmp_path / 'orbax'), '--out', str(tmp_path / 'back')])
  original, back = load_file(os.path.join(directory, 'model.safetensors')), load_file(tmp_path / 'back' / 'model.safetensors')
  assert 'model.layers.0.mlp.experts.7.gate_proj.weight' in back and 'model.layers.1.mlp.gate_proj.weight' in back
  assert set(back) == set(original)
  for name, tensor in original.items():
    np.testing.assert_array_equal(back[name], tensor, err_msg=name)
  config = transformers.AutoConfig.from_pretrained(tmp_path / 'back')
  assert (config.num_experts, config.num_experts_per_tok, config.mlp_only_layers) == (8, 1, [1])
  raw = json.loads((tmp_path / 'back' / 'config.json').read_text())
  assert from_hf_dict(raw) == from_pretrained(directory).config


def test_hub_spelling_of_the_expert_count_is_read():
  raw = dict(architectures=['Qwen3MoeForCausalLM'], model_type='qwen3_moe', vocab_size=64, hidden_size=32,
             intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, rope_theta=1e6)
  assert from_hf_dict(raw).num_experts == 4
  raw['num_local_experts'] = raw.pop('num_experts')
  assert from_hf_dict(raw).num_experts == 4
  with pytest.raises(UserError, match='num_experts_per_tok must be in'):
    from_hf_dict(dict(raw, num_experts_per_tok=5))


def test_lora_on_moe_attention_builds_and_expert_adapters_are_refused():
  config = Qwen2Config(vocab_size=64, hidden_size=32, num_hidden_layers=2, attention_bias=False, qk_norm=True,
                       head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
  model = Qwen2(config, ModelOptions(lora=LoraConfig(targets=('q', 'v'))), rngs=nnx.Rngs(0))
  assert model.layers.q_lora_a.shape[0] == 2
  with pytest.raises(UserError, match="model.lora.targets 'gate': adapters on the routed experts are not built, and this mixture has no dense layer"):
    Qwen2(config, ModelOptions(lora=LoraConfig(targets=('q', 'gate'))), rngs=nnx.Rngs(0))


def _perturbed_router(model: Qwen2, seed: int, scale: float) -> nnx.State:
  state = nnx.state(model)
  router = state['layers']['router_weight']
  noise = jax.random.normal(jax.random.key(seed), router.shape) * scale
  router.set_value(router[...] + noise)
  return state


def test_replay_routes_to_the_recorded_experts_with_live_gates(seed, make_hf_checkpoint):
  """The sampler records every fed token's experts; the full forward of the same weights routes the
  same; with the router perturbed between sampling and training the live top-k differs, yet with
  replay the trainer computes with exactly the recorded experts, its gates from the live router
  (the router's gradient is not zero), and reports the tokens its live router would re-route."""
  directory, _ = make_hf_checkpoint(seed, **CASES['top2-norm-tied'])
  model = from_pretrained(directory)
  tokens, mask = left_padded(random_prompts(seed, [6, 13, 9]))
  settings = DecodeSettings(max_new_tokens=10, sampling=SamplingConfig(temperature=1.0), record_routes=True)
  rollout = GroupSampler(model, group_size=2, settings=settings)(nnx.state(model), tokens, mask, jax.random.key(seed))
  rows = np.repeat(tokens, 2, axis=0)
  sequence = np.concatenate([rows, np.asarray(rollout.tokens)], axis=1)
  segments = np.concatenate([np.repeat(mask, 2, axis=0), np.asarray(rollout.mask)], axis=1).astype(np.int32)
  recorded = np.asarray(rollout.routes)
  assert recorded.shape == sequence.shape + (2, 2) and recorded.dtype == np.uint8
  # Every real token but each answer's last was fed back and recorded; the rest are not.
  fed = segments.astype(bool).copy()
  fed[np.arange(len(fed)), tokens.shape[1] + np.asarray(rollout.lengths) - 1] = False
  assert (recorded[fed] < 8).all() and (recorded[~fed] == 255).all()

  graphdef = nnx.graphdef(model)

  def routed(state, routes):
    hidden, routing = nnx.merge(graphdef, state).hidden_states(sequence, segment_ids=segments, routes=routes,
                                                               return_routing=True)
    return routing

  own = routed(nnx.state(model), None)
  np.testing.assert_array_equal(np.sort(np.asarray(own.experts), -1)[fed], np.sort(recorded, -1)[fed])

  perturbed = _perturbed_router(model, seed, 0.3)
  live = routed(perturbed, None)
  replayed = routed(perturbed, jnp.asarray(recorded))
  # The first sparse layer sees the same input in both passes: where its live choice differs, the
  # replayed pass must report the token re-routed (deeper layers see replay-routed inputs).
  first_changed = np.any(np.sort(np.asarray(live.experts)[:, :, 0], -1) != np.sort(recorded[:, :, 0], -1), -1) & fed
  assert first_changed.any(), 'the perturbed router should choose other experts for some tokens'
  np.testing.assert_array_equal(np.asarray(replayed.experts)[fed], recorded[fed])
  differs = np.asarray(replayed.differs)
  assert differs[first_changed].all() and not differs[~fed].any()

  with_perturbed = nnx.merge(graphdef, perturbed)
  split_graph, router, rest = nnx.split(with_perturbed, lambda path, _: path[-1] == 'router_weight', ...)

  def loss(router):
    model_b = nnx.merge(split_graph, router, rest)
    return jnp.sum(model_b(sequence, segment_ids=segments, routes=jnp.asarray(recorded))[..., :5] ** 2)

  gradient = jax.grad(loss)(router)['layers']['router_weight'][...]
  assert float(jnp.abs(gradient).max()) > 0


# ---- replay in the update ----

MOE_ARCHITECTURE = Qwen2Config(vocab_size=1100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_bias=False,
                               qk_norm=True, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                               norm_topk_prob=True)


def perturbed_sampler(rng, params):
  """A copy of `params` whose router differs (0.3 x a standard normal added): some of the sampler's
  routes are then not the ones the trainer's would choose."""
  sampler = jax.tree.map(lambda p: p, params)
  router = sampler['layers']['router_weight']
  router.set_value(router[...] + jnp.asarray(0.3 * rng.standard_normal(router.shape), router.dtype))
  return sampler


def sampler_routes(graphdef, params, batch) -> jax.Array:
  """The experts a sampler with other weights chose for every real token of `batch` (padding unrecorded)."""
  _, routing = nnx.merge(graphdef, params).hidden_states(batch.tokens, segment_ids=batch.segment_ids,
                                                         return_routing=True)
  real = np.asarray(batch.segment_ids != 0)[..., None, None]
  return jnp.asarray(np.where(real, np.asarray(routing.experts), 255).astype(np.uint8))


@pytest.mark.exhaustive
def test_replayed_update_packed_equals_padded_and_starts_at_ratio_one(seed):
  """The sampler's routes (a perturbed router's) travel through packing: the packed update equals the
  padded one with pi_old, pi_theta and pi_ref replaying them, the auxiliary loss weighted in. pi_theta
  on the weights pi_old was scored with, both replaying: every ratio is exactly 1."""
  from test_packing import assert_packed_equals_padded, run_update
  from test_update import random_batch, random_model
  rng = np.random.default_rng(seed)
  graphdef, params = random_model(rng, MOE_ARCHITECTURE)
  sampler = perturbed_sampler(rng, params)
  _, ref_params = random_model(rng, MOE_ARCHITECTURE)
  batch = random_batch(rng)
  batch = batch.with_rollout(routes=sampler_routes(graphdef, sampler, batch))
  settings = dict(routing_replay='rollout', replay_reference=True, router_aux_loss_coef=0.05,
                  kl_beta=0.05, ppo_epochs=2, tis_cap=2.0)
  padded = run_update(settings, params, batch, seed, packed=False, ref_params=ref_params,
                      architecture=MOE_ARCHITECTURE)
  packed = run_update(settings, params, batch, seed, packed=True, ref_params=ref_params,
                      architecture=MOE_ARCHITECTURE)
  assert_packed_equals_padded(padded, packed, batch)
  metrics = padded[1]
  assert 0 < float(metrics['routing_replay_rerouted_frac']) <= 1 + 1e-5  # a mean of fractions, rounded
  assert float(metrics['router_aux_loss']) >= 1.0 and float(metrics['expert_load_max_over_mean']) >= 1.0
  # pi_old scored with replay, then the loss's pi_theta on the same weights: every ratio is exactly 1
  # (exp(0)), while the trainer's own routes would give other log-probs.
  inputs = LossInputs(batch=batch)
  model = nnx.merge(graphdef, params)
  old = log_probs_of(model, inputs, None, temperature=1.0, implementation='xla_chunked', replay=True)
  own = log_probs_of(model, inputs, None, temperature=1.0, implementation='xla_chunked')
  mask = np.asarray(batch.mask)
  assert np.abs(np.asarray(old) - np.asarray(own))[mask].max() > 1e-4
  weights = algo.aggregation_weights(batch.mask, 'token-mean')
  inputs = inputs.replace(old_log_probs=old, weights=weights, token_weights=weights)
  config = AlgoConfig(group_size=4, routing_replay='rollout', logprob_implementation='xla_chunked')
  _, metrics = policy_loss(params, graphdef, inputs, config, 1.0, on_policy=False)
  assert float(metrics['ratio_mean']) == pytest.approx(1.0, abs=1e-6)
  assert float(metrics['clip_frac_low']) == 0 and float(metrics['clip_frac_high']) == 0


def test_sorted_grouped_experts_equal_the_dense_path_with_gradients(seed):
  """The accelerators' path (pairs sorted by expert, grouped matmuls) against the CPU's (every expert on
  every token): outputs and gradients with respect to the input, the gates and the three weights,
  with one expert taking most pairs and others none."""
  from grpo_jax.model import moe
  rng = np.random.default_rng(seed)
  B, T, D, E, M, k = 3, 7, 16, 8, 12, 2
  x = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32)
  experts = rng.integers(0, 3, (B, T, k))  # experts 3..7 receive nothing
  experts[..., 0] = 1  # expert 1 takes most pairs
  experts[..., 1] = np.where(experts[..., 1] == 1, 2, experts[..., 1])  # a token's k experts differ
  experts = jnp.asarray(experts, jnp.int32)
  gates = jnp.asarray(rng.uniform(0.1, 1.0, (B, T, k)), jnp.float32)
  weights = [jnp.asarray(0.3 * rng.standard_normal(shape), jnp.float32) for shape in ((E, D, M), (E, D, M), (E, M, D))]
  probe = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32)

  def loss(path, x, gates, *weights):
    return jnp.sum(path(x, experts, gates, *weights) * probe)

  every = (0, 1, 2, 3, 4)
  dense = jax.value_and_grad(functools.partial(loss, moe.experts_dense), every)(x, gates, *weights)
  grouped = jax.value_and_grad(functools.partial(loss, moe.experts_forward), every)(x, gates, *weights)
  np.testing.assert_allclose(moe.experts_forward(x, experts, gates, *weights),
                             moe.experts_dense(x, experts, gates, *weights), rtol=1e-5, atol=1e-5)
  for a, b in zip(grouped[1], dense[1]):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.exhaustive
def test_remat_and_scan_give_the_same_gradients(seed):
  """The layers scanned and rematerialised (every layer sparse) against unrolled without remat."""
  config = MOE_ARCHITECTURE
  tokens = jnp.asarray(np.random.default_rng(seed).integers(0, config.vocab_size, (2, 9)), jnp.int32)
  grads = []
  for options in (ModelOptions(remat='full', scan_layers=True), ModelOptions(scan_layers=False)):
    model = Qwen2(config, options, rngs=nnx.Rngs(seed % 1000))
    graphdef, state = nnx.split(model)
    grads.append(jax.grad(lambda s: jnp.sum(nnx.merge(graphdef, s)(tokens)[..., :7] ** 2))(state))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), *grads)
