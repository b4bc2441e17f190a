"""Pallas GPU kernels (Triton backend) for TwELL sparse transformer MLPs.

Public API: the ops below; the kernels and formats live in their own modules.
"""

from pallas_kernels.ops import TwellStats, twell_gated_mlp, twell_mlp

__all__ = ["TwellStats", "twell_gated_mlp", "twell_mlp"]
