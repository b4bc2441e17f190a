"""Baseline kernels the benchmarks compare against; no op runs them.

`d2t`: relu(x Wg^T) with the TwELL pack fused into the GEMM epilogue, the paper's D2T
design. The dense activation never reaches HBM. Each program computes one [BM, 256]
output tile (one TwELL tile of BM rows), so every (row, tile) is packed by exactly one
program and no atomics are needed. In-tile slot positions come from an inclusive
prefix sum done as a matmul with an upper-triangular ones matrix (exact in fp32),
because Triton's scan plus a scatter in the accumulator layout is slower. Entries land
in column order, so the output is deterministic and equals the two-pass D2T's words
(`pallas_kernels.twell.pack.gate_then_pack`) up to the GEMMs' summation order. The
inference ops use the two-pass form instead, which is faster on the H200
(docs/performance_notes.md, "Fused D2T baseline"; docs/design.md §4.1).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _triton as tr
from pallas_kernels.twell import format as fmt

_NT = (((1,), (1,)), ((), ()))  # contract the last dims: a [m, k] x b [n, k] -> [m, n]


@dataclasses.dataclass(frozen=True)
class D2TConfig:
    """Block sizes and launch parameters of the fused D2T kernel.

    block_m rows x 256 columns per program; block_k the K step; chunk the epilogue
    column width (256 / chunk accumulators, packed one after another).
    """

    block_m: int = 128
    block_k: int = 64
    chunk: int = 128
    num_warps: int = 8
    num_stages: int = 3


def d2t_supported(m: int, h: int, n: int, compression: int, cfg: D2TConfig) -> str | None:
    """Why (M, H, N, C) cannot run with `cfg`, or None when it can."""
    try:
        fmt.check_format(n, compression)
    except ValueError as e:
        return str(e)
    if m < 1:
        return f"M={m} tokens: need at least one"
    if h % cfg.block_k:
        return f"d_model H={h} must be a multiple of block_k={cfg.block_k}"
    if fmt.TILE % cfg.chunk or not tr.is_pow2(cfg.chunk):
        return f"chunk={cfg.chunk} must be a power of two dividing {fmt.TILE}"
    return None


def _d2t_kernel(x_ref, w_ref, o_ref, *, m, cfg: D2TConfig, slots):
    """x_ref [BM, H] bf16, w_ref [256, H] bf16 -> o_ref [BM, W] uint32 (one TwELL tile)."""
    tile = pl.program_id(0)
    row_block = pl.program_id(1)
    bm, bk, chunk = cfg.block_m, cfg.block_k, cfg.chunk
    n_chunks = fmt.TILE // chunk
    local_rows = jnp.arange(bm, dtype=jnp.int32)
    row_ok = row_block * bm + local_rows < m  # the last row block may overhang M

    def k_step(k, accs):
        xk = tr.load(x_ref.at[:, pl.ds(k * bk, bk)], mask=row_ok[:, None], other=0.0)
        return tuple(
            acc
            + lax.dot_general(
                xk,
                w_ref[pl.ds(c * chunk, chunk), pl.ds(k * bk, bk)],
                _NT,
                preferred_element_type=jnp.float32,
            )
            for c, acc in enumerate(accs)
        )

    zeros = jnp.zeros((bm, chunk), jnp.float32)
    accs = lax.fori_loop(0, x_ref.shape[1] // bk, k_step, (zeros,) * n_chunks)

    idx = jnp.arange(chunk, dtype=jnp.int32)
    upper_ones = (idx[:, None] <= idx[None, :]).astype(jnp.bfloat16)
    count = jnp.zeros((bm,), jnp.int32)
    for c, acc in enumerate(accs):
        positive = acc > 0
        prefix = jnp.dot(
            positive.astype(jnp.bfloat16), upper_ones, preferred_element_type=jnp.float32
        )
        slot = prefix.astype(jnp.int32) + count[:, None]  # 1-based: word 0 is the count
        columns = (tile * fmt.TILE + c * chunk + idx).astype(jnp.uint32)
        words = fmt.encode_words(acc, columns[None, :])
        keep = positive & (slot < slots) & row_ok[:, None]
        slot = jnp.where(keep, slot, fmt.OUT_OF_TILE_SLOT)  # the format module says why
        tr.store(o_ref.at[local_rows[:, None], slot], words, mask=keep)
        count = count + jnp.sum(positive.astype(jnp.int32), axis=1)
    tr.store(o_ref.at[:, pl.ds(0, 1)], count.astype(jnp.uint32)[:, None], mask=row_ok[:, None])


def d2t(
    x: jax.Array,
    w_gate: jax.Array,
    *,
    compression: int = 8,
    cfg: D2TConfig = D2TConfig(),
    interpret: bool | None = None,
) -> jax.Array:
    """relu(x Wg^T) packed as TwELL.

    Args:
      x: [M, H] bf16 tokens.
      w_gate: [N, H] bf16 gate weight.
      compression: C in {8, 4, 2}.
      cfg: block sizes.
      interpret: run the Pallas interpreter (None: only when there is no GPU).

    Returns:
      uint32 [M, N / C] TwELL words (docs/design.md §3); word 0 of a tile keeps the
      true count, also past capacity.
    """
    m, h = x.shape
    n = w_gate.shape[0]
    reason = d2t_supported(m, h, n, compression, cfg)
    if reason:
        raise ValueError(f"d2t: {reason}")
    slots = fmt.slots_per_tile(compression)
    kernel = functools.partial(_d2t_kernel, m=m, cfg=cfg, slots=slots)
    grid = (n // fmt.TILE, pl.cdiv(m, cfg.block_m))  # tiles vary fastest: Wg stays in L2
    return tr.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, fmt.packed_width(n, compression)), jnp.uint32),
        grid=grid,
        in_specs=[
            pl.BlockSpec((cfg.block_m, h), lambda t, i: (i, 0)),
            pl.BlockSpec((fmt.TILE, h), lambda t, i: (t, 0)),
        ],
        out_specs=pl.BlockSpec((cfg.block_m, slots), lambda t, i: (i, t)),
        compiler_params=tr.compiler_params(cfg.num_warps, cfg.num_stages),
        interpret=tr.resolve_interpret(interpret),
        name=f"twell_d2t_c{compression}",
    )(x, w_gate)
