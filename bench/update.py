"""python bench/update.py [--preset P] [--rows B] [--micro-batch-size M] [--remat R] [--dtype D] [--torch]

Seconds per jitted GRPO update (rl/update.py's optimizer step on one scored batch), trained tokens/s
and model-FLOPs utilisation, optionally against the same update in PyTorch (--torch).

The update is the trainer's own: rl.update.update, jitted as rl/step.py jits it, on a one-device mesh
with the state donated and its shardings pinned, compiled ahead of time so XLA's memory analysis can be printed before it
runs. Weights are random (the model section's build), the batch is random token ids with left padding on every
eighth row, completion masks of random length, random advantages and sampler log-probs. Defaults:
mu = 1, one mini-batch, beta = 0 (the on-policy update: no pi_old or pi_ref pass).

Model FLOPs of one update (remat recomputation, masked-out attention and padding are not discounted
or added: every row is B x T dense tokens). With T = Tp + N tokens per row, N completion tokens,
  P = L * (2*D*N_q*H + 2*D*K*H + 3*D*F)   non-embedding matmul parameters (q, o; k, v; gate, up, down)
  forward(row) = 2*P*T + 2*D*V*N + 2*L*N_q*H*T^2
    2*P per token; the lm_head's 2*D*V only on the N positions whose log-probs are taken (neither
    side computes logits for the prompt; counted once when tied, the embedding gather never);
    causal attention QK^T and PV, 2 * 2*N_q*H per (query, key) pair over T^2/2 pairs, i.e.
    2 * 2*L*N_q*H * (T/2) per token
  update = B * (3 * mu * forward(row) + scoring_passes * forward(row))
    backward = 2 x forward; scoring_passes = [mu > 1 or several mini-batches] (pi_old) + [beta > 0]
  --lora-rank R (adapters on every projection, the base frozen): no weight gradient of the base,
    so backward = 1 x forward for the matmuls with weights and 2 x for attention's; the adapters'
    own FLOPs (2 R (I + O) per adapted projection and token) are left out
MFU = update FLOPs / median seconds / peak, with peak the measured FLOP/s of a square matmul at the
compute dtype on the device (8192^3 on an accelerator, 1024^3 on CPU; metrics.matmul_peak_flops)
and, on H100/H200 in bfloat16, also NVIDIA's nominal dense bf16 peak.

--torch builds transformers' Qwen2ForCausalLM from the same architecture with its own random
weights (SDPA attention, params in --param-dtype, autocast to --dtype), and times: per micro-batch
logits of the last N + 1 positions, loss = -(A * log_softmax(logits / T)[target]) masked
token-mean over the batch's completions, backward; then clip_grad_norm_ 1.0 and AdamW (fused on
CUDA). On-policy this is the gradient of the GRPO clipped surrogate. Both sides take turns.
"""

import argparse
import functools
import os
import sys
import time

import harness

PRESETS = harness.presets('small', 'qwen2.5-0.5b', 'qwen2.5-1.5b', 'qwen2.5-7b')
# NVIDIA's dense (no sparsity) bf16 tensor-core peaks; the first matching name wins.
NOMINAL_BF16_PEAKS = (('H100 PCIe', 756e12), ('H100 NVL', 835e12), ('H200 NVL', 835e12),
                      ('H100', 989e12), ('H200', 989e12))
LOGPROB_IMPLEMENTATIONS = ('auto', 'pallas', 'pallas_mosaic_gpu', 'xla_chunked', 'naive')


