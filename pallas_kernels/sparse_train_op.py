"""Sparse gated MLP for training: hybrid ELL + dense tail behind one `custom_vjp`.

out = (relu(x Wg^T) * (x Wu^T)) Wd with the ELL path of twell.md §5:

forward   U = x Wg^T (dense XLA GEMM, bf16 out) -> Pallas compaction of P = relu(U)
          into ELL rows of width W (true counts kept); rows with more than W positives
          go to a dense tail whose static capacity is picked on the device from a few
          buckets (`lax.switch`); Pallas row kernels compute R = x Wu^T only at P's
          entries (SDDMM), T = P * R, sum |T| and out = T Wd (SpMM); the tail rows
          run the dense formula (XLA) on a [C, H] gather.
backward  Pallas row kernels: dT = gO Wd^T at the entries + (dL/dl1 / M) sign(T),
          dR = dT P, dU = dT R, then dx = dR Wu + dU Wg (one fp32 accumulator); an XLA
          stable sort builds the neuron-sorted (CSC) index; a Pallas kernel per neuron
          computes dWu = dR^T x, dWg = dU^T x, dWd = T^T gO; the tail rows through
          `jax.vjp` of the dense formula on their gather (XLA).
fallback  when the heavy rows exceed the largest tail capacity, the whole call (forward
          and backward) runs the dense formula; `stats["dense_fallback"]` says so.

No host round trips: the choices (tail bucket, fallback) are `lax.cond` / `lax.switch`
on device values whose branches hold only kernels, GEMMs and fusions, so XLA runs them
as CUDA-graph conditionals (see `_fallback_blocks` and `hybrid_format.build_csc` for
what that takes).

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
from pallas_kernels import hybrid_format as hf
from pallas_kernels import sparse_train as st
from pallas_kernels.reference import gated_hidden

_F32 = jnp.float32

# checkpoint_name of the op's ELL residuals, e.g. for
# jax.checkpoint_policies.save_only_these_names(RESIDUALS_NAME).
RESIDUALS_NAME = "twell_sparse_residuals"


# The row kernels, by the names `row_launch` and the train benchmark use.
ROW_KERNELS = ("sddmm_up", "spmm_down", "sddmm_grad", "spmm_dx")


def _require_pow2(name: str, v: int) -> None:
    if not _triton.is_pow2(v):
        raise ValueError(f"{name} must be a power of two, got {v}")


@dataclasses.dataclass(frozen=True)
class SparseTrainConfig:
    """Static configuration of `sparse_gated_mlp_train` (hashable).

    Attributes:
        ell_width: W, ELL slots per row (power of two, multiple of `chunk`).
        tail_capacities: ascending static row capacities of the dense tail; 0 means
            "no tail work". More heavy rows than the largest: dense fallback.
        impl: "pallas" (Triton kernels) or "xla" (same algorithm in plain jnp, for CPU
            and tests: it materialises [M, W, H] gathers).
        compact_block_rows, compact_block_cols, compact_num_warps: compaction tile
            (powers of two; one program per tile) and its Triton warps.
        chunk: ELL slots gathered per step of the row kernels (power of two).
        block_h: H columns per program or step of the row kernels (power of two
            dividing H).
        csc_chunk, csc_block_h: the same for the transposed (per-neuron) SpMM; smaller
            H blocks spread very active neurons over more programs and shrink the
            gathered x / gO working set (2 M csc_block_h bf16); csc_num_warps its
            Triton warps. H200 (M=16384, 29 nnz; ms): 4 / 512 / 2 warps 0.57 against
            4 / 1024 / 4 0.63 in the same process (4 / 256 / 1: 0.58; 8 / 512 / 2:
            0.62); with 4 warps, 512 columns take 1.39 (4 threads per 8-byte piece).
        num_warps, num_stages: Triton launch parameters of the gather kernels.
        fallback_block_rows: rows per step of the dense fallback (an unrolled loop of
            at most 16 dense blocks, larger M getting larger blocks), so that its
            [rows, N] temporaries stay far below the dense MLP's.
        row_launch: (kernel, chunk, block_h, num_warps) that replace the shared
            chunk / block_h / num_warps for one of ROW_KERNELS. Defaults from the H200
            (M=16384, 29 nnz; ms, same process, shared 2 / 2048 / 4 -> override):
            sddmm_up 0.355 -> 0.289-0.295, sddmm_grad 0.381 -> 0.308, spmm_down
            0.267 -> 0.253, spmm_dx 0.479 -> 0.452 (session 7). One warp per row
            keeps the SDDMMs' per-slot dot product inside a warp (shuffles, no
            shared-memory round trip and barrier per chunk); results/NOTES.md.

    The shared row-kernel launch (chunk / block_h / num_warps) follows the GatedT2D
    kernel tuned on the H200 (one row per program, 4 whole 4 KB weight rows per step,
    4 warps, 1 stage); `row_launch` overrides it per kernel.
    """

    ell_width: int = 128
    tail_capacities: tuple[int, ...] = (0, 256, 1024, 2048)
    impl: str = "pallas"
    compact_block_rows: int = 16  # H200, M=16384: 0.35 ms (32 rows / 8 warps: 0.37)
    compact_block_cols: int = 256
    compact_num_warps: int = 4
    fallback_block_rows: int = 2048
    chunk: int = 4
    block_h: int = 2048
    csc_chunk: int = 4
    csc_block_h: int = 512
    csc_num_warps: int = 2
    num_warps: int = 4
    num_stages: int = 1
    row_launch: tuple[tuple[str, int, int, int], ...] = (
        ("sddmm_up", 2, 1024, 1),
        ("spmm_down", 4, 512, 1),
        ("sddmm_grad", 4, 1024, 1),
        ("spmm_dx", 2, 1024, 4),
    )

    def __post_init__(self):
        caps = self.tail_capacities
        if not caps or list(caps) != sorted(caps) or caps[0] < 0:
            raise ValueError(f"tail_capacities must be ascending and >= 0, got {caps}")
        if self.impl not in ("pallas", "xla"):
            raise ValueError(f"impl must be 'pallas' or 'xla', got {self.impl!r}")
        pow2 = ("ell_width", "compact_block_rows", "compact_block_cols", "chunk", "block_h")
        for name in (*pow2, "csc_chunk", "csc_block_h", "csc_num_warps", "compact_num_warps"):
            _require_pow2(name, getattr(self, name))
        self._require_chunk_fits(self.chunk)
        for kernel, chunk, block_h, warps in self.row_launch:
            if kernel not in ROW_KERNELS:
                raise ValueError(f"row_launch: unknown kernel {kernel!r}; one of {ROW_KERNELS}")
            for name, v in (("chunk", chunk), ("block_h", block_h), ("num_warps", warps)):
                _require_pow2(f"{name} of {kernel}", v)
            self._require_chunk_fits(chunk)
        if self.fallback_block_rows < 1:
            raise ValueError(f"fallback_block_rows must be >= 1, got {self.fallback_block_rows}")

    def _require_chunk_fits(self, chunk: int) -> None:
        if self.ell_width % chunk:
            raise ValueError(f"ell_width {self.ell_width} is not a multiple of chunk {chunk}")

    def compact_kwargs(self) -> dict:
        """Keywords of `sparse_train.compact_rows`."""
        return dict(
            width=self.ell_width,
            impl=self.impl,
            block_rows=self.compact_block_rows,
            block_cols=self.compact_block_cols,
            num_warps=self.compact_num_warps,
        )

    def row_kernel_kwargs(self, kernel: str | None = None) -> dict:
        """Launch keywords of a row kernel (one of ROW_KERNELS; None: the shared ones)."""
        kw = dict(
            impl=self.impl,
            chunk=self.chunk,
            block_h=self.block_h,
            num_warps=self.num_warps,
            num_stages=self.num_stages,
        )
        for name, chunk, block_h, warps in self.row_launch:
            if name == kernel:
                kw.update(chunk=chunk, block_h=block_h, num_warps=warps)
        return kw

    def csc_kernel_kwargs(self) -> dict:
        """Launch keywords of the transposed SpMM (`spmm_csc`)."""
        return dict(
            self.row_kernel_kwargs(),
            chunk=self.csc_chunk,
            block_h=self.csc_block_h,
            num_warps=self.csc_num_warps,
        )


@dataclasses.dataclass(frozen=True)
class _Static:
    config: SparseTrainConfig
    interpret: bool


_MIN_BLOCK = 16


def _fit_block(block: int, dim: int) -> int:
    """The largest power of two <= block that divides dim."""
    while block > 1 and dim % block:
        block //= 2
    return block


def resolve_config(m: int, h: int, n: int, config: SparseTrainConfig) -> SparseTrainConfig:
    """Fits the config to the shapes: blocks shrink to powers of two dividing H and N
    (production shapes keep the defaults) and tail capacities are capped at M."""
    caps = tuple(sorted({min(c, m) for c in config.tail_capacities}))
    return dataclasses.replace(
        config,
        tail_capacities=caps,
        block_h=_fit_block(config.block_h, h),
        row_launch=tuple((k, c, _fit_block(b, h), w) for k, c, b, w in config.row_launch),
        csc_block_h=_fit_block(config.csc_block_h, h),
        compact_block_cols=_fit_block(config.compact_block_cols, n),
    )


def sparse_train_supported(m: int, h: int, n: int, config: SparseTrainConfig) -> str | None:
    """Why the Pallas path cannot run these shapes, or None when it can."""
    if config.impl == "xla":
        return None
    cfg = resolve_config(m, h, n, config)
    for name, dim in (("block_h", h), ("csc_block_h", h), ("compact_block_cols", n)):
        if getattr(cfg, name) < _MIN_BLOCK:
            return f"no power-of-two {name} >= {_MIN_BLOCK} divides {dim}"
    for kernel, _, block_h, _ in cfg.row_launch:
        if block_h < _MIN_BLOCK:
            return f"no power-of-two block_h of {kernel} >= {_MIN_BLOCK} divides {h}"
    return None


def _dense_block(x, wg, wu, wd):
    """Dense gated MLP as the reference computes it: (out [C, H], sum |h|).

    bf16-output GEMMs (fp32 accumulation inside), so the backward also runs bf16 GEMMs.
    """
    hid = gated_hidden(x, wg, wu)
    out = jnp.einsum("mn,nh->mh", hid, wd)
    return out.astype(x.dtype), jnp.sum(jnp.abs(hid.astype(_F32)))


# Most dense blocks the fallback unrolls into; larger M gets larger blocks.
_MAX_FALLBACK_BLOCKS = 16


def _fallback_blocks(m: int, block_rows: int) -> list[tuple[int, int]]:
    """Static (start, size) row blocks covering M for the dense fallback.

    The loop is unrolled in Python rather than a `fori_loop`: XLA runs a while loop
    from the host (a device-to-host copy of its predicate per iteration, and one for
    the cond around it), which made the op's two conds stall the GPU ~0.1 ms each per
    step even when the fallback never ran. Unrolled, both conds run as CUDA-graph
    conditionals with a device-side predicate.
    """
    b = max(min(block_rows, m), -(-m // _MAX_FALLBACK_BLOCKS))
    return [(s, min(b, m - s)) for s in range(0, m, b)]


def _after(a, dep):
    """`a`, but computed only once `dep` is: orders the unrolled blocks, so at most one
    block's [rows, N] temporaries are live (the scheduler may otherwise overlap them)."""
    return lax.optimization_barrier((a, dep))[0]


