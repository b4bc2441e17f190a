"""The switch's cutoff from measured costs: the crossover rule, the worst-case figure,
the cache in the workdir and the fallbacks (the timing itself runs on the GPU)."""

import dataclasses
import json

import numpy as np
import pytest

from twell_jax import switch_cost
from twell_jax.config import TrainConfig, model_preset


def test_crossover_interpolates_in_log_space():
    # ratio 0.5 at l0 4, 2.0 at l0 16: log-linear crossing at the geometric middle, 8
    assert switch_cost.crossover([2, 4, 16], [0.4, 0.5, 2.0]) == pytest.approx(8.0)
    assert switch_cost.crossover([2, 4], [1.0, 1.2]) == 0.0  # never faster
    assert switch_cost.crossover([2, 4, 8], [0.5, 0.6, 0.9]) == 8.0  # no claim past the grid


def test_one_disturbed_point_does_not_end_the_search():
    """A ratio above 1 that the points after it contradict is pooled with them."""
    grid = [2, 4, 8, 16, 32, 64]
    noisy = [0.4, 1.05, 0.6, 0.7, 0.9, 1.2]
    pooled = switch_cost.monotone(noisy)
    assert pooled == sorted(pooled)
    assert pooled[1] == pytest.approx((1.05 * 0.6 * 0.7) ** (1 / 3))
    assert pooled[0] == 0.4 and pooled[4:] == pytest.approx([0.9, 1.2])
    # Between 32 (0.9) and 64 (1.2): 32 * 2^(log(1/0.9) / log(1.2/0.9)).
    assert switch_cost.crossover(grid, noisy) == pytest.approx(32 * 2 ** (0.10536 / 0.28768), 1e-4)
    assert switch_cost.monotone([0.5, 0.6, 2.0]) == pytest.approx([0.5, 0.6, 2.0])


def _cutoff(l0):
    """A plain l0 cutoff as the rule of a record without a shift (`rule_config`)."""
    return switch_cost.rule_config({"cutoff": l0})


def _record(cutoff_l0):
    """Fake per-pattern times: sparse 1 ms + l0 / cutoff_l0 ms against dense 2 ms."""
    grid = [2.0, 4.0, 8.0, 16.0]
    pattern = {
        "l0": grid,
        "dense_ms": [2.0] * 4,
        "sparse_ms": [1.0 + g / cutoff_l0 for g in grid],
    }
    pattern["ratio"] = [
        s / d for s, d in zip(pattern["sparse_ms"], pattern["dense_ms"], strict=True)
    ]
    return {"uniform": pattern}


def test_max_regret_counts_the_slower_choice():
    per_pattern = _record(8.0)  # sparse wins below l0 8 (equal at 8)
    assert switch_cost.max_regret(per_pattern, _cutoff(8.0)) == pytest.approx(0.0)
    # a cutoff of 20 runs sparse at l0 16 (3 ms against 2): 50% slower
    assert switch_cost.max_regret(per_pattern, _cutoff(20.0)) == pytest.approx(0.5)
    # a cutoff of 3 runs dense at l0 4 (2 ms against 1.5)
    assert switch_cost.max_regret(per_pattern, _cutoff(3.0)) == pytest.approx(2.0 / 1.5 - 1)


def test_max_regret_between_sees_the_wrong_side_of_each_patterns_own_crossover():
    per_pattern = _record(8.0)  # ratio 0.625, 0.75, 1.0, 1.5 at l0 2, 4, 8, 16
    assert switch_cost.max_regret_between(per_pattern, _cutoff(8.0)) == pytest.approx(0.0, abs=1e-9)
    # A cutoff of 16 runs sparse up to l0 16, where the ratio reaches 1.5.
    assert switch_cost.max_regret_between(per_pattern, _cutoff(16.0)) == pytest.approx(
        0.5, rel=0.02
    )
    # Cutoff 4: dense from l0 4 on, where sparse would take 0.75 of the time.
    assert switch_cost.max_regret_between(per_pattern, _cutoff(4.0)) == pytest.approx(
        1 / 0.75 - 1, rel=0.02
    )
    # Between two measured points: cutoff 11.3 (log-midway 8 -> 16) runs sparse at
    # ratio sqrt(1.5) there, which the measured points (none in (8, 11.3)) do not show.
    assert switch_cost.max_regret(per_pattern, _cutoff(11.3)) == pytest.approx(0.0)
    assert switch_cost.max_regret_between(per_pattern, _cutoff(11.3)) == pytest.approx(
        1.5**0.5 - 1, rel=0.03
    )
    # Two patterns that cross at different l0: no cutoff is right for both.
    other = {k: [v * 1.3 for v in vs] if k == "sparse_ms" or k == "ratio" else vs
             for k, vs in per_pattern["uniform"].items()}  # fmt: skip
    both = {**per_pattern, "skew": other}
    assert switch_cost.max_regret_between(both, _cutoff(8.0)) > 0.25


