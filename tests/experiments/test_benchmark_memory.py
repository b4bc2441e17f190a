"""experiments/benchmark_memory.py on CPU: the CLI's probes of both FFNs, the batch search
against a fake probe, and how a child's out-of-memory and other failures are reported."""

import json
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from experiments import benchmark_memory as bm
from experiments import benchmark_train_model
from tests.experiments.cli import refusal, run_module

REPO = pathlib.Path(__file__).resolve().parents[2]
PROBE = bm.Probe("tiny", "sparse", 8, 64, 20.0, 2e-5, 2, 8)


@pytest.mark.slow
def test_cli_measures_the_dense_and_the_sparse_step_on_cpu(tmp_path):
    """Both impls, each in its own child: XLA's sizes, no device statistics on a CPU."""
    out = tmp_path / "memory.json"
    flags = "--preset=tiny --batch=2 --seq=64 --model_nnz=20 --steps=2"
    args = [sys.executable, "-m", "experiments.benchmark_memory", *flags.split(), f"--out={out}"]
    run = subprocess.run(args, cwd=REPO, capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["command"] == f"python -m experiments.benchmark_memory {flags} --out={out}"
    assert res["device"] == "cpu" and res["jax"] == jax.__version__
    assert res["allocator"] == "bfc" and res["calib_batch"] == 2 and "search" not in res
    for impl in ("dense", "sparse"):
        rec = res["probes"][impl]
        assert rec["impl"] == impl and rec["fit"] and rec["tokens"] == 128
        assert rec["compiled"]["temp_bytes"] > 0
        assert rec["compiled"]["argument_bytes"] > rec["estimate_bytes"]["state"] // 2
        assert rec["peak_bytes"] is None and rec["bytes_limit"] is None  # a CPU keeps none
        assert len(rec["step_times_ms"]) == 2 and rec["step_ms"] > 0
        assert 10 < rec["l0_first"] < 30 and rec["l0_last"] == pytest.approx(rec["l0_first"])
    assert res["probes"]["dense"]["tail_rows_total"] is None
    assert res["probes"]["sparse"]["dense_fallback_total"] == 0
    temps = [res["probes"][impl]["compiled"]["temp_bytes"] for impl in ("dense", "sparse")]
    assert res["ratios"]["temp_bytes sparse/dense"] == pytest.approx(temps[1] / temps[0])
    assert res["ratios"]["peak_bytes sparse/dense"] is None


def test_the_parent_imports_no_backend():
    """On a GPU a backend in the parent would hold memory the children measure."""
    code = "import sys, experiments.benchmark_memory; print('jax' in sys.modules)"
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert run.stdout.strip() == "False", run.stderr[-2000:]


def _fits_up_to(largest: int):
    def probe(batch):
        return {
            "fit": batch <= largest,
            "peak_bytes": 10 * batch,
            "compiled": {"temp_bytes": batch},
        }

    return probe


@pytest.mark.parametrize(
    "fits_up_to, start, max_batch, step, largest, capped, batches",
    [
        (13, 2, 1024, 1, 13, False, [2, 4, 8, 16, 12, 14, 13]),  # doubling, then bisection
        (13, 16, 1024, 1, 13, False, [16, 8, 12, 14, 13]),  # the start fails: below it
        (1, 1, 1024, 1, 1, False, [1, 2]),
        (99, 3, 10, 1, 10, True, [3, 6, 10]),  # the cap fits: the largest may be more
        (13, 2, 1024, 4, 12, False, [2, 4, 8, 16, 12]),  # to within 4: 12 <= largest < 16
    ],
)
def test_largest_fitting_doubles_then_bisects(
    fits_up_to, start, max_batch, step, largest, capped, batches
):
    found = bm.largest_fitting(_fits_up_to(fits_up_to), start, max_batch, step)
    assert found["largest_batch"] == largest and found["capped"] == capped
    assert [t["batch"] for t in found["trace"]] == batches
    assert [t["fit"] for t in found["trace"]] == [b <= fits_up_to for b in batches]
    assert [t["peak_bytes"] for t in found["trace"]] == [10 * b for b in batches]


def test_largest_fitting_nothing_fits_and_a_failed_probe_stops_it():
    assert bm.largest_fitting(_fits_up_to(0), 4, 64) == {
        "largest_batch": 0,
        "capped": False,
        "trace": [
            {"batch": b, "fit": False, "peak_bytes": 10 * b, "temp_bytes": b} for b in (4, 2, 1)
        ],
    }

    def failing(batch):
        if batch == 16:
            raise bm.ProbeError("the sparse probe at batch 16 exited 1")
        return {"fit": True}

    with pytest.raises(bm.ProbeError, match="batch 16 exited 1"):
        bm.largest_fitting(failing, 2, 1024)


def test_run_searches_each_impl_and_reports_the_ratios():
    """The probe at --batch is measured once and reused by the search."""
    calls = []

    def fake(p):
        calls.append((p.impl, p.batch))
        largest, per_seq = (13, 100) if p.impl == "dense" else (20, 60)
        rec = {"impl": p.impl, "batch": p.batch, "fit": p.batch <= largest}
        if rec["fit"]:
            rec.update(device="fake", jax="0", step_ms=1.0, peak_bytes=per_seq * p.batch)
            rec["compiled"] = {"temp_bytes": per_seq // 10 * p.batch}
        return rec

    out = bm.run(PROBE, ["dense", "sparse"], fake, search=True, max_batch=1024)
    assert calls.count(("dense", 8)) == calls.count(("sparse", 8)) == 1
    assert out["device"] == "fake" and out["probes"]["sparse"]["peak_bytes"] == 480
    assert [out["search"][i]["largest_batch"] for i in ("dense", "sparse")] == [13, 20]
    assert [t["batch"] for t in out["search"]["sparse"]["trace"]] == [8, 16, 32, 24, 20, 22, 21]
    assert out["ratios"] == {
        "peak_bytes sparse/dense": pytest.approx(0.6),
        "temp_bytes sparse/dense": pytest.approx(0.6),
        "largest_batch sparse/dense": pytest.approx(20 / 13),
    }
    assert "ratios" not in bm.run(PROBE, ["sparse"], fake)


def _patch_step_builder(monkeypatch, error: Exception):
    """The child's set-up up to the step builder, which raises `error`."""
    import twell_jax.synthetic

    monkeypatch.setattr(
        twell_jax.synthetic, "synthetic_sparse_params", lambda *a, **k: (None, np.zeros(4))
    )

    def raising(*args):
        raise error

    monkeypatch.setattr(benchmark_train_model, "train_step_and_state", raising)


def test_a_child_out_of_memory_exits_3_with_its_record(monkeypatch, capsys):
    message = "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 123 bytes."
    _patch_step_builder(monkeypatch, jax.errors.JaxRuntimeError(message))
    with pytest.raises(SystemExit) as exit_:
        bm.probe_main(PROBE)
    assert exit_.value.code == bm.OUT_OF_MEMORY == 3
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rec == {"impl": "sparse", "batch": 8, "fit": False, "error": message}


@pytest.mark.parametrize(
    "error", [jax.errors.JaxRuntimeError("INTERNAL: ptxas failed"), ValueError("bad shape")]
)
def test_a_child_failing_otherwise_raises(monkeypatch, error):
    _patch_step_builder(monkeypatch, error)
    with pytest.raises(type(error), match=str(error)):
        bm.probe_main(PROBE)


def test_run_probe_maps_the_child_exit_status():
    seen = {}

    def runner(returncode, stdout="", stderr=""):
        def run(args, **kwargs):
            seen.update(args=args, env=kwargs["env"])
            return subprocess.CompletedProcess(args, returncode, stdout, stderr)

        return run

    env = bm.child_env("bfc", 0.9)
    record = '{"impl": "sparse", "batch": 8, "fit": true, "step_ms": 1.0}'
    assert bm.run_probe(PROBE, env, runner(0, f"noise\n{record}\n"))["step_ms"] == 1.0
    assert seen["args"][1:4] == ["-m", "experiments.benchmark_memory", "--probe"]
    assert {"--ffn_impls=sparse", "--batch=8", "--calib_batch=8", "--set="} <= set(seen["args"])
    assert seen["env"]["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert seen["env"]["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.9"
    oom = bm.run_probe(PROBE, env, runner(3, '{"fit": false, "error": "RESOURCE_EXHAUSTED"}'))
    assert oom == {"impl": "sparse", "batch": 8, "fit": False, "error": "RESOURCE_EXHAUSTED"}
    assert bm.run_probe(PROBE, env, runner(3))["fit"] is False
    with pytest.raises(bm.ProbeError, match=r"(?s)batch 8 exited 1; its stderr ends:\n.*Boom"):
        bm.run_probe(PROBE, env, runner(1, stderr="Traceback ...\nValueError: Boom"))
    with pytest.raises(bm.ProbeError, match=r"exited -9 \(killed by a signal\)"):
        bm.run_probe(PROBE, env, runner(-9))
    with pytest.raises(bm.ProbeError, match="printed no record"):
        bm.run_probe(PROBE, env, runner(0, "no json here"))
    platform_env = bm.child_env("platform", 0.9)
    assert platform_env["XLA_PYTHON_CLIENT_ALLOCATOR"] == "platform"
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in platform_env


def test_importing_it_beside_pretrain_defines_no_clashing_flags():
    """The flags are registered by `define_flags` only, so test processes can import
    this module and experiments.pretrain (both have --preset, --steps, --set)."""
    code = "import experiments.benchmark_memory, experiments.pretrain, experiments.benchmark"
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]


@pytest.mark.parametrize(
    "args, why",
    [
        (["--ffn_impls=bogus"], "--ffn_impls must be some of ('dense', 'sparse')"),
        (["--preset=bogus"], "model preset 'bogus': must be one of"),
        (["--preset=tiny", "--set=nokv"], "--set: 'nokv': expected"),
        (["--preset=tiny", "--set=bogus=1"], "unknown config key 'bogus' for ModelConfig"),
        (["--preset=tiny", "--steps=0"], "--batch, --seq and --steps must be at least 1"),
        (["--out=/nonexistent_dir/x.json"], "--out=/nonexistent_dir/x.json: no directory"),
        (["stray"], "unexpected arguments ['stray']"),
    ],
)
def test_bad_flags_are_refused_in_one_line_before_any_probe(args, why):
    proc = run_module("benchmark_memory", *args)
    assert why in refusal(proc) and proc.stdout == ""
