"""decode_attention against an fp32 numpy reference: kernel, cache update, masks, errors.

Every numeric test runs the kernel in the Pallas interpreter and, marked gpu, compiled
on the GPU, and the XLA backend beside them. Tolerance: o is a convex combination of
bf16 values rounded twice on the way (the probabilities fed to P . V and the output),
so |o - truth| <= max|v| / 128 (4 bf16 ulps of the largest value). The cache update
is exact: the new key is rotated in fp32 and rounded once, as the model's RoPE does.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.decode_attention import DecodeAttentionConfig, decode_attention
from tests.lowering import count_triton_calls
from tests.pallas_kernels.attention_requests import assert_refuses_unsupported_requests

# SPLIT splits each row's slots over up to 4 programs (its second kernel combines
# them); WHOLE keeps one program per (row, key / value head).
SPLIT = DecodeAttentionConfig(block_t=16, max_splits=4)
WHOLE = DecodeAttentionConfig(block_t=16, max_splits=1)
IMPLS = [
    pytest.param(("interpret", SPLIT), id="interpret_split"),
    pytest.param(("interpret", WHOLE), id="interpret_whole"),
    pytest.param(("xla", SPLIT), id="xla"),
    pytest.param(("pallas", SPLIT), id="gpu_split", marks=pytest.mark.gpu),
    pytest.param(("pallas", WHOLE), id="gpu_whole", marks=pytest.mark.gpu),
]


def make_case(seed, b, t, n_heads, kv, d, q_scale=1.0):
    """Random bf16 qkv and caches, fp32 angles of random positions."""
    rng = np.random.default_rng(seed)
    qkv = rng.standard_normal((b, (n_heads + 2 * kv) * d))
    qkv[:, : n_heads * d] *= q_scale
    angles = rng.uniform(0, 2 * np.pi, (b, d // 2))
    cache_k, cache_v = (rng.standard_normal((b, t, kv, d)) for _ in range(2))
    return (
        jnp.asarray(qkv, jnp.bfloat16),
        jnp.asarray(np.cos(angles), jnp.float32),
        jnp.asarray(np.sin(angles), jnp.float32),
        jnp.asarray(cache_k, jnp.bfloat16),
        jnp.asarray(cache_v, jnp.bfloat16),
    )


def _bf16(a):
    return np.asarray(jnp.asarray(a, jnp.bfloat16), np.float32)


def reference(qkv, cos, sin, cache_k, cache_v, slot, pad, n_heads):
    """(o [B, nH D], new key [B, nKV, D], new value) in fp32 numpy, straight from the
    definition: rotate-half RoPE rounded to bf16, softmax over slots pad..slot."""
    b, _, kv, d = cache_k.shape
    g = n_heads // kv
    x = np.asarray(qkv, np.float32)
    c, s = np.asarray(cos)[:, None], np.asarray(sin)[:, None]

    def rope(heads):  # [B, heads, D]
        x1, x2 = heads[..., : d // 2], heads[..., d // 2 :]
        return _bf16(np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1))

    q = rope(x[:, : n_heads * d].reshape(b, n_heads, d))
    k_new = rope(x[:, n_heads * d : (n_heads + kv) * d].reshape(b, kv, d))
    v_new = x[:, (n_heads + kv) * d :].reshape(b, kv, d)
    keys = np.asarray(cache_k, np.float32).copy()
    vals = np.asarray(cache_v, np.float32).copy()
    keys[:, slot], vals[:, slot] = k_new, v_new
    o = np.zeros((b, n_heads, d), np.float32)
    for row in range(b):
        seen = slice(int(pad[row]), slot + 1)
        for head in range(n_heads):
            scores = keys[row, seen, head // g] @ q[row, head] / math.sqrt(d)
            p = np.exp(scores - scores.max())
            o[row, head] = (p / p.sum()) @ vals[row, seen, head // g]
    return o.reshape(b, n_heads * d), k_new, v_new


# (b, t, n_heads, kv, d, slot, pad): multi-head, grouped (4 and a padded 3 per kv head),
# slot 0 (the new token alone), a row that sees only its new token (pad == slot), blocks
# that end mid-cache, head_dim 128.
CASES = [
    pytest.param(2, 40, 4, 4, 16, 25, (0, 7), id="mha"),
    pytest.param(3, 70, 8, 2, 32, 69, (0, 16, 50), id="gqa4_full_cache"),
    pytest.param(1, 33, 6, 2, 16, 20, (1,), id="gqa3_padded_rows"),
    pytest.param(2, 16, 4, 2, 16, 0, (0, 0), id="slot0"),
    pytest.param(2, 24, 4, 4, 16, 9, (9, 2), id="row_sees_only_new"),
    pytest.param(1, 50, 2, 1, 128, 47, (13,), id="d128"),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("b, t, n_heads, kv, d, slot, pad", CASES)
def test_matches_reference(impl, b, t, n_heads, kv, d, slot, pad):
    impl, config = impl
    case = make_case(b * t + d, b, t, n_heads, kv, d)
    pad = jnp.asarray(pad, jnp.int32)
    run = jax.jit(functools.partial(decode_attention, n_heads=n_heads, impl=impl, config=config))
    o, ck, cv = run(*case, jnp.int32(slot), pad)
    want_o, k_new, v_new = reference(*case, slot, np.asarray(pad), n_heads)
    bound = np.abs(np.asarray(case[4], np.float32)).max() / 128
    assert o.shape == want_o.shape and o.dtype == jnp.bfloat16
    assert np.abs(np.asarray(o, np.float32) - want_o).max() <= bound
    # the new key / value at the slot, every other slot untouched
    want_k, want_v = np.asarray(case[3], np.float32), np.asarray(case[4], np.float32)
    want_k[:, slot], want_v[:, slot] = k_new, v_new
    np.testing.assert_array_equal(np.asarray(ck, np.float32), want_k)
    np.testing.assert_array_equal(np.asarray(cv, np.float32), want_v)


@pytest.mark.parametrize("impl", IMPLS)
def test_large_scores_stay_finite(impl):
    """Scores in the hundreds (q scaled by 40): the online softmax subtracts its running
    max, so nothing overflows and o still matches."""
    impl, config = impl
    case = make_case(5, 2, 64, 4, 2, 32, q_scale=40.0)
    pad = jnp.asarray([0, 30], jnp.int32)
    o, _, _ = decode_attention(*case, jnp.int32(60), pad, n_heads=4, impl=impl, config=config)
    want_o, _, _ = reference(*case, 60, np.asarray(pad), 4)
    assert np.isfinite(np.asarray(o, np.float32)).all()
    bound = np.abs(np.asarray(case[4], np.float32)).max() / 128
    assert np.abs(np.asarray(o, np.float32) - want_o).max() <= bound


def test_kernel_donated_in_a_loop_matches_xla():
    """Four steps in a jitted fori_loop with the caches carried (in place on a GPU):
    the kernel's caches equal XLA's and its outputs stay within the bound."""
    b, t, n_heads, kv, d = 2, 20, 4, 2, 16
    qkv, cos, sin, ck, cv = make_case(9, b, t, n_heads, kv, d)
    pad = jnp.asarray([0, 5], jnp.int32)

    @functools.partial(jax.jit, static_argnums=0)
    def steps(impl, ck, cv):
        def body(i, carry):
            ck, cv, acc = carry
            x = qkv * (1 + i).astype(qkv.dtype)  # a different token per step
            o, ck, cv = decode_attention(x, cos, sin, ck, cv, 10 + i, pad, n_heads=n_heads,
                                         impl=impl, config=SPLIT)  # fmt: skip
            return ck, cv, acc + o.astype(jnp.float32)

        return jax.lax.fori_loop(0, 4, body, (ck, cv, jnp.zeros((b, n_heads * d))))

    want, got = steps("xla", ck, cv), steps("interpret", ck, cv)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    assert np.abs(np.asarray(got[2]) - np.asarray(want[2])).max() <= 4 * 4.0 / 128


@pytest.mark.parametrize("impl", IMPLS)
def test_traced_slot_past_the_cache_writes_only_its_rows_last_slot(impl):
    """A slot past T that only a trace knows is clamped to T - 1, as XLA's update is:
    the kernel writes no other row's cache (row b's slot T is row b + 1's slot 0 in
    the kernel's flat layout)."""
    impl, config = impl
    b, t, n_heads, kv, d = 2, 24, 4, 2, 16
    case = make_case(3, b, t, n_heads, kv, d)
    pad = jnp.asarray([0, 4], jnp.int32)
    run = jax.jit(functools.partial(decode_attention, n_heads=n_heads, impl=impl, config=config))
    o, ck, cv = run(*case, jnp.int32(t + 3), pad)
    want_o, k_new, v_new = reference(*case, t - 1, np.asarray(pad), n_heads)
    want_k, want_v = np.asarray(case[3], np.float32), np.asarray(case[4], np.float32)
    want_k[:, t - 1], want_v[:, t - 1] = k_new, v_new
    np.testing.assert_array_equal(np.asarray(ck, np.float32), want_k)
    np.testing.assert_array_equal(np.asarray(cv, np.float32), want_v)
    bound = np.abs(want_v).max() / 128
    assert np.abs(np.asarray(o, np.float32) - want_o).max() <= bound


