"""(Gated)T2D kernels (TwELL SDDMM and SpMM) against dense jnp references.

Two kinds of numeric checks:
- exact: integer-valued bf16 inputs make every product and partial sum exact in fp32,
  so the kernels must reproduce the dense bf16 reference bit for bit (any indexing,
  masking or packing mistake shows up as a mismatch);
- random: normal inputs; the bf16 rule: the kernel's error against an fp32 truth is
  at most 1.5x the dense bf16 reference's own error, plus 1e-3 of the scale.

Each runs in the Pallas interpreter (CPU CI) and, marked `gpu`, compiled on the GPU.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import reference
from pallas_kernels._gather import RowLaunch
from pallas_kernels.twell import format as fmt
from pallas_kernels.twell import t2d as t2d_mod
from pallas_kernels.twell.config import T2DConfig
from pallas_kernels.twell.pack import gate_then_pack
from pallas_kernels.twell.t2d import t2d
from tests.lowering import count_triton_calls
from tests.pallas_kernels.twell.kernel_cases import (
    INTERPRET_AND_GPU,
    assert_bf16_close,
    integer_mlp,
)

# ----------------------------------------------------------------------------- T2D


def _packed(x, w_sparse, compression):
    return fmt.pack(reference.hidden(x, w_sparse), compression)


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        (T2DConfig(sddmm=RowLaunch(group=3, num_warps=1, block_h=64)), "sddmm.group=3"),
        (T2DConfig(spmm=RowLaunch(group=4, num_warps=3, block_h=64)), "spmm.num_warps=3"),
    ],
)
def test_t2d_rejects_bad_launches(cfg, message):
    w = jnp.zeros((256, 64), jnp.bfloat16)
    packed = jnp.zeros((4, 32), jnp.uint32)
    with pytest.raises(ValueError, match=message):
        t2d(jnp.zeros((4, 64), jnp.bfloat16), packed, (w, w, w), cfg=cfg, interpret=True)


# The small block_h of the SpMM gives several H blocks per row at test widths.
SMALL_T2D = T2DConfig(spmm=RowLaunch(group=4, num_warps=1, block_h=64))


@pytest.mark.parametrize("interpret", INTERPRET_AND_GPU)
@pytest.mark.parametrize("compression", fmt.COMPRESSIONS)
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize("bias", [12.0, 0.0], ids=["sparse", "overflowing"])
def test_t2d_exact(interpret, compression, gated, bias):
    """Bitwise equal to the dense MLP on integer inputs, overflowed tiles included."""
    x, ws, wu, wd = integer_mlp(2, 21, 128, 512, bias)
    x = x.at[4].set(0)
    weights = (ws, wu, wd) if gated else (ws, wd)
    packed = _packed(x, ws, compression)
    out = t2d(x, packed, weights, compression=compression, cfg=SMALL_T2D, interpret=interpret)
    want = reference.gated_mlp(x, *weights) if gated else reference.mlp(x, *weights)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("interpret", INTERPRET_AND_GPU)
@pytest.mark.parametrize("compression", [8, 2])
@pytest.mark.parametrize("bias", [12.0, 0.0], ids=["sparse", "overflowing"])
def test_t2d_exact_high_precision(interpret, compression, bias):
    """Integer inputs, fp32 u and h: only the gate (bf16 in the format) and the output
    are rounded, on the listed entries and on the overflowed tiles' dense path alike."""
    x, ws, wu, wd = integer_mlp(2, 21, 128, 512, bias)
    x = x.at[4].set(0)
    packed = _packed(x, ws, compression)
    out = t2d(
        x, packed, (ws, wu, wd), compression=compression, high_precision=True, cfg=SMALL_T2D,
        interpret=interpret,
    )  # fmt: skip
    f32 = lambda a: np.asarray(a, np.float32)
    gate = f32(reference.hidden(x, ws))  # the bf16 gate the format holds
    want = ((gate * (f32(x) @ f32(wu).T)) @ f32(wd)).astype(jnp.bfloat16)
    np.testing.assert_array_equal(f32(out), f32(want))


