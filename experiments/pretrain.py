r"""Pre-trains a TwELL transformer LM: `python -m experiments.pretrain --flagfile=...`.

A run is a preset (`twell_jax.config.train_preset`) plus the flags below, which
override single fields; `--set=section.field=value` reaches any other field. The
resolved config (every field) goes to `<workdir>/config.json`, which one log line names.
Training resumes from `<workdir>/checkpoints` when
it holds a checkpoint (the saved config must match, except cadences and the mesh; a
different --steps needs --allow_schedule_change, see below); Ctrl-C saves a checkpoint
and exits. Every check runs before the run writes anything: a refused resume leaves
the workdir (config.json included) as it was.

Resuming with another --steps: the LR schedule (warmup, then cosine to 0 at
optim.total_steps) is a function of the step and the total, so with
--allow_schedule_change the run continues from the checkpoint's step on the new
schedule: the warmup is unchanged and the cosine is stretched (or shortened) to end at
the new --steps, so the LR jumps to the new curve's value at the resumed step. A
--steps below the checkpoint's step is always an error.

Continued pretraining: --init_from_hf=DIR starts a run without checkpoints from the
weights of an HF Llama checkpoint (DIR/config.json and safetensors) with a fresh
optimizer at step 0 (`twell_jax.hf.init`). The architecture (vocab, widths, layers,
heads, RoPE theta, norm eps, tied embeddings, activation) is DIR's: a flag or --set
giving it another value is an error naming the field; the training fields (ffn_impl,
dtypes, remat, seq_len up to max_position_embeddings, the schedule, the L1 term) are
the flags'. The corpus must have been prepared with DIR's tokenizer.json when DIR has a
usable one; its ids must fit the vocab in any case. Everything is checked before the
run writes anything. A workdir with checkpoints resumes them (the log says so) without
reading DIR; the first run records DIR in <workdir>/init_from_hf.json, so resuming
needs neither the flag nor DIR.

A run holds `<workdir>/run.lock` (host and pid) while it runs; a second run on the same
workdir is refused naming the holder, and the lock of a dead process on this host is
taken over with a warning.

Divergence guard: every step's loss and gradient norm must be finite (checked at each
log, eval and save), and the train state before each save. A non-finite value stops
the run before it saves anything more, logs the step and the metric, and keeps the
checkpoints on disk (the last good ones). With --skip_nonfinite=K such a step is
skipped instead (the jitted step keeps the parameters and optimizer state; its batch is
consumed), logged and counted (`skipped_steps` in metrics.jsonl, kept across resumes);
the (K+1)-th stops the run as above.

Energy: --energy adds the joules per token and mean watts of each logging interval
(its steady train time, as tokens/s) to the progress line and metrics.jsonl, read
through NVML over the visible GPUs (`twell_jax.energy`; pip install '.[energy]').

Exit codes:
  0    done (--steps or --stop_at reached, or nothing left to do)
  1    a flag absl cannot parse (an unknown flag, a non-number for a number), an
       --init_from_hf directory that is missing, unreadable or at odds with the flags
       or the corpus (one line), --energy where NVML cannot measure (one line), or an
       unexpected error (traceback)
  2    refused: a bad flag or --set value (the message names the field), positional
       arguments (a stray word, or a value after a boolean flag), a --data_dir that is
       not a prepared corpus, has more token ids than the model's vocabulary or less
       than one batch of training windows, a mesh (--mesh_data x --mesh_fsdp) that does
       not fit the devices, a micro-batch (--batch_size / --grad_accum_steps) that does
       not split evenly over them, one train step that clearly cannot fit in memory
       (twell_jax.step_memory: --seq_len has no positional limit, memory bounds it): all
       these before the workdir is created; or the workdir is locked by another run, or
       the checkpoint's config differs (the message lists the fields), or checkpoints
       exist with --noresume, or the resume would change the schedule (--steps) without
       --allow_schedule_change, or go below the checkpoint
  3    diverged: a non-finite loss, gradient norm or state (past --skip_nonfinite);
       nothing saved after it
  130  interrupted by SIGINT (Ctrl-C) after saving a checkpoint; 143 for SIGTERM
       (128 + the signal number). Re-running the same command resumes.

Examples:

  python -m experiments.pretrain --flagfile=experiments/configs/tiny.flags
  python -m experiments.pretrain --preset=tiny --steps=50 --workdir=/tmp/run \
      --set=model.d_model=64 --set=model.n_layers=2
  # multi-host, one process per host (SLURM / Open MPI find their peers):
  python -m experiments.pretrain --flagfile=experiments/configs/1b.flags --distributed
  # elsewhere name them (on CPU also export JAX_CPU_COLLECTIVES_IMPLEMENTATION=gloo):
  python -m experiments.pretrain ... --distributed --coordinator_address=host0:23456 \
      --num_processes=2 --process_id=0
  # continued pretraining of an HF Llama, on a corpus of its tokenizer:
  python -m experiments.pretrain --flagfile=experiments/configs/tiny.flags \
      --init_from_hf=hf/llama --data_dir=data/llama_tok --workdir=runs/llama_l1

Outputs in --workdir: checkpoints/, metrics.jsonl, metrics.png, config.json (and
init_from_hf.json with --init_from_hf).
"""

