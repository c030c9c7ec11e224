"""Batch-invariant numerics: every reduction in one fixed order, whatever else shares the program.

A row's result from a library matmul, a softmax's sum or a norm's mean depends on what is around
it: XLA:CPU's dot takes another path for 1 row than for 64, for 32 columns than for 64, and splits
a long contraction over threads (measured: the row results differ in 18 of the 30 shapes tried);
a vectorised reduction groups its terms by their place in the array, so a sequence left-padded
in the sampler and packed at an offset in the trainer sums its keys in another order. Then the
sampler's log-probs and the trainer's recomputation differ in their last bits, and the importance
ratio is not 1 (algo.exact_on_policy, DESIGN.md "Exactly on-policy").

Here each reduction is a fold: a left-to-right chain of adds over the reduced index,
`((0 + t_0) + t_1) + ...`, written out in the program (a loop over blocks of FOLD_BLOCK terms, the
terms of a block one add after another), so no compiler or library chooses its order:

  matmul        y[m, n] = fold over k of x[m, k] * w[k, n]        (every projection, the lm_head)
  attention     over the keys in sequence order: scores fold over the head dim, their max (exact in
                any order), exp(s - max), the sum and the weighted values folded over the keys
  sums          fold over the axis (the norms' mean of squares, the softmaxes' sums)
  log-softmax   max + log(fold of exp(x - max)) over the vocabulary

A masked key, a padded token, an unchosen expert contributes an exact 0, and `a + 0 == a`, so the
fold visits the same real terms in the same order wherever padding sits: left-padded in the
sampler, packed at an offset in the trainer, a prompt's keys in their own cache part before the
row's. Elementwise arithmetic is the same whatever the shape; only orders needed fixing. Sharding
cannot change it either: no sum is left to a collective, since the folds are elementwise ops
across devices.

Gradients need no fixed order: each op's backward is the plain op's (custom_vjp), so training
runs the library's kernels there and only the forward values are pinned.

The ops run under `numerics(exact=True)` (the model enters it when its options say
`exact`); `leave_out(name)` gives one op back its library order, which the tests use to show
that each fixed order is needed (tests/test_exact_on_policy.py).
"""

import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp

F32 = jnp.float32
# Terms per step of a fold's loop: written out one after another in the step's body.
FOLD_BLOCK = 16
# A fold of at most this many terms is written out whole (no loop): one block.
UNROLLED = FOLD_BLOCK
# Rows per block of the exact log-prob op: its [rows, V] logits exist one block at a time.
LOGPROB_ROWS = 256
# What leave_out can give back: each fold, and settling between ops ('settle').
OPS = ('matmul', 'attention', 'sum', 'log_softmax', 'settle')

_EXACT = contextvars.ContextVar('grpo_jax_exact_numerics', default=False)
_LEFT_OUT = contextvars.ContextVar('grpo_jax_left_out', default=frozenset())


@contextlib.contextmanager
def numerics(exact: bool):
  """Within: the model's ops take their fixed-order versions when `exact` (a trace-time setting: a
  program traced inside computes in fixed order)."""
  token = _EXACT.set(bool(exact))
  try:
    yield
  finally:
    _EXACT.reset(token)


@contextlib.contextmanager
def leave_out(*names: str):
  """Within: the named ops (of OPS) keep their library order under exact numerics (for tests)."""
  unknown = set(names) - set(OPS)
  if unknown:
    raise ValueError(f'unknown fixed-order ops {sorted(unknown)}; known: {OPS}')
  token = _LEFT_OUT.set(_LEFT_OUT.get() | frozenset(names))
  try:
    yield
  finally:
    _LEFT_OUT.reset(token)


def model_numerics(method):
  """A model method traced under its own options' numerics (`options.exact`)."""
  @functools.wraps(method)
  def within(self, *args, **kwargs):
    with numerics(self.options.exact):
      return method(self, *args, **kwargs)
  return within


def exact(op: str | None = None) -> bool:
  """Whether the code being traced computes in fixed order (`op`: that op, unless left out)."""
  return _EXACT.get() and (op is None or op not in _LEFT_OUT.get())


