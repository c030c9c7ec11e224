"""What works where: every rollout path by every model kind, each cell the tests that show it (on
one device and on a mesh, against the path's one-device or non-composed reference), the test of
the one-line refusal that stops it at start, or what is still open.

docs/rollout-paths.md's table is `markdown()` of this table, and
tests/test_rollout_matrix.py checks both ways: every test named here is collected by pytest under
that id, every refusal's test is named, and docs/rollout-paths.md holds exactly this table. Run
`python tests/rollout_matrix.py` to print it.
"""

import dataclasses

PATHS = {
    'group': 'group sampler',
    'partial': 'partial rollouts (`algo.max_lag`)',
    'split': 'split devices (`rollout.devices`)',
    'agents': 'agents (inference server)',
    'generate': '`generate`',
    'serve': '`serve`',
}
KINDS = {
    'dense': 'dense',
    'moe': 'MoE, routing replay',
    'vl': 'VL',
    'lora': 'LoRA',
    'lora-moe': 'LoRA on MoE',
    'lora-vl': 'LoRA on VL',
}


@dataclasses.dataclass(frozen=True)
class Cell:
  """one_device / mesh: pytest ids (file::test[param]) of the tests that compare the path on one
  device / on a mesh with its reference; refused: the test id of the refusal at start, with the
  config field it names; one_device_refused: the same for a path that cannot run on one device (its
  mesh side tested); note: what the tests show, or what is still open."""

  one_device: tuple[str, ...] = ()
  mesh: tuple[str, ...] = ()
  refused: tuple[str, str] | None = None
  one_device_refused: tuple[str, str] | None = None
  note: str = ''

  @property
  def status(self) -> str:
    if self.refused:
      return 'refused'
    alone = self.one_device or self.one_device_refused
    if alone and self.mesh:
      return 'tested'
    if alone or self.mesh:
      return 'partly tested'
    return 'open'


_REFUSE_LAG = 'tests/test_partial.py::test_lag_with_dynamic_sampling_or_agents_is_refused[agent]'
# LoRA on each path against the merged model (one device, and the adapted model on a mesh).
_LORA = 'tests/test_lora_paths.py::test_lora_sampling_equals_the_merged_model'
# A split needs a device for each side: on one device rollout.devices is refused at start.
_SPLIT_ALONE = ('tests/test_bad_inputs.py::test_split_devices_on_a_host_of_one_device', 'rollout.devices')
# A LoRA run's workdir served, on 8 devices and on one (each run shows both sides).
_SERVE_LORA = 'tests/test_lora_paths.py::test_serve_decodes_a_lora_run_of_each_kind'
_REFUSE_SPLIT = 'tests/test_bad_inputs.py::test_split_devices_an_agent_task_cannot_take'

