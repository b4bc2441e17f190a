"""What every training kernel's wrapper shares: the slot / column iota and one
`pallas_call` for the row-gather kernels, launched from their `RowLaunch`."""

from __future__ import annotations

from pallas_kernels import _triton
from pallas_kernels._gather import RowLaunch

# Software pipelining does not help loops whose loads are data-dependent gathers.
NUM_STAGES = 1


iota = _triton.iota


def row_call(kernel, *, name: str, grid, out_shape, launch: RowLaunch, h: int, interpret):
    """`pallas_call` of a row-gather kernel over H = h columns.

    Raises:
        ValueError: the launch is invalid or its block_h does not divide H.
    """
    reason = launch.unsupported(name)
    if reason is None and h % launch.block_h:
        reason = f"{name}.block_h={launch.block_h} must divide H={h}"
    if reason:
        raise ValueError(reason)
    return _triton.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        compiler_params=_triton.compiler_params(num_warps=launch.num_warps, num_stages=NUM_STAGES),
        interpret=_triton.resolve_interpret(interpret),
        name=name,
    )
