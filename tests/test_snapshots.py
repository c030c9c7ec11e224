"""Hugging Face snapshots while training (grpo_jax/snapshots.py, train.export_hf_every): each
loads in transformers with the logits of the policy at its step; only whole snapshots carry the
final name; a failed write is one line and the run goes on; the oldest beyond
train.export_hf_max_to_keep go. A LoRA run's snapshots are PEFT adapters (peft loads them on the
base) or merged weights."""

import json
import os

import jax
import numpy as np
import pytest

from conftest import torch_logits
from grpo_jax.model import MeshConfig, make_mesh

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(tmp_path, *overrides, config_file='configs/tiny_arith.yaml'):
  from grpo_jax import config as config_lib
  from grpo_jax import train
  from grpo_jax.build import build_task

  config = config_lib.load_config(os.path.join(ROOT, config_file), [
      'rollout.prompts_per_step=8', 'algo.group_size=4', 'train.steps_per_call=1', 'train.progress=false',
      'train.tensorboard=false', 'optim.warmup_steps=0', 'optim.learning_rate=0.01', *overrides])
  mesh = make_mesh(MeshConfig(), jax.devices()[:1])
  model = config.model.build(mesh, config.run.seed)
  return config, train.Run(config, str(tmp_path / 'run'), mesh, model, build_task(config))


def _live_logits(run, tokens):  # the policy the run holds now
  from flax import nnx
  policy = nnx.merge(run.rl_step.graphdef, jax.device_get(run.state.policy))
  return np.asarray(policy(tokens.astype(np.int32)))


def test_snapshots_load_in_transformers_with_the_policys_logits(seed, tmp_path, monkeypatch, capsys):
  """The arith demo for 40 steps, a snapshot every 10 (keep 2), the write of step 20's failing
  midway: one line, and the run goes on. step_30 and step_40 remain, each with the logits of the
  checkpoint of its step (which differ) and a generation_config.json of the run's stop tokens and
  sampling; a stale .partial of a killed run is gone, and no other is left."""
  from flax import nnx
  from transformers import AutoModelForCausalLM, GenerationConfig

  from grpo_jax.build import build_task
  from grpo_jax import config as config_lib
  from grpo_jax.model import loading
  from grpo_jax.restore import restore_policy
  from runs import train_here

  workdir = tmp_path / 'run'
  os.makedirs(workdir / 'hf' / 'step_9.partial')
  writes, write = [], loading.save_hf_params

  def fail_the_second(state, config, directory, dtype, **kwargs):
    writes.append(directory)
    write(state, config, directory, dtype, **kwargs)
    if len(writes) == 2:
      raise OSError(28, 'No space left on device')
  monkeypatch.setattr(loading, 'save_hf_params', fail_the_second)
  overrides = ['train.steps=40', 'train.checkpoint_every=10', 'train.export_hf_every=10',
               'train.export_hf_max_to_keep=2', 'train.progress=false', 'train.tensorboard=false']
  history = train_here(workdir, 'configs/tiny_arith.yaml', *overrides)
  said = [line for line in capsys.readouterr().err.splitlines() if 'snapshot of step' in line]
  assert len(said) == 1 and 'snapshot of step 20' in said[0] and 'No space left on device' in said[0], said
  assert sorted(os.listdir(workdir / 'hf')) == ['step_30', 'step_40']
  assert [row['step'] for row in history if 'export_hf_s' in row] == [10, 20, 30, 40]

  config = config_lib.load_config(os.path.join(ROOT, 'configs/tiny_arith.yaml'), overrides)
  tokens = np.random.default_rng(seed).integers(0, config.model.architecture.vocab_size, (2, 12))
  mesh = make_mesh(MeshConfig(), jax.devices()[:1])
  logits = {}
  for step in (30, 40):
    graphdef, params, _, _ = restore_policy(str(workdir / 'checkpoints'), step, mesh)
    logits[step] = np.asarray(nnx.merge(graphdef, params)(tokens.astype(np.int32)))
    exported = AutoModelForCausalLM.from_pretrained(str(workdir / 'hf' / f'step_{step}')).eval()
    np.testing.assert_allclose(torch_logits(exported, tokens), logits[step], rtol=1e-5, atol=1e-5)
  assert np.abs(logits[40] - logits[30]).max() > 1e-4
  generation = json.load(open(workdir / 'hf' / 'step_40' / 'generation_config.json'))
  assert generation['eos_token_id'] == sorted(build_task(config).stop_token_ids)
  assert generation['do_sample'] and generation['temperature'] == config.rollout.sampling.temperature
  assert GenerationConfig.from_pretrained(str(workdir / 'hf' / 'step_40')).eos_token_id == generation['eos_token_id']


@pytest.mark.exhaustive
@pytest.mark.parametrize('export', ['adapters', 'merged'])
def test_a_lora_runs_snapshots_are_peft_adapters_or_merged(seed, tmp_path, export):
  """LoRA on a random base: the adapters snapshot loads with peft on the base transformers builds
  from the run's base weights, the merged one as a plain model; both with the live policy's logits."""
  from transformers import AutoModelForCausalLM

  config, run = _run(tmp_path, 'train.export_hf_every=1', f'train.export_hf_lora={export}', f'run.seed={seed}',
                     config_file='configs/tiny_arith_lora.yaml')
  tokens = np.random.default_rng(seed).integers(0, config.model.architecture.vocab_size, (2, 12))
  try:
    for _ in range(2):
      run.fused_steps(1)
    live = _live_logits(run, tokens)
    run.snapshots.take(2, run.state)
    if export == 'adapters':  # the base as transformers reads it: the run's frozen weights, exported
      from flax import nnx

      from grpo_jax.model import lora
      from grpo_jax.model.loading import save_hf
      base = nnx.merge(run.rl_step.graphdef, jax.device_get(lora.join(lora.adapters_off(run.state.params),
                                                                      run.state.frozen)))
      save_hf(_plain(base), str(tmp_path / 'base'))
  finally:
    run.close()
  snapshot = str(tmp_path / 'run' / 'hf' / 'step_2')
  if export == 'adapters':
    from peft import PeftModel
    assert sorted(os.listdir(snapshot)) == ['adapter_config.json', 'adapter_model.safetensors',
                                            'generation_config.json']
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tmp_path / 'base')), snapshot).eval()
  else:
    model = AutoModelForCausalLM.from_pretrained(snapshot).eval()
  np.testing.assert_allclose(torch_logits(model, tokens), live, rtol=1e-5, atol=1e-5)


def _plain(model):
  """A LoRA model's base alone (its adapters dropped), as a plain model."""
  import dataclasses

  from flax import nnx

  from grpo_jax.model import lora
  from grpo_jax.model.loading import abstract_model

  plain = dataclasses.replace(model.options, lora=None, param_dtype=model.options.dtype)
  _, base = lora.split_adapters(nnx.state(model))
  return nnx.merge(nnx.graphdef(abstract_model(model.config, plain)), base)
