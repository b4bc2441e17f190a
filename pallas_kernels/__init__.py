"""Pallas GPU kernels (Triton backend) for TwELL sparse transformer MLPs.

Public API: the inference ops (TwELL) and their stage configs, the decode op (gate GEMV,
then the active rows; also as a block's whole FFN half, norm and residual included),
the decode step's attention block in one kernel and its normed q / k / v product, the
training op (hybrid ELL + dense tail) and its remat residual name, and the dense gated
MLP in row blocks (the sparse model's dense branch); the kernels and formats live in
their own modules.
"""

from pallas_kernels.decode import DecodeStats, sparse_decode_ffn_block, sparse_decode_mlp
from pallas_kernels.decode_attention import DecodeAttentionConfig, decode_attention
from pallas_kernels.normed_projection import normed_projection
from pallas_kernels.sparse_train import (
    RESIDUALS_NAME,
    SparseTrainConfig,
    blocked_gated_mlp,
    sparse_gated_mlp_train,
    sparse_train_supported,
)
from pallas_kernels.twell import (
    PackConfig,
    T2DConfig,
    TwellStats,
    twell_gated_mlp,
    twell_mlp,
    twell_supported,
)

__all__ = [
    "RESIDUALS_NAME",
    "DecodeAttentionConfig",
    "DecodeStats",
    "PackConfig",
    "SparseTrainConfig",
    "T2DConfig",
    "TwellStats",
    "blocked_gated_mlp",
    "decode_attention",
    "normed_projection",
    "sparse_decode_ffn_block",
    "sparse_decode_mlp",
    "sparse_gated_mlp_train",
    "sparse_train_supported",
    "twell_gated_mlp",
    "twell_mlp",
    "twell_supported",
]
