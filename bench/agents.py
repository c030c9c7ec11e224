"""python bench/agents.py [--preset small] [--episodes 128] [--turns 4] [--mean-turn 16] [--latency-ms 50] [--no-reuse] [--sandbox N]

Useful tokens/s of multi-turn episodes on the inference server (grpo_jax/agents/inference.py), run
two ways over the same server, model, keys and workload:

  asynchronous: each episode is its own coroutine; a turn goes to the server as soon as the
                episode's previous observation is back, and leaves its slot as soon as it ends.
  lock-step:    turn by turn for all episodes together: every episode's turn t is sent at once,
                the environments answer when the last of them is done, then turn t + 1.

The workload is long-tailed on both sides: each turn's token budget is drawn from a geometric
distribution (mean --mean-turn, capped at --max-turn; the random model rarely stops on its own, so
the budget is the turn's length), and each environment answer takes an exponentially distributed
time (mean --latency-ms, as a tool call or a remote service would) before it appends
--observation tokens. Both ways must give the same trajectories (asserted); useful tokens are the
policy's tokens. The server keeps each turn's KV cache for the episode's next turn (both ways);
--no-reuse prefills every turn's whole context instead. --sandbox N: each environment answer is
instead one real Python tool call (a short script) in a fresh sandbox (grpo_jax/sandbox.py), through
N tool workers as the tool-use environment runs them.
"""

import argparse
import asyncio
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import harness  # noqa: E402

PRESETS = harness.presets('small', 'mid')


def parse_args():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
  parser.add_argument('--preset', choices=sorted(PRESETS), default='small')
  parser.add_argument('--episodes', type=int, default=128)
  parser.add_argument('--turns', type=int, default=4)
  parser.add_argument('--prompt-length', type=int, default=32)
  parser.add_argument('--mean-turn', type=float, default=16, help='mean policy tokens per turn')
  parser.add_argument('--max-turn', type=int, default=128, help='the longest turn')
  parser.add_argument('--observation', type=int, default=8, help='environment tokens per answer')
  parser.add_argument('--latency-ms', type=float, default=50, help='mean environment latency')
  parser.add_argument('--slots', type=int, default=0, help='decode slots (0: one per episode)')
  parser.add_argument('--chunk', type=int, default=4, help='decode steps per server call (rollout.decode_chunk)')
  parser.add_argument('--threads', type=int, default=os.cpu_count())
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--no-reuse', dest='reuse', action='store_false', help='no KV reuse across turns')
  parser.add_argument('--sandbox', type=int, default=0, metavar='N',
                      help='each answer one sandboxed Python call through N tool workers (0: a sleep of the latency)')
  return parser.parse_args()


args = parse_args()
harness.limit_threads(args.threads)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from grpo_jax import testing  # noqa: E402
from grpo_jax.agents.agent import episode_keys  # noqa: E402
from grpo_jax.agents.inference import InferenceServer  # noqa: E402
from grpo_jax.agents.trajectory import Episode  # noqa: E402
from grpo_jax.model import Qwen2Config, from_pretrained, to_hf_dict  # noqa: E402
from grpo_jax.sampler import DecodeSettings, SamplingConfig  # noqa: E402


def workload(vocab: int):
  """Per episode: its prompt, and per turn its budget, the environment's latency and answer."""
  rng = np.random.default_rng(0)
  E, T = args.episodes, args.turns
  prompts = rng.integers(1, vocab, (E, args.prompt_length)).tolist()
  budgets = np.minimum(rng.geometric(1 / args.mean_turn, (E, T)), args.max_turn)
  latencies = rng.exponential(args.latency_ms / 1e3, (E, T))
  answers = rng.integers(1, vocab, (E, T, args.observation)).tolist()
  return prompts, budgets, latencies, answers


TOOLS = None  # the tool workers, with --sandbox


async def answer(latencies, index: int, turn: int) -> None:
  """The environment's time to answer: a sleep of the drawn latency, or one sandboxed Python call."""
  if TOOLS is None:
    await asyncio.sleep(latencies[index, turn])
    return
  text, failed = await TOOLS.call('python', f'print(sum(range({1000 * (index + turn + 1)})))')
  assert not failed, text


async def asynchronous(server, episodes, budgets, latencies, answers):
  async def one(index, episode):
    for turn in range(args.turns):
      await episode.act(int(budgets[index, turn]))
      await answer(latencies, index, turn)
      episode.observe(answers[index][turn])

  await asyncio.gather(*(one(i, e) for i, e in enumerate(episodes)))


