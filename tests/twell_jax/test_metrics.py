"""Metrics records: interval reduction and the jsonl writer's truncation on resume."""

import json

import numpy as np

from twell_jax import metrics


def test_reduce_interval_and_writer_truncation(tmp_path):
    steps = [
        {
            "ce": 2.0,
            "lr": 1e-3,
            "l0": np.array([10.0, 20.0]),
            "sparsity": np.array([0.9, 0.8]),
            "alive": np.array([1.0, 1.0]),
            "tail_rows": np.array([1, 0]),
        },
        {
            "ce": 4.0,
            "lr": 2e-3,
            "l0": np.array([30.0, 40.0]),
            "sparsity": np.array([0.7, 0.6]),
            "alive": np.array([0.5, 1.0]),
            "tail_rows": np.array([2, 3]),
        },
    ]
    record = metrics.reduce_interval(steps, step=2, tokens_per_s=100.0)
    assert record["ce"] == 3.0 and record["lr"] == 2e-3  # mean; last value
    assert record["l0"] == [20.0, 30.0] and record["l0_mean"] == 25.0
    assert record["alive"] == [0.5, 1.0] and record["tail_rows"] == [3, 3]  # last; sum
    json.dumps(record)

    with metrics.MetricsWriter(tmp_path) as w:
        for s in (1, 2, 3):
            w.write({"step": s, "kind": "train", "ce": 1.0})
    with (tmp_path / metrics.METRICS_FILE).open("a") as f:
        f.write('{"step": 4, "kind": "tr')  # a crash mid-line
    # Resuming from step 2 drops what a crashed run logged after its checkpoint.
    with metrics.MetricsWriter(tmp_path, resume_step=2) as w:
        w.write({"step": 3, "kind": "eval", "val_ce": 1.5})
    assert [(r["step"], r["kind"]) for r in metrics.read_metrics(w.path)] == [
        (1, "train"),
        (2, "train"),
        (3, "eval"),
    ]


# One train-interval record, as the trainer logs it.
TRAIN_RECORD = {
    "step": 7,
    "loss": 2.5,
    "ce": 2.4,
    "l1_loss": 0.1,
    "l0_mean": 30.0,
    "sparsity_mean": 0.9,
    "alive_mean": 1.0,
    "lr": 1e-3,
}


def test_train_line_counts_skipped_steps_only_when_there_are_some():
    record = {**TRAIN_RECORD, "skipped_steps": 0}
    line = metrics.format_train_line(record, total_steps=10, d_ff=300)
    assert line.startswith("step      7/10  loss 2.5000") and "tok/s -" in line
    assert "skipped" not in line
    assert metrics.format_train_line({**record, "skipped_steps": 2}, 10, 300).endswith(
        "  skipped 2"
    )


def test_energy_fields_and_their_place_in_the_train_line():
    assert metrics.energy_fields(None, 2.0, 100) == {}  # no meter
    assert metrics.energy_fields(5.0, 2.0, 0) == {}  # an interval of only the compile
    fields = metrics.energy_fields(6.0, 2.0, 400)
    assert fields == {"joules_per_token": 0.015, "watts": 3.0}
    record = TRAIN_RECORD
    assert "mJ/tok" not in metrics.format_train_line(record, 10, 300)
    line = metrics.format_train_line({**record, **fields}, 10, 300)
    assert "  mJ/tok 15 (3 W)" in line
