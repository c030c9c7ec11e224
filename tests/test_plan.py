"""grpo_jax.plan: the 0.5B recipe's RL step compiled by XLA:TPU and XLA:GPU for slices that are
not attached, its per-device bytes against hand counts, and the knobs it names when a run does not
fit. The compilers run in subprocesses (test_deviceless.py says why and where they come from)."""

import json

import pytest

from grpo_jax.config import load_config
from grpo_jax.plan import targets
from test_deviceless import _run


# ---- the demo's RL step, compiled by one TPU's and one GPU's XLA (make test's plan) ----

@pytest.mark.starts_first
@pytest.mark.parametrize('platform, target, devices', [('tpu', 'v5e-4', 4), ('gpu', 'h100x1', 1)])
def test_plan_compiles_the_demo_for_a_tpu_and_a_gpu(platform, target, devices, tmp_path):
  """The default config's K-step jit (sample, score, update) compiled by XLA:TPU for 4 v5e chips
  and by XLA:GPU for one H100, neither attached: the per-device state is the compiled program's
  own, the donated state is updated in place, and a decode step is a count of the target's
  kernels. The 0.5B recipe's plans below check the figures against hand counts (test-all)."""
  report_path = tmp_path / 'plan.json'
  result = _run(platform, ['grpo_jax.plan', '--config', 'configs/tiny_arith.yaml', '--target', target,
                           '--no-advice', '--json', str(report_path)], timeout=600)
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
  report = json.loads(report_path.read_text())
  assert report['fits'] and 'fits' in result.stdout and report['devices'] == devices
  assert report['mesh'] == {'data': 1, 'fsdp': devices, 'tensor': 1, 'expert': 1, 'context': 1}
  (program,) = report['programs']
  assert program['name'] == '10 RL steps in one jit'  # train.steps_per_call: 10
  # fp32 parameters split over FSDP, apart from the tensors no mesh axis divides (the 17-token
  # embedding, the norms); Adam's two moments laid out as the parameters.
  total = report['model']['parameters'] * 4
  per_device = report['per_device']
  assert total / devices <= per_device['parameters'] <= total
  assert 2 * per_device['parameters'] <= per_device['optimizer_state'] <= 2 * per_device['parameters'] + 64
  assert program['aliased'] >= per_device['parameters'] + per_device['optimizer_state']  # donated state
  assert 0 < program['temporaries'] and 0 < report['peak'] <= report['hbm']
  assert program['decode_step']['kernels'] > 0
  # Collectives only where there is more than one device, and inside a decode step only activations.
  moved = sum(program['collectives']['outside'].values())
  assert (moved > 0) == (devices > 1), program['collectives']


# ---- the 0.5B recipe's RL step, compiled by the target's XLA ----

# The layers are one scanned block: two compile as the 24 do, in half the time (the TPU compile of
# the 24 layers took 167 s of the suite).
LAYERS = 2


# The knob the plan names first for the recipe on 8 H100s of 1.4 GiB (test_plan_names_the_knob_...),
# and the H100 case below plans the run again with it on those devices: it fits.
KNOB = 'algo.micro_batch_size=16'
SMALLER_H100 = ['--device-memory', '1.4GiB', '--set', KNOB]


# The sampler's resident weights 8-bit (rollout.weights): int8 on the TPU, fp8 on the H100; and
# model.attention: auto, which is cuDNN's fused attention on the H100 and the chunked path on the TPU.
AUTO = ['--set', 'model.attention=auto']


@pytest.mark.exhaustive
@pytest.mark.starts_first
@pytest.mark.parametrize('platform, target, extra', [('tpu', 'v5e-8', ['--set', 'rollout.weights=int8'] + AUTO),
                                                     ('gpu', 'h100x8', SMALLER_H100 + ['--set', 'rollout.weights=fp8'] + AUTO)],
                         ids=['tpu-v5e-8-int8', 'gpu-h100x8-of-1.4GiB-fp8'])
