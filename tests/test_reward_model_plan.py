"""grpo_jax.plan with a reward model as a reward term (data/reward_terms.py RewardModelTerm): its
weights per device, held beside every program that does not take them, its program compiled on the
step's rows and its forward in the step's estimate, against hand counts from its architecture. The
tiny run's programs are compiled by XLA:CPU over this host's 8 devices standing in for 8 H100s (the
target compilers are slow: test_plan.py's); the 8B recipe is planned for h100x8 by XLA:GPU."""

import dataclasses
import json
import os

import jax
import pytest

from grpo_jax import config as config_lib
from grpo_jax import sharding
from grpo_jax.errors import UserError
from grpo_jax.plan import report as plan, targets
from grpo_jax.plan.programs import model_architecture, step_programs
from test_deviceless import _run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The tiny reward model: D, F, L, N query heads, K KV heads, H head dim, V; Qwen2's q/k/v biases.
D, F, L, N, K, H, V = 32, 64, 2, 4, 2, 8, 64
TINY = dict(architectures=['Qwen2ForSequenceClassification'], model_type='qwen2', hidden_size=D, intermediate_size=F,
            num_hidden_layers=L, num_attention_heads=N, num_key_value_heads=K, vocab_size=V,
            max_position_embeddings=128, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
            id2label={'0': 'LABEL_0'}, label2id={'LABEL_0': 0}, pad_token_id=0)


def hand_counts(d, f, layers, heads, kv, head_dim, vocab, biases: bool, qk_norm: bool) -> tuple[int, int]:
  """(parameters the FSDP axis splits, parameters every device holds whole) of a one-label
  sequence classifier: the matrices (embedding [V, D], q/k/v/o, the SwiGLU's three, the score head
  [D, 1]) have D over 'fsdp'; the norms (and biases, Qwen3's q/k norms) are replicated."""
  split = vocab * d + layers * (2 * d * heads * head_dim + 2 * d * kv * head_dim + 3 * d * f) + d
  whole = layers * (2 * d + (heads * head_dim + 2 * kv * head_dim) * biases + 2 * head_dim * qk_norm) + d
  return split, whole


class _HostTarget(targets.Target):
  """h100x8's figures, its programs compiled for this host's 8 CPU devices."""

  def devices(self):
    return jax.devices()[:8]


H100X8 = _HostTarget(**dict(dataclasses.asdict(targets.parse_target('h100x8')), platform='cpu'))


def _tiny_run(tmp_path, architecture: dict = TINY):
  directory = tmp_path / 'reward_model'
  directory.mkdir(exist_ok=True)
  (directory / 'config.json').write_text(json.dumps(architecture))
  # tiny_math's shapes: P = 32 prompts of Tp = 28 tokens, G = 8 answers of N = 3 tokens; beta > 0: a pi_ref.
  return config_lib.load_config(os.path.join(ROOT, 'configs', 'tiny_math.yaml'), [
      'algo.dynamic_sampling=false', 'algo.kl_beta=0.01',
      f'rewards=[{{name: math}}, {{name: reward_model, path: {directory}, dtype: float32, normalize: group}}]'])


