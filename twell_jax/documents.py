"""Corpus sources: documents from files, directories, .jsonl records or this machine's
Python standard library (the zero-setup default corpus).

A file that is not valid UTF-8 is an error naming the file and the byte offset, unless
`on_invalid_utf8="replace"` substitutes U+FFFD for each invalid sequence and counts them
(`Document.replaced`). `twell_jax.corpus` turns documents into token shards.
"""

import codecs
import dataclasses
import json
import os
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path

# Suffixes read when a directory is given as a corpus source; explicit files are always read.
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".jsonl")
# What a file that is not valid UTF-8 does: raise, or have U+FFFD per invalid sequence.
ON_INVALID_UTF8 = ("error", "replace")


@dataclasses.dataclass(frozen=True)
class Document:
    """One document of a corpus: `key` decides its split, `text` is tokenized.

    `replaced` counts the invalid UTF-8 sequences its source held, each replaced by U+FFFD.
    """

    key: str
    text: str
    replaced: int = 0


# ----------------------------------------------------------------------------- sources


def stdlib_root() -> Path:
    """Returns the directory of this interpreter's Python standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_documents(max_bytes: int = 0) -> Iterator[Document]:
    """Yields the standard library's *.py files: the default corpus, no download needed.

    Files are sorted by relative path and `site-packages` is skipped, so the corpus depends
    only on the Python version.

    Args:
      max_bytes: stop before the total file size would exceed this; 0 means no cap.
    """
    root = stdlib_root()
    files = sorted(
        p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts
    )
    if not files:
        raise FileNotFoundError(f"no *.py files under the stdlib directory {root}")
    total = 0
    for path in files:
        total += path.stat().st_size
        if max_bytes and total > max_bytes:
            return
        # A few stdlib test files are deliberately not UTF-8: replaced (and counted).
        text, replaced = _decode(path.read_bytes(), path, "replace")
        yield Document(f"stdlib/{path.relative_to(root).as_posix()}", text, replaced)


def file_documents(
    paths: Sequence[str | os.PathLike], text_field: str = "text", on_invalid_utf8: str = "error"
) -> Iterator[Document]:
    """Yields documents from text files, directories and .jsonl files.

    A text file is one document; each non-blank line of a .jsonl file is one document (its
    `text_field`); a directory is walked recursively (sorted, hidden entries skipped) for
    files ending in `TEXT_SUFFIXES`. Keys are relative to the given path, so the split does
    not depend on where the corpus lives.

    Args:
      paths: the files and directories.
      text_field: the text field of .jsonl records.
      on_invalid_utf8: "error" (a file that is not valid UTF-8 raises, naming the file
        and byte offset) or "replace" (U+FFFD per invalid sequence, counted in
        `Document.replaced`).

    Raises:
      FileNotFoundError: a path does not exist.
      ValueError: invalid UTF-8 (with "error"), a directory without any such file, or a
        .jsonl line that is not a JSON object with a string `text_field`.
    """
    if on_invalid_utf8 not in ON_INVALID_UTF8:
        raise ValueError(
            f"on_invalid_utf8 must be one of {ON_INVALID_UTF8}, got {on_invalid_utf8!r}"
        )
    for given in paths:
        given = Path(given)
        if given.is_dir():
            files = sorted(
                p
                for p in given.rglob("*")
                if p.is_file()
                and p.suffix in TEXT_SUFFIXES
                and not any(part.startswith(".") for part in p.relative_to(given).parts)
            )
            if not files:
                raise ValueError(
                    f"corpus directory {given} holds no {'/'.join(TEXT_SUFFIXES)} files"
                )
            for path in files:
                key = f"{given.name}/{path.relative_to(given).as_posix()}"
                yield from _read_file(path, key, text_field, on_invalid_utf8)
        elif given.is_file():
            yield from _read_file(given, given.name, text_field, on_invalid_utf8)
        else:
            raise FileNotFoundError(f"corpus path not found: {given}")


def _decode(data: bytes, path: Path, on_invalid_utf8: str, offset: int = 0) -> tuple[str, int]:
    """UTF-8 `data` (at byte `offset` of `path`) -> (text, invalid sequences replaced).

    "replace" gives the text of `data.decode("utf-8", errors="replace")`.
    """
    try:
        return data.decode("utf-8"), 0
    except UnicodeDecodeError as e:
        if on_invalid_utf8 == "error":
            raise ValueError(
                f"{path}: invalid UTF-8 at byte offset {offset + e.start} "
                f"({data[e.start : e.end]!r}); pass --on_invalid_utf8=replace to replace "
                "invalid sequences with U+FFFD"
            ) from None
    # Decode up to each invalid sequence and replace it: linear in len(data).
    view, parts, pos, replaced = memoryview(data), [], 0, 0
    while True:
        try:
            parts.append(codecs.utf_8_decode(view[pos:], "strict", True)[0])
            return "".join(parts), replaced
        except UnicodeDecodeError as e:
            parts.append(codecs.utf_8_decode(view[pos : pos + e.start], "strict", True)[0])
            parts.append("\ufffd")
            replaced += 1
            pos += e.end


def _read_file(path: Path, key: str, text_field: str, on_invalid_utf8: str) -> Iterator[Document]:
    """Yields the document(s) of one file: one per .jsonl line, else the whole file."""
    if path.suffix != ".jsonl":
        yield Document(key, *_decode(path.read_bytes(), path, on_invalid_utf8))
        return
    with path.open("rb") as f:
        offset = 0
        for line_no, raw in enumerate(f, start=1):
            line, replaced = _decode(raw, path, on_invalid_utf8, offset)
            offset += len(raw)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: invalid JSON: {e}") from e
            if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                raise ValueError(
                    f"{path}:{line_no}: expected an object with a string {text_field!r} field"
                )
            yield Document(f"{key}:{line_no}", record[text_field], replaced)
