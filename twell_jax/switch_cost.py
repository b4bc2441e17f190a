"""The per-layer switch's rule from measured costs (docs/design.md §7.1).

A layer with ffn_impl="sparse" runs the sparse training op while its l0 is below its
cutoff and its heavy rows fit the op's dense tail (`sparsity.sparse_wins`). Where
sparse beats dense depends on the layer's shape (at H = 768, N = 2048 the crossover
is near l0 27, at H = 2048, N = 5632 near 68 on an H200) and on the activation
pattern: hot neurons make the sparse step cheaper (they take a dense block), and heavy
rows past the tail's capacity make the op fall back to dense. So the rule is
measured, not guessed: for the run's per-device FFN shape, the FFN forward and
backward of both branches of the model's switch are timed on synthetic gates of each
calibration pattern (`CALIBRATION`) over a grid of l0 values. The uniform pattern's
crossover (log-linear interpolation between grid points) is the base cutoff, and the
skewed patterns' crossovers give how far a layer's hot-neuron share moves it
(`fit_rule`, `sparsity.l0_cutoff`). The measurement runs once per (device, shape,
config) and is kept in the workdir (`FILE_NAME`), so a resumed run takes the same
decisions.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from twell_jax import ffn, sparsity, synthetic
from twell_jax.config import SparsityConfig, TrainConfig

FILE_NAME = "switch_cost.json"
L0_GRID = (2.0, 4.0, 8.0, 16.0, 32.0, 48.0, 64.0, 96.0)
# The calibration patterns, name -> (pattern, sigma): skew sigma = 1 is what trained
# checkpoints show (docs/results.md, "Activation patterns"), heavy_rows sigma = 0.35 a
# p99 of ~13x l0. Two skews, because the cutoff's shift is not linear in the hot share:
# at the 2B shape sigma = 0.5 (hot share ~0.7 at its crossover) moves it by ~2, sigma =
# 1 (~0.88) by ~16, and one knot per skew keeps a layer between them near its own
# crossover (docs/performance_notes.md, "Per-layer switch").
CALIBRATION = {
    "uniform": ("uniform", 1.0),
    "skew": ("skew", 1.0),
    "skew:0.5": ("skew", 0.5),
    "heavy_rows": ("heavy_rows", 0.35),
}
# The knots of a share that moves no cutoff.
_NO_SHIFT = (0.0, 0.0)
# Untimed calls of each branch before each run of timed ones.
_WARMUP = 3
# l0 values, evenly spaced in log l0, at which `max_regret_between` judges the rule.
_BETWEEN_POINTS = 256


@dataclasses.dataclass(frozen=True)
class LayerShape:
    """What the cost of one layer's FFN depends on: tokens per device and call (M),
    d_model (H), d_ff (N) and the sparse op's ELL width."""

    m: int
    h: int
    n: int
    ell_width: int

    def key(self) -> str:
        return f"{jax.devices()[0].device_kind}|{self.m}x{self.h}x{self.n}|W{self.ell_width}"


def monotone(ratios) -> list[float]:
    """`ratios` (ascending l0) made non-decreasing: adjacent points that fall pooled into
    their geometric mean (pool-adjacent-violators in log ratio, equal weights).

    For one activation pattern the sparse op's work grows with l0 and the dense
    branch's does not, so a ratio below an earlier one is timing noise. Unpooled, one
    disturbed point above 1 ended the crossover search at it: on an H100 a uniform
    125M point at l0 16 read 1.01 between 0.77 and 0.84, which put the cutoff at 15.8
    where the neighbours cross near 38 (docs/results.md, "Where the switch puts a
    layer").
    """
    blocks: list[list[float]] = []  # [sum of log ratios, points]
    for r in ratios:
        blocks.append([math.log(r), 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [math.exp(total / count) for total, count in blocks for _ in range(int(count))]


def crossover(l0_grid, ratios) -> float:
    """The l0 below which sparse wins: where `ratios` (sparse / dense time, one per grid
    point, ascending l0), made non-decreasing (`monotone`), cross 1, interpolated
    linearly in (log l0, log ratio).

    0 when sparse loses already at the first grid point, the last grid point when it
    wins everywhere on the grid (no claim beyond what was measured).
    """
    ratios = monotone(ratios)
    if ratios[0] >= 1.0:
        return 0.0
    for i in range(1, len(ratios)):
        if ratios[i] >= 1.0:
            lo, hi = math.log(l0_grid[i - 1]), math.log(l0_grid[i])
            a, b = math.log(ratios[i - 1]), math.log(ratios[i])
            return math.exp(lo + (hi - lo) * (0.0 - a) / (b - a))
    return float(l0_grid[-1])


def _call_times_ms(fn, args, reps: int) -> list[float]:
    """ms of each of `reps` synchronised calls of fn(*args), after `_WARMUP` calls."""
    for _ in range(_WARMUP):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - start) * 1e3)
    return times