def _dense_fallback_fwd(x, wg, wu, wd, block_rows: int):
    """`_dense_block` over blocks of rows: (out [M, H], sum |h|) with O(block N) temps.

    The fallback branch shares the op's memory plan, so a whole-M dense block would make
    the sparse op's peak memory that of the dense MLP.
    """
    out, l1 = jnp.zeros_like(x), jnp.zeros((), _F32)
    for start, size in _fallback_blocks(x.shape[0], block_rows):
        x_b = _after(lax.slice_in_dim(x, start, start + size), out)
        out_b, l1_b = _dense_block(x_b, wg, wu, wd)
        out = lax.dynamic_update_slice_in_dim(out, out_b, start, 0)
        l1 = l1 + l1_b
    return out, l1


def _dense_fallback_bwd(x, g_out, wg, wu, wd, scale, block_rows: int):
    """Gradients of `_dense_block` over blocks of rows: (dx, dWg, dWu, dWd).

    Weight gradients are summed over blocks in fp32, then rounded to the weights' dtype.
    """
    weights = (wg, wu, wd)
    dx = jnp.zeros_like(x)
    dws = tuple(jnp.zeros(w.shape, _F32) for w in weights)
    for start, size in _fallback_blocks(x.shape[0], block_rows):
        rows = functools.partial(lax.slice_in_dim, start_index=start, limit_index=start + size)
        x_b, g_b = _after((rows(x), rows(g_out)), (dx, dws))
        _, vjp = jax.vjp(_dense_block, x_b, *weights)
        dx_b, *dw_b = vjp((g_b, scale))
        dws = tuple(a + d.astype(_F32) for a, d in zip(dws, dw_b, strict=True))
        dx = lax.dynamic_update_slice_in_dim(dx, dx_b, start, 0)
    return (dx, *(d.astype(w.dtype) for d, w in zip(dws, weights, strict=True)))


