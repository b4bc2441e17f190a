"""Continued pretraining from an HF Llama checkpoint (`experiments.pretrain --init_from_hf`).

`prepare` turns the flags' TrainConfig into the run's and checks the directory (reading
only, before the run writes anything); `create_train_state` is the trainer's fresh start
when the workdir has no checkpoint: the HF weights, each placed in its training
sharding, and a new optimizer state at step 0. A workdir with checkpoints resumes them
and never reads the weights (docs/design.md §11).

The run's ModelConfig, field by field:

- the architecture comes from config.json (`ARCHITECTURE_FIELDS`: vocab_size, d_model,
  d_ff, n_layers, n_heads, n_kv_heads, rope_theta, norm_eps, tie_embeddings,
  ffn_variant). A flag or --set giving one of them another value is a ValueError
  naming the field; a preset's value is no request and is replaced;
- init_std is initializer_range unless set explicitly (in a continued run only the
  dead-neuron re-init draws from it);
- seq_len is the flags' (or the preset's): an explicit value above
  max_position_embeddings is a ValueError, the preset's is lowered to it;
- the rest comes from the flags (`FLAG_FIELDS`: ffn_impl, twell_compression,
  sparse_ell_width, sparse_save_residuals, dtype, param_dtype, remat). The
  checkpoint's dtype only says how its tensors are stored: they are read into
  param_dtype, the master copy is fp32.

Tokens: the run reads a corpus prepared beforehand (`experiments.prepare_data`). If the
HF directory holds a tokenizer.json that `twell_jax.tokenizer` loads, the corpus must
have been prepared with it (same fingerprint); otherwise the corpus's tokenizer is taken
to be the checkpoint's (with a warning). Either way its ids must fit vocab_size.

Origin: a fresh start writes `<workdir>/init_from_hf.json` (the directory, its
config.json, its files and sizes), never rewritten by a resume. A later run on the
workdir without --init_from_hf continues as a run of the recorded directory, and if that
directory has gone, the recorded config.json gives the architecture (a resume needs no
HF weights).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import jax
from absl import logging

from twell_jax import corpus, train
from twell_jax import tokenizer as tokenizer_lib
from twell_jax.config import ModelConfig, TrainConfig
from twell_jax.hf import config_map, weights

RECORD_FILE = "init_from_hf.json"
TOKENIZER_FILE = "tokenizer.json"
# ModelConfig field -> the config.json key it comes from; fixed by the checkpoint.
ARCHITECTURE_FIELDS = {
    "vocab_size": "vocab_size",
    "d_model": "hidden_size",
    "d_ff": "intermediate_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "rope_theta": "rope_theta",
    "norm_eps": "rms_norm_eps",
    "tie_embeddings": "tie_word_embeddings",
    "ffn_variant": "hidden_act",
}
# From config.json unless a flag or --set gives them.
HF_DEFAULT_FIELDS = {"init_std": "initializer_range"}
# From the flags (or the preset) alone: how the run trains, not what it trains.
FLAG_FIELDS = (
    *("ffn_impl", "twell_compression", "sparse_ell_width", "sparse_save_residuals"),
    *("dtype", "param_dtype", "remat"),
)
# seq_len: the flags', bounded by max_position_embeddings.
SEQ_LEN_FIELD = "seq_len"


def read_hf_config(hf_dir: str | os.PathLike) -> dict[str, Any]:
    """config.json of `hf_dir`.

    Raises:
      FileNotFoundError: `hf_dir` has no config.json.
      ValueError: config.json is not a JSON object.
    """
    path = Path(hf_dir) / config_map.CONFIG_FILE
    try:
        hf_config = config_map.read_config(hf_dir)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(hf_config, dict):
        raise ValueError(f"{path}: not a JSON object")
    return hf_config


def model_config(
    flags_model: ModelConfig,
    hf_config: Mapping[str, Any],
    explicit: Collection[str],
    source: str = "the HF config.json",
) -> ModelConfig:
    """The run's ModelConfig: the HF architecture with the flags' training fields.

    Args:
      flags_model: the ModelConfig the preset, flags and --set give.
      hf_config: the checkpoint's config.json.
      explicit: dotted keys ("model.d_model") a flag or --set gave explicitly.
      source: names the config in error messages.

    Raises:
      ValueError: an explicit architecture field that differs from the checkpoint's, an
        explicit seq_len above max_position_embeddings (each named), a config our
        model cannot compute, or an invalid resulting ModelConfig.
    """
    hf_model = config_map.config_from_hf(hf_config)
    for name, hf_key in ARCHITECTURE_FIELDS.items():
        if f"model.{name}" not in explicit:
            continue
        asked, given = getattr(flags_model, name), getattr(hf_model, name)
        if name == "n_kv_heads":  # None is "as many as n_heads"
            asked, given = asked or hf_model.n_heads, hf_model.kv_heads
        if asked != given:
            raise ValueError(
                f"model.{name}={getattr(flags_model, name)!r} (set by a flag or --set) "
                f"conflicts with {source}, whose {hf_key} gives model.{name}={given!r}: "
                "the architecture comes from the HF checkpoint; drop the setting"
            )
    seq_len, max_positions = flags_model.seq_len, hf_model.seq_len
    if seq_len > max_positions:
        if f"model.{SEQ_LEN_FIELD}" in explicit:
            raise ValueError(
                f"model.seq_len={seq_len} exceeds max_position_embeddings={max_positions} "
                f"of {source}: set a seq_len of at most {max_positions}"
            )
        logging.info("seq_len %d lowered to max_position_embeddings %d", seq_len, max_positions)
        seq_len = max_positions
    fields = {name: getattr(flags_model, name) for name in FLAG_FIELDS}
    fields.update(
        {n: getattr(flags_model, n) for n in HF_DEFAULT_FIELDS if f"model.{n}" in explicit}
    )
    return dataclasses.replace(hf_model, seq_len=seq_len, **fields)


def check_tokenizer(hf_dir: str | os.PathLike, model: ModelConfig, data_dir: str) -> None:
    """Checks that the corpus of `data_dir` speaks the checkpoint's token ids.

    Raises:
      FileNotFoundError: `data_dir` is not a prepared corpus.
      ValueError: the corpus was prepared with another tokenizer than the checkpoint's
        tokenizer.json, or its ids do not fit `model.vocab_size`.
    """
    tok_meta = corpus.load_meta(data_dir)["tokenizer"]
    path = Path(hf_dir) / TOKENIZER_FILE
    hf_tok, why = None, f"{hf_dir} has no {TOKENIZER_FILE}"
    if path.is_file():
        try:
            hf_tok = tokenizer_lib.HFTokenizer(path)
        except (ValueError, ImportError) as e:
            why = f"{path} is not usable here ({e})"
    if hf_tok is not None and tok_meta["fingerprint"] != hf_tok.fingerprint():
        raise ValueError(
            f"{data_dir} was prepared with the tokenizer {tok_meta['spec']!r}, not the HF "
            f"checkpoint's {path}: its ids would not mean what the checkpoint learned. "
            f"Prepare a corpus with it: python -m experiments.prepare_data "
            f"--data_dir=NEW_DIR --tokenizer={path}"
        )
    if hf_tok is None:
        logging.warning(
            "%s: the corpus's tokenizer %s (%d ids) is taken to be the checkpoint's",
            why,
            tok_meta["spec"],
            tok_meta["vocab_size"],
        )
    if tok_meta["vocab_size"] > model.vocab_size:
        raise ValueError(
            f"{data_dir} uses the tokenizer {tok_meta['spec']!r} of {tok_meta['vocab_size']} "
            f"ids, more than the HF checkpoint's vocab_size={model.vocab_size} (its "
            "embedding rows): prepare the corpus with the checkpoint's tokenizer"
        )


def read_record(workdir: str | os.PathLike) -> dict[str, Any] | None:
    """The workdir's record of the HF checkpoint its run started from; None if none.

    Raises:
      ValueError: the record is corrupt.
    """
    path = Path(workdir) / RECORD_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        if not isinstance(record["hf_dir"], str) or not isinstance(record["config"], dict):
            raise TypeError("hf_dir must be a string and config an object")
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: corrupt record ({type(e).__name__}: {e})") from e
    return record


def write_record(workdir: str | os.PathLike, hf_dir: str | os.PathLike) -> Path:
    """Writes `<workdir>/RECORD_FILE`: `hf_dir` (absolute), its config.json, its files."""
    src = Path(hf_dir).absolute()
    record = {
        "hf_dir": str(src),
        "config": read_hf_config(src),
        "files": {p.name: p.stat().st_size for p in sorted(src.iterdir()) if p.is_file()},
    }
    path = Path(workdir) / RECORD_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{RECORD_FILE}.tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def _same_dir(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    return Path(a).absolute().resolve() == Path(b).absolute().resolve()


def prepare(
    cfg: TrainConfig,
    hf_dir: str | None,
    explicit: Collection[str],
    workdir: str | os.PathLike,
    data_dir: str,
) -> tuple[TrainConfig, str | None]:
    """The run config and the HF directory a fresh start loads (`RunOptions.init_from_hf`).

    Reads only. Without `hf_dir`, the workdir's record names the directory (a run that
    started from it continues as one); without either, returns `(cfg, None)`. A readable
    directory is checked in full (config.json, the safetensors headers against the
    config, the corpus's tokenizer); a recorded directory that has gone gives its
    recorded config.json, for a resume (a fresh start then fails to read the weights).

    Args:
      cfg: the config of the preset, flags and --set.
      hf_dir: --init_from_hf, or None (or "").
      explicit: dotted keys a flag or --set gave (see `model_config`).
      workdir: the run directory (its record is read, nothing is written).
      data_dir: the prepared corpus the run reads.

    Raises:
      FileNotFoundError: `hf_dir` has no config.json or no weights, or `data_dir` is
        not a prepared corpus.
      ValueError: a corrupt directory or record, a flag conflicting with the
        architecture, a config our model cannot compute, a corpus of another tokenizer.
    """
    record = read_record(workdir)
    if not hf_dir:
        if record is None:
            return cfg, None
        hf_dir = record["hf_dir"]
        logging.info("%s/%s: the run started from %s; continuing it", workdir, RECORD_FILE, hf_dir)
    elif record is not None:
        logging.info("%s/%s: the run started from %s", workdir, RECORD_FILE, record["hf_dir"])
    try:
        hf_config, readable = read_hf_config(hf_dir), True
    except FileNotFoundError:
        if record is None or not _same_dir(record["hf_dir"], hf_dir):
            raise
        hf_config, readable = record["config"], False
        logging.warning(
            "%s is gone: the architecture is its config.json as recorded in %s/%s (a resume "
            "needs no HF weights)",
            hf_dir,
            workdir,
            RECORD_FILE,
        )
    source = f"{Path(hf_dir) / config_map.CONFIG_FILE}"
    model = model_config(cfg.model, hf_config, explicit, source)
    cfg = dataclasses.replace(cfg, model=model)
    if readable:
        weights.check_params(hf_dir, model)
        check_tokenizer(hf_dir, model, data_dir)
    logging.info(
        "init_from_hf %s: vocab %d, d_model %d, d_ff %d, %d layers, %d/%d heads, %s from its "
        "config.json; seq_len %d, ffn_impl %s, dtype %s from the flags",
        hf_dir,
        model.vocab_size,
        model.d_model,
        model.d_ff,
        model.n_layers,
        model.n_heads,
        model.kv_heads,
        model.ffn_variant,
        model.seq_len,
        model.ffn_impl,
        model.dtype,
    )
    return cfg, str(hf_dir)


def create_train_state(
    cfg: TrainConfig,
    mesh: jax.sharding.Mesh,
    hf_dir: str | os.PathLike,
    workdir: str | os.PathLike | None = None,
) -> train.TrainState:
    """A fresh TrainState (step 0, new optimizer state) around the weights of `hf_dir`.

    Each parameter is read into cfg.model.param_dtype and placed in its training
    sharding (`weights.load_params`), then cast to the fp32 master copy. With `workdir`,
    process 0 then writes the record of the source (`write_record`).

    Raises:
      FileNotFoundError: no weights in `hf_dir`.
      ValueError: a tensor missing, misshapen or left over for `cfg.model`.
    """
    logging.info("no checkpoint: starting from the HF checkpoint %s", hf_dir)
    params = weights.load_params(hf_dir, cfg.model, mesh)
    donate = cfg.model.param_dtype == "float32"  # the fp32 state can reuse the buffers
    state = train.train_state_from_params(cfg, mesh, params, donate=donate)
    if workdir is not None and jax.process_index() == 0:
        logging.info("HF source recorded -> %s", write_record(workdir, hf_dir))
    return state
