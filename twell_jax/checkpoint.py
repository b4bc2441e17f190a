"""Orbax checkpoints of (train state, data iterator state, config), with safe resume.

Each step directory holds three items: `state` (the train-state pytree, restored with the
shardings of an abstract target), `data` (the grain iterator's JSON state) and `config` (the
run's config dict, JSON). Saving is asynchronous; Orbax writes into a temporary directory and
renames it when complete, so an interrupted save never replaces or loses an earlier step.

On resume, `restore()` compares the saved config with the current one (ignoring fields that
may legitimately change, e.g. total steps) and, if the latest step cannot be read, falls back
to the newest readable one and moves the unreadable directories aside (never deletes them),
logging one line per step moved and writing the full error into the moved directory. What
Orbax and TensorStore print about a failed read is held back and dropped (`_QuietReads`).
"""

import asyncio
import gc
import io
import logging as py_logging
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import jax
import orbax.checkpoint as ocp
from absl import logging

from twell_jax.config_io import config_diff, config_to_dict

# TrainConfig fields that may differ between the saved run and the resumed one (the run
# length and the loop cadence). A key is ignored if its full dotted path (e.g.
# "optim.total_steps") or its last component is listed.
DEFAULT_IGNORE_KEYS = (
    "total_steps",
    "log_every",
    "eval_every",
    "eval_batches",
    "checkpoint_every",
)
CORRUPT_SUFFIX = ".corrupt"
# Written into a moved-aside step directory: the full error of the failed read.
ERROR_FILE = "restore_error.txt"
# Longest error message kept in a log line (TensorStore's own messages are one line).
_BRIEF_CHARS = 300


class CheckpointCorruptError(ValueError):
    """A checkpoint step could not be read.

    The message is one line: the step, its path, the item and the innermost error's type
    and first line. `details` holds the full error chain as text (no live objects: the
    failed read's coroutines can then be collected at once, see `_QuietReads`).
    """

    def __init__(self, message: str, step: int | None = None, details: str = ""):
        super().__init__(message)
        self.step = step
        self.details = details or message


class ConfigMismatchError(ValueError):
    """The saved config differs from the current one; the message lists the keys."""


class _QuietReads:
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

    def __enter__(self) -> "_QuietReads":
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


class Restored(NamedTuple):
    """What `Checkpointer.restore` returns.

    Attributes:
      state: the train-state pytree, laid out like the abstract target.
      data_state: the data iterator state (JSON dict), for `DataIterator.set_state`.
      step: the step restored (older than the latest if the latest was unreadable).
    """

    state: Any
    data_state: dict[str, Any]
    step: int


