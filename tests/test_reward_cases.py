"""math_reward case by case, each expectation the judgement a math RL reward should make (not what
the code happens to return), and one real RewardPool fed hostile completions: towers of exponents,
deep nesting, megabyte answers, invalid unicode and code-injection strings."""

import os
import random
import time

import pytest

from grpo_jax.data import rewards

# An equal pair scores 1.0, a different pair 0.0; `pytest.param(completion, reference, expected, id)`.
CASES = [
    # A reasoning model's thinking block: only what follows it is the answer.
    pytest.param('<think>try \\boxed{3}, no</think>So \\boxed{4}', '4', 1.0, id='after-thinking'),
    pytest.param('<think>try \\boxed{4}</think>So \\boxed{3}', '4', 0.0, id='draft-in-thinking-is-not-the-answer'),
    pytest.param('<think>it is \\boxed{4} but I ran out of tokens', '4', 0.0, id='thinking-never-closed'),
    pytest.param('<think></think>\n\nThe answer is 4.', '4', 1.0, id='empty-thinking-plain-answer'),
    # Fractions and decimals, both directions.
    pytest.param('\\boxed{\\frac{1}{2}}', '0.5', 1.0, id='frac-vs-decimal'),
    pytest.param('so it is \\boxed{0.5}', '\\frac{1}{2}', 1.0, id='decimal-vs-frac'),
    pytest.param('\\boxed{\\dfrac{3}{4}}', '0.75', 1.0, id='dfrac'),
    pytest.param('\\boxed{\\tfrac{3}{4}}', '\\frac34', 1.0, id='tfrac'),
    pytest.param('\\boxed{\\frac{3}{4}}', '0.7', 0.0, id='frac-wrong'),
    # An approximation is not the exact answer, whichever side is rounded.
    pytest.param('\\boxed{0.33}', '\\frac{1}{3}', 0.0, id='rounded-decimal-vs-frac'),
    pytest.param('\\boxed{\\frac{1}{3}}', '0.33', 0.0, id='frac-vs-rounded-reference'),
    # Equations: the value is compared.
    pytest.param('\\boxed{x = 3}', '3', 1.0, id='boxed-equation-vs-value'),
    pytest.param('\\boxed{3}', 'x = 3', 1.0, id='value-vs-equation'),
    pytest.param('\\boxed{x=3}', 'x=3', 1.0, id='equation-vs-equation'),
    pytest.param('\\boxed{x = 4}', '3', 0.0, id='equation-wrong'),
    # Intervals: the ends and their brackets both matter.
    pytest.param('\\boxed{(1, 2]}', '(1,2]', 1.0, id='interval'),
    pytest.param('\\boxed{[1,2]}', '(1,2]', 0.0, id='interval-closed-vs-half-open'),
    pytest.param('\\boxed{(1,2)}', '(1,2]', 0.0, id='interval-open-vs-half-open'),
    pytest.param('\\boxed{\\left[ 1, 2 \\right)}', '[1,2)', 1.0, id='interval-left-right'),
    pytest.param('\\boxed{(-\\infty, 3)}', '(-\\infty,3)', 1.0, id='interval-infinite'),
    # Ordered pairs keep their order; sets and lists of solutions do not.
    pytest.param('\\boxed{(3, -1)}', '(3,-1)', 1.0, id='pair'),
    pytest.param('\\boxed{(-1, 3)}', '(3,-1)', 0.0, id='pair-swapped'),
    pytest.param('\\boxed{\\left( \\frac{1}{2}, 3 \\right)}', '(0.5, 3)', 1.0, id='pair-left-right'),
    pytest.param('\\boxed{\\{1, 2, 3\\}}', '\\{3, 2, 1\\}', 1.0, id='set-reordered'),
    pytest.param('\\boxed{\\left\\{ 1, 2 \\right\\}}', '\\{1,2\\}', 1.0, id='set-left-right'),
    pytest.param('\\boxed{\\{1, 2\\}}', '\\{1, 2, 3\\}', 0.0, id='set-missing-element'),
    pytest.param('\\boxed{3, 2}', '2,3', 1.0, id='solutions-reordered'),
    # Thousands separators: GSM8K references drop them, completions and MATH references keep them.
    pytest.param('\\boxed{1,234}', '1234', 1.0, id='thousands-comma'),
    pytest.param('\\boxed{1{,}234}', '1234', 1.0, id='thousands-braced-comma'),
    pytest.param('\\boxed{10,\\!000}', '10000', 1.0, id='thousands-math-style'),
    pytest.param('\\boxed{1,234,567}', '1234567', 1.0, id='thousands-two-groups'),
    pytest.param('\\boxed{1234}', '1,234', 1.0, id='thousands-in-reference'),
    pytest.param('The answer is 1,234.', '1234', 1.0, id='thousands-plain-text'),
    pytest.param('\\boxed{1\\,234}', '1234', 1.0, id='thousands-thin-space'),
    pytest.param('\\boxed{12\\,345\\,678}', '12345678', 1.0, id='thousands-thin-spaces'),
    pytest.param('\\boxed{1 234}', '1234', 1.0, id='thousands-space'),
    # Read as a mixed number or a product, grouped digits made wrong answers right.
    pytest.param('\\boxed{10\\,000}', '0', 0.0, id='thousands-thin-space-not-a-product'),
    pytest.param('\\boxed{1\\,234}', '235', 0.0, id='thousands-thin-space-not-a-sum'),
    pytest.param('\\boxed{12,34}', '1234', 0.0, id='not-a-thousands-grouping'),
    pytest.param('\\boxed{1,235}', '1234', 0.0, id='thousands-wrong'),
    # Units and currency around the number.
    pytest.param('\\boxed{5\\text{ cm}}', '5', 1.0, id='unit-text'),
    pytest.param('\\boxed{5\\,\\text{cm}}', '5', 1.0, id='unit-thin-space'),
    pytest.param('The answer is 5 dollars.', '5', 1.0, id='unit-plain-text'),
    pytest.param('\\boxed{\\$5}', '5', 1.0, id='currency-in-completion'),
    pytest.param('\\boxed{18.90}', '\\$18.90', 1.0, id='currency-in-reference'),
    pytest.param('\\boxed{\\$1\\,000}', '1000', 1.0, id='currency-thin-space'),
    pytest.param('\\boxed{19}', '\\$18.90', 0.0, id='currency-wrong'),
    pytest.param('\\boxed{6\\text{ cm}}', '5', 0.0, id='unit-wrong'),
    # Percent and degrees.
    pytest.param('\\boxed{50\\%}', '50', 1.0, id='percent-vs-number'),
    pytest.param('\\boxed{50}', '50\\%', 1.0, id='number-vs-percent'),
    pytest.param('\\boxed{0.5}', '50\\%', 1.0, id='fraction-vs-percent'),
    pytest.param('\\boxed{60\\%}', '50', 0.0, id='percent-wrong'),
    pytest.param('\\boxed{30^\\circ}', '30', 1.0, id='degrees-vs-number'),
    pytest.param('\\boxed{30}', '30^\\circ', 1.0, id='number-vs-degrees'),
    pytest.param('\\boxed{31^\\circ}', '30', 0.0, id='degrees-wrong'),
    # Radicals and pi: equal forms are equal, approximations are not.
    pytest.param('\\boxed{2\\sqrt{2}}', '\\sqrt{8}', 1.0, id='sqrt-simplified'),
    pytest.param('\\boxed{\\frac{1}{\\sqrt{2}}}', '\\frac{\\sqrt{2}}{2}', 1.0, id='sqrt-rationalized'),
    pytest.param('\\boxed{3\\sqrt{2}}', '\\sqrt{8}', 0.0, id='sqrt-wrong'),
    pytest.param('\\boxed{2\\pi}', '2\\pi', 1.0, id='pi'),
    pytest.param('\\boxed{6.28}', '2\\pi', 0.0, id='pi-approximated'),
    pytest.param('\\boxed{\\frac{22}{7}}', '\\pi', 0.0, id='pi-as-22-7'),
    # Signs.
    pytest.param('\\boxed{-5}', '-5', 1.0, id='negative'),
    pytest.param('\\boxed{5}', '-5', 0.0, id='negative-sign-lost'),
    pytest.param('\\boxed{-\\frac{1}{2}}', '-0.5', 1.0, id='negative-fraction'),
    pytest.param('\\boxed{-0.75}', '\\frac{3}{4}', 0.0, id='negative-vs-positive'),
    # Which answer counts: the last complete box, whatever prose follows it.
    pytest.param('first \\boxed{3}, no: \\boxed{4}', '4', 1.0, id='last-box-counts'),
    pytest.param('\\boxed{4}. Check: 4 + 1 = 5, so the total is 5.', '4', 1.0, id='box-then-text'),
    pytest.param('\\boxed{4}. Hmm, maybe it is 5.', '5', 0.0, id='box-then-other-answer-in-text'),
    pytest.param('The final answer is $\\boxed{12}$. I hope it is correct.', '12', 1.0, id='box-in-dollars'),
    pytest.param('\\fbox{5}', '5', 1.0, id='fbox'),
    # No answer, or only a plain-text one.
    pytest.param('The answer is 7.', '7', 1.0, id='plain-text-answer'),
    pytest.param('The answer is 8.', '7', 0.0, id='plain-text-wrong'),
    pytest.param('I cannot solve this.', '7', 0.0, id='no-number'),
    pytest.param('', '7', 0.0, id='empty-completion'),
    pytest.param('\\boxed{}', '0', 0.0, id='empty-box-is-not-zero'),
    # Matrices.
    pytest.param('\\boxed{\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}}',
                 '\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}', 1.0, id='matrix'),
    pytest.param('\\boxed{\\begin{bmatrix} 1 & 2 \\\\ 3 & 4 \\end{bmatrix}}',
                 '\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}', 1.0, id='matrix-bracket-style'),
    pytest.param('\\boxed{\\begin{pmatrix} 100 & 200 \\\\ 300 & 400 \\end{pmatrix}}',
                 '\\begin{pmatrix} 100 & 200 \\\\ 300 & 401 \\end{pmatrix}', 0.0, id='matrix-wrong-entry'),
    # Multiple-choice and symbolic text answers.
    pytest.param('\\boxed{\\text{(B)}}', '\\text{(B)}', 1.0, id='choice-text'),
    pytest.param('\\boxed{B}', '\\text{(B)}', 1.0, id='choice-letter'),
    pytest.param('\\boxed{\\text{(C)}}', '\\text{(B)}', 0.0, id='choice-wrong'),
    pytest.param('The answer is (B).', 'B', 1.0, id='choice-plain-text', marks=pytest.mark.xfail(
        strict=True, reason="math-verify's default extraction reads only numbers and LaTeX from prose; its "
        "StringExtractionConfig does not match '(B)', and added to the defaults it outranks numbers in prose")),
    pytest.param('\\boxed{\\varnothing}', '\\emptyset', 1.0, id='empty-set-notations', marks=pytest.mark.xfail(
        strict=True, reason="latex2sympy2_extended 1.11 parses \\emptyset and \\{\\} as EmptySet but "
        "\\varnothing as a free symbol named varnothing")),
]


