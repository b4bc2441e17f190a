"""The grain input pipeline: batch shapes, seeded shuffling, per-process shards, resume."""

import json

import numpy as np
import pytest

from twell_jax import corpus, input_pipeline

SEQ_LEN = 16


def _cfg(data_dir, **kw) -> input_pipeline.DataConfig:
    return input_pipeline.DataConfig(
        data_dir=str(data_dir), seq_len=SEQ_LEN, batch_size=4, num_threads=0, **kw
    )


def _take(it, n: int) -> list[dict[str, np.ndarray]]:
    return [next(it) for _ in range(n)]


def _rows(batches) -> list[tuple[int, ...]]:
    return [tuple(row) for b in batches for row in b["inputs"].tolist()]


def test_missing_or_corrupt_files_name_the_file(prepared):
    out, meta, _ = prepared
    first = out / meta["splits"]["train"]["shards"][0]["file"]
    first.write_bytes(first.read_bytes()[:-2])
    with pytest.raises(ValueError, match=f"corrupt shard .*{first.name}"):
        input_pipeline.make_train_iterator(_cfg(out))
    first.unlink()
    with pytest.raises(FileNotFoundError, match=first.name):
        input_pipeline.make_train_iterator(_cfg(out))
    (out / corpus.META_FILE).write_text('{"format_version": 1}')
    with pytest.raises(ValueError, match=r"corrupt .*meta\.json"):
        corpus.load_meta(out)
    (out / corpus.META_FILE).unlink()
    with pytest.raises(FileNotFoundError, match=r"meta\.json.*prepare_data"):
        input_pipeline.make_train_iterator(_cfg(out))


def test_batches_shapes_and_shifted_targets(prepared):
    out, meta, _ = prepared
    batch = next(input_pipeline.make_train_iterator(_cfg(out)))
    assert set(batch) == {"inputs", "targets"}
    for x in batch.values():
        assert x.shape == (4, SEQ_LEN) and x.dtype == np.int32
        assert x.max() < meta["tokenizer"]["vocab_size"]
    np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])


def test_shuffle_is_seeded_and_epochs_repeat(prepared):
    out, _, _ = prepared
    n = len(input_pipeline.TokenWindows(corpus.open_shards(out, "train"), SEQ_LEN, 257))
    two_epochs = -(-2 * n // 4)  # batches
    a = _rows(_take(input_pipeline.make_train_iterator(_cfg(out, seed=3)), two_epochs))
    b = _rows(_take(input_pipeline.make_train_iterator(_cfg(out, seed=3)), two_epochs))
    c = _rows(_take(input_pipeline.make_train_iterator(_cfg(out, seed=4)), two_epochs))
    assert a == b and a != c
    # Each epoch visits every window once, in a fresh order.
    ordered = _rows(
        _take(input_pipeline.make_train_iterator(_cfg(out, shuffle=False)), -(-n // 4))
    )[:n]
    assert len(set(ordered)) == n
    assert set(a[:n]) == set(a[n : 2 * n]) == set(ordered)
    assert a[:n] != a[n : 2 * n] and a[:n] != ordered


def test_processes_get_disjoint_halves_of_the_batch(prepared):
    out, _, _ = prepared
    cfg = _cfg(out)
    p0 = _take(input_pipeline.make_train_iterator(cfg, process_index=0, process_count=2), 3)
    p1 = _take(input_pipeline.make_train_iterator(cfg, process_index=1, process_count=2), 3)
    assert p0[0]["inputs"].shape == (2, SEQ_LEN)
    assert not set(_rows(p0)) & set(_rows(p1))
    with pytest.raises(ValueError, match="not divisible"):
        input_pipeline.make_train_iterator(cfg, process_index=0, process_count=3)


def test_resume_from_json_state_gives_the_same_batches(prepared):
    out, _, _ = prepared
    cfg = _cfg(out)
    it = input_pipeline.make_train_iterator(cfg)
    _take(it, 3)
    state = json.loads(json.dumps(it.get_state()))
    expected = _take(it, 4)
    resumed = input_pipeline.make_train_iterator(cfg)
    resumed.set_state(state)
    for got, want in zip(_take(resumed, 4), expected, strict=True):
        np.testing.assert_array_equal(got["inputs"], want["inputs"])
        np.testing.assert_array_equal(got["targets"], want["targets"])
    other = input_pipeline.make_train_iterator(_cfg(out, seed=1))
    with pytest.raises(ValueError, match="seed: saved 0 != 1"):
        other.set_state(state)


def test_val_iterator_is_fixed_and_finite(prepared):
    out, meta, _ = prepared
    cfg = _cfg(out)
    first = list(input_pipeline.make_val_iterator(cfg, num_batches=100))
    second = list(input_pipeline.make_val_iterator(cfg, num_batches=100))
    n_windows = (meta["splits"]["val"]["num_tokens"] - 1) // SEQ_LEN
    assert 1 <= len(first) <= n_windows // 4
    assert _rows(first) == _rows(second)
    assert len(list(input_pipeline.make_val_iterator(cfg, num_batches=1))) == 1
    # Unshuffled: the first window is the start of the val stream.
    stream = np.concatenate(corpus.open_shards(out, "val"))
    np.testing.assert_array_equal(first[0]["inputs"][0], stream[:SEQ_LEN])
    with pytest.raises(ValueError, match="fewer than one batch"):
        input_pipeline.make_val_iterator(
            input_pipeline.DataConfig(data_dir=str(out), seq_len=4096), 1
        )
