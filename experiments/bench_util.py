"""Timing and error helpers shared by the benchmarks."""

from __future__ import annotations

import collections
import functools
import glob
import gzip
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
from absl import app, flags, logging

from experiments import entry_points

# experiments/benchmark.py reads the synthetic MLP from here; its home is twell_jax.synthetic.

# Seconds since an arbitrary origin, like `time.perf_counter`.
Clock = Callable[[], float]


def _summary(times_ms: list[float]) -> dict:
    """{"median_ms", "p10_ms", "p90_ms", "reps"} of per-call times in ms."""
    s = sorted(times_ms)
    return {
        "median_ms": statistics.median(s),
        "p10_ms": s[len(s) // 10],
        "p90_ms": s[(len(s) * 9) // 10],
        "reps": len(s),
    }


def time_fn(
    fn, *args, warmup: int = 5, reps: int = 50, inner: int = 1, clock: Clock = time.perf_counter
) -> dict:
    """Wall time of `fn(*args)` per call, synchronised, after `warmup` calls.

    Each of the `reps` samples times `inner` back-to-back calls and one sync, divided
    by `inner` (inner > 1 hides the launch gap between short calls, as in a step).
    `clock` returns seconds (tests pass a fake one).

    Returns {"median_ms", "p10_ms", "p90_ms", "reps"}.
    """
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        start = clock()
        for _ in range(inner):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((clock() - start) * 1e3 / inner)
    return _summary(times)


def time_interleaved(
    fns: dict,
    *args,
    warmup: int = 3,
    reps: int = 15,
    inner: int = 1,
    clock: Clock = time.perf_counter,
) -> dict:
    """Wall times of several functions of the same `args`, called in rotation.

    One round calls every function `inner` times back to back, synchronised after each
    function (its time is divided by inner); `reps` rounds follow `warmup` rounds.
    Rotating makes clock and thermal drift hit every function alike, which matters
    when one call takes most of a second and two runs differ by a few percent.
    Every other round runs in reverse order (a b | b a | a b ...), so each function
    follows each other one equally often: on a power-limited GPU a kernel that runs
    right after dense GEMMs starts throttled, and a fixed order would charge that to
    whichever function comes second. Each function still runs partly in the power
    state the others leave, so a ratio timed this way can differ from the ratio of
    each function timed alone (docs/design.md §8).

    Args:
      fns: name -> callable.
      clock: returns seconds (tests pass a fake one).

    Returns:
      name -> {"median_ms", "p10_ms", "p90_ms", "reps", "times_ms"}; also
      "ratios": "<a>/<b>" -> median over rounds of time(a) / time(b) for every ordered
      pair (a, b) with a listed first.
    """

    def timed(name):
        start = clock()
        for _ in range(inner):
            out = fns[name](*args)
        jax.block_until_ready(out)
        return (clock() - start) * 1e3 / inner

    warm = lambda name: jax.block_until_ready(fns[name](*args))
    return _rotation_summary(_rotate(list(fns), warm, timed, warmup, reps))


def _rotate(names: list[str], warm, timed, warmup: int, reps: int) -> dict[str, list[float]]:
    """`warmup` rounds of `warm(name)`, then `reps` rounds of `timed(name) -> ms`, each
    round over all names, every other round in reverse order; name -> the reps times."""
    for _ in range(warmup):
        for name in names:
            warm(name)
    times = {name: [] for name in names}
    for rep in range(reps):
        for name in names if rep % 2 == 0 else names[::-1]:
            times[name].append(timed(name))
    return times


def _rotation_summary(times: dict[str, list[float]]) -> dict:
    """Per-name `_summary` plus "times_ms", and the median per-round ratio of each pair."""
    names = list(times)
    out = {name: {**_summary(ts), "times_ms": ts} for name, ts in times.items()}
    out["ratios"] = {
        f"{a}/{b}": statistics.median(ta / tb for ta, tb in zip(times[a], times[b], strict=True))
        for i, a in enumerate(names)
        for b in names[i + 1 :]
    }
    return out


def time_steps_interleaved(
    steps: dict,
    states: dict,
    *args,
    warmup: int = 2,
    reps: int = 10,
    clock: Clock = time.perf_counter,
    meter=None,
) -> tuple[dict, dict, dict]:
    """`time_interleaved` for functions that carry a state: `state, aux = step(state, *args)`.

    Each function runs on its own state chain (a donated training state cannot be
    passed twice), one call per function per round, in rotation with every other round
    reversed.

    Args:
      steps: name -> callable returning (new state, aux).
      states: name -> that function's initial state (consumed if the step donates it).
      clock: returns seconds (tests pass a fake one).
      meter: an object whose `joules()` returns cumulative joules (e.g.
        `twell_jax.energy.EnergyMeter`); it is read just outside each timed call's
        clock reads, so its own cost stays out of the times.

    Returns:
      (timing as `time_interleaved` returns it, name -> final state, name -> list of
      the aux outputs of every call, warm-up first). With a meter each name's timing
      also has "joules_per_call" (the timed calls') and "joules" (their sum).
    """
    states = dict(states)
    auxes = {name: [] for name in steps}
    joules = {name: [] for name in steps}

    def call(name):
        start = clock()
        states[name], aux = steps[name](states[name], *args)
        jax.block_until_ready((states[name], aux))
        auxes[name].append(aux)
        return (clock() - start) * 1e3

    def metered(name):
        before = meter.joules()
        ms = call(name)
        joules[name].append(meter.joules() - before)
        return ms

    times = _rotate(list(steps), call, call if meter is None else metered, warmup, reps)
    timing = _rotation_summary(times)
    if meter is not None:
        for name, js in joules.items():
            timing[name].update(joules_per_call=js, joules=sum(js))
    return timing, states, auxes


def compiled_memory(lowered) -> dict:
    """XLA's sizes of a lowered function once compiled: {"temp_bytes", "output_bytes",
    "argument_bytes"}, or {"memory_analysis_error"} on backends without the analysis."""
    try:
        ma = lowered.compile().memory_analysis()
        return {
            "temp_bytes": int(ma.temp_size_in_bytes),
            "output_bytes": int(ma.output_size_in_bytes),
            "argument_bytes": int(ma.argument_size_in_bytes),
        }
    except Exception as e:  # backends without memory_analysis
        return {"memory_analysis_error": repr(e)}


def errors(out: jax.Array, ref: jax.Array) -> dict:
    """Max error relative to the reference's max magnitude, and the norm-relative error."""
    o, r = out.astype(jnp.float32), ref.astype(jnp.float32)
    scale = jnp.maximum(jnp.max(jnp.abs(r)), 1e-30)
    return {
        "max_rel_err": float(jnp.max(jnp.abs(o - r)) / scale),
        "norm_rel_err": float(jnp.linalg.norm(o - r) / jnp.maximum(jnp.linalg.norm(r), 1e-30)),
    }


def _gpu_kernels(events: list[dict]) -> list[dict]:
    """The complete ("X") events of processes whose name mentions a GPU: device kernels
    (the host side of the same trace, Python and XLA's dispatch, is not kernel time)."""
    names = {
        e["pid"]: e.get("args", {}).get("name", "")
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    return [e for e in events if e.get("ph") == "X" and "GPU" in names.get(e.get("pid"), "")]


def kernel_table(events: list[dict], calls: int) -> dict[str, dict]:
    """Device kernels of a profiler trace (Chrome trace events): name -> {"per_call":
    launches per call, "mean_us": mean duration}, over `calls` calls, longest total first."""
    total = collections.defaultdict(lambda: [0, 0.0])
    for e in _gpu_kernels(events):
        entry = total[e["name"]]
        entry[0] += 1
        entry[1] += float(e.get("dur", 0.0))
    ranked = sorted(total.items(), key=lambda kv: -kv[1][1])
    return {
        name: {"per_call": count / calls, "mean_us": dur / count} for name, (count, dur) in ranked
    }


def gpu_timeline(events: list[dict]) -> dict:
    """How busy the GPU was over a trace: {"kernels": launches, "busy_us": time with at
    least one kernel running, "span_us": first kernel start to last kernel end}. span -
    busy is the time the GPU waited between kernels (launch gaps, host work)."""
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)))
                   for e in _gpu_kernels(events) if "ts" in e)  # fmt: skip
    busy, end = 0.0, None
    for start, stop in spans:
        if end is None or start > end:
            busy, end = busy + stop - start, stop
        elif stop > end:
            busy, end = busy + stop - end, stop
    span = end - spans[0][0] if spans else 0.0  # end: the latest stop seen
    return {"kernels": len(spans), "busy_us": busy, "span_us": span}


