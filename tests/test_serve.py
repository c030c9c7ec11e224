"""python -m grpo_jax.serve: JetStream's gRPC server and client stubs end to end, and CLI errors.

The server runs in a subprocess: JetStream's orchestrator SIGKILLs its own process when one of
its threads fails, and a subprocess also bounds shutdown with a timeout.
"""

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch

from runs import device_env
from test_api import write_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def serve(*args, **kwargs):
  return subprocess.Popen([sys.executable, '-m', 'grpo_jax.serve', *map(str, args)], cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def stop(server):
  """SIGINT -> (exit code, stderr); the server must exit within 60 s."""
  server.send_signal(signal.SIGINT)
  try:
    _, stderr = server.communicate(timeout=60)
  except subprocess.TimeoutExpired:
    server.send_signal(signal.SIGUSR1)  # the server dumps every thread's stack
    try:
      _, stderr = server.communicate(timeout=10)
    except subprocess.TimeoutExpired:
      server.kill()
      _, stderr = server.communicate()
    # Not `from None`: when a request failed first, the chained traceback shows that error too.
    raise AssertionError(f'the server did not shut down within 60 s:\n{stderr[-6000:]}')
  return server.returncode, stderr


def alone_then_mixed(port, good, bad, rng):
  """Through the server on `port`: each request of `good` (DecodeRequest fields) at once, then every
  good and bad one at once in a random order -> (the good answers, every answer in the given
  order), an answer the token ids, or a refused call's (code, details)."""
  import grpc
  from jetstream.core.proto import jetstream_pb2, jetstream_pb2_grpc

  with grpc.insecure_channel(f'127.0.0.1:{port}') as channel:
    grpc.channel_ready_future(channel).result(timeout=240)
    stub = jetstream_pb2_grpc.OrchestratorStub(channel)

    def decode(fields):
      try:
        return [i for r in stub.Decode(jetstream_pb2.DecodeRequest(**fields), timeout=240)
                for sample in r.stream_content.samples for i in sample.token_ids]
      except grpc.RpcError as error:
        return error.code(), error.details()

    every = good + bad
    with concurrent.futures.ThreadPoolExecutor(len(every)) as pool:
      alone = list(pool.map(decode, good))
      order = rng.permutation(len(every))  # good and bad requests interleaved at random
      futures = {int(index): pool.submit(decode, every[index]) for index in order}
      mixed = [futures[index].result() for index in range(len(every))]
    assert stub.HealthCheck(jetstream_pb2.HealthCheckRequest(), timeout=30).is_live
  return alone, mixed


def answering_checkpoint(seed, draw, answers_of, enough):
  """draw(seed) -> a checkpoint, answers_of(checkpoint) -> its reference answers. A random model whose
  greedy answers open with the stop token would compare empty answers: the checkpoint is drawn again
  (the next seed, 8 seeds at most) until enough(answers). -> (checkpoint, answers)."""
  for checkpoint_seed in range(seed, seed + 8):
    checkpoint = draw(checkpoint_seed)
    answers = answers_of(checkpoint)
    if enough(answers):
      print(f'checkpoint seed={checkpoint_seed}')
      return checkpoint, answers
  pytest.fail(f'the checkpoints of seeds {seed}..{seed + 7} stop at once where a test needs answers')


def greedy_until_stop(reference, prompt, max_new_tokens, stop_ids):
  """transformers' greedy tokens, cut before the first stop token (JetStream does not send it)."""
  with torch.no_grad():
    out = reference.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens,
                             eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
  for index, token in enumerate(out):
    if token in stop_ids:
      return out[:index]
  return out


@pytest.mark.exhaustive
@pytest.mark.starts_first
def test_jetstream_grpc_server_matches_greedy_decoding(seed, make_hf_checkpoint):
  # Only the stubs are imported here: importing JetStream's orchestrator reconfigures the root logger.
  pytest.importorskip('jetstream.core.proto.jetstream_pb2_grpc',
                      reason='google-jetstream (requirements-extras.txt) is not installed')
  import grpc
  import portpicker
  from jetstream.core.proto import jetstream_pb2, jetstream_pb2_grpc

  from grpo_jax.model import load_tokenizer

  rng = np.random.default_rng(seed)
  prompts = [rng.integers(3, 1000, n).tolist() for n in (6, 13)]
  question = 'seven plus two is'
  long_prompt = rng.integers(3, 1000, 64 + int(rng.integers(1, 30))).tolist()  # cut to its last 64 tokens

  def draw(checkpoint_seed):
    directory, reference = make_hf_checkpoint(checkpoint_seed, name=f'hf{checkpoint_seed}')
    write_tokenizer(directory)
    add_chat_template(directory)
    return directory, reference, load_tokenizer(directory)

  def answers_of(checkpoint):
    _, reference, tokenizer = checkpoint
    stop_ids = {tokenizer.eos_token_id} | set(np.atleast_1d(reference.config.eos_token_id or []).tolist())
    chat_ids = tokenizer.apply_chat_template([{'role': 'user', 'content': question}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False)
    assert len(chat_ids) <= 64  # fits --max-prefill-length untruncated
    return ([greedy_until_stop(reference, prompt, 7, stop_ids) for prompt in prompts]
            + [greedy_until_stop(reference, chat_ids, 5, stop_ids),
               greedy_until_stop(reference, long_prompt[-64:], 8, stop_ids)])

  (directory, _, tokenizer), expected = answering_checkpoint(seed, draw, answers_of, any)

  port = portpicker.pick_unused_port()
  server = serve('--ckpt', directory, '--port', port, '--slots', 2, '--max-prefill-length', 64,
                 '--max-new-tokens', 8, '--greedy', '--dtype', 'float32', '--long-prompts', 'truncate')
  try:
    with grpc.insecure_channel(f'127.0.0.1:{port}') as channel:
      grpc.channel_ready_future(channel).result(timeout=240)
      stub = jetstream_pb2_grpc.OrchestratorStub(channel)
      requests = [jetstream_pb2.DecodeRequest(token_content=jetstream_pb2.DecodeRequest.TokenContent(token_ids=p),
                                              max_tokens=7) for p in prompts]
      requests.append(jetstream_pb2.DecodeRequest(
          text_content=jetstream_pb2.DecodeRequest.TextContent(text=question), max_tokens=5))
      requests.append(jetstream_pb2.DecodeRequest(  # max_tokens 0: the server's --max-new-tokens
          token_content=jetstream_pb2.DecodeRequest.TokenContent(token_ids=long_prompt)))

      def decode(request):
        ids, text = [], ''
        call = stub.Decode(request, timeout=240)
        for response in call:
          for sample in response.stream_content.samples:
            ids.extend(sample.token_ids)
            text += sample.text
        return ids, text, dict(call.trailing_metadata() or ())

      # Four requests at once through two slots: JetStream refills the slot that frees first.
      with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(decode, requests))
      assert stub.HealthCheck(jetstream_pb2.HealthCheckRequest(), timeout=30).is_live
  finally:
    code, stderr = stop(server)
  assert code == 0, stderr[-3000:]
  assert [ids for ids, _, _ in answers] == expected and any(expected)
  assert answers[0][1] == '' and answers[2][1] == tokenizer.decode(expected[2])
  assert answers[3][2] == {'prompt-tokens': str(len(long_prompt)), 'prompt-tokens-kept': '64'}
  assert 'prompt-tokens' not in answers[0][2]


@pytest.mark.starts_first
def test_hostile_clients_never_change_another_clients_answer(seed, make_hf_checkpoint):
  """Good token requests, first alone, then interleaved with bad ones sent at the same time (ids
  past the vocabulary, negative ids, too long, empty, max_tokens 0 and negative, text to a
  token-ids-only server) through two slots: each bad one is refused to its own client with
  INVALID_ARGUMENT, and every good answer is the same in both rounds and equals transformers'."""
  pytest.importorskip('jetstream.core.proto.jetstream_pb2_grpc',
                      reason='google-jetstream (requirements-extras.txt) is not installed')
  import grpc
  import portpicker
  from jetstream.core.proto import jetstream_pb2

  directory, reference = make_hf_checkpoint(seed)
  stop_ids = set(np.atleast_1d(reference.config.eos_token_id or []).tolist())
  rng = np.random.default_rng(seed)
  good = [(rng.integers(3, 1000, n).tolist(), int(budget)) for n, budget in
          zip(rng.integers(1, 17, 6), rng.integers(1, 7, 6))]
  good[0] = (good[0][0], 0)  # max_tokens 0: the server's --max-new-tokens (6)
  expected = [greedy_until_stop(reference, prompt, budget or 6, stop_ids) for prompt, budget in good]
  tokens = lambda ids: dict(token_content=jetstream_pb2.DecodeRequest.TokenContent(token_ids=ids))  # noqa: E731
  bad = [  # (request fields, what the refusal says)
      (dict(tokens([5, 1000, 6]), max_tokens=3), 'token id 1000 at position 1 is outside the vocabulary [0, 1000)'),
      (dict(tokens([7] * 5 + [2**31 - 1]), max_tokens=3), f'token id {2**31 - 1} at position 5 is outside'),
      (dict(tokens([-5, 5, 6]), max_tokens=3), 'token id -5 at position 0 is outside'),
      (dict(tokens(rng.integers(3, 1000, 17).tolist()), max_tokens=3), 'the prompt has 17 tokens, more than'),
      (dict(tokens([]), max_tokens=3), 'the prompt is empty'),
      (dict(tokens([5, 6]), max_tokens=-2), 'max_tokens must be >= 0'),
      (dict(text_content=jetstream_pb2.DecodeRequest.TextContent(text='hello'), max_tokens=3),
       'this server has no tokenizer'),
  ]

  port = portpicker.pick_unused_port()
  server = serve('--ckpt', directory, '--port', port, '--slots', 2, '--max-prefill-length', 16,
                 '--max-new-tokens', 6, '--greedy', '--dtype', 'float32', '--token-ids-only')
  try:
    alone, mixed = alone_then_mixed(port, [dict(tokens(prompt), max_tokens=budget) for prompt, budget in good],
                                    [fields for fields, _ in bad], rng)
  finally:
    code, stderr = stop(server)
  assert code == 0, stderr[-3000:]
  assert alone == expected and mixed[:len(good)] == expected and any(expected)
  for (code, details), (_, message) in zip(mixed[len(good):], bad):
    assert code == grpc.StatusCode.INVALID_ARGUMENT and message in details, details


def test_cli_errors_are_one_line(seed, make_hf_checkpoint, tmp_path):
  def run(*args):
    process = serve(*args)
    _, stderr = process.communicate(timeout=120)
    return process.returncode, stderr.strip()

  code, stderr = run('--ckpt', tmp_path / 'missing', '--port', 1)
  assert code == 2 and stderr == f'error: --ckpt {tmp_path / "missing"} is not a directory'
  directory, _ = make_hf_checkpoint(seed)
  code, stderr = run('--ckpt', directory, '--port', 1)
  assert code == 2 and stderr.startswith('error: ') and 'has no tokenizer' in stderr and '\n' not in stderr
  with socket.socket() as taken:
    taken.bind(('127.0.0.1', 0))
    taken.listen()
    port = taken.getsockname()[1]
    code, stderr = run('--ckpt', directory, '--port', port, '--token-ids-only')
  assert code == 2 and stderr.startswith(f'error: cannot listen on 127.0.0.1:{port}') and '\n' not in stderr


def test_tokenizer_chat_template_padding_and_token_requests(make_hf_checkpoint, seed, tmp_path):
  from grpo_jax.serve.tokenizer import HFTokenizer

  directory, _ = make_hf_checkpoint(seed)
  write_tokenizer(directory)
  plain = HFTokenizer(directory, stop_token_ids=(0, 7), pad_id=5)
  ids = plain.tokenizer('seven plus two is')['input_ids']
  padded, length = plain.encode('seven plus two is', max_prefill_length=64)
  assert length == len(ids) and len(padded) == 16 and padded[:length].tolist() == ids
  assert (padded[length:] == 5).all()
  with pytest.raises(ValueError, match='exceeds max_prefill_length=16'):  # too long: refused, not cut
    plain.encode(' '.join(['seven plus two is'] * 20), max_prefill_length=16)
  assert plain.bos_id == -1 and plain.stop_tokens == {0, 7} and plain.pad_id == 5

  add_chat_template(directory)
  chat = HFTokenizer(directory)
  conversation = [{'role': 'system', 'content': 'be brief'}, {'role': 'user', 'content': 'one plus one'}]
  for text, messages in (('one plus one', conversation[1:]), (json.dumps(conversation), conversation)):
    padded, length = chat.encode(text, max_prefill_length=256)
    expected = chat.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False)
    assert padded[:length].tolist() == list(expected)
    assert len(padded) in (16, 32, 64, 128, 256) and len(padded) // 2 < max(length, 16) <= len(padded)
  never = HFTokenizer(directory, chat_template='never')
  assert never.encode('one plus one')[0][:3].tolist() == never.tokenizer('one plus one')['input_ids'][:3]

  empty = tmp_path / 'no_tokenizer'
  empty.mkdir()
  with pytest.raises(ValueError, match='no tokenizer'):
    HFTokenizer(str(empty)).encode('one plus one')


