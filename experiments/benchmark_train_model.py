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

`run_trained` times the same two steps on a pretrain checkpoint's weights and the
run's own batches instead (`--train_model_workdir`), with every layer sparse or, with
`--train_model_run_switch`, each layer where the run's own cutoff puts it. With an energy meter
(`twell_jax.energy.EnergyMeter`, `--energy`) each record also gives the joules per token
of each chain over its timed steps.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments import bench_util as bu
from twell_jax import corpus, sharding, sparsity, train
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
    """Times, throughput, sparsity drift and first-step agreement of the two chains;
    l0 per layer (mean over all calls) and, with a meter's readings, energy."""
    calls = {impl: [train.host_metrics(m) for m in metrics[impl]] for impl in IMPLS}
    first = {impl: calls[impl][0] for impl in IMPLS}
    last = {impl: calls[impl][-1] for impl in IMPLS}
    dense_ms, sparse_ms = (timing[impl]["median_ms"] for impl in IMPLS)
    sparse_calls = calls["sparse"]
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
        "sparse_layers_first": int(np.sum(first["sparse"]["use_sparse"])),
        "sparse_layers_last": int(np.sum(last["sparse"]["use_sparse"])),
        "tail_rows_total": int(sum(np.sum(m["tail_rows"]) for m in sparse_calls)),
        "dense_fallback_total": int(sum(np.sum(m["dense_fallback"]) for m in sparse_calls)),
    }
    for impl in IMPLS:
        rec[f"{impl}_p10_p90_ms"] = [timing[impl]["p10_ms"], timing[impl]["p90_ms"]]
        rec[f"{impl}_l0_first"] = float(np.mean(first[impl]["l0"]))
        rec[f"{impl}_l0_last"] = float(np.mean(last[impl]["l0"]))
        per_layer = np.mean([c["l0"] for c in calls[impl]], axis=0)
        rec[f"{impl}_l0_per_layer"] = [float(v) for v in per_layer]
    return {**rec, **_energy_fields(timing, n_tokens)}


def _energy_fields(timing: dict, n_tokens: int) -> dict:
    """Joules per token and mean watts of each chain over its timed steps, and the
    ratio dense / sparse of joules per token; {} when no meter was read."""
    if "joules" not in timing["dense"]:
        return {}
    rec = {}
    for impl in IMPLS:
        t = timing[impl]
        rec[f"{impl}_joules_per_token"] = t["joules"] / (t["reps"] * n_tokens)
        rec[f"{impl}_watts"] = t["joules"] / (sum(t["times_ms"]) / 1e3)
    rec["energy_ratio"] = rec["dense_joules_per_token"] / rec["sparse_joules_per_token"]
    return rec


def _cycling(step: Callable, batches: list) -> Callable:
    """`step(state, batch)` as `step(state)`: its k-th call takes batches[k % len]."""
    batch = itertools.cycle(batches)
    return lambda state: step(state, next(batch))


def _time_chains(steps: dict, states: dict, batches: list, warmup: int, reps: int, meter) -> dict:
    """Compiled memory, then the two chains in rotation over `batches` (both take the
    same batch at the same call); `_record` of the result plus each step's memory."""
    memory = {
        impl: bu.compiled_memory(steps[impl].lower(states[impl], batches[0])) for impl in IMPLS
    }
    timing, _, metrics = bu.time_steps_interleaved(
        {impl: _cycling(steps[impl], batches) for impl in IMPLS},
        states,
        warmup=warmup,
        reps=reps,
        meter=meter,
    )
    n_tokens = int(batches[0]["inputs"].size)
    return {
        **_record(metrics, timing, n_tokens),
        **{f"{impl}_memory": memory[impl] for impl in IMPLS},
    }


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
    meter=None,
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
      meter: an `EnergyMeter` (or anything with `joules()`), read around each timed step.

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
        measured = _time_chains(steps, states, [tokens], warmup, reps, meter)
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
                **measured,
            }
        )
        print(json.dumps(records[-1]), flush=True)
    return records


def _trained_config(
    run_cfg: TrainConfig, impl: str, batch: int, run_switch: bool = False
) -> TrainConfig:
    """The run's config for one timed chain: `impl` FFNs, one micro-batch of `batch`
    sequences per step, lr FROZEN_LR, the run's lambda from the first step, no dead-row
    re-init, and (sparse) a switch that never rechecks past step 0, with a cutoff above
    d_ff, so every layer stays sparse, or with `run_switch` the run's own switch."""
    sp = run_cfg.sparsity
    if not run_switch:
        sp = dataclasses.replace(
            sp, sparse_l0_cutoff=float(run_cfg.model.d_ff + 1), sparse_recheck_every=2**30
        )
    return dataclasses.replace(
        run_cfg,
        model=dataclasses.replace(run_cfg.model, ffn_impl=impl),
        batch_size=batch,
        optim=dataclasses.replace(run_cfg.optim, lr=FROZEN_LR, warmup_steps=0, grad_accum_steps=1),
        sparsity=dataclasses.replace(
            sp,
            l1_warmup_steps=0,
            reinit_dead_every=0,
        ),
    )


