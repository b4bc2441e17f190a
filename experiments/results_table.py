"""Renders the result tables of docs/results.md from the benchmark JSON under results/.

    python -m experiments.results_table results/kernel_h200.json [results/train_h200.json]

Exit codes: 0 done, 2 refused (no file given, a missing or unreadable file, a JSON that
is not a --mode=kernel/train/model/train_model benchmark output, or one without a key
its table reads: the command, device, jax version and time, a case's numbers).
"""

from __future__ import annotations

import json
from pathlib import Path

from absl import app, logging

from experiments import entry_points


def _also(case: dict, key: str, label: str) -> str:
    """ "; <label> 1.234x" when the case has that ratio (older kernel files lack some)."""
    return f"; {label} {case[key]:.3f}x" if key in case else ""


def kernel_tables(res: dict) -> str:
    head = (
        "| M | nnz/row | dense XLA gated | gate GEMM | D2T two-pass (pack) | D2T fused "
        "| GatedT2D | TwELL gated | speedup | max rel err | dense non-gated | T2D "
        "| TwELL non-gated | speedup |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    rows = [
        f"| {c['M']} | {c['nnz_per_row']:.1f} | {c['dense_gated_ms']:.2f} ms "
        f"({c['dense_gated_tflops']:.0f} TF/s) | {c['gate_gemm_ms']:.2f} | "
        f"{c['d2t_two_pass_ms']:.2f} ({c['pack_ms']:.2f}; "
        f"{c['d2t_two_pass_over_gemm']:.3f}x GEMM"
        f"{_also(c, 'd2t_two_pass_over_gemm_interleaved', 'interleaved')}) | {c['d2t_ms']:.2f} "
        f"({c['d2t_over_gemm']:.2f}x) | {c['gated_t2d_ms']:.2f} | "
        f"{c['twell_gated_ms']:.2f} | **{c['speedup_gated']:.3f}x**"
        f"{_also(c, 'speedup_gated_interleaved', 'interleaved')}"
        f"{_also(c, 'speedup_gated_single_call', 'single calls')} | "
        f"{c['gated_max_rel_err']:.1e} | {c['dense_mlp_ms']:.2f} | {c['t2d_ms']:.2f} | "
        f"{c['twell_mlp_ms']:.2f} | {c['speedup_nongated']:.2f}x |"
        for c in res["cases"]
    ]
    sweep = "\n\n| nnz/row (M=131072) | dense ms | TwELL ms | speedup | overflow tiles |\n"
    sweep += "|---|---|---|---|---|\n"
    sweep += "\n".join(
        f"| {s['nnz_per_row']:.0f} ({100 * s['nnz_per_row'] / 5632:.1f}%) | "
        f"{s['dense_gated_ms']:.2f} | {s['twell_gated_ms']:.2f} | {s['speedup_gated']:.2f}x | "
        f"{s['overflow_tiles']} |"
        for s in res.get("sweep", [])
    )
    return head + "\n".join(rows) + sweep


def train_table(res: dict) -> str:
    head = (
        "| nnz/row | sparse fwd+bwd | dense fwd+bwd | speedup | temp MB sparse / dense "
        "| grad rel err (dx, dWg, dWu, dWd) |\n|---|---|---|---|---|---|\n"
    )
    rows = []
    for c in res["cases"]:
        mem_s = c["sparse_memory"]["temp_bytes"] / 1e6
        mem_d = c["dense_memory"]["temp_bytes"] / 1e6
        errs = ", ".join(f"{v:.1e}" for v in c["grad_rel_err"].values())
        rows.append(
            f"| {c['l0']:.1f} | {c['sparse_ms']:.2f} ms | {c['dense_ms']:.2f} ms | "
            f"**{c['speedup']:.2f}x** | {mem_s:.0f} / {mem_d:.0f} | {errs} |"
        )
    return head + "\n".join(rows)


def _model_row(name: str, c: dict) -> str:
    return (
        f"| {name} | {c.get('compression', 8)} | {c['tokens']} | {c['twell_l0_mean']:.1f} | "
        f"{c['dense_tokens_per_ms']:.1f} | {c['twell_tokens_per_ms']:.1f} | "
        f"**{100 * (c['speedup'] - 1):+.1f}%** | {c['twell_overflow_tiles']} | "
        f"{c['body_norm_rel_err']:.1e} |"
    )


def _trained_name(c: dict) -> str:
    """A --model_workdirs record's row name: its run (the workdir's name), λ and step."""
    run = Path(c["workdir"]).name if c.get("workdir") else "trained"
    return f"{run}, λ={c['l1_coef']:g} (step {c['step']})"


