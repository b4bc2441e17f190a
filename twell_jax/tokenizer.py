"""Tokenizers: byte-level by default, or a Hugging Face `tokenizer.json` (e.g. our own BPE).

Both kinds share one small interface (`Tokenizer`): `encode(text) -> int32 [L]`,
`decode(ids) -> str`, `vocab_size`, `eos_id` and `spec`, the string `load_tokenizer` turns back
into the same tokenizer. Documents are separated by `eos_id` when a corpus is packed, so no
BOS/PAD is needed. `vocab_size` is the tokenizer's own size; the model pads its embedding to its
config vocab (e.g. 512), which must be >= `vocab_size`.
"""

import hashlib
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

BYTE_SPEC = "byte"
# Special tokens tried, in order, as the end-of-document token of a given tokenizer.json.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")
BPE_EOS = "<|endoftext|>"


class Tokenizer(Protocol):
    """What the data pipeline and sampling need from a tokenizer."""

    @property
    def spec(self) -> str:
        """`"byte"` or the path of a tokenizer.json; `load_tokenizer(spec)` rebuilds it."""

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can emit (ids are in [0, vocab_size))."""

    @property
    def eos_id(self) -> int:
        """End-of-document id, placed between packed documents."""

    def encode(self, text: str) -> np.ndarray:
        """Returns the ids of `text`: int32 [L], without EOS."""

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Returns `[encode(t) for t in texts]`, possibly faster."""

    def decode(self, ids: Iterable[int]) -> str:
        """Returns the text of `ids`; special ids are dropped."""

    def fingerprint(self) -> str:
        """A short hash identifying the vocabulary, to detect a changed tokenizer."""


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then EOS = 256 (`vocab_size` 257)."""

    spec = BYTE_SPEC
    eos_id = 256
    vocab_size = 257

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        # Invalid UTF-8 (e.g. a sample cut mid-character) becomes U+FFFD instead of raising.
        data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")

    def fingerprint(self) -> str:
        return "byte-v1"


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer loaded from a tokenizer.json file."""

    def __init__(
        self, path: str | os.PathLike, eos_token: str | None = None, eos_id: int | None = None
    ):
        """Loads `path`.

        Args:
          path: a tokenizer.json file.
          eos_token: the end-of-document token; by default the first of `EOS_CANDIDATES` that
            the vocabulary contains.
          eos_id: the end-of-document token's id instead (a model config's eos_token_id).

        Raises:
          FileNotFoundError: `path` does not exist.
          ValueError: `path` is not a valid tokenizer.json, or it has no EOS token (or
            none of id `eos_id`).
          ImportError: the optional `tokenizers` package is missing.
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {path}")
        tokenizers = _import_tokenizers()
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust parser raises a bare Exception
            raise ValueError(f"not a valid tokenizer.json: {path}: {e}") from e
        self._path = path.resolve()
        if eos_id is not None:
            eos_token = self._tok.id_to_token(eos_id)
            if eos_token is None:
                raise ValueError(f"tokenizer {path} has no token of eos id {eos_id}")
        candidates = (eos_token,) if eos_token else EOS_CANDIDATES
        ids = [self._tok.token_to_id(t) for t in candidates]
        found = [i for i in ids if i is not None]
        if not found:
            raise ValueError(
                f"tokenizer {path} has none of the EOS tokens {list(candidates)}; "
                "pass eos_token= or add one as a special token"
            )
        self.eos_id = found[0]
        self._special = {self.eos_id}
        # get_vocab_size() counts added tokens too, so every id the tokenizer emits is < it.
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def spec(self) -> str:
        return str(self._path)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        encs = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int32) for e in encs]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids if int(i) not in self._special])

    def fingerprint(self) -> str:
        return hashlib.sha256(self._path.read_bytes()).hexdigest()[:16]


def load_tokenizer(spec: str | os.PathLike) -> Tokenizer:
    """Returns the tokenizer named by `spec`.

    Args:
      spec: `"byte"` for the byte-level tokenizer, or the path of a tokenizer.json.

    Raises:
      FileNotFoundError: `spec` is neither "byte" nor an existing file.
      ValueError: the file is not a usable tokenizer.json.
    """
    if str(spec) == BYTE_SPEC:
        return ByteTokenizer()
    path = Path(spec)
    if not path.exists():
        raise FileNotFoundError(
            f"tokenizer spec {str(spec)!r} is neither {BYTE_SPEC!r} nor an existing tokenizer.json"
        )
    if path.is_dir():
        path = path / "tokenizer.json"
    return HFTokenizer(path)


def train_bpe_from_texts(
    texts: Iterable[str], vocab_size: int, out_path: str | os.PathLike
) -> HFTokenizer:
    """Trains a byte-level BPE and saves it as a tokenizer.json.

    Byte-level pre-tokenization means any UTF-8 text round-trips (no unknown token).

    Args:
      texts: training documents.
      vocab_size: final vocabulary size including the 256 byte tokens and EOS; >= 257.
      out_path: where to write the tokenizer.json.

    Returns:
      The trained tokenizer, loaded from `out_path`; its EOS is `BPE_EOS`.

    Raises:
      ValueError: `vocab_size` is too small.
    """
    if vocab_size < 257:
        raise ValueError(f"BPE vocab_size must be >= 257 (256 bytes + EOS), got {vocab_size}")
    tokenizers = _import_tokenizers()
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BPE_EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_path))
    return HFTokenizer(out_path, eos_token=BPE_EOS)


def _import_tokenizers():
    """Imports the optional `tokenizers` package with an actionable error."""
    try:
        import tokenizers
    except ImportError as e:
        raise ImportError(
            "tokenizer.json / BPE support needs the `tokenizers` package: pip install -e '.[bpe]'"
        ) from e
    return tokenizers
