"""Synthetic activation sparsity: MLP inputs and model parameters with a chosen l0.

Without trained weights at hand, the benchmarks and the production-shape kernel tests
need gate pre-activations of which about `nnz` per token are positive. Both helpers get
them from a bias-like coordinate: a constant x[:, 0] and a negative w_gate[:, 0].

`synthetic_mlp` draws one MLP's bf16 inputs directly. `synthetic_sparse_params`
adapts a randomly initialised `Transformer`:

1. every token embedding gets a constant first coordinate (1.0, against ~0.02 for the
   others), and no layer reads or writes that coordinate otherwise (rows 0 of the
   attention inputs, column 0 of the attention output and of the up / down weights
   are zeroed), so the residual stream keeps it exactly: each RMS-normalised FFN
   input carries a large, nearly constant x[:, 0];
2. w_gate[:, 0] of layer l is set to -b_l, a per-layer bias through that coordinate;
3. b_l is calibrated by bisection (in log space) on the measured l0 of each layer of
   the dense model, on a small batch, until every layer sits near the target.
"""

from __future__ import annotations

import statistics

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from twell_jax.config import model_preset
from twell_jax.model import Transformer


def gate_threshold(nnz_per_row: float, n: int, h: int, x_std: float, w_std: float) -> float:
    """Bias that leaves about `nnz_per_row` of N gate pre-activations positive.

    With x[:, 0] = 1 and Wg[:, 0] = -thr, a gate pre-activation is a normal with std
    sqrt(H - 1) * x_std * w_std shifted by -thr.
    """
    p = min(max(nnz_per_row / n, 1e-9), 0.5)
    std = np.sqrt(h - 1) * x_std * w_std
    return float(std * statistics.NormalDist().inv_cdf(1.0 - p))


def synthetic_mlp(m: int, h: int, n: int, nnz_per_row: float, seed: int = 0):
    """bf16 x [M, H] and gate/up/down weights [N, H] with ~nnz_per_row positive gates.

    The sparsity comes from a bias-like column: x[:, 0] = 1 and Wg[:, 0] = -thr.
    """
    k = jax.random.split(jax.random.key(seed), 4)
    w_std = 0.02
    x = jax.random.normal(k[0], (m, h), jnp.float32)
    x = x.at[:, 0].set(1.0).astype(jnp.bfloat16)
    w_gate = jax.random.normal(k[1], (n, h), jnp.float32) * w_std
    w_gate = w_gate.at[:, 0].set(-gate_threshold(nnz_per_row, n, h, 1.0, w_std))
    w_up = jax.random.normal(k[2], (n, h), jnp.float32) * w_std
    w_down = jax.random.normal(k[3], (n, h), jnp.float32) * w_std
    return x, w_gate.astype(jnp.bfloat16), w_up.astype(jnp.bfloat16), w_down.astype(jnp.bfloat16)


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
