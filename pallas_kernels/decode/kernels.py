"""The decode op's two Pallas-Triton kernels (docs/design.md §4.5).

    part, counts, block_counts, bad = gate_up_down(x, w_gate, w_up, w_down)  # per neuron block
    out = reduce_blocks(part, block_counts, bad)                            # per (row, H block)

gate_up_down reads all of W_gate (the step's unavoidable bytes) and, in a block of
neurons where some token fires, only the rows of W_up and W_down of its firing
neurons, `group` at a time (a compaction in registers): a group's W_up rows make its
h columns, and its W_down rows add h_group W_down[group] to the block's fp32 share of
the output, so each group's rows are gathered once for both products. A block where
nothing fires writes a zero share. reduce_blocks adds all blocks' shares in block
order (deterministic) and rounds once to bf16.

Why this shape: every phase after the gate waits on a memory round trip, and at
decode sizes those round trips, not bytes, set the time; a down kernel that looked up
each chunk of active ids from the block counts chained three of them per chunk
(docs/performance_notes.md, "Decode").

With `eps`, gate_up_down computes the FFN of x / rms(x) (the norm's scale folded into
W_gate and W_up): each row's factor is taken from x after the gate loop and scales
the fp32 gate and up products; reduce_blocks can add a residual.

Shapes: x [M, H] bf16 with M <= 64 (padded inside to Mp = max(16, 2^ceil(log2 M))
rows, the smallest tensor-core tile); weights [N, H] bf16 (w_down is down_proj
transposed). Products round as `pallas_kernels.reference.gated_mlp`: each GEMM
accumulates in fp32, g and x Wu^T are rounded to bf16, h = g * (x Wu^T) is rounded to
bf16, the output is rounded once from its fp32 sum.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _triton as tr
from pallas_kernels.normed_projection import row_factors

_F32 = jnp.float32
_BF16 = jnp.bfloat16
_F32_MAX = float(jnp.finfo(jnp.float32).max)
MAX_TOKENS = 64


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Launches of the two kernels (static arguments of the op).

    block_n: neurons per gate_up_down program; block_k: H columns per step of its gate
      loop (shrunk for larger M so the pipelined tiles fit in shared memory);
      up_block_k: H columns per step of a group's up loop (shrunk like block_k);
      group: active neurons whose W_up and W_down rows are gathered together;
      block_h: H columns per step of a group's down loop (shrunk, like block_k, where
      the tiles would not fit).
    reduce_h: output columns per reduce_blocks program.
    row_products_max_m: for M up to this, the firing neurons' products are per-row
      CUDA-core dot products over whole rows of W_up and W_down, `row_group` neurons
      at a time: one gather round trip per group, where the tensor-core tiles pad M
      to 16 rows and loop over H. Each token row adds ~1.5 us to a block's program,
      so above M = 4 the tiles are faster (docs/performance_notes.md, "Decode").
    row_warps: gate_up_down's warps where the row products run (gate_warps otherwise):
      the whole [row_group, H] rows and the M rows of x held in registers.
    """

    block_n: int = 64
    block_k: int = 256
    up_block_k: int = 512
    group: int = 16
    block_h: int = 256
    gate_warps: int = 4
    gate_stages: int = 4
    reduce_h: int = 64
    reduce_warps: int = 4
    row_products_max_m: int = 4
    row_group: int = 4
    row_warps: int = 8

    def unsupported(self, h: int, n: int) -> str | None:
        """Why these launches cannot run d_model H and d_ff N, or None."""
        fields = ("block_n", "block_k", "up_block_k", "group", "block_h", "reduce_h", "gate_warps",
                  "reduce_warps", "row_group", "row_warps")  # fmt: skip
        for field in fields:
            if not tr.is_pow2(getattr(self, field)):
                return f"DecodeConfig.{field}={getattr(self, field)} must be a power of two"
        if min(self.block_n, self.block_k, self.up_block_k, self.group, self.block_h) < 16:
            return "DecodeConfig block sizes must be >= 16 (tensor-core tiles)"
        if n % self.block_n:
            return f"N={n} is not a multiple of DecodeConfig.block_n={self.block_n}"
        for field in ("block_k", "up_block_k", "block_h", "reduce_h"):
            if h % getattr(self, field):
                return f"H={h} is not a multiple of DecodeConfig.{field}={getattr(self, field)}"
        return None


