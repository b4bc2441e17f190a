"""The decode op's two Pallas-Triton kernels (docs/design.md §4.5).

    up = gate_up(x, w_gate, w_up)            # one program per block of neurons
    out = down(m, up, w_down)                # one program per H block (x splits)

gate_up reads all of W_gate (the step's unavoidable bytes) and, per neuron block, the
rows of W_up of neurons that fire for some token: a masked load of a row that no token
needs moves no memory, and a block with no active neuron skips its up loop. Each block
also lists its active neurons (a local compaction) and counts them. down gathers
h[:, ids] and W_down[ids] chunk by chunk over the K active neurons only; a program
finds the ids of a chunk from the block counts (slot t of the global list lies in the
block whose running count first passes t), so no pass over [N] runs between the two
kernels: an XLA compaction (jnp.nonzero) took as long as both kernels
(docs/performance_notes.md, "Decode").

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

_F32 = jnp.float32
_BF16 = jnp.bfloat16
_F32_MAX = float(jnp.finfo(jnp.float32).max)
MAX_TOKENS = 64


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Launches of the two kernels (static arguments of the op).

    block_n: neurons per gate_up program; block_k: H columns per step of its loops.
    block_h: output columns per down program; chunk: active neurons gathered per step.
      block_k shrinks for larger M so the pipelined tiles fit in shared memory.
    splits: down programs per H block, each summing every splits-th chunk into its own
      fp32 partial (added by XLA); 1 writes the output directly. More splits help when
      many neurons are active (larger M), fewer when few are; 0 picks by M (`splits_for`).
    """

    block_n: int = 64
    block_k: int = 256
    gate_warps: int = 4
    gate_stages: int = 3
    block_h: int = 64
    chunk: int = 64
    splits: int = 0
    down_warps: int = 4
    down_stages: int = 2

    def unsupported(self, h: int, n: int) -> str | None:
        """Why these launches cannot run d_model H and d_ff N, or None."""
        for field in ("block_n", "block_k", "block_h", "chunk", "gate_warps", "down_warps"):
            if not tr.is_pow2(getattr(self, field)):
                return f"DecodeConfig.{field}={getattr(self, field)} must be a power of two"
        if min(self.block_n, self.block_k, self.block_h, self.chunk) < 16:
            return "DecodeConfig block sizes must be >= 16 (tensor-core tiles)"
        if self.splits < 0:
            return f"DecodeConfig.splits={self.splits} must be >= 0 (0: by M)"
        if n % self.block_n:
            return f"N={n} is not a multiple of DecodeConfig.block_n={self.block_n}"
        for field in ("block_k", "block_h"):
            if h % getattr(self, field):
                return f"H={h} is not a multiple of DecodeConfig.{field}={getattr(self, field)}"
        return None


def padded_rows(m: int) -> int:
    """Mp: M rounded up to a power of two, at least 16."""
    return max(16, tr.next_pow2(m))


def splits_for(cfg: DecodeConfig, mp: int) -> int:
    """cfg.splits, or for 0: 1 at Mp = 16 (a few chunks), Mp / 16 above."""
    return cfg.splits or mp // 16


# Shared memory the pipelined gate_up tiles may take (of 227 KB per H100 / H200 SM).
_SMEM_BYTES = 160 * 1024


def _fit_block_k(cfg: DecodeConfig, mp: int) -> int:
    """block_k halved until the gate_up loop's stages of x and weight tiles fit."""
    bk = cfg.block_k
    while bk > 16 and cfg.gate_stages * (mp + cfg.block_n) * bk * 2 > _SMEM_BYTES:
        bk //= 2
    return bk


class GateUp(NamedTuple):
    """gate_up's outputs. h bf16 [Mp, N] (0 for inactive neurons and padding rows);
    counts int32 [N]: tokens with a non-zero (or NaN) gate per neuron; ids int32 [N]:
    block b's active neurons at b * block_n + [0, block_counts[b]), ascending;
    block_counts int32 [N / block_n]; bad int32 [Mp]: 1 for a row of x that is not
    finite."""

    h: jax.Array
    counts: jax.Array
    ids: jax.Array
    block_counts: jax.Array
    bad: jax.Array


