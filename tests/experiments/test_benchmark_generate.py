"""--mode=generate's `run` on CPU with the tiny preset (every path is plain XLA there)."""

import json

import pytest

from experiments import benchmark_generate


@pytest.mark.slow
def test_generate_benchmark_records_both_ffns_their_step_profiles_and_a_second_attention():
    # one call covers both features: each generation setup costs a compile
    (rec,) = benchmark_generate.run(
        ["tiny"], [2], nnz=8.0, prompt_len=8, new_tokens=4, reps=1, kernel_trace=True,
        attentions=("auto", "xla"),
    )  # fmt: skip
    json.dumps(rec)
    assert rec["batch"] == 2 and rec["new_tokens"] == 4
    for ffn in ("dense", "sparse"):
        assert rec[f"{ffn}_decode_ms"] > 0
        tps = 2 * 3 / (rec[f"{ffn}_decode_ms"] * 1e-3)  # the loop makes new_tokens - 1
        assert rec[f"{ffn}_decode_tokens_per_s"] == pytest.approx(tps)
        profile = rec[f"{ffn}_step_profile"]  # no device kernels on a CPU: zeros
        assert set(profile) == {
            "kernels_per_step", "busy_us_per_step", "span_us_per_step", "kernels_per_step_by_name"
        }  # fmt: skip
        assert profile["busy_us_per_step"] <= profile["span_us_per_step"]
        prefill = rec[f"{ffn}_prefill_profile"]
        assert set(prefill) == {"kernels", "busy_us", "span_us", "kernels_by_name"}
        assert rec[f"{ffn}_xla_attention_decode_ms"] > 0
        assert rec[f"{ffn}_decode_xla_attention_over_auto"] > 0
        assert rec[f"{ffn}_prefill_xla_attention_over_auto"] > 0
    assert 0 <= rec["same_tokens_fraction"] <= 1
    assert rec["attentions"] == ["auto", "xla"]
    assert rec["decode_speedup_xla_attention"] > 0 and rec["prefill_speedup_xla_attention"] > 0


def test_usage_keeps_its_line_continuation():
    assert "--model_presets=1.5b \\\n        --generate_batch=" in benchmark_generate.__doc__
