"""Byte-level and tokenizer.json (BPE) tokenizers: round trips and error messages."""

import numpy as np
import pytest

from twell_jax import tokenizer

TEXT = "héllo wörld ✓ 日本語 🙂\n\tdef f(x): return x  # ok"
CORPUS = ["def add(a, b):\n    return a + b\n", "class Foo:\n    pass\n", "héllo wörld 日本\n"] * 20


def test_byte_round_trip_non_ascii():
    tok = tokenizer.load_tokenizer("byte")
    ids = tok.encode(TEXT)
    assert ids.dtype == np.int32
    assert ids.tolist() == list(TEXT.encode("utf-8"))
    assert (tok.vocab_size, tok.eos_id, tok.spec) == (257, 256, "byte")
    # EOS is dropped on decode, so documents joined by EOS decode to their concatenation.
    assert tok.decode([*ids.tolist(), tok.eos_id, *ids.tolist()]) == TEXT + TEXT


def test_byte_decode_of_cut_character_does_not_raise():
    assert tokenizer.ByteTokenizer().decode("é".encode()[:1]) == "\ufffd"


def test_bpe_train_save_load_round_trip(tmp_path):
    texts = [text * 20 for text in CORPUS[:3]]
    out = tmp_path / "tok" / "tokenizer.json"
    trained = tokenizer.train_bpe_from_texts(texts, vocab_size=300, out_path=out)
    loaded = tokenizer.load_tokenizer(str(out))
    assert out.is_file() and loaded.spec == str(out.resolve())
    assert loaded.vocab_size == trained.vocab_size <= 300
    assert loaded.eos_id == trained.eos_id
    ids = loaded.encode(TEXT)
    assert ids.max() < loaded.vocab_size and loaded.eos_id not in ids
    assert loaded.decode([*ids.tolist(), loaded.eos_id]) == TEXT
    # Merges were learned: a frequent line is shorter than its bytes.
    assert len(loaded.encode(CORPUS[0])) < len(CORPUS[0])
    assert loaded.fingerprint() == trained.fingerprint() != "byte-v1"


def test_bpe_errors(tmp_path):
    with pytest.raises(ValueError, match=">= 257"):
        tokenizer.train_bpe_from_texts(CORPUS, vocab_size=100, out_path=tmp_path / "t.json")
    out = tmp_path / "t.json"
    tokenizer.train_bpe_from_texts(CORPUS, vocab_size=280, out_path=out)
    with pytest.raises(ValueError, match="<nope>"):
        tokenizer.HFTokenizer(out, eos_token="<nope>")
    # The EOS by id (a model config's eos_token_id), whatever its name.
    assert tokenizer.HFTokenizer(out, eos_id=65).eos_id == 65
    with pytest.raises(ValueError, match="no token of eos id 100000"):
        tokenizer.HFTokenizer(out, eos_id=100000)


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither 'byte'"):
        tokenizer.load_tokenizer(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=r"not a valid tokenizer\.json"):
        tokenizer.load_tokenizer(bad)
