"""Hugging Face Llama checkpoint directories <-> our model (docs/design.md §11).

A directory holds config.json (`config_map`) and safetensors weights (`weights`):

    cfg, params = hf.load_checkpoint("llama_dir", dtype="float32")   # or mesh=...
    logits, _ = nnx.merge(train.model_graphdef(cfg), params)(tokens)
    hf.save_checkpoint("out_dir", cfg, params, dtype="bfloat16")

`twell_jax.hf.init` starts a pretraining run from such a directory.

Needs the optional `safetensors` package (`pip install -e '.[hf]'`).
"""

from twell_jax.hf.config_map import (
    ACTIVATIONS,
    ARCHITECTURE,
    CONFIG_FILE,
    config_from_hf,
    config_to_hf,
    eos_token_ids,
    read_config,
    rope_theta,
    stop_token_ids,
)
from twell_jax.hf.weights import (
    DEFAULT_SHARD_BYTES,
    INDEX_FILE,
    WEIGHTS_FILE,
    abstract_params,
    check_export_dir,
    check_params,
    load_checkpoint,
    load_params,
    save_checkpoint,
)

__all__ = [
    "ACTIVATIONS",
    "ARCHITECTURE",
    "CONFIG_FILE",
    "DEFAULT_SHARD_BYTES",
    "INDEX_FILE",
    "WEIGHTS_FILE",
    "abstract_params",
    "check_export_dir",
    "check_params",
    "config_from_hf",
    "config_to_hf",
    "eos_token_ids",
    "load_checkpoint",
    "load_params",
    "read_config",
    "rope_theta",
    "save_checkpoint",
    "stop_token_ids",
]
