"""A Hugging Face `config.json` read into the architecture config (model/config.py's Qwen2Config) and
written back from it, in both spellings: transformers 5.x's `rope_parameters` (keyed by layer type for
Gemma 3) and the hub's 4.x top-level `rope_theta` / `rope_scaling`. A key that would change what the
model computes and that the decoder does not implement is refused in one line naming it.
"""

import os

from grpo_jax.errors import UserError, read_json_object
from grpo_jax.model.config import ACTIVATIONS, MODEL_TYPES, ROPE_TYPES, SEQUENCE_CLASSIFIERS, Qwen2Config, VisionConfig


def from_hf_dict(raw: dict, source: str = 'config.json') -> Qwen2Config:
  """Reads a Hugging Face config of a model_type in MODEL_TYPES in either the transformers-4.x (the
  hub's) or 5.x spelling: a VL config's text fields at the top, as the hub writes them, or nested in
  `text_config`, as transformers 5.x does; a gemma3 config's language model from its `text_config`.
  A field that would change what the model computes and that the decoder does not implement is
  refused in one line naming it."""
  architectures = raw.get('architectures') or []
  model_type = raw.get('model_type')
  if model_type in ('qwen2_5_vl', 'gemma3'):
    multimodal = raw
    raw = {**{k: v for k, v in raw.items() if k not in ('text_config', 'vision_config')},
           **(raw.get('text_config') or {})}
    raw['model_type'] = model_type
    if model_type == 'gemma3':  # the wrapper's stop list and stored dtype are the checkpoint's
      raw.update({key: multimodal[key] for key in ('eos_token_id', 'dtype', 'torch_dtype')
                  if multimodal.get(key) is not None})
  known = {MODEL_TYPES[model_type][0], SEQUENCE_CLASSIFIERS.get(model_type)} if model_type in MODEL_TYPES else set()
  if not known or any(a not in known for a in architectures) or len(set(architectures)) > 1:
    found = ', '.join(architectures) or f'model_type={model_type!r}'
    raise UserError(
        f'{source}: unsupported architecture {found} (model_type {model_type!r}); grpo_jax supports '
        + ', '.join(f'{architecture} ({name})' for name, (architecture, _, _) in MODEL_TYPES.items())
        + '; reward models: '
        + ', '.join(f'{architecture} ({name})' for name, architecture in SEQUENCE_CLASSIFIERS.items()))
  labels = _labels_from_hf(raw, source) if SEQUENCE_CLASSIFIERS.get(model_type) in architectures else 0
  _, family, file_defaults = MODEL_TYPES[model_type]
  raw = {**file_defaults, **raw}
  if model_type in ('qwen3', 'qwen3_moe') and raw.get('attention_bias'):
    raise UserError(f'{source}: attention_bias=true is not supported for qwen3 (its o_proj would carry a bias '
                    'too; no Qwen3 checkpoint has one)')
  if model_type in ('llama', 'mistral', 'gemma3_text', 'gemma3', 'deepseek_v3') and raw.get('attention_bias'):
    raise UserError(f'{source}: attention_bias=true is not supported for {model_type} (its o_proj would carry a bias '
                    'too; no published checkpoint has one)')
  if raw.get('use_sliding_window'):
    raise UserError(
        f'{source}: use_sliding_window=true is not supported (Qwen2.5 checkpoints ship with it off); '
        'set it to false only if the model was trained with full attention')
  _refuse_unimplemented(raw, source)
  activation = raw.get('hidden_activation') or raw.get('hidden_act') or family.get('hidden_act', 'silu')
  if activation not in ACTIVATIONS:
    raise UserError(f'{source}: hidden_act={activation!r} is not supported; the decoder has {", ".join(ACTIVATIONS)}')
  gemma = family.get('family') == 'gemma3_text'
  rope = _rope_from_hf(raw, gemma, family.get('partial_rotary_factor', 1.0), source)
  if rope['rope_type'] == 'yarn' and rope.get('rope_factor') is None:
    # No factor: the stretch is max_position_embeddings over the original context (transformers' rule).
    rope['rope_factor'] = float(raw.get('max_position_embeddings', 32768)) / rope['rope_original_max_position_embeddings']
  mrope_section = rope.pop('mrope_section')
  if model_type == 'qwen2_5_vl' and not mrope_section:
    raise UserError(f'{source}: a qwen2_5_vl config needs rope_parameters.mrope_section (or rope_scaling.mrope_section)')
  attention = _attention_from_hf(raw, model_type, gemma, source)

  eos = raw.get('eos_token_id')
  eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
  checkpoint_dtype = raw.get('dtype') or raw.get('torch_dtype') or 'float32'
  num_heads = raw['num_attention_heads'] if 'num_attention_heads' in raw else None
  fields = dict(
      vocab_size=raw.get('vocab_size'),
      hidden_size=raw.get('hidden_size'),
      intermediate_size=raw.get('intermediate_size'),
      num_hidden_layers=raw.get('num_hidden_layers'),
      num_attention_heads=num_heads,
      num_key_value_heads=raw.get('num_key_value_heads') or num_heads,
  )
  missing = [name for name, value in fields.items() if value is None]
  if missing:
    raise UserError(f'{source}: missing field {missing[0]}')
  experts = {}
  if model_type == 'qwen3_moe':
    # transformers 5.x writes the expert count as num_local_experts, 4.x and the hub as num_experts.
    count = raw.get('num_experts', raw.get('num_local_experts'))
    for name, value in (('num_experts', count), ('num_experts_per_tok', raw.get('num_experts_per_tok')),
                        ('moe_intermediate_size', raw.get('moe_intermediate_size'))):
      if value is None:
        raise UserError(f'{source}: missing field {name} (model_type qwen3_moe)')
    if not count:
      raise UserError(f'{source}: num_experts is 0; a qwen3_moe checkpoint has experts')
    experts = dict(num_experts=int(count), num_experts_per_tok=int(raw['num_experts_per_tok']),
                   moe_intermediate_size=int(raw['moe_intermediate_size']),
                   decoder_sparse_step=int(raw.get('decoder_sparse_step', 1)),
                   mlp_only_layers=tuple(int(i) for i in raw.get('mlp_only_layers') or ()),
                   norm_topk_prob=bool(raw.get('norm_topk_prob', False)),
                   router_aux_loss_coef=float(raw.get('router_aux_loss_coef', 0.001)))
  latent = {}
  if model_type == 'deepseek_v3':
    experts, latent = _deepseek_from_hf(raw, source)
    family = {**family, 'rope_interleaved': bool(raw.get('rope_interleave', True))}
  return Qwen2Config(
      **fields,
      # transformers writes a deepseek_v3 head_dim of qk_rope_head_dim (its rotary width): not the heads' width
      head_dim=None if model_type == 'deepseek_v3' else raw.get('head_dim'),
      rms_norm_eps=float(raw.get('rms_norm_eps', 1e-6)),
      tie_word_embeddings=bool(raw.get('tie_word_embeddings', False)),
      max_position_embeddings=int(raw.get('max_position_embeddings', 32768)),
      bos_token_id=raw.get('bos_token_id'),
      eos_token_ids=eos_ids,
      initializer_range=float(raw.get('initializer_range', 0.02)),
      checkpoint_dtype=str(checkpoint_dtype),
      **{**family, **rope, **attention, 'attention_bias': bool(raw.get('attention_bias', family['attention_bias'])),
         'hidden_act': activation},
      **experts,
      **latent,
      **(dict(mrope_section=mrope_section, vision=_vision_from_hf(multimodal, source))
         if model_type == 'qwen2_5_vl' else {}),
      num_labels=labels,
      pad_token_id=_pad_id(raw, fields['vocab_size'], labels, source),
  )