from __future__ import annotations

import json
import signal
from typing import Any

import jax
from absl import app, flags, logging

from experiments import energy_flag, entry_points
from twell_jax import checkpoint, corpus, energy, overrides, run_guards, trainer
from twell_jax import config as config_lib
from twell_jax.hf import init as hf_init

_PRESET = flags.DEFINE_enum(
    "preset", "tiny", ["tiny", "125m", "0.5b", "1b", "1.5b", "2b"], "Model / schedule preset."
)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Run directory (checkpoints, metrics); default runs/<preset>."
)
_DATA_DIR = flags.DEFINE_string(
    "data_dir",
    corpus.DEFAULT_DATA_DIR,
    "Prepared corpus (experiments.prepare_data). The default is prepared from the Python "
    "stdlib on first use.",
)
_INIT_FROM_HF = flags.DEFINE_string(
    "init_from_hf",
    None,
    "HF Llama checkpoint directory (config.json + safetensors) whose weights start a run "
    "without checkpoints; the architecture is its config.json's, the rest the flags'.",
)
_RESUME = flags.DEFINE_bool("resume", True, "Continue from the newest checkpoint in --workdir.")
_STOP_AT = flags.DEFINE_integer(
    "stop_at",
    0,
    "If > 0, save and exit after this step; the schedule still runs to --steps.",
    lower_bound=0,
)
_MAX_TO_KEEP = flags.DEFINE_integer("max_to_keep", 3, "Checkpoints kept (0: all).", lower_bound=0)
_ALLOW_SCHEDULE_CHANGE = flags.DEFINE_bool(
    "allow_schedule_change",
    False,
    "On resume, accept a --steps unlike the checkpoint's: the cosine LR schedule is "
    "recomputed for the new total from the checkpoint's step on.",
)
_SKIP_NONFINITE = flags.DEFINE_integer(
    "skip_nonfinite",
    0,
    "Skip up to this many steps whose loss or gradient norm is not finite (their update "
    "is dropped on the device; the LR schedule then runs as many steps behind); the next "
    "one stops the run (exit 3). 0: stop at the first.",
    lower_bound=0,
)

# What a run refuses to do (exit entry_points.EXIT_REFUSED, one line, no traceback).
REFUSALS = (
    run_guards.WorkdirLockedError,
    run_guards.ScheduleChangeError,
    run_guards.ResumeRefusedError,
    checkpoint.ConfigMismatchError,
    checkpoint.CheckpointCorruptError,  # no step of the workdir is readable
)
EXIT_DIVERGED = 3
_DISTRIBUTED = flags.DEFINE_bool(
    "distributed",
    False,
    "Call jax.distributed.initialize() first (multi-host runs). On SLURM / Open MPI / "
    "cloud TPU it finds its peers itself; elsewhere set the three flags below.",
)
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "With --distributed: host:port of process 0."
)
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "With --distributed.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "With --distributed.")
_SET = flags.DEFINE_multi_string(
    "set", [], "Dotted config override, e.g. model.d_ff=1024; applied after the flags below."
)

