"""Training metrics on the host: interval reduction, progress lines, JSONL log, PNG plot.

The training loop keeps the device metrics of every step since the last log line
(`twell_jax.train.make_train_step`'s dict) and hands them to `reduce_interval`, which
returns one JSON-friendly record. `MetricsWriter` appends records to `metrics.jsonl`
(one line per logged step, plus `"kind": "eval"` lines), and `plot_metrics` turns that
file into a PNG of train / val CE and l0 against the step.

Record keys: `step`, `kind` ("train" or "eval"); train records carry the scalars of the
train step (loss, ce, l1_loss, l1_coef, grad_norm, lr), the per-layer lists l1, l0,
sparsity, alive, use_sparse (and with the sparse switch hot_share, tail_load and the
sparse overflow counters), their layer means
`l0_mean`, `sparsity_mean`, `alive_mean`, `tokens_per_s`, and the run's count of skipped
non-finite steps so far `skipped_steps` (the trainer adds it); with an energy meter
(`--energy`) also `joules_per_token` and `watts` (`energy_fields`); eval records carry
`val_ce`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "metrics.png"

# How per-step values combine over a log interval: state-like values (the schedule,
# the dead-neuron fraction, the sparse switch) are read at the interval's last step,
# event counters are summed, everything else is averaged.
LAST_VALUE_KEYS = ("lr", "l1_coef", "alive", "use_sparse")
SUM_KEYS = ("tail_rows", "dense_fallback")
# Per-layer [L] metrics that also get a layer-mean `<key>_mean` entry.
LAYER_MEAN_KEYS = ("l0", "sparsity", "alive")


def _jsonable(value: Any) -> Any:
    """numpy scalars / arrays -> Python floats, ints, bools and lists."""
    array = np.asarray(value)
    if array.dtype == bool:
        return array.tolist()
    if np.issubdtype(array.dtype, np.integer):
        return array.astype(np.int64).tolist()
    return array.astype(np.float64).tolist()


def reduce_interval(
    steps: Sequence[Mapping[str, Any]], step: int, tokens_per_s: float | None = None
) -> dict[str, Any]:
    """Combines the host metrics of the steps of one log interval into one record.

    Args:
      steps: per-step metrics (numpy scalars or [L] arrays, e.g. `train.host_metrics`),
        oldest first; at least one.
      step: the optimizer step count after the interval's last step.
      tokens_per_s: training throughput over the interval, if measured.

    Returns:
      A JSON-friendly train record (see the module docstring).
    """
    if not steps:
        raise ValueError("reduce_interval needs the metrics of at least one step")
    record: dict[str, Any] = {"step": int(step), "kind": "train"}
    for key in steps[-1]:
        values = np.stack([np.asarray(s[key]) for s in steps])
        if key in LAST_VALUE_KEYS:
            value = values[-1]
        elif key in SUM_KEYS:
            value = values.sum(axis=0)
        else:
            value = values.astype(np.float64).mean(axis=0)
        record[key] = _jsonable(value)
        if key in LAYER_MEAN_KEYS:
            record[f"{key}_mean"] = float(np.mean(value))
    if tokens_per_s is not None:
        record["tokens_per_s"] = float(tokens_per_s)
    return record


def energy_fields(joules: float | None, seconds: float, tokens: int) -> dict[str, float]:
    """{"joules_per_token", "watts"} of an interval that drew `joules` over `seconds`
    and trained `tokens` tokens; {} without a reading (None) or without tokens."""
    if joules is None or tokens <= 0 or seconds <= 0:
        return {}
    return {"joules_per_token": joules / tokens, "watts": joules / seconds}


def format_train_line(record: Mapping[str, Any], total_steps: int, d_ff: int) -> str:
    """One human-readable progress line of a train record.

    `l1` is the lambda-weighted penalty added to CE; `l0` the mean non-zero FFN
    activations per token (over layers) out of N = d_ff. With the sparse kernels the
    line also counts the layers on them and the interval's overflow events.
    """
    tps = record.get("tokens_per_s")
    line = (
        f"step {record['step']:>6}/{total_steps}  loss {record['loss']:.4f}  "
        f"ce {record['ce']:.4f}  l1 {record['l1_loss']:.4f}  "
        f"l0 {record['l0_mean']:.1f}/{d_ff}  sparsity {100 * record['sparsity_mean']:.2f}%  "
        f"alive {100 * record['alive_mean']:.1f}%  "
        f"tok/s {'-' if tps is None else f'{tps:,.0f}'}  lr {record['lr']:.3e}"
    )
    if "joules_per_token" in record:
        line += f"  mJ/tok {1e3 * record['joules_per_token']:.3g} ({record['watts']:.0f} W)"
    if record.get("skipped_steps"):
        line += f"  skipped {record['skipped_steps']}"
    if all(k in record for k in SUM_KEYS):  # ffn_impl="sparse": overflow is never silent
        line += (
            f"  sparse layers {sum(record['use_sparse'])}/{len(record['use_sparse'])}"
            f"  tail rows {sum(record['tail_rows'])}"
            f"  dense fallbacks {sum(record['dense_fallback'])}"
        )
    return line


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Reads a metrics JSONL file; a truncated last line (a crash mid-write) is skipped."""
    path = Path(path)
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


