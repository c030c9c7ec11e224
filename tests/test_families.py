"""The model families beyond Qwen (Llama 3, DeepSeek-LLM, Mistral, GLM-4, Gemma 3) as options of the
one decoder, against transformers on random tiny checkpoints: logits of left-padded rows longer
than the sliding window, greedy decoding through continuous-batching slots against `generate`,
hf -> orbax -> hf conversion under the hub's names, both config.json spellings, the packed update
of a sliding-window model against the padded one, and the fields the decoder refuses."""

import dataclasses
import os

import jax
import numpy as np
import pytest
import transformers
from flax import nnx

from conftest import greedy_answers, torch_logits
from conversion import hf_to_orbax, orbax_to_hf
from grpo_jax.errors import UserError
from grpo_jax.model import ModelOptions, from_hf_dict, from_pretrained, to_hf_dict
from grpo_jax.model.weights import HFCheckpoint, TensorEntry, write_safetensors
from grpo_jax.sampler import DecodeSettings, SamplingConfig
from grpo_jax.sampler.rollout import GroupSampler
from grpo_jax.testing import left_padded, random_prompts
from runs import ROOT

FP32_TOLERANCE = 1e-4
_GEMMA3_TEXT = dict(num_hidden_layers=3, head_dim=16, num_key_value_heads=1, sliding_window=6,
                    layer_types=['sliding_attention', 'full_attention', 'sliding_attention'],
                    query_pre_attn_scalar=24, tie_word_embeddings=True,
                    rope_parameters={'full_attention': {'rope_type': 'linear', 'factor': 8.0, 'rope_theta': 1e6},
                                     'sliding_attention': {'rope_type': 'default', 'rope_theta': 10000.0}})
# Each family's random checkpoint (a transformers config's keywords over testing.TINY_HF_FIELDS:
# hidden 64, 4 query heads over 2 key/value heads unless told otherwise) and the architecture fields
# grpo_jax must read from it, so a case cannot pass by testing Qwen's defaults.
FAMILIES = {
    # Llama 3.1+: llama3 frequency scaling (an original context of 64 puts head_dim 16's
    # frequencies on both sides of the blended band), tied like Llama-3.2-1B/3B.
    'llama3': (dict(model_type='llama', tie_word_embeddings=True,
                    rope_parameters={'rope_type': 'llama3', 'rope_theta': 10000.0, 'factor': 8.0,
                                     'low_freq_factor': 1.0, 'high_freq_factor': 4.0,
                                     'original_max_position_embeddings': 64}),
               dict(family='llama', rope_type='llama3', rope_original_max_position_embeddings=64)),
    # DeepSeek-LLM-7B: the llama architecture with plain RoPE, untied, every head its own keys.
    'deepseek-llm': (dict(model_type='llama', num_key_value_heads=4, vocab_size=517),
                     dict(family='llama', rope_type='default', num_key_value_heads=4)),
    # Mistral: head_dim 24 where hidden / heads is 16, one key/value head, a window of 7 tokens.
    'mistral': (dict(model_type='mistral', head_dim=24, num_key_value_heads=1, sliding_window=7),
                dict(family='mistral', head_dim=24, sliding_window=7)),
    # GLM-4 0414: half of each head rotates, interleaved; q/k/v biases; fused gate/up; extra norms.
    'glm4': (dict(model_type='glm4', head_dim=16, rope_parameters={'rope_type': 'default', 'rope_theta': 10000.0,
                                                                     'partial_rotary_factor': 0.5}),
             dict(family='glm4', partial_rotary_factor=0.5, rope_interleaved=True, fused_gate_up=True)),
    # Gemma 3 1B's shape: local (window 6) and global layers with their own RoPE (the global
    # scaled as 4B-27B's), query_pre_attn_scalar unlike head_dim, q/k norms, (1 + w) norms.
    'gemma3_text': (dict(model_type='gemma3_text', **_GEMMA3_TEXT),
                    dict(family='gemma3_text', sliding_window=6, rope_type='linear', query_pre_attn_scalar=24.0)),
    # Qwen2.5's long-context spelling: YaRN (its frequency ramp, cos and sin scaled by 0.1 ln 4 + 1).
    'qwen2-yarn': (dict(model_type='qwen2', rope_parameters={'rope_type': 'yarn', 'rope_theta': 10000.0, 'factor': 4.0,
                                                             'original_max_position_embeddings': 64}),
                   dict(family='', rope_type='yarn', rope_factor=4.0, rope_original_max_position_embeddings=64)),
    # Gemma 3 4B-27B: the same language model inside Gemma3ForConditionalGeneration, read by prefix.
    'gemma3': (dict(model_type='gemma3', **_GEMMA3_TEXT), dict(family='gemma3_text', sliding_window=6)),
}
# The fast tier's cases per claim; every family runs every claim in make test-all.
FAST = {'parity': ('llama3', 'mistral', 'glm4', 'gemma3_text'), 'conversion': ('glm4', 'gemma3')}


