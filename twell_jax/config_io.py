"""Configs as plain dicts: JSON-friendly round trips (saved next to checkpoints) and the
dotted keys two configs differ in (what a resume checks)."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterable, Mapping
from typing import Any

from twell_jax.config import TrainConfig


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """A config dataclass or mapping -> nested plain dict (tuples become lists: JSON-friendly)."""

    def plain(v):
        if isinstance(v, tuple | list):
            return [plain(x) for x in v]
        if isinstance(v, Mapping):
            return {k: plain(x) for k, x in v.items()}
        return v

    return plain(dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else cfg)


def _from_dict(cls: type, d: dict[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ValueError(f"unknown config keys: {[prefix + k for k in unknown]}")
    kwargs = {}
    for key, value in d.items():
        if dataclasses.is_dataclass(hints[key]):
            value = _from_dict(hints[key], value, f"{prefix}{key}.")
        elif isinstance(value, list):
            value = tuple(value)
        kwargs[key] = value
    return cls(**kwargs)


def train_config_from_dict(d: dict[str, Any]) -> TrainConfig:
    """Inverse of `config_to_dict` for a TrainConfig; missing keys take defaults.

    Raises:
      ValueError: unknown keys (named with their dotted path) or invalid values.
    """
    return _from_dict(TrainConfig, d, "")


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}."""
    flat = {}
    for k, v in tree.items():
        if isinstance(v, Mapping):
            flat.update(flatten(v, f"{prefix}{k}."))
        else:
            flat[prefix + k] = v
    return flat


MISSING = "<missing>"
# Fields added after configs were first saved, by dotted path, with the value a saved
# config that lacks the key stands for (its behaviour when it was written): the key
# missing on one side and this value on the other is no difference.
# ce_chunk_tokens only changes the order of fp32 sums, so any value matches the
# unchunked loss of earlier runs.
ADDED_FIELD_DEFAULTS = {
    "model.n_kv_heads": None,
    "model.sparse_save_residuals": True,
    "sparsity.sparse_switch": "l0",
    "ce_chunk_tokens": 4096,
}


def _lookup(flat: dict[str, Any], key: str) -> Any:
    if key in flat:
        return flat[key]
    return ADDED_FIELD_DEFAULTS.get(key, MISSING)


def config_diff(a: Any, b: Any, ignore_keys: Iterable[str] = ()) -> dict[str, tuple[Any, Any]]:
    """The dotted keys whose values differ between two configs (dataclasses or dicts).

    Args:
      a, b: the configs; tuples and lists compare equal.
      ignore_keys: keys skipped when their full dotted path ("optim.total_steps") or
        their last component ("total_steps") is listed.

    Returns:
      Sorted key -> (a's value, b's value), `MISSING` where a config lacks the key (a
      key of `ADDED_FIELD_DEFAULTS` stands for its default there); empty when the
      configs match.
    """
    ignore = set(ignore_keys)
    fa, fb = flatten(config_to_dict(a)), flatten(config_to_dict(b))
    return {
        k: (_lookup(fa, k), _lookup(fb, k))
        for k in sorted(fa.keys() | fb.keys())
        if _lookup(fa, k) != _lookup(fb, k)
        and k not in ignore
        and k.rsplit(".", 1)[-1] not in ignore
    }
