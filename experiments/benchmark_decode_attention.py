r"""GPU time of a decode step's attention block: XLA's ops against the kernel's launches.

    python -m experiments.benchmark_decode_attention \
        --out=results/decode_attention_kernel_h200.json

One new token per row at the 1.5B shape (32 query and key / value heads of 64, a
768-slot cache, the rows at slot `slot`), `LAYERS` layers with their own caches per
call (so that they do not stay in L2): `pallas_kernels.decode_attention` with
impl="xla" (RoPE, cache update and masked softmax as XLA fuses them) and with the
kernel at several launches (block_t, warps, stages, min_programs; min_programs 1
keeps one program per row and head). Per layer: the GPU's busy time of one call
(`bench_util.call_timeline`) and each kernel's launches and mean µs
(`bench_util.kernel_times`). The calls do not donate the caches, so every case also
copies each layer's two caches (the `memcpy` kernels, the same in every case; a
decode step, which donates them, has none). Why `DecodeAttentionConfig` has the defaults it has
(docs/performance_notes.md, "Generation").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from experiments import bench_util as bu
from pallas_kernels.decode_attention import DecodeAttentionConfig, decode_attention

LAYERS = 8
T, HEADS, HEAD_DIM = 768, 32, 64
BATCHES = (1, 8)
SLOTS = (520, 760)
# (block_t, num_warps, num_stages, min_programs)
LAUNCHES = ((128, 4, 3, 1), (64, 4, 3, 1), (64, 4, 3, 256), (128, 4, 3, 256),
            (64, 4, 3, 512), (32, 4, 3, 512))  # fmt: skip


def _inputs(b: int, seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 3)
    qkv = jax.random.normal(keys[0], (LAYERS, b, 3 * HEADS * HEAD_DIM), jnp.bfloat16)
    angles = jax.random.uniform(keys[1], (b, HEAD_DIM // 2), maxval=6.0)
    shape = (b, T, HEADS, HEAD_DIM)
    caches = tuple(
        jax.random.normal(k, shape, jnp.bfloat16) for k in jax.random.split(keys[2], LAYERS)
    )
    return qkv, jnp.cos(angles), jnp.sin(angles), caches


def run() -> dict:
    """ "b<B>_slot<S>_<impl or launch>" -> {"busy_us_per_layer", "span_us_per_layer",
    "kernels"}."""
    res = {}
    for b in BATCHES:
        qkv, cos, sin, caches = _inputs(b)
        pad = jnp.zeros((b,), jnp.int32)
        for slot in SLOTS:
            print("rows", b, "slot", slot, flush=True)
            cases = bu.attention_launches(
                decode_attention, DecodeAttentionConfig, LAUNCHES, "t{}_w{}_s{}_p{}",
                qkv, cos, sin, caches, caches, jnp.int32(slot), pad, n_heads=HEADS,
            )  # fmt: skip
            res.update({f"b{b}_slot{slot}_{name}": rec for name, rec in cases.items()})
    return res


if __name__ == "__main__":
    bu.main_writing_cases(__doc__, run)
