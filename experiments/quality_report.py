r"""Compares pretraining runs: final validation CE and sparsity, throughput and energy
over the second half, and one plot over steps.

    python -m experiments.quality_report --baseline=l1_0.jsonl l1_*.jsonl \
        --plot=sparsity_ce.png

Each input is a run's metrics.jsonl (`twell_jax.trainer` writes it) or a copy of one; its
label is the file's stem, or its directory's name where stems repeat (runs/125m/
metrics.jsonl and runs/125m_dense/metrics.jsonl are "125m" and "125m_dense"). The table
goes to stdout in Markdown, for README.

Exit codes: 0 done, 2 refused in one line before any output (no file given, a missing
file or a directory, a file without a train and an eval record, two inputs no label
tells apart, a --plot that cannot be written).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from absl import app, flags, logging

from experiments import entry_points
from twell_jax import metrics

_BASELINE = flags.DEFINE_string("baseline", None, "metrics.jsonl of the reference run.")
_PLOT = flags.DEFINE_string(
    "plot", None, "PNG of l0, val CE, tokens/s and sparse layers against step."
)


def _last_half_mean(train: Sequence[dict], key: str, scale: float = 1.0) -> float | None:
    """Mean of `key` over the train records of the second half of the run (None if absent)."""
    half = train[-1]["step"] / 2
    values = [r[key] * scale for r in train if r["step"] > half and r.get(key) is not None]
    return sum(values) / len(values) if values else None


def _all_sparse_from(train: Sequence[dict]) -> int | None:
    """First logged step from which every layer ran the sparse kernels to the end."""
    first = None
    for r in train:
        if r.get("use_sparse") and all(r["use_sparse"]):
            first = r["step"] if first is None else first
        else:
            first = None
    return first


def summarize(records: Sequence[dict]) -> dict:
    """The last train and eval records of a run, reduced to the reported numbers, plus
    throughput and energy over the second half of the run.

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
        "tokens_per_s": _last_half_mean(train, "tokens_per_s"),
        "mj_per_token": _last_half_mean(train, "joules_per_token", 1e3),
        "all_sparse_from": _all_sparse_from(train),
    }


def table(runs: dict[str, dict], baseline: str | None) -> str:
    """Markdown rows, one per run; CE and tokens/s are also given relative to `baseline`'s."""
    base = runs[baseline] if baseline else None

    def rel(s: dict, key: str, fmt: str, unit: str = "") -> str:
        if not base or not s[key] or not base[key]:
            return "—"
        return format(s[key] / base[key] - (1 if fmt.endswith("%") else 0), fmt) + unit

    lines = [
        "| run | λ (L1) | steps | val CE | vs baseline | l0 / token / layer | sparsity "
        "| alive neurons | tokens/s, last half | vs baseline | mJ/token, last half "
        "| all layers sparse from step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in runs.items():
        tps = f"{s['tokens_per_s']:,.0f}" if s["tokens_per_s"] else "—"
        mj = f"{s['mj_per_token']:.2f}" if s["mj_per_token"] else "—"
        sparse_from = "—" if s["all_sparse_from"] is None else str(s["all_sparse_from"])
        lines.append(
            f"| {name} | {s['l1_coef']:g} | {s['step']} | {s['val_ce']:.4f} | "
            f"{rel(s, 'val_ce', '+.2%')} | {s['l0_mean']:.1f} | "
            f"{100 * s['sparsity_mean']:.2f}% | {100 * s['alive_mean']:.1f}% | {tps} | "
            f"{rel(s, 'tokens_per_s', '.3f', 'x')} | {mj} | {sparse_from} |"
        )
    return "\n".join(lines)


def plot(runs: dict[str, list[dict]], path: str | os.PathLike) -> None:
    """Four panels against step, one line per run: l0 per token and layer (log scale),
    validation CE, training tokens/s, and how many layers ran the sparse kernels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), constrained_layout=True)
    (ax_l0, ax_ce), (ax_tps, ax_sparse) = axes
    for name, records in runs.items():
        train = [r for r in records if r.get("kind") == "train"]
        evals = [r for r in records if r.get("kind") == "eval"]
        steps = [r["step"] for r in train]
        ax_l0.plot(steps, [r["l0_mean"] for r in train], label=name)
        ax_ce.plot([r["step"] for r in evals], [r["val_ce"] for r in evals], "o-", label=name)
        timed = [r for r in train if r.get("tokens_per_s")]
        ax_tps.plot([r["step"] for r in timed], [r["tokens_per_s"] for r in timed], label=name)
        ax_sparse.plot(steps, [sum(r.get("use_sparse") or []) for r in train], label=name)
    ax_l0.set(xlabel="step", ylabel="non-zeros per token and layer", title="FFN l0", yscale="log")
    ax_ce.set(xlabel="step", ylabel="val CE (nats/token)", title="validation CE", yscale="log")
    ax_tps.set(xlabel="step", ylabel="tokens/s", title="training throughput", ylim=(0, None))
    ax_sparse.set(xlabel="step", ylabel="layers", title="layers on the sparse kernels")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def labels(paths: Sequence[Path]) -> list[str]:
    """One distinct label per input file (module docstring).

    Raises:
      ValueError: a file given twice, or two files no rule here tells apart.
    """
    if len(set(paths)) < len(paths):
        raise ValueError(f"a file is given twice: {[str(p) for p in paths]}")
    stems = [p.stem for p in paths]
    names = [p.parent.name or str(p.parent) if stems.count(p.stem) > 1 else p.stem for p in paths]
    if len(set(names)) < len(names):
        raise ValueError(f"inputs that share a name and a directory name: {names}")
    return names


def _read(paths: Sequence[Path]) -> dict[str, list[dict]]:
    """label -> the run's records, checked before anything is printed or plotted.

    Raises:
      FileNotFoundError, ValueError: no file, a missing file or a directory, two files
        no label tells apart, a file without a train and an eval record (naming it).
    """
    if not paths:
        raise ValueError("give one or more metrics.jsonl files")
    for path in paths:
        if not path.is_file():
            what = "is a directory" if path.is_dir() else "no such file"
            raise FileNotFoundError(f"{path}: {what} (give metrics.jsonl files)")
    records = {}
    for name, path in zip(labels(paths), paths, strict=True):
        recs = [r for r in metrics.read_metrics(path) if isinstance(r, dict)]
        try:
            summarize(recs)
        except KeyError as e:
            raise ValueError(f"{path}: a train or eval record without {e}") from None
        except ValueError as e:
            raise ValueError(f"{path}: not a run's metrics: {e}") from None
        records[name] = recs
    return records


def main(argv: Sequence[str]) -> int:
    # The inputs are positional: only the log filter of entry_points.start_cli applies.
    logging.get_absl_handler().addFilter(entry_points.keep_log_record)
    paths = [Path(p) for p in argv[1:]]
    if _BASELINE.value and Path(_BASELINE.value) not in paths:
        paths.insert(0, Path(_BASELINE.value))
    try:
        entry_points.check_output_file("plot", _PLOT.value)
        records = _read(paths)
    except (FileNotFoundError, ValueError) as e:
        logging.error("refused: %s", e)
        return entry_points.EXIT_REFUSED
    names = list(records)
    baseline = names[paths.index(Path(_BASELINE.value))] if _BASELINE.value else None
    print(table({k: summarize(v) for k, v in records.items()}, baseline))
    if _PLOT.value:
        plot(records, _PLOT.value)
    return 0


if __name__ == "__main__":
    app.run(main)