def _deepseek_from_hf(raw: dict, source: str) -> tuple[dict, dict]:
  """(the DeepSeekMoE fields, the MLA fields) of a deepseek_v3 config, the hub's and 5.x's
  spellings (n_routed_experts; 5.x also num_local_experts). first_k_dense_replace becomes the
  dense layers' list (mlp_only_layers). A multi-token-prediction layer (num_nextn_predict_layers,
  5.x num_mtp_layers) is not part of the model: its tensors are left unread."""
  def need(name, *spellings):
    for key in (name, *spellings):
      if raw.get(key) is not None:
        return raw[key]
    raise UserError(f'{source}: missing field {name} (model_type deepseek_v3)')
  layers = int(raw['num_hidden_layers'])
  count = int(need('n_routed_experts', 'num_local_experts'))
  dense = min(int(raw.get('first_k_dense_replace') or 0), layers)
  experts = {}
  if count:
    experts = dict(num_experts=count, num_experts_per_tok=int(need('num_experts_per_tok')),
                   moe_intermediate_size=int(need('moe_intermediate_size')), mlp_only_layers=tuple(range(dense)),
                   norm_topk_prob=bool(raw.get('norm_topk_prob', True)),
                   n_group=int(raw.get('n_group') or 1), topk_group=int(raw.get('topk_group') or 1),
                   routed_scaling_factor=float(raw.get('routed_scaling_factor', 1.0)),
                   n_shared_experts=int(raw.get('n_shared_experts') or 0))
  if raw.get('topk_method', 'noaux_tc') != 'noaux_tc' or raw.get('scoring_func', 'sigmoid') != 'sigmoid':
    raise UserError(f'{source}: topk_method {raw.get("topk_method")!r} / scoring_func {raw.get("scoring_func")!r}: '
                    "a deepseek_v3 router is 'noaux_tc' with sigmoid scores")
  rank = raw.get('q_lora_rank')
  latent = dict(q_lora_rank=None if rank is None else int(rank), kv_lora_rank=int(need('kv_lora_rank')),
                qk_nope_head_dim=int(need('qk_nope_head_dim')), qk_rope_head_dim=int(need('qk_rope_head_dim')),
                v_head_dim=int(need('v_head_dim')))
  return experts, latent


