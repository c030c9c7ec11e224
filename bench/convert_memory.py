"""python bench/convert_memory.py [--dtype bfloat16|float32] [--shards N] [--keep]

Peak host memory of `python -m conversion.hf_to_orbax` on a random multi-GB Qwen2 checkpoint
(a Qwen2.5-1.5B shape by default), against the checkpoint's size on disk.

The converter runs in a child process whose resident set is sampled from /proc while it runs,
split into anonymous memory (arrays) and file-backed pages (the safetensors files the converter
reads), since both count towards the peak that `ru_maxrss` reports.
"""

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import ml_dtypes
import numpy as np

from grpo_jax.model import Qwen2Config, to_hf_dict
from grpo_jax.model import weights

SHAPE_1_5B = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                  num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True)
GiB = 2**30


def random_tensor(shape, dtype, seed: int) -> np.ndarray:
  """Normal(0, 0.02) filled in row blocks so only the output (not an fp32 copy) is ever whole."""
  rng = np.random.default_rng(seed)
  out = np.empty(shape, dtype)
  flat = out.reshape(shape[0], -1) if len(shape) > 1 else out.reshape(1, -1)
  rows = max(1, (1 << 24) // flat.shape[1])
  for start in range(0, flat.shape[0], rows):
    block = flat[start:start + rows]
    block[...] = rng.standard_normal(block.shape, np.float32) * 0.02
  return out


def write_checkpoint(config: Qwen2Config, directory: str, dtype, shards: int) -> int:
  """Writes config.json, `shards` safetensors files and their index; returns the tensor bytes."""
  entries = []
  for rule in weights.rules_for(config):
    for name in rule.all_hf_names(config):
      shape = rule.hf_shape(config)
      seed = len(entries)
      entries.append(weights.TensorEntry(name, shape, np.dtype(dtype),
                                         lambda shape=shape, seed=seed: random_tensor(shape, dtype, seed)))
  total = sum(entry.nbytes for entry in entries)
  # Cut into shards of about total / shards bytes, in name order like save_pretrained.
  groups, size = [[]], 0
  for entry in entries:
    if groups[-1] and size >= total / shards * len(groups):
      groups.append([])
    groups[-1].append(entry)
    size += entry.nbytes
  weight_map = {}
  for number, group in enumerate(groups, 1):
    file_name = f'model-{number:05d}-of-{len(groups):05d}.safetensors'
    weights.write_safetensors(os.path.join(directory, file_name), group, metadata={'format': 'pt'})
    weight_map.update({entry.name: file_name for entry in group})
  with open(os.path.join(directory, weights.INDEX_FILE), 'w') as f:
    json.dump({'metadata': {'total_size': total}, 'weight_map': weight_map}, f, indent=2)
  with open(os.path.join(directory, 'config.json'), 'w') as f:
    json.dump(to_hf_dict(config, dtype=np.dtype(dtype).name), f, indent=2)
  return total


def rss_sample(pid: int) -> dict[str, int]:
  """VmRSS, RssAnon and RssFile of `pid` in bytes (empty once it has exited)."""
  sample = {}
  try:
    with open(f'/proc/{pid}/status') as f:
      for line in f:
        key, _, value = line.partition(':')
        if key in ('VmRSS', 'RssAnon', 'RssFile'):
          sample[key] = int(value.split()[0]) * 1024
  except (FileNotFoundError, ProcessLookupError):
    pass
  return sample


def directory_bytes(path: str) -> int:
  return sum(os.path.getsize(os.path.join(root, name)) for root, _, files in os.walk(path) for name in files)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
  parser.add_argument('--dtype', choices=('bfloat16', 'float32'), default='bfloat16', help='stored dtype')
  parser.add_argument('--convert-dtype', choices=('bfloat16', 'float32'), help='hf_to_orbax --dtype')
  parser.add_argument('--layers', type=int, default=SHAPE_1_5B['num_hidden_layers'])
  parser.add_argument('--shards', type=int, default=2)
  parser.add_argument('--keep', action='store_true', help='keep the temporary directory')
  args = parser.parse_args()

  config = Qwen2Config(**{**SHAPE_1_5B, 'num_hidden_layers': args.layers}, checkpoint_dtype=args.dtype)
  dtype = ml_dtypes.bfloat16 if args.dtype == 'bfloat16' else np.float32
  work = tempfile.mkdtemp(prefix='bench_convert_', dir='/tmp')
  try:
    hf, out = os.path.join(work, 'hf'), os.path.join(work, 'orbax')
    os.makedirs(hf)
    start = time.perf_counter()
    tensor_bytes = write_checkpoint(config, hf, dtype, args.shards)
    hf_bytes = directory_bytes(hf)
    print(f'wrote {config.num_params() / 1e9:.3f}B-parameter {args.dtype} checkpoint, '
          f'{hf_bytes / GiB:.2f} GiB in {args.shards} shards, in {time.perf_counter() - start:.0f}s')

    command = [sys.executable, '-m', 'conversion.hf_to_orbax', '--hf', hf, '--out', out]
    command += ['--dtype', args.convert_dtype] if args.convert_dtype else []
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    child = subprocess.Popen(command, cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peaks = {'VmRSS': 0, 'RssAnon': 0, 'RssFile': 0}
    file_at_peak = 0
    while child.poll() is None:
      sample = rss_sample(child.pid)
      for key, value in sample.items():
        peaks[key] = max(peaks[key], value)
      if sample.get('VmRSS', 0) >= peaks['VmRSS']:
        file_at_peak = sample.get('RssFile', 0)
      time.sleep(0.02)
    output = child.stdout.read()
    if child.returncode:
      sys.exit(f'hf_to_orbax failed ({child.returncode}):\n{output}')
    print(output.strip().splitlines()[-1])
    ru_peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # Linux: KiB

    orbax_bytes = directory_bytes(out)
    rows = [('checkpoint on disk (safetensors)', hf_bytes), ('orbax output on disk', orbax_bytes),
            ('peak RSS, ru_maxrss', ru_peak), ('peak RSS, sampled', peaks['VmRSS']),
            ('  file-backed pages at that peak', file_at_peak),
            ('peak anonymous RSS (sampled)', peaks['RssAnon']),
            ('peak file-backed RSS (sampled)', peaks['RssFile'])]
    print(f'{"":<34} {"GiB":>7} {"x ckpt":>7}')
    for name, value in rows:
      print(f'{name:<34} {value / GiB:>7.2f} {value / tensor_bytes:>7.2f}')
  finally:
    if args.keep:
      print(f'kept {work}')
    else:
      shutil.rmtree(work, ignore_errors=True)


if __name__ == '__main__':
  main()
