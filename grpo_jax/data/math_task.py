"""Math word problems from a dataset, rewarded on the host by checking answers with math-verify.

The task reads the records of `task.source` (data/sources.py), maps them to (question, reference
answer) with the `task.format` adapter (data/adapters.py), renders each question through
`task.prompt_template` and, for chat models, the tokenizer's chat template, tokenizes everything
once, and drops prompts longer than `task.max_prompt_tokens` (a ProblemSet; evaluation reads its
held-out problems the same way). Prompts are served in a seeded
shuffle per epoch: the prompts of a step depend only on (run.seed, number of prompts consumed so
far), so a resumed run sees exactly the prompts the uninterrupted run would have seen.
Completions are decoded and scored by the run's reward terms (data/reward_terms.py; by default the
math-verify check alone, 1.0 / 0.0 against the reference answer, in a pool of
`task.reward_workers` processes); checks that time out or crash score 0 and are counted in
`Scores.failures`.

Problems with images (task.format geo3k, verl or vision) need a vision-language model: their
images are made into patches at load and padded to one bucket for the run (data/image_problems.py);
the prompt shows one image part per image, its <|image_pad|> repeated to the image's token count.
"""

import dataclasses
import os
import sys
import weakref
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax import distributed
from grpo_jax.data.adapters import UNREFERENCED_FORMATS, adapt
from grpo_jax.data.image_problems import (ImageInputs, batch_vision, image_dataset, image_inputs, largest_bucket,
                                          problems_bucket, read_image_problems)
from grpo_jax.data.multimodal import (IMAGE_PAD, VISION_END, VISION_FORMATS, VISION_START, expand_image_tokens,
                                      render_user_content)
from grpo_jax.data.reward_composer import Combination, RewardComposer
from grpo_jax.data.reward_terms import MathTerm, RewardTerm
from grpo_jax.data.sources import DatasetSource, load_records
from grpo_jax.data.task import Prompts, Scores, TaskSection, TaskShape
from grpo_jax.errors import FieldError, UserError, require
from grpo_jax.model.loading import load_tokenizer
from grpo_jax.model.vision import ImageBucket, Vision
from grpo_jax.sampler.rollout import Rollout
from grpo_jax.sampler.special_tokens import checkpoint_eos_ids, special_tokens
from grpo_jax.sections import inline, section


@dataclasses.dataclass(frozen=True)
class ProblemFields(TaskSection):
  """The fields of a task whose prompts are a dataset's problems rendered through a tokenizer (the
  math task's section, and the agent task's, whose tool_use environment reads problems so). The
  problems are written in the section itself: `task.source`, `task.split`, `task.format`,
  `task.prompt_field`, `task.answer_field` (data/sources.py)."""

  dataset: DatasetSource = inline(DatasetSource())  # the problems
  mix: tuple[DatasetSource, ...] = ()  # more datasets, shuffled into one stream with the task's own
  prompt_template: str = '{prompt}'  # format string; chat models go through the chat template
  chat_template: bool = True  # apply the tokenizer's chat template when it has one
  # The chat template's thinking switch (Qwen3: a <think> block before the answer, which the reward
  # skips); None: the template's own default. Templates without the switch ignore it.
  enable_thinking: bool | None = None
  tokenizer: str | None = None  # directory of the Hugging Face tokenizer; None: model.path's
  max_prompt_tokens: int = 512  # prompts are left-padded to this; longer prompts are skipped
  reward_workers: int = 4  # processes verifying answers with math-verify

  def __post_init__(self):
    with section('task'):
      for index, dataset in enumerate(self.mix):
        require(bool(dataset.source), f'mix[{index}].source', 'must name a dataset')
      require(self.reward_workers >= 1, 'reward_workers', f'must be >= 1, got {self.reward_workers}')
      require(self.max_prompt_tokens >= 1, 'max_prompt_tokens', f'must be >= 1, got {self.max_prompt_tokens}')

  @property
  def tokenizer_directory(self) -> str | None:
    return self.tokenizer