def _dot_t(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [P, K] . b [Q, K]^T in fp32."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=_F32)


def _gate_up_kernel(x_ref, wg_ref, wu_ref, h_ref, counts_ref, ids_ref, bcount_ref, bad_ref,
                    *, mp, block_n, block_k):  # fmt: skip
    """Program j: neurons j*block_n + [0, block_n); the outputs are `GateUp`'s
    (bad_ref written by program 0)."""
    m, h = x_ref.shape
    n = wg_ref.shape[0]
    j = tr.program_id(0, n // block_n)
    rows = tr.iota(mp)
    row_ok = rows < m
    neurons = pl.ds(j * block_n, block_n)
    steps = h // block_k

    def x_piece(k):
        cols = k * block_k + tr.iota(block_k)
        return tr.load(x_ref.at[rows[:, None], cols[None, :]], mask=row_ok[:, None], other=0)

    def gate_step(k, carry):
        acc, bad = carry
        xk = x_piece(k)
        wk = tr.load(wg_ref.at[neurons, pl.ds(k * block_k, block_k)])
        finite = jnp.abs(xk.astype(_F32)) <= _F32_MAX  # False for inf and NaN
        bad = jnp.maximum(bad, jnp.max(jnp.where(finite, 0, 1), axis=1))
        return acc + _dot_t(xk, wk), bad

    zeros = jnp.zeros((mp, block_n), _F32)
    g32, bad = lax.fori_loop(0, steps, gate_step, (zeros, jnp.zeros((mp,), jnp.int32)))
    # relu that keeps NaN, as jax.nn.relu does (Triton's maximum drops it)
    g = jnp.where(g32 <= 0, 0, g32).astype(_BF16)
    fired = jnp.where(g != 0, 1, 0)  # NaN != 0: a NaN gate is read and propagates
    counts = jnp.sum(fired, axis=0)
    live = jnp.broadcast_to((counts > 0)[:, None], (block_n, block_k))

    def up():
        def up_step(k, acc):
            wk = tr.load(wu_ref.at[neurons, pl.ds(k * block_k, block_k)], mask=live, other=0)
            return acc + _dot_t(x_piece(k), wk)

        return lax.fori_loop(0, steps, up_step, zeros)

    u32 = lax.cond(jnp.sum(counts) > 0, up, lambda: zeros)
    hv = (g.astype(_F32) * u32.astype(_BF16).astype(_F32)).astype(_BF16)
    h_ref[:, neurons] = hv
    counts_ref[neurons] = counts
    # The block's own compaction, a stable partition: active neurons first, ascending,
    # then the rest; every lane stores to its own slot (no masked duplicates).
    active = jnp.where(counts > 0, 1, 0)
    lane = tr.iota(block_n)
    before = jnp.cumsum(active)  # active lanes in [0, lane]
    n_active = jnp.sum(active)
    slot = jnp.where(active > 0, before - 1, n_active + lane - before)
    tr.store(ids_ref.at[j * block_n + slot], j * block_n + lane)
    bcount_ref[j] = n_active

    @pl.when(j == 0)
    def _():
        bad_ref[...] = bad


def gate_up(x, w_gate, w_up, cfg: DecodeConfig, *, interpret: bool) -> GateUp:
    """x [M, H] bf16, w_gate and w_up [N, H] bf16 -> `GateUp`."""
    m, _ = x.shape
    n = w_gate.shape[0]
    mp = padded_rows(m)
    kernel = functools.partial(
        _gate_up_kernel, mp=mp, block_n=cfg.block_n, block_k=_fit_block_k(cfg, mp)
    )
    out = tr.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((mp, n), _BF16),
            jax.ShapeDtypeStruct((n,), jnp.int32),
            jax.ShapeDtypeStruct((n,), jnp.int32),
            jax.ShapeDtypeStruct((n // cfg.block_n,), jnp.int32),
            jax.ShapeDtypeStruct((mp,), jnp.int32),
        ),
        grid=(n // cfg.block_n,),
        compiler_params=tr.compiler_params(cfg.gate_warps, cfg.gate_stages),
        interpret=interpret,
        name="decode_gate_up",
    )(x, w_gate, w_up)
    return GateUp(*out)


def _down_kernel(ids_ref, bcount_ref, h_ref, bad_ref, wd_ref, out_ref, *, m, chunk, block_h,
                 block_n, splits):  # fmt: skip
    """Program (H block b, split s): the sum over chunks s, s + splits, ... of the K
    active neurons of h[:, ids] W_down[ids, b]; a row of x that is not finite gets NaN.

    Slot t of the global id list is in block nb(t) = #{blocks whose running count ends
    at or before t}, at local position t - (the counts of those blocks).
    out_ref: [M, H] x.dtype when splits == 1, else fp32 partials [splits, Mp, H].
    """
    mp = h_ref.shape[0]
    h = wd_ref.shape[1]
    nb = bcount_ref.shape[0]
    nbp = tr.next_pow2(nb)
    b = tr.program_id(0, h // block_h)
    s = tr.program_id(1, splits)
    rows = tr.iota(mp)
    cols = b * block_h + tr.iota(block_h)
    blocks = tr.iota(nbp)
    bcount = tr.load(bcount_ref.at[blocks], mask=blocks < nb, other=0)
    ends = jnp.cumsum(bcount)
    k = jnp.sum(bcount)
    chunks = (k + chunk - 1) // chunk
    trips = (jnp.maximum(chunks - s, 0) + splits - 1) // splits

    def step(i, acc):
        t = (s + i * splits) * chunk + tr.iota(chunk)
        ok = t < k
        before = ends[None, :] <= t[:, None]  # [chunk, nbp]
        block = jnp.sum(jnp.where(before, 1, 0), axis=1)
        start = jnp.sum(jnp.where(before, bcount[None, :], 0), axis=1)
        ids = tr.load(ids_ref.at[block * block_n + t - start], mask=ok, other=0)
        hg = tr.load(h_ref.at[rows[:, None], ids[None, :]], mask=ok[None, :], other=0)
        wg = tr.load(wd_ref.at[ids[:, None], cols[None, :]], mask=ok[:, None], other=0)
        return acc + jnp.dot(hg, wg, preferred_element_type=_F32)

    acc = lax.fori_loop(0, trips, step, jnp.zeros((mp, block_h), _F32))
    acc = jnp.where((tr.load(bad_ref.at[rows]) > 0)[:, None], jnp.nan, acc)
    if splits == 1:
        mask = jnp.broadcast_to((rows < m)[:, None], (mp, block_h))
        tr.store(out_ref.at[rows[:, None], cols[None, :]], acc.astype(out_ref.dtype), mask=mask)
    else:
        out_ref[s, :, pl.ds(b * block_h, block_h)] = acc


def down(m: int, up: GateUp, w_down, cfg: DecodeConfig, *, interpret: bool):
    """out [M, H] bf16: h W_down over the active neurons of `up` (see `_down_kernel`)."""
    mp = up.h.shape[0]
    hd = w_down.shape[1]
    splits = splits_for(cfg, mp)
    kernel = functools.partial(
        _down_kernel,
        m=m,
        chunk=cfg.chunk,
        block_h=cfg.block_h,
        block_n=cfg.block_n,
        splits=splits,
    )
    if splits == 1:
        out_shape = jax.ShapeDtypeStruct((m, hd), w_down.dtype)
    else:
        out_shape = jax.ShapeDtypeStruct((splits, mp, hd), _F32)
    out = tr.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(hd // cfg.block_h, splits),
        compiler_params=tr.compiler_params(cfg.down_warps, cfg.down_stages),
        interpret=interpret,
        name="decode_down",
    )(up.ids, up.block_counts, up.h, up.bad, w_down)
    if splits == 1:
        return out
    return jnp.sum(out, axis=0)[:m].astype(w_down.dtype)
