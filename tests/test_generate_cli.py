"""python -m grpo_jax.generate: JSON output against transformers, tokenizer prompts, errors."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from runs import device_env, one_local_device
from test_api import write_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def generate(*args, devices=8):
  """The CLI in a process of its own that sees `devices` CPU devices."""
  result = subprocess.run([sys.executable, '-m', 'grpo_jax.generate', *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=device_env(devices))
  return result.returncode, result.stdout, result.stderr


@pytest.mark.parametrize('devices', [8, pytest.param(1, marks=pytest.mark.exhaustive)], ids=['mesh', 'one-device'])
def test_greedy_json_matches_transformers(seed, make_hf_checkpoint, devices):
  """On the 8 test devices in the sampler's layout: 4 groups of 2 (weights split over each pair);
  and on a host of one device."""
  directory, reference = make_hf_checkpoint(seed)
  prompt = np.random.default_rng(seed).integers(3, 1000, 7)
  code, stdout, stderr = generate('--ckpt', directory, '--prompt-ids', ' '.join(map(str, prompt)), '--tensor',
                                  min(devices, 2), '--greedy', '--max-new-tokens', 9, '--num-samples', 2, '--json',
                                  devices=devices)
  assert code == 0, stderr
  output = json.loads(stdout)
  with torch.no_grad():
    expected = reference.generate(torch.tensor(prompt[None]), do_sample=False, max_new_tokens=9,
                                  eos_token_id=None, pad_token_id=0)[0, 7:].tolist()
  assert output['token_ids'] == [expected, expected]
  assert output['finish_reason'] == ['length', 'length']
  assert len(output['logprobs'][0]) == 9 and all(x <= 0 for x in output['logprobs'][0])
  assert 'text' not in output


@pytest.mark.parametrize('devices', [8, pytest.param(1, marks=pytest.mark.exhaustive)], ids=['mesh', 'one-device'])
def test_a_mixture_generates_over_the_expert_axis_as_transformers_does(seed, make_hf_checkpoint, capsys, monkeypatch,
                                                                        devices):
  """A Qwen3-MoE checkpoint on the 8 test devices: tensor pairs, its 8 experts split over the 4
  pairs (the trainer's sampler layout: the expert axis), greedy as transformers' generate; and on a
  host of one device (the host's devices are what generate lays the model over)."""
  from grpo_jax import generate as generate_module
  from test_moe import CASES
  if devices == 1:
    one_local_device(monkeypatch)
  layouts = []
  original = generate_module.rollout_layout
  monkeypatch.setattr(generate_module, 'rollout_layout', lambda *a, **k: layouts.append(original(*a, **k)) or layouts[-1])
  directory, reference = make_hf_checkpoint(seed, **CASES['top2-norm-tied'])
  prompt = np.random.default_rng(seed).integers(3, 1000, 6)
  assert generate_module.main(['--ckpt', directory, '--prompt-ids', ' '.join(map(str, prompt)), '--tensor',
                               str(min(devices, 2)), '--greedy', '--max-new-tokens', '8', '--json']) is None
  with torch.no_grad():
    expected = reference.generate(torch.tensor(prompt[None]), do_sample=False, max_new_tokens=8,
                                  eos_token_id=None, pad_token_id=0)[0, 6:].tolist()
  assert json.loads(capsys.readouterr().out)['token_ids'] == [expected]
  expected_mesh = {'data': 1, 'fsdp': 1, 'expert': 4, 'tensor': 2, 'context': 1} if devices == 8 else \
      {'data': 1, 'fsdp': 1, 'expert': 1, 'tensor': 1, 'context': 1}
  assert [dict(layout.mesh.shape) for layout in layouts] == [expected_mesh]


@pytest.mark.exhaustive
def test_text_prompt_with_tokenizer_and_errors(seed, make_hf_checkpoint):
  directory, _ = make_hf_checkpoint(seed)
  code, _, stderr = generate('--ckpt', directory, '--prompt', 'one plus two')
  assert code == 2 and stderr.strip().startswith('error: --prompt needs a tokenizer')
  code, _, stderr = generate('--ckpt', directory, '--prompt-ids', '5 99999')
  assert code == 2 and stderr.strip() == ('error: --prompt-ids: token id 99999 at position 1 is outside the '
                                          'vocabulary [0, 1000)')
  code, _, stderr = generate('--ckpt', directory, '--prompt-ids', '5 6', '--tensor', 3)
  assert code == 2 and stderr.strip() == 'error: --tensor=3 must divide the 8 devices of the mesh'
  write_tokenizer(directory)
  code, stdout, stderr = generate('--ckpt', directory, '--prompt', 'seven plus two is',
                                  '--temperature', 0.7, '--top-p', 0.9, '--seed', 3,
                                  '--max-new-tokens', 5, '--json')
  assert code == 0, stderr
  output = json.loads(stdout)
  assert isinstance(output['text'][0], str) and len(output['token_ids'][0]) <= 5
