"""HF LlamaConfig dicts (config.json) <-> `ModelConfig` (docs/design.md §11).

Mapped: hidden_size -> d_model, intermediate_size -> d_ff, num_hidden_layers ->
n_layers, num_attention_heads -> n_heads, num_key_value_heads -> n_kv_heads,
vocab_size, max_position_embeddings -> seq_len, rope_theta (or transformers 5's
rope_parameters.rope_theta), rms_norm_eps -> norm_eps, initializer_range -> init_std,
tie_word_embeddings -> tie_embeddings, hidden_act "relu" / "silu" -> ffn_variant
"gated_relu" / "gated_silu" (Llama's MLP is always gated), dtype / torch_dtype ->
dtype and param_dtype. What our model does not compute (rope scaling, biases, another
architecture, head_dim != hidden / heads) is a ValueError naming the field.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from twell_jax.config import ModelConfig

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
ARCHITECTURE = "LlamaForCausalLM"
# hidden_act -> ffn_variant: down(act(gate(x)) * up(x)).
ACTIVATIONS = {"relu": "gated_relu", "silu": "gated_silu"}
# LlamaConfig defaults, for keys a config.json leaves out.
_HF_DEFAULTS = {
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
}


def read_config(hf_dir: str | os.PathLike) -> dict[str, Any]:
    """The config.json of an HF checkpoint directory.

    Raises:
      FileNotFoundError: no config.json in `hf_dir`.
      ValueError: it is not a JSON object.
    """
    path = Path(hf_dir) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not an HF checkpoint directory (no {CONFIG_FILE})")
    return _read_json(path)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return config


def _unsupported(field: str, value: Any, why: str) -> ValueError:
    return ValueError(f"HF config {field}={value!r}: {why}")


def rope_theta(hf: Mapping[str, Any]) -> float:
    """RoPE base from `rope_parameters.rope_theta` (transformers >= 5) or `rope_theta`.

    Raises:
      ValueError: rope_scaling or rope_parameters has a rope_type other than "default".
    """
    scaling = hf.get("rope_scaling")
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) != "default":
        raise _unsupported("rope_scaling", scaling, "only default RoPE is supported")
    params = hf.get("rope_parameters") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise _unsupported("rope_parameters.rope_type", rope_type, "only 'default' is supported")
    return float(params.get("rope_theta", hf.get("rope_theta", _HF_DEFAULTS["rope_theta"])))


def _check_supported(hf: Mapping[str, Any]) -> None:
    """Raises ValueError naming the first field of `hf` our model cannot compute."""
    archs = hf.get("architectures")
    if archs is not None and list(archs) != [ARCHITECTURE]:
        raise _unsupported("architectures", archs, f"only [{ARCHITECTURE!r}] is supported")
    if hf.get("model_type", "llama") != "llama":
        raise _unsupported("model_type", hf["model_type"], "only 'llama' is supported")
    for field in ("attention_bias", "mlp_bias"):
        if hf.get(field):
            raise _unsupported(field, hf[field], "our model has no biases")
    act = hf.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise _unsupported("hidden_act", act, f"must be one of {sorted(ACTIVATIONS)}")
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    if hf.get("head_dim") is not None and hf["head_dim"] * heads != hidden:
        raise _unsupported(
            "head_dim",
            hf["head_dim"],
            f"must be hidden_size / num_attention_heads = {hidden}/{heads}",
        )


def config_from_hf(hf: Mapping[str, Any], **overrides: Any) -> ModelConfig:
    """ModelConfig of an HF LlamaConfig dict (the parsed config.json).

    Args:
      hf: the config dict.
      **overrides: ModelConfig fields to set instead (e.g. dtype="float32",
        ffn_impl="twell"). By default the compute and parameter dtypes are the
        checkpoint's `dtype` (`torch_dtype` before transformers 5) when it is bfloat16,
        else float32.

    Raises:
      ValueError: a field our model cannot compute (named), a required field missing,
        or an invalid resulting ModelConfig.
    """
    required = ("vocab_size", "hidden_size", "intermediate_size")
    required += ("num_hidden_layers", "num_attention_heads")
    missing = [k for k in required if k not in hf]
    if missing:
        raise ValueError(f"HF config lacks {missing}")
    _check_supported(hf)
    get = lambda k: hf.get(k, _HF_DEFAULTS[k])
    heads = hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads")
    kv_heads = heads if kv_heads is None else kv_heads  # 0 is ModelConfig's to refuse
    dtype = hf.get("dtype") or hf.get("torch_dtype")
    # float16 (and any other) tensors load exactly as float32: the kernels compute in
    # bfloat16 or float32 (dtype="bfloat16" overrides for speed).
    dtype = dtype if dtype in ("float32", "bfloat16") else "float32"
    fields = dict(
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        d_ff=hf["intermediate_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=heads,
        # Plain multi-head attention keeps the config (and parameter tree) of our own runs.
        n_kv_heads=None if kv_heads == heads else kv_heads,
        seq_len=get("max_position_embeddings"),
        rope_theta=rope_theta(hf),
        norm_eps=float(get("rms_norm_eps")),
        init_std=float(get("initializer_range")),
        tie_embeddings=bool(get("tie_word_embeddings")),
        ffn_variant=ACTIVATIONS[hf.get("hidden_act", "silu")],
        dtype=dtype,
        param_dtype=dtype,
    )
    return ModelConfig(**{**fields, **overrides})


def config_to_hf(
    cfg: ModelConfig, dtype: str | None = None, **token_ids: int | list[int] | None
) -> dict[str, Any]:
    """The HF LlamaConfig dict (config.json) of `cfg`.

    Args:
      cfg: the model config; ffn_variant must be gated ("relu" has no HF Llama form).
      dtype: the dtype name the tensors are saved in (default cfg.param_dtype).
      **token_ids: bos_token_id, eos_token_id, pad_token_id to record (None: left out).

    Raises:
      ValueError: cfg.ffn_variant="relu".
    """
    acts = {v: k for k, v in ACTIVATIONS.items()}
    if cfg.ffn_variant not in acts:
        raise ValueError(
            f"ModelConfig.ffn_variant={cfg.ffn_variant!r}: HF Llama has only gated MLPs "
            f"({sorted(acts)})"
        )
    dtype = dtype or cfg.param_dtype
    hf = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": acts[cfg.ffn_variant],
        "max_position_embeddings": cfg.seq_len,
        "rms_norm_eps": cfg.norm_eps,
        # Both spellings: transformers >= 5 reads rope_parameters, older ones rope_theta.
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"},
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "dtype": dtype,
        "torch_dtype": dtype,
    }
    hf.update({k: v for k, v in token_ids.items() if v is not None})
    return hf


def eos_token_ids(hf: Mapping[str, Any]) -> tuple[int, ...]:
    """The config's eos_token_id (an int or a list of them) as a tuple; () if unset."""
    eos = hf.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(int(i) for i in (eos if isinstance(eos, list) else [eos]))


def stop_token_ids(hf_dir: str | os.PathLike) -> tuple[int, ...]:
    """The ids that end a generation from `hf_dir`: config.json's eos_token_id, then
    those its generation_config.json adds (chat models list their end-of-turn tokens
    there), each once.

    Raises:
      FileNotFoundError, ValueError: as `read_config`.
    """
    ids = eos_token_ids(read_config(hf_dir))
    extra = Path(hf_dir) / GENERATION_CONFIG_FILE
    if extra.is_file():
        ids += eos_token_ids(_read_json(extra))
    return tuple(dict.fromkeys(ids))
