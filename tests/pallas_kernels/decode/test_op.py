"""sparse_decode_mlp against the dense reference: kernels, dedup, stats, fallback, errors.

Every numeric test runs the kernels in the Pallas interpreter and, marked gpu, compiled
on the GPU, and the jnp backend ("xla") beside them. Tolerances: integer-valued inputs
make every fp32 sum exact, so there the op must equal `pallas_kernels.reference.gated_mlp`
bit for bit (same gate GEMM, same rounding points, the down GEMM only summing fewer
exact terms). Normal-valued bf16 inputs use the project's bf16 rule
(`assert_bf16_close`: the error against the fp32 truth at most 1.5x the dense bf16
MLP's plus 1e-3 of the output's largest magnitude); fp32 inputs (xla only) allow 1e-5
of the largest magnitude. Inference only: gradients are not tested.
"""

import dataclasses
import statistics

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import reference
from pallas_kernels.decode import DecodeConfig
from tests.lowering import count_triton_calls
from tests.pallas_kernels.twell.kernel_cases import assert_bf16_close, integer_mlp

H, N = 128, 512
# Small launches for H = 128 (the defaults need H % 256 == 0). SMALL_GROUPS has more H
# pieces (8) than neuron blocks (4), so some programs check two pieces of x, and up to
# 8 up groups per block.
SMALL = DecodeConfig(block_n=32, block_k=64, up_block_k=32, block_h=64, reduce_h=64)
# SMALL_GROUPS also takes its firing neurons 2 at a time where M <= 4 (row products);
# TILES runs the tensor-core firing phase at every M (M <= 4 is where it differs).
SMALL_GROUPS = DecodeConfig(
    block_n=128, block_k=16, up_block_k=32, group=16, block_h=32, reduce_h=32, row_group=2
)
TILES = dataclasses.replace(SMALL, row_products_max_m=0)
IMPLS = [
    pytest.param(("interpret", SMALL), id="interpret"),
    pytest.param(("interpret", SMALL_GROUPS), id="interpret_groups"),
    pytest.param(("xla", SMALL), id="xla"),
    pytest.param(("pallas", SMALL), id="gpu", marks=pytest.mark.gpu),
    pytest.param(("pallas", SMALL_GROUPS), id="gpu_groups", marks=pytest.mark.gpu),
]


def normal_mlp(seed: int, m: int, nnz: float, h: int = H, n: int = N):
    """Normal-valued bf16 (x, w_gate, w_up, w_down) with ~nnz positive gate entries per row.

    The density comes from a bias-like column: x[:, 0] = 1 and w_gate[:, 0] = -q, the
    other columns giving unit-variance pre-activations (q = Phi^-1(1 - nnz / N)).
    """
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, h))
    x[:, 0] = 1.0
    wg = rng.standard_normal((n, h)) / np.sqrt(h - 1)
    wg[:, 0] = -statistics.NormalDist().inv_cdf(1.0 - nnz / n)
    wu, wd = (0.05 * rng.standard_normal((n, h)) for _ in range(2))
    return [jnp.asarray(a, jnp.bfloat16) for a in (x, wg, wu, wd)]


def controlled_mlp(seed: int, active: np.ndarray, h: int = 64):
    """Integer bf16 (x, w_gate, w_up, w_down) whose gate is positive exactly at `active`.

    active: bool [M, N], M < h. x[i, :M] is one-hot at i and w_gate[j, i] is 1-3 where
    neuron j fires for row i, -1 elsewhere; w_gate[:, M:] = 0, so the gate is exactly
    that column. The other columns of x and the up / down weights are small integers.
    """
    m, n = active.shape
    rng = np.random.default_rng(seed)
    x = rng.integers(-2, 3, (m, h)).astype(np.float32)
    x[:, :m] = np.eye(m)
    wg = np.zeros((n, h), np.float32)
    wg[:, :m] = np.where(active.T, rng.integers(1, 4, (n, m)), -1)
    wu = rng.integers(-2, 3, (n, h)).astype(np.float32)
    wd = rng.integers(-1, 2, (n, h)).astype(np.float32)
    return [jnp.asarray(a, jnp.bfloat16) for a in (x, wg, wu, wd)]


