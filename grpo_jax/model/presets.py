"""The public model sizes: Qwen2.5, Qwen3 dense, Qwen3-MoE, Qwen2.5-VL, Llama 3, DeepSeek-LLM, Mistral,
GLM-4 and Gemma 3 shapes as grpo_jax.model.Qwen2Config keyword dicts (the plan's --model-size, the
benchmarks' architectures, the tests' config checks).

  QWEN2_5_PRESETS, QWEN3_PRESETS   size ('0.5B', '7B', ...) -> Qwen2Config keywords
  QWEN3_MOE_PRESETS                size ('30B-A3B', '235B-A22B') -> Qwen2Config keywords
  QWEN2_5_VL_PRESETS               size ('3B', '7B', '32B', '72B') -> Qwen2Config keywords (vision as a dict)
  LLAMA_PRESETS, MISTRAL_PRESETS,  checkpoint ('Llama-3.1-8B', 'DeepSeek-LLM-7B', 'Mistral-Nemo-12B',
  GLM4_PRESETS, GEMMA3_PRESETS     'GLM-4-9B-0414', 'Gemma-3-12B', ...) -> Qwen2Config keywords less the
                                   family's defaults (FAMILY_PRESETS: all four)
  MODEL_PRESETS                    every --model-size name ('7B', 'Qwen2.5-7B', 'Qwen3-8B',
                                   'Qwen3-30B-A3B', 'Llama-3.1-8B') -> keywords
  preset(name, **overrides)        the Qwen2Config of one

Imports only the standard library (preset() imports the config when called): bench/harness.py
reads the presets before it pins the process to N cores, which must come before jax starts its CPU
client and numpy sizes its thread pool.
"""

# The Qwen2.5-*-Instruct config.json files on the Hugging Face hub, as keyword arguments of
# grpo_jax.model.Qwen2Config (and of transformers.Qwen2Config). Every size has rope_theta 1e6 and
# max_position_embeddings 32768; some base (not -Instruct) checkpoints give 131072 instead.
_SHAPE_FIELDS = ('hidden_size', 'intermediate_size', 'num_hidden_layers', 'num_attention_heads',
                 'num_key_value_heads', 'vocab_size', 'tie_word_embeddings')
_QWEN2_5_SHAPES = {  # D, F, L, N, K, V, tied
    '0.5B': (896, 4864, 24, 14, 2, 151936, True),
    '1.5B': (1536, 8960, 28, 12, 2, 151936, True),
    '3B': (2048, 11008, 36, 16, 2, 151936, True),
    '7B': (3584, 18944, 28, 28, 4, 152064, False),
    '14B': (5120, 13824, 48, 40, 8, 152064, False),
    '32B': (5120, 27648, 64, 40, 8, 152064, False),
    '72B': (8192, 29568, 80, 64, 8, 152064, False),
}


def _presets(shapes: dict, **fields) -> dict:
  """size -> Qwen2Config keywords: the shape table's fields and the family's common ones."""
  return {size: dict(zip(_SHAPE_FIELDS, shape), **fields) for size, shape in shapes.items()}


QWEN2_5_PRESETS = _presets(_QWEN2_5_SHAPES, rope_theta=1_000_000.0, max_position_embeddings=32768)
# The Qwen3 dense config.json files (Qwen3-*): head_dim 128, rope_theta 1e6, 40960 positions, no
# q/k/v bias, per-head q/k norms.
_QWEN3_SHAPES = {  # D, F, L, N, K, V, tied
    '0.6B': (1024, 3072, 28, 16, 8, 151936, True),
    '1.7B': (2048, 6144, 28, 16, 8, 151936, True),
    '4B': (2560, 9728, 36, 32, 8, 151936, True),
    '8B': (4096, 12288, 36, 32, 8, 151936, False),
    '14B': (5120, 17408, 40, 40, 8, 151936, False),
    '32B': (5120, 25600, 64, 64, 8, 151936, False),
}
_QWEN3_FIELDS = dict(head_dim=128, rope_theta=1_000_000.0, max_position_embeddings=40960, attention_bias=False,
                     qk_norm=True)
