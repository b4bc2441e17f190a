"""The benchmarks' timers (rotation order, per-function stats, round ratios) and the
results-table printer's refusal of files that are not benchmark outputs."""

import json
import pathlib
import subprocess
import sys
import time

import pytest

from experiments import bench_util as bu
from experiments import results_table


def test_time_interleaved_rotates_and_reports_round_ratios():
    calls = []

    def sleeper(name, seconds):
        def fn(x):
            calls.append(name)
            time.sleep(seconds)
            return x

        return fn

    fns = {"slow": sleeper("slow", 0.004), "fast": sleeper("fast", 0.001)}
    out = bu.time_interleaved(fns, 1, warmup=1, reps=4)
    # one warm-up round, then 4 rounds in rotation, every other one reversed
    assert calls == ["slow", "fast"] + ["slow", "fast", "fast", "slow"] * 2
    assert out["slow"]["reps"] == 4 and len(out["fast"]["times_ms"]) == 4
    assert out["slow"]["median_ms"] > out["fast"]["median_ms"] >= 1.0
    assert set(out["ratios"]) == {"slow/fast"}
    assert out["ratios"]["slow/fast"] == pytest.approx(4.0, rel=0.5)


def test_time_interleaved_inner_calls_back_to_back():
    calls = []

    def fn(name):
        def call(x):
            calls.append(name)
            time.sleep(0.002)
            return x

        return call

    out = bu.time_interleaved({"a": fn("a"), "b": fn("b")}, 1, warmup=1, reps=2, inner=3)
    assert calls == ["a", "b"] + ["a"] * 3 + ["b"] * 6 + ["a"] * 3  # warm-up calls each once
    assert out["a"]["reps"] == 2
    assert 2.0 <= out["a"]["median_ms"] < 6.0  # per call, not per batch of 3


def test_time_steps_interleaved_carries_each_state_chain():
    calls = []

    def stepper(name, seconds):
        def step(state, inc):
            calls.append(name)
            time.sleep(seconds)
            return state + inc, {"seen": state}

        return step

    steps = {"slow": stepper("slow", 0.004), "fast": stepper("fast", 0.001)}
    timing, states, auxes = bu.time_steps_interleaved(
        steps, {"slow": 0, "fast": 100}, 1, warmup=1, reps=4
    )
    assert calls == ["slow", "fast"] + ["slow", "fast", "fast", "slow"] * 2
    assert states == {"slow": 5, "fast": 105}  # 1 warm-up + 4 timed calls, one chain each
    assert [a["seen"] for a in auxes["fast"]] == [100, 101, 102, 103, 104]
    assert timing["slow"]["reps"] == 4 and set(timing["ratios"]) == {"slow/fast"}
    assert timing["ratios"]["slow/fast"] == pytest.approx(4.0, rel=0.5)


def test_train_model_benchmark_cli_on_cpu(tmp_path):
    """--mode=train_model on the tiny preset: same start, same first loss, l0 on target."""
    out = tmp_path / "train_model.json"
    flags = "--model_presets=tiny --model_nnz=20 --train_model_batch=2 --model_seq=128 --reps=2"
    flags += " --train_model_set=sparse_ell_width=32"
    args = ["-m", "experiments.benchmark", "--mode=train_model", *flags.split(), f"--out={out}"]
    run = subprocess.run(
        [sys.executable, *args],
        cwd=pathlib.Path(__file__).resolve().parents[1],
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
    table = results_table.train_model_table(res)
    assert "| tiny | 256 |" in table and table.count("\n") == 2


def test_time_fn_reports_per_call_time_of_inner_batches():
    calls = []

    def fn(x):
        calls.append(x)
        time.sleep(0.002)
        return x

    out = bu.time_fn(fn, 0, warmup=2, reps=3, inner=4)
    assert len(calls) == 2 + 3 * 4 and out["reps"] == 3
    assert 2.0 <= out["median_ms"] < 20.0  # per call, not per batch of 4


def test_train_benchmark_runs_on_cpu_with_the_xla_kernels():
    """The --mode=train record on tiny shapes: sparse and dense agree, heavy rows fall back."""
    from experiments import benchmark_train
    from pallas_kernels.sparse_train import SparseTrainConfig

    cfg = SparseTrainConfig(
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


def test_results_table_names_a_file_that_is_not_a_benchmark_output(tmp_path):
    record = tmp_path / "s11_ab.json"
    record.write_text('{"command": "python scratch/ab.py", "results": {}}')
    with pytest.raises(
        SystemExit, match=r"s11_ab\.json: not a --mode=kernel/train/model/train_model"
    ):
        results_table.main([str(record)])


def test_kernel_and_train_benchmarks_import_without_grain():
    """BUILD.md: --mode=kernel/train need only jax and numpy (no data pipeline)."""
    code = "import sys; sys.modules['grain'] = None; import experiments.benchmark"
    root = pathlib.Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root, timeout=300)
