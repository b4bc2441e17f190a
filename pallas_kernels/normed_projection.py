"""A few tokens' RMSNorm and projection in one GEMV kernel (docs/design.md §11).

    y = normed_projection(x, w_scaled, eps=1e-5)   # rmsnorm(x) W^T, y [M, F]

A decode step's attention block starts with the RMSNorm of the residual stream and
the stacked q / k / v product. In XLA that is three kernels per layer at batch 1: the
norm's sum of squares, its scale-and-convert, and the GEMV (cuBLAS reads the 25 MB
of the 1.5B preset's W_qkv at ~2.1 TB/s), each a launch that waits on the one before
(docs/performance_notes.md, "Generation"). The norm's scale vector is folded into the
weight once (`w_scaled = W * scale[None, :]`, `twell_jax.serving`), which leaves a
per-row factor:

    rmsnorm(x) W^T = rsqrt(mean(x^2) + eps) * (x w_scaled^T)

so one kernel streams w_scaled against the raw x and multiplies each row by its
factor at the end. Program j computes output columns j*block_n .. j*block_n +
block_n - 1 for every row: a pipelined loop over H (the x tile goes straight into the
tensor-core dot, as in the decode op's gate loop), then the rows' sums of squares
from x (in L2 by then; for one or two rows from loads issued before the loop) and the
factor.

Rounding: the product sums in fp32 and y is rounded once to x's dtype. The model
rounds the normed x to bf16 before the product, and here the scaled weight is the
rounded one: the two agree within bf16 rounding, and exactly up to fp32 rounding in
fp32. A row of x that is not finite gives a NaN row, as the model's norm does.

Backends (`impl`): "pallas" (the kernel; bf16, M <= MAX_ROWS), "interpret" (the same
kernel in the Pallas interpreter, for CPU tests), "xla" (`reference`: any dtype and
M) and "auto" (pallas on a GPU for bf16 and supported shapes, xla otherwise).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _triton as tr
from pallas_kernels.reference import rms_factor

DTYPES = (jnp.bfloat16, jnp.float32)
# Tokens per call the kernel takes (rows padded to one 16-row tensor-core tile). On an
# H100 it beats XLA's norm and GEMM by 2.9 us at M = 1 and 0.3 us at M = 8, and loses
# by 7 us at M = 64 (docs/performance_notes.md, "Generation").
MAX_ROWS = 8
_TILE_ROWS = 16
_F32 = jnp.float32
# x elements per load of the sum of squares (a [rows, cols] fp32 value in registers).
_NORM_LOAD = 4096
# Elements of x (M * H) up to which the kernel loads them for the norm before its loop.
_EARLY_NORM_LOAD = 4096


@dataclasses.dataclass(frozen=True)
class ProjectionConfig:
    """The kernel's launch. block_n: output columns per program; block_k: H columns
    per step of its loop (halved for larger M until the pipelined tiles fit);
    num_warps, num_stages: Triton launch parameters of the loop."""

    block_n: int = 64
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 4

    def unsupported(self, h: int, f: int) -> str | None:
        """Why these launches cannot run d_model H and F output columns, or None."""
        for field in ("block_n", "block_k", "num_warps"):
            if not tr.is_pow2(getattr(self, field)):
                return f"ProjectionConfig.{field}={getattr(self, field)} must be a power of two"
        if min(self.block_n, self.block_k) < 16:
            return "ProjectionConfig block sizes must be >= 16 (tensor-core tiles)"
        if f % self.block_n:
            return f"F={f} is not a multiple of ProjectionConfig.block_n={self.block_n}"
        if h % self.block_k:
            return f"H={h} is not a multiple of ProjectionConfig.block_k={self.block_k}"
        return None


def fitted_config(h: int, f: int) -> ProjectionConfig:
    """The default launch with block_k and block_n halved (not below 16) until they
    divide H and F, so that small models run the kernel too."""
    cfg = ProjectionConfig()
    bk, bn = cfg.block_k, cfg.block_n
    while h % bk and bk > 16:
        bk //= 2
    while f % bn and bn > 16:
        bn //= 2
    return dataclasses.replace(cfg, block_k=bk, block_n=bn)


def reference(x: jax.Array, w_scaled: jax.Array, eps: float) -> jax.Array:
    """The op in jnp: x [M, H], w_scaled [F, H] -> [M, F] in x's dtype."""
    y = lax.dot_general(
        x, w_scaled.astype(x.dtype), (((1,), (1,)), ((), ())), preferred_element_type=_F32
    )
    return (y * rms_factor(x, eps)).astype(x.dtype)


