r"""XLA's memory plan of the real training step for a GPU that this machine does not have.

    pip install 'jax[cuda12]==0.11.2'    # the CUDA plugin and wheels; no GPU is used
    python -m experiments.plan_train_memory --preset=2b --seq=2048 \
        --ffn_impls=dense,sparse --batches=8,272 --top=12 \
        --out=results/train_step_memory_2b_h200/plans/train_step_plan_2b_h200.json

The step is `experiments.benchmark_memory`'s (`twell_jax.train.make_train_step` of
--preset with the sparse layers on, --set overrides), built on an abstract state, so
nothing is allocated, and compiled for the GPU that --target_config describes (a
`GpuTargetConfigProto` in text form; `experiments/configs/h200.gpu_target.txtpb` is
the H200's) on the CUDA plugin's compile-only devices (`experiments.compile_only`).
Each (impl, batch) records XLA's `memory_analysis` (arguments, outputs, temporaries:
what the compiler planned) and, with --top, the buffers at the top of the
temporaries' plan (name, shape, size, offset): those that set the peak. With
--devices=N the step is partitioned over N GPUs of one host (the --mesh_data x
--mesh_fsdp mesh; full FSDP by default), the Pallas kernels per batch shard as in
training, and each record is one device's plan, with the step's collectives counted.

    python -m experiments.plan_train_memory --preset=2b --devices=8 --batches=64,256

What such a plan leaves out:
- cuDNN's workspaces are planned as 0 bytes (cuDNN sizes them on a device); the
  attention backward's is an fp32 dQ accumulator of its batch (of a chunk of at most
  32 sequences since `twell_jax.model.in_sequence_chunks`), ~16 MiB per 2048-token
  sequence at 32 heads of 64;
- no autotuning: the GEMMs go to cuBLAS, as the H200's autotuner picks for this step
  (--triton_gemm lets XLA fuse them instead, which planned up to 7 GiB less than the
  card), and a fallback sort instead of CUB's.
With cuBLAS GEMMs the plans of the 2B step came within 0.25 GiB of the H200's at 8
sequences and within its whole-batch cuDNN workspace at 224-272 (docs/
performance_notes.md, "Training-step memory").
"""

from __future__ import annotations

import glob
import json
import math
import os
import pathlib
import platform
import re
import shutil
import tempfile
import time

from absl import app, flags, logging

from experiments import compile_only, entry_points

FLAGS = flags.FLAGS
IMPLS = ("dense", "sparse")
_COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
# A temporaries' buffer line of XLA's buffer-assignment dump.
_VALUE = re.compile(r"value: <\d+ (\S+) @0> \(size=(\d+),offset=(\d+)\): (\S+)")


def define_flags() -> None:
    """The CLI's flags (registered only when the module runs as a program)."""
    flags.DEFINE_string("preset", "2b", "`twell_jax.config.model_preset` name.")
    flags.DEFINE_integer("seq", 2048, "Tokens per sequence.")
    flags.DEFINE_list("ffn_impls", list(IMPLS), "ModelConfig.ffn_impl values to plan.")
    flags.DEFINE_list("batches", ["8"], "Micro-batches (sequences) to plan.")
    flags.DEFINE_float("l1_coef", 2e-5, "Lambda of the L1 activation term.")
    flags.DEFINE_list("set", [], "key=value ModelConfig overrides, e.g. sparse_ell_width=64.")
    flags.DEFINE_string("target_config", str(compile_only.H200), "GpuTargetConfigProto text.")
    flags.DEFINE_integer("devices", 1, "GPUs of the target (one host); --batches are global.")
    flags.DEFINE_integer("mesh_data", 1, "Data-parallel mesh axis (-1: the remaining GPUs).")
    flags.DEFINE_integer("mesh_fsdp", -1, "FSDP mesh axis (-1: the remaining GPUs).")
    flags.DEFINE_integer("top", 0, "Buffers at the top of each plan to record.")
    flags.DEFINE_bool(
        "triton_gemm", False, "Let XLA fuse GEMMs with Triton (off: cuBLAS, as autotuned)."
    )
    flags.DEFINE_string("out", "", "JSON output path (default: print only).")


