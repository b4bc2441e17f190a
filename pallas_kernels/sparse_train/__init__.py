"""Sparse gated MLP for training: hybrid ELL rows plus a dense tail (docs/design.md §5,
§6) behind one `custom_vjp`.

Modules: `format` (the ELL + tail layout, tail plan and CSC index), `compaction` (dense
gate -> ELL), `row_kernels` (SDDMMs and row SpMMs), `csc` (weight gradients by
neuron), `config` (SparseTrainConfig), `reference` (the op's dense formula),
`dense_rows` (the dense formula in row blocks: the op's fallback and a model's dense
branch) and `op` (the custom_vjp and its public entry point).
"""

from pallas_kernels.sparse_train.config import SparseTrainConfig
from pallas_kernels.sparse_train.dense_rows import blocked_gated_mlp
from pallas_kernels.sparse_train.op import (
    RESIDUALS_NAME,
    hot_share,
    resolve_config,
    sparse_gated_mlp_train,
    sparse_train_supported,
)

__all__ = [
    "RESIDUALS_NAME",
    "SparseTrainConfig",
    "blocked_gated_mlp",
    "hot_share",
    "resolve_config",
    "sparse_gated_mlp_train",
    "sparse_train_supported",
]
