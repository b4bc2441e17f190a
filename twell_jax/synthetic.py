"""Synthetic activation sparsity: MLP inputs and model parameters with a chosen l0.

Without trained weights at hand, the benchmarks and the production-shape kernel tests
need gate pre-activations of which about `nnz` per token are positive. Both helpers get
them from a bias-like coordinate: a constant x[:, 0] and a negative w_gate[:, 0].

`synthetic_mlp` draws one MLP's bf16 inputs directly, with an activation pattern
(`gate_pattern`): "uniform" (every neuron equally likely to fire), "skew" (each neuron
its own threshold: hot and dead neurons, as in trained models) or "heavy_rows" (each
token its own activity scale: a heavy-tailed l0 per row). `synthetic_sparse_params`
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

PATTERNS = ("uniform", "skew", "heavy_rows")
# `synthetic_sparse_params`: the seed of the model's initialisation, the calibration
# tokens (seed + 1) and the skew's thresholds; steps of the bias bisection.
_PARAMS_SEED = 0
_BISECT_ROUNDS = 14


def gate_pattern(
    pattern: str, m: int, n: int, nnz_per_row: float, sigma: float = 1.0, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Thresholds and token scales for pre-activations u[i, j] = s_i z[i, j] - thr_j,
    z standard normal, with a mean of `nnz_per_row` positives per token.

    uniform: thr_j = q = Phi^-1(1 - nnz / N), s_i = 1.
    skew: thr_j ~ N(sqrt(1 + sigma^2) q, sigma^2), so that u - thr is N(-sqrt(1+sigma^2)
      q, 1 + sigma^2) over neurons and the mean rate stays nnz / N; neurons below the
      mean threshold are hot (at sigma = 1 the hottest fire for a third of the tokens),
      those above it nearly dead.
    heavy_rows: s_i = exp(sigma z_i - sigma^2 / 2) (lognormal), one threshold for all
      neurons, found by bisection so that the mean over tokens of Phi(-thr / s_i) is
      nnz / N (sigma = 0.35 gives a p99 of about 13x the mean l0).

    Returns:
      (thr float32 [N], scale float32 [M]).

    Raises:
      ValueError: unknown pattern, or sigma < 0.
    """
    if pattern not in PATTERNS:
        raise ValueError(f"pattern must be one of {PATTERNS}, got {pattern!r}")
    if sigma < 0:
        raise ValueError(f"sigma must be >= 0, got {sigma}")
    rng = np.random.default_rng(seed)
    p = min(max(nnz_per_row / n, 1e-9), 0.5)
    q = statistics.NormalDist().inv_cdf(1.0 - p)
    thr = np.full((n,), q)
    scale = np.ones((m,))
    if pattern == "skew":
        thr = np.sqrt(1.0 + sigma**2) * q + sigma * rng.standard_normal(n)
    elif pattern == "heavy_rows":
        scale = np.exp(sigma * rng.standard_normal(m) - sigma**2 / 2)
        lo, hi = 0.0, 10.0 * q + 10.0
        for _ in range(50):  # the mean rate falls as the threshold grows
            mid = (lo + hi) / 2
            rate = float(jnp.mean(jax.scipy.special.ndtr(-mid / scale)))
            lo, hi = (mid, hi) if rate > p else (lo, mid)
        thr = np.full((n,), (lo + hi) / 2)
    return thr.astype(np.float32), scale.astype(np.float32)


def synthetic_mlp(
    m: int,
    h: int,
    n: int,
    nnz_per_row: float,
    seed: int = 0,
    pattern: str = "uniform",
    sigma: float = 1.0,
):
    """bf16 x [M, H] and gate/up/down weights [N, H] with ~nnz_per_row positive gates.

    The sparsity comes from a bias-like column: x[:, 0] = 1 and Wg[:, 0] = -thr_j, the
    other columns giving unit-std pre-activations; `pattern` and `sigma` as in
    `gate_pattern` (token scales multiply x[i, 1:]).
    """
    k = jax.random.split(jax.random.key(seed), 4)
    w_std = 0.02
    thr, scale = gate_pattern(pattern, m, n, nnz_per_row, sigma, seed)
    x = jax.random.normal(k[0], (m, h), jnp.float32) * jnp.asarray(scale)[:, None]
    x = x.at[:, 0].set(1.0).astype(jnp.bfloat16)
    w_gate = jax.random.normal(k[1], (n, h), jnp.float32) * w_std
    std = float(np.sqrt(h - 1) * w_std)  # of the pre-activation's random part
    w_gate = w_gate.at[:, 0].set(-jnp.asarray(thr) * std)
    w_up = jax.random.normal(k[2], (n, h), jnp.float32) * w_std
    w_down = jax.random.normal(k[3], (n, h), jnp.float32) * w_std
    return x, w_gate.astype(jnp.bfloat16), w_up.astype(jnp.bfloat16), w_down.astype(jnp.bfloat16)