def padded_rows(m: int) -> int:
    """Mp: M rounded up to a power of two, at least 16."""
    return max(16, tr.next_pow2(m))


# Shared memory the whole kernel may take: the gate loop's pipelined tiles with the
# down loop's stages of W_down tiles (the card has 227 KB; the defaults at Mp = 64
# come close to it).
_SMEM_TOTAL_BYTES = 220 * 1024


def _fit_block_k(cfg: DecodeConfig, mp: int) -> int:
    """block_k for the gate loop's x and W_gate tiles."""
    return tr.fit_columns(cfg.block_k, mp + cfg.block_n, cfg.gate_stages)


def _fit_up_block_k(cfg: DecodeConfig, mp: int) -> int:
    """up_block_k for the up loop's x and W_up tiles."""
    return tr.fit_columns(cfg.up_block_k, mp + cfg.group, cfg.gate_stages)


def _fit_block_h(cfg: DecodeConfig, mp: int) -> int:
    """block_h halved until the gate and down loops' pipelined tiles fit together."""
    gate = cfg.gate_stages * (mp + cfg.block_n) * _fit_block_k(cfg, mp) * 2
    bh = cfg.block_h
    while bh > 16 and gate + cfg.gate_stages * cfg.group * bh * 2 > _SMEM_TOTAL_BYTES:
        bh //= 2
    return bh


class BlockShares(NamedTuple):
    """gate_up_down's outputs. part fp32 [N / block_n, M, H]: block b's share of the
    output (zeros where block_counts[b] == 0); counts int32 [N]: tokens with a
    non-zero (or NaN) gate per neuron; block_counts int32 [N / block_n]: active neurons
    per block; bad int32 [H / block_k, Mp]: 1 where piece p of row r of x is not
    finite."""

    part: jax.Array
    counts: jax.Array
    block_counts: jax.Array
    bad: jax.Array