def _pattern(crossover_l0, hot_share=0.0, tail_load=0.0):
    """Fake times crossing at `crossover_l0` (ratio l0 / crossover, exact in log-log),
    with a constant hot share and tail load."""
    grid = [2.0, 4.0, 8.0, 16.0, 32.0]
    ratio = [g / crossover_l0 for g in grid]
    stats = {"hot_share": [hot_share] * 5, "tail_load": [tail_load] * 5}
    return {"l0": grid, "dense_ms": [2.0] * 5, "sparse_ms": [2 * r for r in ratio],
            "ratio": ratio, **stats}  # fmt: skip


def test_fit_rule_moves_the_cutoff_with_the_hot_share():
    per_pattern = {"uniform": _pattern(8.0), "skew": _pattern(12.0, hot_share=0.5)}
    rule = switch_cost.fit_rule(per_pattern, per_pattern["uniform"]["l0"])
    assert rule["cutoff"] == pytest.approx(8.0)
    np.testing.assert_allclose(rule["hot_shift"], [0.0, 0.0, 0.5, 4.0], rtol=1e-6)
    # Each pattern gets its own crossover: nothing is decided wrongly, where any one l0
    # cutoff is wrong for one of the two.
    sp = switch_cost.rule_config(rule)
    assert switch_cost.max_regret_between(per_pattern, sp) == pytest.approx(0.0, abs=0.02)
    for cutoff in (8.0, 12.0):
        assert switch_cost.max_regret_between(per_pattern, _cutoff(cutoff)) > 0.3
    # A pattern halfway between uniform and skew gets a cutoff halfway (log-linear
    # ratios make its crossover 10): about right, where the plain cutoff misses by 25%.
    half = {"mixed": _pattern(10.0, hot_share=0.25)}
    assert switch_cost.max_regret_between(half, sp) == pytest.approx(0.0, abs=0.02)
    assert switch_cost.max_regret_between(half, _cutoff(8.0)) == pytest.approx(10 / 8 - 1, rel=0.03)


def test_rule_runs_dense_where_the_tail_overflows():
    """Past a tail load of 1 the sparse op falls back to its dense formula, slower than
    the dense branch whatever l0 says (here 3x at every point)."""
    fallback = _pattern(8.0, tail_load=1.5)
    fallback["sparse_ms"] = [6.0] * 5
    fallback["ratio"] = [3.0] * 5
    sp = switch_cost.rule_config({"cutoff": 20.0})
    assert switch_cost.max_regret({"heavy": fallback}, sp) == pytest.approx(0.0)
    fits = {**fallback, "tail_load": [0.5] * 5}
    assert switch_cost.max_regret({"heavy": fits}, sp) == pytest.approx(2.0)


