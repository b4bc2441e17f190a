"""Static configuration of the sparse training op: ELL width, tail buckets, backend and
one launch per kernel."""

from __future__ import annotations

import dataclasses

from pallas_kernels import _triton
from pallas_kernels._gather import RowLaunch
from pallas_kernels.sparse_train.compaction import CompactLaunch

# The launch fields of the per-row kernels; each gathers `group` ELL slots of one row
# per loop step, so the ELL width must be a multiple of their groups.
ROW_FIELDS = ("sddmm_up", "spmm_down", "sddmm_grad", "spmm_dx")
# Every RowLaunch field: the row kernels and the per-neuron SpMM.
LAUNCH_FIELDS = (*ROW_FIELDS, "spmm_csc")


@dataclasses.dataclass(frozen=True)
class SparseTrainConfig:
    """Static configuration of `sparse_gated_mlp_train` (hashable).

    Attributes:
        ell_width: W, ELL slots per row (a power of two, a multiple of every row
            kernel's group).
        tail_capacities: ascending static row capacities of the dense tail; 0 means
            "no tail work". More heavy rows than the largest: dense fallback.
        impl: "pallas" (Triton kernels) or "xla" (the same algorithm in plain jnp, for
            CPU and tests: it materialises [M, W, H] gathers).
        fallback_block_rows: rows per step of the dense fallback (an unrolled loop of
            at most 16 dense blocks, larger M getting larger blocks), so that its
            [rows, N] temporaries stay far below the dense MLP's.
        compact: the compaction's launch: rows per program, columns per step, warps
            (`compaction.CompactLaunch`).
        sddmm_up: forward SDDMM R = x Wu^T at the entries, T = P R
            (`row_kernels.sddmm_up`).
        spmm_down: forward row SpMM out = T Wd (`row_kernels.spmm_rows`, one term).
        sddmm_grad: backward SDDMM dT = gO Wd^T at the entries, dR, dU
            (`row_kernels.sddmm_grad`).
        spmm_dx: backward row SpMM dx = dR Wu + dU Wg (`row_kernels.spmm_rows`, two
            terms).
        spmm_csc: per-neuron weight-gradient SpMM (`csc.spmm_csc`); smaller H blocks
            spread very active neurons over more programs and shrink the gathered
            x / gO working set (2 M block_h bf16).
        hot_min_count: ELL entries from which a neuron's weight gradients come from
            dense GEMMs instead of the per-neuron SpMM (`hot`; docs/design.md §6.3);
            None: M / 64, where a GEMM row (2 M H tensor-core FLOPs per product)
            costs about what the SpMM's gathers of that many entries cost.
        hot_min_skew: the neurons past hot_min_count take the block only when the
            layer's busy neurons (past hot_min_count or the mean count) average at
            least this many times the mean entries per neuron (`hot.hot_threshold`;
            0: always), so that an even pattern whose mean count nears
            hot_min_count keeps its ordinary neurons in the SpMM.
        hot_capacities: ascending static widths of that dense block, the first 0 (a
            call without hot neurons runs no GEMM); neurons past the largest stay in
            the SpMM.

    Launch defaults: one warp per row keeps the SDDMMs' per-slot dot product inside a
    warp (shuffles, no shared-memory round trip and barrier per group); the measured
    choices are in docs/performance_notes.md ("Compaction", "Training row kernels",
    "Weight-gradient CSC SpMM"). Block widths are fitted to H (and the compaction's
    columns to N) by `op.resolve_config`.
    """

    ell_width: int = 128
    tail_capacities: tuple[int, ...] = (0, 256, 1024, 2048)
    impl: str = "pallas"
    fallback_block_rows: int = 2048
    compact: CompactLaunch = CompactLaunch()
    sddmm_up: RowLaunch = RowLaunch(group=2, num_warps=1, block_h=1024)
    spmm_down: RowLaunch = RowLaunch(group=4, num_warps=1, block_h=512)
    sddmm_grad: RowLaunch = RowLaunch(group=4, num_warps=1, block_h=1024)
    spmm_dx: RowLaunch = RowLaunch(group=2, num_warps=4, block_h=1024)
    spmm_csc: RowLaunch = RowLaunch(group=4, num_warps=2, block_h=512)
    hot_min_count: int | None = None
    hot_min_skew: float = 2.0
    hot_capacities: tuple[int, ...] = (0, 64, 128, 192, 256, 384, 512, 768, 1024)

    def __post_init__(self):
        caps = self.tail_capacities
        if not caps or list(caps) != sorted(caps) or caps[0] < 0:
            raise ValueError(f"tail_capacities must be ascending and >= 0, got {caps}")
        if self.impl not in ("pallas", "xla"):
            raise ValueError(f"impl must be 'pallas' or 'xla', got {self.impl!r}")
        if not _triton.is_pow2(self.ell_width):
            raise ValueError(f"ell_width must be a power of two, got {self.ell_width}")
        reasons = [getattr(self, name).unsupported(name) for name in LAUNCH_FIELDS]
        reasons.append(self.compact.unsupported("compact"))
        for reason in reasons:
            if reason:
                raise ValueError(reason)
        for name in ROW_FIELDS:
            group = getattr(self, name).group
            if self.ell_width % group:
                raise ValueError(
                    f"ell_width {self.ell_width} is not a multiple of {name}.group={group}"
                )
        hot = self.hot_capacities
        if not hot or hot[0] != 0 or list(hot) != sorted(set(hot)):
            raise ValueError(f"hot_capacities must be ascending, starting at 0, got {hot}")
        if self.hot_min_count is not None and self.hot_min_count < 1:
            raise ValueError(f"hot_min_count must be None or >= 1, got {self.hot_min_count}")
        if not self.hot_min_skew >= 0:
            raise ValueError(f"hot_min_skew must be >= 0, got {self.hot_min_skew}")
        if self.fallback_block_rows < 1:
            raise ValueError(f"fallback_block_rows must be >= 1, got {self.fallback_block_rows}")
