"""The tool-use environment (agents/tool_use.py) and the bounded workers behind it
(grpo_jax/workers.py): hostile tool calls become short error observations (hangs, crashes, floods,
memory, network, signals to the trainer, special tokens in the output), observations follow the
chat template (Qwen2.5's tool-response layout), a scripted policy's episode is answered and scored
turn by turn, and the tool-use recipe runs its first RL steps on the CPU."""

import asyncio
import functools
import json
import os

import jax
import numpy as np
import pytest

from grpo_jax import config as config_lib
from grpo_jax import sandbox
from grpo_jax.agents import task as agent_task
from grpo_jax.agents import text, tool_use, tools
from grpo_jax.agents.inference import Completion
from grpo_jax.errors import UserError
from grpo_jax.workers import WorkerPool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, 'configs', 'qwen2_5_3b_gsm8k_tool.yaml')
# A ChatML template with tool messages laid out as Qwen2.5's template lays them out (written for
# these tests; transformers renders with trim_blocks, hence the newlines as expressions): the
# tools in a system turn, consecutive tool results in one user turn, each in <tool_response> tags.
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call these tools:\n<tools>{% for tool in tools %}\n"
    "{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\nCall one as <tool_call>{\"name\": ..., \"arguments\": {...}}"
    "</tool_call><|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n<tool_response>\\n' }}{{ m.content }}\n</tool_response>"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Qwen2.5's layout of a tool result after an assistant turn that ended on <|im_end|>.
QWEN_OBSERVATION = '\n<|im_start|>user\n<tool_response>\n{}\n</tool_response><|im_end|>\n<|im_start|>assistant\n'


def tool_tokenizer_dir(directory) -> str:
  from test_math_task import chat_tokenizer_dir
  chat_tokenizer_dir(directory)
  path = os.path.join(directory, 'tokenizer_config.json')
  with open(path) as f:
    settings = json.load(f)
  with open(path, 'w') as f:
    json.dump(dict(settings, chat_template=TOOL_TEMPLATE), f)
  return str(directory)


def write_gsm8k(path, count: int) -> str:
  with open(path, 'w') as f:
    for i in range(count):
      f.write(json.dumps({'question': f'Tom has {i + 2} apples and buys {i + 3} more. How many?',
                          'answer': f'{i + 2} + {i + 3} = {2 * i + 5}\n#### {2 * i + 5}'}) + '\n')
  return str(path)


@pytest.fixture(scope='module')
def pool():
  """The tool workers as tool_use makes them: each Python call in a sandbox of its own, 3 s at most."""
  limits = sandbox.Limits(timeout_s=3.0, cpu_s=3)
  sandbox.check(limits)
  with WorkerPool(2, tools.work, warmup=('math', '\\boxed{1}', '1'), setup=functools.partial(tools.worker_setup, 'bwrap',
                  limits), timeout_s=3.0 + tool_use.SANDBOX_MARGIN_S, memory_bytes=1 << 30, name='tool worker') as pool:
    yield pool


HOSTILE = [  # (code, a piece of the observation); every one is a tool error
    ('while True:\n  pass', 'error: the python call ran past its 3 s limit'),
    ('import os\nos._exit(3)', ''),
    ('x = bytearray(8 << 30)', 'MemoryError'),
    ('import socket\nsocket.create_connection(("10.1.2.3", 80))', 'OSError: [Errno 101] Network is unreachable'),
    ('raise SystemExit(ValueError("x"))', 'x'),
    ('print(1/0)', 'ZeroDivisionError: division by zero'),
]


def test_hostile_python_is_bounded_in_the_workers(pool):
  """Each hostile script in its own item: the others run on, no worker is lost (each call's sandbox
  ends it), and a flood of output is cut at the tool's limit. Containment itself: test_sandbox.py."""
  futures = [pool.submit('python', code) for code, _ in HOSTILE]
  flood = pool.submit('python', 'print("x" * 10_000_000)')
  fine = pool.submit('python', 'import math\nprint(math.comb(10, 3) * 2)')
  for (code, expected), future in zip(HOSTILE, futures):
    text, failed = future.result(timeout=120)
    assert failed and expected in text, (code, text)
  assert fine.result(timeout=60) == ('240', False)
  text, failed = flood.result(timeout=60)
  assert not failed and len(text) < 1100 and text.endswith('(9999001 more characters cut)')  # print's newline too
  assert pool.failures == 0
  assert pool.map([('calculator', '2 ** 10000'), ('math', 'so \\boxed{7}', '7')]) == \
      [('error: exponent 10000 is past 1000', True), 1.0]


