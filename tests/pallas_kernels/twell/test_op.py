"""Public ops twell_gated_mlp / twell_mlp: contract, statistics, errors, gradients."""

import subprocess
import sys

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import reference
from tests.lowering import count_triton_calls
from tests.pallas_kernels.twell.kernel_cases import INTERPRET_AND_GPU, SMALL_PACK, integer_mlp


def _impl(interpret):
    return "interpret" if interpret else "pallas"


@pytest.mark.parametrize("interpret", INTERPRET_AND_GPU)
@pytest.mark.parametrize("bias", [10.0, 0.0], ids=["sparse", "overflowing"])
def test_gated_op_exact_with_leading_dims_and_stats(interpret, bias):
    x, wg, wu, wd = integer_mlp(0, 30, 128, 512, bias)
    x3 = x.reshape(2, 15, 128)
    out, stats = pk.twell_gated_mlp(x3, wg, wu, wd, impl=_impl(interpret), return_stats=True)
    assert out.shape == x3.shape and out.dtype == jnp.bfloat16
    want = reference.gated_mlp(x, wg, wu, wd).reshape(x3.shape)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))
    gate = reference.hidden(x, wg)
    counts = np.asarray((gate > 0).reshape(30, 2, 256).sum(-1))
    assert float(stats.nnz_per_row) == pytest.approx(counts.sum() / 30)
    assert int(stats.max_tile_count) == counts.max()
    assert int(stats.overflow_tiles) == (counts > 31).sum()
    if bias == 0.0:
        assert int(stats.overflow_tiles) > 0  # the fallback really ran


@pytest.mark.parametrize("interpret", INTERPRET_AND_GPU)
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize(("n_heavy", "tail"), [(0, False), (3, True), (8, True), (12, False)])
def test_heavy_rows_exact_in_the_tail_and_past_it(interpret, gated, n_heavy, tail):
    """Rows whose gate fires everywhere among rows that fire almost nowhere, odd M = 63:
    up to 8 heavy rows (the largest tail capacity at this M) take the dense tail, more
    keep the in-kernel recompute; both exact."""
    from pallas_kernels.twell import heavy_rows

    assert heavy_rows.capacities(63) == (0, 8)
    x, ws, wu, wd = integer_mlp(5, 63, 128, 512, 60.0)
    x = x.at[jnp.arange(n_heavy) * 5, 0].set(-1.0)  # flips the -60 bias to +60
    weights = (ws, wu, wd) if gated else (ws, wd)
    op = pk.twell_gated_mlp if gated else pk.twell_mlp
    out, stats = op(x, *weights, impl=_impl(interpret), return_stats=True)
    want = reference.gated_mlp(x, *weights) if gated else reference.mlp(x, *weights)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))
    assert int(stats.heavy_rows) == n_heavy
    assert int(stats.overflow_tiles) == 2 * n_heavy  # N = 512: two tiles per row
    # C = 8: 32 slots; factor 0: heavy rows only
    bucket, rows, _ = heavy_rows.plan(_tile_counts(x, ws), 32, 0.0, 0)
    assert (int(bucket) == 1) == tail
    if tail:
        np.testing.assert_array_equal(np.asarray(rows)[:n_heavy], np.arange(n_heavy) * 5)


def _row_counts(totals_per_tile):
    """int32 [N / 256, M] tile counts from a list of per-row [tile counts]."""
    return jnp.asarray(np.asarray(totals_per_tile, np.int32).T)


def test_tail_rows_take_long_rows_at_the_lowest_threshold_that_fits():
    """M = 64 (one capacity, 8 rows); factor 2, floor 8: thresholds 2, 4, 8, 16 x mean."""
    from pallas_kernels.twell import heavy_rows

    tail = lambda c, f=2.0: np.flatnonzero(np.asarray(heavy_rows.tail_rows(c, 32, f, 8)))
    # 4 rows of 40 among rows of 2 (mean 4.4): the first threshold (9) takes them.
    rows = [[20, 20]] * 4 + [[1, 1]] * 60
    np.testing.assert_array_equal(tail(_row_counts(rows)), [0, 1, 2, 3])
    np.testing.assert_array_equal(tail(_row_counts(rows), f=0.0), [])
    # 12 rows of 40 do not fit 8; at 4 x mean (50) only the two rows of 100 pass.
    rows = [[20, 20]] * 12 + [[31, 31], [31, 31]] + [[1, 1]] * 50
    np.testing.assert_array_equal(tail(_row_counts(rows)), [12, 13])
    # A heavy row (a tile of 32) is taken at every threshold, the floor holds: rows of
    # 6 among rows of 0 are not long although they pass 2 x mean.
    rows = [[32, 0]] + [[3, 3]] * 5 + [[0, 0]] * 58
    np.testing.assert_array_equal(tail(_row_counts(rows)), [0])
    # 10 heavy rows do not fit: heavy rows alone (the in-kernel recompute takes them).
    rows = [[32, 0]] * 10 + [[20, 20]] * 2 + [[1, 1]] * 52
    np.testing.assert_array_equal(tail(_row_counts(rows)), np.arange(10))


