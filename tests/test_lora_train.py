"""LoRA GRPO end to end (train CLI, checkpoints, export): the CPU demo learns through its adapters,
checkpoints hold only the adapters and resume exactly after kill -9, a LoRA run and a full one
refuse each other's checkpoints in one line, and the exported PEFT directory and merged checkpoint
give transformers the grpo_jax policy's logits. A file of its own: another xdist worker than
test_train's and test_lora's."""

import os
import subprocess
import sys

import numpy as np
import yaml
import pytest
from flax import nnx

from runs import train_here
from test_train import ROOT, read_metrics, device_env

LORA = os.path.join(ROOT, 'configs', 'tiny_arith_lora.yaml')
FULL = os.path.join(ROOT, 'configs', 'tiny_arith.yaml')
QUIET = ['--set', 'train.progress=false', '--set', 'train.tensorboard=false']


def _train(workdir, config, *settings, check=True):
  command = [sys.executable, '-m', 'grpo_jax.train', '--config', config, '--workdir', str(workdir), *QUIET]
  command += [argument for setting in settings for argument in ('--set', setting)]
  result = subprocess.run(command, cwd=ROOT, env=device_env(1), capture_output=True, text=True, timeout=600)
  if check:
    assert result.returncode == 0, result.stderr
  return result


def _stored_tensors(workdir) -> list[str]:
  from grpo_jax.checkpoint import Checkpointer, _name
  import jax
  checkpointer = Checkpointer(str(workdir / 'checkpoints'), max_to_keep=1, asynchronous=False)
  try:
    stored = checkpointer.manager.item_metadata(checkpointer.latest_step())['state']
    return [_name(path) for path, _ in jax.tree_util.tree_leaves_with_path(stored)]
  finally:
    checkpointer.close()


@pytest.mark.exhaustive
@pytest.mark.long
def test_lora_demo_learns_and_checkpoints_only_adapters(tmp_path):
  """configs/tiny_arith_lora.yaml's first 200 of its 400 steps (measured, base at std 0.12: mean
  reward 0.000 over the first 10 steps, 0.89 over steps 181-200, 0.98 over the last 20 of the 400)."""
  _train(tmp_path, LORA, 'train.steps=200', 'train.checkpoint_every=200')
  rows = read_metrics(tmp_path)
  first = np.mean([row['reward_mean'] for row in rows[:10]])
  last = np.mean([row['reward_mean'] for row in rows[-20:]])
  assert first <= 0.2 and last >= 0.8, (first, last)
  names = _stored_tensors(tmp_path)
  params = [name for name in names if name.startswith('params.')]
  assert params and all('_lora_' in name for name in params), params
  assert not [name for name in names if 'embedding' in name or 'q_weight' in name]
  assert any(name.startswith('opt_state.') and 'q_lora_b' in name for name in names)


@pytest.mark.exhaustive
def test_lora_and_full_checkpoints_refuse_each_other(tmp_path):
  train_here(tmp_path / 'full', FULL, *QUIET[1::2], 'train.steps=2', 'train.steps_per_call=1')  # the refusals: CLI lines
  result = _train(tmp_path / 'full', LORA, 'train.steps=4', check=False)
  assert result.returncode != 0
  line = result.stderr.strip().splitlines()[-1]
  assert 'is from a full-parameter run; model.lora cannot resume from it' in line, result.stderr
  train_here(tmp_path / 'lora', LORA, *QUIET[1::2], 'train.steps=2', 'train.steps_per_call=1')
  result = _train(tmp_path / 'lora', FULL, 'train.steps=4', check=False)
  assert result.returncode != 0 and 'holds LoRA adapters' in result.stderr.strip().splitlines()[-1], result.stderr
  result = _train(tmp_path / 'lora', LORA, 'train.steps=4', 'model.lora.rank=8', check=False)
  assert result.returncode != 0 and 'holds adapters of model.lora=' in result.stderr.strip().splitlines()[-1]