def top_buffers(buffer_assignment: str, n: int, min_bytes: int = 0) -> list[dict]:
    """The n buffers of at least min_bytes among the preallocated temporaries that reach
    highest in the plan (offset + size; the larger first where they tie), from the text
    of XLA's `*buffer-assignment.txt` dump; none without a temporaries' allocation."""
    lines = buffer_assignment.splitlines()
    start = next((i for i, line in enumerate(lines) if "preallocated-temp" in line), None)
    if start is None:
        return []
    found = []
    for line in lines[start + 1 :]:
        if line.startswith("allocation"):
            break
        match = _VALUE.search(line)
        if match and not match.group(4).startswith("("):  # tuples: pointer tables
            name, size, offset, shape = match.groups()
            if int(size) >= min_bytes:
                found.append(
                    {"name": name, "shape": shape, "bytes": int(size), "offset": int(offset)}
                )
    found.sort(key=lambda b: (b["offset"] + b["bytes"], b["bytes"]), reverse=True)
    return found[:n]


def _overrides() -> dict[str, str]:
    return dict(kv.split("=", 1) for kv in FLAGS.set)


def plan(impl: str, batch: int, mesh, dump_dir: str, top: int) -> dict:
    """Compiles the step of `impl` at `batch` x --seq on `mesh` (of the target's
    compile-only devices); its record."""
    import jax
    import jax.numpy as jnp

    from experiments import benchmark_train_model as btm
    from twell_jax import sharding, train

    cfg = btm._train_config(FLAGS.preset, impl, batch, FLAGS.seq, FLAGS.l1_coef, _overrides())
    state = train.abstract_train_state(cfg, mesh)
    tokens = jax.ShapeDtypeStruct(
        (batch, FLAGS.seq), jnp.int32, sharding=sharding.batch_sharding(mesh)
    )
    started = time.perf_counter()
    with compile_only.gpu_code_paths():
        lowered = train.make_train_step(cfg, mesh).lower(
            state, {"inputs": tokens, "targets": tokens}
        )
        compiled = lowered.compile()
    memory, text = compiled.memory_analysis(), compiled.as_text()
    record = {
        "impl": impl,
        "batch": batch,
        "seq": FLAGS.seq,
        "tokens": batch * FLAGS.seq,
        "temp_bytes": int(memory.temp_size_in_bytes),
        "argument_bytes": int(memory.argument_size_in_bytes),
        "output_bytes": int(memory.output_size_in_bytes),
        "alias_bytes": int(memory.alias_size_in_bytes),
        "compile_s": round(time.perf_counter() - started, 1),
        # Per device; the partitioned step's collectives (an async one counted once).
        "collectives": {
            op: text.count(f" {op}(") + text.count(f" {op}-start(") for op in _COLLECTIVES
        },
    }
    if top:
        dumps = sorted(glob.glob(os.path.join(dump_dir, "*step_fn*buffer-assignment.txt")))
        if not dumps:
            logging.warning("no buffer-assignment dump of the step in %s: no --top", dump_dir)
        else:
            # Buffers of a thousandth of the plan or more: scalars stack up at its top.
            assignment = pathlib.Path(dumps[-1]).read_text()
            record["top_buffers"] = top_buffers(assignment, top, record["temp_bytes"] // 1000)
        for path in glob.glob(os.path.join(dump_dir, "*")):
            os.remove(path)
    return record


def _refusal(impls, batches, target: pathlib.Path) -> str | None:
    if not impls or not set(impls) <= set(IMPLS):
        return f"--ffn_impls must be some of {IMPLS}, got {impls}"
    if not batches or not all(b.isdigit() and int(b) > 0 for b in batches):
        return f"--batches must be positive integers, got {batches}"
    if FLAGS.seq < 1 or FLAGS.top < 0:
        return f"--seq must be positive and --top at least 0, got {FLAGS.seq}, {FLAGS.top}"
    if any("=" not in kv for kv in FLAGS.set):
        return f"--set takes key=value overrides, got {FLAGS.set}"
    data, fsdp, devices = FLAGS.mesh_data, FLAGS.mesh_fsdp, FLAGS.devices
    axes = [size for size in (data, fsdp) if size != -1]
    if devices < 1 or not axes or min(axes) < 1 or devices % math.prod(axes):
        return f"mesh (data={data}, fsdp={fsdp}) does not fit --devices={devices}"
    if len(axes) == 2 and data * fsdp != devices:
        return f"mesh (data={data}, fsdp={fsdp}) does not fit --devices={devices}"
    if any(int(b) % devices for b in batches):
        return f"--batches must be multiples of --devices={devices} (the batch is split over all)"
    if not target.is_file():
        return f"--target_config={target}: no such file"
    if compile_only.cuda_plugin() is None:
        return f"the jax CUDA plugin is not installed: {compile_only.install_hint()}"
    try:
        entry_points.check_output_file("out", FLAGS.out)
        from experiments import benchmark_train_model as btm

        for impl in impls:  # the preset and the overrides, before any compile
            btm._train_config(FLAGS.preset, impl, 8, FLAGS.seq, FLAGS.l1_coef, _overrides())
    except (OSError, ValueError, KeyError, TypeError) as e:
        return str(e)
    return None


def main(argv) -> int:
    if not entry_points.start_cli(argv):
        return entry_points.EXIT_REFUSED
    dump_dir = tempfile.mkdtemp(prefix="plan_train_memory_")
    # Before JAX starts: no GPU backend is wanted (the compile-only devices need none),
    # the plugin would check its CUDA libraries against a GPU it would not find, and
    # autotuning needs a device.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
    # Without autotuning XLA takes its Triton GEMM fusions, whose fused epilogues plan
    # up to 7 GiB less than the card: its autotuner picks cuBLAS for the step's large
    # GEMMs (docs/performance_notes.md, "Training-step memory").
    xla_flags = ["--xla_gpu_autotune_level=0"]
    if not FLAGS.triton_gemm:
        xla_flags.append("--xla_gpu_enable_triton_gemm=false")
    if FLAGS.top:
        xla_flags += [f"--xla_dump_to={dump_dir}", "--xla_dump_hlo_module_re=.*step_fn.*"]
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *xla_flags]).strip()
    try:
        return _plan_all(dump_dir)
    finally:
        shutil.rmtree(dump_dir, ignore_errors=True)


