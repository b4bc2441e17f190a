"""`python -m experiments.prepare_data`: a BPE trained on the corpus, then its shards."""

import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.corpora import write_text_corpus
from twell_jax import corpus, tokenizer

REPO = Path(__file__).resolve().parents[2]


def test_prepare_data_cli_with_bpe(tmp_path):
    paths, texts = write_text_corpus(tmp_path)
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
    subprocess.run(cmd, check=True, capture_output=True, cwd=REPO)
    meta = corpus.load_meta(out)
    assert meta["tokenizer"]["spec"] == corpus.TOKENIZER_FILE
    tok = tokenizer.load_tokenizer(out / meta["tokenizer"]["spec"])
    assert tok.vocab_size == meta["tokenizer"]["vocab_size"] <= 300
    stream = np.concatenate([*corpus.open_shards(out, "train"), *corpus.open_shards(out, "val")])
    assert len(stream) < sum(len(t.encode()) for t in texts)  # BPE merges
    decoded = tok.decode(stream[: np.argmax(stream == tok.eos_id)])
    assert decoded in texts


def _run(tmp_path, *args):
    cmd = [sys.executable, "-m", "experiments.prepare_data", f"--data_dir={tmp_path / 'out'}"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, cwd=REPO)


def test_invalid_utf8_fails_naming_file_and_offset_unless_replaced(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"hello \xff world \xc3( end")
    run = _run(tmp_path, f"--inputs={bad}")
    assert run.returncode != 0
    assert f"{bad}: invalid UTF-8 at byte offset 6" in run.stderr
    assert not (tmp_path / "out" / corpus.META_FILE).exists()
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
