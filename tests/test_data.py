"""Token-shard preparation and the grain pipelines: content, determinism, sharding, resume."""

import functools
import json
import subprocess
import sys

import numpy as np
import pytest

from twell_jax import data, tokenizer

SEQ_LEN = 16


def _texts(n: int, seed: int) -> list[str]:
    """Random lowercase documents (plus one non-ASCII) so windows are unique."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz \n"))
    texts = ["".join(rng.choice(letters, size=rng.integers(50, 400))) for _ in range(n)]
    texts[0] += " héllo 日本 🙂"
    return texts


@pytest.fixture
def corpus(tmp_path):
    """A directory of 12 .txt files and a .jsonl of 12 records (24 documents)."""
    src = tmp_path / "corpus"
    (src / "sub").mkdir(parents=True)
    texts = _texts(24, seed=0)
    for i, text in enumerate(texts[:12]):
        (src / ("sub" if i % 2 else "") / f"doc{i:02d}.txt").write_text(text, encoding="utf-8")
    jsonl = tmp_path / "extra.jsonl"
    lines = [json.dumps({"text": t, "id": i}) for i, t in enumerate(texts[12:])]
    jsonl.write_text("\n".join(lines[:6]) + "\n\n" + "\n".join(lines[6:]) + "\n")
    return [src, jsonl], texts


@pytest.fixture
def prepared(tmp_path, corpus):
    """The corpus prepared with the byte tokenizer in small shards."""
    paths, texts = corpus
    out = tmp_path / "prepared"
    meta = data.prepare_corpus(
        data.file_documents(paths),
        out,
        tokenizer.ByteTokenizer(),
        source="test",
        val_fraction=0.25,
        shard_tokens=1000,
    )
    return out, meta, texts


def _cfg(data_dir, **kw) -> data.DataConfig:
    return data.DataConfig(
        data_dir=str(data_dir), seq_len=SEQ_LEN, batch_size=4, num_threads=0, **kw
    )


def _take(it, n: int) -> list[dict[str, np.ndarray]]:
    return [next(it) for _ in range(n)]


def _rows(batches) -> list[tuple[int, ...]]:
    return [tuple(row) for b in batches for row in b["inputs"].tolist()]


def test_prepare_writes_every_document_separated_by_eos(prepared):
    out, meta, texts = prepared
    tok = data.load_data_tokenizer(out)
    docs = []
    for split in data.SPLITS:
        info = meta["splits"][split]
        shards = data.open_shards(out, split)
        assert len(shards) == len(info["shards"]) and sum(map(len, shards)) == info["num_tokens"]
        stream = np.concatenate(shards)
        assert stream[-1] == tok.eos_id and (stream == tok.eos_id).sum() == info["num_docs"]
        cuts = np.flatnonzero(stream == tok.eos_id)
        docs += [tok.decode(d) for d in np.split(stream, cuts + 1)[:-1]]
    assert sorted(docs) == sorted(texts)
    assert meta["splits"]["train"]["num_docs"] > 0 and meta["splits"]["val"]["num_docs"] > 0
    assert len(meta["splits"]["train"]["shards"]) > 1  # shard_tokens=1000 rolls over
    assert meta["dtype"] == "uint16" and meta["tokenizer"]["spec"] == "byte"


def test_prepare_is_deterministic_and_refuses_overwrite(tmp_path, corpus, prepared):
    out, meta, _ = prepared
    again = tmp_path / "again"
    meta2 = data.prepare_corpus(
        data.file_documents(corpus[0]),
        again,
        tokenizer.ByteTokenizer(),
        source="test",
        val_fraction=0.25,
        shard_tokens=1000,
    )
    assert meta2["splits"] == meta["splits"]
    for shard in meta["splits"]["train"]["shards"]:
        assert (out / shard["file"]).read_bytes() == (again / shard["file"]).read_bytes()
    with pytest.raises(FileExistsError, match="overwrite"):
        data.prepare_corpus([], out, tokenizer.ByteTokenizer(), source="test")


def test_bad_inputs_name_the_file(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": 3}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        list(data.file_documents([bad]))
    with pytest.raises(FileNotFoundError, match="nope"):
        list(data.file_documents([tmp_path / "nope"]))


def test_missing_or_corrupt_files_name_the_file(prepared):
    out, meta, _ = prepared
    first = out / meta["splits"]["train"]["shards"][0]["file"]
    first.write_bytes(first.read_bytes()[:-2])
    with pytest.raises(ValueError, match=f"corrupt shard .*{first.name}"):
        data.make_train_iterator(_cfg(out))
    first.unlink()
    with pytest.raises(FileNotFoundError, match=first.name):
        data.make_train_iterator(_cfg(out))
    (out / data.META_FILE).write_text('{"format_version": 1}')
    with pytest.raises(ValueError, match=r"corrupt .*meta\.json"):
        data.load_meta(out)
    (out / data.META_FILE).unlink()
    with pytest.raises(FileNotFoundError, match=r"meta\.json.*prepare_data"):
        data.make_train_iterator(_cfg(out))


def test_batches_shapes_and_shifted_targets(prepared):
    out, meta, _ = prepared
    batch = next(data.make_train_iterator(_cfg(out)))
    assert set(batch) == {"inputs", "targets"}
    for x in batch.values():
        assert x.shape == (4, SEQ_LEN) and x.dtype == np.int32
        assert x.max() < meta["tokenizer"]["vocab_size"]
    np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])


def test_shuffle_is_seeded_and_epochs_repeat(prepared):
    out, _, _ = prepared
    n = len(data.TokenWindows(data.open_shards(out, "train"), SEQ_LEN, 257))
    two_epochs = -(-2 * n // 4)  # batches
    a = _rows(_take(data.make_train_iterator(_cfg(out, seed=3)), two_epochs))
    b = _rows(_take(data.make_train_iterator(_cfg(out, seed=3)), two_epochs))
    c = _rows(_take(data.make_train_iterator(_cfg(out, seed=4)), two_epochs))
    assert a == b and a != c
    # Each epoch visits every window once, in a fresh order.
    ordered = _rows(_take(data.make_train_iterator(_cfg(out, shuffle=False)), -(-n // 4)))[:n]
    assert len(set(ordered)) == n
    assert set(a[:n]) == set(a[n : 2 * n]) == set(ordered)
    assert a[:n] != a[n : 2 * n] and a[:n] != ordered


def test_processes_get_disjoint_halves_of_the_batch(prepared):
    out, _, _ = prepared
    cfg = _cfg(out)
    p0 = _take(data.make_train_iterator(cfg, process_index=0, process_count=2), 3)
    p1 = _take(data.make_train_iterator(cfg, process_index=1, process_count=2), 3)
    assert p0[0]["inputs"].shape == (2, SEQ_LEN)
    assert not set(_rows(p0)) & set(_rows(p1))
    with pytest.raises(ValueError, match="not divisible"):
        data.make_train_iterator(cfg, process_index=0, process_count=3)


def test_resume_from_json_state_gives_the_same_batches(prepared):
    out, _, _ = prepared
    cfg = _cfg(out)
    it = data.make_train_iterator(cfg)
    _take(it, 3)
    state = json.loads(json.dumps(it.get_state()))
    expected = _take(it, 4)
    resumed = data.make_train_iterator(cfg)
    resumed.set_state(state)
    for got, want in zip(_take(resumed, 4), expected, strict=True):
        np.testing.assert_array_equal(got["inputs"], want["inputs"])
        np.testing.assert_array_equal(got["targets"], want["targets"])
    other = data.make_train_iterator(_cfg(out, seed=1))
    with pytest.raises(ValueError, match="seed: saved 0 != 1"):
        other.set_state(state)


def test_val_iterator_is_fixed_and_finite(prepared):
    out, meta, _ = prepared
    cfg = _cfg(out)
    first = list(data.make_val_iterator(cfg, num_batches=100))
    second = list(data.make_val_iterator(cfg, num_batches=100))
    n_windows = (meta["splits"]["val"]["num_tokens"] - 1) // SEQ_LEN
    assert 1 <= len(first) <= n_windows // 4
    assert _rows(first) == _rows(second)
    assert len(list(data.make_val_iterator(cfg, num_batches=1))) == 1
    # Unshuffled: the first window is the start of the val stream.
    stream = np.concatenate(data.open_shards(out, "val"))
    np.testing.assert_array_equal(first[0]["inputs"][0], stream[:SEQ_LEN])
    with pytest.raises(ValueError, match="fewer than one batch"):
        data.make_val_iterator(data.DataConfig(data_dir=str(out), seq_len=4096), 1)


def test_ensure_default_data_prepares_stdlib_once(tmp_path, monkeypatch):
    # A 300 kB slice of the stdlib keeps the test fast; the full corpus takes ~1.5 s.
    small = functools.partial(data.stdlib_documents, max_bytes=300_000)
    monkeypatch.setattr(data, "stdlib_documents", small)
    meta = data.ensure_default_data(tmp_path / "d", "byte")
    assert meta["source"].startswith("stdlib:") and meta["splits"]["train"]["num_docs"] > 5
    assert data.ensure_default_data(tmp_path / "d", "byte") == meta  # no second preparation
    assert data.ensure_default_data(tmp_path / "d") == meta  # None accepts the existing one
    bpe = tokenizer.train_bpe_from_texts(["abc abd"] * 10, 260, tmp_path / "tok.json")
    with pytest.raises(ValueError, match="prepared with tokenizer 'byte'"):
        data.ensure_default_data(tmp_path / "d", bpe.spec)


def test_prepare_data_cli_with_bpe(tmp_path, corpus):
    paths, texts = corpus
    out = tmp_path / "cli"
    cmd = [
        sys.executable,
        "-m",
        "experiments.prepare_data",
        f"--data_dir={out}",
        f"--inputs={paths[0]},{paths[1]}",
        "--bpe_vocab_size=300",
        "--val_fraction=0.25",
    ]
    subprocess.run(cmd, check=True, capture_output=True)
    meta = data.load_meta(out)
    assert meta["tokenizer"]["spec"] == data.TOKENIZER_FILE
    tok = data.load_data_tokenizer(out)
    assert tok.vocab_size == meta["tokenizer"]["vocab_size"] <= 300
    stream = np.concatenate([*data.open_shards(out, "train"), *data.open_shards(out, "val")])
    assert len(stream) < sum(len(t.encode()) for t in texts)  # BPE merges
    decoded = tok.decode(stream[: np.argmax(stream == tok.eos_id)])
    assert decoded in texts
