r"""Generates text from an HF Llama checkpoint or a pretrain workdir.

    python -m experiments.generate --hf_dir=DIR --prompt="Once upon a time" \
        [--max_new_tokens=64] [--temperature=0.8 --top_p=0.95 --seed=1]
    python -m experiments.generate --workdir=runs/tiny \
        --prompt="def " --prompt="import " --output_json=out.json
    python -m experiments.generate --hf_dir=DIR --prompt_ids="1,2,3;4,5" --vocab_limit=0

The model: --hf_dir (config.json, safetensors, tokenizer.json if present, its EOS the
config's eos_token_id; `twell_jax.hf`) or --workdir (newest checkpoint; the tokenizer
of the corpus it trained on, named by its data.json, or --data_dir with the same
tokenizer). --tokenizer ("byte" or a tokenizer.json) overrides either. Prompts:
--prompt (repeat it for a batch) or --prompt_ids (ids separated by commas, prompts by
semicolons, taken verbatim). Text prompts of an HF checkpoint get
its bos_token_id in front unless --noadd_bos.

--temperature=0 is greedy; --top_k / --top_p restrict sampling. Generation stops at
--max_new_tokens or a stop id (--stop_ids, default the checkpoint's EOS ids, its
generation_config.json's included, or the tokenizer's; "" for none). --vocab_limit
(at most the model's vocab_size; default: the tokenizer's size when below the model's
padded vocabulary; 0: none) keeps ids the tokenizer cannot decode from being drawn.
--ffn picks the FFN path (`twell_jax.generate`): dense; sparse = the TwELL prefill and
the small-M decode op in the decode steps; auto = the paths measured faster on an H200
for a model configured with the inference kernels (ffn_impl "twell" or "decode":
TwELL for long prefills, the decode op up to batch 8), else dense. Neither a workdir
nor an HF directory is configured so (whether its FFNs are sparse is not known from
the checkpoint, and the sparse paths were timed at the 1.5B shape only), so for a
sparse model pass --ffn=sparse. A single prompt streams its text to stdout as tokens
arrive; a batch prints one line per prompt at the end.
--output_json (in an existing directory) writes {"prompt_ids", "new_token_ids", "text"}
(lists over the batch, plain values for one prompt).

Exit codes: 0 done, 2 refused (missing files, bad flags or positional arguments, an
out-of-range id, a model the requested FFN path cannot run).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from absl import app, flags, logging

from experiments import entry_points, pretrain_run
from twell_jax import generate as generation
from twell_jax import hf
from twell_jax import tokenizer as tokenizer_lib

_HF_DIR = flags.DEFINE_string("hf_dir", None, "HF Llama checkpoint directory.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Pretrain workdir (its checkpoints/).")
_DATA_DIR = flags.DEFINE_string(
    "data_dir", None, "With --workdir: the run's corpus, for its tokenizer (default: its own)."
)
_TOKENIZER = flags.DEFINE_string("tokenizer", None, '"byte" or a tokenizer.json (overrides).')
_PROMPT = flags.DEFINE_multi_string("prompt", [], "Prompt text; repeat for a batch.")
_PROMPT_IDS = flags.DEFINE_string("prompt_ids", None, 'Token ids: "1,2,3" or "1,2,3;4,5".')
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate per prompt.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "Sampling temperature; 0 is greedy.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Sample among the k likeliest tokens (0: all).")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass (1: all).")
_SEED = flags.DEFINE_integer("seed", 0, "Sampler seed.")
_DTYPE = flags.DEFINE_enum(
    "dtype", None, ["float32", "bfloat16"], "Compute dtype (default: the model's)."
)
_FFN = flags.DEFINE_enum("ffn", "auto", list(generation.FFN_MODES), "FFN path.")
_STOP_IDS = flags.DEFINE_string("stop_ids", None, 'Stop ids "2,7" (default EOS; "" none).')
_VOCAB_LIMIT = flags.DEFINE_integer("vocab_limit", None, "Draw only ids below this (0: all).")
_ADD_BOS = flags.DEFINE_bool("add_bos", True, "Prefix text prompts of --hf_dir with BOS.")
_OUTPUT_JSON = flags.DEFINE_string("output_json", None, "Write ids and text here.")


def _ids(text: str, what: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"{what}={text!r}: expected comma-separated integers") from None


def _tokenizer(spec: str, eos_id: int | None = None):
    """`load_tokenizer(spec)`, a tokenizer.json's EOS taken from `eos_id` when given."""
    if spec == tokenizer_lib.BYTE_SPEC or eos_id is None:
        return tokenizer_lib.load_tokenizer(spec)
    return tokenizer_lib.HFTokenizer(spec, eos_id=eos_id)


def _load():
    """(ModelConfig, params, tokenizer or None, default stop ids, BOS id or None)."""
    if (_HF_DIR.value is None) == (_WORKDIR.value is None):
        raise ValueError("give exactly one of --hf_dir and --workdir")
    overrides = {"dtype": _DTYPE.value} if _DTYPE.value else {}
    tok, spec = None, _TOKENIZER.value
    if _HF_DIR.value:
        hf_config = hf.read_config(_HF_DIR.value)
        cfg, params = hf.load_checkpoint(_HF_DIR.value, **overrides)
        local = Path(_HF_DIR.value) / "tokenizer.json"
        if spec is None and local.is_file():
            spec = str(local)
        stop = hf.stop_token_ids(_HF_DIR.value)
        tok = _tokenizer(spec, stop[0] if stop else None) if spec else None
        stop = stop or ((tok.eos_id,) if tok else ())
        return cfg, params, tok, stop, hf_config.get("bos_token_id")
    run_cfg, params, step = pretrain_run.load_params(_WORKDIR.value)
    logging.info("workdir %s at step %d", _WORKDIR.value, step)
    model = run_cfg.model
    if model.ffn_impl == "sparse":
        # The training op (bf16 only) has no part in generation, where a model of the
        # training op and a dense one take the same paths (`generate.inference_configs`):
        # so the run's config may change dtype.
        model = dataclasses.replace(model, ffn_impl="dense")
    cfg = dataclasses.replace(model, **overrides)
    if spec is not None:
        tok = tokenizer_lib.load_tokenizer(spec)
    else:
        try:
            data_dir = pretrain_run.run_corpus(_WORKDIR.value, _DATA_DIR.value)
            tok = pretrain_run.tokenizer_of_corpus(data_dir)
        except FileNotFoundError as e:
            logging.warning("no tokenizer (%s): ids only", e)
    return cfg, params, tok, ((tok.eos_id,) if tok else ()), None