def _norm_loads(x_ref) -> list[jax.Array]:
    """row_factors' loads of x_ref [M, H]: its M rows (rounded up to a power of two, 0
    past M) in pieces of at most _NORM_LOAD elements, x's dtype [Mr, cols] each, cols
    a power of two that divides H (H = 768: pieces of 256, none past the row's end)."""
    m, h = x_ref.shape
    mr = tr.next_pow2(m)
    cols = min(tr.next_pow2(h + 1) // 2, max(16, _NORM_LOAD // mr))
    while h % cols:  # H is a multiple of the kernel's block_k (>= 16)
        cols //= 2
    norm_rows = tr.iota(mr)
    return [
        tr.load(
            x_ref.at[norm_rows[:, None], (start + tr.iota(cols))[None, :]],
            mask=(norm_rows < m)[:, None],
            other=0,
        )
        for start in range(0, h, cols)
    ]


def row_factors(x_ref, tile_rows: int, eps: float, loads: list | None = None) -> jax.Array:
    """Inside a kernel: fp32 [tile_rows], rsqrt(mean(x_r^2) + eps) for each row r of
    x_ref [M, H] (M <= tile_rows) and 0 past M. Sums only the M real rows, in loads
    that issue together (`_norm_loads`; `loads` where the caller issued them earlier),
    their squares added elementwise and reduced across threads once (each reduction
    is a barrier)."""
    m, h = x_ref.shape
    loads = _norm_loads(x_ref) if loads is None else loads
    mr, cols = loads[0].shape
    norm_rows = tr.iota(mr)
    squares = jnp.zeros((mr, cols), _F32)
    for xs in loads:
        xs = xs.astype(_F32)
        squares = squares + xs * xs
    factor = lax.rsqrt(jnp.sum(squares, axis=1) / h + eps)  # [mr]
    # onto the tile's rows (Triton has no slicing or padding of a value)
    pick = (tr.iota(tile_rows)[:, None] == norm_rows[None, :]) & (norm_rows < m)[None, :]
    return jnp.sum(jnp.where(pick, factor[None, :], 0.0), axis=1)


def _kernel(x_ref, w_ref, y_ref, *, block_n, block_k, eps):
    m, h = x_ref.shape
    j = tr.program_id(0, w_ref.shape[0] // block_n)
    mp = _TILE_ROWS
    rows = tr.iota(mp)
    row_ok = rows < m

    def step(k, acc):
        cols = k * block_k + tr.iota(block_k)
        xk = tr.load(x_ref.at[rows[:, None], cols[None, :]], mask=row_ok[:, None], other=0)
        wk = tr.load(w_ref.at[pl.ds(j * block_n, block_n), pl.ds(k * block_k, block_k)])
        return acc + lax.dot_general(xk, wk, (((1,), (1,)), ((), ())), preferred_element_type=_F32)

    # The factors after the loop: a use of the x tile inside the loop besides the dot
    # slows the loop (docs/performance_notes.md, "Decode"). For a few rows their loads
    # issue before it and arrive during it, so that nothing after the loop waits on
    # memory; more rows would hold too many registers through the loop.
    loads = _norm_loads(x_ref) if m * h <= _EARLY_NORM_LOAD else None
    acc = lax.fori_loop(0, h // block_k, step, jnp.zeros((mp, block_n), _F32))
    y = (acc * row_factors(x_ref, mp, eps, loads)[:, None]).astype(y_ref.dtype)
    out_cols = j * block_n + tr.iota(block_n)
    tr.store(y_ref.at[rows[:, None], out_cols[None, :]], y, mask=row_ok[:, None])


@functools.partial(jax.jit, static_argnames=("eps", "cfg", "interpret"))
def _launch(x, w_scaled, *, eps: float, cfg: ProjectionConfig, interpret: bool):
    m = x.shape[0]
    f = w_scaled.shape[0]
    block_k = tr.fit_columns(cfg.block_k, _TILE_ROWS + cfg.block_n, cfg.num_stages)
    kernel = functools.partial(_kernel, block_n=cfg.block_n, block_k=block_k, eps=eps)
    return tr.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, f), x.dtype),
        grid=(f // cfg.block_n,),
        compiler_params=tr.compiler_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name="normed_projection",
    )(x, w_scaled)


def _shape_unsupported(x: jax.Array, w_scaled: jax.Array, cfg: ProjectionConfig) -> str | None:
    """Why the kernel cannot take operands of these (valid) shapes, or None."""
    if x.shape[0] > MAX_ROWS:
        return f"M={x.shape[0]} rows is more than the kernel's MAX_ROWS={MAX_ROWS}"
    return cfg.unsupported(x.shape[1], w_scaled.shape[0])


def kernel_unsupported(x: jax.Array, w_scaled: jax.Array, cfg: ProjectionConfig) -> str | None:
    """Why the kernel cannot take these (valid) operands, or None."""
    if x.dtype != jnp.bfloat16:
        return f"the kernel is bf16 only (x is {x.dtype})"
    return _shape_unsupported(x, w_scaled, cfg)


def _check(x: jax.Array, w_scaled: jax.Array) -> None:
    if x.ndim != 2 or w_scaled.ndim != 2:
        raise ValueError(f"x {x.shape} and w_scaled {w_scaled.shape} must be 2-D: [M, H], [F, H]")
    if x.shape[0] == 0:
        raise ValueError("x has no rows (M=0)")
    if w_scaled.shape[1] != x.shape[1]:
        raise ValueError(f"w_scaled {w_scaled.shape} must be [F, H] with H={x.shape[1]} as x's")
    if x.dtype not in DTYPES or w_scaled.dtype != x.dtype:
        raise ValueError(
            f"x ({x.dtype}) and w_scaled ({w_scaled.dtype}) must share one of bfloat16, float32"
        )


def normed_projection(
    x: jax.Array,
    w_scaled: jax.Array,
    *,
    eps: float,
    impl: str = "auto",
    config: ProjectionConfig | None = None,
) -> jax.Array:
    """rsqrt(mean(x^2) + eps) * (x w_scaled^T), per row (module docstring).

    x: [M, H], the residual stream (not normed); w_scaled: [F, H], the projection
    with the norm's scale folded into its columns, x's dtype; eps: the norm's epsilon;
    config: the kernel's launch (None: the defaults, blocks halved to divide H and F).
    Returns [M, F] in x's dtype. Raises ValueError for bad shapes, dtypes or impl, and
    for impl "pallas" / "interpret" on operands the kernel cannot take.
    """
    _check(x, w_scaled)
    if config is None:
        config = fitted_config(x.shape[1], w_scaled.shape[0])
    reason = _shape_unsupported(x, w_scaled, config)
    impl = tr.resolve_impl(impl, x.dtype, reason, "x")
    if impl == "xla":
        return reference(x, w_scaled, eps)
    return _launch(x, w_scaled, eps=float(eps), cfg=config, interpret=impl == "interpret")
