"""Hot neurons: the plan, and the op's gradients when neurons take the dense block
(a neuron on for every token, more hot neurons than the block holds, all neurons dead,
a row with every neuron on) against jax.grad of the dense reference."""

import dataclasses
import functools
import re

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.sparse_train import SparseTrainConfig, hot
from tests import lowering
from tests.pallas_kernels.sparse_train.cases import MODES, SMALL, H, M, N, make_inputs, rel_err
from tests.pallas_kernels.sparse_train.test_op import _check_against_reference, _grads, _sparse_loss

# Neurons with >= 6 of the 40 tokens are hot; blocks of 2 or 4 neurons.
HOT = dict(SMALL, hot_min_count=6, hot_capacities=(0, 2, 4))


def test_plan_picks_bucket_and_caps_at_the_largest():
    counts = jnp.asarray([0, 9, 3, 6, 12, 5, 6, 1], jnp.int32)
    plan = hot.plan_hot(counts, min_count=6, capacities=(0, 2, 4))
    assert int(plan.is_hot().sum()) == 4 and int(plan.bucket) == 2  # 4 hot fit the capacity 4
    np.testing.assert_array_equal(plan.ids, [1, 3, 4, 6])
    np.testing.assert_array_equal(plan.is_hot(), counts >= 6)
    capped = hot.plan_hot(counts, min_count=1, capacities=(0, 2, 4))
    # 7 hot: the largest capacity, full, holds 4 of them
    assert int(capped.is_hot().sum()) == 4 and int(capped.bucket) == 2
    # the hottest: 12 and 9 above the 4th largest count (6), then both 6s
    np.testing.assert_array_equal(capped.ids, [1, 4, 3, 6])
    np.testing.assert_array_equal(capped.is_hot(), counts >= 6)  # 3, 5, 1 stay in CSC
    np.testing.assert_array_equal(capped.index[np.asarray(capped.ids)], np.arange(4))
    # ties at the K-th largest count past capacity: the one above first, then by id
    ties = hot.plan_hot(jnp.asarray([5, 5, 5, 5, 5, 9], jnp.int32), 1, (0, 2))
    np.testing.assert_array_equal(ties.ids, [5, 0])
    assert int(ties.is_hot().sum()) == 2 and int(ties.bucket) == 1  # 6 hot: capped at 2
    # a block as wide as N holds every hot neuron, by id
    wide = hot.plan_hot(counts, min_count=1, capacities=(0, 8))
    np.testing.assert_array_equal(wide.ids, [1, 2, 3, 4, 5, 6, 7, 8])
    none = hot.plan_hot(jnp.zeros((8,), jnp.int32), min_count=1, capacities=(0, 2))
    assert int(none.bucket) == 0 and (np.asarray(none.ids) == 8).all()  # padding only
    assert not bool(none.is_hot().any())


@pytest.mark.parametrize("seed", range(6))
def test_plan_over_capacity_keeps_the_hottest(seed):
    # Against a numpy ranking (most entries first, ties by id), on counts with many ties
    # at and around the cut.
    rng = np.random.default_rng(seed)
    n, cap, min_count = 300, 64, 3
    counts = rng.integers(0, 12, n) + 30 * (rng.random(n) < 0.2)
    plan = hot.plan_hot(jnp.asarray(counts, jnp.int32), min_count, (0, 16, cap))
    order = np.lexsort((np.arange(n), -counts))  # hottest first, ties by id
    want = np.sort(order[:cap][counts[order[:cap]] >= min_count])
    ids = np.asarray(plan.ids)
    np.testing.assert_array_equal(np.sort(ids[ids < n]), want)
    np.testing.assert_array_equal(np.flatnonzero(plan.is_hot()), want)
    np.testing.assert_array_equal(np.asarray(plan.index)[ids], np.arange(cap))
    assert np.sum(counts >= min_count) > cap and int(plan.bucket) == 2  # over capacity


