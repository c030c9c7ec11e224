"""Hugging Face tensors (Qwen2 / Qwen3 / Qwen3-MoE / Qwen2.5-VL, Llama, Mistral, GLM-4, Gemma 3) <->
grpo_jax parameters, as one declarative table.

Each rule maps a Hugging Face tensor name (per layer, `{i}`; per expert, `{e}`) to a grpo_jax
parameter path and says how the layout changes: PyTorch Linear weights are [out, in] and are
transposed to [in, out], then split into heads. Both directions are read from the same table. A
mixture of experts is stored on the hub (and by transformers' save_pretrained) one tensor per
expert, `mlp.experts.{e}.gate_proj.weight`; grpo_jax stacks a layer's E experts into one array.
GLM-4 stores a layer's gate and up projections as one tensor, `mlp.gate_up_proj.weight` [2F, D]
(gate first): two rules read its halves, and writing joins them again. Gemma 3 calls the norm
before the MLP `pre_feedforward_layernorm` and the one after attention `post_attention_layernorm`
(Qwen's name for the norm before the MLP). A Gemma 3 vision-language checkpoint (the 4B-27B ones)
holds its language model under `language_model.` (the hub's; `model.language_model.` inside
transformers 5.x): read by that prefix, its vision tower and projector left unread.

Reading goes one tensor at a time, with positioned reads of the safetensors files, so converting or
loading a checkpoint never holds more than the destination arrays plus one source tensor.
"""

import dataclasses
import json
import os
import re
from collections.abc import Iterator

import numpy as np

from grpo_jax.errors import UserError
from grpo_jax.model.config import Qwen2Config
from grpo_jax.model.safetensors_io import SafetensorsFile, TensorEntry, write_safetensors  # noqa: F401 (re-exported)

INDEX_FILE = 'model.safetensors.index.json'
SINGLE_FILE = 'model.safetensors'


def dim_sizes(config: Qwen2Config) -> dict[str, int]:
  """Sizes of the dimension letters (D, F, V, N, K, H, O a head's value width, E, M, S the shared
  experts' width, U = 2F fused gate and up, L a score head's labels; multi-head latent attention's Q
  = q_lora_rank, R = kv_lora_rank, A = R + qk_rope_head_dim, B = qk_nope_head_dim + v_head_dim; the vision tower's C, I, P, W and J = 3C, X, Y, Z its patch's channels, frames and
  side; see model/config.py) for this architecture."""
  v = config.vision
  vision = {} if v is None else {'C': v.hidden_size, 'I': v.intermediate_size, 'P': v.patch_dim,
                                 'W': v.hidden_size * v.merge_unit, 'J': 3 * v.hidden_size, 'X': v.in_channels,
                                 'Y': v.temporal_patch_size, 'Z': v.patch_size}
  latent = {} if not config.mla else {'Q': config.q_lora_rank or 0, 'R': config.kv_lora_rank,
                                       'A': config.kv_lora_rank + config.qk_rope_head_dim,
                                       'B': config.qk_nope_head_dim + config.v_head_dim}
  return {'D': config.hidden_size, 'F': config.intermediate_size, 'V': config.vocab_size,
          'N': config.num_attention_heads, 'K': config.num_key_value_heads,
          'H': config.resolved_head_dim, 'O': config.value_head_dim, 'E': config.num_experts,
          'M': config.moe_intermediate_size, 'S': config.shared_expert_size,
          'U': 2 * config.intermediate_size, 'L': config.num_labels, **vision, **latent}


def _evaluate(spec: str, config: Qwen2Config) -> tuple[int, ...]:
  """'N*H D' -> (N * H, D) for this config."""
  sizes = dim_sizes(config)
  return tuple(int(np.prod([sizes[letter] for letter in dim.split('*')])) for dim in spec.split())


