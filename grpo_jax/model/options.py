"""How the model computes (`ModelOptions`: dtypes, rematerialisation, the attention and decode paths,
LoRA, a frozen vision tower); what it computes is its Qwen2Config (model/config.py)."""

import dataclasses
import typing
from typing import Literal

from grpo_jax.errors import require
from grpo_jax.model.attention import (ATTENTION_IMPLEMENTATIONS, DECODE_ATTENTIONS, AttentionImplementation,
                                      DecodeAttention)
from grpo_jax.model.lora import LoraConfig

DType = Literal['float32', 'bfloat16']
# Storage dtypes: float16 too, so a float16 checkpoint converts without a change of precision.
ParamDType = Literal['float32', 'bfloat16', 'float16']
RematPolicy = Literal['none', 'full', 'dots', 'dots_no_batch']
# How a decode step (`extend` of one token per row) runs the layers: 'scan' (one lax.scan over the
# stacked parameters), 'unrolled' (one copy of the layer per index: each matmul reads its layer's
# slice of the stack in place), 'auto' (unrolled when compiling for GPUs, else scan). XLA:GPU
# copies each layer's weights out of the stack at a scan's dynamic index before its matmuls (a
# read and a write of every weight each step on top of the matmul's read: half of a 7B decode
# step on an H200, BENCHMARKS.md "Where a decode step goes"); XLA:TPU reads them in place.
DecodeLayers = Literal['auto', 'scan', 'unrolled']
# How dense decode attention reads the shared prompt caches (SharedPrefix) of the G samples of a
# prompt: 'copy' (each row takes a copy of its prompt's keys and values per layer: B x W x K x H,
# written and read again every step), 'once' (each prompt's keys and values read once, for the
# rows that read it: attention.SharedPart, a few more kernels per layer), 'auto' ('once' where
# the copies would be at least READ_ONCE_BYTES per layer and group of rows, else 'copy').
PromptReads = Literal['auto', 'copy', 'once']
# The KV cache's entries while decoding (model/cache.py): 'compute' (the compute dtype), or 'int8' /
# 'fp8' (8-bit, a scale per token and KV head: half a bf16 cache's bytes). Set from rollout.kv_cache.
KVCacheFormat = Literal['compute', 'int8', 'fp8']
KV_CACHE_FORMATS = typing.get_args(KVCacheFormat)


@dataclasses.dataclass(frozen=True)
class ModelOptions:
  """How the model computes; what it computes is its `Qwen2Config`. Checked on construction."""

  dtype: DType = 'float32'  # compute dtype of activations, matmul inputs and the KV cache
  param_dtype: ParamDType = 'float32'  # storage dtype of parameters (fp32 master weights with bf16 compute)
  remat: RematPolicy = 'none'  # rematerialisation of each layer under autodiff
  scan_layers: bool = True  # one lax.scan over layers: compile time independent of depth
  attention: AttentionImplementation = 'dense'  # full-sequence attention (attention.py); decoding: below
  attention_chunk: int = 512  # queries per chunk with attention='chunked'
  decode_attention: DecodeAttention = 'dense'  # attention over the KV cache while decoding (attention.py)
  decode_layers: DecodeLayers = 'auto'  # the layer loop of a decode step (DecodeLayers above)
  decode_block: int = 256  # cache slots per block of 'blockwise' and 'pallas' decode attention
  prompt_reads: PromptReads = 'auto'  # how dense decode attention reads shared prompts (PromptReads above)
  kv_cache: KVCacheFormat = 'compute'  # the decode cache's entries (KVCacheFormat above; rollout.kv_cache sets it)
  # Low-rank adapters (model/lora.py): the base frozen in `dtype`, the adapters in `param_dtype`.
  lora: LoraConfig | None = None
  # A vision-language model's tower kept as loaded: no gradient flows into it (its features are
  # constants of the loss) and the optimizer leaves its weights alone. LoRA freezes it anyway.
  freeze_vision: bool = False
  # Batch-invariant numerics (ops/fixed_order.py): every reduction of the forward pass (the matmuls'
  # contractions, attention over the keys, the norms' and softmaxes' sums) folded in one fixed order,
  # so a token's values do not depend on what else is in the batch, where its sequence sits in a
  # row, or the mesh. What algo.exact_on_policy sets for the policy (the sampler and the trainer).
  exact: bool = False

  def __post_init__(self):
    choices = {'dtype': typing.get_args(DType), 'param_dtype': typing.get_args(ParamDType),
               'remat': typing.get_args(RematPolicy), 'attention': ATTENTION_IMPLEMENTATIONS,
               'decode_attention': DECODE_ATTENTIONS, 'decode_layers': typing.get_args(DecodeLayers),
               'prompt_reads': typing.get_args(PromptReads), 'kv_cache': KV_CACHE_FORMATS}
    for name, allowed in choices.items():
      require(getattr(self, name) in allowed, name,
              f'must be one of {" | ".join(map(repr, allowed))}, got {getattr(self, name)!r}')
    require(self.attention_chunk >= 1, 'attention_chunk', f'must be >= 1, got {self.attention_chunk}')
    require(self.decode_block >= 1, 'decode_block', f'must be >= 1, got {self.decode_block}')
    require(self.kv_cache == 'compute' or self.decode_attention == 'dense', 'decode_attention',
            f"must be 'dense' with an 8-bit KV cache (kv_cache={self.kv_cache!r}): {self.decode_attention!r} reads the "
            'cache in blocks that do not apply its scales')
    if self.exact:  # the paths that have no fixed order (yet): one line each
      require(self.kv_cache == 'compute', 'kv_cache',
              f'{self.kv_cache!r} rounds the cached keys and values: the sampler then computes other log-probs than the '
              'trainer, which exact numerics (algo.exact_on_policy) rule out; use compute')
      require(self.decode_attention == 'dense', 'decode_attention',
              f"must be 'dense' with exact numerics (algo.exact_on_policy): {self.decode_attention!r} combines the "
              "cache's blocks by an online softmax whose order follows the cache, not the sequence")
      require(self.attention != 'cudnn', 'attention',
              "'cudnn' cannot be exact (algo.exact_on_policy): cuDNN orders its own sums; use 'dense' or 'chunked'")
