"""The benchmark entry points on CPU: --mode=train_model, the train-MLP record, the
results-table printer, check_train_memory's --help, and the kernel benchmarks' import
without the data pipeline."""

import json
import pathlib
import re
import subprocess
import sys

import pytest

import pallas_kernels
from experiments import entry_points, results_table
from tests.experiments.cli import refusal, run_module

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_train_model_benchmark_cli_on_cpu(tmp_path):
    """--mode=train_model on the tiny preset: same start, same first loss, l0 on target."""
    out = tmp_path / "train_model.json"
    flags = "--model_presets=tiny --model_nnz=20 --train_model_batch=2 --model_seq=128 --reps=2"
    flags += " --train_model_set=sparse_ell_width=32"
    args = ["-m", "experiments.benchmark", "--mode=train_model", *flags.split(), f"--out={out}"]
    run = subprocess.run(
        [sys.executable, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads(out.read_text())
    (rec,) = res["cases"]
    assert res["mode"] == "train_model" and rec["preset"] == "tiny"
    assert rec["model_overrides"] == {"sparse_ell_width": "32"}
    assert rec["calls_per_chain"] == 4 and rec["reps"] == 2 and rec["tokens"] == 256
    # Same weights and batch: only the kernels' rounding separates the first losses.
    assert rec["first_loss_sparse"] == pytest.approx(rec["first_loss_dense"], rel=1e-3)
    assert rec["first_grad_norm_sparse"] == pytest.approx(rec["first_grad_norm_dense"], rel=1e-2)
    for impl in ("dense", "sparse"):
        assert 10 < rec[f"{impl}_l0_first"] < 30
        # lr 1e-12: the weights, and so the sparsity, stay where they were calibrated
        assert rec[f"{impl}_l0_last"] == pytest.approx(rec[f"{impl}_l0_first"], rel=1e-3)
        assert rec[f"{impl}_memory"]["temp_bytes"] > 0  # XLA's compiled sizes of each step
        assert rec[f"{impl}_memory"]["argument_bytes"] > rec["tokens"] * 8  # state + batch
    assert rec["sparse_layers_last"] == 4  # the tiny preset's layers, all sparse
    assert rec["dense_fallback_total"] == 0
    assert rec["speedup"] == pytest.approx(rec["dense_ms"] / rec["sparse_ms"])
    assert "energy" not in res and "dense_joules_per_token" not in rec  # no --energy
    assert len(rec["sparse_l0_per_layer"]) == 4
    table = results_table.train_model_table(res)
    assert "| tiny | 256 |" in table and table.count("\n") == 2


@pytest.mark.slow
def test_model_benchmark_cli_on_cpu(tmp_path):
    """--mode=model on the tiny preset: one record per compression, l0 near the target."""
    out = tmp_path / "model.json"
    flags = "--model_presets=tiny --model_nnz=20 --model_batch=2 --model_seq=128 --reps=2"
    args = ["-m", "experiments.benchmark", "--mode=model", *flags.split(), f"--out={out}"]
    run = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["mode"] == "model"
    assert sorted(c["compression"] for c in res["cases"]) == [2, 8]
    for rec in res["cases"]:
        assert rec["preset"] == "tiny" and rec["tokens"] == 256
        assert 15 < rec["twell_l0_mean"] < 30
        assert rec["body_norm_rel_err"] < 2e-2  # the TwELL body against the dense body
        assert rec["speedup"] == pytest.approx(rec["dense_ms"] / rec["twell_ms"])


def test_train_benchmark_runs_on_cpu_with_the_xla_kernels():
    """The --mode=train record on tiny shapes: sparse and dense agree, heavy rows fall back."""
    from experiments import benchmark_train

    cfg = pallas_kernels.SparseTrainConfig(
        impl="xla",
        ell_width=16,
        tail_capacities=(0, 4),
    )
    light, heavy = benchmark_train.run(
        M=40, H=64, N=256, nnz_targets=(5, 200), reps=2, config=cfg, breakdown=True
    )
    assert 3 < light["l0"] < 8 and light["dense_fallback"] == 0
    assert heavy["tail_rows"] == 40 and heavy["dense_fallback"] == 1
    for rec in (light, heavy):
        assert max(rec["grad_rel_err"].values()) < 2e-2  # bf16, norm-relative
        assert rec["sparse_ms"] > 0 and rec["dense_ms"] > 0
        assert {"gate_gemm", "compact", "spmm_csc"} <= set(rec["breakdown_ms"])


def test_on_cpu_the_kernel_mode_is_refused_and_the_train_mode_prints_its_records():
    kernel = run_module("benchmark", "--mode=kernel", "--tokens=256", "--d_model=128")
    assert "refused: --mode=kernel times the Pallas kernels and needs a GPU" in refusal(kernel)
    heavy = run_module("benchmark", "--mode=model", "--pattern=heavy_rows")
    assert "--pattern=heavy_rows is not implemented for --mode=model" in refusal(heavy)
    flags = ["--train_tokens=64", "--d_model=64", "--d_ff=256", "--train_nnz=10", "--reps=2"]
    compare = "--train_config_compare=hot_min_skew=0"
    train = run_module("benchmark", "--mode=train", *flags, compare)
    assert train.returncode == 0, train.stderr[-3000:]
    (rec,) = [json.loads(line) for line in train.stdout.splitlines()]
    assert rec["M"] == 64 and rec["nnz_target"] == 10 and rec["sparse_ms"] > 0
    assert rec["compare"]["sparse_ms"] > 0 and rec["compare"]["sparse_b/sparse"] > 0
    assert train.stderr.count("CPU timings say nothing about GPU speed") == 1


def test_the_train_tune_mode_prints_its_records():
    # The real sweep takes a minute on the CPU: its records are stubbed, the printing is not.
    code = (
        "import sys; from absl import app; from experiments import benchmark, benchmark_train; "
        "benchmark_train.tune = lambda **kw: [{'launch': kw['M']}]; "
        "sys.argv = ['benchmark', '--mode=train_tune', '--train_tokens=64']; "
        "app.run(benchmark.main)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ['{"launch": 64}']


def test_results_table_names_a_file_that_is_not_a_benchmark_output(tmp_path, caplog):
    record = tmp_path / "one_off_ab.json"
    record.write_text('{"command": "python scratch/ab.py", "results": {}}')
    assert results_table.main(["results_table", str(record)]) == entry_points.EXIT_REFUSED
    assert re.search(
        r"refused: .*one_off_ab\.json: not a --mode=kernel/train/model/train_model", caplog.text
    )


def test_results_table_help_and_a_missing_file():
    help_ = run_module("results_table", "--help")
    assert "python -m experiments.results_table results/" in help_.stdout, help_.stderr
    assert "Traceback" not in help_.stderr
    missing = run_module("results_table", "results/no_such_benchmark.json")
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    (line,) = missing.stderr.splitlines()
    assert "refused: " in line and "no_such_benchmark.json" in line


def test_check_train_memory_help_prints_usage_without_running():
    proc = run_module("check_train_memory", "--help")
    assert "python -m experiments.check_train_memory" in proc.stdout, proc.stderr
    assert "temp MB" not in proc.stdout and "Traceback" not in proc.stderr


def test_synthetic_benchmarks_import_without_grain():
    """BUILD.md: --mode=kernel/train and the synthetic --mode=train_model need no data
    pipeline (grain only for a run's own batches)."""
    code = (
        "import sys; sys.modules['grain'] = None; import experiments.benchmark; "
        "import experiments.benchmark_train_model"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=300)


@pytest.mark.parametrize(
    "args, why",
    [
        (["--mode=train", "--out=/nonexistent_dir/x.json"], "--out=/nonexistent_dir/x.json: no"),
        (["--mode=model", "--model_presets=tiny,bogus"], "--model_presets: model preset 'bogus'"),
        (["--mode=switch", "--model_presets=tiny,bogus"], "--model_presets: model preset"),
        (["--mode=generate", "--model_presets=bogus"], "--model_presets: model preset"),
        (["--mode=train_model", "--model_presets=bogus"], "--model_presets: model preset"),
        (["--mode=decode", "--decode_config=bogus=1"], "--decode_config=bogus=1: unknown"),
        (["--mode=tune", "--tune_t2d_cfg=1,2"], "--tune_t2d_cfg=1,2: want <g,w,bh>:<g,w,bh>"),
        (["--mode=tune", "--tune_pack_cfg=a"], "--tune_pack_cfg=a:"),
        (["--mode=switch", "--switch_holdout=nosuch:0.5"], "--switch_holdout=nosuch:0.5:"),
        (["--mode=switch", "--switch_holdout=skew:x"], "sigma is not a number"),
        (["--mode=model", "--model_workdirs=runs/nosuch"], "--model_workdirs: runs/nosuch is"),
        (["--mode=train", "--tokens=abc"], "--tokens=abc: not an int"),
        (["--mode=train", "--train_config=bogus=1"], "--train_config: unknown config key"),
        (["--mode=train", "--train_config=nokv"], "--train_config: 'nokv': expected"),
        (["--mode=train", "--train_config_compare=nokv"], "--train_config_compare: 'nokv'"),
        (["--mode=train", "--reps=0"], "--reps=0: must be at least 1"),
        (["--mode=train_model", "--train_model_workdir=runs/nosuch"], "--train_model_workdir:"),
        (["--mode=train_model", "--train_model_set=nokv"], "--train_model_set: 'nokv'"),
        (["--mode=decode", "--decode_kernel_trace"], "--decode_kernel_trace records the GPU"),
        (["--mode=generate", "--decode_kernel_trace"], "--decode_kernel_trace records the GPU"),
    ],
)
def test_values_found_bad_are_refused_before_any_measurement(args, why):
    proc = run_module("benchmark", *args)
    assert why in refusal(proc)
    assert proc.stdout == ""  # nothing measured or printed


def test_the_switch_mode_runs_at_one_rep(tmp_path):
    """--reps=1 times one call per half of the dense/sparse rotation (and --out records
    the command)."""
    out = tmp_path / "switch.json"
    flags = ["--mode=switch", "--model_presets=tiny", "--train_tokens=64", "--reps=1"]
    proc = run_module("benchmark", *flags, "--switch_l0_grid=8", f"--out={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["command"].startswith("python -m experiments.benchmark --mode=switch")
    (case,) = res["cases"]
    assert case["preset"] == "tiny" and json.loads(proc.stdout.splitlines()[-1])["preset"]
    assert list(case["patterns"]) == ["uniform", "skew", "skew:0.5", "heavy_rows"]
    assert len(case["hot_shift"]) % 2 == 0


def test_the_tune_mode_prints_json_lines(capsys):
    import jax.numpy as jnp

    from experiments import benchmark_tune
    from pallas_kernels.twell.config import PackConfig

    rows = benchmark_tune._time_configs(
        "pack", [PackConfig()], lambda cfg: lambda x: x + 1, (jnp.ones(4),),
        warmup=0, reps=1, inner=1,
    )  # fmt: skip
    (line,) = capsys.readouterr().out.splitlines()
    assert json.loads(line) == {"kind": "pack", **rows[0]}


def test_results_table_refuses_a_list_and_a_record_without_its_command(tmp_path, caplog):
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    assert results_table.main(["results_table", str(listed)]) == entry_points.EXIT_REFUSED
    assert "list.json: not a benchmark output (a JSON list)" in caplog.text
    bare = tmp_path / "bare.json"
    bare.write_text('{"mode": "train", "cases": []}')
    assert results_table.main(["results_table", str(bare)]) == entry_points.EXIT_REFUSED
    assert "bare.json: a --mode=train output without ['command', 'device', 'jax'" in caplog.text


def test_results_table_names_a_trained_run_by_its_workdir():
    case = {"compression": 8, "tokens": 64, "twell_l0_mean": 5.0, "dense_tokens_per_ms": 2.0,
            "twell_tokens_per_ms": 1.0, "speedup": 0.5, "twell_overflow_tiles": 0,
            "body_norm_rel_err": 1e-3}  # fmt: skip
    trained = {**case, "workdir": "/tmp/runs/350m_l1_1e-3", "l1_coef": 1e-3, "step": 9}
    table = results_table.model_table({"cases": [], "trained": [trained]})
    assert "| 350m_l1_1e-3, λ=0.001 (step 9) | 8 |" in table and "125m" not in table