def settle(x):
  """x materialised as it is: no consumer may recompute it inside a fusion of its own. The compiler
  contracts a multiply and an add into one fused multiply-add where they share a fusion, and which
  ops share one depends on the rest of the program: a value recomputed in a consumer's fusion may
  round otherwise than the same value computed on its own (measured: attention's scaled scores, fused
  into the softmax's exp in one program and not in another, 1 ulp apart). Every fixed-order op's
  result, and the model's elementwise values between them under exact numerics, are settled."""
  return jax.tree.map(_settle, x) if _EXACT.get() else x


def _settle(x: jax.Array) -> jax.Array:
  return x if 'settle' in _LEFT_OUT.get() else jax.lax.optimization_barrier(x)


# ---- folds ----

def _fold(arrays: tuple[jax.Array, ...], term, shape, dtype) -> jax.Array:
  """((0 + term(a[0] for a in arrays)) + term(a[1] ...)) + ... over the arrays' leading axis, into an
  accumulator of `shape` and `dtype`: written out up to UNROLLED terms, else a scan over blocks of
  FOLD_BLOCK terms written out in its body (zero-padded: a 0 term leaves the accumulator as it is)."""
  count = arrays[0].shape[0]
  acc = jnp.zeros(shape, dtype)
  if count <= UNROLLED:
    for index in range(count):
      acc = acc + term(*(a[index] for a in arrays))
    return acc
  pad = -count % FOLD_BLOCK
  blocks = tuple(jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)).reshape((-1, FOLD_BLOCK) + a.shape[1:])
                 for a in arrays)

  def body(acc, block):
    for index in range(FOLD_BLOCK):
      acc = acc + term(*(b[index] for b in block))
    return acc, None
  return jax.lax.scan(body, acc, blocks)[0]


def fold_sum(x: jax.Array, axis: int = -1) -> jax.Array:
  """sum over `axis` as ((0 + x_0) + x_1) + ..., in x's dtype (differentiable: adds only)."""
  moved = jnp.moveaxis(x, axis, 0)
  return _settle(_fold((moved,), lambda t: t, moved.shape[1:], x.dtype))


def exact_parts(x: jax.Array) -> tuple[jax.Array, ...]:
  """x as fp32 parts of at most 12 significant bits each, summing exactly to x: x itself when its
  dtype has at most 12 (bf16, fp16), else (high, low): high x's top 12 bits (the low 12 of the
  fp32 mantissa cleared), low = x - high (exact). A product of two parts has at most 24 bits: exact
  in fp32, so `acc + a * b` rounds once, whether or not the compiler fuses it into one multiply-add
  (which it does in some places of a program and not others: measured at XLA:CPU's default
  optimisation level, 55% of a fold's outputs matched an all-fused chain and 85% an unfused one)."""
  if jnp.finfo(x.dtype).nmant + 1 <= 12:
    return (x.astype(F32),)
  x = x.astype(F32)
  high = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(0xFFFFF000), F32)
  return high, x - high


