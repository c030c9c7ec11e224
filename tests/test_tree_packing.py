"""Tree packing (algo.tree_packing): the sequences that share a prompt hold it once per packed row,
each completion a branch attending to it. The layout against the padded rows it came from (every
sequence read back whole, its positions and its attention mask those of its padded row, the prompt's
tokens held once), the model's log-probs on tree rows against the padded rows' (and a branch that
cannot see its root differs: the check can fail), and the tree update against the padded one
(gradients and metrics, fp32, test_update's tolerances): text, a mixture replaying its routes,
images, and on meshes with and without the context axis."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from grpo_jax.model import attention
from grpo_jax.model.qwen2 import segment_positions
from grpo_jax.rl import packing
from grpo_jax.rl.batch import Batch
from grpo_jax.rl.loss import completion_log_probs, packed_token_log_probs
from grpo_jax.testing import random_batch
from test_packing import SETTINGS, assert_packed_equals_padded, run_update
from test_update import ARCHITECTURE, COMPLETION_LENGTH, GROUP, PROMPT_LENGTH, ROWS, TEMPERATURE, random_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A mixture's statistics over the tokens the update computes: a tree's prompt tokens count once.
COUNTED_PER_COMPUTED_TOKEN = ('router_aux_loss', 'expert_load_max_over_mean', 'routing_replay_rerouted_frac')


def shared_prompt_batch(rng, rows=ROWS, group=GROUP, prompt_length=PROMPT_LENGTH,
                        completion_length=COMPLETION_LENGTH, shuffle=False) -> Batch:
  """random_batch with each group's G rows answering one prompt of at least 2 tokens (its real
  tokens and length; the padding before it stays random, as the sampler leaves it), optionally the rows shuffled (sharing
  goes by content, not by row order)."""
  batch = random_batch(rng, rows, prompt_length, completion_length, ARCHITECTURE.vocab_size)
  tokens, segments = np.asarray(batch.tokens).copy(), np.asarray(batch.segment_ids).copy()
  for start in range(0, rows, group):
    leader = start + int(rng.integers(group))
    segments[leader, prompt_length - 2:prompt_length] = 1  # at least 2 prompt tokens: a root to share
    tokens[start:start + group, :prompt_length] = np.where(segments[leader, :prompt_length] != 0,
                                                           tokens[leader, :prompt_length],
                                                           tokens[start:start + group, :prompt_length])
    segments[start:start + group, :prompt_length] = segments[leader, :prompt_length]
  order = rng.permutation(rows) if shuffle else np.arange(rows)
  return Batch.of_sequences(tokens=jnp.asarray(tokens[order]), segment_ids=jnp.asarray(segments[order]),
                            mask=batch.mask[order], advantages=batch.advantages[order],
                            sampler_log_probs=batch.sampler_log_probs[order])


def read_back(packed, index, prompt_tokens):
  """Sequence `index`'s tokens from tree rows, as its root and then its branch hold them, with
  their columns and positions."""
  tokens, segments = np.asarray(packed.tokens)[0], np.asarray(packed.segment_ids)[0]
  row, start = int(packed.row[0, index]), int(packed.start[0, index])
  branch_id = segments[row, start]
  branch = np.flatnonzero(segments[row] == branch_id)
  root = np.flatnonzero(segments[row] == int(attention.tree_root(jnp.asarray(branch_id))))
  columns = branch if root.size == branch.size and (root == branch).all() else np.concatenate([root, branch])
  if branch_id < attention.TREE_BRANCHES:
    assert start - branch[0] == prompt_tokens  # a sequence of its own: its whole prompt in its segment
  else:
    assert start - branch[0] == 1 and root.size == prompt_tokens - 1  # the branch: the last prompt token, then the completion
  positions = np.asarray(segment_positions(jnp.asarray(segments[row:row + 1])))[0]
  return row, columns, tokens[row, columns], positions[columns]


@pytest.mark.parametrize('shuffle', [False, pytest.param(True, marks=pytest.mark.exhaustive)], ids=['in-order', 'shuffled'])
def test_tree_rows_hold_each_prompt_once_and_every_sequence_whole(seed, shuffle):
  """32 sequences, groups of 4 on 8 prompts, rows of 24 tokens: each sequence reads back whole (its
  tree's root, then its branch) at positions 0, 1, ...; each token of a row sees exactly the keys
  its padded row gives it (attention_mask on the packed ids against NumPy's mask of the sequences
  read back); the rows hold fewer tokens than the sequences, every prompt once per row it is in;
  the packed tokens unpack (shifted as log-probs are) to each completion."""
  rng = np.random.default_rng(seed)
  rows, prompt_length, completion_length, row_length = 32, 8, 10, 24
  batch = shared_prompt_batch(rng, rows, 4, prompt_length, completion_length, shuffle=shuffle)
  packed = jax.jit(packing.pack, static_argnums=(2, 3, 4), static_argnames='trees')(
      batch.tokens, batch.segment_ids, completion_length, row_length, 1, trees=True)
  source_tokens, source_segments = np.asarray(batch.tokens), np.asarray(batch.segment_ids)
  segments = np.asarray(packed.segment_ids)[0]
  expected_mask = np.zeros((rows, row_length, row_length), bool)  # [packed row, query, key]
  prompt_copies = {}
  for index in range(rows):
    real = source_tokens[index][source_segments[index] != 0]
    prompt = int((source_segments[index, :prompt_length] != 0).sum())
    row, columns, tokens, positions = read_back(packed, index, prompt)
    np.testing.assert_array_equal(tokens, real)
    np.testing.assert_array_equal(positions, np.arange(len(real)))
    # The sequence's tokens see the earlier ones of the sequence read back, in column order.
    expected_mask[row][np.ix_(columns, columns)] |= np.tril(np.ones((len(real), len(real)), bool))
    prompt_copies.setdefault(tuple(real[:prompt]), set()).add((row, tuple(columns[:max(prompt - 1, 0)])))
  used = int(packed.rows_used[0])
  slots = jnp.broadcast_to(jnp.arange(row_length), (used, row_length))
  mask = np.asarray(attention.attention_mask(slots, jnp.asarray(segments[:used]), slots,
                                             jnp.asarray(segments[:used])))
  real = segments[:used] != 0
  np.testing.assert_array_equal(mask & real[:, :, None] & real[:, None, :], expected_mask[:used])
  # Every prompt once per row that holds it: the rows hold its G copies' tokens fewer times.
  for copies in prompt_copies.values():
    assert len({row for row, _ in copies}) == len(copies)
  placed = int((segments != 0).sum())
  assert placed == int(packed.real_tokens) < int((source_segments != 0).sum())
  unpacked = np.asarray(packing.unpack(jnp.asarray(np.asarray(packed.tokens)[:, :, 1:], jnp.float32), packed,
                                       completion_length))
  mask = np.asarray(batch.mask)
  np.testing.assert_array_equal(unpacked[mask], source_tokens[:, prompt_length:][mask])


@pytest.mark.exhaustive
def test_prompts_that_differ_share_nothing():
  """Prompts that differ in one token share no root, and one-token prompts have nothing to share:
  the rows hold every real token of every sequence."""
  tokens = jnp.asarray([[5, 6, 7, 1, 2], [5, 6, 8, 3, 4], [0, 0, 9, 1, 2], [0, 0, 9, 3, 0]], jnp.int32)
  segments = jnp.asarray([[1, 1, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 1, 1, 1], [0, 0, 1, 1, 0]], jnp.int32)
  packed = packing.pack(tokens, segments, 2, 10, 1, trees=True)
  assert int(packed.real_tokens) == int(segments.sum()) == 15
  shared = packing.pack(tokens.at[1, 2].set(7), segments, 2, 10, 1, trees=True)  # now the first two share 5, 6
  assert int(shared.real_tokens) == 13


def tree_and_padded_log_probs(graphdef, params, batch, row_length):
  model = nnx.merge(graphdef, params)
  padded, _ = completion_log_probs(model, batch.tokens, batch.segment_ids, COMPLETION_LENGTH, temperature=TEMPERATURE,
                                   implementation='xla_chunked')
  packed = packing.pack(batch.tokens, batch.segment_ids, COMPLETION_LENGTH, row_length, 1, trees=True)
  values, _ = packed_token_log_probs(nnx.merge(graphdef, params), packed, temperature=TEMPERATURE,
                                     implementation='xla_chunked')
  return np.asarray(padded), np.asarray(packing.unpack(values, packed, COMPLETION_LENGTH))


def test_log_probs_of_tree_rows_equal_padded_and_a_blind_branch_differs(seed, monkeypatch):
  """The model's log-probs of every completion token from tree rows equal its padded rows' (fp32);
  with branches that cannot see their root (tree_root the identity), they do not."""
  rng = np.random.default_rng(seed)
  graphdef, params = random_model(rng)
  batch = shared_prompt_batch(rng, shuffle=True)
  mask = np.asarray(batch.mask)
  padded, tree = tree_and_padded_log_probs(graphdef, params, batch, 2 * (PROMPT_LENGTH + COMPLETION_LENGTH))
  np.testing.assert_allclose(tree[mask], padded[mask], rtol=1e-5, atol=1e-5)
  monkeypatch.setattr(attention, 'tree_root', lambda segments: segments)
  _, blind = tree_and_padded_log_probs(graphdef, params, batch, 2 * (PROMPT_LENGTH + COMPLETION_LENGTH))
  assert np.abs(blind[mask] - padded[mask]).max() > 1e-2


def tree(settings: dict) -> dict:
  return dict(settings, tree_packing=True)


def grouped_minibatches(settings: dict) -> dict:
  """`settings` with a prompt's rows dealt into one mini-batch where there are several (what
  tree_packing asks for)."""
  return dict(settings, shuffle='groups') if settings.get('num_minibatches', 1) > 1 else settings


@pytest.mark.parametrize('name', [pytest.param(name, marks=() if name == 'token-mean, all terms' else
                                                pytest.mark.exhaustive) for name in sorted(SETTINGS)])
def test_tree_update_equals_padded(seed, name):
  """Every packing setting (test_packing.SETTINGS) with the groups' prompts shared, rows shuffled:
  the tree update's gradients and metrics equal the padded update's, in fewer packed tokens."""
  rng = np.random.default_rng(seed)
  graphdef, params = random_model(rng)
  _, ref_params = random_model(rng)
  batch = shared_prompt_batch(rng, shuffle=sorted(SETTINGS).index(name) % 2 == 1)
  settings = grouped_minibatches(SETTINGS[name])
  padded = run_update(settings, params, batch, seed, packed=False, ref_params=ref_params)
  trees = run_update(tree(settings), params, batch, seed, packed=True, ref_params=ref_params)
  assert_packed_equals_padded(padded, trees, batch)
  assert float(trees[1]['packed_tokens']) < float(padded[1]['sequence_tokens'])


@pytest.mark.exhaustive
def test_replayed_tree_update_equals_padded(seed):
  """A mixture replaying the sampler's routes (the prompt's recorded once per group, as a group's
  shared prefill records them): the tree update equals the padded one with pi_old, pi_theta and
  pi_ref replaying them. The load-balancing term counts a prompt's tokens once per tree, as they are
  computed: its coefficient is 0 here, and it, the load and the rerouted fraction are the trees' own."""
  from test_moe import MOE_ARCHITECTURE, perturbed_sampler, sampler_routes
  rng = np.random.default_rng(seed)
  graphdef, params = random_model(rng, MOE_ARCHITECTURE)
  sampler = perturbed_sampler(rng, params)
  _, ref_params = random_model(rng, MOE_ARCHITECTURE)
  batch = shared_prompt_batch(rng)
  batch = batch.with_rollout(routes=sampler_routes(graphdef, sampler, batch))
  settings = dict(routing_replay='rollout', replay_reference=True, kl_beta=0.05, ppo_epochs=2, tis_cap=2.0)
  padded = run_update(settings, params, batch, seed, packed=False, ref_params=ref_params,
                      architecture=MOE_ARCHITECTURE)
  trees = run_update(tree(settings), params, batch, seed, packed=True, ref_params=ref_params,
                     architecture=MOE_ARCHITECTURE)
  assert_packed_equals_padded(padded, trees, batch, skip=COUNTED_PER_COMPUTED_TOKEN)
  assert float(trees[1]['packed_tokens']) < float(padded[1]['sequence_tokens'])


