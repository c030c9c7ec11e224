"""DeepSeek-V3 (model_type deepseek_v3: multi-head latent attention, DeepSeekMoE) against transformers'
DeepseekV3ForCausalLM on random tiny checkpoints: logits of left-padded rows (with and without
q_lora_rank, one expert group and several, YaRN with its mscale), the latent KV cache's absorbed
attention against the full-sequence forward, greedy decoding through continuous-batching slots
against `generate`, hf -> orbax -> hf conversion under the hub's names, an fp8 checkpoint with
128 x 128 block scales read dequantized (the ragged last block of a 576-row kv_a_proj_with_mqa),
routing replay with the choice bias, and the refusals."""

import dataclasses
import json
import os

import jax
import ml_dtypes
import numpy as np
import pytest
import torch
from flax import nnx

from conftest import greedy_answers, torch_logits
from conversion import hf_to_orbax, orbax_to_hf
from grpo_jax.errors import UserError
from grpo_jax.model import ModelOptions, from_hf_dict, from_pretrained, to_hf_dict
from grpo_jax.model.loading import abstract_model
from grpo_jax.model.weights import HFCheckpoint
from grpo_jax.sampler import DecodeSettings, SamplingConfig
from grpo_jax.sampler.rollout import GroupSampler
from grpo_jax.testing import left_padded, random_prompts

FP32_TOLERANCE = 1e-4
_BASE = dict(model_type='deepseek_v3', vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
             num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=128)
# Each shape's transformers keywords and what grpo_jax must read from them.
SHAPES = {
    # DeepSeek-V3's form: queries through a latent, 4 groups of which 2 are kept, a shared expert,
    # YaRN whose two mscales differ (cos and sin scaled, the softmax scale by mscale_all_dim's).
    'v3': (dict(_BASE, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10,
                n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5,
                rope_parameters=dict(rope_type='yarn', rope_theta=10000.0, factor=4.0, beta_fast=32, beta_slow=1,
                                     mscale=1.0, mscale_all_dim=0.8, original_max_position_embeddings=32)),
           dict(q_lora_rank=24, n_group=4, topk_group=2, rope_type='yarn', rope_interleaved=True, n_shared_experts=1)),
    # Moonlight's and DeepSeek-V2-Lite's form: q_proj directly, one group, two shared experts, plain
    # RoPE in the half-split pairing, no renormalisation of the chosen experts' scores.
    'moonlight': (dict(_BASE, q_lora_rank=None, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
                       v_head_dim=16, n_group=1, topk_group=1, n_shared_experts=2, routed_scaling_factor=1.5,
                       norm_topk_prob=False, rope_interleave=False,
                       rope_parameters=dict(rope_type='default', rope_theta=50000.0)),
                  dict(q_lora_rank=None, n_group=1, rope_type='default', rope_interleaved=False, norm_topk_prob=False)),
}


def model_of(directory, **options):
  return from_pretrained(directory, options=ModelOptions(**options)) if options else from_pretrained(directory)


@pytest.mark.parametrize('shape', list(SHAPES))
def test_logits_match_transformers(shape, seed, make_hf_checkpoint):
  """Left-padded rows give each real token the logits transformers gives the unpadded sequence."""
  hf_fields, expected = SHAPES[shape]
  directory, reference = make_hf_checkpoint(seed, **hf_fields)
  model = model_of(directory)
  assert model.config.mla and model.config.router_scoring == 'sigmoid'
  for name, value in expected.items():
    assert getattr(model.config, name) == value, name
  prompts = random_prompts(seed, [21, 4, 13], vocab=model.config.vocab_size)
  tokens, mask = left_padded(prompts)
  logits = np.asarray(jax.jit(lambda t, m: model(t, segment_ids=m))(tokens, mask))
  for row, prompt in enumerate(prompts):
    np.testing.assert_allclose(logits[row, -len(prompt):], torch_logits(reference, [prompt])[0], rtol=0,
                               atol=FP32_TOLERANCE, err_msg=f'row {row}')


