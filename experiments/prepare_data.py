r"""Tokenizes a corpus into token shards + meta.json for training.

With no --inputs the corpus is this interpreter's Python standard library (*.py), which needs
no download. A file that is not valid UTF-8 stops the run (the error names the file and byte
offset) unless --on_invalid_utf8=replace, which replaces each invalid sequence with U+FFFD and
counts them (log warning, meta.json `invalid_utf8_replaced`). A corpus without text is an
error; one too small for a validation split is prepared with a warning giving its counts,
and so is one too small for a batch of a default pretrain run (the tiny preset) or a
--bpe_vocab_size larger than its text allows (the warning names both sizes).

Exit codes:
  0    prepared
  1    a flag absl cannot parse, or an unexpected error (traceback)
  2    refused (one line): positional arguments, a --data_dir already prepared without
       --overwrite, an --inputs path that does not exist, a directory without text
       files, a file that is not valid UTF-8 (without --on_invalid_utf8=replace), a
       .jsonl line that is not a JSON object with the --text_field string, a corpus
       without text or training documents, a --tokenizer that is missing or invalid, a
       bad --bpe_vocab_size or --val_fraction. A --data_dir this run created is removed.

Examples:

  python -m experiments.prepare_data --data_dir=data/stdlib_byte
  python -m experiments.prepare_data --data_dir=data/stdlib_bpe4k --bpe_vocab_size=4096
  python -m experiments.prepare_data --data_dir=data/mine --inputs=corpus/,extra.jsonl \
      --tokenizer=path/to/tokenizer.json
"""

import shutil
import tempfile
from pathlib import Path

from absl import app, flags, logging

from experiments import entry_points
from twell_jax import corpus, documents, tokenizer

_DATA_DIR = flags.DEFINE_string("data_dir", None, "Output directory.", required=True)
_INPUTS = flags.DEFINE_list(
    "inputs", [], "Text files, directories and .jsonl files; empty: the Python stdlib."
)
_TOKENIZER = flags.DEFINE_string("tokenizer", "byte", "'byte' or a tokenizer.json path.")
_BPE_VOCAB_SIZE = flags.DEFINE_integer(
    "bpe_vocab_size",
    0,
    "If > 0, train a byte-level BPE of this size on the corpus (overrides --tokenizer).",
)
_MAX_BYTES = flags.DEFINE_integer("max_bytes", 0, "Cap on the stdlib corpus size; 0: no cap.")
_TEXT_FIELD = flags.DEFINE_string("text_field", "text", "Text field of .jsonl records.")
_ON_INVALID_UTF8 = flags.DEFINE_enum(
    "on_invalid_utf8",
    "error",
    list(documents.ON_INVALID_UTF8),
    "--inputs that are not valid UTF-8: 'error' names the file and byte offset, 'replace' "
    "substitutes U+FFFD per invalid sequence and counts them in meta.json.",
)
_VAL_FRACTION = flags.DEFINE_float("val_fraction", 0.01, "Fraction of documents for val.")
_SHARD_TOKENS = flags.DEFINE_integer("shard_tokens", corpus.DEFAULT_SHARD_TOKENS, "Tokens/shard.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace an existing prepared corpus.")


def _documents():
    """A fresh iterator over the selected corpus (BPE training reads it once more)."""
    if _INPUTS.value:
        return documents.file_documents(_INPUTS.value, _TEXT_FIELD.value, _ON_INVALID_UTF8.value)
    return documents.stdlib_documents(_MAX_BYTES.value)


def _prepare(source: str) -> dict:
    """Prepares --data_dir from the selected corpus; returns its meta."""
    if _BPE_VOCAB_SIZE.value:
        # Trained outside --data_dir: `prepare_corpus` copies it in with the shards, so
        # an --overwrite that is refused leaves the old corpus and its tokenizer whole.
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / corpus.TOKENIZER_FILE
            tok = corpus.train_corpus_bpe(
                _documents(), out, _BPE_VOCAB_SIZE.value, _VAL_FRACTION.value
            )
            return _prepare_with(tok, source)
    return _prepare_with(tokenizer.load_tokenizer(_TOKENIZER.value), source)


def _prepare_with(tok, source: str) -> dict:
    return corpus.prepare_corpus(
        _documents(),
        _DATA_DIR.value,
        tok,
        source=source,
        val_fraction=_VAL_FRACTION.value,
        shard_tokens=_SHARD_TOKENS.value,
        overwrite=_OVERWRITE.value,
    )


def _first_missing(path: Path) -> Path | None:
    """The outermost of `path` and its parents that does not exist (what a
    `mkdir(parents=True)` of `path` would create first), or None."""
    missing = None
    for p in (path, *path.parents):
        if p.exists():
            return missing
        missing = p
    return missing


def _warn_if_too_small_to_train(data_dir: str) -> None:
    """A corpus that pretrain's defaults would refuse is prepared, but said so now."""
    # Imported here: it brings JAX and grain, which --help, a refusal and the
    # preparation itself do without.
    try:
        from twell_jax import config, input_pipeline
    except ImportError:
        return
    default = config.train_preset("tiny")
    data_cfg = input_pipeline.DataConfig(
        data_dir, seq_len=default.model.seq_len, batch_size=default.batch_size
    )
    try:
        input_pipeline.check_train_batch(data_cfg, process_count=1)
    except ValueError as e:
        logging.warning("too small for a default pretrain run (--preset=tiny): %s", e)


def main(argv):
    if not entry_points.start_cli(argv):
        return entry_points.EXIT_REFUSED
    source = ",".join(_INPUTS.value) or f"stdlib:{documents.stdlib_root()}"
    if (Path(_DATA_DIR.value) / corpus.META_FILE).exists() and not _OVERWRITE.value:
        logging.error("refused: %s is already prepared; pass --overwrite", _DATA_DIR.value)
        return entry_points.EXIT_REFUSED
    created = _first_missing(Path(_DATA_DIR.value))
    try:
        meta = _prepare(source)
    except (FileNotFoundError, ValueError) as e:
        # The inputs are read while the shards are written: a refusal found on the way
        # removes the directories this run made, so no empty data_dir stays behind.
        if created:
            shutil.rmtree(created, ignore_errors=True)
        logging.error("refused: %s", e)
        return entry_points.EXIT_REFUSED
    logging.info("wrote %s/%s", _DATA_DIR.value, corpus.META_FILE)
    print(corpus.summary(meta))
    _warn_if_too_small_to_train(_DATA_DIR.value)
    return 0


if __name__ == "__main__":
    app.run(main)
