"""LoRA (model/lora.py): the adapted model equals its base at init, its adapters' gradients and its
exported PEFT directory equal PyTorch peft's on the same tiny model, the merged weights compute the
same function, pi_ref is the base itself, and only the adapters reach the optimizer."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from grpo_jax import config as config_lib
from grpo_jax.errors import UserError
from grpo_jax.model import ModelOptions, from_pretrained, lora
from grpo_jax.model.loading import ModelConfig, abstract_model
from grpo_jax.model.lora import LoraConfig

TARGETS = ('q', 'k', 'v', 'o', 'gate', 'up', 'down')


def _adapted(directory, settings, seed, randomise=True, mesh=None):
  """The HF checkpoint with `settings`' adapters on it (fp32); with `randomise`, B drawn nonzero too."""
  model = ModelConfig(path=directory, options=ModelOptions(lora=settings)).build(mesh, seed)
  if randomise:
    rng = np.random.default_rng(seed)

    def draw(path, variable):
      if not isinstance(variable, lora.Adapter):
        return variable
      value = jnp.asarray(0.1 * rng.standard_normal(variable.shape), variable.dtype)
      return variable.replace(jax.device_put(value, variable[...].sharding))

    nnx.update(model, nnx.map_state(draw, nnx.state(model)))
  return model


def _tokens(seed, vocab, shape=(3, 9)):
  return np.random.default_rng(seed + 1).integers(0, vocab, shape)


def _peft_model(torch_model, settings, tensors):
  import peft
  import torch
  config = peft.LoraConfig(r=settings.rank, lora_alpha=settings.alpha, use_rslora=settings.rslora,
                           target_modules=[lora.TARGETS[t][1].split('.')[-1] for t in settings.targets],
                           lora_dropout=0.0, bias='none')
  model = peft.get_peft_model(torch_model, config)
  missing = peft.set_peft_model_state_dict(model, {name: torch.tensor(value) for name, value in tensors.items()})
  assert not [name for name in missing.unexpected_keys if 'lora' in name]
  return model.eval()


def test_adapted_model_equals_base_at_init(make_hf_checkpoint, seed):
  directory, _ = make_hf_checkpoint(seed)
  base = from_pretrained(directory, 'float32')
  adapted = _adapted(directory, LoraConfig(rank=4, targets=TARGETS), seed, randomise=False)
  tokens = _tokens(seed, base.config.vocab_size)
  # B is zero, A is not: every adapter adds x A 0 = exact zeros.
  assert all(np.abs(np.asarray(v[...])).max() > 0 for path, v in nnx.to_flat_state(nnx.state(adapted))
             if str(path[-1]).endswith('_lora_a'))
  np.testing.assert_array_equal(np.asarray(adapted(tokens)), np.asarray(base(tokens)))


@pytest.mark.parametrize('targets, rslora', [pytest.param(TARGETS, False, id='all'), pytest.param(
    ('q', 'v', 'down'), True, id='qv-down-rslora', marks=pytest.mark.exhaustive)])
def test_adapter_gradients_equal_peft(make_hf_checkpoint, seed, targets, rslora):
  """d loss / d (A, B) of a cross-entropy over random targets, against peft on transformers."""
  import torch
  directory, torch_model = make_hf_checkpoint(seed)
  settings = LoraConfig(rank=3, alpha=5.0, targets=targets, rslora=rslora)
  model = _adapted(directory, settings, seed)
  tokens = _tokens(seed, model.config.vocab_size)
  labels = np.random.default_rng(seed + 2).integers(0, model.config.vocab_size, tokens.shape)
  graphdef, trained, frozen = nnx.split(model, lora.Adapter, ...)

  def loss(trained):
    logits = nnx.merge(graphdef, trained, frozen)(tokens)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], axis=-1))

  value, grads = jax.value_and_grad(loss)(trained)
  reference = _peft_model(torch_model.float(), settings, lora.peft_tensors(nnx.state(model), settings))
  logits = reference(torch.tensor(tokens)).logits
  torch_loss = -torch.log_softmax(logits, -1).gather(-1, torch.tensor(labels)[..., None]).mean()
  torch_loss.backward()
  assert float(value) == pytest.approx(float(torch_loss), rel=1e-6)
  ours = lora.peft_tensors(nnx.merge_state(grads, frozen), settings)
  theirs = {name.replace('.default', ''): p.grad.numpy() for name, p in reference.named_parameters()
            if 'lora_' in name}
  assert set(ours) == set(theirs) and len(ours) == 2 * len(targets) * model.config.num_hidden_layers
  for name, grad in ours.items():
    np.testing.assert_allclose(grad, theirs[name], rtol=0, atol=1e-5, err_msg=name)
    assert np.abs(theirs[name]).max() > 1e-4, name  # a gradient that is there to compare


