"""Test kit: the models, configs and inputs that tests and benchmarks build for themselves.

  random_hf_model(seed, ...)        a random transformers Qwen2ForCausalLM (the PyTorch reference)
  save_random_hf_checkpoint(...)    the same, saved as a Hugging Face checkpoint directory
  random_prompts(seed, lengths)     prompts of given lengths as lists of token ids
  left_padded(sequences)            those prompts as one left-padded batch and its mask
  random_batch(rng, ...)            a scored batch for the update (rl/batch.Batch) of random sequences
  splitting_token(answers)          a stop id that ends some greedy answers early and not others
  seed_with_split_answers(seed, f)  the first seed drawn from `seed` whose model's greedy answers split

Only the standard library is imported at module level; numpy, torch, transformers and grpo_jax's
model are imported where used. The model sizes (Qwen2.5, Qwen3) are grpo_jax.model.presets'.
"""

import contextlib

# The tests' reference model: small enough to build and run at once on CPU, with GQA (N = 4 query
# heads over K = 2 key/value heads); tests that need tied embeddings or more layers override it.
TINY_HF_FIELDS = dict(vocab_size=1000, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0,
                      max_position_embeddings=1024, tie_word_embeddings=False)
# Qwen2.5-VL: the text model above with M-RoPE (head_dim 16: 8 frequencies as 2 + 3 + 3), a vision
# tower of 3 blocks (the middle one attending over the whole image, the others in windows of 2 x 2
# merged blocks), and its special tokens at the top of the tiny vocabulary.
TINY_VL_TEXT_FIELDS = dict(mrope_section=(2, 3, 3), bos_token_id=None, eos_token_id=None)
TINY_VISION_FIELDS = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                          fullatt_block_indexes=[1], window_size=56, patch_size=14, temporal_patch_size=2,
                          spatial_merge_size=2)
TINY_VL_TOKENS = dict(image_token_id=990, video_token_id=991, vision_start_token_id=992, vision_end_token_id=993)
VL_TOP_LEVEL = ('vision_config', *TINY_VL_TOKENS)


# model_type -> (transformers config class, model class) of the checkpoints the tests build.
HF_CLASSES = {'qwen2': ('Qwen2Config', 'Qwen2ForCausalLM'), 'qwen3': ('Qwen3Config', 'Qwen3ForCausalLM'),
              'qwen3_moe': ('Qwen3MoeConfig', 'Qwen3MoeForCausalLM'),
              'qwen2_5_vl': ('Qwen2_5_VLConfig', 'Qwen2_5_VLForConditionalGeneration'),
              'llama': ('LlamaConfig', 'LlamaForCausalLM'), 'mistral': ('MistralConfig', 'MistralForCausalLM'),
              'glm4': ('Glm4Config', 'Glm4ForCausalLM'), 'gemma3_text': ('Gemma3TextConfig', 'Gemma3ForCausalLM'),
              'gemma3': ('Gemma3Config', 'Gemma3ForConditionalGeneration'),
              'deepseek_v3': ('DeepseekV3Config', 'DeepseekV3ForCausalLM')}
# A Gemma 3 vision-language checkpoint's tower, as small as its config allows (not loaded by grpo_jax).
TINY_GEMMA3_VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                          image_size=28, patch_size=14)


# model_type -> the transformers class of a reward model (one label) the tests build, head='score'.
HF_SCORE_CLASSES = {'qwen2': 'Qwen2ForSequenceClassification', 'qwen3': 'Qwen3ForSequenceClassification',
                    'llama': 'LlamaForSequenceClassification'}


