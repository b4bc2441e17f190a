r"""Benchmarks, sparse against dense, measured in one process on the GPU.

    python -m experiments.benchmark --mode=kernel --out=results/kernel_h200.json
    python -m experiments.benchmark --mode=tune --out=results/tune_h200.json

kernel: the TwELL inference ops against the dense XLA MLP (gated and non-gated) at
M in --tokens, H=2048, N=5632, with synthetic gates at --nnz non-zeros per row, plus a
density sweep of the whole gated MLP (--sweep_nnz) for the crossover
(experiments/benchmark_kernel.py).
tune: launch sweeps of the pack kernel, of the fused D2T baseline and of GatedT2D's
SDDMM and SpMM, at the largest M (experiments/benchmark_tune.py).
train: the hybrid sparse training op's value_and_grad against dense XLA
(experiments/benchmark_train.py), at M=--train_tokens; train_tune: its kernels' block
options (compaction, row kernels, transposed SpMM).
model: model-body forward throughput, twell against dense FFNs, on synthetic-sparsity
weights (experiments/benchmark_model.py), and on trained checkpoints (--model_workdirs).
train_model: whole training-step throughput (forward, backward, AdamW), sparse against
dense FFNs, on the same synthetic-sparsity weights (experiments/benchmark_train_model.py),
or with --train_model_workdir on a pretrain checkpoint and its run's batches; --energy
adds joules per token (NVML, twell_jax.energy).
switch: where the per-layer switch puts its cutoff for each --model_presets layer shape
at M=--train_tokens (`twell_jax.switch_cost.measure`: both branches on every pattern
over an l0 grid, the rule fitted to them) and how far from the faster branch it runs at
worst, also on --switch_holdout patterns it was not fitted to.
decode: decode-size MLPs (M in --decode_tokens), dense XLA against sparse_decode_mlp and
twell_gated_mlp, interleaved (experiments/benchmark_decode.py); --decode_config repeats.
generate: end-to-end generation of --model_presets (prefill + KV-cache decode), dense
against sparse FFNs (experiments/benchmark_generate.py).

Every mode prints its records as JSON lines (--out also writes them, with the command
and the machine, to one JSON file). Without a GPU, --mode=kernel is refused (its Pallas
kernels are compiled for the GPU only); the other modes run on the CPU (XLA paths or the
Pallas interpreter) with a warning: their timings say nothing about GPU speed.

Exit codes:
  0    done
  1    a flag absl cannot parse, --energy where NVML cannot measure, or an unexpected
       error (traceback)
  2    refused (one line), before any measurement: --mode=kernel, or --decode_kernel_trace
       with --mode=decode or generate, without a GPU, --pattern=captured without
       --mode=train and --capture_workdir, --pattern=heavy_rows with --mode=model or
       train_model, --energy with a mode other than train_model, a value the mode reads
       that does not parse (numbers, presets, key=value overrides, launch specs, holdout
       patterns, --reps below 1), a workdir without checkpoints or its corpus, an --out
       that cannot be written, positional arguments
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import time

import jax
from absl import app, flags, logging

from experiments import benchmark_checks as checks
from experiments import (
    benchmark_kernel,
    benchmark_train,
    benchmark_tune,
    energy_flag,
    entry_points,
)
from twell_jax.synthetic import PATTERNS

FLAGS = flags.FLAGS
flags.DEFINE_enum(
    "mode",
    "kernel",
    [
        "kernel",
        "tune",
        "train",
        "train_tune",
        "model",
        "train_model",
        "switch",
        "decode",
        "generate",
    ],
    "What to measure.",
)
flags.DEFINE_list("model_presets", ["1.5b", "2b"], "Presets of --mode=model.")
flags.DEFINE_float("model_nnz", 29.0, "Positive gate entries per token of --mode=model.")
flags.DEFINE_integer("model_batch", 64, "Sequences per forward of --mode=model.")
flags.DEFINE_integer("model_seq", 2048, "Sequence length of --mode=model.")
flags.DEFINE_integer(
    "train_model_batch", 8, "Sequences per step of --mode=train_model (one micro-batch)."
)
flags.DEFINE_list(
    "train_model_set",
    [],
    "key=value ModelConfig overrides of --mode=train_model, e.g. sparse_ell_width=64.",
)
flags.DEFINE_string(
    "train_model_workdir",
    None,
    "Pretrain workdir whose newest checkpoint --mode=train_model times instead of the "
    "synthetic --model_presets, on the run's batches of its own corpus (its data.json, "
    "or --model_data_dir) (--train_model_batch sequences per step, the run's seq_len).",
)
flags.DEFINE_bool(
    "train_model_run_switch",
    False,
    "With --train_model_workdir: the sparse step runs each layer as the run's switch "
    "would (sparse where its l0 on the first batch is below the run's cutoff); else "
    "every layer runs sparse.",
)
flags.DEFINE_list(
    "switch_holdout",
    [],
    "pattern:sigma entries (e.g. skew:0.5,heavy_rows:0.2) that --mode=switch also times "
    "and judges the fitted rule on, without fitting to them.",
)
flags.DEFINE_list("switch_l0_grid", [], "l0 grid of --mode=switch (default: switch_cost.L0_GRID).")
flags.DEFINE_list("model_compressions", ["2", "8"], "TwELL compressions C of --mode=model.")
flags.DEFINE_list(
    "model_workdirs",
    [],
    "Pretrain workdirs whose newest checkpoint --mode=model also measures, on "
    "their corpus's validation tokens at the run's sequence length.",
)
flags.DEFINE_string(
    "model_data_dir",
    None,
    "Prepared corpus of the --model_workdirs, --train_model_workdir or --capture_workdir "
    "runs (default: the one each run records in its data.json; a corpus given here must "
    "have the run's tokenizer).",
)
flags.DEFINE_string("out", "", "JSON output path (default: print only).")
flags.DEFINE_list("tokens", ["16384", "131072"], "Token counts M.")
flags.DEFINE_list("nnz", ["29", "56", "115"], "Target non-zeros per row of the synthetic gate.")
flags.DEFINE_list(
    "sweep_nnz",
    ["29", "56", "115", "170", "230", "345"],
    "Densities of the crossover sweep (at the largest M).",
)
flags.DEFINE_integer("d_model", 2048, "H.")
flags.DEFINE_integer("d_ff", 5632, "N.")
flags.DEFINE_integer("compression", 8, "TwELL compression C.")
flags.DEFINE_list("decode_tokens", ["1", "8", "64", "512"], "Token counts M of --mode=decode.")
flags.DEFINE_float("decode_nnz", 29.0, "Positive gate entries per token of --mode=decode.")
flags.DEFINE_bool(
    "decode_kernel_trace",
    False,
    "--mode=decode / generate: also record each path's device kernels per layer / decode"
    " step and the GPU's busy time (a profiler trace).",
)
flags.DEFINE_list("generate_batch", ["1", "8", "64"], "Prompts per batch of --mode=generate.")
flags.DEFINE_integer("generate_prompt", 512, "Prompt tokens of --mode=generate.")
flags.DEFINE_integer("generate_new", 256, "New tokens per prompt of --mode=generate.")
flags.DEFINE_list(
    "generate_attention",
    ["auto"],
    "Decode-step attention impls of --mode=generate (pallas_kernels.decode_attention: auto, "
    "pallas, xla); the first gives the main figures, the others run in the same rotation.",
)
flags.DEFINE_multi_string(
    "decode_config",
    [""],
    "DecodeConfig overrides of --mode=decode, key=value[,key=value...]; repeat the flag to"
    " time several launches (each against dense).",
)
flags.DEFINE_multi_string(
    "tune_d2t_cfg",
    ["128,64,128,8,3", "128,64,64,8,3", "128,64,128,8,4", "64,64,128,8,3"],
    "Fused D2T baseline block_m,block_k,chunk,num_warps,num_stages to try in --mode=tune.",
)
flags.DEFINE_multi_string(
    "tune_t2d_cfg",
    [
        "2,1,1024:4,1,1024",
        "4,1,1024:4,1,1024",
        "2,1,512:4,1,512",
        "2,1,1024:8,1,1024",
        "2,1,1024:4,1,2048",
    ],
    "GatedT2D launches to try in --mode=tune: <SDDMM>:<SpMM>, each group,num_warps,block_h.",
)
flags.DEFINE_multi_string(
    "tune_pack_cfg",
    ["1,1,8,16,3", "1,1,8,16,7", "2,1,8,8,1", "2,1,8,12,2", "2,1,16,8,1", "8,4,8,4,1"],
    "Pack kernel block_m,num_warps[,group[,steps[,ahead]]] to try in --mode=tune.",
)
flags.DEFINE_enum(
    "pattern",
    "uniform",
    [*PATTERNS, "captured"],
    "Activation pattern of the synthetic gates (twell_jax.synthetic.gate_pattern); the"
    " model modes take uniform or skew. captured (--mode=train): the FFN inputs and"
    " weights of --capture_workdir's checkpoint, each timed beside a uniform control.",
)
flags.DEFINE_string("capture_workdir", None, "Pretrain workdir of --pattern=captured.")
flags.DEFINE_list("capture_layers", ["0"], "Layers of --pattern=captured.")
flags.DEFINE_float(
    "pattern_sigma", 1.0, "sigma of --pattern=skew (thresholds) or heavy_rows (token scales)."
)
flags.DEFINE_list("train_nnz", ["10", "29", "50", "100"], "Densities of --mode=train.")
flags.DEFINE_multi_string(
    "train_config", [], "key=value SparseTrainConfig overrides of --mode=train (repeatable)."
)
flags.DEFINE_multi_string(
    "train_config_compare",
    [],
    "Overrides whose op is timed beside --train_config's (--mode=train).",
)
flags.DEFINE_integer("train_tokens", 16384, "M of --mode=train (per-GPU micro-batch).")
flags.DEFINE_integer("reps", 30, "Timed calls per measurement (median reported).")
flags.DEFINE_integer("warmup", 5, "Untimed calls first.")
flags.DEFINE_integer(
    "inner",
    3,
    "Back-to-back calls per timed sample in --mode=kernel/tune (steady state, as in a"
    " model's forward: the host's dispatch and sync gap between calls is not counted).",
)


def _energy_meter():
    """An open `EnergyMeter` with --energy (exits naming what is missing), else a
    context of None."""
    if not energy_flag.ENERGY.value:
        return contextlib.nullcontext()
    from twell_jax import energy

    try:
        return energy.EnergyMeter()
    except energy.EnergyUnavailableError as e:
        raise SystemExit(f"--energy: {e}") from e


def _train_model(meter) -> list[dict]:
    """--mode=train_model's records: the synthetic presets, or --train_model_workdir."""
    from experiments import benchmark_train_model  # grain, as for --mode=model

    if FLAGS.train_model_workdir:
        return [
            benchmark_train_model.run_trained(
                FLAGS.train_model_workdir,
                checks.runs_data_dir(FLAGS.train_model_workdir),
                batch=FLAGS.train_model_batch,
                reps=FLAGS.reps,
                meter=meter,
                run_switch=FLAGS.train_model_run_switch,
            )
        ]
    return benchmark_train_model.run(
        presets=tuple(FLAGS.model_presets),
        nnz=FLAGS.model_nnz,
        batch=FLAGS.train_model_batch,
        seq=FLAGS.model_seq,
        reps=FLAGS.reps,
        model_overrides=checks.assignments("train_model_set", FLAGS.train_model_set),
        pattern=FLAGS.pattern,
        sigma=FLAGS.pattern_sigma,
        meter=meter,
    )


