"""End-to-end `python -m experiments.pretrain` runs: outputs, resume, Ctrl-C,
divergence, refusals and flagfiles.

Each CLI run is a subprocess on a tiny model (d_model 64, 2 layers, seq 32, batch 4)
over a small synthetic corpus (tests/experiments/pretrain_cli.py).
"""

import importlib.util
import json
import re
import shutil
import signal
import subprocess

import numpy as np
import pytest

from tests.experiments.cli import refusal, run_module
from tests.experiments.pretrain_cli import (
    REPO,
    checkpoint_steps,
    cli_command,
    cli_env,
    run_cli,
    train_ce,
    val_ce,
)
from tests.fake_pynvml import install_module
from twell_jax import corpus, documents, metrics, tokenizer

# A resumed run restores the exact state, and XLA on CPU is deterministic, so only
# reassociation noise (none expected) may separate the two runs.
RESUME_CE_RTOL = 1e-4


@pytest.mark.slow
def test_run_writes_outputs(straight):
    workdir, out = straight
    # One line names the resolved config's file; the config itself is not printed.
    assert out.count(f"resolved config -> {workdir / 'config.json'}") == 1
    assert '"vocab_size"' not in out and len(out.splitlines()) < 40, out[-3000:]
    assert "sparsity" in out and "tok/s" in out
    # The last progress line: elapsed time and (nothing left) ETA.
    assert re.search(r"step +6/6 .*tok/s .* elapsed \d+s  eta 0s", out), out[-3000:]
    assert sorted(train_ce(workdir)) == [1, 2, 3, 4, 5, 6]
    assert sorted(val_ce(workdir)) == [3, 6]
    last = metrics.read_metrics(workdir / metrics.METRICS_FILE)[-2]  # step 6, before eval
    assert {
        "loss",
        "ce",
        "l1_loss",
        "l0_mean",
        "sparsity_mean",
        "alive_mean",
        "lr",
        "tokens_per_s",
    } <= last.keys()
    assert len(last["l0"]) == 2 and 0 < last["l0_mean"] < 256
    assert (workdir / metrics.PLOT_FILE).stat().st_size > 0
    assert json.loads((workdir / "config.json").read_text())["optim"]["total_steps"] == 6
    assert checkpoint_steps(workdir) == [3, 6]


@pytest.mark.slow
def test_more_steps_resume(tmp_path, straight, data_dir, cache_dir):
    workdir = tmp_path / "run"
    shutil.copytree(straight[0], workdir)
    first = train_ce(workdir)
    # More steps: continues from step 6 rather than restarting at 1. The inference-only
    # TwELL compression may change on resume; it does not change training.
    # Another --steps changes the LR schedule: refused (exit 2) unless asked for.
    proc = run_cli(workdir, data_dir, cache_dir, "--steps=9", check=False)
    assert proc.returncode == 2 and "--allow_schedule_change" in proc.stderr
    assert sorted(train_ce(workdir)) == list(range(1, 7))
    out = run_cli(
        workdir,
        data_dir,
        cache_dir,
        "--steps=9",
        "--allow_schedule_change",
        "--set=model.twell_compression=8",
    )
    assert "resumed from checkpoint step 6" in out
    ce = train_ce(workdir)
    assert sorted(ce) == list(range(1, 10))
    assert all(ce[s] == first[s] for s in range(1, 7))  # history kept, not rewritten
    assert checkpoint_steps(workdir) == [3, 6, 9]

    # A different learning rate is not the same run: refused, naming the field.
    proc = run_cli(workdir, data_dir, cache_dir, "--steps=12", "--lr=5e-4", check=False)
    assert proc.returncode == 2 and "refused: config differs" in proc.stderr
    assert "optim.lr: saved" in proc.stderr and "Traceback" not in proc.stderr
    # Fewer steps than the checkpoint's is an error, not "done".
    proc = run_cli(
        workdir, data_dir, cache_dir, "--steps=3", "--allow_schedule_change", check=False
    )
    assert proc.returncode == 2 and "below the checkpoint's step 9" in proc.stderr


