r"""Memory of one real training step, dense against sparse FFNs, and the largest
micro-batch that fits on this GPU.

    python -m experiments.benchmark_memory --preset=2b --batch=8 --seq=2048 \
        --ffn_impls=dense,sparse --model_nnz=29 --search_batch \
        --out=results/train_step_memory_h200.json

The step is the real one: `twell_jax.train.make_train_step` of --preset (forward with the
preset's remat, backward, the L1 activation term, global-norm clipping, AdamW) on one
micro-batch of --batch x --seq tokens, built as `experiments.benchmark_train_model`
builds it: synthetic-sparsity weights with ~--model_nnz positive gate entries per token
and layer, every layer of the sparse model on the sparse kernels, and an lr so small that
the weights, and so the sparsity that sizes the sparse op's buffers, stay put.

Each measurement (a probe) runs in a fresh child process (this module with --probe): a
device's peak only grows within a process, and what one probe left allocated or cached
would count against the next. The child runs the step --steps times on one device and
prints one JSON line: XLA's compiled sizes (`memory_analysis`: arguments, i.e. state and
batch, outputs, temporaries: what the compiler planned); the allocator's peak bytes in
use after the steps, the most its pool grew to and its bytes_limit (`memory_stats`, None
on a CPU: what was held at once, with what the plan leaves out), and the peak before the
first step (set-up and compiling: an equal peak after the steps means the step was not
the peak); the median step time, l0 at the first and the last step, the sparse op's
overflow counters summed over the steps (tail rows, dense fallbacks: whether the sparse
path ran as sized); and `twell_jax.step_memory.estimate`, the analytic lower bound.

--search_batch then finds, per impl, the largest micro-batch that fits: doubling from
--batch until a probe runs out of memory (the child exits OUT_OF_MEMORY), then bisecting
between the last fit and the first failure, each probe a fresh child. Any other failure
of a child stops the run with its exit code and the tail of its stderr. On a CPU nothing
reports running out of memory (the host's OOM killer ends the child), so keep
--max_batch small there.

Exit codes: 0 done, 1 a probe failed other than by running out of memory, 2 refused in
one line before any probe (--ffn_impls other than dense/sparse, an unknown --preset or
a --set that makes no ModelConfig, a --batch, --seq or --steps below 1, a --max_batch
below --batch or --search_step below 1 with --search_batch, an --out that cannot be
written, positional arguments).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import platform
import subprocess
import sys
import time
from collections.abc import Callable

from absl import app, flags, logging

from experiments import entry_points
from twell_jax.overrides import parse_assignments

# The parent imports no backend: on a GPU it would take memory the children measure.
FLAGS = flags.FLAGS


def define_flags() -> None:
    """The CLI's flags, registered only when the module runs as a program: other
    entry points (pretrain, benchmark, neuron_profile) define some of the same names,
    and tests import several of them into one process."""
    flags.DEFINE_string("preset", "2b", "`twell_jax.config.model_preset` name.")
    flags.DEFINE_integer("batch", 8, "Sequences of the micro-batch (the search starts here).")
    flags.DEFINE_integer("seq", 2048, "Tokens per sequence.")
    flags.DEFINE_list("ffn_impls", ["dense", "sparse"], "ModelConfig.ffn_impl values to measure.")
    flags.DEFINE_float(
        "model_nnz", 29.0, "Positive gate entries per token of the synthetic weights."
    )
    flags.DEFINE_float("l1_coef", 2e-5, "Lambda of the L1 activation term.")
    flags.DEFINE_integer("steps", 3, "Train steps per probe (median time reported).")
    flags.DEFINE_list("set", [], "key=value ModelConfig overrides, e.g. sparse_ell_width=64.")
    flags.DEFINE_bool("search_batch", False, "Find each impl's largest micro-batch that fits.")
    flags.DEFINE_integer("max_batch", 1024, "Largest micro-batch the search tries.")
    flags.DEFINE_integer("search_step", 1, "The search stops bisecting at this many sequences.")
    flags.DEFINE_enum("allocator", "bfc", ["bfc", "platform"], "Children's allocator (child_env).")
    flags.DEFINE_float("mem_fraction", 0.95, "Device memory the bfc pool may grow to.")
    flags.DEFINE_string("out", "", "JSON output path (default: print only).")
    flags.DEFINE_bool("probe", False, "Internal: be the child, one probe of --ffn_impls.")
    flags.DEFINE_integer("calib_batch", 0, "Sequences the weights are calibrated on (0: --batch).")


IMPLS = ("dense", "sparse")
# The child's exit status when the step does not fit in device memory.
OUT_OF_MEMORY = 3
_OOM_MARKS = ("RESOURCE_EXHAUSTED", "OUT OF MEMORY", "OUT_OF_MEMORY")
REPO = pathlib.Path(__file__).resolve().parents[1]
GIB = 2**30
# Probe field -> its flag, where the names differ.
_FLAG_OF = {"impl": "ffn_impls", "nnz": "model_nnz", "overrides": "set"}


class ProbeError(RuntimeError):
    """A probe failed other than by running out of memory (exit code, stderr tail)."""


@dataclasses.dataclass(frozen=True)
class Probe:
    """One measurement: the step of `impl` at `batch` x `seq` tokens.

    calib_batch: sequences the synthetic weights are calibrated on, the same at every
    batch of a search, so that every probe steps the same weights.
    overrides: key=value ModelConfig overrides.
    """

    preset: str
    impl: str
    batch: int
    seq: int
    nnz: float
    l1_coef: float
    steps: int
    calib_batch: int
    overrides: tuple[str, ...] = ()

    def argv(self) -> list[str]:
        """The child's command line: this module, --probe and the fields as flags."""
        fields = {**dataclasses.asdict(self), "overrides": ",".join(self.overrides)}
        probe = [f"--{_FLAG_OF.get(k, k)}={v}" for k, v in fields.items()]
        return [sys.executable, "-m", "experiments.benchmark_memory", "--probe", *probe]