@pytest.mark.exhaustive
def test_lora_exports_as_peft_and_merged(tmp_path, make_hf_checkpoint, seed, capsys):
  """A LoRA run on a Hugging Face base: its policy (as grpo_jax.eval restores it), the PEFT directory
  loaded onto transformers' base, and the merged checkpoint all give the same logits; `serve` takes
  the run's workdir, and `generate` refuses it in one line."""
  import peft
  import torch
  import transformers

  from grpo_jax.checkpoint import locate
  from grpo_jax.restore import restore_policy
  from conversion.common import host_mesh
  base, torch_model = make_hf_checkpoint(seed)
  # The entropy bonus moves the adapters even where a random base earns no reward.
  train_here(tmp_path / 'run', LORA, *QUIET[1::2], f'model.path={base}', 'train.steps=3', 'train.steps_per_call=1',
         'optim.learning_rate=2e-2', 'algo.entropy_coef=1.0', 'model.lora.targets=[q, v, o, up, down]')
  # The run's printed and stored config shows the architecture read from model.path, not the section's default.
  stored = yaml.safe_load((tmp_path / 'run' / 'config.yaml').read_text())['model']['architecture']
  fields = ('vocab_size', 'hidden_size', 'intermediate_size', 'num_hidden_layers', 'num_attention_heads',
            'num_key_value_heads', 'tie_word_embeddings')
  assert {name: stored[name] for name in fields} == {name: getattr(torch_model.config, name) for name in fields}
  graphdef, params, config, _ = restore_policy(*locate(str(tmp_path / 'run')), host_mesh())
  policy = nnx.merge(graphdef, params)
  tokens = np.random.default_rng(seed).integers(0, policy.config.vocab_size, (2, 11))
  ours = np.asarray(policy(tokens))
  with torch.no_grad():
    base_logits = torch_model.float()(torch.tensor(tokens)).logits.numpy()
  assert np.abs(ours - base_logits).max() > 1e-3  # the trained adapters act

  def convert(*flags):
    out = tmp_path / '_'.join(flag.strip('-') for flag in flags) if flags else tmp_path / 'plain'
    command = [sys.executable, '-m', 'conversion.orbax_to_hf', '--ckpt', str(tmp_path / 'run'), '--out', str(out), *flags]
    return out, subprocess.run(command, cwd=ROOT, env=device_env(1), capture_output=True, text=True, timeout=300)

  # --peft reads the adapters alone: it exports with the base moved away (PEFT loads them onto it after).
  os.rename(base, f'{base}.away')
  try:
    out, result = convert('--peft')
  finally:
    os.rename(f'{base}.away', base)
  assert result.returncode == 0, result.stderr
  loaded = peft.PeftModel.from_pretrained(torch_model.float(), str(out)).eval()
  with torch.no_grad():
    np.testing.assert_allclose(loaded(torch.tensor(tokens)).logits.numpy(), ours, rtol=0, atol=1e-4)
  out, result = convert('--merge-lora')
  assert result.returncode == 0, result.stderr
  merged = transformers.AutoModelForCausalLM.from_pretrained(str(out)).float().eval()
  with torch.no_grad():
    np.testing.assert_allclose(merged(torch.tensor(tokens)).logits.numpy(), ours, rtol=0, atol=1e-4)
  # Without a flag it is refused before anything is read but the checkpoint's metadata: with its
  # base moved away, the line is about the flags, not about the missing base.
  os.rename(base, f'{base}.away')
  try:
    out, result = convert()
  finally:
    os.rename(f'{base}.away', base)
  assert result.returncode == 2 and result.stderr.strip().splitlines() == [
      f'error: --ckpt {tmp_path / "run"} holds LoRA adapters (model.lora rank 16): pass --merge-lora for a merged Hugging '
      'Face model, or --peft for a PEFT adapter directory'], result.stderr
  assert not os.path.exists(out)
  # grpo_jax.serve takes the run's workdir too: its engine decodes with the adapters on the base.
  from grpo_jax.serve import __main__ as serve
  engine, _ = serve.build_engine(serve.parse_args(['--ckpt', str(tmp_path / 'run'), '--port', '0',
                                                   '--token-ids-only', '--dtype', 'float32']))
  np.testing.assert_allclose(np.asarray(engine._model(tokens)), ours, rtol=0, atol=1e-5)
  # grpo_jax.generate reads model directories: a run's workdir is refused in one line, naming serve and the export.
  from grpo_jax import generate as generate_module
  capsys.readouterr()
  with pytest.raises(SystemExit) as exit_:
    generate_module.main(['--ckpt', str(tmp_path / 'run'), '--prompt-ids', '1 2 3'])
  lines = capsys.readouterr().err.strip().splitlines()
  assert exit_.value.code == 2 and len(lines) == 1 and 'is a training run; generate reads a model directory' in lines[0]