@pytest.mark.slow
def test_resume_matches_straight_run(tmp_path, straight, data_dir, cache_dir):
    split = tmp_path / "split"
    run_cli(split, data_dir, cache_dir, "--steps=6", "--stop_at=3")
    assert checkpoint_steps(split) == [3]
    assert sorted(train_ce(split)) == [1, 2, 3]
    run_cli(split, data_dir, cache_dir, "--steps=6")
    a, b = train_ce(straight[0]), train_ce(split)
    assert sorted(a) == sorted(b) == list(range(1, 7))
    np.testing.assert_allclose([b[s] for s in a], list(a.values()), rtol=RESUME_CE_RTOL)
    np.testing.assert_allclose(val_ce(split)[6], val_ce(straight[0])[6], rtol=RESUME_CE_RTOL)


@pytest.mark.slow
def test_sigint_saves_and_exits(tmp_path, data_dir, cache_dir):
    workdir = tmp_path / "run"
    proc = subprocess.Popen(
        cli_command(workdir, data_dir, ["--steps=6"]),
        cwd=REPO,
        env=cli_env(cache_dir),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # The handler is installed before this line is logged, i.e. before compiling.
        for line in proc.stderr:
            if "Ctrl-C / SIGTERM saves a checkpoint" in line:
                proc.send_signal(signal.SIGINT)
                break
        _, rest = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGINT, rest[-4000:]
    assert "stopped at step" in rest
    steps = checkpoint_steps(workdir)
    assert len(steps) == 1 and 1 <= steps[0] < 6
    assert max(train_ce(workdir)) == steps[0]


@pytest.mark.slow
def test_divergence_exits_3_and_keeps_the_good_checkpoints(tmp_path, data_dir, cache_dir):
    workdir = tmp_path / "run"
    # lr 1e30: from step 2 on every step is non-finite; two are skipped, the third stops.
    proc = run_cli(
        workdir,
        data_dir,
        cache_dir,
        "--steps=20",
        "--lr=1e30",
        "--clip_norm=1e30",
        "--checkpoint_every=1",
        "--max_to_keep=0",
        "--skip_nonfinite=2",
        check=False,
    )
    assert proc.returncode == 3, proc.stderr[-4000:]
    assert "diverged: non-finite" in proc.stderr and "after 2 skipped" in proc.stderr
    assert proc.stderr.count("skipped, state unchanged (") == 2
    records = metrics.read_metrics(workdir / "metrics.jsonl")
    skipped = [r["skipped_steps"] for r in records if r["kind"] == "train"]
    assert skipped[0] == 0 and skipped[-1] == 2
    bad = int(re.search(r"diverged: non-finite \w+ \(.*?\) at step (\d+)", proc.stderr)[1])
    steps = checkpoint_steps(workdir)
    assert steps and max(steps) < bad
    assert not (workdir / "run.lock").exists()


@pytest.mark.slow
def test_a_workdir_without_a_readable_step_is_refused(tmp_path, straight, data_dir, cache_dir):
    workdir = tmp_path / "run"
    shutil.copytree(straight[0], workdir)
    for step in checkpoint_steps(workdir):
        (workdir / "checkpoints" / str(step) / "state" / "_METADATA").write_text("{garbled")
    proc = run_cli(workdir, data_dir, cache_dir, "--steps=9", check=False)
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert "could be restored (steps [3, 6])" in refusal(proc)
    assert checkpoint_steps(workdir) == [3, 6]  # kept in place


@pytest.mark.slow
def test_a_seq_len_too_long_for_memory_exits_2_before_compiling(tmp_path, data_dir, cache_dir):
    # Any machine: the [S, S] attention probabilities alone are 2^44 bytes per layer.
    workdir = tmp_path / "run"
    proc = run_cli(workdir, data_dir, cache_dir, "--seq_len=1048576", check=False)
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert "refused: model.seq_len=1048576" in proc.stderr and "To fit: " in proc.stderr
    assert "compiled" not in proc.stderr and not workdir.exists()


def test_log_filter_drops_only_orbax_info_and_unavailable_backend_notes():
    import logging

    from experiments import entry_points

    def record(path, level, msg):
        return logging.LogRecord("absl", level, path, 1, msg, None, None)

    bridge = "/site-packages/jax/_src/xla_bridge.py"
    tpu = "Unable to initialize backend 'tpu': INTERNAL: Failed to open libtpu.so"
    keep = entry_points.keep_log_record
    orbax = "/x/orbax/checkpoint/a.py"
    assert not keep(record(bridge, logging.INFO, tpu))
    assert not keep(record(orbax, logging.INFO, "saved"))
    assert keep(record(bridge, logging.WARNING, "Falling back to cpu."))
    assert keep(record(orbax, logging.WARNING, "slow"))
    assert keep(record("/x/trainer.py", logging.INFO, "step 1"))


FLAGFILES = sorted(p.stem for p in (REPO / "experiments" / "configs").glob("*.flags"))


@pytest.mark.parametrize("name", FLAGFILES)
def test_flagfile_resolves(name, monkeypatch):
    """Every flagfile parses and yields a valid config (typos fail here, not on a GPU)."""
    from absl import flags

    from experiments import pretrain

    monkeypatch.chdir(REPO)  # nested --flagfile paths are relative to the repo root
    flags.FLAGS(["pretrain", f"--flagfile=experiments/configs/{name}.flags"])
    try:
        cfg = pretrain.resolve_config()
    finally:
        flags.FLAGS.unparse_flags()
    if name in ("0.5b", "1b", "1.5b", "2b"):
        assert cfg.tokens_per_step == 2**20 and cfg.sparsity.l1_coef == 2e-5
        assert cfg.optim.total_steps == 30000 and cfg.model.remat
    if name == "125m_dense":
        assert cfg.sparsity.l1_coef == 0 and cfg.optim.total_steps == 1000
    if name.startswith("1b_demo"):  # the twins differ only in lambda and the FFN
        assert cfg.model.vocab_size == 8192 and cfg.tokens_per_step == 8 * 2048
        assert (cfg.sparsity.l1_coef, cfg.model.ffn_impl) == (
            (0.0, "dense") if name == "1b_demo_dense" else (3e-3, "sparse")
        )


@pytest.mark.slow
def test_energy_flag_logs_joules_per_token_or_stops_before_writing(tmp_path, data_dir, cache_dir):
    """--energy through a fake NVML board at 120 W (tests/fake_pynvml.py); where NVML
    cannot measure (no package here, or no driver) the run exits 1 before it writes."""
    env = {**cli_env(cache_dir), "PYTHONPATH": f"{install_module(tmp_path / 'nvml')}:{REPO}"}
    env["FAKE_NVML_WATTS"] = "120"
    env.pop("CUDA_VISIBLE_DEVICES", None)  # the fake has one board
    workdir = tmp_path / "run"
    cmd = cli_command(workdir, data_dir, ["--steps=3", "--energy"])
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "energy: {'method': 'counter'" in proc.stderr
    assert re.search(r"mJ/tok [0-9.e+-]+ \(1[0-9]{2} W\)", proc.stderr), proc.stderr[-2000:]
    records = [
        r for r in metrics.read_metrics(workdir / metrics.METRICS_FILE) if r["kind"] == "train"
    ]
    assert [r["step"] for r in records] == [1, 2, 3] and "watts" not in records[0]
    # Steps of a few ms: a thread switch between the clock's and the meter's reads
    # shows at this scale (not at a GPU step's), hence the tolerance.
    assert all(r["watts"] == pytest.approx(120, rel=0.1) for r in records[1:])

    if importlib.util.find_spec("pynvml") is None:  # else a real NVML: no driver on CPU
        fresh = tmp_path / "fresh"
        proc = run_cli(fresh, data_dir, cache_dir, "--steps=3", "--energy", check=False)
        assert proc.returncode == 1 and "--energy: energy needs NVML: pip install" in proc.stderr
        assert not (fresh / "config.json").exists()


@pytest.mark.parametrize(
    "flag, message",
    [
        ("--set=model.d_modle=64", "unknown config key 'd_modle' for ModelConfig"),
        ("--set=model.d_model=abc", "ModelConfig.d_model='abc': expected an int"),
        ("--ffn_impl=bogus", "ModelConfig.ffn_impl='bogus': must be one of"),
        ("--steps=0", "OptimConfig.total_steps=0: must be > 0"),
        ("--set=model", "--set='model': expected section.field=value"),
        ("--set=seed.x=1", "TrainConfig.seed is not a config section"),
        ("--lr=inf", "OptimConfig.lr=inf: must be > 0 and finite"),
        ("stray", "unexpected arguments ['stray'] (flags take --name=value)"),
    ],
)
def test_a_bad_config_value_is_one_refused_line(tmp_path, data_dir, cache_dir, flag, message):
    proc = run_cli(tmp_path / "run", data_dir, cache_dir, flag, check=False)
    assert message in refusal(proc)
    assert len(proc.stderr.splitlines()) == 1 and not (tmp_path / "run").exists()


def test_a_corpus_the_run_cannot_read_is_refused_before_the_workdir_exists(
    tmp_path, data_dir, cache_dir
):
    workdir = tmp_path / "run"
    proc = run_cli(workdir, tmp_path / "nope", cache_dir, check=False)
    assert "nope/meta.json not found: prepare the corpus with" in refusal(proc)
    assert not workdir.exists()
    proc = run_cli(workdir, data_dir, cache_dir, "--set=model.vocab_size=128", check=False)
    assert "uses a tokenizer of 257 ids (byte) but model.vocab_size=128" in refusal(proc)
    assert not workdir.exists()


def test_the_presets_own_warmup_above_steps_is_refused_saying_what_to_change(tmp_path):
    proc = run_module("pretrain", "--preset=tiny", "--steps=20", f"--workdir={tmp_path / 'run'}")
    assert "(the tiny preset's warmup: --steps must exceed it, or pass a lower --warmup_steps)" in (
        refusal(proc)
    )
    assert not (tmp_path / "run").exists()


def test_a_mesh_batch_or_corpus_the_devices_cannot_run_is_refused_before_the_workdir_exists(
    tmp_path, monkeypatch, data_dir, cache_dir
):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    small = tmp_path / "small"  # 11 tokens: not one window of 33
    byte = tokenizer.load_tokenizer("byte")
    corpus.prepare_corpus([documents.Document("a.txt", "tiny corpus")], small, byte, source="a")
    workdir = tmp_path / "run"
    for data, flags, message in [
        (data_dir, ["--batch_size=12"], "micro-batches of 12 sequences (grad_accum_steps=1)"),
        (data_dir, ["--batch_size=8", "--grad_accum_steps=2"], "make it a multiple of 16"),
        (data_dir, ["--mesh_data=3"], "mesh (data=3, fsdp=1) does not fit 8 devices"),
        (data_dir, ["--mesh_data=2", "--mesh_fsdp=2"], "mesh (data=2, fsdp=2) does not fit"),
        (small, ["--batch_size=8"], "has 0 windows of 33 tokens, fewer than one batch of 8"),
    ]:
        proc = run_cli(workdir, data, cache_dir, *flags, check=False)
        assert message in refusal(proc), flags
        assert not workdir.exists(), flags


def test_ffn_impl_help_lists_every_implementation():
    from experiments import pretrain
    from twell_jax.config import FFN_IMPLS

    assert all(impl in pretrain._FIELDS["ffn_impl"][2] for impl in FFN_IMPLS)
