"""Model-body forward throughput, `twell` against `dense` FFNs (docs/design.md §8).

The paper measures the model body (no LM head) on 64 x 2048 tokens. `run` times a
randomly initialised model with synthetic sparsity (`twell_jax.synthetic.
synthetic_sparse_params`: a per-layer gate bias calibrated to a target number of
positive gate entries per token per layer); `run_trained` times trained checkpoints of
`experiments.pretrain` at their real sparsity. Both implementations run the same bf16
parameters.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
from flax import nnx

from experiments import bench_util as bu
from experiments import pretrain_run
from twell_jax import input_pipeline, train
from twell_jax.config import ModelConfig, TrainConfig, model_preset
from twell_jax.synthetic import synthetic_sparse_params


def _body_fn(cfg: ModelConfig):
    graphdef = train.model_graphdef(dataclasses.replace(cfg, remat=False))
    body = jax.jit(lambda s, t: nnx.merge(graphdef, s).body(t))
    stats = jax.jit(lambda s, t: nnx.merge(graphdef, s).hidden_states(t)[1])
    return body, stats


def _compare(
    cfg: ModelConfig, state, tokens: jax.Array, reps: int, compressions=(8,)
) -> list[dict]:
    """Times the model body with dense and twell FFNs on the same bf16 parameters.

    All bodies are timed in rotation (`bench_util.time_interleaved`).

    Args:
      cfg: the model config (ffn_impl and twell_compression are overridden).
      state: parameters for `nnx.merge` (an nnx.State or a pure dict).
      tokens: [B, S] int32.
      compressions: the TwELL compressions C to time (the dense body is timed once).

    Returns:
      one record per C: ms and tokens/ms of each path, the speedup, twell's measured
      l0 and overflowed tiles, and the body output's error of twell against dense.
    """
    n_tokens = tokens.size
    dense_body, _ = _body_fn(dataclasses.replace(cfg, ffn_impl="dense"))
    bodies = {"dense": dense_body}
    stats = {}
    for c in compressions:
        twell_cfg = dataclasses.replace(cfg, ffn_impl="twell", twell_compression=c)
        bodies[f"twell_c{c}"], stats[c] = _body_fn(twell_cfg)
    outs = {name: body(state, tokens) for name, body in bodies.items()}
    # Dense and every C in rotation: the runs are long and drift by a few percent.
    timing = bu.time_interleaved(bodies, state, tokens, warmup=2, reps=reps)
    dense_ms = timing["dense"]["median_ms"]
    records = []
    for c in compressions:
        name = f"twell_c{c}"
        twell_ms = timing[name]["median_ms"]
        s = stats[c](state, tokens)
        rec = {
            "compression": c,
            "dense_ms": dense_ms,
            "dense_tokens_per_ms": n_tokens / dense_ms,
            "twell_ms": twell_ms,
            "twell_tokens_per_ms": n_tokens / twell_ms,
            "speedup": dense_ms / twell_ms,
            "speedup_median_of_rounds": timing["ratios"][f"dense/{name}"],
            "dense_p10_p90_ms": [timing["dense"]["p10_ms"], timing["dense"]["p90_ms"]],
            "twell_p10_p90_ms": [timing[name]["p10_ms"], timing[name]["p90_ms"]],
            "reps": reps,
            "twell_l0_per_layer": [float(v) for v in s["l0"]],
            "twell_l0_mean": float(jnp.mean(s["l0"])),
            "twell_overflow_tiles": int(jnp.sum(s["overflow_tiles"])),
        }
        rec.update({f"body_{k}": v for k, v in bu.errors(outs[name], outs["dense"]).items()})
        records.append(rec)
    return records


def run(
    presets=("1.5b", "2b"),
    nnz: float = 29.0,
    batch: int = 64,
    seq: int = 2048,
    reps: int = 10,
    compressions=(8,),
    pattern: str = "uniform",
    sigma: float = 1.0,
) -> list[dict]:
    """tokens/ms of the model body for each preset and C, dense and twell, same weights
    (`pattern`, `sigma`: the gate thresholds of `synthetic_sparse_params`)."""
    records = []
    for preset in presets:
        params, calib_l0 = synthetic_sparse_params(preset, nnz, pattern=pattern, sigma=sigma)
        cfg = model_preset(preset)
        tokens = jax.random.randint(jax.random.key(7), (batch, seq), 0, cfg.vocab_size)
        head = {
            "preset": preset,
            "tokens": batch * seq,
            "target_nnz": nnz,
            "pattern": pattern,
            "pattern_sigma": sigma,
            "calibration_l0_mean": float(calib_l0.mean()),
            "calibration_l0_min": float(calib_l0.min()),
            "calibration_l0_max": float(calib_l0.max()),
        }
        for rec in _compare(cfg, params, tokens, reps, compressions):
            records.append({**head, **rec})
            print(json.dumps(records[-1]), flush=True)
        del params
    return records


def trained_params(workdir: str) -> tuple[TrainConfig, dict, int]:
    """The newest readable checkpoint of a pretrain workdir: (its config, bf16 params,
    step), read as `pretrain_run.load_params` reads it.

    Raises:
      FileNotFoundError: no checkpoint in `workdir`.
    """
    cfg, params, step = pretrain_run.load_params(workdir)
    return cfg, jax.tree.map(lambda a: a.astype(jnp.bfloat16), params), step


def run_trained(
    workdirs, data_dir: str, batch: int = 64, reps: int = 10, compressions=(8, 4, 2)
) -> list[dict]:
    """Model-body throughput of trained checkpoints at their real sparsity.

    The tokens are the first validation sequences of `data_dir` (the run's corpus), at the
    run's sequence length; each TwELL compression C is timed, since real l0 decides which
    C overflows least.
    """
    records = []
    for workdir in workdirs:
        cfg, params, step = trained_params(workdir)
        data_cfg = input_pipeline.DataConfig(
            data_dir, seq_len=cfg.model.seq_len, batch_size=batch, seed=cfg.seed
        )
        tokens = jnp.asarray(next(input_pipeline.make_val_iterator(data_cfg, 1))["inputs"])
        head = {
            "workdir": str(workdir),
            "step": step,
            "l1_coef": cfg.sparsity.l1_coef,
            "tokens": int(tokens.size),
        }
        for rec in _compare(cfg.model, params, tokens, reps, compressions):
            records.append({**head, **rec})
            print(json.dumps(records[-1]), flush=True)
    return records
