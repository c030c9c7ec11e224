"""On-policy distillation (algo.teacher): the per-token advantage against NumPy; the update with a
teacher of another shape against a loss written here on both models' full logits (its gradient,
its metrics), packed against padded; the teacher's checks at start (one line each); and RL runs
with a teacher: the arith task's fused steps resumed exactly, a LoRA teacher, and the student
paths (packing, partial rollouts, LoRA, MoE, vision-language) in test-all."""

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from grpo_jax import build, train
from grpo_jax import config as config_lib
from grpo_jax.config import AlgoConfig
from grpo_jax.data.arith import build_tokenizer
from grpo_jax.errors import FieldError, UserError
from grpo_jax.model.config import Qwen2Config
from grpo_jax.model.loading import init_model, save_orbax
from grpo_jax.rl import algo
from grpo_jax.rl.held import Held, Teacher
from grpo_jax.rl.update import UpdateSettings, update
from grpo_jax.sampler.sampling import SamplingConfig, select
from runs import ROOT, train_here
from test_update import (ARCHITECTURE, COMPLETION_LENGTH, GROUP, PROMPT_LENGTH, ROWS, TEMPERATURE, assert_close,
                         _initial_model, assert_trees_close, delta, fresh_state, full_logits_log_probs, random_batch,
                         random_model)

# A teacher of another shape (wider, deeper, its embedding table padded past the student's ids).
TEACHER = dataclasses.replace(ARCHITECTURE, vocab_size=1152, hidden_size=48, intermediate_size=96, num_hidden_layers=3)


# ---- the per-token advantage ----

def numpy_distilled(advantages, sampler, teacher, mask, weight, scale, discount, group):
  """A_t written out: the discounted sum of -(lp_s - lp_t) over each row's later tokens, less the
  mean of the group's other rows at t (over those with a token there), mixed with A_group."""
  rows, length = mask.shape
  per_token = np.zeros((rows, length))
  for row in range(rows):
    following = 0.0
    for t in reversed(range(length)):
      if mask[row, t]:
        following = (teacher[row, t] - sampler[row, t]) + discount * following
        per_token[row, t] = following
  baseline = np.zeros_like(per_token)
  for row in range(rows if group else 0):
    first = row // group * group
    for t in range(length):
      others = [per_token[j, t] for j in range(first, first + group) if j != row and mask[j, t]]
      baseline[row, t] = np.mean(others) if others else 0.0
  per_token = np.where(mask, per_token - baseline, 0.0)
  return (1 - weight) * advantages[:, None] + weight * scale * per_token


@pytest.mark.parametrize('discount, baseline', [(0.0, True), (0.6, True), (0.0, False)])
def test_distilled_advantages_match_numpy(seed, discount, baseline):
  rng = np.random.default_rng(seed)
  rows, length = 4 * GROUP, 7
  mask = np.arange(length)[None, :] < rng.integers(1, length + 1, rows)[:, None]
  mask[0] = False  # a row with no token (its group's mean is over the others)
  sampler, teacher = rng.uniform(-6, -0.1, (2, rows, length))
  advantages = rng.standard_normal(rows)
  ours = algo.distilled_advantages(jnp.asarray(advantages, jnp.float32), jnp.asarray(sampler, jnp.float32),
                                   jnp.asarray(teacher, jnp.float32), jnp.asarray(mask), weight=0.7, scale=0.5,
                                   discount=discount, group_size=GROUP if baseline else 0)
  expected = numpy_distilled(advantages, sampler, teacher, mask, 0.7, 0.5, discount, GROUP if baseline else 0)
  np.testing.assert_allclose(np.asarray(ours), expected, rtol=1e-5, atol=1e-5)
  metrics = algo.distillation_metrics(jnp.asarray(sampler), jnp.asarray(teacher), jnp.asarray(mask))
  gap = (sampler - teacher)[mask]
  # A mean of terms of either sign: fp32's error is relative to the terms' magnitude, not to the mean
  # (a mean near 0 of 20 terms near 3 moved 5e-5 of itself at seed 3096564919).
  np.testing.assert_allclose(float(metrics['distill_reverse_kl']), gap.mean(), rtol=1e-5,
                             atol=1e-6 * np.abs(gap).mean())
  np.testing.assert_allclose(float(metrics['distill_teacher_confident_frac']), (gap < 0).mean(), rtol=1e-6)


