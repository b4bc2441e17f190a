"""The chunked LM-head cross-entropy against the unchunked optax one: value and gradients."""

import jax
import jax.numpy as jnp
import optax
import pytest

from twell_jax import lm_loss

B, S, H, V = 3, 12, 16, 50


def _inputs(dtype):
    k = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k[0], (B, S, H), jnp.float32).astype(dtype)
    head = 0.5 * jax.random.normal(k[1], (V, H), jnp.float32)
    targets = jax.random.randint(k[2], (B, S), 0, V)
    return x, head, targets


def _reference(x, head, targets):
    """optax CE of the logits as the model computes them (GEMM in x's dtype, fp32 softmax)."""
    logits = jnp.einsum("bsh,vh->bsv", x, head.astype(x.dtype)).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def _rel(a, b):
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


@pytest.mark.parametrize("chunk_tokens", [1 << 20, 12, 7, 1])  # 1, 3, 6 and 12 chunks
def test_fp32_value_and_gradients_match_the_unchunked_loss(chunk_tokens):
    x, head, targets = _inputs(jnp.float32)

    def loss(x, head):
        return lm_loss.cross_entropy(x, head, targets, chunk_tokens)

    value, (d_x, d_head) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, head)
    ref, (r_x, r_head) = jax.value_and_grad(_reference, argnums=(0, 1))(x, head, targets)
    assert float(jax.jit(loss)(x, head)) == pytest.approx(float(ref), rel=1e-6)  # no grad
    assert float(value) == pytest.approx(float(ref), rel=1e-6)
    assert _rel(d_x, r_x) < 1e-6 and _rel(d_head, r_head) < 1e-6
    assert d_x.dtype == jnp.float32 and d_head.dtype == jnp.float32


def test_bf16_matches_autodiff_within_bf16_rounding():
    x, head, targets = _inputs(jnp.bfloat16)

    def loss(x, head):
        return lm_loss.cross_entropy(x, head, targets, 7)

    value, (d_x, d_head) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, head)
    ref, (r_x, r_head) = jax.value_and_grad(_reference, argnums=(0, 1))(x, head, targets)
    assert float(value) == pytest.approx(float(ref), rel=1e-6)
    assert d_x.dtype == jnp.bfloat16 and _rel(d_x, r_x) < 1e-2
    # Plain autodiff rounds the head gradient's GEMM output to bf16; ours sums in fp32.
    assert d_head.dtype == jnp.float32 and _rel(d_head, r_head) < 1e-2


def test_the_cotangent_scales_the_gradients():
    x, head, targets = _inputs(jnp.float32)
    d_x = jax.grad(lambda x: 3.0 * lm_loss.cross_entropy(x, head, targets, 12))(x)
    r_x = jax.grad(lambda x: 3.0 * _reference(x, head, targets))(x)
    assert _rel(d_x, r_x) < 1e-6


def test_seq_chunk_picks_a_divisor_of_the_sequence():
    assert lm_loss.seq_chunk(8, 2048, 4096) == 512
    assert lm_loss.seq_chunk(3, 12, 7) == 2  # 7 // 3 = 2 divides 12
    assert lm_loss.seq_chunk(1, 13, 8) == 1  # 13 is prime
    assert lm_loss.seq_chunk(64, 2048, 16) == 1  # at least one position
    assert lm_loss.seq_chunk(2, 16, 1 << 20) == 16
    with pytest.raises(ValueError, match="chunk_tokens=0"):
        lm_loss.seq_chunk(1, 8, 0)
