"""python bench/grpo_step.py [--threads N] [--steps S] [--warmup W] [--fused-steps K] [--no-trl]

Seconds per GRPO step split into rollout / reward / update, completion tokens/s and model FLOPs
utilisation of grpo_jax against TRL's GRPOTrainer (PyTorch, CPU) on one fixed tiny workload: the
same random Qwen2 weights (D=256, F=704, 4 layers, 8 query / 2 key-value heads, the arithmetic
task's 17-token vocabulary), 8 prompts x G=8 completions of exactly 32 new tokens (no early stop on
either side), one fp32 AdamW update per batch (mu=1), beta=0, the same learning rate and CPU threads.

grpo_jax runs in this process: train.Run.host_step (jitted rollout -> JAX reward -> jitted update),
then the fused K-steps-per-jit path that `python -m grpo_jax.train` takes for this task, with the
four layers unrolled (model.scan_layers: false, as configs/tiny_arith.yaml: on XLA:CPU the scan's
stacked residuals cost more than they save at this depth). TRL runs in
a subprocess of bench/.venv-trl/bin/python (this script with --trl-worker; set it up with the
command in TRL_SETUP). The two sides take turns step by step, so drift in the load of a shared
machine reaches both alike; each reports the median of S steps after W warm-up steps. MFU divides
the same model FLOP count by the same measured peak (XLA's 1024^2 fp32 matmul; torch's is printed).
"""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

import harness

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
TRL_PYTHON = os.path.join(BENCH_DIR, '.venv-trl', 'bin', 'python')
TRL_SETUP = ('python3 -m venv bench/.venv-trl && bench/.venv-trl/bin/pip install torch==2.13.0 '
             '-r bench/requirements-trl.txt')
# Qwen2 shape of the workload; the vocabulary is the arithmetic task's.
ARCHITECTURE = dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8,
                    num_key_value_heads=2, tie_word_embeddings=True, rope_theta=10000.0)
MAX_OPERAND = 9  # prompts '<bos>a+b=' with single digits: 5 tokens, no padding
# The turn-taking protocol: the worker writes WAITING before each TRL step and runs it on GO.
WAITING, GO = 'waiting', 'go'


def parse_args():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
  parser.add_argument('--threads', type=int, default=2, help='CPU threads for each side (default 2)')
  parser.add_argument('--steps', type=int, default=5, help='timed steps per side (median)')
  parser.add_argument('--warmup', type=int, default=2, help='untimed steps first (compilation, lazy init)')
  parser.add_argument('--fused-steps', type=int, default=5, help='K for the fused grpo_jax row; 0 skips it')
  parser.add_argument('--prompts', type=int, default=8, help='P, prompts per step')
  parser.add_argument('--group', type=int, default=8, help='G, completions per prompt')
  parser.add_argument('--new-tokens', type=int, default=32, help='N, tokens per completion')
  parser.add_argument('--learning-rate', type=float, default=1e-6)
  parser.add_argument('--no-trl', action='store_true', help='run only the grpo_jax side')
  parser.add_argument('--trl-python', default=TRL_PYTHON, help='interpreter that has trl installed')
  # The TRL side: this script re-run by --trl-python.
  parser.add_argument('--trl-worker', action='store_true', help=argparse.SUPPRESS)
  parser.add_argument('--model-dir', help=argparse.SUPPRESS)
  parser.add_argument('--result', help=argparse.SUPPRESS)
  args = parser.parse_args()
  # --warmup too: the first step of either side includes compilation or lazy setup.
  for name in ('threads', 'steps', 'warmup', 'prompts', 'new_tokens'):
    if getattr(args, name) < 1:
      parser.error(f'--{name.replace("_", "-")} must be >= 1')
  if args.group < 2:
    parser.error('--group must be >= 2 (a group needs a baseline)')
  if args.fused_steps < 0:
    parser.error('--fused-steps must be >= 0')
  return args


class OtherLoad:
  """Cores kept busy by other processes over an interval: all CPU time on the machine (from
  /proc/stat) less this process's and its waited-for children's. The machine may be shared."""

  def __init__(self):
    self.start = self._sample()

  @staticmethod
  def _sample():
    try:
      with open('/proc/stat') as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    except OSError:
      return None
    busy = sum(fields[:8]) - fields[3] - fields[4]  # all but idle and iowait
    own = os.times()
    own_seconds = own.user + own.system + own.children_user + own.children_system
    return busy / os.sysconf('SC_CLK_TCK'), own_seconds, time.perf_counter()

  def cores(self) -> float | None:
    end = self._sample()
    if end is None or self.start is None:
      return None
    (busy0, own0, wall0), (busy1, own1, wall1) = self.start, end
    return max(0.0, (busy1 - busy0) - (own1 - own0)) / (wall1 - wall0)


