"""Compiled temporary memory of the sparse and dense training MLP steps, and the
sparse op's dense fallback at the production shape (GPU).

    python -m experiments.check_train_memory

M=16384, H=2048, N=5632, ~29 non-zeros per row, with 3000 rows of ~N/2 positives
(more than the largest tail bucket, so the dense fallback runs). Prints XLA's temp
allocation of each value_and_grad step, then the fallback's loss and gradients
against the dense step's. One `experiments.benchmark_train.run` record (timed once).
"""

from __future__ import annotations

from absl import app

from experiments import benchmark_train, entry_points


def main(argv) -> int:
    if not entry_points.start_cli(argv):
        return entry_points.EXIT_REFUSED
    (rec,) = benchmark_train.run(
        M=16384, H=2048, N=5632, nnz_targets=(29.0,), reps=1, heavy_rows=3000, breakdown=False
    )
    for name in ("sparse", "dense"):
        memory = rec[f"{name}_memory"]
        temp = memory.get("temp_bytes")
        shown = f"{temp / 2**20:.1f}" if temp is not None else memory["memory_analysis_error"]
        print(f"{name} temp MB {shown}", flush=True)
    errs = [round(rec["grad_rel_err"][k], 5) for k in ("dx", "dWg", "dWu", "dWd")]
    print(
        f"heavy: fallback {rec['dense_fallback']} tail_rows {rec['tail_rows']} "
        f"loss {rec['sparse_loss']} {rec['dense_loss']} grad rel (dx, dWg, dWu, dWd) {errs}"
    )
    return 0


if __name__ == "__main__":
    app.run(main)
