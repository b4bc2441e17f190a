"""experiments.benchmark_prompt_attention's `run` on CPU at a small shape."""

import json

from experiments import benchmark_prompt_attention as bpa


def test_prompt_attention_benchmark_times_xla_and_every_launch(monkeypatch):
    small = {"HEADS": 2, "HEAD_DIM": 16, "LAYERS": 2, "PROMPTS": ((2, 24),), "NEW_TOKENS": 8}
    launches = ((16, 16, 4, 2), (32, 16, 4, 3))
    for name, value in {**small, "MAX_PAD": 5, "LAUNCHES": launches}.items():
        monkeypatch.setattr(bpa, name, value)  # a small shape: the same code path
    res = bpa.run()
    json.dumps(res)
    assert set(res) == {"b2_s24_xla", "b2_s24_q16_k16_w4_s2", "b2_s24_q32_k16_w4_s3"}
    for rec in res.values():  # no device kernels on a CPU: zero busy time
        assert 0 <= rec["busy_us_per_layer"] <= rec["span_us_per_layer"] or not rec["kernels"]