# ---- the TRL side (runs under bench/.venv-trl; imports no jax and no grpo_jax) ----

def torch_matmul_peak(size: int = 1024, repeats: int = 5) -> float:
  """FLOP/s of a square fp32 torch matmul, best of `repeats` (as grpo_jax.metrics.matmul_peak_flops)."""
  import torch
  x = torch.full((size, size), 0.5)
  x @ x
  best = min(harness.timed(lambda: x @ x) for _ in range(repeats))
  return 2.0 * size ** 3 / best


def arithmetic_prompts(count: int, seed: int = 0) -> list[dict]:
  rng = random.Random(seed)
  pairs = [(rng.randint(0, MAX_OPERAND), rng.randint(0, MAX_OPERAND)) for _ in range(count)]
  return [dict(prompt=f'<bos>{a}+{b}=', answer=str(a + b)) for a, b in pairs]


def arithmetic_reward(completions, answer, **kwargs) -> list[float]:
  """1 where the completion starts with the sum (the arithmetic task's reward, on text)."""
  return [float(completion.startswith(expected)) for completion, expected in zip(completions, answer)]


def trl_worker(args) -> dict:
  """Trains W + S steps with TRL's GRPOTrainer, each started by the parent's GO; returns the times."""
  # Protocol lines go to the original stdout; anything the libraries print goes to stderr.
  protocol = os.fdopen(os.dup(1), 'w')
  os.dup2(2, 1)
  import datasets
  import torch
  import transformers
  import trl

  torch.set_num_threads(args.threads)
  transformers.utils.logging.set_verbosity_error()
  rows, new_tokens = args.prompts * args.group, args.new_tokens
  times = dict(rollout=[], reward=[], step=[])
  lengths = set()

  class TimedGRPOTrainer(trl.GRPOTrainer):
    """GRPOTrainer with its generation and reward calls timed (the rest of the step is the update)."""

    def _generate(self, prompts):
      start = time.perf_counter()
      output = super()._generate(prompts)
      times['rollout'].append(time.perf_counter() - start)
      completion_ids = output[1]
      lengths.update(len(ids) for ids in completion_ids)
      if len(completion_ids) != rows:
        raise RuntimeError(f'TRL sampled {len(completion_ids)} completions in one step, expected {rows}')
      return output

    def _calculate_rewards(self, *args, **kwargs):
      start = time.perf_counter()
      rewards = super()._calculate_rewards(*args, **kwargs)
      times['reward'].append(time.perf_counter() - start)
      return rewards

  class TurnTimer(transformers.TrainerCallback):
    """Waits for the parent's GO before each step, then times on_step_begin -> on_step_end:
    generation, reward, loss, backward, clipping and the optimizer step."""

    def on_step_begin(self, *unused, **kwargs):
      protocol.write(WAITING + '\n')
      protocol.flush()
      if sys.stdin.readline().strip() != GO:
        raise SystemExit('the parent benchmark stopped')
      self.start = time.perf_counter()

    def on_step_end(self, *unused, **kwargs):
      times['step'].append(time.perf_counter() - self.start)

  for method in ('_generate', '_calculate_rewards'):
    if not hasattr(trl.GRPOTrainer, method):
      raise RuntimeError(f'trl {trl.__version__} has no GRPOTrainer.{method}; install the version pinned in '
                         'bench/requirements-trl.txt')
  peak = torch_matmul_peak()
  total_steps = args.warmup + args.steps
  tokenizer = transformers.AutoTokenizer.from_pretrained(args.model_dir)
  model = transformers.AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
  dataset = datasets.Dataset.from_list(arithmetic_prompts(args.prompts * total_steps))
  prompt_lengths = {len(ids) for ids in tokenizer(list(dataset['prompt']))['input_ids']}
  with tempfile.TemporaryDirectory(prefix='bench_trl_') as output_dir:
    config = trl.GRPOConfig(
        output_dir=output_dir, use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        per_device_train_batch_size=rows, gradient_accumulation_steps=1, num_generations=args.group,
        num_iterations=1, beta=0.0, max_completion_length=new_tokens,
        # EOS can never be sampled before N tokens, so every completion is exactly N long.
        generation_kwargs=dict(min_new_tokens=new_tokens), temperature=1.0, top_k=0, top_p=1.0,
        learning_rate=args.learning_rate, lr_scheduler_type='constant', warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, loss_type='dapo', scale_rewards='group', max_steps=total_steps, seed=0,
        use_vllm=False, report_to='none', logging_strategy='no', save_strategy='no', disable_tqdm=True)
    trainer = TimedGRPOTrainer(model=model, reward_funcs=arithmetic_reward, args=config,
                               train_dataset=dataset, processing_class=tokenizer, callbacks=[TurnTimer()])
    trainer.train()
  if lengths != {new_tokens}:
    raise RuntimeError(f'TRL completions had lengths {sorted(lengths)}, expected exactly {new_tokens}')
  optimizer = getattr(trainer.optimizer, 'optimizer', trainer.optimizer)  # accelerate wraps it
  skip = args.warmup
  return dict(versions=dict(torch=torch.__version__, transformers=transformers.__version__, trl=trl.__version__,
                            accelerate=__import__('accelerate').__version__),
              threads=torch.get_num_threads(), matmul_peak=peak, prompt_lengths=sorted(prompt_lengths),
              optimizer=type(optimizer).__name__, **{name: values[skip:] for name, values in times.items()})


