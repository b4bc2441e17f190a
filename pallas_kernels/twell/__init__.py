"""TwELL inference: the sparse gated and non-gated MLP ops and their kernels.

Modules: `format` (the TwELL layout and its jnp reference), `config` (launch
parameters), `pack` (D2T: XLA's gate GEMM, then the pack kernel), `t2d` (the TwELL
SDDMM and SpMM), `op` (the public ops), `reference` (their XLA path). See
docs/design.md §3-§4.
"""

from pallas_kernels.twell.config import PackConfig, T2DConfig
from pallas_kernels.twell.op import TwellStats, twell_gated_mlp, twell_mlp, twell_supported

__all__ = [
    "PackConfig",
    "T2DConfig",
    "TwellStats",
    "twell_gated_mlp",
    "twell_mlp",
    "twell_supported",
]
