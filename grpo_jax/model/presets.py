"""The public model sizes: Qwen2.5, Qwen3 dense and Qwen3-MoE shapes as grpo_jax.model.Qwen2Config
keyword dicts (the plan's --model-size, the benchmarks' architectures, the tests' config checks).

  QWEN2_5_PRESETS, QWEN3_PRESETS   size ('0.5B', '7B', ...) -> Qwen2Config keywords
  QWEN3_MOE_PRESETS                size ('30B-A3B', '235B-A22B') -> Qwen2Config keywords
  QWEN2_5_VL_PRESETS               size ('3B', '7B', '32B', '72B') -> Qwen2Config keywords (vision as a dict)
  FAMILY_PRESETS                   'Llama-3.1-8B', 'Mistral-Nemo-12B', 'Gemma-3-27B', ... -> keywords
  MODEL_PRESETS                    every --model-size name ('7B', 'Qwen2.5-7B', 'Qwen3-8B',
                                   'Qwen3-30B-A3B') -> keywords
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
# The other families' config.json files on the hub (Gemma 3 4B-27B: their text_config, the language
# model that grpo_jax trains), as Qwen2Config keywords over each model_type's defaults.
_FAMILY_FIELDS = ('hidden_size', 'intermediate_size', 'num_hidden_layers', 'num_attention_heads',
                  'num_key_value_heads', 'head_dim', 'vocab_size', 'tie_word_embeddings')
_LLAMA = dict(family='llama', attention_bias=False, qk_norm=False, rms_norm_eps=1e-5)
_LLAMA3 = dict(_LLAMA, rope_theta=500000.0, rope_type='llama3', rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
               rope_original_max_position_embeddings=8192, max_position_embeddings=131072)
_MISTRAL = dict(family='mistral', attention_bias=False, qk_norm=False, rms_norm_eps=1e-5, sliding_window=None)
_GLM4 = dict(family='glm4', attention_bias=True, qk_norm=False, sandwich_norms=True, fused_gate_up=True,
             rope_interleaved=True, partial_rotary_factor=0.5, rope_theta=10000.0, rms_norm_eps=1e-5,
             max_position_embeddings=32768)
_GEMMA3 = dict(family='gemma3_text', attention_bias=False, qk_norm=True, norm_offset=True, sandwich_norms=True,
               embedding_scale=True, hidden_act='gelu_pytorch_tanh', rope_theta=1_000_000.0, local_rope_theta=10000.0,
               rms_norm_eps=1e-6)


def _gemma3_layers(layers: int) -> tuple[str, ...]:
  """Five sliding-window layers, then one global, repeated (sliding_window_pattern 6)."""
  return tuple('sliding_attention' if (i + 1) % 6 else 'full_attention' for i in range(layers))


_FAMILY_SHAPES = {  # D, F, L, N, K, H, V, tied; the family's fields
    'Llama-3.2-1B': ((2048, 8192, 16, 32, 8, 64, 128256, True), dict(_LLAMA3, rope_factor=32.0)),
    'Llama-3.2-3B': ((3072, 8192, 28, 24, 8, 128, 128256, True), dict(_LLAMA3, rope_factor=32.0)),
    'Llama-3.1-8B': ((4096, 14336, 32, 32, 8, 128, 128256, False), dict(_LLAMA3, rope_factor=8.0)),
    'Llama-3.1-70B': ((8192, 28672, 80, 64, 8, 128, 128256, False), dict(_LLAMA3, rope_factor=8.0)),
    'DeepSeek-LLM-7B': ((4096, 11008, 30, 32, 32, 128, 102400, False),
                        dict(_LLAMA, rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=4096)),
    'Mistral-7B-v0.3': ((4096, 14336, 32, 32, 8, 128, 32768, False),
                        dict(_MISTRAL, rope_theta=1_000_000.0, max_position_embeddings=32768)),
    'Mistral-Nemo-12B': ((5120, 14336, 40, 32, 8, 128, 131072, False),
                         dict(_MISTRAL, rope_theta=1_000_000.0, max_position_embeddings=1024000)),
    'Mistral-Small-24B': ((5120, 32768, 40, 32, 8, 128, 131072, False),
                          dict(_MISTRAL, rope_theta=100_000_000.0, max_position_embeddings=32768)),
    'GLM-4-9B-0414': ((4096, 13696, 40, 32, 2, 128, 151552, False), _GLM4),
    'GLM-4-32B-0414': ((6144, 23040, 61, 48, 2, 128, 151552, False), _GLM4),
    'Gemma-3-1B': ((1152, 6912, 26, 4, 1, 256, 262144, True),
                   dict(_GEMMA3, sliding_window=512, layer_types=_gemma3_layers(26), query_pre_attn_scalar=256.0,
                        max_position_embeddings=32768)),
    **{name: ((hidden, mlp, layers, heads, kv_heads, head_dim, 262208, True),
              dict(_GEMMA3, sliding_window=1024, layer_types=_gemma3_layers(layers), query_pre_attn_scalar=scalar,
                   rope_type='linear', rope_factor=8.0, max_position_embeddings=131072))
       for name, (hidden, mlp, layers, heads, kv_heads, head_dim, scalar) in {
           'Gemma-3-4B': (2560, 10240, 34, 8, 4, 256, 256.0),
           'Gemma-3-12B': (3840, 15360, 48, 16, 8, 256, 256.0),
           'Gemma-3-27B': (5376, 21504, 62, 32, 16, 128, 168.0)}.items()},
}
FAMILY_PRESETS = {name: dict(zip(_FAMILY_FIELDS, shape), **fields) for name, (shape, fields) in _FAMILY_SHAPES.items()}
# --model-size names: the Qwen2.5 sizes as they are ('7B') or prefixed, the Qwen3 sizes prefixed
# ('Qwen3-8B', 'Qwen3-30B-A3B'), the Qwen2.5-VL sizes prefixed ('Qwen2.5-VL-7B').
MODEL_PRESETS = {**QWEN2_5_PRESETS, **{f'Qwen2.5-{size}': shape for size, shape in QWEN2_5_PRESETS.items()},
                 **{f'Qwen3-{size}': shape for size, shape in {**QWEN3_PRESETS, **QWEN3_MOE_PRESETS}.items()},
                 **{f'Qwen2.5-VL-{size}': shape for size, shape in QWEN2_5_VL_PRESETS.items()}, **FAMILY_PRESETS}


def preset(name: str, **overrides):
  """grpo_jax.model.Qwen2Config of the model size `name` (a MODEL_PRESETS key: '0.5B', ..., '72B'
  or 'Qwen2.5-7B' for Qwen2.5, 'Qwen3-0.6B', ..., 'Qwen3-32B', 'Qwen3-30B-A3B', 'Qwen3-235B-A22B',
  'Qwen2.5-VL-3B', ..., 'Qwen2.5-VL-72B', a FAMILY_PRESETS name), fields overridden."""
  if name not in MODEL_PRESETS:
    raise KeyError(f'no model preset {name!r}; one of {", ".join(MODEL_PRESETS)}')
  from grpo_jax.model.config import Qwen2Config, VisionConfig  # here: this module imports no jax (the docstring)
  fields = {**MODEL_PRESETS[name], **overrides}
  if isinstance(fields.get('vision'), dict):
    fields['vision'] = VisionConfig(**fields['vision'])
  return Qwen2Config(**fields)
