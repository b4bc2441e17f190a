"""Decode: the sparse gated MLP for a few tokens per call (docs/design.md §4.5).

Modules: `op` (the public op, its capacities and statistics) and `reference` (its
XLA pieces: the gate, the active ids, the gathered and the dense branch).
"""

from pallas_kernels.decode.op import DEFAULT_CAPACITIES, DecodeStats, sparse_decode_mlp

__all__ = ["DEFAULT_CAPACITIES", "DecodeStats", "sparse_decode_mlp"]