def _labels_from_hf(raw: dict, source: str) -> int:
  """A sequence classifier's label count: its `id2label`'s size (what transformers derives it from),
  or `num_labels`; transformers' default, with neither, is 2. A reward model has one."""
  id2label = raw.get('id2label')
  count = len(id2label) if isinstance(id2label, dict) else raw.get('num_labels', 2)
  if count != 1:
    raise UserError(f'{source}: a score head of {count} labels (id2label); a reward model has one label, its score')
  return 1


def _pad_id(raw: dict, vocab_size: int, labels: int, source: str) -> int | None:
  """A reward model's pad_token_id (None when unset): it scores the last token that is not it, so it
  must be a token id. A language model's is not read (None): it samples and never pads with it,
  and hub files and transformers' own spelling of one checkpoint disagree on it (Gemma 3: unset
  and 0)."""
  pad = raw.get('pad_token_id')
  if isinstance(pad, list):
    pad = pad[0] if pad else None
  if not labels or pad is None:
    return None
  if not 0 <= int(pad) < vocab_size:
    raise UserError(f'{source}: pad_token_id {pad} is outside the vocabulary [0, {vocab_size}): a reward model scores '
                    'the last token that is not the pad id')
  return int(pad)


# Fields whose set values would change what the model computes and which the decoder does not
# implement; unset (None) or false they are what it computes.
_UNIMPLEMENTED = ('attn_logit_softcapping', 'final_logit_softcapping', 'mlp_bias', 'use_bidirectional_attention')
# The keys of a rope_parameters (or rope_scaling) dict the decoder reads, by rope_type.
_ROPE_KEYS = {'default': ('rope_type', 'type', 'rope_theta', 'partial_rotary_factor', 'mrope_section'),
              'linear': ('rope_type', 'type', 'rope_theta', 'partial_rotary_factor', 'factor'),
              'yarn': ('rope_type', 'type', 'rope_theta', 'partial_rotary_factor', 'factor', 'beta_fast', 'beta_slow',
                       'mscale', 'mscale_all_dim', 'original_max_position_embeddings', 'truncate'),
              'llama3': ('rope_type', 'type', 'rope_theta', 'partial_rotary_factor', 'factor', 'low_freq_factor',
                         'high_freq_factor', 'original_max_position_embeddings')}
_LAYER_KEYED = ('full_attention', 'sliding_attention')


def _refuse_unimplemented(raw: dict, source: str) -> None:
  for name in _UNIMPLEMENTED:
    if raw.get(name) not in (None, False):
      raise UserError(f'{source}: {name}={raw[name]!r} is not implemented by the decoder (only unset or false is)')