def cases(claim):
  return [pytest.param(name, marks=() if name in FAST[claim] else pytest.mark.exhaustive) for name in FAMILIES]


def jitted(model):
  graphdef, state = nnx.split(model)
  forward = jax.jit(lambda state, tokens, segment_ids: nnx.merge(graphdef, state)(tokens, segment_ids=segment_ids))
  return lambda tokens, segment_ids: np.asarray(forward(state, tokens, segment_ids))


@pytest.mark.parametrize('family', cases('parity'))
def test_logits_and_greedy_decoding_match_transformers(family, seed, make_hf_checkpoint):
  """Left-padded rows (the longest 3 windows long) give each real token the logits transformers
  gives the unpadded sequence; greedy answers through 2 decode slots for 3 prompts (a freed slot
  takes the next prompt) equal transformers' generate, past the window."""
  hf_fields, expected_fields = FAMILIES[family]
  directory, reference = make_hf_checkpoint(seed, **hf_fields)
  model = from_pretrained(directory)
  for name, value in expected_fields.items():
    assert getattr(model.config, name) == value, name

  prompts = random_prompts(seed, [21, 4, 13], vocab=model.config.vocab_size)
  tokens, mask = left_padded(prompts)
  logits = jitted(model)(tokens, mask)
  for row, prompt in enumerate(prompts):
    np.testing.assert_allclose(logits[row, -len(prompt):], torch_logits(reference, [prompt])[0], rtol=0,
                               atol=FP32_TOLERANCE, err_msg=f'row {row}')

  steps = 10
  settings = DecodeSettings(max_new_tokens=steps, sampling=SamplingConfig(greedy=True))
  rollout = GroupSampler(model, group_size=1, settings=settings, slots=2)(nnx.state(model), tokens, mask,
                                                                          jax.random.key(0))
  np.testing.assert_array_equal(np.asarray(rollout.tokens), greedy_answers(reference, tokens, mask, steps))


@pytest.mark.exhaustive
@pytest.mark.parametrize('family', ['mistral', 'glm4', 'gemma3_text'])
def test_greedy_decoding_in_the_rollout_layout_matches_transformers(family, seed, make_hf_checkpoint):
  """The sampler's own layout (a 2 x 2 x 2 training mesh into tensor pairs; Mistral's and Gemma's
  one key/value head replicated over each pair) decodes greedily as transformers' generate does."""
  from grpo_jax.model import MeshConfig, make_mesh
  from grpo_jax.sampler.layout import rollout_layout
  directory, reference = make_hf_checkpoint(seed, **FAMILIES[family][0])
  tokens, mask = left_padded(random_prompts(seed, [21, 4, 13]))
  steps = 10
  settings = DecodeSettings(max_new_tokens=steps, sampling=SamplingConfig(greedy=True))
  mesh = make_mesh(MeshConfig(2, 2, 2))
  with jax.set_mesh(mesh):
    model = from_pretrained(directory, mesh=mesh)
    sampler = GroupSampler(model, group_size=1, settings=settings, slots=2, layout=rollout_layout(model, mesh, 2))
    rollout = jax.device_get(sampler(nnx.state(model), tokens, mask, jax.random.key(0)))
  np.testing.assert_array_equal(np.asarray(rollout.tokens), greedy_answers(reference, tokens, mask, steps))


