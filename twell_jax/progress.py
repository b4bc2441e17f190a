"""Run timing for the progress lines: elapsed time, steady-state step time and ETA.

The first step of a run (or of a resumed run) compiles the train step, so it is timed
apart (`RunTimer.compiled`) and left out of both estimates:

- tokens/s is throughput: the steady steps of one log interval over their train time,
  with evaluations left out (`RunTimer.excluded`);
- the ETA is the steps left times the mean wall time of a steady step since the
  compile, so the evaluations and checkpoint saves the loop has made so far are spread
  over the steps, as they will be over the rest of the run.

Every time comes from an injectable clock (seconds, like `time.perf_counter`), so tests
drive it by hand. An optional energy reader (cumulative joules, e.g.
`twell_jax.energy.EnergyMeter.joules`) is read wherever the clock is, so an interval's
joules cover the same steady train time as its seconds.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import NamedTuple

# Seconds since an arbitrary origin, like `time.perf_counter`.
Clock = Callable[[], float]


class Interval(NamedTuple):
    """One log interval: steady steps, their train seconds, and their joules (None
    without an energy reader)."""

    steps: int
    seconds: float
    joules: float | None = None


def format_duration(seconds: float) -> str:
    """Whole seconds as "42s", "1m02s" or "2h05m" (hours and minutes past an hour)."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class RunTimer:
    """Wall time of one training loop, from its creation: compile, intervals, ETA.

    The loop calls `compiled(step)` after its first step, `count_step()` after every
    other step and `interval()` at each log line; `excluded()` wraps work that is not
    training (evaluation). `energy`, if given, returns cumulative joules.
    """

    def __init__(
        self,
        total_steps: int,
        clock: Clock = time.perf_counter,
        energy: Callable[[], float] | None = None,
    ):
        self._clock = clock
        self._energy = energy or (lambda: 0.0)
        self._has_energy = energy is not None
        self._total = total_steps
        self._start = self._interval_start = clock()
        self._interval_joules = self._energy()
        self._interval_steps = 0
        self._steady: tuple[float, int] | None = None  # (time, step) at the compile's end

    def compiled(self, step: int) -> float:
        """Marks the end of the first (compiling) step `step`; returns its seconds."""
        now = self._clock()
        seconds = now - self._interval_start
        self._steady = (now, step)
        self._interval_start, self._interval_steps = now, 0
        self._interval_joules = self._energy()
        return seconds

    def count_step(self) -> None:
        """Counts one steady step of the current interval."""
        self._interval_steps += 1

    def interval(self) -> Interval:
        """The steady steps since the last call or the compile, their train seconds and
        joules; restarts."""
        now, joules = self._clock(), self._energy()
        out = Interval(
            self._interval_steps,
            now - self._interval_start,
            joules - self._interval_joules if self._has_energy else None,
        )
        self._interval_start, self._interval_steps = now, 0
        self._interval_joules = joules
        return out

    @contextlib.contextmanager
    def excluded(self) -> Iterator[None]:
        """Leaves the time and energy spent inside out of the interval's (not the ETA's)."""
        t0, j0 = self._clock(), self._energy()
        try:
            yield
        finally:
            self._interval_start += self._clock() - t0
            self._interval_joules += self._energy() - j0

    def elapsed(self) -> float:
        """Seconds since the timer started (compile, evaluations and saves included)."""
        return self._clock() - self._start

    def eta(self, step: int) -> float | None:
        """Seconds until `total_steps` at the steady pace so far; None before a steady step."""
        if self._steady is None or step <= self._steady[1]:
            return None
        since, from_step = self._steady
        per_step = (self._clock() - since) / (step - from_step)
        return per_step * max(0, self._total - step)

    def text(self, step: int) -> str:
        """ "elapsed 1m02s  eta 3m10s" at `step` ("eta -" before the first steady step)."""
        eta = self.eta(step)
        return (
            f"elapsed {format_duration(self.elapsed())}  "
            f"eta {'-' if eta is None else format_duration(eta)}"
        )