@pytest.mark.parametrize('shape', ['v3', pytest.param('moonlight', marks=pytest.mark.exhaustive)])
def test_the_latent_cache_holds_the_latent_and_equals_the_full_forward(shape, seed, make_hf_checkpoint):
  """The cache keeps R + Hr values per token and layer (no values of its own); a prefill in two
  chunks and token-by-token decoding over it (the absorbed form) give the full-sequence forward's
  (the expanded form's) logits to 1e-5."""
  directory, _ = make_hf_checkpoint(seed, **SHAPES[shape][0])
  model = model_of(directory)
  c = model.config
  prompts = random_prompts(seed, [11, 6], vocab=c.vocab_size)
  tokens, mask = left_padded(prompts)
  rng = np.random.default_rng(seed)
  follow = rng.integers(3, c.vocab_size, (2, 4)).astype(np.int32)
  whole = np.concatenate([tokens, follow], axis=1)
  whole_mask = np.concatenate([mask, np.ones_like(follow)], axis=1)
  graphdef, state = nnx.split(model)
  expected = np.asarray(jax.jit(lambda s, t, m: nnx.merge(graphdef, s)(t, segment_ids=m))(state, whole, whole_mask))
  extend = jax.jit(lambda s, t, cache, m: nnx.merge(graphdef, s).extend(t, cache, segment_ids=m))

  cache = model.init_cache(2, whole.shape[1])
  assert cache.k.shape == (c.num_hidden_layers, 2, whole.shape[1], 1, c.kv_lora_rank + c.qk_rope_head_dim)
  assert cache.v.shape[-1] == 0
  first, cache = extend(state, tokens[:, :5], cache, mask[:, :5])
  second, cache = extend(state, tokens[:, 5:], cache, mask[:, 5:])
  steps = []
  for t in range(follow.shape[1]):
    out, cache = extend(state, follow[:, t:t + 1], cache, np.ones((2, 1), np.int32))
    steps.append(np.asarray(out))
  got = np.concatenate([np.asarray(first), np.asarray(second)] + steps, axis=1)
  real = whole_mask.astype(bool)
  np.testing.assert_allclose(got[real], expected[real], rtol=0, atol=1e-5)


@pytest.mark.parametrize('decode_attention', ['dense', pytest.param('blockwise', marks=pytest.mark.exhaustive)])
def test_greedy_decoding_through_slots_matches_generate(decode_attention, seed, make_hf_checkpoint):
  """Greedy answers through 2 decode slots for 3 prompts (a freed slot takes the next prompt) over the
  latent cache equal transformers' generate."""
  directory, reference = make_hf_checkpoint(seed, **SHAPES['v3'][0])
  model = model_of(directory, decode_attention=decode_attention)
  tokens, mask = left_padded(random_prompts(seed, [21, 4, 13], vocab=model.config.vocab_size))
  steps = 10
  settings = DecodeSettings(max_new_tokens=steps, sampling=SamplingConfig(greedy=True))
  rollout = GroupSampler(model, group_size=1, settings=settings, slots=2)(nnx.state(model), tokens, mask,
                                                                          jax.random.key(0))
  np.testing.assert_array_equal(np.asarray(rollout.tokens), greedy_answers(reference, tokens, mask, steps))


def test_conversion_both_ways_is_bit_exact_under_the_hub_names(seed, make_hf_checkpoint, tmp_path):
  """hf -> orbax -> hf gives back every tensor bit for bit under the hub's names (the latents'
  projections, the router's choice bias, the shared and routed experts), and transformers reads the
  config.json written back as the same architecture."""
  hf_dir, reference = make_hf_checkpoint(seed, shard_size='100KB', **SHAPES['v3'][0])
  orbax_dir, back_dir = str(tmp_path / 'orbax'), str(tmp_path / 'back')
  hf_to_orbax.main(['--hf', hf_dir, '--out', orbax_dir])
  orbax_to_hf.main(['--ckpt', orbax_dir, '--out', back_dir, '--like', hf_dir])
  original, restored = HFCheckpoint(hf_dir), HFCheckpoint(back_dir)
  assert sorted(restored.names()) == sorted(original.names())
  assert 'model.layers.1.mlp.gate.e_score_correction_bias' in original.names()
  for name in original.names():
    assert np.array_equal(restored.tensor(name), original.tensor(name)), name
  import transformers
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(back_dir).eval()
  tokens = np.random.default_rng(seed).integers(0, 300, (2, 24))
  np.testing.assert_array_equal(torch_logits(reloaded, tokens), torch_logits(reference, tokens))


