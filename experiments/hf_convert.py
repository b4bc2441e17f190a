r"""Exports a pretrain workdir's newest checkpoint as an HF Llama checkpoint directory.

    python -m experiments.hf_convert --workdir=runs/125m --to_hf_dir=exports/125m \
        [--data_dir=data/stdlib_byte] [--dtype=bfloat16] [--max_shard_gb=5]

Writes config.json and model.safetensors (or shards with an index) that
`transformers.LlamaForCausalLM.from_pretrained` and `twell_jax.hf.load_checkpoint`
read (docs/design.md §11). The ReLU FFN becomes `hidden_act: "relu"`, which HF Llama
runs as down(relu(gate(x)) * up(x)), the same function. The tokenizer of the run's
corpus (the one its data.json names, or --data_dir with the same tokenizer) gives
eos_token_id, and a tokenizer.json is
copied next to the weights; a byte-level run has none to copy
(`experiments.generate --tokenizer=byte` decodes it).

The other direction is `experiments.pretrain --init_from_hf=DIR`, which starts a run
from an HF checkpoint's weights; `experiments.generate --hf_dir` runs HF checkpoints.

Exit codes: 0 done, 2 refused (no such workdir or checkpoint, a model HF Llama cannot
express, a non-empty output directory, a --data_dir of another tokenizer than the
run's, positional arguments).
"""

from __future__ import annotations

import shutil

from absl import app, flags, logging

from experiments import entry_points, pretrain_run
from twell_jax import hf
from twell_jax import tokenizer as tokenizer_lib
from twell_jax.config import DTYPES

_WORKDIR = flags.DEFINE_string("workdir", None, "Pretrain workdir (its checkpoints/).")
_TO_HF_DIR = flags.DEFINE_string("to_hf_dir", None, "New directory for the HF checkpoint.")
_DATA_DIR = flags.DEFINE_string(
    "data_dir", None, "The run's corpus, for its tokenizer (default: the one it trained on)."
)
_DTYPE = flags.DEFINE_enum("dtype", None, DTYPES, "Tensor dtype (default: the run's params).")
_MAX_SHARD_GB = flags.DEFINE_float("max_shard_gb", 5.0, "Largest safetensors file, in GB.")


def convert(workdir: str, to_hf_dir: str, data_dir: str | None, dtype: str | None) -> list:
    """Writes the HF directory; returns the files written."""
    hf.check_export_dir(to_hf_dir)  # before the checkpoint's reads
    cfg, params, step = pretrain_run.load_params(workdir)
    logging.info("workdir %s: step %d, model %s", workdir, step, cfg.model)
    tok = None
    try:
        tok = pretrain_run.tokenizer_of_corpus(pretrain_run.run_corpus(workdir, data_dir))
    except FileNotFoundError as e:
        logging.warning("no tokenizer recorded (%s): config.json gets no eos_token_id", e)
    files = hf.save_checkpoint(
        to_hf_dir,
        cfg.model,
        params,
        dtype=dtype,
        max_shard_bytes=int(_MAX_SHARD_GB.value * 1e9),
        eos_token_id=tok.eos_id if tok else None,
    )
    if tok is not None and tok.spec != tokenizer_lib.BYTE_SPEC:
        files.append(shutil.copy(tok.spec, f"{to_hf_dir}/tokenizer.json"))
    return files


def main(argv):
    if not entry_points.start_cli(argv):
        return entry_points.EXIT_REFUSED
    try:
        files = convert(_WORKDIR.value, _TO_HF_DIR.value, _DATA_DIR.value, _DTYPE.value)
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        logging.error("refused: %s", e)
        return entry_points.EXIT_REFUSED
    for f in files:
        print(f)
    return 0


if __name__ == "__main__":
    flags.mark_flags_as_required(["workdir", "to_hf_dir"])
    app.run(main)
