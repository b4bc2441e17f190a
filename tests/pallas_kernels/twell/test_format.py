"""TwELL layout: pack / unpack round trips, overflow bookkeeping, word encoding."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.twell import format as fmt


def _sparse_h(rng, m, n, density):
    h = rng.standard_normal((m, n)).astype(np.float32)
    h[rng.random((m, n)) > density] = 0.0
    return jnp.asarray(np.maximum(h, 0.0), jnp.bfloat16)


@pytest.mark.parametrize("compression", fmt.COMPRESSIONS)
def test_round_trip_without_overflow(compression):
    rng = np.random.default_rng(0)
    h = _sparse_h(rng, 37, 768, 0.04)
    h = h.at[3].set(0)  # an empty row
    packed = fmt.pack(h, compression)
    assert packed.shape == (37, 768 // compression) and packed.dtype == jnp.uint32
    np.testing.assert_array_equal(np.asarray(fmt.unpack(packed, 768, compression)), np.asarray(h))
    np.testing.assert_array_equal(
        np.asarray(fmt.tile_counts(packed, compression)),
        np.asarray((h > 0).reshape(37, 3, 256).sum(-1)),
    )


def test_entries_are_in_column_order_with_global_columns():
    h = (
        jnp.zeros((1, 512), jnp.bfloat16)
        .at[0, jnp.array([300, 260, 511])]
        .set(jnp.array([1.5, 2.0, 3.0], jnp.bfloat16))
    )
    packed = np.asarray(fmt.pack(h, 8))
    tile1 = packed[0, 32:64]
    assert tile1[0] == 3
    values, columns = fmt.decode_words(jnp.asarray(tile1[1:4]))
    np.testing.assert_array_equal(np.asarray(columns), [260, 300, 511])
    np.testing.assert_array_equal(np.asarray(values, np.float32), [2.0, 1.5, 3.0])


def test_overflow_keeps_true_count_and_first_entries():
    h = jnp.ones((2, 256), jnp.bfloat16)  # a full tile: 256 positives, capacity 31
    packed = fmt.pack(h, 8)
    assert int(fmt.tile_counts(packed, 8)[0, 0]) == 256
    decoded = np.asarray(fmt.unpack(packed, 256, 8), np.float32)
    np.testing.assert_array_equal(decoded[:, :31], 1.0)
    np.testing.assert_array_equal(decoded[:, 31:], 0.0)


def test_negative_and_zero_values_are_not_entries():
    h = jnp.asarray([[-1.0, 0.0, 2.0] + [0.0] * 253], jnp.bfloat16)
    assert int(fmt.tile_counts(fmt.pack(h, 8), 8)[0, 0]) == 1


def test_word_encoding_round_trip():
    values = jnp.asarray([0.5, 3.25, 1e-3, 65504.0], jnp.bfloat16)
    columns = jnp.asarray([0, 255, 1000, 65535])
    v, c = fmt.decode_words(fmt.encode_words(values, columns))
    np.testing.assert_array_equal(np.asarray(v), np.asarray(values))
    np.testing.assert_array_equal(np.asarray(c), np.asarray(columns))


@pytest.mark.parametrize(
    ("n", "compression", "message"),
    [(320, 8, "multiple of the TwELL tile"), (512, 16, "compression"), (65792, 8, "16 bits")],
)
def test_bad_format_raises(n, compression, message):
    with pytest.raises(ValueError, match=message):
        fmt.check_format(n, compression)


def test_unpack_rejects_wrong_width():
    with pytest.raises(ValueError, match="packed width"):
        fmt.unpack(jnp.zeros((1, 40), jnp.uint32), 512, 8)