def test_regret_between_points_keeps_the_fallback_a_step():
    """Sparse at 0.8x dense while the tail fits (load 0.9 at l0 16), 1.8x once it
    overflows (load 1.2 at l0 32): between the two the ratio is one or the other, not
    a ramp, so the guard's switch at load 1 (l0 16 * 2^(1/3) = 20.2) is right
    everywhere, while a cutoff of 20 runs dense just before the step."""
    step = _pattern(100.0)
    step.update(ratio=[0.5, 0.6, 0.7, 0.8, 1.8], tail_load=[0.1, 0.2, 0.4, 0.9, 1.2])
    step["sparse_ms"] = [2 * r for r in step["ratio"]]
    fine = np.log([12.0, 19.0, 28.0])  # the tail fits, fits, overflows
    at_12 = np.exp(np.interp(np.log(12.0), np.log([8.0, 16.0]), np.log([0.7, 0.8])))
    np.testing.assert_allclose(switch_cost._ratio_between(step, fine), [at_12, 0.8, 1.8])
    rule = switch_cost.rule_config({"cutoff": 100.0})
    assert switch_cost.max_regret_between({"heavy": step}, rule) == pytest.approx(0.0, abs=1e-9)
    assert switch_cost.max_regret_between({"heavy": step}, _cutoff(20.0)) == pytest.approx(0.25)


def test_fit_rule_without_hot_entries_is_a_plain_cutoff():
    per_pattern = {"uniform": _pattern(8.0), "skew": _pattern(12.0)}  # no hot entries
    rule = switch_cost.fit_rule(per_pattern, per_pattern["uniform"]["l0"])
    assert rule["hot_shift"] == [0.0, 0.0]
    assert switch_cost.rule_config(rule).sparse_l0_cutoff == pytest.approx(8.0)


def test_fit_rule_puts_a_knot_at_each_skews_crossover():
    """The shift is not linear in the hot share: a mild skew (share 0.6) moves the
    crossover by 1, a strong one (0.9) by 10. With a knot for each, a layer between
    them gets a cutoff between them; a straight line from uniform to the strong skew
    alone gives the mild one +6.7 and runs it sparse where it is slower."""
    per_pattern = {
        "uniform": _pattern(8.0),
        "skew": _pattern(18.0, hot_share=0.9),
        "skew:0.5": _pattern(9.0, hot_share=0.6),
    }
    rule = switch_cost.fit_rule(per_pattern, per_pattern["uniform"]["l0"])
    np.testing.assert_allclose(rule["hot_shift"], [0.0, 0.0, 0.6, 1.0, 0.9, 10.0], rtol=1e-6)
    sp = switch_cost.rule_config(rule)
    assert switch_cost.max_regret_between(per_pattern, sp) == pytest.approx(0.0, abs=0.02)
    line = switch_cost.rule_config({"cutoff": 8.0, "hot_shift": [0.0, 0.0, 0.9, 10.0]})
    assert switch_cost.max_regret_between(per_pattern, line) > 0.5
    # A skew whose share at its crossover is not above the uniform one's adds no knot.
    flat = {**per_pattern, "skew:0.5": _pattern(9.0, hot_share=0.0)}
    assert switch_cost.fit_rule(flat, flat["uniform"]["l0"])["hot_shift"] == pytest.approx(
        [0.0, 0.0, 0.9, 10.0]
    )
    # Nor do heavy rows (no hot neurons) below a uniform share above 0: their earlier,
    # tail-driven crossover must not become the shift of a layer without hot neurons.
    some_hot = {
        "uniform": _pattern(8.0, hot_share=0.1),
        "skew": _pattern(18.0, hot_share=0.9),
        "heavy_rows": _pattern(5.0),
    }
    assert switch_cost.fit_rule(some_hot, some_hot["uniform"]["l0"])["hot_shift"] == pytest.approx(
        [0.1, 0.0, 0.9, 10.0]
    )


def test_rule_config_reads_the_earlier_three_value_shift():
    sp = switch_cost.rule_config({"cutoff": 20.0, "hot_shift": [0.2, 0.8, 6.0]})
    assert sp.sparse_hot_shift == (0.2, 0.0, 0.8, 6.0)


def _sparse_cfg(**sparsity):
    cfg = TrainConfig(model=dataclasses.replace(model_preset("tiny"), ffn_impl="sparse"))
    return dataclasses.replace(cfg, sparsity=dataclasses.replace(cfg.sparsity, **sparsity))


def _fake_measure(calls):
    def measure(shape):
        calls.append(shape)
        return {"cutoff": 12.5, "hot_shift": [0.1, 0.0, 0.6, 3.0], "max_regret": 0.01,
                "shape": dataclasses.asdict(shape)}  # fmt: skip

    return measure


