"""The training loop's guards in a run: workdir lock, divergence, checks before writes, schedule.

In-process `trainer.run` calls on a one-layer model (seq 16, batch 2) over the small
prepared corpus of conftest; the end-to-end CLI runs are in tests/experiments.
"""

import dataclasses
import json
import logging
import pathlib
import shutil
import sys

import jax
import numpy as np
import pytest

from tests.corpora import prepare_byte_corpus, write_text_corpus
from tests.fake_pynvml import FakeNvml
from twell_jax import checkpoint, energy, metrics, run_guards, step_memory, train, trainer
from twell_jax import config as C


def tiny_config(steps: int = 2, lr: float = 3e-3, **fields) -> C.TrainConfig:
    model = C.model_preset(
        "tiny", vocab_size=264, d_model=32, d_ff=64, n_layers=1, n_heads=2, seq_len=16
    )
    loop = {"log_every": 1, "eval_every": 1000, "eval_batches": 1, "checkpoint_every": 1000}
    return C.TrainConfig(
        model=model,
        batch_size=2,
        optim=C.OptimConfig(lr=lr, warmup_steps=0, total_steps=steps),
        sparsity=C.SparsityConfig(l1_warmup_steps=1),
        **{**loop, **fields},
    )


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    paths, _ = write_text_corpus(root)
    prepare_byte_corpus(paths, root / "prepared")
    return str(root / "prepared")


@pytest.fixture(scope="module")
def finished(tmp_path_factory, data_dir):
    """A workdir whose run finished 2 steps (checkpoint at step 2)."""
    workdir = tmp_path_factory.mktemp("finished") / "run"
    summary = trainer.run(tiny_config(), trainer.RunOptions(str(workdir), data_dir))
    assert summary["step"] == 2 and not summary["interrupted"]
    return workdir


def _copy(src, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(src, dst)
    return dst


# --- workdir lock ---------------------------------------------------------------


def test_run_refuses_a_locked_workdir_and_releases_on_errors(tmp_path, data_dir, monkeypatch):
    workdir = tmp_path / "run"
    opts = trainer.RunOptions(str(workdir), data_dir)
    with run_guards.WorkdirLock(workdir):
        with pytest.raises(run_guards.WorkdirLockedError, match="in use by pid"):
            trainer.run(tiny_config(), opts)
        assert not (workdir / trainer.CONFIG_FILE).exists()
    # An error inside the run (no energy meter) still removes the lock.
    monkeypatch.setitem(sys.modules, "pynvml", None)
    with pytest.raises(energy.EnergyUnavailableError):
        trainer.run(tiny_config(), dataclasses.replace(opts, energy=True))
    assert not (workdir / run_guards.LOCK_FILE).exists()


def test_what_needs_no_workdir_is_checked_before_the_lock_creates_it(tmp_path, data_dir):
    workdir = tmp_path / "run"
    opts = trainer.RunOptions(str(workdir), data_dir)
    with pytest.raises(FileNotFoundError):
        trainer.run(tiny_config(), dataclasses.replace(opts, data_dir=str(tmp_path / "none")))
    with pytest.raises(ValueError, match=r"mesh \(data=2, fsdp=1\) does not fit 1 devices"):
        trainer.run(tiny_config(mesh_shape=(2, 1)), opts)
    with pytest.raises(ValueError, match="fewer than one batch of 4096 per process"):
        trainer.run(dataclasses.replace(tiny_config(), batch_size=4096), opts)
    assert not workdir.exists()


def test_a_step_that_cannot_fit_is_refused_before_anything_is_written(
    tmp_path, data_dir, monkeypatch
):
    monkeypatch.setattr(step_memory, "available_memory", lambda: (2**16, 1, "the host"))
    workdir = tmp_path / "run"
    with pytest.raises(step_memory.StepMemoryError, match=r"model\.seq_len=16, .*the host has"):
        trainer.run(tiny_config(), trainer.RunOptions(str(workdir), data_dir))
    assert not (workdir / trainer.CONFIG_FILE).exists()
    assert not (workdir / run_guards.LOCK_FILE).exists()


# --- divergence guard ---------------------------------------------------------------


def test_nonfinite_loss_stops_before_saving_and_keeps_good_checkpoints(tmp_path, data_dir):
    # Adam moves every weight by ~lr per step: the loss overflows within a few steps.
    cfg = tiny_config(steps=30, lr=1e30, checkpoint_every=1)
    cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, clip_norm=1e30))
    workdir = tmp_path / "run"
    with pytest.raises(run_guards.DivergenceError) as err:
        trainer.run(cfg, trainer.RunOptions(str(workdir), data_dir, max_to_keep=None))
    e = err.value
    assert 1 < e.step < 30 and e.metric in ("loss", "grad_norm", "state")
    assert f"at step {e.step}" in str(e) and e.metric in str(e)
    with checkpoint.Checkpointer(workdir / trainer.CHECKPOINT_DIR) as ckpt:
        steps = ckpt.all_steps()
        assert steps and max(steps) < e.step and e.last_checkpoint == max(steps)
        # The newest checkpoint left is finite.
        from twell_jax import sharding, train

        mesh = sharding.make_mesh(*cfg.mesh_shape)
        restored = ckpt.restore(train.abstract_train_state(cfg, mesh))
        leaves = [np.asarray(x) for x in jax.tree.leaves(restored.state)]
        assert all(np.isfinite(x).all() for x in leaves if np.issubdtype(x.dtype, np.inexact))
    assert not (workdir / run_guards.LOCK_FILE).exists()


