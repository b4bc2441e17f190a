"""Llama-style transformer with an activation-sparse FFN, in Flax NNX (docs/design.md §7).

    tokens -> embed -> [x + Attn(RMSNorm(x)); x + FFN(RMSNorm(x))] x L -> RMSNorm
           -> LM head (tied by default) -> logits, per-layer FFN stats

Parameters are fp32 masters cast to the compute dtype (bf16) at use; no biases; every
matrix is drawn from N(0, init_std). The L blocks are created with `nnx.vmap`, so every
block parameter carries a leading [L] axis, and run with `jax.lax.scan` (one compiled
layer, optional per-layer remat). FFN weights are stored [N, H] for all three matrices
(`w_down` is down_proj transposed: out = h @ w_down), the layout the kernels read.

FFN implementations (`ModelConfig.ffn_impl`, in `twell_jax.ffn`):
- "dense": XLA einsums with the hidden activation h materialised, so l1 / l0 / fired
  are exact. The baseline, and the CPU training path.
- "twell": `pallas_kernels.twell_gated_mlp` / `twell_mlp` (TwELL inference kernels,
  no sparse gradient); statistics are l0 and TwELL overflow counters only.
- "sparse": `pallas_kernels.sparse_gated_mlp_train` on layers whose `use_sparse` flag is
  set, the dense path on the others (the l0-cutoff switch, docs/design.md §7).
- "decode": `pallas_kernels.sparse_decode_mlp` (the gate GEMV, then only the active
  rows of W_up and W_down; docs/design.md §4.5), for generation's few tokens per step;
  inference only (its backward is no cheaper than dense); statistics l0 and the dense
  fallback flag.

Multi-device: trace the model under `jax.set_mesh(mesh)` with a `twell_jax.sharding`
mesh (`twell_jax.train` does); activations are then kept split over the batch and the
Pallas kernels run per batch shard in `shard_map`. Without a mesh in context the model
is single-device code.

    graphdef = twell_jax.train.model_graphdef(cfg)    # or nnx.split(Transformer(...))
    logits, stats = nnx.merge(graphdef, params)(tokens)
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import pallas_kernels
from pallas_kernels.decode_attention import rotate_half
from twell_jax import ffn, lm_loss, sharding
from twell_jax.config import ModelConfig

Stats = dict[str, jax.Array]


def attention_implementation(dtype: jnp.dtype, head_dim: int) -> str:
    """Picks `jax.nn.dot_product_attention`'s backend: cuDNN where it applies, else XLA.

    cuDNN flash attention is ~5x faster than XLA's on H200 (docs/design.md §9) but needs a GPU,
    a 16-bit dtype and head_dim a multiple of 8 up to 128.
    """
    cudnn_ok = (
        jax.default_backend() == "gpu"
        and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
        and head_dim % 8 == 0
        and head_dim <= 128
    )
    return "cudnn" if cudnn_ok else "xla"


def check_token_ids(tokens: Any, vocab_size: int, name: str = "tokens") -> None:
    """Raises ValueError naming the first id outside [0, vocab_size) and its index.

    An out-of-range id would otherwise gather garbage embeddings (NaN logits on some
    backends). Traced arrays are skipped (jitted code cannot raise on values, so the
    callers check host arrays before jitting), and so are arrays split over hosts.
    """
    if isinstance(tokens, jax.core.Tracer):
        return
    if isinstance(tokens, jax.Array) and not tokens.is_fully_addressable:
        return
    ids = np.asarray(tokens)
    bad = np.argwhere((ids < 0) | (ids >= vocab_size))
    if bad.size:
        index = tuple(int(i) for i in bad[0])
        raise ValueError(
            f"{name}[{', '.join(map(str, index))}] = {int(ids[index])} is not a token id: "
            f"ids must be in [0, vocab_size={vocab_size})"
        )


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], cfg: ModelConfig) -> nnx.Param:
    init = jax.nn.initializers.normal(stddev=cfg.init_std)
    return nnx.Param(init(rngs.params(), shape, cfg.weight_dtype))


class RMSNorm(nnx.Module):
    """y = x / rms(x) * scale, computed in fp32, returned in the compute dtype."""

    def __init__(self, cfg: ModelConfig):
        self.eps = cfg.norm_eps
        self.out_dtype = cfg.compute_dtype
        self.scale = nnx.Param(jnp.ones((cfg.d_model,), cfg.weight_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * self.scale[...].astype(jnp.float32)).astype(self.out_dtype)


def rope_angles(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos, sin of the RoPE angles at integer `positions` [...]: each [..., head_dim / 2] fp32."""
    inv_freq = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angles), jnp.sin(angles)