@pytest.mark.long
def test_plan_compiles_the_small_recipe_for_the_target(platform, target, extra, tmp_path):
  report_path = tmp_path / 'plan.json'
  result = _run(platform, ['grpo_jax.plan', '--config', 'configs/qwen2_5_0_5b_math.yaml', '--model-size', '0.5B',
                           '--layers', str(LAYERS), '--target', target, '--json', str(report_path), *extra],
                timeout=900)
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
  report = json.loads(report_path.read_text())
  assert 'fits' in result.stdout and report['fits'] and report['devices'] == 8 and 'advice' not in report
  assert report['mesh'] == {'data': 1, 'fsdp': 8, 'tensor': 1, 'expert': 1, 'context': 1}
  assert [program['name'] for program in report['programs']] == ['rollout', 'update']
  # FSDP: each device holds an eighth of the fp32 parameters and of each AdamW moment (plus the
  # few tensors too small to split: biases and norms of width D / 8 or less).
  total = report['model']['parameters'] * 4
  per_device = report['per_device']
  assert total / 8 <= per_device['parameters'] <= total / 8 * 1.01
  assert 2 * total / 8 <= per_device['optimizer_state'] <= 2 * total / 8 * 1.01
  # K and V of the layers x 2 heads x 64, bf16, rows split 8 ways: the shared prompt cache (32
  # prompts x 512 tokens) and the 256 slots' own rows (1,024 tokens each).
  assert per_device['kv_cache'] == 2 * LAYERS * (32 * 512 + 256 * 1024) * 2 * 64 * 2 // 8
  update = report['programs'][1]
  fused_attention = sum(count for name, count in update['library_calls'].items() if name.startswith('__cudnn$fmha'))
  assert (fused_attention > 0) == (platform == 'gpu'), update['library_calls']
  assert update['arguments'] >= per_device['parameters'] + per_device['optimizer_state']
  assert update['aliased'] >= per_device['parameters'] + per_device['optimizer_state']  # donated state
  assert 0 < update['temporaries'] and report['peak'] <= report['hbm']
  # The sampler's own layout: 2 KV heads -> weights split over pairs, 4 data groups of rows.
  assert report['rollout_layout'] == {'tensor': 2, 'data_groups': 4, 'experts_per_device': None}
  # Half of the weights per device, at one byte each (the projections, the tied embedding) with a
  # scale per output channel; the norms and biases in bf16.
  weights = report['model']['parameters'] / 2
  assert weights <= per_device['resident_weights'] <= weights * 1.02
  rollout = report['programs'][0]
  # Inside the decode loop only activations move. Per decode step, 256 requests / 4 groups = 64
  # rows: at most the fp32 logits [64, V] gathered over the pair and an all-reduce of [64, D] per
  # attention and MLP block of the layers (plus the embedding's), at 4 bytes; at least those
  # all-reduces at 2 bytes (bf16): the weights are split, not replicated. The training layout
  # moved the whole bf16 model, 0.99 GB, every step.
  rows, vocab, width, layers = 64, 151936, 896, LAYERS
  per_step = sum(rollout['collectives']['per_decode_step'].values())
  assert 2 * layers * rows * width * 2 <= per_step <= 1.25 * rows * (vocab + (2 * layers + 1) * width) * 4
  # Once per rollout, each device receives its resident weights (at most twice them: the reshard).
  outside = rollout['collectives']['outside']
  assert 0.9 * per_device['resident_weights'] <= outside['all-gather'] + outside['all-to-all'] <= 2 * per_device['resident_weights']
  # One decode step's kernels, as the target compiler launches them (a tripwire: kernels per step
  # grew by a quarter when this fails; 96 on XLA:GPU, 878 on XLA:TPU when written, 314 since the
  # cache's segment ids are written as one select there, not a loop over the rows). On GPUs the
  # layers are unrolled, each matmul reads its layer's weights in place and the dense decode
  # attention each layer's own cache array (KVCache.layered): copies write under a tenth of the
  # slots' KV cache per step (64 rows x 1,024 slots x 1 KV head per device), never the weights
  # (with the layers as a scan, XLA:GPU copies each layer's weights out of the stack every step:
  # 44.8 MiB here; with a stacked cache, each layer's rows: 16.9 MiB).
  step = rollout['decode_step']
  assert 0 < step['kernels'] <= {'gpu': 120, 'tpu': 400}[platform]
  if platform == 'gpu':
    slot_cache = 2 * layers * rows * 1024 * 1 * 64 * 2
    assert step['copied'] <= 0.1 * slot_cache, step
  estimate = report['estimate']['programs']['rollout']
  assert estimate['program_s'] == max(estimate['compute_s'], estimate['hbm_s'], estimate['interconnect_s']) > 0
  assert 'WARNING' not in result.stdout and 'E0000' not in result.stdout  # compiler logs kept out of the report


