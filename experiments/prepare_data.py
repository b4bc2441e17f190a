r"""Tokenizes a corpus into token shards + meta.json for training.

With no --inputs the corpus is this interpreter's Python standard library (*.py), which needs
no download. A file that is not valid UTF-8 stops the run (the error names the file and byte
offset) unless --on_invalid_utf8=replace, which replaces each invalid sequence with U+FFFD and
counts them (log warning, meta.json `invalid_utf8_replaced`). A corpus without text is an
error; one too small for a validation split is prepared with a warning giving its counts.
Examples:

  python -m experiments.prepare_data --data_dir=data/stdlib_byte
  python -m experiments.prepare_data --data_dir=data/stdlib_bpe4k --bpe_vocab_size=4096
  python -m experiments.prepare_data --data_dir=data/mine --inputs=corpus/,extra.jsonl \
      --tokenizer=path/to/tokenizer.json
"""

from pathlib import Path

from absl import app, flags, logging

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


def main(argv):
    del argv
    source = ",".join(_INPUTS.value) or f"stdlib:{documents.stdlib_root()}"
    if (Path(_DATA_DIR.value) / corpus.META_FILE).exists() and not _OVERWRITE.value:
        raise app.UsageError(f"{_DATA_DIR.value} is already prepared; pass --overwrite")
    if _BPE_VOCAB_SIZE.value:
        tok = corpus.train_corpus_bpe(
            _documents(), _DATA_DIR.value, _BPE_VOCAB_SIZE.value, _VAL_FRACTION.value
        )
    else:
        tok = tokenizer.load_tokenizer(_TOKENIZER.value)
    meta = corpus.prepare_corpus(
        _documents(),
        _DATA_DIR.value,
        tok,
        source=source,
        val_fraction=_VAL_FRACTION.value,
        shard_tokens=_SHARD_TOKENS.value,
        overwrite=_OVERWRITE.value,
    )
    logging.info("wrote %s/%s", _DATA_DIR.value, corpus.META_FILE)
    print(corpus.summary(meta))


if __name__ == "__main__":
    app.run(main)
