"""Finding the positive entries of a loaded tile as set bits (kernel code).

The pack (TwELL) and the training compaction (ELL) turn a [rows, 256] tile of a dense
bf16 (or fp32) activation into a few entries per row. Both read the tile as 32-bit
words, each thread holding whole groups of `group` columns: [rows, groups, words per
group]. A group's positive elements become the set bits of one int32, so its count is
a popcount and its r-th entry the r-th lowest set bit: no per-element keys and no
scatter of the whole tile (docs/performance_notes.md, "Pack").

A +NaN is positive here (it propagates, as through a dense ReLU); -0 and -NaN are not.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

# Per 32-bit word: the sign bits of its elements, and the bits below each sign.
_SIGN = {1: 0x80000000, 2: 0x80008000}
_REST = {1: 0x7FFFFFFF, 2: 0x7FFF7FFF}


def elements_per_word(dtype) -> int:
    """2 for a 16-bit float, 1 for fp32: the elements one uint32 word holds."""
    size = jnp.dtype(dtype).itemsize
    if size not in (2, 4):
        raise ValueError(f"bit groups need a 16- or 32-bit float, got {jnp.dtype(dtype)}")
    return 4 // size


def positive_flags(words: jax.Array, per_word: int) -> jax.Array:
    """uint32 words [...] -> uint32 [...]: bit 0 (and bit 16 when per_word == 2) set
    where the word's element is positive.

    Two bf16 elements per instruction (SIMD within a register): an element is positive
    when its sign bit is clear and its other bits are not all zero, which `(bits &
    rest) + rest` carries into the sign position without touching the other half. The
    flags double as 16-bit counters: summing them counts each element position apart.
    """
    sign, rest = jnp.uint32(_SIGN[per_word]), jnp.uint32(_REST[per_word])
    positive = ((words & rest) + rest) & ~words & sign
    return positive >> (32 // per_word - 1)


def nonfinite(words: jax.Array, per_word: int) -> jax.Array:
    """uint32 words [...] -> uint32 [...], non-zero where an element is NaN or +-Inf.

    An element's exponent bits are all ones exactly when adding one at the exponent's
    lowest bit carries into the sign position (per half, without touching the other).
    """
    exponent = {1: 0x7F800000, 2: 0x7F807F80}[per_word]
    one = {1: 0x00800000, 2: 0x00800080}[per_word]
    return ((words & jnp.uint32(exponent)) + jnp.uint32(one)) & jnp.uint32(_SIGN[per_word])


def group_bits(flags: jax.Array, per_word: int) -> jax.Array:
    """`positive_flags` [rows, G, Q] -> int32 [rows, G]: bit k = group element k > 0."""
    q = flags.shape[-1]
    # Word i's element e goes to bit per_word * i + e; the bits are disjoint, so a sum
    # is an OR. With two per word, bit 16 of word i lands at 16 + 2i and is folded
    # down to 2i + 1.
    folded = jnp.sum(flags << (per_word * jnp.arange(q, dtype=jnp.uint32)), axis=-1)
    if per_word == 2:
        folded = (folded | (folded >> 15)) & ((1 << 2 * q) - 1)
    return folded.astype(jnp.int32)


def lowest_bit(bits: jax.Array) -> jax.Array:
    """int32: index of the lowest set bit (garbage where bits == 0)."""
    return 31 - lax.clz(bits & -bits)


def element_word(words: jax.Array, element: jax.Array, per_word: int) -> jax.Array:
    """The word holding each group's `element` (int32 [rows, G]): an in-thread pick
    over the group's words [rows, G, Q]."""
    word_index = jnp.arange(words.shape[-1], dtype=jnp.int32)
    pick = word_index == (element // per_word)[..., None]
    return jnp.sum(jnp.where(pick, words, 0), axis=-1)


def for_each_block(load, body, carry, *, steps: int, ahead: int):
    """carry = body(k, load(k), carry) for k in [0, steps), loads `ahead` blocks early.

    load(k) returns one block's values (k may run past steps - 1: the caller clamps,
    re-reading its last block rather than testing a bound per element). The ahead + 1
    blocks in flight live in fixed loop-carried buffers (the loop is unrolled that
    many times) and each is refilled right after its block is used: rotating them
    instead compiles to register copies, and a copy waits for the load it copies,
    which made deeper prefetching no faster. The last steps % (ahead + 1) blocks run
    after the loop from buffers it already filled.
    """
    if steps == 1:
        return body(0, load(0), carry)
    buffers = ahead + 1

    def turn(i, state):
        loaded, carry = state
        loaded = list(loaded)
        for j in range(buffers):
            k = i * buffers + j
            carry = body(k, loaded[j], carry)
            loaded[j] = load(k + buffers)
        return tuple(loaded), carry

    turns = steps // buffers
    first = tuple(load(k) for k in range(buffers))
    loaded, carry = lax.fori_loop(0, turns, turn, (first, carry))
    for j in range(steps % buffers):
        carry = body(turns * buffers + j, loaded[j], carry)
    return carry
