"""Hugging Face snapshots of the policy while training (`train.export_hf_every: N`).

Every N steps (and after the last) the policy is written in the hub layout to
<workdir>/hf/step_<step>: safetensors and config.json (a full-parameter run's policy, or a LoRA
run's base with its adapters merged in), or a PEFT adapter directory (a LoRA run,
`train.export_hf_lora: adapters`), with the run's tokenizer files and a generation_config.json
(the run's stop tokens and sampling settings, unless its tokenizer directory has its own).
transformers and vLLM load it as it is: lm-eval-harness can score a run while it trains.

The step waits only for the parameters' copy to the host (the next step donates their buffers);
a background thread writes the files, into step_<step>.partial, renamed to step_<step> once whole,
so a crash or kill never leaves a half-written snapshot under the final name. The time the step
waited is its metrics row's `export_hf_s`. A snapshot that fails to write is one line and the run
goes on: its checkpoints hold the policy. Only process 0 writes; with several processes each joins
the copy, which gathers the whole policy to every host (the orbax checkpoints stay the way to save
a policy larger than a host's memory).
"""

import json
import os
import re
import shutil
import sys
import threading
import time

import jax

from grpo_jax import distributed

DIRECTORY = 'hf'
PARTIAL = '.partial'


class Snapshots:
  """The run's snapshot writer: `due(step)`, then `take(step, state)` between jitted calls."""

  def __init__(self, config, workdir: str, model, task, primary: bool):
    from grpo_jax.restore import run_tokenizer

    train = config.train
    self.every, self.keep, self.primary = train.export_hf_every, train.export_hf_max_to_keep, primary
    self.directory = os.path.join(workdir, DIRECTORY)
    self.lora = config.model.options.lora
    self.adapters_only = self.lora is not None and train.export_hf_lora == 'adapters'
    self.model_config, self.dtype = model.config, model.param_dtype.name
    self.graphdef = None
    self.base_path, self.tokenizer = config.model.path, run_tokenizer(config)
    sampling = config.rollout.sampling
    self.generation = dict(eos_token_id=sorted(set(model.config.eos_token_ids) | set(task.stop_token_ids)),
                           do_sample=not sampling.greedy)
    if model.config.bos_token_id is not None:
      self.generation['bos_token_id'] = model.config.bos_token_id
    if model.config.pad_token_id is not None:
      self.generation['pad_token_id'] = model.config.pad_token_id
    if not sampling.greedy:
      self.generation.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k)
    self.thread: threading.Thread | None = None
    self.failure: str | None = None
    if self.every and primary:
      os.makedirs(self.directory, exist_ok=True)
      for name in os.listdir(self.directory):  # what a killed run was writing
        if name.endswith(PARTIAL):
          shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
      if self.tokenizer is None:
        print(f'note: train.export_hf_every: the task has no tokenizer directory (task.tokenizer, model.path): '
              f'the snapshots in {self.directory} hold the weights and config.json only', file=sys.stderr, flush=True)

  def due(self, step: int, last: bool) -> bool:
    return bool(self.every) and (step % self.every == 0 or last)

  def take(self, step: int, state) -> float:
    """Copies the policy of `state` (rl/state.TrainState) at `step` to the host and hands it to the
    writer thread (after the previous snapshot's thread ends); the seconds the caller waited."""
    start = time.perf_counter()
    self.wait()
    if self.adapters_only:
      tree = state.params  # the adapters (and whatever trains beside them)
    elif self.lora is not None:
      tree = _merged_policy(state, self.lora)
    else:
      tree = state.policy
    host = distributed.host_values(tree)  # every process joins; the arrays are whole on this host
    if self.primary:
      self.thread = threading.Thread(target=self._write, args=(step, host), name=f'hf-snapshot-{step}', daemon=True)
      self.thread.start()
    return time.perf_counter() - start

  def wait(self) -> None:
    """Until the snapshot being written is whole; a failed one said once."""
    if self.thread is not None:
      self.thread.join()
      self.thread = None
    if self.failure is not None:
      print(f'note: {self.failure}; the run goes on (its checkpoints hold the policy)', file=sys.stderr, flush=True)
      self.failure = None

  def close(self) -> None:
    self.wait()

  def _write(self, step: int, host) -> None:
    from grpo_jax.model import lora
    from grpo_jax.model.loading import copy_tokenizer_files, save_hf_params

    final = os.path.join(self.directory, f'step_{step}')
    staging = final + PARTIAL
    try:
      shutil.rmtree(staging, ignore_errors=True)
      os.makedirs(staging)
      if self.adapters_only:
        lora.save_peft(host, self.lora, staging, self.base_path, self.model_config)
      else:
        save_hf_params(host, self.model_config, staging, self.dtype)
      if self.tokenizer is not None:
        copy_tokenizer_files(self.tokenizer, staging)
      path = os.path.join(staging, 'generation_config.json')
      if not os.path.exists(path):
        with open(path, 'w') as f:
          json.dump(self.generation, f, indent=2)
      if os.path.exists(final):  # the same step again (a run resumed before it): the new copy wins
        shutil.rmtree(final)
      os.replace(staging, final)
      self._prune()
    except Exception as error:  # a full disk, a permission: said by the next wait
      shutil.rmtree(staging, ignore_errors=True)
      self.failure = f'the Hugging Face snapshot of step {step} ({final}) failed: {type(error).__name__}: {error}'

  def _prune(self) -> None:
    if not self.keep:
      return
    for old in snapshot_steps(os.path.dirname(self.directory))[:-self.keep]:
      shutil.rmtree(os.path.join(self.directory, f'step_{old}'), ignore_errors=True)


def _merged_policy(state, settings):
  """A LoRA policy's base with W + s A B in place of each adapted weight, computed where the
  parameters are (one jitted program; its output is one more copy of the base on the devices)."""
  return _merge(settings)(state.params, state.frozen)


_MERGES: dict = {}


def _merge(settings):
  from grpo_jax.model import lora

  if settings not in _MERGES:
    _MERGES[settings] = jax.jit(lambda params, frozen: lora.merged(lora.join(params, frozen), settings))
  return _MERGES[settings]


def snapshot_steps(workdir: str) -> list[int]:
  """The steps of the whole snapshots in `workdir`."""
  directory = os.path.join(workdir, DIRECTORY)
  if not os.path.isdir(directory):
    return []
  return sorted(int(match.group(1)) for name in os.listdir(directory) if (match := re.fullmatch(r'step_(\d+)', name)))