@pytest.mark.exhaustive
@pytest.mark.starts_first
@pytest.mark.long
def test_plan_names_the_knob_that_brings_a_run_under_the_device_memory(tmp_path):
  """The 0.5B recipe's shapes at 2 layers on 8 H100s told they have 1.4 GiB each (the update needs
  1.65): the plan says it does not fit, compiles the knobs, and names first the one that the H100
  case of test_plan_compiles_the_small_recipe_for_the_target plans again (and finds fitting)."""
  report_path = tmp_path / 'plan.json'
  result = _run('gpu', ['grpo_jax.plan', '--config', 'configs/qwen2_5_0_5b_math.yaml', '--model-size', '0.5B',
                        '--layers', str(LAYERS), '--target', 'h100x8', *SMALLER_H100[:2], '--json', str(report_path)],
                timeout=900)
  assert report_path.exists(), result.stdout[-2000:] + result.stderr[-3000:]
  report = json.loads(report_path.read_text())
  assert result.returncode == 1 and 'DOES NOT FIT' in result.stdout
  assert report['hbm'] == int(1.4 * 2**30) and not report['fits']
  update = {program['name']: program['peak'] for program in report['programs']}['update']
  assert update > report['hbm']
  fitting = [row for row in report['advice'] if row['fits']]
  assert fitting and fitting[0]['knob'] == KNOB and f'brings it under: {KNOB}' in result.stdout
  assert all(max(row['peaks'].values()) <= report['hbm'] for row in fitting)
  assert fitting[0]['peaks']['update'] < update  # half the micro-batch, fewer activations


def test_compiler_log_lines_are_summarised_by_kind():
  from grpo_jax.plan import targets
  lines = ['WARNING: All log messages before absl::InitializeLog() is called are written to STDERR',
           'I0000 00:00:17.1 cudart_stub.cc:31] Could not find cuda drivers on your machine',
           'W1125 04:14:25.3 spmd_partitioner.cc:656] [SPMD] Involuntary full rematerialization. The compiler ...',
           "W1125 04:14:26.1 hlo_rematerialization.cc:3000] Can't reduce memory use below 1.5GiB by rematerialization",
           "W1125 04:14:27.0 hlo_rematerialization.cc:3000] Can't reduce memory use below 1.6GiB by rematerialization",
           'E1125 04:14:28.0 gpu_hlo_schedule.cc:1] ... This indicates an error in the calculation!',
           'W1125 04:14:29.0 other.cc:1] something else']
  assert targets.summarise_compiler_log(lines) == [
      "XLA's partitioner replicated a tensor to reshard it (1 log line)",
      'XLA rematerialised values to bring the program under its memory limit (2 log lines)',
      "XLA:GPU's scheduler and its memory accounting disagreed (a compiler diagnostic; the figures above are the "
      "compiled program's) (1 log line)",
      'other compiler warnings (in --json under compiler_log) (1 log line)']


