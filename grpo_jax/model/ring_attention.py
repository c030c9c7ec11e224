"""Ring attention: T tokens over themselves with the sequence split over the mesh's `context` axis.

Each of the c devices on the axis holds T / c of a row's tokens (its queries, keys and values). The
keys and values travel round the ring with collective permutes, one block per step, while every
device attends its queries over the block it holds; an online softmax (running max, sum and
weighted values, fp32) joins the c blocks into the one softmax `attention.attention` computes.
Each step's permute is independent of that step's attention, so the compiler overlaps the two.

The causal mask would leave a contiguous split unbalanced (the first device's queries see one
block, the last's all c). Rows are laid out in zig-zag order instead (`zigzag_order`): the row is
cut into 2c chunks and device i holds chunks i and 2c - 1 - i. A block from an earlier device j < i
is then seen whole by both of device i's chunks through its first chunk and not at all through
its second; a block from a later device j > i only by device i's second chunk, whole. Every step
after the first so computes exactly half a block's scores on every device (`zigzag` skips the
other half), the first the device's own two chunks under the causal mask.

The mask itself is the one every implementation uses: causal in slot order, within a segment, and
inside a sliding window where the layer has one, each block carrying its tokens' slots, segments
and ordinals round with it. So padded and packed rows (segments) are attended exactly as on one
device; the skipped halves are those the causal order masks whole (slots in the zig-zag order of
0 .. T - 1, as the model's full-sequence forward lays them).
"""

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from grpo_jax.model.attention import attention_mask, window_mask
from grpo_jax.sharding import auto_shape, current_mesh, length_axes

CONTEXT_AXIS = 'context'


def _chunk(length: int, devices: int) -> int:
  """Tokens per chunk of a row of `length` cut into the 2c chunks of the zig-zag layout."""
  if length % (2 * devices):
    raise ValueError(f'a context axis of {devices} splits rows into {2 * devices} chunks: '
                     f'{length} tokens do not divide')
  return length // (2 * devices)


def zigzag_order(length: int, devices: int) -> jax.Array:
  """[T] the row's token indices in the order the context axis holds them: 2c chunks, device i
  holding chunk i then chunk 2c - 1 - i (T a multiple of 2c)."""
  chunk = _chunk(length, devices)
  order = []
  for device in range(devices):
    order += [device, 2 * devices - 1 - device]
  return (jnp.asarray(order, jnp.int32)[:, None] * chunk + jnp.arange(chunk, dtype=jnp.int32)).reshape(-1)


def context_size() -> int:
  """The context axis' size in the mesh being traced under (1 off a mesh, inside a shard_map that
  made it manual, or where the rule table does not split rows' length over it: the sampler's
  decoding, whose context axis holds more rows, sharding.axis_rules)."""
  mesh = jax.sharding.get_abstract_mesh()
  return 1 if mesh.empty or CONTEXT_AXIS not in length_axes() else auto_shape(mesh).get(CONTEXT_AXIS, 1)


def to_zigzag(x: jax.Array, devices: int, axis: int = 1) -> jax.Array:
  """x with its `axis` of T tokens in zigzag_order: x[..., zigzag_order(T, c), ...]. Under a mesh
  whose context axis (of size `devices`) splits that axis, two collective permutes of half a
  device's tokens each (`_exchange`); elsewhere reshapes and one reversal."""
  axis = axis % x.ndim
  chunk = _chunk(x.shape[axis], devices)
  if context_size() == devices > 1:
    return _exchange(x, devices, axis, inverse=False)
  chunks = x.reshape(x.shape[:axis] + (2, devices, chunk) + x.shape[axis + 1:])
  first, second = jnp.take(chunks, 0, axis=axis), jnp.flip(jnp.take(chunks, 1, axis=axis), axis=axis)
  return jnp.stack([first, second], axis=axis + 1).reshape(x.shape)