@pytest.mark.parametrize('family, targets, rslora', [
    pytest.param('qwen2', ('q', 'k', 'o', 'up'), False, id='qwen2', marks=pytest.mark.exhaustive),
    pytest.param('glm4', ('q', 'gate', 'up', 'down'), True, id='glm4-gate-up-rslora'),
    pytest.param('glm4', ('v', 'up'), False, id='glm4-up', marks=pytest.mark.exhaustive)])
def test_peft_export_loads_with_equal_logits(make_hf_checkpoint, seed, tmp_path, family, targets, rslora):
  """PEFT loads the exported adapters onto transformers' model with our logits. GLM-4's checkpoint
  holds gate and up as one module (mlp.gate_up_proj): their adapters export as one of rank k r."""
  import peft
  import torch
  from test_families import FAMILIES
  directory, torch_model = make_hf_checkpoint(seed, **(FAMILIES[family][0] if family != 'qwen2' else {}))
  settings = LoraConfig(rank=4, alpha=8.0, targets=targets, rslora=rslora)
  model = _adapted(directory, settings, seed)
  out = tmp_path / 'adapter'
  out.mkdir()
  lora.save_peft(nnx.state(model), settings, str(out), directory, model.config)
  loaded = peft.PeftModel.from_pretrained(torch_model.float(), str(out)).eval()
  tokens = _tokens(seed, model.config.vocab_size)
  with torch.no_grad():
    theirs = loaded(torch.tensor(tokens)).logits.numpy()
  ours = np.asarray(model(tokens))
  assert np.abs(ours - np.asarray(from_pretrained(directory, 'float32')(tokens))).max() > 1e-2  # the adapters act
  np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4)


@pytest.mark.exhaustive
def test_merged_weights_and_decoding_equal_unmerged(make_hf_checkpoint, seed):
  directory, _ = make_hf_checkpoint(seed)
  settings = LoraConfig(rank=4, targets=TARGETS)
  model = _adapted(directory, settings, seed)
  plain = dataclasses.replace(model.options, lora=None)
  merged = nnx.merge(nnx.graphdef(abstract_model(model.config, plain)), lora.merged(nnx.state(model), settings))
  tokens = _tokens(seed, model.config.vocab_size)
  np.testing.assert_allclose(np.asarray(model(tokens)), np.asarray(merged(tokens)), rtol=0, atol=2e-5)
  # Decoding: a prefill and three one-token steps through the KV cache, adapters applied unmerged.
  outputs = []
  for policy in (model, merged):
    cache = policy.init_cache(tokens.shape[0], tokens.shape[1] + 3)
    logits, cache = policy.extend(jnp.asarray(tokens), cache)
    steps = [logits]
    for _ in range(3):
      logits, cache = policy.extend(jnp.argmax(logits[:, -1:], -1).astype(jnp.int32), cache)
      steps.append(logits)
    outputs.append(np.concatenate([np.asarray(s) for s in steps], axis=1))
  np.testing.assert_allclose(outputs[0], outputs[1], rtol=0, atol=2e-5)


def test_reference_policy_is_the_base(make_hf_checkpoint, seed):
  """pi_ref with LoRA: the state's own base with the adapters off, equal to the base model."""
  directory, _ = make_hf_checkpoint(seed)
  model = _adapted(directory, LoraConfig(rank=4, targets=TARGETS), seed)
  graphdef, state = nnx.split(model)
  trained, frozen = lora.split_trainable(state)
  reference = nnx.merge(graphdef, lora.join(lora.adapters_off(trained), frozen))
  tokens = _tokens(seed, model.config.vocab_size)
  base = np.asarray(from_pretrained(directory, 'float32')(tokens))
  assert np.abs(np.asarray(model(tokens)) - base).max() > 1e-2
  np.testing.assert_array_equal(np.asarray(reference(tokens)), base)


