"""What every entry point of `experiments` shares: its first step (`start_cli`: the
log filter, and positional arguments refused in one line), the check of an output
file's path and the command line its result records (`command_line`). Flag-free and
light (no JAX import), so any CLI can import it.
"""

from __future__ import annotations

import logging as py_logging
import os
import sys
from pathlib import Path

from absl import logging

# The exit status of every entry point that refuses its flags or inputs in one line.
EXIT_REFUSED = 2


def keep_log_record(record: py_logging.LogRecord) -> bool:
    """The entry points' absl handler filter: every warning and error, and the INFO
    records but Orbax's (dozens per save or restore) and JAX's notes on the backends it
    could not start ("Unable to initialize backend 'tpu'" opens every CPU run; the mesh
    line names the backend in use).

    Orbax logs through absl like the entry points, so a level on its own logger is not
    enough.
    """
    if record.levelno >= py_logging.WARNING:
        return True
    if "/orbax/" in record.pathname:
        return False
    return not record.getMessage().startswith("Unable to initialize backend")


def command_line(module: str) -> str:
    """The command a result records: `python -m <module>` and this process's arguments."""
    return " ".join([f"python -m {module}", *sys.argv[1:]])


def check_output_file(flag: str, path: str | None) -> None:
    """Refuses `--flag=path` up front when the file could not be written once the work
    is done: a directory, or a parent directory that is missing or not writable.

    Raises:
      FileNotFoundError, ValueError: naming the flag.
    """
    if not path:
        return
    out = Path(path)
    if out.is_dir():
        raise ValueError(f"--{flag}={out}: is a directory")
    if not out.parent.is_dir():
        raise FileNotFoundError(f"--{flag}={out}: no directory {out.parent}")
    if not os.access(out.parent, os.W_OK):
        raise ValueError(f"--{flag}={out}: cannot write in {out.parent}")


def start_cli(argv: list[str]) -> bool:
    """What an entry point's main does first: the log filter (`keep_log_record`) on
    absl's handler, and a one-line refusal of positional arguments (a stray word, or a
    value after a boolean flag, `--resume no`) instead of absl's usage text. Returns
    False when refused."""
    logging.get_absl_handler().addFilter(keep_log_record)
    if len(argv) > 1:
        logging.error("refused: unexpected arguments %s (flags take --name=value)", argv[1:])
        return False
    return True
