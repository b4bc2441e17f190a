"""Orbax checkpointer: round trip, retention, config check, corrupt and interrupted saves."""

import gc
import logging
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from twell_jax import checkpoint

CONFIG = {"model": {"d_model": 8, "n_layers": 2}, "train": {"lr": 1e-3, "total_steps": 10}}
SHARDING = jax.sharding.SingleDeviceSharding(jax.devices()[0])


def _state(step: int) -> dict:
    return {
        "params": {
            "w": jnp.full((4, 8), step, jnp.float32),
            "b": jnp.arange(8, dtype=jnp.bfloat16),
        },
        "opt": {"mu": jnp.arange(3) * step},
        "step": jnp.array(step, jnp.int32),
    }


def _abstract(state) -> dict:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=SHARDING), state)


def _saved(tmp_path, steps, max_to_keep=3) -> checkpoint.Checkpointer:
    ckpt = checkpoint.Checkpointer(tmp_path / "ckpt", max_to_keep=max_to_keep)
    for s in steps:
        ckpt.save(s, _state(s), {"grain": {"next_index": s}}, CONFIG)
    ckpt.wait()
    return ckpt


def _assert_state(restored, step, part=None):
    """restored equals _state(step) (or its `part`), values, dtypes and shardings."""
    want_tree = _state(step) if part is None else _state(step)[part]
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(want_tree), strict=True):
        assert got.dtype == want.dtype and got.sharding == SHARDING
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_round_trip_and_keep_last_n(tmp_path):
    ckpt = _saved(tmp_path, [1, 2, 3, 4], max_to_keep=2)
    assert ckpt.all_steps() == [3, 4] and ckpt.latest_step() == 4
    ckpt.close()
    with checkpoint.Checkpointer(tmp_path / "ckpt", max_to_keep=2) as reopened:
        state, data_state, step = reopened.restore(_abstract(_state(0)), config=CONFIG)
        assert step == 4 and data_state == {"grain": {"next_index": 4}}
        _assert_state(state, 4)
        # Concrete arrays work as the target too: their shardings are used.
        _assert_state(reopened.restore(_state(0), step=3).state, 3)


def test_config_mismatch_lists_keys_and_ignores_allowed_ones(tmp_path):
    with _saved(tmp_path, [1]) as ckpt:
        target = _abstract(_state(0))
        longer = {**CONFIG, "train": {"lr": 1e-3, "total_steps": 99}}
        assert ckpt.restore(target, config=longer).step == 1
        changed = {"model": {"d_model": 8, "n_layers": 3}, "train": {"lr": 2e-3, "total_steps": 10}}
        with pytest.raises(ValueError, match=r"2 key\(s\)") as err:
            ckpt.restore(target, config=changed)
        assert "model.n_layers: saved 2, current 3" in str(err.value)
        assert "train.lr" in str(err.value)
        assert ckpt.restore(target, config=changed, ignore_keys=["n_layers", "train.lr"]).step == 1


def test_shape_mismatch_is_not_called_corruption(tmp_path):
    with _saved(tmp_path, [1, 2]) as ckpt:
        target = _abstract(_state(0))
        target["params"]["w"] = jax.ShapeDtypeStruct((5, 8), jnp.float32, sharding=SHARDING)
        with pytest.raises(ValueError, match=r"params/w: saved \(4, 8\), target \(5, 8\)"):
            ckpt.restore(target)
        assert ckpt.all_steps() == [1, 2]


# A failed Orbax read leaves a callback on a closed asyncio loop; harmless, not ours.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("damage", ["truncate", "delete", "metadata"])
def test_corrupt_step_errors_and_falls_back_to_the_previous_one(tmp_path, damage):
    ckpt = _saved(tmp_path, [1, 2])
    step_dir = tmp_path / "ckpt" / "2"
    arrays = [p for p in (step_dir / "state" / "d").iterdir() if p.is_file()]
    if damage == "truncate":
        for p in arrays:
            p.write_bytes(p.read_bytes()[:10])
    elif damage == "delete":
        for p in arrays:
            p.unlink()
    else:
        (step_dir / "state" / "_METADATA").write_text("{garbled")
    target = _abstract(_state(0))
    with pytest.raises(checkpoint.CheckpointCorruptError, match=f"step 2 at {step_dir}"):
        ckpt.restore(target, step=2)
    state, data_state, step = ckpt.restore(target)
    assert step == 1 and data_state == {"grain": {"next_index": 1}}
    _assert_state(state, 1)
    # The bad step is moved aside, not deleted, and training can save step 2 again.
    assert not step_dir.exists() and list((tmp_path / "ckpt").glob("2.corrupt-*"))
    assert ckpt.all_steps() == [1]
    ckpt.save(2, _state(2), {"grain": {"next_index": 2}}, CONFIG)
    ckpt.wait()
    _assert_state(ckpt.restore(target).state, 2)
    ckpt.close()


