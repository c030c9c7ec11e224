"""Low-rank adapters (LoRA) on the decoder's projections: the `model.lora` section, the adapter
parameters' shapes and layout, and the split of a model's state into what trains and what stays.

A projection y = x W with W [*I, *O] gains two factors, A [*I, r] and B [r, *O], and computes
y = x W + s (x A) B with s = alpha / r (alpha / sqrt(r) with `rslora`). B starts at zero, so the
adapted model equals the base exactly at step 0; A starts as PEFT draws it (uniform in
+-1/sqrt(fan_in)). Both factors are stacked over layers like the weights ([L, *I, r], [L, r, *O])
and carry logical axes, so they shard with their weight: A by the weight's input axes, B by its
output axes (column- and row-parallel as the weight is), and the rank over 'fsdp' where the
other axes leave it free.

With LoRA the base weights are frozen and held in the compute dtype; only the adapters (in
`param_dtype`) are trained, carried by the optimizer and checkpointed. Adapters are a Variable type
of their own (`Adapter`), so a model's state splits by type: `split_trainable`. A reward model's
score head trains beside them (it is new to the base, as peft's modules_to_save).
"""

import dataclasses
import hashlib
import json
import math

import jax
import jax.numpy as jnp
from flax import nnx

from grpo_jax.errors import require

# Projection name -> (weight parameter, PEFT module path within a layer).
TARGETS = {
    'q': ('q_weight', 'self_attn.q_proj'),
    'k': ('k_weight', 'self_attn.k_proj'),
    'v': ('v_weight', 'self_attn.v_proj'),
    'o': ('o_weight', 'self_attn.o_proj'),
    'gate': ('gate_weight', 'mlp.gate_proj'),
    'up': ('up_weight', 'mlp.up_proj'),
    'down': ('down_weight', 'mlp.down_proj'),
    # Multi-head latent attention's (DeepSeek-V3): q is its q_proj when it has no query latent.
    'q_a': ('q_a_weight', 'self_attn.q_a_proj'),
    'q_b': ('q_b_weight', 'self_attn.q_b_proj'),
    'kv_a': ('kv_a_weight', 'self_attn.kv_a_proj_with_mqa'),
    'kv_b': ('kv_b_weight', 'self_attn.kv_b_proj'),
    # DeepSeekMoE's shared experts (every token's MLP in a sparse layer). 'gate', 'up' and 'down' in a
    # mixture are its dense layers' MLP; the routed experts take no adapters.
    'shared_gate': ('shared_gate_weight', 'mlp.shared_experts.gate_proj'),
    'shared_up': ('shared_up_weight', 'mlp.shared_experts.up_proj'),
    'shared_down': ('shared_down_weight', 'mlp.shared_experts.down_proj'),
}
# GLM-4's one module for gate and up (model.config.fused_gate_up): PEFT adapts it as one.
FUSED_GATE_UP = 'gate_up_proj'
# Leading input dimensions each weight contracts (o_weight [L, N, H, D] contracts N and H).
CONTRACT = {'o': 2}


class Adapter(nnx.Param):
  """A LoRA factor: trained, while the rest of a LoRA model's parameters stay frozen."""


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """The `model.lora` section: adapters of rank `rank` on the `targets` projections of every layer."""

  rank: int = 8
  alpha: float = 16.0  # the adapters' output is scaled by alpha / rank
  targets: tuple[str, ...] = ('q', 'k', 'v', 'o', 'gate', 'up', 'down')
  rslora: bool = False  # scale by alpha / sqrt(rank) instead (rank-stabilised LoRA)
  dropout: float = 0.0  # only 0: see __post_init__

  def __post_init__(self):
    require(self.rank >= 1, 'rank', f'must be >= 1, got {self.rank}')
    require(self.alpha > 0, 'alpha', f'must be > 0, got {self.alpha}')
    require(len(self.targets) > 0, 'targets', f'must name at least one of {", ".join(TARGETS)}')
    unknown = [name for name in self.targets if name not in TARGETS]
    require(not unknown, 'targets', f'{unknown[0] if unknown else ""!r} is not a projection; choose among '
            f'{", ".join(TARGETS)}')
    require(len(set(self.targets)) == len(self.targets), 'targets', f'names a projection twice: {list(self.targets)}')
    # Dropout on the adapters' input would make the trainer's log-probs differ from the sampler's
    # (which decodes without it) on every token: the GRPO ratio would start away from 1.
    require(self.dropout == 0.0, 'dropout', f'must be 0 (the sampler decodes without dropout, so any other '
            f'value makes the importance ratio start away from 1), got {self.dropout}')

  @property
  def scale(self) -> float:
    return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


def adapter_names(target: str) -> tuple[str, str]:
  """The DecoderLayers attribute names of a target's A and B factors."""
  return f'{target}_lora_a', f'{target}_lora_b'


def adapted_weight(name: str) -> str | None:
  """The stacked weight an adapter factor (`adapter_names`) adapts, or None for another name."""
  for suffix in ('_lora_a', '_lora_b'):
    if name.endswith(suffix) and name[:-len(suffix)] in TARGETS:
      return TARGETS[name[:-len(suffix)]][0]
  return None