def add_chat_template(directory):
  """Gives the tokenizer in `directory` the test's ChatML-style chat template."""
  config_path = os.path.join(directory, 'tokenizer_config.json')
  with open(config_path) as f:
    tokenizer_config = json.load(f)
  with open(config_path, 'w') as f:
    json.dump(dict(tokenizer_config, chat_template=CHAT_TEMPLATE), f)


VL_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
               "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<|vision_start|><|image_pad|>"
               "<|vision_end|>{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.exhaustive
@pytest.mark.starts_first
@pytest.mark.parametrize('devices', [8, 1], ids=['mesh', 'one-device'])
def test_image_requests_equal_transformers_and_bad_images_are_refused_alone(seed, make_hf_checkpoint, tmp_path,
                                                                            devices):
  """A Qwen2.5-VL checkpoint served on the 8 test devices and on a host of one device:
  conversations with one image, two images of different sizes
  (base64 parts, both part spellings) and none, through two slots at once, decode greedily as
  transformers' generate does on the processor's pixels; undecodable, too many, fetched and
  unearned image tokens are refused to their own clients, and the good answers do not change."""
  pytest.importorskip('jetstream.core.proto.jetstream_pb2_grpc',
                      reason='google-jetstream (requirements-extras.txt) is not installed')
  import base64
  import io

  import grpc
  import portpicker
  from jetstream.core.proto import jetstream_pb2
  from PIL import Image

  from grpo_jax.model.images import ImageSettings, process_image
  from grpo_jax.model import load_tokenizer

  def draw(checkpoint_seed):
    directory, reference = make_hf_checkpoint(checkpoint_seed, name=f'vl{checkpoint_seed}', model_type='qwen2_5_vl',
                                              image_token_id=2, vision_start_token_id=1, vision_end_token_id=3,
                                              video_token_id=4)
    write_tokenizer(directory, special=['<|vision_start|>', '<|image_pad|>', '<|vision_end|>', '<|video_pad|>'])
    with open(os.path.join(directory, 'tokenizer_config.json')) as f:
      tokenizer_config = json.load(f)
    with open(os.path.join(directory, 'tokenizer_config.json'), 'w') as f:
      json.dump(dict(tokenizer_config, chat_template=VL_TEMPLATE), f)
    with open(os.path.join(directory, 'preprocessor_config.json'), 'w') as f:
      json.dump({'min_pixels': 3136, 'max_pixels': 40000, 'patch_size': 14, 'merge_size': 2, 'temporal_patch_size': 2},
                f)
    return directory, reference, load_tokenizer(directory)

  settings = ImageSettings(min_pixels=3136, max_pixels=40000)
  rng = np.random.default_rng(seed)
  pictures = [Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)) for shape in ((75, 130, 3), (60, 56, 3))]
  encoded = []
  for picture in pictures:
    buffer = io.BytesIO()
    picture.save(buffer, format='PNG')
    encoded.append(base64.b64encode(buffer.getvalue()).decode())
  image = lambda i: {'type': 'image', 'image': f'data:image/png;base64,{encoded[i]}'}  # noqa: E731
  image_url = lambda i: {'type': 'image_url', 'image_url': {'url': f'data:image/png;base64,{encoded[i]}'}}  # noqa: E731
  text = lambda t: {'type': 'text', 'text': t}  # noqa: E731
  conversations = [
      [{'role': 'user', 'content': [image(0), text('seven plus two')]}],
      [{'role': 'system', 'content': 'be brief'},
       {'role': 'user', 'content': [text('one'), image_url(1), text('plus'), image(0)]}],
      [{'role': 'user', 'content': 'four plus four'}],
  ]

  def expected(checkpoint, conversation, budget=6):
    _, reference, tokenizer = checkpoint
    stop_ids = {tokenizer.eos_token_id} | set(np.atleast_1d(reference.config.text_config.eos_token_id or []).tolist())
    shown = [dict(m, content=[{'type': 'image'} if p['type'] != 'text' else p for p in m['content']])
             if isinstance(m['content'], list) else m for m in conversation]
    ids = tokenizer.apply_chat_template(shown, add_generation_prompt=True, tokenize=True, return_dict=False)
    order = [0 if p.get('image') == image(0)['image'] else 1 for m in conversation if isinstance(m['content'], list)
             for p in m['content'] if p['type'] != 'text']
    processed = [process_image(pictures[i], settings) for i in order]
    counts = iter(int(np.prod(grid)) // 4 for _, grid in processed)
    ids = torch.tensor([[t for token in ids for t in ([2] * next(counts) if token == 2 else [token])]])
    inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids))
    if processed:
      inputs.update(pixel_values=torch.tensor(np.concatenate([p for p, _ in processed])),
                    image_grid_thw=torch.tensor([g for _, g in processed]), mm_token_type_ids=(ids == 2).int())
    with torch.no_grad():
      out = reference.generate(**inputs, do_sample=False, max_new_tokens=budget, eos_token_id=None,
                               pad_token_id=0)[0, ids.shape[1]:].tolist()
    return out[:next((i for i, t in enumerate(out) if t in stop_ids), len(out))]

  (directory, _, _), answers = answering_checkpoint(
      seed, draw, lambda checkpoint: [expected(checkpoint, c) for c in conversations], all)
  bad = [  # (conversation, what the refusal says)
      ([{'role': 'user', 'content': [{'type': 'image', 'image': 'data:image/png;base64,@@@@'}]}], 'not valid base64'),
      ([{'role': 'user', 'content': [{'type': 'image', 'image': base64.b64encode(b'not a png').decode()},
                                     text('one')]}], 'not an image format Pillow can read'),
      ([{'role': 'user', 'content': [image(0), image(1), image(0)]}], 'more than the server\'s --max-images 2'),
      ([{'role': 'user', 'content': [{'type': 'image', 'image': 'https://example.com/a.png'}]}], 'fetches no URL'),
      ([{'role': 'user', 'content': 'one <|image_pad|> two'}], 'is the image token'),
  ]

  port = portpicker.pick_unused_port()
  server = serve('--ckpt', directory, '--port', port, '--slots', 2, '--max-prefill-length', 128,
                 '--max-new-tokens', 6, '--greedy', '--dtype', 'float32', '--max-images', 2, env=device_env(devices))
  as_text = lambda c: dict(text_content=jetstream_pb2.DecodeRequest.TextContent(text=json.dumps(c)))  # noqa: E731
  good = [as_text(c) for c in conversations]
  try:
    alone, mixed = alone_then_mixed(port, good, [as_text(c) for c, _ in bad] + [
        dict(token_content=jetstream_pb2.DecodeRequest.TokenContent(token_ids=[5, 2, 6]))], rng)
  finally:
    code, stderr = stop(server)
  assert code == 0, stderr[-3000:]
  assert alone == answers and mixed[:len(good)] == answers and all(answers)
  for (code, details), message in zip(mixed[len(good):], [m for _, m in bad] + ['is the image token']):
    assert code == grpc.StatusCode.INVALID_ARGUMENT and message in details, details