QWEN3_PRESETS = _presets(_QWEN3_SHAPES, **_QWEN3_FIELDS)
# The Qwen3-MoE config.json files (Qwen3-*B-A*B): Qwen3's attention, and in every layer
# (decoder_sparse_step 1, no mlp_only_layers) E experts of width M of which each token takes k,
# their probabilities renormalised over the k. intermediate_size F is the dense MLP's width, which
# no layer of these checkpoints uses. Totals / activated per the model cards: 30.5B / 3.3B and
# 235B / 22B.
_QWEN3_MOE_FIELDS = ('hidden_size', 'intermediate_size', 'moe_intermediate_size', 'num_hidden_layers',
                     'num_attention_heads', 'num_key_value_heads', 'num_experts', 'num_experts_per_tok')
_QWEN3_MOE_SHAPES = {  # D, F, M, L, N, K, E, k
    '30B-A3B': (2048, 6144, 768, 48, 32, 4, 128, 8),
    '235B-A22B': (4096, 12288, 1536, 94, 64, 4, 128, 8),
}
QWEN3_MOE_PRESETS = {size: dict(zip(_QWEN3_MOE_FIELDS, shape), vocab_size=151936, tie_word_embeddings=False,
                          norm_topk_prob=True, **_QWEN3_FIELDS)
                     for size, shape in _QWEN3_MOE_SHAPES.items()}
# The Qwen2.5-VL-*-Instruct config.json files: the Qwen2.5 language model of the same size (128,000
# positions) with M-RoPE over [16, 24, 24] frequencies and one vision tower for every size (32 blocks
# of width 1280, windows of 112 pixels but blocks 7, 15, 23 and 31, merging 2 x 2 patches into the
# language model's width). Totals per the model cards: 3.75B, 8.29B, 33.5B, 73.4B.
_VISION_TOWER = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, patch_size=14,
                     temporal_patch_size=2, spatial_merge_size=2, window_size=112, fullatt_block_indexes=(7, 15, 23, 31),
                     tokens_per_second=2, image_token_id=151655, video_token_id=151656,
                     vision_start_token_id=151652, vision_end_token_id=151653)
QWEN2_5_VL_PRESETS = {size: dict(QWEN2_5_PRESETS[size], max_position_embeddings=128000, mrope_section=(16, 24, 24),
                                 vision=dict(_VISION_TOWER, out_hidden_size=QWEN2_5_PRESETS[size]['hidden_size']))
                      for size in ('3B', '7B', '32B', '72B')}
# The model families beyond Qwen (grpo_jax.model.config.MODEL_TYPES; preset() fills in the family's
# defaults there: Llama's missing biases, GLM-4's fused gate/up and extra norms, Gemma 3's q/k
# norms, (1 + w) norms, scaled embedding and GeLU). Each is the hub's config.json of the
# instruct/base checkpoint; the parameter totals, to the parameter, sit beside each preset in
# tests/test_presets.py with the transformers count they are checked against.
_FAMILY_FIELDS = ('hidden_size', 'intermediate_size', 'num_hidden_layers', 'num_attention_heads',
                  'num_key_value_heads', 'head_dim', 'vocab_size', 'tie_word_embeddings')
# Llama 3.1 and 3.2: rope_theta 500,000 stretched by the llama3 rule from 8,192 to 131,072 positions
# (3.1: factor 8; 3.2: factor 32), RMSNorm eps 1e-5; 3.2-1B and 3B tie their embeddings.
_LLAMA3_SHAPES = {  # D, F, L, N, K, H, V, tied; rope factor
    'Llama-3.2-1B': ((2048, 8192, 16, 32, 8, 64, 128256, True), 32.0),
    'Llama-3.2-3B': ((3072, 8192, 28, 24, 8, 128, 128256, True), 32.0),
    'Llama-3.1-8B': ((4096, 14336, 32, 32, 8, 128, 128256, False), 8.0),
    'Llama-3.1-70B': ((8192, 28672, 80, 64, 8, 128, 128256, False), 8.0),
}
LLAMA_PRESETS = {name: dict(zip(_FAMILY_FIELDS, shape), family='llama', rope_theta=500_000.0, rms_norm_eps=1e-5,
                            max_position_embeddings=131072, rope_type='llama3', rope_factor=factor,
                            rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                            rope_original_max_position_embeddings=8192)
                 for name, (shape, factor) in _LLAMA3_SHAPES.items()}
