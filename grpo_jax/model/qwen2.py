"""Qwen2 / Qwen2.5 / Qwen3 / Qwen3-MoE / Qwen2.5-VL decoder in Flax NNX: one model, the family's
differences are options of its Qwen2Config (`attention_bias`, `qk_norm`, `num_experts`,
`mrope_section` and `vision`). Its layers (stacked parameters, one layer's computation) are
model/layers.py's, its KV cache model/cache.py's, its vision tower model/vision.py's: given
`images`, the tower's features replace the embeddings of the image tokens.

  embedding      [V, D]            lm_head     [D, V] (absent when tied)       final_norm [D]

Sliding-window layers (config.sliding_layers) also mask the keys sliding_window or more tokens back,
counted in real tokens of the sequence (attention.window_mask), in every path: the full-sequence
forward (padded or packed), prefill and decode over the cache and a shared prompt.

Masking uses segment ids [B, T]: 0 marks padding, and a token attends to earlier tokens of its own
segment only. A Hugging Face 0/1 attention mask is a valid segment-id array, and packed sequences
use 1, 2, 3, ... per row. Left- and right-padded batches therefore give each real token the same
logits as the unpadded sequence.
"""

import dataclasses
import functools
import typing
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpo_jax.errors import UserError, require
from grpo_jax.model.attention import TREE_BRANCHES, ends_softmax, real_segments, resolve_attention, sequence_attention
from grpo_jax.model.cache import SharedPrefix, stack_layers, unstack
from grpo_jax.model.decoding import CacheDecoding
from grpo_jax.model.config import Qwen2Config
from grpo_jax.model.embedding import embedding_lookup
from grpo_jax.model.layers import (DENSE_MLP_PARAMS, DecoderLayers, decoder_block, inverse_frequencies, layer_params,
                                   rms_norm, stacked_layers)
from grpo_jax.model.lora import TARGETS
from grpo_jax.model.moe import Routing, gathered
from grpo_jax.model.options import DType, ModelOptions, ParamDType  # noqa: F401 (names the model's users import)
from grpo_jax.model.quantize import Quantized, output_scale
from grpo_jax.model.ring_attention import context_size, from_zigzag, ring_attention, to_zigzag
from grpo_jax.model.token_ids import check_token_ids
from grpo_jax.model.vision import Images, VisionTower, place, place_any
from grpo_jax.ops import fixed_order
from grpo_jax.ops.logprob import target_platform
from grpo_jax.sharding import constrain

# prompt_reads 'auto' (model/options.py PromptReads) reads once from this many bytes. An estimate, not
# yet measured on a GPU: the few extra kernels of 'once' cost a few microseconds each, what an H100
# reads of 16 MiB takes.
READ_ONCE_BYTES = 16 << 20
# The window of a layer that attends over the whole sequence, in a model where others slide.
FULL_WINDOW = 1 << 30

