"""Compaction kernel against its jnp twin, and its CUDA lowering at production shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from pallas_kernels.sparse_train import compaction
from pallas_kernels.sparse_train.config import SparseTrainConfig
from tests.lowering import count_triton_calls
from tests.pallas_kernels.sparse_train.cases import (
    MODES,
    PH,
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

_LAUNCHES = {
    "default": compaction.CompactLaunch(block_cols=128),
    "ahead_3_of_2_tiles": compaction.CompactLaunch(block_cols=128, block_m=8, ahead=3),
    "one_row_per_program": compaction.CompactLaunch(block_cols=64, block_m=1, num_warps=1),
    "groups_of_16": compaction.CompactLaunch(block_cols=64, group=16, block_m=32, num_warps=4),
}


def _assert_matches_reference(u, width, launch, interpret):
    ell_ref, fired_ref, _ = compaction.compact_rows_ref(jax.nn.relu(u), width)
    ell, fired, finite = compaction.compact_rows(u, width=width, launch=launch, interpret=interpret)
    np.testing.assert_array_equal(ell.counts, ell_ref.counts)
    np.testing.assert_array_equal(ell.cols, ell_ref.cols)
    np.testing.assert_array_equal(f32(ell.vals), f32(ell_ref.vals))
    np.testing.assert_array_equal(ell.col_counts, ell_ref.col_counts)
    np.testing.assert_array_equal(fired, fired_ref)
    assert bool(finite)
    return ell


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("launch", list(_LAUNCHES), ids=str)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "fp32"])
def test_compact_rows_matches_reference(interpret, launch, dtype):
    """Heavy rows past W (true counts kept, left out of the column counts), empty rows,
    M = 40 not a multiple of a program's rows; fp32 gates hold one element per word."""
    x, wg, *_ = make_inputs(0, M, H, N, 8, heavy=(3, 30), zero=(0, 39))
    u = jnp.einsum("mh,nh->mn", x, wg, preferred_element_type=dtype)  # pre-relu, as the op
    ell = _assert_matches_reference(u, 16, _LAUNCHES[launch], interpret)
    assert int(ell.counts[3]) > 16 and int(ell.counts[0]) == 0


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "fp32"])
def test_compact_rows_corrects_records_of_long_rows(interpret, dtype):
    """Programs whose long rows leave the column counts: one long row among short ones
    (sharing words with them), a program of only long rows, and a long row in a last
    program that overhangs M = 37."""
    x, wg, *_ = make_inputs(2, M, H, N, 8)
    u = jnp.einsum("mh,nh->mn", x, wg, preferred_element_type=dtype)[:37]
    every_third = jnp.arange(N) % 3 == 0
    u = u.at[3, :64].set(1.0).at[8:16].set(jnp.where(every_third, u[8:16], 0.5))
    u = u.at[35, 100:].set(2.0)
    ell = _assert_matches_reference(u, 16, _LAUNCHES["default"], interpret)
    long_rows = np.flatnonzero(np.asarray(ell.counts) > 16)
    np.testing.assert_array_equal(long_rows, [3, *range(8, 16), 35])


