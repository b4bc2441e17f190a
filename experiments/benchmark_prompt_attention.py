r"""GPU time of a prefill's attention: XLA's ops against the prompt kernel's launches.

    python -m experiments.benchmark_prompt_attention \
        --out=results/prompt_attention_kernel_h200.json

Prompts at the 1.5B shape (32 query and key / value heads of 64), 8 rows of 512
tokens and 1 row of 2048, each with 256 more cache slots for the new tokens, the
rows left-padded by up to 64 tokens; `LAYERS` layers with their own caches per call:
`pallas_kernels.prompt_attention` with impl="xla" (RoPE, cache update and masked
softmax over the whole cache as XLA fuses them) and with the kernel at several
launches (block_q, block_k, warps, stages). Per layer: the GPU's busy time of one
call (`bench_util.call_timeline`) and each kernel's launches and mean µs
(`bench_util.kernel_times`). Why `PromptAttentionConfig` has the defaults it has
(docs/performance_notes.md, "Generation").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from experiments import bench_util as bu
from pallas_kernels.prompt_attention import PromptAttentionConfig, prompt_attention

LAYERS = 8
HEADS, HEAD_DIM, NEW_TOKENS, MAX_PAD = 32, 64, 256, 64
PROMPTS = ((8, 512), (1, 2048))  # (rows, tokens)
# (block_q, block_k, num_warps, num_stages); the first is the default.
LAUNCHES = ((128, 64, 8, 2), (128, 64, 4, 2), (128, 64, 4, 3), (128, 64, 8, 3),
            (128, 128, 8, 2), (128, 32, 4, 3), (64, 64, 4, 2), (64, 64, 4, 3),
            (64, 32, 4, 3), (64, 64, 8, 2))  # fmt: skip


def _inputs(b: int, s: int, seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 4)
    qkv = jax.random.normal(keys[0], (LAYERS, b, s, 3 * HEADS * HEAD_DIM), jnp.bfloat16)
    angles = jax.random.uniform(keys[1], (s, HEAD_DIM // 2), maxval=6.0)
    shape = (b, s + NEW_TOKENS, HEADS, HEAD_DIM)
    caches = tuple(jnp.zeros(shape, jnp.bfloat16) for _ in range(LAYERS))
    pad = jax.random.randint(keys[2], (b,), 0, MAX_PAD + 1, jnp.int32)
    return qkv, jnp.cos(angles), jnp.sin(angles), caches, pad


def run() -> dict:
    """ "b<B>_s<S>_<xla or launch>" -> {"busy_us_per_layer", "span_us_per_layer",
    "kernels"}."""
    res = {}
    for b, s in PROMPTS:
        qkv, cos, sin, caches, pad = _inputs(b, s)
        print("rows", b, "tokens", s, flush=True)
        cases = bu.attention_launches(
            prompt_attention, PromptAttentionConfig, LAUNCHES, "q{}_k{}_w{}_s{}",
            qkv, cos, sin, caches, caches, pad, n_heads=HEADS,
        )  # fmt: skip
        res.update({f"b{b}_s{s}_{name}": rec for name, rec in cases.items()})
    return res


if __name__ == "__main__":
    bu.main_writing_cases(__doc__, run)
