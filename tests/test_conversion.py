"""HF safetensors <-> orbax conversion: bit-exact round trips, restores onto a mesh, clear errors."""

import json
import os
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import pytest
import torch

from conftest import torch_logits
from grpo_jax.errors import UserError
from grpo_jax.model import MeshConfig, from_pretrained, make_mesh
from grpo_jax.model.weights import HFCheckpoint, SafetensorsFile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(module, *args):
  """Runs `python -m module args` from the repo root; returns (exit code, stdout, stderr)."""
  result = subprocess.run([sys.executable, '-m', module, *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
  return result.returncode, result.stdout, result.stderr


def convert_both_ways(hf_dir, tmp_path, *extra):
  orbax_dir, back_dir = tmp_path / 'orbax', tmp_path / 'back'
  code, _, stderr = run_cli('conversion.hf_to_orbax', '--hf', hf_dir, '--out', orbax_dir, *extra)
  assert code == 0, stderr
  code, _, stderr = run_cli('conversion.orbax_to_hf', '--ckpt', orbax_dir, '--out', back_dir,
                            '--like', hf_dir, '--max-shard-gb', 0.0002)
  assert code == 0, stderr
  return str(orbax_dir), str(back_dir)


@pytest.mark.parametrize('tied, model_type', [(True, 'qwen2'), *(pytest.param(*case, marks=pytest.mark.exhaustive)
                                                                  for case in [(False, 'qwen2'), (True, 'qwen3')])])
def test_round_trip_is_bit_exact_and_loads_in_transformers(tied, model_type, seed, make_hf_checkpoint, tmp_path):
  from transformers import AutoModelForCausalLM

  hf_dir, reference = make_hf_checkpoint(seed, shard_size='200KB', tie_word_embeddings=tied, model_type=model_type)
  assert os.path.isfile(os.path.join(hf_dir, 'model.safetensors.index.json'))
  orbax_dir, back_dir = convert_both_ways(hf_dir, tmp_path)

  original, restored = HFCheckpoint(hf_dir), HFCheckpoint(back_dir)
  assert sorted(restored.names()) == sorted(original.names())
  for name in original.names():
    assert np.array_equal(restored.tensor(name), original.tensor(name)), name
  assert os.path.isfile(os.path.join(back_dir, 'model.safetensors.index.json'))  # split by --max-shard-gb

  reloaded = AutoModelForCausalLM.from_pretrained(back_dir).eval()
  assert type(reloaded) is type(reference)  # written back as the same family member
  tokens = np.random.default_rng(seed).integers(0, 1000, (2, 64))
  np.testing.assert_array_equal(torch_logits(reloaded, tokens), torch_logits(reference, tokens))
  # The orbax checkpoint itself loads through the public API with the same logits.
  np.testing.assert_allclose(np.asarray(from_pretrained(orbax_dir)(tokens.astype(np.int32))),
                             torch_logits(reference, tokens), rtol=0, atol=1e-4)


@pytest.mark.exhaustive
def test_orbax_restores_straight_onto_a_mesh(seed, make_hf_checkpoint, tmp_path):
  hf_dir, reference = make_hf_checkpoint(seed, num_attention_heads=8, num_key_value_heads=4)
  orbax_dir = tmp_path / 'orbax'
  assert run_cli('conversion.hf_to_orbax', '--hf', hf_dir, '--out', orbax_dir)[0] == 0
  mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
  model = from_pretrained(str(orbax_dir), mesh=mesh)
  sharding = model.layers.q_weight[...].sharding
  assert sharding.mesh.shape == mesh.shape
  assert tuple(sharding.spec) == (None, 'fsdp', 'tensor')
  tokens = np.random.default_rng(seed).integers(0, 1000, (4, 32), dtype=np.int32)
  with jax.set_mesh(mesh):
    logits = jax.jit(lambda t: model(t))(tokens)
  np.testing.assert_allclose(np.asarray(logits), torch_logits(reference, tokens), rtol=0, atol=1e-4)


@pytest.mark.exhaustive
def test_bfloat16_conversion_stores_rounded_weights(seed, make_hf_checkpoint, tmp_path):
  hf_dir, reference = make_hf_checkpoint(seed)
  orbax_dir, back_dir = convert_both_ways(hf_dir, tmp_path, '--dtype', 'bfloat16')
  with open(os.path.join(orbax_dir, 'config.json')) as f:
    assert json.load(f)['dtype'] == 'bfloat16'
  back = HFCheckpoint(back_dir)
  name = 'model.layers.1.mlp.down_proj.weight'
  expected = reference.state_dict()[name].numpy().astype(ml_dtypes.bfloat16)
  assert back.tensor(name).dtype == ml_dtypes.bfloat16
  assert np.array_equal(back.tensor(name), expected)


# ---- error cases: one line on stderr, exit status 2, nothing written ----

def _rewrite_single_file(hf_dir, change):
  """Loads model.safetensors, applies change(dict) and writes it back."""
  from safetensors.torch import load_file, save_file
  path = os.path.join(hf_dir, 'model.safetensors')
  tensors = load_file(path)
  change(tensors)
  save_file(tensors, path, metadata={'format': 'pt'})


def _assert_one_line_error(code, stderr, *fragments):
  assert code == 2, stderr
  lines = stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith('error: '), stderr
  for fragment in fragments:
    assert fragment in lines[0], lines[0]


def test_missing_tensor(seed, make_hf_checkpoint, tmp_path):
  hf_dir, _ = make_hf_checkpoint(seed)
  _rewrite_single_file(hf_dir, lambda t: t.pop('model.layers.1.self_attn.k_proj.bias'))
  code, _, stderr = run_cli('conversion.hf_to_orbax', '--hf', hf_dir, '--out', tmp_path / 'out')
  _assert_one_line_error(code, stderr, 'missing tensor model.layers.1.self_attn.k_proj.bias')
  assert not (tmp_path / 'out').exists() and not (tmp_path / 'out.partial').exists()


def test_shape_mismatch_names_tensor_expected_and_found(seed, make_hf_checkpoint, tmp_path):
  hf_dir, _ = make_hf_checkpoint(seed)

  def shrink(tensors):
    tensors['model.layers.0.mlp.up_proj.weight'] = torch.zeros(170, 64) + 0.5
  _rewrite_single_file(hf_dir, shrink)
  code, _, stderr = run_cli('conversion.hf_to_orbax', '--hf', hf_dir, '--out', tmp_path / 'out')
  _assert_one_line_error(code, stderr, 'model.layers.0.mlp.up_proj.weight', '[170, 64]', 'expected [176, 64]')


def test_unexpected_tensor(seed, make_hf_checkpoint, tmp_path):
  hf_dir, _ = make_hf_checkpoint(seed)
  _rewrite_single_file(hf_dir, lambda t: t.update({'model.layers.0.extra.weight': torch.ones(3)}))
  code, _, stderr = run_cli('conversion.hf_to_orbax', '--hf', hf_dir, '--out', tmp_path / 'out')
  _assert_one_line_error(code, stderr, 'unexpected tensor model.layers.0.extra.weight')


def test_unsupported_architecture(seed, make_hf_checkpoint, tmp_path):
  hf_dir, _ = make_hf_checkpoint(seed)
  path = os.path.join(hf_dir, 'config.json')
  with open(path) as f:
    config = json.load(f)
  config.update(architectures=['Gemma2ForCausalLM'], model_type='gemma2')
  with open(path, 'w') as f:
    json.dump(config, f)
  code, _, stderr = run_cli('conversion.hf_to_orbax', '--hf', hf_dir, '--out', tmp_path / 'out')
  _assert_one_line_error(code, stderr, 'unsupported architecture Gemma2ForCausalLM')


@pytest.mark.parametrize('damage', ['no-config', 'no-weights', 'missing-shard', 'truncated', 'garbage'])
def test_missing_or_corrupt_files(damage, seed, make_hf_checkpoint, tmp_path):
  sharded = damage == 'missing-shard'
  hf_dir, _ = make_hf_checkpoint(seed, shard_size='200KB' if sharded else None)
  weights_path = os.path.join(hf_dir, 'model.safetensors')
  if damage == 'no-config':
    os.remove(os.path.join(hf_dir, 'config.json'))
    expected = 'config.json not found'
  elif damage == 'no-weights':
    os.remove(weights_path)
    expected = 'has neither model.safetensors.index.json nor model.safetensors'
  elif damage == 'missing-shard':
    shard = sorted(f for f in os.listdir(hf_dir) if f.startswith('model-'))[-1]
    os.remove(os.path.join(hf_dir, shard))
    expected = f'{shard} not found'
  elif damage == 'truncated':
    with open(weights_path, 'r+b') as f:
      f.truncate(os.path.getsize(weights_path) // 2)
    expected = 'is truncated'
  else:
    with open(weights_path, 'wb') as f:
      f.write(os.urandom(4096))
    expected = 'is not a readable safetensors file'
  code, _, stderr = run_cli('conversion.hf_to_orbax', '--hf', hf_dir, '--out', tmp_path / 'out')
  _assert_one_line_error(code, stderr, expected)


@pytest.mark.exhaustive
def test_corrupt_orbax_checkpoint_and_existing_output(seed, make_hf_checkpoint, tmp_path):
  hf_dir, _ = make_hf_checkpoint(seed)
  orbax_dir = tmp_path / 'orbax'
  assert run_cli('conversion.hf_to_orbax', '--hf', hf_dir, '--out', orbax_dir)[0] == 0
  # Converting again onto a non-empty --out refuses rather than overwriting.
  code, _, stderr = run_cli('conversion.hf_to_orbax', '--hf', hf_dir, '--out', orbax_dir)
  _assert_one_line_error(code, stderr, 'already exists', '--force')
  # A checkpoint whose config disagrees with its tensors names the tensor.
  path = orbax_dir / 'config.json'
  config = json.loads(path.read_text())
  config['intermediate_size'] = 200
  path.write_text(json.dumps(config))
  code, _, stderr = run_cli('conversion.orbax_to_hf', '--ckpt', orbax_dir, '--out', tmp_path / 'back')
  _assert_one_line_error(code, stderr, "tensor layers.down_weight", '[2, 176, 64]', 'expected [2, 200, 64]')
  code, _, stderr = run_cli('conversion.orbax_to_hf', '--ckpt', hf_dir, '--out', tmp_path / 'back')
  _assert_one_line_error(code, stderr, 'is not a grpo_jax checkpoint')


def test_safetensors_reader_reads_bfloat16(tmp_path):
  from safetensors.torch import load_file, save_file
  values = torch.randn(5, 7).to(torch.bfloat16)
  save_file({'x': values, 'y': torch.randn(3)}, str(tmp_path / 'a.safetensors'))
  reader = SafetensorsFile(str(tmp_path / 'a.safetensors'))
  x = reader.tensor('x')
  assert x.dtype == ml_dtypes.bfloat16 and x.shape == (5, 7)
  np.testing.assert_array_equal(x.astype(np.float32), values.float().numpy())
  np.testing.assert_array_equal(reader.tensor('y'), load_file(str(tmp_path / 'a.safetensors'))['y'].numpy())


def _write_raw_safetensors(path, header: dict, data: bytes) -> None:
  text = json.dumps(header).encode()
  with open(path, 'wb') as f:
    f.write(len(text).to_bytes(8, 'little') + text + data)


@pytest.mark.parametrize('damage, message', [
    # The case: a [64] fp32 tensor given 8 bytes that overlap another tensor's.
    (lambda h: h['x'].update(data_offsets=[256, 264]), 'data_offsets [256, 264] spanning 8 bytes, but F32 [64] needs 256'),
    (lambda h: h['y'].pop('data_offsets'), 'tensor y has an entry without dtype, shape and data_offsets'),
    (lambda h: h['y'].update(dtype='F31'), "tensor y has unknown dtype 'F31'"),
    (lambda h: h['y'].update(shape=[8, -1]), 'tensor y has shape [8, -1]'),
    (lambda h: h['y'].update(data_offsets=[200, 232]), 'tensor y overlaps the tensor before it'),
    (lambda h: h['y'].update(data_offsets=[288, 320]), 'tensor y leaves a gap of 32 bytes'),
    (lambda h: h.update(z={'dtype': 'F32', 'shape': [4], 'data_offsets': [288, 304]}), 'is truncated'),
])
def test_corrupt_safetensors_headers_are_refused_like_the_reference_reader(tmp_path, seed, damage, message):
  """Headers the `safetensors` library refuses are refused here too, naming file and tensor, instead
  of converting into wrong weights; the undamaged file reads back exactly."""
  from safetensors import SafetensorError
  from safetensors.numpy import load_file
  rng = np.random.default_rng(seed)
  x, y = rng.standard_normal(64).astype(np.float32), rng.standard_normal(8).astype(np.float32)
  header = {'x': {'dtype': 'F32', 'shape': [64], 'data_offsets': [0, 256]},
            'y': {'dtype': 'F32', 'shape': [8], 'data_offsets': [256, 288]}}
  good = tmp_path / 'good.safetensors'
  _write_raw_safetensors(good, header, x.tobytes() + y.tobytes())
  reader = SafetensorsFile(str(good))
  np.testing.assert_array_equal(reader.tensor('x'), x)
  np.testing.assert_array_equal(reader.tensor('y'), y)
  damage(header)
  bad = tmp_path / 'bad.safetensors'
  _write_raw_safetensors(bad, header, x.tobytes() + y.tobytes())
  with pytest.raises(SafetensorError):  # the reference reader refuses it as well
    load_file(str(bad))
  with pytest.raises(UserError) as error:
    SafetensorsFile(str(bad))
  assert message in str(error.value) and str(bad) in str(error.value)


@pytest.mark.exhaustive
@pytest.mark.starts_first
def test_a_training_runs_policy_exports_to_transformers(seed, tmp_path):
  """orbax_to_hf on a training workdir: the policy the run trained (its parameters after the last
  step, as the run held them) loads in transformers with the same logits; --step picks an earlier
  checkpoint, which differs; a path that is no checkpoint at all is one clear error."""
  from flax import nnx
  from transformers import AutoModelForCausalLM

  from grpo_jax import config as config_lib
  from grpo_jax import train
  from grpo_jax.build import build_task

  config = config_lib.load_config(os.path.join(ROOT, 'configs', 'tiny_arith.yaml'), [
      'rollout.prompts_per_step=8', 'algo.group_size=4', 'train.steps_per_call=1', 'train.progress=false',
      'train.tensorboard=false',
      'optim.warmup_steps=0', 'optim.learning_rate=0.01', 'algo.entropy_coef=0.01', f'run.seed={seed}'])
  mesh = make_mesh(MeshConfig(), jax.devices()[:1])
  model = config.model.build(mesh, config.run.seed)
  run = train.Run(config, str(tmp_path / 'run'), mesh, model, build_task(config))
  try:
    for _ in range(2):
      run.fused_steps(1)
      run.save()
    trained = nnx.merge(run.rl_step.graphdef, jax.device_get(run.state.params))
  finally:
    run.close()

  code, _, stderr = run_cli('conversion.orbax_to_hf', '--ckpt', tmp_path / 'run', '--out', tmp_path / 'hf')
  assert code == 0, stderr
  assert 'at step 2' in stderr
  tokens = np.random.default_rng(seed).integers(0, config.model.architecture.vocab_size, (2, 12))
  exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / 'hf')).eval()
  np.testing.assert_allclose(torch_logits(exported, tokens), np.asarray(trained(tokens.astype(np.int32))),
                             rtol=1e-5, atol=1e-5)

  code, _, stderr = run_cli('conversion.orbax_to_hf', '--ckpt', tmp_path / 'run' / 'checkpoints', '--step', 1,
                            '--out', tmp_path / 'hf1')
  assert code == 0 and 'at step 1' in stderr, stderr
  earlier = AutoModelForCausalLM.from_pretrained(str(tmp_path / 'hf1')).eval()
  assert np.abs(torch_logits(earlier, tokens) - torch_logits(exported, tokens)).max() > 1e-4
  code, _, stderr = run_cli('conversion.orbax_to_hf', '--ckpt', tmp_path / 'run', '--step', 7, '--out', tmp_path / 'x')
  assert code == 2 and stderr.startswith('error:') and 'step 7' in stderr and 'Traceback' not in stderr, stderr
  code, _, stderr = run_cli('conversion.orbax_to_hf', '--ckpt', tmp_path, '--out', tmp_path / 'y')
  assert code == 2 and 'nor a training run' in stderr and 'Traceback' not in stderr, stderr