# Flag -> dotted TrainConfig field. None (the default) keeps the preset's value.
_FIELDS = {
    "steps": ("optim.total_steps", flags.DEFINE_integer, "Optimizer steps of the run."),
    "warmup_steps": ("optim.warmup_steps", flags.DEFINE_integer, "LR warmup steps."),
    "lr": ("optim.lr", flags.DEFINE_float, "Peak learning rate."),
    "weight_decay": ("optim.weight_decay", flags.DEFINE_float, "AdamW weight decay."),
    "clip_norm": ("optim.clip_norm", flags.DEFINE_float, "Global gradient-norm clip."),
    "grad_accum_steps": (
        "optim.grad_accum_steps",
        flags.DEFINE_integer,
        "Micro-batches per step (the micro-batch is batch_size / grad_accum_steps).",
    ),
    "batch_size": ("batch_size", flags.DEFINE_integer, "Global batch in sequences per step."),
    "seq_len": (
        "model.seq_len",
        flags.DEFINE_integer,
        "Tokens per sequence (no positional limit; a run whose step cannot fit in memory "
        "is refused).",
    ),
    "l1_coef": ("sparsity.l1_coef", flags.DEFINE_float, "L1 activation penalty lambda."),
    "l1_warmup_steps": (
        "sparsity.l1_warmup_steps",
        flags.DEFINE_integer,
        "Steps of the linear lambda ramp.",
    ),
    "reinit_dead_every": (
        "sparsity.reinit_dead_every",
        flags.DEFINE_integer,
        "Dead-neuron re-init period.",
    ),
    "ffn_impl": ("model.ffn_impl", flags.DEFINE_string, " | ".join(config_lib.FFN_IMPLS) + "."),
    "ffn_variant": ("model.ffn_variant", flags.DEFINE_string, "gated_relu | relu | gated_silu."),
    "remat": ("model.remat", flags.DEFINE_bool, "Rematerialise layers in the backward pass."),
    "sparse_save_residuals": (
        "model.sparse_save_residuals",
        flags.DEFINE_bool,
        "With remat, keep the sparse FFN's ELL residuals (or recompute them: less memory).",
    ),
    "dtype": ("model.dtype", flags.DEFINE_string, "Compute dtype."),
    "seed": ("seed", flags.DEFINE_integer, "Init and data-order seed."),
    "log_every": ("log_every", flags.DEFINE_integer, "Steps between progress lines."),
    "eval_every": ("eval_every", flags.DEFINE_integer, "Steps between validations."),
    "eval_batches": ("eval_batches", flags.DEFINE_integer, "Validation batches."),
    "checkpoint_every": ("checkpoint_every", flags.DEFINE_integer, "Steps between saves."),
}
_FIELD_FLAGS = {name: define(name, None, help_) for name, (_, define, help_) in _FIELDS.items()}
_MESH_DATA = flags.DEFINE_integer("mesh_data", None, "Data-parallel mesh size (-1: the rest).")
_MESH_FSDP = flags.DEFINE_integer("mesh_fsdp", None, "FSDP mesh size (-1: the rest).")


def _changes(cfg: config_lib.TrainConfig) -> dict[str, Any]:
    """Dotted key -> value of every field the set flags and `--set` give (in that order).

    Raises:
      ValueError: a malformed `--set`.
    """
    changes: dict[str, Any] = {
        _FIELDS[name][0]: flag.value
        for name, flag in _FIELD_FLAGS.items()
        if flag.value is not None
    }
    if _MESH_DATA.value is not None or _MESH_FSDP.value is not None:
        data_size, fsdp_size = cfg.mesh_shape
        changes["mesh_shape"] = (
            data_size if _MESH_DATA.value is None else _MESH_DATA.value,
            fsdp_size if _MESH_FSDP.value is None else _MESH_FSDP.value,
        )
    try:
        changes.update(overrides.parse_assignments(_SET.value))
    except ValueError as e:
        raise ValueError(f"--set={e}") from e
    return changes


def explicit_fields() -> set[str]:
    """The dotted config keys a flag or `--set` gives (what a preset gives is not listed)."""
    return set(_changes(config_lib.train_preset(_PRESET.value)))


