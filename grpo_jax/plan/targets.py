"""Accelerators to compile for without having them: TPU slices and GPU clusters, deviceless.

JAX compiles for a topology that is not attached ("deviceless" ahead-of-time compilation): with
the TPU compiler (the `libtpu` wheel) or the GPU one (`jax-cuda12-plugin`, plus `ptxas` from
`nvidia-cuda-nvcc-cu12`) importable, `jax.experimental.topologies` describes the target's devices,
a mesh is built over them, and `jit(f).trace(...).lower().compile()` runs the real XLA:TPU /
XLA:GPU passes and the real Mosaic / Triton kernel compilers, with `memory_analysis()` giving the
compiler's own per-device numbers. `requirements-compile.txt` pins the compilers; `make test`
installs them into `.venv/compilers` and the compile tests put that folder on PYTHONPATH.

Run deviceless compiles with `JAX_PLATFORMS=cpu` (the host's own devices are CPUs; the targets
are only compiled for, never initialised). Target names:

  v4-N, v5p-N   N TensorCores (two per chip), as Cloud TPU names them: v5p-128 is 64 chips
  v5e-N, v6e-N  N chips: v5e-8 is 8 chips
  h100xN, h200xN        N GPUs on one host (N <= 8)
  h100xHxG, h200xHxG    H hosts of G GPUs each: h100x8x8 is 64 GPUs; h100x64 means the same
"""

import contextlib
import dataclasses
import os
import re
import sys
import tempfile

from grpo_jax.errors import UserError

GiB = 1 << 30
STARTUP_LOG: list[str] = []  # what the compilers' plugins logged as jax loaded them (python -m grpo_jax.plan)


def format_bytes(value: int) -> str:
  """'1.25 GiB' from a quarter GiB up, else '12.5 MiB'."""
  return f'{value / GiB:.2f} GiB' if value >= GiB / 4 else f'{value / (1 << 20):.1f} MiB'

# Per chip: HBM bytes, peak dense bf16 FLOP/s, HBM bytes/s, inter-chip interconnect (ICI) bytes/s
# in each direction (public specifications: Cloud TPU's system-architecture pages give v4 2,400,
# v5p 4,800, v5e 1,600 and v6e 3,584 Gbps per chip; the HBM sizes are the capacity the TPU
# compiler reports when a program does not fit).
_TPU = {
    'v4': dict(hbm=32 * GiB, flops=275e12, bandwidth=1.2e12, ici=300e9, cores_per_chip=2, dims=3),
    'v5p': dict(hbm=int(95.74 * GiB), flops=459e12, bandwidth=2.765e12, ici=600e9, cores_per_chip=2, dims=3),
    'v5e': dict(hbm=16 * GiB, flops=197e12, bandwidth=0.819e12, ici=200e9, cores_per_chip=1, dims=2),
    'v6e': dict(hbm=32 * GiB, flops=918e12, bandwidth=1.64e12, ici=448e9, cores_per_chip=1, dims=2),
}
# The compiler's topology names: chips -> physical shape (x, y[, z]).
_SHAPES_3D = {4: '2x2x1', 8: '2x2x2', 16: '2x2x4', 32: '2x4x4', 64: '4x4x4', 128: '4x4x8',
              256: '4x8x8', 512: '8x8x8', 1024: '8x8x16', 2048: '8x16x16', 4096: '16x16x16'}
_SHAPES_2D = {1: '1x1', 4: '2x2', 8: '2x4', 16: '4x4', 32: '4x8', 64: '8x8', 128: '8x16', 256: '16x16'}

# NVIDIA Hopper GPUs (SXM), from NVIDIA's public specifications: 132 SMs of 228 KiB shared memory
# (227 KiB opt-in per block) and 64 Ki 32-bit registers, compute capability 9.0; what XLA:GPU's
# passes and Triton's tiling read from a stream_executor.GpuTargetConfigProto. device_memory_size
# is the HBM as the driver reports it. Links, per GPU and direction: NVLink 4 within a host (900 GB/s
# both ways), and between hosts one 400 Gb/s InfiniBand NDR adapter per GPU (HGX / DGX H100, H200).
# name: the device kind as the driver reports it; from jax 0.12 on, Pallas's Triton lowering reads
# the compute capability from it when the devices are only described (any other name: no kernels).
_GPU = {
    'h100': dict(name='NVIDIA H100 80GB HBM3', hbm=85_520_809_984, flops=989e12, bandwidth=3.35e12,
                 clock_ghz=1.98, nvlink=450e9, network=50e9),
    'h200': dict(name='NVIDIA H200', hbm=150_754_820_096, flops=989e12, bandwidth=4.8e12,
                 clock_ghz=1.98, nvlink=450e9, network=50e9),
}


# What the compilers log on stderr while compiling, in one line each (the report keeps the count).
_COMPILER_NOTES = {  # the first key a line holds names it: the partitioner's note before the memory one
    'Involuntary full rematerialization': "XLA's partitioner replicated a tensor to reshard it",
    'rematerialization': 'XLA rematerialised values to bring the program under its memory limit',
    'This indicates an error in the calculation': "XLA:GPU's scheduler and its memory accounting disagreed "
                                                  "(a compiler diagnostic; the figures above are the compiled program's)",
}


