"""The sampler's own layout (sampler/layout.py): weights cast and laid out once per rollout,
tensor-parallel over `rollout.tensor` devices and replicated over the data groups.

On 8 CPU devices, for training meshes (8,1,1), (1,8,1), (2,2,2), (2,1,4) and sampler tensor sizes
1, 2, 4, 8 the rollout equals one device's (tokens, masks, lengths and stop flags exactly,
log-probs to 1e-5 in fp32). The model has 4 query heads over 2 KV heads: at t = 4 the KV heads do
not divide (their projections and the cache are replicated over each tensor group), at t = 8
neither do the query heads. The compiled programs' collectives are read back (traffic.py) and
held to a hand count: the decode loop moves activations only, and the reshard moves each
device's resident weights about once."""

import dataclasses
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from grpo_jax.plan import traffic
from grpo_jax.errors import UserError
from grpo_jax.model import MeshConfig, ModelOptions, from_pretrained, make_mesh
from grpo_jax.sampler import DecodeSettings, SamplingConfig
from grpo_jax.sampler.layout import choose_tensor, resident_bytes_per_device, rollout_layout, rollout_mesh
from grpo_jax.sampler.rollout import GroupSampler
from grpo_jax.testing import left_padded, random_prompts, seed_with_split_answers

# Its module-scoped fixtures are built once: the whole file runs on one xdist worker.
pytestmark = pytest.mark.xdist_group('test_rollout_layout')

FIELDS = ('tokens', 'mask', 'lengths', 'stopped')
VOCAB, HIDDEN, MLP = 1024, 64, 128  # divisible by 8: vocabulary, MLP columns split on every tensor size
MESHES = [(8, 1, 1), (1, 8, 1), (2, 2, 2), (2, 1, 4)]
SAMPLINGS = {'greedy': SamplingConfig(greedy=True), 't1': SamplingConfig(temperature=1.0),
             'top_p': SamplingConfig(temperature=0.7, top_p=0.9)}
# Every training mesh meets every sampler tensor size; sampling modes and slot counts rotate over them.
CASES = [(mesh, tensor, list(SAMPLINGS)[(i + j) % 3], (0, 6)[(i + j) % 2])
         for i, mesh in enumerate(MESHES) for j, tensor in enumerate((1, 2, 4, 8))]
# Hybrid sharding's mesh (data 2 x fsdp 4) into tensor groups of its fsdp size: laid out through each
# device's own D slice (RolloutLayout.place), never through another group's replica.
CASES.append(((2, 4, 1), 4, 't1', 6))
# make test's two: a cube into tensor groups of 4 (from fsdp x tensor), and data replicas of tensor pairs.
FAST_CASES = {((2, 2, 2), 4), ((2, 1, 4), 2)}


@pytest.fixture(scope='module')
def checkpoint(tmp_path_factory):
  """(directory, seed, stop ids): a random checkpoint and the stop ids for _inputs(seed)'s prompts.

  The stop ids are an eighth of the vocabulary less every token of the model's unstopped greedy
  answers, and one taken from those answers (testing.splitting_token). The greedy answers then
  stop at that token alone: rows holding it end early, the others run to the budget, so greedy
  lengths differ whatever the seed (a random eighth that held a token every row starts with ended
  them all at one token). A model whose greedy answers all hold the same tokens is passed over
  (testing.seed_with_split_answers)."""
  from grpo_jax.testing import save_random_hf_checkpoint
  seed = int(os.environ.get('TEST_SEED') or int.from_bytes(os.urandom(4), 'little'))
  print(f'checkpoint seed={seed}')
  directory = str(tmp_path_factory.mktemp('layout') / 'hf')
  greedy = DecodeSettings(max_new_tokens=12, sampling=SAMPLINGS['greedy'])

  def greedy_answers(candidate):
    save_random_hf_checkpoint(directory, candidate, vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=MLP)
    tokens, mask, _ = _inputs(candidate)
    answers = np.asarray(_sample(from_pretrained(directory), tokens, mask, greedy, 0)[1].tokens)
    return answers, set(answers.ravel().tolist())

  seed, split, held = seed_with_split_answers(seed, greedy_answers)
  return directory, seed, tuple(t for t in _inputs(seed)[2] if t not in held) + (split,)