@dataclasses.dataclass(frozen=True)
class Rule:
  hf_name: str  # Hugging Face name; '{i}' stands for the layer index, '{e}' for the expert's
  path: tuple[str, ...]  # grpo_jax parameter path in the NNX state
  transpose: bool  # PyTorch Linear [out, in] -> [in, out], before the reshape
  hf_spec: str  # Hugging Face shape in dim letters, e.g. 'N*H D'
  spec: str  # grpo_jax shape of one layer's slice (of one expert's, stacked over E), e.g. 'D N H'
  # The architecture field that must hold for the tensor to exist ('!' negates; 'family=glm4' and
  # 'family!=glm4' compare it with a value); '': always.
  when: str = ''
  layers: str = 'all'  # the layers that have it: 'all', 'dense' (a dense MLP), 'sparse' (experts), 'vision'
  half: int | None = None  # the half of the tensor's leading axis this parameter is (a fused gate_up_proj)

  def present(self, config: Qwen2Config) -> bool:
    if self.per_layer and not config.layers_of(self.layers):
      return False
    if not self.when:
      return True
    if '=' in self.when:
      field, value = self.when.split('=')
      return (str(getattr(config, field.rstrip('!'))) == value) != field.endswith('!')
    negated = self.when.startswith('!')
    return bool(getattr(config, self.when.lstrip('!'))) != negated

  @property
  def per_layer(self) -> bool:
    return '{i}' in self.hf_name

  @property
  def per_expert(self) -> bool:
    return '{e}' in self.hf_name

  def hf_names(self, config: Qwen2Config, index: int | None) -> list[str]:
    """The Hugging Face tensors of the `index`-th slice of the stacked parameter (one per expert)."""
    if not self.per_layer:
      return [self.hf_name]
    layer = config.layers_of(self.layers)[index]
    return [self.hf_name.format(i=layer, e=e) for e in range(config.num_experts if self.per_expert else 1)]

  def all_hf_names(self, config: Qwen2Config) -> list[str]:
    count = len(config.layers_of(self.layers)) if self.per_layer else 1
    return [name for index in range(count) for name in self.hf_names(config, index if self.per_layer else None)]

  def shape(self, config: Qwen2Config) -> tuple[int, ...]:
    return _evaluate(self.spec, config)

  def hf_shape(self, config: Qwen2Config) -> tuple[int, ...]:
    return _evaluate(self.hf_spec, config)