def resolve_config() -> config_lib.TrainConfig:
    """The preset with the set flags and then `--set` overrides applied.

    Raises:
      ValueError: a malformed `--set`, or an override names an unknown field or an
        invalid value.
    """
    cfg = config_lib.train_preset(_PRESET.value)
    changes = _changes(cfg)
    try:
        return overrides.with_overrides(cfg, changes)
    except ValueError as e:
        why = str(e)
        if why.startswith("OptimConfig.warmup_steps=") and "optim.warmup_steps" not in changes:
            # The value named is the preset's, which the user may not know they can set.
            why += (
                f" (the {_PRESET.value} preset's warmup: --steps must exceed it, or pass a "
                "lower --warmup_steps)"
            )
        raise ValueError(f"invalid config override: {why}") from e


def main(argv):
    if not entry_points.start_cli(argv):
        return entry_points.EXIT_REFUSED
    if _DISTRIBUTED.value:
        jax.distributed.initialize(  # before any other JAX call; None: auto-detect
            _COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value
        )
    try:
        cfg = resolve_config()
    except ValueError as e:  # absl's UsageError would print the whole --help first
        logging.error("refused: %s", e)
        return entry_points.EXIT_REFUSED
    workdir = _WORKDIR.value or f"runs/{_PRESET.value}"
    logging.info(
        "preset %s, workdir %s, data_dir %s, resume %s",
        _PRESET.value,
        workdir,
        _DATA_DIR.value,
        _RESUME.value,
    )

    # A missing corpus is refused before --init_from_hf's checks, which read it.
    try:
        if _DATA_DIR.value == corpus.DEFAULT_DATA_DIR:
            corpus.ensure_default_data(_DATA_DIR.value)  # zero-setup default corpus
        corpus.load_meta(_DATA_DIR.value)
    except (FileNotFoundError, ValueError) as e:
        logging.error("refused: %s", e)
        return entry_points.EXIT_REFUSED
    try:  # the workdir's record may name the HF source without the flag
        cfg, init_from_hf = hf_init.prepare(
            cfg, _INIT_FROM_HF.value, explicit_fields(), workdir, _DATA_DIR.value
        )
    except (FileNotFoundError, ValueError) as e:
        logging.error("init_from_hf: %s", e)
        return 1  # a bad flag value
    # The final config (the workdir's HF record may have given the vocab size), checked
    # here so that a refusal is one line; trainer.run takes what the checks built.
    try:
        checked = trainer.check_run(cfg, _DATA_DIR.value)
    except (FileNotFoundError, ValueError) as e:
        logging.error("refused: %s", e)
        return entry_points.EXIT_REFUSED
    origin = f"{init_from_hf} (HF)" if init_from_hf else _PRESET.value
    sp = cfg.sparsity
    opts = trainer.RunOptions(
        workdir=workdir,
        data_dir=_DATA_DIR.value,
        max_to_keep=_MAX_TO_KEEP.value or None,
        resume=_RESUME.value,
        stop_at=_STOP_AT.value,
        allow_schedule_change=_ALLOW_SCHEDULE_CHANGE.value,
        skip_nonfinite=_SKIP_NONFINITE.value,
        init_from_hf=init_from_hf,
        energy=energy_flag.ENERGY.value,
        plot_title=(
            f"{origin}: {cfg.model.ffn_variant}/{cfg.model.ffn_impl}, "
            f"L1 {sp.l1_coef:g} (warmup {sp.l1_warmup_steps})"
        ),
    )
    try:
        summary = trainer.run(cfg, opts, checked=checked)
    except REFUSALS as e:
        logging.error("refused: %s", e)
        return entry_points.EXIT_REFUSED
    except run_guards.DivergenceError as e:
        logging.error("diverged: %s", e)
        return EXIT_DIVERGED
    except energy.EnergyUnavailableError as e:
        logging.error("--energy: %s", e)
        return 1  # a flag this machine cannot serve
    logging.info("summary: %s", json.dumps(summary))
    if summary["interrupted"]:
        return 128 + signal.Signals[summary["signal"]].value
    return 0


if __name__ == "__main__":
    app.run(main)