class Checkpointer:
    """Saves and restores training checkpoints in one directory, keeping the last few."""

    def __init__(
        self, directory: str | os.PathLike, max_to_keep: int | None = 3, async_save: bool = True
    ):
        """Opens (creating if needed) the checkpoint directory.

        Args:
          directory: where step directories live (a local or mounted file system path).
          max_to_keep: keep this many newest steps; None keeps all.
          async_save: return from `save` once arrays are copied off the device and write in
            the background (call `wait()` before reading the files).
        """
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            enable_async_checkpointing=async_save,
            create=True,
            # Leftovers of interrupted saves are never complete checkpoints; drop them.
            cleanup_tmp_directories=True,
        )
        handlers = {
            "state": ocp.StandardCheckpointHandler(),
            "data": ocp.JsonCheckpointHandler(),
            "config": ocp.JsonCheckpointHandler(),
        }
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, item_handlers=handlers
        )

    def save(
        self, step: int, state: Any, data_state: Mapping[str, Any], config: Mapping[str, Any]
    ) -> None:
        """Starts saving one checkpoint (asynchronously unless `async_save=False`).

        Args:
          step: the training step; must be larger than every saved step.
          state: pytree of jax.Arrays (sharded arrays are saved by every process).
          data_state: `DataIterator.get_state()`; must be JSON-serialisable.
          config: the run's config: a JSON-serialisable dict, or a config dataclass.
        """
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                data=ocp.args.JsonSave(dict(data_state)),
                config=ocp.args.JsonSave(config_to_dict(config)),
            ),
            force=True,  # the training loop decides the cadence
        )

    def latest_step(self) -> int | None:
        """Returns the newest completed step, or None if there is none."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """Returns the completed steps, oldest first."""
        return sorted(self._manager.all_steps())

    def saved_config(self, step: int) -> dict[str, Any]:
        """The config dict saved with `step` (without reading the state).

        Raises:
          CheckpointCorruptError: the step's config item is unreadable.
        """
        args = ocp.args.Composite(config=ocp.args.JsonRestore())
        return self._read(step, "config", lambda: self._manager.restore(step, args=args).config)

    def restore(
        self,
        abstract_state: Any,
        step: int | None = None,
        *,
        config: Mapping[str, Any] | None = None,
        ignore_keys: Iterable[str] = DEFAULT_IGNORE_KEYS,
    ) -> Restored:
        """Restores a checkpoint onto the shardings of `abstract_state`.

        Args:
          abstract_state: pytree like the saved state whose leaves are jax.ShapeDtypeStruct
            with `.sharding` (or jax.Arrays, whose sharding is used).
          step: the step to restore; None restores the newest readable step, falling back to
            older ones and renaming unreadable newer step directories to
            `<step>.corrupt-<time>` so training can save those steps again (one warning
            line per step moved; the full error goes to `ERROR_FILE` inside it).
          config: the current config; if given, it must equal the saved one except for
            `ignore_keys`.
          ignore_keys: config keys (dotted paths or last components) allowed to differ.

        Returns:
          A `Restored(state, data_state, step)`.

        Raises:
          FileNotFoundError: there is no checkpoint (or not `step`).
          CheckpointCorruptError: `step` (or, with step=None, every step) is unreadable.
          ConfigMismatchError: (a ValueError) the saved config differs from `config`.
        """
        self.wait()
        abstract_state = jax.tree.map(_abstract, abstract_state)
        steps = self.all_steps()
        if step is not None:
            if step not in steps:
                raise FileNotFoundError(
                    f"no checkpoint for step {step} in {self.directory} (steps: {steps})"
                )
            with _QuietReads():
                return self._restore_checked(step, abstract_state, config, ignore_keys)
        if not steps:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        errors, restored = [], None
        with _QuietReads() as quiet:
            for candidate in reversed(steps):
                try:
                    restored = self._restore_checked(candidate, abstract_state, config, ignore_keys)
                    break
                except CheckpointCorruptError as e:
                    quiet.failed()
                    errors.append(e)
        if restored is not None:
            for bad in errors:
                self._quarantine(bad, restored.step)
            return restored
        # Every step failing suggests the target (e.g. a changed model), not the files, is at
        # fault; keep every step in place.
        raise CheckpointCorruptError(
            f"no step of {self.directory} could be restored (steps {steps}); newest error: "
            f"{errors[0]}"
        ) from errors[0]

    def wait(self) -> None:
        """Blocks until pending asynchronous saves are written (and raises their errors)."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves and releases the manager's resources."""
        self._manager.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _restore_checked(
        self,
        step: int,
        abstract_state: Any,
        config: Mapping[str, Any] | None,
        ignore_keys: Iterable[str],
    ) -> Restored:
        """Restores one step; unreadable files become CheckpointCorruptError."""
        saved_config = self.saved_config(step)
        if config is not None:
            check_config(saved_config, config, ignore_keys, where=f"checkpoint step {step}")
        metadata = self._read(step, "state metadata", lambda: self._manager.item_metadata(step))
        _check_shapes(_shapes(metadata.state), _shapes(abstract_state), step)
        args = ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()
        )
        restored = self._read(step, "state/data", lambda: self._manager.restore(step, args=args))
        return Restored(restored.state, restored.data, step)

    def _read(self, step: int, what: str, read: Callable[[], Any]) -> Any:
        """`read()`, or a CheckpointCorruptError naming the step and `what` was read.

        The error is raised outside the `except` block, so it carries the Orbax error
        only as text (not as its __context__, which would keep the failed read alive).
        """
        try:
            return read()
        except Exception as e:  # Orbax/TensorStore raise many types for broken files
            error = _corrupt(step, self.directory / str(step), what, e)
        raise error

    def _quarantine(self, error: CheckpointCorruptError, restored_step: int) -> None:
        """Renames an unreadable step directory aside so Orbax no longer lists it.

        Logs one line naming the step, the error and where it went, and writes the full
        error into the moved directory. Only process 0 renames (the directory is shared);
        every process reloads its step list.
        """
        src = self.directory / str(error.step)
        dst = src.with_name(f"{error.step}{CORRUPT_SUFFIX}-{int(time.time())}")
        if jax.process_index() == 0 and src.exists():
            src.rename(dst)
            (dst / ERROR_FILE).write_text(error.details)
            logging.warning(
                "%s; moved to %s (full error in %s); using step %d",
                error,
                dst.name,
                ERROR_FILE,
                restored_step,
            )
        self._manager.reload()


def _corrupt(step: int, path: Path, what: str, e: Exception) -> CheckpointCorruptError:
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


def _abstract(leaf: Any) -> Any:
    """jax.Array -> ShapeDtypeStruct with its sharding; ShapeDtypeStructs pass through."""
    if isinstance(leaf, jax.Array):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)
    return leaf


def _shapes(tree: Any) -> dict[tuple[str, ...], tuple[int, ...]]:
    """Leaf shapes by path, with path keys as strings so dicts and attributes compare equal."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return {
        tuple(_key_name(k) for k in path): tuple(getattr(leaf, "shape", ()))
        for path, leaf in leaves
    }


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _check_shapes(saved: dict, target: dict, step: int) -> None:
    """Raises ValueError for leaves in both trees whose shapes differ (a changed model).

    Structural differences are left to Orbax, which reports them on restore.
    """
    diff = [
        f"  {'/'.join(k)}: saved {saved[k]}, target {target[k]}"
        for k in sorted(saved.keys() & target.keys())
        if saved[k] != target[k]
    ]
    if diff:
        raise ValueError(
            f"checkpoint step {step} has {len(diff)} array(s) shaped unlike the restore "
            "target:\n" + "\n".join(diff)
        )


def check_config(
    saved: Mapping[str, Any],
    current: Mapping[str, Any],
    ignore_keys: Iterable[str] = DEFAULT_IGNORE_KEYS,
    where: str = "checkpoint",
) -> None:
    """Raises if two (nested) config dicts differ outside `ignore_keys`.

    Raises:
      ConfigMismatchError: (a ValueError) listing each differing dotted key with its
        saved and current value.
    """
    diff = config_diff(saved, current, ignore_keys)
    if diff:
        lines = "\n".join(f"  {k}: saved {a!r}, current {b!r}" for k, (a, b) in diff.items())
        raise ConfigMismatchError(
            f"config differs from {where} in {len(diff)} key(s):\n{lines}\n"
            "use the saved config, a new checkpoint dir, or extend ignore_keys"
        )