def test_threshold_only_where_the_busy_neurons_stand_out():
    """min_count holds where the neurons past max(min_count, the mean count) average
    min_skew x the mean count, else no neuron is hot: an even pattern (counts 6-9)
    has none whatever the floor; one spike makes every neuron past the floor hot."""
    never = np.iinfo(np.int32).max
    even = jnp.asarray([6, 7, 8, 9] * 4, jnp.int32)  # mean 7.5
    assert int(hot.hot_threshold(even, 6, 0.0)) == 6
    assert int(hot.hot_threshold(even, 6, 2.0)) == never  # past 7.5: 8s and 9s, 1.1x
    assert int(hot.hot_threshold(even, 9, 2.0)) == never  # past 9: 1.2x
    spiked = even.at[5].set(40)  # mean 9.6; past it only the 40: 4.2x the mean
    assert int(hot.hot_threshold(spiked, 20, 2.0)) == 20
    assert int(hot.hot_threshold(spiked, 20, 4.5)) == never
    # A floor below the mean: judged on the 40 alone, not on all 16 (1x the mean).
    assert int(hot.hot_threshold(spiked, 6, 2.0)) == 6
    edge = jnp.asarray([0, 0, 0, 4], jnp.int32)  # 4 = 4x the mean of 1
    assert int(hot.hot_threshold(edge, 4, 4.0)) == 4
    assert int(hot.hot_threshold(jnp.zeros((8,), jnp.int32), 3, 2.0)) == 3
    plan = hot.plan_hot(spiked, hot.hot_threshold(spiked, 20, 2.0), (0, 2, 4))
    np.testing.assert_array_equal(plan.is_hot(), np.arange(16) == 5)
    assert int(plan.is_hot().sum()) == 1 and int(plan.bucket) == 1
    none = hot.plan_hot(even, hot.hot_threshold(even, 6, 2.0), (0, 2, 4))
    assert int(none.is_hot().sum()) == 0 and int(none.bucket) == 0


@pytest.mark.parametrize("l0", [12.0, 24.0])
def test_uniform_gates_have_no_hot_neurons_and_skewed_ones_keep_theirs(l0):
    """On the benchmarks' synthetic gates with the mean count near or past the floor
    M / 64 (the 125M layer's situation at l0 >= 23): the uniform pattern's neurons
    pass the floor by the hundred but take no block, the skewed one's take it."""
    from twell_jax.synthetic import synthetic_mlp

    m, h, n = 4096, 128, 512
    floor = m // 64  # 64; the mean count is 8 l0: 96 or 192
    for pattern, hot_expected in (("uniform", False), ("skew", True)):
        x, wg, *_ = synthetic_mlp(m, h, n, l0, seed=1, pattern=pattern)
        counts = jnp.sum(jnp.einsum("mh,nh->mn", x, wg) > 0, axis=0, dtype=jnp.int32)
        assert int(jnp.sum(counts >= floor)) > 100, pattern
        n_hot = int(jnp.sum(counts >= hot.hot_threshold(counts, floor, 2.0)))
        assert (n_hot > 0) == hot_expected, (pattern, n_hot)


@pytest.mark.parametrize("bad", [(4, 16), (0, 16, 4), (0, 4, 4)])
def test_bad_hot_capacities_raise(bad):
    with pytest.raises(ValueError, match="hot_capacities"):
        SparseTrainConfig(hot_capacities=bad)
    with pytest.raises(ValueError, match="hot_min_count"):
        SparseTrainConfig(hot_min_count=0)
    with pytest.raises(ValueError, match="hot_min_skew"):
        SparseTrainConfig(hot_min_skew=-1.0)


def _inputs(case):
    x, wg, wu, wd, proj = make_inputs(20, M, H, N, 3)
    if case in ("always_on", "always_on_and_full_row"):
        wg = wg.at[7, 0].set(8.0)  # x[:, 0] = 1: neuron 7 fires for every token
        wg = wg.at[100, 0].set(8.0)
    if case == "many_hot":
        wg = wg.at[:8, 0].set(0.0)  # 8 neurons on for half the tokens: more than 4
    if case == "all_dead":
        wg = wg.at[:, 0].set(-40.0)
    if case == "always_on_and_full_row":
        x = x.at[11, 0].set(-40.0)  # every gate of token 11 positive: a tail row
    return x, wg, wu, wd, proj


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize(
    "case, n_hot",
    [("always_on", 2), ("many_hot", None), ("all_dead", 0), ("always_on_and_full_row", 2)],
)
def test_op_grads_with_hot_neurons(interpret, case, n_hot):
    stats = _check_against_reference(_inputs(case), SparseTrainConfig(**HOT), interpret)
    if n_hot is not None:
        assert int(stats["hot_neurons"]) == n_hot
    else:
        assert int(stats["hot_neurons"]) > 4  # past the largest block
    if case == "all_dead":
        assert float(stats["l0"]) == 0.0
    assert int(stats["dense_fallback"]) == 0


