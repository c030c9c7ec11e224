"""The architecture config: Qwen2 / Qwen2.5 / Qwen3 / Qwen3-MoE / Qwen2.5-VL and the other families as
options of one dataclass (its config.json spellings: model/hf_config.py).

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
import math

from grpo_jax.errors import UserError
from grpo_jax.model.vision_config import VisionConfig  # noqa: F401 (the architecture's `vision`; re-exported)

ACTIVATIONS = ('silu', 'gelu_pytorch_tanh')
ROPE_TYPES = ('default', 'linear', 'llama3', 'yarn')
ROUTER_SCORINGS = ('softmax', 'sigmoid')
LAYER_TYPES = ('full_attention', 'sliding_attention')
# The layer stack's weights held by some layers only (Qwen2Config.layers_holding): a dense layer's
# MLP; a sparse layer's router (and DeepSeekMoE's choice bias), routed experts and shared experts.
DENSE_MLP_PARAMS = ('gate_weight', 'up_weight', 'down_weight')
EXPERT_PARAMS = ('router_weight', 'router_bias', 'expert_gate_weight', 'expert_up_weight', 'expert_down_weight',
                 'shared_gate_weight', 'shared_up_weight', 'shared_down_weight')

# model_type -> (architecture class, its defaults for the fields that tell the families apart, the
# values transformers gives the config.json keys a file leaves out). A field a config.json sets
# itself (attention_bias, partial_rotary_factor, ...) overrides its default.
_GEMMA3 = dict(family='gemma3_text', attention_bias=False, qk_norm=True, norm_offset=True, sandwich_norms=True,
               embedding_scale=True, hidden_act='gelu_pytorch_tanh')
_GEMMA3_FILE = dict(vocab_size=262208, head_dim=256, max_position_embeddings=131072, tie_word_embeddings=True,
                    bos_token_id=2, eos_token_id=1, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
                    rope_local_base_freq=10000.0, query_pre_attn_scalar=256, sliding_window=4096)
MODEL_TYPES = {'qwen2': ('Qwen2ForCausalLM', dict(attention_bias=True, qk_norm=False), {}),
               'qwen3': ('Qwen3ForCausalLM', dict(attention_bias=False, qk_norm=True), {}),
               'qwen3_moe': ('Qwen3MoeForCausalLM', dict(attention_bias=False, qk_norm=True), {}),
               'qwen2_5_vl': ('Qwen2_5_VLForConditionalGeneration', dict(attention_bias=True, qk_norm=False), {}),
               # Llama 3.x and DeepSeek-LLM (its own vocabulary, plain RoPE)
               'llama': ('LlamaForCausalLM', dict(family='llama', attention_bias=False, qk_norm=False),
                         dict(max_position_embeddings=2048, bos_token_id=1, eos_token_id=2)),
               'mistral': ('MistralForCausalLM', dict(family='mistral', attention_bias=False, qk_norm=False),
                           dict(max_position_embeddings=131072, bos_token_id=1, eos_token_id=2, sliding_window=4096)),
               'glm4': ('Glm4ForCausalLM', dict(family='glm4', attention_bias=True, qk_norm=False, sandwich_norms=True,
                                                fused_gate_up=True, rope_interleaved=True, partial_rotary_factor=0.5),
                        dict(head_dim=128, max_position_embeddings=131072, rms_norm_eps=1.5625e-07)),
               'gemma3_text': ('Gemma3ForCausalLM', _GEMMA3, _GEMMA3_FILE),
               # DeepSeek-V3/R1, Moonlight, Kimi-K2: multi-head latent attention and DeepSeekMoE
               'deepseek_v3': ('DeepseekV3ForCausalLM', dict(family='deepseek_v3', attention_bias=False, qk_norm=False,
                                                             rope_interleaved=True, router_scoring='sigmoid'),
                               dict(vocab_size=129280, max_position_embeddings=4096, bos_token_id=0, eos_token_id=1,
                                    rms_norm_eps=1e-6, rope_theta=10000.0, q_lora_rank=1536, kv_lora_rank=512,
                                    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_group=8, topk_group=4,
                                    n_shared_experts=1, n_routed_experts=256, num_experts_per_tok=8,
                                    moe_intermediate_size=2048, first_k_dense_replace=3, norm_topk_prob=True,
                                    routed_scaling_factor=2.5, rope_interleave=True)),
               # the 4B-27B checkpoints: their language model, read by its prefix (text-only; the
               # vision tower and projector are not loaded), is a gemma3_text decoder
               'gemma3': ('Gemma3ForConditionalGeneration', _GEMMA3, _GEMMA3_FILE)}
SUPPORTED_ARCHITECTURES = tuple(architecture for architecture, _, _ in MODEL_TYPES.values())
# Reward models: the decoder with a `score` head of one label instead of the lm_head (what
# Skywork-Reward-V2 and most open reward models are), by the model_type of their decoder.
SEQUENCE_CLASSIFIERS = {'qwen2': 'Qwen2ForSequenceClassification', 'qwen3': 'Qwen3ForSequenceClassification',
                        'llama': 'LlamaForSequenceClassification'}


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
  """YaRN's attention temperature for a context stretched by `factor`: 0.1 mscale ln(factor) + 1."""
  return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


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
  qk_norm: bool = False  # per-head RMSNorm of queries and keys before RoPE (Qwen3, Gemma 3)
  # The families beyond Qwen (MODEL_TYPES holds each one's defaults); '' is a Qwen model, its
  # model_type read from the fields above and below.
  family: str = ''  # 'llama' (and DeepSeek-LLM), 'mistral', 'glm4', 'gemma3_text'
  hidden_act: str = 'silu'  # the gated MLP's activation: 'silu' or 'gelu_pytorch_tanh' (Gemma 3)
  norm_offset: bool = False  # RMSNorm scales by (1 + w), in fp32 before the cast (Gemma 3)
  sandwich_norms: bool = False  # a norm on the attention's and on the MLP's output too (GLM-4, Gemma 3)
  fused_gate_up: bool = False  # the checkpoint stores gate and up as one [2F, D] tensor (GLM-4)
  embedding_scale: bool = False  # embeddings times sqrt(hidden_size), in the table's dtype (Gemma 3)
  query_pre_attn_scalar: float | None = None  # attention scores scaled by its -1/2 power; None: head_dim's
  # RoPE beyond the plain one: frequency scaling, a rotated fraction of the head, the pairing.
  rope_type: str = 'default'  # 'default', 'linear' (positions / rope_factor) or 'llama3' (Llama 3.1+)
  rope_factor: float = 1.0  # 'linear' and 'llama3': how far the context was stretched
  rope_low_freq_factor: float = 1.0  # 'llama3': wavelengths above original / this are divided by rope_factor
  rope_high_freq_factor: float = 4.0  # 'llama3': those below original / this are kept; between, blended
  rope_original_max_position_embeddings: int = 8192  # 'llama3': the context before the stretch
  partial_rotary_factor: float = 1.0  # the fraction of each head that rotates (the rest passes; GLM-4: 0.5)
  rope_interleaved: bool = False  # rotate pairs (2i, 2i + 1) instead of (i, i + H/2) (GLM-4)
  # Sliding-window attention: a query sees the keys at most sliding_window - 1 tokens before it.
  sliding_window: int | None = None  # None: every layer attends over the whole sequence
  # Per layer, 'sliding_attention' or 'full_attention' (Gemma 3); () with sliding_window: every layer slides.
  layer_types: tuple[str, ...] = ()
  local_rope_theta: float = 10000.0  # the sliding layers' own RoPE base when layer_types mixes them (Gemma 3)
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
  # YaRN ('yarn' rope_type; rope_factor and rope_original_max_position_embeddings as above): the
  # frequencies between the two correction dimensions blended, cos and sin scaled by rope_attention_factor.
  rope_beta_fast: float = 32.0  # rotations that bound the extrapolated (kept) frequencies
  rope_beta_slow: float = 1.0  # ... and the interpolated (divided) ones
  rope_mscale: float = 0.0  # 0: unset; with rope_mscale_all_dim, the attention factor's numerator
  rope_mscale_all_dim: float = 0.0  # 0: unset; DeepSeek's softmax scale is multiplied by its mscale squared
  rope_truncate: bool = True  # the correction range rounded outwards to whole dimensions
  # Multi-head latent attention (DeepSeek-V3, family deepseek_v3; kv_lora_rank 0: not MLA): keys and
  # values come from one latent of R = kv_lora_rank values per token (normed) and one rotary key of
  # Hr = qk_rope_head_dim shared by the heads; each head's key is its up-projection of the latent
  # (Hn = qk_nope_head_dim) joined with the rotary key, its value another up-projection (Hv =
  # v_head_dim). Queries through a latent of Rq = q_lora_rank (normed), or directly (None). head_dim
  # is then Hn + Hr, what the queries and keys hold per head.
  q_lora_rank: int | None = None  # Rq
  kv_lora_rank: int = 0  # R
  qk_nope_head_dim: int = 0  # Hn
  qk_rope_head_dim: int = 0  # Hr, the rotated part of a query and a key
  v_head_dim: int = 0  # Hv
  # DeepSeekMoE's router (router_scoring 'sigmoid'): each expert's score a sigmoid, chosen by score plus
  # a load-balancing bias (router_bias, never a weight) within the topk_group of n_group groups whose
  # two best scores sum highest, weighted by the scores (normalised with norm_topk_prob) times
  # routed_scaling_factor; n_shared_experts' worth of SwiGLU width (M each) computed for every token.
  router_scoring: str = 'softmax'  # 'softmax' (Qwen3-MoE) or 'sigmoid' (DeepSeekMoE)
  n_group: int = 1
  topk_group: int = 1
  routed_scaling_factor: float = 1.0
  n_shared_experts: int = 0
  vision: VisionConfig | None = None  # the vision tower (Qwen2.5-VL); None: a text model
  # A reward model (SEQUENCE_CLASSIFIERS): a `score` head [D, num_labels] in place of the lm_head,
  # read at each row's last token that is not pad_token_id; 0: a causal language model.
  num_labels: int = 0
  pad_token_id: int | None = None  # the padding id; a reward model scores the rightmost token that is not it

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
    if not (self.attention_bias or self.qk_norm or self.family):
      raise UserError('model architecture field attention_bias=false needs qk_norm=true (Qwen3): '
                      'Qwen2 checkpoints always carry q/k/v biases')
    families = sorted({defaults.get('family', '') for _, defaults, _ in MODEL_TYPES.values()})
    if self.family not in families:
      raise UserError(f'model architecture field family must be one of {families}, got {self.family!r}')
    if self.hidden_act not in ACTIVATIONS:
      raise UserError(f'model architecture field hidden_act must be one of {list(ACTIVATIONS)}, '
                      f'got {self.hidden_act!r}')
    if self.rope_type not in ROPE_TYPES:
      raise UserError(f'model architecture field rope_type must be one of {list(ROPE_TYPES)}, got {self.rope_type!r}')
    if not self.rope_factor > 0 or not self.local_rope_theta > 0:
      raise UserError('model architecture fields rope_factor and local_rope_theta must be positive')
    if self.rope_type == 'llama3' and not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor:
      raise UserError('model architecture field rope_low_freq_factor must be positive and below rope_high_freq_factor')
    if self.query_pre_attn_scalar is not None and not self.query_pre_attn_scalar > 0:
      raise UserError('model architecture field query_pre_attn_scalar must be positive, '
                      f'got {self.query_pre_attn_scalar}')
    if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2 or not self.rotary_dim:
      raise UserError(f'model architecture field partial_rotary_factor ({self.partial_rotary_factor}) must rotate an '
                      f'even, non-zero part of head_dim ({self.resolved_head_dim})')
    if self.sliding_window is not None and self.sliding_window <= 0:
      raise UserError(f'model architecture field sliding_window must be positive, got {self.sliding_window}')
    if self.layer_types:
      if len(self.layer_types) != self.num_hidden_layers or not set(self.layer_types) <= set(LAYER_TYPES):
        raise UserError(f'model architecture field layer_types must name {self.num_hidden_layers} layers, each one of '
                        f'{list(LAYER_TYPES)}')
      if 'sliding_attention' in self.layer_types and self.sliding_window is None:
        raise UserError('model architecture field layer_types names sliding_attention layers, but sliding_window '
                        'is unset')
    if (self.family or self.sliding_window) and (self.vision is not None or self.mrope_section):
      raise UserError('model architecture: a vision tower and M-RoPE go with the Qwen models only')
    if self.family not in ('', 'deepseek_v3') and self.num_experts:
      raise UserError('model architecture: experts go with the Qwen3-MoE and DeepSeek-V3 models only')
    self._check_latent_attention()
    self._check_router()
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
      if self.qk_norm is False and not self.family:
        raise UserError('model architecture: a mixture of experts (num_experts > 0) is Qwen3-MoE, which has qk_norm')
    bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
    if bad:
      raise UserError(f'model architecture field mlp_only_layers names layer {bad[0]}, outside [0, '
                      f'{self.num_hidden_layers})')
    if self.mrope_section and (len(self.mrope_section) != 3 or sum(self.mrope_section) != self.resolved_head_dim // 2
                               or min(self.mrope_section) < 0):
      raise UserError(f'model architecture field mrope_section {list(self.mrope_section)} must be three sizes '
                      f'summing to head_dim / 2 = {self.resolved_head_dim // 2}')
    if self.num_labels < 0:
      raise UserError(f'model architecture field num_labels must be >= 0, got {self.num_labels}')
    if self.num_labels and self.model_type not in SEQUENCE_CLASSIFIERS:
      raise UserError(f'model architecture: a score head (num_labels) goes with the decoders of '
                      f'{", ".join(SEQUENCE_CLASSIFIERS.values())}, not a {self.model_type} model')
    if self.pad_token_id is not None and not 0 <= self.pad_token_id < self.vocab_size:
      raise UserError(f'model architecture field pad_token_id ({self.pad_token_id}) is outside the vocabulary '
                      f'[0, {self.vocab_size})')
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

  def _check_latent_attention(self) -> None:
    """MLA's fields (kv_lora_rank > 0), which go with family deepseek_v3 and it with them."""
    if self.kv_lora_rank < 0:
      raise UserError(f'model architecture field kv_lora_rank must be >= 0, got {self.kv_lora_rank}')
    if (self.family == 'deepseek_v3') != bool(self.kv_lora_rank):
      raise UserError('model architecture: multi-head latent attention (kv_lora_rank > 0) goes with family '
                      f'deepseek_v3 and it with MLA; got family {self.family!r}, kv_lora_rank {self.kv_lora_rank}')
    if not self.kv_lora_rank:
      return
    for name in ('qk_nope_head_dim', 'qk_rope_head_dim', 'v_head_dim'):
      if getattr(self, name) <= 0:
        raise UserError(f'model architecture field {name} must be positive with kv_lora_rank, got {getattr(self, name)}')
    if self.qk_rope_head_dim % 2:
      raise UserError(f'model architecture field qk_rope_head_dim must be even (rotary pairs), got {self.qk_rope_head_dim}')
    if self.q_lora_rank is not None and self.q_lora_rank <= 0:
      raise UserError(f'model architecture field q_lora_rank must be positive or null, got {self.q_lora_rank}')
    if self.head_dim is not None and self.head_dim != self.qk_nope_head_dim + self.qk_rope_head_dim:
      raise UserError(f'model architecture field head_dim ({self.head_dim}) must be qk_nope_head_dim + qk_rope_head_dim '
                      f'({self.qk_nope_head_dim + self.qk_rope_head_dim}) with multi-head latent attention')
    if self.attention_bias or self.qk_norm or self.partial_rotary_factor != 1.0:
      raise UserError('model architecture: multi-head latent attention has no attention_bias, qk_norm or '
                      'partial_rotary_factor (its rotary part is qk_rope_head_dim)')
    dense = tuple(range(len(self.mlp_only_layers)))
    if self.num_experts and (self.mlp_only_layers != dense or self.decoder_sparse_step != 1):
      raise UserError('model architecture: a deepseek_v3 model\'s dense layers are its first ones '
                      f'(first_k_dense_replace), got mlp_only_layers {list(self.mlp_only_layers)}')

  def _check_router(self) -> None:
    if self.router_scoring not in ROUTER_SCORINGS:
      raise UserError(f'model architecture field router_scoring must be one of {list(ROUTER_SCORINGS)}, '
                      f'got {self.router_scoring!r}')
    grouped = (self.n_group, self.topk_group, self.routed_scaling_factor, self.n_shared_experts) != (1, 1, 1.0, 0)
    if not self.num_experts or (self.router_scoring == 'softmax' and not grouped):
      return
    if self.router_scoring != 'sigmoid':
      raise UserError('model architecture fields n_group, topk_group, routed_scaling_factor and n_shared_experts go '
                      "with router_scoring 'sigmoid' (DeepSeekMoE)")
    if self.n_group <= 0 or self.num_experts % self.n_group or self.num_experts // self.n_group < 2:
      raise UserError(f'model architecture field n_group ({self.n_group}) must split num_experts ({self.num_experts}) '
                      'into groups of at least 2 experts (a group is scored by its two best)')
    if not 1 <= self.topk_group <= self.n_group:
      raise UserError(f'model architecture field topk_group must be in [1, n_group={self.n_group}], got {self.topk_group}')
    if self.num_experts_per_tok > self.topk_group * (self.num_experts // self.n_group):
      raise UserError(f'model architecture field num_experts_per_tok ({self.num_experts_per_tok}) exceeds the experts of '
                      f'topk_group ({self.topk_group}) groups of {self.num_experts // self.n_group}')
    if not self.routed_scaling_factor > 0 or self.n_shared_experts < 0:
      raise UserError('model architecture fields routed_scaling_factor must be positive and n_shared_experts >= 0')

  @property
  def mla(self) -> bool:
    """Whether attention is multi-head latent attention (DeepSeek-V3)."""
    return self.kv_lora_rank > 0

  @property
  def latent_queries(self) -> bool:
    """Whether queries come through their own latent (MLA with q_lora_rank)."""
    return self.mla and self.q_lora_rank is not None

  @property
  def direct_queries(self) -> bool:
    """Whether queries are one projection of the hidden state (q_proj)."""
    return not self.latent_queries

  @property
  def grouped_attention(self) -> bool:
    """Whether attention is grouped-query attention with k_proj and v_proj (not MLA)."""
    return not self.mla

  @property
  def value_head_dim(self) -> int:
    """What a head's value (and the attention's output) holds: head_dim, or MLA's v_head_dim."""
    return self.v_head_dim if self.mla else self.resolved_head_dim

  @property
  def cache_entry(self) -> tuple[int, int, int]:
    """(heads, key width, value width) of one token's KV-cache entry per layer: GQA's K heads of H
    each; MLA's one latent (R values, normed) joined with the rotary key (Hr), its values the
    latent itself (read from the keys: a value width of 0)."""
    if self.mla:
      return 1, self.kv_lora_rank + self.qk_rope_head_dim, 0
    return self.num_key_value_heads, self.resolved_head_dim, self.resolved_head_dim

  @property
  def shared_expert_size(self) -> int:
    """The SwiGLU width of a sparse layer's shared experts (DeepSeekMoE), 0 without them."""
    return self.n_shared_experts * self.moe_intermediate_size

  def attention_scale(self) -> float:
    """The factor attention scores are scaled by: H^-1/2 (query_pre_attn_scalar^-1/2 for Gemma 3);
    MLA's (Hn + Hr)^-1/2, with YaRN times the square of mscale(factor, rope_mscale_all_dim)."""
    if self.query_pre_attn_scalar is not None:
      return self.query_pre_attn_scalar ** -0.5
    scale = self.resolved_head_dim ** -0.5
    if self.mla and self.rope_type != 'default' and self.rope_mscale_all_dim:
      scale *= yarn_mscale(self.rope_factor, self.rope_mscale_all_dim) ** 2
    return scale

  def rope_attention_factor(self) -> float:
    """What YaRN scales cos and sin by (1 for the other rope types)."""
    if self.rope_type != 'yarn':
      return 1.0
    if self.rope_mscale and self.rope_mscale_all_dim:
      return yarn_mscale(self.rope_factor, self.rope_mscale) / yarn_mscale(self.rope_factor, self.rope_mscale_all_dim)
    return yarn_mscale(self.rope_factor)

  @property
  def model_type(self) -> str:
    """The Hugging Face model_type this architecture is written as."""
    if self.family:
      return self.family
    if self.vision is not None:
      return 'qwen2_5_vl'
    return 'qwen3_moe' if self.num_experts else 'qwen3' if self.qk_norm else 'qwen2'

  @property
  def architecture(self) -> str:
    """The transformers class this architecture is written as."""
    return SEQUENCE_CLASSIFIERS[self.model_type] if self.num_labels else MODEL_TYPES[self.model_type][0]

  @property
  def has_lm_head(self) -> bool:
    """Whether the model has an lm_head of its own: a language model whose embedding is not tied."""
    return not self.tie_word_embeddings and not self.num_labels

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

  def layers_holding(self, weight: str) -> tuple[int, ...]:
    """The layers whose slices the stacked weight `weight` (a parameter's name in the layer stack)
    holds, in order: EXPERT_PARAMS the sparse layers, DENSE_MLP_PARAMS the dense ones, any other
    every layer."""
    return self.layers_of('sparse' if weight in EXPERT_PARAMS else 'dense' if weight in DENSE_MLP_PARAMS else 'all')

  @property
  def num_sparse_layers(self) -> int:
    """Ls, the layers with a mixture of experts (what the recorded routes hold per token)."""
    return sum(self.sparse_layers)

  @property
  def sliding_layers(self) -> tuple[bool, ...]:
    """[L] whether each layer attends over a sliding window of sliding_window tokens."""
    if self.layer_types:
      return tuple(kind == 'sliding_attention' for kind in self.layer_types)
    return (self.sliding_window is not None,) * self.num_hidden_layers

  @property
  def rotary_dim(self) -> int:
    """The part of each head that RoPE rotates (all of it but with partial_rotary_factor; MLA's
    qk_rope_head_dim, the last part of a query)."""
    if self.mla:
      return self.qk_rope_head_dim
    return int(self.resolved_head_dim * self.partial_rotary_factor)

  @property
  def resolved_head_dim(self) -> int:
    if self.head_dim is not None:
      return self.head_dim
    if self.kv_lora_rank:
      return self.qk_nope_head_dim + self.qk_rope_head_dim
    return self.hidden_size // self.num_attention_heads

  def num_params(self, active: bool = False) -> int:
    """Parameter count, counting a tied embedding once; `active`: those one token computes with
    (k of the E experts of each sparse layer, the router's all), what FLOPs and MFU count."""
    d, f, v, h = self.hidden_size, self.intermediate_size, self.vocab_size, self.resolved_head_dim
    n, k = self.num_attention_heads, self.num_key_value_heads
    if self.mla:
      r, rope, value = self.kv_lora_rank, self.qk_rope_head_dim, self.v_head_dim
      rq = self.q_lora_rank
      queries = d * n * h if rq is None else d * rq + rq + rq * n * h
      attention = queries + d * (r + rope) + r + r * n * (self.qk_nope_head_dim + value) + n * value * d
    else:
      attention = d * n * h + 2 * d * k * h + n * h * d
      attention += (n * h + 2 * k * h) if self.attention_bias else 0
      attention += 2 * h if self.qk_norm else 0
    sparse = self.num_sparse_layers
    experts = self.num_experts_per_tok if active else self.num_experts
    shared = 3 * d * self.shared_expert_size + (self.num_experts if self.router_scoring == 'sigmoid' else 0)
    mlps = (self.num_hidden_layers - sparse) * 3 * d * f + sparse * (experts * 3 * d * self.moe_intermediate_size
                                                                     + d * self.num_experts + shared)
    layers = self.num_hidden_layers * (attention + (4 if self.sandwich_norms else 2) * d) + mlps
    head = d * self.num_labels if self.num_labels else 0 if self.tie_word_embeddings else d * v
    return v * d + layers + d + head + (self.vision.num_params() if self.vision is not None else 0)