def random_hf_model(seed: int, *, init: str = 'random', jitter=None, device=None, model_type: str = 'qwen2',
                    head: str = 'lm', **overrides):
  """A transformers Qwen2ForCausalLM (or of another model_type, HF_CLASSES' class: 'gemma3' a
  Gemma3ForConditionalGeneration whose text config the overrides are) in eval mode:
  TINY_HF_FIELDS updated by `overrides` (any keyword of the transformers config, e.g.
  **to_hf_dict(config) or attn_implementation='sdpa'). For 'qwen2_5_vl' they are the text
  config's, but for VL_TOP_LEVEL keys (vision_config: TINY_VISION_FIELDS updated by it).

  init: 'random' draws every parameter from a normal distribution, biases and norms included
    (transformers' default init leaves biases at 0 and norm weights at 1, which would hide a
    layout mistake in a parity check); 'default' keeps transformers' init under
    torch.manual_seed(seed), for benchmarks where the values do not matter.
  jitter: after init, adds std * N(0, 1) from torch's global generator to each parameter: a
    float for all of them, or {name suffix: std} for those whose name ends so (e.g. 'bias').
  device: where the parameters are created (e.g. 'cuda'); the host by default.
  head: 'lm' (a causal LM) or 'score': a reward model, HF_SCORE_CLASSES' sequence classifier of
    one label (pad_token_id 0 unless the overrides set it).
  """
  import torch
  import transformers

  if init not in ('random', 'default'):
    raise ValueError(f"init must be 'random' or 'default', got {init!r}")
  config_name, model_name = HF_CLASSES[model_type]
  if head == 'score':
    model_name = HF_SCORE_CLASSES[model_type]
    overrides = {'num_labels': 1, 'pad_token_id': 0, **overrides}
  elif head != 'lm':
    raise ValueError(f"head must be 'lm' or 'score', got {head!r}")
  config_class, model_class = getattr(transformers, config_name), getattr(transformers, model_name)
  overrides = {key: value for key, value in overrides.items() if key not in ('architectures', 'model_type')}
  if model_type == 'gemma3':  # the language model of a vision-language checkpoint, with a tiny tower
    text = {**TINY_HF_FIELDS, 'pad_token_id': 0, **overrides}
    config = config_class(text_config=text, vision_config=TINY_GEMMA3_VISION, mm_tokens_per_image=1,
                          tie_word_embeddings=text['tie_word_embeddings'])
  elif model_type == 'qwen2_5_vl':
    top = {key: overrides.pop(key) for key in VL_TOP_LEVEL if key in overrides}
    text = {**TINY_HF_FIELDS, **TINY_VL_TEXT_FIELDS, **overrides}
    text['rope_parameters'] = {'rope_type': 'default', 'rope_theta': text.pop('rope_theta'),
                               'mrope_section': list(text.pop('mrope_section'))}
    config = config_class(text_config=text, **{**TINY_VL_TOKENS, **top,
                                               'vision_config': {**TINY_VISION_FIELDS, 'out_hidden_size': text['hidden_size'],
                                                                 **top.get('vision_config', {})},
                                               'tie_word_embeddings': text['tie_word_embeddings']})
  else:
    # GLM-4's default pad id (151329) lies outside the tiny vocabulary.
    pad = {'pad_token_id': 0} if model_type == 'glm4' else {}
    config = config_class(**{**TINY_HF_FIELDS, **pad, **overrides})
  torch.manual_seed(seed)
  with torch.device(device) if device is not None else contextlib.nullcontext():
    model = model_class(config).eval()
  with torch.no_grad():
    if init == 'random':
      # A generator of its own: the draws depend on the seed alone, not on how much of the global
      # stream the constructor consumed.
      generator = torch.Generator().manual_seed(seed)
      for name, parameter in model.named_parameters():
        noise = torch.randn(parameter.shape, generator=generator)
        if name.endswith(('norm.weight', 'norm1.weight', 'norm2.weight', 'ln_q.weight')):
          parameter.copy_(1.0 + 0.2 * noise)
        elif name.endswith('bias'):
          parameter.copy_(0.5 * noise)
        else:
          parameter.copy_(0.08 * noise)
      for name, buffer in model.named_buffers():  # DeepSeekMoE's choice bias, which init leaves at 0
        if name.endswith('e_score_correction_bias'):
          buffer.copy_(0.1 * torch.randn(buffer.shape, generator=generator))
    if jitter is not None:
      for name, parameter in model.named_parameters():
        if isinstance(jitter, dict):
          std = next((value for suffix, value in jitter.items() if name.endswith(suffix)), 0.0)
        else:
          std = jitter
        if std:
          parameter.add_(std * torch.randn_like(parameter))
  return model


def save_random_hf_checkpoint(directory: str, seed: int, *, max_shard_size=None, **model_kwargs):
  """random_hf_model(seed, **model_kwargs), saved to `directory` (in safetensors shards of at most
  `max_shard_size`, e.g. '200KB', when given) for grpo_jax to load; returns the torch model."""
  model = random_hf_model(seed, **model_kwargs)
  model.save_pretrained(directory, **({'max_shard_size': max_shard_size} if max_shard_size else {}))
  return model