@dataclasses.dataclass(frozen=True)
class Reference:
  """What a math task's reward compares a prompt's completions with (its Prompts.answers, one per
  prompt): the reference answer ('' for a dataset of prompts alone), the question as the policy was
  asked it, before the chat template (a judge's {prompt}: data/judge.py), and the conversation the
  policy's chat template rendered (chat messages: a reward model of another tokenizer renders it
  through its own template, rl/model_scores.py)."""

  answer: str
  question: str
  messages: tuple[dict, ...] = ()


def question_text(messages: tuple[dict, ...]) -> str:
  """A problem's question as the policy was asked it, as text: of its chat messages the last user
  message's content (the question; a system message is the setting, not the question)."""
  users = [message['content'] for message in messages if message['role'] == 'user']
  return users[-1] if users else messages[-1]['content']


def conversation(task: 'ProblemFields', prompt) -> tuple[dict, ...]:
  """The chat messages of a problem's prompt: the question through the task's prompt_template as
  one user message, or the dataset's own messages."""
  if isinstance(prompt, str):
    return ({'role': 'user', 'content': _format(task.prompt_template, prompt)},)
  return tuple(dict(message) for message in prompt)


class ProblemSet:
  """The problems of one or more datasets, ready for the policy: `prompt_ids` (token ids of each
  rendered prompt, at most `max_prompt_tokens`), `answers` (reference strings), `conversations` (each
  prompt's chat messages before the chat template, `conversation`; an image problem's text as
  rendered, one image pad per image, as one user message), `data_sources`, `texts`,
  and `images`: each problem's (patches [n, P], grid (t, h, w)) per image, () for a text problem.

  datasets: each a data.sources.DatasetSource (the task's, task.mix's, eval's), `section` their
  name in messages; rendering follows `task` (template, chat template, max_prompt_tokens);
  `images`: how images reach the model (needed by a dataset with images). Prints the kept /
  skipped counts of each dataset. `bucket`: (images per prompt, patches per image) every batch's
  Vision is padded to, the most of this set's problems; None without images.
  """

  def __init__(self, tokenizer, use_chat_template: bool, task: 'ProblemFields', datasets, section: str, tools=None,
               images: ImageInputs | None = None):
    self.tokenizer, self.use_chat_template, self.task_config = tokenizer, use_chat_template, task
    self.tools = tools  # function schemas the chat template lists for the model (tool use), or None
    self.image_inputs = images
    self.prompt_ids, self.answers, self.data_sources, self.texts, self.images = [], [], [], [], []
    self.conversations = []
    for data in datasets:
      self._add(data, section)
    if not self.prompt_ids:
      raise UserError(f'{section}: every prompt is longer than task.max_prompt_tokens={task.max_prompt_tokens} tokens')
    self.bucket = problems_bucket(self.images, images)

  def _add(self, data, section: str) -> None:
    task = self.task_config
    if data.format in VISION_FORMATS:
      texts, ids, answers, images, total, skipped = read_image_problems(data, section, self.image_inputs,
                                                                        self._render_with_images, self._tokenized)
      conversations = [({'role': 'user', 'content': text},) for text in texts]
    else:
      records = load_records(data.source, data.split)
      adapted = adapt(records, data.format, data.source, data.prompt_field, data.answer_field)
      texts = [self.render(problem.prompt, index, section) for index, problem in enumerate(adapted.problems)]
      ids = self._tokenized(texts)
      answers = [(problem.answer, problem.data_source) for problem in adapted.problems]
      conversations = [conversation(task, problem.prompt) for problem in adapted.problems]
      images, total, skipped = [()] * len(texts), len(records), f'{adapted.skipped_no_answer} without an answer'
    keep = [index for index, row in enumerate(ids) if 0 < len(row) <= task.max_prompt_tokens]
    if distributed.is_primary():  # every process reads the same records; one says so
      print(f'{section}: {data.source} ({data.split}, format {data.format}): kept {len(keep)} of {total} '
            f'records; skipped {len(ids) - len(keep)} longer than task.max_prompt_tokens={task.max_prompt_tokens}, '
            f'{skipped}', file=sys.stderr, flush=True)
    if ids and not keep:
      raise UserError(f'every prompt of {data.source} is longer than task.max_prompt_tokens='
                      f'{task.max_prompt_tokens} tokens (the shortest has {min(map(len, ids))})')
    self.prompt_ids += [np.asarray(ids[index], np.int32) for index in keep]
    self.answers += [answers[index][0] for index in keep]
    self.data_sources += [answers[index][1] for index in keep]
    self.texts += [texts[index] for index in keep]
    self.conversations += [conversations[index] for index in keep]
    self.images += [images[index] for index in keep]

  def _tokenized(self, texts: list[str]) -> list[list[int]]:
    return tokenize_prompts(self.tokenizer, self.use_chat_template, texts)

  def _render_with_images(self, question: str, counts: list[int], where: str) -> tuple[str, str]:
    """The prompt of a question whose i-th image marker stands for counts[i] image tokens: its text
    with one <|image_pad|> per image (for logs), and the text the model reads."""
    text = _format(self.task_config.prompt_template, question)
    if not self.use_chat_template:
      return expand_image_tokens(text, [1] * len(counts)), expand_image_tokens(text, counts)
    shown = self.render([{'role': 'user', 'content': render_user_content(text)}], 0, where)
    pieces = shown.split(IMAGE_PAD)
    if len(pieces) - 1 != len(counts):
      raise UserError(f"{where}: the tokenizer's chat template renders {len(pieces) - 1} {IMAGE_PAD} for "
                      f'{len(counts)} images (an image part must become {VISION_START}{IMAGE_PAD}{VISION_END})')
    return shown, pieces[0] + ''.join(IMAGE_PAD * count + piece for count, piece in zip(counts, pieces[1:]))

  def __len__(self) -> int:
    return len(self.prompt_ids)

  def render(self, question, index: int = 0, section: str = 'task') -> str:
    return render_prompt(self.tokenizer, self.use_chat_template, self.task_config, question, index, section, self.tools)

  def vision(self, indices, tokens: np.ndarray, mask: np.ndarray) -> Vision | None:
    """The Vision of the problems at `indices`, whose prompts are tokens / mask [len(indices), Tp]
    (left_padded): their images padded to the set's bucket, made on the host's CPU, not on the
    first accelerator (the caller places them, as it places the tokens); None for a set without
    images."""
    if self.bucket is None:
      return None
    return batch_vision([self.images[index] for index in indices], tokens, mask, self.image_inputs, self.bucket)

  def left_padded(self, indices, length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, mask) [len(indices), length] int32 of the problems at `indices`, left-padded."""
    tokens = np.full((len(indices), length), pad_id, np.int32)
    mask = np.zeros((len(indices), length), np.int32)
    for row, index in enumerate(indices):
      ids = self.prompt_ids[index]
      tokens[row, length - len(ids):] = ids
      mask[row, length - len(ids):] = 1
    return tokens, mask


def render_prompt(tokenizer, use_chat_template: bool, task: 'ProblemFields', question, index: int = 0,
                  section: str = 'task', tools=None) -> str:
  """The prompt text of one question (problem `index` of `section`, for messages): the task's
  template, then the chat template for chat models; a question given as chat messages goes
  through the chat template alone. `tools`: function schemas the chat template lists."""
  messages = prompt_messages(use_chat_template, task, question, index, section)
  if isinstance(messages, str):
    return messages
  return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                       **template_options(task, tools))


def prompt_messages(use_chat_template: bool, task: 'ProblemFields', question, index: int = 0,
                    section: str = 'task') -> list[dict] | str:
  """The chat messages a question's prompt renders (render_prompt), or its text without a chat
  template."""
  if not isinstance(question, str):  # already chat messages, as in some RL datasets
    if not use_chat_template:
      raise UserError(f'{section}: record {index} holds chat messages; they need task.chat_template: true and a '
                      'tokenizer with a chat template')
    return list(question)
  text = _format(task.prompt_template, question)
  return [{'role': 'user', 'content': text}] if use_chat_template else text


def template_options(task: 'ProblemFields', tools=None) -> dict:
  """The chat template's keyword arguments of a task: its thinking switch, the tools it lists."""
  options = {} if task.enable_thinking is None else {'enable_thinking': task.enable_thinking}
  if tools:
    options['tools'] = tools
  return options


