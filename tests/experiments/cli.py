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