def test_measures_once_then_reads_the_workdir(tmp_path):
    calls = []
    cfg = _sparse_cfg()
    kw = dict(can_measure=True, measure_fn=_fake_measure(calls))
    out = switch_cost.resolve_cutoff(cfg, str(tmp_path), 1024, **kw)
    assert out.sparsity.sparse_l0_cutoff == 12.5
    assert out.sparsity.sparse_hot_shift == (0.1, 0.0, 0.6, 3.0)
    assert calls == [switch_cost.LayerShape(1024, 128, 512, cfg.model.sparse_ell_width)]
    saved = json.loads((tmp_path / switch_cost.FILE_NAME).read_text())
    assert list(saved) == [calls[0].key()]
    # A restart reads the record back: no second measurement, the same cutoff.
    again = switch_cost.resolve_cutoff(cfg, str(tmp_path), 1024, **kw)
    assert again.sparsity.sparse_l0_cutoff == 12.5 and len(calls) == 1
    # Another layer shape (e.g. a different micro-batch) is measured and kept beside it.
    switch_cost.resolve_cutoff(cfg, str(tmp_path), 2048, **kw)
    assert len(calls) == 2
    assert len(json.loads((tmp_path / switch_cost.FILE_NAME).read_text())) == 2


@pytest.mark.parametrize(
    "cfg, can_measure",
    [
        (_sparse_cfg(), False),  # no GPU: nothing to time
        (_sparse_cfg(sparse_switch="l0"), True),  # the fixed rule asked for
        (TrainConfig(model=model_preset("tiny")), True),  # dense FFNs: no switch
    ],
)
def test_keeps_the_configured_cutoff(tmp_path, cfg, can_measure):
    calls = []
    out = switch_cost.resolve_cutoff(
        cfg, str(tmp_path), 1024, can_measure=can_measure, measure_fn=_fake_measure(calls)
    )
    assert out == cfg and calls == []
    assert not (tmp_path / switch_cost.FILE_NAME).exists()


def test_bad_switch_name_raises():
    with pytest.raises(ValueError, match="sparse_switch"):
        _sparse_cfg(sparse_switch="fast")


@pytest.mark.parametrize("pattern, sigma", [("skew", 1.0), ("heavy_rows", 0.35)])
def test_both_branches_report_the_shares_the_switch_reads(pattern, sigma):
    """The sparse op (interpret mode here) and the dense branch count the same hot
    share and tail load, so the switch's decision does not depend on the branch a
    layer ran."""
    from twell_jax import ffn
    from twell_jax.synthetic import synthetic_mlp

    width = 32
    x, wg, wu, wd = synthetic_mlp(256, 128, 256, 20.0, seed=3, pattern=pattern, sigma=sigma)
    w = {"w_gate": wg, "w_up": wu, "w_down": wd}
    _, sparse = ffn.sparse(x, w, width)
    _, dense = ffn.dense_counted(x, w, width)
    for key in ("l0", "hot_share", "tail_load"):
        assert float(sparse[key]) == pytest.approx(float(dense[key]), abs=0.01), key
    if pattern == "skew":
        assert 0.1 < float(dense["hot_share"]) < 1.0
    else:
        assert float(dense["tail_load"]) > 0.0


def test_time_pattern_times_both_halves_at_one_rep():
    """--mode=switch --reps=1: each half of the rotation times one call (reps // 2 would
    time none, and the median of no times raises)."""
    import jax.numpy as jnp

    shape = switch_cost.LayerShape(64, 32, 64, 16)
    calls = []

    def branch(name):
        def fn(x, w, g):
            calls.append(name)
            return x

        return fn

    shares = lambda x, w: (jnp.float32(0.5), jnp.float32(0.0))
    fns = (branch("dense"), branch("sparse"), shares)
    rec = switch_cost._time_pattern(shape, (8.0,), "uniform", 1.0, fns, reps=1)
    assert len(rec["dense_ms"]) == len(rec["sparse_ms"]) == 1 and rec["ratio"][0] > 0
    timed = 2 * (switch_cost._WARMUP + 1)  # two halves of warm-up and one timed call
    assert calls.count("dense") == calls.count("sparse") == timed
