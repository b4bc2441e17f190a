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
    ell_ref, fired_ref = compaction.compact_rows_ref(jax.nn.relu(u), 16)
    launch = compaction.CompactLaunch(block_rows, block_cols, num_warps=4)
    ell, fired = compaction.compact_rows(u, width=16, launch=launch, interpret=interpret)
    np.testing.assert_array_equal(ell.counts, ell_ref.counts)
    np.testing.assert_array_equal(ell.cols, ell_ref.cols)
    np.testing.assert_array_equal(f32(ell.vals), f32(ell_ref.vals))
    np.testing.assert_array_equal(fired, fired_ref)
    assert int(ell.counts[3]) > 16 and int(ell.counts[0]) == 0


def test_compact_rows_lowers_for_cuda(verified_modules):
    launch = SparseTrainConfig().compact
    fn = lambda p: compaction.compact_rows(p, width=PW, launch=launch, interpret=False)
    assert count_triton_calls(fn, zeros((PM, PN))) == 1
    assert len(verified_modules) == 1
