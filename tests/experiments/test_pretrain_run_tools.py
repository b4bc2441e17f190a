"""The tools that read a finished pretrain run: the model benchmark, the neuron
profile and the captured-pattern benchmark, and the quality report."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.experiments.cli import refusal, run_module
from tests.experiments.pretrain_cli import REPO
from twell_jax import metrics


@pytest.mark.slow
def test_trained_checkpoint_feeds_the_model_benchmark(straight, data_dir):
    """benchmark_model restores a pretrain workdir and times its body on val tokens."""
    import jax
    import jax.numpy as jnp

    from experiments import benchmark_model

    workdir, _ = straight
    cfg, params, step = benchmark_model.trained_params(str(workdir))
    assert step == 6 and cfg.model.d_model == 64 and cfg.sparsity.l1_coef == 1e-3
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
    (rec,) = benchmark_model.run_trained(
        [str(workdir)], str(data_dir), batch=2, reps=1, compressions=(4,)
    )
    assert rec["step"] == 6 and rec["compression"] == 4 and rec["tokens"] == 2 * 32
    assert len(rec["twell_l0_per_layer"]) == 2 and 0 < rec["twell_l0_mean"] < 256
    assert rec["body_norm_rel_err"] < 1e-2  # CPU: the twell op's XLA path
    with pytest.raises(FileNotFoundError, match="not a pretrain workdir"):
        benchmark_model.trained_params(str(workdir / "checkpoints"))


@pytest.mark.slow
def test_trained_checkpoint_neuron_profile_and_captured_benchmark(straight, data_dir):
    """The neuron profile and the captured-pattern benchmark read a pretrain workdir."""
    from experiments import benchmark_train
    from pallas_kernels import SparseTrainConfig

    workdir, _ = straight
    out = workdir.parent / "profile.json"
    cli = ["-m", "experiments.neuron_profile", f"--workdir={workdir}", f"--data_dir={data_dir}"]
    proc = subprocess.run(
        [sys.executable, *cli, "--batch=2", f"--out={out}"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| layer | l0 |" in proc.stdout
    too_many = subprocess.run(
        [sys.executable, *cli, "--batch=100000"], cwd=REPO, capture_output=True, text=True
    )
    assert "fewer than one batch of 100000" in refusal(too_many)
    prof = json.loads(out.read_text())
    assert prof["command"].startswith(f"python -m experiments.neuron_profile --workdir={workdir}")
    assert prof["step"] == 6 and prof["tokens"] == 64 and len(prof["layers"]) == 2
    for rec in prof["layers"]:
        assert 0 < rec["l0"] <= rec["l0_max"] and 0 <= rec["dead_share"] < 1
        assert rec["top1_share"] <= rec["top10_share"] <= 1 and 0 < rec["hottest_rate"] <= 1
    recs = benchmark_train.run_captured(
        str(workdir), str(data_dir), layers=(0, 1), M=64, reps=1,
        config=SparseTrainConfig(impl="xla"),
        compare=SparseTrainConfig(impl="xla", hot_min_count=10**6),
    )  # fmt: skip
    for layer, rec in enumerate(recs):
        assert rec["layer"] == layer and rec["pattern"] == "captured" and rec["M"] == 64
        # the op saw the layer's real FFN input: its l0 is the profile's
        assert rec["l0"] == pytest.approx(prof["layers"][layer]["l0"], rel=1e-3)
        assert max(rec["grad_rel_err"].values()) < 3e-2
        # the paired ratio of its own rotation, near the ratio of the two medians
        assert 0 < rec["vs_uniform"] < 10
        assert rec["uniform_control"]["sparse_ms"] > 0
        # the compared config in the same rotation, on both inputs
        assert sorted(rec["compare"]) == ["captured", "control", "vs_uniform"]
        assert all(0 < v < 10 for v in rec["compare"].values())


@pytest.mark.slow
def test_quality_report_table_and_plot(tmp_path, straight):
    from experiments import quality_report

    workdir, _ = straight
    records = metrics.read_metrics(workdir / metrics.METRICS_FILE)
    worse = [{**r, "val_ce": r["val_ce"] * 1.1} if r.get("kind") == "eval" else r for r in records]
    summaries = {"base": quality_report.summarize(records), "l1": quality_report.summarize(worse)}
    assert summaries["base"]["step"] == 6
    assert summaries["base"]["l1_coef"] == pytest.approx(1e-3)
    train = [r for r in records if r.get("kind") == "train"]
    late = [r["tokens_per_s"] for r in train if r["step"] > 3 and r.get("tokens_per_s")]
    assert summaries["base"]["tokens_per_s"] == pytest.approx(sum(late) / len(late))
    assert summaries["base"]["mj_per_token"] is None  # no --energy
    every = all(all(r["use_sparse"]) for r in train if r["step"] >= train[-1]["step"])
    assert (summaries["base"]["all_sparse_from"] is not None) == every
    table = quality_report.table(summaries, "base")
    rows = table.splitlines()[2:]
    assert rows[0].startswith("| base |") and "+0.00%" in rows[0]
    assert rows[1].startswith("| l1 |") and "+10.00%" in rows[1]
    quality_report.plot({"base": records, "l1": worse}, tmp_path / "q.png")
    assert (tmp_path / "q.png").stat().st_size > 0
    with pytest.raises(ValueError, match="eval record"):
        quality_report.summarize([r for r in records if r.get("kind") == "train"])


def test_neuron_profile_refusals_are_one_line():
    def profile(*args):
        return run_module("neuron_profile", *args)

    assert "runs/no_such_run" in refusal(profile("--workdir=runs/no_such_run"))
    assert "--batch=0: must be at least 1" in refusal(profile("--workdir=x", "--batch=0"))
    no_dir = profile("--workdir=x", "--out=/nonexistent_dir/profile.json")
    assert "--out=/nonexistent_dir/profile.json: no directory" in refusal(no_dir)


def test_quality_report_labels_runs_apart_by_directory():
    """Two runs' metrics.jsonl share a stem: each gets its directory's name (one stem
    for both merged them into one row, the baseline compared with itself)."""
    from experiments.quality_report import labels

    runs = [Path("runs/125m_dense/metrics.jsonl"), Path("runs/125m/metrics.jsonl")]
    assert labels(runs) == ["125m_dense", "125m"]
    assert labels([Path("l1_0.jsonl"), Path("l1_1e-3.jsonl")]) == ["l1_0", "l1_1e-3"]
    assert labels([*runs, Path("copies/l1.jsonl")]) == ["125m_dense", "125m", "l1"]
    with pytest.raises(ValueError, match="given twice"):
        labels([runs[0], runs[0]])
    with pytest.raises(ValueError, match="share a name and a directory name"):
        labels([Path("a/run/metrics.jsonl"), Path("b/run/metrics.jsonl")])


def test_quality_report_refusals_are_one_line(tmp_path):
    def report(*args):
        return run_module("quality_report", *args)

    only_train = tmp_path / "only_train.jsonl"
    only_train.write_text('{"kind": "train", "step": 1}\n')
    assert "give one or more metrics.jsonl files" in refusal(report())
    assert "no_such.jsonl: no such file" in refusal(report(str(tmp_path / "no_such.jsonl")))
    assert "is a directory" in refusal(report(str(tmp_path)))
    assert "at least one train and one eval record" in refusal(report(str(only_train)))
    no_dir = report("--plot=/nonexistent_dir/q.png", str(only_train))
    assert "--plot=/nonexistent_dir/q.png: no directory" in refusal(no_dir)


def test_quality_report_usage_keeps_its_line_continuation():
    from experiments import quality_report

    assert "l1_*.jsonl \\\n        --plot=" in quality_report.__doc__
