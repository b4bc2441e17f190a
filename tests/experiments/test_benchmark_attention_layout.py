"""experiments.benchmark_attention_layout's `run` on CPU at a small shape."""

import json

from experiments import benchmark_attention_layout as bal


def test_attention_layout_benchmark_times_every_layout_at_both_m(monkeypatch):
    for name, value in {"H": 64, "HEADS": 4, "HEAD_DIM": 16, "LAYERS": 2}.items():
        monkeypatch.setattr(bal, name, value)  # a small shape: the same code path
    res = bal.run()
    json.dumps(res)
    assert set(res) == {f"{name}_m{m}" for name in bal._layouts() for m in (1, 8)}
    for rec in res.values():  # no device kernels on a CPU: zero busy time
        assert 0 <= rec["busy_us_per_layer"] <= rec["span_us_per_layer"] or not rec["kernels"]