class _BadBatches:
    """The train iterator with an out-of-vocabulary id (NaN embedding) in some batches."""

    def __init__(self, it, bad: set[int]):
        self._it, self._bad, self._n = it, bad, 0

    def __next__(self):
        batch, self._n = next(self._it), self._n + 1
        if self._n in self._bad:
            batch = {**batch, "inputs": batch["inputs"].copy()}
            batch["inputs"][0, 0] = 10**6
        return batch

    def get_state(self):
        return self._it.get_state()

    def set_state(self, state):
        self._it.set_state(state)


def _inject_bad_batches(monkeypatch, *steps: int) -> None:
    """Batches `steps` (1-based, counted from this run's first step) are bad."""
    make = trainer.input_pipeline.make_train_iterator
    monkeypatch.setattr(
        trainer.input_pipeline,
        "make_train_iterator",
        lambda cfg: _BadBatches(make(cfg), set(steps)),
    )


def _restored(cfg, workdir, step):
    from twell_jax import sharding, train

    mesh = sharding.make_mesh(*cfg.mesh_shape)
    with checkpoint.Checkpointer(workdir / trainer.CHECKPOINT_DIR) as ckpt:
        return ckpt.restore(train.abstract_train_state(cfg, mesh), step=step)


def _same_state(a, b) -> bool:
    a, b = (jax.tree.leaves((s.params, s.opt_state)) for s in (a, b))
    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b, strict=True))