def adapter_shapes(target: str, weight_shape: tuple, weight_axes: tuple, rank: int):
  """((A shape, A axes), (B shape, B axes)) for a stacked weight [L, *I, *O] with its logical axes."""
  inner = 1 + CONTRACT.get(target, 1)  # L and the input dims
  a = ((*weight_shape[:inner], rank), (*weight_axes[:inner], 'lora_rank'))
  b = ((weight_shape[0], rank, *weight_shape[inner:]), (weight_axes[0], 'lora_rank', *weight_axes[inner:]))
  return a, b


def init_a(key, shape, dtype):
  """A as PEFT initialises lora_A (kaiming-uniform, a = sqrt(5)): uniform in +-1/sqrt(fan_in)."""
  fan_in = math.prod(shape[1:-1])
  bound = 1.0 / math.sqrt(fan_in)
  return jax.random.uniform(key, shape, jnp.float32, -bound, bound).astype(dtype)


def has_adapters(state: nnx.State) -> bool:
  return any(isinstance(v, Adapter) for v in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable)))


def split_adapters(state: nnx.State) -> tuple[nnx.State, nnx.State]:
  """(the adapters, everything else) of a LoRA model's state."""
  return nnx.split_state(state, Adapter, ...)


def _trains_beside_adapters(path, variable) -> bool:
  """An adapter, or a reward model's score head: a head that is new to the base (peft's
  modules_to_save) must learn beside the adapters, which could not move it."""
  return isinstance(variable, Adapter) or tuple(str(key) for key in path) == ('score',)


def split_trainable(state: nnx.State) -> tuple[nnx.State, nnx.State | None]:
  """(what trains, what stays frozen): (adapters, base) of a LoRA model, a reward model's score
  head among what trains; (everything, None) otherwise."""
  if not has_adapters(state):
    return state, None
  return nnx.split_state(state, _trains_beside_adapters, ...)


def join(trainable: nnx.State, frozen: nnx.State | None) -> nnx.State:
  """The model's whole state again (no copies: the same arrays)."""
  return trainable if frozen is None else nnx.merge_state(trainable, frozen)


def adapters_off(trainable: nnx.State) -> nnx.State:
  """The adapters with every B factor zero: joined with the base, the base model itself (the
  reference policy of the KL term; x A 0 adds exact zeros)."""
  def off(path, variable):
    return variable.replace(jnp.zeros_like(variable[...])) if str(path[-1]).endswith('_lora_b') else variable
  return nnx.map_state(off, trainable)


def merged(state: nnx.State, lora: LoraConfig) -> nnx.State:
  """The base parameters with each adapted weight replaced by W + s A B, computed in fp32 and
  stored in W's dtype; the adapters dropped. Traceable."""
  layers = state['layers']
  values = {}
  for target in lora.targets:
    weight_name, _ = TARGETS[target]
    a_name, b_name = adapter_names(target)
    weight, a, b = layers[weight_name][...], layers[a_name][...], layers[b_name][...]
    L, rank = a.shape[0], a.shape[-1]
    delta = jnp.einsum('lir,lro->lio', a.reshape(L, -1, rank).astype(jnp.float32),
                       b.reshape(L, rank, -1).astype(jnp.float32)).reshape(weight.shape)
    values[weight_name] = (weight.astype(jnp.float32) + lora.scale * delta).astype(weight.dtype)

  def replace(path, variable):
    name = str(path[-1]) if len(path) >= 2 and str(path[0]) == 'layers' else None
    return variable.replace(values[name]) if name in values else variable

  _, base = split_adapters(state)
  return nnx.map_state(replace, base)


def base_fingerprint(architecture: dict) -> str:
  """A short hash of a base model's architecture (its HF config dict), stored with LoRA checkpoints."""
  return hashlib.sha256(json.dumps(architecture, sort_keys=True).encode()).hexdigest()[:16]


# ---- PEFT's adapter format ----

