"""The benchmarks' timers: rotation order, per-function stats, round ratios.

The timed functions advance a fake clock instead of sleeping, so the times are exact.
"""

import json

import jax
import jax.numpy as jnp
import pytest

from experiments import bench_util as bu


class FakeClock:
    """`time.perf_counter` stand-in that moves only when `advance` is called."""

    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def test_time_interleaved_rotates_and_reports_round_ratios():
    clock, calls = FakeClock(), []

    def sleeper(name, seconds):
        def fn(x):
            calls.append(name)
            clock.advance(seconds)
            return x

        return fn

    fns = {"slow": sleeper("slow", 0.004), "fast": sleeper("fast", 0.001)}
    out = bu.time_interleaved(fns, 1, warmup=1, reps=4, clock=clock)
    # one warm-up round, then 4 rounds in rotation, every other one reversed
    assert calls == ["slow", "fast"] + ["slow", "fast", "fast", "slow"] * 2
    assert out["slow"]["reps"] == 4 and len(out["fast"]["times_ms"]) == 4
    assert out["slow"]["median_ms"] == pytest.approx(4.0)
    assert out["fast"]["times_ms"] == pytest.approx([1.0] * 4)
    assert set(out["ratios"]) == {"slow/fast"}
    assert out["ratios"]["slow/fast"] == pytest.approx(4.0)


def test_time_interleaved_inner_calls_back_to_back():
    clock, calls = FakeClock(), []

    def fn(name):
        def call(x):
            calls.append(name)
            clock.advance(0.002)
            return x

        return call

    out = bu.time_interleaved(
        {"a": fn("a"), "b": fn("b")}, 1, warmup=1, reps=2, inner=3, clock=clock
    )
    assert calls == ["a", "b"] + ["a"] * 3 + ["b"] * 6 + ["a"] * 3  # warm-up calls each once
    assert out["a"]["reps"] == 2
    assert out["a"]["median_ms"] == pytest.approx(2.0)  # per call, not per batch of 3


def test_time_steps_interleaved_carries_each_state_chain():
    clock, calls = FakeClock(), []

    def stepper(name, seconds):
        def step(state, inc):
            calls.append(name)
            clock.advance(seconds)
            return state + inc, {"seen": state}

        return step

    steps = {"slow": stepper("slow", 0.004), "fast": stepper("fast", 0.001)}
    timing, states, auxes = bu.time_steps_interleaved(
        steps, {"slow": 0, "fast": 100}, 1, warmup=1, reps=4, clock=clock
    )
    assert calls == ["slow", "fast"] + ["slow", "fast", "fast", "slow"] * 2
    assert states == {"slow": 5, "fast": 105}  # 1 warm-up + 4 timed calls, one chain each
    assert [a["seen"] for a in auxes["fast"]] == [100, 101, 102, 103, 104]
    assert timing["slow"]["reps"] == 4 and set(timing["ratios"]) == {"slow/fast"}
    assert timing["ratios"]["slow/fast"] == pytest.approx(4.0)


def test_time_steps_interleaved_meters_only_the_timed_calls():
    """A fake meter drawing 1 J per ms of the slow step and 0.5 J per ms of the fast one."""
    clock = FakeClock()

    class Meter:
        total = 0.0

        def joules(self):
            return self.total

    meter = Meter()

    def stepper(seconds, joules_per_ms):
        def step(state):
            clock.advance(seconds)
            meter.total += joules_per_ms * seconds * 1e3
            return state + 1, {}

        return step

    steps = {"slow": stepper(0.004, 1.0), "fast": stepper(0.001, 0.5)}
    timing, _, _ = bu.time_steps_interleaved(
        steps, {"slow": 0, "fast": 0}, warmup=2, reps=3, clock=clock, meter=meter
    )
    assert timing["slow"]["joules_per_call"] == pytest.approx([4.0] * 3)  # no warm-up call
    assert timing["slow"]["joules"] == pytest.approx(12.0)
    assert timing["fast"]["joules"] == pytest.approx(1.5)
    plain, _, _ = bu.time_steps_interleaved(steps, {"slow": 0, "fast": 0}, reps=2, clock=clock)
    assert "joules" not in plain["slow"]


def test_time_fn_reports_per_call_time_of_inner_batches():
    clock, calls = FakeClock(), []

    def fn(x):
        calls.append(x)
        clock.advance(0.002)
        return x

    out = bu.time_fn(fn, 0, warmup=2, reps=3, inner=4, clock=clock)
    assert len(calls) == 2 + 3 * 4 and out["reps"] == 3
    assert out["median_ms"] == pytest.approx(2.0)  # per call, not per batch of 4
    assert out["p10_ms"] == pytest.approx(2.0) and out["p90_ms"] == pytest.approx(2.0)


def test_kernel_table_counts_device_kernels_only():
    events = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
        {"ph": "X", "pid": 1, "name": "gemm", "dur": 10.0},
        {"ph": "X", "pid": 1, "name": "gemm", "dur": 14.0},
        {"ph": "X", "pid": 1, "name": "relu", "dur": 1.0},
        {"ph": "X", "pid": 2, "name": "gemm", "dur": 500.0},  # host side: not a kernel
        {"ph": "i", "pid": 1, "name": "marker"},
    ]
    table = bu.kernel_table(events, calls=2)
    assert list(table) == ["gemm", "relu"]  # longest total first
    assert table["gemm"] == {"per_call": 1.0, "mean_us": 12.0}
    assert table["relu"] == {"per_call": 0.5, "mean_us": 1.0}


def test_gpu_timeline_merges_overlapping_kernels_and_counts_gaps():
    gpu = {"ph": "X", "pid": 1}
    events = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
        {**gpu, "name": "a", "ts": 100.0, "dur": 10.0},
        {**gpu, "name": "b", "ts": 105.0, "dur": 10.0},  # overlaps a: busy 100..115
        {**gpu, "name": "c", "ts": 120.0, "dur": 5.0},  # after a 5 µs gap
        {**gpu, "name": "d", "ts": 121.0, "dur": 1.0},  # inside c
        {"ph": "X", "pid": 2, "name": "host", "ts": 0.0, "dur": 500.0},
    ]
    assert bu.gpu_timeline(events) == {"kernels": 4, "busy_us": 20.0, "span_us": 25.0}
    assert bu.gpu_timeline(events[:2]) == {"kernels": 0, "busy_us": 0.0, "span_us": 0.0}


def test_kernel_times_runs_on_a_host_without_device_kernels():
    fn = jax.jit(lambda x: x * 2)
    table = bu.kernel_times(fn, jnp.ones(4), calls=2)
    assert isinstance(table, dict)
    assert all("GPU" not in name for name in table)


def test_write_cases_records_the_command(tmp_path):
    out = tmp_path / "cases.json"
    doc = "Title.\n\n    python -m x --out=y\n\nWhat it\nmeasures."
    bu.write_cases(doc, {"a": 1}, str(out), "python -m x --out=y")
    res = json.loads(out.read_text())
    assert res["command"] == "python -m x --out=y" and res["cases"] == {"a": 1}
    assert res["measures"] == "What it measures."
