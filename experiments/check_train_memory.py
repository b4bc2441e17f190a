"""Compiled temporary memory of the sparse and dense training MLP steps, and the
sparse op's dense fallback at the production shape (GPU).

    python -m experiments.check_train_memory

M=16384, H=2048, N=5632, ~29 non-zeros per row. Prints XLA's temp allocation of each
value_and_grad step, then forces the dense fallback (3000 rows with ~N/2 positives:
more than the largest tail bucket) and compares the loss and gradients with the dense
step's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from experiments import benchmark_train as bt
from pallas_kernels.sparse_train import SparseTrainConfig


def _rel(a: jax.Array, b: jax.Array) -> float:
    a, b = a.astype(jnp.float32).ravel(), b.astype(jnp.float32).ravel()
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def main() -> None:
    m, h, n = 16384, 2048, 5632
    sparse = jax.jit(
        jax.value_and_grad(
            functools.partial(bt._sparse_loss, config=SparseTrainConfig()),
            argnums=(0, 1, 2, 3),
            has_aux=True,
        )
    )
    dense = jax.jit(jax.value_and_grad(bt._dense_loss, argnums=(0, 1, 2, 3)))
    args = bt.synthetic_inputs(1, m, h, n, 29.0)
    for name, step in (("sparse", sparse), ("dense", dense)):
        temp = step.lower(*args).compile().memory_analysis().temp_size_in_bytes
        print(f"{name} temp MB {temp / 2**20:.1f}", flush=True)
    heavy = bt.synthetic_inputs(2, m, h, n, 29.0, heavy_rows=3000)
    (loss, stats), grads = sparse(*heavy)
    loss_d, grads_d = dense(*heavy)
    errs = [round(_rel(a, b), 5) for a, b in zip(grads, grads_d, strict=True)]
    print(
        f"heavy: fallback {int(stats['dense_fallback'])} tail_rows {int(stats['tail_rows'])} "
        f"loss {float(loss)} {float(loss_d)} grad rel (dx, dWg, dWu, dWd) {errs}"
    )


if __name__ == "__main__":
    main()
