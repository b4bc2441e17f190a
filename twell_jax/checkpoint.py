"""Orbax checkpoints of (train state, data iterator state, config), with safe resume.

Each step directory holds three items: `state` (the train-state pytree, restored with the
shardings of an abstract target), `data` (the grain iterator's JSON state) and `config` (the
run's config dict, JSON). Saving is asynchronous; Orbax writes into a temporary directory and
renames it when complete, so an interrupted save never replaces or loses an earlier step.

On resume, `restore()` compares the saved config with the current one (ignoring fields that
may legitimately change, e.g. total steps) and, if the latest step cannot be read, falls back
to the newest readable one and moves the unreadable directories aside (never deletes them),
logging one line per step moved and writing the full error into the moved directory. What
Orbax and TensorStore print about a failed read is held back and dropped (`QuietReads`).

A reader of a run's checkpoints (generation, export, a benchmark), possibly beside the run
still training, opens the directory `read_only`: nothing is created, moved or deleted
(a writer's manager deletes the temporary directory of a save in progress as a
leftover), and `restore_params` reads the parameters alone, from the newest step whose
parameters are readable.
"""

import os
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import jax
import orbax.checkpoint as ocp
from absl import logging

from twell_jax.checkpoint_errors import CheckpointCorruptError, QuietReads, corrupt_error
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


class ConfigMismatchError(ValueError):
    """The saved config differs from the current one; the message lists the keys."""


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
        self,
        directory: str | os.PathLike,
        max_to_keep: int | None = 3,
        async_save: bool = True,
        *,
        read_only: bool = False,
    ):
        """Opens (creating if needed) the checkpoint directory.

        Args:
          directory: where step directories live (a local or mounted file system path).
          max_to_keep: keep this many newest steps; None keeps all.
          async_save: return from `save` once arrays are copied off the device and write in
            the background (call `wait()` before reading the files).
          read_only: open an existing directory to read it, possibly beside a run that
            is still saving into it: nothing is created, renamed or deleted (a save in
            progress writes into a temporary directory that a writer's manager would
            delete as a leftover), and `restore` skips unreadable steps in place.

        Raises:
          FileNotFoundError: read_only and `directory` does not exist.
        """
        self.directory = Path(directory).absolute()
        self.read_only = read_only
        if read_only and not self.directory.is_dir():
            raise FileNotFoundError(f"{self.directory}: no checkpoint directory")
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None if read_only else max_to_keep,
            save_interval_steps=0 if read_only else 1,
            enable_async_checkpointing=async_save and not read_only,
            create=not read_only,
            # Leftovers of interrupted saves are never complete checkpoints; drop them.
            cleanup_tmp_directories=not read_only,
            read_only=read_only,
        )
        handlers = {
            # A reader restores parts of the state (`restore_params`), which only the
            # PyTree handler does; both read the same files.
            "state": ocp.PyTreeCheckpointHandler()
            if read_only
            else ocp.StandardCheckpointHandler(),
            "data": ocp.JsonCheckpointHandler(),
            "config": ocp.JsonCheckpointHandler(),
        }
        # Orbax warns that a read_only manager's directory is read only: what was asked.
        quiet = lambda record: not record.getMessage().startswith("Given directory is read only")
        logging.get_absl_logger().addFilter(quiet)
        try:
            self._manager = ocp.CheckpointManager(
                self.directory, options=options, item_handlers=handlers
            )
        finally:
            logging.get_absl_logger().removeFilter(quiet)

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

        def read(candidate: int) -> Restored:
            return self._restore_checked(candidate, abstract_state, config, ignore_keys)

        return self._newest_readable(read, step)

    def restore_params(self, abstract_params: Any, step: int | None = None) -> Restored:
        """Restores only the train state's `params` (a reader's load: generation, export),
        without the optimizer state's reads and memory.

        Args:
          abstract_params: pytree like the saved params, leaves jax.ShapeDtypeStruct with
            `.sharding` (or jax.Arrays); or a function of the step that returns one (say,
            built from that step's `saved_config`, whose errors count as the step's).
          step: as in `restore`; None takes the newest readable step.

        Returns:
          Restored(state={"params": params}, data_state={}, step).

        Raises:
          ValueError: the Checkpointer is not read_only (the writer's handler restores
            whole states only).
          FileNotFoundError, CheckpointCorruptError: as `restore`.
        """
        if not self.read_only:
            raise ValueError("restore_params needs a read_only Checkpointer")

        def read(candidate: int) -> Restored:
            params = abstract_params(candidate) if callable(abstract_params) else abstract_params
            target = {"params": jax.tree.map(_abstract, params)}
            args = ocp.args.Composite(state=self._state_args(target, partial=True))
            restored = self._restore_shaped(candidate, target, "params", args)
            return Restored(restored.state, {}, candidate)

        return self._newest_readable(read, step)

    def _newest_readable(self, read: Callable[[int], Restored], step: int | None) -> Restored:
        """read(step), or with step None read(newest readable step): unreadable newer steps
        are moved aside (`_quarantine`), or only skipped when read_only."""
        steps = self.all_steps()
        if step is not None:
            if step not in steps:
                raise FileNotFoundError(
                    f"no checkpoint for step {step} in {self.directory} (steps: {steps})"
                )
            with QuietReads():
                return read(step)
        if not steps:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        errors, restored = [], None
        with QuietReads() as quiet:
            for candidate in reversed(steps):
                try:
                    restored = read(candidate)
                    break
                except CheckpointCorruptError as e:
                    quiet.failed()
                    errors.append(e)
        if restored is not None:
            for bad in errors:
                if self.read_only:
                    logging.warning("%s; using step %d", bad, restored.step)
                else:
                    self._quarantine(bad, restored.step)
            return restored
        # Every step failing suggests the target (e.g. a changed model), not the files, is at
        # fault; keep every step in place.
        raise CheckpointCorruptError(
            f"no step of {self.directory} could be restored (steps {steps}); newest error: "
            f"{errors[0]}"
        ) from errors[0]

    def _state_args(self, target: Any, partial: bool = False):
        """Restore args of the `state` item onto `target`'s shardings (the handler's kind:
        `__init__`)."""
        if not self.read_only:
            return ocp.args.StandardRestore(target)
        restore_args = jax.tree.map(lambda a: ocp.ArrayRestoreArgs(sharding=a.sharding), target)
        return ocp.args.PyTreeRestore(
            item=target, restore_args=restore_args, partial_restore=partial
        )

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
        args = ocp.args.Composite(
            state=self._state_args(abstract_state), data=ocp.args.JsonRestore()
        )
        restored = self._restore_shaped(step, abstract_state, "state/data", args)
        return Restored(restored.state, restored.data, step)

    def _restore_shaped(self, step: int, target: Any, what: str, args: ocp.args.Composite):
        """`args`' items of `step`, once its state's array shapes are checked against
        `target`'s (a changed model is a ValueError, not a corrupt step)."""
        metadata = self._read(step, "state metadata", lambda: self._manager.item_metadata(step))
        _check_shapes(_shapes(metadata.state), _shapes(target), step)
        return self._read(step, what, lambda: self._manager.restore(step, args=args))

    def _read(self, step: int, what: str, read: Callable[[], Any]) -> Any:
        """`read()`, or a CheckpointCorruptError naming the step and `what` was read.

        The error is raised outside the `except` block, so it carries the Orbax error
        only as text (not as its __context__, which would keep the failed read alive).
        """
        try:
            return read()
        except Exception as e:  # Orbax/TensorStore raise many types for broken files
            error = corrupt_error(step, self.directory / str(step), what, e)
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
            "run with the saved config, or start a new workdir"
        )
