"""Serving a checkpoint: `python -m grpo_jax.serve` (__main__.py) is the CLI.

  engine.py     QwenEngine: JetStream's Engine API (prefill / insert / generate) over sampler/decode.py
  tokenizer.py  the Hugging Face tokenizer behind JetStream's tokenizer interface (chat templates)
  requests.py   what a served request must satisfy before it is queued (ids, lengths, max_tokens, images)
  server.py     JetStream's orchestrator and gRPC server over the engine, each request checked first

This package sits above the sampler and the model, which never import it: a training run does not
load the engine. Nothing here imports jetstream at import time (server.py does when the server
starts), so the engine runs in-process where JetStream and TensorFlow are absent.
"""

from grpo_jax.serve.engine import QwenEngine

__all__ = ['QwenEngine']