def parse_args():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
  parser.add_argument('--preset', choices=sorted(PRESETS), default='small')
  parser.add_argument('--rows', type=int, default=64, help='B, rows (completions) per update')
  parser.add_argument('--prompt-length', type=int, default=256, help='Tp, left-padded prompt tokens')
  parser.add_argument('--completion-length', type=int, default=768, help='N, completion tokens')
  parser.add_argument('--dtype', choices=('float32', 'bfloat16'),
                      help='compute dtype (default: bfloat16 on an accelerator, float32 on CPU)')
  parser.add_argument('--param-dtype', choices=('float32', 'bfloat16'), default='float32',
                      help='storage dtype of parameters and optimizer moments (fp32 master weights)')
  parser.add_argument('--remat', choices=('none', 'full', 'dots', 'dots_no_batch'), default='none')
  parser.add_argument('--micro-batch-size', type=int, default=0,
                      help='rows per gradient-accumulation chunk inside the jit (default: the mini-batch)')
  parser.add_argument('--no-scan-layers', action='store_true', help='unroll the layer loop')
  parser.add_argument('--attention', choices=('dense', 'chunked', 'cudnn'), default='dense',
                      help='training attention (model.attention)')
  parser.add_argument('--attention-chunk', type=int, default=512, help='queries per chunk for --attention chunked')
  parser.add_argument('--logprob-implementation', choices=LOGPROB_IMPLEMENTATIONS, default='auto')
  parser.add_argument('--ppo-epochs', type=int, default=1, help='mu')
  parser.add_argument('--num-minibatches', type=int, default=1)
  parser.add_argument('--kl-beta', type=float, default=0.0, help='beta > 0 adds the pi_ref pass')
  parser.add_argument('--lora-rank', type=int, default=0,
                      help='R > 0: LoRA adapters of rank R (alpha 2R) on every projection, the base frozen')
  parser.add_argument('--warmup', type=int, default=2, help='untimed updates of each side first')
  parser.add_argument('--repeats', type=int, default=5, help='timed updates (median)')
  parser.add_argument('--threads', type=int, default=os.cpu_count(), help='CPU threads (CPU only)')
  parser.add_argument('--torch', action='store_true',
                      help='also time the update in PyTorch (transformers Qwen2ForCausalLM)')
  args = parser.parse_args()
  for name in ('rows', 'prompt_length', 'completion_length', 'ppo_epochs', 'num_minibatches',
               'warmup', 'repeats', 'threads', 'attention_chunk'):
    if getattr(args, name) < 1:
      parser.error(f'--{name.replace("_", "-")} must be >= 1, got {getattr(args, name)}')
  if args.rows < 2:
    parser.error('--rows must be >= 2 (the rows are one group of G = B completions)')
  if args.rows % args.num_minibatches:
    parser.error(f'--num-minibatches {args.num_minibatches} must divide --rows {args.rows}')
  minibatch = args.rows // args.num_minibatches
  args.micro_batch_size = args.micro_batch_size or minibatch
  if args.micro_batch_size < 1 or minibatch % args.micro_batch_size:
    parser.error(f'--micro-batch-size {args.micro_batch_size} must divide the mini-batch of '
                 f'{minibatch} rows (--rows / --num-minibatches)')
  if args.kl_beta < 0:
    parser.error(f'--kl-beta must be >= 0, got {args.kl_beta}')
  if args.torch and args.lora_rank:
    parser.error('--torch times the full-parameter update only')
  if args.torch and (args.ppo_epochs > 1 or args.num_minibatches > 1 or args.kl_beta > 0):
    parser.error('--torch times only the on-policy update: --ppo-epochs 1, --num-minibatches 1, --kl-beta 0')
  return args


args = parse_args()
harness.limit_threads(args.threads)
if args.torch:
  # Both frameworks share the accelerator: JAX must not reserve most of its memory up front.
  os.environ.setdefault('XLA_PYTHON_CLIENT_PREALLOCATE', 'false')

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from grpo_jax import config as config_lib  # noqa: E402
from grpo_jax import testing  # noqa: E402
from grpo_jax.errors import UserError  # noqa: E402
from grpo_jax.model import MeshConfig, ModelOptions, Qwen2Config, make_mesh, to_hf_dict  # noqa: E402
from grpo_jax.metrics import matmul_peak_flops  # noqa: E402
from grpo_jax.rl.held import Held
from grpo_jax.rl import update as update_lib  # noqa: E402
from grpo_jax.rl.batch import Batch  # noqa: E402
from grpo_jax.model import lora  # noqa: E402
from grpo_jax.model.lora import LoraConfig  # noqa: E402
from grpo_jax.rl.state import create_train_state  # noqa: E402

