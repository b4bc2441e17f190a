"""Small corpora shared by the data, pretrain and prepare_data tests."""

import json
from pathlib import Path

import numpy as np


def random_texts(n: int, seed: int) -> list[str]:
    """Random lowercase documents (plus one non-ASCII) so windows are unique."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz \n"))
    texts = ["".join(rng.choice(letters, size=rng.integers(50, 400))) for _ in range(n)]
    texts[0] += " héllo 日本 🙂"
    return texts


def write_text_corpus(root: Path) -> tuple[list[Path], list[str]]:
    """A directory of 12 .txt files and a .jsonl of 12 records (24 documents) under root.

    Returns ([the directory, the .jsonl], the 24 texts).
    """
    src = root / "corpus"
    (src / "sub").mkdir(parents=True)
    texts = random_texts(24, seed=0)
    for i, text in enumerate(texts[:12]):
        (src / ("sub" if i % 2 else "") / f"doc{i:02d}.txt").write_text(text, encoding="utf-8")
    jsonl = root / "extra.jsonl"
    lines = [json.dumps({"text": t, "id": i}) for i, t in enumerate(texts[12:])]
    jsonl.write_text("\n".join(lines[:6]) + "\n\n" + "\n".join(lines[6:]) + "\n")
    return [src, jsonl], texts


def prepare_byte_corpus(paths: list[Path], out: Path) -> dict:
    """Prepares `write_text_corpus`'s paths into out with the byte tokenizer in small
    shards (a quarter of the documents for validation); returns the meta."""
    from twell_jax import corpus, documents, tokenizer

    return corpus.prepare_corpus(
        documents.file_documents(paths),
        out,
        tokenizer.ByteTokenizer(),
        source="test",
        val_fraction=0.25,
        shard_tokens=1000,
    )