def _dot_t(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [P, K] . b [Q, K]^T in fp32."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=_F32)


def _group_lanes(q, group: int, slot, active, n_active, j):
    """Group q of block j's active neurons (ranks q*group .. q*group + group - 1).

    slot, active: int32 [block_n] (an active lane's rank; 1 where a lane fires).
    Returns onehot bool [group, block_n] (member -> its lane), ok bool [group] (the
    member exists) and ids int32 [group] (its neuron; block j's first where not ok)."""
    block_n = slot.shape[0]
    rank = q * group + tr.iota(group)
    onehot = (slot[None, :] == rank[:, None]) & (active[None, :] > 0)
    ids = j * block_n + jnp.sum(jnp.where(onehot, tr.iota(block_n)[None, :], 0), axis=1)
    return onehot, rank < n_active, ids


def _gate_up_down_kernel(x_ref, wg_ref, wu_ref, wd_ref, part_ref, counts_ref, bcount_ref,
                         bad_ref, *, mp, block_n, block_k, up_block_k, group, block_h,
                         row_group, eps):  # fmt: skip
    """Program j: neurons j*block_n + [0, block_n); the outputs are `BlockShares`'.
    With eps, the products of row r are those of x_r / rms(x_r) (`gate_up_down`)."""
    m, h = x_ref.shape
    n = wg_ref.shape[0]
    nb = n // block_n
    j = tr.program_id(0, nb)
    rows = tr.iota(mp)
    row_ok = rows < m
    neurons = pl.ds(j * block_n, block_n)
    pieces = h // block_k

    def x_cols(cols):
        return tr.load(x_ref.at[rows[:, None], cols[None, :]], mask=row_ok[:, None], other=0)

    def x_piece(k):
        return x_cols(k * block_k + tr.iota(block_k))

    def gate_step(k, acc):
        return acc + _dot_t(x_piece(k), tr.load(wg_ref.at[neurons, pl.ds(k * block_k, block_k)]))

    # The row products take x's rows whole. With a norm, whose factor needs them too,
    # their loads issue before the gate loop and arrive during it, so that the factor
    # does not wait on a load after it (docs/performance_notes.md, "Decode").
    early = row_group and eps is not None
    x_rows = [tr.load(x_ref.at[r, tr.iota(h)]) for r in range(m)] if early else None
    zeros = jnp.zeros((mp, block_n), _F32)
    g32 = lax.fori_loop(0, pieces, gate_step, zeros)
    # The RMSNorm's per-row factor, after the loop (the x tile stays the dot's alone);
    # it commutes with relu (factor > 0) and scales the up products the same way.
    factor = None
    if eps is not None:
        factor = (
            row_factors(x_ref, mp, eps) if x_rows is None else _factors_of_rows(x_rows, mp, eps)
        )
        g32 = g32 * factor[:, None]

    # The finite check of x runs outside the gate loop, one piece per program: inside,
    # a use of the x tile besides the dot slows the loop (docs/performance_notes.md).
    def check_piece(piece):
        finite = jnp.abs(x_piece(piece).astype(_F32)) <= _F32_MAX  # False for inf and NaN
        bad_ref[piece, :] = jnp.max(jnp.where(finite, 0, 1), axis=1)

    for p in range(pl.cdiv(pieces, nb)):
        pl.when(j + p * nb < pieces)(functools.partial(check_piece, j + p * nb))

    # relu that keeps NaN, as jax.nn.relu does (Triton's maximum drops it)
    g = jnp.where(g32 <= 0, 0, g32).astype(_BF16)
    # NaN != 0: read, propagates. Padding rows are zeros, but 0 * inf is NaN: masked.
    counts = jnp.sum(jnp.where((g != 0) & row_ok[:, None], 1, 0), axis=0)
    active = jnp.where(counts > 0, 1, 0)
    n_active = jnp.sum(active)
    counts_ref[neurons] = counts
    bcount_ref[j] = n_active
    slot = jnp.cumsum(active) - 1  # an active lane's rank in the block

    # A block where nothing fires writes a zero share, so that the block sum loads
    # every share at once instead of first loading which blocks fired (one round
    # trip to memory instead of two, docs/performance_notes.md, "Decode").
    @pl.when(n_active == 0)
    def _():
        def zero_row(r, carry):
            tr.store(part_ref.at[j, r, tr.iota(h)], jnp.zeros((h,), _F32))
            return carry

        lax.fori_loop(0, m, zero_row, 0)

    if row_group:
        fire = functools.partial(
            _fire_by_rows, x_ref, wu_ref, wd_ref, part_ref, j=j, group=row_group, factor=factor,
            x_rows=x_rows,
        )  # fmt: skip
        pl.when(n_active > 0)(lambda: fire(g, active, slot, n_active))
        return

    @pl.when(n_active > 0)
    def _():
        out_ok = jnp.broadcast_to(row_ok[:, None], (mp, block_h))

        def up_down_group(q, carry, *, first):
            onehot, ok, ids = _group_lanes(q, group, slot, active, n_active, j)

            def up_step(k, acc):
                cols = k * up_block_k + tr.iota(up_block_k)
                xk = x_cols(cols)
                wk = tr.load(wu_ref.at[ids[:, None], cols[None, :]], mask=ok[:, None], other=0)
                return acc + _dot_t(xk, wk)

            zeros = jnp.zeros((mp, group), _F32)
            u = lax.fori_loop(0, h // up_block_k, up_step, zeros)
            if factor is not None:
                u = u * factor[:, None]
            sel = jnp.where(onehot, 1.0, 0.0).astype(_BF16)  # [group, block_n]
            g_ids = _dot_t(g, sel)  # g[:, ids], exact: one term per column
            hv = (g_ids * u.astype(_BF16).astype(_F32)).astype(_BF16)  # [Mp, group]

            def down_step(c, carry):
                cols = c * block_h + tr.iota(block_h)
                wd = tr.load(wd_ref.at[ids[:, None], cols[None, :]], mask=ok[:, None], other=0)
                dst = part_ref.at[j, rows[:, None], cols[None, :]]
                share = jnp.dot(hv, wd, preferred_element_type=_F32)
                if not first:  # a later group adds to the block's share so far
                    share = share + tr.load(dst, mask=out_ok, other=0)
                tr.store(dst, share, mask=out_ok)
                return carry

            return lax.fori_loop(0, h // block_h, down_step, carry)

        # The first group stores its share without reading one back: a read of the
        # share, even one masked off, held every step of the down loop (~1.7 us of
        # 18 at M = 8; docs/performance_notes.md, "Decode").
        up_down_group(0, 0, first=True)
        later = functools.partial(up_down_group, first=False)
        lax.fori_loop(1, pl.cdiv(n_active, group), later, 0)


def _factors_of_rows(x_rows, tile_rows: int, eps: float) -> jax.Array:
    """fp32 [tile_rows]: rsqrt(mean(x_r^2) + eps) of each loaded row x_r (bf16 [H]),
    0 past the rows."""
    rows = tr.iota(tile_rows)
    factor = jnp.zeros((tile_rows,), _F32)
    for r, x_r in enumerate(x_rows):
        x32 = x_r.astype(_F32)
        f_r = lax.rsqrt(jnp.sum(x32 * x32) / x_r.shape[0] + eps)
        factor = jnp.where(rows == r, f_r, factor)
    return factor


def _fire_by_rows(x_ref, wu_ref, wd_ref, part_ref, g, active, slot, n_active, *, j, group,
                  factor, x_rows=None):  # fmt: skip
    """The firing phase for small M (`DecodeConfig.row_products_max_m`): per group of
    the block's active neurons, their whole W_up and W_down rows in one gather, then
    for each token row r the up products x_r . Wu[id] and the share sum_id h[r, id]
    Wd[id] as CUDA-core products (M is small; nothing is padded).

    The rows of x and of the block's gate are taken once per block, before the groups:
    a load inside the row loop would wait on memory once per row (the reductions'
    barriers keep the compiler from issuing the next row's load early).

    g: bf16 [Mp, block_n] gate of the block; active, slot: int32 [block_n] (1 where a
    lane fires; its rank among the active lanes); n_active: int32 scalar; factor: fp32
    [Mp] norm factors of the rows (None: no norm); x_rows: M values bf16 [H], x's
    rows where the caller loaded them already (None: loaded here)."""
    m, h = x_ref.shape
    rows, cols = tr.iota(g.shape[0]), tr.iota(h)
    g32 = g.astype(_F32)
    if x_rows is None:
        x_rows = [tr.load(x_ref.at[r, cols]) for r in range(m)]  # bf16 [H] each
    g_rows = [jnp.sum(jnp.where(rows[:, None] == r, g32, 0), axis=0) for r in range(m)]
    if factor is not None:
        f_rows = [jnp.sum(jnp.where(rows == r, factor, 0)) for r in range(m)]

    def one_group(q, carry, *, first):
        onehot, ok, ids = _group_lanes(q, group, slot, active, n_active, j)
        wu = tr.load(wu_ref.at[ids[:, None], cols[None, :]], mask=ok[:, None], other=0)
        wd = tr.load(wd_ref.at[ids[:, None], cols[None, :]], mask=ok[:, None], other=0)
        # wu / wd stay bf16 (half the registers of [group, H] fp32 tiles); the
        # products convert them per row
        for r in range(m):
            u = jnp.sum(wu.astype(_F32) * x_rows[r].astype(_F32)[None, :], axis=1)  # [group]
            if factor is not None:
                u = u * f_rows[r]
            g_ids = jnp.sum(jnp.where(onehot, g_rows[r][None, :], 0), axis=1)  # exact: one term
            hv = (g_ids * u.astype(_BF16).astype(_F32)).astype(_BF16).astype(_F32)
            share = jnp.sum(hv[:, None] * wd.astype(_F32), axis=0)  # [H] fp32
            dst = part_ref.at[j, r, cols]
            if not first:  # a later group adds to the share so far
                share = share + tr.load(dst)
            tr.store(dst, share)
        return carry

    one_group(0, 0, first=True)  # stores without a read back, as in the tiles
    lax.fori_loop(1, pl.cdiv(n_active, group), functools.partial(one_group, first=False), 0)


def _row_group(cfg: DecodeConfig, m: int) -> int:
    """Neurons per step of `_fire_by_rows` for M tokens; 0: the tensor-core tiles."""
    return cfg.row_group if m <= cfg.row_products_max_m else 0


def gate_up_down(x, w_gate, w_up, w_down, cfg: DecodeConfig, *, interpret: bool,
                 eps: float | None = None) -> BlockShares:  # fmt: skip
    """x [M, H] bf16, weights [N, H] bf16 -> `BlockShares`. With eps, of the rows
    x_r * rsqrt(mean(x_r^2) + eps) (an RMSNorm whose scale is folded into w_gate and
    w_up): each row's gate and up products are scaled by its factor in fp32, before
    they are rounded."""
    m, h = x.shape
    n = w_gate.shape[0]
    mp = padded_rows(m)
    block_k = _fit_block_k(cfg, mp)
    nb = n // cfg.block_n
    row_group = _row_group(cfg, m)
    kernel = functools.partial(
        _gate_up_down_kernel, mp=mp, block_n=cfg.block_n, block_k=block_k,
        up_block_k=_fit_up_block_k(cfg, mp), group=cfg.group, block_h=_fit_block_h(cfg, mp),
        row_group=row_group, eps=eps,
    )  # fmt: skip
    warps = cfg.row_warps if row_group else cfg.gate_warps
    out = tr.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((nb, m, h), _F32),
            jax.ShapeDtypeStruct((n,), jnp.int32),
            jax.ShapeDtypeStruct((nb,), jnp.int32),
            jax.ShapeDtypeStruct((h // block_k, mp), jnp.int32),
        ),
        grid=(nb,),
        compiler_params=tr.compiler_params(warps, cfg.gate_stages),
        interpret=interpret,
        name="decode_gate_up_down",
    )(x, w_gate, w_up, w_down)
    return BlockShares(*out)


def _reduce_kernel(part_ref, bad_ref, *refs, reduce_h, pieces):
    """Program (row r, H block c): the sum over blocks of part[:, r, block c] (zero
    for blocks where nothing fired), NaN where row r of x is not finite; plus the
    residual's block where refs is (residual_ref, out_ref). part_ref is
    `BlockShares.part` as [nb, M * H], bad_ref `BlockShares.bad` as [pieces * Mp]
    (flat, so every index is one array)."""
    out_ref = refs[-1]
    nb = part_ref.shape[0]
    m, h = out_ref.shape
    mp = bad_ref.shape[0] // pieces
    nbp = tr.next_pow2(nb)
    r = tr.program_id(0, m)
    c = tr.program_id(1, h // reduce_h)
    blocks = tr.iota(nbp)
    cols = r * h + c * reduce_h + tr.iota(reduce_h)
    mask = jnp.broadcast_to((blocks < nb)[:, None], (nbp, reduce_h))
    shares = tr.load(part_ref.at[blocks[:, None], cols[None, :]], mask=mask, other=0)
    total = jnp.sum(shares, axis=0)
    p = tr.iota(tr.next_pow2(pieces))
    bad = jnp.max(tr.load(bad_ref.at[p * mp + r], mask=p < pieces, other=0))
    total = jnp.where(bad > 0, jnp.nan, total).astype(out_ref.dtype)
    block = pl.ds(c * reduce_h, reduce_h)
    if len(refs) == 2:  # the residual add, rounded as x + out in bf16 is
        total = (refs[0][r, block].astype(_F32) + total.astype(_F32)).astype(out_ref.dtype)
    out_ref[r, block] = total


def reduce_blocks(shares: BlockShares, cfg: DecodeConfig, *, interpret: bool,
                  residual: jax.Array | None = None) -> jax.Array:  # fmt: skip
    """out [M, H] bf16: the sum of `shares`' block shares (see `_reduce_kernel`),
    rounded, plus `residual` [M, H] bf16 where given (rounded again)."""
    nb, m, h = shares.part.shape
    pieces = shares.bad.shape[0]
    extra = () if residual is None else (residual,)
    return tr.pallas_call(
        functools.partial(_reduce_kernel, reduce_h=cfg.reduce_h, pieces=pieces),
        out_shape=jax.ShapeDtypeStruct((m, h), _BF16),
        grid=(m, h // cfg.reduce_h),
        compiler_params=tr.compiler_params(cfg.reduce_warps, 1),
        interpret=interpret,
        name="decode_reduce_blocks",
    )(shares.part.reshape(nb, m * h), shares.bad.reshape(-1), *extra)
