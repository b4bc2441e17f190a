"""A run's batches: process-local rows to global arrays, the corpus's vocabulary check
and the validation evaluator (`twell_jax.trainer` uses them)."""

from __future__ import annotations

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