@pytest.mark.parametrize('family', cases('conversion'))
def test_conversion_both_ways_is_bit_exact_under_the_hub_names(family, seed, make_hf_checkpoint, tmp_path):
  """hf -> orbax -> hf gives back every tensor bit for bit under the hub's names (GLM-4's fused
  gate_up_proj whole); Gemma 3's vision-language checkpoint comes back as its language model
  alone (Gemma3ForCausalLM), which transformers loads with the same logits."""
  hf_dir, reference = make_hf_checkpoint(seed, shard_size='100KB', **FAMILIES[family][0])
  orbax_dir, back_dir = str(tmp_path / 'orbax'), str(tmp_path / 'back')
  hf_to_orbax.main(['--hf', hf_dir, '--out', orbax_dir])
  orbax_to_hf.main(['--ckpt', orbax_dir, '--out', back_dir, '--like', hf_dir])

  original, restored = HFCheckpoint(hf_dir), HFCheckpoint(back_dir)
  assert sorted(restored.names()) == sorted(original.names())
  for name in original.names():
    assert np.array_equal(restored.tensor(name), original.tensor(name)), name
  if family == 'glm4':
    assert 'model.layers.0.mlp.gate_up_proj.weight' in restored.names()
  if family == 'gemma3':  # the original holds them under the hub's prefix, beside a vision tower
    assert original.unread and any(name.startswith('language_model.model.') for name in original._stored.values())
    assert not restored.unread and not restored._stored
    # The names transformers 5.x gives them in memory read the same.
    in_memory = tmp_path / 'in_memory'
    in_memory.mkdir()
    stored = {original._stored.get(name, name): original.tensor(name) for name in original.names()}
    stored.update({name: np.zeros(1, np.float32) for name in original.unread})
    write_safetensors(str(in_memory / 'model.safetensors'), [
        TensorEntry.of(name.replace('language_model.model.', 'model.language_model.'), tensor)
        for name, tensor in stored.items()])
    renamed = HFCheckpoint(str(in_memory))
    assert sorted(renamed.names()) == sorted(original.names())
    assert all(np.array_equal(renamed.tensor(name), original.tensor(name)) for name in original.names())

  reloaded = transformers.AutoModelForCausalLM.from_pretrained(back_dir).eval()
  tokens = np.random.default_rng(seed).integers(0, reference.config.get_text_config().vocab_size, (2, 24))
  np.testing.assert_array_equal(torch_logits(reloaded, tokens), torch_logits(reference, tokens))