def tokenize_prompts(tokenizer, use_chat_template: bool, texts: list[str]) -> list[list[int]]:
  """The ids of rendered prompts. A chat template writes the family's BOS or prefix itself (Llama 3's
  <|begin_of_text|>, Gemma's <bos>, Mistral's <s>, GLM-4's [gMASK]<sop>), so its text is tokenized
  with no special tokens added, as transformers' apply_chat_template does; a prompt without a
  template gets them from the tokenizer, as the model saw text in pretraining."""
  return tokenizer(list(texts), add_special_tokens=not use_chat_template)['input_ids'] if texts else []


def open_tokenizer(task: 'ProblemFields', model_path: str | None):
  """(tokenizer, its special ids, whether prompts go through its chat template) of a task that
  reads `task.tokenizer`, else `model_path`; one-line errors for a missing tokenizer or eos token.
  Its stops join the tokenizer's eos with the eos ids of config.json and generation_config.json in
  both directories (a Llama 3 instruct model ends turns on <|eot_id|> and <|eom_id|> too)."""
  where = f'task.tokenizer {task.tokenizer}' if task.tokenizer else f'model.path {model_path}'
  tokenizer = load_tokenizer(task.tokenizer or model_path)
  if tokenizer is None:
    raise UserError(f'{where} has no tokenizer (tokenizer.json or vocab.json)')
  special = special_tokens(tokenizer, checkpoint_eos_ids(model_path, task.tokenizer))
  if special.eos_id is None:
    raise UserError(f'the tokenizer in {where} has no eos token (set eos_token in tokenizer_config.json)')
  if '\0' not in _format(task.prompt_template, '\0'):
    raise UserError(f'task.prompt_template {task.prompt_template!r} has no {{prompt}} for the question')
  return tokenizer, special, task.chat_template and bool(getattr(tokenizer, 'chat_template', None))


