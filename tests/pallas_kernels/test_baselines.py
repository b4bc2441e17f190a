"""The fused D2T baseline (pack in the GEMM epilogue) against the jnp oracle and the
two-pass D2T of the inference ops.

Each runs in the Pallas interpreter (CPU CI) and, marked `gpu`, compiled on the GPU.
"""

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import reference
from pallas_kernels.baselines import d2t
from pallas_kernels.twell import format as fmt
from pallas_kernels.twell.pack import gate_then_pack
from tests.lowering import count_triton_calls
from tests.pallas_kernels.twell.kernel_cases import (
    INTERPRET_AND_GPU,
    SMALL_D2T,
    SMALL_PACK,
    integer_mlp,
)


@pytest.mark.parametrize("interpret", INTERPRET_AND_GPU)
@pytest.mark.parametrize("compression", fmt.COMPRESSIONS)
@pytest.mark.parametrize(("m", "bias"), [(77, 12.0), (130, 0.0)])
def test_d2t_packs_exactly(interpret, compression, m, bias):
    """Odd M (masked row block), sparse and ~50%-dense (overflowing) gates, empty rows."""
    x, wg, _, _ = integer_mlp(0, m, 128, 512, bias)
    x = x.at[5].set(0)  # all-zero row: no positives at all
    packed = d2t(x, wg, compression=compression, cfg=SMALL_D2T, interpret=interpret)
    expected = fmt.pack(reference.hidden(x, wg), compression)
    np.testing.assert_array_equal(
        np.asarray(fmt.tile_counts(packed, compression)),
        np.asarray(fmt.tile_counts(expected, compression)),
    )
    # Payload words up to each tile's (clamped) count: same entries, same order.
    np.testing.assert_array_equal(
        np.asarray(fmt.unpack(packed, 512, compression)),
        np.asarray(fmt.unpack(expected, 512, compression)),
    )
    w = fmt.slots_per_tile(compression)
    got = np.asarray(packed).reshape(m, -1, w)
    want = np.asarray(expected).reshape(m, -1, w)
    used = np.arange(w)[None, None, :] <= np.minimum(want[:, :, :1], w - 1)
    np.testing.assert_array_equal(got[used], want[used])


@pytest.mark.parametrize("interpret", INTERPRET_AND_GPU)
def test_d2t_full_tiles_overflow_with_true_count(interpret):
    x = jnp.ones((64, 64), jnp.bfloat16)
    wg = jnp.ones((256, 64), jnp.bfloat16)  # every entry positive: count 256 per tile
    packed = d2t(x, wg, compression=8, cfg=SMALL_D2T, interpret=interpret)
    np.testing.assert_array_equal(np.asarray(fmt.tile_counts(packed, 8)), 256)


@pytest.mark.parametrize("interpret", INTERPRET_AND_GPU)
def test_d2t_random_matches_dense_relu(interpret):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((96, 256))
    x[:, 0] = 1.0
    wg = rng.standard_normal((512, 256)) * 0.05
    wg[:, 0] = -0.4  # ~30% density: 80 of the 127 slots per tile at C=2
    x, wg = jnp.asarray(x, jnp.bfloat16), jnp.asarray(wg, jnp.bfloat16)
    packed = d2t(x, wg, compression=2, cfg=SMALL_D2T, interpret=interpret)
    gate = reference.hidden(x, wg).astype(jnp.float32)
    decoded = fmt.unpack(packed, 512, 2).astype(jnp.float32)
    # fp32 summation order differs from XLA's: values agree to bf16 rounding, and an
    # entry may only be missing/extra where the exact value is within rounding of 0.
    np.testing.assert_allclose(np.asarray(decoded), np.asarray(gate), rtol=1e-2, atol=1e-3)


def test_d2t_rejects_unsupported_shapes():
    x = jnp.zeros((8, 96), jnp.bfloat16)
    with pytest.raises(ValueError, match="multiple of block_k"):
        d2t(x, jnp.zeros((256, 96), jnp.bfloat16), interpret=True)
    with pytest.raises(ValueError, match="multiple of the TwELL tile"):
        d2t(jnp.zeros((8, 64), jnp.bfloat16), jnp.zeros((320, 64), jnp.bfloat16), interpret=True)


@pytest.mark.parametrize("interpret", INTERPRET_AND_GPU)
@pytest.mark.parametrize(("m", "bias"), [(77, 12.0), (130, 0.0)])
def test_fused_d2t_equals_gate_then_pack(interpret, m, bias):
    """Integer inputs: both D2T forms see the same exact gate, so the same words."""
    x, wg, _, _ = integer_mlp(0, m, 128, 512, bias)
    x = x.at[5].set(0)
    two_pass = gate_then_pack(x, wg, compression=8, cfg=SMALL_PACK, interpret=interpret)
    fused = d2t(x, wg, compression=8, cfg=SMALL_D2T, interpret=interpret)
    np.testing.assert_array_equal(
        np.asarray(fmt.tile_counts(fused, 8)), np.asarray(fmt.tile_counts(two_pass, 8))
    )
    np.testing.assert_array_equal(
        np.asarray(fmt.unpack(fused, 512, 8)), np.asarray(fmt.unpack(two_pass, 512, 8))
    )


@pytest.mark.parametrize("compression", fmt.COMPRESSIONS)
def test_d2t_lowers_for_cuda(compression):
    x, w = jnp.zeros((16384, 2048), jnp.bfloat16), jnp.zeros((5632, 2048), jnp.bfloat16)
    fn = functools.partial(d2t, compression=compression, interpret=False)
    assert count_triton_calls(fn, x, w) == 1


@pytest.mark.gpu
def test_gpu_production_shape_fused_equals_two_pass():
    """H=2048, N=5632, odd M, ~30 non-zeros per row, default configs of both forms."""
    from twell_jax.synthetic import synthetic_mlp

    x, wg, _, _ = synthetic_mlp(4099, 2048, 5632, 30.0)
    fused = d2t(x, wg)
    np.testing.assert_array_equal(
        np.asarray(fmt.unpack(fused, 5632, 8) != 0), np.asarray(reference.hidden(x, wg) != 0)
    )
    # The fused kernel sums in another order: it may differ only at the ReLU boundary.
    differ = fmt.unpack(fused, 5632, 8) != fmt.unpack(gate_then_pack(x, wg), 5632, 8)
    assert float(jnp.mean(differ)) < 1e-4
