"""Helpers for the end-to-end `python -m experiments.pretrain` tests: the tiny run's
flags, a small synthetic corpus and the CLI as a subprocess.

The subprocesses share a persistent compilation cache (the `cache_dir` fixture of
conftest.py), so only the first one pays for compiling the train and eval steps.
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from twell_jax import corpus, documents, metrics, tokenizer

REPO = Path(__file__).resolve().parents[2]
TINY_FLAGS = (
    "--preset=tiny",
    "--set=model.d_model=64",
    "--set=model.n_layers=2",
    "--set=model.d_ff=256",
    "--seq_len=32",
    "--batch_size=4",
    "--warmup_steps=1",
    "--l1_coef=1e-3",
    "--log_every=1",
    "--eval_every=3",
    "--eval_batches=2",
    "--checkpoint_every=3",
)


def cli_env(cache_dir: Path) -> dict[str, str]:
    return {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "JAX_COMPILATION_CACHE_DIR": str(cache_dir),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }


def cli_command(workdir: Path, data_dir: Path, flags) -> list[str]:
    return [
        sys.executable,
        "-m",
        "experiments.pretrain",
        *TINY_FLAGS,
        f"--data_dir={data_dir}",
        f"--workdir={workdir}",
        *flags,
    ]


def run_cli(workdir: Path, data_dir: Path, cache_dir: Path, *flags: str, check: bool = True):
    """Runs the CLI to completion.

    Returns:
      Its combined output, failing the test on a non-zero exit; with check=False the
      CompletedProcess.
    """
    proc = subprocess.run(
        cli_command(workdir, data_dir, flags),
        cwd=REPO,
        env=cli_env(cache_dir),
        capture_output=True,
        text=True,
        timeout=300,
    )
    if not check:
        return proc
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stderr + proc.stdout


def train_ce(workdir: Path) -> dict[int, float]:
    records = metrics.read_metrics(workdir / metrics.METRICS_FILE)
    return {r["step"]: r["ce"] for r in records if r["kind"] == "train"}


def val_ce(workdir: Path) -> dict[int, float]:
    records = metrics.read_metrics(workdir / metrics.METRICS_FILE)
    return {r["step"]: r["val_ce"] for r in records if r["kind"] == "eval"}


def checkpoint_steps(workdir: Path) -> list[int]:
    return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


def write_word_corpus(out: Path) -> Path:
    """A byte-tokenized corpus of 120 short synthetic documents (both splits non-empty)."""
    rng = np.random.default_rng(0)
    words = [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "a",
        "lazy",
        "dog",
        "while",
        "sparse",
        "neurons",
        "rarely",
        "fire",
    ]
    docs = [
        documents.Document(f"doc{i}.txt", " ".join(rng.choice(words, size=120))) for i in range(120)
    ]
    meta = corpus.prepare_corpus(
        docs, out, tokenizer.load_tokenizer("byte"), source="synthetic", val_fraction=0.2
    )
    assert meta["splits"]["val"]["num_tokens"] > 2 * 4 * 33  # two val batches
    return out
