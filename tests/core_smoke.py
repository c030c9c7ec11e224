"""The core on the JAX the GPU images carry, without a GPU: `make core-smoke` runs this script in an
environment of its own (.venv-gpu-image: requirements-gpu-image.txt, Python 3.12, the GPU images'
jax/jaxlib and their packages; no jetstream, seqio, tensorflow, clu or math-verify).

It checks what the benchmarks run on those images: a forward pass (the KV-cache path against the
full sequence), the group sampler (greedy tokens against the full forward's argmax), the fused
log-prob op (against NumPy's log-softmax), the ragged decode-attention kernel's Mosaic GPU schedule (lowered for
CUDA, and interpreted against NumPy), the mixture of experts' grouped matmuls (against every
expert on every token) and its expert parallelism (two devices against one), the embedding's and the
lm_head's gradients on a data x fsdp mesh of two devices (hybrid sharding's collectives) against
one, and RL steps of the demo configs (dense, and a mixture with routing replay), with any deprecation
warning JAX or Flax raise on grpo_jax's own calls turned into an error. Not a pytest module (the
main environment runs the suite); `python tests/core_smoke.py` prints one line per check.
"""

import contextlib
import io
import json
import os
import sys
import tempfile
import warnings

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
# Two CPU devices: the expert-parallel check runs a mesh of them (the other checks use the first).
os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=2').strip()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# A deprecation that JAX, Flax, Optax or Orbax warns about on a call of grpo_jax's is an error here.
for category in (DeprecationWarning, FutureWarning):
  warnings.filterwarnings('error', category=category, module=r'grpo_jax(\.|$)')

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from grpo_jax.model import ModelOptions, Qwen2Config, init_model  # noqa: E402
from grpo_jax.ops.logprob import token_logprobs  # noqa: E402
from grpo_jax.sampler import DecodeSettings, GroupSampler, SamplingConfig  # noqa: E402

FORBIDDEN = ('jetstream', 'seqio', 'tensorflow', 'torch', 'wandb', 'mlflow')  # the trackers: only when named


def check(name, ok, detail=''):
  print(f'{"ok  " if ok else "FAIL"} {name}{": " + detail if detail else ""}', flush=True)
  if not ok:
    sys.exit(1)