def trace_events(run: Callable[[], object], calls: int = 1) -> list[dict]:
    """Chrome trace events (jax.profiler, CUPTI on a GPU) of `calls` synchronised calls
    of `run()`; [] where the profiler wrote no trace. Warm `run` up first."""
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            for _ in range(calls):
                jax.block_until_ready(run())
        files = glob.glob(f"{tmp}/**/*.trace.json.gz", recursive=True)
        if not files:
            return []
        with gzip.open(files[0]) as f:
            trace = json.load(f)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def kernel_times(fn, *args, calls: int = 5) -> dict[str, dict]:
    """`kernel_table` of `calls` calls of `fn(*args)` after one warm-up ({} where the
    trace has no device kernels)."""
    jax.block_until_ready(fn(*args))
    return kernel_table(trace_events(lambda: fn(*args), calls), calls)


def call_timeline(fn, *args) -> dict:
    """`gpu_timeline` of one call of `fn(*args)` after one warm-up."""
    jax.block_until_ready(fn(*args))
    return gpu_timeline(trace_events(lambda: fn(*args)))


def stacked_attention_layers(op, qkv, cos, sin, cache_k, cache_v, *rest, **kwargs):
    """`op(qkv[i], cos, sin, cache_k[i], cache_v[i], *rest, **kwargs)` for every layer i
    of the stacked qkv [L, ...] and the L caches (tuples): (o [L, ...], caches)."""
    out, cache_k, cache_v = [], list(cache_k), list(cache_v)
    for i in range(qkv.shape[0]):
        o, cache_k[i], cache_v[i] = op(qkv[i], cos, sin, cache_k[i], cache_v[i], *rest, **kwargs)
        out.append(o)
    return jnp.stack(out), tuple(cache_k), tuple(cache_v)


