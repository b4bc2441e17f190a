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

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments import bench_util as bu
from twell_jax.config import model_preset
from twell_jax.model import Transformer


def _with_gate_bias(state, bias: jax.Array):
    """state with w_gate[l, :, 0] = -bias[l] (bias [L])."""
    w = state["blocks"]["ffn"]["w_gate"]
    w.value = w.value.at[:, :, 0].set(-bias[:, None].astype(w.value.dtype))
    return state


def synthetic_sparse_state(preset: str, nnz: float, seed: int = 0, calib_tokens=(8, 2048),
                           rounds: int = 14):
    """bf16 parameters of `preset` with ~nnz positive gate entries per token per layer.

    Returns (state, l0 per layer [L] measured on the calibration batch).
    """
    cfg = model_preset(preset, ffn_impl="dense", remat=False)
    model = Transformer(cfg, rngs=nnx.Rngs(seed))
    graphdef, state = nnx.split(model)
    state = jax.tree.map(lambda a: a.astype(jnp.bfloat16), state)
    state["embed"].value = state["embed"].value.at[:, 0].set(1.0)
    attn, ffn = state["blocks"]["attn"], state["blocks"]["ffn"]
    for name in ("wq", "wk", "wv"):  # [L, H, nH, D]: ignore the constant coordinate
        attn[name].value = attn[name].value.at[:, 0].set(0)
    attn["wo"].value = attn["wo"].value.at[..., 0].set(0)  # [L, nH, D, H]: never write it
    for name in ("w_up", "w_down"):  # [L, N, H]
        ffn[name].value = ffn[name].value.at[:, :, 0].set(0)
    tokens = jax.random.randint(jax.random.key(seed + 1), calib_tokens, 0, cfg.vocab_size)

    @jax.jit
    def layer_l0(state):
        return nnx.merge(graphdef, state)(tokens)[1]["l0"]

    lo = jnp.full((cfg.n_layers,), 1e-3)
    hi = jnp.full((cfg.n_layers,), 1e3)
    for _ in range(rounds):  # geometric bisection: l0 falls as the bias grows
        mid = jnp.sqrt(lo * hi)
        l0 = layer_l0(_with_gate_bias(state, mid))
        lo = jnp.where(l0 > nnz, mid, lo)
        hi = jnp.where(l0 > nnz, hi, mid)
    state = _with_gate_bias(state, jnp.sqrt(lo * hi))
    return state, np.asarray(layer_l0(state))


def run(presets=("1.5b", "2b"), nnz: float = 29.0, batch: int = 64, seq: int = 2048,
        reps: int = 10) -> list[dict]:
    """tokens/ms of the model body for each preset, dense and twell, same weights."""
    records = []
    for preset in presets:
        state, calib_l0 = synthetic_sparse_state(preset, nnz)
        vocab = model_preset(preset).vocab_size
        tokens = jax.random.randint(jax.random.key(7), (batch, seq), 0, vocab)
        rec = {"preset": preset, "tokens": batch * seq, "target_nnz": nnz,
               "calibration_l0_mean": float(calib_l0.mean()),
               "calibration_l0_min": float(calib_l0.min()),
               "calibration_l0_max": float(calib_l0.max())}
        outs = {}
        for impl in ("dense", "twell"):
            cfg = model_preset(preset, ffn_impl=impl, remat=False)
            abstract = nnx.eval_shape(lambda cfg=cfg: Transformer(cfg, rngs=nnx.Rngs(0)))
            graphdef = nnx.split(abstract)[0]
            body = jax.jit(lambda s, t, g=graphdef: nnx.merge(g, s).body(t))
            stats = jax.jit(lambda s, t, g=graphdef: nnx.merge(g, s)._body(t, None)[1])
            outs[impl] = body(state, tokens)
            t = bu.time_fn(body, state, tokens, warmup=3, reps=reps)
            rec[f"{impl}_ms"] = t["median_ms"]
            rec[f"{impl}_tokens_per_ms"] = batch * seq / t["median_ms"]
            if impl == "twell":
                s = stats(state, tokens)
                rec["twell_l0_mean"] = float(jnp.mean(s["l0"]))
                rec["twell_overflow_tiles"] = int(jnp.sum(s["overflow_tiles"]))
        rec["speedup"] = rec["dense_ms"] / rec["twell_ms"]
        rec.update({f"body_{k}": v for k, v in bu.errors(outs["twell"], outs["dense"]).items()})
        records.append(rec)
        print(rec, flush=True)
        del state
    return records
