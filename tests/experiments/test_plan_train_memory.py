"""experiments/plan_train_memory.py: the top of a plan read from XLA's buffer-assignment
dump, the CLI's refusals, and (where the jax CUDA plugin is installed) a real plan."""

import json

import pytest

from experiments import compile_only
from experiments import plan_train_memory as ptm
from tests.experiments.cli import refusal, run_module

# The shape of XLA's dump: parameters first, then the temporaries' allocation.
_ASSIGNMENT = """BufferAssignment:
allocation 0: size 64, parameter 0, shape |f32[16]| at ShapeIndex {}:
 value: <1 p0 @0> (size=64,offset=0): f32[16]{0}
allocation 1: size 4096, preallocated-temp:
 value: <7 gemm.1 @0> (size=2048,offset=0): bf16[32,32]{1,0}
 value: <8 tuple.3{} @0> (size=16,offset=4080): (f32[], f32[])
 value: <9 slice.2 @0> (size=1024,offset=3072): bf16[16,32]{1,0}
 value: <10 scalar.4 @0> (size=4,offset=4092): f32[]
 value: <11 fusion.5 @0> (size=2048,offset=2048): bf16[32,32]{1,0}
allocation 2: size 8, output shape is |s32[2]|:
 value: <12 out @0> (size=8,offset=0): s32[2]{0}
"""


def test_top_buffers_reads_the_temporaries_plan():
    top = ptm.top_buffers(_ASSIGNMENT, 2, min_bytes=8)
    assert [b["name"] for b in top] == ["fusion.5", "slice.2"]  # both end at 4096
    assert top[1] == {"name": "slice.2", "shape": "bf16[16,32]{1,0}", "bytes": 1024, "offset": 3072}
    names = [b["name"] for b in ptm.top_buffers(_ASSIGNMENT, 10)]
    assert names == ["fusion.5", "slice.2", "scalar.4", "gemm.1"]  # no tuple, no parameter
    assert ptm.top_buffers(_ASSIGNMENT.split("allocation 1")[0], 3) == []  # no temporaries


@pytest.mark.parametrize(
    "args, says",
    [
        (["--ffn_impls=twell"], "--ffn_impls must be some of"),
        (["--batches=8,0"], "--batches must be positive integers"),
        (["--target_config=/nonexistent.txtpb"], "no such file"),
        (["--out=/nonexistent/plan.json"], "--out=/nonexistent/plan.json"),
        (["stray"], "unexpected arguments"),
        (["--devices=8", "--mesh_data=3"], "does not fit --devices=8"),
        (["--devices=4", "--mesh_data=2", "--mesh_fsdp=4"], "does not fit --devices=4"),
        (["--devices=4", "--batches=6"], "multiples of --devices=4"),
        (["--set=remat"], "--set takes key=value"),
        (["--seq=0"], "--seq must be positive"),
        (["--top=-1"], "--top at least 0"),
    ],
)
def test_cli_refuses_in_one_line(args, says):
    if args[0].startswith("--out") and compile_only.cuda_plugin() is None:
        says = "jax CUDA plugin is not installed"  # refused before the output path
    assert says in refusal(run_module("plan_train_memory", *args))


@pytest.mark.skipif(
    compile_only.cuda_plugin() is not None, reason="the jax CUDA plugin is installed"
)
def test_cli_names_the_missing_plugin():
    says = refusal(run_module("plan_train_memory"))
    assert "jax CUDA plugin is not installed: pip install 'jax[cuda12]==0.11.2'" in says


@pytest.mark.slow
@pytest.mark.skipif(compile_only.cuda_plugin() is None, reason="needs the jax CUDA plugin (no GPU)")
def test_cli_plans_both_steps_without_a_gpu(tmp_path):
    out = tmp_path / "plan.json"
    args = ["--preset=tiny", "--seq=256", "--batches=2,4", "--top=3", f"--out={out}"]
    proc = run_module("plan_train_memory", *args, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["target"] == "NVIDIA H200" and res["preset"] == "tiny"
    plans = {(p["impl"], p["batch"]): p for p in res["plans"]}
    assert set(plans) == {(i, b) for i in ("dense", "sparse") for b in (2, 4)}
    for (_, batch), p in plans.items():
        assert p["tokens"] == batch * 256 and len(p["top_buffers"]) == 3
        assert p["temp_bytes"] > 0 and p["argument_bytes"] > 0
    assert plans[("dense", 4)]["temp_bytes"] > plans[("dense", 2)]["temp_bytes"]
    assert sum(plans[("sparse", 2)]["collectives"].values()) == 0  # one device


@pytest.mark.slow
@pytest.mark.skipif(compile_only.cuda_plugin() is None, reason="needs the jax CUDA plugin (no GPU)")
def test_cli_plans_the_step_partitioned_over_two_gpus(tmp_path):
    """Full FSDP over 2 GPUs, remat on: half the state per device, the gradients
    reduce-scattered, and the sparse step gathers no more than the dense one (its ELL
    residuals, had the remat policy kept them, were all-gathered in every layer)."""
    out = tmp_path / "plan.json"
    args = ["--preset=tiny", "--seq=256", "--batches=4", "--set=remat=true", f"--out={out}"]
    one = run_module("plan_train_memory", *args, timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]
    single = {p["impl"]: p for p in json.loads(out.read_text())["plans"]}
    two = run_module("plan_train_memory", *args, "--devices=2", timeout=600)
    assert two.returncode == 0, two.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["devices"] == 2 and res["mesh"] == {"data": 1, "fsdp": -1}
    split = {p["impl"]: p for p in res["plans"]}
    for impl in ("dense", "sparse"):
        assert split[impl]["argument_bytes"] < 0.6 * single[impl]["argument_bytes"]
        assert split[impl]["collectives"]["reduce-scatter"] > 0
    gathers = {impl: split[impl]["collectives"]["all-gather"] for impl in split}
    assert gathers["sparse"] == gathers["dense"] > 0