class MathTask:
  """Prompts from `task.source`, rewards from the run's terms on the host (a Task). The tokenizer
  is read from `task.tokenizer`, else `model_path`; `seed` (run.seed) orders the prompts; `rewards` (the config's terms;
  empty: the math check alone), `combination` (reward_combination) and `max_new_tokens` (the overlong term's
  budget) shape the reward;
  `tools`: function schemas the chat template shows the model (agents/tool_use.py); `images`: how
  images reach the model (image_inputs), needed by problems with images."""

  jittable = False

  def __init__(self, task: 'ProblemFields', model_path: str, seed: int, rewards: tuple[RewardTerm, ...] = (),
               max_new_tokens: int = 0, problems: bool = True, tools=None, images: ImageInputs | None = None,
               combination: Combination = 'sum'):
    self.tokenizer, special, self.use_chat_template = open_tokenizer(task, model_path)
    self.task_config, self.seed = task, seed
    self.image_inputs = images  # how images reach the model (image_inputs), for problems with images
    self.vocab_size = len(self.tokenizer)
    self.eos_id, self.pad_id, self.stop_token_ids = special.eos_id, special.pad_id, special.stop_ids
    self.prompt_length = task.max_prompt_tokens
    # problems=False: only the tokenizer, rendering and stop ids (evaluation brings its own problems).
    self.problems = (ProblemSet(self.tokenizer, self.use_chat_template, task, (task.dataset, *task.mix), 'task',
                                tools, images) if problems else None)
    self.composer = RewardComposer(rewards or (MathTerm(),), max_new_tokens, task.reward_workers, combination)
    weakref.finalize(self, self.composer.close)  # the workers end with the task, not only at exit
    self._permutations = {}

  @property
  def answers(self) -> list[str]:
    return self.problems.answers

  @property
  def texts(self) -> list[str]:
    return self.problems.texts

  @property
  def num_prompts(self) -> int:
    return len(self.problems)

  @property
  def vision_bucket(self) -> ImageBucket | None:
    """(images per prompt, patches per image) every step's images are padded to; None: text."""
    return None if self.problems is None else self.problems.bucket

  def order(self, position: int, count: int) -> np.ndarray:
    """Dataset indices of prompts position .. position + count - 1 of the run's stream: epoch e
    (= position // dataset size) is a permutation seeded by (run.seed, e)."""
    size = self.num_prompts
    indices = np.empty(count, np.int64)
    for i in range(count):
      epoch, offset = divmod(position + i, size)
      indices[i] = self._permutation(epoch)[offset]
    return indices

  def _permutation(self, epoch: int) -> np.ndarray:
    if epoch not in self._permutations:
      if len(self._permutations) >= 2:  # a batch spans at most the current epoch and the next
        self._permutations.pop(min(self._permutations))
      self._permutations[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.num_prompts)
    return self._permutations[epoch]

  def prompts(self, key: jax.Array, position: int, count: int) -> Prompts:
    """Prompts `position` .. `position + count - 1` of the run, left-padded to prompt_length, with
    their images in the run's bucket when they have some; answers: their References (reference
    answer, question). `key` is unused: the order comes from run.seed and `position`, which
    checkpoints record."""
    del key
    indices = self.order(position, count)
    tokens, mask = self.problems.left_padded(indices, self.prompt_length, self.pad_id)
    return Prompts(tokens=jnp.asarray(tokens), mask=jnp.asarray(mask),
                   answers=[self.reference(index) for index in indices],
                   vision=self.problems.vision(indices, tokens, mask))

  def reference(self, index: int) -> Reference:
    """Problem `index`'s Reference: its answer, its question and its conversation."""
    messages = self.problems.conversations[index]
    return Reference(self.answers[index], question_text(messages), messages)

  # ---- rewards ----

  def decode(self, tokens, mask) -> list[str]:
    """Completion texts of rows tokens [B, N] where mask [B, N]; ids beyond the tokenizer (the
    model's padded vocabulary) and special tokens are dropped."""
    tokens, mask = np.asarray(tokens), np.asarray(mask).astype(bool)
    return [self.tokenizer.decode(row[keep & (row < self.vocab_size)], skip_special_tokens=True)
            for row, keep in zip(tokens, mask)]

  def reward(self, rollout: Rollout, prompts: Prompts, group_size: int, model_scores: dict) -> Scores:
    """Rewards [P * G] (float32): row p * G + g is completion g of prompt p; each term's values
    in `Scores.terms`; model_scores: the step's reward models' scores of the rows, by term label."""
    completions = self.decode(rollout.tokens, rollout.mask)
    references = [reference for reference in prompts.answers for _ in range(group_size)]
    if len(completions) != len(references):
      raise ValueError(f'{len(completions)} completions for {len(prompts.answers)} prompts x {group_size}')
    composed = self.composer.score(completions, [reference.answer for reference in references],
                                   np.asarray(rollout.lengths), np.asarray(rollout.stopped), group_size,
                                   {label: np.asarray(values) for label, values in model_scores.items()})
    return Scores(rewards=jnp.asarray(composed.total, jnp.float32), failures=jnp.asarray(composed.failures, jnp.int32),
                  terms={label: jnp.asarray(values, jnp.float32) for label, values in composed.terms.items()})

  def state_dict(self) -> dict:
    """The reward's running statistics (checkpoints record them; the prompts' order needs only the
    data position)."""
    return dict(rewards=self.composer.state_dict())

  def load_state_dict(self, state: dict) -> None:
    self.composer.load_state_dict(state.get('rewards', {}))

  def close(self) -> None:
    self.composer.close()


