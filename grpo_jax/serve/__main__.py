"""python -m grpo_jax.serve --ckpt DIR --port P [--host 127.0.0.1] [--slots N] [options]

Serves a Qwen2 / Qwen2.5 checkpoint through JetStream's own orchestrator and gRPC server
(`jetstream.core.server_lib.run`, interleaved mode: one engine prefills and generates). Clients use
JetStream's stubs (`jetstream.core.proto.jetstream_pb2_grpc.OrchestratorStub(channel).Decode`):

  token_content: token ids, used as sent; the response carries token ids only.
  text_content:  text, rendered with the tokenizer's chat template (--chat-template auto: when the
                 tokenizer has one) as one user message, or as a conversation when the text is a
                 JSON list of {"role", "content"} objects; the response carries text and token ids.
                 A vision-language checkpoint (Qwen2.5-VL) reads images in such a conversation's
                 content lists, inline as base64 (JetStream's request has no image field):
                   [{"role": "user", "content": [
                       {"type": "image", "image": "data:image/png;base64,iVBORw0..."},
                       {"type": "text", "text": "Which quadrant holds the mark?"}]}]
                 ({"type": "image_url", "image_url": {"url": "data:..."}} too), bounded by
                 --max-images, --max-image-bytes and resized into [--min-pixels, --max-pixels]
                 (default: the checkpoint's preprocessor_config.json) as transformers' processor does.

Every request is checked in its handler before it is queued (serve/requests.py): ids outside the
vocabulary, an empty or over-long prompt (--long-prompts), a negative max_tokens, text sent to
a --token-ids-only server, and an image that is undecodable, too large, one too many or sent to a
text model are refused to that client alone with INVALID_ARGUMENT; max_tokens 0 means
--max-new-tokens. Images are decoded and processed in the handler too; the prefill runs the vision
tower once per prompt, over a bucket of a power of two of images (and of patches each), so the
server compiles a bounded set of prefills.

Sampling (--greedy / --temperature / --top-k / --top-p) is fixed for the server: JetStream's
DecodeRequest has no field for it. Stop tokens end a sample and are not sent, as JetStream does.
Needs the extras (google-jetstream), which serve/server.py imports when the server starts; nothing
outside serve/ imports jetstream.
"""

import argparse
import faulthandler
import os
import signal
import socket
import sys
import time

from grpo_jax.errors import UserError, cli_main
from grpo_jax.sampler.decode import DecodeSettings
from grpo_jax.sampler.sampling import add_sampling_flags, sampling_from_flags
from grpo_jax.sampler.special_tokens import checkpoint_eos_ids, special_tokens
from grpo_jax.serve.engine import QwenEngine
from grpo_jax.serve.requests import LONG_PROMPTS, ImageRules
from grpo_jax.serve.server import PREFILL_BUCKETS, start_server
from grpo_jax.serve.tokenizer import CHAT_TEMPLATE_MODES


def check_port(host: str, port: int) -> None:
  family = socket.AF_INET6 if ':' in host else socket.AF_INET
  with socket.socket(family, socket.SOCK_STREAM) as probe:
    try:
      probe.bind((host.strip('[]'), port))
    except OSError as error:
      raise UserError(f'cannot listen on {host}:{port}: {error.strerror or error}') from None