def _gather_rows(a, rows):
    return a.at[rows].get(mode="fill", fill_value=0)


def _pad_rows(a, c_max):
    return jnp.pad(a, ((0, c_max - a.shape[0]), (0, 0)))


def _tail_fwd(cap, x, rows, wg, wu, wd):
    """Dense formula on the first `cap` tail rows: (out [C_max, H], sum |h|)."""
    c_max = rows.shape[0]
    if cap == 0:
        return jnp.zeros((c_max, x.shape[1]), x.dtype), jnp.zeros((), _F32)
    out, l1 = _dense_block(_gather_rows(x, rows[:cap]), wg, wu, wd)
    return _pad_rows(out, c_max), l1


def _tail_bwd(cap, x, g_out, rows, wg, wu, wd, scale, dws):
    """Adds the tail rows' gradients: (dx rows [C_max, H], (dWg, dWu, dWd))."""
    c_max = rows.shape[0]
    if cap == 0:
        return jnp.zeros((c_max, x.shape[1]), x.dtype), dws
    sel = rows[:cap]
    _, vjp = jax.vjp(_dense_block, _gather_rows(x, sel), wg, wu, wd)
    dxt, *dw_t = vjp((_gather_rows(g_out, sel), scale))
    dws = tuple(
        (a.astype(_F32) + b.astype(_F32)).astype(a.dtype) for a, b in zip(dws, dw_t, strict=True)
    )
    return _pad_rows(dxt, c_max), dws


