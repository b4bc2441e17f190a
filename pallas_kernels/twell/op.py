"""Public TwELL inference ops: the sparse gated and non-gated MLP.

    out = twell_gated_mlp(x, w_gate, w_up, w_down)   # (relu(x Wg^T) * (x Wu^T)) Wd
    out = twell_mlp(x, w_up, w_down)                 # relu(x Wu^T) Wd

Backends (`impl`): "pallas" (D2T then (Gated)T2D, compiled for the GPU),
"interpret" (the same kernels in the Pallas interpreter, for CPU tests), "xla" (the
dense jnp computation with the same rounding and statistics, for CPU models) and
"auto" (pallas on a GPU, xla elsewhere).

D2T (docs/design.md §4.1): XLA's gate GEMM writes the bf16 activation, then the pack
kernel packs it and also writes the tile counts. (Gated)T2D (§4.2, §4.3): a TwELL
SDDMM (gated only) and an H-blocked TwELL SpMM.

Overflow policy (§4.4): a (row, tile) with more positives than its W - 1 slots keeps
its true count in the format. A row with such a tile is a heavy row: while a call's
heavy rows fit the largest of a few static capacities (`heavy_rows`: M/128 to M/8)
they are cleared from the packed gate and computed by the dense formula on their
gather; beyond that the SpMM sees the counts and recomputes each overflowed tile from x
and the dense weight rows. Either way the output is correct at any density.
`TwellStats.overflow_tiles` and `heavy_rows` say how much took those paths (ask with
return_stats=True).

Gradients: the ops are `custom_vjp`s whose backward is the dense MLP's, so they may
sit inside a differentiated model; training should use the hybrid sparse op instead.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels import _triton as tr
from pallas_kernels import reference as mlp_reference
from pallas_kernels.twell import format as fmt
from pallas_kernels.twell import heavy_rows, reference
from pallas_kernels.twell.config import PackConfig, T2DConfig
from pallas_kernels.twell.pack import pack_tiles
from pallas_kernels.twell.t2d import shape_unsupported, t2d

IMPLS = tr.IMPLS


class TwellStats(NamedTuple):
    """What one call saw: all scalars.

    nnz_per_row: fp32 mean number of positive gate entries per token (true count).
    max_tile_count: int32 largest count in any (row, tile).
    overflow_tiles: int32 number of (row, tile) pairs past capacity.
    heavy_rows: int32 rows with a tile past capacity: computed by the dense formula in
      a tail while they fit its largest bucket (`heavy_rows`), else recomputed tile by
      tile inside the SpMM.
    tail_rows: int32 rows the dense tail computed: the heavy rows and the long ones
      (`T2DConfig.tail_row_factor`); 0 when the heavy rows did not fit it.
    """

    nnz_per_row: jax.Array
    max_tile_count: jax.Array
    overflow_tiles: jax.Array
    heavy_rows: jax.Array
    tail_rows: jax.Array


@dataclasses.dataclass(frozen=True)
class TwellOptions:
    """Static choices of one op call (hashable: the custom_vjp's non-diff argument)."""

    gated: bool
    compression: int
    high_precision: bool
    impl: str
    d2t: PackConfig
    t2d: T2DConfig


def _check_inputs(x: jax.Array, weights: tuple[jax.Array, ...], opts: TwellOptions) -> None:
    names = ("w_gate", "w_up", "w_down") if opts.gated else ("w_up", "w_down")
    if opts.impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {opts.impl!r}")
    if x.ndim < 1:
        raise ValueError(f"x must be [..., H], got a scalar of shape {x.shape}")
    if x.dtype != jnp.bfloat16:
        raise ValueError(f"x must be bfloat16, got {x.dtype}")
    h = x.shape[-1]
    n = weights[0].shape[0] if weights[0].ndim == 2 else None
    for name, w in zip(names, weights, strict=True):
        if w.ndim != 2 or w.shape != (n, h):
            raise ValueError(
                f"{name} must be [N, H] = [{n}, {h}] like {names[0]} with H = x.shape[-1], "
                f"got {w.shape}"
            )
        if w.dtype != jnp.bfloat16:
            raise ValueError(f"{name} must be bfloat16, got {w.dtype}")
    reason = twell_supported(h, n, opts.compression)
    if reason:
        raise ValueError(reason)


def twell_supported(h: int, n: int, compression: int = 8) -> str | None:
    """Why the TwELL ops cannot run d_model H, d_ff N and compression C, or None."""
    return shape_unsupported(h, n, compression)


def _sparse_forward(x, weights, opts: TwellOptions):
    """Pallas path: out [M, H] and the pack's tile counts, int32 [N / 256, M]."""
    interpret = opts.impl == "interpret" or (opts.impl == "auto" and not tr.on_gpu())
    # The gate stays live until the dense tail, which reads its rows (a second gate
    # GEMM on the tail rows cost ~17 µs at M = 4096; docs/performance_notes.md).
    gate = mlp_reference.hidden(x, weights[0])
    packed, counts = pack_tiles(
        gate,
        compression=opts.compression,
        cfg=opts.d2t,
        interpret=interpret,
        with_counts=True,
    )
    with jax.named_scope("twell_heavy_rows"):
        slots = fmt.slots_per_tile(opts.compression)
        bucket, rows, caps = heavy_rows.plan(
            counts, slots, opts.t2d.tail_row_factor, opts.t2d.tail_row_min_entries
        )
        packed = heavy_rows.clear(packed, rows, slots)
    out = t2d(
        x,
        packed,
        weights,
        compression=opts.compression,
        high_precision=opts.high_precision,
        cfg=opts.t2d,
        interpret=interpret,
    )
    with jax.named_scope("twell_dense_tail"):
        out = heavy_rows.add_tail(
            out, x, gate, weights, bucket, rows, caps, high_precision=opts.high_precision
        )
    return out, counts


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _twell_apply(opts: TwellOptions, x, *weights):
    use_pallas = opts.impl in ("pallas", "interpret") or (opts.impl == "auto" and tr.on_gpu())
    if use_pallas:
        return _sparse_forward(x, weights, opts)
    return reference.dense_forward(x, weights, high_precision=opts.high_precision)


def _twell_apply_fwd(opts, x, *weights):
    return _twell_apply(opts, x, *weights), (x, weights)


def _twell_apply_bwd(opts, residuals, cotangents):
    x, weights = residuals
    _, vjp = jax.vjp(lambda *a: reference.dense_mlp(a[0], a[1:]), x, *weights)
    return vjp(cotangents[0])


_twell_apply.defvjp(_twell_apply_fwd, _twell_apply_bwd)


def _stats(counts: jax.Array, slots: int, cfg: T2DConfig) -> TwellStats:
    """TwellStats of the tile counts of M rows, int32 [N / 256, M]."""
    m = counts.shape[1]
    in_tail = jnp.sum(
        heavy_rows.tail_rows(counts, slots, cfg.tail_row_factor, cfg.tail_row_min_entries),
        dtype=jnp.int32,
    )
    return TwellStats(
        nnz_per_row=jnp.sum(counts, dtype=jnp.float32) / max(m, 1),
        max_tile_count=jnp.max(counts, initial=0),
        overflow_tiles=jnp.sum(counts >= slots, dtype=jnp.int32),
        heavy_rows=jnp.sum(heavy_rows.heavy(counts, slots), dtype=jnp.int32),
        tail_rows=jnp.where(in_tail <= max(heavy_rows.capacities(m)), in_tail, 0),
    )


def _run(x, weights, opts: TwellOptions, return_stats: bool):
    _check_inputs(x, weights, opts)
    lead, h = x.shape[:-1], x.shape[-1]
    x2d = x.reshape(-1, h)
    if x2d.shape[0] == 0:
        out = jnp.zeros_like(x)
        counts = jnp.zeros((weights[0].shape[0] // fmt.TILE, 0), jnp.int32)
    else:
        out, counts = _twell_apply(opts, x2d, *weights)
        out = out.reshape(*lead, h)
    if not return_stats:
        return out
    return out, _stats(counts, fmt.slots_per_tile(opts.compression), opts.t2d)


def twell_gated_mlp(
    x: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    *,
    compression: int = 8,
    high_precision: bool = False,
    return_stats: bool = False,
    impl: str = "auto",
    d2t_config: PackConfig = PackConfig(),
    t2d_config: T2DConfig = T2DConfig(),
):
    """The TwELL gated MLP: (relu(x Wg^T) * (x Wu^T)) Wd.

    Args:
      x: [..., H] bf16 tokens.
      w_gate: [N, H] bf16 (gate_proj.weight).
      w_up: [N, H] bf16 (up_proj.weight).
      w_down: [N, H] bf16 (down_proj.weight transposed).
      compression: TwELL compression C in {8, 4, 2}: W = 256 / C slots per tile.
      high_precision: keep the up product and h in fp32 (only the output is rounded).
      return_stats: also return a TwellStats.
      impl: "auto", "pallas", "interpret" or "xla" (module docstring).
      d2t_config: launch of the D2T stage's pack kernel (after XLA's gate GEMM).
      t2d_config: launches of the T2D stage's SDDMM and SpMM kernels.

    Returns:
      out [..., H] bf16, or (out, TwellStats) when return_stats.

    Raises:
      ValueError: on a wrong dtype or shape, N not a multiple of 256 or above 65536,
        H not a multiple of 64, or an unknown compression or impl.
    """
    opts = TwellOptions(True, compression, high_precision, impl, d2t_config, t2d_config)
    return _run(x, (w_gate, w_up, w_down), opts, return_stats)


def twell_mlp(
    x: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    *,
    compression: int = 8,
    return_stats: bool = False,
    impl: str = "auto",
    d2t_config: PackConfig = PackConfig(),
    t2d_config: T2DConfig = T2DConfig(),
):
    """The TwELL non-gated MLP: relu(x Wu^T) Wd.

    Args and returns as `twell_gated_mlp`, without w_gate and high_precision.
    """
    opts = TwellOptions(False, compression, False, impl, d2t_config, t2d_config)
    return _run(x, (w_up, w_down), opts, return_stats)