# Hand-written config.json files as the hub ships them for transformers 4.x (top-level rope_theta,
# rope_scaling, partial_rotary_factor, rope_local_base_freq; no rope_parameters).
HUB_CONFIGS = {
    'Llama-3.2-1B': dict(architectures=['LlamaForCausalLM'], model_type='llama', hidden_size=2048,
                         intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=64, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
                         rope_scaling={'factor': 32.0, 'high_freq_factor': 4.0, 'low_freq_factor': 1.0,
                                       'original_max_position_embeddings': 8192, 'rope_type': 'llama3'},
                         rms_norm_eps=1e-05, tie_word_embeddings=True, attention_bias=False, mlp_bias=False,
                         hidden_act='silu', bos_token_id=128000, eos_token_id=128001, torch_dtype='bfloat16',
                         pretraining_tp=1),
    'deepseek-llm-7b-base': dict(architectures=['LlamaForCausalLM'], model_type='llama', hidden_size=4096,
                                 intermediate_size=11008, num_hidden_layers=30, num_attention_heads=32,
                                 num_key_value_heads=32, vocab_size=102400, max_position_embeddings=4096,
                                 rope_theta=10000.0, rope_scaling=None, rms_norm_eps=1e-06, tie_word_embeddings=False,
                                 hidden_act='silu', bos_token_id=100000, eos_token_id=100001, torch_dtype='bfloat16'),
    'Mistral-7B-v0.1': dict(architectures=['MistralForCausalLM'], model_type='mistral', hidden_size=4096,
                            intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                            num_key_value_heads=8, vocab_size=32000, max_position_embeddings=32768,
                            rope_theta=10000.0, sliding_window=4096, rms_norm_eps=1e-05, tie_word_embeddings=False,
                            hidden_act='silu', bos_token_id=1, eos_token_id=2, torch_dtype='bfloat16'),
    'Mistral-Nemo-Base-2407': dict(architectures=['MistralForCausalLM'], model_type='mistral', hidden_size=5120,
                                   intermediate_size=14336, num_hidden_layers=40, num_attention_heads=32,
                                   num_key_value_heads=8, head_dim=128, vocab_size=131072,
                                   max_position_embeddings=1024000, rope_theta=1000000.0, sliding_window=None,
                                   rms_norm_eps=1e-05, tie_word_embeddings=False, hidden_act='silu',
                                   bos_token_id=1, eos_token_id=2, torch_dtype='bfloat16'),
    'GLM-4-9B-0414': dict(architectures=['Glm4ForCausalLM'], model_type='glm4', hidden_size=4096,
                          intermediate_size=13696, num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=2,
                          head_dim=128, vocab_size=151552, max_position_embeddings=32768, rope_theta=10000.0,
                          partial_rotary_factor=0.5, attention_bias=True, rms_norm_eps=1e-05,
                          tie_word_embeddings=False, hidden_act='silu', pad_token_id=151329,
                          eos_token_id=[151329, 151336, 151338], torch_dtype='bfloat16'),
    'gemma-3-1b-pt': dict(architectures=['Gemma3ForCausalLM'], model_type='gemma3_text', hidden_size=1152,
                          intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1,
                          head_dim=256, vocab_size=262144, max_position_embeddings=32768, rope_theta=1000000.0,
                          rope_local_base_freq=10000.0, rope_scaling=None, sliding_window=512,
                          sliding_window_pattern=6, query_pre_attn_scalar=256, attn_logit_softcapping=None,
                          final_logit_softcapping=None, hidden_activation='gelu_pytorch_tanh', rms_norm_eps=1e-06,
                          bos_token_id=2, eos_token_id=1, pad_token_id=0, torch_dtype='bfloat16'),
    'gemma-3-4b-pt': dict(architectures=['Gemma3ForConditionalGeneration'], model_type='gemma3',
                          text_config=dict(model_type='gemma3_text', hidden_size=2560, intermediate_size=10240,
                                           num_hidden_layers=34, num_attention_heads=8, num_key_value_heads=4,
                                           head_dim=256, vocab_size=262208, rope_theta=1000000.0,
                                           rope_local_base_freq=10000.0, sliding_window=1024, sliding_window_pattern=6,
                                           query_pre_attn_scalar=256,
                                           rope_scaling={'factor': 8.0, 'rope_type': 'linear'}),
                          vision_config=dict(model_type='siglip_vision_model', hidden_size=1152, image_size=896,
                                             patch_size=14, num_hidden_layers=27),
                          mm_tokens_per_image=256, eos_token_id=[1, 106], torch_dtype='bfloat16'),
}
# Gemma 3's sliding layers on a base of their own, read from the hub's key (every published file
# has 10000, the default, which would hide a reader that ignores it).
HUB_CONFIGS['gemma-3-1b-pt, local base 5000'] = dict(HUB_CONFIGS['gemma-3-1b-pt'], rope_local_base_freq=5000.0)
# What each hub file must give, beyond what transformers' own reading of it is compared with.
HUB_EXPECTED = {
    'Llama-3.2-1B': dict(rope_type='llama3', rope_factor=32.0, rope_original_max_position_embeddings=8192,
                         rope_theta=500000.0, tie_word_embeddings=True),
    'deepseek-llm-7b-base': dict(family='llama', rope_type='default', num_key_value_heads=32),
    'Mistral-7B-v0.1': dict(sliding_window=4096, sliding_layers=(True,) * 32),
    'Mistral-Nemo-Base-2407': dict(sliding_window=None, head_dim=128, hidden_size=5120),
    'GLM-4-9B-0414': dict(partial_rotary_factor=0.5, rotary_dim=64, eos_token_ids=(151329, 151336, 151338)),
    'gemma-3-1b-pt': dict(local_rope_theta=10000.0, rope_theta=1e6, sliding_window=512,
                          layer_types=((('sliding_attention',) * 5 + ('full_attention',)) * 4
                                       + ('sliding_attention',) * 2)),
    'gemma-3-4b-pt': dict(rope_type='linear', rope_factor=8.0, vocab_size=262208, family='gemma3_text'),
    'gemma-3-1b-pt, local base 5000': dict(local_rope_theta=5000.0, rope_theta=1e6),
}