def from_zigzag(x: jax.Array, devices: int, axis: int = 1) -> jax.Array:
  """to_zigzag's inverse: the tokens of `axis` back in their order."""
  axis = axis % x.ndim
  if context_size() == devices > 1:
    return _exchange(x, devices, axis, inverse=True)
  pairs = x.reshape(x.shape[:axis] + (devices, 2, x.shape[axis] // (2 * devices)) + x.shape[axis + 1:])
  first, second = jnp.take(pairs, 0, axis=axis + 1), jnp.flip(jnp.take(pairs, 1, axis=axis + 1), axis=axis)
  return jnp.concatenate([first, second], axis=axis).reshape(x.shape)


def _zigzag_place(chunk: int, devices: int) -> tuple[int, int]:
  """(device, slot) where the zig-zag layout holds chunk `chunk` of 2c."""
  return (chunk, 0) if chunk < devices else (2 * devices - 1 - chunk, 1)


def _exchange(x: jax.Array, devices: int, axis: int, inverse: bool) -> jax.Array:
  """to_zigzag (or, inverse, from_zigzag) of x whose `axis` the context axis splits: in the row's
  order device d holds chunks 2d and 2d + 1, in the zig-zag one device i chunks i and 2c - 1 - i.
  The even chunks move by one permutation of the devices and the odd ones by another, so each device
  sends and receives half its tokens twice; nothing is gathered."""
  even = [(d, _zigzag_place(2 * d, devices)[0]) for d in range(devices)]  # contiguous device -> zig-zag one
  odd = [(d, _zigzag_place(2 * d + 1, devices)[0]) for d in range(devices)]
  spec = P(*([None] * axis + [CONTEXT_AXIS]))

  def local(x, index):
    me = index[0]
    first, second = jnp.split(x, 2, axis=axis)
    if not inverse:  # send chunk 2d and chunk 2d + 1; device i's even chunk is its slot 0 when i is even
      from_even = jax.lax.ppermute(first, CONTEXT_AXIS, even)
      from_odd = jax.lax.ppermute(second, CONTEXT_AXIS, odd)
      parity = me % 2 == 0
      return jnp.concatenate([jnp.where(parity, from_even, from_odd), jnp.where(parity, from_odd, from_even)],
                             axis=axis)
    parity = me % 2 == 0  # this device's even chunk (the one whose contiguous place is slot 0 of its holder)
    to_even, to_odd = jnp.where(parity, first, second), jnp.where(parity, second, first)
    back = lambda pairs: [(j, i) for i, j in pairs]  # noqa: E731
    return jnp.concatenate([jax.lax.ppermute(to_even, CONTEXT_AXIS, back(even)),
                            jax.lax.ppermute(to_odd, CONTEXT_AXIS, back(odd))], axis=axis)

  return jax.shard_map(local, mesh=current_mesh(), in_specs=(spec, P(CONTEXT_AXIS)), out_specs=spec,
                       axis_names={CONTEXT_AXIS}, check_vma=False)(x, _device_index(devices))


def _device_index(devices: int) -> jax.Array:
  """[c] 0 .. c - 1, which a shard_map over the context axis hands each device its own entry of:
  its place on the axis. (lax.axis_index reads it from the device ids of the mesh set outside
  the jit, which under a mesh entered inside it, the sampler's prefill mesh, are other devices'.)"""
  return jnp.arange(devices, dtype=jnp.int32)


def _block_stats(q, k, v, mask, chunk: int):
  """One block's online-softmax statistics: q [B, t, K, G, H] over k, v [B, s, K, H] under mask
  [B, t, s] -> (max, sum [B, K, G, t], weighted values [B, K, G, t, Hv]) in fp32, the scores scaled
  by H^-1/2 in fp32 as `attention.grouped_attention` scales them, `chunk` queries at a time (each
  chunk rematerialised: O(chunk x s) scores live)."""
  neg = jnp.finfo(jnp.float32).min
  batch, length = q.shape[:2]
  chunk = min(chunk, length)
  while length % chunk:
    chunk -= 1

  @jax.checkpoint
  def one(inputs):
    q_chunk, mask_chunk = inputs
    s = jnp.einsum('BTKGH,BSKH->BKGTS', q_chunk, k, preferred_element_type=jnp.float32) * (q.shape[-1] ** -0.5)
    s = jnp.where(mask_chunk[:, None, None], s, neg)
    m = s.max(axis=-1)
    p = jnp.where(mask_chunk[:, None, None], jnp.exp(s - m[..., None]), 0.0)
    acc = jnp.einsum('BKGTS,BSKH->BKGTH', p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return m, p.sum(axis=-1), acc

  def split(x):  # [B, t, ...] -> [t / chunk, B, chunk, ...]
    return jnp.moveaxis(x.reshape(batch, length // chunk, chunk, *x.shape[2:]), 1, 0)

  m, l, acc = jax.lax.map(one, (split(q), split(mask)))  # [n, B, K, G, chunk, ...]
  join = lambda x: jnp.moveaxis(x, 0, 3).reshape(x.shape[1:4] + (length,) + x.shape[5:])  # noqa: E731
  return join(m), join(l), join(acc)


def _merge(stats, block):
  """Two online-softmax statistics of the same queries over disjoint keys -> their union's."""
  (m1, l1, a1), (m2, l2, a2) = stats, block
  m = jnp.maximum(m1, m2)
  s1, s2 = jnp.exp(m1 - m), jnp.exp(m2 - m)
  return m, l1 * s1 + l2 * s2, a1 * s1[..., None] + a2 * s2[..., None]


def _merge_half(stats, block, half: int):
  """`_merge` of a block's statistics that cover only the queries from `half` on."""
  tail = tuple(x[..., half:] if i < 2 else x[..., half:, :] for i, x in enumerate(stats))
  merged = _merge(tail, block)
  return tuple(jnp.concatenate([x[..., :half], y], axis=-1) if i < 2 else
               jnp.concatenate([x[..., :half, :], y], axis=-2) for i, (x, y) in enumerate(zip(stats, merged)))


def _local_ring(q, k, v, slots, segments, ordinals, index, window, *, devices: int, chunk: int, zigzag: bool,
                skip: int | None):
  """One device's part of ring_attention (inside shard_map over the context axis): its queries
  [B, t, N, H] over the c blocks of keys that pass it. skip: a step whose block is not attended
  (tests: the ring then misses it)."""
  batch, length, num_heads, head_dim = q.shape
  num_kv_heads = k.shape[2]
  grouped = q.reshape(batch, length, num_kv_heads, num_heads // num_kv_heads, head_dim)
  me = index[0]  # this device's place on the axis (_device_index)
  half = length // 2

  def mask(q_rows, k_rows, block):
    _, _, k_slots, k_segments, k_ordinals = block
    out = attention_mask(slots[:, q_rows], segments[:, q_rows], k_slots[:, k_rows], k_segments[:, k_rows])
    if window is not None:
      out = out & window_mask(ordinals[:, q_rows], k_ordinals[:, k_rows], window)
    return out

  def stats_of(q_rows, k_rows, block):
    bk, bv = block[0][:, k_rows], block[1][:, k_rows]
    return _block_stats(grouped[:, q_rows], bk, bv, mask(q_rows, k_rows, block), chunk)

  every = slice(None)
  block = (k, v, slots, segments, ordinals)
  ring = [(j, (j + 1) % devices) for j in range(devices)]
  stats = None
  for step in range(devices):
    following = jax.lax.ppermute(block, CONTEXT_AXIS, ring) if step < devices - 1 else None
    if step != skip:
      if step == 0 or not zigzag:
        part = stats_of(every, every, block)
        stats = part if stats is None else _merge(stats, part)
      else:
        # The block came from device (me - step) mod c: an earlier one's is seen through its first
        # chunk by all of this device's queries, a later one's whole by this device's second chunk.
        stats = jax.lax.cond((me - step) % devices < me,
                             lambda stats, block: _merge(stats, stats_of(every, slice(0, half), block)),
                             lambda stats, block: _merge_half(stats, stats_of(slice(half, None), every, block), half),
                             stats, block)
    block = following
  m, l, acc = stats
  out = acc / l[..., None]  # every query sees itself in its own block: l > 0
  return out.transpose(0, 3, 1, 2, 4).reshape(batch, length, num_heads, v.shape[-1]).astype(v.dtype)


def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, slots: jax.Array, segments: jax.Array, *,
                   chunk: int, ordinals: jax.Array | None = None, window: jax.Array | None = None,
                   zigzag: bool = True, skip: int | None = None) -> jax.Array:
  """`attention.attention` of T tokens over themselves under the causal segment mask (and a sliding
  `window` over `ordinals`), with T split over the current mesh's context axis. q [B, T, N, H]; k, v
  [B, T, K, H]; slots, segments, ordinals [B, T]. zigzag: the rows are in zigzag_order (slots its
  permutation of 0 .. T - 1), and the halves of blocks the causal order masks whole are skipped;
  False computes every block whole (any slots). `chunk`: queries per step of each block's scores."""
  mesh = current_mesh()
  devices = mesh.shape[CONTEXT_AXIS]
  ordinals = segments if ordinals is None else ordinals
  rows = P(None, CONTEXT_AXIS)
  local = functools.partial(_local_ring, devices=devices, chunk=chunk, zigzag=zigzag, skip=skip)
  window_spec = () if window is None else (P(),)
  return jax.shard_map(lambda q, k, v, s, g, o, i, *w: local(q, k, v, s, g, o, i, w[0] if w else None), mesh=mesh,
                       in_specs=(rows,) * 6 + (P(CONTEXT_AXIS),) + window_spec, out_specs=rows,
                       axis_names={CONTEXT_AXIS}, check_vma=False)(
      q, k, v, slots, segments, ordinals, _device_index(devices), *(() if window is None else (window,)))
