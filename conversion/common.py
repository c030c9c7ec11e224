"""Pieces shared by the two conversion CLIs: a host-CPU mesh and atomic output directories."""

import contextlib
import os
import shutil

import jax

from grpo_jax.errors import UserError
from grpo_jax.sharding import MeshConfig, make_mesh


def host_mesh():
  """Conversion runs on the host's CPU devices, never on accelerators, whatever is attached."""
  return make_mesh(MeshConfig(data=1, fsdp=-1, tensor=1), devices=jax.devices('cpu'))


@contextlib.contextmanager
def atomic_directory(out: str, force: bool):
  """Yields a staging directory that replaces `out` only once everything is written.

  A crash or kill mid-conversion leaves `out` as it was (absent, or the previous good copy).
  """
  out = os.path.abspath(out)
  if os.path.exists(out) and not os.path.isdir(out):
    raise UserError(f'--out {out} exists and is not a directory')
  if os.path.isdir(out) and os.listdir(out) and not force:
    raise UserError(f'--out {out} already exists and is not empty; pass --force to replace it')
  staging = out.rstrip('/') + '.partial'
  shutil.rmtree(staging, ignore_errors=True)
  os.makedirs(staging)
  try:
    yield staging
  except BaseException:
    shutil.rmtree(staging, ignore_errors=True)
    raise
  previous = out.rstrip('/') + '.previous'
  if os.path.exists(out):
    os.replace(out, previous)
  os.replace(staging, out)
  shutil.rmtree(previous, ignore_errors=True)
