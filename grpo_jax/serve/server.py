"""JetStream's orchestrator and gRPC server over a QwenEngine (`start_server`), as `python -m
grpo_jax.serve` runs them (interleaved mode: one engine prefills and generates).

JetStream queues a request as it comes and prefills it on a worker thread, where an exception ends
the whole server; its servicer is therefore replaced by one that checks each request in its own
handler first (checked_servicer, with requests.py's rules), and its driver by one whose prefill
thread hands a prompt's images to the engine on its padded tokens (image_driver). JetStream's
orchestrator module keeps its own classes: server_lib is given a view of it holding these two.

Imports jetstream (the extras, google-jetstream) only inside its functions: the rest of serve/
imports without it.
"""

import asyncio
import dataclasses
import logging
import os
import types

import jax

from grpo_jax.serve.engine import QwenEngine, ResultTokens, with_images
from grpo_jax.serve.requests import ImageRules, RequestError, RequestRules
from grpo_jax.serve.tokenizer import HFTokenizer

# JetStream 0.2.2 pads token requests to one of these lengths, and max_prefill_length must be one.
PREFILL_BUCKETS = tuple(16 << i for i in range(12))
JETSTREAM_THREADS = ('prefill-', 'transfer-', 'generate-', 'detokenize-')


def register_with_jetstream() -> None:
  """Makes QwenEngine, ResultTokens and HFTokenizer virtual subclasses of JetStream's ABCs (its
  detokenizer tells results from requests with isinstance). Imports jetstream: serving only."""
  from jetstream.core import orchestrator
  from jetstream.engine import engine_api, tokenizer_api

  engine_api.Engine.register(QwenEngine)
  engine_api.ResultTokens.register(ResultTokens)
  tokenizer_api.Tokenizer.register(HFTokenizer)
  if not hasattr(jax, 'tree_map'):
    # 0.2.2 frees each inserted prefix with jax.tree_map, which newer jax no longer has.
    orchestrator.delete_pytree = _delete_arrays


def _delete_arrays(tree) -> None:
  for leaf in jax.tree.leaves(tree):
    if isinstance(leaf, jax.Array):
      leaf.delete()


class _ImagePrompt(list):
  """A queued prompt's checked ids, carrying its processed images to the prefill thread."""

  def __init__(self, ids, images):
    super().__init__(ids)
    self.images = images


def image_driver():
  """JetStream's Driver whose prefill thread hands a prompt's images to QwenEngine.prefill on its
  padded tokens (engine.with_images); other prompts go as JetStream pads them. Imports jetstream."""
  from jetstream.core import orchestrator

  class ImageDriver(orchestrator.Driver):

    def _process_prefill_content(self, request, tokenizer, is_bos, max_prefill_length):
      tokens, true_length = super()._process_prefill_content(request, tokenizer, is_bos, max_prefill_length)
      images = getattr(request.prefill_content, 'images', ())
      return (with_images(tokens, images) if images else tokens), true_length

  return ImageDriver


@dataclasses.dataclass(frozen=True)
class _Queued:
  """What JetStream's Decode reads of a request, once admitted: the checked ids stand in for the
  content (text requests are tokenized in the handler, so the prefill thread never is)."""

  max_tokens: int
  session_cache: str
  prompt: tuple[list[int], bool]  # (ids, or an _ImagePrompt; the client tokenizes: the answer carries ids only)


def checked_servicer(rules: RequestRules):
  """JetStream's LLMOrchestrator class with every request checked by `rules` before it is queued
  (a refusal aborts that call with INVALID_ARGUMENT; a truncated prompt is reported in the call's
  trailing metadata: prompt-tokens, as sent, and prompt-tokens-kept). Imports jetstream."""
  import grpc
  from jetstream.core import orchestrator

  class CheckedOrchestrator(orchestrator.LLMOrchestrator):

    def _get_prefill_content(self, request: _Queued):
      return request.prompt

    async def Decode(self, request, context=None):  # noqa: N802 (the gRPC method's name)
      kind = request.WhichOneof('content')
      content = (request.token_content.token_ids if kind == 'token_content' else
                 request.text_content.text if kind == 'text_content' else None)
      try:  # off the event loop: a text request is tokenized here, and its images decoded and resized
        admitted = await asyncio.to_thread(rules.admit, kind, content, request.max_tokens)
      except RequestError as error:
        if context is None:
          raise
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))  # raises: nothing is queued
      if admitted.truncated and context is not None:
        context.set_trailing_metadata((('prompt-tokens', str(admitted.prompt_tokens)),
                                       ('prompt-tokens-kept', str(len(admitted.token_ids)))))
      ids = _ImagePrompt(admitted.token_ids, admitted.images) if admitted.images else admitted.token_ids
      queued = _Queued(max_tokens=admitted.max_tokens, session_cache=request.session_cache,
                       prompt=(ids, not admitted.text))
      async for response in super().Decode(queued, context):
        yield response

  return CheckedOrchestrator


def request_rules(engine: QwenEngine, long_prompts: str = 'refuse', images: ImageRules | None = None) -> RequestRules:
  """The limits the served engine sets on a request."""
  tokenizer = engine.build_tokenizer(engine.get_tokenizer()) if engine.tokenizer_path else None
  return RequestRules(vocab_size=engine.vocab_size, max_prompt_tokens=engine.max_prefill_length,
                      max_new_tokens=engine.max_new_tokens, tokenizer=tokenizer, long_prompts=long_prompts,
                      images=images)


def start_server(engine: QwenEngine, port: int, host: str = '127.0.0.1', *, threads: int | None = None,
                 verbose: bool = False, long_prompts: str = 'refuse', images: ImageRules | None = None):
  """Starts JetStream's gRPC server over `engine`, its requests checked (checked_servicer);
  returns its JetStreamServer (call .stop())."""
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '1')  # jetstream imports TensorFlow (via seqio)
  register_with_jetstream()
  from jetstream.core import config_lib, orchestrator, server_lib

  # server_lib builds its servicer as orchestrator.LLMOrchestrator(driver=...): it is given a view of
  # the orchestrator module whose servicer is the checked one (JetStream's own module is untouched).
  server_lib.orchestrator = types.SimpleNamespace(
      Driver=image_driver(), LLMOrchestrator=checked_servicer(request_rules(engine, long_prompts, images)))

  if not verbose:
    logging.getLogger().setLevel(logging.WARNING)  # the orchestrator logs every step at INFO
  devices = list(engine.mesh.devices.flat)
  config = config_lib.ServerConfig(
      interleaved_slices=(f'{devices[0].platform}={len(devices)}',),
      interleaved_engine_create_fns=(lambda _devices: engine,))
  server_lib._HOST = host  # 0.2.2 always binds [::]; this is the one place it reads the host
  return server_lib.run(port=port, config=config, devices=devices, threads=threads, jax_padding=False)