@contextlib.contextmanager
def compiler_log(lines: list):
  """Collects what native code writes to stderr (file descriptor 2) into `lines`, so the
  compilers' log lines do not interleave with the report."""
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile(mode='w+b') as captured:
    os.dup2(captured.fileno(), 2)
    try:
      yield lines
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      captured.seek(0)
      lines.extend(line for line in captured.read().decode(errors='replace').splitlines() if line.strip())


def summarise_compiler_log(lines: list) -> list[str]:
  """One line per kind of compiler message, with its count."""
  counts = {}
  for line in lines:
    kind = next((note for key, note in _COMPILER_NOTES.items() if key in line), None)
    if kind is None and re.match(r'\s*[WE]\d{4} ', line):  # absl's warnings and errors; info lines are left out
      kind = 'other compiler warnings (in --json under compiler_log)'
    if kind is not None:
      counts[kind] = counts.get(kind, 0) + 1
  return [f'{note} ({count} log line{"s" * (count > 1)})' for note, count in counts.items()]


def gpu_target_config(kind: str) -> str:
  """The text-format GpuTargetConfigProto of an NVIDIA GPU kind ('h100' or 'h200')."""
  spec = _GPU[kind]
  return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  shared_memory_per_block_optin: 232448
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  thread_dim_limit_x: 1024
  thread_dim_limit_y: 1024
  thread_dim_limit_z: 64
  memory_bandwidth: {int(spec['bandwidth'])}
  l2_cache_size: 52428800
  clock_rate_ghz: {spec['clock_ghz']}
  device_memory_size: {spec['hbm']}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  cuda_compute_capability {{ major: 9 minor: 0 }}
  device_vendor: "NVIDIA Corporation"
  name: "{spec['name']}"
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 }}
device_description_str: "{spec['name']}"
"""


# Deviceless, XLA:GPU has no GPU to time candidate kernels on, yet at its default autotune level it
# still builds every candidate config of each fusion (hundreds of nvJitLink compiles) before it
# falls back to the default one: half of a program's compile time. At level 0 it takes the default
# directly, and the compiled program is the same: the same kernels, fusions and tilings, only
# without the empty per-fusion "native emitter" annotations (the 0.5B recipe on h100x8, checked
# HLO line by line). A user's own XLA_FLAGS setting of it wins.
_DEVICELESS_OPTIONS = {'gpu': {'xla_gpu_autotune_level': 0}}


def compiler_options(platform: str) -> dict:
  """The compiler options of a deviceless compile for `platform` ('gpu', 'tpu' or 'cpu')."""
  return {name: value for name, value in _DEVICELESS_OPTIONS.get(platform, {}).items()
          if f'--{name}=' not in os.environ.get('XLA_FLAGS', '')}


@dataclasses.dataclass(frozen=True)
class Target:
  """One accelerator slice or cluster, compiled for from any host."""

  name: str  # as given, e.g. 'v5p-128' or 'h100x8x8'
  kind: str  # 'v4', 'v5p', 'v5e', 'v6e', 'h100', 'h200'
  platform: str  # 'tpu' or 'gpu'
  chips: int  # TPU chips or GPUs
  hosts: int  # GPU hosts (TPU: the compiler's own host layout)
  hbm_bytes: int  # per chip
  peak_flops: float  # dense bf16 FLOP/s per chip
  hbm_bandwidth: float  # bytes/s per chip
  link_bandwidth: float  # bytes/s per chip and direction: ICI (TPU), NVLink within a host (GPU)
  network_bandwidth: float  # bytes/s per chip between GPU hosts (TPU slices: ICI throughout)

  @property
  def device_kind(self) -> str:
    """A GPU's device kind as the driver reports it (what Pallas's Triton lowering reads the
    compute capability from); a TPU's kind name."""
    return _GPU[self.kind]['name'] if self.platform == 'gpu' else self.kind

  def link(self, devices) -> str:
    """The slowest link class a collective over `devices` (the target's device objects) uses:
    'network' when a GPU group spans hosts, else 'nvlink' (GPU) or 'ici' (a TPU slice)."""
    if self.platform == 'gpu':
      return 'network' if len({device.process_index for device in devices}) > 1 else 'nvlink'
    return 'ici'

  def link_bandwidth_of(self, link: str) -> float:
    """Bytes/s per device and direction of a link class (Target.link)."""
    return self.network_bandwidth if link == 'network' else self.link_bandwidth

  def group_bandwidth(self, devices) -> float:
    """Bytes/s per device of the slowest link a collective over `devices` uses (Target.link)."""
    return self.link_bandwidth_of(self.link(devices))

  def devices(self):
    """The target's devices, as the compiler describes them (needs its compiler installed)."""
    from jax.experimental import topologies
    try:
      if self.platform == 'tpu':
        os.environ.setdefault('TPU_SKIP_MDS_QUERY', '1')  # no Cloud metadata server to ask
        os.environ['LIBTPU_INIT_ARGS'] = with_tpu_workarounds(os.environ.get('LIBTPU_INIT_ARGS', ''))
        shape = (_SHAPES_3D if _TPU[self.kind]['dims'] == 3 else _SHAPES_2D)[self.chips]
        options = dict(chips_per_host_bounds=[1, 1, 1]) if self.chips == 1 else {}
        topology = topologies.get_topology_desc(platform='tpu', topology_name=f'{self.kind}:{shape}', **options)
      else:
        layout = f'1x{self.hosts}x{self.chips // self.hosts}'
        topology = topologies.get_topology_desc(layout, platform='cuda', topology=layout,
                                                target_config=gpu_target_config(self.kind))
    except Exception as error:  # the compiler's plugin is missing or refused the topology
      raise UserError(f'cannot describe target {self.name}: {error} (install the compilers: '
                      f'pip install -r requirements-compile.txt; see grpo_jax/targets.py)') from error
    return list(topology.devices)

  def describe(self) -> str:
    links = (f'NVLink {self.link_bandwidth / 1e9:.0f} GB/s, network {self.network_bandwidth / 1e9:.0f} GB/s'
             if self.platform == 'gpu' else f'ICI {self.link_bandwidth / 1e9:.0f} GB/s')
    return (f'{self.name}: {self.chips} x {self.kind} ({self.platform}), {self.hbm_bytes / GiB:.2f} GiB HBM, '
            f'{self.peak_flops / 1e12:.0f} TFLOP/s bf16, {self.hbm_bandwidth / 1e12:.2f} TB/s HBM, {links} per chip')


