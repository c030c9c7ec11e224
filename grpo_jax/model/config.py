"""Qwen2 / Qwen2.5 / Qwen3 / Qwen3-MoE / Qwen2.5-VL architecture, read from and written to a Hugging Face
`config.json`.

One model family: Qwen3 dense is Qwen2 with per-head RMSNorm on queries and keys before RoPE
(`qk_norm`), no bias on the q/k/v projections (`attention_bias`), and an explicit head_dim.
Qwen3-MoE is Qwen3 whose MLP, in the layers `sparse_layers` names, is a mixture of `num_experts`
SwiGLU experts of width `moe_intermediate_size`, each token sent to the `num_experts_per_tok` the
router scores highest. Qwen2.5-VL is Qwen2 whose rotary positions are multimodal (M-RoPE: each
frequency of the head rotates by the temporal, height or width position, as `mrope_section` splits
them) with a vision tower (`vision`, a VisionConfig) whose features stand in for the image tokens.

Field names follow the Hugging Face spelling so a user can compare a checkpoint's config.json
with this dataclass line by line. Dimension letters used elsewhere: D = hidden_size,
F = intermediate_size, N = num_attention_heads, K = num_key_value_heads, H = head_dim,
V = vocab_size, L = num_hidden_layers; for mixtures of experts E = num_experts, M =
moe_intermediate_size (an expert's SwiGLU width), k = num_experts_per_tok.
"""

import dataclasses
import os

from grpo_jax.errors import UserError, read_json_object

# model_type -> (architecture class, its defaults for the fields that tell the family members apart)
MODEL_TYPES = {'qwen2': ('Qwen2ForCausalLM', dict(attention_bias=True, qk_norm=False)),
               'qwen3': ('Qwen3ForCausalLM', dict(attention_bias=False, qk_norm=True)),
               'qwen3_moe': ('Qwen3MoeForCausalLM', dict(attention_bias=False, qk_norm=True)),
               'qwen2_5_vl': ('Qwen2_5_VLForConditionalGeneration', dict(attention_bias=True, qk_norm=False))}
SUPPORTED_ARCHITECTURES = tuple(architecture for architecture, _ in MODEL_TYPES.values())


@dataclasses.dataclass(frozen=True)
class VisionConfig:
  """Qwen2.5-VL's vision tower (model/vision.py) and the prompt tokens that hold its features.

  Dimension letters: C = hidden_size (the tower's width), I = intermediate_size, P = in_channels x
  temporal_patch_size x patch_size^2 (one flattened patch), W = C x spatial_merge_size^2 (the
  merger's width); its output is the language model's D = out_hidden_size.
  """

  depth: int = 2  # Lv, transformer blocks
  hidden_size: int = 32  # C
  intermediate_size: int = 64  # I, the blocks' SwiGLU width (with biases)
  num_heads: int = 2
  out_hidden_size: int = 64  # the language model's hidden_size
  in_channels: int = 3
  patch_size: int = 14  # pixels per patch side
  temporal_patch_size: int = 2  # frames per patch (an image is repeated to fill them)
  spatial_merge_size: int = 2  # m: m x m patches merge into one language-model token
  window_size: int = 112  # pixels per side of an attention window (blocks not in fullatt_block_indexes)
  fullatt_block_indexes: tuple[int, ...] = ()  # blocks attending over the whole image
  tokens_per_second: int = 2  # video only: the temporal position step per second
  rope_theta: float = 10000.0  # the tower's 2D rotary base
  image_token_id: int = 151655  # <|image_pad|>: one per merged patch, replaced by its feature
  video_token_id: int = 151656
  vision_start_token_id: int = 151652  # <|vision_start|>
  vision_end_token_id: int = 151653  # <|vision_end|>

  def __post_init__(self):
    for name in ('depth', 'hidden_size', 'intermediate_size', 'num_heads', 'out_hidden_size', 'in_channels',
                 'patch_size', 'temporal_patch_size', 'spatial_merge_size', 'window_size'):
      if getattr(self, name) <= 0:
        raise UserError(f'model architecture field vision.{name} must be positive, got {getattr(self, name)}')
    if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
      raise UserError(f'model architecture field vision.hidden_size ({self.hidden_size}) must split into '
                      f'vision.num_heads ({self.num_heads}) heads of a multiple of 4 (the 2D rotary embedding)')
    if self.window_size % (self.patch_size * self.spatial_merge_size):
      raise UserError(f'model architecture field vision.window_size ({self.window_size}) must be a multiple of '
                      f'patch_size x spatial_merge_size ({self.patch_size * self.spatial_merge_size})')
    bad = [i for i in self.fullatt_block_indexes if not 0 <= i < self.depth]
    if bad:
      raise UserError(f'model architecture field vision.fullatt_block_indexes names block {bad[0]}, outside '
                      f'[0, {self.depth})')

  @property
  def head_dim(self) -> int:
    return self.hidden_size // self.num_heads

  @property
  def patch_dim(self) -> int:
    """P, one flattened patch: channels x frames x pixels."""
    return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

  @property
  def merge_unit(self) -> int:
    """Patches per language-model token (m^2)."""
    return self.spatial_merge_size ** 2

  def num_params(self) -> int:
    c, i, w = self.hidden_size, self.intermediate_size, self.hidden_size * self.merge_unit
    block = 2 * c + (c * 3 * c + 3 * c) + (c * c + c) + 2 * (c * i + i) + (i * c + c)
    return self.patch_dim * c + self.depth * block + c + (w * w + w) + (w * self.out_hidden_size + self.out_hidden_size)


