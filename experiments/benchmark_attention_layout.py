"""GPU time of a decode step's attention projections in several weight layouts.

    python -m experiments.benchmark_attention_layout --out=results/attention_layout_decode_h200.json

One token (M = 1), eight or 64 times the attention weights of the 1.5B / 2B shape
(H 2048, 32 heads of 64), 8 layers with their own weights per call (so that the
weights do not stay in L2), each layout jitted alone; per layer: the GPU's busy time
of one call (`bench_util.call_timeline`) and each kernel's launches and mean µs
(`bench_util.kernel_times`). Layouts: q / k / v as the model stores them ([H, nH, D],
three einsums), stacked into one matrix with H last or first, or three matrices with
H last; W_o as the model stores it ([nH, D, H]), as [nH D, H] and as [H, nH D].
Why `twell_jax.serving` uses the layout it does (docs/performance_notes.md,
"Generation"). With the attention norm, for the stacked matrix: XLA's RMSNorm then
the product (as generation ran it before), and `pallas_kernels.normed_projection`
(norm and product in one kernel, the norm's scale folded into the weight) at its
default launch and at those of `PROJECTION_LAUNCHES` (up to its MAX_ROWS tokens).
There each layer has its own x
(with one x, XLA batches the layers' products into fewer, larger GEMMs).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from experiments import bench_util as bu
from pallas_kernels.normed_projection import MAX_ROWS, ProjectionConfig, normed_projection

LAYERS = 8
H, HEADS, HEAD_DIM = 2048, 32, 64
TOKENS = (1, 8, 64)
PROJECTION_LAUNCHES = {
    "block_n32": ProjectionConfig(block_n=32),
    "block_k128_stages6": ProjectionConfig(block_k=128, num_stages=6),
    "block_k512_stages3": ProjectionConfig(block_k=512, num_stages=3),
    "warps8": ProjectionConfig(num_warps=8),
}


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


def _normed_products() -> dict:
    """name -> product of one layer's x [M, H] and stacked [3 nH D, H] weight, normed."""
    scale = 1 + 0.1 * jax.random.normal(jax.random.key(1), (H,))

    def norm_then_product(x, w):
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-5)
        return (normed * scale).astype(x.dtype) @ w.T

    kernel = lambda cfg: lambda x, w: normed_projection(x, w, eps=1e-5, config=cfg)
    launches = {"": None} | {f"_{k}": v for k, v in PROJECTION_LAUNCHES.items()}
    kernels = {f"qkv_norm_kernel{name}": kernel(cfg) for name, cfg in launches.items()}
    return {"qkv_norm_xla": norm_then_product} | kernels


def run() -> dict:
    """ "<layout>_m<M>" -> {"busy_us_per_layer", "span_us_per_layer", "kernels"}."""
    res = {}
    wqkv = [_weight((3 * HEADS * HEAD_DIM, H), i) for i in range(LAYERS)]
    for m in TOKENS:
        x = jax.random.normal(jax.random.key(0), (m, H), jnp.bfloat16)
        for name, (ws, product) in _layouts().items():
            fn = jax.jit(lambda x, ws, f=product: [f(x, w) for w in ws])
            rec = res[f"{name}_m{m}"] = bu.per_layer_profile(fn, x, ws, layers=LAYERS)
            print(m, name, round(rec["busy_us_per_layer"], 2), flush=True)
        keys = jax.random.split(jax.random.key(2), LAYERS)
        xs = [jax.random.normal(k, (m, H), jnp.bfloat16) for k in keys]
        for name, product in _normed_products().items():
            if m > MAX_ROWS and "kernel" in name:  # "auto" would time XLA's ops instead
                continue
            fn = jax.jit(lambda xs, ws, f=product: [f(x, w) for x, w in zip(xs, ws, strict=True)])
            rec = res[f"{name}_m{m}"] = bu.per_layer_profile(fn, xs, wqkv, layers=LAYERS)
            print(m, name, round(rec["busy_us_per_layer"], 2), flush=True)
    return res


if __name__ == "__main__":
    bu.main_writing_cases(__doc__, run)
