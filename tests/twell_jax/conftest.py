"""Fixtures of the corpus and input-pipeline tests: a small text corpus, prepared."""

import pytest

from tests.corpora import prepare_byte_corpus, write_text_corpus


@pytest.fixture
def text_corpus(tmp_path):
    """A directory of 12 .txt files and a .jsonl of 12 records (24 documents)."""
    return write_text_corpus(tmp_path)


@pytest.fixture
def prepared(tmp_path, text_corpus):
    """The corpus prepared with the byte tokenizer in small shards."""
    paths, texts = text_corpus
    out = tmp_path / "prepared"
    return out, prepare_byte_corpus(paths, out), texts
