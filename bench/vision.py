"""python bench/vision.py [--rows 256] [--repeats 5] [--image-side 448] [--prompt 1024] [--response 1024]

The vision tower's share of a vision-language GRPO step, two ways:

  measured   on this machine, the CPU demo's model (configs/tiny_spot.yaml): the update's forward and
             backward (completion log-probs, gradients of their sum) and the sampler's prefill over
             the same rows, each with the images (the tower runs; the update recomputes it per row)
             and without (the same tokens, the image tokens left as embeddings): the tower's share
             is 1 - without / with, both timed in this process (min of --repeats).
  counted    for Qwen2.5-VL-7B (the geo3k recipe's model), FLOPs counted from the shapes (not a
             compiler's count: XLA's cost analysis counts a scanned block once): the tower on one
             image of --image-side pixels a side against the language model on a row of --prompt
             + --response tokens, forward; the update's backward doubles both alike.

  python bench/vision.py
"""

import argparse
import os
import sys
import time

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from grpo_jax import config as config_lib  # noqa: E402
from grpo_jax.data.spot import SpotTask  # noqa: E402
from grpo_jax.model.loading import init_model  # noqa: E402
from grpo_jax.model.presets import preset  # noqa: E402
from grpo_jax.model.vision import extended, model_inputs  # noqa: E402
from grpo_jax.rl.loss import completion_log_probs  # noqa: E402
from grpo_jax.sampler.decode import prefill  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def timed(function, *args, repeats: int) -> float:
  jax.block_until_ready(function(*args))  # compile
  best = float('inf')
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(function(*args))
    best = min(best, time.perf_counter() - start)
  return best


def measured(rows: int, repeats: int) -> list[tuple[str, float, float]]:
  config = config_lib.load_config(os.path.join(ROOT, 'configs', 'tiny_spot.yaml'))
  model = init_model(config.model.architecture, options=config.model.options)
  graphdef, params = nnx.split(model)
  task = SpotTask(config.model.architecture)
  prompts = task.prompts(jax.random.key(0), 0, rows)
  completion = jax.random.randint(jax.random.key(1), (rows, 2), 7, 11)
  tokens = jnp.concatenate([prompts.tokens, completion], axis=1)
  segments = jnp.ones_like(tokens)
  vision = extended(prompts.vision, prompts.mask, jnp.ones_like(completion))

  @jax.jit
  def update(params, vision):
    def total(params):
      values, _ = completion_log_probs(nnx.merge(graphdef, params), tokens, segments, 2, temperature=1.0,
                                       implementation='auto', **model_inputs(vision))
      return jnp.sum(values)
    return jax.grad(total)(params)

  @jax.jit
  def sample_prefill(params, vision):
    model = nnx.merge(graphdef, params)
    return prefill(model, prompts.tokens, prompts.mask, model.init_cache(rows, prompts.tokens.shape[1]),
                   vision=vision).hidden

  return [(name, timed(fn, params, prompts.vision if name == 'prefill' else vision, repeats=repeats),
           timed(fn, params, None, repeats=repeats))
          for name, fn in (('update fwd+bwd', update), ('prefill', sample_prefill))]


def counted(image_side: int, prompt: int, response: int) -> dict:
  """Forward FLOPs (2 per multiply-add) of the Qwen2.5-VL-7B tower on one image and of its language
  model on one row."""
  c = preset('Qwen2.5-VL-7B')
  v = c.vision
  side = image_side // (v.patch_size * v.spatial_merge_size) * v.spatial_merge_size  # patches a side
  n = side * side
  tower = v.image_flops(n)
  tokens = prompt + response
  text_params = c.num_params() - v.num_params() - c.vocab_size * c.hidden_size  # the embedding is a lookup
  language = 2 * tokens * text_params + 4 * c.num_hidden_layers * c.num_attention_heads * c.resolved_head_dim * tokens ** 2 // 2
  return dict(patches=n, image_tokens=n // v.merge_unit, tower=tower, language=language)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
  parser.add_argument('--rows', type=int, default=256)
  parser.add_argument('--repeats', type=int, default=5)
  parser.add_argument('--image-side', type=int, default=448)
  parser.add_argument('--prompt', type=int, default=1024)
  parser.add_argument('--response', type=int, default=1024)
  args = parser.parse_args()
  print(f'# measured: configs/tiny_spot.yaml\'s model, {args.rows} rows, {jax.device_count()} CPU device(s), '
        f'min of {args.repeats}')
  print(f'{"program":<16}{"with images s":>15}{"without s":>11}{"tower share":>13}')
  for name, with_images, without in measured(args.rows, args.repeats):
    print(f'{name:<16}{with_images:>15.4f}{without:>11.4f}{1 - without / with_images:>13.1%}')
  count = counted(args.image_side, args.prompt, args.response)
  share = count['tower'] / (count['tower'] + count['language'])
  print(f'# counted: Qwen2.5-VL-7B, one {args.image_side} x {args.image_side} image ({count["patches"]} patches, '
        f'{count["image_tokens"]} image tokens), a row of {args.prompt} + {args.response} tokens, forward FLOPs')
  print(f'tower {count["tower"] / 1e12:.3f} TFLOP, language model {count["language"] / 1e12:.3f} TFLOP per row: '
        f'the tower {share:.1%} of the update; in the sampler once per prompt (1 / G of that per sample)')


if __name__ == '__main__':
  main()
