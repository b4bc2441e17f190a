"""Corpus sources: bad files are named, invalid UTF-8 names the file and offset."""

import pytest

from twell_jax import documents


def test_bad_inputs_name_the_file(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": 3}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        list(documents.file_documents([bad]))
    with pytest.raises(FileNotFoundError, match="nope"):
        list(documents.file_documents([tmp_path / "nope"]))


def test_invalid_utf8_is_an_error_naming_file_and_offset(tmp_path):
    txt = tmp_path / "a.txt"
    txt.write_bytes("héllo ".encode() + b"\xe2\x82 x")
    with pytest.raises(ValueError, match=r"a\.txt: invalid UTF-8 at byte offset 7 "):
        list(documents.file_documents([txt]))
    jsonl = tmp_path / "b.jsonl"
    jsonl.write_bytes(b'{"text": "ok"}\n{"text": "\xff"}\n')
    with pytest.raises(ValueError, match=r"b\.jsonl: invalid UTF-8 at byte offset 25 "):
        list(documents.file_documents([jsonl]))
    with pytest.raises(ValueError, match="on_invalid_utf8"):
        list(documents.file_documents([txt], on_invalid_utf8="ignore"))