def _args(b=2, t=8, n_heads=4, kv=2, d=16, dtype=jnp.bfloat16):
    return (
        jnp.zeros((b, (n_heads + 2 * kv) * d), dtype),
        jnp.zeros((b, d // 2)),
        jnp.zeros((b, d // 2)),
        jnp.zeros((b, t, kv, d), dtype),
        jnp.zeros((b, t, kv, d), dtype),
        jnp.int32(3),
        jnp.zeros((b,), jnp.int32),
    )


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: (a[0][:, :-1], *a[1:]), "qkv must be"),
        (lambda a: (a[0], a[1][:, :-1], *a[2:]), "cos must be"),
        (lambda a: (*a[:4], a[4][:, :-1], *a[5:]), "cache_k and cache_v"),
        (lambda a: (*a[:3], a[3].astype(jnp.float32), a[4].astype(jnp.float32), *a[5:]), "dtype"),
        (lambda a: (*a[:5], jnp.zeros((2,), jnp.int32), a[6]), "slot must be"),
        (lambda a: (*a[:6], jnp.zeros((3,), jnp.int32)), "pad must be"),
        (lambda a: (*a[:5], jnp.int32(8), a[6]), r"slot must be in \[0, T\) = \[0, 8\)"),
        (lambda a: (*a[:5], -1, a[6]), "slot must be in"),
    ],
    ids=[
        "qkv_width",
        "cos_shape",
        "cache_shapes",
        "cache_dtype",
        "slot_shape",
        "pad_shape",
        "slot_past_cache",
        "slot_negative",
    ],
)
def test_bad_inputs_raise(change, message):
    with pytest.raises(ValueError, match=message):
        decode_attention(*change(_args()), n_heads=4)


def test_unsupported_requests_raise():
    assert_refuses_unsupported_requests(decode_attention, _args)
    with pytest.raises(ValueError, match="block_t"):
        decode_attention(*_args(), n_heads=4, impl="interpret",
                         config=DecodeAttentionConfig(block_t=24))  # fmt: skip
    with pytest.raises(ValueError, match="max_splits"):
        decode_attention(*_args(), n_heads=4, impl="interpret",
                         config=DecodeAttentionConfig(max_splits=3))  # fmt: skip


def test_auto_runs_xla_for_fp32_and_on_cpu():
    """fp32 (any backend) and this CPU run the XLA ops: exactly the "xla" result."""
    case = make_case(2, 2, 12, 4, 2, 16)
    pad = jnp.asarray([0, 4], jnp.int32)
    for dtype in (jnp.float32, jnp.bfloat16):
        args = [a.astype(dtype) if a.dtype == jnp.bfloat16 else a for a in case]
        auto = decode_attention(*args, jnp.int32(7), pad, n_heads=4)
        xla = decode_attention(*args, jnp.int32(7), pad, n_heads=4, impl="xla")
        for a, c in zip(auto, xla, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(c))


@pytest.mark.parametrize(
    "b, t, n_heads, kv, d",
    [(1, 768, 32, 32, 64), (8, 2048, 32, 8, 64), (3, 100, 12, 4, 128)],
    ids=["1.5b_b1", "gqa_b8", "d128"],
)
def test_cross_lowers_for_cuda(b, t, n_heads, kv, d):
    """Production launches (the default config) lower through Pallas -> Triton: the
    split kernel and its combine where B x nKV is below min_programs."""
    config = DecodeAttentionConfig()
    fn = functools.partial(decode_attention, n_heads=n_heads, impl="pallas", config=config)
    kernels = 1 if config.splits(b * kv) == 1 else 2
    assert count_triton_calls(fn, *_args(b, t, n_heads, kv, d)) == kernels


def test_splits_grow_until_enough_programs():
    config = DecodeAttentionConfig(min_programs=256, max_splits=16)
    assert [config.splits(p) for p in (1, 32, 100, 256, 512)] == [16, 8, 4, 1, 1]