def _step_fn(ffn):
    """jit of x, weights, upstream gradient -> d(<out, g> + l1) / d(x, weights)."""

    def loss(x, w, g):
        out, stats = ffn(x, w)
        return jnp.sum(out.astype(jnp.float32) * g.astype(jnp.float32)) + stats["l1"]

    return jax.jit(jax.grad(loss, argnums=(0, 1)))


def _sparse_stats_fn(ell_width: int):
    """jit of x, weights -> the sparse branch's (hot_share, tail_load)."""

    def shares(x, w):
        stats = ffn.sparse(x, w, ell_width)[1]
        return stats["hot_share"], stats["tail_load"]

    return jax.jit(shares)


def _time_pattern(shape, grid, pattern, sigma, fns, reps) -> dict:
    """One pattern over the l0 grid: l0, both branches' ms, their ratio and the layer's
    hot share and tail load at each point."""
    dense, sparse, shares = fns
    rec = {"sigma": sigma, "l0": [], "dense_ms": [], "sparse_ms": [], "ratio": [],
           "hot_share": [], "tail_load": []}  # fmt: skip
    for i, target in enumerate(grid):
        x, wg, wu, wd = synthetic.synthetic_mlp(
            shape.m, shape.h, shape.n, target, seed=i, pattern=pattern, sigma=sigma
        )
        w = {"w_gate": wg, "w_up": wu, "w_down": wd}
        g = jax.random.normal(jax.random.key(i), x.shape, x.dtype)
        d_ms, s_ms = [], []
        half = max(1, reps // 2)  # at least one call per half (reps=1 times two)
        for _ in range(2):  # dense, sparse, dense, sparse
            d_ms += _call_times_ms(dense, (x, w, g), half)
            s_ms += _call_times_ms(sparse, (x, w, g), half)
        hot, tail = shares(x, w)
        rec["l0"].append(float(jnp.mean(jnp.sum(jnp.einsum("mh,nh->mn", x, wg) > 0, axis=1))))
        rec["dense_ms"].append(statistics.median(d_ms))
        rec["sparse_ms"].append(statistics.median(s_ms))
        rec["ratio"].append(rec["sparse_ms"][-1] / rec["dense_ms"][-1])
        rec["hot_share"].append(float(hot))
        rec["tail_load"].append(float(tail))
    return rec


def measure(
    shape: LayerShape,
    l0_grid=L0_GRID,
    reps: int = 10,
    holdout: dict[str, tuple[str, float]] | None = None,
) -> dict:
    """Times both branches of the switch at `shape` on every `CALIBRATION` pattern and
    grid point, and fits the switch's rule to them (`fit_rule`).

    Dense and sparse alternate within each case (the same power state for both) and
    each time is the median of `reps` synchronised calls (at least two: one per half).
    `holdout` ({name: (pattern, sigma)}) adds patterns that are timed and judged but not
    fitted to.

    Returns:
      {"shape", "device", "l0_grid", "patterns": {name: {"sigma", "l0", "dense_ms",
      "sparse_ms", "ratio", "hot_share", "tail_load"}}, `fit_rule`'s keys,
      "max_regret" and "max_regret_between" of the rule on the fitted patterns, and with
      holdout "holdout" (the same per pattern) and "holdout_max_regret_between"}.
    """
    sparse = _step_fn(lambda x, w: ffn.sparse(x, w, shape.ell_width))
    dense = _step_fn(lambda x, w: ffn.dense_counted(x, w, shape.ell_width))
    fns = (dense, sparse, _sparse_stats_fn(shape.ell_width))
    grid = [g for g in l0_grid if g < shape.n / 4]
    per_pattern = {
        name: _time_pattern(shape, grid, p, sigma, fns, reps)
        for name, (p, sigma) in CALIBRATION.items()
    }
    rule = fit_rule(per_pattern, grid)
    sp = rule_config(rule)
    result = {
        "shape": dataclasses.asdict(shape),
        "device": jax.devices()[0].device_kind,
        "l0_grid": grid,
        "patterns": per_pattern,
        **rule,
        "max_regret": max_regret(per_pattern, sp),
        "max_regret_between": max_regret_between(per_pattern, sp),
    }
    if holdout:
        held = {
            name: _time_pattern(shape, grid, p, sigma, fns, reps)
            for name, (p, sigma) in holdout.items()
        }
        result["holdout"] = held
        result["holdout_max_regret_between"] = max_regret_between(held, sp)
    return result


def _stat_at(rec: dict, key: str, l0):
    """rec[key] interpolated at `l0` (a float or an array), linearly in log l0 (held
    flat past the ends)."""
    log_l0 = np.log(rec["l0"])
    order = np.argsort(log_l0)
    at = np.log(np.maximum(l0, 1e-6))
    return np.interp(at, log_l0[order], np.asarray(rec[key])[order])


def fit_rule(per_pattern: dict, grid) -> dict:
    """The switch's rule from the measured patterns (docs/design.md §7.1).

    The uniform pattern's crossover is the base cutoff. Hot neurons move a layer's
    crossover, by an amount that is not linear in the hot share, so the shift is
    piecewise linear through one knot per pattern: the uniform pattern's share at the
    base (shift 0), and each skewed pattern's share at its own crossover with that
    crossover's distance from the base (`sparsity.l0_cutoff`). A pattern whose share
    there does not exceed the uniform one's adds no knot, nor does one that ties an
    earlier knot's share. Heavy rows need no
    fitting: the rule's tail guard (`sparsity.sparse_wins`) is where the sparse op
    falls back, and below it heavy rows are not dearer than uniform ones
    (docs/results.md, "Activation patterns").

    Returns:
      {"cutoff", "hot_shift": flat knots [share, shift, ...] (`SparsityConfig`),
      "cutoffs": each pattern's own crossover}.
    """
    cutoffs = {p: crossover(grid, r["ratio"]) for p, r in per_pattern.items()}
    base = cutoffs["uniform"]
    uniform = per_pattern["uniform"]
    if "hot_share" not in uniform:
        return {"cutoff": base, "hot_shift": list(_NO_SHIFT), "cutoffs": cutoffs}
    low = max(float(_stat_at(uniform, "hot_share", base)), 0.0)
    knots = [(low, 0.0)]
    for name, rec in per_pattern.items():
        if name == "uniform" or "hot_share" not in rec:
            continue
        share = min(float(_stat_at(rec, "hot_share", cutoffs[name])), 1.0)
        if share > low:  # heavy rows (no hot neurons) and mild skews move nothing
            knots.append((share, cutoffs[name] - base))
    kept = []
    for share, shift in sorted(knots):
        if not kept or share > kept[-1][0]:
            kept.append((share, shift))
    return {"cutoff": base, "hot_shift": [v for k in kept for v in k], "cutoffs": cutoffs}


def rule_config(rule: dict) -> SparsityConfig:
    """A SparsityConfig deciding as `rule` (`fit_rule`'s keys; without "hot_shift", as
    in older records, a plain l0 cutoff; an older 3-value hot_shift (low, high, shift)
    is read as `SparsityConfig` reads it)."""
    hot_shift = tuple(rule.get("hot_shift", _NO_SHIFT))
    return SparsityConfig(sparse_l0_cutoff=rule["cutoff"], sparse_hot_shift=hot_shift)


def _sparse_chosen(rec: dict, l0_values, sp: SparsityConfig) -> np.ndarray:
    """bool [len(l0_values)]: where the rule runs the sparse kernels on a pattern whose
    statistics vary with l0 as measured in `rec` (none recorded: 0)."""
    l0_values = np.asarray(l0_values)
    stats = [
        _stat_at(rec, key, l0_values) if key in rec else np.zeros(l0_values.shape)
        for key in ("hot_share", "tail_load")
    ]
    return np.asarray(sparsity.sparse_wins(l0_values, *stats, sp))


def max_regret(per_pattern: dict, sp: SparsityConfig) -> float:
    """How much slower than the faster branch the switch runs at worst, over the
    measured patterns and l0 values (0.05: 5% slower), with `sp`'s rule deciding
    (`rule_config`)."""
    worst = 0.0
    for rec in per_pattern.values():
        chosen_sparse = _sparse_chosen(rec, rec["l0"], sp)
        points = zip(chosen_sparse, rec["dense_ms"], rec["sparse_ms"], strict=True)
        for use_sparse, d, s in points:
            chosen = s if use_sparse else d
            worst = max(worst, chosen / min(d, s) - 1.0)
    return worst


def _ratio_between(rec: dict, fine) -> np.ndarray:
    """rec's sparse / dense ratio at the log-l0 values `fine`, interpolated linearly in
    (log l0, log ratio) within each regime of the sparse op: its heavy rows fit the
    dense tail (tail load <= 1) or it falls back. The fallback is a branch, a step in
    cost, so the ratio is not interpolated across it (each regime's end value is held
    up to the step, at the tail load's interpolated crossing of 1)."""
    log_l0, log_ratio = np.log(rec["l0"]), np.log(rec["ratio"])
    load = np.asarray(rec.get("tail_load", np.zeros(len(log_l0))))
    order = np.argsort(log_l0)
    fine_fits = np.interp(fine, log_l0[order], load[order]) <= 1.0
    out = np.interp(fine, log_l0[order], log_ratio[order])
    for fine_mask, point_mask in ((fine_fits, load <= 1.0), (~fine_fits, load > 1.0)):
        idx = np.flatnonzero(point_mask)
        if fine_mask.any() and idx.size:
            idx = idx[np.argsort(log_l0[idx])]
            out[fine_mask] = np.interp(fine[fine_mask], log_l0[idx], log_ratio[idx])
    return np.exp(out)


def max_regret_between(per_pattern: dict, sp: SparsityConfig) -> float:
    """`max_regret` between the measured points too: each pattern's sparse / dense ratio
    and its statistics interpolated linearly in log l0 (the ratio in log, as `crossover`
    does, within each regime of the dense tail: `_ratio_between`), and evaluated at
    `_BETWEEN_POINTS` l0 values spaced evenly in log l0 over the measured range. A
    pattern whose own crossover lies away from the cutoff the rule gives it is decided
    wrongly between the two, which the measured points alone do not see."""
    worst = 0.0
    for rec in per_pattern.values():
        log_l0 = np.log(rec["l0"])
        fine = np.linspace(log_l0.min(), log_l0.max(), _BETWEEN_POINTS)
        ratio = _ratio_between(rec, fine)
        sparse_chosen = _sparse_chosen(rec, np.exp(fine), sp)
        slower = np.where(sparse_chosen, ratio, 1.0 / ratio)
        worst = max(worst, float(np.max(slower)) - 1.0)
    return max(worst, 0.0)


def layer_shape(cfg: TrainConfig, tokens_per_device: int) -> LayerShape:
    """The FFN call of one layer in this run: its M is the tokens of one micro-batch on
    one device (the op runs per batch shard)."""
    m = cfg.model
    return LayerShape(tokens_per_device, m.d_model, m.d_ff, m.sparse_ell_width)


def resolve_cutoff(
    cfg: TrainConfig,
    workdir: str | None,
    tokens_per_device: int,
    *,
    can_measure: bool | None = None,
    measure_fn=measure,
) -> TrainConfig:
    """`cfg` with the sparse_l0_cutoff the switch will use.

    With sparsity.sparse_switch="cost", ffn_impl="sparse" and a GPU: the measured
    crossover for this run's layer shape, read from `workdir/switch_cost.json` when it
    holds one for this device and shape, else measured (seconds) and written there.
    Otherwise the configured sparse_l0_cutoff is kept (there are no kernels to time).
    `can_measure` (default: the backend is a GPU) and `measure_fn` are for tests.
    """
    sp = cfg.sparsity
    if sp.sparse_switch != "cost" or cfg.model.ffn_impl != "sparse":
        return cfg
    if not (jax.default_backend() == "gpu" if can_measure is None else can_measure):
        logging.info(
            "per-layer switch: no GPU to measure costs on; sparse below l0 %g (sparse_l0_cutoff)",
            sp.sparse_l0_cutoff,
        )
        return cfg
    shape = layer_shape(cfg, tokens_per_device)
    path = os.path.join(workdir, FILE_NAME) if workdir else None
    saved = {}
    if path and os.path.exists(path):
        with open(path) as f:
            saved = json.load(f)
    record = saved.get(shape.key())
    if record is None:
        record = measure_fn(shape)
        saved[shape.key()] = record
        if path:
            tmp = path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(saved, f, indent=1)
            os.replace(tmp, path)
    rule = rule_config(record)  # older records have no shifts: a plain l0 cutoff
    cutoff = rule.sparse_l0_cutoff
    between = record.get("max_regret_between")  # absent from older records
    knots = rule.sparse_hot_shift
    pairs = zip(knots[0::2], knots[1::2], strict=True)
    shifts = ", ".join(f"{d:+.1f} at {h:.2f}" for h, d in pairs)
    logging.info(
        "per-layer switch: sparse below l0 %.1f at M=%d H=%d N=%d, moved by the hot-neuron "
        "share (%s), while the heavy rows fit the dense tail (worst case %.1f%% slower "
        "than the faster branch on the measured patterns, %s between the measured "
        "points%s)",
        cutoff, shape.m, shape.h, shape.n, shifts, 100 * record["max_regret"],
        "?" if between is None else f"{100 * between:.1f}%", f"; {path}" if path else "",
    )  # fmt: skip
    fitted = {"sparse_l0_cutoff": cutoff, "sparse_hot_shift": rule.sparse_hot_shift}
    return dataclasses.replace(cfg, sparsity=dataclasses.replace(sp, **fitted))