def _one_rope(params: dict, theta: float, partial: float, where: str, source: str) -> dict:
  """The RoPE fields of one rope_parameters (5.x) or rope_scaling-with-rope_theta (4.x) dict."""
  rope_type = params.get('rope_type') or params.get('type') or 'default'
  if rope_type == 'mrope' and params.get('mrope_section'):  # the hub's Qwen2.5-VL spelling of default RoPE
    rope_type = 'default'
  if rope_type not in _ROPE_KEYS:
    raise UserError(f'{source}: {where}: rope type {rope_type!r} is not supported; the decoder has '
                    f'{", ".join(ROPE_TYPES)}')
  unknown = [key for key in params if key not in _ROPE_KEYS[rope_type]]
  if unknown and not (rope_type == 'default' and unknown == ['factor'] and params['factor'] == 1.0):
    raise UserError(f'{source}: {where}.{unknown[0]} is not implemented for rope_type {rope_type!r}')
  fields = dict(rope_theta=float(params.get('rope_theta', theta)), rope_type=rope_type,
                partial_rotary_factor=float(params.get('partial_rotary_factor', partial)),
                mrope_section=tuple(int(n) for n in params.get('mrope_section') or ()))
  if rope_type == 'yarn':
    if 'original_max_position_embeddings' not in params:
      raise UserError(f'{source}: {where}.original_max_position_embeddings is missing (rope_type yarn)')
    fields.update(rope_factor=None if params.get('factor') is None else float(params['factor']),
                  rope_original_max_position_embeddings=int(params['original_max_position_embeddings']),
                  rope_beta_fast=float(params.get('beta_fast') or 32), rope_beta_slow=float(params.get('beta_slow') or 1),
                  rope_mscale=float(params.get('mscale') or 0), rope_mscale_all_dim=float(params.get('mscale_all_dim') or 0),
                  rope_truncate=bool(params.get('truncate', True)))
  elif rope_type != 'default':
    if 'factor' not in params:
      raise UserError(f'{source}: {where}.factor is missing (rope_type {rope_type!r})')
    fields['rope_factor'] = float(params['factor'])
  if rope_type == 'llama3':
    for key in ('low_freq_factor', 'high_freq_factor', 'original_max_position_embeddings'):
      if key not in params:
        raise UserError(f'{source}: {where}.{key} is missing (rope_type llama3)')
    fields.update(rope_low_freq_factor=float(params['low_freq_factor']),
                  rope_high_freq_factor=float(params['high_freq_factor']),
                  rope_original_max_position_embeddings=int(params['original_max_position_embeddings']))
  return fields


def _rope_from_hf(raw: dict, layer_keyed: bool, partial: float, source: str) -> dict:
  """The RoPE fields in either spelling. transformers 5.x: `rope_parameters` (for Gemma 3 one per
  layer type); the hub (4.x): `rope_theta` and `rope_scaling` at the top (Gemma 3: those of the
  global layers, `rope_local_base_freq` the sliding layers' base), GLM-4's `partial_rotary_factor`
  at the top."""
  partial = float(raw.get('partial_rotary_factor', partial))
  parameters = raw.get('rope_parameters') or {}
  if not layer_keyed:
    if any(key in parameters for key in _LAYER_KEYED):
      raise UserError(f'{source}: rope_parameters keyed by layer type are read for gemma3 only')
    params = {**(raw.get('rope_scaling') or {}), **parameters}
    return _one_rope(params, float(raw.get('rope_theta', 10000.0)), partial, 'rope_parameters', source)
  if parameters:
    unknown = [key for key in parameters if key not in _LAYER_KEYED]
    if unknown:
      raise UserError(f'{source}: rope_parameters.{unknown[0]}: a gemma3 config keys rope_parameters by layer type')
    full, local = parameters.get('full_attention') or {}, parameters.get('sliding_attention') or {}
  else:
    full = {**(raw.get('rope_scaling') or {}), 'rope_theta': raw.get('rope_theta', 1_000_000.0)}
    local = {'rope_theta': raw.get('rope_local_base_freq', 10000.0)}
  fields = _one_rope(full, 1_000_000.0, partial, 'rope_parameters.full_attention', source)
  local = _one_rope(local, 10000.0, partial, 'rope_parameters.sliding_attention', source)
  if local['rope_type'] != 'default' or local['partial_rotary_factor'] != fields['partial_rotary_factor']:
    raise UserError(f'{source}: rope_parameters.sliding_attention must be default RoPE over the same part of the head '
                    'as the full-attention layers')
  return dict(fields, local_rope_theta=local['rope_theta'])


