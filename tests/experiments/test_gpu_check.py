"""experiments/gpu_check.sh: its target list, checked before anything runs."""

import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "gpu_check.sh"


def test_an_unknown_target_stops_before_anything_runs(tmp_path):
    proc = subprocess.run(
        ["bash", str(SCRIPT), "kernel", "trian"],
        env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "unknown target 'trian'; targets: tests tests_train" in proc.stderr
    assert not (tmp_path / "out").exists()  # nothing ran, not even the output folder


def test_the_usage_line_lists_the_known_targets():
    lines = SCRIPT.read_text().splitlines()
    usage = lines[2].split("[", 1)[1].split("]", 1)[0].split("|")
    known = "".join(line.split('"')[1] for line in lines if line.startswith("TARGETS")).split()
    assert sorted(usage) == sorted(known)