# XLA:TPU flags every TPU compile of the plan takes (unless LIBTPU_INIT_ARGS already sets them): the
# pinned libtpu's "rotated pincer short" all-reduce emitter aborts on some v5p layouts
# (rotated_pincer_short_emitter.cc: color_count >= ShardCount, 2 vs. 3 on DeepSeek-V3's fsdp 32 x
# expert 8 at more than 4 layers, 3 vs. 4 on a v5p-1024); without it the same all-reduces take
# another emitter. A run on such a slice needs the same flag.
TPU_WORKAROUNDS = ('--xla_tpu_enable_pincer_short_emitter=false',)


def with_tpu_workarounds(flags: str) -> str:
  """LIBTPU_INIT_ARGS `flags` with each of TPU_WORKAROUNDS the flags do not set already."""
  given = {flag.split('=')[0] for flag in flags.split()}
  return ' '.join([flags] * bool(flags.strip()) + [flag for flag in TPU_WORKAROUNDS if flag.split('=')[0] not in given])


LINK_NAMES = {'nvlink': 'NVLink', 'network': 'network', 'ici': 'ICI'}


def parse_target(name: str) -> Target:
  """'v5p-128', 'v5e-8', 'v6e-16', 'v4-32', 'h100x8', 'h100x8x8', 'h100x64', 'h200x8' -> Target."""
  text = name.strip().lower()
  tpu = re.fullmatch(r'(v4|v5p|v5e|v6e)-(\d+)', text)
  if tpu:
    kind, count = tpu.group(1), int(tpu.group(2))
    spec = _TPU[kind]
    chips, extra = divmod(count, spec['cores_per_chip'])
    shapes = _SHAPES_3D if spec['dims'] == 3 else _SHAPES_2D
    if extra or chips not in shapes:
      sizes = ', '.join(f'{kind}-{c * spec["cores_per_chip"]}' for c in shapes)
      raise UserError(f'--target {name}: not a {kind} slice this tool knows; one of {sizes}')
    return Target(name, kind, 'tpu', chips, 1, spec['hbm'], spec['flops'], spec['bandwidth'], spec['ici'], spec['ici'])
  gpu = re.fullmatch(r'(h100|h200)x(\d+)(?:x(\d+))?', text)
  if gpu:
    kind, first, second = gpu.group(1), int(gpu.group(2)), gpu.group(3)
    if second is not None:
      hosts, per_host = first, int(second)
    else:
      hosts, per_host = (first // 8, 8) if first > 8 and first % 8 == 0 else (1, first)
    if per_host < 1 or per_host > 8 or hosts < 1 or (second is None and first > 8 and first % 8):
      raise UserError(f'--target {name}: GPUs come 1 to 8 per host (h100x8, h100x8x8 = 8 hosts x 8)')
    spec = _GPU[kind]
    return Target(name, kind, 'gpu', hosts * per_host, hosts, spec['hbm'], spec['flops'], spec['bandwidth'],
                  spec['nvlink'], spec['network'])
  raise UserError(f'--target {name}: expected v4-N, v5p-N, v5e-N, v6e-N (Cloud TPU names) or '
                  f'h100xN, h200xN, h100xHOSTSxGPUS')


if __name__ == '__main__':  # the probes' command line (plan/probes.py), under this module's name
  from grpo_jax.errors import cli_main
  from grpo_jax.plan.probes import main
  raise SystemExit(cli_main(main)())