def main():
  seed = int.from_bytes(os.urandom(4), 'little')
  import flax
  import jaxlib
  import optax
  import orbax.checkpoint
  print(f'jax {jax.__version__}, jaxlib {jaxlib.__version__}, flax {flax.__version__}, optax {optax.__version__}, '
        f'orbax-checkpoint {orbax.checkpoint.__version__} on Python {sys.version.split()[0]}; seed={seed}', flush=True)
  rng = np.random.default_rng(seed)
  config = Qwen2Config(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
  model = init_model(config, options=ModelOptions(dtype='float32', param_dtype='float32'), seed=seed % 1000)

  tokens = rng.integers(0, 97, (2, 11)).astype(np.int32)
  logits = np.asarray(model(tokens))
  cache = model.init_cache(2, 16)
  first, cache = model.extend(tokens[:, :7], cache)
  rest, _ = model.extend(tokens[:, 7:], cache)
  cached = np.concatenate([np.asarray(first), np.asarray(rest)], axis=1)
  error = float(np.max(np.abs(cached - logits)))
  check('forward: prefill + cached extend equal the full sequence', np.isfinite(logits).all() and error < 1e-4,
        f'max |difference| {error:.2e}')

  prompts = rng.integers(0, 97, (2, 5)).astype(np.int32)
  sampler = GroupSampler(model, group_size=2, settings=DecodeSettings(max_new_tokens=6, sampling=SamplingConfig(
      greedy=True)), slots=3)
  rollout = jax.device_get(sampler(nnx.state(model), prompts, np.ones_like(prompts), jax.random.key(seed % 1000)))
  sequences = np.concatenate([np.repeat(prompts, 2, axis=0), rollout.tokens], axis=1)
  argmax = np.asarray(model(sequences)).argmax(-1)[:, 4:-1]
  check('group sampler: greedy tokens equal the full forward\'s argmax',
        np.array_equal(rollout.tokens, argmax) and rollout.lengths.tolist() == [6] * 4)

  hidden = rng.standard_normal((3, 40, 32)).astype(np.float32)
  weight = rng.standard_normal((32, 300)).astype(np.float32) * 0.3
  targets = rng.integers(0, 300, (3, 40))
  got = np.asarray(token_logprobs(jnp.asarray(hidden), jnp.asarray(weight), jnp.asarray(targets),
                                  implementation='xla_chunked', block_vocab=128))
  z = hidden.astype(np.float64) @ weight.astype(np.float64)
  z -= z.max(-1, keepdims=True)
  want = np.take_along_axis(z - np.log(np.exp(z).sum(-1, keepdims=True)), targets[..., None], -1)[..., 0]
  error = float(np.max(np.abs(got - want)))
  check('fused log-probs equal NumPy\'s log-softmax', error < 1e-4, f'max |difference| {error:.2e}')

  # The ragged decode-attention kernel's GPU schedule (Pallas Mosaic GPU): lowered for CUDA (its
  # Mosaic GPU module built, no device needed) and interpreted here against NumPy. Rows of 0, 5 and
  # 200 of 256 slots, 7 query rows of one kv head each.
  from grpo_jax.ops import decode_attention_mosaic_gpu
  lengths = np.asarray([5, 200, 0], np.int32)
  q, k_cache, v_cache = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
                         for shape in ((3, 1, 7, 64), (2, 3, 256, 1, 64), (2, 3, 256, 1, 64)))
  args = (q, k_cache, v_cache, jnp.asarray([1], jnp.int32), jnp.asarray(lengths), jnp.ones((3, 256), jnp.int32),
          jnp.asarray(np.repeat(lengths[:, None], 7, 1)), jnp.ones((3, 7), jnp.int32))
  kernel = lambda interpret: lambda *a: decode_attention_mosaic_gpu.cache_stats(  # noqa: E731
      *a, block=64, scale=0.125, interpret=interpret)
  lowered = 'mosaic_gpu' in jax.jit(kernel(False)).trace(*args).lower(lowering_platforms=('cuda',)).as_text()
  _, l, acc = (np.asarray(x) for x in jax.jit(kernel(True))(*args))
  s = np.asarray(q[1, 0], np.float32) @ np.asarray(k_cache[1, 1, :200, 0], np.float32).T * 0.125
  p = np.exp(s - s.max(-1, keepdims=True))
  want = (p / p.sum(-1, keepdims=True)) @ np.asarray(v_cache[1, 1, :200, 0], np.float32)
  error = float(np.max(np.abs(acc[1, 0] / l[1, 0][:, None] - want)))
  check('decode attention (Mosaic GPU) lowers for CUDA and, interpreted, equals NumPy', lowered and error < 2e-2
        and not l[2].any(), f'max |difference| {error:.2e}')

  # The decode step's whole attention in the same kernel (what 'pallas' runs on a GPU): each row's
  # shared prompt read at its index, then its cache, the softmax ended in the kernel, the 7 real
  # query rows stored by TMA. Prompt segments 0 are padding.
  prompts = [jnp.asarray(rng.standard_normal((2, 64, 1, 64)), jnp.bfloat16) for _ in range(2)]
  prompt_of = np.asarray([1, 0, 1], np.int32)
  prompt_segments = np.where(np.arange(64) < 50, 1, 0)[None].repeat(2, 0).astype(np.int32)
  prompt = (*prompts, jnp.asarray(prompt_of), jnp.asarray(prompt_segments))
  whole = lambda interpret: lambda *a: decode_attention_mosaic_gpu.cache_stats(  # noqa: E731
      *a, block=64, scale=0.125, interpret=interpret, prompt=prompt, finish=True)
  lowered = 'mosaic_gpu' in jax.jit(whole(False)).trace(*args).lower(lowering_platforms=('cuda',)).as_text()
  got = np.asarray(jax.jit(whole(True))(*args), np.float32)
  read = prompt_of[1]  # row 1's prompt, its first 50 slots real
  keys = np.concatenate([np.asarray(prompts[0][read, :50, 0], np.float32), np.asarray(k_cache[1, 1, :200, 0], np.float32)])
  values = np.concatenate([np.asarray(prompts[1][read, :50, 0], np.float32),
                           np.asarray(v_cache[1, 1, :200, 0], np.float32)])
  s = np.asarray(q[1, 0], np.float32) @ keys.T * 0.125
  p = np.exp(s - s.max(-1, keepdims=True))
  error = float(np.max(np.abs(got[1, 0] - (p / p.sum(-1, keepdims=True)) @ values)))
  check('decode attention with the prompt in place, the softmax ended in the kernel (Mosaic GPU): lowers for CUDA '
        'and, interpreted, equals NumPy', lowered and got.shape == (3, 1, 7, 64) and error < 2e-2,
        f'max |difference| {error:.2e}')

  from grpo_jax.model import moe
  experts = jnp.asarray(rng.integers(0, 8, (2, 9, 2)), jnp.int32)
  experts = jnp.where(experts[..., :1] == experts[..., 1:], jnp.stack([experts[..., 0], (experts[..., 0] + 1) % 8], -1),
                      experts)  # a token's two experts differ
  x, gates = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for shape in ((2, 9, 16), (2, 9, 2)))
  weights = [jnp.asarray(0.3 * rng.standard_normal(shape), jnp.float32) for shape in ((8, 16, 12), (8, 16, 12), (8, 12, 16))]
  error = float(jnp.max(jnp.abs(moe.experts_forward(x, experts, gates, *weights) - moe.experts_dense(x, experts, gates, *weights))))
  check('mixture of experts: sorted grouped matmuls equal every expert on every token', error < 1e-4,
        f'max |difference| {error:.2e}')
  from grpo_jax import sharding
  mixture = Qwen2Config(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=8, attention_bias=False, qk_norm=True, num_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=16)
  alone = np.asarray(init_model(mixture, seed=seed % 1000)(tokens))
  mesh = sharding.make_mesh(sharding.MeshConfig(data=1, fsdp=1, tensor=1, expert=2))
  split = init_model(mixture, mesh=mesh, seed=seed % 1000)
  graphdef, state = nnx.split(split)
  with jax.set_mesh(mesh):
    parallel = np.asarray(jax.jit(lambda state: nnx.merge(graphdef, state)(tokens))(state))
  error = float(np.max(np.abs(parallel - alone)))
  check('mixture of experts: expert-parallel logits on 2 devices equal one device', error < 1e-4,
        f'max |difference| {error:.2e}')

  # Hybrid sharding's gradients: the embedding lookup's (an all-to-all within fsdp) and the fused
  # log-prob op's dW (a reduce-scatter over fsdp, a sum over data) on 2 devices against one.
  from grpo_jax.model.embedding import embedding_lookup
  table = jnp.asarray(rng.standard_normal((97, 32)), jnp.float32)
  ids = jnp.asarray(rng.integers(0, 97, (4, 9)), jnp.int32)
  cotangent = jnp.asarray(rng.standard_normal((4, 9, 32)), jnp.float32)
  head = jnp.asarray(0.3 * rng.standard_normal((32, 97)), jnp.float32)
  hidden = jnp.asarray(rng.standard_normal((4, 9, 32)), jnp.float32)

  def grads(table, head):
    return jax.grad(lambda table, head: jnp.sum(embedding_lookup(table, ids) * cotangent)
                    + jnp.sum(token_logprobs(hidden, head, ids, implementation='xla_chunked')), (0, 1))(table, head)

  alone = grads(table, head)
  for shape in (dict(data=1, fsdp=2), dict(data=2, fsdp=1)):
    mesh = sharding.make_mesh(sharding.MeshConfig(**shape))
    with jax.set_mesh(mesh):
      layouts = (sharding.named_sharding(mesh, table.shape, ('vocab', 'embed')),
                 sharding.named_sharding(mesh, head.shape, ('embed', 'vocab')))
      split = jax.jit(grads, in_shardings=layouts)(table, head)
    error = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(split, alone))
    check(f'embedding and lm_head gradients on a {shape["data"]} x {shape["fsdp"]} (data x fsdp) mesh equal one '
          'device', error < 1e-4, f'max |difference| {error:.2e}')

  from grpo_jax import train
  for name, config_name in (('demo', 'tiny_arith.yaml'), ('mixture-of-experts demo, routing replay', 'tiny_arith_moe.yaml')):
    with tempfile.TemporaryDirectory() as workdir:
      printed = io.StringIO()
      try:
        with contextlib.redirect_stdout(printed):  # the resolved config and the progress lines
          train.main(['--config', os.path.join(ROOT, 'configs', config_name), '--workdir', workdir,
                      '--set', 'train.steps=3', '--set', 'train.checkpoint_every=0'])
      except BaseException:
        print(printed.getvalue())
        raise
      with open(os.path.join(workdir, 'metrics.jsonl')) as f:
        rows = [json.loads(line) for line in f]
    steps = [row for row in rows if 'policy_loss' in row]
    check(f'RL steps of the {name} config', len(steps) == 3 and all(np.isfinite(row['policy_loss']) for row in steps),
          f'{len(steps)} steps')
  loaded = sorted(name for name in sys.modules if name.split('.')[0] in FORBIDDEN)
  check('no jetstream, seqio, tensorflow, torch, wandb or mlflow imported', not loaded, ', '.join(loaded[:5]))


if __name__ == '__main__':
  main()