def _stat(stats: dict | None, key: str) -> int | None:
    return None if stats is None or key not in stats else int(stats[key])


def measure(p: Probe) -> dict:
    """Builds and runs the step of `p` in this process; its record (module docstring)."""
    import jax
    import numpy as np

    from experiments import bench_util as bu
    from experiments import benchmark_train_model as btm
    from twell_jax import sharding, step_memory, train
    from twell_jax.synthetic import synthetic_sparse_params

    device = jax.devices()[0]
    mesh = sharding.make_mesh(1, 1, devices=[device])  # one GPU's memory, whatever is there
    params, calib_l0 = synthetic_sparse_params(p.preset, p.nnz, calib_tokens=(p.calib_batch, p.seq))
    overrides = dict(kv.split("=", 1) for kv in p.overrides)
    cfg = btm._train_config(p.preset, p.impl, p.batch, p.seq, p.l1_coef, overrides)
    step, state = btm.train_step_and_state(cfg, mesh, params)
    del params  # the state holds its own fp32 copy
    tokens = btm._batch(cfg.model.vocab_size, p.batch, p.seq, mesh)
    # The step's calls below reuse this compile (jit and the AOT path share the cache).
    compiled = bu.compiled_memory(step.lower(state, tokens))
    before = device.memory_stats()
    timing, _, metrics = bu.time_steps_interleaved(
        {p.impl: step}, {p.impl: state}, tokens, warmup=0, reps=p.steps
    )
    after = device.memory_stats()
    host = [train.host_metrics(m) for m in metrics[p.impl]]
    est = step_memory.estimate(cfg, devices=1)
    counters = {  # the sparse op's overflow counters, summed over the steps
        f"{k}_total": int(sum(np.sum(m[k]) for m in host)) if k in host[0] else None
        for k in ("tail_rows", "dense_fallback")
    }
    return {
        "impl": p.impl,
        "batch": p.batch,
        "seq": p.seq,
        "tokens": p.batch * p.seq,
        "fit": True,
        "device": str(device.device_kind),
        "jax": jax.__version__,
        "compiled": compiled,
        "peak_bytes": _stat(after, "peak_bytes_in_use"),
        "peak_pool_bytes": _stat(after, "peak_pool_bytes"),
        "bytes_limit": _stat(after, "bytes_limit"),
        "peak_bytes_before_steps": _stat(before, "peak_bytes_in_use"),
        "bytes_in_use_before_steps": _stat(before, "bytes_in_use"),
        "step_ms": timing[p.impl]["median_ms"],
        "step_times_ms": timing[p.impl]["times_ms"],
        "calibration_l0_mean": float(np.mean(calib_l0)),
        "l0_first": float(np.mean(host[0]["l0"])),
        "l0_last": float(np.mean(host[-1]["l0"])),
        **counters,
        "estimate_bytes": {**dataclasses.asdict(est), "total": est.total},
    }