class TRLWorker:
  """The parent's handle on the TRL subprocess: starts it, runs its steps one at a time.

  A worker that fails is reported once (with the tail of its log) and the benchmark goes on with
  the grpo_jax side alone.
  """

  def __init__(self, args, model_dir: str):
    self.directory = tempfile.TemporaryDirectory(prefix='bench_trl_worker_')
    self.result = os.path.join(self.directory.name, 'result.json')
    self.log = open(os.path.join(self.directory.name, 'worker.log'), 'w+')
    command = [args.trl_python, os.path.abspath(__file__), '--trl-worker', '--model-dir', model_dir,
               '--result', self.result, '--threads', str(args.threads), '--steps', str(args.steps),
               '--warmup', str(args.warmup), '--prompts', str(args.prompts), '--group', str(args.group),
               '--new-tokens', str(args.new_tokens), '--learning-rate', str(args.learning_rate)]
    self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=self.log, text=True)
    self.failed = False
    self._expect_waiting()  # model loaded, trainer built: ready for the first step

  def _expect_waiting(self, last: bool = False) -> None:
    line = self.process.stdout.readline()
    if line.strip() == WAITING or (last and not line):
      return
    self._fail()

  def _fail(self) -> None:
    if self.process.poll() is None:  # alive but off protocol: it will not finish on its own
      self.process.kill()
    self.process.wait()
    self.log.seek(0)
    tail = '\n'.join(self.log.read().strip().splitlines()[-25:])
    print(f'\nTRL side failed (exit {self.process.returncode}); its last lines:\n{tail}', file=sys.stderr)
    self.failed = True

  def step(self, last: bool) -> None:
    """Runs one TRL step and returns when the worker is idle again (or finished, after the last)."""
    if self.failed:
      return
    self.process.stdin.write(GO + '\n')
    self.process.stdin.flush()
    self._expect_waiting(last)

  def finish(self) -> dict | None:
    if not self.failed and self.process.wait() != 0:
      self._fail()
    self.log.close()
    with self.directory:
      if self.failed:
        return None
      with open(self.result) as f:
        return json.load(f)


def start_trl(args, model_dir: str) -> TRLWorker | None:
  if not os.path.exists(args.trl_python):
    print(f'TRL side skipped: {args.trl_python} does not exist. Set it up (CPU torch, pinned trl) with\n'
          f'  {TRL_SETUP}', file=sys.stderr)
    return None
  return TRLWorker(args, model_dir)


# ---- the grpo_jax side ----

def write_model(directory: str, seed: int = 0) -> None:
  """Random Qwen2 weights as a Hugging Face checkpoint, with the arithmetic task's tokenizer."""
  from grpo_jax.data import arith
  from grpo_jax.model import Qwen2Config, init_model, save_hf
  architecture = Qwen2Config(vocab_size=len(arith.SYMBOLS), eos_token_ids=(arith.SYMBOLS.index(arith.EOS),),
                             **ARCHITECTURE)
  save_hf(init_model(architecture, seed=seed), directory)
  tokenizer = arith.build_tokenizer()
  # TRL tokenizes the prompt text: '<bos>' must stay one token rather than five characters.
  tokenizer.add_special_tokens([arith.PAD, arith.EOS, arith.BOS])
  tokenizer.save(os.path.join(directory, 'tokenizer.json'))
  with open(os.path.join(directory, 'tokenizer_config.json'), 'w') as f:
    json.dump({'tokenizer_class': 'PreTrainedTokenizerFast', 'pad_token': arith.PAD, 'eos_token': arith.EOS}, f)