def test_the_plan_counts_a_reward_models_weights_program_and_forward(tmp_path):
  config = _tiny_run(tmp_path)
  architecture = model_architecture(config, None, None)
  report = plan.plan(config, H100X8, architecture, only={'reward_model'})

  split, whole = hand_counts(D, F, L, N, K, H, V, biases=True, qk_norm=False)
  scoring = report['reward_models']['reward_model']
  assert scoring['parameters'] == split + whole
  per_device = report['per_device']
  assert per_device['reward_models'] == (split // 8 + whole) * 4  # float32, split 8 ways by FSDP

  (program,) = report['programs']
  assert program['name'] == 'reward_model' and program['compiled_peak'] > 0
  assert program['arguments'] >= per_device['reward_models']
  # Beside it for the step: the train state and pi_ref, which it does not take.
  assert program['beside'] == dict(parameters=per_device['parameters'], optimizer_state=per_device['optimizer_state'],
                                   reference=per_device['reference'])
  assert program['peak'] == program['compiled_peak'] + per_device['parameters'] + per_device['optimizer_state'] + \
      per_device['reference'] == report['peak']
  assert sum(program['collectives']['outside'].values()) > 0  # the weights' FSDP gathers

  # One forward over the step's 32 x 8 rows of 28 + 3 tokens, 2 FLOPs per parameter and token.
  flops = 2 * (split + whole) * 32 * 8 * (28 + 3)
  estimate = report['estimate']
  part = estimate['programs']['reward_model']
  assert part['flops'] == estimate['reward_model_flops'] == flops
  assert part['compute_s'] == pytest.approx(flops / (8 * H100X8.peak_flops), rel=1e-12)
  assert part['hbm_s'] == pytest.approx(scoring['bytes'] / H100X8.hbm_bandwidth, rel=1e-12)
  assert part['program_s'] == max(part['compute_s'], part['hbm_s'], part['interconnect_s']) > 0
  assert estimate['step_s'] - estimate['step_without_reward_models_s'] == pytest.approx(part['program_s'], rel=1e-9)
  text = plan.format_report(report)
  assert 'reward models' in text and 'program "reward_model"' in text and "reward models' forward" in text


def test_the_reward_models_weights_lie_beside_every_program_that_does_not_take_them(tmp_path):
  """The rollout takes the policy's weights, the update the train state and pi_ref: each holds the
  reward model's weights beside it (and the rollout the optimizer state and pi_ref), so the fit
  check counts them in every program's peak."""
  config = _tiny_run(tmp_path)
  mesh = sharding.make_mesh(config.mesh, jax.devices()[:8])
  built = step_programs(config, model_architecture(config, None, None), mesh)
  assert [name for name, _, _ in built.programs] == ['rollout', 'reward_model', 'update']
  split, whole = hand_counts(D, F, L, N, K, H, V, biases=True, qk_norm=False)
  weights = (split // 8 + whole) * 4
  devices = list(mesh.devices.reshape(-1))
  beside = {name: plan.held_beside(args, built.resident, devices) for name, _, args in built.programs}
  state = built.state
  assert beside['rollout'] == dict(optimizer_state=sharding.bytes_per_device(state.opt_state),
                                   reference=sharding.bytes_per_device(built.held.reference), reward_models=weights)
  assert beside['update'] == dict(reward_models=weights)
  assert beside['reward_model'] == dict(parameters=sharding.bytes_per_device(state.params),
                                        optimizer_state=sharding.bytes_per_device(state.opt_state),
                                        reference=sharding.bytes_per_device(built.held.reference))


def test_a_reward_model_the_plan_cannot_read_is_refused_in_one_line(tmp_path):
  config = _tiny_run(tmp_path)
  mesh = sharding.make_mesh(config.mesh, jax.devices()[:8])
  architecture = model_architecture(config, None, None)
  (tmp_path / 'reward_model' / 'config.json').unlink()
  with pytest.raises(UserError, match=r'^reward term .reward_model.: path \S+reward_model has no config.json') as error:
    step_programs(config, architecture, mesh)
  assert '\n' not in str(error.value)
  language_model = {key: value for key, value in TINY.items() if key not in ('id2label', 'label2id', 'pad_token_id')}
  config = _tiny_run(tmp_path, dict(language_model, architectures=['Qwen2ForCausalLM']))
  with pytest.raises(UserError, match=r'is a language model \(Qwen2ForCausalLM\), not a reward model') as error:
    step_programs(config, architecture, mesh)
  assert '\n' not in str(error.value)


@pytest.mark.exhaustive
@pytest.mark.starts_first
@pytest.mark.long
def test_the_reward_model_recipe_is_planned_for_8_h100s(tmp_path):
  """configs/qwen3_8b_hh_reward_model.yaml by XLA:GPU for 8 H100s, the policy at 2 of its layers
  (its programs' shapes otherwise the recipe's), the 8B reward model whole from its config.json:
  its bf16 weights an eighth per device, its program's FSDP gathers at least the seven eighths
  each device lacks, its forward's FLOPs in the estimate, and it fits."""
  report_path = tmp_path / 'plan.json'
  result = _run('gpu', ['grpo_jax.plan', '--config', 'configs/qwen3_8b_hh_reward_model.yaml', '--model-size', 'Qwen3-8B',
                        '--layers', '2', '--target', 'h100x8', '--no-advice', '--json', str(report_path)], timeout=900)
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
  report = json.loads(report_path.read_text())
  assert [program['name'] for program in report['programs']] == ['rollout', 'reward_model', 'update']
  # Skywork-Reward-V2-Qwen3-8B: Qwen3-8B's shapes (no biases, q/k norms) with a score head.
  split, whole = hand_counts(4096, 12288, 36, 32, 8, 128, 151936, biases=False, qk_norm=True)
  assert report['reward_models']['reward_model']['parameters'] == split + whole
  weights = (split // 8 + whole) * 2
  assert report['per_device']['reward_models'] == weights
  programs = {program['name']: program for program in report['programs']}
  assert programs['rollout']['beside']['reward_models'] == programs['update']['beside']['reward_models'] == weights
  scoring = programs['reward_model']
  assert scoring['arguments'] >= weights and 'reward_models' not in scoring['beside']
  assert scoring['collectives']['outside'].get('all-gather', 0) >= 7 * weights * 0.99
  assert report['estimate']['reward_model_flops'] == 2 * (split + whole) * 512 * (1024 + 1024)
  assert report['fits'] and report['peak'] == max(program['peak'] for program in report['programs'])
