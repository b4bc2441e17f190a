"""Pallas GPU kernels (Triton backend) for TwELL sparse transformer MLPs.

Public API: the inference ops (TwELL), the training op (hybrid ELL + dense tail) and
its remat residual name; the kernels and formats live in their own modules.
"""

from pallas_kernels.ops import TwellStats, twell_gated_mlp, twell_mlp
from pallas_kernels.sparse_train_op import (
    RESIDUALS_NAME,
    SparseTrainConfig,
    sparse_gated_mlp_train,
)

__all__ = [
    "RESIDUALS_NAME",
    "SparseTrainConfig",
    "TwellStats",
    "sparse_gated_mlp_train",
    "twell_gated_mlp",
    "twell_mlp",
]