@dataclasses.dataclass(frozen=True)
class Qwen2Config:
  """Architecture of a Qwen2-family decoder. The defaults describe a tiny test-sized model."""

  vocab_size: int = 256  # V
  hidden_size: int = 64  # D
  intermediate_size: int = 176  # F, SwiGLU hidden width
  num_hidden_layers: int = 2  # L
  num_attention_heads: int = 4  # N, query heads
  num_key_value_heads: int = 2  # K, key/value heads (GQA: N is a multiple of K)
  head_dim: int | None = None  # H; None means hidden_size // num_attention_heads
  rope_theta: float = 1_000_000.0  # RoPE base frequency
  rms_norm_eps: float = 1e-6  # epsilon inside RMSNorm
  tie_word_embeddings: bool = False  # lm_head shares the token embedding
  max_position_embeddings: int = 32768  # longest context the checkpoint was trained for
  bos_token_id: int | None = None  # beginning-of-sequence token, if any
  eos_token_ids: tuple[int, ...] = ()  # tokens that end a completion
  initializer_range: float = 0.02  # std of the normal init used for random weights
  checkpoint_dtype: str = 'float32'  # dtype the checkpoint stores its weights in
  attention_bias: bool = True  # q/k/v projections carry a bias (Qwen2: yes, Qwen3: no)
  qk_norm: bool = False  # per-head RMSNorm of queries and keys before RoPE (Qwen3)
  # Mixture of experts (Qwen3-MoE); num_experts 0 is a dense model.
  num_experts: int = 0  # E, experts in each sparse layer
  num_experts_per_tok: int = 1  # k, experts each token is sent to
  moe_intermediate_size: int = 0  # M, each expert's SwiGLU width
  decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % decoder_sparse_step == 0 ...
  mlp_only_layers: tuple[int, ...] = ()  # ... and it is not listed here (these keep the dense MLP)
  norm_topk_prob: bool = False  # renormalise the k chosen experts' probabilities to sum to 1
  router_aux_loss_coef: float = 0.001  # the checkpoint's load-balancing weight (pretraining; RL: algo's)
  # Multimodal rotary positions (Qwen2.5-VL): the H/2 frequencies split into temporal, height and
  # width parts of these sizes, positions [B, T, 3]; () is the text model's 1D RoPE.
  mrope_section: tuple[int, ...] = ()
  vision: VisionConfig | None = None  # the vision tower (Qwen2.5-VL); None: a text model

  def __post_init__(self):
    positive = ('vocab_size', 'hidden_size', 'intermediate_size', 'num_hidden_layers',
                'num_attention_heads', 'num_key_value_heads')
    for name in positive:
      if getattr(self, name) <= 0:
        raise UserError(f'model architecture field {name} must be positive, got {getattr(self, name)}')
    if self.head_dim is not None and self.head_dim <= 0:
      raise UserError(f'model architecture field head_dim must be positive, got {self.head_dim}')
    for name in ('rope_theta', 'rms_norm_eps', 'max_position_embeddings'):
      if not getattr(self, name) > 0:
        raise UserError(f'model architecture field {name} must be positive, got {getattr(self, name)}')
    if not self.initializer_range >= 0:
      raise UserError(f'model architecture field initializer_range must be >= 0, got {self.initializer_range}')
    for token in (*self.eos_token_ids, *([self.bos_token_id] if self.bos_token_id is not None else [])):
      if token < 0:
        raise UserError(f'model architecture token ids must be >= 0, got {token}')
    if self.num_attention_heads % self.num_key_value_heads:
      raise UserError(
          f'num_attention_heads ({self.num_attention_heads}) must be a multiple of '
          f'num_key_value_heads ({self.num_key_value_heads})')
    if self.head_dim is None and self.hidden_size % self.num_attention_heads:
      raise UserError(
          f'hidden_size ({self.hidden_size}) is not divisible by num_attention_heads '
          f'({self.num_attention_heads}); set head_dim explicitly')
    if not (self.attention_bias or self.qk_norm):
      raise UserError('model architecture field attention_bias=false needs qk_norm=true (Qwen3): '
                      'Qwen2 checkpoints always carry q/k/v biases')
    if self.resolved_head_dim % 2:
      raise UserError(f'head_dim must be even for rotary embeddings, got {self.resolved_head_dim}')
    if self.num_experts < 0:
      raise UserError(f'model architecture field num_experts must be >= 0, got {self.num_experts}')
    if self.num_experts:
      if not 1 <= self.num_experts_per_tok <= self.num_experts:
        raise UserError(f'model architecture field num_experts_per_tok must be in [1, num_experts='
                        f'{self.num_experts}], got {self.num_experts_per_tok}')
      if self.moe_intermediate_size <= 0:
        raise UserError(f'model architecture field moe_intermediate_size must be positive, got {self.moe_intermediate_size}')
      if self.decoder_sparse_step <= 0:
        raise UserError(f'model architecture field decoder_sparse_step must be positive, got {self.decoder_sparse_step}')
      if self.num_experts > 32767:
        raise UserError(f'model architecture field num_experts must be at most 32767, got {self.num_experts}')
      if self.qk_norm is False:
        raise UserError('model architecture: a mixture of experts (num_experts > 0) is Qwen3-MoE, which has qk_norm')
    bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
    if bad:
      raise UserError(f'model architecture field mlp_only_layers names layer {bad[0]}, outside [0, '
                      f'{self.num_hidden_layers})')
    if self.mrope_section and (len(self.mrope_section) != 3 or sum(self.mrope_section) != self.resolved_head_dim // 2
                               or min(self.mrope_section) < 0):
      raise UserError(f'model architecture field mrope_section {list(self.mrope_section)} must be three sizes '
                      f'summing to head_dim / 2 = {self.resolved_head_dim // 2}')
    if self.vision is not None:
      if not self.mrope_section:
        raise UserError('model architecture: a vision tower (vision) needs mrope_section, its multimodal positions')
      if self.vision.out_hidden_size != self.hidden_size:
        raise UserError(f'model architecture field vision.out_hidden_size ({self.vision.out_hidden_size}) must equal '
                        f'hidden_size ({self.hidden_size}): its features stand in for token embeddings')
      if self.num_experts or self.qk_norm:
        raise UserError('model architecture: a vision tower goes with the Qwen2.5 language model (no experts, '
                        'no qk_norm)')
      for name in ('image_token_id', 'video_token_id', 'vision_start_token_id', 'vision_end_token_id'):
        if not 0 <= getattr(self.vision, name) < self.vocab_size:
          raise UserError(f'model architecture field vision.{name} ({getattr(self.vision, name)}) is outside the '
                          f'vocabulary [0, {self.vocab_size})')

  @property
  def model_type(self) -> str:
    """The Hugging Face model_type this architecture is written as."""
    if self.vision is not None:
      return 'qwen2_5_vl'
    return 'qwen3_moe' if self.num_experts else 'qwen3' if self.qk_norm else 'qwen2'

  @property
  def sparse_layers(self) -> tuple[bool, ...]:
    """[L] whether each layer's MLP is the mixture of experts (transformers' rule)."""
    return tuple(bool(self.num_experts) and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0
                 for i in range(self.num_hidden_layers))

  def layers_of(self, kind: str) -> tuple[int, ...]:
    """The layers of a kind, in order: 'all', 'dense' (a dense MLP) or 'sparse' (experts); 'vision':
    the vision tower's blocks."""
    if kind == 'vision':
      return tuple(range(self.vision.depth)) if self.vision is not None else ()
    return tuple(i for i, sparse in enumerate(self.sparse_layers) if kind == 'all' or sparse == (kind == 'sparse'))

  @property
  def num_sparse_layers(self) -> int:
    """Ls, the layers with a mixture of experts (what the recorded routes hold per token)."""
    return sum(self.sparse_layers)

  @property
  def resolved_head_dim(self) -> int:
    return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads

  def num_params(self, active: bool = False) -> int:
    """Parameter count, counting a tied embedding once; `active`: those one token computes with
    (k of the E experts of each sparse layer, the router's all), what FLOPs and MFU count."""
    d, f, v, h = self.hidden_size, self.intermediate_size, self.vocab_size, self.resolved_head_dim
    n, k = self.num_attention_heads, self.num_key_value_heads
    attention = d * n * h + 2 * d * k * h + n * h * d
    attention += (n * h + 2 * k * h) if self.attention_bias else 0
    attention += 2 * h if self.qk_norm else 0
    sparse = self.num_sparse_layers
    experts = self.num_experts_per_tok if active else self.num_experts
    mlps = (self.num_hidden_layers - sparse) * 3 * d * f + sparse * (experts * 3 * d * self.moe_intermediate_size
                                                                     + d * self.num_experts)
    layers = self.num_hidden_layers * (attention + 2 * d) + mlps
    head = 0 if self.tie_word_embeddings else d * v
    return v * d + layers + d + head + (self.vision.num_params() if self.vision is not None else 0)