def _whole_along(x: jax.Array, axis: int) -> jax.Array:
  """x with `axis` on every device whole (the others as they are), under a mesh: a contraction
  sharded over devices (a row-parallel weight, an FSDP shard) is gathered once for the fold, not
  one block at a time inside its loop (which the partitioner otherwise does: 299 GiB of gathers per
  0.5B decode step on 8 H100s, planned deviceless)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return x
  spec = [jax.sharding.PartitionSpec.UNCONSTRAINED] * x.ndim
  spec[axis] = None
  return jax.lax.with_sharding_constraint(x, jax.sharding.PartitionSpec(*spec))


def _fold_matmul_fp32(x: jax.Array, w: jax.Array) -> jax.Array:
  """x [*, M, K] @ w [*, K, N] (same leading dims) in fp32, each output a fold over k of the exact
  products of x's and w's parts (exact_parts), in the order (x part, w part) for each k."""
  x, w = _whole_along(x, x.ndim - 1), _whole_along(w, w.ndim - 2)
  xs = [jnp.moveaxis(part, -1, 0)[..., :, None] for part in exact_parts(x)]  # [K, *, M, 1]
  ws = [jnp.moveaxis(part, -2, 0)[..., None, :] for part in exact_parts(w)]  # [K, *, 1, N]
  count_x = len(xs)

  def term(*parts):
    total = None
    for a in parts[:count_x]:
      for b in parts[count_x:]:
        total = a * b if total is None else total + a * b
    return total
  shape = jnp.broadcast_shapes(xs[0].shape[1:], ws[0].shape[1:])
  return _settle(_fold((*xs, *ws), term, shape, F32))


@jax.custom_vjp
def fold_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
  """x [M, K] @ w [K, N] -> [M, N] fp32, each output a fold over k (its gradient: the plain dot's)."""
  return _fold_matmul_fp32(x, w)


def _plain_matmul(x, w):
  return jnp.dot(x, w, preferred_element_type=F32)


def _fold_matmul_fwd(x, w):
  return _fold_matmul_fp32(x, w), (x, w)


def _fold_matmul_bwd(residuals, g):
  return jax.vjp(_plain_matmul, *residuals)[1](g)


fold_matmul.defvjp(_fold_matmul_fwd, _fold_matmul_bwd)


# ---- attention ----

def _plain_attention(q, k, v, mask):
  """The library-order attention (attention.grouped_attention's maths, one part): the backward."""
  batch, length, num_heads, head_dim = q.shape
  kv_heads = k.shape[-2]
  q = q.reshape(batch, length, kv_heads, num_heads // kv_heads, head_dim)
  scores = jnp.einsum('BTKGH,BSKH->BKGTS', q, k, preferred_element_type=F32) * (head_dim ** -0.5)
  scores = jnp.where(mask[:, None, None], scores, jnp.finfo(F32).min)
  probs = jax.nn.softmax(scores, axis=-1)
  probs = jnp.where(mask[:, None, None], probs, 0.0).astype(v.dtype)
  out = jnp.einsum('BKGTS,BSKH->BTKGH', probs, v)
  return out.reshape(batch, length, num_heads, head_dim)


def _fixed_attention(q, k, v, mask):
  batch, length, num_heads, head_dim = q.shape
  keys, kv_heads = k.shape[1], k.shape[-2]
  groups = num_heads // kv_heads
  # [B, K, G*T, H] queries against [B, K, H, S] keys: one fold over H per (query, key) pair.
  q5 = q.reshape(batch, length, kv_heads, groups, head_dim).transpose(0, 2, 3, 1, 4).reshape(
      batch, kv_heads, groups * length, head_dim)
  scores = _fold_matmul_fp32(q5, k.transpose(0, 2, 3, 1))  # [B, K, G*T, S]
  scores = _settle(scores.reshape(batch, kv_heads, groups, length, keys) * (head_dim ** -0.5))
  seen = mask[:, None, None]
  scores = jnp.where(seen, scores, jnp.finfo(F32).min)
  top = _settle(jnp.max(scores, axis=-1, keepdims=True))  # a max is exact in any order
  # exp over a materialised argument, in a loop of its own: fused with the max's reduction its
  # rounding followed the batch (measured, 1 ulp at 1 row against 8).
  shifted = _settle(scores - top)
  weights = _settle(jnp.where(seen, jnp.exp(shifted), 0.0))  # masked keys: exact zeros
  total = fold_sum(weights, axis=-1)  # [B, K, G, T]
  values = _fold_matmul_fp32(weights.reshape(batch, kv_heads, groups * length, keys),
                             v.transpose(0, 2, 1, 3))  # [B, K, G*T, H]: the keys in sequence order
  out = values.reshape(batch, kv_heads, groups, length, head_dim) / jnp.where(total > 0, total, 1.0)[..., None]
  return _settle(
      out.transpose(0, 3, 1, 2, 4).reshape(batch, length, num_heads, head_dim).astype(v.dtype))


@jax.custom_vjp
def fixed_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
  """Grouped-query attention with its reductions folded over the keys in slot order. q [B, T, N, H];
  k, v [B, S, K, H]; mask [B, T, S] -> [B, T, N, H] in v's dtype. A fully masked query gives 0."""
  return _fixed_attention(q, k, v, mask)


def _fixed_attention_fwd(q, k, v, mask):
  return _fixed_attention(q, k, v, mask), (q, k, v, mask)


def _fixed_attention_bwd(residuals, g):
  q, k, v, mask = residuals
  dq, dk, dv = jax.vjp(lambda q, k, v: _plain_attention(q, k, v, mask), q, k, v)[1](g)
  return dq, dk, dv, None


fixed_attention.defvjp(_fixed_attention_fwd, _fixed_attention_bwd)


# ---- softmax, log-softmax ----

def softmax(x: jax.Array, axis: int = -1) -> jax.Array:
  """softmax with its sum folded (fp32 in, fp32 out; differentiable through the fold)."""
  shifted = settle(x - jax.lax.stop_gradient(settle(jnp.max(x, axis=axis, keepdims=True))))
  weights = settle(jnp.exp(shifted))
  return settle(weights / jnp.expand_dims(fold_sum(weights, axis=axis), axis))


def log_sum_exp(x: jax.Array) -> jax.Array:
  """[..., V] fp32 -> [...]: max + log(fold over V of exp(x - max))."""
  top = _settle(jnp.max(x, axis=-1))
  finite = _settle(jnp.where(jnp.isfinite(top), top, 0.0))
  shifted = _settle(x - finite[..., None])
  terms = _settle(jnp.exp(shifted))
  log_total = _settle(jnp.log(fold_sum(terms, axis=-1)))
  return _settle(finite + log_total)


def token_log_probs(logits: jax.Array, targets: jax.Array, temperature: float) -> jax.Array:
  """log softmax(logits / temperature)[targets] with the vocabulary's sum folded: logits [..., V]
  fp32, targets [...] -> [...] fp32. The sampler's and the trainer's one formula."""
  scaled = _settle(logits / temperature)
  picked = jnp.take_along_axis(scaled, targets[..., None], axis=-1)[..., 0]
  if 'log_softmax' in _LEFT_OUT.get():
    return picked - jax.nn.logsumexp(scaled, axis=-1)
  return _settle(picked - log_sum_exp(scaled))


def _exact_logprobs(h, w, y, temperature):
  rows = h.shape[0]
  block = min(LOGPROB_ROWS, rows)
  pad = -rows % block
  if pad:
    h = jnp.concatenate([h, jnp.zeros((pad, h.shape[1]), h.dtype)])
    y = jnp.concatenate([y, jnp.zeros((pad,), y.dtype)])

  def one(inputs):
    hb, yb = inputs
    return token_log_probs(_fold_matmul_fp32(hb, w), yb, temperature)
  out = jax.lax.map(one, (h.reshape(-1, block, h.shape[1]), y.reshape(-1, block)))
  return out.reshape(-1)[:rows]


def _naive_logprobs(h, w, y, temperature):
  logits = jnp.dot(h, w, preferred_element_type=F32) / temperature
  return jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), y[:, None], axis=-1)[:, 0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def exact_logprobs(h: jax.Array, w: jax.Array, y: jax.Array, temperature: float) -> jax.Array:
  """log softmax(h @ w / temperature)[y] for h [T, D], w [D, V], y [T]: the logits a fold over D,
  the log-sum-exp a fold over V, LOGPROB_ROWS tokens at a time (rows are independent). Gradient:
  the naive path's."""
  return _exact_logprobs(h, w, y, temperature)


def _exact_logprobs_fwd(h, w, y, temperature):
  return _exact_logprobs(h, w, y, temperature), (h, w, y)


def _exact_logprobs_bwd(temperature, residuals, g):
  h, w, y = residuals
  dh, dw = jax.vjp(lambda h, w: _naive_logprobs(h, w, y, temperature), h, w)[1](g)
  return dh, dw, None


exact_logprobs.defvjp(_exact_logprobs_fwd, _exact_logprobs_bwd)
