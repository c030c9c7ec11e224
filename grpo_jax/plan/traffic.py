"""What a compiled program moves between devices: its collectives, read from the optimized HLO.

Memory analysis sees buffers, not traffic. This reads `compiled.as_text()` (the target compiler's
own optimized, partitioned program) and lists every collective with its bytes per device, the
size of its device groups, and how many times it runs: each computation's count is the sum over
its callers of the caller's count, times the trip count where the caller is a `while` (XLA's
`known_trip_count`, else a loop condition `counter < constant` as `lax.scan` and `fori_loop`
write them). A loop whose trip count depends on the data (the sampler's decode loop) counts once
per iteration: collectives inside the loop marked `marker` (a `jax.named_scope` around it) are
reported per iteration of that loop, the rest per execution of the program.

Bytes per device, by kind: all-gather: the gathered result; all-reduce: the reduced operand;
reduce-scatter: the operand before scattering; all-to-all and collective-permute: the operand;
ragged-all-to-all: its operand, the rows each device sends (every one goes to one device: its
traffic; the receive buffer, sized for every sender's rows landing on one device, bounds memory).
Asynchronous pairs (`-start` / `-done`) count once, a `-start` written as ((operands), results) by
its results (a reduce-scatter-start as the synchronous form: g times its results). The interconnect
time of a collective over a group of g devices at a link bandwidth of W bytes/s per device is
estimated as bytes * (g - 1) / g / W, twice that for an all-reduce (a reduce-scatter then an
all-gather), on the slowest link the group spans.
"""

import dataclasses
import math
import re
from collections.abc import Callable

import numpy as np

KINDS = ('all-gather', 'all-reduce', 'reduce-scatter', 'all-to-all', 'permute')
_OPCODES = {'all-gather': 'all-gather', 'all-gather-start': 'all-gather', 'all-reduce': 'all-reduce',
            'all-reduce-start': 'all-reduce', 'reduce-scatter': 'reduce-scatter',
            'reduce-scatter-start': 'reduce-scatter', 'all-to-all': 'all-to-all',
            'all-to-all-start': 'all-to-all', 'ragged-all-to-all': 'all-to-all',
            'ragged-all-to-all-start': 'all-to-all', 'collective-permute': 'permute',
            'collective-permute-start': 'permute'}
_DTYPE_BYTES = {'pred': 1, 's4': 1, 'u4': 1, 's8': 1, 'u8': 1, 'f8e4m3fn': 1, 'f8e5m2': 1, 's16': 2, 'u16': 2,
                'f16': 2, 'bf16': 2, 's32': 4, 'u32': 4, 'f32': 4, 's64': 8, 'u64': 8, 'f64': 8, 'c64': 8,
                'c128': 16}

