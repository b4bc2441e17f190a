"""Corpus preparation and the token shards on disk (documents: `twell_jax.documents`).

Preparing (`prepare_corpus`, driven by experiments/prepare_data.py) turns documents into one
token stream per split, `doc EOS doc EOS ...`, written as raw little-endian shards
(`train_00000.bin`, ...) plus `meta.json`, which is written last so its presence means the
shards are complete. Documents go to train or val by a hash of their key (a relative path, or
`path:line` for .jsonl), so the split is deterministic and stable when documents are added.
`load_meta` and `open_shards` read a prepared corpus back; `twell_jax.input_pipeline` cuts
the shards into batches.

Bad input is refused while preparing: a file that is not valid UTF-8 is an error naming
the file and the byte offset, unless `on_invalid_utf8="replace"` substitutes U+FFFD for
each invalid sequence (meta.json's `invalid_utf8_replaced` and a log warning count them);
a corpus without any text is an error; a validation split that comes out empty (too few
documents for `val_fraction`) is logged as a warning with the document and token counts.
"""

import hashlib
import json
import os
import shutil
import sys
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from absl import logging

from twell_jax import tokenizer as tokenizer_lib
from twell_jax.documents import Document, stdlib_documents, stdlib_root

# Where the zero-setup stdlib corpus is prepared by default.
DEFAULT_DATA_DIR = "data/stdlib_byte"
META_FILE = "meta.json"
TOKENIZER_FILE = "tokenizer.json"
FORMAT_VERSION = 1
SPLITS = ("train", "val")
# 2**28 uint16 tokens = 512 MiB per shard: few files, each comfortably memory-mappable.
DEFAULT_SHARD_TOKENS = 2**28
# Documents are tokenized this many at a time (encode_batch is parallel for BPE).
_ENCODE_CHUNK = 256


def is_val(key: str, val_fraction: float) -> bool:
    """Whether the document with this key belongs to the validation split."""
    h = int.from_bytes(hashlib.sha1(key.encode("utf-8")).digest()[:8], "little")
    return h / 2**64 < val_fraction


# ----------------------------------------------------------------------------- preparing


def train_corpus_bpe(
    documents: Iterable[Document],
    out_path: str | os.PathLike,
    vocab_size: int,
    val_fraction: float = 0.01,
) -> tokenizer_lib.HFTokenizer:
    """Trains a byte-level BPE on the training split of `documents`.

    Validation documents (same `is_val` rule as `prepare_corpus`) are left out so that the
    validation loss is measured on text the tokenizer has not seen.

    Returns:
      The tokenizer, saved as the tokenizer.json `out_path`; pass it to `prepare_corpus`,
      which copies it into its data_dir with the shards (so train it outside a prepared
      data_dir: a refused preparation then leaves that corpus whole). A corpus too small
      for `vocab_size` gives a smaller vocabulary (logged as a warning).
    """
    texts = [d.text for d in documents if not is_val(d.key, val_fraction)]
    if not any(texts):
        raise ValueError(
            f"no text to train a BPE on: {len(texts)} training documents, all empty"
            if texts
            else "no text to train a BPE on: the corpus has no training documents"
        )
    tok = tokenizer_lib.train_bpe_from_texts(texts, vocab_size, out_path)
    if tok.vocab_size < vocab_size:
        logging.warning(
            "BPE vocabulary of %d tokens, not the %d requested: the training text is too "
            "small for more merges",
            tok.vocab_size,
            vocab_size,
        )
    return tok


class _ShardWriter:
    """Appends token ids to `<split>_NNNNN.bin` files of at most `shard_tokens` tokens."""

    def __init__(self, out_dir: Path, split: str, dtype: np.dtype, shard_tokens: int):
        self._out_dir, self._split, self._dtype = out_dir, split, dtype
        self._shard_tokens = shard_tokens
        self.shards: list[dict[str, Any]] = []
        self.num_docs = 0
        self._file = None

    def write_doc(self, ids: np.ndarray, eos_id: int):
        self.num_docs += 1
        self._write(np.append(ids, eos_id).astype(self._dtype))

    def _write(self, ids: np.ndarray):
        while ids.size:
            if self._file is None or self.shards[-1]["num_tokens"] == self._shard_tokens:
                self._roll()
            room = self._shard_tokens - self.shards[-1]["num_tokens"]
            head, ids = ids[:room], ids[room:]
            # Raw little-endian so the meta's dtype string fully describes the bytes.
            self._file.write(head.astype(self._dtype.newbyteorder("<"), copy=False).tobytes())
            self.shards[-1]["num_tokens"] += int(head.size)

    def _roll(self):
        self.close()
        name = f"{self._split}_{len(self.shards):05d}.bin"
        self._file = (self._out_dir / name).open("wb")
        self.shards.append({"file": name, "num_tokens": 0})

    def close(self):
        if self._file is not None:
            self._file.close()
            self._file = None