_LAYER = 'model.layers.{i}.'
_BLOCK = 'visual.blocks.{i}.'
RULES = (
    # Rule(Hugging Face name, grpo_jax path, transpose, Hugging Face shape, grpo_jax shape[, when])
    Rule('model.embed_tokens.weight', ('embedding',), False, 'V D', 'V D'),
    Rule(_LAYER + 'input_layernorm.weight', ('layers', 'attn_norm'), False, 'D', 'D'),
    Rule(_LAYER + 'self_attn.q_proj.weight', ('layers', 'q_weight'), True, 'N*H D', 'D N H', 'direct_queries'),
    Rule(_LAYER + 'self_attn.q_proj.bias', ('layers', 'q_bias'), False, 'N*H', 'N H', 'attention_bias'),
    Rule(_LAYER + 'self_attn.q_norm.weight', ('layers', 'q_norm'), False, 'H', 'H', 'qk_norm'),
    Rule(_LAYER + 'self_attn.k_proj.weight', ('layers', 'k_weight'), True, 'K*H D', 'D K H', 'grouped_attention'),
    Rule(_LAYER + 'self_attn.k_proj.bias', ('layers', 'k_bias'), False, 'K*H', 'K H', 'attention_bias'),
    Rule(_LAYER + 'self_attn.k_norm.weight', ('layers', 'k_norm'), False, 'H', 'H', 'qk_norm'),
    Rule(_LAYER + 'self_attn.v_proj.weight', ('layers', 'v_weight'), True, 'K*H D', 'D K H', 'grouped_attention'),
    Rule(_LAYER + 'self_attn.v_proj.bias', ('layers', 'v_bias'), False, 'K*H', 'K H', 'attention_bias'),
    # Multi-head latent attention (DeepSeek-V3): the query's latent, the keys' and values' latent
    # with the shared rotary key (kv_a_proj_with_mqa: R + Hr rows), the per-head up-projections.
    Rule(_LAYER + 'self_attn.q_a_proj.weight', ('layers', 'q_a_weight'), True, 'Q D', 'D Q', 'latent_queries'),
    Rule(_LAYER + 'self_attn.q_a_layernorm.weight', ('layers', 'q_a_norm'), False, 'Q', 'Q', 'latent_queries'),
    Rule(_LAYER + 'self_attn.q_b_proj.weight', ('layers', 'q_b_weight'), True, 'N*H Q', 'Q N H', 'latent_queries'),
    Rule(_LAYER + 'self_attn.kv_a_proj_with_mqa.weight', ('layers', 'kv_a_weight'), True, 'A D', 'D A', 'mla'),
    Rule(_LAYER + 'self_attn.kv_a_layernorm.weight', ('layers', 'kv_a_norm'), False, 'R', 'R', 'mla'),
    Rule(_LAYER + 'self_attn.kv_b_proj.weight', ('layers', 'kv_b_weight'), True, 'N*B R', 'R N B', 'mla'),
    Rule(_LAYER + 'self_attn.o_proj.weight', ('layers', 'o_weight'), True, 'D N*O', 'N O D'),
    Rule(_LAYER + 'post_attention_layernorm.weight', ('layers', 'mlp_norm'), False, 'D', 'D', 'family!=gemma3_text'),
    Rule(_LAYER + 'post_self_attn_layernorm.weight', ('layers', 'attn_post_norm'), False, 'D', 'D', 'family=glm4'),
    Rule(_LAYER + 'post_mlp_layernorm.weight', ('layers', 'mlp_post_norm'), False, 'D', 'D', 'family=glm4'),
    Rule(_LAYER + 'post_attention_layernorm.weight', ('layers', 'attn_post_norm'), False, 'D', 'D',
         'family=gemma3_text'),
    Rule(_LAYER + 'pre_feedforward_layernorm.weight', ('layers', 'mlp_norm'), False, 'D', 'D', 'family=gemma3_text'),
    Rule(_LAYER + 'post_feedforward_layernorm.weight', ('layers', 'mlp_post_norm'), False, 'D', 'D',
         'family=gemma3_text'),
    Rule(_LAYER + 'mlp.gate_proj.weight', ('layers', 'gate_weight'), True, 'F D', 'D F', '!fused_gate_up', 'dense'),
    Rule(_LAYER + 'mlp.up_proj.weight', ('layers', 'up_weight'), True, 'F D', 'D F', '!fused_gate_up', 'dense'),
    *(Rule(_LAYER + 'mlp.gate_up_proj.weight', ('layers', path), True, 'U D', 'D F', 'fused_gate_up', 'dense', half)
      for half, path in enumerate(('gate_weight', 'up_weight'))),
    Rule(_LAYER + 'mlp.down_proj.weight', ('layers', 'down_weight'), True, 'D F', 'F D', layers='dense'),
    Rule(_LAYER + 'mlp.gate.weight', ('layers', 'router_weight'), True, 'E D', 'D E', layers='sparse'),
    Rule(_LAYER + 'mlp.gate.e_score_correction_bias', ('layers', 'router_bias'), False, 'E', 'E',
         'router_scoring=sigmoid', 'sparse'),
    Rule(_LAYER + 'mlp.shared_experts.gate_proj.weight', ('layers', 'shared_gate_weight'), True, 'S D', 'D S',
         'n_shared_experts', 'sparse'),
    Rule(_LAYER + 'mlp.shared_experts.up_proj.weight', ('layers', 'shared_up_weight'), True, 'S D', 'D S',
         'n_shared_experts', 'sparse'),
    Rule(_LAYER + 'mlp.shared_experts.down_proj.weight', ('layers', 'shared_down_weight'), True, 'D S', 'S D',
         'n_shared_experts', 'sparse'),
    Rule(_LAYER + 'mlp.experts.{e}.gate_proj.weight', ('layers', 'expert_gate_weight'), True, 'M D', 'D M',
         layers='sparse'),
    Rule(_LAYER + 'mlp.experts.{e}.up_proj.weight', ('layers', 'expert_up_weight'), True, 'M D', 'D M', layers='sparse'),
    Rule(_LAYER + 'mlp.experts.{e}.down_proj.weight', ('layers', 'expert_down_weight'), True, 'D M', 'M D',
         layers='sparse'),
    Rule('model.norm.weight', ('final_norm',), False, 'D', 'D'),
    Rule('lm_head.weight', ('lm_head',), True, 'V D', 'D V', 'has_lm_head'),
    Rule('score.weight', ('score',), True, 'L D', 'D L', 'num_labels'),  # a reward model's head
    # Qwen2.5-VL's vision tower (model/vision.py): its blocks are the 'vision' layers.
    Rule('visual.patch_embed.proj.weight', ('visual', 'patch_weight'), False, 'C X Y Z Z', 'C P', 'vision'),
    *(Rule(_BLOCK + name, ('visual', path), transpose, hf, ours, 'vision', layers='vision') for name, path, transpose, hf, ours in (
        ('norm1.weight', 'norm1', False, 'C', 'C'),
        ('norm2.weight', 'norm2', False, 'C', 'C'),
        ('attn.qkv.weight', 'qkv_weight', True, 'J C', 'C J'),
        ('attn.qkv.bias', 'qkv_bias', False, 'J', 'J'),
        ('attn.proj.weight', 'proj_weight', True, 'C C', 'C C'),
        ('attn.proj.bias', 'proj_bias', False, 'C', 'C'),
        ('mlp.gate_proj.weight', 'gate_weight', True, 'I C', 'C I'),
        ('mlp.gate_proj.bias', 'gate_bias', False, 'I', 'I'),
        ('mlp.up_proj.weight', 'up_weight', True, 'I C', 'C I'),
        ('mlp.up_proj.bias', 'up_bias', False, 'I', 'I'),
        ('mlp.down_proj.weight', 'down_weight', True, 'C I', 'I C'),
        ('mlp.down_proj.bias', 'down_bias', False, 'C', 'C'))),
    Rule('visual.merger.ln_q.weight', ('visual', 'merger_norm'), False, 'C', 'C', 'vision'),
    Rule('visual.merger.mlp.0.weight', ('visual', 'merger_in_weight'), True, 'W W', 'W W', 'vision'),
    Rule('visual.merger.mlp.0.bias', ('visual', 'merger_in_bias'), False, 'W', 'W', 'vision'),
    Rule('visual.merger.mlp.2.weight', ('visual', 'merger_out_weight'), True, 'D W', 'W D', 'vision'),
    Rule('visual.merger.mlp.2.bias', ('visual', 'merger_out_bias'), False, 'D', 'D', 'vision'),
)

