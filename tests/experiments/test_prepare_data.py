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
