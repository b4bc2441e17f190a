"""A run's batches: process-local rows to global arrays, the corpus's vocabulary check,
the record of which corpus a run trained on, and the validation evaluator
(`twell_jax.trainer` uses them)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
from absl import logging

from twell_jax import input_pipeline, train
from twell_jax.config import TrainConfig


def global_batch(local: dict[str, np.ndarray], placement, global_rows: int) -> dict:
    """This process's [B_p, S] numpy rows -> global [B, S] jax.Arrays on `placement`."""
    return {
        k: jax.make_array_from_process_local_data(placement, v, (global_rows, *v.shape[1:]))
        for k, v in local.items()
    }


def check_vocab(cfg: TrainConfig, meta: dict[str, Any], data_dir: str) -> None:
    """Raises ValueError when the corpus's tokenizer has more ids than the model."""
    tok = meta["tokenizer"]
    if tok["vocab_size"] > cfg.model.vocab_size:
        raise ValueError(
            f"{data_dir} uses a tokenizer of {tok['vocab_size']} ids ({tok['spec']}) but "
            f"model.vocab_size={cfg.model.vocab_size}: raise the vocab size or use another corpus"
        )


DATA_FILE = "data.json"


def write_data_record(workdir: str | Path, data_dir: str, meta: dict[str, Any]) -> None:
    """Writes workdir/data.json: the corpus a run trains on (absolute path and tokenizer
    fingerprint), so that tools reading the run (benchmarks on its checkpoint) take the
    same tokens without being told."""
    record = {"data_dir": str(Path(data_dir).resolve()), "tokenizer": meta["tokenizer"]}
    (Path(workdir) / DATA_FILE).write_text(json.dumps(record, indent=2) + "\n")


def run_data_dir(workdir: str | Path, data_dir: str | None = None) -> str:
    """The corpus of the run in `workdir`: `data_dir` when given, else its data.json's.

    Raises:
      FileNotFoundError: no `data_dir`, and the run has no data.json (written by runs
        since it exists) or the corpus it names is not on this machine: name the corpus.
      ValueError: `data_dir`'s tokenizer is not the one the run trained with.
    """
    path = Path(workdir) / DATA_FILE
    record = json.loads(path.read_text()) if path.exists() else None
    if data_dir is None:
        if record is None:
            raise FileNotFoundError(f"{path}: the run does not record its corpus; name it")
        if not Path(record["data_dir"]).is_dir():
            raise FileNotFoundError(
                f"{workdir} trained on {record['data_dir']}, which is not here: name a "
                f"copy of that corpus (its tokenizer fingerprint is checked)"
            )
        return record["data_dir"]
    if record is not None:
        from twell_jax import corpus

        theirs = record["tokenizer"].get("fingerprint")
        ours = corpus.load_meta(data_dir)["tokenizer"].get("fingerprint")
        if theirs != ours:
            raise ValueError(
                f"{data_dir}: tokenizer fingerprint {ours}, but {workdir} trained on "
                f"{record['data_dir']} with tokenizer fingerprint {theirs}"
            )
    return data_dir


class Evaluator:
    """Mean validation CE over the first `eval_batches` val batches (the same ones each time)."""

    def __init__(self, cfg: TrainConfig, data_cfg: input_pipeline.DataConfig, mesh, placement):
        self._cfg, self._data_cfg, self._placement = cfg, data_cfg, placement
        self._step = train.make_eval_step(cfg, mesh)
        try:
            next(input_pipeline.make_val_iterator(data_cfg, 1))
            self.enabled = True
        except ValueError as e:  # e.g. a small corpus without one full val batch
            logging.warning("validation disabled: %s", e)
            self.enabled = False

    def __call__(self, params) -> float:
        ces = [
            self._step(params, global_batch(b, self._placement, self._cfg.batch_size))
            for b in input_pipeline.make_val_iterator(self._data_cfg, self._cfg.eval_batches)
        ]
        return float(np.mean(jax.device_get(ces)))