def _attention_from_hf(raw: dict, model_type: str, layer_keyed: bool, source: str) -> dict:
  """sliding_window, layer_types and query_pre_attn_scalar, with transformers' defaults for a key a
  config leaves out (Mistral and Gemma 3 slide over 4096 tokens unless told otherwise)."""
  if model_type == 'mistral':
    return dict(sliding_window=raw.get('sliding_window', 4096))
  if not layer_keyed:
    return {}
  window = raw.get('sliding_window', 4096)
  layer_types = raw.get('layer_types')
  if not layer_types:
    pattern = int(raw.get('sliding_window_pattern', raw.get('_sliding_window_pattern', 6)))
    layer_types = ['sliding_attention' if (i + 1) % pattern else 'full_attention'
                   for i in range(int(raw.get('num_hidden_layers') or 0))]
  return dict(sliding_window=window, layer_types=tuple(layer_types),
              query_pre_attn_scalar=float(raw.get('query_pre_attn_scalar', 256)))


def _vision_from_hf(raw: dict, source: str) -> VisionConfig:
  """The vision tower and its token ids of a Qwen2.5-VL config (the hub's and 5.x's spellings)."""
  vision = raw.get('vision_config')
  if not isinstance(vision, dict):
    raise UserError(f'{source}: a qwen2_5_vl config needs a vision_config')
  text = raw.get('text_config') or {}
  activation = vision.get('hidden_act', 'silu')
  if activation != 'silu':
    raise UserError(f'{source}: vision_config.hidden_act={activation!r} is not supported; Qwen2.5-VL uses silu')
  defaults = VisionConfig()
  fields = dict(depth='depth', hidden_size='hidden_size', intermediate_size='intermediate_size', num_heads='num_heads',
                out_hidden_size='out_hidden_size', in_channels='in_channels', patch_size='patch_size',
                temporal_patch_size='temporal_patch_size', spatial_merge_size='spatial_merge_size',
                window_size='window_size', tokens_per_second='tokens_per_second')
  values = {}
  for name, key in fields.items():
    value = vision.get(key, vision.get({'in_channels': 'in_chans', 'patch_size': 'spatial_patch_size'}.get(key, key)))
    if value is None and name in ('depth', 'hidden_size', 'intermediate_size', 'num_heads', 'out_hidden_size'):
      raise UserError(f'{source}: missing field vision_config.{key}')
    values[name] = int(value if value is not None else getattr(defaults, name))
  rope = vision.get('rope_parameters') or {}
  tokens = {}
  for name in ('image_token_id', 'video_token_id', 'vision_start_token_id', 'vision_end_token_id'):
    value = raw.get(name, text.get(name))
    tokens[name] = int(value) if value is not None else getattr(defaults, name)
  return VisionConfig(**values, fullatt_block_indexes=tuple(int(i) for i in vision.get('fullatt_block_indexes') or ()),
                      rope_theta=float(rope.get('rope_theta', vision.get('rope_theta', 10000.0))), **tokens)