def attention_launches(op, config_cls, launches, name_format: str, *args, n_heads: int) -> dict:
    """`per_layer_profile` of `stacked_attention_layers(op, *args)` with impl="xla" and
    with the kernel at each launch (`config_cls(*launch)`; the interpreter off a GPU):
    {"xla" or name_format.format(*launch): profile}."""
    impl = "pallas" if jax.default_backend() == "gpu" else "interpret"
    cases = [("xla", "xla", config_cls())] + [
        (name_format.format(*launch), impl, config_cls(*launch)) for launch in launches
    ]
    res = {}
    for name, case_impl, config in cases:
        fn = jax.jit(
            functools.partial(
                stacked_attention_layers, op, n_heads=n_heads, impl=case_impl, config=config
            )
        )
        res[name] = per_layer_profile(fn, *args, layers=args[0].shape[0])
        print(name, round(res[name]["busy_us_per_layer"], 2), flush=True)
    return res


def per_layer_profile(fn, *args, layers: int) -> dict:
    """One call of `fn(*args)` that runs `layers` layers, per layer: {"busy_us_per_layer",
    "span_us_per_layer", "kernels": name -> (launches, mean µs)}."""
    table = kernel_times(fn, *args, calls=5)
    line = call_timeline(fn, *args)
    return {
        "busy_us_per_layer": line["busy_us"] / layers,
        "span_us_per_layer": line["span_us"] / layers,
        "kernels": {k: (v["per_call"] / layers, v["mean_us"]) for k, v in table.items()},
    }


def write_cases(doc: str, cases: dict, out: str, command: str = "") -> None:
    """Writes {"measures": doc's third paragraph, "command", "cases", "device", "jax"} as
    JSON to `out` (nothing when empty): the record of a standalone benchmark module."""
    res = {"measures": doc.split("\n\n")[2].replace("\n", " "), "command": command}
    res.update(cases=cases, device=jax.devices()[0].device_kind, jax=jax.__version__)
    if out:
        with open(out, "w") as f:
            json.dump(res, f, indent=1)


def main_writing_cases(doc: str, run: Callable[[], dict]) -> None:
    """The absl entry point of a standalone benchmark module: `--out`, then
    `write_cases(doc, run(), --out, the command)`. The flag is defined here, when the
    module runs as __main__, so modules that import one another never define it twice,
    and made a key flag of that module so that its --help lists it.

    These modules time device kernels (a profiler trace's GPU busy time): without a
    GPU, an --out that cannot be written, or positional arguments, the run is refused
    in one line (exit 2) before any work.
    """
    out = flags.DEFINE_string("out", "", "JSON output path (default: print only).")
    # absl files __main__'s flags under sys.argv[0]; --help lists that module's key flags.
    flags.FLAGS.register_key_flag_for_module(sys.argv[0], flags.FLAGS[out.name])

    def main(argv):
        if not entry_points.start_cli(argv):
            return entry_points.EXIT_REFUSED
        try:
            entry_points.check_output_file("out", out.value)
            if jax.default_backend() != "gpu":
                raise ValueError("times the GPU's kernels (busy time, launches) and needs a GPU")
        except (FileNotFoundError, ValueError) as e:
            logging.error("refused: %s", e)
            return entry_points.EXIT_REFUSED
        spec = getattr(sys.modules["__main__"], "__spec__", None)  # run with -m
        module = spec.name if spec else sys.argv[0]
        write_cases(doc, run(), out.value, entry_points.command_line(module))
        return 0

    app.run(main)