def prepare_corpus(
    documents: Iterable[Document],
    data_dir: str | os.PathLike,
    tokenizer: tokenizer_lib.Tokenizer,
    *,
    source: str,
    val_fraction: float = 0.01,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Tokenizes `documents` into train/val shards plus meta.json under `data_dir`.

    Shards are written to a private temporary directory and moved in before meta.json, so a
    crash leaves no meta.json and concurrent preparers (one per host) do not clash.

    Args:
      documents: the corpus, e.g. `stdlib_documents()` or `file_documents(paths)`.
      data_dir: output directory (created).
      tokenizer: encodes the text; a tokenizer.json is copied into `data_dir`.
      source: human-readable description of the corpus, recorded in meta.json.
      val_fraction: expected fraction of documents in the validation split.
      shard_tokens: maximum tokens per shard file.
      overwrite: replace an existing prepared corpus in `data_dir`.

    Returns:
      The meta dict that was written to meta.json; `invalid_utf8_replaced` counts the
      invalid UTF-8 sequences the sources replaced (`Document.replaced`) and the
      documents that held them.

    A validation split that comes out empty while `val_fraction` > 0 (a corpus of few
    documents) is not an error: it is logged as a warning with the documents and tokens
    of the corpus, and evaluation then has no data.

    Raises:
      FileExistsError: `data_dir` already holds meta.json and `overwrite` is False.
      ValueError: bad arguments, a corpus without any text, or one with no training
        documents.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if shard_tokens < 2:
        raise ValueError(f"shard_tokens must be >= 2, got {shard_tokens}")
    data_dir = Path(data_dir)
    meta_path = data_dir / META_FILE
    if meta_path.exists() and not overwrite:
        raise FileExistsError(f"{meta_path} exists; pass overwrite=True to re-prepare")
    data_dir.mkdir(parents=True, exist_ok=True)
    tmp_dir = data_dir / f".tmp-{uuid.uuid4().hex}"
    tmp_dir.mkdir()
    dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32)
    writers = {s: _ShardWriter(tmp_dir, s, dtype, shard_tokens) for s in SPLITS}
    text_chars = replaced = replaced_docs = 0
    try:
        for chunk in _chunks(documents, _ENCODE_CHUNK):
            for doc, ids in zip(
                chunk, tokenizer.encode_batch([d.text for d in chunk]), strict=True
            ):
                split = "val" if is_val(doc.key, val_fraction) else "train"
                writers[split].write_doc(ids, tokenizer.eos_id)
                text_chars += len(doc.text)
                replaced += doc.replaced
                replaced_docs += doc.replaced > 0
        for w in writers.values():
            w.close()
        num_docs = sum(w.num_docs for w in writers.values())
        if text_chars == 0:
            raise ValueError(
                f"corpus {source!r} is empty: "
                + (f"{num_docs} documents, all without text" if num_docs else "no documents")
            )
        if writers["train"].num_docs == 0:
            raise ValueError(f"corpus {source!r} has no training documents")
        meta = {
            "format_version": FORMAT_VERSION,
            "dtype": dtype.name,
            "source": source,
            "python": sys.version.split()[0],
            "val_fraction": val_fraction,
            "invalid_utf8_replaced": {"sequences": replaced, "documents": replaced_docs},
            "tokenizer": _tokenizer_meta(tokenizer),
            "splits": {
                s: {
                    "num_docs": w.num_docs,
                    "num_tokens": sum(sh["num_tokens"] for sh in w.shards),
                    "shards": w.shards,
                }
                for s, w in writers.items()
            },
        }
        if meta_path.exists():  # overwrite: the old corpus is incomplete from here on
            meta_path.unlink()
        if tokenizer.spec != tokenizer_lib.BYTE_SPEC:  # keep data_dir self-contained
            dst = data_dir / TOKENIZER_FILE
            if not (dst.exists() and os.path.samefile(tokenizer.spec, dst)):
                shutil.copyfile(tokenizer.spec, dst)
        for w in writers.values():
            for shard in w.shards:
                os.replace(tmp_dir / shard["file"], data_dir / shard["file"])
        _write_json_atomic(meta_path, meta)
    finally:
        for w in writers.values():
            w.close()
        shutil.rmtree(tmp_dir, ignore_errors=True)
    logging.info("prepared %s: %s", data_dir, summary(meta))
    if replaced:
        logging.warning(
            "%s: replaced %d invalid UTF-8 sequences with U+FFFD in %d documents",
            source,
            replaced,
            replaced_docs,
        )
    if val_fraction > 0 and writers["val"].num_docs == 0:
        train = meta["splits"]["train"]
        logging.warning(
            "corpus %r is too small for a validation split: none of its %d documents "
            "(%d tokens) fell into val at val_fraction=%g; evaluation will have no data "
            "(add documents or raise val_fraction)",
            source,
            train["num_docs"],
            train["num_tokens"],
            val_fraction,
        )
    return meta


def _tokenizer_meta(tokenizer: tokenizer_lib.Tokenizer) -> dict[str, Any]:
    """The tokenizer's meta.json entry; a tokenizer.json is recorded as its copy in data_dir."""
    byte = tokenizer.spec == tokenizer_lib.BYTE_SPEC
    return {
        "spec": tokenizer.spec if byte else TOKENIZER_FILE,
        "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id,
        "fingerprint": tokenizer.fingerprint(),
    }


