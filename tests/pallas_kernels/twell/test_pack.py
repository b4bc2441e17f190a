"""The pack kernel (D2T after XLA's gate GEMM) against the jnp oracle `format.pack`.

Packing copies bf16 values, so the checks are exact: true counts, then every payload
word up to each tile's clamped count. Each runs in the Pallas interpreter (CPU CI)
and, marked `gpu`, compiled on the GPU.
"""

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import reference
from pallas_kernels.twell import format as fmt
from pallas_kernels.twell.config import PackConfig
from pallas_kernels.twell.pack import gate_then_pack, pack_tiles
from tests.lowering import count_triton_calls
from tests.pallas_kernels.twell.kernel_cases import INTERPRET_AND_GPU, SMALL_PACK, integer_mlp


def _assert_same_words(packed, expected, n, compression):
    np.testing.assert_array_equal(
        np.asarray(fmt.tile_counts(packed, compression)),
        np.asarray(fmt.tile_counts(expected, compression)),
    )
    w = fmt.slots_per_tile(compression)
    m = packed.shape[0]
    got = np.asarray(packed).reshape(m, -1, w)
    want = np.asarray(expected).reshape(m, -1, w)
    used = np.arange(w)[None, None, :] <= np.minimum(want[:, :, :1], w - 1)
    np.testing.assert_array_equal(got[used], want[used])
    np.testing.assert_array_equal(
        np.asarray(fmt.unpack(packed, n, compression)),
        np.asarray(fmt.unpack(expected, n, compression)),
    )


def _assert_counts(counts, expected, compression):
    """The pack's tile-major counts are the oracle's true counts, transposed."""
    assert counts.dtype == jnp.int32
    np.testing.assert_array_equal(
        np.asarray(counts), np.asarray(fmt.tile_counts(expected, compression)).T
    )


def _adversarial(seed, m, n):
    """Sparse random values with an all-zero row, a full tile and a dense row."""
    rng = np.random.default_rng(seed)
    h = rng.standard_normal((m, n)).astype(np.float32)
    h[h < 1.5] = 0.0  # ~7% density: 17 of 256 per tile on average
    h[min(2, m - 1)] = 0.0
    h[0, :256] = rng.random(256) + 0.25  # every entry of a tile: count 256
    if m > 3:
        h[3] = np.abs(h[3]) + 0.5  # a whole row positive
    h[:, -1] = -1.0  # negatives are not entries
    return jnp.asarray(h, jnp.bfloat16)


@pytest.mark.parametrize("interpret", INTERPRET_AND_GPU)
@pytest.mark.parametrize("compression", fmt.COMPRESSIONS)
@pytest.mark.parametrize("m", [1, 37, 64])
def test_pack_matches_oracle(interpret, compression, m):
    """Odd M (masked row block), empty rows, full and overflowing tiles, every C."""
    h = _adversarial(m, m, 768)
    packed, counts = pack_tiles(
        h, compression=compression, cfg=SMALL_PACK, interpret=interpret, with_counts=True
    )
    expected = fmt.pack(h, compression)
    _assert_same_words(packed, expected, 768, compression)
    _assert_counts(counts, expected, compression)


@pytest.mark.parametrize("interpret", INTERPRET_AND_GPU)
@pytest.mark.parametrize(
    "cfg",
    [
        PackConfig(block_m=32, num_warps=8, group=4, steps=1),
        PackConfig(block_m=4, num_warps=2, group=16, steps=1),
        PackConfig(block_m=4, num_warps=2, steps=4),  # 45 rows: the last program overhangs
        PackConfig(block_m=8, num_warps=4, steps=2, ahead=1),
        PackConfig(block_m=1, num_warps=1, steps=8, ahead=3),  # 45 = 5 x 8 + 5 rows
    ],
    ids=["bm32_g4", "bm4_g16", "bm4_x4", "bm8_x2", "bm1_x8_ahead3"],
)
def test_pack_configs(interpret, cfg):
    h = _adversarial(7, 45, 512)
    packed = pack_tiles(h, compression=4, cfg=cfg, interpret=interpret)
    _assert_same_words(packed, fmt.pack(h, 4), 512, 4)
    words, counts = pack_tiles(h, compression=4, cfg=cfg, interpret=interpret, with_counts=True)
    np.testing.assert_array_equal(
        np.asarray(fmt.tile_counts(words, 4)), np.asarray(fmt.tile_counts(packed, 4))
    )
    _assert_counts(counts, fmt.pack(h, 4), 4)


