"""Whole-model training-step throughput, `sparse` against `dense` FFNs (docs/design.md §8).

The paper reports tokens/ms of the full training step (forward, backward, AdamW) of
its 2B model, sparse against dense: +21.9% on an H100. Here both start from the same
synthetic-sparsity weights (`twell_jax.synthetic.synthetic_sparse_params`: a per-layer gate
bias calibrated so that about `nnz` gate entries per token per layer are positive) and
a fresh AdamW state, and each steps its own state chain on the same batch, in rotation
(`bench_util.time_steps_interleaved`). The sparse model starts with every layer on the
sparse kernels (`TrainState.use_sparse`), as a run past its first recheck would be;
its l0-cutoff switch keeps running.

The weights must stay at the calibrated sparsity while the steps are timed. A fresh
AdamW's first updates are sign-like (m / sqrt(v) = +-1 per element) and move every
gate pre-activation coherently: at the paper's learning rate, warming up from 0, l0
went from 26 to ~110 within 10 steps on the H200 and the sparse step spilled into its
tail buckets and dense fallbacks. So the optimizer runs at lr = 1e-12: each update is
far below the fp32 master weights' rounding step (~2e-9 at 0.02) and rounds away
(only weights that are exactly 0 move, by 1e-12 a step), while the step still computes
everything a real step does (clipping, moments, decay, the update). Each record gives
l0 at the first and the last step of both chains.

One step is one micro-batch of `batch` x `seq` tokens (the paper's per-GPU micro-batch
is 8 x 2048, with gradient checkpointing, as in the presets).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from experiments import bench_util as bu
from twell_jax import sharding, train
from twell_jax.config import OptimConfig, SparsityConfig, TrainConfig, model_preset
from twell_jax.overrides import with_overrides
from twell_jax.synthetic import synthetic_sparse_params

IMPLS = ("dense", "sparse")
# Small enough that AdamW's updates round away in the fp32 weights (module docstring).
FROZEN_LR = 1e-12


def _train_config(
    preset: str, impl: str, batch: int, seq: int, l1_coef: float, model_overrides: dict
) -> TrainConfig:
    model = with_overrides(model_preset(preset, ffn_impl=impl, seq_len=seq), model_overrides)
    return TrainConfig(
        model=model,
        batch_size=batch,
        sparsity=SparsityConfig(l1_coef=l1_coef),
        optim=OptimConfig(lr=FROZEN_LR, warmup_steps=0),
    )


def train_step_and_state(cfg: TrainConfig, mesh, params: dict) -> tuple[Callable, train.TrainState]:
    """The jitted train step of `cfg` and a fresh state around `params` (not donated).

    With ffn_impl="sparse" every layer starts on the sparse kernels, as a run past its
    first recheck would be (module docstring).
    """
    state = train.train_state_from_params(cfg, mesh, params)
    if cfg.model.ffn_impl == "sparse":
        on = jax.device_put(jnp.ones_like(state.use_sparse), state.use_sparse.sharding)
        state = dataclasses.replace(state, use_sparse=on)
    return train.make_train_step(cfg, mesh), state


def _batch(vocab: int, batch: int, seq: int, mesh) -> dict[str, jax.Array]:
    """{"inputs", "targets"}: int32 [batch, seq], targets the inputs shifted by one."""
    tokens = jax.random.randint(jax.random.key(7), (batch, seq + 1), 0, vocab)
    arrays = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    return jax.device_put(arrays, sharding.batch_sharding(mesh))


def _record(metrics: dict[str, list], timing: dict, n_tokens: int) -> dict:
    """Times, throughput, sparsity drift and first-step agreement of the two chains."""
    first = {impl: train.host_metrics(metrics[impl][0]) for impl in IMPLS}
    last = {impl: train.host_metrics(metrics[impl][-1]) for impl in IMPLS}
    dense_ms, sparse_ms = (timing[impl]["median_ms"] for impl in IMPLS)
    sparse_calls = [train.host_metrics(m) for m in metrics["sparse"]]
    rec = {
        "tokens": n_tokens,
        "dense_ms": dense_ms,
        "sparse_ms": sparse_ms,
        "dense_tokens_per_ms": n_tokens / dense_ms,
        "sparse_tokens_per_ms": n_tokens / sparse_ms,
        "speedup": dense_ms / sparse_ms,
        "speedup_median_of_rounds": timing["ratios"]["dense/sparse"],
        "reps": timing["dense"]["reps"],
        "calls_per_chain": len(metrics["dense"]),
        # Same weights and batch at the first call: the two losses differ only by the
        # kernels' bf16 rounding.
        "first_loss_dense": first["dense"]["loss"],
        "first_loss_sparse": first["sparse"]["loss"],
        "first_grad_norm_dense": first["dense"]["grad_norm"],
        "first_grad_norm_sparse": first["sparse"]["grad_norm"],
        "sparse_layers_last": int(np.sum(last["sparse"]["use_sparse"])),
        "tail_rows_total": int(sum(np.sum(m["tail_rows"]) for m in sparse_calls)),
        "dense_fallback_total": int(sum(np.sum(m["dense_fallback"]) for m in sparse_calls)),
    }
    for impl in IMPLS:
        rec[f"{impl}_p10_p90_ms"] = [timing[impl]["p10_ms"], timing[impl]["p90_ms"]]
        rec[f"{impl}_l0_first"] = float(np.mean(first[impl]["l0"]))
        rec[f"{impl}_l0_last"] = float(np.mean(last[impl]["l0"]))
    return rec


def run(
    presets=("1.5b", "2b"),
    nnz: float = 29.0,
    batch: int = 8,
    seq: int = 2048,
    reps: int = 10,
    warmup: int = 2,
    l1_coef: float = 2e-5,
    model_overrides: dict | None = None,
    pattern: str = "uniform",
    sigma: float = 1.0,
) -> list[dict]:
    """Training-step tokens/ms of each preset, dense and sparse FFNs, same start.

    Args:
      presets: `model_preset` names.
      nnz: target positive gate entries per token per layer of the synthetic weights.
      batch, seq: sequences and tokens per sequence of each step (one micro-batch).
      reps: timed rounds (one step of each chain per round) after `warmup` rounds.
      l1_coef: lambda of the L1 activation term (both chains compute it).
      model_overrides: ModelConfig field -> value (strings are parsed) for both
        chains, e.g. {"sparse_ell_width": "64"}.
      pattern, sigma: "uniform" or "skew" gate thresholds (`synthetic_sparse_params`).

    Returns:
      one record per preset (see `_record`), also printed as it completes.
    """
    mesh = sharding.make_mesh()
    records = []
    for preset in presets:
        params, calib_l0 = synthetic_sparse_params(
            preset, nnz, calib_tokens=(batch, seq), pattern=pattern, sigma=sigma
        )
        steps, states = {}, {}
        for impl in IMPLS:
            cfg = _train_config(preset, impl, batch, seq, l1_coef, model_overrides or {})
            steps[impl], states[impl] = train_step_and_state(cfg, mesh, params)
        del params
        tokens = _batch(cfg.model.vocab_size, batch, seq, mesh)
        memory = {
            impl: bu.compiled_memory(steps[impl].lower(states[impl], tokens)) for impl in IMPLS
        }
        timing, states, metrics = bu.time_steps_interleaved(
            steps, states, tokens, warmup=warmup, reps=reps
        )
        del states
        records.append(
            {
                "preset": preset,
                "batch": batch,
                "seq": seq,
                "target_nnz": nnz,
                "pattern": pattern,
                "pattern_sigma": sigma,
                "l1_coef": l1_coef,
                "model_overrides": dict(model_overrides or {}),
                "calibration_l0_mean": float(calib_l0.mean()),
                **_record(metrics, timing, batch * seq),
                **{f"{impl}_memory": memory[impl] for impl in IMPLS},
            }
        )
        print(records[-1], flush=True)
    return records
