"""The checks of `experiments.benchmark`'s flags, run before any measurement: what the
machine cannot run and every value the selected --mode reads (`refusal`), and the
parsed values main then uses."""

from __future__ import annotations

import os

import jax
from absl import flags

from experiments import benchmark_tune, energy_flag, entry_points
from pallas_kernels.sparse_train import SparseTrainConfig
from twell_jax.overrides import parse_assignments, with_overrides
from twell_jax.synthetic import PATTERNS

FLAGS = flags.FLAGS
# Modes that only time Pallas kernels compiled for the GPU: there is no CPU path to run.
GPU_MODES = ("kernel",)


def runs_data_dir(*workdirs: str) -> str:
    """The corpus the runs in `workdirs` trained on (their data.json), or --model_data_dir
    after checking it has their tokenizer."""
    from twell_jax import run_data  # grain: only the modes that read a corpus

    dirs = {run_data.run_data_dir(w, FLAGS.model_data_dir or None) for w in workdirs}
    if len(dirs) > 1:
        raise ValueError(f"runs {list(workdirs)} trained on different corpora {sorted(dirs)}")
    return dirs.pop()


def train_config(overrides: list[str], flag: str = "train_config") -> SparseTrainConfig:
    """SparseTrainConfig with key=value `overrides` (--train_config and its compare).

    Raises:
      ValueError: an item without "=", an unknown key or a bad value, naming `flag`.
    """
    pairs = assignments(flag, overrides)
    try:
        return with_overrides(SparseTrainConfig(), pairs)
    except ValueError as e:
        raise ValueError(f"--{flag}: {e}") from None


def _numbers(flag: str, kind: type, least: float = 0) -> list:
    """--flag's list as `kind` values, each at least `least`.

    Raises:
      ValueError: naming the flag and the value.
    """
    out = []
    for text in FLAGS[flag].value:
        try:
            value = kind(text)
        except ValueError:
            what = "an int" if kind is int else "a number"
            raise ValueError(f"--{flag}={text}: not {what}") from None
        if value < least:
            raise ValueError(f"--{flag}={text}: must be at least {least}")
        out.append(value)
    return out


def assignments(flag: str, items: list[str]) -> dict[str, str]:
    """key=value items of --flag as a dict (ValueError naming the flag)."""
    try:
        return parse_assignments(items)
    except ValueError as e:
        raise ValueError(f"--{flag}: {e}") from None


def decode_configs() -> list:
    """One DecodeConfig per --decode_config flag (ValueError naming the bad one)."""
    from pallas_kernels.decode import DecodeConfig

    configs = []
    for spec in FLAGS.decode_config:
        pairs = assignments("decode_config", [kv for kv in spec.split(",") if kv])
        try:
            configs.append(with_overrides(DecodeConfig(), pairs))
        except ValueError as e:
            raise ValueError(f"--decode_config={spec}: {e}") from None
    return configs


def holdout() -> dict[str, tuple[str, float]]:
    """--switch_holdout as {entry: (pattern, sigma)} (ValueError naming a bad entry)."""
    holdout = {}
    for entry in FLAGS.switch_holdout:
        pattern, _, sigma = entry.partition(":")
        if pattern not in PATTERNS:
            raise ValueError(f"--switch_holdout={entry}: pattern must be one of {list(PATTERNS)}")
        try:
            holdout[entry] = (pattern, float(sigma or 1.0))
        except ValueError:
            raise ValueError(f"--switch_holdout={entry}: sigma is not a number") from None
    return holdout


def _check_workdirs(flag: str, *workdirs: str) -> None:
    """Each pretrain workdir of --flag has checkpoints and its corpus is here
    (`runs_data_dir`).

    Raises:
      FileNotFoundError, ValueError: naming the workdir or the corpus.
    """
    from twell_jax.trainer import CHECKPOINT_DIR  # grain: only the modes that read a run

    for workdir in workdirs:
        if not os.path.isdir(os.path.join(workdir, CHECKPOINT_DIR)):
            why = "is not a pretrain workdir (no checkpoints)"
            raise FileNotFoundError(f"--{flag}: {workdir} {why}")
    runs_data_dir(*workdirs)


def _check_values() -> None:
    """Every value the selected --mode reads, parsed before anything is measured.

    Raises:
      FileNotFoundError, ValueError: naming the flag.
    """
    entry_points.check_output_file("out", FLAGS.out)
    if FLAGS.reps < 1:
        raise ValueError(f"--reps={FLAGS.reps}: must be at least 1")
    if FLAGS.warmup < 0 or FLAGS.inner < 1:
        raise ValueError("--warmup must be at least 0, --inner at least 1")
    _numbers("tokens", int, 1)
    mode = FLAGS.mode
    if mode == "kernel":
        _numbers("nnz", float)
        _numbers("sweep_nnz", float)
    if mode == "tune":
        benchmark_tune.launch_configs(FLAGS.tune_d2t_cfg, FLAGS.tune_pack_cfg, FLAGS.tune_t2d_cfg)
    if mode == "train":
        train_config(FLAGS.train_config)
        train_config(FLAGS.train_config_compare, "train_config_compare")
        _numbers("train_nnz", float)
        if FLAGS.pattern == "captured":
            _numbers("capture_layers", int)
            _check_workdirs("capture_workdir", FLAGS.capture_workdir)
    presets = mode in ("model", "switch", "generate") or (
        mode == "train_model" and not FLAGS.train_model_workdir
    )
    for preset in FLAGS.model_presets if presets else ():
        from twell_jax import config as config_lib

        try:
            config_lib.model_preset(preset)
        except ValueError as e:
            raise ValueError(f"--model_presets: {e}") from None
    if mode == "model":
        _numbers("model_compressions", int, 1)
        if FLAGS.model_workdirs:
            _check_workdirs("model_workdirs", *FLAGS.model_workdirs)
    if mode == "train_model":
        assignments("train_model_set", FLAGS.train_model_set)
        if FLAGS.train_model_workdir:
            _check_workdirs("train_model_workdir", FLAGS.train_model_workdir)
    if mode == "switch":
        holdout()
        _numbers("switch_l0_grid", float)
    if mode == "decode":
        _numbers("decode_tokens", int, 1)
        decode_configs()
    if mode == "generate":
        _numbers("generate_batch", int, 1)


def refusal() -> str | None:
    """Why the flags ask for what this machine cannot run, or for values that are not
    valid (checked before any work), or None."""
    if FLAGS.pattern == "captured" and (FLAGS.mode != "train" or not FLAGS.capture_workdir):
        return "--pattern=captured needs --mode=train and --capture_workdir"
    if FLAGS.pattern == "heavy_rows" and FLAGS.mode in ("model", "train_model"):
        return f"--pattern={FLAGS.pattern} is not implemented for --mode={FLAGS.mode}"
    if energy_flag.ENERGY.value and FLAGS.mode != "train_model":
        return "--energy is implemented for --mode=train_model only"
    if FLAGS.mode in GPU_MODES and jax.default_backend() != "gpu":
        return f"--mode={FLAGS.mode} times the Pallas kernels and needs a GPU"
    if (
        FLAGS.decode_kernel_trace
        and FLAGS.mode in ("decode", "generate")
        and jax.default_backend() != "gpu"
    ):
        return "--decode_kernel_trace records the GPU's kernels and busy time and needs a GPU"
    try:
        _check_values()
    except (FileNotFoundError, ValueError) as e:
        return str(e)
    return None