# DeepSeek-LLM-7B (base and chat): a LlamaForCausalLM with multi-head attention (K = N), its own
# 102,400-token vocabulary, plain RoPE (theta 10,000) over 4,096 positions; its file leaves head_dim
# to hidden / heads (128).
LLAMA_PRESETS['DeepSeek-LLM-7B'] = dict(zip(_FAMILY_FIELDS, (4096, 11008, 30, 32, 32, None, 102400, False)),
                                        family='llama', rope_theta=10000.0, rms_norm_eps=1e-6,
                                        max_position_embeddings=4096)
# Mistral: rope_theta 1e6 (Small-24B-2501: 1e8), RMSNorm eps 1e-5, no sliding window in any of these
# three files (sliding_window null); Nemo and Small have heads of 128 narrower than D / N.
_MISTRAL_SHAPES = {  # D, F, L, N, K, H, V, tied; rope_theta, positions
    'Mistral-7B-v0.3': ((4096, 14336, 32, 32, 8, 128, 32768, False), 1_000_000.0, 32768),
    'Mistral-Nemo-12B': ((5120, 14336, 40, 32, 8, 128, 131072, False), 1_000_000.0, 1024000),
    'Mistral-Small-24B': ((5120, 32768, 40, 32, 8, 128, 131072, False), 100_000_000.0, 32768),
}
MISTRAL_PRESETS = {name: dict(zip(_FAMILY_FIELDS, shape), family='mistral', rope_theta=theta, rms_norm_eps=1e-5,
                              max_position_embeddings=positions)
                   for name, (shape, theta, positions) in _MISTRAL_SHAPES.items()}
# GLM-4-0414: 2 KV heads of 128, half of each head rotated (interleaved), q/k/v biases, rope_theta
# 10,000 over 32,768 positions, RMSNorm eps 1e-5.
_GLM4_SHAPES = {  # D, F, L, N, K, H, V, tied
    'GLM-4-9B-0414': (4096, 13696, 40, 32, 2, 128, 151552, False),
    'GLM-4-32B-0414': (6144, 23040, 61, 48, 2, 128, 151552, False),
}
GLM4_PRESETS = {name: dict(zip(_FAMILY_FIELDS, shape), family='glm4', rope_theta=10000.0, rms_norm_eps=1e-5,
                           max_position_embeddings=32768, partial_rotary_factor=0.5)
                for name, shape in _GLM4_SHAPES.items()}
# Gemma 3 (the 4B-27B: their text_config, the language model alone): five sliding layers (local
# RoPE base 10,000) then one global (base 1e6; 4B-27B stretch it linearly by 8), tied embeddings,
# RMSNorm eps 1e-6. 1B: a 512-token window over 32,768 positions and 262,144 tokens; the others:
# 1,024 over 131,072 and 262,208 tokens. Queries are scaled by 256^-1/2 (27B: 168 = D / N).
_GEMMA3_SHAPES = {  # D, F, L, N, K, H, V, tied; window, query_pre_attn_scalar
    'Gemma-3-1B': ((1152, 6912, 26, 4, 1, 256, 262144, True), 512, 256),
    'Gemma-3-4B': ((2560, 10240, 34, 8, 4, 256, 262208, True), 1024, 256),
    'Gemma-3-12B': ((3840, 15360, 48, 16, 8, 256, 262208, True), 1024, 256),
    'Gemma-3-27B': ((5376, 21504, 62, 32, 16, 128, 262208, True), 1024, 168),
}
GEMMA3_PRESETS = {
    name: dict(zip(_FAMILY_FIELDS, shape), family='gemma3_text', rms_norm_eps=1e-6, rope_theta=1_000_000.0,
               local_rope_theta=10000.0, sliding_window=window, query_pre_attn_scalar=float(scalar),
               layer_types=tuple('full_attention' if (i + 1) % 6 == 0 else 'sliding_attention'
                                 for i in range(shape[2])),
               **(dict(max_position_embeddings=32768) if name == 'Gemma-3-1B' else
                  dict(max_position_embeddings=131072, rope_type='linear', rope_factor=8.0)))
    for name, (shape, window, scalar) in _GEMMA3_SHAPES.items()}