# Tensors some exporters add that carry no information (recomputed from the config).
IGNORED = re.compile(r'model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq')
# A vision-language checkpoint's language model under a prefix (Gemma 3's: the hub's, 5.x's), read
# as a text model's names; the rest of such a checkpoint (its vision tower, its projector) unread.
LANGUAGE_MODEL_PREFIXES = (('language_model.', ''), ('model.language_model.', 'model.'))
UNREAD_PARTS = re.compile(r'(model\.)?(vision_tower|multi_modal_projector)\..*')


# fp8 checkpoints (DeepSeek-V3's): `W.weight_scale_inv` beside an F8_E4M3 `W.weight`, one fp32 per
# block of quantization_config.weight_block_size.
SCALE_SUFFIX = '_scale_inv'
_LAYER_INDEX = re.compile(r'model\.layers\.(\d+)\.')


def _prediction_layer(name: str, config: Qwen2Config) -> bool:
  """Whether `name` belongs to a DeepSeek-V3 multi-token-prediction layer (layer index L and up):
  not part of the model grpo_jax trains, left unread."""
  match = _LAYER_INDEX.match(name)
  return config.family == 'deepseek_v3' and match is not None and int(match.group(1)) >= config.num_hidden_layers


def _fp8_block(directory: str) -> tuple[int, int] | None:
  """config.json's quantization_config block (rows, columns) of an fp8 checkpoint; None without one."""
  path = os.path.join(directory, 'config.json')
  if not os.path.isfile(path):
    return None
  with open(path) as f:
    quantization = json.load(f).get('quantization_config')
  if not quantization:
    return None
  method, block = quantization.get('quant_method'), quantization.get('weight_block_size')
  if method != 'fp8' or quantization.get('fmt', 'e4m3') != 'e4m3' or not (
      isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
    raise UserError(f'{path}: quantization_config {quantization} is not read: grpo_jax reads fp8 (e4m3) weights '
                    'with a weight_block_size of two positive ints')
  return tuple(block)


def rules_for(config: Qwen2Config) -> tuple[Rule, ...]:
  """The rules of the tensors this architecture has."""
  return tuple(rule for rule in RULES if rule.present(config))


def to_internal(rule: Rule, tensor: np.ndarray, config: Qwen2Config) -> np.ndarray:
  """Hugging Face layout -> grpo_jax layout of one layer's slice."""
  if rule.half is not None:
    tensor = np.split(tensor, 2, axis=0)[rule.half]
  if rule.transpose:
    tensor = tensor.T
  return tensor.reshape(rule.shape(config))


def to_hf(rule: Rule, array: np.ndarray, config: Qwen2Config) -> np.ndarray:
  """grpo_jax layout of one layer's slice -> Hugging Face layout (contiguous); of a `half` rule, its
  half of the Hugging Face tensor."""
  shape = rule.hf_shape(config)
  if rule.half is not None:
    shape = (shape[0] // 2,) + shape[1:]
  if rule.transpose:
    return np.ascontiguousarray(array.reshape(shape[::-1]).T)
  return np.ascontiguousarray(array.reshape(shape))


class HFCheckpoint:
  """The safetensors tensors of a Hugging Face model directory, by name, across shards."""

  def __init__(self, directory: str):
    index_path = os.path.join(directory, INDEX_FILE)
    single_path = os.path.join(directory, SINGLE_FILE)
    files: dict[str, SafetensorsFile] = {}
    self._where: dict[str, SafetensorsFile] = {}
    if os.path.isfile(index_path):
      try:
        with open(index_path) as f:
          weight_map = json.load(f)['weight_map']
      except (json.JSONDecodeError, KeyError) as error:
        raise UserError(f'{index_path} is not a valid safetensors index ({error})') from None
      for name, file_name in weight_map.items():
        if file_name not in files:
          shard = os.path.join(directory, file_name)
          if not os.path.isfile(shard):
            raise UserError(f'{shard} not found (listed in {INDEX_FILE} for tensor {name})')
          files[file_name] = SafetensorsFile(shard)
        if name not in files[file_name].names():
          raise UserError(f'{INDEX_FILE} places tensor {name} in {file_name}, but that file lacks it')
        self._where[name] = files[file_name]
    elif os.path.isfile(single_path):
      single = SafetensorsFile(single_path)
      self._where = {name: single for name in single.names()}
    else:
      raise UserError(f'{directory} has neither {INDEX_FILE} nor {SINGLE_FILE}')
    self.directory = directory
    # A vision-language checkpoint's language model: its tensors by their text model's names (the
    # stored name kept for the read); its vision tower and projector left aside, never read.
    self.unread = sorted(name for name in self._where if UNREAD_PARTS.fullmatch(name))
    self._stored: dict[str, str] = {}
    for prefix, replacement in LANGUAGE_MODEL_PREFIXES:
      if self.unread and any(name.startswith(prefix) for name in self._where):
        self._stored = {replacement + name[len(prefix):]: name for name in self._where if name.startswith(prefix)}
        break
    kept = {name: name for name in self._where if name not in self.unread and name not in self._stored.values()}
    self._where = {name: self._where[stored] for name, stored in {**kept, **self._stored}.items()}
    self.block = _fp8_block(directory)
    # fp8 weights (DeepSeek-V3's): each with its per-block inverse scales beside it, read dequantized.
    self.scales = {name[:-len(SCALE_SUFFIX)]: name for name in self._where if name.endswith(SCALE_SUFFIX)}
    for weight, scale in self.scales.items():
      if weight not in self._where:
        raise UserError(f'{directory}: tensor {scale} scales a tensor {weight} the checkpoint lacks')
      if self.block is None:
        raise UserError(f'{directory}: tensor {scale} needs config.json\'s quantization_config.weight_block_size')
      rows, columns = self._shape(weight)
      expected = (-(-rows // self.block[0]), -(-columns // self.block[1]))
      if self._shape(scale) != expected:
        raise UserError(f'{directory}: tensor {scale} has shape {list(self._shape(scale))}, expected {list(expected)} '
                        f'(blocks of {self.block[0]} x {self.block[1]} over {weight} [{rows}, {columns}])')
    self._scale_files = {scale: self._where.pop(scale) for scale in self.scales.values()}

  def names(self) -> list[str]:
    return list(self._where)

  def _shape(self, name: str) -> tuple[int, ...]:
    return self._where[name].shape(self._stored.get(name, name))

  def tensor(self, name: str) -> np.ndarray:
    """The tensor `name` as stored; an fp8 one with inverse scales, dequantized to fp32 (each
    128 x 128 block, the last ones ragged, times its scale: the product exact, then rounded once)."""
    if name not in self._where:
      raise UserError(f'{self.directory}: missing tensor {name}')
    tensor = self._where[name].tensor(self._stored.get(name, name))
    if name not in self.scales:
      return tensor
    scale_name = self.scales[name]
    scale = self._scale_files[scale_name].tensor(self._stored.get(scale_name, scale_name)).astype(np.float32)
    rows, columns = tensor.shape
    spread = np.repeat(np.repeat(scale, self.block[0], axis=0), self.block[1], axis=1)[:rows, :columns]
    return (tensor.astype(np.float64) * spread.astype(np.float64)).astype(np.float32)

  def check(self, config: Qwen2Config) -> None:
    """Every expected tensor present with the expected shape, nothing unexpected."""
    expected = {}
    for rule in rules_for(config):
      for name in rule.all_hf_names(config):
        expected[name] = rule.hf_shape(config)
    for name, shape in expected.items():
      if name not in self._where:
        raise UserError(f'{self.directory}: missing tensor {name}')
      found = self._shape(name)
      if found != shape:
        raise UserError(
            f'{self.directory}: tensor {name} has shape {list(found)}, expected {list(shape)} '
            'from config.json')
    for name in self._where:
      tied_head = name == 'lm_head.weight' and config.tie_word_embeddings
      if name not in expected and not tied_head and not IGNORED.fullmatch(name) and not _prediction_layer(name, config):
        raise UserError(f'{self.directory}: unexpected tensor {name} for a {config.model_type} model')
    if self.unread and config.model_type != 'gemma3_text':
      raise UserError(f'{self.directory}: unexpected tensor {self.unread[0]} for a {config.model_type} model')

  def layer_slice(self, rule: Rule, config: Qwen2Config, index: int | None) -> np.ndarray:
    """The `index`-th slice of a layer-stacked parameter (the whole parameter if not per layer),
    grpo_jax layout; a layer's E experts stacked."""
    slices = [to_internal(rule, self.tensor(name), config) for name in rule.hf_names(config, index)]
    return np.stack(slices) if rule.per_expert else slices[0]


def hf_tensors(params: dict, config: Qwen2Config) -> Iterator[TensorEntry]:
  """Every Hugging Face tensor of `params` (grpo_jax path -> host-readable array), produced lazily
  one layer slice at a time."""
  rules = rules_for(config)
  for rule in rules:
    if rule.half == 1:  # written with its first half
      continue
    halves = [rule] + [other for other in rules if other.half == 1 and other.hf_name == rule.hf_name]
    array = params[rule.path]
    dtype = np.dtype(array.dtype)
    shape = rule.hf_shape(config)
    if rule.per_layer:
      for index in range(array.shape[0]):
        for expert, name in enumerate(rule.hf_names(config, index)):
          at = (index, expert) if rule.per_expert else (index,)

          def produce(halves=halves, at=at):
            parts = [to_hf(half, np.asarray(params[half.path][at]), config) for half in halves]
            return parts[0] if len(parts) == 1 else np.concatenate(parts)
          yield TensorEntry(name, shape, dtype, produce)
    else:
      yield TensorEntry(rule.hf_name, shape, dtype,
                        lambda rule=rule, array=array: to_hf(rule, np.asarray(array), config))
