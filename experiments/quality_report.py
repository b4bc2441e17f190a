"""Compares pretraining runs: final validation CE, sparsity, and one plot over steps.

    python -m experiments.quality_report --baseline=l1_0.jsonl l1_*.jsonl \
        --plot=sparsity_ce.png

Each input is a copy of a run's metrics.jsonl (`twell_jax.trainer` writes it); its
label is the file's stem. The table goes to stdout in Markdown, for README.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from absl import app, flags

from twell_jax import metrics

_BASELINE = flags.DEFINE_string("baseline", None, "metrics.jsonl of the reference run.")
_PLOT = flags.DEFINE_string("plot", None, "PNG of sparsity and val CE against step.")


def summarize(records: Sequence[dict]) -> dict:
    """The last train and eval records of a run, reduced to the reported numbers.

    Raises:
      ValueError: the run has no train or no eval record.
    """
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    if not train or not evals:
        raise ValueError("a run needs at least one train and one eval record")
    last, val = train[-1], evals[-1]
    return {
        "step": last["step"],
        "l1_coef": last.get("l1_coef"),
        "val_ce": val["val_ce"],
        "l0_mean": last["l0_mean"],
        "sparsity_mean": last["sparsity_mean"],
        "alive_mean": last["alive_mean"],
        "tokens_per_s": last.get("tokens_per_s"),
    }


def table(runs: dict[str, dict], baseline: str | None) -> str:
    """Markdown rows, one per run; CE is also given relative to `baseline`'s."""
    base = runs[baseline]["val_ce"] if baseline else None
    lines = [
        "| run | λ (L1) | steps | val CE | vs baseline | l0 / token / layer | sparsity "
        "| alive neurons | tokens/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in runs.items():
        rel = f"{100 * (s['val_ce'] / base - 1):+.2f}%" if base else "—"
        tps = f"{s['tokens_per_s']:,.0f}" if s["tokens_per_s"] else "—"
        lines.append(
            f"| {name} | {s['l1_coef']:g} | {s['step']} | {s['val_ce']:.4f} | {rel} | "
            f"{s['l0_mean']:.1f} | {100 * s['sparsity_mean']:.2f}% | "
            f"{100 * s['alive_mean']:.1f}% | {tps} |"
        )
    return "\n".join(lines)


def plot(runs: dict[str, list[dict]], path: str | os.PathLike) -> None:
    """Sparsity (1 - l0/N) and validation CE against step, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_sp, ax_ce) = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    for name, records in runs.items():
        train = [r for r in records if r.get("kind") == "train"]
        evals = [r for r in records if r.get("kind") == "eval"]
        ax_sp.plot(
            [r["step"] for r in train], [100 * r["sparsity_mean"] for r in train], label=name
        )
        ax_ce.plot([r["step"] for r in evals], [r["val_ce"] for r in evals], "o-", label=name)
    ax_sp.set(xlabel="step", ylabel="sparsity % (1 - l0/N)", title="FFN sparsity", ylim=(70, 100))
    ax_ce.set(xlabel="step", ylabel="val CE (nats/token)", title="validation CE", yscale="log")
    for ax in (ax_sp, ax_ce):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: Sequence[str]) -> None:
    paths = [Path(p) for p in argv[1:]]
    if _BASELINE.value and Path(_BASELINE.value) not in paths:
        paths.insert(0, Path(_BASELINE.value))
    if not paths:
        raise app.UsageError("give one or more metrics.jsonl files")
    records = {p.stem: metrics.read_metrics(p) for p in paths}
    for name, recs in records.items():
        if not recs:
            raise app.UsageError(f"{name}: no metrics (missing or empty file)")
    baseline = Path(_BASELINE.value).stem if _BASELINE.value else None
    print(table({k: summarize(v) for k, v in records.items()}, baseline))
    if _PLOT.value:
        plot(records, _PLOT.value)


if __name__ == "__main__":
    app.run(main)
