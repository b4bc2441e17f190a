"""Dotted-key config overrides: `with_overrides` and the `section.field=value` parser.

Flags reach any `TrainConfig` field as strings ("model.d_ff=1024", "optim.betas=0.9,0.99",
"sparsity.tokens_until_dead=none"); `with_overrides` parses each to the type of the field
it replaces and reruns the dataclasses' validation.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Iterable
from typing import Any


def parse_assignments(items: Iterable[str]) -> dict[str, str]:
    """["model.d_ff=1024", ...] -> {"model.d_ff": "1024", ...} (later items win).

    Raises:
      ValueError: an item without "=".
    """
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"{item!r}: expected section.field=value")
        out[key.strip()] = value.strip()
    return out


def _convert(text: str, kind: type) -> Any:
    """`kind(text)` for a scalar field type; ValueError saying what was expected."""
    try:
        return kind(text.strip())
    except (TypeError, ValueError):
        raise ValueError(f"expected {'an' if kind is int else 'a'} {kind.__name__}") from None


def _parse(text: str, current: Any, hint: Any) -> Any:
    """Parses a string override to the type of the field it replaces.

    Raises:
      ValueError: saying what the field expects (the caller names field and value).
    """
    if text.lower() == "none" and type(None) in typing.get_args(hint):
        return None
    if isinstance(current, bool):
        if text.lower() not in ("true", "false", "1", "0"):
            raise ValueError("expected a bool (true, false, 1 or 0)")
        return text.lower() in ("true", "1")
    if isinstance(current, tuple):
        parts = text.split(",")
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:  # tuple[X, ...]: any length
            return tuple(_convert(x, args[0]) for x in parts)
        if len(parts) != len(current):
            kinds = "/".join(sorted({type(c).__name__ for c in current}))
            raise ValueError(
                f"expected {len(current)} comma-separated {kinds} values, got {len(parts)}"
            )
        return tuple(_convert(x, type(c)) for c, x in zip(current, parts, strict=True))
    if isinstance(current, int | float | str):
        return _convert(text, type(current))
    # None default with an `X | None` hint: parse as X.
    base = [t for t in typing.get_args(hint) if t is not type(None)]
    return _convert(text, base[0]) if base and isinstance(hint, types.UnionType) else text


def with_overrides(cfg: Any, overrides: dict[str, Any]) -> Any:
    """Returns `cfg` with dotted-key overrides applied via `dataclasses.replace`.

    Example: `with_overrides(cfg, {"model.d_ff": 1024, "optim.lr": "3e-4"})`. String
    values are parsed to the field's type ("true", "0.9,0.99", "none"), so flag values
    can be passed through unchanged. Validation reruns on every replaced dataclass.

    Raises:
      ValueError: unknown key, unparsable or invalid value.
    """
    grouped: dict[str, Any] = {}
    for key, value in overrides.items():
        head, _, rest = key.partition(".")
        if head in grouped and isinstance(grouped[head], dict) != bool(rest):
            raise ValueError(f"{head!r} is overridden both whole and by its fields")
        if rest:
            grouped.setdefault(head, {})[rest] = value
        else:
            grouped[head] = value
    names = {f.name for f in dataclasses.fields(cfg)}
    hints = typing.get_type_hints(type(cfg))
    changes = {}
    for name, value in grouped.items():
        if name not in names:
            raise ValueError(f"unknown config key {name!r} for {type(cfg).__name__}")
        current = getattr(cfg, name)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ValueError(f"{name!r} is a config section: override {name}.<field>")
            value = with_overrides(current, value)
        elif isinstance(value, dict):
            raise ValueError(
                f"{type(cfg).__name__}.{name} is not a config section: override {name}=<value>"
            )
        elif isinstance(value, str) and not isinstance(current, str):
            try:
                value = _parse(value, current, hints[name])
            except ValueError as e:
                raise ValueError(f"{type(cfg).__name__}.{name}={value!r}: {e}") from None
        changes[name] = value
    return dataclasses.replace(cfg, **changes)