def _kernel_kwargs(static: _Static, kernel: str) -> dict:
    return dict(static.config.row_kernel_kwargs(kernel), interpret=static.interpret)


def _forward(static: _Static, x, wg, wu, wd):
    cfg = static.config
    m, width, caps = x.shape[0], cfg.ell_width, cfg.tail_capacities
    with jax.named_scope("twell_gate_gemm"):
        # U in x.dtype straight from the GEMM (fp32 accumulation inside): compaction
        # keeps the entries > 0, so no separate relu pass over [M, N].
        u = jnp.einsum("mh,nh->mn", x, wg, preferred_element_type=x.dtype)
    with jax.named_scope("twell_compact"):
        ell, fired = st.compact_rows(u, **cfg.compact_kwargs(), interpret=static.interpret)
        plan = hf.plan_tail(ell.counts, width, caps)
        ell_count = hf.ell_counts(ell.counts, width)
    fallback = plan.bucket == len(caps)

    def sparse(_):
        with jax.named_scope("twell_sddmm_up"):
            kw = _kernel_kwargs(static, "sddmm_up")
            r, t, l1_rows = st.sddmm_up(x, wu, ell_count, ell.cols, ell.vals, **kw)
        with jax.named_scope("twell_spmm_down"):
            kw = _kernel_kwargs(static, "spmm_down")
            out = st.spmm_rows(((t, wd),), ell_count, ell.cols, out_dtype=x.dtype, **kw)
        with jax.named_scope("twell_tail_fwd"):
            branches = [functools.partial(_tail_fwd, cap) for cap in caps]
            out_t, l1_t = lax.switch(plan.bucket, branches, x, plan.rows, wg, wu, wd)
            out = out.at[plan.rows].set(out_t, mode="drop")
        return out, jnp.sum(l1_rows) + l1_t, r, t

    def dense(_):
        with jax.named_scope("twell_dense_fallback_fwd"):
            out, l1_sum = _dense_fallback_fwd(x, wg, wu, wd, cfg.fallback_block_rows)
        zeros = jnp.zeros_like(ell.vals)
        return out, l1_sum, zeros, zeros

    out, l1_sum, r, t = lax.cond(fallback, dense, sparse, None)
    cap_used = jnp.asarray((*caps, -1), jnp.int32)[plan.bucket]
    stats = {
        "l0": jnp.sum(ell.counts).astype(_F32) / m,
        "l1": l1_sum / m,
        "max_row_count": jnp.max(ell.counts),
        "tail_rows": plan.n_rows,
        "tail_capacity": cap_used,
        "dense_fallback": fallback.astype(jnp.int32),
        "fired": fired,
    }
    res = (x, wg, wu, wd, ell_count, ell.cols, ell.vals, ell.col_counts, r, t, plan.rows)
    res = (*res, plan.bucket)
    return out, stats, res


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _op(static, l1_coef, x, wg, wu, wd):
    out, stats, _ = _forward(static, x, wg, wu, wd)
    return out, stats


