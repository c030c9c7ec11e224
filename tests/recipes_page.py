"""docs/recipes.md, made from configs/: each recipe's header comment (the command that runs it, what it
reproduces, the plan command where it gives one) and its --model-size preset (test_recipes.RECIPES).
tests/test_docs.py checks that the page is `markdown()`. Run `python tests/recipes_page.py >
docs/recipes.md` after changing a recipe's header."""

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

INTRO = """# Recipes

Each file in `configs/` is a run: the tiny ones train on the CPU in minutes (docs/quickstart.md), the
others are the recipes of public GRPO runs (verl's `examples/grpo_trainer`, Megatron-LM's RL
example) and their moves to other families, for real weights. Every recipe's first line is the
command that runs it; nothing is downloaded, so `model.path` (and `algo.teacher`) name local
directories and the datasets come from local files or the local Hugging Face cache.

`tests/test_recipes.py` loads every recipe, passes all its checks, and traces and lowers its RL step
on abstract shapes at reduced depth over 8 CPU devices with the preset below: the recipe's mesh,
batch, sequence lengths, rewards and algorithm as the run builds them. `python -m grpo_jax.plan`
compiles it for the accelerators it names (docs/scaling.md); BENCHMARKS.md holds the full-depth
plans, each with its command.

This page is made from the recipes' headers by `python tests/recipes_page.py`.
"""


def header(path: str) -> tuple[list[str], list[str], list[str]]:
  """(the run command's lines, the description's lines, the plan command lines) of a config."""
  command, text, plans = [], [], []
  with open(path) as f:
    lines = [line.rstrip('\n') for line in f]
  comments = []
  for line in lines:
    if not line.startswith('#'):
      break
    comments.append(line[1:].strip())
  index = 0
  while index < len(comments):
    command.append(re.split(r'\s{2,}\(', comments[index])[0])  # a note after the command: '  (make ... makes ...)'
    index += 1
    if not command[-1].endswith('\\'):
      break
  for line in comments[index:]:
    if line.startswith('python -m grpo_jax.plan'):  # as it runs from the checkout: the compilers on the path
      plans.append(f'PYTHONPATH=.venv/compilers {line}')
    else:
      text.append(line)
  return command, text, plans


def _joined(lines: list[str]) -> str:
  """Comment lines as one paragraph (a word broken at a hyphen joined again)."""
  text = ''
  for line in lines:
    text += line if text.endswith('-') and not text.endswith(' -') else (' ' if text else '') + line
  return text.strip()


def markdown() -> str:
  from test_recipes import RECIPES, REWARD_MODEL_CONFIGS

  sections = [INTRO]
  names = sorted(set(RECIPES) | set(REWARD_MODEL_CONFIGS), key=lambda name: (not name.startswith('tiny_'), name))
  for name in names:
    command, text, plans = header(os.path.join(ROOT, 'configs', name))
    preset = RECIPES.get(name, (None, 1))[0]
    lines = [f'## `configs/{name}`', '', _joined(text), '']
    if preset:
      lines += [f'Preset: `--model-size {preset}`.', '']
    lines += ['```bash', *command, *plans, '```', '']
    sections.append('\n'.join(lines))
  return '\n'.join(sections).rstrip('\n') + '\n'


if __name__ == '__main__':
  sys.stdout.write(markdown())