def test_only_adapters_train(tmp_path):
  """The optimizer state mirrors the adapters alone; the base lies in the state's `frozen`, in the
  compute dtype, and a checkpoint would not hold it."""
  from grpo_jax.build import build_rl_step, build_task
  from grpo_jax import sharding
  from grpo_jax.rl.state import create_train_state
  config = config_lib.load_config('configs/tiny_arith_lora.yaml', ['model.dtype=bfloat16', 'algo.kl_beta=0.1'])
  mesh = sharding.make_mesh(config.mesh, devices=jax.devices()[:1])
  model = config.model.build(mesh, 0)
  step = build_rl_step(config, model, mesh, build_task(config))
  trained, frozen = lora.split_trainable(nnx.state(model))
  state = create_train_state(trained, step.optimizer, 0, shardings=step.state_shardings, frozen=frozen)
  adapter_shapes = sorted(x.shape for x in jax.tree.leaves(trained))
  assert adapter_shapes and all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.params))
  assert {x.dtype for x in jax.tree.leaves(state.frozen)} == {jnp.dtype(jnp.bfloat16)}
  moments = [x.shape for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
  assert sorted(moments) == sorted(adapter_shapes * 2)  # AdamW's mu and nu, of the adapters only
  assert state.checkpointed().frozen is None
  assert len(jax.tree.leaves(state.policy)) == len(jax.tree.leaves(trained)) + len(jax.tree.leaves(frozen))


@pytest.mark.parametrize('override, field', [
    ('model.lora.rank=0', 'model.lora.rank'), ('model.lora.targets=[q, qkv]', 'model.lora.targets'),
    ('model.lora.dropout=0.05', 'model.lora.dropout'), ('model.lora.alpha=-1', 'model.lora.alpha')])
def test_bad_lora_settings_are_one_line_errors(override, field):
  with pytest.raises(UserError) as error:
    config_lib.load_config('configs/tiny_arith_lora.yaml', [override])
  assert field in str(error.value) and '\n' not in str(error.value), str(error.value)


@pytest.mark.exhaustive
def test_rollout_layout_carries_the_adapters(make_hf_checkpoint, seed):
  """The sampler's own tensor-parallel layout (sampler/layout.py) lays the adapters out with their
  weights: sampled from an FSDP mesh of 8 into tensor groups of 4, the rollout equals one device's."""
  from grpo_jax.model import MeshConfig, make_mesh
  from grpo_jax.sampler import DecodeSettings, SamplingConfig
  from grpo_jax.sampler.layout import rollout_layout
  from grpo_jax.sampler.rollout import GroupSampler
  from grpo_jax.testing import left_padded, random_prompts
  directory, _ = make_hf_checkpoint(seed, vocab_size=1024, hidden_size=64, intermediate_size=128)
  settings = LoraConfig(rank=8, targets=TARGETS)
  tokens, mask = left_padded(random_prompts(seed, [5, 17, 11, 3], vocab=1024))
  decode = DecodeSettings(max_new_tokens=10, sampling=SamplingConfig(temperature=1.0))

  def sample(model, layout=None):
    sampler = GroupSampler(model, group_size=2, settings=decode, slots=0, layout=layout)
    return jax.device_get(sampler(nnx.state(model), tokens, mask, jax.random.key(3)))

  one = _adapted(directory, settings, seed)
  reference = sample(one)
  mesh = make_mesh(MeshConfig(1, 8, 1))
  with jax.set_mesh(mesh):
    model = _adapted(directory, settings, seed, mesh=mesh)
    layers = nnx.state(model)['layers']
    # FSDP splits every factor once: A of q by D, B of q (no D) by its rank, B of o by its rank.
    assert [layers[name][...].sharding.spec[1] for name in ('q_lora_a', 'q_lora_b', 'o_lora_b')] == ['fsdp'] * 3
    layout = rollout_layout(model, mesh, 4)
    resident = layout.place(nnx.state(model))
    assert resident['layers']['q_lora_b'][...].sharding.spec[2] == 'tensor'  # B split by its heads
    rollout = sample(model, layout)
  for name in ('tokens', 'mask', 'lengths'):
    np.testing.assert_array_equal(np.asarray(getattr(rollout, name)), np.asarray(getattr(reference, name)), err_msg=name)
  np.testing.assert_allclose(np.asarray(rollout.log_probs), np.asarray(reference.log_probs), rtol=1e-5, atol=1e-5)
  base = sample(from_pretrained(directory, 'float32'))
  assert not np.array_equal(np.asarray(base.tokens), np.asarray(reference.tokens))  # the adapters steer it


def test_step_flops_count_no_weight_gradients_of_the_base():
  from grpo_jax.metrics import model_flops_per_step
  from grpo_jax.rl.algo import AlgoConfig
  from grpo_jax.sampler.rollout import RolloutConfig
  rollout, algo = RolloutConfig(prompts_per_step=2, max_new_tokens=3), AlgoConfig(group_size=2)
  sampled, trained = 2 * 4 + 4 * 3, 4 * (4 + 3)  # prompts once + completions; rows x (prompt + completion)
  assert model_flops_per_step(100, 4, rollout, algo) == 2 * 100 * sampled + 6 * 100 * trained
  assert model_flops_per_step(100, 4, rollout, algo, adapter_params=10) == 2 * 110 * sampled + (4 * 100 + 6 * 10) * trained
