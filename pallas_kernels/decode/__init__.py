"""Decode: the sparse gated MLP for a few tokens per call (docs/design.md §4.5).

Modules: `op` (the public op and its statistics), `kernels` (its two Pallas kernels and
their launches) and `reference` (its XLA pieces: the gate, the compaction of the active
ids, the MLP over those ids and the dense MLP).
"""

from pallas_kernels.decode.kernels import DecodeConfig
from pallas_kernels.decode.op import (
    DecodeStats,
    decode_supported,
    sparse_decode_ffn_block,
    sparse_decode_mlp,
)

__all__ = [
    "DecodeConfig",
    "DecodeStats",
    "decode_supported",
    "sparse_decode_ffn_block",
    "sparse_decode_mlp",
]
