"""T2D and GatedT2D: the down projection (and the fused up projection) from TwELL.

One program per token row. The row's x stays in registers; for every TwELL entry j
the program gathers the contiguous rows Wu[j] and Wd[j] (4 KB each at H = 2048, L2
hits for the most part), so h_j never leaves registers:

    gated:     u_j = x . Wu[j]        h_j = bf16(g_j * bf16(u_j))     out += h_j Wd[j]
    non-gated: h_j = g_j (the packed value is already relu(x Wu^T))   out += h_j Wd[j]

Rounding follows the dense bf16 XLA MLP (u and h rounded to bf16, fp32 dots and
accumulation) so the two agree to bf16 summation-order noise; `high_precision`
keeps u and h in fp32. A tile whose count overflowed its W - 1 slots is recomputed
from x and the dense weight rows of that tile (gate GEMV, ReLU, up, down), so the
result stays exact whatever the density; the caller counts those tiles.

The row's entries are first flattened across tiles (counts -> prefix sums), then
gathered `group` at a time: vectorising over a tile's W slots instead wastes most of
the work at about 1.3 entries per tile (spec §6.2), while a scalar entry loop keeps
too few gathers in flight.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _triton as tr
from pallas_kernels import twell_format as fmt

MAX_CHUNK = 2048


@dataclasses.dataclass(frozen=True)
class T2DConfig:
    """Launch parameters of the T2D kernels (one program per row).

    group: entries gathered per loop step (a power of two). Several independent 4 KB
    row gathers in flight per program hide L2 latency; entries are flattened across
    tiles first, so a group is never wasted on a tile's empty slots.
    """

    group: int = 4
    num_warps: int = 4
    num_stages: int = 1
    # Weight rows are re-read by every token, activations once: ask L2 to keep the
    # weights (evict_last) and to drop the streamed rows first.
    cache_hints: bool = True


def h_chunk(h: int) -> int:
    """Largest power of two dividing H, capped at MAX_CHUNK: loads come in 2^k pieces."""
    return min(h & -h, MAX_CHUNK)


def t2d_supported(h: int, n: int, compression: int, cfg: T2DConfig) -> str | None:
    """Why (H, N, C) cannot run, or None when it can."""
    try:
        fmt.check_format(n, compression)
    except ValueError as e:
        return str(e)
    if h % 64:
        return f"d_model H={h} must be a multiple of 64"
    if cfg.group < 1 or cfg.group & (cfg.group - 1):
        return f"group={cfg.group} must be a power of two"
    return None


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _t2d_kernel(x_ref, packed_ref, *refs, gated, high_precision, slots, chunk, group, hints):
    """One token row.

    x_ref [1, H] bf16; packed_ref [1, N/C] uint32; weights [N, H] bf16 (gated: w_gate,
    w_up, w_down; else w_up, w_down); out_ref [1, H] in x's dtype.
    """
    if gated:
        wg_ref, wu_ref, wd_ref, out_ref = refs
    else:
        wg_ref = None
        wu_ref, wd_ref, out_ref = refs
    h = x_ref.shape[1]
    n_tiles = packed_ref.shape[1] // slots
    cols = [pl.ds(c * chunk, chunk) for c in range(h // chunk)]
    keep, stream = ("evict_last", "evict_first") if hints else (None, None)
    row = jnp.int32(0)  # an array index: the interpreter's load rejects a Python int here
    x = [tr.load(x_ref.at[row, col], eviction_policy=stream).astype(jnp.float32) for col in cols]
    # Gathers index with arrays on both axes: the interpreter cannot mix them with slices.
    col_ids = [c * chunk + jnp.arange(chunk, dtype=jnp.int32)[None, :] for c in range(len(cols))]

    def gather(w_ref, j, ok, c):
        """Rows j [G] of w_ref, columns of chunk c: [G, chunk] fp32 (zeros where not ok)."""
        rows = tr.load(
            w_ref.at[j[:, None], col_ids[c]], mask=ok[:, None], other=0.0, eviction_policy=keep
        )
        return rows.astype(jnp.float32)

    def round_bf16(v):
        return v if high_precision else v.astype(jnp.bfloat16).astype(jnp.float32)

    def hidden(g, j, ok):
        """h for gate values g [G] fp32 of neurons j [G]; ok masks the gathers."""
        if not gated:
            return g
        u = sum(jnp.sum(x[c][None, :] * gather(wu_ref, j, ok, c), axis=1) for c in range(len(x)))
        return round_bf16(g * round_bf16(u))

    def add_rows(acc, hj, j, ok):
        """acc += sum_i hj[i] * Wd[j[i]]."""
        return tuple(
            a + jnp.sum(hj[:, None] * gather(wd_ref, j, ok, c), axis=0) for c, a in enumerate(acc)
        )

    # Per-tile counts -> a flat list of the row's entries (tile-major, column order).
    tile_ids = jnp.arange(_next_pow2(n_tiles), dtype=jnp.int32)
    real_tile = tile_ids < n_tiles
    counts = tr.load(packed_ref.at[0, tile_ids * slots], mask=real_tile, other=0)
    counts = counts.astype(jnp.int32)
    overflow = counts >= slots
    listed = jnp.where(overflow, 0, counts)  # overflowed tiles are recomputed below
    ends = jnp.cumsum(listed)
    starts = ends - listed
    total = jnp.sum(listed)

    def entry_group(step, acc):
        e = step * group + jnp.arange(group, dtype=jnp.int32)
        ok = e < total
        tile = jnp.sum((ends[None, :] <= e[:, None]).astype(jnp.int32), axis=1)
        start = jnp.sum(jnp.where(tile_ids[None, :] == tile[:, None], starts[None, :], 0), axis=1)
        word = tr.load(packed_ref.at[0, tile * slots + (e - start) + 1], mask=ok, other=0)
        j = (word & 0xFFFF).astype(jnp.int32)
        g = lax.bitcast_convert_type((word >> 16).astype(jnp.uint16), jnp.bfloat16)
        return add_rows(acc, hidden(g.astype(jnp.float32), j, ok), j, ok)

    def dense_tile(t, acc):
        # Overflowed tile: recompute relu(x . W[j]) for its 256 columns, `group` at a time.
        def columns(step, acc):
            j = t * fmt.TILE + step * group + jnp.arange(group, dtype=jnp.int32)
            ok = jnp.ones((group,), jnp.bool_)
            w_ref = wg_ref if gated else wu_ref
            g = sum(jnp.sum(x[c][None, :] * gather(w_ref, j, ok, c), axis=1) for c in range(len(x)))
            g = jnp.maximum(g, 0.0).astype(jnp.bfloat16).astype(jnp.float32)
            return add_rows(acc, hidden(g, j, ok), j, ok)

        count = packed_ref[0, t * slots].astype(jnp.int32)
        return lax.cond(
            count >= slots,
            lambda acc: lax.fori_loop(0, fmt.TILE // group, columns, acc),
            lambda acc: acc,
            acc,
        )

    acc = tuple(jnp.zeros((chunk,), jnp.float32) for _ in cols)
    acc = lax.fori_loop(0, (total + group - 1) // group, entry_group, acc)
    acc = lax.cond(
        jnp.sum(overflow.astype(jnp.int32)) > 0,
        lambda acc: lax.fori_loop(0, n_tiles, dense_tile, acc),
        lambda acc: acc,
        acc,
    )
    for a, col in zip(acc, cols, strict=True):
        tr.store(out_ref.at[row, col], a.astype(out_ref.dtype), eviction_policy=stream)


def t2d(
    x: jax.Array,
    packed: jax.Array,
    weights: tuple[jax.Array, ...],
    *,
    compression: int = 8,
    high_precision: bool = False,
    cfg: T2DConfig = T2DConfig(),
    interpret: bool | None = None,
) -> jax.Array:
    """Down projection of a TwELL activation, gated or not.

    Args:
      x: [M, H] bf16 tokens (read for the up projection and for overflowed tiles).
      packed: [M, N / C] uint32 TwELL gate (gated) or hidden activation (non-gated).
      weights: (w_gate, w_up, w_down) for the gated MLP, (w_up, w_down) for the
        non-gated one; each [N, H] bf16, w_down being down_proj transposed.
      compression: C in {8, 4, 2} of `packed`.
      high_precision: keep u and h in fp32 instead of rounding them to bf16.
      cfg: launch parameters.
      interpret: run the Pallas interpreter (None: only when there is no GPU).

    Returns:
      [M, H] in x's dtype.
    """
    m, h = x.shape
    n = weights[-1].shape[0]
    reason = t2d_supported(h, n, compression, cfg)
    if reason:
        raise ValueError(f"t2d: {reason}")
    gated = len(weights) == 3
    kernel = functools.partial(
        _t2d_kernel,
        gated=gated,
        high_precision=high_precision,
        slots=fmt.slots_per_tile(compression),
        chunk=h_chunk(h),
        group=cfg.group,
        hints=cfg.cache_hints,
    )
    row = lambda i: (i, 0)
    whole = lambda i: (0, 0)
    return tr.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, h), x.dtype),
        grid=(m,),
        in_specs=[
            pl.BlockSpec((1, h), row),
            pl.BlockSpec((1, packed.shape[1]), row),
            *[pl.BlockSpec((n, h), whole) for _ in weights],
        ],
        out_specs=pl.BlockSpec((1, h), row),
        compiler_params=tr.compiler_params(cfg.num_warps, cfg.num_stages),
        interpret=tr.resolve_interpret(interpret),
        name=f"twell_{'gated_' if gated else ''}t2d_c{compression}",
    )(x, packed, *weights)
