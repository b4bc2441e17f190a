"""Runs an `experiments` entry point in a subprocess, as a user would (tests only)."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_module(module: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """`python -m <module> args` (`experiments.<module>` for a bare name) from the
    repository root, on the CPU, with its output captured as text."""
    name = module if "." in module else f"experiments.{module}"
    return subprocess.run(
        [sys.executable, "-m", name, *args],
        cwd=REPO,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def refusal(proc: subprocess.CompletedProcess) -> str:
    """The one line a refused CLI run writes to stderr after its log lines, checked for
    exit code 2 and no traceback or help text."""
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr and "Exit codes:" not in proc.stderr
    (line,) = [line for line in proc.stderr.splitlines() if "refused: " in line]
    return line