def test_both_config_spellings_read_alike_and_write_back():
  """A hub config.json (DeepSeek-V3's keys, rope_scaling at the top) and transformers 5.x's respelling
  of it read as one architecture, and what grpo_jax writes reads back as itself."""
  import transformers
  raw = dict(architectures=['DeepseekV3ForCausalLM'], model_type='deepseek_v3', vocab_size=129280, hidden_size=7168,
             intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
             num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256, routed_scaling_factor=2.5,
             kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128,
             topk_method='noaux_tc', n_group=8, topk_group=4, num_experts_per_tok=8, first_k_dense_replace=3,
             norm_topk_prob=True, scoring_func='sigmoid', hidden_act='silu', max_position_embeddings=163840,
             rms_norm_eps=1e-06, rope_theta=10000, num_nextn_predict_layers=1, tie_word_embeddings=False,
             rope_scaling={'beta_fast': 32, 'beta_slow': 1, 'factor': 40, 'mscale': 1.0, 'mscale_all_dim': 1.0,
                           'original_max_position_embeddings': 4096, 'type': 'yarn'},
             bos_token_id=0, eos_token_id=1, torch_dtype='bfloat16',
             quantization_config={'activation_scheme': 'dynamic', 'fmt': 'e4m3', 'quant_method': 'fp8',
                                  'weight_block_size': [128, 128]})
  config = from_hf_dict(raw)
  assert (config.kv_lora_rank, config.q_lora_rank, config.resolved_head_dim, config.value_head_dim) == (512, 1536, 192,
                                                                                                       128)
  assert config.cache_entry == (1, 576, 0) and config.mlp_only_layers == (0, 1, 2)
  assert (config.rope_type, config.rope_factor, config.rope_mscale_all_dim) == ('yarn', 40.0, 1.0)
  assert config.attention_scale() == pytest.approx(192 ** -0.5 * (0.1 * np.log(40) + 1) ** 2)
  respelled = transformers.AutoConfig.for_model(**{k: v for k, v in raw.items() if k != 'quantization_config'})
  assert from_hf_dict(respelled.to_dict()) == config
  assert from_hf_dict(to_hf_dict(config)) == config
  written = transformers.AutoConfig.for_model(**to_hf_dict(config)).to_dict()
  assert from_hf_dict(written) == config


