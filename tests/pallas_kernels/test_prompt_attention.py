"""prompt_attention against an fp32 numpy reference: kernel, cache update, masks, errors.

Every numeric test runs the kernel in the Pallas interpreter and, marked gpu, compiled
on the GPU, and the XLA backend beside them. Tolerance as for decode_attention: o is a
convex combination of bf16 values rounded twice on the way (the probabilities fed to
P . V and the output), so |o - truth| <= max|v| / 128. The cache update is exact.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.prompt_attention import (
    PromptAttentionConfig,
    _kernel_attention,
    prompt_attention,
)
from tests.lowering import count_triton_calls
from tests.pallas_kernels.attention_requests import assert_refuses_unsupported_requests

# Small blocks so that short prompts span several query and key blocks.
SMALL = PromptAttentionConfig(block_q=32, block_k=16, num_warps=4)
IMPLS = [
    pytest.param(("interpret", SMALL), id="interpret"),
    pytest.param(("interpret", PromptAttentionConfig(block_q=16, block_k=16)), id="interpret_16"),
    pytest.param(("xla", SMALL), id="xla"),
    pytest.param(("pallas", SMALL), id="gpu_small", marks=pytest.mark.gpu),
    pytest.param(("pallas", PromptAttentionConfig()), id="gpu_default", marks=pytest.mark.gpu),
]


def _bf16(a):
    return np.asarray(jnp.asarray(a, jnp.bfloat16), np.float32)


def make_case(seed, b, s, t, n_heads, kv, d, q_scale=1.0):
    """Random bf16 qkv [B, S, F], fp32 angles [B, S, D / 2], caches of garbage (slots
    past S must stay as they are)."""
    rng = np.random.default_rng(seed)
    qkv = rng.standard_normal((b, s, (n_heads + 2 * kv) * d))
    qkv[..., : n_heads * d] *= q_scale
    angles = rng.uniform(0, 2 * np.pi, (b, s, d // 2))
    cache_k, cache_v = (rng.standard_normal((b, t, kv, d)) for _ in range(2))
    return (
        jnp.asarray(qkv, jnp.bfloat16),
        jnp.asarray(np.cos(angles), jnp.float32),
        jnp.asarray(np.sin(angles), jnp.float32),
        jnp.asarray(cache_k, jnp.bfloat16),
        jnp.asarray(cache_v, jnp.bfloat16),
    )


def reference(qkv, cos, sin, pad, n_heads, kv):
    """(o [B, S, nH D], keys, values [B, S, nKV, D]) in fp32 numpy from the definition:
    rotate-half RoPE rounded to bf16; query q of row b sees slots pad[b]..q, a padding
    query (q < pad[b]) only itself."""
    x = np.asarray(qkv, np.float32)
    b, s, f = x.shape
    d = f // (n_heads + 2 * kv)
    g = n_heads // kv
    c, sn = np.asarray(cos)[:, :, None], np.asarray(sin)[:, :, None]

    def rope(heads):  # [B, S, heads, D]
        x1, x2 = heads[..., : d // 2], heads[..., d // 2 :]
        return _bf16(np.concatenate([x1 * c - x2 * sn, x2 * c + x1 * sn], axis=-1))

    q = rope(x[..., : n_heads * d].reshape(b, s, n_heads, d))
    k = rope(x[..., n_heads * d : (n_heads + kv) * d].reshape(b, s, kv, d))
    v = x[..., (n_heads + kv) * d :].reshape(b, s, kv, d)
    o = np.zeros((b, s, n_heads, d), np.float32)
    for row in range(b):
        for i in range(s):
            seen = np.arange(s)
            seen = seen[(seen <= i) & ((seen >= pad[row]) | (seen == i))]
            for head in range(n_heads):
                scores = k[row, seen, head // g] @ q[row, i, head] / math.sqrt(d)
                p = np.exp(scores - scores.max())
                o[row, i, head] = (p / p.sum()) @ v[row, seen, head // g]
    return o.reshape(b, s, n_heads * d), k, v


# (b, s, t, n_heads, kv, d, pad): multi-head; grouped (4 per kv head) over several
# query blocks with S not a multiple of any block; a prompt shorter than one block;
# a row that is all padding but its last token; head_dim 64.
CASES = [
    pytest.param(2, 40, 48, 4, 4, 16, (0, 7), id="mha"),
    pytest.param(3, 70, 70, 8, 2, 32, (0, 16, 50), id="gqa4"),
    pytest.param(1, 5, 9, 2, 1, 16, (2,), id="shorter_than_a_block"),
    pytest.param(2, 24, 30, 4, 2, 16, (23, 0), id="one_real_token"),
    pytest.param(1, 33, 33, 2, 2, 64, (3,), id="d64"),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("b, s, t, n_heads, kv, d, pad", CASES)
def test_matches_reference(impl, b, s, t, n_heads, kv, d, pad):
    impl, config = impl
    case = make_case(b * s + d, b, s, t, n_heads, kv, d)
    pad_arr = jnp.asarray(pad, jnp.int32)
    run = jax.jit(functools.partial(prompt_attention, n_heads=n_heads, impl=impl, config=config))
    o, ck, cv = run(*case, pad_arr)
    want_o, k, v = reference(*case[:3], np.asarray(pad), n_heads, kv)
    bound = np.abs(v).max() / 128
    assert o.shape == want_o.shape and o.dtype == jnp.bfloat16
    # every real query; padding queries' outputs are never read
    real = np.arange(s)[None, :] >= np.asarray(pad)[:, None]
    err = np.abs(np.asarray(o, np.float32) - want_o).max(axis=-1)
    assert err[real].max() <= bound
    assert np.isfinite(np.asarray(o, np.float32)).all()
    # slots 0..S-1 hold the prompt's keys / values, the rest is untouched
    want_k, want_v = np.asarray(case[3], np.float32), np.asarray(case[4], np.float32)
    want_k[:, :s], want_v[:, :s] = k, v
    np.testing.assert_array_equal(np.asarray(ck, np.float32), want_k)
    np.testing.assert_array_equal(np.asarray(cv, np.float32), want_v)


@pytest.mark.parametrize("impl", IMPLS)
def test_large_scores_stay_finite(impl):
    """Scores in the hundreds (q scaled by 40): the online softmax subtracts its running
    max, so nothing overflows and o still matches."""
    impl, config = impl
    case = make_case(5, 2, 40, 40, 4, 2, 32, q_scale=40.0)
    pad = np.asarray([0, 30])
    o, _, _ = prompt_attention(*case, jnp.asarray(pad), n_heads=4, impl=impl, config=config)
    want_o, _, v = reference(*case[:3], pad, 4, 2)
    o = np.asarray(o, np.float32)
    assert np.isfinite(o).all()
    assert np.abs(o[0] - want_o[0]).max() <= np.abs(v).max() / 128
    assert np.abs(o[1, 30:] - want_o[1, 30:]).max() <= np.abs(v).max() / 128


def _args(b=2, s=8, t=10, n_heads=4, kv=2, d=16, dtype=jnp.bfloat16):
    return (
        jnp.zeros((b, s, (n_heads + 2 * kv) * d), dtype),
        jnp.zeros((b, s, d // 2)),
        jnp.zeros((b, s, d // 2)),
        jnp.zeros((b, t, kv, d), dtype),
        jnp.zeros((b, t, kv, d), dtype),
        jnp.zeros((b,), jnp.int32),
    )


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: (a[0][..., :-1], *a[1:]), "qkv must be"),
        (lambda a: (a[0][0], *a[1:]), "qkv must be"),
        (lambda a: (*a[:4], a[4][:, :-1], a[5]), "caches"),
        (lambda a: (a[0], a[1], a[2], a[3][:, :4], a[4][:, :4], a[5]), "S <= 4"),
        (lambda a: (*a[:5], jnp.zeros((3,), jnp.int32)), "pad must be"),
        (lambda a: (*a[:5], jnp.zeros((2,))), "pad must be an integer"),
        (lambda a: (a[0], a[1][:, 0], *a[2:]), r"cos must be \[B, S, head_dim / 2\]"),
        (lambda a: (*a[:2], a[2][:1], *a[3:]), r"sin must be"),
        (
            lambda a: (*a[:3], a[3].astype(jnp.float32), a[4].astype(jnp.float32), a[5]),
            "the caches must have qkv's dtype bfloat16, got float32",
        ),
    ],
    ids=[
        "qkv_width",
        "qkv_rank",
        "cache_shapes",
        "prompt_longer_than_cache",
        "pad_shape",
        "pad_dtype",
        "cos_without_s",
        "sin_batch",
        "cache_dtype",
    ],
)
def test_bad_inputs_raise(change, message):
    with pytest.raises(ValueError, match=message):
        prompt_attention(*change(_args()), n_heads=4)


def test_unsupported_requests_raise():
    assert_refuses_unsupported_requests(prompt_attention, _args)
    with pytest.raises(ValueError, match="block_k"):
        prompt_attention(*_args(), n_heads=4, impl="interpret",
                         config=PromptAttentionConfig(block_q=32, block_k=24))  # fmt: skip
    with pytest.raises(ValueError, match="multiple of"):
        prompt_attention(*_args(), n_heads=4, impl="interpret",
                         config=PromptAttentionConfig(block_q=16, block_k=32))  # fmt: skip


def test_auto_runs_xla_for_fp32_and_on_cpu():
    """fp32 (any backend) and this CPU run the XLA ops: exactly the "xla" result."""
    case = make_case(2, 2, 12, 16, 4, 2, 16)
    pad = jnp.asarray([0, 4], jnp.int32)
    for dtype in (jnp.float32, jnp.bfloat16):
        args = [a.astype(dtype) if a.dtype == jnp.bfloat16 else a for a in case]
        auto = prompt_attention(*args, pad, n_heads=4)
        xla = prompt_attention(*args, pad, n_heads=4, impl="xla")
        for a, c in zip(auto, xla, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(c))


@pytest.mark.parametrize(
    "b, s, n_heads, kv, d",
    [(8, 512, 32, 32, 64), (2, 1000, 32, 8, 128), (1, 24, 12, 4, 64)],
    ids=["1.5b_b8", "gqa_d128", "short"],
)
def test_cross_lowers_for_cuda(b, s, n_heads, kv, d):
    """The default launch lowers through Pallas -> Triton: one kernel per call (the
    RoPE and cache update around it are XLA's, as on the "xla" path)."""
    kernel = functools.partial(_kernel_attention, config=PromptAttentionConfig(), interpret=False)
    q = jnp.zeros((b, s, n_heads, d), jnp.bfloat16)
    kv_heads = jnp.zeros((b, s, kv, d), jnp.bfloat16)
    assert count_triton_calls(kernel, q, kv_heads, kv_heads, jnp.zeros((b,), jnp.int32)) == 1
