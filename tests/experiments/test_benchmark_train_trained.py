"""--mode=train_model on a pretrain checkpoint (`benchmark_train_model.run_trained`) and
its joules per token, on CPU: a 2-layer run of the real trainer (sparse FFNs, 8 steps)
is timed dense against sparse on its own batches, with a fake NVML board
(tests/fake_pynvml.py) behind the energy meter."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from experiments import benchmark_train_model, results_table
from tests.corpora import prepare_byte_corpus, write_text_corpus
from tests.fake_pynvml import FakeNvml, install_module
from twell_jax import config, energy, trainer

REPO = Path(__file__).resolve().parents[2]
STEPS = 8
VOCAB = 264


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(workdir, data_dir, summary) of a finished 8-step run."""
    root = tmp_path_factory.mktemp("trained")
    paths, _ = write_text_corpus(root)
    prepare_byte_corpus(paths, root / "data")
    model = config.model_preset(
        "tiny", vocab_size=VOCAB, d_model=64, d_ff=256, n_layers=2, n_heads=2, seq_len=32,
        ffn_impl="sparse", sparse_ell_width=32,
    )  # fmt: skip
    cfg = config.TrainConfig(
        model=model,
        batch_size=4,
        optim=config.OptimConfig(lr=1e-2, warmup_steps=1, total_steps=STEPS),
        sparsity=config.SparsityConfig(l1_coef=1e-3, sparse_switch="l0"),
        log_every=STEPS,
        eval_every=1000,
        eval_batches=1,
        checkpoint_every=1000,
    )
    summary = trainer.run(cfg, trainer.RunOptions(str(root / "run"), str(root / "data")))
    assert summary["step"] == STEPS
    return root / "run", root / "data", summary


def test_trained_checkpoint_is_timed_on_its_batches_with_energy(run, monkeypatch):
    workdir, data_dir, summary = run
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(watts=300.0))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # the fake's one board
    with energy.EnergyMeter() as meter:
        rec = benchmark_train_model.run_trained(workdir, data_dir, batch=2, reps=2, meter=meter)
    assert rec["step"] == STEPS and rec["run_ffn_impl"] == "sparse"
    assert rec["tokens"] == 2 * 32 and rec["seq"] == 32 and rec["batches"] == 4
    assert rec["calls_per_chain"] == 4 and rec["reps"] == 2
    # The checkpoint's weights: the loss is the trained model's, far below a fresh
    # model's log(vocab), and the same through both FFN paths on the same first batch.
    assert rec["first_loss_dense"] < np.log(VOCAB) - 1.0, (rec["first_loss_dense"], summary)
    assert rec["first_loss_sparse"] == pytest.approx(rec["first_loss_dense"], rel=1e-2)
    for impl in ("dense", "sparse"):
        assert len(rec[f"{impl}_l0_per_layer"]) == 2
        assert 0 < min(rec[f"{impl}_l0_per_layer"]) <= max(rec[f"{impl}_l0_per_layer"]) <= 256
        # lr 1e-12 keeps the weights: l0 moves only with the batch
        assert rec[f"{impl}_memory"]["temp_bytes"] > 0
        # The fake board draws 300 W whatever runs: joules follow the timed seconds.
        # The meter is read just outside each timed step: biased high on a loaded CPU.
        assert 0.9 * 300.0 <= rec[f"{impl}_watts"] <= 1.5 * 300.0
        assert rec[f"{impl}_joules_per_token"] > 0
    assert rec["sparse_layers_last"] == 2  # every layer held on the sparse kernels
    assert 0 <= rec["run_cutoff_sparse_layers"] <= 2
    assert rec["energy_ratio"] == pytest.approx(
        rec["dense_joules_per_token"] / rec["sparse_joules_per_token"]
    )


def test_run_switch_keeps_the_layers_the_run_would_run_dense(run, monkeypatch):
    """A run cutoff of 0 puts every layer on the dense branch of the sparse model."""
    from experiments import pretrain_run

    workdir, data_dir, _ = run
    load = pretrain_run.load_params

    def no_sparse_layers(path):
        cfg, params, step = load(path)
        sp = dataclasses.replace(cfg.sparsity, sparse_l0_cutoff=0.0)
        return dataclasses.replace(cfg, sparsity=sp), params, step

    monkeypatch.setattr(pretrain_run, "load_params", no_sparse_layers)
    rec = benchmark_train_model.run_trained(workdir, data_dir, batch=2, reps=2, run_switch=True)
    assert rec["run_switch"] and rec["sparse_layers_first"] == rec["sparse_layers_last"] == 0
    assert rec["first_loss_sparse"] == pytest.approx(rec["first_loss_dense"], rel=1e-2)


@pytest.mark.slow
def test_train_model_cli_reads_a_workdir_and_writes_energy(run, tmp_path):
    workdir, data_dir, _ = run
    out = tmp_path / "train_model.json"
    fake_dir = install_module(tmp_path / "fake_nvml")
    env = {**os.environ, "PYTHONPATH": f"{fake_dir}:{REPO}", "FAKE_NVML_WATTS": "200"}
    env.pop("CUDA_VISIBLE_DEVICES", None)  # the fake has one board
    args = [
        "-m", "experiments.benchmark", "--mode=train_model", f"--train_model_workdir={workdir}",
        "--train_model_batch=2", "--reps=2", "--energy",  # the corpus: the run's data.json
        f"--out={out}",
    ]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["energy"] == {"method": "counter", "devices": [0], "names": ["Fake GPU"]}
    (rec,) = res["cases"]
    assert rec["workdir"] == str(workdir) and rec["step"] == STEPS
    assert rec["data_dir"] == str(Path(data_dir).resolve())
    assert 0.9 * 200.0 <= rec["dense_watts"] <= 1.5 * 200.0  # read outside the clock
    assert rec["sparse_joules_per_token"] > 0
    table = results_table.train_model_table(res)
    assert f"| run step {STEPS} | 64 |" in table and "mJ/token dense / sparse" in table
