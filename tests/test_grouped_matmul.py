"""The grouped matmul (grpo_jax/ops/grouped_matmul.py): its Triton kernels, interpreted on CPU,
against jax.lax.ragged_dot (forward, d rows, d weight), the tile map against a NumPy walk of
the groups, and the programs the real TPU and GPU compilers make of a Qwen3-30B-A3B expert MLP."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.ops.grouped_matmul import QWEN3_30B_A3B, grouped_matmul, row_tiles
from test_deviceless import _run

HIGHEST = jax.lax.Precision.HIGHEST
# fp32 throughout; the kernels sum the contraction in another order than XLA's dot, nothing else.
RTOL, ATOL = 1e-5, 1e-5


def _sizes(rng, case: str, groups: int, rows: int) -> np.ndarray:
  """Group sizes of one kind: random with empty groups, every row in one group, a total short of
  the rows (the rest must come out as zeros), or a total past them (cut at R, as ragged_dot does)."""
  if case == 'one_group':
    sizes = np.zeros(groups, np.int32)
    sizes[rng.integers(groups)] = rows
    return sizes
  cuts = np.sort(rng.integers(0, rows + 1, groups - 1))
  sizes = np.diff(np.concatenate([[0], cuts, [rows]])).astype(np.int32)
  sizes[rng.choice(groups, 2, replace=False)] = 0  # empty groups, wherever they fall
  if case == 'short':
    sizes[-1] = 0
    sizes = np.minimum(sizes, rows // groups)
  if case == 'past':
    sizes[-1] += rows // 3
  return sizes


def _product_and_grads(matmul, rows, weight, sizes, d_out):
  out, pullback = jax.vjp(lambda r, w: matmul(r, w, sizes), rows, weight)
  return (out, *pullback(d_out))


# D and M that the 16- and 32-wide tiles do not divide (masked edges), and one that they do.
@pytest.mark.parametrize('case, shape, block_rows', [
    ('random', (53, 40, 24, 6), 16), ('one_group', (40, 48, 40, 5), 16),
    ('short', (50, 32, 64, 4), 16), ('past', (37, 48, 40, 5), 32), ('random', (96, 64, 32, 8), None)])
def test_triton_kernels_match_ragged_dot(seed, case, shape, block_rows):
  rows, model, hidden, groups = shape
  rng = np.random.default_rng(seed)
  sizes = jnp.asarray(_sizes(rng, case, groups, rows))
  x = jnp.asarray(rng.standard_normal((rows, model)), jnp.float32)
  weight = jnp.asarray(rng.standard_normal((groups, model, hidden)), jnp.float32)
  d_out = jnp.asarray(rng.standard_normal((rows, hidden)), jnp.float32)

  def triton(r, w, s):
    return grouped_matmul(r, w, s, implementation='triton', block_rows=block_rows, interpret=True)

  def reference(r, w, s):
    return jax.lax.ragged_dot(r, w, s, precision=HIGHEST)

  got = jax.jit(_product_and_grads, static_argnums=0)(triton, x, weight, sizes, d_out)
  want = jax.jit(_product_and_grads, static_argnums=0)(reference, x, weight, sizes, d_out)
  for name, a, b in zip(('out', 'd rows', 'd weight'), got, want):
    scale = float(jnp.max(jnp.abs(b))) or 1.0
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=ATOL * scale,
                               err_msg=f'{name}, sizes {np.asarray(sizes)}')
  total = min(int(jnp.sum(sizes)), rows)
  # Exact zeros past the groups' total, in the output and in d rows, as ragged_dot gives.
  assert not np.any(np.asarray(got[0][total:])) and not np.any(np.asarray(got[1][total:]))


def test_auto_is_ragged_dot_off_gpu():
  """On CPU (and TPU) the default is XLA's ragged_dot itself, not the interpreted kernels."""
  args = (jnp.ones((8, 4)), jnp.ones((2, 4, 3)), jnp.array([3, 5], jnp.int32))
  assert 'ragged_dot' in str(jax.make_jaxpr(grouped_matmul)(*args))
  assert 'pallas_call' not in str(jax.make_jaxpr(grouped_matmul)(*args))


@pytest.mark.parametrize('block_rows', [16, 64])
def test_row_tiles_cover_each_row_once_within_one_group(seed, block_rows):
  """Every row lies in exactly one tile, every tile in one group (group E: past the total), no
  tile is taller than block_rows, and Tl = ceil(R / block_rows) + E tiles were enough."""
  rng = np.random.default_rng(seed)
  rows, groups = 300, 12
  tiles = jax.jit(row_tiles, static_argnums=(1, 2))
  for case in ('random', 'one_group', 'short', 'past'):
    sizes = _sizes(rng, case, groups, rows)
    group, start, end = (np.asarray(a) for a in tiles(jnp.asarray(sizes), rows, block_rows))
    owner = np.searchsorted(np.minimum(np.cumsum(sizes), rows), np.arange(rows), side='right')
    covered = np.zeros(rows, int)
    for g, s, e in zip(group, start, end):
      assert 0 <= e - s <= block_rows
      covered[s:e] += 1
      assert np.all(owner[s:e] == g), (case, sizes, g, s, e)
    assert np.all(covered == 1), (case, sizes)


# ---- compiled by the real XLA:GPU / Triton and XLA:TPU / Mosaic compilers (deviceless) ----

@pytest.mark.exhaustive
@pytest.mark.starts_first
@pytest.mark.parametrize('platform, target, kernel', [('gpu', 'h100x1', '__gpu$xla.gpu.triton'),
                                                      ('tpu', 'v5p-8', 'tpu_custom_call')])
def test_expert_mlp_compiles_without_dense_expansion(platform, target, kernel):
  """Forward and backward of a Qwen3-30B-A3B expert MLP (E = 128, D = 2,048, M = 768, bf16) over
  R = 4,096 sorted rows: grouped-matmul kernels in the compiled program (Triton on GPU: three
  forward, three d rows, three d weight), and no array with both an E and an R dimension (what
  XLA:GPU's own expansion of ragged_dot builds: [128, 4096, 2048] and the like)."""
  result = _run(platform, ['grpo_jax.plan.experts', 'mlp', target, '--rows', '4096'], timeout=600)
  lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith('{')]
  assert lines and result.returncode == 0, result.stderr[-3000:]
  summary = lines[0]
  calls = summary['custom_calls'].get(kernel, 0)
  assert calls == 9 if platform == 'gpu' else calls > 0, summary
  assert summary['dense_expansion'] == [], summary
  # The largest array is a weight (or its gradient), not an activation of E x R rows.
  experts, model, hidden = QWEN3_30B_A3B['experts'], QWEN3_30B_A3B['model'], QWEN3_30B_A3B['hidden']
  assert summary['largest_bytes'] <= experts * model * hidden * 2, summary