def test_sampling_never_draws_past_the_vocab_limit(seed):
  """Ids past sampling.vocab_limit are never drawn, greedy or sampled, even where they are the
  likeliest; the log-prob stays that of the whole softmax (as top-k / top-p leave it)."""
  rng = np.random.default_rng(seed)
  logits = jnp.asarray(rng.standard_normal((64, 40)), jnp.float32).at[:, 35:].add(20.0)
  for config in (SamplingConfig(vocab_limit=32), SamplingConfig(greedy=True, vocab_limit=32)):
    tokens, log_probs = select(logits, jax.random.PRNGKey(seed % (1 << 31)), config)
    assert int(tokens.max()) < 32
    expected = jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, None], axis=1)[:, 0]
    np.testing.assert_allclose(np.asarray(log_probs), np.asarray(expected), rtol=1e-6)
  assert int(select(logits, jax.random.PRNGKey(0), SamplingConfig(greedy=True))[0].min()) >= 35


# ---- the update with a teacher ----

def random_teacher(rng) -> Teacher:
  return Teacher(*random_model(rng, TEACHER), path='random')


DISTILL = dict(distill_weight=0.7, distill_scale=0.5, distill_discount=0.5)


def distill_update(params, teacher, batch, seed, **fields):
  config = AlgoConfig(group_size=GROUP, teacher='random', logprob_implementation='xla_chunked', **DISTILL, **fields)
  optimizer = optax.sgd(2.0 ** 13)  # the parameter change is the (scaled) gradient itself (test_update's rule)
  run = functools.partial(update, graphdef=_initial_model()[0], optimizer=optimizer,
                          schedule=optax.constant_schedule(1.0),
                          settings=UpdateSettings(algo=config, temperature=TEMPERATURE, rows=ROWS))
  state, metrics = jax.jit(run)(fresh_state(params, optimizer, seed), batch, Held(teacher=teacher))
  return delta(state.params, params), metrics


