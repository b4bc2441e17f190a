"""Orbax checkpoints of (train state, data iterator state, config), with safe resume.

Each step directory holds three items: `state` (the train-state pytree, restored with the
shardings of an abstract target), `data` (the grain iterator's JSON state) and `config` (the
run's config dict, JSON). Saving is asynchronous; Orbax writes into a temporary directory and
renames it when complete, so an interrupted save never replaces or loses an earlier step.

On resume, `restore()` compares the saved config with the current one (ignoring fields that
may legitimately change, e.g. total steps) and, if the latest step cannot be read, falls back
to the newest readable one and moves the unreadable directories aside (never deletes them).
"""

import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import jax
import orbax.checkpoint as ocp
from absl import logging

from twell_jax.config import config_diff, config_to_dict

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


class CheckpointCorruptError(ValueError):
    """A checkpoint step could not be read; the message names the step and its path."""

    def __init__(self, message: str, step: int | None = None):
        super().__init__(message)
        self.step = step


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
        try:
            return self._manager.restore(
                step, args=ocp.args.Composite(config=ocp.args.JsonRestore())
            ).config
        except Exception as e:  # Orbax/tensorstore raise many types for broken files
            raise _corrupt(step, self.directory / str(step), "config", e) from e

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
            older ones (with a warning) and renaming unreadable newer step directories to
            `<step>.corrupt` so training can save those steps again.
          config: the current config; if given, it must equal the saved one except for
            `ignore_keys`.
          ignore_keys: config keys (dotted paths or last components) allowed to differ.

        Returns:
          A `Restored(state, data_state, step)`.

        Raises:
          FileNotFoundError: there is no checkpoint (or not `step`).
          CheckpointCorruptError: `step` (or, with step=None, every step) is unreadable.
          ValueError: the saved config differs from `config`.
        """
        self.wait()
        abstract_state = jax.tree.map(_abstract, abstract_state)
        steps = self.all_steps()
        if step is not None:
            if step not in steps:
                raise FileNotFoundError(
                    f"no checkpoint for step {step} in {self.directory} (steps: {steps})"
                )
            return self._restore_checked(step, abstract_state, config, ignore_keys)
        if not steps:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        errors = []
        for candidate in reversed(steps):
            try:
                restored = self._restore_checked(candidate, abstract_state, config, ignore_keys)
            except CheckpointCorruptError as e:
                logging.warning("%s; trying an older step", e)
                errors.append(e)
                continue
            for bad in errors:
                self._quarantine(bad.step)
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
        path = self.directory / str(step)
        saved_config = self.saved_config(step)
        if config is not None:
            check_config(saved_config, config, ignore_keys, where=f"checkpoint step {step}")
        try:
            saved_shapes = _shapes(self._manager.item_metadata(step).state)
        except Exception as e:
            raise _corrupt(step, path, "state metadata", e) from e
        _check_shapes(saved_shapes, _shapes(abstract_state), step)
        try:
            restored = self._manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state),
                    data=ocp.args.JsonRestore(),
                ),
            )
        except Exception as e:
            raise _corrupt(step, path, "state/data", e) from e
        return Restored(restored.state, restored.data, step)

    def _quarantine(self, step: int) -> None:
        """Renames an unreadable step directory aside so Orbax no longer lists it.

        Only process 0 renames (the directory is shared); every process reloads its step list.
        """
        src = self.directory / str(step)
        dst = src.with_name(f"{step}{CORRUPT_SUFFIX}-{int(time.time())}")
        if jax.process_index() == 0 and src.exists():
            src.rename(dst)
            logging.warning("moved unreadable checkpoint %s to %s", src, dst)
        self._manager.reload()


def _corrupt(step: int, path: Path, what: str, e: Exception) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"checkpoint step {step} at {path} is unreadable ({what}): {type(e).__name__}: {e}", step
    )


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
      ValueError: listing each differing dotted key with its saved and current value.
    """
    diff = config_diff(saved, current, ignore_keys)
    if diff:
        lines = "\n".join(f"  {k}: saved {a!r}, current {b!r}" for k, (a, b) in diff.items())
        raise ValueError(
            f"config differs from {where} in {len(diff)} key(s):\n{lines}\n"
            "use the saved config, a new checkpoint dir, or extend ignore_keys"
        )