def to_hf_dict(config: Qwen2Config, dtype: str | None = None) -> dict:
  """A config.json that transformers 4.x and 5.x both read as this architecture.

  Both rope spellings are written: 4.x reads `rope_theta`, 5.x reads `rope_parameters`.
  """
  dtype = dtype or config.checkpoint_dtype
  eos = list(config.eos_token_ids)
  text = {
      'architectures': [config.architecture],
      'model_type': config.model_type,
      'attention_bias': config.attention_bias,
      'vocab_size': config.vocab_size,
      'hidden_size': config.hidden_size,
      'intermediate_size': config.intermediate_size,
      'num_hidden_layers': config.num_hidden_layers,
      'num_attention_heads': config.num_attention_heads,
      'num_key_value_heads': config.num_key_value_heads,
      **({'head_dim': config.head_dim} if config.head_dim is not None else {}),
      'hidden_act': config.hidden_act,
      'rms_norm_eps': config.rms_norm_eps,
      'rope_theta': config.rope_theta,
      'rope_parameters': _rope_hf_dict(config),
      **({'rope_scaling': _rope_scaling(config)} if config.rope_type != 'default' else {}),
      'tie_word_embeddings': config.tie_word_embeddings,
      'max_position_embeddings': config.max_position_embeddings,
      'use_sliding_window': False,
      'attention_dropout': 0.0,
      'initializer_range': config.initializer_range,
      'bos_token_id': config.bos_token_id,
      'eos_token_id': eos[0] if len(eos) == 1 else (eos or None),
      'dtype': dtype,
      'torch_dtype': dtype,
      **(_experts_hf_dict(config) if config.num_experts and config.family != 'deepseek_v3' else {}),
      **({'pad_token_id': config.pad_token_id} if config.pad_token_id is not None else {}),
      **({'num_labels': config.num_labels, 'id2label': {str(i): f'LABEL_{i}' for i in range(config.num_labels)},
          'label2id': {f'LABEL_{i}': i for i in range(config.num_labels)}} if config.num_labels else {}),
  }
  if config.family:
    text.update(_family_hf_dict(config))
  return _multimodal_hf_dict(config, text) if config.vision is not None else text


def _rope_hf_dict(config: Qwen2Config) -> dict:
  """5.x's rope_parameters of the (global) layers: the type, base and the type's own keys."""
  rope = {'rope_type': config.rope_type, 'rope_theta': config.rope_theta}
  if config.rope_type != 'default':
    rope['factor'] = config.rope_factor
  if config.rope_type == 'llama3':
    rope.update(low_freq_factor=config.rope_low_freq_factor, high_freq_factor=config.rope_high_freq_factor,
                original_max_position_embeddings=config.rope_original_max_position_embeddings)
  if config.rope_type == 'yarn':
    rope.update(beta_fast=config.rope_beta_fast, beta_slow=config.rope_beta_slow,
                original_max_position_embeddings=config.rope_original_max_position_embeddings,
                **({'mscale': config.rope_mscale} if config.rope_mscale else {}),
                **({'mscale_all_dim': config.rope_mscale_all_dim} if config.rope_mscale_all_dim else {}),
                **({} if config.rope_truncate else {'truncate': False}))
  return rope


def _rope_scaling(config: Qwen2Config) -> dict | None:
  """The hub's (4.x) rope_scaling: rope_parameters without the base; None for default RoPE."""
  if config.rope_type == 'default':
    return None
  return {key: value for key, value in _rope_hf_dict(config).items() if key != 'rope_theta'}


def _family_hf_dict(config: Qwen2Config) -> dict:
  """The keys a family beyond Qwen adds, in both spellings: 5.x's rope_parameters (for Gemma 3
  keyed by layer type) and the hub's top-level rope_theta, rope_scaling, partial_rotary_factor,
  rope_local_base_freq."""
  rope = _rope_hf_dict(config)
  keys = {'rope_scaling': _rope_scaling(config)}
  if config.partial_rotary_factor != 1.0:
    rope['partial_rotary_factor'] = keys['partial_rotary_factor'] = config.partial_rotary_factor
  if config.family == 'mistral':
    keys['sliding_window'] = config.sliding_window
  if config.family == 'deepseek_v3':
    keys.update(_deepseek_hf_dict(config))
  if config.family == 'gemma3_text':
    local = {'rope_type': 'default', 'rope_theta': config.local_rope_theta}
    scalar = config.query_pre_attn_scalar
    keys.update(hidden_activation=config.hidden_act,
                query_pre_attn_scalar=int(scalar) if scalar == int(scalar) else scalar,  # transformers: an int
                sliding_window=config.sliding_window, layer_types=list(config.layer_types),
                rope_local_base_freq=config.local_rope_theta,
                rope_parameters={'full_attention': rope, 'sliding_attention': local},
                attn_logit_softcapping=None, final_logit_softcapping=None, use_bidirectional_attention=False)
  else:
    keys['rope_parameters'] = rope
  return keys