def _with_gate_bias(params: dict, bias: jax.Array, shape: jax.Array) -> dict:
    """params with w_gate[l, j, 0] = -bias[l] shape[l, j]; the other arrays are shared."""
    ffn = params["blocks"]["ffn"]
    thr = bias[:, None] * shape
    w_gate = ffn["w_gate"].at[:, :, 0].set(-thr.astype(ffn["w_gate"].dtype))
    return {**params, "blocks": {**params["blocks"], "ffn": {**ffn, "w_gate": w_gate}}}


def synthetic_sparse_params(
    preset: str,
    nnz: float,
    calib_tokens=(8, 2048),
    pattern: str = "uniform",
    sigma: float = 1.0,
) -> tuple[dict, np.ndarray]:
    """bf16 parameters of `preset` with ~nnz positive gate entries per token per layer.

    pattern "skew" gives every neuron its own threshold, in units of its layer's
    calibrated bias b_l: b_l (sqrt(1 + sigma^2) + sigma z_j / q) with z_j standard
    normal and q = Phi^-1(1 - nnz / N), the `gate_pattern` skew with the layer's
    pre-activation scale b_l / q; the bisection then sets b_l for that shape.

    Returns (pure-dict params for `nnx.merge`, l0 per layer [L] measured on the
    calibration batch).

    Raises:
      ValueError: a pattern other than "uniform" or "skew".
    """
    if pattern not in ("uniform", "skew"):
        raise ValueError(
            f"synthetic_sparse_params: pattern must be 'uniform' or 'skew', got {pattern!r}"
        )
    cfg = model_preset(preset, ffn_impl="dense", remat=False)
    graphdef, state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(_PARAMS_SEED)))
    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), nnx.to_pure_dict(state))
    params["embed"] = params["embed"].at[:, 0].set(1.0)
    attn, ffn = params["blocks"]["attn"], params["blocks"]["ffn"]
    for name in ("wq", "wk", "wv"):  # [L, H, nH, D]: ignore the constant coordinate
        attn[name] = attn[name].at[:, 0].set(0)
    attn["wo"] = attn["wo"].at[..., 0].set(0)  # [L, nH, D, H]: never write it
    for name in ("w_up", "w_down"):  # [L, N, H]
        ffn[name] = ffn[name].at[:, :, 0].set(0)
    tokens = jax.random.randint(jax.random.key(_PARAMS_SEED + 1), calib_tokens, 0, cfg.vocab_size)

    @jax.jit
    def layer_l0(params):
        return nnx.merge(graphdef, params)(tokens)[1]["l0"]

    shape = jnp.ones((cfg.n_layers, cfg.d_ff), jnp.float32)
    if pattern == "skew":
        q = statistics.NormalDist().inv_cdf(1.0 - min(max(nnz / cfg.d_ff, 1e-9), 0.5))
        z = np.random.default_rng(_PARAMS_SEED).standard_normal((cfg.n_layers, cfg.d_ff))
        shape = jnp.asarray(np.sqrt(1.0 + sigma**2) + sigma * z / q, jnp.float32)
    lo = jnp.full((cfg.n_layers,), 1e-3)
    hi = jnp.full((cfg.n_layers,), 1e3)
    for _ in range(_BISECT_ROUNDS):  # geometric bisection: l0 falls as the bias grows
        mid = jnp.sqrt(lo * hi)
        l0 = layer_l0(_with_gate_bias(params, mid, shape))
        lo = jnp.where(l0 > nnz, mid, lo)
        hi = jnp.where(l0 > nnz, hi, mid)
    params = _with_gate_bias(params, jnp.sqrt(lo * hi), shape)
    return params, np.asarray(layer_l0(params))
