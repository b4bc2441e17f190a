"""The benchmarks' timers: rotation order, per-function stats and round ratios."""

import time

import pytest

from experiments import bench_util as bu


def test_time_interleaved_rotates_and_reports_round_ratios():
    calls = []

    def sleeper(name, seconds):
        def fn(x):
            calls.append(name)
            time.sleep(seconds)
            return x

        return fn

    fns = {"slow": sleeper("slow", 0.004), "fast": sleeper("fast", 0.001)}
    out = bu.time_interleaved(fns, 1, warmup=1, reps=4)
    assert calls == ["slow", "fast"] * 5  # one warm-up round, then 4 rounds in rotation
    assert out["slow"]["reps"] == 4 and len(out["fast"]["times_ms"]) == 4
    assert out["slow"]["median_ms"] > out["fast"]["median_ms"] >= 1.0
    assert set(out["ratios"]) == {"slow/fast"}
    assert out["ratios"]["slow/fast"] == pytest.approx(4.0, rel=0.5)