@pytest.mark.parametrize('completion, reference, expected', CASES)
def test_math_reward_cases(completion, reference, expected):
  assert rewards.math_reward(completion, reference) == expected


# ---- hostile completions through a real pool ----

WORKERS = 2
# Under math-verify's own 3 s alarm (rewards.VERIFY_TIMEOUT_S), so checks that never end meet the
# pool's deadline, not the alarm: the kill-and-replace path runs on real inputs.
TIMEOUT_S = 2.0
NO_SUCH_ANSWER = '\\frac{7}{13}'  # appears in no hostile string (nor in a tmp_path), as text or value


def latex_junk(size: int, seed: int, tokens: list[str]) -> str:
  """`size` characters of random LaTeX-like tokens: the same text on every run."""
  generator, pieces, length = random.Random(seed), [], 0
  while length < size:
    pieces.append(generator.choice(tokens))
    length += len(pieces[-1])
  return ''.join(pieces)


# No digits, so no number or value can appear by chance; unbalanced braces and boxes on purpose.
JUNK_TOKENS = ['\\frac{', '}', '{', '\\sqrt', '^', '_', 'x', 'y', '\\left(', '\\right)', '+', '-', '$', '\\\\', '&',
               '\\begin{pmatrix}', '\\end{pmatrix}', ' ', '\\cdot', '=', '\\text{', ':', '(', ')', '[', ']', '\n']
