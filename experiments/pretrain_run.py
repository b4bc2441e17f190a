"""Reads what a pretrain workdir holds: its config, newest parameters and tokenizer.

Shared by `experiments.hf_convert`, `experiments.generate` and
`experiments.neuron_profile` (flag-free, so the CLIs can import it), with the log
filter of every CLI that reads or writes checkpoints (`keep_log_record`) and their check
of an output file's path (`check_output_file`). A workdir
(`experiments.pretrain --workdir`) holds checkpoints/ (each step with its config); the
tokenizer is recorded by the prepared corpus it trained on (`<data_dir>/meta.json`:
"byte", or a tokenizer.json copied into data_dir), which the workdir does not name,
hence the `data_dir` argument.
"""

from __future__ import annotations

import logging as py_logging
import os
from pathlib import Path
from typing import Any

import jax
from absl import logging

from twell_jax import checkpoint, corpus, sharding, train, trainer
from twell_jax import tokenizer as tokenizer_lib
from twell_jax.config import TrainConfig
from twell_jax.config_io import train_config_from_dict


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


def tokenizer_of_corpus(data_dir: str | Path) -> tokenizer_lib.Tokenizer:
    """The tokenizer `data_dir` was prepared with (its meta.json entry).

    Raises:
      FileNotFoundError: `data_dir` is not a prepared corpus.
    """
    spec = corpus.load_meta(data_dir)["tokenizer"]["spec"]
    if spec != tokenizer_lib.BYTE_SPEC:
        spec = str(Path(data_dir) / spec)  # recorded relative to data_dir
    return tokenizer_lib.load_tokenizer(spec)


def keep_log_record(record: py_logging.LogRecord) -> bool:
    """The entry points' absl handler filter: every warning and error, and the INFO
    records but Orbax's (dozens per save or restore) and JAX's notes on the backends it
    could not start ("Unable to initialize backend 'tpu'" opens every CPU run; the mesh
    line names the backend in use).

    Orbax logs through absl like the entry points, so a level on its own logger is not
    enough.
    """
    if record.levelno >= py_logging.WARNING:
        return True
    if "/orbax/" in record.pathname:
        return False
    return not record.getMessage().startswith("Unable to initialize backend")


def check_output_file(flag: str, path: str | None) -> None:
    """Refuses `--flag=path` up front when the file could not be written once the work
    is done: a directory, or a parent directory that is missing or not writable.

    Raises:
      FileNotFoundError, ValueError: naming the flag.
    """
    if not path:
        return
    out = Path(path)
    if out.is_dir():
        raise ValueError(f"--{flag}={out}: is a directory")
    if not out.parent.is_dir():
        raise FileNotFoundError(f"--{flag}={out}: no directory {out.parent}")
    if not os.access(out.parent, os.W_OK):
        raise ValueError(f"--{flag}={out}: cannot write in {out.parent}")


def start_cli(argv: list[str]) -> bool:
    """What an entry point's main does first: the log filter (`keep_log_record`) on
    absl's handler, and a one-line refusal of positional arguments (a stray word, or a
    value after a boolean flag, `--resume no`) instead of absl's usage text. Returns
    False when refused."""
    logging.get_absl_handler().addFilter(keep_log_record)
    if len(argv) > 1:
        logging.error("refused: unexpected arguments %s (flags take --name=value)", argv[1:])
        return False
    return True
