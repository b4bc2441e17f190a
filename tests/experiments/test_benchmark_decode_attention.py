"""experiments.benchmark_decode_attention's `run` on CPU at a small shape."""

import json

from experiments import benchmark_decode_attention as bda


def test_decode_attention_benchmark_times_xla_and_every_launch(monkeypatch):
    small = {"T": 32, "HEADS": 2, "HEAD_DIM": 16, "LAYERS": 2, "BATCHES": (1,), "SLOTS": (20,)}
    for name, value in {**small, "LAUNCHES": ((16, 4, 3, 1), (16, 4, 3, 8))}.items():
        monkeypatch.setattr(bda, name, value)  # a small shape: the same code path
    res = bda.run()
    json.dumps(res)
    assert set(res) == {"b1_slot20_xla", "b1_slot20_t16_w4_s3_p1", "b1_slot20_t16_w4_s3_p8"}
    for rec in res.values():  # no device kernels on a CPU: zero busy time
        assert 0 <= rec["busy_us_per_layer"] <= rec["span_us_per_layer"] or not rec["kernels"]