def test_the_pools_calls_hold_their_memory_together(capsys):
  """Each Python call's processes hold their worker's share of the pool's budget (its cgroup's or
  the rlimits' bound, sandbox.py), so the calls running at once stay within it; the run says which
  bound holds on this machine."""
  import types
  for workers in (1, 3, 4, 8, 64):
    assert workers * tool_use.call_memory_bytes(workers) <= tool_use.TOOL_MEMORY_BYTES
  assert [tool_use.call_memory_bytes(workers) for workers in (1, 4, 8)] == [1 << 30, 1 << 30, 512 << 20]
  task = types.SimpleNamespace(sandbox='bwrap', tool_timeout_s=3.0, reward_workers=8)
  setup = tool_use._worker_setup(task, ('python',))
  assert setup.args[1].memory_bytes == 512 << 20
  said = capsys.readouterr().err
  assert said.startswith("task.sandbox: bwrap: a call's processes hold 512 MiB together: ") and said.count('\n') == 1


def test_a_pool_serves_async_callers_while_one_item_hangs(pool):
  """An event loop awaits several calls; one that hangs holds one worker until its deadline while
  the other worker answers the rest."""
  async def run():
    hung = asyncio.ensure_future(pool.call('python', 'import time\ntime.sleep(60)'))
    await asyncio.sleep(0.2)
    quick = await asyncio.gather(*(pool.call('calculator', f'{i} * 3') for i in range(6)))
    answered_first = not hung.done()  # the quick ones came back while the hung call still held its worker
    return await hung, quick, answered_first

  hung, quick, answered_first = asyncio.run(run())
  assert hung == ('error: the python call ran past its 3 s limit', True)
  assert quick == [(str(3 * i), False) for i in range(6)] and answered_first


def test_observations_follow_the_chat_template(tmp_path):
  from grpo_jax.model import load_tokenizer
  tokenizer = load_tokenizer(tool_tokenizer_dir(tmp_path))
  schemas = [tools.SCHEMAS['python']]
  layout = text.message_format(tokenizer, True, schemas)
  assert (layout.turn_end, layout.before + '{}' + layout.after) == ('<|im_end|>', '<|im_end|>' + QWEN_OBSERVATION)
  plain = text.message_format(tokenizer, False, schemas)
  assert (plain.before, plain.after) == ('\n<output>\n', '\n</output>\n')
  tokenizer.chat_template = "{% for m in messages %}{% if m.role != 'tool' %}{{ m.content }}{% endif %}{% endfor %}"
  with pytest.raises(UserError, match='does not render a tool message'):
    text.message_format(tokenizer, True, schemas)


class ScriptedPolicy:
  """An inference handle that answers an episode's turns with fixed texts, recording the contexts."""

  def __init__(self, tokenizer, turns):
    self.tokenizer, self.turns, self.contexts = tokenizer, list(turns), []
    self.vocab_size = len(tokenizer)  # the observations' ids are checked against it

  async def generate(self, request):
    self.contexts.append(request.tokens)
    ids = self.tokenizer(self.turns[len(self.contexts) - 1], add_special_tokens=False)['input_ids']
    return Completion(tokens=tuple(ids), log_probs=tuple([-1.0] * len(ids)), finish_reason='stop')


