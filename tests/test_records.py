"""Records own their rows: a per-token field added to the rollout record reaches the update.

The test declares one field, `tag` [P*G, N], on a subclass of the sampler's Rollout, and has every
rollout the sampler makes carry it (Rollout.of for groups and the pool, agents/trajectory.collate
for episodes): a function of the row's own tokens and positions. Nothing else changes. Inside the
update's loss (one micro-batch of one mini-batch, after the update's shuffles, packing and the
split devices' crossing) the field is read back beside the tokens it came with, and must equal that
function of them on every trained token: each mode carried it, row for row, without naming it.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.agents import stage as agent_stage
from grpo_jax.rl import update as update_lib
from grpo_jax.sampler.rollout import Rollout
from runs import train_here


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Tagged(Rollout):
  """A Rollout with one more per-token field. tag: [P*G, N] int32 (expected_tag of the row)."""

  tag: jax.Array | None = None


def expected_tag(tokens):
  """[R, N] int32: 1000 * token + its position in the completion, +7 (never the zeros of padding)."""
  numpy = np if isinstance(tokens, np.ndarray) else jnp
  return (tokens.astype(numpy.int32) * 1000 + numpy.arange(tokens.shape[1], dtype=numpy.int32)[None, :] + 7)


def tagged(rollout: Rollout) -> Tagged:
  fields = {field.name: getattr(rollout, field.name) for field in dataclasses.fields(Rollout)}
  return Tagged(**fields, tag=expected_tag(rollout.tokens))


@pytest.fixture
def tagging(monkeypatch):
  """Every rollout carries `tag`, and the loss reports tag_tokens (trained tokens it saw) and
  tag_wrong (those whose tag is not their own tokens')."""
  made = Rollout.of
  monkeypatch.setattr(Rollout, 'of', classmethod(lambda cls, *args, **kwargs: tagged(made(*args, **kwargs))))
  collate = agent_stage.collate
  monkeypatch.setattr(agent_stage, 'collate',
                      lambda *args, **kwargs: (lambda r, *rest: (tagged(r), *rest))(*collate(*args, **kwargs)))
  loss = update_lib.policy_loss

  def checked(params, graphdef, micro, *args):
    value, metrics = loss(params, graphdef, micro, *args)
    rollout = micro.batch.rollout
    assert isinstance(rollout, Tagged), type(rollout)  # at trace time: the record itself came through
    wrong = rollout.mask & (rollout.tag != expected_tag(rollout.tokens))
    return value, dict(metrics, tag_tokens=jnp.sum(rollout.mask).astype(jnp.float32),
                       tag_wrong=jnp.sum(wrong).astype(jnp.float32))

  monkeypatch.setattr(update_lib, 'policy_loss', checked)


QUIET = ('train.progress=false', 'train.tensorboard=false', 'train.checkpoint_every=0')
MODES = {
    # Groups, two steps inside one jit, packed, in two mini-batches of micro-batches.
    'group': ('configs/tiny_arith.yaml', 1, 'train.steps=2', 'train.steps_per_call=2', 'algo.packing=true',
              'algo.num_minibatches=2', 'algo.micro_batch_size=32', 'rollout.prompts_per_step=8'),
    # The pool of partial rollouts: groups carried across steps.
    'pool': ('configs/tiny_arith.yaml', 1, 'train.steps=2', 'algo.max_lag=1', 'algo.tis_cap=2.0', 'rollout.prompts_per_step=8',
             'rollout.slots=16'),
    # Split devices: the sampler's 4 devices make the groups the trainer's 4 train on, a step later.
    'split': ('configs/tiny_arith.yaml', 8, 'train.steps=2', 'algo.max_lag=1', 'algo.tis_cap=2.0', 'rollout.devices=4',
              'rollout.prompts_per_step=8'),
    # Agents: episodes on the inference server, collated on the host.
    'agents': ('configs/tiny_guess.yaml', 1, 'train.steps=1', 'rollout.prompts_per_step=4'),
}


@pytest.mark.parametrize('mode', [pytest.param(name, marks=() if name in ('group', 'agents') else pytest.mark.exhaustive)
                                  for name in MODES])
def test_a_field_added_to_the_rollout_reaches_the_update(tmp_path, tagging, mode):
  config, devices, *overrides = MODES[mode]
  history = train_here(tmp_path, config, *QUIET, *overrides, devices=devices)
  assert len(history) == int(next(o for o in overrides if o.startswith('train.steps=')).split('=')[1])
  for row in history:
    assert row['tag_tokens'] > 0, row
    assert row['tag_wrong'] == 0, row