CELLS = {
    ('group', 'dense'): Cell(
        ('tests/test_rollout.py::test_greedy_matches_transformers_generate[scan-qwen2]',),
        ('tests/test_rollout_layout.py::test_rollout_in_the_sampler_layout_equals_one_device[2x2x2-t4-t1-slots0]',
         'tests/test_mesh_equivalence.py::test_jittable_task_on_a_mesh_equals_one_device[2x2x2]'),
        note='transformers\' greedy generate; RL steps on a mesh equal one device'),
    ('group', 'moe'): Cell(
        ('tests/test_moe.py::test_replay_routes_to_the_recorded_experts_with_live_gates',),
        ('tests/test_moe_mesh.py::test_moe_rl_steps_on_an_expert_mesh_equal_one_device[fsdp-x-tensor-x-expert]',),
        note='recorded routes equal the full forward\'s; RL steps on fsdp x tensor x expert equal one device'),
    ('group', 'vl'): Cell(
        ('tests/test_vision_rl.py::test_image_prompts_through_the_slots_equal_generate_and_the_updates_log_probs',),
        ('tests/test_vision_rl.py::test_vision_rl_steps_on_a_mesh_equal_one_device',),
        note='transformers\' generate on the same pixels; RL steps on (2, 2, 2) equal one device'),
    ('group', 'lora'): Cell(
        (f'{_LORA}[group-dense]',),
        ('tests/test_lora.py::test_rollout_layout_carries_the_adapters',),
        note='the adapters equal their merged weights; the sampler\'s layout on fsdp 8 equals one device'),
    ('group', 'lora-moe'): Cell(
        (f'{_LORA}[group-moe]',), (f'{_LORA}[group-moe-mesh]',),
        note="attention adapters (routed experts' adapters are refused at build: model.lora.targets), on fsdp x tensor x "
             'expert'),
    ('group', 'lora-vl'): Cell(
        (f'{_LORA}[group-vl]',), (f'{_LORA}[group-vl-mesh]',),
        note='image prompts; on data x fsdp x tensor'),
    ('partial', 'dense'): Cell(
        ('tests/test_partial.py::test_carried_groups_equal_one_call[lag1]',),
        ('tests/test_partial.py::test_carried_groups_equal_one_call[lag1-mesh]',),
        note='carried groups equal one call of the group sampler'),
    ('partial', 'moe'): Cell(
        ('tests/test_partial.py::test_carried_groups_equal_one_call[lag1-moe-routes]',),
        ('tests/test_moe_mesh.py::test_moe_partial_rollouts_resume_on_another_expert_size_equal_uninterrupted',),
        note='carried groups and their routes equal one call\'s; resumed on another expert size equals the '
             'uninterrupted run'),
    ('partial', 'vl'): Cell(
        ('tests/test_vision_rl.py::test_partial_rollouts_carry_image_prompts_as_one_call_samples_them[one-device]',),
        ('tests/test_vision_rl.py::test_partial_rollouts_carry_image_prompts_as_one_call_samples_them[mesh]',),
        note='carried groups (answers prefilled again over the image prompt) equal one call; on data x fsdp x '
             'tensor'),
    ('partial', 'lora'): Cell(
        (f'{_LORA}[partial-dense]',), (f'{_LORA}[partial-dense-mesh]',),
        note='on data x fsdp x tensor'),
    ('partial', 'lora-moe'): Cell(
        (f'{_LORA}[partial-moe]',), (f'{_LORA}[partial-moe-mesh]',),
        note='attention adapters, on fsdp x tensor x expert'),
    ('partial', 'lora-vl'): Cell(
        (f'{_LORA}[partial-vl]',), (f'{_LORA}[partial-vl-mesh]',),
        note='image prompts carried over steps; on data x fsdp x tensor, group by group (which groups leave at a '
             'step depends on the mesh)'),
    ('split', 'dense'): Cell(
        one_device_refused=_SPLIT_ALONE, mesh=('tests/test_split.py::test_every_token_is_its_versions_sample',),
        note='4 trainer + 4 sampler devices: each token is its version\'s teacher-forced sample'),
    ('split', 'moe'): Cell(
        one_device_refused=_SPLIT_ALONE, mesh=('tests/test_split.py::test_a_mixture_on_split_devices_samples_each_version_and_records_its_routes',),
        note='4 + 4 devices: each token is its version\'s teacher-forced sample; every fed token\'s routes recorded'),
    ('split', 'vl'): Cell(
        one_device_refused=_SPLIT_ALONE,
        mesh=('tests/test_vision_math.py::test_split_devices_sample_image_prompts_as_their_versions[full]',),
        note='4 + 4 devices, teacher-forced per version through the vision tower'),
    ('split', 'lora'): Cell(
        one_device_refused=_SPLIT_ALONE, mesh=('tests/test_split.py::test_lora_on_split_devices_samples_each_version[dense]',),
        note='4 + 4 devices: each token is its version\'s sample (adapters joined with the base), teacher-forced'),
    ('split', 'lora-moe'): Cell(
        one_device_refused=_SPLIT_ALONE, mesh=('tests/test_split.py::test_lora_on_split_devices_samples_each_version[moe]',),
        note='4 + 4 devices, attention adapters with routing replay: each token is its version\'s sample'),
    ('split', 'lora-vl'): Cell(
        one_device_refused=_SPLIT_ALONE,
        mesh=('tests/test_vision_math.py::test_split_devices_sample_image_prompts_as_their_versions[lora]',),
        note='4 + 4 devices, adapters on q, v and gate: each token is its version\'s sample with the images'),
    ('agents', 'dense'): Cell(
        ('tests/test_agents.py::test_server_tokens_equal_the_group_sampler',),
        ('tests/test_agents.py::test_agent_steps_on_a_mesh_equal_one_device',),
        note='the server\'s tokens equal the group sampler\'s; RL steps on (1, 8, 1) and (2, 2, 2) equal one device'),
    ('agents', 'moe'): Cell(
        ('tests/test_agents_moe.py::test_agent_turns_on_a_mixture_record_the_routes_the_update_replays',
         'tests/test_agents_moe.py::test_the_agent_task_trains_a_mixture_replaying_the_servers_routes'),
        ('tests/test_agents_moe.py::test_agent_steps_on_a_mixture_over_the_expert_axis_equal_one_device',),
        note='recorded routes equal the full forward\'s, replayed by the update; RL steps on fsdp x tensor x expert '
             'equal one device'),
    ('agents', 'vl'): Cell(
        ('tests/test_agent_images.py::test_two_turns_with_an_image_each_answer_as_transformers',
         'tests/test_agent_images.py::test_the_update_reads_the_images_the_server_showed'),
        ('tests/test_agent_images.py::test_image_agent_steps_on_a_mesh_equal_one_device',),
        note='an image in each of two turns: transformers\' greedy answers; the update reads the server\'s images; '
             'RL steps on fsdp x tensor equal one device'),
    ('agents', 'lora'): Cell(
        (f'{_LORA}[agents-dense]',), (f'{_LORA}[agents-dense-mesh]',),
        note='on data x fsdp x tensor'),
    ('agents', 'lora-moe'): Cell(
        (f'{_LORA}[agents-moe]',), (f'{_LORA}[agents-moe-mesh]',),
        note='attention adapters, on fsdp x tensor x expert'),
    ('agents', 'lora-vl'): Cell(
        (f'{_LORA}[agents-vl]',), (f'{_LORA}[agents-vl-mesh]',),
        note='requests with images; on data x fsdp x tensor'),
    ('generate', 'dense'): Cell(
        ('tests/test_generate_cli.py::test_greedy_json_matches_transformers[one-device]',),
        ('tests/test_generate_cli.py::test_greedy_json_matches_transformers[mesh]',),
        note='transformers\' greedy generate, on a data 4 x tensor 2 serving mesh and on a host of one device'),
    ('generate', 'moe'): Cell(
        ('tests/test_generate_cli.py::test_a_mixture_generates_over_the_expert_axis_as_transformers_does[one-device]',),
        ('tests/test_generate_cli.py::test_a_mixture_generates_over_the_expert_axis_as_transformers_does[mesh]',),
        note='transformers\' greedy generate, tensor pairs with the experts over the expert axis'),
    ('generate', 'vl'): Cell(
        ('tests/test_vision_rl.py::test_generate_takes_images_as_transformers_does[one-device]',),
        ('tests/test_vision_rl.py::test_generate_takes_images_as_transformers_does[mesh]',),
        note='transformers\' generate on the same pixels'),
    ('generate', 'lora'): Cell(
        refused=('tests/test_lora_train.py::test_lora_exports_as_peft_and_merged', '--ckpt'),
        note='generate reads model directories: a run\'s workdir is refused, naming serve (which decodes a LoRA run) '
             'and the merged export'),
    ('generate', 'lora-moe'): Cell(
        refused=('tests/test_lora_train.py::test_lora_exports_as_peft_and_merged', '--ckpt'),
        note='the same line for a LoRA run of any kind (generate reads its merged export)'),
    ('generate', 'lora-vl'): Cell(
        refused=('tests/test_lora_train.py::test_lora_exports_as_peft_and_merged', '--ckpt'),
        note='the same line for a LoRA run of any kind (generate reads its merged export)'),
    ('serve', 'dense'): Cell(
        ('tests/test_engine.py::test_greedy_matches_transformers_and_log_probs_match_full_forward[qwen2]',),
        ('tests/test_serve.py::test_hostile_clients_never_change_another_clients_answer',),
        note='transformers\' greedy generate and the full forward\'s log-probs'),
    ('serve', 'moe'): Cell(
        ('tests/test_engine.py::test_serve_lays_a_mixture_over_the_expert_axis_and_matches_transformers[one-device]',),
        ('tests/test_engine.py::test_serve_lays_a_mixture_over_the_expert_axis_and_matches_transformers[mesh]',
         'tests/test_serve.py::test_a_mixture_served_over_the_expert_axis_answers_as_transformers_through_grpc'),
        note='transformers\' greedy generate, tensor pairs with the experts and slots over the expert axis: serve\'s '
             'engine, and the server through JetStream\'s gRPC client'),
    ('serve', 'vl'): Cell(
        ('tests/test_serve.py::test_image_requests_equal_transformers_and_bad_images_are_refused_alone[one-device]',),
        ('tests/test_serve.py::test_image_requests_equal_transformers_and_bad_images_are_refused_alone[mesh]',),
        note='transformers\' generate, through the gRPC server'),
    ('serve', 'lora'): Cell(
        (f'{_SERVE_LORA}[dense]',),
        (f'{_SERVE_LORA}[dense]', 'tests/test_lora_train.py::test_lora_exports_as_peft_and_merged'),
        note='a LoRA run\'s workdir served on 8 devices and on one: the engine decodes the restored policy\'s greedy '
             'tokens and log-probs (a full forward per step)'),
    ('serve', 'lora-moe'): Cell(
        (f'{_SERVE_LORA}[moe]',), (f'{_SERVE_LORA}[moe]',),
        note='attention adapters, the experts over the expert axis: the restored policy\'s greedy tokens and '
             'log-probs'),
    ('serve', 'lora-vl'): Cell(
        (f'{_SERVE_LORA}[vl]',), (f'{_SERVE_LORA}[vl]',),
        note='adapters in the decoder: the restored policy\'s greedy tokens and log-probs'),
}
# Refusals at start that no cell above needs, since the path cannot take any model kind: each one
# a combination of paths.
COMBINATIONS = {
    'agents with partial rollouts': (_REFUSE_LAG, 'algo.max_lag'),
    'agents on split devices': (_REFUSE_SPLIT, 'rollout.devices'),
}


