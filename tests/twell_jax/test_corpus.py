"""Corpus sources and shard preparation: content, determinism, bad inputs, the default corpus."""

import functools

import numpy as np
import pytest

from twell_jax import corpus, tokenizer


def test_prepare_writes_every_document_separated_by_eos(prepared):
    out, meta, texts = prepared
    tok = tokenizer.ByteTokenizer()
    docs = []
    for split in corpus.SPLITS:
        info = meta["splits"][split]
        shards = corpus.open_shards(out, split)
        assert len(shards) == len(info["shards"]) and sum(map(len, shards)) == info["num_tokens"]
        stream = np.concatenate(shards)
        assert stream[-1] == tok.eos_id and (stream == tok.eos_id).sum() == info["num_docs"]
        cuts = np.flatnonzero(stream == tok.eos_id)
        docs += [tok.decode(d) for d in np.split(stream, cuts + 1)[:-1]]
    assert sorted(docs) == sorted(texts)
    assert meta["splits"]["train"]["num_docs"] > 0 and meta["splits"]["val"]["num_docs"] > 0
    assert len(meta["splits"]["train"]["shards"]) > 1  # shard_tokens=1000 rolls over
    assert meta["dtype"] == "uint16" and meta["tokenizer"]["spec"] == "byte"


def test_prepare_is_deterministic_and_refuses_overwrite(tmp_path, text_corpus, prepared):
    out, meta, _ = prepared
    again = tmp_path / "again"
    meta2 = corpus.prepare_corpus(
        corpus.file_documents(text_corpus[0]),
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
        corpus.prepare_corpus([], out, tokenizer.ByteTokenizer(), source="test")


def test_bad_inputs_name_the_file(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": 3}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        list(corpus.file_documents([bad]))
    with pytest.raises(FileNotFoundError, match="nope"):
        list(corpus.file_documents([tmp_path / "nope"]))


def test_ensure_default_data_prepares_stdlib_once(tmp_path, monkeypatch):
    # A 300 kB slice of the stdlib keeps the test fast; the full corpus takes ~1.5 s.
    small = functools.partial(corpus.stdlib_documents, max_bytes=300_000)
    monkeypatch.setattr(corpus, "stdlib_documents", small)
    meta = corpus.ensure_default_data(tmp_path / "d", "byte")
    assert meta["source"].startswith("stdlib:") and meta["splits"]["train"]["num_docs"] > 5
    assert corpus.ensure_default_data(tmp_path / "d", "byte") == meta  # no second preparation
    assert corpus.ensure_default_data(tmp_path / "d") == meta  # None accepts the existing one
    bpe = tokenizer.train_bpe_from_texts(["abc abd"] * 10, 260, tmp_path / "tok.json")
    with pytest.raises(ValueError, match="prepared with tokenizer 'byte'"):
        corpus.ensure_default_data(tmp_path / "d", bpe.spec)
