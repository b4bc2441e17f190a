"""Sparse vs dense gated-MLP training step (value_and_grad, L1 term in both).

`run()` builds synthetic sparse gates (a bias-like column x[:, 0] = 1 with
Wg[:, 0] = -thr picks ~nnz positives per row), times jax.value_and_grad with respect
to x and the three weights of the sparse op and of the dense XLA reference in the
same process (warm-up, median over samples of back-to-back calls,
`jax.block_until_ready`), adds a per-kernel breakdown, and reports memory: the
compiled executables' sizes (`memory_analysis`, independent of call order) and the
growth of the device's `peak_bytes_in_use` across each path's first call (0 when an
earlier path already reached a higher peak).

    python -m experiments.benchmark_train --nnz 10,29,50,100
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from experiments import bench_util as bu
from pallas_kernels._gather import RowLaunch
from pallas_kernels.reference import gated_hidden
from pallas_kernels.sparse_train import (
    SparseTrainConfig,
    compaction,
    csc,
    hot,
    resolve_config,
    row_kernels,
    sparse_gated_mlp_train,
)
from pallas_kernels.sparse_train import format as fmt
from pallas_kernels.sparse_train.compaction import CompactLaunch
from pallas_kernels.sparse_train.config import LAUNCH_FIELDS, ROW_FIELDS
from twell_jax.synthetic import gate_pattern

L1_COEF = 2e-5


def synthetic_inputs(
    seed: int,
    m: int,
    h: int,
    n: int,
    nnz: float,
    heavy_rows: int = 0,
    pattern: str = "uniform",
    sigma: float = 1.0,
):
    """bf16 (x, w_gate, w_up, w_down, g) with ~nnz positive gate entries per row.

    `pattern` / `sigma`: the activation pattern (`twell_jax.synthetic.gate_pattern`).
    `heavy_rows` rows drop the bias (about N/2 positives each) to exercise the tail.
    """
    k = jax.random.split(jax.random.key(seed), 5)
    thr, scale = gate_pattern(pattern, m, n, nnz, sigma, seed)
    x = jax.random.normal(k[0], (m, h), jnp.bfloat16)
    if pattern == "heavy_rows":
        x = (x.astype(jnp.float32) * jnp.asarray(scale)[:, None]).astype(jnp.bfloat16)
    x = x.at[:, 0].set(1.0)
    if heavy_rows:
        x = x.at[:heavy_rows, 0].set(0.0)
    wg = (jax.random.normal(k[1], (n, h)) / np.sqrt(h - 1)).at[:, 0].set(-jnp.asarray(thr))
    wu = 0.02 * jax.random.normal(k[2], (n, h))
    wd = 0.02 * jax.random.normal(k[3], (n, h))
    g = jax.random.normal(k[4], (m, h), jnp.bfloat16)
    bf = lambda a: a.astype(jnp.bfloat16)
    return x, bf(wg), bf(wu), bf(wd), g


def _dense_loss(x, wg, wu, wd, g):
    # The reference's bf16-output GEMMs: the fast dense XLA path (fp32 outputs would
    # make the backward run fp32 GEMMs).
    hid = gated_hidden(x, wg, wu)
    out = jnp.einsum("mn,nh->mh", hid, wd)
    l1 = jnp.mean(jnp.sum(jnp.abs(hid.astype(jnp.float32)), axis=-1))
    return jnp.sum(out.astype(jnp.float32) * g.astype(jnp.float32)) + L1_COEF * l1


def _sparse_loss(x, wg, wu, wd, g, *, config):
    out, stats = sparse_gated_mlp_train(x, wg, wu, wd, config=config)
    loss = jnp.sum(out.astype(jnp.float32) * g.astype(jnp.float32)) + L1_COEF * stats["l1"]
    return loss, stats


def _median_ms(fn, args, samples: int, inner: int = 5, warmup: int = 3) -> float:
    """Median over `samples` of (time of `inner` back-to-back calls) / inner, in ms."""
    return bu.time_fn(fn, *args, warmup=warmup, reps=samples, inner=inner)["median_ms"]


def _peak_bytes() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def _memory(fn, args) -> dict:
    """Compiled sizes and the peak growth over the first call of `fn`."""
    out = bu.compiled_memory(fn.lower(*args))
    before = _peak_bytes()
    jax.block_until_ready(fn(*args))
    after = _peak_bytes()
    if before is not None and after is not None:
        out["peak_bytes_in_use"] = int(after)
        out["peak_growth_bytes"] = int(after - before)
    return out


def _breakdown(
    x, wg, wu, wd, g, config: SparseTrainConfig, samples: int, only: tuple[str, ...] = ()
) -> dict:
    """Milliseconds of each stage of the sparse step (or of `only`), jitted one at a time.

    A stage whose GPU work is shorter than one jitted call's dispatch reads as the
    dispatch time, and a stage jitted alone may run its `lax.switch` from the host (too
    few ops around it for a CUDA-graph conditional): small stages, such as `hot_grads`
    without hot neurons, are upper bounds. A profiler trace of the whole step
    (`bench_util.kernel_times`) is the finer measure."""
    config = resolve_config(x.shape[0], x.shape[1], wg.shape[0], config)
    kw = {k: dict(launch=getattr(config, k), impl=config.impl) for k in LAUNCH_FIELDS}
    width = config.ell_width
    gate = jax.jit(lambda x, w: jnp.einsum("mh,nh->mn", x, w, preferred_element_type=x.dtype))
    compact = jax.jit(
        functools.partial(
            compaction.compact_rows, width=width, launch=config.compact, impl=config.impl
        )
    )
    p = gate(x, wg)
    ell, *_ = compact(p)
    cnt = fmt.ell_counts(ell.counts, width)
    sddmm_up = jax.jit(functools.partial(row_kernels.sddmm_up, **kw["sddmm_up"]))
    r, t, _ = sddmm_up(x, wu, cnt, ell.cols, ell.vals)
    spmm_down = jax.jit(
        lambda t, w, c, cols: row_kernels.spmm_rows(((t, w),), c, cols, **kw["spmm_down"])
    )
    scale = jnp.asarray([L1_COEF / x.shape[0]], jnp.float32)
    sddmm_grad = jax.jit(functools.partial(row_kernels.sddmm_grad, **kw["sddmm_grad"]))
    dr, du, t, _ = sddmm_grad(g, wd, cnt, ell.cols, ell.vals, r, scale)
    spmm_dx = jax.jit(
        lambda a, b, w1, w2, c, cols: row_kernels.spmm_rows(
            ((a, w1), (b, w2)), c, cols, **kw["spmm_dx"]
        )
    )

    def index(c, cols, col_counts, dr, du, t):
        exclude = hot.config_plan(col_counts, config).is_hot()
        index = fmt.build_csc(c, cols, col_counts, exclude=exclude)
        return index.offsets, index.order, *csc.csc_entries(index, width, dr, du, t)

    def hot_grads(c, cols, col_counts, dr, du, t, x, g, dws):
        # dws: the CSC SpMM's outputs, passed in as in the step (zeros made here would
        # time three [N, H] memsets the step does not run).
        plan = hot.config_plan(col_counts, config)
        return hot.switch_hot_grads(plan, config.hot_capacities, c, cols, dr, du, t, x, g, dws)

    index = jax.jit(index)
    offsets, *entries = index(cnt, ell.cols, ell.col_counts, dr, du, t)
    spmm_csc = jax.jit(functools.partial(csc.spmm_csc, **kw["spmm_csc"]))
    stages = {
        "gate_gemm": (gate, (x, wg)),
        "compact": (compact, (p,)),
        "sddmm_up": (sddmm_up, (x, wu, cnt, ell.cols, ell.vals)),
        "spmm_down": (spmm_down, (t, wd, cnt, ell.cols)),
        "sddmm_grad": (sddmm_grad, (g, wd, cnt, ell.cols, ell.vals, r, scale)),
        "spmm_dx": (spmm_dx, (dr, du, wu, wg, cnt, ell.cols)),
        "csc_index": (index, (cnt, ell.cols, ell.col_counts, dr, du, t)),
        "spmm_csc": (spmm_csc, (offsets, *entries, x, g)),
        "hot_grads": (
            jax.jit(hot_grads),
            (cnt, ell.cols, ell.col_counts, dr, du, t, x, g, spmm_csc(offsets, *entries, x, g)),
        ),
    }
    return {k: _median_ms(f, a, samples) for k, (f, a) in stages.items() if not only or k in only}


def tune(
    M: int = 16384,
    H: int = 2048,
    N: int = 5632,
    nnz: float = 29,
    samples: int = 10,
    row_options=(
        RowLaunch(group=4, num_warps=4, block_h=2048),
        RowLaunch(group=2, num_warps=4, block_h=2048),
        RowLaunch(group=2, num_warps=2, block_h=2048),
        RowLaunch(group=4, num_warps=2, block_h=2048),
        RowLaunch(group=1, num_warps=4, block_h=2048),
        RowLaunch(group=2, num_warps=4, block_h=1024),
        RowLaunch(group=2, num_warps=1, block_h=1024),
        RowLaunch(group=4, num_warps=1, block_h=1024),
        RowLaunch(group=4, num_warps=1, block_h=512),
        RowLaunch(group=1, num_warps=1, block_h=1024),
    ),
    csc_options=(
        RowLaunch(group=4, num_warps=2, block_h=512),
        RowLaunch(group=8, num_warps=2, block_h=512),
        RowLaunch(group=4, num_warps=1, block_h=256),
        RowLaunch(group=8, num_warps=4, block_h=512),
        RowLaunch(group=4, num_warps=4, block_h=1024),
        RowLaunch(group=2, num_warps=4, block_h=1024),
        RowLaunch(group=4, num_warps=4, block_h=2048),
        RowLaunch(group=2, num_warps=4, block_h=2048),
        RowLaunch(group=4, num_warps=8, block_h=1024),
        RowLaunch(group=4, num_warps=2, block_h=1024),
        RowLaunch(group=1, num_warps=4, block_h=1024),
        RowLaunch(group=2, num_warps=4, block_h=512),
        RowLaunch(group=4, num_warps=4, block_h=512),
    ),
    compact_options=(
        CompactLaunch(),
        CompactLaunch(block_m=16, ahead=3),
        CompactLaunch(block_m=16, num_warps=4),
        CompactLaunch(block_m=8, num_warps=1, ahead=3),
        CompactLaunch(block_m=32, num_warps=4),
        CompactLaunch(group=16),
    ),
) -> list[dict]:
    """Times the kernels over launch options; one JSON-able dict per option.

    Args:
        row_options: RowLaunch options, each given to the four row kernels at once
            (`config.ROW_FIELDS`).
        csc_options: RowLaunch options of the transposed SpMM (`spmm_csc`).
        compact_options: CompactLaunch options of the compaction.

    Each record holds the option's fields under "launch" (and the config fields it
    set under "fields") and the milliseconds of the stages it affects.
    """
    args = synthetic_inputs(0, M, H, N, nnz)
    base = SparseTrainConfig()

    def sweep(fields, options, only):
        """One dict per option: its launch and the ms of the `only` stages."""
        rows = []
        for launch in options:
            cfg = dataclasses.replace(base, **dict.fromkeys(fields, launch))
            times = _breakdown(*args, config=cfg, samples=samples, only=only)
            rows.append({"fields": list(fields), "launch": dataclasses.asdict(launch), **times})
        return rows

    return [
        *sweep(("compact",), compact_options, ("compact",)),
        *sweep(ROW_FIELDS, row_options, ROW_FIELDS),
        *sweep(("spmm_csc",), csc_options, ("spmm_csc",)),
    ]


def _steps(config: SparseTrainConfig) -> dict:
    """The jitted steps one record times: value_and_grad and forward, sparse and dense."""
    argnums = (0, 1, 2, 3)
    sparse = functools.partial(_sparse_loss, config=config)
    return {
        "dense": jax.jit(jax.value_and_grad(_dense_loss, argnums=argnums)),
        "sparse": jax.jit(jax.value_and_grad(sparse, argnums=argnums, has_aux=True)),
        "sparse_fwd": jax.jit(lambda *a: sparse(*a)[0]),
        "dense_fwd": jax.jit(_dense_loss),
    }


def _measure(
    args, steps: dict, config: SparseTrainConfig, reps: int, breakdown: bool, steps_b=None
) -> dict:
    """One record: statistics, gradient errors, memory and medians of `steps` on args.

    With `steps_b` (`_steps` of another config) its sparse step joins the value_and_grad
    rotation, and "compare" holds its median time, speedup, hot neurons and its
    per-round time over the first config's ("sparse_b/sparse")."""
    sparse, dense = steps["sparse"], steps["dense"]
    rec = {"sparse_memory": _memory(sparse, args), "dense_memory": _memory(dense, args)}
    (loss_s, stats), grads_s = sparse(*args)
    loss_d, grads_d = dense(*args)
    rec.update(
        l0=float(stats["l0"]),
        l1=float(stats["l1"]),
        max_row_count=int(stats["max_row_count"]),
        tail_rows=int(stats["tail_rows"]),
        tail_capacity=int(stats["tail_capacity"]),
        dense_fallback=int(stats["dense_fallback"]),
        hot_neurons=int(stats["hot_neurons"]),
        alive_fraction=float(jnp.mean(stats["fired"])),
        sparse_loss=float(loss_s),
        dense_loss=float(loss_d),
        grad_rel_err={
            name: float(
                jnp.linalg.norm((a.astype(jnp.float32) - b.astype(jnp.float32)).ravel())
                / jnp.linalg.norm(b.astype(jnp.float32).ravel())
            )
            for name, a, b in zip(("dx", "dWg", "dWu", "dWd"), grads_s, grads_d, strict=True)
        },
    )
    for suffix in ("", "_fwd"):
        fns = {"sparse": steps["sparse" + suffix], "dense": steps["dense" + suffix]}
        if steps_b is not None and not suffix:
            fns = {"sparse_b": steps_b["sparse"], **fns}
        t = bu.time_interleaved(fns, *args, warmup=3, reps=reps, inner=5)
        rec[f"sparse{suffix}_ms"] = t["sparse"]["median_ms"]
        rec[f"dense{suffix}_ms"] = t["dense"]["median_ms"]
        if "sparse_b" in fns:
            rec["compare"] = {
                "sparse_ms": t["sparse_b"]["median_ms"],
                "speedup": t["dense"]["median_ms"] / t["sparse_b"]["median_ms"],
                "hot_neurons": int(steps_b["sparse"](*args)[0][1]["hot_neurons"]),
                "sparse_b/sparse": t["ratios"]["sparse_b/sparse"],
            }
    rec["speedup"] = rec["dense_ms"] / rec["sparse_ms"]
    if breakdown:
        parts = _breakdown(*args, config=config, samples=max(reps // 2, 3))
        rec["breakdown_ms"] = parts
        # The rest of the step is XLA glue, conditionals and launch gaps.
        rec["breakdown_sum_ms"] = sum(parts.values())
    return rec


def run(
    M: int = 16384,
    H: int = 2048,
    N: int = 5632,
    nnz_targets=(10, 29, 50, 100),
    reps: int = 20,
    heavy_rows: int = 0,
    config: SparseTrainConfig | None = None,
    breakdown: bool = True,
    pattern: str = "uniform",
    sigma: float = 1.0,
    compare: SparseTrainConfig | None = None,
) -> list[dict]:
    """Times sparse vs dense value_and_grad; one JSON-able dict per nnz target.

    Args:
        M, H, N: tokens, d_model, d_ff.
        nnz_targets: target positive gate entries per row.
        reps: timing samples (each the mean of 5 back-to-back calls); medians reported.
        heavy_rows: rows forced to ~N/2 positives (exercise the dense tail / fallback).
        config: SparseTrainConfig (default: the production one, Pallas kernels).
        breakdown: also time each stage separately.
        pattern, sigma: activation pattern of the synthetic gates (`gate_pattern`).
        compare: another config whose sparse step joins the rotation ("compare").
    """
    config = config or SparseTrainConfig()
    steps = _steps(config)
    steps_b = _steps(compare) if compare is not None else None
    records = []
    for i, nnz in enumerate(nnz_targets):
        args = synthetic_inputs(i, M, H, N, nnz, heavy_rows, pattern, sigma)
        rec = {"M": M, "H": H, "N": N, "nnz_target": nnz, "heavy_rows": heavy_rows}
        rec.update(pattern=pattern, sigma=sigma)
        rec.update(_measure(args, steps, config, reps, breakdown, steps_b))
        records.append(rec)
        del args
    return records


def run_captured(
    workdir: str,
    data_dir: str,
    layers=(0,),
    M: int = 16384,
    reps: int = 20,
    config: SparseTrainConfig | None = None,
    compare: SparseTrainConfig | None = None,
) -> list[dict]:
    """The op on the FFN inputs and weights of a trained checkpoint, with a control.

    For each layer of `layers`: x = that layer's FFN input on the first M validation
    tokens of `data_dir`, the checkpoint's bf16 weights and a random upstream
    gradient; then the same shapes with uniform synthetic gates at the measured l0
    (pattern "uniform"). `vs_uniform` is the captured sparse time over the control's:
    the median per-round ratio with the two alternating in one rotation. With
    `compare`, the op under that config joins the rotation on both inputs, and
    `compare` holds its ratios: `vs_uniform`, and `captured` / `control`, its time over
    `config`'s on each input (per-round medians; the controls read how far identical
    work drifts).
    """
    from flax import nnx

    from experiments.benchmark_model import trained_params  # grain: only for this mode
    from twell_jax import input_pipeline, neuron_profile, train

    config = config or SparseTrainConfig()
    steps = _steps(config)
    steps_b = _steps(compare) if compare is not None else None
    cfg, params, step = trained_params(workdir)
    seq = cfg.model.seq_len
    data_cfg = input_pipeline.DataConfig(
        data_dir, seq_len=seq, batch_size=-(-M // seq), seed=cfg.seed
    )
    tokens = jnp.asarray(next(input_pipeline.make_val_iterator(data_cfg, 1))["inputs"])
    if tokens.size < M:
        raise ValueError(f"{data_dir}: {tokens.size} validation tokens, fewer than M={M}")
    model = nnx.merge(train.model_graphdef(cfg.model), params)
    ffn_in = model.ffn_inputs(tokens)[:, :M].astype(jnp.bfloat16)
    ffn = params["blocks"]["ffn"]
    records = []
    for layer in layers:
        w = tuple(ffn[k][layer].astype(jnp.bfloat16) for k in ("w_gate", "w_up", "w_down"))
        x = ffn_in[layer]
        g = jax.random.normal(jax.random.key(layer), x.shape, jnp.bfloat16)
        counts = neuron_profile.gate_positives(x[None], w[0][None])
        shape = neuron_profile.profile(*counts)[0]
        rec = {"workdir": workdir, "step": step, "layer": layer, "M": M}
        rec.update(H=x.shape[1], N=w[0].shape[0], pattern="captured", profile=shape)
        rec.update(_measure((x, *w, g), steps, config, reps, breakdown=False))
        control = synthetic_inputs(layer, M, x.shape[1], w[0].shape[0], max(rec["l0"], 0.5))
        rec["uniform_control"] = _measure(control, steps, config, reps, breakdown=False)
        # The ratio from its own rotation: captured and control alternate call by call.
        # (`time_interleaved` gives a/b for a listed before b: the compared ones first.)
        pair = {}
        if steps_b is not None:
            pair["captured_b"] = functools.partial(steps_b["sparse"], x, *w, g)
            pair["control_b"] = functools.partial(steps_b["sparse"], *control)
        pair["captured"] = functools.partial(steps["sparse"], x, *w, g)
        pair["control"] = functools.partial(steps["sparse"], *control)
        t = bu.time_interleaved(pair, warmup=3, reps=2 * reps, inner=5)
        ratios = t["ratios"]
        rec["vs_uniform"] = ratios["captured/control"]
        if steps_b is not None:
            rec["compare"] = {
                "vs_uniform": ratios["captured_b/control_b"],
                "captured": ratios["captured_b/captured"],
                "control": ratios["control_b/control"],
            }
        records.append(rec)
        print(json.dumps({k: v for k, v in rec.items() if not isinstance(v, dict)}), flush=True)
    return records


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, default=16384)
    parser.add_argument("--nnz", default="10,29,50,100")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--heavy_rows", type=int, default=0)
    parser.add_argument("--tune", action="store_true", help="sweep the kernels' launch options")
    a = parser.parse_args()
    if a.tune:
        for rec in tune(M=a.m):
            print(json.dumps(rec))
        return
    nnz = tuple(float(v) for v in a.nnz.split(","))
    for rec in run(M=a.m, nnz_targets=nnz, reps=a.reps, heavy_rows=a.heavy_rows):
        print(json.dumps(rec))


if __name__ == "__main__":
    main()
