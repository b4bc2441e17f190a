"""The per-layer switch's cutoff from measured costs (docs/design.md §7.1).

A layer with ffn_impl="sparse" runs the sparse training op while its l0 is below a
cutoff. Where sparse beats dense depends on the layer's shape (at H = 768, N = 2048
the sparse step is slower than dense above l0 of a few, at H = 2048, N = 5632 it wins
up to l0 of about 70) and on the activation pattern (hot neurons, heavy rows). So the
cutoff is measured, not guessed: for the run's per-device FFN shape, the FFN forward
and backward of both branches of the model's switch are timed on synthetic gates of
each pattern of `synthetic.PATTERNS` over a grid of l0 values, and the cutoff is the
l0 at which the geometric mean over patterns of sparse / dense time crosses 1
(log-linear interpolation between grid points). The measurement runs once per
(device, shape, config) and is kept in the workdir (`FILE_NAME`), so a resumed run
takes the same decisions.
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

from twell_jax import ffn, synthetic
from twell_jax.config import TrainConfig

FILE_NAME = "switch_cost.json"
L0_GRID = (2.0, 4.0, 8.0, 16.0, 32.0, 48.0, 64.0, 96.0)
# Pattern strengths of the calibration: skew sigma = 1 is what trained checkpoints show
# (docs/results.md, "Activation patterns"), heavy_rows sigma = 0.35 a p99 of ~13x l0.
_SIGMA = {"uniform": 1.0, "skew": 1.0, "heavy_rows": 0.35}


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


def crossover(l0_grid, ratios) -> float:
    """The l0 below which sparse wins: where `ratios` (sparse / dense time, one per grid
    point, ascending l0) crosses 1, interpolated linearly in (log l0, log ratio).

    0 when sparse loses already at the first grid point, the last grid point when it
    wins everywhere on the grid (no claim beyond what was measured).
    """
    if ratios[0] >= 1.0:
        return 0.0
    for i in range(1, len(ratios)):
        if ratios[i] >= 1.0:
            lo, hi = math.log(l0_grid[i - 1]), math.log(l0_grid[i])
            a, b = math.log(ratios[i - 1]), math.log(ratios[i])
            return math.exp(lo + (hi - lo) * (0.0 - a) / (b - a))
    return float(l0_grid[-1])


def _call_times_ms(fn, args, warmup: int, reps: int) -> list[float]:
    """ms of each of `reps` synchronised calls of fn(*args), after `warmup` calls."""
    for _ in range(warmup):
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


def measure(shape: LayerShape, l0_grid=L0_GRID, reps: int = 10, warmup: int = 3) -> dict:
    """Times both branches of the switch at `shape` on every pattern and grid point.

    Dense and sparse alternate within each case (the same power state for both) and
    each time is the median of `reps` synchronised calls.

    Returns:
      {"shape", "device", "l0_grid", "patterns": {pattern: {"l0", "dense_ms",
      "sparse_ms", "ratio"}}, "ratio_geomean", "cutoff", "cutoffs" (per pattern),
      "max_regret" (`max_regret` at the cutoff), "max_regret_between"
      (`max_regret_between` at the cutoff)}.
    """
    sparse = _step_fn(lambda x, w: ffn.sparse(x, w, shape.ell_width))
    dense = _step_fn(ffn.dense_counted)
    grid = [g for g in l0_grid if g < shape.n / 4]
    per_pattern = {}
    for pattern in synthetic.PATTERNS:
        rec = {"l0": [], "dense_ms": [], "sparse_ms": [], "ratio": []}
        for i, target in enumerate(grid):
            x, wg, wu, wd = synthetic.synthetic_mlp(
                shape.m, shape.h, shape.n, target, seed=i, pattern=pattern, sigma=_SIGMA[pattern]
            )
            w = {"w_gate": wg, "w_up": wu, "w_down": wd}
            g = jax.random.normal(jax.random.key(i), x.shape, x.dtype)
            d_ms, s_ms = [], []
            for _ in range(2):  # dense, sparse, dense, sparse
                d_ms += _call_times_ms(dense, (x, w, g), warmup, reps // 2)
                s_ms += _call_times_ms(sparse, (x, w, g), warmup, reps // 2)
            l0 = float(jnp.mean(jnp.sum(jnp.einsum("mh,nh->mn", x, wg) > 0, axis=1)))
            rec["l0"].append(l0)
            rec["dense_ms"].append(statistics.median(d_ms))
            rec["sparse_ms"].append(statistics.median(s_ms))
            rec["ratio"].append(rec["sparse_ms"][-1] / rec["dense_ms"][-1])
        per_pattern[pattern] = rec
    geomean = [
        float(np.exp(np.mean([np.log(per_pattern[p]["ratio"][i]) for p in per_pattern])))
        for i in range(len(grid))
    ]
    cutoff = crossover(grid, geomean)
    return {
        "shape": dataclasses.asdict(shape),
        "device": jax.devices()[0].device_kind,
        "l0_grid": grid,
        "patterns": per_pattern,
        "ratio_geomean": geomean,
        "cutoff": cutoff,
        "cutoffs": {p: crossover(grid, r["ratio"]) for p, r in per_pattern.items()},
        "max_regret": max_regret(per_pattern, cutoff),
        "max_regret_between": max_regret_between(per_pattern, cutoff),
    }


def max_regret(per_pattern: dict, cutoff: float) -> float:
    """How much slower than the faster branch the switch runs at worst, over the
    measured patterns and l0 values (0.05: 5% slower), with `cutoff` deciding."""
    worst = 0.0
    for rec in per_pattern.values():
        for l0, d, s in zip(rec["l0"], rec["dense_ms"], rec["sparse_ms"], strict=True):
            chosen = s if l0 < cutoff else d
            worst = max(worst, chosen / min(d, s) - 1.0)
    return worst


def max_regret_between(per_pattern: dict, cutoff: float, points: int = 256) -> float:
    """`max_regret` between the measured points too: each pattern's sparse / dense ratio
    interpolated linearly in (log l0, log ratio), as `crossover` does, and evaluated at
    `points` l0 values spaced evenly in log l0 over the measured range. A pattern whose
    own crossover lies away from `cutoff` is decided wrongly between the two, and its
    worst case is at the cutoff, which the measured points alone do not see."""
    worst = 0.0
    for rec in per_pattern.values():
        log_l0 = np.log(rec["l0"])
        order = np.argsort(log_l0)
        fine = np.linspace(log_l0.min(), log_l0.max(), points)
        ratio = np.exp(np.interp(fine, log_l0[order], np.log(rec["ratio"])[order]))
        sparse_chosen = fine < math.log(cutoff) if cutoff > 0 else np.zeros(points, bool)
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
    cutoff = record["cutoff"]
    between = record.get("max_regret_between")  # absent from older records
    logging.info(
        "per-layer switch: sparse below l0 %.1f at M=%d H=%d N=%d (worst case %.1f%% "
        "slower than the faster branch on the measured patterns, %s between the measured "
        "points%s)",
        cutoff, shape.m, shape.h, shape.n, 100 * record["max_regret"],
        "?" if between is None else f"{100 * between:.1f}%", f"; {path}" if path else "",
    )  # fmt: skip
    return dataclasses.replace(cfg, sparsity=dataclasses.replace(sp, sparse_l0_cutoff=cutoff))