def run_both(args, model_dir: str, workdir: str) -> tuple[dict, dict | None]:
  """grpo_jax's steps in this process, taking turns with TRL's in the worker."""
  import jax

  from grpo_jax import config as config_lib
  from grpo_jax import sharding
  from grpo_jax.build import build_task
  from grpo_jax.model import ModelOptions
  from grpo_jax.train import Run

  total_steps = 2 * args.warmup + args.steps + 2 * args.fused_steps
  config = config_lib.Config(
      run=config_lib.RunConfig(name='bench_grpo_step', seed=0),
      model=config_lib.ModelConfig(path=model_dir, options=ModelOptions(scan_layers=False)),
      task=arith.ArithSection(max_operand=MAX_OPERAND, operators='+'),
      rollout=config_lib.RolloutConfig(prompts_per_step=args.prompts, max_new_tokens=args.new_tokens),
      algo=config_lib.AlgoConfig(group_size=args.group),
      optim=config_lib.OptimConfig(learning_rate=args.learning_rate),
      train=config_lib.TrainConfig(steps=total_steps, checkpoint_every=0, progress=False))
  mesh = sharding.make_mesh(config.mesh)
  task = build_task(config)
  # The end token no longer stops the sampler, so every completion is N tokens, as on TRL's side.
  task.stop_token_ids = ()
  run = Run(config, workdir, mesh, config.model.build(mesh, config.run.seed), task)
  try:
    for _ in range(args.warmup):  # compiles, before the worker starts
      run.host_step()
    other_load = OtherLoad()  # from here: the worker's whole life is this process's own CPU time
    worker = None if args.no_trl else start_trl(args, model_dir)
    host = []
    rounds = args.warmup + args.steps
    for index in range(rounds):
      row = run.host_step()
      if index >= args.warmup:
        host.append(row)
      if worker:
        worker.step(last=index == rounds - 1)
    trl_result = worker.finish() if worker else None
    if trl_result and trl_result['prompt_lengths'] != [task.prompt_length]:
      raise RuntimeError(f'TRL tokenized the prompts to {trl_result["prompt_lengths"]} tokens, grpo_jax\'s task '
                         f'to {task.prompt_length}: the workloads differ')
    other_cores = {'host-loop steps': other_load.cores()}
    lengths = {float(row['response_len_mean']) for row in host} | {float(row['response_len_max']) for row in host}
    if lengths != {float(args.new_tokens)}:
      raise RuntimeError(f'grpo_jax completions were not all {args.new_tokens} tokens: {sorted(lengths)}')
    fused = None
    if args.fused_steps:
      run.fused_steps(args.fused_steps)  # compiles the K-step jit
      other_load = OtherLoad()
      fused = run.fused_steps(args.fused_steps)[0]['step_time_s']
      other_cores['fused steps'] = other_load.cores()
  finally:
    run.checkpointer.close()
    run.log.close()
  jax_result = dict(version=jax.__version__, matmul_peak=run.peak_flops, step_flops=run.step_flops,
                    num_params=run.num_params, vocab_size=task.vocab_size, prompt_length=task.prompt_length,
                    fused_step=fused, other_cores=other_cores,
                    **{name: [row[f'{name}_s'] for row in host] for name in ('rollout', 'reward', 'update')},
                    step=[row['step_time_s'] for row in host])
  return jax_result, trl_result


def median(values) -> float:
  return statistics.median(float(v) for v in values)


