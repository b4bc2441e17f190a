"""The train step's memory lower bound and the up-front refusal of configs that cannot fit."""

import dataclasses

import pytest

from twell_jax import config as C
from twell_jax import sharding, step_memory

H200 = 139 * step_memory.GIB


def _with(cfg: C.TrainConfig, **model) -> C.TrainConfig:
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **model))


def test_estimate_terms_scale_with_the_shape():
    cfg = C.train_preset("tiny")  # batch 16, seq 128, 4 layers, 4 heads
    base = step_memory.estimate(cfg, devices=1)
    long = step_memory.estimate(_with(cfg, seq_len=1024), devices=1)
    assert long.attention == 8**2 * base.attention  # rows x heads x S^2 per layer
    # One cross-entropy chunk of ce_chunk_tokens = 4096 tokens (16 x 256) is held at once.
    assert long.logits == 2 * base.logits == 16 * 256 * 512 * 4
    whole = dataclasses.replace(_with(cfg, seq_len=1024), ce_chunk_tokens=1 << 30)
    assert step_memory.estimate(whole, devices=1).logits == 8 * base.logits
    assert long.state == base.state
    assert step_memory.estimate(_with(cfg, seq_len=1024), devices=1, cudnn=True).attention == 0
    remat = step_memory.estimate(_with(cfg, seq_len=1024, remat=True), devices=1)
    assert remat.attention == long.attention // 4 and remat.activations < long.activations
    # The batch splits over the devices, the state over the FSDP axis.
    split = step_memory.estimate(cfg, devices=4, fsdp=4)
    assert split.rows == 4 and split.logits == base.logits // 4
    assert split.state == pytest.approx(base.state / 4, abs=1)


@pytest.mark.parametrize(
    "preset, devices, fsdp, memory",
    [
        ("tiny", 1, 1, 8 * step_memory.GIB),  # a small CPU host
        ("125m", 1, 1, H200),
        ("0.5b", 8, 8, H200),
        ("1b", 8, 8, H200),
        ("1.5b", 8, 8, H200),
        ("2b", 8, 8, H200),
    ],
)
def test_the_presets_fit_where_they_run(preset, devices, fsdp, memory):
    est = step_memory.estimate(C.train_preset(preset), devices, fsdp, cudnn=preset != "tiny")
    assert est.total < memory / 2


def test_check_fits_refuses_with_the_numbers_and_the_flags(monkeypatch):
    mesh = sharding.make_mesh(1, 1)
    cfg = _with(C.train_preset("tiny"), seq_len=4096)
    need = step_memory.estimate(cfg, devices=1).total
    assert step_memory.check_fits(cfg, mesh, (need, 1, "the host")).total == need
    # Only clearly too much is refused: up to REFUSE_FACTOR x the memory passes.
    step_memory.check_fits(cfg, mesh, (int(need / 1.4), 1, "the host"))
    with pytest.raises(step_memory.StepMemoryError) as err:
        step_memory.check_fits(cfg, mesh, (need // 4, 2, "the host"))
    msg = str(err.value)
    assert msg.startswith("model.seq_len=4096, batch_size=16, grad_accum_steps=1:")
    assert "(2 devices x" in msg and "attention probabilities" in msg
    assert "lower --seq_len" in msg and "--grad_accum_steps" in msg and "--remat" in msg
    monkeypatch.setattr(step_memory, "available_memory", lambda: None)
    assert step_memory.check_fits(cfg, mesh).total == need  # memory unknown: no check