def test_layout_advice_compiles_the_update_with_hybrid_sharding_on_gpu_hosts_only():
  """The plan's layout advice, its compiles stood in for: on GPUs of several hosts with the default
  mesh it compiles the update alone with mesh.hybrid=true and puts that update's estimate beside
  the planned rollout; it stays out of TPUs, one host, hybrid meshes and hand-set sizes."""
  from grpo_jax import config as config_lib
  from grpo_jax.plan import advice

  def report(update_s, update_peak, step_s):
    return dict(hbm=80 << 30, programs=[dict(name='rollout', peak=50 << 30), dict(name='update', peak=update_peak)],
                estimate=dict(step_s=step_s, programs=dict(update=dict(program_s=update_s, bound='compute'))))

  asked = []

  def compile_plan(config, only):
    asked.append((config.mesh.hybrid, only))
    return report(52.0, 70 << 30, 0.0)

  def load(extra, base=()):
    return config_lib.load_config('configs/tiny_arith.yaml', [*base, *extra])

  planned = report(60.0, 20 << 30, 150.0)
  row = advice.layout_advice(load, compile_plan, planned, targets.parse_target('h100x8x8'))
  assert asked == [(True, {'update'})]
  assert row['step_s'] == 142.0 and row['faster'] and row['fits'] and row['peak'] == 70 << 30
  assert 'step >= 142.00 s (now 150.00 s)' in advice.format_layout_advice(row)
  row = advice.layout_advice(load, lambda config, only: report(52.0, 90 << 30, 0.0), planned,
                             targets.parse_target('h100x8x8'))
  assert not row['fits'] and not row['faster']
  for target, base in (('v5p-128', ()), ('h100x8', ()), ('h100x8x8', ('mesh.hybrid=auto',)),
                       ('h100x8x8', ('mesh.data=2',))):
    assert advice.layout_advice(lambda extra: load(extra, base), compile_plan, planned,
                                targets.parse_target(target)) is None
  assert len(asked) == 1