@pytest.mark.parametrize('name', sorted(HUB_CONFIGS))
def test_hub_and_transformers_5_spellings_read_alike(name):
  """A hub config.json and transformers 5.24's own re-spelling of it (rope_parameters, keyed by
  layer type for Gemma 3) read as one architecture; written back, it reads the same again."""
  raw = HUB_CONFIGS[name]
  config = from_hf_dict(raw)
  for field, value in HUB_EXPECTED[name].items():
    assert getattr(config, field) == value, field
  # transformers 5.x writes head_dim out where a hub file leaves it to hidden / heads.
  same = lambda c: dataclasses.replace(c, head_dim=c.resolved_head_dim)  # noqa: E731
  respelled = transformers.AutoConfig.for_model(**raw).to_dict()
  assert 'rope_parameters' in (respelled.get('text_config') or respelled)
  assert same(from_hf_dict(respelled)) == same(config)
  assert from_hf_dict(to_hf_dict(config)) == config
  written = transformers.AutoConfig.for_model(**to_hf_dict(config)).to_dict()  # transformers reads what we write
  assert same(from_hf_dict(written)) == same(config)


@pytest.mark.parametrize('change, message', [
    (dict(final_logit_softcapping=30.0), 'final_logit_softcapping=30.0 is not implemented'),
    (dict(attn_logit_softcapping=50.0), 'attn_logit_softcapping=50.0 is not implemented'),
    (dict(use_bidirectional_attention=True), 'use_bidirectional_attention=True is not implemented'),
    (dict(rope_scaling={'rope_type': 'dynamic', 'factor': 4.0}), "rope type 'dynamic' is not supported"),
    (dict(rope_scaling={'rope_type': 'yarn', 'factor': 4.0}), 'original_max_position_embeddings is missing'),
    (dict(rope_scaling={'rope_type': 'linear', 'factor': 4.0, 'attention_factor': 2.0}),
     'attention_factor is not implemented'),
    (dict(hidden_activation='gelu'), "hidden_act='gelu' is not supported"),
])
def test_fields_the_decoder_does_not_implement_are_refused_in_one_line(change, message):
  raw = {**HUB_CONFIGS['gemma-3-1b-pt'], **change}
  with pytest.raises(UserError) as error:
    from_hf_dict(raw)
  assert message in str(error.value) and '\n' not in str(error.value)
  llama = {**HUB_CONFIGS['Llama-3.2-1B'], 'mlp_bias': True}
  with pytest.raises(UserError, match='mlp_bias=True is not implemented'):
    from_hf_dict(llama)