def _round_tiers(m=24, n=512):
    """Row blocks of 8 needing 1, 2 and 3 rounds of the pack (groups of 8).

    Rows 0-7: at most one entry per group (one round); row 1 has one in each of a
    tile's 32 groups, past the 31 slots of C=8. Rows 8-15: one group with two entries
    (two rounds). Rows 16-23: a group with three (three rounds).
    """
    rng = np.random.default_rng(11)
    h = np.zeros((m, n), np.float32)
    for r in range(m):
        cols = rng.choice(n // 8, size=5, replace=False) * 8 + rng.integers(0, 8, 5)
        h[r, cols] = rng.random(5) + 0.5
    h[1, np.arange(32) * 8 + 7] = rng.random(32) + 0.5
    h[0, 255] = 3.0  # the last lane of a tile
    h[9, 256 + 8 : 256 + 16] = 0.0
    h[9, [256 + 9, 256 + 14]] = [2.0, 0.75]
    h[20, 16:24] = [0, 1.0, 0, 2.0, 0, 0, 1.5, 0]
    h[12, 300] = -2.0  # a negative is not an entry
    return jnp.asarray(h, jnp.bfloat16)


@pytest.mark.parametrize("interpret", INTERPRET_AND_GPU)
@pytest.mark.parametrize("compression", [8, 2])
@pytest.mark.parametrize("steps", [1, 4])
def test_pack_round_tiers(interpret, compression, steps):
    """Blocks needing one, two and three rounds, alone per program or in turns of one
    program's loop."""
    h = _round_tiers()
    cfg = PackConfig(block_m=8, num_warps=2, group=8, steps=steps)
    packed = pack_tiles(h, compression=compression, cfg=cfg, interpret=interpret)
    _assert_same_words(packed, fmt.pack(h, compression), h.shape[1], compression)


@pytest.mark.parametrize("interpret", INTERPRET_AND_GPU)
@pytest.mark.parametrize(("m", "bias"), [(77, 12.0), (130, 0.0)])
def test_gate_then_pack_matches_oracle(interpret, m, bias):
    """Integer inputs: the exact gate, sparse and overflowing, packed as the oracle does."""
    x, wg, _, _ = integer_mlp(0, m, 128, 512, bias)
    x = x.at[5].set(0)
    packed = gate_then_pack(x, wg, compression=8, cfg=SMALL_PACK, interpret=interpret)
    _assert_same_words(packed, fmt.pack(reference.hidden(x, wg), 8), 512, 8)


@pytest.mark.parametrize(
    ("h", "kwargs", "message"),
    [
        (jnp.zeros((4, 256), jnp.float32), {}, "bfloat16"),
        (jnp.zeros((4, 2, 256), jnp.bfloat16), {}, "2-D"),
        (jnp.zeros((4, 320), jnp.bfloat16), {}, "multiple of the TwELL tile"),
        (jnp.zeros((4, 256), jnp.bfloat16), {"compression": 3}, "compression"),
        (jnp.zeros((4, 256), jnp.bfloat16), {"cfg": PackConfig(block_m=48)}, "power of two"),
        (jnp.zeros((4, 256), jnp.bfloat16), {"cfg": PackConfig(group=6)}, "group=6"),
        (jnp.zeros((4, 256), jnp.bfloat16), {"cfg": PackConfig(steps=0)}, "steps=0"),
        (jnp.zeros((0, 256), jnp.bfloat16), {}, "at least one"),
        (jnp.zeros((4, 256), jnp.bfloat16), {"cfg": PackConfig(group=32)}, "group=32"),
        (
            jnp.zeros((4, 256), jnp.bfloat16),
            {"cfg": PackConfig(steps=8, ahead=2)},
            "multiple of ahead",
        ),
    ],
)
def test_pack_rejects_bad_inputs(h, kwargs, message):
    with pytest.raises(ValueError, match=message):
        pack_tiles(h, interpret=True, **kwargs)


@pytest.mark.parametrize("compression", fmt.COMPRESSIONS)
@pytest.mark.parametrize("m", [16384, 16383], ids=["whole_blocks", "partial_block"])
@pytest.mark.parametrize("with_counts", [False, True], ids=["words", "with_counts"])
def test_pack_lowers_for_cuda(compression, m, with_counts):
    """Production shape (N=5632) and the default block sizes; an odd M masks the load."""
    h = jnp.zeros((m, 5632), jnp.bfloat16)
    fn = functools.partial(
        pack_tiles,
        compression=compression,
        cfg=PackConfig(block_m=2),
        interpret=False,
        with_counts=with_counts,
    )
    assert count_triton_calls(fn, h) == 1


@pytest.mark.parametrize(("steps", "ahead"), [(1, 1), (4, 1), (16, 3)])
@pytest.mark.parametrize("m", [16384, 16383], ids=["whole_blocks", "partial_block"])
def test_pack_steps_lower_for_cuda(steps, ahead, m):
    """Several row blocks per program: the prefetching loop lowers too."""
    h = jnp.zeros((m, 5632), jnp.bfloat16)
    cfg = PackConfig(steps=steps, ahead=ahead)
    fn = functools.partial(pack_tiles, cfg=cfg, interpret=False)
    assert count_triton_calls(fn, h) == 1


@pytest.mark.gpu
def test_gpu_production_shape():
    """H=2048, N=5632, odd M, ~30 non-zeros per row, the default config."""
    from twell_jax.synthetic import synthetic_mlp

    x, wg, _, _ = synthetic_mlp(4099, 2048, 5632, 30.0)
    packed, counts = gate_then_pack(x, wg, with_counts=True)
    expected = fmt.pack(reference.hidden(x, wg), 8)
    _assert_same_words(packed, expected, 5632, 8)
    _assert_counts(counts, expected, 8)


@pytest.mark.parametrize("interpret", INTERPRET_AND_GPU)
def test_pack_nan_policy(interpret):
    """The pack keeps a +NaN as an entry (as the dense MLP's ReLU propagates it); a
    -NaN, like any negative, is not one."""
    h = np.zeros((8, 256), np.float32)
    h[0, 5], h[0, 7] = np.nan, 1.0
    h[1, 3], h[1, 9] = -np.nan, 2.0
    h = jnp.asarray(h, jnp.bfloat16)
    packed = pack_tiles(h, cfg=PackConfig(), interpret=interpret)
    assert np.asarray(fmt.tile_counts(packed, 8))[:2, 0].tolist() == [2, 1]
    dense = np.asarray(fmt.unpack(packed, 256, 8), np.float32)
    assert np.isnan(dense[0, 5]) and dense[0, 7] == 1.0 and dense[1, 9] == 2.0
    assert np.count_nonzero(np.nan_to_num(dense, nan=1.0)) == 3