@pytest.mark.parametrize("interpret", MODES)
def test_compact_rows_adversarial_patterns(interpret):
    """A row with every column on (every group full), a column on in every row (a hot
    neuron), all of a tile's columns dead, -0 (not positive) and tiny positives."""
    x, wg, *_ = make_inputs(1, M, H, N, 4)
    u = jnp.einsum("mh,nh->mn", x, wg, preferred_element_type=jnp.bfloat16)
    u = u.at[:, 128:256].multiply(-1.0).at[:, 130].set(0.25).at[7].set(1.0)
    u = u.at[11, :128].set(-0.0).at[12, 5].set(1e-30)
    ell = _assert_matches_reference(u, 16, _LAUNCHES["default"], interpret)
    assert int(ell.counts[7]) == N and int(ell.cols[12, 0]) <= 5


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize(
    ("bad", "positive"),
    [(np.nan, True), (-np.nan, False), (-np.inf, False), (np.inf, True)],
    ids=["+nan", "-nan", "-inf", "+inf"],
)
def test_compact_rows_flags_nonfinite_gates(interpret, dtype, bad, positive):
    """A non-finite gate clears all_finite, in any program; by the sign bit, +NaN and
    +Inf count as entries of their row and -NaN and -Inf do not."""
    x, wg, *_ = make_inputs(0, M, H, N, 8)
    u = jnp.einsum("mh,nh->mn", x, wg, preferred_element_type=dtype)
    u = u.at[37].set(jnp.where(u[37] > 0, u[37], 0)).at[37, 7].set(-1)  # a known non-positive
    launch = _LAUNCHES["default"]
    clean, _, finite = compaction.compact_rows(u, width=16, launch=launch, interpret=interpret)
    assert bool(finite)
    # The bit pattern itself: a device conversion may canonicalise a NaN's sign.
    bits = np.array(bad, np.float32).view(np.uint32)
    if dtype == jnp.bfloat16:
        value = lax.bitcast_convert_type(jnp.uint16(bits >> 16), dtype)
    else:
        value = lax.bitcast_convert_type(jnp.uint32(bits), dtype)
    u_bad = u.at[37, 7].set(value)
    assert np.signbit(np.asarray(u_bad[37, 7], np.float32)) != positive
    ell, _, finite = compaction.compact_rows(u_bad, width=16, launch=launch, interpret=interpret)
    assert not bool(finite)
    assert not bool(compaction.compact_rows_ref(u_bad, 16)[2])
    np.testing.assert_array_equal(ell.counts, clean.counts.at[37].add(int(positive)))


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("nan_row", [None, 35], ids=["finite", "nan_in_last_block"])
def test_gate_to_ell_in_row_blocks_matches_one_call(monkeypatch, interpret, nan_row):
    """Past GATE_BLOCK_ROWS rows the gate GEMM and its compaction run block by block
    (16 rows here: blocks of 16, 16 and 8 over M = 40, heavy and empty rows in
    different blocks): the same ELL rows, column counts, fired neurons and finite flag
    as the compaction of the whole gate."""
    x, wg, *_ = make_inputs(0, M, H, N, 8, heavy=(3, 30), zero=(0, 20, 39))
    if nan_row is not None:
        x = x.at[nan_row, 5].set(jnp.nan)
    launch = _LAUNCHES["ahead_3_of_2_tiles"]
    u = jnp.einsum("mh,nh->mn", x, wg, preferred_element_type=x.dtype)
    want = compaction.compact_rows(u, width=16, launch=launch, interpret=interpret)
    monkeypatch.setattr(compaction, "GATE_BLOCK_ROWS", 16)
    rows, compact = [], compaction.compact_rows
    monkeypatch.setattr(compaction, "compact_rows", lambda u, **k: (
        rows.append(u.shape[0]), compact(u, **k))[1])  # fmt: skip
    got = compaction.gate_to_ell(x, wg, width=16, launch=launch, interpret=interpret)
    assert rows == [16, 16, 8]
    for name, a, b in zip(("counts", "cols", "vals", "col_counts"), got[0], want[0], strict=True):
        np.testing.assert_array_equal(f32(a), f32(b), err_msg=name)
    np.testing.assert_array_equal(got[1], want[1])
    assert bool(got[2]) == bool(want[2]) == (nan_row is None)
    assert int(got[0].counts[30]) > 16 and int(got[0].counts[20]) == 0


def test_gate_to_ell_in_row_blocks_lowers_for_cuda(monkeypatch, verified_modules):
    """Production shapes in 4 blocks of 4096 rows: one compaction kernel per block."""
    monkeypatch.setattr(compaction, "GATE_BLOCK_ROWS", 4096)
    launch = SparseTrainConfig().compact
    fn = lambda x, w: compaction.gate_to_ell(x, w, width=PW, launch=launch, interpret=False)
    assert count_triton_calls(fn, zeros((PM, PH)), zeros((PN, PH))) == 4
    assert len(verified_modules) == 4


def test_compact_rows_lowers_for_cuda(verified_modules):
    launch = SparseTrainConfig().compact
    fn = lambda p: compaction.compact_rows(p, width=PW, launch=launch, interpret=False)
    assert count_triton_calls(fn, zeros((PM, PN))) == 1
    assert len(verified_modules) == 1


@pytest.mark.parametrize(
    ("p", "match"),
    [
        (jnp.zeros((8, 256), jnp.int32), "bf16 or fp32"),
        (jnp.zeros((256,), jnp.bfloat16), "bf16 or fp32"),
        (jnp.zeros((8, 200), jnp.bfloat16), "block_cols=128"),
    ],
)
def test_compact_rows_rejects_unsupported_inputs(p, match):
    with pytest.raises(ValueError, match=match):
        compaction.compact_rows(p, width=16, launch=_LAUNCHES["default"], interpret=True)