def _quantize_fp8(weight: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
  """weight [r, c] fp32 -> (fp8 e4m3 values, fp32 inverse scales [ceil(r / block), ceil(c / block)]),
  each block scaled so that its largest magnitude is e4m3's 448 (DeepSeek-V3's recipe)."""
  rows, columns = weight.shape
  scales = np.zeros((-(-rows // block), -(-columns // block)), np.float32)
  values = np.zeros(weight.shape, ml_dtypes.float8_e4m3fn)
  for i in range(scales.shape[0]):
    for j in range(scales.shape[1]):
      part = weight[i * block:(i + 1) * block, j * block:(j + 1) * block]
      scales[i, j] = np.abs(part).max() / 448.0
      values[i * block:(i + 1) * block, j * block:(j + 1) * block] = (part / scales[i, j]).astype(
          ml_dtypes.float8_e4m3fn)
  return values, scales


def test_an_fp8_checkpoint_with_block_scales_reads_dequantized(seed, make_hf_checkpoint, tmp_path):
  """The hub's fp8 layout (F8_E4M3 weights, `weight_scale_inv` per 128 x 128 block, quantization_config)
  on a checkpoint whose kv_a_proj_with_mqa has DeepSeek-V3's 576 rows (4 whole blocks and a ragged
  fifth of 64): every tensor reads as its values times its block's scale, bit for bit against NumPy,
  and the model's logits equal transformers' on the dequantized weights."""
  from safetensors.torch import save_file
  fields = dict(SHAPES['v3'][0], kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=16, v_head_dim=16,
                q_lora_rank=136)
  directory, reference = make_hf_checkpoint(seed, **fields)
  fp8_dir = tmp_path / 'fp8'
  fp8_dir.mkdir()
  tensors, expected = {}, {}
  stored = HFCheckpoint(directory)
  for name in stored.names():
    array = stored.tensor(name)
    # As the hub's checkpoint: every linear layer's weight in fp8 but the embedding, lm_head and router.
    quantized = array.ndim == 2 and not name.endswith(('embed_tokens.weight', 'lm_head.weight', 'mlp.gate.weight'))
    if not quantized:
      tensors[name] = torch.from_numpy(np.ascontiguousarray(array))
      expected[name] = array
      continue
    values, scales = _quantize_fp8(array, 128)
    tensors[name] = torch.from_numpy(values.view(np.uint8).copy()).view(torch.float8_e4m3fn)
    tensors[name + '_scale_inv'] = torch.from_numpy(scales)
    rows, columns = array.shape
    spread = np.kron(scales.astype(np.float64), np.ones((128, 128)))[:rows, :columns]
    expected[name] = (values.astype(np.float64) * spread).astype(np.float32)
  kv_a = 'model.layers.0.self_attn.kv_a_proj_with_mqa.weight'
  assert tensors[kv_a].shape == (576, 64) and tensors[kv_a + '_scale_inv'].shape == (5, 1)
  save_file(tensors, str(fp8_dir / 'model.safetensors'))
  with open(os.path.join(directory, 'config.json')) as f:
    config = json.load(f)
  config['quantization_config'] = {'quant_method': 'fp8', 'fmt': 'e4m3', 'activation_scheme': 'dynamic',
                                   'weight_block_size': [128, 128]}
  with open(fp8_dir / 'config.json', 'w') as f:
    json.dump(config, f)

  read = HFCheckpoint(str(fp8_dir))
  assert sorted(read.names()) == sorted(expected)
  for name, array in expected.items():
    assert np.array_equal(read.tensor(name), array), name
  model = from_pretrained(str(fp8_dir))
  dequantized = {name: torch.from_numpy(array) for name, array in expected.items()}
  import transformers
  twin = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
  missing, unexpected = twin.load_state_dict(_module_names(twin, dequantized), strict=False)
  assert not unexpected and all('e_score_correction_bias' not in name for name in missing)
  tokens = np.random.default_rng(seed).integers(3, 300, (2, 17))
  np.testing.assert_allclose(np.asarray(model(tokens)), torch_logits(twin, tokens), rtol=0, atol=FP32_TOLERANCE)

  bad = tmp_path / 'unscaled'
  bad.mkdir()
  save_file({k: v for k, v in tensors.items() if k != kv_a + '_scale_inv'}, str(bad / 'model.safetensors'))
  with open(bad / 'config.json', 'w') as f:
    json.dump({k: v for k, v in config.items() if k != 'quantization_config'}, f)
  with pytest.raises(UserError, match='quantization_config'):
    HFCheckpoint(str(bad))


def _module_names(model, tensors: dict) -> dict:
  """The hub's per-expert tensors as transformers 5.x's module holds them (gate_up_proj [E, 2M, D],
  down_proj [E, D, M] per layer)."""
  out = {name: t for name, t in tensors.items() if '.mlp.experts.' not in name}
  layers = sorted({int(name.split('.')[2]) for name in tensors if '.mlp.experts.' in name})
  for layer in layers:
    prefix = f'model.layers.{layer}.mlp.experts.'
    count = len({name.split('.')[5] for name in tensors if name.startswith(prefix)})
    gate = [tensors[f'{prefix}{e}.gate_proj.weight'] for e in range(count)]
    up = [tensors[f'{prefix}{e}.up_proj.weight'] for e in range(count)]
    out[prefix + 'gate_up_proj'] = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up)])
    out[prefix + 'down_proj'] = torch.stack([tensors[f'{prefix}{e}.down_proj.weight'] for e in range(count)])
  return out


def test_replay_keeps_the_recorded_experts_and_the_bias_only_chooses(seed, make_hf_checkpoint):
  """Routes recorded from one forward, replayed, give that forward's logits bit for bit; after the
  choice bias changes (so the live router chooses otherwise), the replayed forward still gives them,
  since the bias never weighs an expert, while the live forward moves and counts its re-routed
  tokens."""
  directory, _ = make_hf_checkpoint(seed, **SHAPES['v3'][0])
  model = model_of(directory)
  tokens, mask = left_padded(random_prompts(seed, [15, 9], vocab=model.config.vocab_size))
  hidden, routing = model.hidden_states(tokens, segment_ids=mask, return_routing=True)
  routes = routing.experts
  np.testing.assert_array_equal(np.asarray(model.hidden_states(tokens, segment_ids=mask, routes=routes)),
                                np.asarray(hidden))
  bias = model.layers.router_bias
  bias[...] = bias[...] + 5.0 * jax.random.normal(jax.random.key(seed % 2**31), bias.shape)
  live, moved = model.hidden_states(tokens, segment_ids=mask, return_routing=True)
  assert np.any(np.asarray(moved.experts) != np.asarray(routes))
  assert not np.allclose(np.asarray(live), np.asarray(hidden))
  replayed, again = model.hidden_states(tokens, segment_ids=mask, routes=routes, return_routing=True)
  np.testing.assert_array_equal(np.asarray(replayed), np.asarray(hidden))
  assert np.asarray(again.differs).any()


def test_refusals_name_the_field():
  raw = to_hf_dict(from_hf_dict({**SHAPES['v3'][0], 'architectures': ['DeepseekV3ForCausalLM'],
                                 'num_key_value_heads': 4}))
  for change, message in ((dict(attention_bias=True), 'attention_bias=true is not supported for deepseek_v3'),
                          (dict(scoring_func='softmax'), "a deepseek_v3 router is 'noaux_tc'"),
                          (dict(n_group=3), 'n_group (3) must split num_experts (8)'),
                          (dict(kv_lora_rank=None), 'missing field kv_lora_rank')):
    with pytest.raises(UserError, match=message.replace('(', r'\(').replace(')', r'\)')) as error:
      from_hf_dict({**raw, **change})
    assert '\n' not in str(error.value)
  from grpo_jax.model.loading import abstract_model
  with pytest.raises(UserError, match="model.decode_attention 'pallas'"):
    abstract_model(from_hf_dict(raw), ModelOptions(decode_attention='pallas'))
  with pytest.raises(UserError, match='algo.exact_on_policy'):  # refused until its sums are in fixed order
    abstract_model(from_hf_dict(raw), ModelOptions(exact=True))


def test_lora_on_the_latent_attention_and_shared_experts_equals_peft_and_the_cache(seed, make_hf_checkpoint,
                                                                                    tmp_path):
  """Adapters on every MLA projection (q_a, q_b, kv_a, kv_b, o), the dense layer's MLP and the shared
  experts: logits equal peft's LoRA on transformers' modules (each factor at its layer); decoding
  over the latent cache (kv_b's adapter folded into the absorbed weights) equals the adapted full
  forward. Refused in one line each: a target the architecture lacks (naming its projections), the
  MLP of a mixture without dense layers (naming what can be adapted), and a PEFT directory with the
  MLP's adapters (peft would put them on the routed experts: the merged export holds them)."""
  import peft
  from test_lora import _adapted
  from grpo_jax.model import lora
  from grpo_jax.model.lora import LoraConfig
  directory, reference = make_hf_checkpoint(seed, **SHAPES['v3'][0])
  settings = LoraConfig(rank=3, alpha=6.0, targets=('q_a', 'q_b', 'kv_a', 'kv_b', 'o', 'gate', 'down', 'shared_gate',
                                                    'shared_up', 'shared_down'))
  model = _adapted(directory, settings, seed)
  tokens = np.random.default_rng(seed).integers(3, 300, (2, 11))
  ours = np.asarray(model(tokens))
  assert np.abs(ours - np.asarray(model_of(directory)(tokens))).max() > 1e-2  # the adapters act
  # peft's LoRA on exactly these modules: by whole paths (a shared expert's gate_proj ends as the dense
  # layer's does), and under another model_type, which peft on transformers 5 would otherwise re-aim
  # at the routed experts' fused weights (save_peft's refusal).
  reference = reference.float()
  reference.config.model_type = 'deepseek_v3_modules_as_named'
  paths = '|'.join(lora.TARGETS[target][1].replace('.', r'\.') for target in settings.targets)
  peft_model = peft.get_peft_model(reference, peft.LoraConfig(r=3, lora_alpha=6.0, lora_dropout=0.0,
                                                              target_modules=rf'.*\.layers\.\d+\.({paths})'))
  tensors = lora.peft_tensors(nnx.state(model), settings, layers_of=lora.stacked_targets(model.config, settings))
  result = peft.set_peft_model_state_dict(peft_model, {name: torch.tensor(value) for name, value in tensors.items()})
  assert not result.unexpected_keys and not [name for name in result.missing_keys if 'lora' in name]
  assert len(tensors) == 2 * (3 * 5 + 2 + 2 * 3)  # A and B of each layer's attention, the dense MLP, the shared experts
  np.testing.assert_allclose(ours, torch_logits(peft_model, tokens), rtol=0, atol=FP32_TOLERANCE)
  graphdef, state = nnx.split(model)
  extend = jax.jit(lambda s, t, cache: nnx.merge(graphdef, s).extend(t, cache))
  prefill, cache = extend(state, tokens[:, :10], model.init_cache(2, 12))
  step, _ = extend(state, tokens[:, 10:], cache)
  np.testing.assert_allclose(np.concatenate([np.asarray(prefill), np.asarray(step)], axis=1), ours, rtol=0, atol=1e-5)
  with pytest.raises(UserError, match="'k': a deepseek_v3 model has no self_attn.k_proj; its projections are"):
    _adapted(directory, LoraConfig(rank=3, targets=('q_a', 'k')), seed)
  with pytest.raises(UserError, match="'up': adapters on the routed experts are not built, and this mixture has no "
                     "dense layer; target the attention projections or the shared experts"):
    abstract_model(dataclasses.replace(model.config, mlp_only_layers=()), ModelOptions(lora=LoraConfig(targets=('up',))))
  with pytest.raises(UserError, match="model.lora.targets 'gate': a PEFT directory of a deepseek_v3 model cannot "
                     r"carry adapters on its MLP .* export the merged model \(--merge-lora\)$"):
    lora.save_peft(nnx.state(model), settings, str(tmp_path / 'peft'), directory, model.config)
  assert not os.path.exists(tmp_path / 'peft')


@pytest.mark.exhaustive
@pytest.mark.long
def test_the_deepseek_v3_demo_learns_with_routing_replay(tmp_path):
  """configs/tiny_arith_mla.yaml (a DeepSeek-V3-shaped model: a query latent, a latent KV cache,
  grouped sigmoid routing, a shared expert, a dense first layer), trained with the sampler's routes
  replayed: from about nothing to a last-20 mean reward of 0.85 or more in 400 steps, its replay
  metrics logged. From the command line at XLA's default optimisation level, as a user runs it
  (runs.train_learning; seeds 0-4 by bench/demo_seeds.py on 2026-12-06: 0.892, 0.917, 0.876, 0.901,
  0.964). In this process's -O0 build seed 0 ends at 0.817: another trajectory, not a worse demo."""
  from runs import train_learning
  rows = train_learning(tmp_path, 'configs/tiny_arith_mla.yaml', 'train.progress=false', 'train.tensorboard=false',
                        'train.checkpoint_every=0')
  first = np.mean([row['reward_mean'] for row in rows[:10]])
  last = np.mean([row['reward_mean'] for row in rows[-20:]])
  assert first <= 0.05 and last >= 0.85, (first, last)
  assert {'routing_replay_rerouted_frac', 'expert_load_max_over_mean'} <= set(rows[-1])


@pytest.mark.exhaustive
def test_on_a_mesh_logits_equal_one_device_and_greedy_decoding_in_the_rollout_layout(seed, make_hf_checkpoint):
  """On data 1 x fsdp 2 x tensor 2 x expert 2 the logits equal one device's (heads over tensor, the
  latents replicated, the experts over the expert axis), and the sampler's own layout (its groups one
  device each: the latent cache's rows split over all 8) decodes greedily as transformers'
  generate does."""
  from grpo_jax.model import MeshConfig, make_mesh
  from grpo_jax.sampler.layout import rollout_layout
  from test_sharding import forward_on
  directory, reference = make_hf_checkpoint(seed, **SHAPES['v3'][0])
  tokens = np.random.default_rng(seed).integers(3, 300, (8, 24), dtype=np.int32)
  single = np.asarray(model_of(directory)(tokens))
  mesh = make_mesh(MeshConfig(data=1, fsdp=2, tensor=2, expert=2))
  model = from_pretrained(directory, mesh=mesh)
  assert model.layers.kv_b_weight[...].sharding.spec[2] == 'tensor'
  np.testing.assert_allclose(np.asarray(forward_on(model, mesh, tokens)), single, rtol=0,
                             atol=3.5e-6 * np.abs(single).max())
  prompts, mask = left_padded(random_prompts(seed, [21, 4, 13], vocab=300))
  steps = 10
  settings = DecodeSettings(max_new_tokens=steps, sampling=SamplingConfig(greedy=True))
  with jax.set_mesh(mesh):
    layout = rollout_layout(model, mesh)
    assert dict(layout.mesh.shape)['tensor'] == 1  # one latent head: no tensor groups by default
    sampler = GroupSampler(model, group_size=1, settings=settings, slots=2, layout=layout)
    rollout = jax.device_get(sampler(nnx.state(model), prompts, mask, jax.random.key(0)))
  np.testing.assert_array_equal(np.asarray(rollout.tokens), greedy_answers(reference, prompts, mask, steps))


@pytest.mark.exhaustive
def test_on_a_context_mesh_logits_equal_one_device(seed, make_hf_checkpoint):
  """Latent attention and DeepSeekMoE with the rows split along their length (fsdp 2 x expert 2 x
  context 2: the ring over the latent attention's expanded heads, the experts' tokens over rows x
  context): the logits of one device."""
  from grpo_jax.model import MeshConfig, make_mesh
  from test_sharding import forward_on
  directory, _ = make_hf_checkpoint(seed, **SHAPES['v3'][0])
  tokens = np.random.default_rng(seed).integers(3, 300, (4, 24), dtype=np.int32)
  single = np.asarray(model_of(directory)(tokens))
  mesh = make_mesh(MeshConfig(data=1, fsdp=2, tensor=1, expert=2, context=2))
  np.testing.assert_allclose(np.asarray(forward_on(from_pretrained(directory, mesh=mesh), mesh, tokens)), single,
                             rtol=0, atol=3.5e-6 * np.abs(single).max())


@pytest.mark.exhaustive
def test_packed_update_equals_padded(seed):
  """The RL update of a DeepSeek-V3-shaped model (a query latent, grouped sigmoid routing, a shared
  expert, a dense first layer) on packed rows equals the padded one: gradients and metrics."""
  from grpo_jax.model.config import Qwen2Config
  from test_packing import SETTINGS, assert_packed_equals_padded, exact_fill_batch, run_update
  from test_update import ARCHITECTURE, random_model
  architecture = Qwen2Config(
      vocab_size=ARCHITECTURE.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=4, family='deepseek_v3', attention_bias=False, qk_norm=False,
      rope_interleaved=True, router_scoring='sigmoid', q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
      qk_rope_head_dim=4, v_head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
      n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.0, norm_topk_prob=True,
      mlp_only_layers=(0,), rope_theta=10000.0)
  rng = np.random.default_rng(seed)
  _, params = random_model(rng, architecture)
  _, ref_params = random_model(rng, architecture)
  batch = exact_fill_batch(rng)
  settings = SETTINGS['token-mean, all terms']
  padded = run_update(settings, params, batch, seed, packed=False, ref_params=ref_params, architecture=architecture)
  packed = run_update(settings, params, batch, seed, packed=True, ref_params=ref_params, architecture=architecture)
  assert_packed_equals_padded(padded, packed, batch)


def test_the_optimizer_leaves_the_choice_bias_as_the_checkpoint_has_it():
  """The run's optimizer (its frozen parameters as build_rl_step takes them, weight decay on) moves
  the router and leaves DeepSeekMoE's choice bias untouched, holding no moments for it."""
  import optax
  from grpo_jax import config as config_lib
  from grpo_jax.build import frozen_parameters
  from grpo_jax.model.loading import abstract_model
  config = config_lib.load_config('configs/tiny_arith_mla.yaml', ['optim.weight_decay=0.5', 'optim.warmup_steps=0'])
  architecture = config.model.architecture
  assert frozen_parameters(config, architecture) == ('layers/router_bias',)
  optimizer, _ = config.optim.build(10, frozen=frozen_parameters(config, architecture))
  params = jax.tree.map(lambda p: jnp_normal(p.shape), nnx.state(abstract_model(architecture), nnx.Param))
  state = optimizer.init(params)
  updates, _ = optimizer.update(jax.tree.map(lambda p: p + 1.0, params), state, params)
  assert not np.asarray(updates['layers']['router_bias'][...]).any()
  assert np.abs(np.asarray(updates['layers']['router_weight'][...])).min() > 0
  masked = [leaf for leaf in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, optax.MaskedNode))
            if isinstance(leaf, optax.MaskedNode)]
  assert masked  # no moments for the bias