def test_update_with_a_teacher_matches_full_logits(seed):
  """The update's gradient and metrics with a teacher of another shape and table size against the
  loss written out on both models' full logits: A_t from the teacher's log-softmax of the sampled
  tokens (NumPy), the on-policy surrogate -A_t pi / sg(pi), token-mean. Micro-batches of B / 2."""
  rng = np.random.default_rng(seed)
  graphdef, params = random_model(rng)
  teacher = random_teacher(rng)
  batch = random_batch(rng)
  student_log_probs, _ = jax.jit(full_logits_log_probs, static_argnums=0)(graphdef, params, batch)
  teacher_log_probs, _ = jax.jit(full_logits_log_probs, static_argnums=0)(teacher.graphdef, teacher.params, batch)
  # The sampler near the student (a real sampler's numerics), so the reverse KL is the teacher's gap.
  sampler = np.asarray(student_log_probs) + 0.05 * rng.standard_normal(student_log_probs.shape)
  batch = batch.with_rollout(log_probs=jnp.asarray(sampler, jnp.float32))
  mask = np.asarray(batch.mask)
  advantages = numpy_distilled(np.asarray(batch.advantages), sampler, np.asarray(teacher_log_probs), mask,
                               DISTILL['distill_weight'], DISTILL['distill_scale'], DISTILL['distill_discount'], GROUP)

  def reference(params):
    log_probs, _ = full_logits_log_probs(graphdef, params, batch)
    ratio = jnp.exp(log_probs - jax.lax.stop_gradient(log_probs))
    return jnp.sum(-jnp.asarray(advantages, jnp.float32) * ratio * mask) / mask.sum()

  grads = jax.jit(jax.grad(reference))(params)
  expected = jax.tree.map(lambda g: -(2.0 ** 13) * np.asarray(g, np.float64), grads)
  ours, metrics = distill_update(params, teacher, batch, seed, micro_batch_size=ROWS // 2)
  assert_trees_close(ours, expected)
  gap = (sampler - np.asarray(teacher_log_probs))[mask]
  assert_close(metrics['distill_reverse_kl'], gap.mean(), 'distill_reverse_kl', scale=float(np.abs(gap).mean()))
  assert_close(metrics['distill_teacher_confident_frac'], (gap < 0).mean(), 'distill_teacher_confident_frac')
  assert_close(metrics['policy_loss'], float(np.sum(-advantages * mask) / mask.sum()), 'policy_loss',
               scale=float(np.abs(advantages).max()))
  assert np.abs(np.asarray(ours['lm_head'])).max() > 1e-3  # a real gradient


def test_packed_update_with_a_teacher_equals_padded(seed):
  rng = np.random.default_rng(seed)
  _, params = random_model(rng)
  teacher = random_teacher(rng)
  batch = random_batch(rng)
  padded = distill_update(params, teacher, batch, seed)
  packed = distill_update(params, teacher, batch, seed, packing=True, micro_batch_tokens=PROMPT_LENGTH + COMPLETION_LENGTH)
  assert_trees_close(packed[0], padded[0])
  for name in ('distill_reverse_kl', 'distill_teacher_confident_frac', 'grad_norm', 'entropy'):
    assert_close(packed[1][name], padded[1][name], name)


# ---- the checks at start ----

def teacher_checkpoint(directory, architecture: Qwen2Config, tokenizer=None, seed: int = 2) -> str:
  """A random grpo_jax checkpoint at `directory` with the arith task's tokenizer (or `tokenizer`,
  a `tokenizers` Tokenizer) beside it."""
  os.makedirs(directory, exist_ok=True)
  (tokenizer or build_tokenizer()).save(os.path.join(directory, 'tokenizer.json'))
  save_orbax(init_model(architecture, seed=seed), directory)
  return str(directory)


ARITH = dict(vocab_size=17, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, rope_theta=10000.0, tie_word_embeddings=True)


def arith_overrides(teacher: str, steps: int = 4) -> tuple:
  return (f'algo.teacher={teacher}', f'train.steps={steps}', 'train.steps_per_call=2', 'train.checkpoint_every=2',
          'rollout.prompts_per_step=4', 'algo.group_size=4', 'train.tensorboard=false',
          *(f'model.architecture.{name}={value}' for name, value in ARITH.items() if name != 'tie_word_embeddings'))


def test_bad_teachers_are_refused_in_one_line_before_anything_compiles(tmp_path):
  with pytest.raises(FieldError, match=r'algo\.distill_weight must be in \[0, 1\]'):
    AlgoConfig(distill_weight=1.5)
  cases = {
      'missing': (str(tmp_path / 'nowhere'), r'algo\.teacher: .*nowhere does not exist'),
      'small': (teacher_checkpoint(tmp_path / 'small', Qwen2Config(**dict(ARITH, vocab_size=12))),
                r'algo\.teacher: .*has 12 embedding rows, fewer than the student\'s 17 token ids'),
  }
  other = build_tokenizer()
  other.add_special_tokens(['<extra>'])  # one more id: 18 tokens against 17
  cases['tokenizer'] = (teacher_checkpoint(tmp_path / 'other', Qwen2Config(**dict(ARITH, vocab_size=18)), other),
                        r'another tokenizer than the student \(17 tokens against 18\)')
  config_path = os.path.join(ROOT, 'configs/tiny_arith.yaml')
  for name, (path, message) in cases.items():
    config = config_lib.load_config(config_path, list(arith_overrides(path)))
    workdir, mesh, model = train.setup(config, config_path, str(tmp_path / f'run-{name}'), devices=jax.devices()[:1])
    compiled = []  # from the student on (its random init compiles; a checkpoint's is read)
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **kwargs: compiled.append(event) if 'backend_compile' in event else None)
    try:
      with pytest.raises(UserError, match=message):
        train.train(config, workdir, mesh, model)
    finally:
      jax.monitoring.clear_event_listeners()
    assert not compiled, name
    assert not os.path.exists(os.path.join(workdir, 'metrics.jsonl'))


