"""TwELL pack of a dense activation that is already in HBM (the two-pass D2T).

`d2t` fuses the pack into the gate GEMM's epilogue, where Triton has to move the
scatter's operands out of the tensor-core accumulator layout. This kernel packs a
[M, N] activation that XLA's GEMM wrote instead: every program loads one [BM, 256]
tile in a plain blocked layout and writes its positive entries into that tile's W
words, by default one entry per row per round (`tile_select`; 1.07 ms at M=131072
and ~29 non-zeros per row on the H200, against 1.24-1.32 ms for the prefix count and
scatter that `method="cumsum"` keeps). Programs are independent (one per (row block,
tile)), so nothing serialises across N.

The extra traffic is one bf16 write and read of [M, N] (about 0.7 ms at M=131072,
N=5632 on an H200); what it buys is an XLA (cuBLAS) GEMM instead of a Pallas one
with a heavy epilogue. `experiments/benchmark.py --mode=kernel` times both paths.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _triton as tr
from pallas_kernels import reference
from pallas_kernels import tile_select as ts
from pallas_kernels import twell_format as fmt

METHODS = ("select", "cumsum", "matmul")


@dataclasses.dataclass(frozen=True)
class PackConfig:
    """Launch parameters of the pack kernel.

    block_m rows x one 256-column tile per program; method is how entries reach their
    words: "select" (`tile_select`: one row-wise min-reduction and one [block_m]
    store per entry of the fullest row), or a scatter of the whole tile at in-tile
    prefix counts taken by "cumsum" (a Triton scan) or "matmul" (against an
    upper-triangular ones matrix on the tensor cores).
    """

    block_m: int = 8  # H200, M=131072, N=5632, cumsum: 1.32 ms (16/4: 1.40, 32/8: 1.42-1.52)
    num_warps: int = 4
    method: str = "select"  # matmul: 3.4x slower than cumsum at 32/8


def _pack_kernel(h_ref, o_ref, *, m, block_m, slots, method):
    """h_ref [BM, 256] (bf16) -> o_ref [BM, W] uint32: one TwELL tile of BM rows."""
    tile = pl.program_id(0)
    rows = jnp.arange(block_m, dtype=jnp.int32)
    row_ok = pl.program_id(1) * block_m + rows < m  # the last row block may overhang M
    h = tr.load(h_ref, mask=row_ok[:, None], other=0)
    positive = h > 0
    lane = jnp.arange(fmt.TILE, dtype=jnp.int32)
    count = jnp.sum(positive.astype(jnp.int32), axis=1)
    if method == "select":
        _select_into_words(o_ref, h, positive, lane, count, tile, slots)
    else:
        _scatter_into_words(o_ref, h, positive, lane, tile, slots, method)
    tr.store(o_ref.at[:, pl.ds(0, 1)], count.astype(jnp.uint32)[:, None], mask=row_ok[:, None])


def _select_into_words(o_ref, h, positive, lane, count, tile, slots):
    """Entry j of every row goes to word j + 1, one round per entry (`tile_select`)."""
    keys = ts.entry_keys(h, positive, lane)

    def store_round(j, key):
        words = fmt.encode_words(ts.key_value(key, h, lane), tile * fmt.TILE + ts.key_lane(key))
        ok = key != ts.NO_ENTRY
        tr.store(o_ref.at[:, pl.ds(j + 1, 1)], words[:, None], mask=ok[:, None])

    ts.for_each_entry(keys, jnp.minimum(jnp.max(count), slots - 1), store_round)


def _scatter_into_words(o_ref, h, positive, lane, tile, slots, prefix):
    """Every positive element is scattered to word = its in-tile prefix count."""
    rows = jnp.arange(h.shape[0], dtype=jnp.int32)
    if prefix == "matmul":
        upper_ones = (lane[:, None] <= lane[None, :]).astype(jnp.bfloat16)
        inclusive = jnp.dot(
            positive.astype(jnp.bfloat16), upper_ones, preferred_element_type=jnp.float32
        ).astype(jnp.int32)
    else:
        inclusive = jnp.cumsum(positive.astype(jnp.int32), axis=1)
    keep = positive & (inclusive < slots)  # slot = inclusive: word 0 is the count
    slot = jnp.where(keep, inclusive, fmt.OUT_OF_TILE_SLOT)
    words = fmt.encode_words(h, tile * fmt.TILE + lane[None, :])
    tr.store(o_ref.at[rows[:, None], slot], words, mask=keep)


def pack_supported(m: int, n: int, compression: int, cfg: PackConfig) -> str | None:
    """Why an [M, N] activation cannot be packed with `cfg`, or None when it can."""
    try:
        fmt.check_format(n, compression)
    except ValueError as e:
        return str(e)
    if m < 1:
        return f"M={m} tokens: need at least one"
    if cfg.block_m < 1 or cfg.block_m & (cfg.block_m - 1):
        return f"block_m={cfg.block_m} must be a power of two"
    if cfg.method not in METHODS:
        return f"method={cfg.method!r} must be one of {METHODS}"
    return None


def pack_tiles(
    h: jax.Array,
    *,
    compression: int = 8,
    cfg: PackConfig = PackConfig(),
    interpret: bool | None = None,
) -> jax.Array:
    """Packs the positive entries of a dense activation as TwELL (like `twell_format.pack`).

    Args:
      h: [M, N] bf16 activation, or the gate pre-activation (only entries > 0 count).
      compression: C in {8, 4, 2}.
      cfg: launch parameters.
      interpret: run the Pallas interpreter (None: only when there is no GPU).

    Returns:
      uint32 [M, N / C] TwELL words; word 0 of a tile keeps the true count, also past
      capacity; words past the count are undefined.

    Raises:
      ValueError: h is not a 2-D bf16 array, or (M, N, C, cfg) is unsupported.
    """
    if h.ndim != 2 or h.dtype != jnp.bfloat16:
        raise ValueError(f"pack_tiles: h must be a 2-D bfloat16 [M, N], got {h.dtype}{h.shape}")
    m, n = h.shape
    reason = pack_supported(m, n, compression, cfg)
    if reason:
        raise ValueError(f"pack_tiles: {reason}")
    slots = fmt.slots_per_tile(compression)
    kernel = functools.partial(
        _pack_kernel, m=m, block_m=cfg.block_m, slots=slots, method=cfg.method
    )
    return tr.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, fmt.packed_width(n, compression)), jnp.uint32),
        grid=(n // fmt.TILE, pl.cdiv(m, cfg.block_m)),
        in_specs=[pl.BlockSpec((cfg.block_m, fmt.TILE), lambda t, i: (i, t))],
        out_specs=pl.BlockSpec((cfg.block_m, slots), lambda t, i: (i, t)),
        compiler_params=tr.compiler_params(cfg.num_warps, num_stages=1),
        interpret=tr.resolve_interpret(interpret),
        name=f"twell_pack_c{compression}",
    )(h)


def gate_then_pack(
    x: jax.Array,
    w_gate: jax.Array,
    *,
    compression: int = 8,
    cfg: PackConfig = PackConfig(),
    interpret: bool | None = None,
) -> jax.Array:
    """The two-pass D2T: XLA's bf16 gate GEMM x Wg^T, then `pack_tiles`.

    Args:
      x: [M, H] bf16; w_gate: [N, H] bf16.

    Returns:
      uint32 [M, N / C]: the words of `d2t` (up to the GEMMs' summation order).
    """
    return pack_tiles(
        reference.hidden(x, w_gate), compression=compression, cfg=cfg, interpret=interpret
    )