def is_out_of_memory(e: BaseException) -> bool:
    """Whether `e` is XLA running out of device memory: RESOURCE_EXHAUSTED from the
    allocator, or CUDA's out-of-memory from a launch or a library's workspace."""
    import jax

    text = str(e).upper()
    return isinstance(e, jax.errors.JaxRuntimeError) and any(m in text for m in _OOM_MARKS)


def probe_main(p: Probe) -> None:
    """The child: prints `measure(p)` as one JSON line, or, when the step does not fit,
    {"fit": false, "error"} and exits OUT_OF_MEMORY. Other errors propagate."""
    try:
        rec = measure(p)
    except Exception as e:
        if not is_out_of_memory(e):
            raise
        oom = {"impl": p.impl, "batch": p.batch, "fit": False, "error": str(e)[:2000]}
        print(json.dumps(oom), flush=True)
        sys.exit(OUT_OF_MEMORY)
    print(json.dumps(rec), flush=True)


def child_env(allocator: str, mem_fraction: float) -> dict[str, str]:
    """The children's environment: this one, with the allocator set so that what it
    reports is the step's own use."""
    env = dict(os.environ)
    # JAX preallocates 75% of a GPU at start-up by default: the pool's size would then
    # say nothing about the step, and a probe could not use more than the fraction.
    # Grown on demand, the pool holds what the step's buffers needed (peak_pool_bytes).
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    env["XLA_PYTHON_CLIENT_ALLOCATOR"] = allocator
    if allocator == "platform":
        # No pool: every buffer is allocated from and returned to the driver as it
        # goes, so a probe runs out of memory only when the device has none left (no
        # pool limit, no fragmentation). XLA keeps no statistics for this allocator:
        # memory_stats() is None, and only the compiled sizes and the fit are measured.
        env.pop("XLA_PYTHON_CLIENT_MEM_FRACTION", None)
    else:
        # The BFC pool, up to this fraction of the device, keeps the peak statistics.
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = str(mem_fraction)
    return env