def test_the_ragged_kernel_refuses_a_sliding_window_in_one_line():
  from grpo_jax.model.loading import abstract_model
  config = from_hf_dict({**HUB_CONFIGS['Mistral-7B-v0.1'], 'num_hidden_layers': 1, 'hidden_size': 64,
                         'intermediate_size': 64, 'num_attention_heads': 4, 'num_key_value_heads': 2, 'vocab_size': 64})
  with pytest.raises(UserError, match="model.decode_attention 'pallas': the ragged decode kernel has no sliding"):
    abstract_model(config, ModelOptions(decode_attention='pallas'))


def test_packed_update_of_a_sliding_window_model_equals_padded(seed):
  """The update's gradients and log-prob metrics on packed rows (sequences of up to 11 tokens
  side by side, each sliding over 3) equal those on padded rows, for a Gemma 3 architecture."""
  from test_packing import SETTINGS, assert_packed_equals_padded, exact_fill_batch, run_update
  from test_update import ARCHITECTURE, random_model
  sliding = dataclasses.replace(ARCHITECTURE, family='gemma3_text', attention_bias=False, qk_norm=True,
                                norm_offset=True, sandwich_norms=True, embedding_scale=True,
                                hidden_act='gelu_pytorch_tanh', sliding_window=3, query_pre_attn_scalar=12.0,
                                layer_types=('sliding_attention', 'full_attention'), local_rope_theta=100.0)
  rng = np.random.default_rng(seed)
  _, params = random_model(rng, sliding)
  _, ref_params = random_model(rng, sliding)
  batch = exact_fill_batch(rng)
  settings = SETTINGS['token-mean, all terms']
  padded = run_update(settings, params, batch, seed, packed=False, ref_params=ref_params, architecture=sliding)
  packed = run_update(settings, params, batch, seed, packed=True, ref_params=ref_params, architecture=sliding)
  assert_packed_equals_padded(padded, packed, batch)


@pytest.mark.exhaustive
def test_sliding_window_paths_agree(seed):
  """For a model whose layers slide (Gemma 3's mix: local and global layers, each with its RoPE),
  the chunked and dense full-sequence attention, unrolled and rematerialised layers, and the
  blockwise and dense decode attention with scanned or unrolled decode layers give the same logits
  and answers (each path's own mask, each layer's own frequencies)."""
  from grpo_jax.model import Qwen2Config, init_model
  config = Qwen2Config(family='gemma3_text', attention_bias=False, qk_norm=True, norm_offset=True,
                       sandwich_norms=True, embedding_scale=True, hidden_act='gelu_pytorch_tanh', sliding_window=5,
                       layer_types=('sliding_attention', 'full_attention'), query_pre_attn_scalar=24.0,
                       local_rope_theta=100.0, vocab_size=256)
  tokens, mask = left_padded(random_prompts(seed, [19, 7], vocab=256))
  expected = jitted(init_model(config, seed=seed % 1000))(tokens, mask)
  for options in (ModelOptions(attention='chunked', attention_chunk=4), ModelOptions(scan_layers=False, remat='full')):
    np.testing.assert_allclose(jitted(init_model(config, options=options, seed=seed % 1000))(tokens, mask), expected,
                               rtol=0, atol=1e-5, err_msg=str(options))
  answers = {}
  for options in (ModelOptions(), ModelOptions(decode_attention='blockwise', decode_block=4),
                  ModelOptions(decode_layers='unrolled', prompt_reads='once')):
    model = init_model(config, options=options, seed=seed % 1000)
    settings = DecodeSettings(max_new_tokens=8, sampling=SamplingConfig(greedy=True))
    answers[options] = np.asarray(GroupSampler(model, group_size=2, settings=settings)(
        nnx.state(model), tokens, mask, jax.random.key(0)).tokens)
  for options, tokens_out in answers.items():
    np.testing.assert_array_equal(tokens_out, answers[ModelOptions()], err_msg=str(options))


# The tokenizer each family's checkpoint gets (tests/family_tokenizers.py).
TOKENIZERS = {'llama3': 'llama3', 'deepseek-llm': 'deepseek', 'mistral': 'mistral', 'glm4': 'glm4',
              'gemma3_text': 'gemma3', 'gemma3': 'gemma3'}