def rope_tables(seq_len: int, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos, sin of the RoPE angles of positions 0..S-1, each [S, head_dim / 2] fp32."""
    return rope_angles(jnp.arange(seq_len), head_dim, theta)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates the two halves of each head (Llama / HF "rotate_half" convention), in
    fp32, rounded to x's dtype (one definition with the decode attention's XLA path).

    Args:
      x: [B, S, heads, head_dim].
      cos, sin: [S, head_dim / 2] fp32 (positions shared by the batch) or
        [B, S, head_dim / 2] (per-row positions, e.g. left-padded prompts).
    """
    return rotate_half(x, cos, sin)


# Sequences per call of the attention block (per batch shard). cuDNN's backward keeps an
# fp32 dQ accumulator over its whole batch (16 MiB per 2048-token sequence at 32 heads of
# 64): at large micro-batches that set the training step's peak, so larger batches run
# the block in chunks (docs/performance_notes.md, "Training-step memory").
ATTENTION_CHUNK_SEQS = 32


def in_sequence_chunks(fn: Callable[[jax.Array], jax.Array], x: jax.Array) -> jax.Array:
    """`fn(x)` for a per-sequence fn: x [B, ...] -> [B, ...], run on chunks of at most
    `ATTENTION_CHUNK_SEQS` sequences of each batch shard when B is larger.

    A chunk takes the same rows of every shard (a [shards, rows] view of B), so it
    stays split over the mesh like B itself. The chunks are as even as their count
    allows (at most two sizes, so at most two compiles of fn's kernels).
    """
    b, shards = x.shape[0], sharding.batch_shards()
    per_shard = b // shards if b % shards == 0 else b
    chunks = -(-per_shard // ATTENTION_CHUNK_SEQS)
    if chunks == 1:
        return fn(x)
    view = x.reshape(b // per_shard, per_shard, *x.shape[1:])
    bounds = [per_shard * c // chunks for c in range(chunks + 1)]
    outs = []
    for start, stop in itertools.pairwise(bounds):
        out = fn(view[:, start:stop].reshape(-1, *x.shape[1:]))
        outs.append(out.reshape(b // per_shard, stop - start, *out.shape[1:]))
    return jnp.concatenate(outs, axis=1).reshape(b, *outs[0].shape[2:])


class Attention(nnx.Module):
    """Causal self-attention with RoPE and no biases; grouped-query when n_kv_heads <
    n_heads (each key / value head serves n_heads / n_kv_heads consecutive query heads,
    HF's `repeat_kv` order; `jax.nn.dot_product_attention` groups them itself)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        h, n, kv, d = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.dtype = cfg.compute_dtype
        self.wq = _normal(rngs, (h, n, d), cfg)
        self.wk = _normal(rngs, (h, kv, d), cfg)
        self.wv = _normal(rngs, (h, kv, d), cfg)
        self.wo = _normal(rngs, (n, d, h), cfg)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        """x: [B, S, H] compute dtype -> [B, S, H] compute dtype.

        q, k, v [B, S, nH or nKV, D] (q and k rotated by `apply_rope(., cos, sin)`),
        causal attention, then one 2-D product over the flattened (head, D) axis.
        Generation uses W_o as [H, nH D] instead (`twell_jax.serving`): at one token per
        call XLA compiles both this layout and the einsum over (head, D) into a slow
        reduction (docs/performance_notes.md, "Generation"). Runs on chunks of at most
        ATTENTION_CHUNK_SEQS sequences (`in_sequence_chunks`). The fp32 weights are
        read once outside the chunks (an FSDP mesh gathers each once) and cast inside
        them, so that the chunks' weight gradients add up in fp32.
        """
        wq, wk, wv = self.wq[...], self.wk[...], self.wv[...]
        n, d, h = self.wo.shape
        wo = self.wo[...].reshape(n * d, h)
        impl = attention_implementation(self.dtype, d)

        def block(x):
            proj = lambda w: jnp.einsum("bsh,hnd->bsnd", x, w.astype(self.dtype))
            q, k = apply_rope(proj(wq), cos, sin), apply_rope(proj(wk), cos, sin)
            o = jax.nn.dot_product_attention(q, k, proj(wv), is_causal=True, implementation=impl)
            return jnp.dot(o.reshape(*o.shape[:-2], n * d), wo.astype(self.dtype))

        return in_sequence_chunks(block, x)


class FeedForward(nnx.Module):
    """The FFN block, weights [N, H]: w_gate (gated variants), w_up, w_down."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        shape = (cfg.d_ff, cfg.d_model)
        if cfg.gated:
            self.w_gate = _normal(rngs, shape, cfg)
        self.w_up = _normal(rngs, shape, cfg)
        self.w_down = _normal(rngs, shape, cfg)

    def __call__(self, x: jax.Array, use_sparse: jax.Array) -> tuple[jax.Array, Stats]:
        """FFN of M tokens.

        Args:
          x: [M, H] compute dtype.
          use_sparse: bool scalar; with ffn_impl="sparse", run the sparse kernels.

        Returns:
          out [M, H] compute dtype, and stats {l1, l0: fp32 scalars, fired: [N] bool};
          ffn_impl="sparse" adds hot_share and tail_load (fp32, what the switch reads:
          `ffn.sparse`) and the int32 counters `ffn.SPARSE_COUNTERS`; ffn_impl="twell"
          gives {l0, max_tile_count, overflow_tiles} instead (see `ffn.twell`).
        """
        cfg = self.cfg
        names = ("w_gate", "w_up", "w_down") if cfg.gated else ("w_up", "w_down")
        w = {k: getattr(self, k)[...].astype(cfg.compute_dtype) for k in names}
        if cfg.ffn_impl == "twell":
            twell = lambda x, w: ffn.twell(x, w, cfg.twell_compression)
            return ffn.per_batch_shard(twell)(x, w)
        if cfg.ffn_impl == "decode":
            return ffn.per_batch_shard(ffn.decode)(x, w)
        if cfg.ffn_impl == "sparse":
            sparse = ffn.per_batch_shard(lambda x, w: ffn.sparse(x, w, cfg.sparse_ell_width))
            dense = ffn.per_batch_shard(lambda x, w: ffn.dense_counted(x, w, cfg.sparse_ell_width))
            return jax.lax.cond(use_sparse, sparse, dense, x, w)
        return ffn.dense(x, w, cfg.ffn_variant)


class Block(nnx.Module):
    """Pre-norm transformer layer: attention then FFN, each with a residual."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg)
        self.attn = Attention(cfg, rngs=rngs)
        self.ffn_norm = RMSNorm(cfg)
        self.ffn = FeedForward(cfg, rngs=rngs)

    def __call__(
        self, x: jax.Array, cos: jax.Array, sin: jax.Array, use_sparse: jax.Array
    ) -> tuple[jax.Array, Stats]:
        """x: [B, S, H] compute dtype -> ([B, S, H], this layer's FFN stats)."""
        x, ffn_in = self.ffn_input(x, cos, sin)
        out, stats = self.ffn(ffn_in, use_sparse)
        return x + out.reshape(x.shape), stats

    def ffn_input(
        self, x: jax.Array, cos: jax.Array, sin: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        """x: [B, S, H] -> (x after the attention residual [B, S, H], the FFN input
        [B * S, H]: that residual stream normalised)."""
        x = x + self.attn(self.attn_norm(x), cos, sin)
        b, s, h = x.shape
        return x, self.ffn_norm(x).reshape(b * s, h)


def _remat_policy(cfg: ModelConfig) -> Callable | None:
    """Remat policy of a layer: keep the sparse op's small ELL residuals (docs/design.md
    §6.4) rather than recompute them, unless `sparse_save_residuals` is off or the
    batch is split over several devices; recompute everything on the other paths.

    Split over devices, the residuals leave the op's `shard_map` split too, but XLA's GPU
    partitioner all-gathered them into the layer loop's stack: every device kept every
    token's residuals (8 x the memory on 8 GPUs) and paid an all-gather per layer
    (docs/performance_notes.md, "Training-step memory"). Recomputed, nothing crosses."""
    if cfg.ffn_impl != "sparse" or not cfg.sparse_save_residuals:
        return None
    if sharding.batch_shards() > 1:
        return None
    return jax.checkpoint_policies.save_only_these_names(pallas_kernels.RESIDUALS_NAME)


class Transformer(nnx.Module):
    """The language model. Parameter tree (pure-dict view):

    embed [V, H], lm_head [V, H] (untied only), final_norm.scale [H],
    blocks.{attn_norm,ffn_norm}.scale [L, H], blocks.attn.wq [L, H, nH, D],
    blocks.attn.{wk,wv} [L, H, nKV, D], blocks.attn.wo [L, nH, D, H],
    blocks.ffn.{w_gate,w_up,w_down} [L, N, H].
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = _normal(rngs, (cfg.vocab_size, cfg.d_model), cfg)
        if not cfg.tie_embeddings:
            self.lm_head = _normal(rngs, (cfg.vocab_size, cfg.d_model), cfg)
        keys = jax.random.split(rngs.params(), cfg.n_layers)
        self.blocks = nnx.vmap(lambda k: Block(cfg, rngs=nnx.Rngs(params=k)))(keys)
        self.final_norm = RMSNorm(cfg)

    def hidden_states(
        self, tokens: jax.Array, use_sparse: jax.Array | None = None
    ) -> tuple[jax.Array, Stats]:
        """Model body without the LM head, and the per-layer FFN statistics.

        Args:
          tokens: [B, S] int32 in [0, vocab_size), S <= seq_len (a concrete array with
            an id out of range is a ValueError, `check_token_ids`).
          use_sparse: [L] bool per-layer switch for ffn_impl="sparse" (default: all on).

        Returns:
          Final-norm hidden states [B, S, H] in the compute dtype, and the stats of
          `__call__`.
        """
        cfg = self.cfg
        check_token_ids(tokens, cfg.vocab_size)
        if use_sparse is None:
            use_sparse = jnp.ones((cfg.n_layers,), bool)
        x = sharding.constrain_batch(
            jnp.take(self.embed[...], tokens, axis=0).astype(cfg.compute_dtype)
        )
        cos, sin = rope_tables(tokens.shape[1], cfg.head_dim, cfg.rope_theta)
        graphdef, layers = nnx.split(self.blocks)

        def layer(x, xs):
            block_state, layer_use_sparse = xs
            x, stats = nnx.merge(graphdef, block_state)(x, cos, sin, layer_use_sparse)
            return sharding.constrain_batch(x), stats

        if cfg.remat:
            # prevent_cse=False is safe (and faster) inside scan.
            layer = jax.checkpoint(layer, prevent_cse=False, policy=_remat_policy(cfg))
        x, stats = jax.lax.scan(layer, x, (layers, use_sparse))
        return self.final_norm(x), stats

    def ffn_inputs(self, tokens: jax.Array) -> jax.Array:
        """Every layer's FFN input: [L, B * S, H] compute dtype.

        What the FFN kernels of a trained model see (the benchmarks' captured pattern
        and the neuron profile read it). The sparse training path is switched off; the
        other FFN implementations run as configured.
        """
        cfg = self.cfg
        check_token_ids(tokens, cfg.vocab_size)
        x = jnp.take(self.embed[...], tokens, axis=0).astype(cfg.compute_dtype)
        cos, sin = rope_tables(tokens.shape[1], cfg.head_dim, cfg.rope_theta)
        graphdef, layers = nnx.split(self.blocks)
        off = jnp.zeros((), bool)

        def layer(x, block_state):
            block = nnx.merge(graphdef, block_state)
            x, ffn_in = block.ffn_input(x, cos, sin)
            out, _ = block.ffn(ffn_in, off)
            return x + out.reshape(x.shape), ffn_in

        return jax.lax.scan(layer, x, layers)[1]

    def body(self, tokens: jax.Array, use_sparse: jax.Array | None = None) -> jax.Array:
        """`hidden_states` without the statistics (what the throughput benchmarks time,
        docs/design.md §8)."""
        return self.hidden_states(tokens, use_sparse)[0]

    def __call__(
        self, tokens: jax.Array, use_sparse: jax.Array | None = None
    ) -> tuple[jax.Array, dict[str, Any]]:
        """Forward pass.

        Args:
          tokens: [B, S] int32, S <= seq_len.
          use_sparse: [L] bool per-layer switch for ffn_impl="sparse" (default: all on);
            ignored by the other implementations.

        Returns:
          logits [B, S, V] fp32 and stats stacked over layers: `l1` [L] fp32 (mean over
          tokens of sum_N |h|, differentiable), `l0` [L] fp32 (mean non-zeros per
          token), `fired` [L, N] bool (fired for at least one token of this batch);
          ffn_impl="sparse" adds `tail_rows`, `dense_fallback` [L] int32; ffn_impl="twell"
          gives `l0`, `max_tile_count`, `overflow_tiles`, each [L], instead.
        """
        x, stats = self.hidden_states(tokens, use_sparse)
        return lm_loss.logits(x, self.head_weight()), stats

    def head_weight(self) -> jax.Array:
        """The LM head [V, H] in the parameter dtype: the embedding when tied."""
        return (self.embed if self.cfg.tie_embeddings else self.lm_head)[...]
