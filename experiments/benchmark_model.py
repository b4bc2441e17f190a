"""Model-body forward throughput, `twell` against `dense` FFNs (twell.md §7).

The paper measures the model body (no LM head) on 64 x 2048 tokens. Without trained
weights at hand we use a synthetic-sparsity initialisation of a randomly initialised
model, calibrated to a target number of positive gate entries per token per layer:

1. every token embedding gets a constant first coordinate (1.0, against ~0.02 for the
   others), and no layer reads or writes that coordinate otherwise (rows 0 of the
   attention inputs, column 0 of the attention output and of the up / down weights
   are zeroed), so the residual stream keeps it exactly: each RMS-normalised FFN
   input carries a large, nearly constant x[:, 0];
2. w_gate[:, 0] of layer l is set to -b_l, a per-layer bias through that coordinate;
3. b_l is calibrated by bisection (in log space) on the measured l0 of each layer of
   the dense model, on a small batch, until every layer sits near the target.

Both implementations then run the same bf16 parameters.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments import bench_util as bu
from experiments import train_loop
from twell_jax import checkpoint, data, train
from twell_jax.config import ModelConfig, TrainConfig, model_preset, train_config_from_dict
from twell_jax.model import Transformer


def _with_gate_bias(params: dict, bias: jax.Array) -> dict:
    """params with w_gate[l, :, 0] = -bias[l] (bias [L]); the other arrays are shared."""
    ffn = params["blocks"]["ffn"]
    w_gate = ffn["w_gate"].at[:, :, 0].set(-bias[:, None].astype(ffn["w_gate"].dtype))
    return {**params, "blocks": {**params["blocks"], "ffn": {**ffn, "w_gate": w_gate}}}


def synthetic_sparse_params(
    preset: str, nnz: float, seed: int = 0, calib_tokens=(8, 2048), rounds: int = 14
) -> tuple[dict, np.ndarray]:
    """bf16 parameters of `preset` with ~nnz positive gate entries per token per layer.

    Returns (pure-dict params for `nnx.merge`, l0 per layer [L] measured on the
    calibration batch).
    """
    cfg = model_preset(preset, ffn_impl="dense", remat=False)
    graphdef, state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(seed)))
    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), nnx.to_pure_dict(state))
    params["embed"] = params["embed"].at[:, 0].set(1.0)
    attn, ffn = params["blocks"]["attn"], params["blocks"]["ffn"]
    for name in ("wq", "wk", "wv"):  # [L, H, nH, D]: ignore the constant coordinate
        attn[name] = attn[name].at[:, 0].set(0)
    attn["wo"] = attn["wo"].at[..., 0].set(0)  # [L, nH, D, H]: never write it
    for name in ("w_up", "w_down"):  # [L, N, H]
        ffn[name] = ffn[name].at[:, :, 0].set(0)
    tokens = jax.random.randint(jax.random.key(seed + 1), calib_tokens, 0, cfg.vocab_size)

    @jax.jit
    def layer_l0(params):
        return nnx.merge(graphdef, params)(tokens)[1]["l0"]

    lo = jnp.full((cfg.n_layers,), 1e-3)
    hi = jnp.full((cfg.n_layers,), 1e3)
    for _ in range(rounds):  # geometric bisection: l0 falls as the bias grows
        mid = jnp.sqrt(lo * hi)
        l0 = layer_l0(_with_gate_bias(params, mid))
        lo = jnp.where(l0 > nnz, mid, lo)
        hi = jnp.where(l0 > nnz, hi, mid)
    params = _with_gate_bias(params, jnp.sqrt(lo * hi))
    return params, np.asarray(layer_l0(params))


def _body_fn(cfg: ModelConfig):
    graphdef = train.model_graphdef(dataclasses.replace(cfg, remat=False))
    body = jax.jit(lambda s, t: nnx.merge(graphdef, s).body(t))
    stats = jax.jit(lambda s, t: nnx.merge(graphdef, s)._body(t, None)[1])
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
) -> list[dict]:
    """tokens/ms of the model body for each preset and C, dense and twell, same weights."""
    records = []
    for preset in presets:
        params, calib_l0 = synthetic_sparse_params(preset, nnz)
        cfg = model_preset(preset)
        tokens = jax.random.randint(jax.random.key(7), (batch, seq), 0, cfg.vocab_size)
        head = {
            "preset": preset,
            "tokens": batch * seq,
            "target_nnz": nnz,
            "calibration_l0_mean": float(calib_l0.mean()),
            "calibration_l0_min": float(calib_l0.min()),
            "calibration_l0_max": float(calib_l0.max()),
        }
        for rec in _compare(cfg, params, tokens, reps, compressions):
            records.append({**head, **rec})
            print(records[-1], flush=True)
        del params
    return records


def trained_params(workdir: str) -> tuple[TrainConfig, dict, int]:
    """The newest checkpoint of a pretrain workdir: (its config, bf16 params, step).

    Raises:
      FileNotFoundError: no config.json or no checkpoint in `workdir`.
    """
    path = Path(workdir)
    config_file = path / train_loop.CONFIG_FILE
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file}: not a pretrain workdir (no config.json)")
    cfg = train_config_from_dict(json.loads(config_file.read_text()))
    mesh = train.make_mesh()
    with checkpoint.Checkpointer(path / train_loop.CHECKPOINT_DIR) as ckpt:
        if ckpt.latest_step() is None:
            raise FileNotFoundError(f"{path / train_loop.CHECKPOINT_DIR}: no checkpoint")
        restored = ckpt.restore(train.abstract_train_state(cfg, mesh))
    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), restored.state.params)
    return cfg, params, restored.step


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
        data_cfg = data.DataConfig(
            data_dir, seq_len=cfg.model.seq_len, batch_size=batch, seed=cfg.seed
        )
        tokens = jnp.asarray(next(data.make_val_iterator(data_cfg, 1))["inputs"])
        head = {
            "workdir": str(workdir),
            "step": step,
            "l1_coef": cfg.sparsity.l1_coef,
            "tokens": int(tokens.size),
        }
        for rec in _compare(cfg.model, params, tokens, reps, compressions):
            records.append({**head, **rec})
            print(records[-1], flush=True)
    return records
