"""Inputs, tolerances and small launches shared by the sparse training tests.

Errors are norm-based relative errors: values at the ReLU boundary make max-relative
errors meaningless in bf16 (an entry rounding across 0 flips the pattern), while the
norm of the difference stays at the bf16 rounding level (docs/design.md §9 states the
same rule for the speed-accuracy records).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels._gather import RowLaunch
from pallas_kernels.sparse_train import compaction, config
from pallas_kernels.sparse_train import format as fmt

OUT_RTOL = 1e-2  # norm-relative error of outputs / kernel results vs dense bf16
GRAD_RTOL = 2e-2  # norm-relative error of gradients vs jax.grad of the dense reference
LAM = 5.0  # large enough that the L1 sign term moves the gradients visibly

# Small shapes: M not a multiple of any block, W small so heavy rows reach the tail.
M, H, N = 40, 128, 256
# Row-kernel launch of the kernel tests: 2 groups per row of W=16, 2 H pieces.
ROW = RowLaunch(group=8, num_warps=4, block_h=64)
CSC = RowLaunch(group=8, num_warps=2, block_h=128)
_DEFAULT = config.SparseTrainConfig()
SMALL = dict(
    ell_width=16,
    tail_capacities=(0, 2, 4),
    compact=compaction.CompactLaunch(block_cols=128, block_m=8),
    # The default warps, with groups and H blocks that split the small rows.
    **{
        name: dataclasses.replace(getattr(_DEFAULT, name), group=8, block_h=64)
        for name in config.ROW_FIELDS
    },
    spmm_csc=CSC,
    fallback_block_rows=16,  # 3 blocks over M=40, the last one shorter
)
MODES = [
    pytest.param(True, id="interpret"),
    pytest.param(False, id="gpu", marks=pytest.mark.gpu),
]

# Production shapes of the CUDA cross-lowering tests.
PM, PH, PN, PW = 16384, 2048, 5632, 128


def zeros(shape, dtype=jnp.bfloat16):
    return jnp.zeros(shape, dtype)


def make_inputs(seed, m, h, n, nnz, heavy=(), zero=()):
    """bf16 (x, w_gate, w_up, w_down, proj) with ~nnz positive gates per row.

    A bias-like column (x[:, 0] = 1, Wg[:, 0] = -thr) sets the density; heavy rows
    drop the bias (about N/2 positives), zero rows keep only the bias (none).
    """
    k = jax.random.split(jax.random.key(seed), 5)
    thr = float(jax.scipy.special.ndtri(1.0 - nnz / n))
    x = jax.random.normal(k[0], (m, h)).at[:, 0].set(1.0)
    for i in heavy:
        x = x.at[i, 0].set(0.0)
    for i in zero:
        x = x.at[i].set(0.0).at[i, 0].set(1.0)
    wg = (jax.random.normal(k[1], (n, h)) / np.sqrt(h - 1)).at[:, 0].set(-thr)
    wu = jax.random.normal(k[2], (n, h)) / np.sqrt(h)
    wd = jax.random.normal(k[3], (n, h)) / np.sqrt(n)
    proj = jax.random.normal(k[4], (m, h))
    bf = lambda a: a.astype(jnp.bfloat16)
    return bf(x), bf(wg), bf(wu), bf(wd), proj


def rel_err(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def f32(a):
    return np.asarray(a, np.float32)


def l1_of_hidden(h):
    """Mean over tokens of sum over N of |h| (docs/design.md §2), fp32 scalar: the
    op's stats["l1"]."""
    return jnp.mean(jnp.sum(jnp.abs(h.astype(jnp.float32)), axis=-1))


def l0_of_hidden(h):
    """Mean over tokens of the number of non-zeros per row, fp32 scalar: the op's
    stats["l0"]."""
    return jnp.mean(jnp.sum((h != 0).astype(jnp.float32), axis=-1))


def ell_of(x, wg, width):
    p = jax.nn.relu(jnp.einsum("mh,nh->mn", x, wg, preferred_element_type=jnp.float32))
    p = p.astype(x.dtype)
    ell, fired, _ = compaction.compact_rows_ref(p, width)
    return p, ell, fmt.ell_counts(ell.counts, width), fired


def scatter(vals, cols, ell_count, n):
    """Dense [M, N] of per-slot values (unused slots dropped)."""
    m, w = cols.shape
    c = jnp.where(fmt.slot_mask(ell_count, w), cols, n)
    rows = jnp.arange(m)[:, None]
    return jnp.zeros((m, n), jnp.float32).at[rows, c].set(vals.astype(jnp.float32), mode="drop")
