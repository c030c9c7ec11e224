"""The layers of grpo_jax (DESIGN.md, STYLE.md principle 17), read from the source: no module
imports a room above its own, not even lazily inside a function, and the rooms' imports form no
cycle.

A room is a subpackage (ops, model, sampler, ...) or a top-level module (errors, config, train, ...)
of grpo_jax/. Every file under grpo_jax/ is parsed, nothing is imported: `import grpo_jax.x`,
`from grpo_jax.x import y`, `from grpo_jax import x`, relative forms and importlib.import_module
with a literal name count wherever they stand. tests/, bench/, conversion/ and launch/ stand
outside the house and may import any room.
"""

import ast
import functools
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / 'grpo_jax'

# The rungs, ground first: a room imports only rooms on lower rungs (and itself).
LAYERS = (
    ('errors',),  # the one-sentence errors a user can cause: every room raises them
    ('sections', 'sharding', 'workers', 'metrics', 'trackers', 'distributed', 'sandbox', 'cgroups', 'records'),  # the rest
    # of the ground floor
    ('config_yaml',),  # the YAML form of any config of sections: read, checked, written
    ('ops',),  # kernels: fused log-probs, decode attention, grouped matmul
    ('model',),  # the one decoder, its weights, vision tower, images and token-id check
    ('sampler',),  # decode, slots, rollouts, the pool, the rollout layout
    ('data',),  # tasks, datasets, rewards
    ('agents', 'evaluation', 'generate'),  # what runs the sampler over tasks: episodes, pass@k, generate
    ('rl', 'checkpoint'),  # the RL step and its state; a state's checkpoints
    ('config',),  # assembles the sections into a run's Config
    ('restore',),  # a run's policy read back from its checkpoints, by its config
    ('build', 'plan', 'serve', 'testing', 'snapshots'),  # a run's objects built; the plan; serving; the test model;
    # the policy's Hugging Face snapshots while training
    ('train', 'eval', 'train_reward'),  # the run's CLIs
)
# Rooms on one rung of which the first imports the second, and why that is right.
SAME_RUNG = {
    ('agents', 'evaluation'): "an episode's evaluation and the tool environment use evaluation.py's "
                              'estimators (summarize, final_answer), one set for every evaluator',
    ('sandbox', 'cgroups'): "the sandbox holds each call's process tree in a cgroup of its own, where one can be "
                            'made (cgroups.py: both cgroup versions, nothing of the sandbox)',
    ('plan', 'build'): "the plan compiles the run's own RL step, which build.py is the one place to build",
    ('train_reward', 'train'): "a reward-model run checks its workdir, its resumed config and its LoRA base as the RL "
                               'run does (check_workdir, changed_keys, base_record, check_base): one set of checks',
}
RUNG = {room: rung for rung, rooms in enumerate(LAYERS) for room in rooms}


def module_of(path: pathlib.Path) -> str:
  """grpo_jax/a/b.py -> 'grpo_jax.a.b'; a package's __init__.py -> the package."""
  parts = path.relative_to(PACKAGE.parent).with_suffix('').parts
  return '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)


def room_of(module: str) -> str | None:
  """'grpo_jax.sampler.decode' -> 'sampler'; the package itself has no room."""
  parts = module.split('.')
  return parts[1] if len(parts) > 1 else None


def statements(node: ast.AST):
  """The nodes under `node` outside expressions: every statement, in function and class bodies,
  branches and except clauses too (an import is a statement; skipping the expressions halves the walk)."""
  for child in ast.iter_child_nodes(node):
    if not isinstance(child, ast.expr):
      yield child
      yield from statements(child)


