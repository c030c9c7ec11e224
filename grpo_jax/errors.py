"""User-facing errors: one sentence naming the field, file or tensor, and a clean exit."""

import contextlib
import functools
import logging
import os
import sys
import threading


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


def read_text(path: str, what: str) -> str:
  """The UTF-8 text of the file at `path`; a UserError naming it (as `what`, e.g. 'config file')
  when it is not UTF-8 or cannot be read."""
  try:
    with open(path, encoding='utf-8') as f:
      return f.read()
  except UnicodeDecodeError as error:
    raise UserError(f'{what} {path} is not UTF-8 text (byte {error.start}: {error.reason})') from None
  except OSError as error:
    raise UserError(f'{what} {path} cannot be read: {error.strerror or error}') from None


def read_json_object(path: str, what: str, fields: str) -> dict:
  """The JSON object in the file at `path` (read_text's errors, `what` naming it); a UserError when
  it is not JSON or not an object (of `fields`, e.g. 'config fields')."""
  import json
  try:
    value = json.loads(read_text(path, what))
  except json.JSONDecodeError as error:
    raise UserError(f'{path} is not valid JSON ({error.msg} at line {error.lineno})') from None
  if not isinstance(value, dict):
    raise UserError(f'{path} must hold a JSON object of {fields}, got a {type(value).__name__}')
  return value


def root_cause(error: BaseException) -> str:
  """The first line of the innermost exception `error` was raised from (TensorStore and orbax wrap
  the message that names the damaged file in several layers of bare exceptions)."""
  while error.__cause__ is not None:
    error = error.__cause__
  text = str(error).strip()
  return text.splitlines()[0] if text else type(error).__name__


def _loop_closed(value) -> bool:
  return isinstance(value, RuntimeError) and 'Event loop is closed' in str(value)


@contextlib.contextmanager
def checkpoint_read():
  """Around a checkpoint read: when a read fails, TensorStore's callback threads can still post to
  the read's event loop after orbax closed it, and report 'Event loop is closed' (as an unraisable
  exception, or through a thread's or sys's excepthook) before the failure itself reaches the
  caller. Those, and only those, are dropped while the read runs; after a failure,
  quiet_abandoned_reads takes over."""
  hooks = (sys.unraisablehook, threading.excepthook, sys.excepthook)

  def unraisable(info):
    if not _loop_closed(info.exc_value):
      hooks[0](info)

  def thread(args):
    if not _loop_closed(args.exc_value):
      hooks[1](args)

  def report(kind, value, traceback):
    if not _loop_closed(value):
      hooks[2](kind, value, traceback)

  sys.unraisablehook, threading.excepthook, sys.excepthook = unraisable, thread, report
  try:
    yield
  finally:
    if (sys.unraisablehook, threading.excepthook, sys.excepthook) == (unraisable, thread, report):
      sys.unraisablehook, threading.excepthook, sys.excepthook = hooks


def quiet_abandoned_reads() -> None:
  """After a checkpoint read failed (and was reported as one UserError), drops what orbax's and
  TensorStore's abandoned concurrent reads print later: the exceptions of read coroutines that are
  garbage-collected unawaited ('Exception ignored in: <coroutine ...>'), asyncio's 'Task (or
  Future) exception was never retrieved', and 'Event loop is closed' from TensorStore's callback threads (through
  threading's or sys's excepthook). Anything else still reaches the previous hooks."""
  def from_checkpoint_io(exc_value, obj=None) -> bool:
    code = getattr(obj, 'cr_code', None)
    if code is not None and ('orbax' in code.co_filename or 'tensorstore' in code.co_filename):
      return True
    text = str(exc_value)
    return 'Encountered error while reading array index' in text or 'Event loop is closed' in text

  previous_unraisable = sys.unraisablehook
  previous_thread = threading.excepthook

  def unraisable(info):
    if not from_checkpoint_io(info.exc_value, info.object):
      previous_unraisable(info)

  def thread(args):
    if not from_checkpoint_io(args.exc_value):
      previous_thread(args)

  class _Filter(logging.Filter):
    def filter(self, record):
      error = record.exc_info[1] if record.exc_info else None
      return not (record.getMessage().startswith(('Task exception was never retrieved',
                                                  'Future exception was never retrieved'))
                  or (error is not None and from_checkpoint_io(error)))

  previous_except = sys.excepthook

  def report(kind, value, traceback):
    if not _loop_closed(value):
      previous_except(kind, value, traceback)

  sys.unraisablehook = unraisable
  threading.excepthook = thread
  sys.excepthook = report
  logging.getLogger('asyncio').addFilter(_Filter())


@contextlib.contextmanager
def quiet_native_stderr():
  """Silences file descriptor 2 while TensorFlow's native libraries load: they log cuInit and
  oneDNN notices before TF_CPP_MIN_LOG_LEVEL takes effect. Python exceptions are unaffected."""
  sys.stderr.flush()
  saved = os.dup(2)
  with open(os.devnull, 'w') as devnull:
    os.dup2(devnull.fileno(), 2)
  try:
    yield
  finally:
    os.dup2(saved, 2)
    os.close(saved)