def _print_records(records: list[dict]) -> None:
    """One JSON line per record on stdout, as the modes that print while they run."""
    for rec in records:
        print(json.dumps(rec), flush=True)


def main(argv):
    if not entry_points.start_cli(argv):
        return entry_points.EXIT_REFUSED
    why = checks.refusal()
    if why:  # absl's UsageError would print the whole --help first
        logging.error("refused: %s", why)
        return entry_points.EXIT_REFUSED
    if jax.default_backend() == "cpu":
        logging.warning("--mode=%s on the CPU: CPU timings say nothing about GPU speed", FLAGS.mode)
    tokens = [int(t) for t in FLAGS.tokens]
    h, n, c = FLAGS.d_model, FLAGS.d_ff, FLAGS.compression
    bench = benchmark_kernel.KernelBench(
        h, n, c, FLAGS.reps, FLAGS.warmup, FLAGS.inner, FLAGS.pattern, FLAGS.pattern_sigma
    )
    result = {
        "mode": FLAGS.mode,
        "command": entry_points.command_line("experiments.benchmark"),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),  # the compiler's flags shape the timings
        "device": str(jax.devices()[0].device_kind),
        "jax": jax.__version__,
        "host": platform.node(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "pattern": FLAGS.pattern,
        "pattern_sigma": FLAGS.pattern_sigma,
    }
    if FLAGS.mode == "kernel":
        result["cases"] = []
        for m in tokens:
            for nnz in FLAGS.nnz:
                result["cases"].append(benchmark_kernel.kernel_case(m, float(nnz), bench))
                print(json.dumps(result["cases"][-1]), flush=True)
        result["sweep"] = []
        for nnz in FLAGS.sweep_nnz:
            result["sweep"].append(benchmark_kernel.sweep_case(max(tokens), float(nnz), bench))
            print(json.dumps(result["sweep"][-1]), flush=True)
    elif FLAGS.mode == "train" and FLAGS.pattern == "captured":
        result["cases"] = benchmark_train.run_captured(
            FLAGS.capture_workdir,
            checks.runs_data_dir(FLAGS.capture_workdir),
            layers=tuple(int(v) for v in FLAGS.capture_layers),
            M=FLAGS.train_tokens,
            reps=FLAGS.reps,
            config=checks.train_config(FLAGS.train_config),
            compare=checks.train_config(FLAGS.train_config_compare)
            if FLAGS.train_config_compare
            else None,
        )
    elif FLAGS.mode == "train":
        result["cases"] = benchmark_train.run(
            M=FLAGS.train_tokens,
            H=h,
            N=n,
            nnz_targets=tuple(float(v) for v in FLAGS.train_nnz),
            reps=FLAGS.reps,
            pattern=FLAGS.pattern,
            sigma=FLAGS.pattern_sigma,
            config=checks.train_config(FLAGS.train_config),
            compare=checks.train_config(FLAGS.train_config_compare)
            if FLAGS.train_config_compare
            else None,
        )
        _print_records(result["cases"])
    elif FLAGS.mode == "model":
        # Imported here: the model benchmark pulls in the data pipeline (grain), which
        # the kernel and training modes do not need.
        from experiments import benchmark_model

        result["cases"] = benchmark_model.run(
            presets=tuple(FLAGS.model_presets),
            nnz=FLAGS.model_nnz,
            batch=FLAGS.model_batch,
            seq=FLAGS.model_seq,
            reps=FLAGS.reps,
            compressions=tuple(int(c) for c in FLAGS.model_compressions),
            pattern=FLAGS.pattern,
            sigma=FLAGS.pattern_sigma,
        )
        if FLAGS.model_workdirs:
            result["trained"] = benchmark_model.run_trained(
                FLAGS.model_workdirs,
                checks.runs_data_dir(*FLAGS.model_workdirs),
                batch=FLAGS.model_batch,
                reps=FLAGS.reps,
            )
    elif FLAGS.mode == "train_model":
        with _energy_meter() as meter:
            result["cases"] = _train_model(meter)
            if meter:
                result["energy"] = meter.describe()
    elif FLAGS.mode == "switch":
        from twell_jax import config as config_lib
        from twell_jax import switch_cost

        result["cases"] = []
        for preset in FLAGS.model_presets:
            m = config_lib.model_preset(preset)
            shape = switch_cost.LayerShape(
                FLAGS.train_tokens, m.d_model, m.d_ff, m.sparse_ell_width
            )
            holdout = checks.holdout()
            grid = tuple(float(g) for g in FLAGS.switch_l0_grid) or switch_cost.L0_GRID
            measured = switch_cost.measure(shape, grid, reps=FLAGS.reps, holdout=holdout)
            result["cases"].append({"preset": preset, **measured})
            keys = ("cutoff", "hot_shift", "cutoffs", "max_regret",
                    "max_regret_between", "holdout_max_regret_between")  # fmt: skip
            print(json.dumps({"preset": preset, **{k: measured.get(k) for k in keys}}))
    elif FLAGS.mode == "decode":
        from experiments import benchmark_decode

        result["cases"] = []
        for config in checks.decode_configs():
            result["cases"] += benchmark_decode.run(
                [int(m) for m in FLAGS.decode_tokens],
                h,
                n,
                FLAGS.decode_nnz,
                FLAGS.reps,
                FLAGS.pattern,
                sigma=FLAGS.pattern_sigma,
                compression=c,
                config=config,
                warmup=FLAGS.warmup,
                kernel_trace=FLAGS.decode_kernel_trace,
            )
    elif FLAGS.mode == "generate":
        from experiments import benchmark_generate

        result["cases"] = benchmark_generate.run(
            FLAGS.model_presets,
            [int(b) for b in FLAGS.generate_batch],
            nnz=FLAGS.model_nnz,
            prompt_len=FLAGS.generate_prompt,
            new_tokens=FLAGS.generate_new,
            reps=FLAGS.reps,
            kernel_trace=FLAGS.decode_kernel_trace,
            attentions=FLAGS.generate_attention,
        )
    elif FLAGS.mode == "train_tune":
        result["tune"] = benchmark_train.tune(M=FLAGS.train_tokens, H=h, N=n)
        _print_records(result["tune"])
    else:
        result["tune"] = benchmark_tune.tune(
            max(tokens),
            bench,
            d2t_specs=FLAGS.tune_d2t_cfg,
            pack_specs=FLAGS.tune_pack_cfg,
            t2d_specs=FLAGS.tune_t2d_cfg,
        )
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    app.run(main)
