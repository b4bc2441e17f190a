"""L1 sparsity objective, activation statistics and dead-neuron tracking (docs/design.md §2).

Everything here is a pure function over arrays, usable inside `jax.jit`:
- `hidden_stats(h)`: per-layer l1 / l0 / fired of one FFN hidden activation [M, N].
- `l1_coef_at(step, cfg)` and `l1_penalty(...)`: the lambda-weighted term added to CE.
- `update_tokens_since_fired`, `alive_fraction`: dead-neuron bookkeeping.
- `reinit_dead_rows`: re-draw the gate rows of dead neurons.
- `next_use_sparse`: the per-layer l0-cutoff switch between sparse kernels and dense.

Conventions: L layers, N = d_ff, M tokens; FFN weights are stacked per layer as
[L, N, H] under `params["blocks"]["ffn"]` (see `twell_jax.model`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from twell_jax.config import ModelConfig, SparsityConfig

# Saturation value of `tokens_since_fired`: int32 would overflow after ~2k steps of
# 1M-token batches, and any count past tokens_until_dead means the same thing.
_INT32_MAX = jnp.iinfo(jnp.int32).max

FFN_WEIGHTS = ("w_gate", "w_up", "w_down")


def hidden_stats(h: jax.Array) -> dict[str, jax.Array]:
    """Statistics of one layer's FFN hidden activation.

    Args:
      h: [M, N] hidden activation (any float dtype), e.g. relu(x Wg^T) * (x Wu^T).

    Returns:
      dict with `l1`: fp32 scalar, mean over tokens of sum_N |h| (differentiable, the
      quantity penalised); `l0`: fp32 scalar, mean non-zeros per token; `fired`: [N]
      bool, the neuron was non-zero for at least one token.
    """
    nonzero = h != 0
    return {
        "l1": jnp.mean(jnp.sum(jnp.abs(h.astype(jnp.float32)), axis=-1)),
        "l0": jnp.mean(jnp.sum(nonzero.astype(jnp.float32), axis=-1)),
        "fired": jnp.any(nonzero, axis=0),
    }


def l1_coef_at(step: jax.Array | int, cfg: SparsityConfig) -> jax.Array:
    """lambda at optimizer `step`: linear ramp 0 -> l1_coef over l1_warmup_steps. fp32."""
    if cfg.l1_warmup_steps == 0:
        return jnp.asarray(cfg.l1_coef, jnp.float32)
    ramp = jnp.minimum(jnp.asarray(step, jnp.float32) / cfg.l1_warmup_steps, 1.0)
    return cfg.l1_coef * ramp


def weight_l1(params: dict[str, Any]) -> jax.Array:
    """Mean over layers of sum |W| over the FFN matrices present. fp32 scalar."""
    ffn = params["blocks"]["ffn"]
    per_layer = sum(
        jnp.sum(jnp.abs(ffn[k].astype(jnp.float32)), axis=(1, 2)) for k in FFN_WEIGHTS if k in ffn
    )
    return jnp.mean(per_layer)


def l1_penalty(
    layer_l1: jax.Array, params: dict[str, Any], step: jax.Array | int, cfg: SparsityConfig
) -> jax.Array:
    """The sparsity term added to CE: lambda(step) * mean over layers of the L1 target.

    Args:
      layer_l1: [L] fp32 per-layer activation L1 (`hidden_stats(h)["l1"]` stacked).
      params: model parameters (pure dict); read only when l1_target == "weights".
      step: optimizer step (for the lambda warmup).
      cfg: sparsity config.

    Returns:
      fp32 scalar.
    """
    target = jnp.mean(layer_l1) if cfg.l1_target == "activations" else weight_l1(params)
    return l1_coef_at(step, cfg) * target


def sparsity_fraction(l0: jax.Array, d_ff: int) -> jax.Array:
    """Fraction of zero hidden activations, 1 - l0 / N (same shape as l0)."""
    return 1.0 - l0 / d_ff


def init_tokens_since_fired(n_layers: int, d_ff: int) -> jax.Array:
    """All neurons start alive: zeros [L, N] int32."""
    return jnp.zeros((n_layers, d_ff), jnp.int32)


def update_tokens_since_fired(
    tokens_since_fired: jax.Array, fired: jax.Array, n_tokens: int
) -> jax.Array:
    """Resets fired neurons to 0 and ages the others by the batch's token count.

    Args:
      tokens_since_fired: [L, N] int32.
      fired: [L, N] bool, fired at least once in this batch.
      n_tokens: tokens in this batch.

    Returns:
      [L, N] int32, saturating at int32 max.
    """
    aged = jnp.minimum(tokens_since_fired, _INT32_MAX - n_tokens) + n_tokens
    return jnp.where(fired, 0, aged).astype(jnp.int32)


def alive_fraction(tokens_since_fired: jax.Array, tokens_until_dead: int) -> jax.Array:
    """Per-layer fraction of neurons that fired within the last tokens_until_dead tokens.

    Returns:
      [L] fp32.
    """
    return jnp.mean((tokens_since_fired < tokens_until_dead).astype(jnp.float32), axis=-1)


def reinit_dead_rows(
    params: dict[str, Any],
    tokens_since_fired: jax.Array,
    rng: jax.Array,
    model_cfg: ModelConfig,
    tokens_until_dead: int,
) -> tuple[dict[str, Any], jax.Array]:
    """Re-draws the gating rows of dead neurons from N(0, init_std).

    The gating rows are those of w_gate (gated variants) or w_up (the non-gated "relu"
    variant): the rows that decide whether a neuron fires. Re-drawn neurons get a
    fresh tokens_until_dead budget (their counter is reset to 0).

    Args:
      params: pure-dict model parameters with `params["blocks"]["ffn"][w]` [L, N, H].
      tokens_since_fired: [L, N] int32.
      rng: PRNG key.
      model_cfg: supplies ffn_variant and init_std.
      tokens_until_dead: a neuron is dead when tokens_since_fired >= this.

    Returns:
      (params with only the dead rows changed, tokens_since_fired with them reset).
    """
    dead = tokens_since_fired >= tokens_until_dead
    name = "w_gate" if model_cfg.gated else "w_up"
    w = params["blocks"]["ffn"][name]
    fresh = model_cfg.init_std * jax.random.normal(rng, w.shape, jnp.float32)
    new_w = jnp.where(dead[..., None], fresh.astype(w.dtype), w)
    ffn = {**params["blocks"]["ffn"], name: new_w}
    new_params = {**params, "blocks": {**params["blocks"], "ffn": ffn}}
    return new_params, jnp.where(dead, 0, tokens_since_fired)


def l0_cutoff(hot_share, cfg: SparsityConfig):
    """A layer's l0 cutoff (docs/design.md §7.1): `sparse_l0_cutoff`, moved by the
    shift that `sparse_hot_shift`'s knots give at the layer's hot share (linear between
    knots, held at the end ones: no extrapolation past the calibration patterns).

    hot_share: fp32 array of any shape (or a float); returns its shape.
    """
    knots = cfg.sparse_hot_shift
    shares = jnp.asarray(knots[0::2], jnp.float32)
    shifts = jnp.asarray(knots[1::2], jnp.float32)
    return cfg.sparse_l0_cutoff + jnp.interp(jnp.asarray(hot_share, jnp.float32), shares, shifts)


def sparse_wins(l0, hot_share, tail_load, cfg: SparsityConfig):
    """Whether a layer with these statistics runs the sparse kernels: l0 below its
    `l0_cutoff`, and its heavy rows within the sparse op's dense tail (tail_load, rows
    past the ELL width over the tail's largest capacity, at most 1): past it the op
    runs its dense fallback, slower than the dense branch (docs/design.md §7.1).
    Arrays of one shape (or floats) -> bool of that shape."""
    fits = jnp.asarray(tail_load, jnp.float32) <= 1.0
    return (jnp.asarray(l0, jnp.float32) < l0_cutoff(hot_share, cfg)) & fits


def next_use_sparse(
    step: jax.Array,
    l0: jax.Array,
    hot_share: jax.Array,
    tail_load: jax.Array,
    use_sparse: jax.Array,
    cfg: SparsityConfig,
) -> jax.Array:
    """The per-layer switch (docs/design.md §7): which layers run the sparse kernels next.

    Every `sparse_recheck_every` steps (starting at step 0) a layer is switched to the
    sparse kernels iff its statistics of this step say so (`sparse_wins`), and back to
    dense otherwise; in between the switch holds.

    Args:
      step: optimizer step that measured the statistics (int32 scalar).
      l0: [L] fp32 mean non-zeros per token of this step.
      hot_share: [L] fp32, the hot neurons' share of the entries (`ffn.sparse`).
      tail_load: [L] fp32, rows past the ELL width over the sparse op's tail capacity.
      use_sparse: [L] bool, the current switch.
      cfg: sparsity config.

    Returns:
      [L] bool.
    """
    wins = sparse_wins(l0, hot_share, tail_load, cfg)
    return jnp.where(step % cfg.sparse_recheck_every == 0, wins, use_sparse)
