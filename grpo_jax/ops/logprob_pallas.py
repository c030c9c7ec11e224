"""Pallas log-prob kernels that never hold a [T, V] logits array: padding, block checks, and the
choice between the TPU and GPU schedules.

The forward kernel folds logits tiles into per-token statistics (tiles.py). The backward pass
recomputes each tile and contracts d logits with W (dh) and h (dW). dh sums over the vocabulary
and dW over tokens, so each gets its own kernel whose grid owns one output tile and loops over
the other axis: the logits are computed three times in total (as flash attention does for dq and
dk/dv), but no kernel needs atomics or a [T, V] buffer.

Two schedules share the tile maths, each in its own module, so that a machine imports only the
Pallas backend it runs (and the XLA path in logprob.py imports none):
  'mosaic'  (TPU, logprob_mosaic.py) the reduction is the last grid axis, with running
            statistics in VMEM scratch; (8, 128)-aligned blocks sized to fit VMEM, D whole.
  'mosaic_gpu' (GPU, logprob_mosaic_gpu.py, the default there) every grid axis is parallel and
            each program (one warpgroup) loops over the reduction, the D slices of h and W
            TMA-copied into shared memory and multiplied on WGMMA; blocks are multiples of 64.
Both run under `interpret=True` on CPU, which is how the tests exercise the kernel bodies.
"""

import jax.numpy as jnp


def _round_up(value: int, multiple: int) -> int:
  return -(-value // multiple) * multiple


def block_shapes(schedule: str, tokens: int, model: int, vocab: int, block_tokens: int,
                 block_vocab: int, block_model: int) -> tuple[int, int, int]:
  """Clamps requested blocks to the problem and checks them against the backend's rules:
  Mosaic wants (8, 128)-aligned blocks (or the whole dimension); Mosaic GPU multiples of 64 (WGMMA's
  M is 64 rows, and the dW kernel's M is block_model), block_vocab and block_model at most 256 (a
  TMA box's and WGMMA's N limit)."""
  if schedule == 'mosaic':
    block_tokens = min(block_tokens, _round_up(tokens, 8))
    if block_vocab >= vocab:
      block_vocab = vocab
    if block_tokens % 8 or (block_vocab % 128 and block_vocab != vocab):
      raise ValueError(f'mosaic blocks need block_tokens % 8 == 0 and block_vocab % 128 == 0, got '
                       f'{block_tokens} and {block_vocab}')
    return block_tokens, block_vocab, model
  block_tokens = min(block_tokens, _round_up(tokens, 64))
  for name, value in (('block_tokens', block_tokens), ('block_vocab', block_vocab),
                      ('block_model', block_model)):
    if value < 64 or value % 64 or (name != 'block_tokens' and value > 256):
      raise ValueError(f'mosaic_gpu {name} must be a multiple of 64 (block_vocab and block_model at '
                       f'most 256), got {value}')
  return block_tokens, block_vocab, block_model


def _schedule_module(schedule: str):
  """The schedule's kernels, imported only when they run (Pallas TPU or Mosaic GPU)."""
  if schedule == 'mosaic':
    from grpo_jax.ops import logprob_mosaic
    return logprob_mosaic
  from grpo_jax.ops import logprob_mosaic_gpu
  return logprob_mosaic_gpu


def _pad(array, axis: int, multiple: int):
  extra = _round_up(array.shape[axis], multiple) - array.shape[axis]
  if not extra:
    return array
  widths = [(0, 0)] * array.ndim
  widths[axis] = (0, extra)
  return jnp.pad(array, widths)


def pallas_forward(h, w, y, *, schedule, block_tokens, block_vocab, block_model, inv_temperature,
                   with_entropy, interpret):
  """h [T, D], w [D, V], y [T] int32 -> (logp [T], lse [T], entropy [T] or None), fp32.

  Padded tokens (zero rows, target 0) are computed and dropped; the backward pass pads the
  cotangents with zeros, so they contribute nothing.
  """
  tokens = h.shape[0]
  block_tokens, block_vocab, block_model = block_shapes(
      schedule, tokens, h.shape[1], w.shape[1], block_tokens, block_vocab, block_model)
  h, w = _pad(_pad(h, 0, block_tokens), 1, block_model), _pad(w, 0, block_model)
  y = _pad(y[:, None], 0, block_tokens)
  common = dict(block_tokens=block_tokens, block_vocab=block_vocab,
                inv_temperature=inv_temperature, with_entropy=with_entropy, interpret=interpret)
  columns = _schedule_module(schedule).forward(
      h, w, y, **common, **({} if schedule == 'mosaic' else dict(block_model=block_model)))
  logp, lse, *entropy = (column[:tokens, 0] for column in columns)
  return logp, lse, (entropy[0] if with_entropy else None)


def pallas_backward(h, w, y, lse, entropy, g_logp, g_entropy, *, schedule, block_tokens,
                    block_vocab, block_model, inv_temperature, interpret):
  """Per-token vectors [T] (entropy and g_entropy None without entropy) -> dh [T, D], dW [D, V]."""
  (tokens, model), with_entropy = h.shape, entropy is not None
  block_tokens, block_vocab, block_model = block_shapes(
      schedule, tokens, model, w.shape[1], block_tokens, block_vocab, block_model)
  columns = [y, lse, g_logp] + ([entropy, g_entropy] if with_entropy else [])
  columns = [_pad(column[:, None], 0, block_tokens) for column in columns]
  h_padded = _pad(_pad(h, 0, block_tokens), 1, block_model)
  w_padded = _pad(w, 0, block_model)
  common = dict(block_tokens=block_tokens, block_vocab=block_vocab,
                inv_temperature=inv_temperature, with_entropy=with_entropy, interpret=interpret)
  dh, dw = _schedule_module(schedule).backward(
      h_padded, w_padded, columns, **common,
      **({} if schedule == 'mosaic' else dict(block_model=block_model)))
  return dh[:tokens, :model], dw[:model]
