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
from grpo_jax.data import synthetic_preferences
from grpo_jax.sharding import MeshConfig, make_mesh
from runs import ROOT, read_metrics, without_timing

CONFIG = os.path.join(ROOT, 'configs', 'tiny_reward_model.yaml')
SMALL = ['train.progress=false', 'train.tensorboard=false', 'optim.schedule=constant', 'optim.warmup_steps=0',
         'preferences.pairs_per_batch=8', 'eval.every=2', 'eval.source=null',
         'eval.held_out=0.2']


@pytest.fixture
def pairs(tmp_path, seed):
  """A preference file of 36 random-word pairs (29 to train on: the last batch of an epoch padded)
  and its tokenizer."""
  paths = synthetic_preferences.write(str(tmp_path / 'data'), pairs=36, held_out=8, seed=seed % 1000)
  return [f'preferences.source={paths["pairs"]}', f'preferences.tokenizer={paths["tokenizer"]}']


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


def _assert_scores_as_the_run(run, scores, seed):
  """`scores` (an export's, through transformers) of 6 fresh random rows are the run's model's to 1e-4 in fp32."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(2, 20, 6)
  mask = (np.arange(20)[None, :] < lengths[:, None]).astype(np.int32)
  tokens = np.where(mask == 1, rng.integers(1, len(run.tokenizer), (6, 20)), 0).astype(np.int32)
  model = nnx.merge(run.graphdef, run.state.policy)
  np.testing.assert_allclose(np.asarray(model.scores(tokens, segment_ids=mask))[:, 0], scores(tokens, mask),
                             rtol=1e-4, atol=1e-4)


def _tensors(workdir):
  return load_file(os.path.join(workdir, 'reward_model', 'model.safetensors'))


def test_trains_resumes_exactly_evaluates_held_out_pairs_and_exports_for_transformers(tmp_path, pairs, seed):
  whole = tmp_path / 'whole'
  history = _train(whole, *pairs, 'train.steps=6', 'train.checkpoint_every=2', 'train.max_to_keep=3')
  assert [row['step'] for row in history] == [1, 2, 3, 4, 5, 6]
  assert [row['epoch'] for row in history] == [0, 0, 0, 0, 1, 1]  # 29 pairs: 4 batches an epoch
  assert history[3]['pairs'] == 5 and history[0]['pairs'] == 8  # the epoch's last batch: 5 real pairs
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
    _assert_scores_as_the_run(run, scores, seed)
  finally:
    run.close()


def test_a_language_model_gets_a_fresh_score_head_on_its_own_decoder(tmp_path, make_hf_checkpoint, seed):
  """model.path a causal LM: its decoder's weights, a score head [D, 1] drawn as transformers draws
  it, the tokenizer's pad token as pad_token_id; scored as transformers' sequence classifier built
  on the same checkpoint scores with that head. Without a pad token: one line."""
  from transformers import Qwen2ForSequenceClassification

  from grpo_jax.errors import UserError
  from grpo_jax.model.loading import ModelConfig
  from grpo_jax.model.score_head import build_reward_model
  directory, _ = make_hf_checkpoint(seed)
  tokenizer = synthetic_preferences.build_tokenizer()
  tokenizer.save_pretrained(directory)
  mesh = make_mesh(MeshConfig(data=1, fsdp=1, tensor=1), devices=jax.devices()[:1])
  model, loaded = build_reward_model(ModelConfig(path=directory), mesh, seed)
  assert model.config.num_labels == 1 and model.config.pad_token_id == loaded.pad_token_id == tokenizer.pad_token_id
  head = np.asarray(model.score[...])
  assert head.shape == (64, 1) and 0.01 < head.std() < 0.03  # normal, std initializer_range (0.02)
  reference = Qwen2ForSequenceClassification.from_pretrained(directory, num_labels=1,
                                                             pad_token_id=tokenizer.pad_token_id).eval()
  with torch.no_grad():
    reference.score.weight.copy_(torch.tensor(head.T))
  rng = np.random.default_rng(seed)
  lengths = rng.integers(2, 16, 5)
  mask = (np.arange(16)[None, :] < lengths[:, None]).astype(np.int32)
  tokens = np.where(mask == 1, rng.integers(1, 1000, (5, 16)), tokenizer.pad_token_id).astype(np.int32)
  with torch.no_grad():
    want = reference(input_ids=torch.tensor(tokens, dtype=torch.long)).logits[:, 0].numpy()
  np.testing.assert_allclose(np.asarray(model.scores(tokens, segment_ids=mask))[:, 0], want, rtol=1e-4, atol=1e-4)

  # A Llama checkpoint whose tokenizer has no pad token (Qwen2's tokenizer class would give it one).
  directory, _ = make_hf_checkpoint(seed, name='llama', model_type='llama')
  tokenizer.save_pretrained(directory)
  with open(os.path.join(directory, 'tokenizer_config.json')) as f:
    settings = json.load(f)
  settings.pop('pad_token')
  with open(os.path.join(directory, 'tokenizer_config.json'), 'w') as f:
    json.dump(settings, f)
  with pytest.raises(UserError, match=r'^the tokenizer of .* has no pad token: a reward model reads'):
    build_reward_model(ModelConfig(path=directory), mesh, seed)


@pytest.mark.parametrize('case', ['missing', 'not-a-pair'])
def test_bad_preference_data_is_one_line(tmp_path, pairs, capsys, case):
  source = tmp_path / 'bad.jsonl'
  if case == 'not-a-pair':
    source.write_text(json.dumps({'prompt': 'box ?', 'chosen': 'warm'}) + '\n')
  with pytest.raises(SystemExit) as exit:
    train_reward.main(['--config', CONFIG, '--workdir', str(tmp_path / 'run'), *[a for o in SMALL + pairs for a in
                                                                               ('--set', o)],
                       '--set', f'preferences.source={source}'])
  assert exit.value.code == 2
  error = capsys.readouterr().err.strip().splitlines()
  want = {'missing': f'error: preferences.source {source} not found',
          'not-a-pair': f"error: record 0 of {source} (format messages): no field 'rejected' (missing or null; its "
                        'fields: prompt, chosen)'}[case]
  assert error[-1] == want and not any(line.startswith('Traceback') for line in error)
  assert not os.path.exists(tmp_path / 'run' / 'config.yaml')  # nothing written before the inputs are checked


@pytest.mark.exhaustive
def test_lora_trains_the_adapters_and_the_score_head_by_peft_gradients(make_hf_checkpoint, seed):
  """With model.lora the trained split is the adapters and the score head (peft's modules_to_save),
  the base frozen; one SGD step of the Bradley-Terry update moves each by the gradient transformers
  + peft compute on the same pairs (B drawn nonzero, so A's gradient is there too)."""
  import optax
  import peft

  from grpo_jax.model import lora
  from grpo_jax.model.lora import LoraConfig
  from grpo_jax.rl.preference import PreferenceBatch, preference_update
  from grpo_jax.rl.state import init_train_state
  from test_lora import _adapted
  directory, torch_model = make_hf_checkpoint(seed, head='score')
  settings = LoraConfig(rank=3, alpha=5.0, targets=('q', 'v', 'down'))
  graphdef, state = nnx.split(_adapted(directory, settings, seed))
  trained, frozen = lora.split_trainable(state)
  assert set(nnx.to_pure_dict(trained)) == {'layers', 'score'} and 'score' not in nnx.to_pure_dict(frozen)
  rng = np.random.default_rng(seed)

  def side():
    lengths = rng.integers(3, 12, 6)
    mask = (np.arange(12)[None, :] < lengths[:, None]).astype(np.int32)
    return np.where(mask == 1, rng.integers(3, 1000, (6, 12)), 0).astype(np.int32), mask
  (chosen, chosen_mask), (rejected, rejected_mask) = side(), side()
  weights = np.array([1, 1, 1, 1, 1, 0], np.float32)
  batch = PreferenceBatch(chosen=chosen, chosen_mask=chosen_mask, rejected=rejected, rejected_mask=rejected_mask,
                          weights=weights)
  optimizer = optax.sgd(1.0)
  after, _ = jax.jit(lambda state, batch: preference_update(
      state, batch, graphdef=graphdef, optimizer=optimizer, schedule=optax.constant_schedule(1.0)))(
      init_train_state(trained, optimizer, 0, frozen=frozen), batch)
  for old, new in zip(jax.tree.leaves(frozen), jax.tree.leaves(after.frozen)):
    assert np.array_equal(np.asarray(old), np.asarray(new))
  before_tensors = lora.peft_tensors(state, settings)
  after_tensors = lora.peft_tensors(lora.join(after.params, after.frozen), settings)
  ours = {name: before_tensors[name] - after_tensors[name] for name in before_tensors}  # SGD at rate 1: the gradient
  ours['score'] = (np.asarray(trained['score'][...]) - np.asarray(after.params['score'][...])).T

  reference = peft.get_peft_model(torch_model.float(), peft.LoraConfig(
      r=3, lora_alpha=5.0, target_modules=['q_proj', 'v_proj', 'down_proj'], lora_dropout=0.0, bias='none',
      task_type='SEQ_CLS', modules_to_save=['score']))
  peft.set_peft_model_state_dict(reference, {name: torch.tensor(value) for name, value in before_tensors.items()}
                                 | {'base_model.model.score.weight': torch.tensor(np.asarray(trained['score'][...]).T)})

  def scores(tokens, mask):
    return reference(input_ids=torch.tensor(tokens, dtype=torch.long),
                     attention_mask=torch.tensor(mask, dtype=torch.long)).logits[:, 0]
  terms = -torch.nn.functional.logsigmoid(scores(chosen, chosen_mask) - scores(rejected, rejected_mask))
  (torch.sum(terms * torch.tensor(weights)) / weights.sum()).backward()
  theirs = {name.replace('.default', ''): parameter.grad.numpy() for name, parameter in reference.named_parameters()
            if parameter.requires_grad}
  theirs['score'] = theirs.pop('base_model.model.score.modules_to_save.weight')
  assert set(ours) == set(theirs) and len(ours) == 2 * 3 * 2 + 1
  for name, grad in ours.items():
    np.testing.assert_allclose(grad, theirs[name], rtol=0, atol=1e-5, err_msg=name)
    assert np.abs(theirs[name]).max() > 1e-4, name  # a gradient that is there to compare


@pytest.mark.exhaustive
@pytest.mark.starts_first
@pytest.mark.long
def test_killed_mid_first_save_then_after_a_commit_resumes_exactly(tmp_path, pairs):
  """kill -9 of the command line while its first checkpoint is written, and again just after the
  resumed run's first commit: the run resumed to its end equals an uninterrupted one, metrics,
  held-out evaluations, last checkpoint and export bit for bit."""
  import random
  import subprocess
  import sys

  from runs import device_env
  from test_crash_safety import (STEPS, TIMEOUT_S, _checkpoints, _log, assert_complete_checkpoints,
                                 assert_resumed_from_newest, assert_same_final_state, kill_at)
  settings = [*SMALL, *pairs, f'train.steps={STEPS}', 'train.checkpoint_every=2', 'train.max_to_keep=3',
              'preferences.pairs_per_batch=4']

  def start(workdir):
    command = [sys.executable, '-m', 'grpo_jax.train_reward', '--config', CONFIG, '--workdir', str(workdir)]
    command += [argument for setting in settings for argument in ('--set', setting)]
    log = open(next(f'{workdir}.{n}.log' for n in range(100) if not os.path.exists(f'{workdir}.{n}.log')), 'w')
    process = subprocess.Popen(command, cwd=ROOT, env=device_env(1), stdout=subprocess.DEVNULL, stderr=log)
    process.log = log
    return process

  whole, killed = tmp_path / 'whole', tmp_path / 'killed'
  reference = start(whole)
  assert reference.wait(timeout=TIMEOUT_S) == 0, _log(reference)
  seed = random.randrange(2**32)
  rng, hits = random.Random(seed), []
  for moment in ('first-save', 'commit'):
    before = max(_checkpoints(killed)[0], default=None)
    victim = start(killed)
    hits.append(kill_at(victim, killed, moment, rng))
    assert_resumed_from_newest(victim, killed, before)
    assert_complete_checkpoints(killed)
  before = max(_checkpoints(killed)[0], default=None)
  resumed = start(killed)
  assert resumed.wait(timeout=TIMEOUT_S) == 0, f'{hits} (seed {seed}):\n{_log(resumed)}'
  assert_resumed_from_newest(resumed, killed, before)
  assert without_timing(read_metrics(killed)) == without_timing(read_metrics(whole)), f'{hits} (seed {seed})'
  assert read_metrics(killed, 'eval.jsonl') == read_metrics(whole, 'eval.jsonl')
  assert_same_final_state(killed, whole)
  ours, theirs = _tensors(killed), _tensors(whole)
  assert sorted(ours) == sorted(theirs) and all(np.array_equal(ours[name], theirs[name]) for name in ours)


@pytest.mark.exhaustive
def test_a_lora_run_exports_its_adapters_merged(tmp_path, pairs, seed):
  """A LoRA run's export is a plain sequence classifier, the adapters merged into the base: it
  scores fresh rows as the run's adapted model does (1e-4 in fp32)."""
  workdir = tmp_path / 'lora'
  _train(workdir, *pairs, 'train.steps=3', 'model.lora.rank=2', 'model.lora.targets=[q, v, up]')
  config = train_reward.load_config(CONFIG, [*SMALL, *pairs, 'train.steps=3', 'model.lora.rank=2',
                                             'model.lora.targets=[q, v, up]'])
  run = train_reward.RewardRun(config, str(workdir), make_mesh(config.mesh, devices=jax.devices()[:1]))
  try:
    assert run.step == 3 and run.state.frozen is not None
    names = set(_tensors(workdir))
    assert 'score.weight' in names and not any('lora' in name for name in names)
    _assert_scores_as_the_run(run, _transformers_scorer(str(workdir / 'reward_model')), seed)
  finally:
    run.close()


@pytest.mark.exhaustive
def test_a_run_on_a_data_fsdp_tensor_mesh_equals_one_device(tmp_path, pairs):
  """Losses, accuracies, gradient norms and held-out evaluations on a 2 x 2 x 2 mesh equal one device's."""
  settings = [*pairs, 'train.steps=3', 'preferences.micro_batches=2']
  one = _train(tmp_path / 'one', *settings, 'mesh.fsdp=1')
  config = train_reward.load_config(CONFIG, [*SMALL, *settings, 'mesh.data=2', 'mesh.fsdp=2', 'mesh.tensor=2'])
  workdir, mesh = train_reward.setup(config, CONFIG, str(tmp_path / 'cube'), devices=jax.devices()[:8])
  cube = train_reward.train(config, workdir, mesh)
  # The gradient norm is a root of a sum over every parameter's squared gradient, each gradient
  # itself a sum over the micro-batches and data shards: on the mesh both sums run in another fp32
  # order, which moved it by 1.14e-5 of itself at seed 2654203604 (the losses agreed to 1e-5).
  tolerance = dict(grad_norm=5e-5)
  for ours, theirs in zip(cube, one):
    for name in ('loss', 'accuracy', 'grad_norm', 'eval/loss', 'eval/accuracy'):
      if theirs.get(name) is not None:
        np.testing.assert_allclose(ours[name], theirs[name], rtol=tolerance.get(name, 1e-5), err_msg=name)
  # The parameters are compared through what they compute (the held-out loss after the last update):
  # AdamW's early steps are about each gradient's sign, which rounding flips where an element is near 0.
  assert cube[-1]['eval/loss'] is not None


def test_each_epoch_visits_every_training_pair_once_in_an_order_of_the_seed_and_the_epoch(tmp_path, seed):
  """The held-out pairs are none of the training ones; step s's batch depends on (seed, s) alone; each
  epoch's batches hold every training pair once, the last filled up with pairs of weight 0."""
  from grpo_jax.data.preference_set import PreferenceEvalConfig, PreferencesConfig, PreferenceSet
  records = synthetic_preferences.pair_records(np.random.default_rng(seed), 23, 8, beta=20.0)
  for index, record in enumerate(records):
    record['margin'] = float(index)
  source = tmp_path / 'pairs.jsonl'
  source.write_text(''.join(json.dumps(record) + '\n' for record in records))
  tokenizer = synthetic_preferences.build_tokenizer()
  section = PreferencesConfig(source=str(source), pairs_per_batch=4, margin_field='margin')

  def made(run_seed):
    return PreferenceSet(section, PreferenceEvalConfig(held_out=0.2), tokenizer, tokenizer.pad_token_id, run_seed)
  data = made(seed)
  assert (len(data.train), len(data.held_out), data.batches_per_epoch) == (18, 5, 5)
  assert not set(data.train.margin) & set(data.held_out.margin)
  assert sorted(data.train.margin.tolist() + data.held_out.margin.tolist()) == list(range(23))
  orders = []
  for epoch in range(3):
    batches = [data.batch(step) for step in range(epoch * 5, epoch * 5 + 5)]
    assert [int(batch['weights'].sum()) for batch in batches] == [4, 4, 4, 4, 2]
    assert all(batch['chosen'].shape == (4, data.report['width']) for batch in batches)
    seen = [margin for batch in batches for margin, weight in zip(batch['margin'], batch['weights']) if weight]
    assert sorted(seen) == sorted(data.train.margin.tolist())
    orders.append(seen)
  assert orders[0] != orders[1] != orders[2]
  again = made(seed)
  assert all(np.array_equal(again.batch(step)['chosen'], data.batch(step)['chosen']) for step in (0, 7, 14))
  assert any(not np.array_equal(made(seed + 1).batch(step)['margin'], data.batch(step)['margin']) for step in (0, 7))