@pytest.mark.exhaustive
@pytest.mark.starts_first
def test_a_mixture_served_over_the_expert_axis_answers_as_transformers_through_grpc(seed, make_hf_checkpoint):
  """A Qwen3-MoE checkpoint served on the 8 test devices with --tensor 2 (tensor pairs, its 8 experts
  over the expert axis of the 4 pairs, as training's sampler lays it out): JetStream's own gRPC
  client gets transformers' greedy answers, two requests at once through two slots."""
  pytest.importorskip('jetstream.core.proto.jetstream_pb2_grpc',
                      reason='google-jetstream (requirements-extras.txt) is not installed')
  import grpc
  import portpicker
  from jetstream.core.proto import jetstream_pb2, jetstream_pb2_grpc
  from test_moe import CASES

  rng = np.random.default_rng(seed)
  prompts = [rng.integers(3, 1000, n).tolist() for n in (5, 11)]

  def draw(checkpoint_seed):
    return make_hf_checkpoint(checkpoint_seed, name=f'moe{checkpoint_seed}', **CASES['top2-norm-tied'])

  def answers_of(checkpoint):
    _, reference = checkpoint
    stop_ids = set(np.atleast_1d(reference.config.eos_token_id or []).tolist())
    return [greedy_until_stop(reference, prompt, 6, stop_ids) for prompt in prompts]

  (directory, _), expected = answering_checkpoint(seed, draw, answers_of, all)
  port = portpicker.pick_unused_port()
  server = serve('--ckpt', directory, '--port', port, '--slots', 2, '--max-prefill-length', 64, '--max-new-tokens', 6,
                 '--greedy', '--dtype', 'float32', '--tensor', 2, '--token-ids-only')
  try:
    with grpc.insecure_channel(f'127.0.0.1:{port}') as channel:
      grpc.channel_ready_future(channel).result(timeout=240)
      stub = jetstream_pb2_grpc.OrchestratorStub(channel)

      def decode(prompt):
        request = jetstream_pb2.DecodeRequest(token_content=jetstream_pb2.DecodeRequest.TokenContent(token_ids=prompt),
                                              max_tokens=6)
        return [token for response in stub.Decode(request, timeout=240)
                for sample in response.stream_content.samples for token in sample.token_ids]

      with concurrent.futures.ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(decode, prompts))
  finally:
    code, stderr = stop(server)
  assert code == 0, stderr[-3000:]
  assert answers == expected
