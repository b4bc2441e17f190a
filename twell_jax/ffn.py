"""The FFN implementations the model switches between (`ModelConfig.ffn_impl`).

Each takes x [M, H] in the compute dtype and a dict of weights [N, H] ("w_gate" for the
gated variants, "w_up", "w_down", the last one down_proj transposed) and returns
(out [M, H] x.dtype, a dict of statistics). `per_batch_shard` runs one per batch shard
(`shard_map`) and combines the statistics by `STAT_REDUCTIONS`.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

import pallas_kernels
from pallas_kernels.sparse_train import hot_share, resolve_config
from twell_jax import sharding
from twell_jax.sparsity import hidden_stats

Stats = dict[str, jax.Array]


# GEMMs below return the inputs' dtype (XLA accumulates in fp32 inside and rounds once):
# asking for fp32 outputs would make the backward pass run fp32 GEMMs.


def _proj(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [M, H] @ w [N, H]^T -> [M, N] in x.dtype."""
    return jnp.einsum("mh,nh->mn", x, w)


def dense(x: jax.Array, w: dict[str, jax.Array], variant: str) -> tuple[jax.Array, Stats]:
    """XLA FFN with h materialised in x.dtype, as a dense bf16 MLP rounds it.

    Args:
      x: [M, H] compute dtype.
      w: "w_up", "w_down" and (gated variants) "w_gate", each [N, H] compute dtype.
      variant: ModelConfig.ffn_variant.

    Returns:
      out [M, H] in x.dtype and `hidden_stats(h)`.
    """
    up = _proj(x, w["w_up"])
    if variant == "relu":
        h = jax.nn.relu(up)
    else:
        act = jax.nn.relu if variant == "gated_relu" else jax.nn.silu
        h = act(_proj(x, w["w_gate"])) * up
    return jnp.einsum("mn,nh->mh", h, w["w_down"]), hidden_stats(h)


def twell(x: jax.Array, w: dict[str, jax.Array], compression: int) -> tuple[jax.Array, Stats]:
    """TwELL inference kernels (no sparse gradient). x [M, H] bf16 -> [M, H] bf16.

    Stats: `l0` fp32 (positive gate entries per token, an upper bound on the non-zeros
    of h), `max_tile_count` and `overflow_tiles` int32 (TwELL tiles past capacity,
    recomputed densely by the kernel).
    """
    if "w_gate" in w:
        out, stats = pallas_kernels.twell_gated_mlp(
            x, w["w_gate"], w["w_up"], w["w_down"], compression=compression, return_stats=True
        )
    else:
        out, stats = pallas_kernels.twell_mlp(
            x, w["w_up"], w["w_down"], compression=compression, return_stats=True
        )
    return out, {
        "l0": stats.nnz_per_row,
        "max_tile_count": stats.max_tile_count,
        "overflow_tiles": stats.overflow_tiles,
    }


# Overflow counters of the sparse training op (docs/design.md §6.4: nothing silently lost);
# zero on the dense path.
SPARSE_COUNTERS = ("tail_rows", "dense_fallback")


def sparse(x: jax.Array, w: dict[str, jax.Array], ell_width: int) -> tuple[jax.Array, Stats]:
    """Sparse training kernels (gated ReLU), same outputs as `dense_counted`.

    The L1 gradient reaches the kernels through the cotangent of the differentiable
    `stats["l1"]` (docs/design.md §6: c = g_l1 / M), exactly as on the dense path, so
    the op's own `l1_coef` stays 0. Stats: l1, l0 (fp32), fired (bool [N]), what the
    per-layer switch reads besides l0 (docs/design.md §7.1): hot_share (fp32, the hot
    neurons' share of the entries) and tail_load (fp32, `tail_load`), and the int32
    `SPARSE_COUNTERS`.
    """
    config = pallas_kernels.SparseTrainConfig(ell_width=ell_width)
    out, stats = pallas_kernels.sparse_gated_mlp_train(
        x, w["w_gate"], w["w_up"], w["w_down"], config=config
    )
    # lax.cond with the dense branch needs identical structures and dtypes.
    return out.astype(x.dtype), {
        "l1": stats["l1"].astype(jnp.float32),
        "l0": stats["l0"].astype(jnp.float32),
        "fired": stats["fired"].astype(bool),
        "hot_share": stats["hot_share"].astype(jnp.float32),
        "tail_load": tail_load(stats["tail_rows"], _op_limits(x, w, ell_width)[1]),
        **{k: stats[k].astype(jnp.int32) for k in SPARSE_COUNTERS},
    }