def first_k_active(m: int, n: int, k: int) -> np.ndarray:
    """Neurons 0..k-1 fire, each for one row (round robin): K = k, no row sharing."""
    active = np.zeros((m, n), bool)
    for j in range(k):
        active[j % m, j] = True
    return active


def run(impl, x, wg, wu, wd, **kw):
    """The op through `impl`'s backend and config, on the kernels up to 64 tokens."""
    backend, cfg = impl
    kw = {"max_tokens": 64, **kw}
    return pk.sparse_decode_mlp(x, wg, wu, wd, impl=backend, config=cfg, return_stats=True, **kw)


def assert_exact(out, x, wg, wu, wd):
    want = reference.gated_mlp(x, wg, wu, wd)
    assert out.dtype == want.dtype and out.shape == want.shape
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))


def expected_stats(x, wg):
    """(K, l0) the op should report, from the dense reference's gate."""
    gate = np.asarray(reference.hidden(x, wg), np.float32) > 0
    return int(gate.any(axis=0).sum()), float(gate.sum()) / x.shape[0]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("m", [1, 3, 8, 64])
def test_random_sparse_inputs_match_dense(impl, m):
    """Normal-valued bf16 inputs, ~4 positives per row; K grows with M."""
    x, wg, wu, wd = normal_mlp(m, m, 4.0)
    out, stats = run(impl, x, wg, wu, wd)
    assert out.shape == (m, H) and out.dtype == jnp.bfloat16
    assert_bf16_close(out, x, (wg, wu, wd), gated=True)
    k, l0 = expected_stats(x, wg)
    assert int(stats.active_neurons) == k and int(stats.dense_fallback) == 0
    assert float(stats.l0) == pytest.approx(l0)