GiB = 2 ** 30


def run_config(architecture: Qwen2Config, dtype: str) -> config_lib.Config:
  """The run config the trainer would see: one prompt with G = B completions of N tokens."""
  return config_lib.Config(
      model=config_lib.ModelConfig(architecture=architecture, options=ModelOptions(
          dtype=dtype, param_dtype=args.param_dtype, remat=args.remat, scan_layers=not args.no_scan_layers,
          attention=args.attention, attention_chunk=args.attention_chunk,
          lora=LoraConfig(rank=args.lora_rank, alpha=2.0 * args.lora_rank) if args.lora_rank else None)),
      rollout=config_lib.RolloutConfig(prompts_per_step=1, max_new_tokens=args.completion_length),
      algo=config_lib.AlgoConfig(group_size=args.rows, ppo_epochs=args.ppo_epochs,
                                 num_minibatches=args.num_minibatches, kl_beta=args.kl_beta,
                                 micro_batch_size=args.micro_batch_size,
                                 logprob_implementation=args.logprob_implementation))


def random_batch(vocab_size: int, seed: int = 0) -> dict:
  """Numpy arrays of a Batch: every eighth row's prompt left-padded by up to Tp / 2 tokens,
  completions of random length in [1, N] (segment id 0 after the end, as make_batch gives)."""
  rng = np.random.default_rng(seed)
  B, Tp, N = args.rows, args.prompt_length, args.completion_length
  tokens = rng.integers(1, vocab_size, (B, Tp + N), dtype=np.int32)
  prompt_segments = np.ones((B, Tp), np.int32)
  for row in range(7, B, 8):
    prompt_segments[row, :rng.integers(1, Tp // 2 + 1) if Tp > 1 else 0] = 0
  lengths = rng.integers(1, N + 1, B)
  mask = np.arange(N)[None, :] < lengths[:, None]
  tokens[:, :Tp][prompt_segments == 0] = 0
  tokens[:, Tp:][~mask] = 0
  return dict(tokens=tokens, segment_ids=np.concatenate([prompt_segments, mask.astype(np.int32)], axis=1),
              mask=mask, advantages=rng.standard_normal(B).astype(np.float32),
              sampler_log_probs=-rng.uniform(0.01, 5.0, (B, N)).astype(np.float32))


def update_flops(config: Qwen2Config, settings) -> float:
  """Model FLOPs of one update, the formula in the module docstring."""
  D, F, L, V = config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.vocab_size
  N_q, K, H = config.num_attention_heads, config.num_key_value_heads, config.resolved_head_dim
  N, T = args.completion_length, args.prompt_length + args.completion_length
  matmul_params = L * (2 * D * N_q * H + 2 * D * K * H + 3 * D * F)
  forward = 2 * matmul_params * T + 2 * D * V * N + 2 * L * N_q * H * T ** 2
  scoring_passes = (not settings.on_policy) + (settings.algo.kl_beta > 0)
  if args.lora_rank:  # no weight gradients of the frozen base; attention's backward stays 2 x
    attention = 2 * L * N_q * H * T ** 2
    return args.rows * (forward * (2 * settings.algo.ppo_epochs + scoring_passes) + attention * settings.algo.ppo_epochs)
  return args.rows * forward * (3 * settings.algo.ppo_epochs + scoring_passes)


def memory_line(compiled) -> str:
  memory = compiled.memory_analysis()
  if memory is None:
    return 'XLA memory analysis: not available on this backend'
  return (f'XLA memory analysis: temp {memory.temp_size_in_bytes / GiB:.2f} GiB, arguments '
          f'{memory.argument_size_in_bytes / GiB:.2f} GiB, output {memory.output_size_in_bytes / GiB:.2f} '
          f'GiB (aliased with donated arguments {memory.alias_size_in_bytes / GiB:.2f} GiB)')


def jax_update(architecture: Qwen2Config, config: config_lib.Config, arrays: dict):
  """(step, settings, live) where step() runs one donated update and waits for it."""
  mesh = make_mesh(MeshConfig(data=1, fsdp=1, tensor=1), devices=jax.devices()[:1])
  model = config.model.build(mesh, 0)  # with --lora-rank: adapters on a frozen base in the compute dtype
  graphdef, params = nnx.split(model)
  params, frozen = lora.split_trainable(params)
  held = Held(reference=jax.tree.map(jnp.copy, params) if config.algo.kl_beta > 0 and frozen is None else None)
  optimizer, schedule = config.optim.build(args.warmup + args.repeats + 1)
  settings = update_lib.UpdateSettings(algo=config.algo, temperature=config.rollout.sampling.temperature,
                                       rows=config.completions_per_step)
  with jax.set_mesh(mesh):
    state = create_train_state(params, optimizer, 0, frozen=frozen)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  update = jax.jit(functools.partial(update_lib.update, graphdef=graphdef, optimizer=optimizer, schedule=schedule,
                                     settings=settings),
                   donate_argnums=0, out_shardings=(jax.tree.map(lambda x: x.sharding, state), replicated))
  batch = Batch.of_sequences(**jax.device_put(arrays))
  start = time.perf_counter()
  with jax.set_mesh(mesh):
    compiled = update.lower(state, batch, held).compile()
  print(f'compile {time.perf_counter() - start:.1f} s; {memory_line(compiled)}', flush=True)
  live = dict(state=state)

  def step():
    with jax.set_mesh(mesh):
      live['state'], live['metrics'] = jax.block_until_ready(compiled(live['state'], batch, held))

  return step, settings, live


def torch_update(architecture: Qwen2Config, config: config_lib.Config, arrays: dict):
  """(step, name): the same update in PyTorch on the same batch (see the module docstring)."""
  try:
    import torch
    import transformers
  except ImportError as error:
    raise SystemExit(f'--torch needs torch and transformers in this interpreter ({error})') from None
  device = 'cpu' if jax.default_backend() == 'cpu' else 'cuda'
  if device == 'cuda' and not torch.cuda.is_available():
    raise SystemExit(f'--torch: JAX runs on {jax.default_backend()} but this torch build '
                     f'({torch.__version__}) has no CUDA device; the comparison would be meaningless')
  if device == 'cpu':
    torch.set_num_threads(args.threads)
  model = testing.random_hf_model(0, init='default', device=device, attn_implementation='sdpa',
                                 **to_hf_dict(architecture))
  model = model.to(getattr(torch, args.param_dtype)).train()
  optim = config.optim
  optimizer = torch.optim.AdamW(model.parameters(), lr=optim.learning_rate, betas=(optim.b1, optim.b2),
                                eps=optim.eps, weight_decay=optim.weight_decay,
                                **({'fused': True} if device == 'cuda' else {}))
  tokens = torch.from_numpy(arrays['tokens']).long().to(device)
  attention = torch.from_numpy(arrays['segment_ids']).to(device)
  # grpo_jax numbers positions from each row's first real token; transformers needs them given.
  positions = (attention.cumsum(1) - 1).clamp(min=0)
  N = args.completion_length
  targets = tokens[:, -N:, None]
  mask = torch.from_numpy(arrays['mask']).to(device)
  weights = mask.float() / mask.sum()  # token-mean over the whole batch
  advantages = torch.from_numpy(arrays['advantages']).to(device)[:, None]
  temperature = config.rollout.sampling.temperature
  autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=args.dtype == 'bfloat16')
  micro = args.micro_batch_size

  def step():
    optimizer.zero_grad(set_to_none=True)
    for start in range(0, args.rows, micro):
      rows = slice(start, start + micro)
      with autocast:
        logits = model(input_ids=tokens[rows], attention_mask=attention[rows], position_ids=positions[rows],
                       logits_to_keep=N + 1).logits[:, :-1]
      log_probs = torch.log_softmax(logits.float() / temperature, dim=-1).gather(-1, targets[rows])[..., 0]
      (-(advantages[rows] * log_probs * weights[rows]).sum()).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), optim.max_grad_norm)
    optimizer.step()
    if device == 'cuda':
      torch.cuda.synchronize()

  return step, f'torch {torch.__version__} (transformers {transformers.__version__})'


