"""The prompt's attention in generation, as one flash-attention kernel (docs/design.md §11).

    out, cache_k, cache_v = prompt_attention(qkv, cos, sin, cache_k, cache_v, pad,
                                             n_heads=32)

A prefill writes its S tokens per row to cache slots 0..S-1 and attends causally among
them. XLA's attention (`cached_attention`) materialises the fp32 scores [B, nH, S, T]
over the cache's whole length T, with their softmax and the transposes around them as
separate kernels: at 8 prompts of 512 tokens on the 1.5B preset those took ~475 µs of
a layer's ~1080 µs, more than the FFN (docs/performance_notes.md, "Generation").

Here q and k are rotated and the cache written in XLA (`rope_and_cache`, as for the
XLA path), then one program per (block of `block_q` queries, row b, query head h)
streams the row's keys and values of its key / value head (grouped-query attention:
h // (nH / nKV)) up to its last query, `block_k` slots at a time, with an online
softmax in fp32: scores q . k / sqrt(D) on tensor cores (bf16 inputs, fp32 sums), the
probabilities rounded to bf16 for P . V, the output rounded once. The mask is
`attention_mask`'s: query q of row b sees slots pad[b]..q, a padding query (q < pad[b])
only itself, so every softmax has a term. Nothing of size S x S reaches memory.

Backends (`impl`): "pallas" (the kernel; bf16), "interpret" (the same kernel in the
Pallas interpreter, for CPU tests), "xla" (`cached_attention` at slot 0; any dtype)
and "auto" (pallas on a GPU for bf16 and supported shapes, xla otherwise). The kernel
differs from "xla" within bf16 rounding: XLA rounds the normalised probabilities to
bf16 before P . V, the kernel the running, unnormalised ones.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _triton as tr
from pallas_kernels.decode_attention import (
    EMPTY_MAX,
    cached_attention,
    check_heads_and_caches,
    rope_and_cache,
)

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class PromptAttentionConfig:
    """The kernel's launch: block_q queries per program, block_k slots per step of its
    key / value loop (powers of two >= 16; block_q a multiple of block_k), and Triton's
    num_warps and num_stages. The defaults were the fastest of a launch sweep on the
    H200 (docs/performance_notes.md, "Generation")."""

    block_q: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 2

    def unsupported(self, head_dim: int, elements: int) -> str | None:
        """Why the kernel cannot run this head size, or None (elements: the largest of
        q's and the caches' element counts)."""
        for name in ("block_q", "block_k"):
            v = getattr(self, name)
            if not tr.is_pow2(v) or v < 16:
                return f"PromptAttentionConfig.{name}={v} must be a power of two >= 16"
        if self.block_q % self.block_k:
            return (
                f"PromptAttentionConfig.block_q={self.block_q} must be a multiple of "
                f"block_k={self.block_k}"
            )
        if not tr.is_pow2(head_dim) or head_dim < 16:
            return f"head_dim={head_dim} must be a power of two >= 16 for the kernel"
        if elements >= 2**31:
            return f"{elements} elements in one operand: the kernel indexes in int32"
        return None


def _kernel(pad_ref, q_ref, k_ref, v_ref, o_ref, *, b_size, s_len, n_heads, kv, block_q, block_k):
    """Program (i, b, h): queries i*block_q .. of row b, query head h. q_ref / o_ref are
    [B * S * nH, D] (row (b * S + s) * nH + h), k_ref / v_ref [B * S * nKV, D]."""
    d = q_ref.shape[1]
    i = tr.program_id(0, pl.cdiv(s_len, block_q))
    b = tr.program_id(1, b_size)
    h = tr.program_id(2, n_heads)
    hk = h // (n_heads // kv)
    pad = pad_ref[b]
    cols = tr.iota(d)
    sq = i * block_q + tr.iota(block_q)
    q_rows = ((b * s_len + sq) * n_heads + h)[:, None]
    q_ok = (sq < s_len)[:, None]
    q = tr.load(q_ref.at[q_rows, cols[None, :]], mask=q_ok, other=0)
    scale = 1.0 / math.sqrt(d)

    def step(j, carry):
        m, total, acc = carry
        t = j * block_k + tr.iota(block_k)
        rows = ((b * s_len + t) * kv + hk)[:, None]
        in_row = (t < s_len)[:, None]
        keys = tr.load(k_ref.at[rows, cols[None, :]], mask=in_row, other=0)
        s = lax.dot_general(q, keys, (((1,), (1,)), ((), ())), preferred_element_type=_F32)
        sees = (t[None, :] <= sq[:, None]) & ((t[None, :] >= pad) | (t[None, :] == sq[:, None]))
        s = jnp.where(sees, s * scale, -jnp.inf)  # [block_q, block_k]
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        vals = tr.load(v_ref.at[rows, cols[None, :]], mask=in_row, other=0)
        pv = jnp.dot(p.astype(vals.dtype), vals, preferred_element_type=_F32)
        return m_new, total * alpha + jnp.sum(p, axis=1), acc * alpha[:, None] + pv

    start = (
        jnp.full((block_q,), EMPTY_MAX, _F32),
        jnp.zeros((block_q,), _F32),
        jnp.zeros((block_q, d), _F32),
    )
    # Causal: the key blocks up to this block's last query.
    last = ((i + 1) * block_q + block_k - 1) // block_k
    _, total, acc = lax.fori_loop(0, last, step, start)
    tr.store(o_ref.at[q_rows, cols[None, :]], (acc / total[:, None]).astype(o_ref.dtype), mask=q_ok)


def _kernel_attention(q, k, v, pad, config: PromptAttentionConfig, interpret: bool):
    """o [B, S, nH D] of rotated q [B, S, nH, D] and k, v [B, S, nKV, D]."""
    b, s, n_heads, d = q.shape
    kv = k.shape[2]
    kernel = functools.partial(
        _kernel, b_size=b, s_len=s, n_heads=n_heads, kv=kv, block_q=config.block_q,
        block_k=config.block_k,
    )  # fmt: skip
    out = tr.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((b * s * n_heads, d), q.dtype),
        grid=(pl.cdiv(s, config.block_q), b, n_heads),
        compiler_params=tr.compiler_params(config.num_warps, config.num_stages),
        interpret=interpret,
        name="prompt_attention",
    )(
        pad.astype(jnp.int32),
        q.reshape(-1, d),
        k.reshape(-1, d),
        v.reshape(-1, d),
    )
    return out.reshape(b, s, n_heads * d)


def prompt_attention(
    qkv: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    cache_k: jax.Array,
    cache_v: jax.Array,
    pad: jax.Array,
    *,
    n_heads: int,
    impl: str = "auto",
    config: PromptAttentionConfig = PromptAttentionConfig(),
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Causal attention among a prompt's S tokens per row, with RoPE and the cache update.

    Args:
      qkv: [B, S, (n_heads + 2 nKV) D], the prompt's fused q / k / v projection (q's
        heads, then k's, then v's; not rotated).
      cos, sin: [B, S, D / 2] or [S, D / 2] fp32 RoPE angles of the tokens' positions.
      cache_k, cache_v: [B, T, nKV, D] in qkv's dtype, T >= S; the prompt's keys and
        values go to slots 0..S-1.
      pad: int32 [B], each row's first real slot: query q of row b attends to slots
        pad[b]..q.
      n_heads: query heads (a multiple of nKV: grouped-query attention).
      impl: "auto", "pallas", "interpret" or "xla" (module docstring).
      config: the kernel's launch.

    Returns:
      (o [B, S, n_heads D] in qkv's dtype, cache_k, cache_v).

    Raises:
      ValueError: shapes that do not match, an unknown impl, or a kernel impl asked for
        a dtype other than bf16 or a shape the kernel cannot run.
    """
    if qkv.ndim != 3 or cache_k.ndim != 4 or cache_v.shape != cache_k.shape:
        raise ValueError(
            f"qkv must be [B, S, F] and the caches [B, T, n_kv_heads, head_dim] alike, got "
            f"{qkv.shape}, {cache_k.shape} and {cache_v.shape}"
        )
    check_heads_and_caches(qkv.dtype, cache_k, cache_v, pad, n_heads)
    (b, s, f), (_, t, kv, d) = qkv.shape, cache_k.shape
    if f != (n_heads + 2 * kv) * d or cache_k.shape[0] != b or s > t:
        raise ValueError(
            f"qkv must be [B, S, (n_heads + 2 n_kv_heads) head_dim] = [{b}, S <= {t}, "
            f"{(n_heads + 2 * kv) * d}] for caches {cache_k.shape}, got {qkv.shape}"
        )
    for name, a in (("cos", cos), ("sin", sin)):
        if a.shape not in ((b, s, d // 2), (s, d // 2)):
            raise ValueError(
                f"{name} must be [B, S, head_dim / 2] = [{b}, {s}, {d // 2}] or [S, head_dim / "
                f"2], got {a.shape}"
            )
    reason = config.unsupported(d, max(b * s * n_heads * d, b * t * kv * d))
    impl = tr.resolve_impl(impl, qkv.dtype, reason, "qkv")
    if impl == "xla":
        return cached_attention(qkv, cos, sin, cache_k, cache_v, 0, pad, n_heads)
    q, k, v, cache_k, cache_v = rope_and_cache(qkv, cos, sin, cache_k, cache_v, 0, n_heads)
    return _kernel_attention(q, k, v, pad, config, impl == "interpret"), cache_k, cache_v
