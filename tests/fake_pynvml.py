"""A stand-in for nvidia-ml-py's `pynvml`: GPUs that draw a set power, for CPU tests.

In a test: `monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(watts=300.0))`. In a
subprocess: put `install_module(dir)`'s directory on PYTHONPATH; the FAKE_NVML_*
variables configure it (see `FakeNvml.from_env`).

Every device draws `watts` (a test may change it); the energy counter, where
`counter=True`, is that power integrated over `time.perf_counter`, in mJ.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path


class NVMLError(Exception):
    pass


class NVMLError_NotSupported(NVMLError):
    pass


class NVMLError_LibraryNotFound(NVMLError):
    pass


class FakeNvml:
    """The module's functions that `twell_jax.energy` calls, with call counts."""

    NVMLError = NVMLError
    NVMLError_NotSupported = NVMLError_NotSupported
    NVMLError_LibraryNotFound = NVMLError_LibraryNotFound

    def __init__(self, watts: float = 300.0, counter: bool = True, device_count: int | None = 1):
        """device_count None: no driver (nvmlInit raises as on a machine without one)."""
        self.watts, self.counter, self.device_count = watts, counter, device_count
        self.calls = {"power": 0, "counter": 0, "init": 0, "shutdown": 0}
        self._lock = threading.Lock()
        # A real counter holds the energy since the driver loaded: far from 0.
        self._mj = [7.5e9] * (device_count or 0)
        self._last = time.perf_counter()

    @classmethod
    def from_env(cls) -> FakeNvml:
        """FAKE_NVML_WATTS (300), FAKE_NVML_COUNTER ("1"; "0": power only)."""
        return cls(
            watts=float(os.environ.get("FAKE_NVML_WATTS", "300")),
            counter=os.environ.get("FAKE_NVML_COUNTER", "1") == "1",
        )

    def _advance(self) -> None:
        with self._lock:
            now = time.perf_counter()
            self._mj = [mj + self.watts * (now - self._last) * 1e3 for mj in self._mj]
            self._last = now

    def nvmlInit(self) -> None:
        if self.device_count is None:
            raise NVMLError_LibraryNotFound("NVML Shared Library Not Found")
        self.calls["init"] += 1

    def nvmlShutdown(self) -> None:
        self.calls["shutdown"] += 1

    def nvmlDeviceGetCount(self) -> int:
        return self.device_count

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> int:
        raise NVMLError(f"Not Found: {uuid}")

    def nvmlDeviceGetName(self, handle: int) -> bytes:
        return b"Fake GPU"

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:
        self.calls["power"] += 1
        return round(self.watts * 1e3)

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: int) -> int:
        if not self.counter:
            raise NVMLError_NotSupported("Not Supported")
        self.calls["counter"] += 1
        self._advance()
        return int(self._mj[handle])


def install_module(directory: str | os.PathLike) -> Path:
    """Writes `<directory>/pynvml.py`, which becomes a `FakeNvml.from_env()`; returns
    the directory (for PYTHONPATH; the repository root must be importable too)."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    (path / "pynvml.py").write_text(
        "import sys\nfrom tests.fake_pynvml import FakeNvml\n"
        "sys.modules[__name__] = FakeNvml.from_env()\n"
    )
    return path