HOSTILE_TOKENS = JUNK_TOKENS + ['\\boxed{', 'answer', '\\fbox{', '$$', '\\[', '\\]']


def hostile_items(marker: str) -> list[tuple[str, str, str, float]]:
  """(id, completion, reference, reward it deserves); `marker` is a file that executed code would create."""
  return [
      ('tower-9', '\\boxed{9^{9^{9^{9}}}}', '1', 0.0),
      ('tower-10', '\\boxed{10^{10^{10^{10}}}}', '1', 0.0),
      ('frac-5000-open', '\\boxed{' + '\\frac{' * 5_000, '1', 0.0),
      # 1/(1/(...(1/2))) 5,000 deep equals 2: the reference 3 is wrong whether or not it is parsed.
      ('frac-5000', '\\boxed{' + '\\frac{1}{' * 5_000 + '2' + '}' * 5_000 + '}', '3', 0.0),
      ('parentheses-50000', '\\boxed{' + '(' * 50_000 + '1' + ')' * 50_000 + '}', '2', 0.0),
      ('parentheses-50000-plain', 'answer: 1+' + '(' * 50_000 + '1' + ')' * 50_000, '3', 0.0),
      ('braces-100000', '\\boxed{' + '{' * 100_000 + '1' + '}' * 100_000 + '}', '2', 0.0),
      ('braces-100000-open', '{' * 100_000 + '1', '2', 0.0),
      ('megabyte-number', '\\boxed{' + '1' * 1_000_000 + '}', '1', 0.0),
      ('megabyte-plain-number', '1' * 1_000_000, '1', 0.0),
      ('megabyte-latex', latex_junk(1_000_000, 0, HOSTILE_TOKENS), '7', 0.0),
      ('lone-surrogate', '\\boxed{\ud800}', '1', 0.0),
      ('nul-bytes', '\x00' * 1_000 + '\\boxed{\x00}', '1', 0.0),
      ('import-system', f"__import__('os').system('touch {marker}')", NO_SUCH_ANSWER, 0.0),
      ('import-system-boxed', f"\\boxed{{__import__('os').system('touch {marker}')}}", NO_SUCH_ANSWER, 0.0),
      ('eval-open-boxed', f"\\boxed{{eval(\"open('{marker}','w')\")}}", NO_SUCH_ANSWER, 0.0),
      ('template-dollar', '${{7*7}}', NO_SUCH_ANSWER, 0.0),
      ('template', '{{7*7}}', NO_SUCH_ANSWER, 0.0),
      ('backticks', f'`touch {marker}`', NO_SUCH_ANSWER, 0.0),
      ('subshell', f'$(touch {marker})', NO_SUCH_ANSWER, 0.0),
      ('tex-input', '\\boxed{\\input{/etc/passwd}}', NO_SUCH_ANSWER, 0.0),
      ('tex-include', '\\include{/etc/passwd} \\boxed{\\include{/etc/passwd}}', NO_SUCH_ANSWER, 0.0),
      ('tex-write18', f'\\immediate\\write18{{touch {marker}}} \\boxed{{\\write18{{touch {marker}}}}}',
       NO_SUCH_ANSWER, 0.0),
      # Right answers in hostile surroundings are still right.
      ('surrogates-around-answer', '\udcff\ud800 so \\boxed{42} \udfff', '42', 1.0),
      ('megabyte-junk-then-box', latex_junk(1_000_000, 1, HOSTILE_TOKENS) + ' so \\boxed{42}', '42', 1.0),
      ('half-megabyte-junk-then-text', latex_junk(500_000, 2, JUNK_TOKENS) + '\n\nThe answer is 42.', '42', 1.0),
  ]