@pytest.mark.parametrize("interpret", INTERPRET_AND_GPU)
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("factor", [2.0, 0.0], ids=["long_rows_in_tail", "off"])
def test_long_rows_exact_in_the_tail(interpret, gated, factor):
    """Four rows with 36-52 entries and no overflowed tile among rows of 0-6, odd M = 63:
    with the floor at 16 the tail takes exactly them (tail_rows 4, heavy_rows 0), and
    the output is the dense one either way."""
    x, ws, wu, wd = integer_mlp(5, 63, 128, 512, 60.0)
    x = x.at[jnp.arange(4) * 7, 0].set(0.5)  # halves those rows' -60 bias
    counts = np.asarray(_tile_counts(x, ws))
    assert counts.max() < 32 and (counts.sum(0)[::7][:4] > 16).all()
    weights = (ws, wu, wd) if gated else (ws, wd)
    op = pk.twell_gated_mlp if gated else pk.twell_mlp
    cfg = pk.T2DConfig(tail_row_factor=factor, tail_row_min_entries=16)
    out, stats = op(x, *weights, impl=_impl(interpret), return_stats=True, t2d_config=cfg)
    want = reference.gated_mlp(x, *weights) if gated else reference.mlp(x, *weights)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))
    assert int(stats.heavy_rows) == 0
    assert int(stats.tail_rows) == (4 if factor else 0)


