r"""Per-layer neuron profile of a pretrain workdir's newest checkpoint.

    python -m experiments.neuron_profile --workdir=runs/125m [--data_dir=data] \
        [--batch=8] [--out=profile.json]

On the first validation sequences of the run's corpus (the one its data.json names,
or --data_dir, whose tokenizer must be the run's), counts each layer's positive
gate entries per neuron and per token and prints, per layer: l0 (mean, p99, max per
token), the share of all positives held by the top 1% and 10% of neurons, the share of
dead neurons and the hottest neuron's firing rate (`twell_jax.neuron_profile`).
--out writes the same records as JSON, with the command that made them.

Exit codes: 0 done, 2 refused (no such workdir or checkpoint, no prepared corpus, a
--data_dir of another tokenizer than the run's, a --batch below 1 or above the
validation split, an --out that cannot be written, positional arguments).
"""

from __future__ import annotations

import json

import jax.numpy as jnp
from absl import app, flags, logging
from flax import nnx

from experiments import entry_points, pretrain_run
from experiments.benchmark_model import trained_params
from twell_jax import input_pipeline, neuron_profile, train

_WORKDIR = flags.DEFINE_string("workdir", None, "Pretrain workdir (config.json + checkpoints).")
_DATA_DIR = flags.DEFINE_string(
    "data_dir", None, "The run's prepared corpus (default: the one it trained on)."
)
_BATCH = flags.DEFINE_integer("batch", 8, "Validation sequences to profile.")
_OUT = flags.DEFINE_string("out", None, "Also write the records as JSON here.")


def run(workdir: str, data_dir: str | None, batch: int) -> dict:
    """{"workdir", "step", "tokens", "layers": [profile record per layer]}; the tokens
    are `data_dir`'s (None: the run's corpus, `pretrain_run.run_corpus`)."""
    cfg, params, step = trained_params(workdir)
    data_dir = pretrain_run.run_corpus(workdir, data_dir)
    data_cfg = input_pipeline.DataConfig(
        data_dir, seq_len=cfg.model.seq_len, batch_size=batch, seed=cfg.seed
    )
    tokens = jnp.asarray(next(input_pipeline.make_val_iterator(data_cfg, 1))["inputs"])
    model = nnx.merge(train.model_graphdef(cfg.model), params)
    ffn = params["blocks"]["ffn"]
    w_gate = ffn["w_gate"] if cfg.model.gated else ffn["w_up"]
    per_neuron, per_token = neuron_profile.gate_positives(model.ffn_inputs(tokens), w_gate)
    layers = neuron_profile.profile(per_neuron, per_token)
    return {"workdir": workdir, "step": step, "tokens": int(tokens.size), "layers": layers}


def main(argv):
    if not entry_points.start_cli(argv):
        return entry_points.EXIT_REFUSED
    try:
        if _BATCH.value < 1:
            raise ValueError(f"--batch={_BATCH.value}: must be at least 1")
        entry_points.check_output_file("out", _OUT.value)
        result = run(_WORKDIR.value, _DATA_DIR.value, _BATCH.value)
    except (FileNotFoundError, ValueError) as e:
        logging.error("refused: %s", e)
        return entry_points.EXIT_REFUSED
    print(f"{result['workdir']} at step {result['step']}, {result['tokens']} tokens")
    print(neuron_profile.table(result["layers"]))
    if _OUT.value:
        command = entry_points.command_line("experiments.neuron_profile")
        with open(_OUT.value, "w") as f:
            json.dump({"command": command, **result}, f, indent=1)
    return 0


if __name__ == "__main__":
    flags.mark_flag_as_required("workdir")
    app.run(main)