def test_recovery_from_a_truncated_step_logs_one_line(tmp_path, capfd, caplog):
    """A truncated step is one warning line (step, error type), not TensorStore's noise.

    Many random arrays make many concurrent reads, which a failed one abandons.
    """
    state = {f"w{i}": jax.random.normal(jax.random.key(i), (64, 64)) for i in range(16)}
    ckpt = checkpoint.Checkpointer(tmp_path / "ckpt")
    for step in (1, 2):
        ckpt.save(step, state, {"grain": {"next_index": step}}, CONFIG)
    ckpt.wait()
    step_dir = tmp_path / "ckpt" / "2"
    for p in (step_dir / "state").rglob("d/*"):
        p.write_bytes(p.read_bytes()[:100])
    capfd.readouterr()
    with caplog.at_level(logging.INFO):
        assert ckpt.restore(_abstract(state)).step == 1
        gc.collect()  # nothing left to report later either
    out, err = capfd.readouterr()
    assert out.count("\n") + err.count("\n") == 0, (out + err)[-2000:]
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    (line,) = warnings
    assert "\n" not in line and len(line) < 1000
    assert f"checkpoint step 2 at {step_dir}" in line and "ValueError: " in line
    assert "using step 1" in line
    (moved,) = (tmp_path / "ckpt").glob("2.corrupt-*")
    assert moved.name in line
    details = (moved / checkpoint.ERROR_FILE).read_text()
    assert details.startswith(line.split("; moved to")[0]) and "Traceback" in details
    ckpt.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_all_steps_unreadable_moves_nothing(tmp_path):
    with _saved(tmp_path, [1, 2]) as ckpt:
        for step in (1, 2):
            (tmp_path / "ckpt" / str(step) / "state" / "_METADATA").write_text("{garbled")
        with pytest.raises(checkpoint.CheckpointCorruptError, match=r"no step .* \[1, 2\]"):
            ckpt.restore(_abstract(_state(0)))
        assert ckpt.all_steps() == [1, 2]


def test_interrupted_save_keeps_the_previous_checkpoint(tmp_path):
    _saved(tmp_path, [1, 2]).close()
    # What a killed save leaves behind: a partial step directory under Orbax's tmp name.
    partial = tmp_path / "ckpt" / "3.orbax-checkpoint-tmp-1234567"
    shutil.copytree(tmp_path / "ckpt" / "2", partial)
    shutil.rmtree(partial / "state" / "d")
    with checkpoint.Checkpointer(tmp_path / "ckpt") as ckpt:
        assert ckpt.latest_step() == 2
        _assert_state(ckpt.restore(_abstract(_state(0))).state, 2)
        ckpt.save(3, _state(3), {"grain": {"next_index": 3}}, CONFIG)
        ckpt.wait()
        assert ckpt.all_steps() == [1, 2, 3]
        _assert_state(ckpt.restore(_abstract(_state(0))).state, 3)


def test_no_checkpoint_is_a_clear_error(tmp_path):
    with checkpoint.Checkpointer(tmp_path / "empty") as ckpt:
        assert ckpt.latest_step() is None
        with pytest.raises(FileNotFoundError, match="no checkpoint"):
            ckpt.restore(_abstract(_state(0)))


def test_saved_config_reads_only_the_config(tmp_path):
    with _saved(tmp_path, [1, 2]) as ckpt:
        (tmp_path / "ckpt" / "2" / "state" / "_METADATA").write_text("{garbled")
        assert ckpt.saved_config(2) == CONFIG
        shutil.rmtree(tmp_path / "ckpt" / "1" / "config")
        with pytest.raises(checkpoint.CheckpointCorruptError, match=r"step 1 .* unreadable"):
            ckpt.saved_config(1)


def test_a_reader_leaves_a_save_in_progress_alone(tmp_path):
    """A read_only Checkpointer (generation, export) opened while a run is saving keeps
    the save's temporary directory, which a writer's manager deletes as a leftover; it
    creates nothing, and restores the whole state or the params alone."""
    _saved(tmp_path, [1, 2]).close()
    in_progress = tmp_path / "ckpt" / "3.orbax-checkpoint-tmp-1234567"
    shutil.copytree(tmp_path / "ckpt" / "2", in_progress)
    for done in in_progress.rglob("commit_success.txt"):  # not written yet
        done.unlink()
    with checkpoint.Checkpointer(tmp_path / "ckpt", read_only=True) as reader:
        assert reader.all_steps() == [1, 2]
        _assert_state(reader.restore(_abstract(_state(0))).state, 2)
        restored = reader.restore_params(_abstract(_state(0))["params"])
        assert restored.step == 2 and restored.data_state == {}
        _assert_state(restored.state["params"], 2, "params")
    assert in_progress.is_dir()
    with pytest.raises(FileNotFoundError, match="no checkpoint directory"):
        checkpoint.Checkpointer(tmp_path / "absent", read_only=True)
    assert not (tmp_path / "absent").exists()
    # A writer's manager deletes it, in the background: the contrast this test guards.
    checkpoint.Checkpointer(tmp_path / "ckpt").close()
    deadline = time.monotonic() + 20
    while in_progress.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not in_progress.exists()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_reader_skips_an_unreadable_step_in_place(tmp_path, caplog):
    """The newest step unreadable: a reader falls back to the previous one with one
    warning and moves nothing (the run that wrote it decides); params need only the
    params' files, so a step whose optimizer state alone is broken still loads."""
    _saved(tmp_path, [1, 2, 3]).close()
    (tmp_path / "ckpt" / "3" / "state" / "_METADATA").write_text("{garbled")
    params = _abstract(_state(0))["params"]
    with checkpoint.Checkpointer(tmp_path / "ckpt", read_only=True) as reader:
        with caplog.at_level(logging.WARNING):
            restored = reader.restore_params(params)
        assert restored.step == 2
        _assert_state(restored.state["params"], 2, "params")
        (warning,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING
                      and "checkpoint step" in r.getMessage()]  # fmt: skip
        assert "step 3" in warning and "using step 2" in warning
        assert reader.all_steps() == [1, 2, 3]
        with pytest.raises(checkpoint.CheckpointCorruptError, match="step 3"):
            reader.restore_params(params, step=3)
    assert (tmp_path / "ckpt" / "3").is_dir()
    writer = checkpoint.Checkpointer(tmp_path / "ckpt")
    with pytest.raises(ValueError, match="read_only"):
        writer.restore_params(params)
    writer.close()
