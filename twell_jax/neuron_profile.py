"""How a model's FFN activity is spread over neurons and tokens, layer by layer.

Trained ReLU FFNs are far from uniform: a few hot neurons hold most of the non-zeros,
many neurons are dead, and some tokens are much more active than the mean. The
sparse kernels' speed depends on that shape (docs/design.md §6.3), so the benchmarks
report it beside their timings (`experiments/neuron_profile.py` prints it for a
workdir).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


@jax.jit
def gate_positives(ffn_inputs: jax.Array, w_gate: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Positive gate pre-activations per neuron and per token.

    Args:
      ffn_inputs: [L, M, H] each layer's FFN input (`Transformer.ffn_inputs`).
      w_gate: [L, N, H] the gate weights (for a non-gated FFN: w_up).

    Returns:
      (per neuron int32 [L, N], per token int32 [L, M]) counts of x w_gate^T > 0, the
      GEMM in the inputs' dtype as the FFN computes it.
    """

    def layer(args):
        x, w = args
        pos = jnp.einsum("mh,nh->mn", x, w.astype(x.dtype)) > 0
        return jnp.sum(pos, axis=0, dtype=jnp.int32), jnp.sum(pos, axis=1, dtype=jnp.int32)

    return jax.lax.map(layer, (ffn_inputs, w_gate))


def profile(per_neuron: np.ndarray, per_token: np.ndarray) -> list[dict]:
    """One record per layer from `gate_positives`' counts.

    Keys: l0 (mean positives per token), l0_p99 and l0_max (per token), top1_share and
    top10_share (share of all positives held by the 1% / 10% most active neurons;
    uniform: ~0.01 / ~0.10), dead_share (neurons that never fired on these tokens),
    hottest_rate (the most active neuron's firing rate over tokens).
    """
    per_neuron, per_token = np.asarray(per_neuron), np.asarray(per_token)
    records = []
    for col, row in zip(per_neuron, per_token, strict=True):
        n, m = col.shape[0], row.shape[0]
        ranked = np.sort(col)[::-1]
        total = max(int(ranked.sum()), 1)
        records.append(
            {
                "l0": float(row.mean()),
                "l0_p99": float(np.percentile(row, 99)),
                "l0_max": int(row.max()),
                "top1_share": float(ranked[: max(n // 100, 1)].sum() / total),
                "top10_share": float(ranked[: max(n // 10, 1)].sum() / total),
                "dead_share": float(np.mean(col == 0)),
                "hottest_rate": float(ranked[0] / m),
            }
        )
    return records


def table(records: list[dict]) -> str:
    """Markdown table of `profile` records, one row per layer."""
    head = "| layer | l0 | l0 p99 | l0 max | top 1% share | top 10% share | dead | hottest rate |"
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(records):
        lines.append(
            f"| {i} | {r['l0']:.1f} | {r['l0_p99']:.0f} | {r['l0_max']} | {r['top1_share']:.2f}"
            f" | {r['top10_share']:.2f} | {r['dead_share']:.2f} | {r['hottest_rate']:.3f} |"
        )
    return "\n".join(lines)