def parse_args(argv):
  parser = argparse.ArgumentParser(prog='python -m grpo_jax.serve', description=__doc__.splitlines()[0])
  parser.add_argument('--ckpt', required=True,
                      help='Hugging Face directory, grpo_jax checkpoint, or a training workdir / checkpoints/<step> '
                           '(a LoRA run\'s: its adapters on its base)')
  parser.add_argument('--port', type=int, required=True)
  parser.add_argument('--host', default='127.0.0.1', help='address to listen on ([::] for all)')
  parser.add_argument('--slots', type=int, default=8, help='concurrent decodes (decode batch B)')
  parser.add_argument('--max-prefill-length', type=int, default=1024,
                      help=f'longest prompt in tokens; one of {", ".join(map(str, PREFILL_BUCKETS))}')
  parser.add_argument('--max-new-tokens', type=int, default=512, help='longest completion per request')
  add_sampling_flags(parser)
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--dtype', choices=('float32', 'bfloat16'), default='bfloat16')
  parser.add_argument('--tensor', type=int, default=0,
                      help='devices per tensor-parallel group; the host\'s devices form groups of this size, '
                           'which share the slots (0: the largest dividing the KV heads)')
  parser.add_argument('--chat-template', choices=CHAT_TEMPLATE_MODES, default='auto',
                      help='apply the tokenizer chat template to text requests')
  parser.add_argument('--token-ids-only', action='store_true',
                      help='serve a checkpoint without tokenizer (text requests are refused)')
  parser.add_argument('--long-prompts', choices=LONG_PROMPTS, default='refuse',
                      help='a prompt longer than --max-prefill-length: refused (INVALID_ARGUMENT), or cut to its '
                           'last tokens with the cut in the trailing metadata (prompt-tokens, prompt-tokens-kept)')
  parser.add_argument('--max-images', type=int, default=4,
                      help='most images one request may hold (vision-language checkpoints)')
  parser.add_argument('--max-image-bytes', type=int, default=16 << 20, help='largest image a request may send, '
                      'in encoded bytes')
  parser.add_argument('--min-pixels', type=int, help='images are resized to at least this area (default: the '
                      'checkpoint\'s preprocessor_config.json)')
  parser.add_argument('--max-pixels', type=int, help='images are resized to at most this area, which bounds '
                      'their patches and image tokens (default: the checkpoint\'s)')
  parser.add_argument('--verbose', action='store_true', help="keep JetStream's per-step logs")
  return parser.parse_args(argv)


def image_rules(args, source: str, config) -> ImageRules | None:
  """How a vision-language checkpoint's server reads images (None: a text model)."""
  from grpo_jax.model.images import ImageSettings
  from grpo_jax.model.vision import check_processor
  if config.vision is None:
    return None
  if args.max_images < 1 or args.max_image_bytes < 1:
    raise UserError('--max-images and --max-image-bytes must be at least 1')
  settings = ImageSettings.from_checkpoint(source, min_pixels=args.min_pixels, max_pixels=args.max_pixels)
  check_processor(settings, config.vision, f'{source}/preprocessor_config.json')
  return ImageRules(settings=settings, vision=config.vision, max_images=args.max_images,
                    max_image_bytes=args.max_image_bytes)


