"""The documentation cannot rot: the README stays short and links every page of docs/; every link
resolves; docs/recipes.md is the recipes' own headers; the README's tour config loads; and every
command in a shell block of the README or docs/ is run by `test_every_command_runs`
(make test-all), as written or shortened, or is in ALLOWED with its reason.

A command runs in a folder of its own (configs/, launch/ and .venv linked in), so what it writes
(runs/, data/, ckpt/, hf/) lands there, in the order the pages give them: a command that reads what
an earlier one wrote (the reward-model demo's policy reads the reward model) finds it. Shortened:
a training run stops after its first call (`train.steps` = its `steps_per_call`), a plan compiles
2 layers, a pod launch script prints its commands (`--dry-run`). Placeholders (`/path/to/...`,
`DIR`) name a tiny random checkpoint with a tokenizer, made here.
"""

import functools
import glob
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
PAGES = ['README.md', *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, 'docs', '*.md')))]
README_LINES = 200

pytestmark = pytest.mark.xdist_group('test_docs')  # the commands run in order, in one folder

# (pattern, why the command is not run here). Each pattern must match a command of the docs.
ALLOWED = [
  (r'^make demo', 'a demo run whole (1-10 minutes): the demo tests of make test-all run each demo config to '
                  'the reward the docs state, and its training command is run below'),
  (r'^make test', 'the suite itself: CI runs make test-all (.ci/run)'),
  (r'^python -m grpo_jax\.serve ', 'a server that runs until stopped, on JetStream (an extra): tests/test_serve.py '
                                   'starts it on a tiny checkpoint and sends it requests'),
  (r'^python -m grpo_jax\.train --config configs/(?!tiny_)\S+ --set model\.path=/data/',
   'real weights under /data: tests/test_recipes.py loads each recipe and lowers its RL step at reduced depth'),
  (r'^PYTHONPATH=\.venv/compilers python -m grpo_jax\.plan --config configs/\S+ --model-size \S+ --target \S+$',
   "a recipe's plan at full depth: the plan commands' configs, presets and targets are checked here "
   '(test_plan_commands_name_real_configs_presets_and_targets), each recipe is lowered by tests/test_recipes.py, '
   'and compiling every recipe for its target, even at 2 layers, takes about 10 minutes (BENCHMARKS.md holds '
   'the full-depth plans, each with its command)'),
]


def shell_commands(page: str) -> list[str]:
  """The commands of a page's shell blocks (```bash, or a bare ``` block's lines that start with a
  command), continuation lines joined, comments dropped."""
  with open(os.path.join(ROOT, page)) as f:
    text = f.read()
  commands = []
  for language, body in re.findall(r'```(\w*)\n(.*?)```', text, re.S):
    if language not in ('bash', 'sh', ''):
      continue
    for line in re.sub(r'\\\n\s*', ' ', body).split('\n'):
      line = re.sub(r'\s+#\s.*$', '', line).strip()
      if not line or line.startswith('#'):
        continue
      if language == '' and not re.match(r'(python\b|make\b|PYTHONPATH=)', line):
        continue  # a bare block's output or file tree
      commands.append(line)
  return commands


@functools.cache
def all_commands() -> list[str]:
  """Every page's commands, each once, in the order of the pages (the README first)."""
  return list(dict.fromkeys(command for page in PAGES for command in shell_commands(page)))


def allowed(command: str) -> str | None:
  return next((why for pattern, why in ALLOWED if re.search(pattern, command)), None)


def runnable() -> list[str]:
  return [command for command in all_commands() if allowed(command) is None]


# ---- make test: the pages' shape, links, and every command accounted for ----

def test_the_readme_is_short_and_links_every_page():
  with open(os.path.join(ROOT, 'README.md')) as f:
    readme = f.read()
  assert readme.count('\n') < README_LINES
  linked = set(re.findall(r'\]\((docs/[^)#]+\.md)', readme))
  assert linked == {page for page in PAGES if page.startswith('docs/')}


@pytest.mark.parametrize('page', PAGES)
def test_every_link_resolves(page):
  with open(os.path.join(ROOT, page)) as f:
    text = f.read()
  for target in re.findall(r'\]\(([^)#\s]+)', text):
    if not re.match(r'[a-z]+://', target):
      assert os.path.exists(os.path.join(ROOT, os.path.dirname(page), target)), f'{page}: {target}'


def test_the_recipes_page_is_the_recipes_headers():
  import recipes_page
  with open(os.path.join(ROOT, 'docs', 'recipes.md')) as f:
    assert f.read() == recipes_page.markdown(), 'docs/recipes.md: run python tests/recipes_page.py > docs/recipes.md'


def test_every_command_is_run_or_allowed_with_its_reason():
  """Each command is run by test_every_command_runs or named by ALLOWED; each ALLOWED entry names a
  command the docs still hold; the runner knows how to run each one that is not allowed."""
  commands = all_commands()
  assert len(commands) > 20
  for pattern, _ in ALLOWED:
    assert any(re.search(pattern, command) for command in commands), f'ALLOWED names no command: {pattern}'
  for command in runnable():
    assert prepared(command, '/tmp/x'), f'the docs test cannot run: {command}'


def test_the_tour_config_is_a_valid_config(tmp_path, make_hf_checkpoint):
  """The README's 30-line tour, its paths pointed at a tiny checkpoint and data files, loads."""
  from grpo_jax import config as config_lib
  from grpo_jax.data import word_problems

  with open(os.path.join(ROOT, 'README.md')) as f:
    [tour] = [body for body in re.findall(r'```yaml\n(.*?)```', f.read(), re.S) if 'configs/my_run.yaml' in body]
  files = word_problems.write(str(tmp_path / 'data'))
  hf_dir, _ = make_hf_checkpoint(0)
  text = (tour.replace('/data/Qwen2.5-7B-Instruct', hf_dir).replace('data/train.jsonl', files['train'])
          .replace('data/test.jsonl', files['eval']))
  path = tmp_path / 'my_run.yaml'
  path.write_text(text)
  config = config_lib.load_config(str(path))
  assert config.train.loggers == ('jsonl', 'tensorboard', 'wandb') and config.train.export_hf_every == 100
  assert config.algo.dynamic_sampling and config.model.options.lora.rank == 64


