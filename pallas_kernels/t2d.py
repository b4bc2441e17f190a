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

The entry loop is scalar (count-bounded `fori_loop`): at about 1.3 entries per
tile, vectorising over the W slots wastes most of the work (spec §6.2).
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
    """Launch parameters of the T2D kernels (one program per row)."""

    num_warps: int = 1
    num_stages: int = 1


def h_chunk(h: int) -> int:
    """Largest power of two dividing H, capped at MAX_CHUNK: loads come in 2^k pieces."""
    return min(h & -h, MAX_CHUNK)


def t2d_supported(h: int, n: int, compression: int) -> str | None:
    """Why (H, N, C) cannot run, or None when it can."""
    try:
        fmt.check_format(n, compression)
    except ValueError as e:
        return str(e)
    if h % 64:
        return f"d_model H={h} must be a multiple of 64"
    return None


def _t2d_kernel(x_ref, packed_ref, *refs, gated, high_precision, slots, chunk):
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
    n_chunks = h // chunk
    cols = [pl.ds(c * chunk, chunk) for c in range(n_chunks)]
    x = [x_ref[0, col].astype(jnp.float32) for col in cols]

    def dot_x(w_ref, j):
        return sum(jnp.sum(x[c] * w_ref[j, col].astype(jnp.float32)) for c, col in enumerate(cols))

    def round_bf16(v):
        return v if high_precision else v.astype(jnp.bfloat16).astype(jnp.float32)

    def add_row(acc, hj, j):
        return tuple(
            a + hj * wd_ref[j, col].astype(jnp.float32) for a, col in zip(acc, cols, strict=True)
        )

    def hidden(g, j):
        """h_j from the gate value g (bf16-exact, fp32) of neuron j."""
        if not gated:
            return g
        return round_bf16(g * round_bf16(dot_x(wu_ref, j)))

    def packed_entry(e, carry):
        acc, base = carry
        word = packed_ref[0, base + e]
        j = (word & 0xFFFF).astype(jnp.int32)
        g = lax.bitcast_convert_type((word >> 16).astype(jnp.uint16), jnp.bfloat16)
        return add_row(acc, hidden(g.astype(jnp.float32), j), j), base

    def dense_column(j, acc):
        # Overflowed tile: recompute relu(x . W[j]) for every column of the tile.
        g = jnp.maximum(dot_x(wg_ref if gated else wu_ref, j), 0.0)
        g = g.astype(jnp.bfloat16).astype(jnp.float32)
        return add_row(acc, hidden(g, j), j)

    def tile_step(t, acc):
        base = t * slots
        count = packed_ref[0, base].astype(jnp.int32)

        def sparse(acc):
            return lax.fori_loop(1, count + 1, packed_entry, (acc, base))[0]

        def dense(acc):
            first = t * fmt.TILE
            return lax.fori_loop(first, first + fmt.TILE, dense_column, acc)

        return lax.cond(count < slots, sparse, dense, acc)

    zeros = tuple(jnp.zeros((chunk,), jnp.float32) for _ in cols)
    acc = lax.fori_loop(0, packed_ref.shape[1] // slots, tile_step, zeros)
    for a, col in zip(acc, cols, strict=True):
        out_ref[0, col] = a.astype(out_ref.dtype)


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
    reason = t2d_supported(h, n, compression)
    if reason:
        raise ValueError(f"t2d: {reason}")
    gated = len(weights) == 3
    kernel = functools.partial(
        _t2d_kernel, gated=gated, high_precision=high_precision,
        slots=fmt.slots_per_tile(compression), chunk=h_chunk(h),
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