async def lock_step(server, episodes, budgets, latencies, answers):
  for turn in range(args.turns):
    await asyncio.gather(*(e.act(int(budgets[i, turn])) for i, e in enumerate(episodes)))
    await asyncio.gather(*(answer(latencies, i, turn) for i in range(len(episodes))))
    for index, episode in enumerate(episodes):
      episode.observe(answers[index][turn])


def main():
  config = Qwen2Config(**PRESETS[args.preset])
  with tempfile.TemporaryDirectory(prefix='bench_agents_') as directory:
    testing.save_random_hf_checkpoint(directory, 0, init='default', jitter=0.02, **to_hf_dict(config))
    model = from_pretrained(directory, dtype='float32')
  graphdef, params = nnx.split(model)
  global TOOLS
  prompts, budgets, latencies, answers = workload(config.vocab_size)
  if args.sandbox:
    import functools
    from grpo_jax import sandbox
    from grpo_jax.agents import tools
    from grpo_jax.workers import WorkerPool
    sandbox.check()
    TOOLS = WorkerPool(args.sandbox, tools.work, setup=functools.partial(tools.worker_setup, 'bwrap', sandbox.Limits()),
                       timeout_s=30.0, name='tool worker')
  args.slots = args.slots or args.episodes
  budget = args.turns * (args.max_turn + args.observation)
  server = InferenceServer(graphdef, settings=DecodeSettings(sampling=SamplingConfig(temperature=1.0),
                                                             max_new_tokens=args.max_turn),
                           slots=args.slots, max_context=args.prompt_length + budget, chunk=args.chunk, reuse=args.reuse)
  server.bind(params)
  keys = episode_keys(jax.random.key(0), args.episodes)
  out = {}

  def run(name, driver):
    def step():
      server.bind(params)  # a fresh start: no caches kept from the last run
      episodes = [Episode(server, prompt, budget, key) for prompt, key in zip(prompts, keys)]
      before = (server.stats.decode_steps, server.stats.tokens, server.stats.prefilled_tokens)

      async def serve():
        async with server:
          await driver(server, episodes, budgets, latencies, answers)

      asyncio.run(serve())
      out[name] = ([e.trajectory for e in episodes], server.stats.decode_steps - before[0],
                   server.stats.tokens - before[1], server.stats.prefilled_tokens - before[2])
    return step

  runs = {'asynchronous episodes': run('asynchronous episodes', asynchronous),
          'lock-step turns': run('lock-step turns', lock_step)}
  results = harness.interleaved(runs, args.repeats)
  reference = out['lock-step turns'][0]
  for name, (trajectories, *_) in out.items():  # the same episodes, whichever way they ran
    for index, (mine, theirs) in enumerate(zip(trajectories, reference)):
      assert mine.tokens == theirs.tokens and mine.loss_mask == theirs.loss_mask, f'{name}: episode {index}'
      np.testing.assert_allclose(mine.log_probs, theirs.log_probs, rtol=1e-5, atol=1e-5)

  environment = (f'each answer one sandboxed Python call through {args.sandbox} tool workers' if args.sandbox else
                 f'environment latency exponential (mean {latencies.mean() * 1e3:.0f} ms, max '
                 f'{latencies.max() * 1e3:.0f} ms)')
  print(f'\n{args.preset}: {config.num_params() / 1e6:.0f}M params, {args.episodes} episodes x {args.turns} turns, '
        f'turn budgets geometric (mean {budgets.mean():.1f}, p90 {np.percentile(budgets, 90):.0f}, max '
        f'{budgets.max()}), {environment}, {args.observation} observation tokens; {args.slots} slots, chunks of '
        f'{args.chunk}; KV reuse across turns {"on" if args.reuse else "off"}; {jax.default_backend()}, '
        f'{args.threads} threads, median of {args.repeats}')
  print(f'{"episodes run":<24} {"warm-up s":>9} {"s":>8} {"useful tok":>10} {"useful tok/s":>12} {"vs lock-step":>12} '
        f'{"decode steps":>12} {"occupancy":>9} {"prefilled":>9}')
  base = out['lock-step turns'][2] / results['lock-step turns'][1]
  for name, (first, seconds) in results.items():
    _, steps, tokens, prefilled = out[name]
    print(f'{name:<24} {first:>9.2f} {seconds:>8.3f} {tokens:>10} {tokens / seconds:>12.0f} '
          f'{tokens / seconds / base:>11.2f}x {steps:>12} {tokens / (steps * args.slots):>9.0%} {prefilled:>9}')
  print('useful tok/s = policy tokens / seconds; occupancy = policy tokens / (decode steps x slots); prefilled = '
        'context tokens run through a prefill; the same trajectories both ways (asserted)')
  return 0


if __name__ == '__main__':
  sys.exit(main())
