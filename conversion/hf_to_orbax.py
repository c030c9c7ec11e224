"""python -m conversion.hf_to_orbax --hf DIR --out DIR [--dtype bfloat16]

Converts a Hugging Face Qwen2/Qwen2.5 checkpoint (model.safetensors or a sharded index) to a
grpo_jax checkpoint: config.json, params/ (orbax, restorable straight onto any mesh) and the
tokenizer files. Tensors are read one at a time with positioned reads, so host memory stays near
one copy of the model.
"""

import argparse
import resource
import sys
import time

from conversion.common import atomic_directory, host_mesh
from grpo_jax.errors import UserError, cli_main
from grpo_jax.model import weights
from grpo_jax.model.hf_config import load_hf_config
from grpo_jax.model.loading import load_hf, save_orbax
from grpo_jax.model.qwen2 import ModelOptions

DTYPES = ('float32', 'bfloat16', 'float16')


@cli_main
def main(argv=None):
  parser = argparse.ArgumentParser(prog='python -m conversion.hf_to_orbax', description=__doc__.splitlines()[0])
  parser.add_argument('--hf', required=True, help='Hugging Face model directory')
  parser.add_argument('--out', required=True, help='grpo_jax checkpoint directory to write')
  parser.add_argument('--dtype', choices=DTYPES, help="stored dtype (default: the checkpoint's)")
  parser.add_argument('--force', action='store_true', help='replace a non-empty --out')
  args = parser.parse_args(sys.argv[1:] if argv is None else argv)

  start = time.perf_counter()
  config = load_hf_config(args.hf)
  dtype = args.dtype or config.checkpoint_dtype
  if dtype not in DTYPES:
    raise UserError(f'{args.hf}/config.json: dtype {dtype!r} is not supported; pass --dtype')
  weights.HFCheckpoint(args.hf).check(config)  # fail before anything is written
  with atomic_directory(args.out, args.force) as staging:
    # Only the storage dtype matters: conversion runs no forward pass.
    model = load_hf(args.hf, options=ModelOptions(param_dtype=dtype), mesh=host_mesh())
    save_orbax(model, staging, tokenizer_from=args.hf)
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
  print(f'wrote {args.out}: {config.num_params() / 1e9:.3f}B parameters as {dtype} '
        f'in {time.perf_counter() - start:.1f}s, peak host memory {peak:.2f} GiB')


if __name__ == '__main__':
  main()