def build_engine(args) -> tuple[QwenEngine, ImageRules | None]:
  """The engine over --ckpt, and how its requests' images are read (None: a text model, or no tokenizer)."""
  from flax import nnx

  from grpo_jax.checkpoint import locate
  from grpo_jax.restore import restore_policy, run_of, run_tokenizer
  from grpo_jax.model.hf_config import load_hf_config
  from grpo_jax.model.loading import from_pretrained, load_tokenizer
  from grpo_jax.model.qwen2 import ModelOptions
  from grpo_jax.sampler.layout import place_program, rollout_layout, serving_read_mesh

  if not os.path.isdir(args.ckpt):
    raise UserError(f'--ckpt {args.ckpt} is not a directory')
  training = locate(args.ckpt)  # a training run's policy, else a model directory
  run = run_of(*training) if training is not None else None
  source = (run_tokenizer(run[0]) or args.ckpt) if run is not None else args.ckpt
  tokenizer = load_tokenizer(source)
  if tokenizer is None and not args.token_ids_only:
    raise UserError(f'{args.ckpt} has no tokenizer, which text requests need; add tokenizer.json '
                    'or pass --token-ids-only')
  if args.chat_template == 'always' and not getattr(tokenizer, 'chat_template', None):
    raise UserError(f'--chat-template always, but the tokenizer in {args.ckpt} has no chat template')
  if args.max_prefill_length not in PREFILL_BUCKETS:
    raise UserError(f'--max-prefill-length must be one of {", ".join(map(str, PREFILL_BUCKETS))} '
                    f'(JetStream pads prompts to these), got {args.max_prefill_length}')
  if args.slots < 1 or args.max_new_tokens < 1:
    raise UserError('--slots and --max-new-tokens must be at least 1')
  if args.tensor < 0:
    raise UserError(f'--tensor must be >= 0 (0: chosen for the model), got {args.tensor}')
  sampling = sampling_from_flags(args)
  check_port(args.host, args.port)
  # Resident weights in the sampler's layout over this host's devices (sampler/layout.py).
  architecture = run[1] if run is not None else load_hf_config(args.ckpt)
  images = image_rules(args, source, architecture) if tokenizer is not None else None
  # A mixture of experts is read FSDP, then laid out with its experts (and the slots) over the
  # tensor groups (serving_read_mesh).
  mesh = serving_read_mesh(architecture, args.tensor)
  if run is None:
    model = from_pretrained(args.ckpt, dtype=args.dtype, mesh=mesh)
  else:  # the run's policy at --dtype; a LoRA run's adapters decode unmerged, as in training
    graphdef, params, _, _ = restore_policy(training[0], run[2], mesh,
                                            options=ModelOptions(dtype=args.dtype, param_dtype=args.dtype))
    model = nnx.merge(graphdef, params)
  if architecture.num_sparse_layers:
    layout = rollout_layout(model, mesh, args.tensor)
    graphdef, params = nnx.split(model)
    with layout.active():
      model = nnx.merge(graphdef, place_program(layout)(params))
  # config.json's and generation_config.json's eos ids (a list for Llama 3 instruct) end answers too:
  # a run's, where its training read them (model.path, then its tokenizer's directory).
  directories = (run[0].model.path, source) if run is not None else (args.ckpt,)
  special = special_tokens(tokenizer, (*model.config.eos_token_ids, *checkpoint_eos_ids(*directories)))
  settings = DecodeSettings(sampling=sampling, max_new_tokens=args.max_new_tokens, stop_token_ids=special.stop_ids,
                            pad_id=special.pad_id)
  return QwenEngine(model, slots=args.slots, max_prefill_length=args.max_prefill_length, settings=settings,
                    seed=args.seed, tokenizer_path=source if tokenizer else None,
                    chat_template=args.chat_template), images


@cli_main
def main(argv=None):
  # SIGINT and SIGTERM stop cleanly (a shell may start a background job with SIGINT ignored), from
  # the start: a client may be answered, and stop the server, before the line below is printed.
  signal.signal(signal.SIGINT, signal.default_int_handler)
  signal.signal(signal.SIGTERM, signal.default_int_handler)
  args = parse_args(sys.argv[1:] if argv is None else argv)
  engine, images = build_engine(args)
  try:
    server = start_server(engine, args.port, args.host, verbose=args.verbose, long_prompts=args.long_prompts,
                          images=images)
  except ImportError as error:
    raise UserError(f'serving needs google-jetstream (pip install -r requirements-extras.txt): {error}') from None
  except RuntimeError as error:  # grpc could not bind after all
    raise UserError(f'cannot listen on {args.host}:{args.port}: {error}') from None
  try:
    print(f'serving {args.ckpt} on {args.host}:{args.port} with {engine.slots} slots', file=sys.stderr, flush=True)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # kill -USR1: every thread's stack to stderr
    # Serves until a signal. Not server.wait_for_termination(): it blocks this thread in one lock wait,
    # and a signal the kernel hands to one of the server's many other threads never wakes it, so the
    # handler never ran (a server of CI's test-all ignored SIGINT for 70 s). Sleeping a second at a
    # time, this thread runs the handler within a second whichever thread took the signal.
    while True:
      time.sleep(1.0)
  except KeyboardInterrupt:
    pass
  finally:
    server.stop()  # the orchestrator's threads and the gRPC server


if __name__ == '__main__':
  main()
