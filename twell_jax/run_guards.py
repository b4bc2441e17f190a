"""The training loop's run guards: the workdir lock, stop signals, schedule and divergence.

- `WorkdirLock`: `<workdir>/run.lock` (host and pid) for the life of a run; a second
  run on the same workdir is refused with `WorkdirLockedError`.
- `StopRequest`: the first SIGINT / SIGTERM becomes a flag the loop polls between steps
  (it then saves and returns); the second aborts.
- `check_schedule`: a resume may not change `optim.total_steps` unless allowed, nor go
  below the checkpoint's step (`ScheduleChangeError`).
- `DivergenceError` and `all_finite`: the divergence guard's error and state check.

`twell_jax.trainer` uses them around its loop.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

LOCK_FILE = "run.lock"


class DivergenceError(RuntimeError):
    """A step's loss, gradient norm or the train state is not finite; nothing was saved.

    Attributes:
      step: the first step found non-finite (past the skip allowance).
      metric: which value: "loss", "grad_norm" or "state".
      last_checkpoint: the newest checkpoint step on disk (the last good one), or None.
      skipped: non-finite steps skipped before this one (`--skip_nonfinite`).
    """

    def __init__(
        self, step: int, metric: str, value: float, last_checkpoint: int | None, skipped: int = 0
    ):
        kept = "none" if last_checkpoint is None else f"step {last_checkpoint}"
        after = f" after {skipped} skipped non-finite step(s)" if skipped else ""
        super().__init__(
            f"non-finite {metric} ({value}) at step {step}{after}: stopped without saving; "
            f"last good checkpoint: {kept}"
        )
        self.step, self.metric, self.last_checkpoint = step, metric, last_checkpoint
        self.skipped = skipped


class ScheduleChangeError(ValueError):
    """A resume that would change the schedule's length, or go back before the checkpoint."""


class ResumeRefusedError(ValueError):
    """The workdir holds checkpoints that the run cannot resume as asked: resume is
    off, or the corpus is not the one their data position was saved on."""


class WorkdirLockedError(RuntimeError):
    """Another live run holds the workdir lock; the message names its host and pid."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class WorkdirLock:
    """`<workdir>/run.lock` for the life of a run: one run per workdir.

    The file is created atomically (O_CREAT | O_EXCL) and holds {"host", "pid", "time"}.
    An existing lock from another live process (or another host, whose processes this
    one cannot see) raises `WorkdirLockedError` naming the holder; a lock left by a dead
    process of this host is taken over with a warning. The lock is removed on exit
    (normal, exception, KeyboardInterrupt) if it is still ours; a SIGKILL leaves a stale
    lock, which the next run on the same host takes over.
    """

    def __init__(self, workdir: str | os.PathLike):
        self.path = Path(workdir) / LOCK_FILE
        self.owner = {"host": socket.gethostname(), "pid": os.getpid()}
        self.held = False

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump({**self.owner, "time": time.time()}, f)
        return True

    def _holder(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}

    def acquire(self) -> WorkdirLock:
        """Takes the lock.

        Raises:
          WorkdirLockedError: another live run (or an unreadable lock file) holds it.
        """
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(3):
            if self._create():
                self.held = True
                return self
            holder = self._holder()
            if holder is None:  # released between our create and read: try again
                continue
            host, pid = holder.get("host"), holder.get("pid")
            if not isinstance(pid, int) or not host:
                raise WorkdirLockedError(
                    f"{self.path} exists but names no holder ({self.path.read_text()!r}): "
                    "if no run uses this workdir, delete it"
                )
            if host == self.owner["host"] and not _pid_alive(pid):
                logging.warning(
                    "taking over the stale lock %s of pid %d on %s (not running)",
                    self.path,
                    pid,
                    host,
                )
                self.path.unlink(missing_ok=True)
                continue
            remote = "" if host == self.owner["host"] else "; if that run is gone, delete the lock"
            raise WorkdirLockedError(
                f"workdir {self.path.parent} is in use by pid {pid} on host {host} "
                f"(lock {self.path}); wait for it to finish, stop it, or use another "
                f"--workdir{remote}"
            )
        raise WorkdirLockedError(f"could not take {self.path}: it keeps changing hands")

    def release(self) -> None:
        """Removes the lock file if it is still ours."""
        if not self.held:
            return
        self.held = False
        holder = self._holder()
        if holder and all(holder.get(k) == v for k, v in self.owner.items()):
            self.path.unlink(missing_ok=True)
        else:
            logging.warning("%s is no longer ours (%s); left in place", self.path, holder)

    def __enter__(self) -> WorkdirLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


class StopRequest:
    """Turns the first SIGINT / SIGTERM into a flag the loop polls between steps.

    Stopping between steps keeps the (donated) train state valid for the final save;
    the second signal restores the default handlers, so another Ctrl-C aborts at once.
    """

    _SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.requested = False
        self.signal: str | None = None
        self._previous = {}

    def __enter__(self) -> StopRequest:
        try:
            self._previous = {s: signal.signal(s, self._handle) for s in self._SIGNALS}
        except ValueError:  # not the main thread: no signal handling, stop only when done
            self._previous = {}
        return self

    def _handle(self, signum, frame):
        del frame
        logging.warning(
            "%s: stopping at the next step boundary and saving a checkpoint "
            "(again to abort without saving)",
            signal.Signals(signum).name,
        )
        self.requested = True
        self.signal = signal.Signals(signum).name
        self._restore()

    def _restore(self):
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def __exit__(self, *exc) -> None:
        self._restore()

    def agreed(self) -> bool:
        """Whether any process was asked to stop (a collective when multi-host)."""
        if jax.process_count() == 1:
            return self.requested
        return bool(np.any(multihost_utils.process_allgather(np.asarray(self.requested))))


def check_schedule(saved_total: int, total: int, step: int, allow_change: bool) -> None:
    """Refuses a resume from `step` that changes `optim.total_steps` from `saved_total`
    to `total` (unless `allow_change`) or that goes back (`total < step`).

    Raises:
      ScheduleChangeError: naming both totals, the step and the flags to use.
    """
    if total < step:
        raise ScheduleChangeError(
            f"--steps={total} is below the checkpoint's step {step}: the run is already past "
            "it (use a fresh workdir for a shorter run)"
        )
    if total != saved_total and not allow_change:
        raise ScheduleChangeError(
            f"optim.total_steps={total} differs from the checkpoint's {saved_total} (step "
            f"{step}): the LR schedule ends at total_steps, so this changes the LR from step "
            f"{step} on; pass --allow_schedule_change to continue on the new schedule, or "
            f"--steps={saved_total}"
        )


def all_finite(tree) -> jax.Array:
    """Whether every floating-point leaf of `tree` is finite (one scalar)."""
    leaves = [
        jnp.all(jnp.isfinite(x))
        for x in jax.tree.leaves(tree)
        if jnp.issubdtype(x.dtype, jnp.inexact)
    ]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)
