"""Qwen2 / Qwen2.5 in Flax NNX: the module, its architecture config, sharding and I/O."""

from grpo_jax.model.config import Qwen2Config, from_hf_dict, load_hf_config, to_hf_dict
from grpo_jax.model.loading import (from_pretrained, init_model, load_tokenizer, save_hf,
                                    save_orbax)
from grpo_jax.model.qwen2 import KVCache, ModelOptions, Qwen2
from grpo_jax.model.sharding import MeshConfig, make_mesh

__all__ = ['KVCache', 'MeshConfig', 'ModelOptions', 'Qwen2', 'Qwen2Config', 'from_hf_dict',
           'from_pretrained', 'init_model', 'load_hf_config', 'load_tokenizer', 'make_mesh', 'save_hf',
           'save_orbax', 'to_hf_dict']