def run_probe(p: Probe, env: dict[str, str], runner: Callable = subprocess.run) -> dict:
    """Runs `p` in a fresh child; its record ("fit": False when it ran out of memory).

    Raises:
      ProbeError: the child failed otherwise, or printed no record.
    """
    proc = runner(p.argv(), env=env, cwd=REPO, capture_output=True, text=True, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    where = f"the {p.impl} probe at batch {p.batch}"
    if proc.returncode not in (0, OUT_OF_MEMORY):
        signal = " (killed by a signal)" if proc.returncode < 0 else ""
        raise ProbeError(
            f"{where} exited {proc.returncode}{signal}; its stderr ends:\n{proc.stderr[-3000:]}"
        )
    if proc.returncode == OUT_OF_MEMORY:
        rec = json.loads(lines[-1]) if lines else {}
        return {"impl": p.impl, "batch": p.batch, **rec, "fit": False}
    if not lines:
        raise ProbeError(f"{where} printed no record; its stderr ends:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def _temp(rec: dict) -> int | None:
    return (rec.get("compiled") or {}).get("temp_bytes")


def largest_fitting(probe: Callable, start: int, max_batch: int, step: int = 1) -> dict:
    """The largest micro-batch b <= max_batch with `probe(b)["fit"]` (fitting is taken
    to be monotone in b): doubling from `start` to the first failure, then bisecting
    between the last fit and it until they are at most `step` apart (each probe costs a
    compile); a `start` that fails bisects below it. An exception from `probe` stops
    the search.

    Returns {"largest_batch" (0: not even 1 fits; the true largest is below
    largest_batch + step), "capped" (max_batch fit: the largest may be more), "trace":
    [{"batch", "fit", "peak_bytes", "temp_bytes"}] in probe order}.
    """
    trace = []

    def fits(batch: int) -> bool:
        rec = probe(batch)
        trace.append({"batch": batch, "fit": rec["fit"], "peak_bytes": rec.get("peak_bytes")})
        trace[-1]["temp_bytes"] = _temp(rec)
        return rec["fit"]

    lo, batch = 0, start
    while fits(batch):
        lo = batch
        if batch >= max_batch:
            return {"largest_batch": lo, "capped": True, "trace": trace}
        batch = min(2 * batch, max_batch)
    hi = batch
    while hi - lo > step:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return {"largest_batch": lo, "capped": False, "trace": trace}


def _ratio(dense, sparse) -> float | None:
    return sparse / dense if dense and sparse is not None else None


def _describe(rec: dict) -> str:
    if not rec["fit"]:
        return f"{rec['impl']} batch {rec['batch']}: out of memory"
    gib = lambda n: "n/a" if n is None else f"{n / GIB:.2f} GiB"
    return (
        f"{rec['impl']} batch {rec['batch']}: fits, peak {gib(rec['peak_bytes'])}, "
        f"XLA temp {gib(_temp(rec))}, step {rec['step_ms']:.1f} ms"
    )


def run(base: Probe, impls, probe_fn: Callable, search=False, max_batch=0, step=1) -> dict:
    """The parent: each impl at base.batch, then with `search` its largest micro-batch
    (`largest_fitting` up to max_batch, to within `step`).

    probe_fn: Probe -> record (`run_probe` in a fresh child; tests pass a fake).

    Returns {"probes": impl -> record at base.batch, "search": impl -> `largest_fitting`
    (with `search`), "ratios": sparse/dense of peak_bytes and temp_bytes at base.batch
    and of largest_batch (None where either is unknown), "device", "jax"}.
    """

    def probe(impl: str, batch: int) -> dict:
        rec = probe_fn(dataclasses.replace(base, impl=impl, batch=batch))
        print(_describe(rec), flush=True)
        return rec

    probes = {impl: probe(impl, base.batch) for impl in impls}
    first = next((r for r in probes.values() if "device" in r), {})
    out = {"device": first.get("device"), "jax": first.get("jax"), "probes": probes}
    for impl in impls if search else ():
        again = lambda b, impl=impl: probes[impl] if b == base.batch else probe(impl, b)
        out.setdefault("search", {})[impl] = largest_fitting(again, base.batch, max_batch, step)
    if set(IMPLS) <= set(impls):
        dense, sparse = (probes[impl] for impl in IMPLS)
        out["ratios"] = {
            "peak_bytes sparse/dense": _ratio(dense.get("peak_bytes"), sparse.get("peak_bytes")),
            "temp_bytes sparse/dense": _ratio(_temp(dense), _temp(sparse)),
        }
        if search:
            largest = (out["search"][impl]["largest_batch"] for impl in IMPLS)
            out["ratios"]["largest_batch sparse/dense"] = _ratio(*largest)
    return out


# Run in a child on the CPU: the parent imports no JAX (`twell_jax.config` does).
_CHECK_CONFIG = """
import sys
from twell_jax.config import model_preset
from twell_jax.overrides import parse_assignments, with_overrides
try:
    model = model_preset(sys.argv[1], seq_len=int(sys.argv[2]))
    with_overrides(model, parse_assignments(sys.argv[3:]))
except ValueError as e:
    print(e)
    sys.exit(2)
"""


def config_error(preset: str, seq: int, overrides: list[str]) -> str | None:
    """Why --preset, --seq and --set make no ModelConfig (checked in a CPU child, the
    parent importing no JAX), or None."""
    args = [sys.executable, "-c", _CHECK_CONFIG, preset, str(seq), *overrides]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(args, env=env, cwd=REPO, capture_output=True, text=True, check=False)
    if proc.returncode == 0:
        return None
    if proc.returncode == 2 and proc.stdout.strip():
        return proc.stdout.strip().splitlines()[-1]
    return f"checking --preset={preset} --set failed: {proc.stderr.strip()[-500:]}"


def refusal() -> str | None:
    """Why the flags cannot run, checked before any probe, or None."""
    impls = FLAGS.ffn_impls
    if not impls or not set(impls) <= set(IMPLS):
        return f"--ffn_impls must be some of {IMPLS}, got {impls}"
    if min(FLAGS.batch, FLAGS.seq, FLAGS.steps) < 1 or FLAGS.calib_batch < 0:
        return "--batch, --seq and --steps must be at least 1, --calib_batch at least 0"
    if FLAGS.search_batch and (FLAGS.max_batch < FLAGS.batch or FLAGS.search_step < 1):
        return "--max_batch must be at least --batch, --search_step at least 1"
    try:
        parse_assignments(FLAGS.set)
    except ValueError as e:
        return f"--set: {e}"
    try:
        entry_points.check_output_file("out", FLAGS.out)
    except (FileNotFoundError, ValueError) as e:
        return str(e)
    if FLAGS.probe:  # the parent checked the config
        return None
    return config_error(FLAGS.preset, FLAGS.seq, FLAGS.set)


def main(argv):
    if not entry_points.start_cli(argv):
        return entry_points.EXIT_REFUSED
    why = refusal()
    if why:  # absl's UsageError would print the whole --help first
        logging.error("refused: %s", why)
        return entry_points.EXIT_REFUSED
    impls = FLAGS.ffn_impls
    given = {
        f.name: getattr(FLAGS, _FLAG_OF.get(f.name, f.name)) for f in dataclasses.fields(Probe)
    }
    given.update(impl=impls[0], calib_batch=FLAGS.calib_batch or FLAGS.batch)
    base = Probe(**{**given, "overrides": tuple(FLAGS.set)})
    if FLAGS.probe:
        return probe_main(base)
    env = child_env(FLAGS.allocator, FLAGS.mem_fraction)
    result = {
        "command": entry_points.command_line("experiments.benchmark_memory"),
        "host": platform.node(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "allocator": FLAGS.allocator,
        "mem_fraction": FLAGS.mem_fraction if FLAGS.allocator == "bfc" else None,
        **{k: v for k, v in dataclasses.asdict(base).items() if k not in ("impl", "overrides")},
        "model_overrides": parse_assignments(FLAGS.set),
    }
    probe_fn = lambda p: run_probe(p, env)
    search = (FLAGS.search_batch, FLAGS.max_batch, FLAGS.search_step)
    result.update(run(base, impls, probe_fn, *search))
    for impl, found in result.get("search", {}).items():
        print(f"{impl}: largest micro-batch {found['largest_batch']}", flush=True)
    print(json.dumps(result.get("ratios", {})), flush=True)
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    define_flags()
    app.run(main)
