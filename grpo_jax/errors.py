"""User-facing errors: one sentence naming the field, file or tensor, and a clean exit."""

import functools
import sys


class UserError(Exception):
  """A mistake the user can fix (config, paths, checkpoints, data).

  CLIs print only its message, never a traceback, and exit with status 2.
  """


def cli_main(main):
  """Wraps a CLI entry point so a `UserError` ends the process with one line on stderr."""

  @functools.wraps(main)
  def wrapper(*args, **kwargs):
    try:
      return main(*args, **kwargs)
    except UserError as error:
      print(f'error: {error}', file=sys.stderr)
      sys.exit(2)

  return wrapper