# DeepSeek-V3 (and R1, the same shape) and Moonlight: multi-head latent attention (latents of 512 and a
# rotary key of 64 per token; 128 + 64 query and key values and 128 value values per head) and
# DeepSeekMoE (sigmoid router with its choice bias, shared experts, the first layers dense). V3:
# queries through a latent of 1,536, 8 groups of 32 experts of which 4 are kept, YaRN stretching
# 4,096 positions by 40; Moonlight: q_proj directly, one group, 2 shared experts, plain RoPE.
# Totals / activated per the model cards: 671B / 37B (the multi-token-prediction layer's 14B, which
# grpo_jax does not load, excluded) and 16B / 3B.
_DEEPSEEK_LATENT = dict(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
DEEPSEEK_V3_PRESETS = {
    'DeepSeek-V3-671B': dict(hidden_size=7168, intermediate_size=18432, num_hidden_layers=61, num_attention_heads=128,
                             num_key_value_heads=128, vocab_size=129280, tie_word_embeddings=False,
                             moe_intermediate_size=2048, num_experts=256, num_experts_per_tok=8, n_shared_experts=1,
                             n_group=8, topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True,
                             mlp_only_layers=(0, 1, 2), q_lora_rank=1536, **_DEEPSEEK_LATENT, rope_theta=10000.0,
                             rms_norm_eps=1e-6, max_position_embeddings=163840, rope_type='yarn', rope_factor=40.0,
                             rope_original_max_position_embeddings=4096, rope_mscale=1.0, rope_mscale_all_dim=1.0,
                             bos_token_id=0, eos_token_ids=(1,), family='deepseek_v3'),
    'Moonlight-16B-A3B': dict(hidden_size=2048, intermediate_size=11264, num_hidden_layers=27, num_attention_heads=16,
                              num_key_value_heads=16, vocab_size=163840, tie_word_embeddings=False,
                              moe_intermediate_size=1408, num_experts=64, num_experts_per_tok=6, n_shared_experts=2,
                              routed_scaling_factor=2.446, norm_topk_prob=True, mlp_only_layers=(0,), q_lora_rank=None,
                              **_DEEPSEEK_LATENT, rope_theta=50000.0, rms_norm_eps=1e-5, max_position_embeddings=8192,
                              bos_token_id=163584, eos_token_ids=(163585,), family='deepseek_v3'),
}
FAMILY_PRESETS = {**LLAMA_PRESETS, **MISTRAL_PRESETS, **GLM4_PRESETS, **GEMMA3_PRESETS, **DEEPSEEK_V3_PRESETS}
# --model-size names: the Qwen2.5 sizes as they are ('7B') or prefixed, the Qwen3 sizes prefixed
# ('Qwen3-8B', 'Qwen3-30B-A3B'), the Qwen2.5-VL sizes prefixed ('Qwen2.5-VL-7B'), the other
# families by their checkpoints' names ('Llama-3.1-8B', 'Gemma-3-12B').
MODEL_PRESETS = {**QWEN2_5_PRESETS, **{f'Qwen2.5-{size}': shape for size, shape in QWEN2_5_PRESETS.items()},
                 **{f'Qwen3-{size}': shape for size, shape in {**QWEN3_PRESETS, **QWEN3_MOE_PRESETS}.items()},
                 **{f'Qwen2.5-VL-{size}': shape for size, shape in QWEN2_5_VL_PRESETS.items()}, **FAMILY_PRESETS}


def preset(name: str, **overrides):
  """grpo_jax.model.Qwen2Config of the model size `name` (a MODEL_PRESETS key: '0.5B', ..., '72B'
  or 'Qwen2.5-7B' for Qwen2.5, 'Qwen3-0.6B', ..., 'Qwen3-32B', 'Qwen3-30B-A3B', 'Qwen3-235B-A22B',
  'Qwen2.5-VL-3B', ..., 'Qwen2.5-VL-72B', 'Llama-3.1-8B', 'Gemma-3-12B', ...), fields overridden; a
  family beyond Qwen gets its defaults from the config's MODEL_TYPES table, as a config.json would."""
  if name not in MODEL_PRESETS:
    raise KeyError(f'no model preset {name!r}; one of {", ".join(MODEL_PRESETS)}')
  from grpo_jax.model.config import MODEL_TYPES, Qwen2Config, VisionConfig  # here: this module imports no jax
  fields = {**MODEL_PRESETS[name], **overrides}
  if fields.get('family'):
    fields = {**MODEL_TYPES[fields['family']][1], **fields}
  if isinstance(fields.get('vision'), dict):
    fields['vision'] = VisionConfig(**fields['vision'])
  return Qwen2Config(**fields)