def test_a_scripted_tool_episode(tmp_path):
  """Turns that call Python (Qwen2.5's format), misuse the calculator (the tag format), call a tool
  that does not exist, print a special token, then answer: each call's observation follows its
  turn outside the loss mask, errors are counted, and the answer is scored with math-verify."""
  directory = tool_tokenizer_dir(tmp_path / 'tokenizer')
  source = write_gsm8k(tmp_path / 'g.jsonl', 3)
  config = config_lib.load_config(RECIPE, [f'model.path={directory}', f'task.source={source}', 'task.reward_workers=1',
                                           'task.max_turns=6', 'task.max_prompt_tokens=1024'])
  task = agent_task.build(config)
  try:
    problem = task.problems(0, 1)[0]
    answer = problem.data
    turns = ['<tool_call>\n{"name": "python", "arguments": {"code": "print(40 + 2)"}}\n</tool_call><|im_end|>',
             'Let me check: <calculator>1/0</calculator><|im_end|>',
             '<tool_call>{"name": "browser", "arguments": {}}</tool_call><|im_end|>',
             '<python>print("<|im_" + "end|>")</python><|im_end|>',
             f'The total is \\boxed{{{answer}}}.<|im_end|>']
    policy = ScriptedPolicy(task.tokenizer, turns)
    [trajectory] = asyncio.run(task.agent.episodes(policy, problem, 1, jax.random.key(0), 1024))
    tokenizer = task.tokenizer
    assert (trajectory.reward, trajectory.turns, trajectory.tool_calls, trajectory.tool_errors) == (1.0, 5, 4, 2)
    observations, turn_texts, current, policy_run = [], [], [], None
    for token, mask in zip(trajectory.tokens, trajectory.loss_mask):
      if mask != policy_run and current:
        (turn_texts if policy_run else observations).append(current)
        current = []
      policy_run = mask
      current.append(token)
    turn_texts.append(current)
    assert [tokenizer.decode(t) for t in turn_texts] == turns
    assert [tokenizer.decode(o) for o in observations] == [
        QWEN_OBSERVATION.format('42'), QWEN_OBSERVATION.format('error: division by zero'),
        QWEN_OBSERVATION.format("error: unknown tool 'browser'; tools: calculator, python"),
        QWEN_OBSERVATION.format('<|im_end|>')]
    special = tokenizer.convert_tokens_to_ids('<|im_end|>')
    assert observations[3].count(special) == 1  # the tool's '<|im_end|>' is text, the template's a token
    # Each turn saw the prompt and everything before it.
    for turn, context in enumerate(policy.contexts):
      before = sum(len(t) + len(o) for t, o in zip(turn_texts[:turn], observations[:turn]))
      assert context == problem.prompt + tuple(trajectory.tokens[:before])
    # The prompt lists the tools through the chat template.
    assert '"name": "python"' in tokenizer.decode(problem.prompt)
  finally:
    task.close()


@pytest.mark.parametrize('fields, message', [
    (['task.tools=[shell]'], 'task.tools must name tools among calculator, python'),
    (['task.tool_timeout_s=0'], 'task.tool_timeout_s must be > 0'),
    (['rewards=[{name: format}]'], 'rewards apply to dataset tasks'),
])
def test_bad_tool_configs_are_one_line_errors(tmp_path, fields, message):
  base = [f'model.path={tool_tokenizer_dir(tmp_path)}', f'task.source={write_gsm8k(tmp_path / "g.jsonl", 2)}']
  with pytest.raises(UserError, match=message):
    config_lib.load_config(RECIPE, base + fields)


def test_tool_use_refuses_to_run_model_code_without_its_sandbox(tmp_path, monkeypatch, capsys):
  fields = [f'model.path={tool_tokenizer_dir(tmp_path / "tokenizer")}', 'task.reward_workers=1',
            'task.max_prompt_tokens=1024',
            f'task.source={write_gsm8k(tmp_path / "g.jsonl", 2)}']
  monkeypatch.setattr(sandbox, 'bwrap', lambda: None)
  with pytest.raises(UserError) as error:
    agent_task.build(config_lib.load_config(RECIPE, fields))
  assert str(error.value).startswith('task.sandbox: bwrap, but bubblewrap (bwrap) is not installed; install '
                                     'bubblewrap (Debian/Ubuntu: apt-get install bubblewrap')
  # Opted out: it runs, and says so on every start. Without the python tool nothing needs a sandbox.
  for extra in (['task.sandbox=none'], ['task.tools=[calculator]']):
    agent_task.build(config_lib.load_config(RECIPE, fields + extra)).close()
    said = capsys.readouterr().err
    assert ('task.sandbox: none: the python tool runs model-written code unsandboxed' in said) == (extra[0][5] == 's')