def peft_tensors(state: nnx.State, lora: LoraConfig, fused_gate_up: bool = False,
                 layers_of: dict[str, tuple[int, ...]] | None = None) -> dict:
  """The adapters of a LoRA model's state as PEFT names them for transformers' model (numpy, their
  own dtype): lora_A.weight [r, in] and lora_B.weight [out, r] per layer and target. layers_of
  {target: the model's layers its stack holds, in order} (`stacked_targets`; default: every layer
  from 0) places the MLP's factors of a mixture with dense layers (a dense 'gate' stack holds
  DeepSeek-V3's first three, a shared expert's the rest).

  fused_gate_up (GLM-4, whose checkpoints hold gate and up as one `mlp.gate_up_proj` [2F, D], gate
  first): the gate and up adapters become one adapter of that module, exactly: A stacks their A's
  [k r, D], B places their B's block-diagonally [2F, k r] (k: how many of the two are targets, the
  other's rows zero), so B A is gate's B A over up's. Its rank k r and alpha keep their scale
  (save_peft's rank_pattern and alpha_pattern)."""
  import numpy as np

  layers, tensors = state['layers'], {}
  factors = {}
  for target in lora.targets:
    a_name, b_name = adapter_names(target)
    a, b = np.asarray(layers[a_name][...]), np.asarray(layers[b_name][...])
    factors[target] = ([a[index].reshape(-1, lora.rank).T for index in range(a.shape[0])],
                       [b[index].reshape(lora.rank, -1).T for index in range(b.shape[0])])
  fused = [target for target in ('gate', 'up') if target in factors] if fused_gate_up else []
  for target, (a_layers, b_layers) in factors.items():
    if target in fused:
      continue
    indices = (layers_of or {}).get(target, range(len(a_layers)))
    for index, a, b in zip(indices, a_layers, b_layers, strict=True):
      prefix = f'base_model.model.model.layers.{index}.{TARGETS[target][1]}'
      tensors[f'{prefix}.lora_A.weight'] = np.ascontiguousarray(a)
      tensors[f'{prefix}.lora_B.weight'] = np.ascontiguousarray(b)
  if fused:
    width = factors[fused[0]][1][0].shape[0]  # F, each half's rows
    for index in range(len(factors[fused[0]][0])):
      a = np.concatenate([factors[target][0][index] for target in fused])
      b = np.zeros((2 * width, len(fused) * lora.rank), a.dtype)
      for block, target in enumerate(fused):
        half = ('gate', 'up').index(target)
        b[half * width:(half + 1) * width, block * lora.rank:(block + 1) * lora.rank] = factors[target][1][index]
      prefix = f'base_model.model.model.layers.{index}.mlp.{FUSED_GATE_UP}'
      tensors[f'{prefix}.lora_A.weight'] = np.ascontiguousarray(a)
      tensors[f'{prefix}.lora_B.weight'] = b
  return tensors


def stacked_targets(architecture, lora: LoraConfig) -> dict[str, tuple[int, ...]]:
  """{target: the layers its stacked weight (and so its factors) holds, in order}: a shared expert's
  the sparse layers, the MLP's in a mixture its dense ones, the attention's every layer."""
  return {target: architecture.layers_holding(TARGETS[target][0]) for target in lora.targets}


def save_peft(state: nnx.State, lora: LoraConfig, directory: str, base_model: str | None, architecture=None) -> None:
  """Writes a PEFT adapter directory (adapter_config.json, adapter_model.safetensors) that
  `peft.PeftModel.from_pretrained` loads onto the base model. architecture (the model's
  Qwen2Config; None: a dense model of unfused projections) says where the factors go: GLM-4's fused
  gate and up (peft_tensors), a mixture's dense and sparse layers (stacked_targets).

  Refused for adapters on a mixture's MLP (its dense layers', its shared experts'): on transformers
  5, peft takes an MoE model's `gate_proj` / `up_proj` / `down_proj` for the routed experts' fused
  weights (as transformers 4 named them) whatever path the config gives, so those adapters would
  land on the experts or nowhere. The merged export holds them exactly."""
  import os

  from safetensors.numpy import save_file

  if architecture is not None and architecture.num_experts:
    mlp = [target for target in lora.targets if TARGETS[target][1].startswith('mlp.')]
    require(not mlp, 'model.lora.targets', f'{mlp[0] if mlp else ""!r}: a PEFT directory of a {architecture.model_type} '
            "model cannot carry adapters on its MLP (peft reads a mixture's gate_proj / up_proj / down_proj as the "
            'routed experts\' fused weights); export the merged model (--merge-lora)')
  fused_gate_up = bool(architecture is not None and architecture.fused_gate_up)
  layers_of = stacked_targets(architecture, lora) if architecture is not None else None
  modules = sorted({TARGETS[target][1].split('.')[-1] for target in lora.targets})
  fused = [target for target in ('gate', 'up') if target in lora.targets] if fused_gate_up else []
  patterns = {}
  if fused:
    modules = sorted((set(modules) - {'gate_proj', 'up_proj'}) | {FUSED_GATE_UP})
    k = len(fused)  # the fused adapter's rank is k r: its alpha keeps alpha / r (or / sqrt(r))
    patterns = dict(rank_pattern={FUSED_GATE_UP: k * lora.rank},
                    alpha_pattern={FUSED_GATE_UP: lora.alpha * (math.sqrt(k) if lora.rslora else k)})
  config = dict(peft_type='LORA', task_type='CAUSAL_LM', r=lora.rank, lora_alpha=lora.alpha,
                target_modules=modules, **patterns,
                lora_dropout=lora.dropout, bias='none', use_rslora=lora.rslora, fan_in_fan_out=False,
                inference_mode=True, base_model_name_or_path=base_model)
  with open(os.path.join(directory, 'adapter_config.json'), 'w') as f:
    json.dump(config, f, indent=2)
  save_file(peft_tensors(state, lora, fused_gate_up, layers_of), os.path.join(directory, 'adapter_model.safetensors'),
            metadata=dict(format='pt'))