@pytest.mark.parametrize("seed", range(4))
def test_t2d_entry_positions_match_a_tile_walk(seed):
    """Entry e's word, from one reduction over the tiles, equals walking the tiles:
    empty tiles, full tiles and overflowed tiles (listed as empty) included."""
    rng = np.random.default_rng(seed)
    slots, n_tiles = 8, 11
    counts = rng.choice([0, 0, 1, 2, slots - 1, slots, 40], size=n_tiles)
    padded = np.zeros(t2d_mod._next_pow2(n_tiles), np.int32)  # as the kernels load them
    padded[:n_tiles] = counts
    ent = t2d_mod._entries_of(jnp.asarray(padded), slots)
    want = [t * slots + 1 + k for t, c in enumerate(counts) if c < slots for k in range(c)]
    assert int(ent.total) == len(want)
    got = []
    for step in range(-(-len(want) // 4)):
        pos, ok = ent.positions(step, 4)
        got += [int(p) for p, o in zip(np.asarray(pos), np.asarray(ok), strict=True) if o]
    assert got == want


@pytest.mark.parametrize("interpret", INTERPRET_AND_GPU)
@pytest.mark.parametrize("group", [1, 2, 8])
def test_t2d_entry_groups(interpret, group):
    x, ws, wu, wd = integer_mlp(3, 9, 128, 768, 10.0)
    one = RowLaunch(group=group, num_warps=1, block_h=64)
    cfg = dataclasses.replace(SMALL_T2D, sddmm=one, spmm=one)
    out = t2d(
        x,
        _packed(x, ws, 4),
        (ws, wu, wd),
        compression=4,
        cfg=cfg,
        interpret=interpret,
    )
    np.testing.assert_array_equal(
        np.asarray(out, np.float32), np.asarray(reference.gated_mlp(x, ws, wu, wd), np.float32)
    )


@pytest.mark.parametrize("interpret", INTERPRET_AND_GPU)
@pytest.mark.parametrize("h", [1024, 2048, 192])
def test_t2d_d_model_sizes(interpret, h):
    """Production H, another power of two, and a non-power-of-two H (chunked loads)."""
    x, ws, wu, wd = integer_mlp(4, 4, h, 256, 0.0, gated_bias=False)
    x = x.at[:, 1:].set(jnp.clip(x[:, 1:], -1, 1))
    ws = ws.at[:, 0].set(-float(h) / 8)
    # production block_h: H=2048 gives 2 SpMM blocks
    out = t2d(x, _packed(x, ws, 8), (ws, wu, wd), compression=8, interpret=interpret)
    assert_bf16_close(out, x, (ws, wu, wd), gated=True)


@pytest.mark.parametrize("interpret", INTERPRET_AND_GPU)
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
def test_t2d_random_bf16_rule(interpret, gated):
    rng = np.random.default_rng(5)
    m, h, n = 16, 256, 512
    x = rng.standard_normal((m, h)).astype(np.float32)
    x[:, 0] = 1.0
    ws = rng.standard_normal((n, h)) * 0.06
    ws[:, 0] = -1.5  # ~2% density
    wu, wd = (rng.standard_normal((n, h)) * 0.06 for _ in range(2))
    x, ws, wu, wd = (jnp.asarray(a, jnp.bfloat16) for a in (x, ws, wu, wd))
    weights = (ws, wu, wd) if gated else (ws, wd)
    out = t2d(x, _packed(x, ws, 8), weights, compression=8, cfg=SMALL_T2D, interpret=interpret)
    assert_bf16_close(out, x, weights, gated)


@pytest.mark.parametrize("interpret", INTERPRET_AND_GPU)
def test_t2d_high_precision_is_closer_to_fp32(interpret):
    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.standard_normal((8, 128)), jnp.bfloat16).at[:, 0].set(1)
    ws, wu, wd = (
        jnp.asarray(rng.standard_normal((256, 128)) * 0.1, jnp.bfloat16) for _ in range(3)
    )
    ws = ws.at[:, 0].set(-0.3)
    packed = _packed(x, ws, 4)
    gate = reference.hidden(x, ws).astype(jnp.float32)
    up = jnp.dot(x.astype(jnp.float32), wu.astype(jnp.float32).T)
    truth = jnp.dot(gate * up, wd.astype(jnp.float32))
    cfg = SMALL_T2D
    hp = t2d(
        x, packed, (ws, wu, wd), compression=4, high_precision=True, cfg=cfg, interpret=interpret
    )
    low = t2d(x, packed, (ws, wu, wd), compression=4, cfg=cfg, interpret=interpret)
    err_hi = float(jnp.max(jnp.abs(hp.astype(jnp.float32) - truth)))
    err_lo = float(jnp.max(jnp.abs(low.astype(jnp.float32) - truth)))
    scale = float(jnp.max(jnp.abs(truth)))
    assert err_hi <= 8e-3 * scale  # output rounding to bf16 only
    assert err_hi <= err_lo


# ------------------------------------------------------- cross-lowering to CUDA (CPU CI)

M_PROD, H_PROD, N_PROD = 16384, 2048, 5632


@pytest.mark.parametrize("compression", fmt.COMPRESSIONS)
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
@pytest.mark.parametrize("high_precision", [False, True], ids=["bf16", "hp"])
def test_t2d_lowers_for_cuda(compression, gated, high_precision):
    x = jnp.zeros((M_PROD, H_PROD), jnp.bfloat16)
    packed = jnp.zeros((M_PROD, N_PROD // compression), jnp.uint32)
    w = jnp.zeros((N_PROD, H_PROD), jnp.bfloat16)
    weights = (w, w, w) if gated else (w, w)

    def fn(x, packed, *weights):
        return t2d(
            x,
            packed,
            weights,
            compression=compression,
            high_precision=high_precision,
            interpret=False,
        )

    # gated: SDDMM then SpMM; non-gated: the SpMM alone.
    assert count_triton_calls(fn, x, packed, *weights) == (2 if gated else 1)


def test_t2d_lowers_for_cuda_at_non_power_of_two_width():
    x = jnp.zeros((M_PROD, 768), jnp.bfloat16)
    w = jnp.zeros((3072, 768), jnp.bfloat16)
    packed = jnp.zeros((M_PROD, 3072 // 8), jnp.uint32)
    fn = lambda x, p, a, b, c: t2d(x, p, (a, b, c), interpret=False)
    assert count_triton_calls(fn, x, packed, w, w, w) == 2


@pytest.mark.gpu
def test_gpu_production_shape_against_dense():
    """H=2048, N=5632, odd M, ~30 non-zeros per row, default block sizes."""
    from twell_jax.synthetic import synthetic_mlp

    x, wg, wu, wd = synthetic_mlp(4099, H_PROD, N_PROD, 30.0)
    packed = jax.jit(lambda x, w: gate_then_pack(x, w))(x, wg)
    np.testing.assert_array_equal(
        np.asarray(fmt.unpack(packed, N_PROD, 8) != 0),
        np.asarray(reference.hidden(x, wg) != 0),
    )
    out = jax.jit(lambda *a: t2d(a[0], a[1], a[2:]))(x, packed, wg, wu, wd)
    assert_bf16_close(out, x, (wg, wu, wd), gated=True)
