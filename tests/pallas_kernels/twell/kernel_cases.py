"""Shared inputs and checks for the TwELL kernel and op tests."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import reference
from pallas_kernels.baselines import D2TConfig
from pallas_kernels.twell.config import PackConfig

INTERPRET_AND_GPU = [
    pytest.param(True, id="interpret"),
    pytest.param(False, id="gpu", marks=pytest.mark.gpu),
]
SMALL_D2T = D2TConfig(block_m=64, block_k=64, chunk=128, num_warps=4, num_stages=2)
SMALL_PACK = PackConfig(block_m=4, num_warps=2, steps=4, ahead=3)
BF16_FACTOR = 1.5
SCALE_ATOL = 1e-3


def integer_mlp(seed, m, h, n, bias, gated_bias=True):
    """Integer-valued x [M, H] and weights [N, H] in bf16; the bias column sets density.

    x[:, 0] = 1 and W[:, 0] = -bias on the sparse weight (the gate, or the up weight
    of the non-gated MLP, both passed as `w_sparse`).
    """
    rng = np.random.default_rng(seed)
    x = rng.integers(-2, 3, (m, h)).astype(np.float32)
    x[:, 0] = 1.0
    w_sparse = rng.integers(-2, 3, (n, h)).astype(np.float32)
    w_sparse[:, 0] = -bias if gated_bias else 0.0
    w_up = rng.integers(-1, 2, (n, h)).astype(np.float32)
    w_down = rng.integers(-1, 2, (n, h)).astype(np.float32)
    return [jnp.asarray(a, jnp.bfloat16) for a in (x, w_sparse, w_up, w_down)]


def assert_bf16_close(out, x, weights, gated):
    """The bf16 rule against an fp32 truth computed from the same bf16 inputs."""
    f32 = [a.astype(jnp.float32) for a in (x, *weights)]
    if gated:
        truth = reference.gated_mlp(*f32)
        dense = reference.gated_mlp(x, *weights)
    else:
        truth = reference.mlp(*f32)
        dense = reference.mlp(x, *weights)
    scale = float(jnp.max(jnp.abs(truth)))
    dense_err = float(jnp.max(jnp.abs(dense.astype(jnp.float32) - truth)))
    err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - truth)))
    assert err <= BF16_FACTOR * dense_err + SCALE_ATOL * scale, (err, dense_err, scale)