def _tile_counts(x, w_sparse):
    """int32 [N / 256, M]: true positives per (row, tile), as the pack writes them."""
    gate = reference.hidden(x, w_sparse)
    m, n = gate.shape
    return jnp.sum((gate > 0).reshape(m, n // 256, 256), axis=-1, dtype=jnp.int32).T


def _dots_per_branch(jaxpr, found):
    """found += the dot_general count of every branch of every cond, recursively."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "cond":
            for branch in eqn.params["branches"]:
                found.append(sum(e.primitive.name == "dot_general" for e in branch.jaxpr.eqns))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            _dots_per_branch(sub, found)
    return found


@pytest.mark.parametrize("gated", [True, False])
def test_dense_tail_reuses_the_gate(gated):
    """The tail's branches run the up and down products only (gated) or the down
    product only: their gate rows come from the call's gate GEMM."""
    x, wg, wu, wd = integer_mlp(0, 64, 128, 512, 10.0)
    if gated:
        fn = lambda *a: pk.twell_gated_mlp(*a, impl="interpret")
        args = (x, wg, wu, wd)
    else:
        fn = lambda *a: pk.twell_mlp(*a, impl="interpret")
        args = (x, wu, wd)
    per_branch = _dots_per_branch(jax.make_jaxpr(fn)(*args).jaxpr, [])
    assert max(per_branch) == (2 if gated else 1), per_branch


def test_heavy_row_capacities():
    from pallas_kernels.twell import heavy_rows

    assert heavy_rows.capacities(16384) == (0, 128, 256, 512, 1024, 2048)
    assert heavy_rows.capacities(5) == (0, 5)
    assert heavy_rows.capacities(1000) == (0, 8, 16, 32, 63, 125)


@pytest.mark.parametrize("interpret", INTERPRET_AND_GPU)
@pytest.mark.parametrize("compression", [8, 2])
def test_nongated_op_exact(interpret, compression):
    x, wu, _, wd = integer_mlp(1, 19, 128, 256, 8.0)
    out = pk.twell_mlp(
        x, wu, wd, compression=compression, impl=_impl(interpret), d2t_config=SMALL_PACK
    )
    np.testing.assert_array_equal(
        np.asarray(out, np.float32), np.asarray(reference.mlp(x, wu, wd), np.float32)
    )


@pytest.mark.parametrize("gated", [True, False])
def test_xla_impl_matches_kernels_and_stats(gated):
    x, ws, wu, wd = integer_mlp(2, 12, 128, 512, 6.0)
    weights = (ws, wu, wd) if gated else (ws, wd)
    op = pk.twell_gated_mlp if gated else pk.twell_mlp
    out_x, st_x = op(x, *weights, impl="xla", return_stats=True)
    out_i, st_i = op(x, *weights, impl="interpret", return_stats=True)
    np.testing.assert_array_equal(np.asarray(out_x, np.float32), np.asarray(out_i, np.float32))
    for a, b in zip(st_x, st_i, strict=True):
        assert float(a) == float(b)


def test_auto_impl_runs_on_cpu_and_under_jit():
    x, wg, wu, wd = integer_mlp(3, 8, 64, 256, 4.0)
    out = jax.jit(pk.twell_gated_mlp)(x, wg, wu, wd)
    np.testing.assert_array_equal(
        np.asarray(out, np.float32), np.asarray(reference.gated_mlp(x, wg, wu, wd), np.float32)
    )


def test_high_precision_xla_path_is_closer_to_fp32():
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((16, 128)), jnp.bfloat16)
    wg, wu, wd = (
        jnp.asarray(rng.standard_normal((256, 128)) * 0.1, jnp.bfloat16) for _ in range(3)
    )
    truth = reference.gated_mlp(*(a.astype(jnp.float32) for a in (x, wg, wu, wd)))
    hi = pk.twell_gated_mlp(x, wg, wu, wd, impl="xla", high_precision=True, compression=2)
    lo = pk.twell_gated_mlp(x, wg, wu, wd, impl="xla", compression=2)
    err = lambda o: float(jnp.max(jnp.abs(o.astype(jnp.float32) - truth)))
    assert err(hi) <= err(lo)


def test_empty_batch():
    _, wg, wu, wd = integer_mlp(5, 1, 64, 256, 4.0)
    out, stats = pk.twell_gated_mlp(jnp.zeros((0, 64), jnp.bfloat16), wg, wu, wd, return_stats=True)
    assert out.shape == (0, 64) and int(stats.overflow_tiles) == 0


def test_gradients_are_the_dense_mlps():
    x, wg, wu, wd = integer_mlp(6, 8, 64, 256, 4.0)
    x = x * 0.25

    def loss(op, *a):
        return jnp.sum(op(*a).astype(jnp.float32) ** 2)

    got = jax.grad(lambda *a: loss(pk.twell_gated_mlp, *a), argnums=(0, 1, 2, 3))(x, wg, wu, wd)
    want = jax.grad(lambda *a: loss(reference.gated_mlp, *a), argnums=(0, 1, 2, 3))(x, wg, wu, wd)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(
            np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=1e-2, atol=1e-2
        )


X = jnp.zeros((4, 128), jnp.bfloat16)
W = jnp.zeros((256, 128), jnp.bfloat16)


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((X.astype(jnp.float32), W, W, W), {}, "x must be bfloat16"),
        ((X, W.astype(jnp.float32), W, W), {}, "w_gate must be bfloat16"),
        ((X, W, W[:, :64], W), {}, r"w_up must be \[N, H\]"),
        ((X, W, W, W[:128]), {}, r"w_down must be \[N, H\]"),
        ((X[:, :64], W, W, W), {}, r"w_gate must be \[N, H\]"),
        ((X, W[:192], W[:192], W[:192]), {}, "multiple of the TwELL tile"),
        ((X[:, :96], W[:, :96], W[:, :96], W[:, :96]), {}, "multiple of 64"),
        ((X, W, W, W), {"compression": 16}, "compression must be one of"),
        ((X, W, W, W), {"impl": "cuda"}, "impl must be one of"),
        ((jnp.zeros((), jnp.bfloat16), W, W, W), {}, r"x must be \[\.\.\., H\]"),
    ],
)
def test_gated_op_errors(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        pk.twell_gated_mlp(*args, **kwargs)


def test_nongated_op_errors():
    with pytest.raises(ValueError, match=r"w_down must be \[N, H\]"):
        pk.twell_mlp(X, W, W[:, :64])
    with pytest.raises(ValueError, match="x must be bfloat16"):
        pk.twell_mlp(X.astype(jnp.float16), W, W)


def test_too_many_columns_for_16_bit_indices():
    x = jax.ShapeDtypeStruct((4, 64), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((65792, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="16 bits"):
        jax.eval_shape(pk.twell_mlp, x, w, w)


@pytest.mark.parametrize("gated", [True, False])
def test_ops_lower_for_cuda(gated):
    x = jnp.zeros((16384, 2048), jnp.bfloat16)
    w = jnp.zeros((5632, 2048), jnp.bfloat16)
    if gated:
        fn = lambda x, a, b, c: pk.twell_gated_mlp(x, a, b, c, impl="pallas")
        assert count_triton_calls(fn, x, w, w, w) == 3  # pack, SDDMM, SpMM
    else:
        fn = lambda x, a, b: pk.twell_mlp(x, a, b, impl="pallas")
        assert count_triton_calls(fn, x, w, w) == 2  # pack, SpMM


# A fresh interpreter: the first interpret-mode pallas_call of a process is what used to
# register a trace-context config (pallas_kernels/_triton.py says why that matters).
_TRACE_ONCE = """
import jax, jax.numpy as jnp
import pallas_kernels
traces = []

@jax.jit
def mlp(x, w):
    traces.append(None)  # runs once per trace
    return pallas_kernels.twell_gated_mlp(x, w, w, w, impl="interpret")

x = jnp.ones((8, 64), jnp.bfloat16)
w = jnp.full((256, 64), 0.01, jnp.bfloat16)
for _ in range(3):
    mlp(x, w).block_until_ready()
print("traces", len(traces))
"""


def test_first_pallas_call_does_not_retrace_the_caller():
    """The function that holds the first interpret-mode kernel compiles once, not twice."""
    run = subprocess.run(
        [sys.executable, "-c", _TRACE_ONCE], capture_output=True, text=True, check=False
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split()[-2:] == ["traces", "1"], run.stdout
