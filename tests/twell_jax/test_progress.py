"""Run timing of the progress lines: compile apart, interval throughput, elapsed and ETA.

A fake clock (the benchmark timers' one) moves only when the test advances it.
"""

import pytest

from tests.experiments.test_bench_util import FakeClock
from twell_jax import progress


@pytest.mark.parametrize(
    "seconds, text",
    [(0, "0s"), (41.6, "42s"), (59.7, "1m00s"), (62, "1m02s"), (3599, "59m59s"), (7500, "2h05m")],
)
def test_format_duration(seconds, text):
    assert progress.format_duration(seconds) == text


def test_eta_uses_steady_steps_and_evals_stay_out_of_the_throughput():
    clock = FakeClock()
    timer = progress.RunTimer(total_steps=100, clock=clock)
    assert timer.text(0) == "elapsed 0s  eta -"
    clock.advance(30)  # the first step compiles
    assert timer.compiled(1) == 30
    assert timer.text(1) == "elapsed 30s  eta -"
    for _ in range(4):  # steps 2..5 at 2 s each
        clock.advance(2)
        timer.count_step()
    assert timer.interval() == (4, 8, None)  # no energy reader
    # 95 steps left at 2 s: the 30 s compile is not in the estimate.
    assert timer.eta(5) == pytest.approx(190)
    assert timer.text(5) == "elapsed 38s  eta 3m10s"
    with timer.excluded():  # a 10 s evaluation
        clock.advance(10)
    for _ in range(5):  # steps 6..10
        clock.advance(2)
        timer.count_step()
    assert timer.interval() == (5, 10, None)  # train time only
    # The evaluation is spread over the steady steps: (8 + 10 + 10) s / 9 steps.
    assert timer.eta(10) == pytest.approx(90 * 28 / 9)
    assert timer.elapsed() == pytest.approx(58)


def test_energy_is_read_with_the_clock_and_evals_stay_out_of_it():
    """A fake meter at 100 W: the compile and the evaluation draw energy, but an
    interval's joules are those of its steady train seconds only."""
    clock = FakeClock()
    joules = lambda: 100.0 * clock.now
    timer = progress.RunTimer(total_steps=10, clock=clock, energy=joules)
    clock.advance(30)  # compile
    timer.compiled(1)
    for _ in range(2):
        clock.advance(2)
        timer.count_step()
    with timer.excluded():  # a 10 s evaluation at the same power
        clock.advance(10)
    clock.advance(2)
    timer.count_step()
    interval = timer.interval()
    assert (interval.steps, interval.seconds) == (3, 6)
    assert interval.joules == pytest.approx(600)
    clock.advance(1)
    timer.count_step()
    assert timer.interval().joules == pytest.approx(100)  # restarted