def random_prompts(seed: int, lengths, vocab: int = 1000) -> list[list[int]]:
  """One prompt of each length in `lengths`, token ids uniform in [3, vocab): never the pad id 0.
  Lists of Python ints, as a tokenizer returns them; np.asarray(prompt, np.int32) where an array
  is needed."""
  import numpy as np
  rng = np.random.default_rng(seed)
  return [rng.integers(3, vocab, n).tolist() for n in lengths]


def left_padded(sequences, pad_id: int = 0, width: int | None = None):
  """P token sequences as one batch, right-aligned the way the sampler takes prompts.

  -> (tokens [P, T] int32, pad_id before each sequence; mask [P, T] int32, 1 on its tokens),
  T = `width`, by default the longest sequence's length.
  """
  import numpy as np
  width = width or max(len(s) for s in sequences)
  tokens = np.full((len(sequences), width), pad_id, np.int32)
  mask = np.zeros((len(sequences), width), np.int32)
  for row, sequence in enumerate(sequences):
    tokens[row, width - len(sequence):] = sequence
    mask[row, width - len(sequence):] = 1
  return tokens, mask


def splitting_token(answers) -> int | None:
  """The earliest token (by position, then row) before the last position of `answers` [R, N] that
  some rows hold and others do not: as a stop id it ends some answers early and leaves others
  running. A random model's greedy answers cycle over a few tokens, which random stop ids often
  all miss. None when every row holds the same tokens."""
  import numpy as np
  answers = np.asarray(answers)
  held = [set(row.tolist()) for row in answers]
  return next((int(t) for t in answers[:, :-1].T.ravel() if not all(int(t) in h for h in held)), None)


def seed_with_split_answers(seed: int, greedy_answers, attempts: int = 8):
  """-> (seed, stop id, extra): the first of `seed` and seeds drawn from it for which
  greedy_answers(seed) -> (answers [R, N], extra) holds a splitting_token. Now and then a random
  model gives one token the largest logit after every context, so that every greedy answer is
  that token repeated and no stop id ends some answers before others; such a draw is passed over
  and the seed taken is printed (TEST_SEED=that seed replays it at once). AssertionError if none
  of `attempts` seeds splits."""
  import numpy as np
  seeds = [seed, *(int(s) for s in np.random.default_rng(seed).integers(0, 2**32, attempts - 1))]
  for candidate in seeds:
    answers, extra = greedy_answers(candidate)
    stop = splitting_token(answers)
    if stop is not None:
      if candidate != seed:
        print(f'seed={candidate} (seed {seed}: every greedy answer held the same tokens)')
      return candidate, stop, extra
  raise AssertionError(f'seeds {seeds}: every greedy answer holds the same tokens, for each model')


def random_batch(rng, rows: int, prompt_length: int, completion_length: int, vocab_size: int, shapes=None,
                 advantages=None):
  """A scored batch (rl/batch.Batch) of left-padded prompts and right-padded completions of the
  given (prompt, completion) real lengths; random where not given, with one one-token and one
  full-length completion among them. Random tokens everywhere (padding included), random
  advantages and sampler log-probs."""
  import jax.numpy as jnp
  import numpy as np
  from grpo_jax.rl.batch import Batch
  if shapes is None:
    lengths = rng.integers(1, completion_length + 1, rows)
    lengths[:2] = [1, completion_length]
    rng.shuffle(lengths)
    shapes = [(int(rng.integers(1, prompt_length + 1)), int(length)) for length in lengths]
  prompt_real, completion_real = np.asarray(shapes).T
  tokens = rng.integers(0, vocab_size, (rows, prompt_length + completion_length))
  prompt_segments = np.arange(prompt_length)[None, :] >= (prompt_length - prompt_real)[:, None]
  mask = np.arange(completion_length)[None, :] < completion_real[:, None]
  if advantages is None:
    advantages = rng.standard_normal(rows)
  return Batch.of_sequences(tokens=jnp.asarray(tokens, jnp.int32),
                            segment_ids=jnp.asarray(np.concatenate([prompt_segments, mask], axis=1), jnp.int32),
                            mask=jnp.asarray(mask), advantages=jnp.asarray(advantages, jnp.float32),
                            sampler_log_probs=jnp.asarray(rng.uniform(-8.0, -0.5, mask.shape), jnp.float32))
