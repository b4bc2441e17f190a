"""Reads what a pretrain workdir holds: its config, newest parameters and tokenizer.

Shared by `experiments.hf_convert`, `experiments.generate` and
`experiments.neuron_profile` (flag-free, so the CLIs can import it). A workdir
(`experiments.pretrain --workdir`) holds checkpoints/ (each step with its config); the
tokenizer is recorded by the prepared corpus it trained on (`<data_dir>/meta.json`:
"byte", or a tokenizer.json copied into data_dir), which the workdir names in its
data.json (`run_corpus`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax

from twell_jax import checkpoint, corpus, run_data, sharding, train, trainer
from twell_jax import tokenizer as tokenizer_lib
from twell_jax.config import TrainConfig
from twell_jax.config_io import train_config_from_dict
from twell_jax.input_pipeline import DataConfig


def load_params(workdir: str | Path) -> tuple[TrainConfig, dict[str, Any], int]:
    """(the run's config, its newest readable parameters as saved (fp32 masters), that step).

    The config is the one saved with that checkpoint step. Only the parameters are read
    (not the optimizer state), onto one device. The checkpoints are opened read-only, so
    this is safe beside a run that is still training in `workdir`: a save in progress is
    left alone, and an unreadable newest step is skipped (one warning) but not moved.

    Raises:
      FileNotFoundError: `workdir` has no checkpoints.
      checkpoint.CheckpointCorruptError: no step's config and parameters are readable.
    """
    directory = Path(workdir) / trainer.CHECKPOINT_DIR
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory}: not a pretrain workdir (no checkpoints)")
    # Generation and export are single-device code: restore onto the first device.
    mesh = sharding.make_mesh(1, 1, devices=jax.devices()[:1])
    with checkpoint.Checkpointer(directory, read_only=True) as ckpt:
        if ckpt.latest_step() is None:
            raise FileNotFoundError(f"{directory}: no checkpoint")
        configs = {}

        def params_target(step: int):
            configs[step] = train_config_from_dict(ckpt.saved_config(step))
            return train.abstract_train_state(configs[step], mesh).params

        restored = ckpt.restore_params(params_target)
    return configs[restored.step], restored.state["params"], restored.step


def run_corpus(workdir: str | Path, data_dir: str | None = None) -> str:
    """The prepared corpus of the run in `workdir`: `data_dir` when given (checked
    against the tokenizer the run recorded), else the one its data.json names; a run
    from before data.json existed falls back to the default corpus (`DataConfig`).

    Raises:
      FileNotFoundError: the recorded corpus is not on this machine (name a copy).
      ValueError: `data_dir`'s tokenizer is not the run's.
    """
    if data_dir is None and not (Path(workdir) / run_data.DATA_FILE).exists():
        return DataConfig.data_dir
    return run_data.run_data_dir(workdir, data_dir)


def tokenizer_of_corpus(data_dir: str | Path) -> tokenizer_lib.Tokenizer:
    """The tokenizer `data_dir` was prepared with (its meta.json entry).

    Raises:
      FileNotFoundError: `data_dir` is not a prepared corpus.
    """
    spec = corpus.load_meta(data_dir)["tokenizer"]["spec"]
    if spec != tokenizer_lib.BYTE_SPEC:
        spec = str(Path(data_dir) / spec)  # recorded relative to data_dir
    return tokenizer_lib.load_tokenizer(spec)
