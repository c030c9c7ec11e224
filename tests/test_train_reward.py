"""Reward-model training (`python -m grpo_jax.train_reward`): a run trains on seeded batches of
preference pairs, its held-out accuracy and loss are transformers' on the exported model, a run
resumed from a checkpoint ends bit for bit where the uninterrupted one does, and the export scores
as our model does; a language model gets a fresh score head on its own decoder; with LoRA only the
adapters and the score head train, by the gradient transformers + peft compute; kill -9 mid-run
resumes exactly; bad inputs are one line each."""

import json
import os
import shutil

import jax
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import load_file

from grpo_jax import train_reward
from grpo_jax.data import word_preferences
from grpo_jax.sharding import make_mesh
from runs import ROOT, read_metrics, without_timing

CONFIG = os.path.join(ROOT, 'configs', 'tiny_reward_model.yaml')
SMALL = ['train.progress=false', 'train.tensorboard=false', 'optim.schedule=constant', 'optim.warmup_steps=0',
         'preferences.pairs_per_batch=8', 'eval.every=2', 'eval.held_out=0.2']


@pytest.fixture
def pairs(tmp_path, seed):
  """A preference file of 36 random-word pairs (29 to train on: the last batch of an epoch padded)
  and its tokenizer."""
  paths = word_preferences.write(str(tmp_path / 'data'), 36, seed % 1000)
  return [f'preferences.source={paths["train"]}', f'preferences.tokenizer={paths["tokenizer"]}']


def _train(workdir, *overrides):
  config = train_reward.load_config(CONFIG, [*SMALL, *overrides])
  workdir, mesh = train_reward.setup(config, CONFIG, str(workdir), devices=jax.devices()[:1])
  return train_reward.train(config, workdir, mesh)


def _transformers_scorer(directory):
  """Scores [B] of token rows [B, T] by transformers' AutoModelForSequenceClassification from `directory`."""
  from transformers import AutoModelForSequenceClassification
  model = AutoModelForSequenceClassification.from_pretrained(directory, local_files_only=True).eval()

  def scores(tokens, mask):
    with torch.no_grad():
      return model(input_ids=torch.tensor(tokens, dtype=torch.long),
                   attention_mask=torch.tensor(mask, dtype=torch.long)).logits[:, 0].numpy()
  return scores


def _tensors(workdir):
  return load_file(os.path.join(workdir, 'reward_model', 'model.safetensors'))


def test_trains_resumes_exactly_evaluates_held_out_pairs_and_exports_for_transformers(tmp_path, pairs, seed):
  whole = tmp_path / 'whole'
  history = _train(whole, *pairs, 'train.steps=6', 'train.checkpoint_every=2', 'train.max_to_keep=3')
  assert [row['step'] for row in history] == [1, 2, 3, 4, 5, 6]
  assert [row['epoch'] for row in history] == [0, 0, 0, 0, 1, 1]  # 29 pairs: 4 batches an epoch
  assert history[3]['pairs'] == 5 and history[0]['pairs'] == 8  # the epoch's last batch: 5 real pairs
  assert history[-1]['loss'] < history[0]['loss']
  evaluations = read_metrics(whole, 'eval.jsonl')
  assert [row['step'] for row in evaluations] == [0, 2, 4, 6] and evaluations[0]['eval/pairs'] == 7
  assert history[-1]['eval/accuracy'] == evaluations[-1]['eval/accuracy']

  # Resumed from step 2 (as if the run had stopped after saving it), the run ends where the whole one does.
  resumed = tmp_path / 'resumed'
  shutil.copytree(whole, resumed)
  for step in ('4', '6'):
    shutil.rmtree(resumed / 'checkpoints' / step)
  shutil.rmtree(resumed / 'reward_model')
  _train(resumed, *pairs, 'train.steps=6', 'train.checkpoint_every=2', 'train.max_to_keep=3')
  assert without_timing(read_metrics(resumed)) == without_timing(read_metrics(whole))
  assert read_metrics(resumed, 'eval.jsonl') == evaluations
  ours, theirs = _tensors(resumed), _tensors(whole)
  assert sorted(ours) == sorted(theirs) and 'score.weight' in ours
  assert all(np.array_equal(ours[name], theirs[name]) for name in ours)

  # The held-out accuracy and loss of the last step are transformers' on the exported model.
  export = str(whole / 'reward_model')
  with open(os.path.join(export, 'config.json')) as f:
    written = json.load(f)
  assert written['architectures'] == ['Qwen2ForSequenceClassification'] and written['num_labels'] == 1
  config = train_reward.load_config(CONFIG, [*SMALL, *pairs, 'train.steps=6'])
  run = train_reward.RewardRun(config, str(whole), make_mesh(config.mesh, devices=jax.devices()[:1]))  # restores step 6
  try:
    assert run.step == 6
    held, scores = run.data.held_out, _transformers_scorer(export)
    chosen, rejected = scores(held.chosen, held.chosen_mask), scores(held.rejected, held.rejected_mask)
    gap = chosen - rejected
    loss = np.mean(np.log1p(np.exp(-gap)) + 0.001 * (chosen + rejected) ** 2)  # the config's center_coef
    assert evaluations[-1]['eval/accuracy'] == pytest.approx(np.mean(gap > 0), abs=1e-9)
    np.testing.assert_allclose(evaluations[-1]['eval/loss'], loss, rtol=1e-4)
    # Fresh random rows: the export's scores are the restored run's to 1e-4 in fp32.
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, 20, 6)
    mask = (np.arange(20)[None, :] < lengths[:, None]).astype(np.int32)
    tokens = np.where(mask == 1, rng.integers(1, len(run.tokenizer), (6, 20)), 0).astype(np.int32)
    model = nnx.merge(run.graphdef, run.state.policy)
    np.testing.assert_allclose(np.asarray(model.scores(tokens, segment_ids=mask))[:, 0],
                               scores(tokens, mask), rtol=1e-4, atol=1e-4)
  finally:
    run.close()