def test_arith_run_with_a_teacher_resumes_exactly(tmp_path):
  """Four fused steps with a teacher (a random checkpoint beside the arith tokenizer), against two
  and then two more resumed from the step-2 checkpoint: the same metrics, the teacher's included."""
  teacher = teacher_checkpoint(tmp_path / 'teacher', Qwen2Config(**dict(ARITH, hidden_size=48)))
  whole = train_here(tmp_path / 'whole', 'configs/tiny_arith.yaml', *arith_overrides(teacher))
  train_here(tmp_path / 'cut', 'configs/tiny_arith.yaml', *arith_overrides(teacher, steps=2))
  resumed = train_here(tmp_path / 'cut', 'configs/tiny_arith.yaml', *arith_overrides(teacher))
  assert [row['step'] for row in resumed] == [1, 2, 3, 4]
  for ours, theirs in zip(resumed, whole):
    for name in ('reward_mean', 'distill_reverse_kl', 'distill_teacher_confident_frac', 'policy_loss', 'grad_norm'):
      assert ours[name] == theirs[name], (ours['step'], name)
  # Another model's log-probs: never equal to the student's, nor the same on every token.
  assert all(abs(row['distill_reverse_kl']) > 1e-4 and 0 < row['distill_teacher_confident_frac'] < 1 for row in whole)


# ---- every student path (test-all) ----

def student_teacher(tmp_path, config_path: str) -> str:
  """A teacher for the student of `config_path`: its architecture (a mixture's routed by its own
  router) with other random weights, beside its task's built-in tokenizer."""
  config = config_lib.load_config(os.path.join(ROOT, config_path), [])
  return teacher_checkpoint(tmp_path / 'teacher', config.model.architecture, build.build_task(config).tokenizer, seed=7)


PATHS = {
    'lora student': ('configs/tiny_arith_lora.yaml', ()),
    'moe student, routing replay': ('configs/tiny_arith_moe.yaml', ()),
    'partial rollouts': ('configs/tiny_arith.yaml', ('algo.max_lag=1', 'algo.tis_cap=2.0')),
    'packing, two epochs': ('configs/tiny_arith.yaml', ('algo.packing=true', 'algo.ppo_epochs=2')),
    'vision-language student': ('configs/tiny_spot.yaml', ()),
    # The trainer on this process's first 2 devices, the sampler on its last one (one version behind).
    'split devices': ('configs/tiny_arith.yaml', ('rollout.devices=1', 'algo.max_lag=1', 'algo.tis_cap=2.0')),
}


@pytest.mark.exhaustive
@pytest.mark.parametrize('name', sorted(PATHS))
def test_every_student_path_trains_with_a_teacher(tmp_path, name):
  """Two RL steps with a teacher on each student path the issue lists (the vision-language
  student's teacher sees its images): the teacher's metrics are
  there and finite, and they are another model's (never 0)."""
  config_path, overrides = PATHS[name]
  teacher = student_teacher(tmp_path, config_path)
  rows = train_here(tmp_path / 'run', config_path, f'algo.teacher={teacher}', 'train.steps=2', 'train.steps_per_call=1',
                    'train.checkpoint_every=0', 'train.tensorboard=false', 'eval.every=0', *overrides,
                    devices=2 if name == 'split devices' else 1)
  assert len(rows) == 2
  for row in rows:
    assert np.isfinite(row['distill_reverse_kl']) and abs(row['distill_reverse_kl']) > 1e-5, row
    assert 0 < row['distill_teacher_confident_frac'] < 1 and np.isfinite(row['loss'])


@pytest.mark.exhaustive
def test_a_lora_runs_policy_teaches_merged(tmp_path):
  """A LoRA training run as the teacher: its adapters merged into its base at load, so the
  teacher's log-probs are the LoRA run's policy's."""
  from grpo_jax import restore
  from grpo_jax.model.qwen2 import ModelOptions
  from grpo_jax.sharding import MeshConfig, make_mesh
  train_here(tmp_path / 'lora', 'configs/tiny_arith_lora.yaml', 'train.steps=2', 'train.steps_per_call=2',
             'train.checkpoint_every=2', 'train.tensorboard=false')
  mesh = make_mesh(MeshConfig(data=1, fsdp=-1, tensor=1), jax.devices()[:1])
  options = ModelOptions(dtype='float32', param_dtype='float32')
  path = str(tmp_path / 'lora')
  graphdef, merged = restore.load_checkpoint_model(path, mesh, options, *restore.checkpoint_architecture(path, 'teacher'))
  adapted_graph, adapted, _, _ = restore.restore_policy(str(tmp_path / 'lora' / 'checkpoints'), None, mesh, options)
  tokens = jnp.asarray(np.random.default_rng(0).integers(3, 17, (2, 6)), jnp.int32)
  np.testing.assert_allclose(np.asarray(nnx.merge(graphdef, merged)(tokens)),
                             np.asarray(nnx.merge(adapted_graph, adapted)(tokens)), rtol=1e-5, atol=1e-5)
  assert 'lora' not in str(jax.tree_util.tree_structure(merged)).lower()
  rows = train_here(tmp_path / 'student', 'configs/tiny_arith.yaml', *arith_overrides(str(tmp_path / 'lora'), steps=2))
  assert all(np.isfinite(row['distill_reverse_kl']) for row in rows)