def _multimodal_hf_dict(config: Qwen2Config, text: dict) -> dict:
  """A Qwen2.5-VL config.json in both spellings at once: the text fields at the top with
  `rope_scaling.mrope_section` (the hub's, transformers 4.x) and in `text_config` with
  `rope_parameters.mrope_section` (5.x)."""
  v = config.vision
  sections = list(config.mrope_section)
  text = dict(text, rope_parameters={'rope_type': 'default', 'rope_theta': config.rope_theta,
                                     'mrope_section': sections})
  tokens = {name: getattr(v, name) for name in ('image_token_id', 'video_token_id', 'vision_start_token_id',
                                                 'vision_end_token_id')}
  vision = {'model_type': 'qwen2_5_vl_vision', 'depth': v.depth, 'hidden_size': v.hidden_size,
            'intermediate_size': v.intermediate_size, 'num_heads': v.num_heads, 'out_hidden_size': v.out_hidden_size,
            'in_channels': v.in_channels, 'in_chans': v.in_channels, 'patch_size': v.patch_size,
            'spatial_patch_size': v.patch_size, 'temporal_patch_size': v.temporal_patch_size,
            'spatial_merge_size': v.spatial_merge_size, 'window_size': v.window_size,
            'fullatt_block_indexes': list(v.fullatt_block_indexes), 'tokens_per_second': v.tokens_per_second,
            'hidden_act': 'silu', 'initializer_range': config.initializer_range,
            'rope_parameters': {'rope_type': 'axial', 'rope_theta': v.rope_theta}}
  return {**text, 'rope_scaling': {'type': 'mrope', 'rope_type': 'default', 'mrope_section': sections},
          'text_config': {**text, 'model_type': 'qwen2_5_vl_text', **tokens}, 'vision_config': vision, **tokens}


def _deepseek_hf_dict(config: Qwen2Config) -> dict:
  """A deepseek_v3 config's MLA and DeepSeekMoE keys (the hub's names, which 5.x reads too); no
  multi-token-prediction layer (num_nextn_predict_layers 0: grpo_jax does not train one)."""
  dense = len(config.mlp_only_layers) if config.num_experts else config.num_hidden_layers
  return {'q_lora_rank': config.q_lora_rank, 'kv_lora_rank': config.kv_lora_rank,
          'qk_nope_head_dim': config.qk_nope_head_dim, 'qk_rope_head_dim': config.qk_rope_head_dim,
          'v_head_dim': config.v_head_dim, 'rope_interleave': config.rope_interleaved,
          'n_routed_experts': config.num_experts, 'num_experts_per_tok': config.num_experts_per_tok,
          'moe_intermediate_size': config.moe_intermediate_size, 'n_shared_experts': config.n_shared_experts,
          'n_group': config.n_group, 'topk_group': config.topk_group,
          'routed_scaling_factor': config.routed_scaling_factor, 'first_k_dense_replace': dense,
          'norm_topk_prob': config.norm_topk_prob, 'topk_method': 'noaux_tc', 'scoring_func': 'sigmoid',
          'num_nextn_predict_layers': 0}


def _experts_hf_dict(config: Qwen2Config) -> dict:
  # The expert count under both spellings: transformers 5.x reads num_local_experts, 4.x num_experts.
  return {'num_experts': config.num_experts, 'num_local_experts': config.num_experts,
          'num_experts_per_tok': config.num_experts_per_tok, 'moe_intermediate_size': config.moe_intermediate_size,
          'decoder_sparse_step': config.decoder_sparse_step, 'mlp_only_layers': list(config.mlp_only_layers),
          'norm_topk_prob': config.norm_topk_prob, 'router_aux_loss_coef': config.router_aux_loss_coef,
          'output_router_logits': False}


def load_hf_config(directory: str) -> Qwen2Config:
  """Reads `directory/config.json`, with a clear error when it is missing or not JSON."""
  path = os.path.join(directory, 'config.json')
  if not os.path.isfile(path):
    raise UserError(f'{path} not found: a model directory needs a config.json')
  return from_hf_dict(read_json_object(path, 'model config', 'config fields'), source=path)
