"""The set-bit tests of the pack and the compaction against plain numpy compares."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import bit_groups


def _bits_of(words, per_word):
    return np.asarray(bit_groups.group_bits(bit_groups.positive_flags(words, per_word), per_word))


@pytest.mark.parametrize("roll", [0, 1, 12345])
def test_bf16_bits_match_int16_compare_on_every_pattern(roll):
    """Two elements per instruction against `int16(bits) > 0` on all 65536 bf16 bit
    patterns (zeros of both signs, NaNs, infinities, subnormals), each paired with
    another pattern in the same uint32."""
    bits = np.arange(1 << 16, dtype=np.uint16)
    pairs = np.stack([bits, np.roll(bits, roll)], axis=-1)  # [65536, 2]: element 2i, 2i + 1
    groups = pairs.reshape(-1, 4, 8)  # [R, G, S]: 8-element groups of 4 pairs
    words = jnp.asarray(groups.reshape(-1, 4, 4, 2).view(np.uint32)[..., 0])
    weights = 1 << np.arange(8)
    want = np.sum((groups.view(np.int16) > 0) * weights, axis=-1)
    np.testing.assert_array_equal(_bits_of(words, 2), want)


def test_fp32_bits_match_int32_compare():
    """One element per word: fp32 specials and random patterns against `int32 > 0`."""
    specials = np.array(
        [0.0, -0.0, 1e-45, -1e-45, np.inf, -np.inf, np.nan, -np.nan, 1.0, -1.0], np.float32
    )
    rng = np.random.default_rng(0)
    patterns = np.concatenate([specials.view(np.uint32), rng.integers(0, 2**32, 4086, np.uint32)])
    groups = patterns.reshape(-1, 8, 8)  # [R, G, 8]
    weights = 1 << np.arange(8)
    want = np.sum((groups.view(np.int32) > 0) * weights, axis=-1)
    np.testing.assert_array_equal(_bits_of(jnp.asarray(groups), 1), want)


def test_flags_count_each_element_position():
    """Summed flags keep one 16-bit counter per bf16 element of a word."""
    values = np.array([[1.0, -1.0], [2.0, 3.0], [0.0, 5.0]], np.float32).astype(jnp.bfloat16)
    words = jnp.asarray(np.asarray(values).view(np.uint32)[:, 0])
    total = int(jnp.sum(bit_groups.positive_flags(words, 2)))
    assert (total & 0xFFFF, total >> 16) == (2, 2)


def test_element_word_and_lowest_bit():
    words = jnp.arange(12, dtype=jnp.uint32).reshape(1, 3, 4)
    bits = jnp.array([[0b1000, 0b0110, 0b1]], jnp.int32)
    element = bit_groups.lowest_bit(bits)
    np.testing.assert_array_equal(element, [[3, 1, 0]])
    np.testing.assert_array_equal(bit_groups.element_word(words, element, 2), [[1, 4, 8]])
    np.testing.assert_array_equal(bit_groups.element_word(words, element, 1), [[3, 5, 8]])


@pytest.mark.parametrize("steps", [1, 2, 3, 5, 7, 8])
@pytest.mark.parametrize("ahead", [1, 2, 3])
def test_for_each_block_visits_every_block_once_in_order(steps, ahead):
    """Full turns of ahead + 1 blocks, then the remainder from the buffers they filled;
    loads past the last block are clamped by the caller and never used."""

    def load(k):
        return jnp.minimum(k, steps - 1) * 10

    # The loop index is traced inside lax.fori_loop: record the visits in the carry.
    def body(k, block, carry):
        order, count = carry
        return order.at[count].set(k * 1000 + block), count + 1

    order, count = bit_groups.for_each_block(
        load, body, (jnp.full((16,), -1), jnp.int32(0)), steps=steps, ahead=ahead
    )
    assert int(count) == steps
    want = [k * 1000 + k * 10 for k in range(steps)]
    np.testing.assert_array_equal(np.asarray(order[:steps]), want)
