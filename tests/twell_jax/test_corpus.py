"""Corpus sources and shard preparation: content, determinism, bad inputs, the default corpus."""

import functools

import numpy as np
import pytest

from twell_jax import corpus, documents, tokenizer


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
        documents.file_documents(text_corpus[0]),
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


def test_ensure_default_data_prepares_stdlib_once(tmp_path, monkeypatch):
    # A 300 kB slice of the stdlib keeps the test fast; the full corpus takes ~1.5 s.
    small = functools.partial(documents.stdlib_documents, max_bytes=300_000)
    monkeypatch.setattr(corpus, "stdlib_documents", small)
    meta = corpus.ensure_default_data(tmp_path / "d", "byte")
    assert meta["source"].startswith("stdlib:") and meta["splits"]["train"]["num_docs"] > 5
    assert corpus.ensure_default_data(tmp_path / "d", "byte") == meta  # no second preparation
    assert corpus.ensure_default_data(tmp_path / "d") == meta  # None accepts the existing one
    bpe = tokenizer.train_bpe_from_texts(["abc abd"] * 10, 260, tmp_path / "tok.json")
    with pytest.raises(ValueError, match="prepared with tokenizer 'byte'"):
        corpus.ensure_default_data(tmp_path / "d", bpe.spec)


def test_replace_counts_like_python_replace(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, 4000, dtype=np.uint8).tobytes()
    (tmp_path / "r.txt").write_bytes(data)
    (doc,) = documents.file_documents([tmp_path / "r.txt"], on_invalid_utf8="replace")
    assert doc.text == data.decode("utf-8", errors="replace")
    assert doc.replaced > 100
    jsonl = tmp_path / "r.jsonl"
    jsonl.write_bytes(b'{"text": "a\xff\xfe"}\n{"text": "b"}\n')
    docs = list(documents.file_documents([jsonl], on_invalid_utf8="replace"))
    assert [(d.text, d.replaced) for d in docs] == [("a\ufffd\ufffd", 2), ("b", 0)]
    meta = corpus.prepare_corpus(
        docs, tmp_path / "out", tokenizer.ByteTokenizer(), source="t", val_fraction=0
    )
    assert meta["invalid_utf8_replaced"] == {"sequences": 2, "documents": 1}


def test_empty_inputs_are_errors(tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(ValueError, match=r"d holds no .*\.txt"):
        list(documents.file_documents([tmp_path / "d"]))
    tok = tokenizer.ByteTokenizer()
    with pytest.raises(ValueError, match="is empty: no documents"):
        corpus.prepare_corpus([], tmp_path / "o1", tok, source="t")
    docs = [documents.Document("a", ""), documents.Document("b", "")]
    with pytest.raises(ValueError, match="is empty: 2 documents, all without text"):
        corpus.prepare_corpus(docs, tmp_path / "o2", tok, source="t")
    assert not (tmp_path / "o2" / corpus.META_FILE).exists()
    with pytest.raises(ValueError, match="no text to train a BPE on"):
        corpus.train_corpus_bpe(docs, tmp_path / "o3.json", 300, val_fraction=0)


def test_too_small_for_val_warns_with_counts(tmp_path, monkeypatch):
    warnings = []
    monkeypatch.setattr(corpus.logging, "warning", lambda msg, *a: warnings.append(msg % a))
    docs = [documents.Document("only", "abc")]
    meta = corpus.prepare_corpus(
        docs, tmp_path / "o", tokenizer.ByteTokenizer(), source="t", val_fraction=0.01
    )
    assert meta["splits"]["val"]["num_docs"] == 0
    assert warnings == [
        "corpus 't' is too small for a validation split: none of its 1 documents (4 tokens) "
        "fell into val at val_fraction=0.01; evaluation will have no data "
        "(add documents or raise val_fraction)"
    ]
    corpus.prepare_corpus(
        docs, tmp_path / "o0", tokenizer.ByteTokenizer(), source="t", val_fraction=0
    )
    assert len(warnings) == 1  # val_fraction=0 asks for no validation split