def report(args, jax_result: dict, trl_result: dict | None) -> None:
  P, G, N = args.prompts, args.group, args.new_tokens
  tokens = P * G * N
  peak, flops = jax_result['matmul_peak'], jax_result['step_flops']
  a = ARCHITECTURE
  print(f'\nworkload: Qwen2 D={a["hidden_size"]} F={a["intermediate_size"]} L={a["num_hidden_layers"]} heads '
        f'{a["num_attention_heads"]}/{a["num_key_value_heads"]}, vocab {jax_result["vocab_size"]}, {jax_result["num_params"] / 1e6:.2f}M '
        f'params, fp32; {P} prompts x G={G}, prompt {jax_result["prompt_length"]} + exactly {N} new tokens; mu=1, '
        f'beta=0, AdamW lr {args.learning_rate:g}, grad clip 1.0')
  torch_threads = f' (torch reports {trl_result["threads"]})' if trl_result else ''
  turns = '; the sides take turns step by step' if trl_result else ''
  print(f'threads: {args.threads} CPU threads on each side{torch_threads}, {os.cpu_count()} cores on this machine'
        f'{turns}; median of {args.steps} steps after {args.warmup} warm-up')
  peaks = f'XLA {peak / 1e9:.1f} GFLOP/s'
  if trl_result:
    peaks += f', torch {trl_result["matmul_peak"] / 1e9:.1f} GFLOP/s'
  print(f'model FLOPs per step: {flops / 1e9:.1f} GFLOP (2N per sampled token + 6N per trained token); '
        f'measured fp32 1024^2 matmul peak: {peaks}; MFU = FLOPs / step s / XLA peak on every row')
  others = [f'{value:.2f} during the {name}' for name, value in jax_result['other_cores'].items()
            if value is not None]
  if others:
    print(f'CPU used by other processes (cores of {os.cpu_count()}, mean): {", ".join(others)}')
  crowded = [name for name, value in jax_result['other_cores'].items()
             if value is not None and value > 0.25 and args.threads + value > os.cpu_count()]
  if crowded:
    print(f'WARNING: during the {" and the ".join(crowded)}, {args.threads} threads plus the other work needed '
          f'more than the {os.cpu_count()} cores: threads wait for each other (PyTorch\'s OpenMP pool worst of '
          'all), so those rows are not comparable; re-run on a quiet machine or with fewer --threads')
  trl_step = median(trl_result['step']) if trl_result else None
  header = f'{"":<36} {"rollout s":>9} {"reward s":>9} {"update s":>9} {"step s":>8} {"tokens/s":>9} {"MFU":>6}'
  print('\n' + header + (f' {"vs TRL":>7}' if trl_result else ''))

  def row(name, rollout, reward, update, step):
    cells = [f'{v:>9.3f}' if v is not None else f'{"-":>9}' for v in (rollout, reward, update)]
    line = f'{name:<36} {" ".join(cells)} {step:>8.3f} {tokens / step:>9.0f} {flops / step / peak:>6.1%}'
    print(line + (f' {step / trl_step:>6.2f}x' if trl_step else ''))

  j = {name: median(jax_result[name]) for name in ('rollout', 'reward', 'update', 'step')}
  row(f'grpo_jax {jax_result["version"]} host loop', j['rollout'], j['reward'], j['update'], j['step'])
  if jax_result['fused_step'] is not None:
    row(f'grpo_jax fused, {args.fused_steps} steps per jit', None, None, None, jax_result['fused_step'])
  if trl_result:
    updates = [s - r - w for s, r, w in zip(trl_result['step'], trl_result['rollout'], trl_result['reward'])]
    row(f'TRL {trl_result["versions"]["trl"]} GRPOTrainer', median(trl_result['rollout']),
        median(trl_result['reward']), median(updates), trl_step)
    met = 'met' if j['step'] / trl_step <= 0.5 else 'NOT met'
    versions = ', '.join(f'{name} {version}' for name, version in trl_result['versions'].items())
    print(f'\ngrpo_jax host-loop step / TRL step = {j["step"] / trl_step:.2f}x (target <= 0.5x: {met}); '
          f'TRL side: {versions}, {trl_result["optimizer"]}')
    print('per-step seconds, grpo_jax: ' + ' '.join(f'{float(s):.3f}' for s in jax_result['step'])
          + '; TRL: ' + ' '.join(f'{s:.3f}' for s in trl_result['step']))
  print('rollout: sampling P x G completions (grpo_jax: + drawing the prompts; TRL: + tokenizing and decoding); '
        'reward: scoring them; update: the rest of the step (grpo_jax: batch, loss, backward, AdamW, metrics to '
        'host; TRL: step - rollout - reward: advantages, forward, backward, clipping, AdamW)')


def main():
  args = parse_args()
  harness.limit_threads(args.threads)
  if args.trl_worker:
    result = trl_worker(args)
    with open(args.result, 'w') as f:
      json.dump(result, f)
    return 0
  with tempfile.TemporaryDirectory(prefix='bench_grpo_step_') as directory:
    model_dir, workdir = os.path.join(directory, 'model'), os.path.join(directory, 'run')
    write_model(model_dir)
    jax_result, trl_result = run_both(args, model_dir, workdir)
  report(args, jax_result, trl_result)
  return 0


if __name__ == '__main__':
  sys.exit(main())
