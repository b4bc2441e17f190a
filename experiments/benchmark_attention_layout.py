"""GPU time of a decode step's attention projections in several weight layouts.

    python -m experiments.benchmark_attention_layout --out=results/attention_layout_decode_h200.json

One token (M = 1) or eight (M = 8) times the attention weights of the 1.5B / 2B shape
(H 2048, 32 heads of 64), 8 layers with their own weights per call (so that the
weights do not stay in L2), each layout jitted alone; per layer: the GPU's busy time
of one call (`bench_util.call_timeline`) and each kernel's launches and mean µs
(`bench_util.kernel_times`). Layouts: q / k / v as the model stores them ([H, nH, D],
three einsums), stacked into one matrix with H last or first, or three matrices with
H last; W_o as the model stores it ([nH, D, H]), as [nH D, H] and as [H, nH D].
Why `twell_jax.serving` uses the layout it does (docs/performance_notes.md,
"Generation").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from experiments import bench_util as bu

LAYERS = 8
H, HEADS, HEAD_DIM = 2048, 32, 64


def _weight(shape: tuple[int, ...], seed: int) -> jax.Array:
    return (0.02 * jax.random.normal(jax.random.key(seed), shape)).astype(jnp.bfloat16)


def _layouts() -> dict:
    """name -> (per-layer weights, product of x [M, H] and one layer's weights)."""
    n, d, L = HEADS, HEAD_DIM, LAYERS
    three = lambda shape: [[_weight(shape, 3 * i + t) for t in range(3)] for i in range(L)]
    each = lambda shape: [_weight(shape, i) for i in range(L)]
    qkv_hnd = lambda x, ws: [jnp.einsum("bh,hnd->bnd", x, w) for w in ws]
    o_ndh = lambda x, w: jnp.einsum("bnd,ndh->bh", x.reshape(-1, n, d), w)
    return {
        "qkv_einsum_hnd": (three((H, n, d)), qkv_hnd),
        "qkv_fused_t": (each((3 * n * d, H)), lambda x, w: x @ w.T),
        "qkv_fused": (each((H, 3 * n * d)), lambda x, w: x @ w),
        "qkv_three_t": (three((n * d, H)), lambda x, ws: [x @ w.T for w in ws]),
        "o_einsum_ndh": (each((n, d, H)), o_ndh),
        "o_2d": (each((n * d, H)), lambda x, w: x @ w),
        "o_2d_t": (each((H, n * d)), lambda x, w: x @ w.T),
    }  # fmt: skip


def run() -> dict:
    """ "<layout>_m<M>" -> {"busy_us_per_layer", "span_us_per_layer", "kernels"}."""
    res = {}
    for m in (1, 8):
        x = jax.random.normal(jax.random.key(0), (m, H), jnp.bfloat16)
        for name, (ws, product) in _layouts().items():
            fn = jax.jit(lambda x, ws, f=product: [f(x, w) for w in ws])
            rec = res[f"{name}_m{m}"] = bu.per_layer_profile(fn, x, ws, layers=LAYERS)
            print(m, name, round(rec["busy_us_per_layer"], 2), flush=True)
    return res


if __name__ == "__main__":
    bu.main_writing_cases(__doc__, run)