def _format(template: str, question) -> str:
  try:
    return template.format(prompt=question)
  except (KeyError, IndexError, ValueError) as error:
    raise UserError(f'task.prompt_template {template!r} is not a format string with only {{prompt}} '
                    f'({type(error).__name__}: {error}); write literal braces doubled, e.g. \\boxed{{{{}}}}') from None


@dataclasses.dataclass(frozen=True)
class MathSection(ProblemFields):
  """The `task` section of `task.name: math`: a dataset's problems, scored on the host."""

  name: Literal['math'] = 'math'
  # Problems with images (format geo3k, verl or vision):
  max_images: int = 1  # images a problem may have (more: the row is bad); the bucket holds the most found
  min_pixels: int | None = None  # smallest resized image area; None: model.path's preprocessor_config.json
  max_pixels: int | None = None  # largest resized image area (bounds the patches); None: as min_pixels
  skip_bad_images: bool = False  # leave out (and count) rows whose images are missing or corrupt; else stop

  def __post_init__(self):
    super().__post_init__()
    with section('task'):
      require(bool(self.dataset.source), 'source', 'must name the problems for task.name=math (a .jsonl/.json/.parquet '
              'file, hf:<name>[:<config>] or tfds:<name>)')
      require(self.max_images >= 1, 'max_images', f'must be >= 1, got {self.max_images}')
      for name, value in (('min_pixels', self.min_pixels), ('max_pixels', self.max_pixels)):
        require(value is None or value >= 1, name, f'must be >= 1, got {value}')
      require(None in (self.min_pixels, self.max_pixels) or self.min_pixels <= self.max_pixels, 'min_pixels',
              f'({self.min_pixels}) must not exceed task.max_pixels ({self.max_pixels})')

  def check_run(self, config) -> None:
    """A math task reads its tokenizer from model.path or task.tokenizer; problems with images need
    a vision-language model."""
    require(bool(config.model.path or self.tokenizer), 'model.path',
            'or task.tokenizer must be set for task.name=math: the tokenizer is read from that directory')
    unreferenced = [data.source for data in (self.dataset, *self.mix) if data.format in UNREFERENCED_FORMATS]
    if unreferenced:  # a dataset of prompts alone is scored by terms that read no reference answer
      checking = next((term for term in config.rewards or (MathTerm(),) if term.needs_reference), None)
      if checking is not None:
        what = f'term {checking.name!r}' if config.rewards else 'default term (math)'
        raise FieldError('rewards', f'cannot score {unreferenced[0]} (format prompts: no reference answers): its '
                         f'{what} checks answers against references; list terms that need none, e.g. '
                         '- {name: reward_model, path: DIR}')
    evaluated = config.eval.dataset
    require(evaluated.source is None or evaluated.format not in UNREFERENCED_FORMATS, 'eval.format',
            f'cannot be prompts: evaluation checks answers against the reference answers of {evaluated.source}')
    data = image_dataset((self.dataset, *self.mix, config.eval.dataset))
    if data is None:
      return
    why = f'format {data.format} of {data.source} has images'
    require(bool(config.model.path) or config.model.architecture.vision is not None, 'model.architecture.vision',
            f'must describe a vision tower: {why}')


