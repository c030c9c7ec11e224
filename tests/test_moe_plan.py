"""Mixtures of experts in the plan and the rollout layout: the Qwen3-MoE presets against their
model cards, FLOPs counted on the active parameters, and the sampler's resident experts sharded
over its data groups (sampler/layout.py) on a tiny mixture over 8 CPU devices.

The deviceless plans of the two recipes (configs/qwen3_30b_a3b_dapo.yaml, qwen3_235b_a22b_dapo.yaml)
take minutes per target and are not run here; BENCHMARKS.md has their figures and commands."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from grpo_jax import config as config_lib
from grpo_jax.metrics import model_flops_per_step
from grpo_jax.model import MeshConfig, make_mesh
from grpo_jax.model.config import Qwen2Config
from grpo_jax.model.hf_config import from_hf_dict, to_hf_dict
from grpo_jax.model.loading import abstract_model, init_model
from grpo_jax.model.presets import QWEN3_MOE_PRESETS, preset
from grpo_jax.plan import traffic
from grpo_jax.plan.report import estimate, routes_bytes
from grpo_jax.plan.targets import parse_target
from grpo_jax.sampler import DecodeSettings, SamplingConfig
from grpo_jax.sampler.layout import resident_bytes_per_device, rollout_layout
from grpo_jax.sampler.rollout import GroupSampler
from grpo_jax.testing import left_padded, random_prompts

# The model cards: total and activated parameters, in billions.
CARDS = {'30B-A3B': (30.5, 3.3), '235B-A22B': (235.0, 22.0)}


@pytest.mark.parametrize('size', sorted(QWEN3_MOE_PRESETS))
def test_moe_presets_match_their_model_cards(size):
  config = preset(f'Qwen3-{size}')
  total, active = CARDS[size]
  # The cards round to two or three digits ('3.3B' for 3.35B): within 2%.
  assert abs(config.num_params() / 1e9 - total) <= 0.02 * total
  assert abs(config.num_params(active=True) / 1e9 - active) <= 0.02 * active
  assert config.model_type == 'qwen3_moe' and config.num_sparse_layers == config.num_hidden_layers
  # The count is the model's: every parameter of the abstract model, and the active ones are the
  # total less the E - k experts a token skips in each layer (3 D M each).
  state = nnx.state(abstract_model(config))
  assert sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(state)) == config.num_params()
  skipped = (config.num_experts - config.num_experts_per_tok) * 3 * config.hidden_size * config.moe_intermediate_size
  assert config.num_params() - config.num_params(active=True) == config.num_hidden_layers * skipped
  assert from_hf_dict(to_hf_dict(config)) == config  # as a config.json writes and reads it


def test_flops_count_the_active_parameters():
  """The plan's estimate (and the trainer's MFU, train.py) count 2 N per sampled token and 6 N per
  trained one with N the active parameters: for Qwen3-30B-A3B a ninth of the total."""
  architecture = preset('Qwen3-30B-A3B')
  config = config_lib.load_config('configs/qwen3_30b_a3b_dapo.yaml')
  prompt_length = config.task.max_prompt_tokens
  report = dict(model=dict(trained=architecture.num_params()), per_device=dict(resident_weights=0, kv_cache=0),
                programs=[], program_devices={})
  flops = estimate(config, parse_target('h100x8x4'), architecture, prompt_length, report)['model_flops']
  active = architecture.num_params(active=True)
  assert flops == model_flops_per_step(active, prompt_length, config.rollout, config.algo)
  assert flops < model_flops_per_step(architecture.num_params(), prompt_length, config.rollout, config.algo) / 8
  # The recorded routes of one step: 1,024 rows x 12,288 tokens x 48 layers x top-8, one byte each.
  sequence = prompt_length + config.rollout.max_new_tokens
  assert routes_bytes(architecture, config.completions_per_step, sequence) == 1024 * 12288 * 48 * 8
  assert routes_bytes(preset('Qwen3-8B'), 1024, sequence) == 0


# A tiny mixture: 16 experts of width 32 in both layers, top-2; 4 query heads over 2 KV heads.
TINY = Qwen2Config(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_bias=False, qk_norm=True,
                   num_experts=16, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
EXPERTS = ('expert_gate_weight', 'expert_up_weight', 'expert_down_weight')


def _collectives_moved(found, in_loop: bool) -> int:
  return sum(traffic.totals(found, in_loop=in_loop).values())


def test_resident_experts_are_sharded_over_the_sampler_groups():
  """FSDP over 8 devices, sampler tensor 2 (4 groups, the sampler mesh's 'expert' axis): each device holds 4 of the 16 experts
  of each layer, each expert's M split over the pair, while the dense weights lie whole along D and
  are replicated over the groups. The layout moves about the resident weights (at most 1.5x them;
  straight from D over 8 devices to E over 4 XLA replicated the experts first, 2.8x)."""
  mesh = make_mesh(MeshConfig(1, 8, 1))
  with jax.set_mesh(mesh):
    model = init_model(TINY, mesh=mesh)
    layout = rollout_layout(model, mesh, 2)
    params = nnx.state(model)
    place = jax.jit(layout.place)
    resident = place(params)
    hlo = place.lower(params).compile().as_text()
  assert (layout.data_groups, layout.tensor, layout.experts_per_device(16)) == (4, 2, 4)
  layers = resident['layers']
  for name in EXPERTS:
    stacked = layers[name][...]
    assert stacked.sharding.spec[1] == 'expert'
    d_or_m = (64, 16) if name != 'expert_down_weight' else (16, 64)
    assert stacked.sharding.shard_shape(stacked.shape) == (2, 4) + d_or_m
    original = np.asarray(params['layers'][name][...])
    held = {}
    for shard in stacked.addressable_shards:  # every expert on the 2 devices of one group, no other
      experts = range(*shard.index[1].indices(16))
      np.testing.assert_array_equal(np.asarray(shard.data), original[shard.index])
      held.setdefault(tuple(experts), set()).add(shard.device)
    assert sorted(held) == [tuple(range(i, i + 4)) for i in range(0, 16, 4)]
    assert all(len(devices) == 2 for devices in held.values())
  for name in ('q_weight', 'o_weight', 'router_weight'):
    dense = layers[name][...]
    assert 'expert' not in jax.tree.leaves(tuple(dense.sharding.spec))
    assert dense.sharding.shard_shape(dense.shape)[1 if name != 'o_weight' else 3] == 64  # D whole
  found = traffic.collectives(hlo, 8)
  assert _collectives_moved(found, False) <= 1.5 * resident_bytes_per_device(params, layout)


@pytest.mark.exhaustive
def test_decode_loop_moves_no_expert_weight_on_cpu():
  """Sampler tensor 1 over 8 devices (8 data groups, 2 experts each): per decode step the
  collectives are activation-sized, every one smaller than a single layer's experts of one
  projection (which a gather of the experts would move). On XLA:CPU, which lowers the ragged
  matmul as a dense product over the experts, so partitions it along E; XLA:TPU and XLA:GPU keep
  it ragged and gather the experts (BENCHMARKS.md, "Mixture of experts")."""
  mesh = make_mesh(MeshConfig(1, 8, 1))
  tokens, mask = left_padded(random_prompts(0, [5, 17, 11, 3, 8, 2, 14, 6], vocab=1024))
  decode = DecodeSettings(max_new_tokens=4, sampling=SamplingConfig(temperature=1.0))
  with jax.set_mesh(mesh):
    model = init_model(TINY, mesh=mesh)
    layout = rollout_layout(model, mesh, 1)
    sampler = GroupSampler(model, group_size=2, settings=decode, layout=layout)
    hlo = sampler._run.lower(nnx.state(model), tokens, mask, jax.random.key(0)).compile().as_text()
  found = traffic.collectives(hlo, 8)
  one_projection = TINY.num_experts * TINY.hidden_size * TINY.moe_intermediate_size * 4
  in_loop = [c for c in found if c.in_loop]
  assert in_loop and all(c.bytes * c.count < one_projection for c in in_loop)
  assert 0 < _collectives_moved(found, True) < one_projection
  assert not any('expert' in c.where for c in in_loop)


def test_a_ragged_all_to_all_moves_the_rows_sent_not_its_receive_buffer():
  """The plan's traffic of a ragged all-to-all (the experts' dispatch) is its operand, the rows each
  device sends, in the synchronous form (XLA:TPU's, its operand named on another line) and the
  asynchronous one (XLA:GPU's, its operands in the start's tuple); its receive buffer, 4x the rows
  here (every sender's rows could land on one device), is memory, not traffic."""
  rows, receive, width = 64, 256, 128
  offsets = ', '.join(['s64[4]{0} %o'] * 4)
  sync = f"""HloModule m

ENTRY %main (p0: bf16[{rows},{width}], p1: bf16[{receive},{width}], o: s64[4]) -> bf16[{receive},{width}] {{
  %p0 = bf16[{rows},{width}]{{1,0}} parameter(0)
  %p1 = bf16[{receive},{width}]{{1,0}} parameter(1)
  %o = s64[4]{{0}} parameter(2)
  ROOT %r = bf16[{receive},{width}]{{1,0}} ragged-all-to-all(%p0, %p1, %o, %o, %o, %o), replica_groups={{{{0,1,2,3}}}}
}}
"""
  start = (f'((bf16[{rows},{width}]{{1,0}}, bf16[{receive},{width}]{{1,0}}, {offsets.replace(" %o", "")}), '
           f'bf16[{receive},{width}]{{1,0}})')
  asynchronous = sync.replace(
      f'ROOT %r = bf16[{receive},{width}]{{1,0}} ragged-all-to-all(',
      f'%s = {start} ragged-all-to-all-start(').replace(
      '}}}\n}', '}}}\n  ROOT %r = bf16[' + f'{receive},{width}' + ']{1,0} ragged-all-to-all-done(%s)\n}')
  for hlo in (sync, asynchronous):
    found = traffic.collectives(hlo, 4)
    assert [(c.kind, c.bytes, c.count) for c in found] == [('all-to-all', rows * width * 2, 1)], hlo


def test_fewer_slots_than_answers_decode_in_turns():
  """The plan's decode bytes: each step reads the resident weights and half the slots' cache, and
  with 512 slots for 1,024 answers each slot decodes two answers in turn (at worst both to the
  budget), so twice the steps of 1,024 slots."""
  from grpo_jax import config as config_lib
  architecture = preset('Qwen3-30B-A3B')
  report = dict(model=dict(trained=architecture.num_params()), per_device=dict(resident_weights=7, kv_cache=40),
                programs=[], program_devices={})
  config = config_lib.load_config('configs/qwen3_30b_a3b_dapo.yaml', [])
  answers = config.completions_per_step
  assert answers == 1024 and config.rollout.slots in (0, answers)
  every = estimate(config, parse_target('h100x8x4'), architecture, 2048, report)['decode_hbm_bytes']
  halved = dict(report, per_device=dict(resident_weights=7, kv_cache=20))
  fewer = config_lib.load_config('configs/qwen3_30b_a3b_dapo.yaml', ['rollout.slots=512'])
  turns = estimate(fewer, parse_target('h100x8x4'), architecture, 2048, halved)['decode_hbm_bytes']
  assert every == config.rollout.max_new_tokens * (7 + 20)
  assert turns == 2 * config.rollout.max_new_tokens * (7 + 10)