def nominal_peak(device_kind: str, dtype: str) -> float | None:
  if dtype != 'bfloat16':
    return None
  return next((peak for name, peak in NOMINAL_BF16_PEAKS if name in device_kind), None)


def main():
  backend = jax.default_backend()
  device = jax.devices()[0]
  dtype = args.dtype or ('float32' if backend == 'cpu' else 'bfloat16')
  architecture = Qwen2Config(**PRESETS[args.preset])
  try:
    config = run_config(architecture, dtype)
  except UserError as error:
    raise SystemExit(f'bench/update.py: {error}') from None
  arrays = random_batch(architecture.vocab_size)
  B, Tp, N = args.rows, args.prompt_length, args.completion_length
  print(f'{args.preset}: {architecture.num_params() / 1e6:.0f}M params, {B} rows x ({Tp} + {N}) tokens, '
        f'{dtype} compute / {args.param_dtype} params, remat {args.remat}, micro-batch '
        f'{args.micro_batch_size}, {"unrolled" if args.no_scan_layers else "scanned"} layers, {args.attention} '
        f'attention, log-probs '
        f'{args.logprob_implementation}, mu={args.ppo_epochs} x {args.num_minibatches} mini-batch(es), '
        f'beta={args.kl_beta}')
  print(f'device: {backend} ({device.device_kind}), jax {jax.__version__}'
        + (f', {args.threads} threads' if backend == 'cpu' else ''), flush=True)

  jax_step, settings, live = jax_update(architecture, config, arrays)
  jax_name = 'grpo_jax'
  steps = {jax_name: jax_step}
  if args.torch:
    torch_step, torch_name = torch_update(architecture, config, arrays)
    steps[torch_name] = torch_step
  for _ in range(args.warmup - 1):  # harness.interleaved's first call is the last warm-up
    for step in steps.values():
      step()
  results = harness.interleaved(steps, args.repeats)

  flops = update_flops(architecture, settings)
  tokens = B * (Tp + N)
  peak = matmul_peak_flops(dtype, 1024 if backend == 'cpu' else 8192)
  nominal = nominal_peak(device.device_kind, dtype)
  metrics = {name: float(value) for name, value in jax.device_get(live['metrics']).items()}
  print(f'model FLOPs per update {flops:.3e}; peak: measured {"1024" if backend == "cpu" else "8192"}^3 '
        f'{dtype} matmul {peak / 1e12:.2f} TFLOP/s'
        + (f', nominal dense bf16 {nominal / 1e12:.0f} TFLOP/s' if nominal else ''))
  header = f'{"implementation":<44} {"s/update":>9} {"tokens/s":>10} {"TFLOP/s":>8} {"MFU meas.":>9}'
  print(header + (f' {"MFU nom.":>8}' if nominal else ''))
  for name, (_, seconds) in results.items():
    rate = flops / seconds
    print(f'{name:<44} {seconds:>9.4f} {tokens / seconds:>10.0f} {rate / 1e12:>8.2f} {rate / peak:>9.1%}'
          + (f' {rate / nominal:>8.1%}' if nominal else ''))
  if args.torch:
    print(f'grpo_jax/torch throughput ratio: {results[torch_name][1] / results[jax_name][1]:.2f}x '
          '(> 1: grpo_jax faster)')
  stats = device.memory_stats() or {}
  if 'peak_bytes_in_use' in stats:
    print(f'JAX peak device memory in use: {stats["peak_bytes_in_use"] / GiB:.2f} GiB')
  print(f'median of {args.repeats} after {args.warmup} warm-up; last grpo_jax update: loss '
        f'{metrics["loss"]:.4g}, grad norm {metrics["grad_norm"]:.4g}, skipped {metrics["nonfinite"]:.0f}; '
        'MFU meas. = against the measured matmul peak'
        + (', MFU nom. = against the nominal' if nominal else ''))
  return 0


if __name__ == '__main__':
  sys.exit(main())
