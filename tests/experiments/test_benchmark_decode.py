"""--mode=decode's `run` on CPU at a tiny shape (every path is plain XLA there)."""

import json

import pytest

from experiments import benchmark_decode


def test_decode_benchmark_records_every_path_per_m():
    records = benchmark_decode.run(
        (1, 3, 9), 64, 256, 4.0, 1, "skew", layers=2, max_tokens=8, warmup=1, inner=1
    )
    json.dumps(records)  # JSON-able as written
    assert [r["M"] for r in records] == [1, 3, 9]
    for rec in records:
        assert rec["layers"] == 2 and len(rec["active_neurons_per_layer"]) == 2
        for name in ("dense", "sparse", "twell"):
            assert rec[f"{name}_ms"] > 0
            assert rec[f"{name}_tokens_per_s"] == pytest.approx(rec["M"] / rec[f"{name}_ms"] * 1e3)
        assert rec["speedup_sparse"] == pytest.approx(rec["dense_ms"] / rec["sparse_ms"])
        assert set(rec["ratios"]) == {"dense/sparse", "dense/twell", "sparse/twell"}
        assert rec["sparse_max_rel_err"] < 1e-2  # bf16 against the dense MLP
        assert rec["sparse_bytes_per_layer"] < rec["dense_bytes_per_layer"]
        assert all(0 < k <= 256 for k in rec["active_neurons_per_layer"])
        # M above max_tokens runs the dense formula in every layer
        assert rec["dense_fallback_layers"] == (2 if rec["M"] > 8 else 0)


def test_decode_benchmark_kernel_trace_names_every_path():
    (rec,) = benchmark_decode.run(
        (2,), 64, 256, 4.0, 1, "uniform", layers=2, warmup=1, inner=1, kernel_trace=True
    )
    json.dumps(rec)
    assert set(rec["kernels_per_layer"]) == {"dense", "sparse", "twell"}
    assert set(rec["timeline_per_layer"]) == {"dense", "sparse", "twell"}
    for line in rec["timeline_per_layer"].values():
        assert set(line) == {"kernels", "busy_us", "span_us"}
        assert 0 <= line["busy_us"] <= line["span_us"] or line["span_us"] == 0
    for table in rec["kernels_per_layer"].values():  # empty on a CPU: no device kernels
        assert all(set(v) == {"per_layer", "mean_us"} for v in table.values())