def test_each_mesh_axis_is_attributed_to_the_link_its_groups_use():
  """2 H100 hosts of 4 GPUs, mesh data=2 x fsdp=2 x tensor=2 in make_mesh's order (host-major): a
  data group is {i, i + 4}, across the hosts; an fsdp group {i, i + 2} and a tensor group {i, i + 1}
  stay within one. A 4 MiB fp32 all-reduce over each axis, compiled by XLA:GPU and read back as the
  plan reads its programs, is 4 MiB per device on the network for data and on NVLink for the others;
  the hybrid layout puts data over the 2 hosts and fsdp over each one's 4 GPUs."""
  def links(mesh):
    result = _run('gpu', ['grpo_jax.plan.targets', 'links', 'h100x2x4', '--mesh', mesh], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return {line['axis']: (line['size'], line['links']) for line in map(json.loads, result.stdout.splitlines())}

  assert links('data=2,fsdp=2,tensor=2') == {'data': (2, {'network': 4 << 20}), 'fsdp': (2, {'nvlink': 4 << 20}),
                                             'tensor': (2, {'nvlink': 4 << 20})}
  # mesh.hybrid: data over the hosts, fsdp within each (auto: on, for GPUs on more than one host).
  assert links('hybrid=auto') == {'data': (2, {'network': 4 << 20}), 'fsdp': (4, {'nvlink': 4 << 20})}


@pytest.mark.exhaustive
@pytest.mark.starts_first
@pytest.mark.long
def test_plan_of_split_devices_and_of_partial_rollouts(tmp_path):
  """rollout.devices: the sampler's program on its own 4 devices, the weights' layout program and
  the update on the trainer's 4; the bytes crossing per step are the sampler's resident weights and
  the step's prompts to each sampler device, the groups made ready back, over NVLink; the
  overlapped step is the pipeline's period. Partial rollouts on shared devices move no more per
  decode step than activations (the slots pinned by rows: no all-to-all of the prompt caches)."""
  lagged = ['--set', 'algo.max_lag=1', '--set', 'algo.tis_cap=2', '--set', 'algo.dynamic_sampling=false']
  reports = {}
  for name, extra in (('split', ['--set', 'rollout.devices=4']), ('shared', [])):
    path = tmp_path / f'{name}.json'
    result = _run('gpu', ['grpo_jax.plan', '--config', 'configs/tiny_math.yaml', '--target', 'h100x8', '--no-advice',
                          '--json', str(path), *lagged, *extra], timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    reports[name] = json.loads(path.read_text())
  split = reports['split']
  assert [program['name'] for program in split['programs']] == ['rollout', 'transfer', 'update']
  assert split['program_devices'] == {'rollout': 4, 'transfer': 4, 'update': 4}
  assert split['mesh'] == {'data': 1, 'fsdp': 4, 'tensor': 1, 'expert': 1, 'context': 1}
  crossing = split['split']
  assert crossing['sampler_devices'] == crossing['trainer_devices'] == 4
  assert crossing['transfer_bytes_per_device'] == split['per_device']['resident_weights'] > 0
  assert crossing['transfer_bytes'] == 4 * crossing['transfer_bytes_per_device']
  # tiny_math: P prompts of Tp tokens (int32 tokens and mask; a host task's answers stay on the
  # host), P x G completions of N tokens each (at least int32 tokens and versions, fp32 log-probs).
  config = load_config('configs/tiny_math.yaml', ['algo.max_lag=1', 'algo.tis_cap=2', 'algo.dynamic_sampling=false'])
  prompts, completions = config.rollout.prompts_per_step, config.completions_per_step
  assert crossing['prompts_bytes'] % (prompts * 8) == 0 and crossing['prompts_bytes'] >= prompts * 8 * 4
  assert crossing['groups_bytes'] >= completions * config.rollout.max_new_tokens * 12
  assert crossing['bytes_per_device'] == (crossing['transfer_bytes_per_device'] + crossing['prompts_bytes']
                                          + -(-crossing['groups_bytes'] // 4))
  assert crossing['link'] == 'nvlink'
  estimate = split['estimate']
  rollout, update = (estimate['programs'][name]['program_s'] for name in ('rollout', 'update'))
  assert estimate['serial_s'] == pytest.approx(rollout + update + estimate['crossing_s'])
  assert estimate['step_s'] == pytest.approx(max(rollout, update, estimate['serial_s'] / 2))
  for name, report in reports.items():
    per_step = report['programs'][0]['collectives']['per_decode_step']
    assert per_step.get('all-to-all', 0) == 0 and per_step.get('all-reduce', 0) > 0, (name, per_step)


@pytest.mark.exhaustive
@pytest.mark.starts_first
@pytest.mark.long
def test_the_32b_recipe_fits_8_hosts_and_its_decode_loop_moves_under_a_quarter_gib_per_step(tmp_path):
  """The Qwen2.5-32B recipe on 8 hosts of 8 H100s at full depth (only there did the figure grow:
  at full depth under hybrid sharding XLA:GPU rematerialised the decode loop's all-gathers to meet
  its memory, 0.27 GiB per step with a slot per answer): it fits, and the compiled rollout's decode
  loop moves under 0.25 GiB of collectives per GPU per step (0.097 at its 512 slots)."""
  path = tmp_path / 'plan.json'
  result = _run('gpu', ['grpo_jax.plan', '--config', 'configs/qwen2_5_32b_dapo_aime.yaml', '--model-size', '32B',
                        '--target', 'h100x8x8', '--no-advice', '--json', str(path)], timeout=1800)
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
  report = json.loads(path.read_text())
  assert report['fits'], report['peak']
  rollout = next(program for program in report['programs'] if program['name'] == 'rollout')
  per_step = sum(rollout['collectives']['per_decode_step'].values())
  assert 0 < per_step < 0.25 * 2 ** 30, rollout['collectives']
