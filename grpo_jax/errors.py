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


class FieldError(UserError, ValueError):
  """A bad value of one named field; whoever knows where the field lives (a config section, a
  command-line flag) renames it with `renamed`, so the message names it as the user wrote it."""

  def __init__(self, field: str, message: str):
    super().__init__(f'{field} {message}')
    self.field, self.message = field, message

  def renamed(self, field: str) -> 'FieldError':
    return FieldError(field, self.message)


def require(condition: bool, field: str, message: str) -> None:
  """Raises FieldError(field, message) unless condition holds."""
  if not condition:
    raise FieldError(field, message)
