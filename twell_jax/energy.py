"""GPU energy through NVML: joules drawn by the visible NVIDIA GPUs (docs/design.md §8).

NVML comes from the optional `nvidia-ml-py` package (import name `pynvml`):
`pip install '.[energy]'`. `EnergyMeter` reads one of two sources, the same for all of
its devices:

- "counter": `nvmlDeviceGetTotalEnergyConsumption`, the driver's cumulative energy of
  the board in mJ (Volta and newer). A reading is the difference of two counts; the
  driver advances the count at intervals of its own, so a short reading is exact to
  within one of them.
- "power": where a device has no counter, a daemon thread samples
  `nvmlDeviceGetPowerUsage` (mW) every `interval_s` and integrates it (trapezoids; the
  last sample is held up to the moment of a reading). Such older boards return the
  instantaneous power; boards that average it over 1 s (Ampere but GA100, and newer)
  all have the counter.

Asking for energy where none can be measured is an error, not a None:
`EnergyUnavailableError` when the package is missing, NVML does not start (no NVIDIA
driver), a device does not exist, or a device reports neither source. A run given
`--energy` therefore fails before it measures anything.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from typing import Any

INSTALL_HINT = "pip install '.[energy]' (the nvidia-ml-py package)"


class EnergyUnavailableError(RuntimeError):
    """No energy reading is possible here; the message says why."""


def _import_nvml() -> Any:
    try:
        import pynvml
    except ImportError as e:
        raise EnergyUnavailableError(f"energy needs NVML: {INSTALL_HINT}") from e
    return pynvml


def visible_gpus(environ: dict[str, str] | None = None) -> list[int | str] | None:
    """NVML ids of the GPUs CUDA shows this process, in CUDA's order; None: all of them.

    NVML numbers every GPU of the host and ignores CUDA_VISIBLE_DEVICES, so the devices
    a JAX process uses are read from that variable: an integer entry is taken as an
    NVML index (NVML's order is CUDA's under `CUDA_DEVICE_ORDER=PCI_BUS_ID`; the meter
    sums its devices, so only the set matters), any other entry ("GPU-...") as a UUID.
    """
    value = (os.environ if environ is None else environ).get("CUDA_VISIBLE_DEVICES")
    if value is None or not value.strip():
        return None
    entries = [e.strip() for e in value.split(",") if e.strip()]
    return [int(e) if e.isdigit() else e for e in entries]


class EnergyMeter:
    """Cumulative joules of a set of NVIDIA GPUs since the meter was opened.

    `joules()` may be read any number of times (two reads bound an interval);
    `start()` / `stop()` measure one interval. Close the meter (or use it as a context
    manager) to stop the sampler thread and release NVML.

    Args:
      devices: NVML indices or UUID strings; None: `visible_gpus()`, or every GPU of
        the host when CUDA_VISIBLE_DEVICES is unset.
      interval_s: the power sampler's period (method "power" only).
      clock: seconds, like `time.perf_counter` (the power integration's time base).

    Raises:
      EnergyUnavailableError: see the module docstring.
    """

    def __init__(
        self,
        devices: Sequence[int | str] | None = None,
        *,
        interval_s: float = 0.01,
        clock=time.perf_counter,
    ):
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self._nvml = nvml = _import_nvml()
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as e:
            raise EnergyUnavailableError(f"NVML did not start ({e}): no NVIDIA driver?") from e
        self._closed = False
        try:
            self.devices, self._handles, self.names = self._open(devices)
            self.method = "counter" if all(map(self._has_counter, self._handles)) else "power"
            if self.method == "power":
                for handle, name in zip(self._handles, self.names, strict=True):
                    self._watts(handle, name)  # raises when a device has neither source
        except BaseException:
            nvml.nvmlShutdown()
            raise
        self.interval_s, self._clock = interval_s, clock
        self._lock = threading.Lock()
        self._stop_sampling = threading.Event()
        self._start_joules: float | None = None
        if self.method == "counter":
            self._base_mj = [nvml.nvmlDeviceGetTotalEnergyConsumption(h) for h in self._handles]
        else:
            self._sample_time = clock()
            self._sample_watts = self._total_watts()
            self._integrated = 0.0  # joules up to _sample_time
            self._thread = threading.Thread(target=self._sample, name="energy-meter", daemon=True)
            self._thread.start()

    def _open(self, devices) -> tuple[list[int | str], list[Any], list[str]]:
        """(the NVML ids, their handles, their names)."""
        nvml = self._nvml
        count = nvml.nvmlDeviceGetCount()
        if count == 0:
            raise EnergyUnavailableError("NVML sees no NVIDIA GPU")
        ids = visible_gpus() if devices is None else list(devices)
        ids = list(range(count)) if ids is None else ids
        handles = []
        for dev in ids:
            try:
                if isinstance(dev, str):
                    handles.append(nvml.nvmlDeviceGetHandleByUUID(dev))
                elif 0 <= dev < count:
                    handles.append(nvml.nvmlDeviceGetHandleByIndex(dev))
                else:
                    raise EnergyUnavailableError(f"no GPU {dev}: NVML sees {count}")
            except nvml.NVMLError as e:
                raise EnergyUnavailableError(f"GPU {dev!r}: {e}") from e
        names = []
        for handle in handles:
            name = nvml.nvmlDeviceGetName(handle)
            names.append(name.decode() if isinstance(name, bytes) else str(name))
        return ids, handles, names

    def _has_counter(self, handle) -> bool:
        try:
            self._nvml.nvmlDeviceGetTotalEnergyConsumption(handle)
        except self._nvml.NVMLError:  # NotSupported, or a driver without the call
            return False
        return True

    def _watts(self, handle, name: str) -> float:
        try:
            return self._nvml.nvmlDeviceGetPowerUsage(handle) / 1e3
        except self._nvml.NVMLError as e:
            raise EnergyUnavailableError(f"{name}: neither energy counter nor power ({e})") from e

    def _total_watts(self) -> float:
        return sum(self._watts(h, n) for h, n in zip(self._handles, self.names, strict=True))

    def _sample(self) -> None:
        """The power sampler: trapezoids between samples every `interval_s` seconds."""
        while not self._stop_sampling.wait(self.interval_s):
            watts, now = self._total_watts(), self._clock()
            with self._lock:
                self._integrated += 0.5 * (watts + self._sample_watts) * (now - self._sample_time)
                self._sample_time, self._sample_watts = now, watts

    def joules(self) -> float:
        """Joules drawn by all the meter's devices since it was opened."""
        if self._closed:
            raise RuntimeError("EnergyMeter is closed")
        if self.method == "counter":
            counts = [self._nvml.nvmlDeviceGetTotalEnergyConsumption(h) for h in self._handles]
            return sum(c - b for c, b in zip(counts, self._base_mj, strict=True)) / 1e3
        with self._lock:  # the last sample's power, held until now
            return self._integrated + self._sample_watts * (self._clock() - self._sample_time)

    def start(self) -> None:
        """Starts one interval (`stop` returns its joules)."""
        self._start_joules = self.joules()

    def stop(self) -> float:
        """Joules since the last `start`."""
        if self._start_joules is None:
            raise RuntimeError("EnergyMeter.stop without start")
        joules, self._start_joules = self.joules() - self._start_joules, None
        return joules

    def describe(self) -> dict[str, Any]:
        """{"method", "devices", "names", "interval_s" (power only)} for result files."""
        out = {"method": self.method, "devices": self.devices, "names": self.names}
        if self.method == "power":
            out["interval_s"] = self.interval_s
        return out

    def close(self) -> None:
        """Stops the sampler and releases NVML; idempotent."""
        if self._closed:
            return
        if self.method == "power":
            self._stop_sampling.set()
            self._thread.join()
        self._closed = True
        self._nvml.nvmlShutdown()

    def __enter__(self) -> EnergyMeter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