def _run_switch_state(run_cfg: TrainConfig, state: train.TrainState, batch: dict):
    """`state` with the layers on the sparse kernels that the run's switch would put
    there for `batch`: its rule (`sparsity.next_use_sparse` at a recheck step) on each
    layer's statistics from a forward with every layer on the switch's dense branch (no
    step, so no chain moves)."""
    graphdef = train.model_graphdef(dataclasses.replace(run_cfg.model, ffn_impl="sparse"))
    dense = jnp.zeros((run_cfg.model.n_layers,), bool)
    forward = jax.jit(lambda p, t: nnx.merge(graphdef, p).hidden_states(t, dense)[1])
    stats = forward(state.params, batch["inputs"])
    shares = (stats["hot_share"], stats["tail_load"])
    use = sparsity.next_use_sparse(0, stats["l0"], *shares, state.use_sparse, run_cfg.sparsity)
    return dataclasses.replace(state, use_sparse=jax.device_put(use, state.use_sparse.sharding))


def run_trained(
    workdir: str | Path,
    data_dir: str | Path,
    batch: int = 8,
    reps: int = 10,
    warmup: int = 2,
    meter=None,
    run_switch: bool = False,
) -> dict:
    """Training-step tokens/ms of a pretrain checkpoint, dense and sparse FFNs, on its data.

    With `run_switch` the sparse chain runs each layer as the run's own switch would:
    on the sparse kernels where the layer's l0 on the first batch (one dense step) is
    below the run's cutoff, dense elsewhere; otherwise every layer runs sparse.

    The weights (fp32 masters) and the config are the newest checkpoint's
    (`pretrain_run.load_params`); the steps are the run's model at its seq_len, each
    chain from a fresh AdamW state (`_trained_config`: the weights and l0 stay the
    checkpoint's). The batches are the first `warmup + reps` batches of `batch`
    sequences of the run's training pipeline over `data_dir` (its seed): call k of
    each chain takes batch k, so both chains step the same real tokens.

    Returns:
      the `_record` fields (l0 per layer included) and each step's memory, plus the
      workdir, its step, the run's l1_coef and ffn_impl, and how many layers the run's
      own l0 cutoff would have kept on the sparse kernels at the sparse chain's l0.

    Raises:
      FileNotFoundError: `workdir` has no checkpoint, or `data_dir` is not a corpus.
      ValueError: the corpus's token ids do not fit the model's vocabulary.
    """
    # grain (through the input pipeline and the trainer) only for this mode: synthetic
    # runs need neither.
    from experiments import pretrain_run
    from twell_jax import input_pipeline

    run_cfg, params, step = pretrain_run.load_params(workdir)
    tok = corpus.load_meta(data_dir)["tokenizer"]
    if tok["vocab_size"] > run_cfg.model.vocab_size:
        raise ValueError(
            f"{data_dir}: {tok['vocab_size']} token ids, but the run's model has "
            f"vocab_size={run_cfg.model.vocab_size}: not the run's corpus"
        )
    mesh = sharding.make_mesh()
    data_cfg = input_pipeline.DataConfig(
        str(data_dir), seq_len=run_cfg.model.seq_len, batch_size=batch, seed=run_cfg.seed
    )
    train_iter = input_pipeline.make_train_iterator(data_cfg)
    placement = sharding.batch_sharding(mesh)
    batches = [jax.device_put(next(train_iter), placement) for _ in range(warmup + reps)]
    steps, states = {}, {}
    for impl in IMPLS:
        steps[impl], states[impl] = train_step_and_state(
            _trained_config(run_cfg, impl, batch, run_switch), mesh, params
        )
    del params
    cutoff = run_cfg.sparsity.sparse_l0_cutoff
    if run_switch:
        states["sparse"] = _run_switch_state(run_cfg, states["sparse"], batches[0])
    measured = _time_chains(steps, states, batches, warmup, reps, meter)
    del states
    record = {
        "workdir": str(workdir),
        "step": step,
        "data_dir": str(data_dir),
        "batch": batch,
        "seq": run_cfg.model.seq_len,
        "batches": len(batches),
        "run_ffn_impl": run_cfg.model.ffn_impl,
        "l1_coef": run_cfg.sparsity.l1_coef,
        "run_l0_cutoff": cutoff,
        "run_cutoff_sparse_layers": sum(v < cutoff for v in measured["sparse_l0_per_layer"]),
        "run_switch": run_switch,
        **measured,
    }
    print(json.dumps(record), flush=True)
    return record
