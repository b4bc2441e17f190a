"""The standalone attention benchmarks' `run` on CPU at small shapes, and their --help:
experiments.benchmark_attention_layout, benchmark_decode_attention and
benchmark_prompt_attention."""

import json
import re

import pytest

from experiments import benchmark_attention_layout as bal
from experiments import benchmark_decode_attention as bda
from experiments import benchmark_prompt_attention as bpa
from tests.experiments.cli import refusal, run_module


def _run_small(monkeypatch, module, **constants) -> dict:
    """module.run() with its shape constants replaced (a small shape: the same code
    path); the records are JSON-able and each per-layer timeline is consistent."""
    for name, value in constants.items():
        monkeypatch.setattr(module, name, value)
    res = module.run()
    json.dumps(res)
    for rec in res.values():  # no device kernels on a CPU: zero busy time
        assert 0 <= rec["busy_us_per_layer"] <= rec["span_us_per_layer"] or not rec["kernels"]
    return res


def test_attention_layout_benchmark_times_every_layout_and_launch_at_each_m(monkeypatch):
    launches = {"block_n16": bal.ProjectionConfig(block_n=16, block_k=16)}
    small = {"H": 64, "HEADS": 4, "HEAD_DIM": 16, "LAYERS": 2, "TOKENS": (1, 8)}
    res = _run_small(monkeypatch, bal, **small, PROJECTION_LAUNCHES=launches)
    names = [*bal._layouts(), "qkv_norm_xla", "qkv_norm_kernel", "qkv_norm_kernel_block_n16"]
    assert set(res) == {f"{name}_m{m}" for name in names for m in (1, 8)}


def test_decode_attention_benchmark_times_xla_and_every_launch(monkeypatch):
    small = {"T": 32, "HEADS": 2, "HEAD_DIM": 16, "LAYERS": 2, "BATCHES": (1,), "SLOTS": (20,)}
    res = _run_small(monkeypatch, bda, **small, LAUNCHES=((16, 4, 3, 1), (16, 4, 3, 8)))
    assert set(res) == {"b1_slot20_xla", "b1_slot20_t16_w4_s3_p1", "b1_slot20_t16_w4_s3_p8"}


def test_prompt_attention_benchmark_times_xla_and_every_launch(monkeypatch):
    small = {"HEADS": 2, "HEAD_DIM": 16, "LAYERS": 2, "PROMPTS": ((2, 24),), "NEW_TOKENS": 8}
    launches = ((16, 16, 4, 2), (32, 16, 4, 3))
    res = _run_small(monkeypatch, bpa, **small, MAX_PAD=5, LAUNCHES=launches)
    assert set(res) == {"b2_s24_xla", "b2_s24_q16_k16_w4_s2", "b2_s24_q32_k16_w4_s3"}


@pytest.mark.parametrize("module", [bal, bda, bpa], ids=lambda m: m.__name__.split(".")[-1])
def test_help_shows_the_usage_and_the_out_flag(module):
    proc = run_module(module.__name__, "--help")
    assert "--out: JSON output path" in proc.stdout, proc.stdout + proc.stderr
    usage = re.search(rf"python -m {module.__name__}[^\n]*(\n +[^\n]+)*", proc.stdout)[0]
    # A continued usage line keeps its backslash and newline (no run of spaces instead).
    assert "--out=results/" in usage and not re.search(r"\S {2,}-", usage), usage


@pytest.mark.parametrize("module", [bal, bda, bpa], ids=lambda m: m.__name__.split(".")[-1])
def test_on_cpu_or_with_a_bad_out_the_run_is_refused_before_any_work(module):
    """Off a GPU the profiler traces no device kernels: busy times of 0 are refused, as
    is an --out whose directory is missing and a positional argument."""
    cpu = run_module(module.__name__, "--out=results/never_written.json")
    assert "refused: times the GPU's kernels" in refusal(cpu)
    assert cpu.stdout == ""
    no_dir = run_module(module.__name__, "--out=/nonexistent_dir/x.json")
    assert "--out=/nonexistent_dir/x.json: no directory" in refusal(no_dir)
    assert "unexpected arguments ['stray']" in refusal(run_module(module.__name__, "stray"))
