"""docs/rollout-paths.md's table of rollout paths by model kind (tests/rollout_matrix.py) is the table
the tests check: every test it names is collected by pytest under that id, and the page holds it as
`rollout_matrix.markdown()` writes it."""

import os
import subprocess
import sys

from rollout_matrix import CELLS, KINDS, PATHS, markdown, named_tests
from runs import ROOT

BEGIN, END = '<!-- rollout matrix: python tests/rollout_matrix.py -->\n', '<!-- end of rollout matrix -->\n'


def test_every_cell_is_in_the_table():
  assert set(CELLS) == {(path, kind) for path in PATHS for kind in KINDS}


def test_the_readme_holds_the_table():
  with open(os.path.join(ROOT, 'docs', 'rollout-paths.md')) as f:
    text = f.read()
  assert BEGIN in text and END in text, 'docs/rollout-paths.md lacks the rollout matrix markers'
  assert text.split(BEGIN, 1)[1].split(END, 1)[0] == markdown(), \
      'docs/rollout-paths.md\'s rollout matrix differs from tests/rollout_matrix.py: paste `python tests/rollout_matrix.py`'


def test_every_named_test_exists():
  """Collected (every tier) under the very id the table names: a renamed test or parameter fails here."""
  ids = named_tests()
  files = sorted({test.split('::')[0] for test in ids})
  result = subprocess.run([sys.executable, '-m', 'pytest', '--collect-only', '-q', '-m', '', '-p', 'no:cacheprovider',
                           *files], cwd=ROOT, capture_output=True, text=True, timeout=300)
  collected = set(result.stdout.split())
  missing = sorted(test for test in ids if test not in collected)
  assert not missing, f'not collected: {missing}\n{result.stdout[-2000:]}{result.stderr[-2000:]}'