_COMPUTATION = re.compile(r'^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$')
_INSTRUCTION = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([\w\-]+)\((.*)$')
_ARRAY = re.compile(r'\b([a-z]+[0-9]*)\[([0-9,]*)\]')
_CALLS = re.compile(r'\b(?:condition|body|to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)')
_BRANCHES = re.compile(r'branch_computations=\{([^}]*)\}')
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
# ops whose called computations run inside them
_FUSING = {'fusion', 'fusion-start', 'reduce', 'reduce-window', 'scatter', 'select-and-scatter', 'sort', 'map',
           'all-reduce', 'all-reduce-start', 'reduce-scatter', 'reduce-scatter-start'}
_NOT_KERNELS = {'parameter', 'get-tuple-element', 'tuple', 'bitcast', 'constant', 'while', 'call', 'conditional',
                'after-all', 'partition-id', 'replica-id', 'opt-barrier', 'add-dependency', 'async-start',
                'async-update', 'domain'}
_MOVES = {'copy', 'copy-start', 'slice', 'dynamic-slice', 'concatenate', 'transpose', 'reshape', 'pad'}
_SCALAR = re.compile(r'^\w+\[\]')  # a scalar result: s32[], pred[] (a dynamic slice's index arithmetic)
_FREE = {'parameter', 'bitcast', 'constant', 'tuple', 'get-tuple-element', 'broadcast', 'iota'}


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective of the program.

  kind:    one of KINDS.
  bytes:   per device, per execution (see the module docstring).
  groups:  the device groups, as logical device ids (indices into the program's devices).
  count:   executions per run of the program, or per iteration of the marked loop when `in_loop`.
  in_loop: inside the loop named by the marker (counted per iteration of it).
  where:   the JAX operation it came from (HLO metadata op_name), for reading the report.
  """

  kind: str
  bytes: int
  groups: tuple[tuple[int, ...], ...]
  count: int
  in_loop: bool
  where: str

  @property
  def group_size(self) -> int:
    return max((len(group) for group in self.groups), default=1)


def _shape_bytes(text: str) -> list[int]:
  """Bytes of each array in an HLO shape (a tuple gives several)."""
  return [math.prod(int(d) for d in dims.split(',') if d) * _DTYPE_BYTES.get(dtype, 4)
          for dtype, dims in _ARRAY.findall(re.sub(r'\{[^{}]*\}', '', text))]


def _iota_groups(dims: list[int], reshape: list[int], transpose: list[int] | None) -> list[list[int]]:
  ids = np.arange(math.prod(reshape)).reshape(reshape)
  if transpose is not None:
    ids = ids.transpose(transpose)
  return ids.reshape(dims).tolist()


def parse_groups(text: str, devices: int) -> tuple[tuple[int, ...], ...]:
  """replica_groups in any of XLA's spellings -> groups of logical device ids."""
  match = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", text)
  if match:  # mesh['a'=4,'b'=2] {'b'}: over a mesh of the ids in order, groups along the named axes
    axes = re.findall(r"'([^']+)'=(\d+)", match.group(1))
    names, sizes = [name for name, _ in axes], [int(size) for _, size in axes]
    along = [names.index(name) for name in re.findall(r"'([^']+)'", match.group(2))]
    ids = np.arange(math.prod(sizes)).reshape(sizes)
    rest = [axis for axis in range(len(sizes)) if axis not in along]
    ids = ids.transpose(rest + along).reshape(-1, math.prod(sizes[a] for a in along) if along else 1)
    return tuple(tuple(group) for group in ids.tolist())
  match = re.search(r'replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?', text)
  if match:
    dims = [int(d) for d in match.group(1).split(',')]
    reshape = [int(d) for d in match.group(2).split(',')]
    transpose = [int(d) for d in match.group(3).split(',')] if match.group(3) else None
    return tuple(tuple(group) for group in _iota_groups(dims, reshape, transpose))
  match = re.search(r'replica_groups=\{((?:\{[\d,\s]*\},?\s*)*)\}', text)
  if match and match.group(1).strip():
    return tuple(tuple(int(i) for i in group.split(',') if i.strip())
                 for group in re.findall(r'\{([\d,\s]*)\}', match.group(1)))
  match = re.search(r'source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}', text)
  if match:  # a permute: each pair is a link used
    return tuple((int(a), int(b)) for a, b in re.findall(r'\{(\d+),(\d+)\}', match.group(1)))
  return (tuple(range(devices)),)  # no groups written: all devices


def _bytes(kind: str, opcode: str, shape: str, group_size: int, operand: str = '') -> int:
  """Bytes per device of one collective from its result shape, and its first operand's shape
  `operand` (see the module docstring)."""
  sizes = _shape_bytes(shape)
  if opcode in ('all-gather-start', 'collective-permute-start'):
    return sizes[1] if len(sizes) > 1 else sum(sizes)  # (operand, result[, contexts]): the result arrives
  if opcode == 'ragged-all-to-all-start':
    return sizes[0]  # ((operand, output, four offset arrays), result, ...): the rows sent
  if opcode == 'ragged-all-to-all':  # its result is the receive buffer: the operand is what is sent
    return sum(_shape_bytes(operand)) if operand else sum(sizes)
  if opcode == 'all-to-all-start' or (opcode == 'all-reduce-start' and shape.lstrip().startswith('((')):
    return sum(sizes) // 2  # ((operands), results) of equal sizes (XLA:GPU's asynchronous forms)
  if kind == 'reduce-scatter':  # the operand, of which each device keeps 1 / g (a -start: its results')
    return sum(_shape_bytes(_async_result(shape))) * group_size
  return sum(sizes)


def _walk(hlo: str, marker: str, visit_instruction: Callable) -> None:
  """Calls visit_instruction(match, count, in_loop, fused) for every instruction of the optimized
  HLO module `hlo` reachable from its entry: `count` its executions per run (or per iteration of the
  loop named `marker` when `in_loop`, see the module docstring), `fused` whether it sits inside a
  fusion (or a reducer) rather than being launched itself. `match` is an _INSTRUCTION match:
  (name, result shape, opcode, the rest of the line)."""
  computations: dict[str, list[str]] = {}
  entry, current = None, None
  for line in hlo.splitlines():
    if current is None:
      match = _COMPUTATION.match(line)
      if match and '=' not in line.split('(')[0]:
        current = match.group(1)
        computations[current] = []
        if line.startswith('ENTRY'):
          entry = current
      continue
    if line.strip() == '}':
      current = None
      continue
    computations[current].append(line)
  if entry is None:
    return

  instructions = {name: [m for m in map(_INSTRUCTION.match, lines) if m] for name, lines in computations.items()}

  def trip_count(line: str, condition: str) -> int | None:
    found = _TRIP.search(line)
    if found:
      return int(found.group(1))
    parsed = instructions.get(condition, [])  # else a condition `counter < constant` (init 0, step 1)
    root = next((m for m in parsed if m.group(0).lstrip().startswith('ROOT')), None)
    if root is None or root.group(3) != 'compare' or 'direction=LT' not in root.group(0):
      return None
    constants = {m.group(1): m.group(4) for m in parsed if m.group(3) == 'constant'}
    for operand in re.findall(r'%([\w.\-]+)', root.group(4).split(')')[0]):
      number = re.match(r'(-?\d+)\)', constants.get(operand, ''))
      if number:
        return int(number.group(1))
    return None

  def visit(name: str, count: int, in_loop: bool, fused: bool, depth: int = 0):
    if depth > 64:
      return
    for match in instructions.get(name, []):
      opcode, line = match.group(3), match.group(0)
      visit_instruction(match, count, in_loop, fused)
      called = _CALLS.findall(line)
      for branches in _BRANCHES.findall(line):
        called += [b.strip().lstrip('%') for b in branches.split(',') if b.strip()]
      if not called:
        continue
      if opcode == 'while':
        body = re.search(r'body=%?([\w.\-]+)', line).group(1)
        condition = re.search(r'condition=%?([\w.\-]+)', line).group(1)
        op_name = _OP_NAME.search(line)
        marked = bool(op_name) and op_name.group(1).endswith(f'{marker}/while')
        if marked and not in_loop:  # per iteration of the marked loop
          visit(body, 1, True, fused, depth + 1)
          visit(condition, 1, True, fused, depth + 1)
          continue
        trips = trip_count(line, condition) or 1
        visit(body, count * trips, in_loop, fused, depth + 1)
        visit(condition, count * (trips + 1), in_loop, fused, depth + 1)
        continue
      # Fusions (and reducers) run inside their caller's kernel; calls, branches and async wrappers
      # launch what they hold.
      inside = fused or opcode in _FUSING
      for callee in called:
        visit(callee, count, in_loop, inside, depth + 1)

  visit(entry, 1, False, False)


def collectives(hlo: str, devices: int, marker: str = 'decode_loop') -> list[Collective]:
  """Every collective of the optimized HLO module `hlo` of a program over `devices` devices."""
  found: list[Collective] = []
  shapes: dict[str, str] = {}  # instruction -> its result shape (operands are written by name only)

  def visit(match, count, in_loop, fused):
    shapes[match.group(1)] = match.group(2)
    kind = _OPCODES.get(match.group(3))
    if kind is None:
      return
    line = match.group(0)
    first = re.search(r'%([\w.\-]+)', match.group(4))
    where = _OP_NAME.search(line)
    groups = parse_groups(line, devices)
    if not groups:  # a permute with no source-target pairs moves nothing
      return
    size = max(len(group) for group in groups)
    operand = shapes.get(first.group(1), '') if first else ''
    found.append(Collective(kind=kind, bytes=_bytes(kind, match.group(3), match.group(2), size, operand),
                            groups=groups,
                            count=count, in_loop=in_loop, where=where.group(1) if where else ''))

  _walk(hlo, marker, visit)
  return found


@dataclasses.dataclass(frozen=True)
class Kernels:
  """What one iteration of the marked loop (a decode step) launches, read from the optimized HLO.

  kernels: launched operations (fusions, library calls, copies, collectives), nested loops of
           known trip count multiplied out; what runs only on the host (tuples, bitcasts,
           parameters) is left out.
  bytes:   their operands and results (an upper bound of the memory traffic: an in-place update
           counts its whole buffer, an operand read by several kernels counts once for each).
  copied:  the results of the kernels that only move data (copies, slices, concatenations,
           transposes: no arithmetic), i.e. bytes written that a kernel reading in place would
           not write. A weight copied out of a stack every step shows up here.
  """

  kernels: int
  bytes: int
  copied: int


def _async_result(shape: str) -> str:
  """The result of an asynchronous `-start` written as ((operands), result, context...)."""
  if not shape.startswith('(('):
    return shape
  depth = 0
  for index, char in enumerate(shape[1:], 1):
    depth += {'(': 1, ')': -1}.get(char, 0)
    if depth == 0:  # the end of the operands' tuple
      rest = shape[index + 1:].lstrip(', ')
      return rest.split(', ')[0] if not rest.startswith('(') else rest[:rest.index(')') + 1]
  return shape


def decode_step_kernels(hlo: str, marker: str = 'decode_loop') -> Kernels:
  """The kernels of one iteration of the loop named `marker` in the optimized HLO module `hlo`."""
  fused_ops: dict[str, set[str]] = {}  # fused computation -> its opcodes (scalar index arithmetic left out)
  shapes: dict[str, str] = {}  # instruction -> its result shape (operands are written by name only)
  for name, body in re.findall(r'\n%?([\w.\-]+) [^\n]*\{\n(.*?)\n\}', '\n' + hlo, re.S):
    parsed = [m for m in map(_INSTRUCTION.match, body.splitlines()) if m]
    fused_ops[name] = {m.group(3) for m in parsed if not _SCALAR.match(m.group(2))}
    shapes.update((m.group(1), m.group(2)) for m in parsed)
  totals = dict(kernels=0, bytes=0, copied=0)

  def visit(match, count, in_loop, fused):
    opcode = match.group(3)
    if not in_loop or fused or opcode in _NOT_KERNELS or opcode.endswith('-done'):
      return
    line = match.group(0)
    operands = match.group(4)
    operands = operands[:operands.index(')')] if ')' in operands else operands
    read = sum(sum(_shape_bytes(shapes.get(operand, ''))) for operand in re.findall(r'%([\w.\-]+)', operands))
    result = sum(_shape_bytes(_async_result(match.group(2)) if opcode.endswith('-start') else match.group(2)))
    totals['kernels'] += count
    totals['bytes'] += count * (result + read)
    called = _CALLS.findall(line)
    moves = (opcode in _MOVES or (opcode in _FUSING and called and fused_ops.get(called[0], {'?'}) <= _MOVES | _FREE))
    if moves:
      totals['copied'] += count * result
  _walk(hlo, marker, visit)
  return Kernels(**totals)


def totals(found: list[Collective], in_loop: bool) -> dict[str, int]:
  """Bytes per device by kind, for the collectives inside (or outside) the marked loop."""
  result = {kind: 0 for kind in KINDS}
  for collective in found:
    if collective.in_loop == in_loop:
      result[collective.kind] += collective.bytes * collective.count
  return result


def by_link(found: list[Collective], in_loop: bool, link: Callable[[tuple[int, ...]], str],
            bandwidth: Callable[[str], float]) -> dict[str, dict[str, float]]:
  """The collectives inside (or outside) the marked loop by the link class they run on: each on the
  slowest class any of its groups uses (`link(group)`: e.g. 'nvlink', 'network', 'ici'), with its
  bytes per device and interconnect time at `bandwidth(class)` bytes/s per device (the module
  docstring's estimate). -> {class: {'bytes': ..., 'seconds': ...}}; a collective over one device
  moves nothing and is left out."""
  result: dict[str, dict[str, float]] = {}
  for collective in found:
    size = collective.group_size
    if collective.in_loop != in_loop or not collective.bytes or size <= 1:
      continue
    classes = {link(group) for group in collective.groups if len(group) > 1}
    slowest = min(classes, key=bandwidth)
    factor = {'all-reduce': 2.0 * (size - 1) / size, 'permute': 1.0}.get(collective.kind, (size - 1) / size)
    entry = result.setdefault(slowest, dict(bytes=0, seconds=0.0))
    entry['bytes'] += collective.count * collective.bytes
    entry['seconds'] += collective.count * collective.bytes * factor / bandwidth(slowest)
  return result


def seconds(found: list[Collective], in_loop: bool, bandwidth: Callable[[tuple[int, ...]], float]) -> float:
  """Interconnect time estimate of the collectives inside (or outside) the marked loop;
  `bandwidth(group)` is the bytes/s per device of the slowest link the group spans."""
  return sum(entry['seconds'] for entry in by_link(found, in_loop, lambda group: group, bandwidth).values())