def _inputs(seed):
  tokens, mask = left_padded(random_prompts(seed, [5, 17, 11, 3, 8, 2, 14, 6], vocab=VOCAB))
  # An eighth of the vocabulary stops an answer: sampled lengths spread from 1 token to the budget.
  stops = tuple(int(t) for t in np.random.default_rng(seed).choice(VOCAB, VOCAB // 8, replace=False))
  return tokens, mask, stops


def _sample(model, tokens, mask, decode, slots, layout=None):
  sampler = GroupSampler(model, group_size=2, settings=decode, slots=slots, layout=layout)
  return sampler, sampler(nnx.state(model), tokens, mask, jax.random.key(11))


@pytest.fixture(scope='module')
def inputs(checkpoint):
  """Prompts (_inputs) and the checkpoint's stop ids for them."""
  _, seed, stops = checkpoint
  return *_inputs(seed)[:2], stops


@pytest.fixture(scope='module')
def references(checkpoint, inputs):
  """One device, today's sampler (the training layout), per sampling mode."""
  directory, _, _ = checkpoint
  tokens, mask, stops = inputs
  model = from_pretrained(directory)
  return {name: jax.device_get(_sample(model, tokens, mask, DecodeSettings(max_new_tokens=12, sampling=sampling,
                                                                           stop_token_ids=stops), 0)[1])
          for name, sampling in SAMPLINGS.items()}


def assert_same_samples(rollout, reference, where: str, sampled: bool) -> None:
  """The rollouts' fields equal and their log-probs to 1e-5 in every row, but for one row at most where
  sampled: the same key's noise on logits a few ulps apart (sums in another order) picks the other of
  two tokens whose noisy scores tie to within those ulps (one token in 192 at seed 3410766580), and
  that row goes its own way from there; before it, it is held like the rest. A row laid out wrongly
  differs from its first token, and every such row does."""
  tokens, expected = np.asarray(rollout.tokens), np.asarray(reference.tokens)
  parted = np.flatnonzero((tokens != expected).any(1))
  assert len(parted) <= (1 if sampled else 0), f'tokens on {where}: rows {parted} differ'
  whole = np.setdiff1d(np.arange(len(tokens)), parted)
  for name in FIELDS:
    np.testing.assert_array_equal(np.asarray(getattr(rollout, name))[whole], np.asarray(getattr(reference, name))[whole],
                                  err_msg=f'{name} on {where}')
  log_probs, expected_log_probs = np.asarray(rollout.log_probs), np.asarray(reference.log_probs)
  np.testing.assert_allclose(log_probs[whole], expected_log_probs[whole], rtol=1e-5, atol=1e-5, err_msg=where)
  for row in parted:
    first = int(np.flatnonzero(tokens[row] != expected[row])[0])
    np.testing.assert_allclose(log_probs[row, :first], expected_log_probs[row, :first], rtol=1e-5, atol=1e-5,
                               err_msg=f'{where}: row {row} before it parts at token {first}')


@pytest.mark.parametrize('mesh_shape, tensor, sampling, slots', [
    pytest.param(m, t, s, b, id=f'{"x".join(map(str, m))}-t{t}-{s}-slots{b}',
                 marks=() if (m, t) in FAST_CASES else pytest.mark.exhaustive) for m, t, s, b in CASES])
def test_rollout_in_the_sampler_layout_equals_one_device(checkpoint, inputs, references, mesh_shape, tensor, sampling,
                                                        slots):
  directory, _, _ = checkpoint
  tokens, mask, stops = inputs
  decode = DecodeSettings(max_new_tokens=12, sampling=SAMPLINGS[sampling], stop_token_ids=stops)
  mesh = make_mesh(MeshConfig(*mesh_shape))
  with jax.set_mesh(mesh):
    model = from_pretrained(directory, mesh=mesh)
    layout = rollout_layout(model, mesh, tensor)
    assert (layout.tensor, layout.data_groups) == (tensor, 8 // tensor)
    _, rollout = _sample(model, tokens, mask, decode, slots, layout)
  reference = references[sampling]
  assert_same_samples(rollout, reference, f'{mesh_shape}, tensor {tensor}', sampled=sampling != 'greedy')
  assert np.asarray(reference.lengths).min() < np.asarray(reference.lengths).max()
  # Handed back in the training layout: rows over the training mesh's batch axes.
  assert rollout.tokens.sharding.mesh.shape == mesh.shape


@pytest.mark.exhaustive
@pytest.mark.parametrize('mesh_shape, tensor', [((1, 8, 1), 4), ((2, 2, 2), 8)], ids=['fsdp8-t4', '2x2x2-t8'])
def test_qwen3_rollout_in_the_sampler_layout_equals_one_device(seed, make_hf_checkpoint, mesh_shape, tensor):
  """Qwen3's shape (per-head q/k norms, head_dim 24 where D / N = 16) from FSDP and a cube of 8
  devices into tensor groups of 4 (the KV heads divide) and 8 (they do not): sampled at t = 1."""
  directory, _ = make_hf_checkpoint(seed, vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=MLP,
                                    model_type='qwen3', head_dim=24)
  tokens, mask, stops = _inputs(seed)
  decode = DecodeSettings(max_new_tokens=12, sampling=SAMPLINGS['t1'], stop_token_ids=stops)
  reference = jax.device_get(_sample(from_pretrained(directory), tokens, mask, decode, 6)[1])
  mesh = make_mesh(MeshConfig(*mesh_shape))
  with jax.set_mesh(mesh):
    model = from_pretrained(directory, mesh=mesh)
    _, rollout = _sample(model, tokens, mask, decode, 6, rollout_layout(model, mesh, tensor))
  assert_same_samples(rollout, reference, f'{mesh_shape}, tensor {tensor}', sampled=True)

def test_resident_weights_are_cast_split_over_tensor_and_replicated_over_data(checkpoint):
  directory, _, _ = checkpoint
  mesh = make_mesh(MeshConfig(1, 8, 1))
  with jax.set_mesh(mesh):
    model = from_pretrained(directory, mesh=mesh, options=ModelOptions(dtype='bfloat16', param_dtype='float32'))
    layout = rollout_layout(model, mesh, 4)
    params = nnx.state(model)
    resident = jax.jit(layout.place)(params)
  assert layout.mesh.shape == dict(data=2, fsdp=1, tensor=4, expert=1, context=1)
  assert list(np.asarray(layout.mesh.devices).reshape(-1)) == list(np.asarray(mesh.devices).reshape(-1))
  gate = resident['layers']['gate_weight'][...]
  assert gate.dtype == jnp.bfloat16 and params['layers']['gate_weight'][...].dtype == jnp.float32
  assert gate.sharding.spec == PartitionSpec(None, None, 'tensor')  # D whole, MLP columns over tensor
  assert resident['embedding'][...].sharding.spec == PartitionSpec('tensor')  # vocabulary over tensor
  np.testing.assert_array_equal(np.asarray(gate, np.float32),
                                np.asarray(params['layers']['gate_weight'][...].astype(jnp.bfloat16), np.float32))
  expected = sum(math.prod(v.shape) for v in jax.tree.leaves(params)) * 2  # bf16, before splitting
  assert resident_bytes_per_device(params, layout) < expected / 2
  assert resident_bytes_per_device(params, layout) == sum(
      math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(resident))


@pytest.mark.exhaustive
def test_collectives_of_the_reshard_and_the_decode_loop(checkpoint):
  """FSDP over 8 devices, sampler tensor 4: the reshard receives about the resident weights (at
  most twice them), and a decode step moves only activations, bounded by a hand count."""
  directory, seed, _ = checkpoint
  tokens, mask, stops = _inputs(seed)
  decode = DecodeSettings(max_new_tokens=12, sampling=SamplingConfig(temperature=1.0), stop_token_ids=stops)
  mesh = make_mesh(MeshConfig(1, 8, 1))
  # Per decode step, rows = 16 requests / 2 data groups: the gathered fp32 logits [rows, V], two
  # all-reduces of [rows, D] per layer plus the embedding lookup's, and the loop's scalars.
  rows, layers = 8, 2
  activations = rows * VOCAB * 4 + (2 * layers + 1) * rows * HIDDEN * 4
  per_step = {}
  for tensor in (4, None):  # None: today's training layout, which the bound must catch
    with jax.set_mesh(mesh):
      model = from_pretrained(directory, mesh=mesh)
      layout = rollout_layout(model, mesh, tensor) if tensor else None
      sampler = GroupSampler(model, group_size=2, settings=decode, layout=layout)
      hlo = sampler._run.lower(nnx.state(model), tokens, mask, jax.random.key(0)).compile().as_text()
    found = traffic.collectives(hlo, 8)
    per_step[tensor] = sum(traffic.totals(found, in_loop=True).values())
    if layout is not None:
      params = nnx.state(model)
      resident = resident_bytes_per_device(params, layout)
      reshard = traffic.totals(found, in_loop=False)
      moved = reshard['all-gather'] + reshard['all-to-all'] + reshard['permute']
      assert resident * 0.9 <= moved <= 2 * resident
  assert 0 < per_step[4] <= 1.25 * activations + 4096
  assert per_step[None] > 1.25 * activations + 4096  # weights gathered inside the loop


def test_traffic_counts_a_known_program():
  """A jitted loop on 8 devices that gathers an [8, 256] fp32 array in each of 3 scanned layers per
  iteration, plus one all-reduce outside: counted per iteration and outside by hand."""
  mesh = make_mesh(MeshConfig(1, 8, 1))
  x = jax.device_put(jnp.arange(8 * 256, dtype=jnp.float32).reshape(8, 256), NamedSharding(mesh, PartitionSpec('fsdp')))
  w = jax.device_put(jnp.ones((3, 256, 256)), NamedSharding(mesh, PartitionSpec()))

  def program(x, w):
    def body(carry):
      value, count = carry
      def layer(v, weight):
        gathered = jax.lax.with_sharding_constraint(v, NamedSharding(mesh, PartitionSpec()))
        return jax.lax.with_sharding_constraint(jnp.tanh(gathered @ weight), NamedSharding(mesh, PartitionSpec('fsdp'))), None
      value, _ = jax.lax.scan(layer, value, w)
      return value, count + 1
    with jax.named_scope('decode_loop'):
      value, _ = jax.lax.while_loop(lambda c: c[1] < jnp.int32(x[0, 0]) + 5, body, (x, jnp.int32(0)))
    return jnp.sum(value)

  with jax.set_mesh(mesh):
    hlo = jax.jit(program).lower(x, w).compile().as_text()
  found = traffic.collectives(hlo, 8)
  per_iteration = traffic.totals(found, in_loop=True)
  assert per_iteration['all-gather'] == 3 * 8 * 256 * 4
  gathers = [c for c in found if c.kind == 'all-gather']
  assert all(c.group_size == 8 and c.count == 3 and c.in_loop for c in gathers)
  assert traffic.totals(found, in_loop=False)['all-reduce'] > 0  # the final sum, once


def test_asynchronous_collectives_count_once():
  """XLA:GPU's asynchronous forms, as its optimized programs write them: the -start carries the
  bytes (an all-to-all-start's shape, and a newer all-reduce-start's or reduce-scatter-start's, holds
  operands and results), the -done none."""
  hlo = """HloModule m

ENTRY %main (p0: bf16[2,512,8,1,128], p1: f32[64,256]) -> bf16[2,512,8,1,128] {
  %p0 = bf16[2,512,8,1,128]{4,3,1,0,2} parameter(0)
  %p1 = f32[64,256]{1,0} parameter(1)
  %all-to-all-start.3 = ((bf16[2,512,8,1,128]{4,3,1,0,2}), bf16[2,512,8,1,128]{4,3,1,0,2}) all-to-all-start(%p0), channel_id=23, replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, dimensions={2}
  %all-to-all-done.3 = bf16[2,512,8,1,128]{4,3,1,0,2} all-to-all-done(%all-to-all-start.3)
  %all-gather-start.1 = (f32[64,256]{1,0}, f32[512,256]{1,0}) all-gather-start(%p1), channel_id=24, replica_groups=[1,8]<=[8], dimensions={0}
  %all-gather-done.1 = f32[512,256]{1,0} all-gather-done(%all-gather-start.1)
  %all-reduce-start.2 = ((f32[64,256]{1,0}), f32[64,256]{1,0}) all-reduce-start(%p1), channel_id=25, replica_groups=[2,4]<=[8], to_apply=%add, output_to_operand_aliasing={{1}: (0, {})}
  %all-reduce-done.2 = f32[64,256]{1,0} all-reduce-done(%all-reduce-start.2)
  %all-reduce-start.3 = bf16[8,128]{1,0} all-reduce-start(%p0), channel_id=26, replica_groups=[2,4]<=[8], to_apply=%add
  %all-reduce-done.3 = bf16[8,128]{1,0} all-reduce-done(%all-reduce-start.3)
  %reduce-scatter-start = ((f32[64,256]{1,0}, bf16[8,128]{1,0}), (f32[16,256]{1,0}, bf16[2,128]{1,0})) reduce-scatter-start(%p1, %p0), channel_id=27, replica_groups=[2,4]<=[8], dimensions={0}, to_apply=%add
  %reduce-scatter-done = (f32[16,256]{1,0}, bf16[2,128]{1,0}) reduce-scatter-done(%reduce-scatter-start)
  ROOT %copy = bf16[2,512,8,1,128]{4,3,1,0,2} copy(%all-to-all-done.3)
}
"""
  found = traffic.collectives(hlo, 8)
  # jax 0.12's XLA:GPU writes an all-reduce-start as ((operand), result), jax 0.10's as the result alone.
  # A reduce-scatter-start, as ((operands), (results)): its operands, as the synchronous form counts.
  assert traffic.totals(found, in_loop=False) == {'all-gather': 512 * 256 * 4, 'all-reduce': 64 * 256 * 4 + 8 * 128 * 2,
                                                  'reduce-scatter': 64 * 256 * 4 + 8 * 128 * 2,
                                                  'all-to-all': 2 * 512 * 8 * 128 * 2, 'permute': 0}
  assert [c.groups for c in found if c.kind == 'all-to-all'] == [((0, 1, 2, 3), (4, 5, 6, 7))]


def test_replica_group_spellings():
  assert traffic.parse_groups('replica_groups=[4,2]<=[8]', 8) == ((0, 1), (2, 3), (4, 5), (6, 7))
  assert traffic.parse_groups('replica_groups=[2,4]<=[4,2]T(1,0)', 8) == ((0, 2, 4, 6), (1, 3, 5, 7))
  assert traffic.parse_groups('replica_groups={{0,1},{2,3}}', 4) == ((0, 1), (2, 3))
  assert traffic.parse_groups("replica_groups=mesh['a'=4,'b'=2] {'b'}", 8) == ((0, 1), (2, 3), (4, 5), (6, 7))
  assert traffic.parse_groups("replica_groups=mesh['a'=4,'b'=2] {'a'}", 8) == ((0, 2, 4, 6), (1, 3, 5, 7))
  assert traffic.parse_groups('source_target_pairs={{0,1},{1,2}}', 4) == ((0, 1), (1, 2))
  assert traffic.parse_groups('source_target_pairs={}', 4) == ()


def test_a_permute_with_no_pairs_moves_nothing():
  """XLA:GPU writes `source_target_pairs={}` for a permute that has nothing to send (seen in the
  32B partial-rollout sampler): it is no collective, and the rest of the program is still read."""
  hlo = """HloModule m

ENTRY %main (p: f32[8,4]) -> f32[8,4] {
  %p = f32[8,4]{1,0} parameter(0)
  %collective-permute.1 = f32[8,4]{1,0} collective-permute(%p), channel_id=1, source_target_pairs={}
  ROOT %all-reduce.2 = f32[8,4]{1,0} all-reduce(%collective-permute.1), channel_id=2, replica_groups={{0,1}}, to_apply=%add
}
"""
  found = traffic.collectives(hlo, 2)
  assert [c.kind for c in found] == ['all-reduce'] and found[0].bytes == 8 * 4 * 4


@dataclasses.dataclass(frozen=True)
class FakeDevice:
  platform: str
  process_index: int


def test_default_tensor_size():
  gpus = [FakeDevice('gpu', host) for host in range(8) for _ in range(8)]  # 8 hosts of 8 GPUs
  assert choose_tensor(gpus, kv_heads=8) == 8  # Qwen2.5-32B: a host's NVLink group
  assert choose_tensor(gpus, kv_heads=4) == 4  # 7B
  assert choose_tensor(gpus, kv_heads=2) == 2  # 0.5B
  assert choose_tensor([FakeDevice('gpu', host) for host in range(2) for _ in range(4)], kv_heads=8) == 4
  assert choose_tensor([FakeDevice('tpu', chip // 4) for chip in range(64)], kv_heads=8) == 8  # across hosts on ICI
  assert choose_tensor([FakeDevice('tpu', 0)] * 6, kv_heads=8) == 2
  assert choose_tensor([FakeDevice('cpu', 0)] * 8, kv_heads=8) == 1


def test_tensor_that_does_not_divide_the_devices_is_one_line():
  with pytest.raises(UserError, match=r'rollout.tensor=3 must divide the 8 devices'):
    rollout_mesh(make_mesh(MeshConfig(1, 8, 1)), 3)


def test_interconnect_time_uses_the_slowest_link_a_group_spans():
  """Two H100 hosts of 2 GPUs: an all-reduce within a host runs on NVLink, one across hosts on the
  network; each moves 2 (g - 1) / g of its bytes, an all-gather (g - 1) / g."""
  from grpo_jax.plan import targets
  target = targets.parse_target('h100x2x2')
  devices = [FakeDevice('gpu', host) for host in (0, 0, 1, 1)]
  size = 1 << 30
  within = traffic.Collective('all-reduce', size, ((0, 1), (2, 3)), count=3, in_loop=True, where='')
  across = traffic.Collective('all-gather', size, ((0, 2), (1, 3)), count=1, in_loop=False, where='')

  def bandwidth(group):
    return target.group_bandwidth([devices[i] for i in group])

  assert traffic.seconds([within, across], True, bandwidth) == pytest.approx(3 * size * 2 * 0.5 / 450e9)
  assert traffic.seconds([within, across], False, bandwidth) == pytest.approx(size * 0.5 / 50e9)
  assert traffic.totals([within, across], True) == dict(traffic.totals([], True), **{'all-reduce': 3 * size})


def test_the_plan_tries_wider_sampler_tensor_axes_as_knobs():
  from grpo_jax import config as config_lib
  from grpo_jax.plan.advice import knobs
  from grpo_jax.model.presets import preset
  config = config_lib.load_config(None, ['model.remat=full', 'model.attention=chunked'])
  found = [knob.name for knob in knobs(config, preset('7B'), devices=8, sequence_length=24, current_rollout_tensor=2)]
  assert [name for name in found if name.startswith('rollout.tensor')] == ['rollout.tensor=4', 'rollout.tensor=8']
  why = {knob.name: knob.why for knob in knobs(config, preset('7B'), 8, 24, 2)}
  assert 'replicated' in why['rollout.tensor=8'] and 'replicated' not in why['rollout.tensor=4']  # 4 KV heads
  # A mesh laid out by host (the 32B recipe's trainer split over 4 hosts held its state whole on each
  # and did not fit): FSDP over every host is tried right after rematerialisation, and only there.
  hybrid = [knob.name for knob in knobs(config_lib.load_config(None, ['mesh.hybrid=auto']), preset('7B'), 32, 24,
                                        hybrid=True)]
  assert hybrid[:2] == ['model.remat=full', 'mesh.hybrid=false'] and 'mesh.hybrid=false' not in found