def imported_modules(tree: ast.Module, module: str, is_package: bool, calls: bool = True):
  """(line, grpo_jax module) of every import in `tree`, the ones inside functions included, and
  (calls) of every importlib.import_module call with a literal name."""
  package = module if is_package else module.rpartition('.')[0]
  for node in ast.walk(tree) if calls else statements(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        yield node.lineno, alias.name
    elif isinstance(node, ast.ImportFrom):
      if node.level:  # from . import x; from ..y import z
        base = package.split('.')[:len(package.split('.')) - node.level + 1]
        source = '.'.join(base + ([node.module] if node.module else []))
      else:
        source = node.module
      if source == 'grpo_jax':  # from grpo_jax import config: the names are its modules
        for alias in node.names:
          yield node.lineno, f'grpo_jax.{alias.name}'
      else:
        yield node.lineno, source
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == 'import_module'
          and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
      yield node.lineno, node.args[0].value


@functools.cache
def imports() -> tuple:
  """(file, line, importer's room, imported module, its room) of every import between grpo_jax's modules."""
  found = []
  for path in sorted(PACKAGE.rglob('*.py')):
    module = module_of(path)
    text = path.read_text()
    tree = ast.parse(text, str(path))
    for line, imported in imported_modules(tree, module, path.name == '__init__.py', 'import_module' in text):
      if imported == 'grpo_jax' or imported.startswith('grpo_jax.'):
        found.append((str(path.relative_to(PACKAGE.parent)), line, room_of(module), imported, room_of(imported)))
  return tuple(found)


def strongly_connected(graph: dict) -> list[list]:
  """Tarjan's strongly connected components of `graph` (node -> set of nodes)."""
  index, low, stack, on_stack, components = {}, {}, [], set(), []

  def visit(node):
    index[node] = low[node] = len(index)
    stack.append(node)
    on_stack.add(node)
    for successor in sorted(graph.get(node, ())):
      if successor not in index:
        visit(successor)
        low[node] = min(low[node], low[successor])
      elif successor in on_stack:
        low[node] = min(low[node], index[successor])
    if low[node] == index[node]:
      component = []
      while not component or component[-1] != node:
        component.append(stack.pop())
        on_stack.discard(component[-1])
      components.append(sorted(component))

  for node in sorted(graph):
    if node not in index:
      visit(node)
  return components


def cycle_through(graph: dict, start: str, rooms: set) -> list:
  """A shortest cycle from `start` back to it among `rooms`, as [start, ..., start] (breadth first)."""
  came_from, frontier = {start: None}, [start]
  while frontier:
    following = []
    for node in frontier:
      for successor in sorted(graph.get(node, ())):
        if successor == start:
          path = [node]
          while came_from[path[-1]] is not None:
            path.append(came_from[path[-1]])
          return path[::-1] + [start]
        if successor in rooms and successor not in came_from:
          came_from[successor] = node
          following.append(successor)
    frontier = following
  return []


def test_every_room_has_a_rung():
  rooms = {room_of(module_of(path)) for path in PACKAGE.rglob('*.py')} - {None}
  missing = sorted(rooms - set(RUNG))
  assert not missing, f'rooms of grpo_jax/ with no rung in LAYERS (add each where its imports put it): {missing}'
  stale = sorted(set(RUNG) - rooms)
  assert not stale, f'LAYERS names rooms grpo_jax/ no longer has: {stale}'


def test_no_room_imports_a_room_above_it_or_beside_it():
  wrong = []
  for file, line, importer, imported, room in imports():
    if importer is None:  # the package's own __init__ runs before any of its modules: it imports none
      wrong.append(f'{file}:{line} imports {imported}: grpo_jax/__init__.py must import no room')
    elif room is None or room == importer:
      continue
    elif importer not in RUNG or room not in RUNG:
      wrong.append(f'{file}:{line} imports {imported}: room {importer if importer not in RUNG else room} has no '
                   'rung in LAYERS')
    elif RUNG[room] > RUNG[importer]:
      wrong.append(f'{file}:{line} imports {imported}: room {importer} (rung {RUNG[importer]}) may not import '
                   f'room {room} (rung {RUNG[room]}), above it; move the shared piece down')
    elif RUNG[room] == RUNG[importer] and (importer, room) not in SAME_RUNG:
      wrong.append(f'{file}:{line} imports {imported}: room {importer} may not import room {room}, on its own '
                   f'rung {RUNG[room]}')
  assert not wrong, 'imports against the layers (DESIGN.md):\n' + '\n'.join(wrong)


def test_rooms_import_each_other_in_no_cycle():
  graph, where = {}, {}
  for file, line, importer, _, room in imports():
    if importer is not None and room is not None and room != importer:
      graph.setdefault(importer, set()).add(room)
      where.setdefault((importer, room), f'{file}:{line}')
  components = [component for component in strongly_connected(graph) if len(component) > 1]
  described = []
  for component in components:
    cycle = min((cycle_through(graph, room, set(component)) for room in component), key=len)
    described.append(f'{", ".join(component)}; one cycle: {cycle[0]} ' + ' '.join(
        f'-> {b} ({where[a, b]})' for a, b in zip(cycle, cycle[1:])))
  assert not components, 'rooms that import each other in a cycle:\n' + '\n'.join(described)


def test_the_reader_sees_every_form_of_import():
  source = ('import grpo_jax.errors\nfrom grpo_jax import config, metrics\nfrom . import slots\n'
            'from ..model.qwen2 import Qwen2\ndef lazy():\n  from grpo_jax.plan import targets\n'
            "  importlib.import_module('grpo_jax.train')\n")
  found = sorted(imported_modules(ast.parse(source), 'grpo_jax.sampler.decode', is_package=False))
  assert found == [(1, 'grpo_jax.errors'), (2, 'grpo_jax.config'), (2, 'grpo_jax.metrics'), (3, 'grpo_jax.sampler'),
                   (4, 'grpo_jax.model.qwen2'), (6, 'grpo_jax.plan'), (7, 'grpo_jax.train')]
  tucked = 'try:\n  pass\nexcept ImportError:\n  from grpo_jax import train\n'
  assert list(imported_modules(ast.parse(tucked), 'grpo_jax.ops', is_package=True, calls=False)) == [
      (4, 'grpo_jax.train')]
  assert room_of('grpo_jax.model.qwen2') == 'model' and room_of('grpo_jax') is None
