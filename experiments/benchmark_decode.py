"""Decode-size gated MLPs: dense XLA against `sparse_decode_mlp` and `twell_gated_mlp`.

    python -m experiments.benchmark --mode=decode --out=results/decode_h200.json

`run` times the three on M tokens per call (decode: M = 1-64; M = 512 shows where the
decode op falls back to dense), with synthetic gates at ~nnz positives per row
(`twell_jax.synthetic.synthetic_mlp`, pattern uniform or skew), all in rotation in one
process (`bench_util.time_interleaved`, docs/design.md §8).

Each call runs `layers` MLPs with their own weights on the same x, as a decode step
runs one MLP per layer: one weight set would stay in the GPU's L2 (50 MB on an H200)
on the sparse path, whose step reads ~25 MB at the 2B shape, and not on the dense one
(69 MB), which would flatter the sparse op. Times are per layer (the call's time
over `layers`); `*_tokens_per_s` is M over that time, one MLP layer's throughput.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from experiments import bench_util as bu
from pallas_kernels import reference
from pallas_kernels.decode import DecodeConfig, sparse_decode_mlp
from pallas_kernels.twell import twell_gated_mlp, twell_supported
from twell_jax.synthetic import synthetic_mlp


def _layer_stack(op, layers: int):
    """jit of x, L-tuples of [N, H] weights -> `op`'s outputs stacked over L: `op` once
    per layer's weights, unrolled (one dispatch per call, as in a model's step).

    Each weight is its own argument buffer, as in a serving step's unrolled layers: a
    slice of a stacked [L, N, H] array would be copied out for the Pallas kernels
    (a custom call needs its operands whole) and not for XLA's GEMMs."""

    def stack(x, wg, wu, wd):
        outs = [op(x, wg[i], wu[i], wd[i]) for i in range(layers)]
        return jax.tree.map(lambda *a: jnp.stack(a), *outs)

    return jax.jit(stack)


def _inputs(m: int, h: int, n: int, nnz: float, pattern: str, sigma: float, layers: int):
    """x [M, H] (layer 0's) and the weights of `layers` synthetic MLPs, L-tuples of [N, H]."""
    mlps = [
        synthetic_mlp(m, h, n, nnz, seed=seed, pattern=pattern, sigma=sigma)
        for seed in range(layers)
    ]
    return mlps[0][0], *(tuple(mlp[i] for mlp in mlps) for i in (1, 2, 3))


def case(
    m: int,
    h: int,
    n: int,
    nnz: float,
    reps: int,
    pattern: str,
    *,
    sigma: float = 1.0,
    layers: int = 8,
    compression: int = 8,
    config: DecodeConfig = DecodeConfig(),
    max_tokens: int = 64,
    warmup: int = 3,
    inner: int = 3,
    kernel_trace: bool = False,
) -> dict:
    """One M: ms, tokens/s and ratios of each path, the decode op's stats, the errors;
    with kernel_trace also each path's device kernels per layer (`bu.kernel_times`) and
    its GPU busy time against the span of one call (`bu.call_timeline`)."""
    x, wg, wu, wd = _inputs(m, h, n, nnz, pattern, sigma, layers)
    opts = {"config": config, "max_tokens": max_tokens}
    fns = {
        "dense": _layer_stack(reference.gated_mlp, layers),
        "sparse": _layer_stack(lambda *a: sparse_decode_mlp(*a, **opts), layers),
    }
    twell_reason = twell_supported(h, n, compression)
    if twell_reason is None:
        fns["twell"] = _layer_stack(lambda *a: twell_gated_mlp(*a, compression=compression), layers)
    stats = _layer_stack(lambda *a: sparse_decode_mlp(*a, **opts, return_stats=True)[1], layers)(
        x, wg, wu, wd
    )
    outs = {name: fn(x, wg, wu, wd) for name, fn in fns.items()}
    timing = bu.time_interleaved(fns, x, wg, wu, wd, warmup=warmup, reps=reps, inner=inner)

    itemsize = jnp.dtype(x.dtype).itemsize
    active = [int(k) for k in stats.active_neurons]
    bytes_per_layer = {
        "dense": 3 * n * h * itemsize,
        # W_gate, then each active row of W_up and W_down once.
        "sparse": (n + 2 * sum(active) / layers) * h * itemsize,
    }
    rec = {
        "M": m,
        "H": h,
        "N": n,
        "pattern": pattern,
        "pattern_sigma": sigma,
        "target_nnz": nnz,
        "layers": layers,
        "compression": compression,
        "decode_config": dataclasses.asdict(config),
        "max_tokens": max_tokens,
        "reps": reps,
        "inner": inner,
        "l0_per_layer": [float(v) for v in stats.l0],
        "active_neurons_per_layer": active,
        "dense_fallback_layers": int(jnp.sum(stats.dense_fallback)),
        "twell_unsupported": twell_reason,
    }
    for name in fns:
        ms = timing[name]["median_ms"] / layers
        rec[f"{name}_ms"] = ms
        rec[f"{name}_p10_p90_ms"] = [timing[name][k] / layers for k in ("p10_ms", "p90_ms")]
        rec[f"{name}_tokens_per_s"] = m / (ms * 1e-3)
        if name != "dense":
            rec.update({f"{name}_{k}": v for k, v in bu.errors(outs[name], outs["dense"]).items()})
    for name, nbytes in bytes_per_layer.items():
        rec[f"{name}_bytes_per_layer"] = nbytes
        rec[f"{name}_gb_per_s"] = nbytes / (rec[f"{name}_ms"] * 1e-3) / 1e9
    if kernel_trace:  # per layer: each kernel's launches and mean µs; the GPU's busy time
        rec["kernels_per_layer"], rec["timeline_per_layer"] = {}, {}
        for name, fn in fns.items():
            rec["kernels_per_layer"][name] = {
                k: {"per_layer": v["per_call"] / layers, "mean_us": v["mean_us"]}
                for k, v in bu.kernel_times(fn, x, wg, wu, wd).items()
            }
            line = bu.call_timeline(fn, x, wg, wu, wd)
            rec["timeline_per_layer"][name] = {
                k: line[k] / layers for k in ("kernels", "busy_us", "span_us")
            }
    rec["ratios"] = timing["ratios"]  # median over rounds of time(a) / time(b)
    rec["speedup_sparse"] = rec["dense_ms"] / rec["sparse_ms"]
    if "twell" in fns:
        rec["speedup_twell"] = rec["dense_ms"] / rec["twell_ms"]
    return rec


def run(
    M_list: Sequence[int],
    H: int,
    N: int,
    nnz: float,
    reps: int,
    pattern: str,
    **kwargs,
) -> list[dict]:
    """One `case` record per M (JSON-able), each printed as it completes.

    Args:
      M_list: tokens per call, e.g. (1, 8, 64, 512).
      H, N: d_model and d_ff.
      nnz: target positive gate entries per token.
      reps: timed rounds.
      pattern: "uniform", "skew" or "heavy_rows" (`twell_jax.synthetic.gate_pattern`).
      kwargs: `case`'s keywords (sigma, layers, compression, config, max_tokens,
        warmup, inner, kernel_trace).
    """
    records = []
    for m in M_list:
        records.append(case(m, H, N, nnz, reps, pattern, **kwargs))
        print(json.dumps(records[-1]), flush=True)
    return records