@pytest.mark.exhaustive
@pytest.mark.long
def test_tree_update_with_images_equals_padded(seed):
  """Prompts with 0, 1 or 2 images, each answered G times (a group shows its prompt's images, the
  tower run once per prompt): the tree update, whose roots carry the images' features and M-RoPE
  positions and whose branches continue them, equals the padded update; and on fsdp 2 x context 2
  (the tree rows split along their length)."""
  from grpo_jax import config as config_lib
  from grpo_jax import sharding
  from grpo_jax.model import vision
  from test_vision_rl import CONFIG, image_prompt

  architecture = config_lib.load_config(CONFIG).model.architecture
  v = architecture.vision
  rng = np.random.default_rng(seed)
  graphdef, params = random_model(rng, architecture)
  _, ref_params = random_model(rng, architecture)
  drawn = [image_prompt(rng, v, 1 if index == 0 else None) for index in range(ROWS // GROUP)]  # the first shows one
  prompts, images = map(list, zip(*drawn))
  width, steps = max(map(len, prompts)), 4
  prompt_tokens = np.zeros((len(prompts), width), np.int32)
  prompt_mask = np.zeros((len(prompts), width), np.int32)
  for p, row in enumerate(prompts):
    prompt_tokens[p, width - len(row):], prompt_mask[p, width - len(row):] = row, 1
  prompt_vision = vision.vision_of(images, prompt_tokens, prompt_mask, architecture, max_images=2, max_patches=16)
  row_prompts, row_mask = np.repeat(prompt_tokens, GROUP, axis=0), np.repeat(prompt_mask, GROUP, axis=0)
  mask = np.arange(steps)[None, :] < rng.integers(1, steps + 1, ROWS)[:, None]
  batch = Batch.of_sequences(
      tokens=jnp.asarray(np.concatenate([row_prompts, rng.integers(6, 11, (ROWS, steps))], axis=1), jnp.int32),
      segment_ids=jnp.asarray(np.concatenate([row_mask, mask], axis=1), jnp.int32), mask=jnp.asarray(mask),
      advantages=jnp.asarray(rng.standard_normal(ROWS), jnp.float32),
      sampler_log_probs=jnp.asarray(rng.uniform(-3.0, -0.5, mask.shape), jnp.float32),
      images=prompt_vision.images,
      vision=vision.RowImages.answering(prompt_vision, GROUP, jnp.asarray(row_mask), jnp.asarray(mask)))
  settings = dict(ppo_epochs=2, kl_beta=0.05, tis_cap=1.5, entropy_coef=0.01, pack_length=2 * (width + steps))
  padded = run_update(settings, params, batch, seed, packed=False, ref_params=ref_params, architecture=architecture)
  trees = run_update(tree(settings), params, batch, seed, packed=True, ref_params=ref_params,
                     architecture=architecture)
  assert_packed_equals_padded(padded, trees, batch)
  assert float(trees[1]['packed_tokens']) < float(padded[1]['sequence_tokens'])
  mesh = jax.make_mesh((1, 2, 1, 1, 2), sharding.MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 5,
                       devices=jax.devices()[:4])
  place = lambda tree: jax.device_put(tree, sharding.state_shardings(tree, mesh))  # noqa: E731
  with jax.set_mesh(mesh):
    on_context = run_update(tree(settings), place(params), jax.device_put(batch, jax.NamedSharding(mesh, jax.P())),
                            seed, packed=True, ref_params=place(ref_params), architecture=architecture)
  for name in ('packed_rows', 'packed_padding_frac', 'packed_tokens', 'micro_batches'):  # each batch group packs its own
    padded[1].pop(name, None), on_context[1].pop(name)
  assert_packed_equals_padded(padded, on_context, batch)


# make test's: three branches a row, two copies of each root; the others, test-all's.
@pytest.mark.parametrize('pack_length', [pytest.param(length, marks=() if length == 20 else pytest.mark.exhaustive)
                                         for length in (9, 14, 20, 24)],
                         ids=['one-branch', 'two-branches', 'three-branches', 'four-branches'])
def test_update_token_count_is_what_the_trees_hold(seed, pack_length):
  """metrics.update_tokens_per_group (the plan's and the MFU's count of the update's tokens) equals
  what the tree rows hold for full-length answers: 8 groups of 4, prompts of 5 and answers of 4
  tokens (a root of 4, branches of 5), in rows of one sequence's width (one branch: no saving), two
  branches, three (two copies of each root) and four."""
  from grpo_jax.metrics import update_tokens_per_group
  from grpo_jax.rl.algo import AlgoConfig
  rng = np.random.default_rng(seed)
  rows, group, prompt_length, completion_length = 32, 4, 5, 4
  prompts = np.repeat(rng.integers(1, 100, (rows // group, prompt_length)), group, axis=0)
  tokens = np.concatenate([prompts, rng.integers(1, 100, (rows, completion_length))], axis=1)
  order = rng.permutation(rows)
  packed = packing.pack(jnp.asarray(tokens[order], jnp.int32), jnp.ones(tokens.shape, jnp.int32), completion_length,
                        pack_length, 1, trees=True)
  algo = AlgoConfig(group_size=group, packing=True, tree_packing=True, pack_length=pack_length)
  assert int(packed.real_tokens) == rows // group * update_tokens_per_group(prompt_length, completion_length, algo)
  flat = AlgoConfig(group_size=group, packing=True, pack_length=pack_length)
  assert update_tokens_per_group(prompt_length, completion_length, flat) == group * (prompt_length + completion_length)


def test_a_branch_joins_its_tree_in_a_row_already_holding_it():
  """Rows of 10, tree 0 (prefix 1, branches 5, 5, 4, 2): row 0 takes 1 + 5, row 1 a copy for the
  second 5, the 4 joins row 0's copy and the 2 row 1's. Joining only the copy opened last puts the 4
  in row 1 and then opens a second copy in row 0 for the 2. Each (row, tree) holds one root, and
  the rows hold 33 tokens (34 with the second root)."""
  lengths = jnp.asarray([6, 3, 5, 6, 7, 8], jnp.int32)
  prefix = jnp.asarray([1, 1, 1, 1, 2, 2], jnp.int32)
  leader = jnp.asarray([0, 0, 0, 0, 4, 4], jnp.int32)
  row, prefix_at, _, segment, fill = (np.asarray(value) for value in packing.place_trees(lengths, prefix, leader, 6, 10))
  opened = [(int(row[index]), int(leader[index])) for index in range(6) if prefix_at[index] >= 0]
  assert len(opened) == len(set(opened)) == 4  # two copies of each tree, in four rows
  roots = {(int(row[index]), int(attention.tree_root(jnp.asarray(segment[index])))) for index in range(6)}
  assert len(roots) == 4  # the branches of a tree in a row hang from one root
  assert int(fill.sum()) == 33 and (fill <= 10).all()