def _plan_all(dump_dir: str) -> int:
    target = pathlib.Path(FLAGS.target_config)
    reason = _refusal(FLAGS.ffn_impls, FLAGS.batches, target)
    if reason:
        logging.error("refused: %s", reason)
        return entry_points.EXIT_REFUSED
    import jax

    from twell_jax import sharding

    text = target.read_text()
    gpus = compile_only.devices(text, FLAGS.devices)
    mesh = sharding.make_mesh(FLAGS.mesh_data, FLAGS.mesh_fsdp, devices=gpus)
    result = {
        "command": entry_points.command_line("experiments.plan_train_memory"),
        "host": platform.node(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "jax": jax.__version__,
        "target": (re.findall(r'device_description_str: "([^"]*)"', text) or [None])[0],
        "preset": FLAGS.preset,
        "devices": FLAGS.devices,
        "mesh": {"data": FLAGS.mesh_data, "fsdp": FLAGS.mesh_fsdp},
        "l1_coef": FLAGS.l1_coef,
        "model_overrides": _overrides(),
        "plans": [],
    }
    for impl in FLAGS.ffn_impls:
        for batch in map(int, FLAGS.batches):
            record = plan(impl, batch, mesh, dump_dir, FLAGS.top)
            result["plans"].append(record)
            gib = {k: round(record[k] / 2**30, 3) for k in ("temp_bytes", "argument_bytes")}
            print(json.dumps({"impl": impl, "batch": batch, **gib}), flush=True)
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    define_flags()
    app.run(main)
