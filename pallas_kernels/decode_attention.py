"""Attention for one new token per row over a KV cache, in one kernel (docs/design.md §11).

    out, cache_k, cache_v = decode_attention(qkv, cos, sin, cache_k, cache_v, slot, pad,
                                             n_heads=32)

A decode step's attention block is small work spread over many small XLA kernels: the
RoPE of q and k, two cache updates, the q . K^T reduction, the masked softmax's
max / exp / sum and the P . V reduction, each a launch that costs more than its bytes
(docs/performance_notes.md, "Generation"). Here one program per (row b, key/value
head) does all of it:

1. loads its query heads and the new key and value from the row's fused q / k / v
   projection `qkv`, rotates q and k (RoPE, HF's rotate-half layout, rounded to the
   cache dtype as `rotate_half`, the model's RoPE, rounds) and writes the new key and
   value to cache slot `slot` (the caches are aliased in place);
2. streams the cached keys and values of slots pad[b] .. slot - 1 in blocks of
   `block_t`, with an online softmax in fp32 (scores q . k / sqrt(D) on tensor cores,
   bf16 inputs with fp32 sums, as XLA's attention computes them), the new token's
   score and value taken from registers;
3. writes o = softmax . V for its query heads, rounded once.

Only the slots the row can see are read: a row at position p reads p keys and values,
not the cache's whole length T.

Backends (`impl`): "pallas" (the kernel; bf16), "interpret" (the same kernel in the
Pallas interpreter, for CPU tests), "xla" (`cached_attention`: RoPE,
`dynamic_update_slice` and `jax.nn.dot_product_attention` with a mask, as the prompt's
attention runs; any dtype) and "auto" (pallas on a GPU for bf16 and supported shapes,
xla otherwise). The kernel differs from "xla" within bf16 rounding: XLA rounds the normalised
probabilities to bf16 before P . V, the kernel rounds the running, unnormalised ones.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import _triton as tr

IMPLS = tr.IMPLS
_F32 = jnp.float32
# Tensor-core dots need at least 16 rows: a key / value head's query heads are padded
# to this many.
_MIN_ROWS = 16


@dataclasses.dataclass(frozen=True)
class DecodeAttentionConfig:
    """The kernel's launch.

    block_t: cache slots per step of the key / value loop (a power of two, >= 16).
    num_warps, num_stages: Triton launch parameters of the loop.
    min_programs: the row's slots are split into up to `max_splits` (a power of two)
      ranges, each its own program, until B x nKV x splits reaches this; the splits'
      partial softmax sums are then combined by a second kernel. One row of 32 heads
      is otherwise 32 programs on a 132-SM card, each looping over every slot.
    """

    block_t: int = 128
    num_warps: int = 4
    num_stages: int = 3
    min_programs: int = 256
    max_splits: int = 16

    def splits(self, programs: int) -> int:
        """Slot ranges per (row, key / value head) for B x nKV = `programs`."""
        s = 1
        while s < self.max_splits and programs * s < self.min_programs:
            s *= 2
        return s

    def unsupported(self, head_dim: int, group: int, cache_elements: int) -> str | None:
        """Why the kernel cannot run this shape, or None."""
        if not tr.is_pow2(self.block_t) or self.block_t < 16:
            return f"DecodeAttentionConfig.block_t={self.block_t} must be a power of two >= 16"
        if not tr.is_pow2(self.max_splits):
            return f"DecodeAttentionConfig.max_splits={self.max_splits} must be a power of two"
        if not tr.is_pow2(head_dim) or head_dim < 16:
            return f"head_dim={head_dim} must be a power of two >= 16 for the kernel"
        if group > 128:
            return f"{group} query heads per key / value head: the kernel takes at most 128"
        if cache_elements >= 2**31:
            return f"a layer's cache has {cache_elements} elements: the kernel indexes in int32"
        return None


def _check_inputs(qkv, cos, sin, cache_k, cache_v, slot, pad, n_heads: int) -> None:
    if cache_k.ndim != 4 or cache_v.shape != cache_k.shape:
        raise ValueError(
            f"cache_k and cache_v must both be [B, T, n_kv_heads, head_dim], got "
            f"{cache_k.shape} and {cache_v.shape}"
        )
    check_heads_and_caches(qkv.dtype, cache_k, cache_v, pad, n_heads)
    b, _, kv, d = cache_k.shape
    if qkv.shape != (b, (n_heads + 2 * kv) * d):
        raise ValueError(
            f"qkv must be [B, (n_heads + 2 n_kv_heads) head_dim] = [{b}, "
            f"{(n_heads + 2 * kv) * d}], got {qkv.shape}"
        )
    for name, a in (("cos", cos), ("sin", sin)):
        if a.shape != (b, d // 2):
            raise ValueError(f"{name} must be [B, head_dim / 2] = [{b}, {d // 2}], got {a.shape}")
    if jnp.shape(slot) != () or not jnp.issubdtype(jnp.result_type(slot), jnp.integer):
        raise ValueError(f"slot must be an integer scalar, got shape {jnp.shape(slot)}")
    t = cache_k.shape[1]
    if not isinstance(slot, jax.core.Tracer) and not 0 <= int(slot) < t:
        raise ValueError(f"slot must be in [0, T) = [0, {t}), got {int(slot)}")


def check_heads_and_caches(dtype, cache_k, cache_v, pad, n_heads: int) -> None:
    """What the decode and prompt attention ops check alike, on caches already [B, T,
    nKV, D] of one shape: n_heads a multiple of nKV, an even head_dim, caches of qkv's
    `dtype`, and pad an integer [B]. Raises ValueError naming the operand."""
    b, _, kv, d = cache_k.shape
    if n_heads < 1 or n_heads % kv:
        raise ValueError(f"n_heads={n_heads} must be a positive multiple of n_kv_heads={kv}")
    if d % 2:
        raise ValueError(f"head_dim={d} must be even for RoPE")
    if cache_k.dtype != dtype or cache_v.dtype != dtype:
        raise ValueError(
            f"the caches must have qkv's dtype {dtype}, got {cache_k.dtype} / {cache_v.dtype}"
        )
    if jnp.shape(pad) != (b,) or not jnp.issubdtype(jnp.result_type(pad), jnp.integer):
        raise ValueError(f"pad must be an integer [B] = [{b}], got shape {jnp.shape(pad)}")


def rotate_half(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """RoPE (HF's rotate-half layout) of x [..., heads, D] with cos / sin [..., D / 2]
    fp32, in fp32, rounded to x's dtype; the model's `apply_rope`."""
    x1, x2 = jnp.split(x.astype(_F32), 2, axis=-1)
    c, s = cos[..., None, :], sin[..., None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def attention_mask(query_slots: jax.Array, pad: jax.Array, t: int) -> jax.Array:
    """Which cache slots each query sees: bool [B, 1, S, T].

    Query slot q of row b sees slots pad[b]..q (its real tokens so far); a padding
    query (q < pad[b]) sees only itself, so that its softmax stays finite (its output
    is never read).
    """
    keys = jnp.arange(t)[None, None, :]
    q = query_slots[None, :, None]
    real = (keys >= pad[:, None, None]) | (keys == q)
    return ((keys <= q) & real)[:, None]


def rope_and_cache(qkv, cos, sin, cache_k, cache_v, slot, n_heads: int):
    """S new tokens per row in XLA ops: (q [B, S, nH, D], k, v [B, S, nKV, D], cache_k,
    cache_v), q and k rotated (RoPE) and the new keys / values written to slots
    slot..slot+S-1. Shapes as `cached_attention`."""
    b, s, _ = qkv.shape
    kv, d = cache_k.shape[2:]
    q, k, v = jnp.split(qkv, [n_heads * d, (n_heads + kv) * d], axis=-1)
    q = rotate_half(q.reshape(b, s, n_heads, d), cos, sin)
    k = rotate_half(k.reshape(b, s, kv, d), cos, sin)
    v = v.reshape(b, s, kv, d)
    at = (0, slot, 0, 0)
    cache_k = lax.dynamic_update_slice(cache_k, k.astype(cache_k.dtype), at)
    cache_v = lax.dynamic_update_slice(cache_v, v.astype(cache_v.dtype), at)
    return q, k, v, cache_k, cache_v


def cached_attention(qkv, cos, sin, cache_k, cache_v, slot, pad, n_heads: int):
    """S new tokens per row in XLA ops: the prompt's attention, and "xla" for one token.

    qkv [B, S, (nH + 2 nKV) D]; cos, sin [B, S, D / 2] or [S, D / 2]; caches [B, T, nKV,
    D]. The new keys / values go to slots slot..slot+S-1, query slot q of row b attends
    to slots pad[b]..q (`attention_mask`). Returns (o [B, S, nH D], cache_k, cache_v).
    """
    b, s, _ = qkv.shape
    t, d = cache_k.shape[1], cache_k.shape[3]
    q, _, _, cache_k, cache_v = rope_and_cache(qkv, cos, sin, cache_k, cache_v, slot, n_heads)
    mask = attention_mask(slot + jnp.arange(s), pad, t)
    # XLA attention: cuDNN's flash attention takes no arbitrary (left-padding) mask.
    o = jax.nn.dot_product_attention(q, cache_k, cache_v, mask=mask, implementation="xla")
    return o.reshape(b, s, n_heads * d), cache_k, cache_v


# The running max before any slot is seen (a split or query block with none yet): finite,
# so that exp(m - max) is 0, not NaN.
EMPTY_MAX = -1e30


def _kernel(slot_ref, pad_ref, qkv_ref, cos_ref, sin_ref, ck_ref, cv_ref, *outs,
            b_size, t_len, kv, group, d, block_t, splits):  # fmt: skip
    """Program (b, h, s): key / value head h of row b, slot range s of `splits`.
    qkv_ref [B * F] and cos_ref / sin_ref [B * D / 2] are flat; the caches are
    [B * T * nKV, D] (row (b * T + t) * nKV + h). outs: (o [B * nH * D], ck, cv) for one
    split, else (m, total [B * nKV * S * G], acc [B * nKV * S * G * D] fp32, ck, cv), the
    partial softmax of each split for `_combine_kernel`; ck / cv are the caches' buffers."""
    *results, ck_out, cv_out = outs
    b = tr.program_id(0, b_size)
    h = tr.program_id(1, kv)
    split = tr.program_id(2, splits)
    f = qkv_ref.shape[0] // b_size
    n_heads = group * kv
    slot = slot_ref[0]
    pad = pad_ref[b]
    half = d // 2
    cols = tr.iota(d)
    # RoPE as x * cos + swap(x) * (+-sin): swap exchanges the two halves of a head.
    cos = tr.load(cos_ref.at[b * half + cols % half])
    sin = tr.load(sin_ref.at[b * half + cols % half]) * jnp.where(cols < half, -1.0, 1.0)
    swapped = (cols + half) % d

    def rotated(first_col, rows_ok):
        """The rotated heads whose columns start at first_col [R]: [R, D] cache dtype."""
        at = b * f + first_col[:, None]
        x = tr.load(qkv_ref.at[at + cols[None, :]], mask=rows_ok[:, None], other=0)
        xs = tr.load(qkv_ref.at[at + swapped[None, :]], mask=rows_ok[:, None], other=0)
        return (x.astype(_F32) * cos[None, :] + xs.astype(_F32) * sin[None, :]).astype(x.dtype)

    gp = max(_MIN_ROWS, tr.next_pow2(group))
    r = tr.iota(gp)
    q_ok = r < group
    q = rotated((h * group + r) * d, q_ok)  # [Gp, D]; padded rows are zero
    one = tr.iota(1)
    k_new = rotated((n_heads + h + one) * d, one == 0)  # [1, D]
    v_new = tr.load(qkv_ref.at[b * f + (n_heads + kv + h + one[:, None]) * d + cols[None, :]])
    new_row = ((b * t_len + slot) * kv + h + one)[:, None]
    first_split = jnp.broadcast_to(split == 0, (1, d))
    tr.store(ck_out.at[new_row, cols[None, :]], k_new, mask=first_split)
    tr.store(cv_out.at[new_row, cols[None, :]], v_new, mask=first_split)

    scale = 1.0 / math.sqrt(d)
    # Split 0's online softmax starts from the new token (its score, weight 1 and
    # value), the others' from nothing.
    m = jnp.sum(q.astype(_F32) * k_new.astype(_F32), axis=1) * scale  # [Gp]
    m = jnp.where(split == 0, m, EMPTY_MAX)
    total = jnp.where(split == 0, jnp.ones((gp,), _F32), 0)
    acc = jnp.where(split == 0, jnp.broadcast_to(v_new.astype(_F32), (gp, d)), 0)

    def step(j, carry):
        m, total, acc = carry
        t = j * block_t + tr.iota(block_t)
        seen = (t >= pad) & (t < slot)
        rows = ((b * t_len + t) * kv + h)[:, None]
        keys = tr.load(ck_ref.at[rows, cols[None, :]], mask=seen[:, None], other=0)
        s = lax.dot_general(q, keys, (((1,), (1,)), ((), ())), preferred_element_type=_F32)
        s = jnp.where(seen[None, :], s * scale, -jnp.inf)  # [Gp, block_t]
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        vals = tr.load(cv_ref.at[rows, cols[None, :]], mask=seen[:, None], other=0)
        pv = jnp.dot(p.astype(vals.dtype), vals, preferred_element_type=_F32)
        return m_new, total * alpha + jnp.sum(p, axis=1), acc * alpha[:, None] + pv

    first, last = pad // block_t, (slot + block_t - 1) // block_t
    per_split = (last - first + splits - 1) // splits
    lo = first + split * per_split
    m, total, acc = lax.fori_loop(lo, jnp.minimum(lo + per_split, last), step, (m, total, acc))
    if splits == 1:
        (out_ref,) = results
        at = b * n_heads * d + ((h * group + r) * d)[:, None] + cols[None, :]
        tr.store(out_ref.at[at], (acc / total[:, None]).astype(out_ref.dtype), mask=q_ok[:, None])
        return
    m_ref, total_ref, acc_ref = results
    at = ((b * kv + h) * splits + split) * group + r  # [Gp]
    tr.store(m_ref.at[at], m, mask=q_ok)
    tr.store(total_ref.at[at], total, mask=q_ok)
    tr.store(acc_ref.at[at[:, None] * d + cols[None, :]], acc, mask=q_ok[:, None])


def _combine_kernel(m_ref, total_ref, acc_ref, out_ref, *, b_size, kv, group, d, splits):
    """Program (b, h): o of key / value head h's query heads of row b from the splits'
    partial softmax sums (`_kernel`'s outputs), rounded once to out_ref's dtype."""
    b = tr.program_id(0, b_size)
    h = tr.program_id(1, kv)
    gp = tr.next_pow2(group)
    r = tr.iota(gp)
    ok = r < group
    cols = tr.iota(d)
    base = (b * kv + h) * splits * group + r  # split 0's entries of these heads
    ms = [tr.load(m_ref.at[base + s * group], mask=ok, other=0) for s in range(splits)]
    m = functools.reduce(jnp.maximum, ms)
    total, acc = jnp.zeros((gp,), _F32), jnp.zeros((gp, d), _F32)
    for s in range(splits):
        w = jnp.exp(ms[s] - m)
        at = (base + s * group)[:, None] * d + cols[None, :]
        total = total + w * tr.load(total_ref.at[base + s * group], mask=ok, other=0)
        acc = acc + w[:, None] * tr.load(acc_ref.at[at], mask=ok[:, None], other=0)
    at = (b * kv * group + h * group + r)[:, None] * d + cols[None, :]
    tr.store(out_ref.at[at], (acc / total[:, None]).astype(out_ref.dtype), mask=ok[:, None])


def _kernel_attention(qkv, cos, sin, cache_k, cache_v, slot, pad, n_heads: int,
                      config: DecodeAttentionConfig, interpret: bool):  # fmt: skip
    b, t, kv, d = cache_k.shape
    group, splits = n_heads // kv, config.splits(b * kv)
    kernel = functools.partial(
        _kernel, b_size=b, t_len=t, kv=kv, group=group, d=d, block_t=config.block_t,
        splits=splits,
    )  # fmt: skip
    if splits == 1:
        results = (jax.ShapeDtypeStruct((b * n_heads * d,), qkv.dtype),)
    else:
        entries = b * kv * splits * group
        results = (jax.ShapeDtypeStruct((entries,), _F32),) * 2 + (
            jax.ShapeDtypeStruct((entries * d,), _F32),
        )
    n = len(results)
    *results, ck, cv = tr.pallas_call(
        kernel,
        out_shape=(
            *results,
            jax.ShapeDtypeStruct((b * t * kv, d), cache_k.dtype),
            jax.ShapeDtypeStruct((b * t * kv, d), cache_v.dtype),
        ),
        grid=(b, kv, splits),
        input_output_aliases={5: n, 6: n + 1},
        compiler_params=tr.compiler_params(config.num_warps, config.num_stages),
        interpret=interpret,
        name="decode_attention",
    )(
        jnp.reshape(slot, (1,)).astype(jnp.int32),
        pad.astype(jnp.int32),
        qkv.reshape(-1),
        cos.astype(_F32).reshape(-1),
        sin.astype(_F32).reshape(-1),
        cache_k.reshape(b * t * kv, d),
        cache_v.reshape(b * t * kv, d),
    )
    if splits > 1:
        results = [
            tr.pallas_call(
                functools.partial(
                    _combine_kernel, b_size=b, kv=kv, group=group, d=d, splits=splits
                ),
                out_shape=jax.ShapeDtypeStruct((b * n_heads * d,), qkv.dtype),
                grid=(b, kv),
                compiler_params=tr.compiler_params(1, 1),
                interpret=interpret,
                name="decode_attention_combine",
            )(*results)
        ]
    (out,) = results
    return out.reshape(b, n_heads * d), ck.reshape(cache_k.shape), cv.reshape(cache_v.shape)


def decode_attention(
    qkv: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    cache_k: jax.Array,
    cache_v: jax.Array,
    slot: jax.Array,
    pad: jax.Array,
    *,
    n_heads: int,
    impl: str = "auto",
    config: DecodeAttentionConfig = DecodeAttentionConfig(),
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Causal attention of one new token per row, with RoPE and the cache update.

    Args:
      qkv: [B, (n_heads + 2 nKV) D], the new tokens' fused q / k / v projection (q's
        heads, then k's, then v's; not rotated).
      cos, sin: [B, D / 2] fp32 RoPE angles of each row's position.
      cache_k, cache_v: [B, T, nKV, D] in qkv's dtype; the new key / value go to `slot`.
      slot: int32 scalar, the cache slot of the new tokens (the same for every row), in
        [0, T). A traced slot past the cache is clamped to T - 1 on every path, as
        `lax.dynamic_update_slice` clamps it in XLA's; the kernel must not write into
        the next row's cache.
      pad: int32 [B], each row's first real slot: row b attends to slots pad[b]..slot.
      n_heads: query heads (a multiple of nKV: grouped-query attention).
      impl: "auto", "pallas", "interpret" or "xla" (module docstring).
      config: the kernel's launch.

    Returns:
      (o [B, n_heads D] in qkv's dtype, cache_k, cache_v): the caches with slot written
      (in place when donated).

    Raises:
      ValueError: shapes or dtypes that do not match, a concrete slot outside [0, T),
        an unknown impl, or a kernel impl asked for a dtype other than bf16 or a shape
        the kernel cannot run.
    """
    _check_inputs(qkv, cos, sin, cache_k, cache_v, slot, pad, n_heads)
    b, t, kv, d = cache_k.shape
    slot = jnp.clip(slot, 0, t - 1)
    reason = config.unsupported(d, n_heads // kv, b * t * kv * d)
    impl = tr.resolve_impl(impl, qkv.dtype, reason, "qkv")
    if impl == "xla":
        o, cache_k, cache_v = cached_attention(
            qkv[:, None], cos[:, None], sin[:, None], cache_k, cache_v, slot, pad, n_heads
        )
        return o[:, 0], cache_k, cache_v
    return _kernel_attention(
        qkv, cos, sin, cache_k, cache_v, slot, pad, n_heads, config, impl == "interpret"
    )