def test_skip_nonfinite_keeps_the_state_counts_and_survives_a_resume(
    tmp_path, data_dir, monkeypatch, caplog
):
    cfg = tiny_config(steps=4, checkpoint_every=1)
    workdir = tmp_path / "run"
    opts = trainer.RunOptions(str(workdir), data_dir, max_to_keep=None, skip_nonfinite=2)
    _inject_bad_batches(monkeypatch, 2)
    with caplog.at_level(logging.WARNING):
        summary = trainer.run(cfg, opts)
    assert summary["step"] == 4 and summary["skipped_steps"] == 1
    (line,) = [r.getMessage() for r in caplog.records if "skipped, state" in r.getMessage()]
    assert line.startswith("step 2: non-finite loss nan") and "1 of --skip_nonfinite=2" in line
    # Step 2 kept step 1's parameters and optimizer state; step 3 trained on.
    s1, s2, s3 = (_restored(cfg, workdir, step) for step in (1, 2, 3))
    assert int(s2.state.step) == 2 and _same_state(s1.state, s2.state)
    assert not _same_state(s2.state, s3.state)
    records = [r for r in metrics.read_metrics(workdir / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["skipped_steps"] for r in records] == [0, 1, 1, 1]
    assert all(np.isfinite(r["ce"]) for r in records if r["step"] != 2)
    # The logged LR is the one applied: the schedule stays a step behind after the skip.
    schedule = train.lr_schedule(cfg.optim)
    assert [r["lr"] for r in records] == pytest.approx([float(schedule(i)) for i in (0, 1, 1, 2)])
    # The count is saved with the checkpoints: one more skip reaches the limit.
    _inject_bad_batches(monkeypatch, 1, 2)
    more = dataclasses.replace(opts, allow_schedule_change=True)
    with pytest.raises(run_guards.DivergenceError, match="step 6 after 2 skipped") as err:
        trainer.run(tiny_config(steps=8, checkpoint_every=1), more)
    assert err.value.skipped == 2 and err.value.last_checkpoint == 5


# --- every check before any write; schedule changes ---------------------------------


def test_rejected_resume_leaves_config_json_unchanged(tmp_path, finished, data_dir):
    workdir = _copy(finished, tmp_path)
    before = (workdir / trainer.CONFIG_FILE).read_bytes()
    metrics_before = (workdir / "metrics.jsonl").read_bytes()
    opts = trainer.RunOptions(str(workdir), data_dir)
    with pytest.raises(checkpoint.ConfigMismatchError, match=r"optim\.lr"):
        trainer.run(tiny_config(lr=1e-2), opts)
    with pytest.raises(run_guards.ResumeRefusedError, match="resume is off"):
        trainer.run(tiny_config(lr=1e-2), dataclasses.replace(opts, resume=False))
    with pytest.raises(run_guards.ScheduleChangeError, match="--allow_schedule_change"):
        trainer.run(tiny_config(steps=4), opts)
    assert (workdir / trainer.CONFIG_FILE).read_bytes() == before
    assert (workdir / "metrics.jsonl").read_bytes() == metrics_before
    assert not (workdir / run_guards.LOCK_FILE).exists()


def test_steps_below_the_checkpoint_is_an_error(tmp_path, finished, data_dir):
    workdir = _copy(finished, tmp_path)
    opts = trainer.RunOptions(str(workdir), data_dir, allow_schedule_change=True)
    with pytest.raises(run_guards.ScheduleChangeError, match="below the checkpoint's step 2"):
        trainer.run(tiny_config(steps=1), opts)
    # The same total is a finished run: nothing to do.
    assert trainer.run(tiny_config(), opts)["step"] == 2


def test_allowed_schedule_change_continues_on_the_new_schedule(tmp_path, finished, data_dir):
    workdir = _copy(finished, tmp_path)
    opts = trainer.RunOptions(str(workdir), data_dir, allow_schedule_change=True)
    assert trainer.run(tiny_config(steps=3), opts)["step"] == 3
    assert json.loads((workdir / trainer.CONFIG_FILE).read_text())["optim"]["total_steps"] == 3


def test_a_resume_may_split_the_same_batch_into_more_micro_batches(tmp_path, finished, data_dir):
    """grad_accum_steps changes how a step's batch is cut, not the step (what a run
    moved to fewer devices may need); the learning rate still may not change."""
    workdir = _copy(finished, tmp_path)
    opts = trainer.RunOptions(str(workdir), data_dir, allow_schedule_change=True)
    micro = tiny_config(steps=3)
    micro = dataclasses.replace(micro, optim=dataclasses.replace(micro.optim, grad_accum_steps=2))
    assert trainer.run(micro, opts)["step"] == 3
    with pytest.raises(checkpoint.ConfigMismatchError, match=r"optim\.lr"):
        trainer.run(
            dataclasses.replace(micro, optim=dataclasses.replace(micro.optim, lr=1.0)), opts
        )


# --- energy per token ------------------------------------------------------------------


def test_energy_is_logged_per_interval_and_a_missing_meter_stops_before_writes(
    tmp_path, data_dir, monkeypatch
):
    """A fake NVML board at 250 W: every interval after the compiling step records its
    joules per token, and the power they imply is the board's."""
    fake = FakeNvml(watts=250.0)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # the fake's one board
    workdir = tmp_path / "run"
    opts = trainer.RunOptions(str(workdir), data_dir, energy=True)
    cfg = tiny_config(steps=3)
    trainer.run(cfg, opts)
    records = [r for r in metrics.read_metrics(workdir / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert "joules_per_token" not in records[0]  # the compile step is no interval's
    for r in records[1:]:
        # Steps of a few ms: a thread switch between the clock's and the meter's reads
        # shows at this scale (not at a GPU step's), hence the tolerance.
        assert 0.9 * 250.0 <= r["watts"] <= 1.5 * 250.0
        joules_per_s = r["joules_per_token"] * r["tokens_per_s"]
        assert joules_per_s == pytest.approx(r["watts"], rel=1e-6)  # the same seconds
    assert fake.calls["init"] == fake.calls["shutdown"] == 1  # closed with the run

    monkeypatch.setitem(sys.modules, "pynvml", None)  # the package is not installed
    fresh = tmp_path / "fresh"
    with pytest.raises(energy.EnergyUnavailableError, match="pip install"):
        trainer.run(cfg, dataclasses.replace(opts, workdir=str(fresh)))
    assert not (fresh / trainer.CONFIG_FILE).exists()
    assert not (fresh / metrics.METRICS_FILE).exists()


# --- the run's corpus record ------------------------------------------------------


def test_a_run_records_its_corpus_and_readers_check_a_given_one(tmp_path, finished, data_dir):
    from twell_jax import run_data

    assert run_data.run_data_dir(finished) == str(pathlib.Path(data_dir).resolve())
    assert run_data.run_data_dir(finished, data_dir) == data_dir  # same tokenizer
    other = tmp_path / "other"
    paths, _ = write_text_corpus(tmp_path / "text")
    prepare_byte_corpus(paths, other)
    meta = json.loads((other / "meta.json").read_text())
    meta["tokenizer"]["fingerprint"] = "not-the-runs"
    (other / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="fingerprint not-the-runs"):
        run_data.run_data_dir(finished, str(other))
    bare = _copy(finished, tmp_path)
    (bare / run_data.DATA_FILE).unlink()
    with pytest.raises(FileNotFoundError, match="does not record its corpus"):
        run_data.run_data_dir(bare)
    assert run_data.run_data_dir(bare, str(other)) == str(other)  # nothing to check against
    moved = _copy(finished, tmp_path / "moved")
    record = json.loads((moved / run_data.DATA_FILE).read_text())
    record["data_dir"] = str(tmp_path / "elsewhere")
    (moved / run_data.DATA_FILE).write_text(json.dumps(record))
    with pytest.raises(FileNotFoundError, match="elsewhere, which is not here"):
        run_data.run_data_dir(moved)
    assert run_data.run_data_dir(moved, data_dir) == data_dir  # a copy, same fingerprint


# --- stopping early ---------------------------------------------------------------


def _train_steps(workdir) -> list[int]:
    records = metrics.read_metrics(pathlib.Path(workdir) / metrics.METRICS_FILE)
    return [r["step"] for r in records if r["kind"] == "train"]


def test_stop_at_logs_its_steps_and_a_rerun_past_it_trains_nothing(tmp_path, data_dir):
    cfg = tiny_config(steps=6, log_every=4)
    opts = trainer.RunOptions(str(tmp_path / "run"), data_dir, stop_at=3)
    assert trainer.run(cfg, opts)["step"] == 3
    assert _train_steps(opts.workdir) == [3]  # steps 1-3, logged at the stop
    assert trainer.run(cfg, opts)["step"] == 3  # already there: no step trained
    assert checkpoint.Checkpointer(tmp_path / "run" / trainer.CHECKPOINT_DIR).all_steps() == [3]
    assert trainer.run(cfg, dataclasses.replace(opts, stop_at=0))["step"] == 6
    assert _train_steps(opts.workdir) == [3, 4, 6]


def test_a_stop_request_between_log_steps_logs_the_steps_it_ran(tmp_path, data_dir, monkeypatch):
    class StopAtThirdStep(run_guards.StopRequest):
        polls = 0

        def agreed(self):
            StopAtThirdStep.polls += 1
            self.signal = "SIGTERM"
            return StopAtThirdStep.polls >= 3

    monkeypatch.setattr(trainer, "StopRequest", StopAtThirdStep)
    opts = trainer.RunOptions(str(tmp_path / "run"), data_dir)
    summary = trainer.run(tiny_config(steps=6, log_every=4), opts)
    assert summary["step"] == 3 and summary["interrupted"] and summary["signal"] == "SIGTERM"
    assert _train_steps(opts.workdir) == [3]


def test_resuming_on_another_corpus_is_refused_naming_it(tmp_path, finished, data_dir):
    other = tmp_path / "other"
    paths, _ = write_text_corpus(tmp_path / "text")
    prepare_byte_corpus(paths[:1], other)  # the same tokenizer, other tokens
    workdir = _copy(finished, tmp_path)
    with pytest.raises(run_guards.ResumeRefusedError, match=f"cannot resume on {other}"):
        trainer.run(tiny_config(), trainer.RunOptions(str(workdir), str(other)))


def test_a_missing_or_truncated_val_shard_is_refused_before_the_workdir(tmp_path, data_dir):
    for damage in ("missing", "truncated"):
        corpus_dir = tmp_path / damage
        shutil.copytree(data_dir, corpus_dir)
        shard = (
            corpus_dir
            / json.loads((corpus_dir / "meta.json").read_text())["splits"]["val"]["shards"][0][
                "file"
            ]
        )
        if damage == "missing":
            shard.unlink()
        else:
            shard.write_bytes(shard.read_bytes()[:10])
        workdir = tmp_path / f"run_{damage}"
        with pytest.raises((FileNotFoundError, ValueError), match=f"{shard.name}"):
            trainer.run(tiny_config(), trainer.RunOptions(str(workdir), str(corpus_dir)))
        assert not workdir.exists()