def test_plan_commands_name_real_configs_presets_and_targets():
  """Every plan command of the docs: its config loads, its --model-size is a preset, its --target
  is a target the plan knows (checked without compiling)."""
  from grpo_jax import config as config_lib
  from grpo_jax.model.presets import MODEL_PRESETS
  from grpo_jax.plan import targets

  plans = [command for command in all_commands() if ' -m grpo_jax.plan ' in f' {command} ']
  assert len(plans) > 10
  for command in plans:
    words = shlex.split(command)
    arguments = dict(zip(words, words[1:]))  # each flag -> the word after it
    config_lib.load_config(os.path.join(ROOT, arguments['--config']))
    assert arguments['--model-size'] in MODEL_PRESETS, command
    targets.parse_target(arguments['--target'])


# ---- make test-all: each command run ----

def prepared(command: str, where: str) -> list[tuple[list[str], dict]] | None:
  """The command as it runs here: [(argv, extra environment), ...] (a command of `&&` parts runs
  each in turn), shortened and with its placeholders filled; None where the runner has no rule."""
  steps = []
  for part in command.split(' && '):
    words = shlex.split(part)
    environment = {}
    while words and re.match(r'^[A-Z_]+=', words[0]):
      name, value = words.pop(0).split('=', 1)
      environment[name] = value
    words = _without_optional(words)
    words = [os.path.join(where, 'tiny_hf') if word.startswith('/path/to/') or word == 'DIR' else word
             for word in words]
    if words[:3] == ['python', '-m', 'grpo_jax.train'] or words[:3] == ['python', '-m', 'grpo_jax.train_reward']:
      words += ['--set', f'train.steps={_steps_per_call(words[words.index("--config") + 1])}',
                '--set', 'train.progress=false']
    elif words[:3] == ['python', '-m', 'grpo_jax.plan']:
      words += [flag for flag in ('--no-advice',) if flag not in words]
      words += [] if '--layers' in words else ['--layers', '2']
    elif words[:2] == ['python', 'launch/xm_launch.py']:
      words += ['--dry-run']
    elif words[0] == 'launch/tpu_pod.sh':
      words = ['bash', *words, '--dry-run']
    elif words[0] == 'sbatch':
      nodes = next(w.split('=')[1] for w in words if w.startswith('--nodes='))
      script = next(w for w in words if w.startswith('launch/'))
      words = ['bash', script, '--dry-run', *words[words.index(script) + 1:]]
      environment.update(SLURM_NNODES=nodes, SLURM_JOB_NODELIST=','.join(f'node-{i}' for i in range(int(nodes))),
                         SLURM_GPUS_ON_NODE='8', PATH='/usr/bin:/bin')
    elif not (words[:2] == ['python', '-m'] and words[2].split('.')[0] in ('grpo_jax', 'conversion')):
      return None
    if words[0] == 'python':
      words[0] = sys.executable
    steps.append((words, environment))
  return steps


def _without_optional(words: list[str]) -> list[str]:
  """A usage line's optional parts ('[--dtype bfloat16]') left out; a value holding brackets
  ('train.loggers=[jsonl, wandb]') kept."""
  kept, optional = [], False
  for word in words:
    optional = optional or word.startswith('[-')
    if not optional:
      kept.append(word)
    optional = optional and not word.endswith(']')
  return kept


def _steps_per_call(config: str) -> int:
  import yaml
  with open(os.path.join(ROOT, config)) as f:
    return int((yaml.safe_load(f).get('train') or {}).get('steps_per_call', 1))


@pytest.fixture(scope='module')
def folder(tmp_path_factory):
  """Where the commands run: configs/, launch/, .venv linked in; a tiny checkpoint with a tokenizer
  for the placeholders; the distillation demo's teacher, as `make demo-distill` makes it first."""
  from test_api import write_tokenizer

  from grpo_jax.testing import save_random_hf_checkpoint

  where = tmp_path_factory.mktemp('docs')
  for name in ('configs', 'launch', '.venv'):
    if os.path.exists(os.path.join(ROOT, name)):
      os.symlink(os.path.join(ROOT, name), where / name)
  save_random_hf_checkpoint(str(where / 'tiny_hf'), 0)
  write_tokenizer(str(where / 'tiny_hf'))
  teacher = [sys.executable, '-m', 'grpo_jax.train', '--config', 'configs/tiny_arith.yaml', '--set', 'run.seed=1',
             '--workdir', 'runs/tiny_arith_teacher', '--set', 'train.steps=10', '--set', 'train.progress=false']
  subprocess.run(teacher, cwd=where, env=_environment({}), check=True, capture_output=True)
  return where


def _environment(extra: dict) -> dict:
  environment = dict(os.environ, **extra)
  environment['PYTHONPATH'] = os.pathsep.join(filter(None, [extra.get('PYTHONPATH'), ROOT]))
  environment.update(WANDB_MODE='offline', WANDB_SILENT='true')
  return environment


@pytest.mark.exhaustive
@pytest.mark.parametrize('command', runnable())
@pytest.mark.long
def test_every_command_runs(command, folder):
  for argv, extra in prepared(command, str(folder)):
    result = subprocess.run(argv, cwd=folder, env=_environment(extra), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f'{" ".join(argv)}\n{result.stderr[-3000:]}'