def test_hot_block_changes_nothing_but_the_schedule():
    """Same gradients (to bf16 rounding) with the hot block on or off."""
    inputs = _inputs("always_on")
    on = _check_against_reference(inputs, SparseTrainConfig(**HOT), True)
    off_cfg = dataclasses.replace(SparseTrainConfig(**HOT), hot_min_count=M + 1)
    off = _check_against_reference(inputs, off_cfg, True)
    assert int(on["hot_neurons"]) == 2 and int(off["hot_neurons"]) == 0


@pytest.mark.parametrize("interpret", MODES)
def test_an_even_layer_keeps_its_neurons_in_the_spmm(interpret):
    """~12 entries a row spread evenly over the neurons (Poisson counts, mean ~1.9):
    with a floor of 1 every neuron that fires passes it, at ~1.1x the mean count, so
    at the default min_skew none is hot; with min_skew 0 they fill the block (4).
    Exact both ways, the rows past W = 16 in the tail."""
    inputs = make_inputs(21, M, H, N, 12)
    floor = dict(HOT, hot_min_count=1)
    even = _check_against_reference(inputs, SparseTrainConfig(**floor), interpret)
    always = SparseTrainConfig(**floor, hot_min_skew=0.0)
    every = _check_against_reference(inputs, always, interpret)
    assert int(even["hot_neurons"]) == 0 and float(even["hot_share"]) == 0.0
    assert int(every["hot_neurons"]) > 4 and float(every["hot_share"]) == 1.0


@pytest.mark.parametrize("case", ["always_on", "many_hot"])
def test_hot_block_in_row_blocks(monkeypatch, case):
    """Past hot.BLOCK_ROWS rows the dense block is built and multiplied block by block
    (16 rows here: 16, 16 and 8 over M = 40) and the blocks' fp32 products summed: the
    gradients of the whole block, to that summation order, and still the reference's."""
    inputs = _inputs(case)
    cfg = SparseTrainConfig(**HOT)
    (_, (_, whole_stats)), whole = _grads(_sparse_loss, *inputs, cfg=cfg, interpret=True)
    monkeypatch.setattr(hot, "BLOCK_ROWS", 16)
    rows, products = [], hot._block_products
    monkeypatch.setattr(hot, "_block_products", lambda k, i, c, *a: (
        rows.append(c.shape[0]), products(k, i, c, *a))[1])  # fmt: skip
    (_, (_, stats)), blocked = _grads(_sparse_loss, *inputs, cfg=cfg, interpret=True)
    assert rows[-3:] == [16, 16, 8]  # the largest bucket's branch, traced last
    assert int(stats["hot_neurons"]) == int(whole_stats["hot_neurons"]) >= 2
    for name, a, b in zip(("dx", "dWg", "dWu", "dWd"), blocked, whole, strict=True):
        assert rel_err(a, b) < 1e-3, name
    _check_against_reference(inputs, cfg, True)


@pytest.mark.skipif(lowering._compile_only_h200() is None, reason="needs the jax CUDA plugin")
def test_block_products_read_their_arrays_in_place_on_h200():
    """XLA's H200 plan of the hot block feeds the scattered arrays to the GEMMs as they
    are: no slice of them anywhere in the plan (one [M, K, 3] array took 4 here)."""
    m, width, n, h, k = 2048, 128, 1024, 256, 64
    args = [jnp.zeros((n,), jnp.int32), jnp.zeros((m,), jnp.int32)]
    args += [jnp.zeros((m, width), jnp.int32)] + [jnp.zeros((m, width), jnp.bfloat16)] * 3
    args += [jnp.zeros((m, h), jnp.bfloat16)] * 2
    hlo = lowering.compiled_hlo_for_h200(functools.partial(hot._block_products, k), *args)
    assert "scatter" in hlo
    assert not re.findall(r"%\S*slice\S* = ", hlo)