def named_tests() -> set[str]:
  """Every pytest id the table names."""
  ids = {test for cell in CELLS.values() for test in (*cell.one_device, *cell.mesh)}
  ids |= {refused[0] for cell in CELLS.values() for refused in (cell.refused, cell.one_device_refused) if refused}
  return ids | {test for test, _ in COMBINATIONS.values()}


def _short(test: str) -> str:
  return f'`{test.split("::", 1)[1]}`'


def markdown() -> str:
  """docs/rollout-paths.md's table: a row per path, a column per kind, each cell its status; then the tests."""
  lines = ['| path | ' + ' | '.join(KINDS.values()) + ' |', '|---' * (len(KINDS) + 1) + '|']
  for path, path_name in PATHS.items():
    lines.append(f'| {path_name} | ' + ' | '.join(CELLS[path, kind].status for kind in KINDS) + ' |')
  lines.append('')
  for (path, kind), cell in CELLS.items():
    tests = [f'one device: {", ".join(map(_short, cell.one_device))}'] if cell.one_device else []
    tests += [f'mesh: {", ".join(map(_short, cell.mesh))}'] if cell.mesh else []
    tests += [f'refused ({cell.refused[1]}): {_short(cell.refused[0])}'] if cell.refused else []
    tests += [f'one device refused ({cell.one_device_refused[1]}): {_short(cell.one_device_refused[0])}'] \
        if cell.one_device_refused else []
    detail = '; '.join(tests + ([cell.note] if cell.note else []))
    lines.append(f'- {PATHS[path]} x {KINDS[kind]}: **{cell.status}**' + (f'. {detail}' if detail else ''))
  for name, (test, field) in COMBINATIONS.items():
    lines.append(f'- {name}: **refused** ({field}): {_short(test)}')
  return '\n'.join(lines) + '\n'


if __name__ == '__main__':
  print(markdown(), end='')