def from_hf_dict(raw: dict, source: str = 'config.json') -> Qwen2Config:
  """Reads a Hugging Face Qwen2, Qwen3, Qwen3-MoE or Qwen2.5-VL config in either the transformers-4.x
  or 5.x spelling (a VL config's text fields at the top, as the hub writes them, or nested in
  `text_config`, as transformers 5.x does)."""
  architectures = raw.get('architectures') or []
  model_type = raw.get('model_type')
  if model_type == 'qwen2_5_vl':
    multimodal = raw
    raw = {**{k: v for k, v in raw.items() if k not in ('text_config', 'vision_config')},
           **(raw.get('text_config') or {})}
    raw['model_type'] = model_type
  if model_type not in MODEL_TYPES or any(a != MODEL_TYPES[model_type][0] for a in architectures):
    found = ', '.join(architectures) or f'model_type={model_type!r}'
    raise UserError(
        f'{source}: unsupported architecture {found} (model_type {model_type!r}); grpo_jax supports '
        f'{", ".join(SUPPORTED_ARCHITECTURES)} (model_type qwen2: Qwen2 and Qwen2.5; qwen3: Qwen3 dense; '
        'qwen3_moe: Qwen3 mixtures of experts)')
  family = MODEL_TYPES[model_type][1]
  if model_type in ('qwen3', 'qwen3_moe') and raw.get('attention_bias'):
    raise UserError(f'{source}: attention_bias=true is not supported for qwen3 (its o_proj would carry a bias '
                    'too; no Qwen3 checkpoint has one)')
  if raw.get('use_sliding_window'):
    raise UserError(
        f'{source}: use_sliding_window=true is not supported (Qwen2.5 checkpoints ship with it off); '
        'set it to false only if the model was trained with full attention')
  activation = raw.get('hidden_act', 'silu')
  if activation != 'silu':
    raise UserError(f'{source}: hidden_act={activation!r} is not supported; Qwen2 and Qwen3 use silu')

  # transformers 5.x nests rope settings in `rope_parameters`; 4.x has `rope_theta` and `rope_scaling`.
  rope = raw.get('rope_parameters') or {}
  rope_theta = rope.get('rope_theta', raw.get('rope_theta', 10000.0))
  scaling = raw.get('rope_scaling') or {}
  rope_type = rope.get('rope_type') or scaling.get('rope_type') or scaling.get('type') or 'default'
  mrope_section = tuple(int(n) for n in rope.get('mrope_section') or scaling.get('mrope_section') or ())
  if rope_type == 'mrope' and mrope_section:  # the hub's Qwen2.5-VL spelling of default RoPE with sections
    rope_type = 'default'
  if rope_type != 'default':
    raise UserError(f'{source}: rope type {rope_type!r} is not supported; only the default RoPE is')
  if model_type == 'qwen2_5_vl' and not mrope_section:
    raise UserError(f'{source}: a qwen2_5_vl config needs rope_parameters.mrope_section (or rope_scaling.mrope_section)')

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
  return Qwen2Config(
      **fields,
      head_dim=raw.get('head_dim'),
      rope_theta=float(rope_theta),
      rms_norm_eps=float(raw.get('rms_norm_eps', 1e-6)),
      tie_word_embeddings=bool(raw.get('tie_word_embeddings', False)),
      max_position_embeddings=int(raw.get('max_position_embeddings', 32768)),
      bos_token_id=raw.get('bos_token_id'),
      eos_token_ids=eos_ids,
      initializer_range=float(raw.get('initializer_range', 0.02)),
      checkpoint_dtype=str(checkpoint_dtype),
      attention_bias=bool(raw.get('attention_bias', family['attention_bias'])),
      qk_norm=family['qk_norm'],
      **experts,
      **(dict(mrope_section=mrope_section, vision=_vision_from_hf(multimodal, source))
         if model_type == 'qwen2_5_vl' else {}),
  )


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
      'architectures': [MODEL_TYPES[config.model_type][0]],
      'model_type': config.model_type,
      'attention_bias': config.attention_bias,
      'vocab_size': config.vocab_size,
      'hidden_size': config.hidden_size,
      'intermediate_size': config.intermediate_size,
      'num_hidden_layers': config.num_hidden_layers,
      'num_attention_heads': config.num_attention_heads,
      'num_key_value_heads': config.num_key_value_heads,
      **({'head_dim': config.head_dim} if config.head_dim is not None else {}),
      'hidden_act': 'silu',
      'rms_norm_eps': config.rms_norm_eps,
      'rope_theta': config.rope_theta,
      'rope_parameters': {'rope_type': 'default', 'rope_theta': config.rope_theta},
      'tie_word_embeddings': config.tie_word_embeddings,
      'max_position_embeddings': config.max_position_embeddings,
      'use_sliding_window': False,
      'attention_dropout': 0.0,
      'initializer_range': config.initializer_range,
      'bos_token_id': config.bos_token_id,
      'eos_token_id': eos[0] if len(eos) == 1 else (eos or None),
      'dtype': dtype,
      'torch_dtype': dtype,
      **(_experts_hf_dict(config) if config.num_experts else {}),
  }
  return _multimodal_hf_dict(config, text) if config.vision is not None else text


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
