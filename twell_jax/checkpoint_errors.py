"""What a failed checkpoint read looks like to the user: one line, not Orbax's noise.

A broken step directory makes Orbax and TensorStore raise deep error chains and print
thousands of lines (abandoned reads' tracebacks, asyncio's complaints). `corrupt_error`
turns a read's exception into a `CheckpointCorruptError` whose message is one line
(the step, its path, what was read and the innermost error), and `QuietReads` holds
back what a restore prints, dropping it when a read failed.
"""

import asyncio
import gc
import io
import logging as py_logging
import sys
import traceback
from pathlib import Path

from absl import logging

# Longest error message kept in a log line (TensorStore's own messages are one line).
_BRIEF_CHARS = 300


class CheckpointCorruptError(ValueError):
    """A checkpoint step could not be read.

    The message is one line: the step, its path, the item and the innermost error's type
    and first line. `details` holds the full error chain as text (no live objects: the
    failed read's coroutines can then be collected at once, see `QuietReads`).
    """

    def __init__(self, message: str, step: int | None = None, details: str = ""):
        super().__init__(message)
        self.step = step
        self.details = details or message


class QuietReads:
    """Holds back what Orbax, TensorStore and asyncio print during a restore; drops it
    if a read failed.

    A failed TensorStore read abandons the other reads of the same restore on a closed
    asyncio loop: their callbacks print "Event loop is closed" tracebacks to sys.stderr,
    the coroutines report "Exception ignored" through sys.unraisablehook when collected,
    and asyncio logs "Task exception was never retrieved", each with the TensorStore spec
    (thousands of lines for one truncated step). Inside the context sys.stderr is a
    buffer, unraisable exceptions are written into it and the asyncio logger's records
    are held. On exit, after a `failed()` call (or a CheckpointCorruptError), the garbage
    is collected inside the context, so the abandoned coroutines report into the buffer,
    and everything held is dropped (counted at debug level); otherwise it is replayed.
    Everything that writes to sys.stderr in these seconds is held too, so no log line
    of the caller's is written inside.
    """

    def __enter__(self) -> "QuietReads":
        self._failed = False
        self._buffer = io.StringIO()
        self._records: list[py_logging.LogRecord] = []
        self._stderr, self._unraisablehook = sys.stderr, sys.unraisablehook
        sys.stderr, sys.unraisablehook = self._buffer, sys.__unraisablehook__
        py_logging.getLogger(asyncio.__name__).addFilter(self._hold)
        return self

    def _hold(self, record: py_logging.LogRecord) -> bool:
        self._records.append(record)
        return False

    def failed(self) -> None:
        """Marks the output held so far and until exit as a failed read's: dropped."""
        self._failed = True

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None and issubclass(exc_type, CheckpointCorruptError):
            self._failed = True
        if self._failed:
            gc.collect()  # the abandoned read coroutines report now, into the buffer
        asyncio_logger = py_logging.getLogger(asyncio.__name__)
        asyncio_logger.removeFilter(self._hold)
        sys.stderr, sys.unraisablehook = self._stderr, self._unraisablehook
        text, records = self._buffer.getvalue(), self._records
        if self._failed:
            logging.debug(
                "dropped %d lines and %d asyncio records of failed checkpoint reads",
                text.count("\n"),
                len(records),
            )
            return
        sys.stderr.write(text)
        for record in records:
            asyncio_logger.handle(record)


def corrupt_error(step: int, path: Path, what: str, e: Exception) -> CheckpointCorruptError:
    message = f"checkpoint step {step} at {path} is unreadable ({what}): {_brief(e)}"
    details = message + "\n\n" + "".join(traceback.format_exception(e))
    return CheckpointCorruptError(message, step, details)


def _brief(e: BaseException) -> str:
    """`Type: first line` of the innermost error of `e`'s chain (TensorStore's own
    message, e.g. "ValueError: OUT_OF_RANGE: Error reading ..."), on one short line."""
    seen = {id(e)}
    while (inner := e.__cause__ or e.__context__) is not None and id(inner) not in seen:
        seen.add(id(inner))
        e = inner
    lines = str(e).strip().splitlines()
    first = lines[0].split(" See full TensorStore details")[0] if lines else ""
    if len(first) > _BRIEF_CHARS:
        first = first[: _BRIEF_CHARS - 3] + "..."
    return f"{type(e).__name__}: {first}"