_REMAT_POLICIES = {
    'full': None,  # save nothing, recompute the whole block
    'dots': jax.checkpoint_policies.dots_saveable,
    'dots_no_batch': jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def segment_positions(segment_ids: jax.Array) -> jax.Array:
  """Position of each token within its sequence [B, T]: counting from its segment's first token,
  and for a tree's branch (attention.TREE_BRANCHES) on from its root's last, the root being the
  latest root before it in the row."""
  length = segment_ids.shape[1]
  index = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), segment_ids.shape)
  starts = jnp.concatenate(
      [jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
  segment_start = jax.lax.cummax(jnp.where(starts, index, 0), axis=1)
  within = index - segment_start
  tree = segment_ids >= TREE_BRANCHES
  root = tree & (segment_ids % TREE_BRANCHES == 0)
  roots = jnp.cumsum(root, axis=1, dtype=jnp.int32)  # root tokens up to each token
  before = jax.lax.cummax(jnp.where(starts & root, roots - 1, 0), axis=1)  # ... before the latest root's first
  return within + jnp.where(tree & ~root, roots - before, 0)


def score_positions(tokens: jax.Array, pad_id: int | None) -> jax.Array:
  """[B] the position a reward model reads in each row of tokens [B, T]: the rightmost token that
  is not `pad_id` (0 for a row of pad ids), or the last position when there is no pad id, for a
  batch of one row only (transformers' rule, which cannot tell padding from tokens without one)."""
  batch, length = tokens.shape
  if pad_id is None:
    if batch > 1:
      raise UserError(f'a reward model without pad_token_id scores one row at a time, got {batch}: set pad_token_id in '
                      "its config.json (the id its tokenizer pads with)")
    return jnp.full((batch,), length - 1, jnp.int32)
  index = jnp.arange(length, dtype=jnp.int32)
  return jnp.argmax(jnp.where(tokens != pad_id, index, -1), axis=1).astype(jnp.int32)


class Qwen2(nnx.Module, CacheDecoding):
  """Qwen2 causal LM. `model(tokens)` -> fp32 logits [B, T, V].

  options: dtypes, rematerialisation, layer scan and full-sequence attention (see ModelOptions);
  kept as `self.options`. Incremental decoding (`extend`) reads the cache
  as `options.decode_attention` says.
  """

  def __init__(self, config: Qwen2Config, options: ModelOptions = ModelOptions(), *, rngs: nnx.Rngs):
    self.config = config
    self.options = options
    normal = nnx.initializers.normal(config.initializer_range)
    V, D = config.vocab_size, config.hidden_size
    self.embedding = nnx.Param(normal(rngs.params(), (V, D), self.param_dtype),
                               logical_axes=('vocab', 'embed'))
    self.layers = DecoderLayers(config, self.param_dtype, rngs)
    require(not (options.exact and config.family == 'deepseek_v3'), 'algo.exact_on_policy',
            "(model.exact) is not built for DeepSeek-V3's latent attention and sigmoid router: their sums are not in "
            'fixed order; set it false')
    require(not (config.mla and options.decode_attention == 'pallas'), 'model.decode_attention',
            "'pallas': the ragged decode kernel reads grouped-query caches, not multi-head latent attention's latent "
            "one; choose 'dense' or 'blockwise'")
    require(not (config.mla and options.kv_cache != 'compute'), 'rollout.kv_cache',
            f"{options.kv_cache!r}: multi-head latent attention's latent cache is not quantized; use compute")
    require(not (any(config.sliding_layers) and options.decode_attention == 'pallas'), 'model.decode_attention',
            "'pallas': the ragged decode kernel has no sliding window, which this model's layers use; "
            "choose 'dense' or 'blockwise'")
    self.final_norm = nnx.Param(jnp.full((D,), 0.0 if config.norm_offset else 1.0, self.param_dtype),
                                logical_axes=('act_embed',))
    if config.has_lm_head:
      self.lm_head = nnx.Param(normal(rngs.params(), (D, V), self.param_dtype),
                               logical_axes=('embed', 'vocab'))
    if config.num_labels:  # a reward model: its score head in place of the lm_head
      self.score = nnx.Param(normal(rngs.params(), (D, config.num_labels), self.param_dtype),
                             logical_axes=('embed', None))
    if config.vision is not None:
      self.visual = VisionTower(config.vision, config.initializer_range, self.param_dtype, rngs)
    if options.lora is not None and config.num_sparse_layers == config.num_hidden_layers:
      # A mixture's 'gate' / 'up' / 'down' are its dense layers' MLP (DeepSeek-V3's first three).
      experts = [target for target in options.lora.targets if TARGETS[target][0] in DENSE_MLP_PARAMS]
      require(not experts, 'model.lora.targets',
              f'{experts[0] if experts else ""!r}: adapters on the routed experts are not built, and this '
              f'mixture has no dense layer; target the attention projections'
              f'{" or the shared experts" if config.n_shared_experts else ""}')
    if options.lora is not None:
      names = layer_params(config)
      absent = [target for target in options.lora.targets if TARGETS[target][0] not in names]
      present = [target for target, (weight, _) in TARGETS.items() if weight in names]
      require(not absent, 'model.lora.targets',
              f'{absent[0] if absent else ""!r}: a {config.model_type} model has no {TARGETS[absent[0]][1] if absent else ""}; '
              f'its projections are {", ".join(present)}')
    if options.lora is not None:  # drawn last: the base weights are those of the same seed without LoRA
      self.layers.add_adapters(options.lora, rngs.params(), jnp.dtype(options.param_dtype))

  @property
  def dtype(self) -> jnp.dtype:
    """Compute dtype: activations, matmul inputs, the KV cache."""
    return jnp.dtype(self.options.dtype)

  @property
  def param_dtype(self) -> jnp.dtype:
    """Storage dtype of the (base) parameters: with LoRA the frozen base is held in the compute
    dtype, and `options.param_dtype` is the adapters'."""
    return jnp.dtype(self.options.dtype if self.options.lora is not None else self.options.param_dtype)

  @property
  def lora_scale(self) -> float:
    return 0.0 if self.options.lora is None else self.options.lora.scale

  def layer_settings(self) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Per layer, what run_layers hands each layer: its RoPE inverse frequencies [L, R/2] (None
    when every layer's are the same: `frequency(None)`, one constant, keeps a scanned program's
    size independent of depth) and its attention window [L] (FULL_WINDOW for a full-attention
    layer; None when no layer slides)."""
    c = self.config
    windows = None
    if any(c.sliding_layers):
      windows = np.asarray([c.sliding_window if sliding else FULL_WINDOW for sliding in c.sliding_layers], np.int32)
    frequencies = inverse_frequencies(c)
    return (None if (frequencies == frequencies[0]).all() else frequencies), windows

  def frequency(self, per_layer: jax.Array | None) -> jax.Array:
    """A layer's inverse frequencies [R/2]: its slice of layer_settings', or every layer's."""
    return inverse_frequencies(self.config)[0] if per_layer is None else per_layer

  def final_norm_of(self, x: jax.Array) -> jax.Array:
    return rms_norm(x, self.final_norm[...], self.config.rms_norm_eps, self.config.norm_offset)

  def run_layers(self, x: jax.Array, layer: Callable, xs=None, replay: jax.Array | None = None,
                 scan: bool | None = None, runs: bool = False) -> tuple[jax.Array, typing.Any, Routing | None]:
    """Runs the L layers on x [B, T, D]: `layer(x, params, xs_l, replay_l) -> (x, out_l, routing_l)`,
    where params is one layer's slice of the stacked parameters, xs_l of `xs` (a pytree of [L, ...]
    arrays, or None) and replay_l of `replay` ([Ls, B, T, k] routes of the sparse layers, or None;
    None in a dense layer). -> (x, the out_l stacked along a leading L axis, the sparse layers'
    Routing stacked along a leading Ls axis, or None in a dense model).

    As one lax.scan with `scan` (default: `scan_layers`) when every layer is of one kind, otherwise
    unrolled over the same arrays; either way xs is sliced one layer at a time, so a stacked KV
    cache is read in place, never carried. With `runs` (small xs: the full-sequence forward) a
    model whose kinds come in runs (DeepSeek-V3's dense layers, then its sparse ones) scans each
    run, its slices of the stacks taken once, so the program's size does not grow with depth.
    """
    params = self.layers.arrays()
    sparse = self.config.sparse_layers

    def body(x, inputs):
      x, out, routing = layer(x, *inputs)
      return x, (out, routing)
    if self._scans(scan):
      x, (outs, routings) = jax.lax.scan(body, x, (params, xs, replay))
      return x, outs, routings
    if runs and (self.options.scan_layers if scan is None else scan):
      return self._run_scans(x, body, params, xs, replay)
    slot = {name: {i: j for j, i in enumerate(stacked_layers(self.config, name))} for name in params}
    sparse_index = [sum(sparse[:i]) for i in range(len(sparse))]
    outs, routings = [], []
    for index in range(self.config.num_hidden_layers):
      own = {name: value[slot[name][index]] for name, value in params.items() if index in slot[name]}
      replay_l = None if replay is None or not sparse[index] else replay[sparse_index[index]]
      x, out, routing = layer(x, own, jax.tree.map(lambda a, i=index: a[i], xs), replay_l)
      outs.append(out)
      if routing is not None:
        routings.append(routing)
    stack = lambda parts: jax.tree.map(lambda *p: jnp.stack(p), *parts)  # noqa: E731
    return x, stack(outs), (stack(routings) if routings else None)

  def _run_scans(self, x, body, params, xs, replay):
    """run_layers as one scan per run of layers of one kind, in layer order."""
    sparse = self.config.sparse_layers
    starts = [0] + [i for i in range(1, len(sparse)) if sparse[i] != sparse[i - 1]] + [len(sparse)]
    outs, routings = [], []
    for start, stop in zip(starts[:-1], starts[1:]):
      layers = set(range(start, stop))
      own = {}
      for name, value in params.items():
        held = [j for j, i in enumerate(stacked_layers(self.config, name)) if i in layers]
        if held:
          own[name] = value[held[0]:held[-1] + 1]
      first = sum(sparse[:start])
      replay_run = None if replay is None or not sparse[start] else replay[first:first + stop - start]
      x, (out, routing) = jax.lax.scan(body, x, (own, jax.tree.map(lambda a: a[start:stop], xs), replay_run))
      outs.append(out)
      if routing is not None:
        routings.append(routing)
    join = lambda parts: jax.tree.map(lambda *p: jnp.concatenate(p), *parts)  # noqa: E731
    return x, join(outs), (join(routings) if routings else None)

  def _scans(self, scan: bool | None) -> bool:
    """Whether run_layers(scan=scan) runs its layers as a scan (every layer of one kind)."""
    return (self.options.scan_layers if scan is None else scan) and len(set(self.config.sparse_layers)) == 1

  def _reads_prompts_once(self, prefix: SharedPrefix | None) -> bool:
    """Whether dense decode attention reads each prompt of `prefix` once for its rows
    (`ModelOptions.prompt_reads`); only where the prefix bounds its readers."""
    if prefix is None or not prefix.readers or self.options.prompt_reads == 'copy' or self.options.exact:
      return False  # exact numerics read each row's copy: its keys in the sequence's order
    if self.options.prompt_reads == 'once':
      return True
    rows, (width, kv_heads, head_dim) = prefix.index.shape[1], prefix.k.shape[-3:]
    return rows * width * kv_heads * head_dim * prefix.k.dtype.itemsize >= READ_ONCE_BYTES

  def _scan_decode(self) -> bool:
    """Whether a decode step runs its layers as a scan (`ModelOptions.decode_layers`)."""
    if self.options.decode_layers == 'auto':
      return self.options.scan_layers and target_platform() != 'gpu'
    return self.options.decode_layers == 'scan'

  def loop_view(self) -> tuple[typing.Any, Callable[[typing.Any], 'Qwen2']]:
    """(pieces, rebuild) for a loop whose body runs decode steps: `rebuild(pieces)` inside the body
    is this model. With unrolled decode layers (`decode_layers`), each stacked layer array is cut
    into one array per layer before the loop and stacked again inside it, where XLA folds each
    layer's slice of the stack back to its own piece: the matmuls read the pieces in place. XLA:GPU
    otherwise copies every layer's weights out of the loop-invariant stack on every iteration (a
    slice feeding a matmul inside a while body is materialised). The cut costs one copy of the
    layer weights, made once per loop."""
    graphdef, state = nnx.split(self)
    if self._scan_decode():
      return state, lambda pieces: nnx.merge(graphdef, pieces)
    stacked = lambda path, x: path[0] == jax.tree_util.DictKey('layers') and x.ndim >= 1  # noqa: E731
    # With the decode step's attention in one kernel (attention.ends_softmax: 'pallas' on GPUs, the
    # option that cuts a step's kernels), the dense MLP's gate and up weights are cut as one
    # [D, F, 2] piece per layer (the cut copies them anyway), so the loop's MLP is one matmul
    # (layers._mlp_block): XLA:GPU's dot merger leaves two matmuls of one input apart past its size
    # threshold (the 7B's [3584, 18944] pair), a kernel per layer. Not where adapters add to either
    # (LoRA), nor where a layer has no dense MLP.
    leaves = dict(jax.tree_util.tree_flatten_with_path(state)[0])
    names = self.layers.names
    fuse = ('gate_weight' in names and not any(name.startswith(('gate_lora', 'up_lora')) for name in names)
            and ends_softmax(self.options.decode_attention))
    gate, up = jax.tree_util.DictKey('gate_weight'), jax.tree_util.DictKey('up_weight')

    def cut(path, x):
      if not stacked(path, x):
        return x
      if fuse and path[1] == gate:
        other = leaves[(path[0], up) + path[2:]]
        return tuple(jnp.stack([x[i], other[i]], axis=-1) for i in range(x.shape[0]))
      if fuse and path[1] == up:  # held in gate's piece: an empty placeholder keeps the state's shape
        return tuple(x[i][..., :0] for i in range(x.shape[0]))
      return tuple(x[i] for i in range(x.shape[0]))
    pieces = jax.tree_util.tree_map_with_path(cut, state)

    def rebuild(pieces):
      restacked = jax.tree.map(lambda p: jnp.stack(p) if isinstance(p, tuple) else p, pieces,
                               is_leaf=lambda p: isinstance(p, tuple))
      return nnx.merge(graphdef, restacked)
    return pieces, rebuild

  def layer_view(self, arrays: tuple[jax.Array, ...]) -> tuple[typing.Any, Callable]:
    """(pieces, rebuild) for [L, ...] arrays that a decode loop's layers read one layer each (the
    shared prompts' keys and values): loop_view's cut, when the decode layers are unrolled."""
    if self._scan_decode():
      return arrays, lambda pieces: pieces
    pieces = tuple(unstack(x) for x in arrays)  # an 8-bit cache's values and scales alike
    return pieces, lambda pieces: tuple(stack_layers(parts) for parts in pieces)

  # ---- full-sequence forward (training, scoring) ----

  @fixed_order.model_numerics
  def __call__(self, tokens: jax.Array, *, positions: jax.Array | None = None,
               segment_ids: jax.Array | None = None, routes: jax.Array | None = None,
               images: Images | None = None) -> jax.Array:
    """tokens [B, T] int32 -> logits [B, T, V] fp32; a reward model's: its scores [B, num_labels]
    (`scores`), what transformers' sequence classifier returns as its logits."""
    if self.config.num_labels:
      return self.scores(tokens, positions=positions, segment_ids=segment_ids)
    return self.project(self.hidden_states(tokens, positions=positions, segment_ids=segment_ids, routes=routes,
                                           images=images))

  @fixed_order.model_numerics
  def scores(self, tokens: jax.Array, *, positions: jax.Array | None = None,
             segment_ids: jax.Array | None = None) -> jax.Array:
    """A reward model's scores [B, num_labels] fp32 of token rows [B, T]: its score head on the
    final-norm hidden state of each row's rightmost token that is not the pad id, the token
    transformers' sequence classifier reads. That rule looks at the ids, not at `segment_ids`: a
    row that ends in the pad id (a completion closed by a Qwen <|endoftext|>, a Llama whose pad is
    its eos) is read at the token before it, and a row of pad ids only at its first. Without a pad id
    the last position is read, and only a batch of one row is taken, as transformers does."""
    c = self.config
    require(c.num_labels > 0, 'model', 'scores need a reward model (a checkpoint with a score head)')
    index = score_positions(tokens, c.pad_token_id)
    hidden = self.hidden_states(tokens, positions=positions, segment_ids=segment_ids)
    return self.score_head(jnp.take_along_axis(hidden, index[:, None, None], axis=1)[:, 0])

  def score_head(self, last: jax.Array) -> jax.Array:
    """The score head on final-norm hidden states last [B, D] (each sequence's read token) ->
    scores [B, num_labels] fp32; `scores` reads one sequence per row, packed rows read several."""
    return jnp.einsum('BD,DL->BL', last.astype(self.dtype), self.score[...].astype(self.dtype),
                      preferred_element_type=jnp.float32)

  @fixed_order.model_numerics
  def hidden_states(self, tokens: jax.Array, *, positions: jax.Array | None = None,
                    segment_ids: jax.Array | None = None, routes: jax.Array | None = None,
                    return_routing: bool = False, images: Images | None = None, placed=None):
    """Final-norm hidden states [B, T, D] (what the fused log-prob op consumes).

    positions: [B, T], or [B, T, 3] with M-RoPE (vision.mrope_positions); default: each token's
    index among its segment's. routes [B, T, Ls, k]: a mixture of experts routes each token to
    these experts (routing replay, model/moe.py). return_routing: return (hidden, Routing)
    instead, what the sparse layers did (None for a dense model). images: the vision tower's
    input and where its features go (model/vision.py). placed: (features [B, F, D], placement)
    features already computed (image_features), placed as vision.place_any says: placement [B, T]
    into each row from its own, or [B', T, 2] into rows that take them from several of the B
    (packed rows).
    """
    hidden, routing, _ = self.sequence_pass(tokens, positions=positions, segment_ids=segment_ids, routes=routes,
                                            images=images, placed=placed)
    return (hidden, routing) if return_routing else hidden

  def sequence_pass(self, tokens: jax.Array, *, positions: jax.Array | None = None,
                    segment_ids: jax.Array | None = None, routes: jax.Array | None = None,
                    images: Images | None = None, placed=None, keep_kv: bool = False):
    """hidden_states' forward -> (hidden [B, T, D], Routing or None, and with `keep_kv` every
    layer's keys and values (k [L, B, T, K, H], v [L, B, T, K, Hv]) as a KV cache holds them, in
    the row's order; else None). Under a mesh with a context axis the rows split along their
    length and attention goes round the ring (model/ring_attention.py): the update's passes, and
    the sampler's prefill of prompts split over context (model.extend)."""
    if keep_kv and self.config.mla:
      raise ValueError("keep_kv: multi-head latent attention's cache holds its latent, which the full-sequence "
                       'forward does not return; prefill it through model.extend on one device per row')
    segment_ids = real_segments(tokens, segment_ids)
    ordinals = segment_positions(segment_ids)  # the default positions; what a sliding window counts
    if positions is None:
      positions = ordinals
    context, length = context_size(), tokens.shape[1]
    padded = length + -length % (2 * context) if context > 1 else length  # the zig-zag layout's 2c chunks
    slots = jnp.broadcast_to(jnp.arange(padded, dtype=jnp.int32), (tokens.shape[0], padded))
    if context > 1:
      # Context parallelism: the rows padded to 2c chunks (pads of segment 0, which no real token
      # sees), every per-token input in the zig-zag order the context axis holds them in, attention by
      # the ring; the hidden states (and routes) come back in the row's order, the pads cut.
      def zigzag(x, axis=1, pad_value=None):
        pad = [(0, 0)] * x.ndim
        pad[axis] = (0, padded - length)
        x = jnp.pad(x, pad, mode='edge') if pad_value is None else jnp.pad(x, pad, constant_values=pad_value)
        return to_zigzag(x, context, axis)
      segment_ids, ordinals, positions, slots = (zigzag(segment_ids, pad_value=0), zigzag(ordinals), zigzag(positions),
                                                 to_zigzag(slots, context))
      attend = functools.partial(ring_attention, slots=slots, segments=segment_ids, chunk=self.options.attention_chunk,
                                 ordinals=ordinals)
    else:
      attend = sequence_attention(resolve_attention(self.options.attention, self.dtype), slots, segment_ids,
                                  self.options.attention_chunk, ordinals=ordinals)
    real = segment_ids != 0

    def block(params, x, replay, frequency, window):
      return decoder_block(params, x, positions, functools.partial(attend, window=window), config=self.config,
                           dtype=self.dtype, inverse_frequency=self.frequency(frequency),
                           lora_scale=self.lora_scale, real=real, replay=replay)
    if self.options.remat != 'none':
      block = jax.checkpoint(block, policy=_REMAT_POLICIES[self.options.remat])

    def layer(x, params, settings, replay):
      x, kv, routing = block(params, x, replay, *settings)
      return x, kv if keep_kv else None, routing

    x = self._embed(tokens, images)
    if placed is not None:
      x = place_any(x, *placed)
    replay = self._replay(routes)
    if context > 1:
      x = constrain(zigzag(x), ('batch', 'seq', 'act_embed'))
      replay = None if replay is None else zigzag(replay, axis=2)
    x, kv, routing = self.run_layers(x, layer, self.layer_settings(), replay=replay, runs=True)
    hidden = self.final_norm_of(x)
    routing = gathered(routing)
    if context > 1:
      hidden = constrain(from_zigzag(hidden, context)[:, :length], ('batch', 'seq', 'act_embed'))
      if routing is not None:
        routing = dataclasses.replace(routing, experts=from_zigzag(routing.experts, context)[:, :length],
                                      differs=from_zigzag(routing.differs, context)[:, :length])
      if keep_kv:
        kv = tuple(from_zigzag(x, context, axis=2)[:, :, :length] for x in kv)
    return hidden, routing, kv

  def _replay(self, routes: jax.Array | None) -> jax.Array | None:
    """routes [B, T, Ls, k] -> [Ls, B, T, k], the sparse layers' slices (None: route live)."""
    if routes is None:
      return None
    c = self.config
    expected = (c.num_sparse_layers, c.num_experts_per_tok)
    if not c.num_sparse_layers or routes.shape[2:] != expected:
      raise ValueError(f'routes of shape {routes.shape}: this model routes [B, T, {expected[0]}, {expected[1]}]')
    return jnp.moveaxis(routes, 2, 0)

  def lm_head_weight(self) -> jax.Array:
    """[D, V] in the compute dtype; the transposed embedding when tied."""
    require(not self.config.num_labels, 'model', 'a reward model (a score head) has no lm_head: it scores, and does '
            'not sample or take log-probs')
    if self.config.tie_word_embeddings:
      return self.embedding[...].astype(self.dtype).T
    return self.lm_head[...].astype(self.dtype)

  @fixed_order.model_numerics
  def project(self, hidden: jax.Array) -> jax.Array:
    """hidden [B, T, D] -> logits [B, T, V], accumulated and returned in fp32."""
    weight = self.lm_head_weight()
    if fixed_order.exact('matmul') and not isinstance(weight, Quantized):  # the sampler's logits, folded over D
      flat = hidden.astype(self.dtype).reshape(-1, hidden.shape[-1])
      logits = fixed_order.fold_matmul(flat, weight).reshape(hidden.shape[:-1] + (weight.shape[-1],))
    elif isinstance(weight, Quantized):  # the sampler's 8-bit copy: the values, each column scaled after
      logits = jnp.einsum('BTD,DV->BTV', hidden.astype(self.dtype), weight.values.astype(self.dtype),
                          preferred_element_type=jnp.float32) * output_scale(weight, 1)
    else:
      logits = jnp.einsum('BTD,DV->BTV', hidden.astype(self.dtype), weight, preferred_element_type=jnp.float32)
    return constrain(logits, ('batch', 'seq', 'vocab'))

  def _embed(self, tokens: jax.Array, images: Images | None = None) -> jax.Array:
    if not isinstance(tokens, jax.core.Tracer) and getattr(tokens, 'is_fully_addressable', True):
      # An eager call checks its ids here; under jit the doors that take ids check them
      # (token_ids.py): a traced lookup cannot raise, and would answer a bad id with a NaN row.
      check_token_ids(np.asarray(tokens), self.config.vocab_size, 'model input')
    table = self.embedding[...]
    if isinstance(table, Quantized):  # the sampler's 8-bit copy (a tied output projection): rows scaled
      x = (embedding_lookup(table.values, tokens).astype(self.dtype)
           * jnp.take(table.scale[:, 0], tokens, axis=0)[..., None].astype(self.dtype))
    else:
      x = embedding_lookup(table, tokens)
      if self.config.embedding_scale:  # sqrt(D) rounded to the table's dtype, as the checkpoint's model does
        x = x * jnp.asarray(self.config.hidden_size ** 0.5, x.dtype)
      x = x.astype(self.dtype)
    if isinstance(table, Quantized) and self.config.embedding_scale:
      x = x * jnp.asarray(self.config.hidden_size ** 0.5, self.dtype)
    if images is not None:
      x = place(x, self.image_features(images), images.placement)
    return constrain(fixed_order.settle(x), ('batch', 'seq', 'act_embed'))

  @fixed_order.model_numerics
  def image_features(self, images: Images) -> jax.Array:
    """Each row's merged image features [B, F, D] in the compute dtype (constants of the loss with
    `freeze_vision`)."""
    if self.config.vision is None:
      raise ValueError('images given to a model without a vision tower')
    checkpoint = None
    if self.options.remat != 'none':  # the tower's blocks rematerialised as the decoder's are
      checkpoint = functools.partial(jax.checkpoint, policy=_REMAT_POLICIES[self.options.remat])
    features = self.visual(images, self.dtype, checkpoint)
    return jax.lax.stop_gradient(features) if self.options.freeze_vision else features
