"""Launch parameters of the TwELL inference kernels (the ops' `d2t_config` and
`t2d_config`).

The row-gather kernels (SDDMM, SpMM) take the `RowLaunch` they share with the training
kernels; the pack kernel has a launch of its own. All are frozen dataclasses: they are
static arguments of the ops.
"""

from __future__ import annotations

import dataclasses

from pallas_kernels._gather import RowLaunch


@dataclasses.dataclass(frozen=True)
class PackConfig:
    """Launch parameters of the pack kernel (the D2T stage after XLA's gate GEMM).

    block_m rows x one 256-column tile per block; `steps` blocks one after the other
    per program, with the loads of the next `ahead` blocks in flight while one is
    packed (steps must be a multiple of ahead + 1: the loop is unrolled that much).
    The tile is read as [block_m, 256 / group, group / 2] bf16 pairs (uint32; group a
    power of two in 2..16), each thread holding whole groups. The defaults are the
    fastest launch measured (docs/performance_notes.md, "Pack").
    """

    block_m: int = 1
    num_warps: int = 1
    group: int = 8
    steps: int = 16
    ahead: int = 3


@dataclasses.dataclass(frozen=True)
class T2DConfig:
    """Launches of the TwELL SDDMM (gated only) and SpMM kernels of the T2D stage, and
    which rows they leave to the dense tail.

    Each `RowLaunch` gives the entries gathered per step, the warps per program and
    the H block (fitted to H); num_stages is Triton's pipelining depth. The defaults
    are the fastest launches measured (docs/performance_notes.md, "T2D SDDMM and
    SpMM"). Long rows: one with more than max(tail_row_min_entries, tail_row_factor
    x 2^k x the call's mean l0) entries goes to the dense tail with the heavy rows,
    at the lowest k (0..3) at which they fit it (`heavy_rows.tail_rows`);
    tail_row_factor 0 leaves every row that did not overflow to the kernels.
    """

    sddmm: RowLaunch = RowLaunch(group=2, num_warps=1, block_h=1024)
    spmm: RowLaunch = RowLaunch(group=4, num_warps=1, block_h=1024)
    num_stages: int = 1
    tail_row_factor: float = 2.0
    tail_row_min_entries: int = 64
