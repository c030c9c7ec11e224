"""The reward model a reward-model run trains, built from what `model` names: a sequence classifier
(a checkpoint with a score head), a language model given a fresh score head, or random weights.

A reward model trained from a base or instruct model is that model's decoder with its lm_head
replaced by a score head [D, 1] (transformers' *ForSequenceClassification with num_labels 1): the
head is drawn as transformers' `_init_weights` draws a Linear, normal with std initializer_range,
and the model reads each row at its last token that is not the pad id, so the tokenizer must have
a pad token, which becomes the model's pad_token_id. With LoRA the score head trains beside the
adapters (model/lora.py split_trainable), in param_dtype like them.
"""

import dataclasses
import functools

import jax
from flax import nnx
from jax.sharding import Mesh

from grpo_jax.errors import UserError
from grpo_jax.model.hf_config import load_hf_config
from grpo_jax.model.loading import (ModelConfig, abstract_model, from_pretrained, load_reward_model,
                                    load_tokenizer)
from grpo_jax.model.qwen2 import Qwen2
from grpo_jax.sharding import state_shardings


def with_score_head(model: Qwen2, pad_token_id: int, mesh: Mesh, seed: int) -> Qwen2:
  """Language model `model` as a reward model: its parameters but the lm_head (the same arrays),
  and a fresh score head [D, 1] drawn from `seed` (normal, std initializer_range), laid out over
  `mesh`; num_labels 1 and `pad_token_id` in its config."""
  config = dataclasses.replace(model.config, num_labels=1, pad_token_id=pad_token_id)
  graphdef, abstract = nnx.split(abstract_model(config, model.options))
  head_shardings = state_shardings(nnx.State({'score': abstract['score']}), mesh)

  @functools.partial(jax.jit, out_shardings=head_shardings)
  def create():  # only the head leaves: the rest of this init is dead code to XLA
    return nnx.State({'score': nnx.state(Qwen2(config, model.options, rngs=nnx.Rngs(seed)))['score']})

  values = nnx.to_pure_dict(nnx.state(model))
  values.pop('lm_head', None)
  values.update(nnx.to_pure_dict(create()))
  nnx.replace_by_pure_dict(abstract, values)
  return nnx.merge(graphdef, abstract)


def _pad_id(tokenizer, where: str) -> int:
  if tokenizer.pad_token_id is None:
    raise UserError(f'{where} has no pad token: a reward model reads each row at its last token that is not the '
                    'pad id; give the tokenizer one (pad_token in tokenizer_config.json)')
  return int(tokenizer.pad_token_id)


def _checked_tokenizer(tokenizer, vocab_size: int, where: str):
  if len(tokenizer) > vocab_size:
    raise UserError(f'{where} has {len(tokenizer)} tokens, more than the model\'s {vocab_size} embedding rows')
  return tokenizer


def build_reward_model(section: ModelConfig, mesh: Mesh, seed: int, tokenizer_path: str | None = None):
  """(reward model on `mesh`, its tokenizer) of the `model` section: model.path a sequence
  classifier (loading.load_reward_model, its tokenizer beside it), or a language model (its decoder
  and a fresh score head, `with_score_head`), or no path: random weights for model.architecture
  with a score head. `tokenizer_path`: the tokenizer where model.path holds none (a random model's,
  or to take the place of the checkpoint's). With LoRA the adapters and the head come from `seed`."""
  options = section.options
  tokenizer = None
  if tokenizer_path is not None:
    tokenizer = load_tokenizer(tokenizer_path)
    if tokenizer is None:
      raise UserError(f'preferences.tokenizer {tokenizer_path} holds no tokenizer (tokenizer.json or vocab.json)')
  where = f'the tokenizer of {tokenizer_path or section.path}'
  if section.path:
    architecture = load_hf_config(section.path)
    if architecture.num_labels:
      model, own = load_reward_model(section.path, mesh=mesh, options=options, seed=seed)
      if tokenizer is not None and _pad_id(tokenizer, where) != architecture.pad_token_id:
        raise UserError(f'{where} pads with id {tokenizer.pad_token_id}, but {section.path}\'s pad_token_id is '
                        f'{architecture.pad_token_id}: the score would be read at the wrong token')
      tokenizer = tokenizer or own
    else:
      tokenizer = tokenizer or load_tokenizer(section.path)
      if tokenizer is None:
        raise UserError(f'{section.path} has no tokenizer (tokenizer.json or vocab.json): set preferences.tokenizer')
      _checked_tokenizer(tokenizer, architecture.vocab_size, where)
      pad = _pad_id(tokenizer, where)
      model = with_score_head(from_pretrained(section.path, mesh=mesh, options=options, seed=seed), pad, mesh, seed)
  else:
    if tokenizer is None:
      raise UserError('a reward model of random weights (no model.path) needs preferences.tokenizer, the tokenizer '
                      'its pairs are read with')
    architecture = section.architecture
    _checked_tokenizer(tokenizer, architecture.vocab_size, where)
    pad = _pad_id(tokenizer, where)
    if architecture.pad_token_id not in (None, pad):
      raise UserError(f'model.architecture.pad_token_id ({architecture.pad_token_id}) is not the pad id of '
                      f'{where} ({pad})')
    architecture = dataclasses.replace(architecture, num_labels=architecture.num_labels or 1, pad_token_id=pad)
    model = dataclasses.replace(section, architecture=architecture).build(mesh, seed)
  if options.lora is not None:  # the base is held in the compute dtype; the head trains in param_dtype
    model.score.set_value(model.score[...].astype(options.param_dtype))
  return model, tokenizer