def _op_fwd(static, l1_coef, x, wg, wu, wd):
    out, stats, res = _forward(static, x, wg, wu, wd)
    # Named so a remat policy can keep the small ELL residuals (~20 MB per layer at
    # M=16384) instead of re-running the gate GEMM and the forward kernels.
    x, wg, wu, wd, *ell_res = res
    ell_res = checkpoint_name(tuple(ell_res), RESIDUALS_NAME)
    return (out, stats), (l1_coef, x, wg, wu, wd, *ell_res)


def _op_bwd(static, res, cts):
    cfg = static.config
    l1_coef, x, wg, wu, wd, ell_count, cols, p_vals, col_counts, r, t, rows, bucket = res
    g_out, g_stats = cts
    m, caps = x.shape[0], cfg.tail_capacities
    g_out = g_out.astype(x.dtype)
    # d loss / d sum|T|: the l1 cotangent (loss = ... + lam * l1) plus the baked-in coef.
    scale = (g_stats["l1"].astype(_F32) + l1_coef) / m

    with jax.named_scope("twell_csc_index"):
        # Outside the cond: the sort depends only on the forward's pattern, and a cond
        # whose branches hold only kernels, GEMMs and fusions runs as a CUDA-graph
        # conditional (a device-side predicate) instead of a host round trip.
        csc = hf.build_csc(ell_count, cols, col_counts)

    def sparse(_):
        ell = (ell_count, cols, p_vals, r, t, scale[None])
        with jax.named_scope("twell_sddmm_grad"):
            dr, du = st.sddmm_grad(g_out, wd, *ell, **_kernel_kwargs(static, "sddmm_grad"))
        with jax.named_scope("twell_spmm_dx"):
            kw = _kernel_kwargs(static, "spmm_dx")
            terms = ((dr, wu), (du, wg))
            dx = st.spmm_rows(terms, ell_count, cols, out_dtype=x.dtype, **kw)
        with jax.named_scope("twell_csc_entries"):
            entries = st.csc_entries(csc, cfg.ell_width, dr, du, t)
        with jax.named_scope("twell_spmm_csc"):
            kw_csc = dict(cfg.csc_kernel_kwargs(), interpret=static.interpret)
            dwu, dwg, dwd = st.spmm_csc(csc.offsets, csc.order, *entries, x, g_out, **kw_csc)
        with jax.named_scope("twell_tail_bwd"):
            branches = [functools.partial(_tail_bwd, cap) for cap in caps]
            dx_t, (dwg, dwu, dwd) = lax.switch(
                bucket, branches, x, g_out, rows, wg, wu, wd, scale, (dwg, dwu, dwd)
            )
            dx = dx.at[rows].set(dx_t, mode="drop")
        return dx, dwg, dwu, dwd

    def dense(_):
        with jax.named_scope("twell_dense_fallback_bwd"):
            return _dense_fallback_bwd(x, g_out, wg, wu, wd, scale, cfg.fallback_block_rows)

    dx, dwg, dwu, dwd = lax.cond(bucket == len(caps), dense, sparse, None)
    return jnp.zeros_like(l1_coef), dx, dwg, dwu, dwd


_op.defvjp(_op_fwd, _op_bwd)


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
    """Activation-sparse gated ReLU MLP with a sparse backward (twell.md §5).

    Args:
        x: [..., H] tokens (bf16); leading axes are flattened to M tokens.
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
            dense_fallback: int32 scalar, 1 when the tail was full and the call ran
                densely.
            fired: bool [N], neurons positive for at least one token.

    Raises:
        ValueError: shapes the Pallas kernels do not support (see
            `sparse_train_supported`; block sizes are otherwise fitted to H and N by
            `resolve_config`) or inconsistent weight shapes.
    """
    lead, h = x.shape[:-1], x.shape[-1]
    n = w_gate.shape[0]
    for w in (w_gate, w_up, w_down):
        if w.shape != (n, h):
            raise ValueError(f"weights must all be [N, H] = {(n, h)}, got {w.shape}")
    x2 = x.reshape(-1, h)
    reason = sparse_train_supported(x2.shape[0], h, n, config)
    if reason:
        raise ValueError(f"sparse_gated_mlp_train: {reason}")
    config = resolve_config(x2.shape[0], h, n, config)
    static = _Static(config, _triton.resolve_interpret(interpret))
    out, stats = _op(static, jnp.asarray(l1_coef, _F32), x2, w_gate, w_up, w_down)
    return out.reshape(*lead, h), stats
