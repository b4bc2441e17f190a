"""Fixtures of the pretrain CLI tests (tests/experiments/pretrain_cli.py), per worker
process: one corpus, one compilation cache and one finished run shared by the modules
that read it."""

from pathlib import Path

import pytest

from tests.experiments.pretrain_cli import run_cli, write_word_corpus


@pytest.fixture(scope="package")
def data_dir(tmp_path_factory) -> Path:
    """A byte-tokenized corpus of 120 short synthetic documents (both splits non-empty)."""
    return write_word_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="package")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("jax_cache")


@pytest.fixture(scope="package")
def straight(tmp_path_factory, data_dir, cache_dir) -> tuple[Path, str]:
    """A finished 6-step run (its workdir and output); tests copy it before changing it."""
    workdir = tmp_path_factory.mktemp("straight") / "run"
    return workdir, run_cli(workdir, data_dir, cache_dir, "--steps=6")