def model_table(res: dict) -> str:
    head = (
        "| model | C | tokens | l0 (twell) | dense tokens/ms | twell tokens/ms | change "
        "| overflow tiles | body norm rel err |\n|---|---|---|---|---|---|---|---|---|\n"
    )
    rows = [_model_row(c["preset"], c) for c in res["cases"]]
    rows += [_model_row(_trained_name(c), c) for c in res.get("trained", [])]
    return head + "\n".join(rows)


def _temp_gb(case: dict) -> str:
    """XLA temp memory of the two steps, or "-" for records without it."""
    mem = [case.get(f"{impl}_memory", {}).get("temp_bytes") for impl in ("sparse", "dense")]
    return "-" if None in mem else " / ".join(f"{b / 1e9:.1f}" for b in mem)


def _train_model_name(c: dict) -> str:
    """The preset, or for a checkpoint's record (--train_model_workdir) its run and step."""
    return c.get("preset") or f"{Path(c['workdir']).name} step {c['step']}"


def _energy_cells(c: dict) -> str:
    """ "mJ/token dense / sparse | dense / sparse" cells of a --energy record."""
    mj = [1e3 * c[f"{impl}_joules_per_token"] for impl in ("dense", "sparse")]
    return f" {mj[0]:.3g} / {mj[1]:.3g} | {c['energy_ratio']:.3f}x |"


def train_model_table(res: dict) -> str:
    energy = "energy" in res  # --energy: two more columns
    head = (
        "| model | tokens/step | l0 dense / sparse (first -> last step) | dense tokens/ms "
        "| sparse tokens/ms | change | first loss dense / sparse | tail rows, fallbacks "
        "| temp GB sparse / dense |"
        + (" mJ/token dense / sparse | energy dense / sparse |" if energy else "")
        + "\n|---|---|---|---|---|---|---|---|---|"
        + ("---|---|" if energy else "")
        + "\n"
    )
    rows = [
        f"| {_train_model_name(c)} | {c['tokens']} | {c['dense_l0_first']:.1f} -> "
        f"{c['dense_l0_last']:.1f} / {c['sparse_l0_first']:.1f} -> {c['sparse_l0_last']:.1f} | "
        f"{c['dense_tokens_per_ms']:.1f} | {c['sparse_tokens_per_ms']:.1f} | "
        f"**{100 * (c['speedup'] - 1):+.1f}%** | "
        f"{c['first_loss_dense']:.4f} / {c['first_loss_sparse']:.4f} | "
        f"{c['tail_rows_total']}, {c['dense_fallback_total']} | {_temp_gb(c)} |"
        + (_energy_cells(c) if energy else "")
        for c in res["cases"]
    ]
    return head + "\n".join(rows)


TABLES = {
    "kernel": kernel_tables,
    "train": train_table,
    "model": model_table,
    "train_model": train_model_table,
}


def render(path: str) -> str:
    """The header line and table of one benchmark output file.

    Raises:
      OSError: the file cannot be read.
      ValueError: it is not JSON, or not the output of a --mode in `TABLES`.
    """
    with open(path) as f:
        res = json.load(f)
    if not isinstance(res, dict):
        raise ValueError(f"{path}: not a benchmark output (a JSON {type(res).__name__})")
    if res.get("mode") not in TABLES:
        raise ValueError(
            f"{path}: not a --mode={'/'.join(TABLES)} benchmark output (mode="
            f"{res.get('mode')!r}); the one-off A/B records under results/ hold their "
            "numbers under 'results' (or top-level keys) and their script under 'script'"
        )
    missing = [key for key in ("command", "device", "jax", "time") if key not in res]
    if missing:
        raise ValueError(f"{path}: a --mode={res['mode']} output without {missing}")
    head = f"`{res['command']}` ({res['device']}, jax {res['jax']}, {res['time']})"
    try:
        table = TABLES[res["mode"]](res)
    except KeyError as e:
        raise ValueError(f"{path}: a --mode={res['mode']} output without {e}") from None
    return f"{head}\n\n{table}"


def main(argv):
    paths = argv[1:]
    try:
        if not paths:
            raise ValueError("give one or more benchmark JSON files (results/*.json)")
        # Every file is read before anything is printed, so a refusal leaves no tables.
        tables = [render(path) for path in paths]
    except (OSError, ValueError) as e:
        logging.error("refused: %s", e)
        return entry_points.EXIT_REFUSED
    for table in tables:
        print(table)
        print()
    return 0


if __name__ == "__main__":
    app.run(main)