def _op_limits(
    x: jax.Array, w: dict[str, jax.Array], ell_width: int
) -> tuple[pallas_kernels.SparseTrainConfig, int]:
    """(the sparse op's config resolved for x [M, H] and weights [N, H] at ELL width
    `ell_width` (`resolve_config`), its largest dense-tail capacity)."""
    (m, h), n = x.shape, w["w_up"].shape[0]
    config = pallas_kernels.SparseTrainConfig(ell_width=ell_width)
    resolved = resolve_config(m, h, n, config)
    return resolved, max(resolved.tail_capacities[-1], 1)


def tail_load(tail_rows: jax.Array, capacity: int) -> jax.Array:
    """fp32: rows past the ELL width over the sparse op's largest dense-tail capacity
    (`_op_limits`); above 1 the op falls back to its dense formula. What the per-layer
    switch reads as a layer's heavy rows."""
    return tail_rows.astype(jnp.float32) / capacity


def decode(x: jax.Array, w: dict[str, jax.Array]) -> tuple[jax.Array, Stats]:
    """The small-M decode path (gated ReLU). x [M, H] bf16 or fp32 -> [M, H] x.dtype.

    Stats: `l0` fp32 (non-zero gate entries per token) and `dense_fallback` int32 (1 when
    M is above the op's max_tokens and the dense formula ran).
    """
    out, stats = pallas_kernels.sparse_decode_mlp(
        x, w["w_gate"], w["w_up"], w["w_down"], return_stats=True
    )
    return out, {"l0": stats.l0, "dense_fallback": stats.dense_fallback}


# Rows per block of the dense branch of the per-layer switch (ffn_impl="sparse").
DENSE_BRANCH_BLOCK_ROWS = 4096


def dense_counted(x: jax.Array, w: dict[str, jax.Array], ell_width: int) -> tuple[jax.Array, Stats]:
    """The dense branch of the switch (gated ReLU): `dense`'s output, and the stats of
    `sparse` at ELL width `ell_width` (the switch reads the same statistics whichever
    branch ran) with zero overflow counters, computed in blocks of
    `DENSE_BRANCH_BLOCK_ROWS` rows (`pallas_kernels.blocked_gated_mlp`). XLA plans the
    switch's memory for its larger branch, so a whole-M dense branch would give the
    sparse model the dense FFN's [M, N] temporaries however rarely it ran
    (docs/performance_notes.md, "Training-step memory")."""
    out, l1_sum, counts = pallas_kernels.blocked_gated_mlp(
        x, w["w_gate"], w["w_up"], w["w_down"], DENSE_BRANCH_BLOCK_ROWS, ell_width
    )
    m = x.shape[0]
    resolved, capacity = _op_limits(x, w, ell_width)
    stats = {
        "l1": l1_sum / m,
        "l0": counts.nnz / m,
        "fired": counts.fired,
        "hot_share": hot_share(counts.col_counts, resolved),
        "tail_load": tail_load(counts.heavy_rows, capacity),
    }
    return out, {**stats, **{k: jnp.zeros((), jnp.int32) for k in SPARSE_COUNTERS}}


def _any(v: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    return jax.lax.psum(v.astype(jnp.int32), axes) > 0


def _pmax(v: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """pmax of a statistic that no loss differentiates: pmax has no derivative rule,
    and a value_and_grad over the step, traced in shard_map without its varying-axes
    checks (`sharding.per_batch_shard`), asks every reduction for one."""
    return jax.lax.pmax(jax.lax.stop_gradient(v), axes)


# How each statistic combines over batch shards.
STAT_REDUCTIONS = {
    "l1": jax.lax.pmean,
    "l0": jax.lax.pmean,
    "fired": _any,
    "max_tile_count": _pmax,
    "overflow_tiles": jax.lax.psum,
    "hot_share": jax.lax.pmean,
    "tail_load": _pmax,
    "tail_rows": jax.lax.psum,
    "dense_fallback": _pmax,
}


def per_batch_shard(fn: Callable) -> Callable:
    """`sharding.per_batch_shard` with the FFN statistics' reductions."""
    return sharding.per_batch_shard(fn, STAT_REDUCTIONS)