class MetricsWriter:
    """Appends metric records to `<workdir>/metrics.jsonl`.

    On resume from step s, records of steps after s are dropped first: they were written
    by a run that crashed after its last checkpoint and are about to be redone.
    """

    def __init__(self, workdir: str | os.PathLike, resume_step: int = 0):
        """Opens the file for appending, truncating records after `resume_step`."""
        self.path = Path(workdir) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_step]
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, self.path)
        self._file = self.path.open("a")

    def write(self, record: Mapping[str, Any]) -> None:
        """Appends one record as a JSON line and flushes it (the file is always usable)."""
        self._file.write(json.dumps(dict(record)) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def plot_metrics(
    records: Sequence[Mapping[str, Any]], path: str | os.PathLike, title: str = ""
) -> None:
    """Writes a PNG of CE (train and val) and mean l0 / sparsity against the step.

    Args:
      records: metric records, e.g. `read_metrics(workdir / METRICS_FILE)`.
      path: output PNG path (written atomically).
      title: figure title, e.g. the preset and L1 coefficient.
    """
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and in tests
    import matplotlib.pyplot as plt

    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    fig, (ax_ce, ax_l0) = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    ax_ce.plot([r["step"] for r in train], [r["ce"] for r in train], label="train CE")
    if evals:
        ax_ce.plot([r["step"] for r in evals], [r["val_ce"] for r in evals], "o-", label="val CE")
    ax_ce.set(xlabel="step", ylabel="cross-entropy (nats/token)", title="CE")
    ax_ce.legend()
    ax_ce.grid(alpha=0.3)

    steps = [r["step"] for r in train]
    ax_l0.plot(steps, [r["l0_mean"] for r in train], color="C2", label="l0 (mean over layers)")
    ax_l0.set(xlabel="step", ylabel="non-zero FFN activations per token", title="l0")
    ax_l0.grid(alpha=0.3)
    ax_sp = ax_l0.twinx()
    ax_sp.plot(
        steps,
        [100 * r["sparsity_mean"] for r in train],
        color="C3",
        alpha=0.6,
        linestyle="--",
        label="sparsity %",
    )
    ax_sp.set_ylabel("sparsity % (1 - l0/N)")
    lines = ax_l0.get_lines() + ax_sp.get_lines()
    ax_l0.legend(lines, [line.get_label() for line in lines], loc="center right")
    if title:
        fig.suptitle(title)

    path = Path(path)
    tmp = path.with_name(f".{path.stem}.tmp{path.suffix}")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)