@pytest.mark.parametrize("backend", ["interpret", pytest.param("pallas", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("cfg", [SMALL, TILES], ids=["row_products", "tiles"])
@pytest.mark.parametrize("k", [1, 3, 4, 5, 17, 48], ids=lambda k: f"k{k}")
@pytest.mark.parametrize("m", [1, 3, 4])
def test_both_firing_phases_at_few_tokens(backend, cfg, k, m):
    """M <= 4 through the row products (groups of 4: k around their edges; a later
    group adds to the share of the earlier ones) and through the tensor-core tiles,
    exact on integer inputs."""
    x, wg, wu, wd = controlled_mlp(5, first_k_active(m, N, k))
    out, stats = run((backend, cfg), x, wg, wu, wd)
    assert int(stats.active_neurons) == k and int(stats.dense_fallback) == 0
    assert_exact(out, x, wg, wu, wd)


@pytest.mark.parametrize("impl", IMPLS)
def test_integer_inputs_are_bitwise_dense(impl):
    x, wg, wu, wd = integer_mlp(0, 8, H, N, 40.0)
    out, stats = run(impl, x, wg, wu, wd)
    assert 0 < int(stats.active_neurons) < N and int(stats.dense_fallback) == 0
    assert_exact(out, x, wg, wu, wd)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("k", [0, 1, 15, 16, 17, 48, 64], ids=lambda k: f"k{k}")
def test_active_counts_around_group_edges(impl, k):
    """K from 0 (all dead: exact zeros) through one up group to several, odd M = 5."""
    x, wg, wu, wd = controlled_mlp(3, first_k_active(5, N, k))
    out, stats = run(impl, x, wg, wu, wd)
    assert int(stats.active_neurons) == k and int(stats.dense_fallback) == 0
    assert_exact(out, x, wg, wu, wd)
    if k == 0:
        np.testing.assert_array_equal(np.asarray(out, np.float32), 0.0)


@pytest.mark.parametrize("impl", IMPLS)
def test_every_neuron_active(impl):
    """Full blocks: each of 8 rows fires a 1/8 of the neurons, K = N."""
    active = np.zeros((8, N), bool)
    for j in range(N):
        active[j % 8, j] = True
    x, wg, wu, wd = controlled_mlp(8, active)
    out, stats = run(impl, x, wg, wu, wd)
    assert int(stats.active_neurons) == N
    assert_exact(out, x, wg, wu, wd)


@pytest.mark.parametrize("impl", IMPLS)
def test_one_hot_neuron_for_every_row(impl):
    """Every row fires neuron 17 only: 8 row entries, K = 1 (dedup)."""
    active = np.zeros((8, N), bool)
    active[:, 17] = True
    x, wg, wu, wd = controlled_mlp(2, active)
    out, stats = run(impl, x, wg, wu, wd)
    assert int(stats.active_neurons) == 1 and float(stats.l0) == 1.0
    assert np.all(np.asarray(out, np.float32).any(axis=1))  # every row gets neuron 17
    assert_exact(out, x, wg, wu, wd)


@pytest.mark.parametrize("impl", IMPLS)
def test_rows_sharing_neurons_are_gathered_once(impl):
    """4 rows each fire 6 of the same 8 neurons: 24 row entries, K = 8."""
    rng = np.random.default_rng(4)
    active = np.zeros((4, N), bool)
    pool = np.arange(20, 28)
    for row in active:
        row[rng.choice(pool, 6, replace=False)] = True
    x, wg, wu, wd = controlled_mlp(4, active)
    out, stats = run(impl, x, wg, wu, wd)
    assert float(stats.l0) == 6.0 and int(stats.active_neurons) == 8
    assert_exact(out, x, wg, wu, wd)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf, -jnp.inf], ids=["nan", "inf", "-inf"])
def test_nonfinite_x_gives_a_nan_row(impl, bad):
    x, wg, wu, wd = controlled_mlp(5, first_k_active(3, N, 5))
    x = x.at[1, 40].set(bad)
    out, _ = run(impl, x, wg, wu, wd)
    got = np.asarray(out, np.float32)
    assert np.isnan(got[1]).all() and np.isfinite(got[[0, 2]]).all()
    want = np.asarray(reference.gated_mlp(x, wg, wu, wd), np.float32)
    np.testing.assert_array_equal(got[[0, 2]], want[[0, 2]])


@pytest.mark.parametrize("impl", IMPLS)
def test_nan_gate_weight_propagates(impl):
    """A NaN in w_gate makes that neuron's gate NaN for every row, as in the dense MLP."""
    x, wg, wu, wd = controlled_mlp(6, first_k_active(4, N, 6))
    wg = wg.at[300, 40].set(jnp.nan)
    out, _ = run(impl, x, wg, wu, wd)
    assert np.isnan(np.asarray(out, np.float32)).all()
    assert np.isnan(np.asarray(reference.gated_mlp(x, wg, wu, wd), np.float32)).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_inf_gate_weight_counts_only_real_rows(impl):
    """An inf in w_gate makes 0 * inf = NaN on the kernels' zero padding rows (M = 3 runs
    as 16): the stats count the call's rows only, as the jnp path does."""
    x, wg, wu, wd = controlled_mlp(6, first_k_active(3, N, 6))
    wg = wg.at[300, 1].set(jnp.inf)
    _, stats = run(impl, x, wg, wu, wd)
    # 6 entries by construction, and neuron 300 in each of the 3 rows: x[:, 1] is
    # one-hot, so row 1's gate there is inf and the others' 0 * inf = NaN (read, counted)
    assert float(stats.l0) == 3.0 and int(stats.active_neurons) == 7


def test_fp32_inputs():
    x, wg, wu, wd = (a.astype(jnp.float32) for a in normal_mlp(9, 3, 4.0))
    out, stats = run(("xla", SMALL), x, wg, wu, wd)
    want = np.asarray(reference.gated_mlp(x, wg, wu, wd))
    assert out.dtype == jnp.float32 and int(stats.dense_fallback) == 0
    np.testing.assert_allclose(np.asarray(out), want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_default_max_tokens_runs_dense_above_8_tokens():
    x, wg, wu, wd = controlled_mlp(7, first_k_active(9, N, 3))
    _, at9 = pk.sparse_decode_mlp(x, wg, wu, wd, impl="interpret", config=SMALL, return_stats=True)
    _, at8 = pk.sparse_decode_mlp(
        x[:8], wg, wu, wd, impl="interpret", config=SMALL, return_stats=True
    )
    assert int(at9.dense_fallback) == 1 and int(at8.dense_fallback) == 0


def test_more_tokens_than_max_tokens_run_dense():
    x, wg, wu, wd = controlled_mlp(7, first_k_active(9, N, 3))
    out, stats = run(("interpret", SMALL), x, wg, wu, wd, max_tokens=8)
    assert int(stats.dense_fallback) == 1 and int(stats.active_neurons) == 3
    assert_exact(out, x, wg, wu, wd)


def test_leading_axes_jit_and_empty_batch():
    x, wg, wu, wd = normal_mlp(6, 6, 4.0)
    op = jax.jit(pk.sparse_decode_mlp, static_argnames=("impl", "config", "return_stats"))
    out3, _ = op(x.reshape(2, 3, H), wg, wu, wd, impl="interpret", config=SMALL,
                 return_stats=True)  # fmt: skip
    assert out3.shape == (2, 3, H)
    eager = pk.sparse_decode_mlp(x, wg, wu, wd, impl="interpret", config=SMALL)
    np.testing.assert_array_equal(
        np.asarray(out3.reshape(6, H), np.float32), np.asarray(eager, np.float32)
    )
    out0, stats0 = run(("interpret", SMALL), jnp.zeros((0, H), jnp.bfloat16), wg, wu, wd)
    assert out0.shape == (0, H) and int(stats0.active_neurons) == 0


def test_auto_runs_xla_off_the_gpu_and_for_fp32():
    """On this CPU (or with fp32) "auto" is the jnp path: no Triton kernel in its HLO."""
    x, wg, wu, wd = normal_mlp(10, 2, 4.0)
    hlo = jax.jit(pk.sparse_decode_mlp).lower(x, wg, wu, wd).as_text()
    assert "triton" not in hlo


@pytest.mark.parametrize(
    ("m", "cfg"),
    [
        (1, DecodeConfig()),
        (3, DecodeConfig()),
        (8, DecodeConfig()),
        (64, DecodeConfig()),
    ],
)
def test_cross_lowers_for_cuda_at_production_shape(m, cfg):
    """H = 2048, N = 5632, the default launches (row products at M = 1 and 3, tiles
    above): both kernels lower to Triton."""
    x = jnp.zeros((m, 2048), jnp.bfloat16)
    w = jnp.zeros((5632, 2048), jnp.bfloat16)
    fn = lambda *a: pk.sparse_decode_mlp(*a, impl="pallas", config=cfg, max_tokens=64)
    assert count_triton_calls(fn, x, w, w, w) == 2


@pytest.mark.gpu
@pytest.mark.parametrize("block_h", [256, 512, 1024])
def test_gpu_wide_down_tiles_still_launch(block_h):
    """A block_h too wide for shared memory at M = 64 is narrowed, not a launch failure."""
    from twell_jax.synthetic import synthetic_mlp

    x, wg, wu, wd = synthetic_mlp(64, 2048, 5632, 29.0)
    out = pk.sparse_decode_mlp(x, wg, wu, wd, config=DecodeConfig(block_h=block_h), max_tokens=64)
    assert_bf16_close(out, x, (wg, wu, wd), gated=True)


def test_launch_sizes_shrink_to_fit_shared_memory():
    from pallas_kernels.decode import kernels

    cfg = DecodeConfig()  # 4 gate stages: block_k 256 up to Mp = 16 (M <= 16)
    assert [kernels._fit_block_k(cfg, mp) for mp in (16, 32, 64)] == [256, 128, 128]
    assert [kernels._fit_block_h(cfg, mp) for mp in (16, 32, 64)] == [256, 256, 256]
    # the up loop's [Mp, up_block_k] x and [group, up_block_k] W_up tiles
    assert [kernels._fit_up_block_k(cfg, mp) for mp in (16, 32, 64)] == [512, 256, 256]
    three = DecodeConfig(gate_stages=3)
    assert [kernels._fit_block_k(three, mp) for mp in (16, 32, 64)] == [256, 256, 128]
    wide = DecodeConfig(block_h=2048, gate_stages=3)  # the down loop's [group, block_h] tiles
    assert [kernels._fit_block_h(wide, mp) for mp in (16, 32, 64)] == [1024, 512, 1024]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 4, 8, 24, 33, 64])