@pytest.mark.parametrize('family', [pytest.param(name, marks=() if name == 'gemma3_text' else pytest.mark.exhaustive)
                                    for name in TOKENIZERS])
def test_one_rl_step_on_the_math_task_with_the_familys_tokenizer_and_template(family, seed, make_hf_checkpoint,
                                                                              tmp_path):
  """configs/tiny_math.yaml from a random checkpoint of the family, with the family's tokenizer, chat
  template and stop lists (family_tokenizers.py): the prompts the step trains on are what
  transformers' apply_chat_template gives (the family's BOS or prefix once), every answer ends at one
  of the family's stops or at the token cap, and the step's update is finite and moves the weights (an
  entropy bonus gives it a gradient whatever the random model scores)."""
  import json

  from family_tokenizers import write_family
  from grpo_jax import config as config_lib
  from grpo_jax import train
  from grpo_jax.data.math_task import open_tokenizer
  directory, _ = make_hf_checkpoint(seed % 1000, **FAMILIES[family][0])
  tokens = write_family(directory, TOKENIZERS[family])
  source = tmp_path / 'problems.jsonl'
  questions = [f'What is {a} + {b}?' for a, b in ((2, 3), (4, 1), (3, 3), (1, 5))]
  with open(source, 'w') as f:
    for question in questions:
      f.write(json.dumps({'question': question, 'answer': str(sum(map(int, question[8:-1].split(' + '))))}) + '\n')
  overrides = [f'model.path={directory}', 'task.tokenizer=null', f'task.source={source}', 'task.max_prompt_tokens=96',
               'task.reward_workers=1', 'rollout.prompts_per_step=2', 'algo.group_size=4', 'rollout.max_new_tokens=6',
               'algo.dynamic_sampling=false', 'train.steps=1', 'train.checkpoint_every=0', 'train.progress=false',
               'train.tensorboard=false', 'eval.source=null', 'optim.warmup_steps=0',
               'algo.entropy_coef=0.01']  # a gradient whatever the random model's rewards
  config = config_lib.load_config(os.path.join(ROOT, 'configs/tiny_math.yaml'), overrides)
  tokenizer, special, use_template = open_tokenizer(config.task, directory)
  assert use_template
  stops = set(special.stop_ids)
  assert {tokenizer.convert_tokens_to_ids(stop) for stop in tokens.stops} <= stops
  task = train.build_task(config)
  assert len(task.problems.prompt_ids) == len(questions)
  for index, question in enumerate(questions):  # the reference: transformers' own rendering
    expected = tokenizer.apply_chat_template([{'role': 'user', 'content': question}], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)['input_ids']
    assert list(task.problems.prompt_ids[index]) == list(expected), index
  workdir, mesh, model = train.setup(config, os.path.join(ROOT, 'configs/tiny_math.yaml'), str(tmp_path / 'run'),
                                     devices=jax.devices()[:1])
  run = train.Run(config, workdir, mesh, model, task)
  before = [np.asarray(leaf) for leaf in jax.tree.leaves(run.state.params)]
  rollouts = []
  try:
    with jax.set_mesh(run.mesh):
      run.state, metrics = run.rl_step(run.state, run.held,
                                       lambda stage, value: stage == 'rollout' and rollouts.append(value))
    after = [np.asarray(leaf) for leaf in jax.tree.leaves(run.state.params)]
  finally:
    run.close()
  (rollout,) = rollouts
  for tokens_row, length, stopped in zip(np.asarray(rollout.tokens), np.asarray(rollout.lengths),
                                         np.asarray(rollout.stopped)):
    answer = list(tokens_row[:length])
    ended = [i for i, token in enumerate(answer) if token in stops]
    assert ended == ([length - 1] if stopped else []), (answer, stops)
    assert stopped or length == 6
  assert np.isfinite(float(metrics['policy_loss'])) and float(metrics['grad_norm']) > 0
  assert any(not np.array_equal(b, a) for b, a in zip(before, after))
