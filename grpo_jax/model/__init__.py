"""Qwen2 / Qwen2.5 / Qwen3 in Flax NNX: the module, its architecture config and sizes, and I/O.

The names below load their module when first used, so importing a light submodule
(grpo_jax.model.presets) does not import jax.
"""

import importlib

_MODULES = {
    'grpo_jax.model.config': ('Qwen2Config',),
    'grpo_jax.model.hf_config': ('from_hf_dict', 'load_hf_config', 'to_hf_dict'),
    'grpo_jax.model.loading': ('from_pretrained', 'init_model', 'load_reward_model', 'load_tokenizer', 'save_hf',
                               'save_orbax'),
    'grpo_jax.model.qwen2': ('KVCache', 'ModelOptions', 'Qwen2'),
    'grpo_jax.sharding': ('MeshConfig', 'make_mesh'),
}
_EXPORTS = {name: module for module, names in _MODULES.items() for name in names}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
  if name not in _EXPORTS:
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
  return getattr(importlib.import_module(_EXPORTS[name]), name)