@pytest.mark.exhaustive
@pytest.mark.starts_first
def test_the_tool_recipe_runs_its_first_steps_on_the_cpu(tmp_path, make_hf_checkpoint):
  """configs/qwen2_5_3b_gsm8k_tool.yaml at reduced size (a random 2-layer Qwen2, the test tokenizer
  with a tool template, GSM8K-format records): two RL steps train on multi-turn episodes, and
  evaluation runs episodes of held-out problems before and after."""
  from test_train import read_metrics, run_cli
  directory, _ = make_hf_checkpoint(5)
  tool_tokenizer_dir(directory)
  run_cli(tmp_path, '--config', RECIPE, '--set', f'model.path={directory}', '--set',
          f'task.source={write_gsm8k(tmp_path / "g.jsonl", 8)}', '--set', 'task.reward_workers=1',
          '--set', 'task.max_prompt_tokens=1024',
          '--set', 'model.dtype=float32', '--set', 'model.attention=dense', '--set', 'rollout.prompts_per_step=2',
          '--set', 'algo.group_size=2', '--set', 'rollout.max_new_tokens=24', '--set', 'task.turn_tokens=8',
          '--set', 'algo.num_minibatches=1', '--set', 'algo.micro_batch_size=4', '--set', 'train.steps=2',
          '--set', 'train.checkpoint_every=0', '--set', 'mesh.fsdp=1', '--set', f'eval.source={tmp_path / "g.jsonl"}',
          '--set', 'eval.split=train', '--set', 'eval.every=2', '--set', 'eval.max_problems=2',
          '--set', 'eval.samples=2',
          '--set', 'eval.k=2', '--set', 'eval.batch_prompts=2',
          '--set', 'train.progress=false', '--set', 'train.tensorboard=false')
  rows = read_metrics(tmp_path)
  assert [row['step'] for row in rows] == [1, 2]
  for row in rows:
    assert np.isfinite(row['policy_loss']) and row['episode/turns'] >= 1
  with open(tmp_path / 'eval.jsonl') as f:
    summaries = [json.loads(line) for line in f]
  assert [(s['step'], s['eval/problems']) for s in summaries] == [(0, 2), (2, 2)]
  assert all(0 <= s['eval/pass@2'] <= 1 and 1 <= s['eval/episode/turns'] <= 4 for s in summaries)


def test_without_tools_it_is_the_math_task_as_a_single_turn_agent(tmp_path, seed):
  """task.tools [] and max_turns 1: the math task's prompts in the math task's order, and each
  episode's reward is what the math task gives its completion."""
  from grpo_jax.agents.trajectory import collate
  from grpo_jax.data.math_task import MathTask
  directory = tool_tokenizer_dir(tmp_path / 'tokenizer')
  source = write_gsm8k(tmp_path / 'g.jsonl', 5)
  common = [f'model.path={directory}', f'task.source={source}', 'task.reward_workers=1', f'run.seed={seed % 1000}',
            'task.max_prompt_tokens=192']
  agent = agent_task.build(config_lib.load_config(RECIPE, common + ['task.tools=[]', 'task.max_turns=1']))
  math_config = config_lib.load_config(RECIPE, common + ['task.name=math', 'eval.source=null'])
  math = MathTask(math_config.task, math_config.model.path, math_config.run.seed)
  try:
    for position in (0, 3):  # across the epoch boundary at 5
      mine, theirs = agent.prompts(None, position, 4), math.prompts(None, position, 4)
      np.testing.assert_array_equal(mine.tokens, theirs.tokens)
      np.testing.assert_array_equal(mine.mask, theirs.mask)
      assert [problem.data for problem in mine.answers] == [reference.answer for reference in theirs.answers]
    prompts = math.prompts(None, 0, 2)
    rng = np.random.default_rng(seed)
    trajectories = []
    for problem in agent.problems(0, 2):
      # Each problem gets a right and a wrong boxed answer (so the rewards are neither all 0 nor all 1)
      # and one drawn from the other forms, in a drawn order.
      right, wrong = problem.data, str(int(problem.data) + 1)
      guess = rng.choice([right, wrong])
      other = str(rng.choice([f'<python>print({guess})</python><|im_end|>',
                              f'<think>\\boxed{{{right}}}</think> {guess}<|im_end|>',
                              f'so \\boxed{{{guess}}}<|im_end|>']))
      texts = [f'so \\boxed{{{right}}}<|im_end|>', f'so \\boxed{{{wrong}}}<|im_end|>', other]
      for text in rng.permutation(texts):
        text = str(text)
        [trajectory] = asyncio.run(agent.agent.episodes(ScriptedPolicy(agent.tokenizer, [text]), problem, 1,
                                                        jax.random.key(0), 48))
        assert trajectory.turns == 1 and trajectory.tool_calls == 0
        trajectories.append(trajectory)
    rollout, scores, _ = collate(trajectories, 48, agent.pad_id)
    expected = math.reward(rollout, prompts, 3, {})
    np.testing.assert_array_equal(scores.rewards, np.asarray(expected.rewards))
    assert 0 < scores.rewards.sum() < len(trajectories)
  finally:
    agent.close()
    math.close()