def _continuation(tok, prompt: list[int], new: list[int]) -> str:
    """The text `new` adds after `prompt`. Decoding `new` alone would drop a leading
    space that tokenizers such as SentencePiece's write into the first token."""
    head, whole = tok.decode(prompt), tok.decode(prompt + new)
    return whole[len(head) :] if whole.startswith(head) else tok.decode(new)


def _prompts(tok, bos: int | None) -> list[list[int]]:
    if bool(_PROMPT.value) == (_PROMPT_IDS.value is not None):
        raise ValueError("give exactly one of --prompt and --prompt_ids")
    if _PROMPT_IDS.value is not None:
        prompts = [_ids(row, "--prompt_ids") for row in _PROMPT_IDS.value.split(";")]
        beyond = sorted({i for row in prompts for i in row if tok and i >= tok.vocab_size})
        if beyond:  # valid model ids (the vocabulary is padded), but no text
            logging.warning(
                "--prompt_ids %s are past the tokenizer's %d ids: the model reads them, "
                "their text shows as U+FFFD", beyond[:8], tok.vocab_size
            )  # fmt: skip
        return prompts
    if tok is None:
        raise ValueError("--prompt needs a tokenizer: pass --tokenizer, or use --prompt_ids")
    head = [bos] if bos is not None and _ADD_BOS.value else []
    return [head + tok.encode(text).tolist() for text in _PROMPT.value]


class _Streamer:
    """Writes the prompt's text, then the text of one row to stdout as its tokens arrive."""

    def __init__(self, tok, prompt: list[int]):
        self.tok, self.prompt, self.ids, self.printed = tok, prompt, [], ""
        self.started = False

    def __call__(self, column) -> None:
        # The prompt waits for the first column, which comes after every input check.
        if not self.started:
            sys.stdout.write(self.tok.decode(self.prompt))
            self.started = True
        token = int(column[0])
        if token == generation.NO_TOKEN:
            return
        self.ids.append(token)
        text = _continuation(self.tok, self.prompt, self.ids)
        # U+FFFD at the end: a character whose next bytes are still to come.
        if text.endswith("\ufffd") or not text.startswith(self.printed):
            return
        sys.stdout.write(text[len(self.printed) :])
        sys.stdout.flush()
        self.printed = text


def run() -> dict:
    """Loads, generates, prints; returns the --output_json record."""
    entry_points.check_output_file("output_json", _OUTPUT_JSON.value)
    cfg, params, tok, stop, bos = _load()
    prompts = _prompts(tok, bos)
    if _STOP_IDS.value is not None:
        stop = tuple(_ids(_STOP_IDS.value, "--stop_ids"))
    limit = _VOCAB_LIMIT.value
    if limit is None:
        limit = tok.vocab_size if tok and tok.vocab_size < cfg.vocab_size else 0
    elif not 0 <= limit <= cfg.vocab_size:
        raise ValueError(
            f"--vocab_limit={limit}: must be in [0, {cfg.vocab_size}] (the model's "
            "vocab_size; 0: no limit)"
        )
    sampling = generation.SamplingConfig(
        _TEMPERATURE.value, _TOP_K.value, _TOP_P.value, vocab_limit=limit or None
    )
    stream = _Streamer(tok, prompts[0]) if tok and len(prompts) == 1 else None
    out = generation.generate(
        cfg,
        params,
        prompts,
        _MAX_NEW.value,
        sampling=sampling,
        stop_tokens=stop,
        seed=_SEED.value,
        ffn=_FFN.value,
        on_tokens=stream,
    )
    texts = [
        _continuation(tok, prompt, new) if tok else ""
        for prompt, new in zip(prompts, out.new_token_ids, strict=True)
    ]
    if stream:
        sys.stdout.write(texts[0][len(stream.printed) :] + "\n")
    else:
        for b, (ids, text) in enumerate(zip(prompts, texts, strict=True)):
            print(f"[{b}] {tok.decode(ids) + text if tok else out.new_token_ids[b]}")
    one = len(prompts) == 1
    return {
        "prompt_ids": out.prompt_ids[0] if one else out.prompt_ids,
        "new_token_ids": out.new_token_ids[0] if one else out.new_token_ids,
        "text": texts[0] if one else texts,
    }


def main(argv):
    if not entry_points.start_cli(argv):
        return entry_points.EXIT_REFUSED
    try:
        record = run()
    except (FileNotFoundError, ValueError, ImportError) as e:
        logging.error("refused: %s", e)
        return entry_points.EXIT_REFUSED
    if _OUTPUT_JSON.value:
        with open(_OUTPUT_JSON.value, "w") as f:
            json.dump(record, f)
    return 0


if __name__ == "__main__":
    app.run(main)