@pytest.fixture(scope='module')
def pool_and_startup_s():
  """A pool shared by the module, and how long its workers took to start (the cost of a replacement)."""
  start = time.monotonic()
  with rewards.RewardPool(WORKERS, timeout_s=TIMEOUT_S) as pool:
    assert pool.map(['\\boxed{1}', '\\boxed{2}'], ['1', '1']) == [1.0, 0.0]
    yield pool, time.monotonic() - start


def test_hostile_completions_score_zero_within_the_deadline(pool_and_startup_s, tmp_path):
  pool, startup_s = pool_and_startup_s
  items = hostile_items(str(tmp_path / 'MARKER'))
  ids, completions, references, expected = (list(column) for column in zip(*items))
  with pytest.raises(UnicodeEncodeError):  # the surrogate items really are invalid text
    completions[ids.index('lone-surrogate')].encode('utf-8')
  failures_before = pool.failures
  start = time.monotonic()
  got = pool.map(completions, references)
  elapsed = time.monotonic() - start
  failures = pool.failures - failures_before

  assert dict(zip(ids, got)) == dict(zip(ids, expected))
  assert os.listdir(tmp_path) == []  # no command ran, no file was opened for writing
  # A check is stopped (and counted) only past the deadline, and then scores 0.0. The towers would
  # compute numbers of 10^8 digits and more: they always reach it.
  assert 2 <= failures <= got.count(0.0)
  # Each item holds a worker for at most the deadline, and each failure adds one restart; spawning
  # is slower on a busy machine than it was for the warm-up, hence the margins.
  restart_s = 3 * startup_s + 5.0
  bound_s = (len(items) * TIMEOUT_S + failures * restart_s) / WORKERS + TIMEOUT_S + restart_s + 10.0
  assert TIMEOUT_S <= elapsed < bound_s, f'{elapsed:.1f} s for {len(items)} items, {failures} past the deadline'

  # The replaced workers score ordinary answers, and nothing new counts as a failure.
  ordinary = ['\\boxed{\\frac{1}{2}}', '\\boxed{3}', 'The answer is 12.']
  assert pool.map(ordinary, ['0.5', '4', '12']) == [1.0, 0.0, 1.0]
  assert pool.failures - failures_before == failures