@pytest.mark.parametrize("pattern", ["uniform", "skew"])
def test_gpu_production_shape(m, pattern):
    """H = 2048, N = 5632, ~29 positives per row, the defaults: the bf16 rule."""
    from twell_jax.synthetic import synthetic_mlp

    x, wg, wu, wd = synthetic_mlp(m, 2048, 5632, 29.0, pattern=pattern)
    out, stats = pk.sparse_decode_mlp(x, wg, wu, wd, max_tokens=64, return_stats=True)
    assert int(stats.dense_fallback) == 0
    assert int(stats.active_neurons) == expected_stats(x, wg)[0]
    assert_bf16_close(out, x, (wg, wu, wd), gated=True)


X = jnp.zeros((4, 64), jnp.bfloat16)
W = jnp.zeros((256, 64), jnp.bfloat16)


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((X.astype(jnp.float16), W, W, W), {}, "x must be bfloat16 or float32, got float16"),
        ((X[0, 0], W, W, W), {}, r"x must be \[\.\.\., H\]"),
        ((X, W.astype(jnp.float32), W, W), {}, "w_gate must have x's dtype bfloat16"),
        ((X, W, W, W.astype(jnp.float32)), {}, "w_down must have x's dtype"),
        ((X, W, W[:, :32], W), {}, r"w_up must be \[N, H\] = \[256, 64\]"),
        ((X, W, W, W[:128]), {}, r"w_down must be \[N, H\]"),
        ((X[:, :32], W, W, W), {}, r"w_gate must be \[N, H\] = \[256, 32\]"),
        ((X, W[0], W, W), {}, r"w_gate must be an \[N, H\] matrix, got shape \(64,\)"),
        ((X, W, W[None], W), {}, r"w_up must be an \[N, H\] matrix"),
        ((X, W, W, W), {"impl": "cuda"}, "impl='cuda': must be one of"),
        (
            (X.astype(jnp.float32), *(W.astype(jnp.float32),) * 3),
            {"impl": "interpret"},
            "runs bf16 only",
        ),
        ((X, W, W, W), {"impl": "interpret"}, "H=64 is not a multiple of DecodeConfig.block_k"),
        ((X, W, W, W), {"max_tokens": 0}, r"max_tokens=0: must be in \[1, 64\]"),
        ((X, W, W, W), {"config": DecodeConfig(group=24)}, "group=24 must be a power of two"),
        (
            (X, W, W, W),
            {"config": DecodeConfig(block_k=32, up_block_k=48, block_h=32, reduce_h=32)},
            "up_block_k=48 must be a power of two",
        ),
        (
            (X, W, W, W),
            {"config": DecodeConfig(block_k=32, up_block_k=128, block_h=32, reduce_h=32)},
            "H=64 is not a multiple of DecodeConfig.up_block_k=128",
        ),
    ],
)
def test_bad_inputs_raise(args, kwargs, message):
    kwargs = {"impl": "xla", **kwargs}
    if "config" in kwargs:
        kwargs["impl"] = "interpret"
    with pytest.raises(ValueError, match=message):
        pk.sparse_decode_mlp(*args, **kwargs)


@pytest.mark.parametrize("eps", [0.0, -1e-6, float("nan")])
def test_the_block_refuses_a_norm_eps_that_is_not_positive(eps):
    with pytest.raises(ValueError, match=f"eps={eps} must be > 0 and finite"):
        pk.sparse_decode_ffn_block(X, W, W, W, eps=eps, impl="xla")


def test_exported_with_the_other_ops():
    assert pk.sparse_decode_mlp is pk.decode.sparse_decode_mlp
    assert {"sparse_decode_mlp", "DecodeStats", "twell_gated_mlp"} <= set(pk.__all__)
