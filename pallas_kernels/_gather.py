"""Launch parameters shared by the row-gather kernels (TwELL T2D and the training
row / CSC kernels): one frozen dataclass per kernel, one validation rule."""

from __future__ import annotations

import dataclasses

from pallas_kernels import _triton


@dataclasses.dataclass(frozen=True)
class RowLaunch:
    """Launch of one row-gather kernel.

    group: entries (weight rows) gathered per loop step, a power of two: several
      independent row gathers in flight per program hide L2 latency.
    num_warps: Triton warps per program, a power of two.
    block_h: width of one gathered piece of a weight row, a power of two (fitted to
      the largest power of two dividing H by `fit`). Kernels that split H run one
      program per block.
    """

    group: int
    num_warps: int
    block_h: int

    def unsupported(self, name: str) -> str | None:
        """Why this launch is invalid (naming the field as `name.field`), or None."""
        for field in ("group", "num_warps", "block_h"):
            v = getattr(self, field)
            if not _triton.is_pow2(v):
                return f"{name}.{field}={v} must be a power of two"
        return None

    def fit(self, h: int) -> RowLaunch:
        """The same launch with block_h shrunk to the largest power of two <= block_h
        that divides H, and num_warps shrunk by the same factor (at least 1): each
        thread keeps the elements per load it was tuned for. Four warps over a 256-wide
        block at H = 768 made the dx SpMM 4x slower than one warp
        (docs/performance_notes.md, "Training row kernels")."""
        block_h = fit_block(self.block_h, h)
        num_warps = max(1, self.num_warps * block_h // self.block_h)
        return dataclasses.replace(self, block_h=block_h, num_warps=num_warps)


def fit_block(block: int, dim: int) -> int:
    """The largest power of two <= block that divides dim (1 when dim is odd)."""
    while block > 1 and dim % block:
        block //= 2
    return block
