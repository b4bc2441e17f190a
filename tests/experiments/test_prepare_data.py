"""`python -m experiments.prepare_data`: a BPE trained on the corpus, then its shards."""

import numpy as np
import pytest

from tests.corpora import write_text_corpus
from tests.experiments.cli import refusal, run_module
from twell_jax import corpus, tokenizer


def test_prepare_data_cli_with_bpe(tmp_path):
    paths, texts = write_text_corpus(tmp_path)
    out = tmp_path / "cli"
    proc = run_module(
        "prepare_data",
        f"--data_dir={out}",
        f"--inputs={paths[0]},{paths[1]}",
        "--bpe_vocab_size=300",
        "--val_fraction=0.25",
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    meta = corpus.load_meta(out)
    assert meta["tokenizer"]["spec"] == corpus.TOKENIZER_FILE
    tok = tokenizer.load_tokenizer(out / meta["tokenizer"]["spec"])
    assert tok.vocab_size == meta["tokenizer"]["vocab_size"] <= 300
    stream = np.concatenate([*corpus.open_shards(out, "train"), *corpus.open_shards(out, "val")])
    assert len(stream) < sum(len(t.encode()) for t in texts)  # BPE merges
    decoded = tok.decode(stream[: np.argmax(stream == tok.eos_id)])
    assert decoded in texts
    # A refused --overwrite trains its BPE outside the corpus: the old one stays whole.
    before = (out / corpus.TOKENIZER_FILE).read_bytes()
    other = tmp_path / "other.txt"
    other.write_text("quite different words entirely, " * 50)
    refused = run_module("prepare_data", f"--data_dir={out}", f"--inputs={other}",
                         "--bpe_vocab_size=280", "--overwrite", "--val_fraction=-0.5")  # fmt: skip
    assert "val_fraction must be in [0, 1)" in refusal(refused)
    assert (out / corpus.TOKENIZER_FILE).read_bytes() == before
    assert corpus.load_meta(out) == meta


def _run(tmp_path, *args):
    return run_module("prepare_data", f"--data_dir={tmp_path / 'out'}", *args)


def test_invalid_utf8_fails_naming_file_and_offset_unless_replaced(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"hello \xff world \xc3( end")
    run = _run(tmp_path, f"--inputs={bad}")
    assert (
        f"{bad}: invalid UTF-8 at byte offset 6 (b'\\xff'); pass --on_invalid_utf8=replace to "
        in (refusal(run))
    )
    assert not (tmp_path / "out").exists()
    run = _run(tmp_path, f"--inputs={bad}", "--on_invalid_utf8=replace", "--val_fraction=0")
    assert run.returncode == 0, run.stderr
    assert "replaced 2 invalid UTF-8 sequences" in run.stderr
    assert "2 invalid UTF-8 sequences replaced in 1 docs" in run.stdout
    meta = corpus.load_meta(tmp_path / "out")
    assert meta["invalid_utf8_replaced"] == {"sequences": 2, "documents": 1}


def test_empty_input_is_an_error(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    run = _run(tmp_path, f"--inputs={empty}")
    assert run.returncode != 0 and "is empty: 1 documents, all without text" in run.stderr
    run = _run(tmp_path, f"--inputs={empty}", "--bpe_vocab_size=300", "--val_fraction=0")
    assert run.returncode != 0 and "no text to train a BPE on" in run.stderr
    assert not (tmp_path / "out" / corpus.META_FILE).exists()


def test_corpus_too_small_for_val_warns_with_counts(tmp_path):
    one = tmp_path / "one.txt"
    one.write_text("a single short document\n")
    run = _run(tmp_path, f"--inputs={one}", "--val_fraction=0.01")
    assert run.returncode == 0, run.stderr
    assert "too small for a validation split: none of its 1 documents (25 tokens)" in run.stderr


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("empty_dir", None, "empty_dir holds no .txt/.md/.rst/.py/.jsonl files"),
        ("missing", "", "corpus path not found: "),
        ("a.bin", b"\x7fELF\x02\x01\x01\x00\x80\x81", "a.bin: invalid UTF-8 at byte offset 8"),
        ("a.jsonl", b'{"txt": "a"}\n', "a.jsonl:1: expected an object with a string 'text' field"),
        ("b.jsonl", b'{"text": "a"}\n{bad\n', "b.jsonl:2: invalid JSON: "),
    ],
)
def test_an_input_it_cannot_read_is_one_refused_line_leaving_no_data_dir(
    tmp_path, name, content, message
):
    path = tmp_path / name
    if content is None:
        path.mkdir()
    elif content:
        path.write_bytes(content)
    run = _run(tmp_path, f"--inputs={path}", f"--data_dir={tmp_path / 'out' / 'sub'}")
    assert message in refusal(run)
    assert not (tmp_path / "out").exists()  # nor the parent the run would have made


def test_an_already_prepared_data_dir_is_one_refused_line(tmp_path):
    one = tmp_path / "one.txt"
    one.write_text("a single short document\n")
    assert _run(tmp_path, f"--inputs={one}").returncode == 0
    again = _run(tmp_path, f"--inputs={one}")
    assert "out is already prepared; pass --overwrite" in refusal(again)
    assert len(again.stderr.splitlines()) == 1


def test_warns_when_the_corpus_is_smaller_than_asked_or_than_a_default_run(tmp_path):
    one = tmp_path / "one.txt"
    one.write_text("a single short document\n")
    run = _run(tmp_path, f"--inputs={one}", "--bpe_vocab_size=512", "--val_fraction=0")
    assert run.returncode == 0, run.stderr
    vocab = corpus.load_meta(tmp_path / "out")["tokenizer"]["vocab_size"]
    assert vocab < 512 and f"BPE vocabulary of {vocab} tokens, not the 512 requested" in run.stderr
    assert "too small for a default pretrain run (--preset=tiny): train split of" in run.stderr
