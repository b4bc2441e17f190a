"""Run guards: the workdir lock and the schedule check (the loop's use: test_trainer)."""

import json
import socket
import subprocess
import sys

import pytest

from twell_jax import run_guards


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_lock_is_exclusive_names_the_holder_and_is_released(tmp_path):
    with run_guards.WorkdirLock(tmp_path / "w") as lock:
        holder = json.loads(lock.path.read_text())
        assert holder["host"] == socket.gethostname() and holder["pid"] == lock.owner["pid"]
        with pytest.raises(run_guards.WorkdirLockedError, match=f"pid {holder['pid']} on host"):
            run_guards.WorkdirLock(tmp_path / "w").acquire()
    assert not (tmp_path / "w" / run_guards.LOCK_FILE).exists()


def test_stale_lock_of_this_host_is_taken_over(tmp_path):
    path = tmp_path / run_guards.LOCK_FILE
    path.write_text(json.dumps({"host": socket.gethostname(), "pid": _dead_pid()}))
    with run_guards.WorkdirLock(tmp_path) as lock:
        assert json.loads(path.read_text())["pid"] == lock.owner["pid"]
    assert not path.exists()


def test_lock_of_another_host_or_unreadable_is_refused(tmp_path):
    path = tmp_path / run_guards.LOCK_FILE
    path.write_text(json.dumps({"host": "elsewhere", "pid": _dead_pid()}))
    with pytest.raises(run_guards.WorkdirLockedError, match=r"on host elsewhere.*delete the lock"):
        run_guards.WorkdirLock(tmp_path).acquire()
    path.write_text("")
    with pytest.raises(run_guards.WorkdirLockedError, match="names no holder"):
        run_guards.WorkdirLock(tmp_path).acquire()
    assert path.read_text() == ""  # a refused lock is left alone


def test_check_schedule_refuses_a_change_unless_allowed_and_never_goes_back():
    run_guards.check_schedule(10, 10, 4, allow_change=False)
    run_guards.check_schedule(10, 20, 4, allow_change=True)
    with pytest.raises(
        run_guards.ScheduleChangeError, match=r"--allow_schedule_change.*--steps=10"
    ):
        run_guards.check_schedule(10, 20, 4, allow_change=False)
    with pytest.raises(run_guards.ScheduleChangeError, match="below the checkpoint's step 4"):
        run_guards.check_schedule(10, 3, 4, allow_change=True)
