"""Sparse gated MLP for training: hybrid ELL + dense tail behind one `custom_vjp`.

out = (relu(x Wg^T) * (x Wu^T)) Wd with the ELL path of docs/design.md §5-§6:

forward   U = x Wg^T (dense XLA GEMM, bf16 out) -> Pallas compaction of P = relu(U)
          into ELL rows of width W (true counts kept); rows with more than W positives
          go to a dense tail whose static capacity is picked on the device from a few
          buckets (`lax.switch`); Pallas row kernels compute R = x Wu^T only at P's
          entries (SDDMM), T = P * R, sum |T| and out = T Wd (SpMM); the tail rows
          run the dense formula (XLA) on a [C, H] gather.
backward  Pallas row kernels: T = P R again, dT = gO Wd^T at the entries + (dL/dl1 / M)
          sign(T), dR = dT P, dU = dT R (this kernel also counts gO's NaN / Inf per
          row), then dx = dR Wu + dU Wg (one fp32 accumulator); an XLA
          stable sort builds the neuron-sorted (CSC) index; a Pallas kernel per neuron
          computes dWu = dR^T x, dWg = dU^T x, dWd = T^T gO, except for hot neurons
          (`hot`: at least `hot_min_count` entries, in a layer whose busy neurons
          average `hot_min_skew` times the mean count), whose rows come from dense
          GEMMs over a [M, K] block; the tail rows through `jax.vjp` of the dense
          formula on their gather (XLA).
fallback  when the heavy rows exceed the largest tail capacity, or x or a weight holds
          a NaN or Inf, the whole call (forward and backward) runs the dense formula,
          which propagates non-finite values exactly as the reference does;
          `stats["dense_fallback"]` says so. A NaN or Inf that arrives only with the
          backward's incoming gradient runs the dense backward alone.

No host round trips: the choices (tail bucket, fallback) are `lax.cond` / `lax.switch`
on device values whose branches hold only kernels, GEMMs and fusions, so XLA runs them
as CUDA-graph conditionals (docs/design.md §6.4; see `dense_rows.row_blocks` and
`format.build_csc` for what that takes).

The L1 term is differentiable through `stats["l1"]`: a loss `f(out) + lam * stats["l1"]`
gets exactly the gradient of the dense reference with its L1 term. `l1_coef` adds the
gradient of `l1_coef * l1` on top (for callers that do not put l1 in the loss).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from pallas_kernels import _triton
from pallas_kernels._operands import check_gated_mlp
from pallas_kernels.sparse_train import compaction, csc, dense_rows, hot, row_kernels
from pallas_kernels.sparse_train import format as fmt
from pallas_kernels.sparse_train.config import LAUNCH_FIELDS, SparseTrainConfig
from pallas_kernels.sparse_train.reference import dense_block

_F32 = jnp.float32

# checkpoint_name of the op's ELL residuals, e.g. for
# jax.checkpoint_policies.save_only_these_names(RESIDUALS_NAME).
RESIDUALS_NAME = "twell_sparse_residuals"


@dataclasses.dataclass(frozen=True)
class _Static:
    config: SparseTrainConfig
    interpret: bool


# Narrowest H (and N) block the Pallas path accepts.
_MIN_BLOCK = 16


# Tokens per ELL entry from which a neuron is hot when hot_min_count is None (§6.3).
_HOT_TOKENS_PER_ENTRY = 64


def hot_share(col_counts: jax.Array, config: SparseTrainConfig) -> jax.Array:
    """fp32 scalar: the share of all entries that fall in the hot neurons of a
    resolved config (`hot.hot_threshold`; col_counts: int32 [N] entries per neuron);
    0 without entries. What the per-layer sparse / dense switch reads as a layer's
    skew."""
    return _share_past(col_counts, hot.config_threshold(col_counts, config))


def _share_past(col_counts: jax.Array, threshold: jax.Array) -> jax.Array:
    """fp32 scalar: the share of all entries in neurons with at least `threshold`."""
    hot_counts = jnp.where(col_counts >= threshold, col_counts, 0)
    total = jnp.maximum(jnp.sum(col_counts, dtype=_F32), 1.0)
    return jnp.sum(hot_counts, dtype=_F32) / total


def resolve_config(m: int, h: int, n: int, config: SparseTrainConfig) -> SparseTrainConfig:
    """Fits the config to the shapes: every kernel's block shrinks to the largest power
    of two dividing H (the compaction's columns: N), production shapes keeping the
    defaults, tail capacities are capped at M and hot_min_count=None becomes M / 64."""
    caps = tuple(sorted({min(c, m) for c in config.tail_capacities}))
    launches = {name: getattr(config, name).fit(h) for name in LAUNCH_FIELDS}
    hot_min = config.hot_min_count or max(1, -(-m // _HOT_TOKENS_PER_ENTRY))
    return dataclasses.replace(
        config, tail_capacities=caps, compact=config.compact.fit(n), hot_min_count=hot_min,
        **launches,
    )  # fmt: skip


def sparse_train_supported(m: int, h: int, n: int, config: SparseTrainConfig) -> str | None:
    """Why the Pallas path cannot run these shapes, or None when it can."""
    if config.impl == "xla":
        return None
    cfg = resolve_config(m, h, n, config)
    for name in LAUNCH_FIELDS:
        if getattr(cfg, name).block_h < _MIN_BLOCK:
            return f"no power-of-two {name}.block_h >= {_MIN_BLOCK} divides H={h}"
    if cfg.compact.block_cols < _MIN_BLOCK:
        return f"no power-of-two compact.block_cols >= {_MIN_BLOCK} divides N={n}"
    return None


def _gather_rows(a, rows):
    return a.at[rows].get(mode="fill", fill_value=0)


def _tail_fwd(cap, out, x, rows, wg, wu, wd):
    """Writes the dense formula's rows for the first `cap` tail rows into out [M, H];
    returns (out, sum |h| of those rows). The tail rows' outputs are written inside
    the bucket's branch, so a call without heavy rows runs no [C_max, H] scatter."""
    if cap == 0:
        return out, jnp.zeros((), _F32)
    sel = rows[:cap]
    out_t, l1 = dense_block(_gather_rows(x, sel), wg, wu, wd)
    return out.at[sel].set(out_t, mode="drop"), l1


def _tail_bwd(cap, dx, x, g_out, rows, wg, wu, wd, scale, dws):
    """Writes the tail rows' dx into dx [M, H] and adds their weight gradients:
    (dx, (dWg, dWu, dWd))."""
    if cap == 0:
        return dx, dws
    sel = rows[:cap]
    _, vjp = jax.vjp(dense_block, _gather_rows(x, sel), wg, wu, wd)
    dxt, *dw_t = vjp((_gather_rows(g_out, sel), scale))
    dws = tuple(
        (a.astype(_F32) + b.astype(_F32)).astype(a.dtype) for a, b in zip(dws, dw_t, strict=True)
    )
    return dx.at[sel].set(dxt, mode="drop"), dws


def _kernel_kwargs(static: _Static, launch) -> dict:
    """The keywords of a row or CSC kernel call: its launch, impl and interpret."""
    return dict(launch=launch, impl=static.config.impl, interpret=static.interpret)


def _forward(static: _Static, x, wg, wu, wd):
    cfg = static.config
    m, width, caps = x.shape[0], cfg.ell_width, cfg.tail_capacities
    ell, fired, gate_finite = compaction.gate_to_ell(
        x, wg, width=width, launch=cfg.compact, impl=cfg.impl, interpret=static.interpret
    )
    with jax.named_scope("twell_compact"):
        plan = fmt.plan_tail(ell.counts, width, caps)
        ell_count = fmt.ell_counts(ell.counts, width)
    # Non-finite inputs run the dense formula, which propagates NaN/Inf exactly as the
    # reference does (the ELL pattern of a NaN gate is not meaningful, and the SDDMM
    # never reads W_up/W_down outside the pattern). The backward reads the decision from
    # the bucket in the residuals, so it is folded in there. A NaN or Inf in x or W_gate
    # makes every gate of its row or column non-finite (Inf * 0 is NaN), so the
    # compaction's check of U covers both; a gate that overflows bf16 from finite
    # inputs also runs densely, as the reference's Inf would spread.
    with jax.named_scope("twell_finite_check"):
        # One fusion over both weights (two reductions cost a launch and a gap more).
        finite = gate_finite & jnp.all(jnp.isfinite(wu) & jnp.isfinite(wd))
        nonfinite = ~finite
    bucket = jnp.where(nonfinite, len(caps), plan.bucket).astype(plan.bucket.dtype)
    fallback = bucket == len(caps)

    # The ELL kernels run outside the switch: one conditional (tail bucket or dense
    # fallback) instead of a cond around a switch, each costing a CUDA-graph
    # conditional node and a launch gap. After a fallback their inputs are a stale or
    # zero pattern whose columns are still in range, and their results go unused.
    with jax.named_scope("twell_sddmm_up"):
        kw = _kernel_kwargs(static, cfg.sddmm_up)
        r, t, l1_rows = row_kernels.sddmm_up(x, wu, ell_count, ell.cols, ell.vals, **kw)
    with jax.named_scope("twell_spmm_down"):
        kw = _kernel_kwargs(static, cfg.spmm_down)
        out = row_kernels.spmm_rows(((t, wd),), ell_count, ell.cols, out_dtype=x.dtype, **kw)

    def tail(cap, out):
        with jax.named_scope("twell_tail_fwd"):
            out, l1_t = _tail_fwd(cap, out, x, plan.rows, wg, wu, wd)
        return out, jnp.sum(l1_rows) + l1_t

    def dense(_):
        with jax.named_scope("twell_dense_fallback_fwd"):
            out, l1_sum, *_ = dense_rows.dense_forward(
                x, wg, wu, wd, cfg.fallback_block_rows, cfg.ell_width
            )
        return out, l1_sum

    branches = [functools.partial(tail, cap) for cap in caps] + [dense]
    out, l1_sum = lax.switch(bucket, branches, out)
    cap_used = jnp.asarray((*caps, -1), jnp.int32)[bucket]
    threshold = hot.config_threshold(ell.col_counts, cfg)
    stats = {
        "l0": jnp.sum(ell.counts).astype(_F32) / m,
        "l1": l1_sum / m,
        "max_row_count": jnp.max(ell.counts),
        "tail_rows": plan.n_rows,
        "tail_capacity": cap_used,
        "dense_fallback": fallback.astype(jnp.int32),
        "hot_neurons": jnp.sum(ell.col_counts >= threshold, dtype=jnp.int32),
        "hot_share": _share_past(ell.col_counts, threshold),
        "fired": fired,
    }
    res = (x, wg, wu, wd, ell_count, ell.cols, ell.vals, ell.col_counts, r, t, plan.rows)
    res = (*res, bucket)
    return out, stats, res


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _op(static, l1_coef, x, wg, wu, wd):
    out, stats, _ = _forward(static, x, wg, wu, wd)
    return out, stats


def _op_fwd(static, l1_coef, x, wg, wu, wd):
    out, stats, res = _forward(static, x, wg, wu, wd)
    # Named so a remat policy can keep the small ELL residuals (~12 MB per layer at
    # M=16384) instead of re-running the gate GEMM and the forward kernels. They are
    # kept compact: int16 columns, and no T = P * R, which the backward recomputes
    # bit for bit (docs/performance_notes.md, "Training-step memory").
    x, wg, wu, wd, ell_count, cols, p_vals, col_counts, r, _, rows, bucket = res
    saved = (ell_count, cols, p_vals, col_counts, r, rows, bucket)
    saved = checkpoint_name(saved, RESIDUALS_NAME)
    return (out, stats), (l1_coef, x, wg, wu, wd, *saved)


def _op_bwd(static, res, cts):
    cfg = static.config
    l1_coef, x, wg, wu, wd, ell_count, cols, p_vals, col_counts, r, rows, bucket = res
    g_out, g_stats = cts
    m, caps = x.shape[0], cfg.tail_capacities
    g_out = g_out.astype(x.dtype)
    # d loss / d sum|T|: the l1 cotangent (loss = ... + lam * l1) plus the baked-in coef.
    scale = (g_stats["l1"].astype(_F32) + l1_coef) / m

    with jax.named_scope("twell_csc_index"):
        # Outside the switch: the sort depends only on the forward's pattern, and a switch
        # whose branches hold only kernels, GEMMs and fusions runs as a CUDA-graph
        # conditional (a device-side predicate) instead of a host round trip.
        plan = hot.config_plan(col_counts, cfg)
        index = fmt.build_csc(ell_count, cols, col_counts, exclude=plan.is_hot())

    with jax.named_scope("twell_sddmm_grad"):
        # Before the switch: the kernel reads every row of gO whole, so it also counts
        # gO's non-finite values, which pick the dense branch (no separate pass over
        # [M, H]).
        # After a forward fallback its ELL inputs are zeros or a stale pattern whose
        # columns are still in range: the results are then unused.
        kw = _kernel_kwargs(static, cfg.sddmm_grad)
        dr, du, t, g_bad = row_kernels.sddmm_grad(
            g_out, wd, ell_count, cols, p_vals, r, scale[None], **kw
        )

    # As in the forward, the ELL kernels run before one switch over the tail buckets
    # and the dense backward (nested conditionals cost more than their kernels); after
    # a fallback their results go unused.
    with jax.named_scope("twell_spmm_dx"):
        kw = _kernel_kwargs(static, cfg.spmm_dx)
        terms = ((dr, wu), (du, wg))
        dx = row_kernels.spmm_rows(terms, ell_count, cols, out_dtype=x.dtype, **kw)
    with jax.named_scope("twell_csc_entries"):
        entries = csc.csc_entries(index, cfg.ell_width, dr, du, t)
    with jax.named_scope("twell_spmm_csc"):
        kw = _kernel_kwargs(static, cfg.spmm_csc)
        dwu, dwg, dwd = csc.spmm_csc(index.offsets, index.order, *entries, x, g_out, **kw)
    with jax.named_scope("twell_hot_grads"):
        dwu, dwg, dwd = hot.switch_hot_grads(
            plan, cfg.hot_capacities, ell_count, cols, dr, du, t, x, g_out, (dwu, dwg, dwd)
        )

    def tail(cap, dx, dws):
        with jax.named_scope("twell_tail_bwd"):
            return _tail_bwd(cap, dx, x, g_out, rows, wg, wu, wd, scale, dws)

    def dense(dx, dws):
        with jax.named_scope("twell_dense_fallback_bwd"):
            dx, dwg, dwu, dwd = dense_rows.dense_backward(
                x, g_out, wg, wu, wd, scale, cfg.fallback_block_rows
            )
        return dx, (dwg, dwu, dwd)

    # A non-finite upstream gradient (or l1 cotangent) also runs the dense backward: the
    # sparse one would carry it only along the pattern, where the dense formula's
    # 0 * NaN spreads it through every neuron's weight gradient.
    cts_finite = jnp.all(g_bad == 0) & jnp.isfinite(scale)
    branch = jnp.where(cts_finite, bucket, len(caps))
    branches = [functools.partial(tail, cap) for cap in caps] + [dense]
    dx, (dwg, dwu, dwd) = lax.switch(branch, branches, dx, (dwg, dwu, dwd))
    return jnp.zeros_like(l1_coef), dx, dwg, dwu, dwd


_op.defvjp(_op_fwd, _op_bwd)


def _empty_stats(n: int) -> dict[str, jax.Array]:
    """The stats of a call without tokens: the usual shapes and dtypes, all zero."""
    i32 = jnp.zeros((), jnp.int32)
    return {
        "l0": jnp.zeros((), _F32),
        "l1": jnp.zeros((), _F32),
        "max_row_count": i32,
        "tail_rows": i32,
        "tail_capacity": i32,
        "dense_fallback": i32,
        "hot_neurons": i32,
        "hot_share": jnp.zeros((), _F32),
        "fired": jnp.zeros((n,), jnp.bool_),
    }


def sparse_gated_mlp_train(
    x: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    *,
    l1_coef: float | jax.Array = 0.0,
    config: SparseTrainConfig = SparseTrainConfig(),
    interpret: bool | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Activation-sparse gated ReLU MLP with a sparse backward (docs/design.md §5-§6).

    Args:
        x: [..., H] tokens (bf16); leading axes are flattened to M tokens. M = 0
            returns an empty output, zero stats and zero gradients without a launch.
        w_gate, w_up, w_down: [N, H] (w_down is down_proj transposed).
        l1_coef: adds the gradient of `l1_coef * stats["l1"]` in the backward without
            the caller putting l1 in its loss (traced scalar: warmups are fine). Use
            either this or `lam * stats["l1"]` in the loss, not both.
        config: static SparseTrainConfig.
        interpret: Pallas interpret mode (None: interpret unless on a GPU).

    Returns:
        (out [..., H] in x.dtype, stats). Gradients flow to x, the three weights and,
        through `stats["l1"]`, into the L1 term. stats is a dict (per shard under
        `shard_map`):
            l0: fp32 scalar, mean number of positive gate entries per token (exact).
            l1: fp32 scalar, mean over tokens of sum over N of |h|; differentiable.
            max_row_count: int32 scalar, the most positives of one token.
            tail_rows: int32 scalar, rows with more than W positives (tail/fallback).
            tail_capacity: int32 scalar, tail bucket capacity used (-1: fallback).
            dense_fallback: int32 scalar, 1 when the call ran densely: the tail was
                full, or an input held a NaN or Inf.
            hot_neurons: int32 scalar, neurons with at least `hot.hot_threshold` ELL
                entries (their weight gradients run as dense GEMMs).
            hot_share: fp32 scalar, the hot neurons' share of the ELL entries
                (`hot_share`; 0 without entries).
            fired: bool [N], neurons positive for at least one token.

    Raises:
        ValueError: shapes the Pallas kernels do not support (see
            `sparse_train_supported`; block sizes are otherwise fitted to H and N by
            `resolve_config`), a scalar x, weights that are not [N, H] matrices, an x
            neither bf16 nor fp32, or weights of another dtype than x's.
    """
    check_gated_mlp(x, (w_gate, w_up, w_down))
    lead, h = x.shape[:-1], x.shape[-1]
    n = w_gate.shape[0]
    x2 = x.reshape(-1, h)
    if x2.shape[0] == 0:
        # No tokens: nothing to launch. The outputs depend on no input, so every
        # gradient (x, weights, l1) is zero.
        return jnp.zeros(x.shape, x.dtype), _empty_stats(n)
    reason = sparse_train_supported(x2.shape[0], h, n, config)
    if reason:
        raise ValueError(f"sparse_gated_mlp_train: {reason}")
    config = resolve_config(x2.shape[0], h, n, config)
    static = _Static(config, _triton.resolve_interpret(interpret))
    out, stats = _op(static, jnp.asarray(l1_coef, _F32), x2, w_gate, w_up, w_down)
    return out.reshape(*lead, h), stats