def build(config) -> MathTask:
  """The task of a run's Config: its task section, the model's tokenizer, run.seed, the reward
  terms and their combination and, for problems with images, how they reach the model."""
  return MathTask(config.task, config.model.path, config.run.seed, config.rewards, config.rollout.max_new_tokens,
                  images=image_inputs(config), combination=config.reward_combination)


@dataclasses.dataclass(frozen=True)
class MathShape(TaskShape):
  """A math task's shape for the plan: a TaskShape and, for problems with images, the bucket its
  prompts' images are padded to at most (images per prompt, patches per image), or None."""

  vision_bucket: ImageBucket | None = None


def shape(config, architecture) -> MathShape:
  """The task's shape for the plan, without reading its problems: the prompt width, and the special
  ids of its tokenizer when there is one here (else the last id stops and 0 pads: the ids change
  neither the programs' shapes nor their memory). Problems with images get the largest bucket the
  settings allow: task.max_images images of the patches of max_pixels, or of max_prompt_tokens
  image tokens when fewer (a run pads to its data's largest, at most this)."""
  task = config.task
  bucket = None
  if image_dataset((task.dataset, *task.mix)) is not None and architecture.vision is not None:
    bucket = largest_bucket(config, architecture.vision)
  directory = task.tokenizer or config.model.path
  tokenizer = load_tokenizer(directory) if directory and os.path.isdir(directory) else None
  if tokenizer is None:
    return MathShape(task.max_prompt_tokens, architecture.vocab_size, (architecture.vocab_size - 1,), 0, bucket)
  special = special_tokens(tokenizer, checkpoint_eos_ids(config.model.path, task.tokenizer))
  return MathShape(task.max_prompt_tokens, architecture.vocab_size, tuple(special.stop_ids), special.pad_id, bucket)