def jnp_normal(shape):
  import jax.numpy as jnp
  return jnp.asarray(np.random.default_rng(0).standard_normal(shape), jnp.float32)


def test_the_router_stays_in_fp32_in_a_bf16_model_and_its_sampler(seed, make_hf_checkpoint):
  """With bf16 weights and compute the router and its choice bias are held in fp32 (as transformers
  keeps gate.weight and e_score_correction_bias), in the trainer's state and in the sampler's
  resident copy, and the router's logits are computed in fp32."""
  from grpo_jax.model.moe import route, Router
  from grpo_jax.sampler.layout import rollout_layout
  from grpo_jax.model import MeshConfig, make_mesh
  directory, _ = make_hf_checkpoint(seed, **SHAPES['v3'][0])
  model = from_pretrained(directory, 'bfloat16')
  assert model.layers.router_weight[...].dtype == np.float32 and model.layers.router_bias[...].dtype == np.float32
  assert model.layers.q_a_weight[...].dtype == jax.numpy.bfloat16
  mesh = make_mesh(MeshConfig(data=1, fsdp=1, tensor=1), jax.devices()[:1])
  placed = rollout_layout(model, mesh).place(nnx.state(model))
  assert placed['layers']['router_weight'][...].dtype == np.float32
  assert placed['layers']['router_bias'][...].dtype == np.float32
  assert placed['layers']['kv_b_weight'][...].dtype == jax.numpy.bfloat16
  h = jax.numpy.asarray(np.random.default_rng(seed).standard_normal((1, 5, 64)), jax.numpy.bfloat16)
  router, bias = model.layers.router_weight[...][0], model.layers.router_bias[...][0]
  rule = Router.of(model.config)
  experts, _, probabilities, _ = route(h, router, top_k=2, norm_topk_prob=True, bias=bias, rule=rule)
  scores = 1 / (1 + np.exp(-(np.asarray(h, np.float64) @ np.asarray(router, np.float64))))
  np.testing.assert_allclose(np.asarray(probabilities), scores / scores.sum(-1, keepdims=True), rtol=1e-5)
