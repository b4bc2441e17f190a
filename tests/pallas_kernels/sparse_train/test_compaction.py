"""Compaction kernel against its jnp twin, and its CUDA lowering at production shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.sparse_train import compaction
from pallas_kernels.sparse_train.config import SparseTrainConfig
from tests.lowering import count_triton_calls
from tests.pallas_kernels.sparse_train.cases import (
    MODES,
    PM,
    PN,
    PW,
    H,
    M,
    N,
    f32,
    make_inputs,
    zeros,
)


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize(
    ("block_rows", "block_cols", "dtype"),
    [(16, 128, jnp.bfloat16), (32, 256, jnp.bfloat16), (16, 128, jnp.float32)],
)
def test_compact_rows_matches_reference(interpret, block_rows, block_cols, dtype):
    """Heavy rows past W (true counts kept), empty rows, M not a multiple of the block;
    fp32 gates take `tile_select`'s two-reduction path."""
    x, wg, *_ = make_inputs(0, M, H, N, 8, heavy=(3, 30), zero=(0, 39))
    u = jnp.einsum("mh,nh->mn", x, wg, preferred_element_type=dtype)  # pre-relu, as the op
    ell_ref, fired_ref, _ = compaction.compact_rows_ref(jax.nn.relu(u), 16)
    launch = compaction.CompactLaunch(block_rows, block_cols, num_warps=4)
    ell, fired, finite = compaction.compact_rows(u, width=16, launch=launch, interpret=interpret)
    np.testing.assert_array_equal(ell.counts, ell_ref.counts)
    np.testing.assert_array_equal(ell.cols, ell_ref.cols)
    np.testing.assert_array_equal(f32(ell.vals), f32(ell_ref.vals))
    np.testing.assert_array_equal(fired, fired_ref)
    assert int(ell.counts[3]) > 16 and int(ell.counts[0]) == 0
    assert bool(finite)


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("bad", [jnp.nan, -jnp.inf, jnp.inf])
def test_compact_rows_flags_nonfinite_gates(interpret, bad):
    """A non-finite gate clears all_finite; NaN and -Inf leave the counts of their
    tile as they were (neither is positive)."""
    x, wg, *_ = make_inputs(0, M, H, N, 8)
    u = jnp.einsum("mh,nh->mn", x, wg, preferred_element_type=jnp.bfloat16)
    u = u.at[5].set(jnp.where(u[5] > 0, u[5], 0)).at[5, 7].set(-1)  # a known non-positive
    launch = compaction.CompactLaunch(16, 128, num_warps=4)
    clean, _, finite = compaction.compact_rows(u, width=16, launch=launch, interpret=interpret)
    assert bool(finite)
    ell, _, finite = compaction.compact_rows(
        u.at[5, 7].set(bad), width=16, launch=launch, interpret=interpret
    )
    assert not bool(finite)
    assert not bool(compaction.compact_rows_ref(u.at[5, 7].set(bad), 16)[2])
    if bad != jnp.inf:
        np.testing.assert_array_equal(ell.counts, clean.counts)


def test_compact_rows_lowers_for_cuda(verified_modules):
    launch = SparseTrainConfig().compact
    fn = lambda p: compaction.compact_rows(p, width=PW, launch=launch, interpret=False)
    assert count_triton_calls(fn, zeros((PM, PN))) == 1
    assert len(verified_modules) == 1