@pytest.mark.exhaustive
@pytest.mark.starts_first
@pytest.mark.long
def test_the_distillation_demo_student_learns_from_its_teacher(tmp_path):
  """The CPU demo (make demo-distill): the arith demo's model at run.seed=1 teaches a fresh student
  of half its width from the teacher's per-token log-probs alone (distill_weight 1: the reward is
  not trained on). After 500 steps the student's last-20 reward is at least 0.7 (from ~0.005) and
  its reverse KL to the teacher is under half its first steps'. (Against GRPO alone, see
  bench/distill.py in BENCHMARKS.md: the same number of steps on average, not a third.)"""
  from runs import train_learning
  teacher = tmp_path / 'teacher'
  train_learning(teacher, 'configs/tiny_arith.yaml', 'run.seed=1', 'train.tensorboard=false')
  rows = train_learning(tmp_path / 'distill', 'configs/tiny_arith_distill.yaml', f'algo.teacher={teacher}',
                        'train.tensorboard=false', 'train.checkpoint_every=0')
  mean = lambda rows, name: float(np.mean([row[name] for row in rows]))  # noqa: E731
  assert mean(rows[:10], 'reward_mean') < 0.05 and mean(rows[-20:], 'reward_mean') >= 0.7
  assert mean(rows[-20:], 'distill_reverse_kl') < 0.5 * mean(rows[:10], 'distill_reverse_kl')


# ---- the plan ----

@pytest.mark.exhaustive
def test_the_plan_counts_the_teachers_weights_forward_and_arguments(tmp_path):
  """The arith run planned with a teacher from its config.json alone (compiled by XLA:CPU over 8
  devices standing in for 8 H100s): the teacher's parameters and bytes, its share per device, its
  forward's FLOPs in the update, and its arrays among the compiled step's arguments."""
  from grpo_jax.model.hf_config import to_hf_dict
  from grpo_jax.plan import report as plan
  from test_reward_model_plan import H100X8
  teacher_architecture = Qwen2Config(**dict(ARITH, hidden_size=48, intermediate_size=128, num_hidden_layers=2))
  directory = tmp_path / 'teacher'
  directory.mkdir()
  (directory / 'config.json').write_text(json.dumps(to_hf_dict(teacher_architecture, dtype='float32')))
  overrides = [*arith_overrides(str(directory)), 'train.steps_per_call=1', 'mesh.fsdp=8']
  config = config_lib.load_config(os.path.join(ROOT, 'configs/tiny_arith.yaml'), overrides)
  architecture = config.model.architecture
  with_teacher = plan.plan(config, H100X8, architecture)
  without = plan.plan(dataclasses.replace(config, algo=dataclasses.replace(config.algo, teacher=None)), H100X8,
                      architecture)
  teacher = with_teacher['teacher']
  parameters = teacher_architecture.num_params()
  assert teacher['parameters'] == parameters and teacher['bytes'] == 4 * parameters
  assert teacher['bytes'] / 8 <= with_teacher['per_device']['teacher'] < teacher['bytes'] / 2  # FSDP over 8
  rows, length = config.completions_per_step, 5 + config.rollout.max_new_tokens  # prompts <bos> a + b =
  assert with_teacher['estimate']['teacher_flops'] == 2.0 * parameters * rows * length
  grown = with_teacher['programs'][0]['arguments'] - without['programs'][0]['arguments']
  assert grown == with_teacher['per_device']['teacher'], (grown, with_teacher['per_device'])
  assert 'teacher' not in without['per_device'] and without['estimate']['teacher_flops'] == 0
