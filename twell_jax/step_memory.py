"""Whether one train step can fit in device memory: a lower bound, checked before a run.

`model.seq_len` has no positional limit (the RoPE tables are computed for any length)
and no config rule bounds it; what does is memory. A step that cannot fit fails only
once it has compiled and starts to allocate (an out-of-memory error, or the host's OOM
killer on a CPU). `check_fits` refuses such a run up front instead, from a lower bound
of what one step must hold on each device:

- state: parameters, AdamW moments (the abstract train state, exact) and the fp32
  gradient accumulator, divided over the FSDP axis;
- logits: the fp32 [tokens, V] logits of one chunk of a micro-batch (the cross-entropy
  of `twell_jax.lm_loss` holds one `ce_chunk_tokens` chunk at a time);
- activations: what the backward pass needs at least per token and layer, the layer's
  input, the attention's queries and output (3 H) and the FFN's pre-activations (2 N
  gated, N plain ReLU), in the compute dtype, for every layer; with `model.remat` only
  the layer inputs (H) of every layer plus one layer's full set;
- attention: XLA's attention (every backend but cuDNN on a GPU) materialises the
  [heads, S, S] probabilities of a layer; every layer's are kept for the backward,
  one layer's with remat.

A micro-batch is `batch_size / grad_accum_steps` sequences split over the mesh's
devices. Everything else (XLA's temporaries, the bf16 copies, the cuDNN workspace) comes
on top, so the bound is below what a step uses, and `check_fits` refuses only when it
exceeds `REFUSE_FACTOR` times the memory: a run it lets through can still run out, one
it refuses cannot fit. The memory is the device's `bytes_limit` where the backend
reports it (GPU, TPU); on a CPU, whose devices share the host, the host's physical
memory against the bound times the number of local devices.
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax
import numpy as np

from twell_jax import lm_loss, model, sharding, train
from twell_jax.config import TrainConfig

# Refuse when the lower bound exceeds the memory by this factor (see the docstring).
REFUSE_FACTOR = 1.5
GIB = 2**30


class StepMemoryError(ValueError):
    """One train step cannot fit in memory; the message has the numbers and the flags."""


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """Lower bounds of one train step's bytes on one device, by kind (module docstring)."""

    state: int
    logits: int
    activations: int
    attention: int
    rows: int  # sequences of one micro-batch on one device

    @property
    def total(self) -> int:
        return self.state + self.logits + self.activations + self.attention

    def describe(self) -> str:
        parts = {
            "attention probabilities": self.attention,
            "activations": self.activations,
            "logits": self.logits,
            "parameters + optimizer state": self.state,
        }
        ordered = sorted(parts.items(), key=lambda kv: -kv[1])
        return ", ".join(f"{name} {_size(n)}" for name, n in ordered)


def _size(n: int) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / 2**20:.0f} MiB"


def _state_bytes(cfg: TrainConfig) -> tuple[int, int]:
    """(train state, parameters) bytes, unsharded: shapes only, nothing is allocated."""
    one_device = sharding.make_mesh(1, 1, devices=jax.devices()[:1])
    abstract = train.abstract_train_state(cfg, one_device)

    def nbytes(tree) -> int:
        return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))

    return nbytes(abstract), nbytes(abstract.params)


def estimate(
    cfg: TrainConfig, devices: int, fsdp: int = 1, cudnn: bool | None = None
) -> StepMemory:
    """Lower bounds of one train step's memory on each of `devices` devices.

    Args:
      cfg: the run config.
      devices: devices of the mesh (the batch is split over all of them).
      fsdp: size of the mesh's FSDP axis (the state is split over it).
      cudnn: whether attention runs on cuDNN (no [S, S] probabilities); None asks
        `twell_jax.model.attention_implementation` for this backend.
    """
    m = cfg.model
    if cudnn is None:
        cudnn = model.attention_implementation(m.compute_dtype, m.head_dim) == "cudnn"
    state, params = _state_bytes(cfg)
    micro = cfg.batch_size // cfg.optim.grad_accum_steps
    rows = -(-micro // devices)
    tokens = rows * m.seq_len
    itemsize = m.compute_dtype.itemsize
    full_layer = tokens * (3 * m.d_model + (2 if m.gated else 1) * m.d_ff) * itemsize
    probs = 0 if cudnn else rows * m.n_heads * m.seq_len**2 * itemsize
    if m.remat:
        activations = m.n_layers * tokens * m.d_model * itemsize + full_layer
        attention = probs
    else:
        activations, attention = m.n_layers * full_layer, m.n_layers * probs
    return StepMemory(
        state=-(-(state + params) // fsdp),  # + the gradient accumulator, like the params
        logits=rows * lm_loss.seq_chunk(rows, m.seq_len, cfg.ce_chunk_tokens) * m.vocab_size * 4,
        activations=activations,
        attention=attention,
        rows=rows,
    )


def available_memory() -> tuple[int, int, str] | None:
    """(bytes, devices sharing them, what) of this process's memory, or None if unknown.

    A device's `bytes_limit` where the backend reports one; else (CPU) the host's
    physical memory, shared by every local device.
    """
    device = jax.local_devices()[0]
    stats = device.memory_stats() or {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), 1, f"each {device.device_kind} device"
    try:
        host = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None
    return host, jax.local_device_count(), "the host"


def check_fits(
    cfg: TrainConfig, mesh: jax.sharding.Mesh, memory: tuple[int, int, str] | None = None
) -> StepMemory:
    """Refuses a config whose train step clearly cannot fit (module docstring).

    Args:
      cfg: the run config.
      mesh: the run's mesh (from `sharding.make_mesh`).
      memory: (bytes, devices sharing them, what) for tests; default `available_memory()`.

    Returns:
      The estimate (per device).

    Raises:
      StepMemoryError: the lower bound exceeds REFUSE_FACTOR times the memory; the
        message gives both, the parts of the bound and the flags that shrink it.
    """
    est = estimate(cfg, mesh.size, mesh.shape[sharding.FSDP_AXIS])
    memory = available_memory() if memory is None else memory
    if memory is None:
        return est
    limit, sharing, where = memory
    need = est.total * sharing
    if need <= REFUSE_FACTOR * limit:
        return est
    m = cfg.model
    fixes = ["lower --seq_len or --batch_size", "raise --grad_accum_steps"]
    if not m.remat:
        fixes.append("turn on --remat")
    fixes.append("use more devices")
    shared = f" ({sharing} devices x {_size(est.total)})" if sharing > 1 else ""
    raise StepMemoryError(
        f"model.seq_len={m.seq_len}, batch_size={cfg.batch_size}, "
        f"grad_accum_steps={cfg.optim.grad_accum_steps}: one train step needs at least "
        f"{_size(need)}{shared} but {where} has {_size(limit)}. Per device, "
        f"for a micro-batch of {est.rows} x {m.seq_len} tokens: {est.describe()}. "
        f"To fit: {', '.join(fixes)}"
    )