def _chunks(items: Iterable[Document], size: int) -> Iterator[list[Document]]:
    chunk = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _write_json_atomic(path: Path, obj: Any):
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def summary(meta: dict[str, Any]) -> str:
    """One line describing a prepared corpus: tokens and documents per split, tokenizer."""
    sp = meta["splits"]
    line = (
        f"train {sp['train']['num_tokens']:,} tokens / {sp['train']['num_docs']} docs, "
        f"val {sp['val']['num_tokens']:,} tokens / {sp['val']['num_docs']} docs, "
        f"tokenizer {meta['tokenizer']['spec']} (vocab {meta['tokenizer']['vocab_size']})"
    )
    bad = meta.get("invalid_utf8_replaced", {})
    if bad.get("sequences"):
        line += f", {bad['sequences']} invalid UTF-8 sequences replaced in {bad['documents']} docs"
    return line


def ensure_default_data(
    data_dir: str | os.PathLike, tokenizer_spec: str | None = None
) -> dict[str, Any]:
    """Returns the meta of `data_dir`, first preparing the stdlib corpus there if needed.

    This lets the main job run with zero setup. Every process may call it: each prepares
    privately and the result is deterministic.

    Args:
      data_dir: a prepared corpus directory, or where to prepare the stdlib corpus.
      tokenizer_spec: "byte" or a tokenizer.json path; None accepts whatever tokenizer an
        existing `data_dir` was prepared with, and uses "byte" to prepare a new one.

    Raises:
      ValueError: `data_dir` was prepared with a tokenizer other than `tokenizer_spec`.
    """
    data_dir = Path(data_dir)
    tok = tokenizer_lib.load_tokenizer(tokenizer_spec or tokenizer_lib.BYTE_SPEC)
    if not (data_dir / META_FILE).exists():
        logging.info(
            "no %s in %s: preparing the Python stdlib corpus from %s",
            META_FILE,
            data_dir,
            stdlib_root(),
        )
        try:
            prepare_corpus(stdlib_documents(), data_dir, tok, source=f"stdlib:{stdlib_root()}")
        except FileExistsError:
            logging.info("another process prepared %s meanwhile", data_dir)
    meta = load_meta(data_dir)
    if tokenizer_spec is not None and meta["tokenizer"]["fingerprint"] != tok.fingerprint():
        raise ValueError(
            f"{data_dir} was prepared with tokenizer {meta['tokenizer']['spec']!r}, not "
            f"{tokenizer_spec!r}; use another data_dir or re-run experiments.prepare_data"
        )
    return meta


# ----------------------------------------------------------------------------- reading back


def load_meta(data_dir: str | os.PathLike) -> dict[str, Any]:
    """Reads and checks `data_dir/meta.json`.

    Raises:
      FileNotFoundError: no meta.json (the corpus was never prepared, or preparing crashed).
      ValueError: meta.json is not valid JSON or lacks required fields.
    """
    path = Path(data_dir) / META_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: prepare the corpus with "
            f"`python -m experiments.prepare_data --data_dir={data_dir}`"
        )
    try:
        meta = json.loads(path.read_text())
        if meta["format_version"] != FORMAT_VERSION:
            raise ValueError(f"format_version {meta['format_version']} != {FORMAT_VERSION}")
        np.dtype(meta["dtype"])
        missing = {"spec", "vocab_size", "eos_id", "fingerprint"} - meta["tokenizer"].keys()
        if missing:
            raise KeyError(f"tokenizer fields {sorted(missing)}")
        for split in SPLITS:
            for shard in meta["splits"][split]["shards"]:
                if not {"file", "num_tokens"} <= shard.keys():
                    raise KeyError(f"file/num_tokens in a {split} shard entry")
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"corrupt {path}: {type(e).__name__}: {e}") from e
    return meta


def open_shards(
    data_dir: str | os.PathLike, split: str, meta: dict[str, Any] | None = None
) -> list[np.ndarray]:
    """Memory-maps the shards of one split.

    Returns:
      One read-only array per shard: [num_tokens] of meta's dtype.

    Raises:
      FileNotFoundError: a shard file is missing.
      ValueError: a shard's size does not match meta.json (truncated or overwritten).
    """
    meta = meta or load_meta(data_dir)
    dtype = np.dtype(meta["dtype"]).newbyteorder("<")
    arrays = []
    for shard in meta["splits"][split]["shards"]:
        path = Path(data_dir) / shard["file"]
        if not path.is_file():
            raise FileNotFoundError(f"shard {path} listed in {META_FILE} is missing")
        expected = shard["num_tokens"] * dtype.itemsize
        if path.stat().st_size != expected:
            raise ValueError(
                f"corrupt shard {path}: {path.stat().st_size} bytes, {META_FILE} says {expected}"
            )
        arrays.append(np.memmap(path, dtype=dtype, mode="r", shape=(shard["num_tokens"],)))
    return arrays
