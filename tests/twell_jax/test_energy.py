"""The NVML energy meter against a fake `pynvml` (tests/fake_pynvml.py): the driver's
counter, the power-integration fallback, and the errors where nothing can be measured."""

import sys
import threading
import time

import pytest

from tests.fake_pynvml import FakeNvml
from twell_jax import energy


@pytest.fixture
def nvml(monkeypatch):
    fake = FakeNvml(watts=250.0)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    return fake


def test_counter_is_read_where_the_driver_has_it(nvml):
    with energy.EnergyMeter() as meter:
        assert meter.method == "counter"
        assert meter.describe() == {"method": "counter", "devices": [0], "names": ["Fake GPU"]}
        assert 0 <= meter.joules() < 1  # since the meter opened, not since the driver loaded
        meter.start()
        t0 = time.perf_counter()
        time.sleep(0.05)
        joules = meter.stop()
        seconds = time.perf_counter() - t0
    # 250 W over the interval, to within the fake counter's 1 mJ steps and the
    # scheduling of a loaded machine between the two clocks' reads.
    assert joules == pytest.approx(250 * seconds, rel=0.1, abs=2e-3)
    assert nvml.calls["power"] == 0  # no sampler thread on this path
    assert nvml.calls["init"] == nvml.calls["shutdown"] == 1


def test_power_is_integrated_where_the_counter_is_not_supported(nvml):
    nvml.counter = False
    with energy.EnergyMeter(interval_s=0.005) as meter:
        assert meter.method == "power" and meter.describe()["interval_s"] == 0.005
        start, t0 = meter.joules(), time.perf_counter()
        time.sleep(0.1)
        nvml.watts, t1 = 100.0, time.perf_counter()  # the sampler must follow the change
        time.sleep(0.1)
        joules, t2 = meter.joules() - start, time.perf_counter()
    # 250 W, then 100 W: to within the sampler's lag at the change (one period when idle);
    # the mean power lies between the two levels, not at either.
    assert 100 * (t2 - t0) < joules < 250 * (t2 - t0)
    assert joules == pytest.approx(250 * (t1 - t0) + 100 * (t2 - t1), rel=0.2)
    assert nvml.calls["power"] > 10  # sampled in the background, not once
    with pytest.raises(RuntimeError, match="closed"):
        meter.joules()


def test_constant_power_integrates_exactly(nvml):
    nvml.counter = False
    clock_reads = []  # the reading thread's, not the sampler's

    def clock():
        now = time.perf_counter()
        if threading.current_thread() is threading.main_thread():
            clock_reads.append(now)
        return now

    with energy.EnergyMeter(interval_s=0.002, clock=clock) as meter:
        start = meter.joules()
        first = clock_reads[-1]
        time.sleep(0.03)
        joules = meter.joules() - start
        last = clock_reads[-1]
    assert joules == pytest.approx(250 * (last - first), rel=1e-6)


def test_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    with pytest.raises(energy.EnergyUnavailableError, match=r"pip install '\.\[energy\]'"):
        energy.EnergyMeter()


def test_no_driver_and_missing_devices_are_errors(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(device_count=None))
    with pytest.raises(energy.EnergyUnavailableError, match="no NVIDIA driver"):
        energy.EnergyMeter()
    fake = FakeNvml(device_count=0)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    with pytest.raises(energy.EnergyUnavailableError, match="sees no NVIDIA GPU"):
        energy.EnergyMeter()
    fake = FakeNvml(device_count=2)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    with pytest.raises(energy.EnergyUnavailableError, match="no GPU 3: NVML sees 2"):
        energy.EnergyMeter([0, 3])
    assert fake.calls["shutdown"] == fake.calls["init"] == 1  # released after the error


def test_a_device_with_neither_source_is_an_error(monkeypatch, nvml):
    nvml.counter = False

    def no_power(handle):
        raise nvml.NVMLError_NotSupported("Not Supported")

    monkeypatch.setattr(nvml, "nvmlDeviceGetPowerUsage", no_power)
    with pytest.raises(energy.EnergyUnavailableError, match="neither energy counter nor power"):
        energy.EnergyMeter()


def test_several_devices_are_summed(monkeypatch):
    fake = FakeNvml(watts=100.0, device_count=4)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,3")
    with energy.EnergyMeter() as meter:
        assert meter.devices == [1, 3]
        meter.start()
        t0 = time.perf_counter()
        time.sleep(0.05)
        joules, seconds = meter.stop(), time.perf_counter() - t0
    assert joules == pytest.approx(2 * 100 * seconds, rel=0.1, abs=4e-3)


def test_visible_gpus_reads_cuda_visible_devices():
    assert energy.visible_gpus({}) is None
    assert energy.visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) is None
    assert energy.visible_gpus({"CUDA_VISIBLE_DEVICES": "2, 0"}) == [2, 0]
    assert energy.visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-ab12,1"}) == ["GPU-ab12", 1]
