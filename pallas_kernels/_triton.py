"""The one module that touches the Pallas Triton backend.

The Triton backend is deprecated since jax 0.11 (it still works in 0.11.2). Keeping
its imports and compiler parameters here means a later move to Mosaic GPU or
jax_triton touches one file.
"""

from __future__ import annotations

import warnings

# jax.experimental.pallas.fuser is imported for its side effect. Interpret mode imports
# it the first time a pallas_call runs, and it registers a config option that is part
# of jit's trace context; every function traced before that (the whole train step, say)
# then misses jit's cache on its next call and compiles a second time. Registering it
# here, before anything is traced, keeps one compile per function
# (tests/pallas_kernels/twell/test_op.py).
import jax
import jax.experimental.pallas.fuser
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

load = pltriton.load
store = pltriton.store


def compiler_params(num_warps: int, num_stages: int) -> pltriton.CompilerParams:
    """Triton launch parameters for one `pallas_call`."""
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): Triton values hold 2^k elements."""
    return 1 << max(n - 1, 0).bit_length()


# Shared memory a loop's pipelined bf16 tiles may take (of 227 KB per H100 / H200 SM).
PIPELINE_SMEM_BYTES = 160 * 1024


def fit_columns(columns: int, tile_rows: int, stages: int) -> int:
    """columns halved (not below 16) until `stages` pipelined bf16 [tile_rows, columns]
    tiles fit in PIPELINE_SMEM_BYTES."""
    while columns > 16 and stages * tile_rows * columns * 2 > PIPELINE_SMEM_BYTES:
        columns //= 2
    return columns


def iota(n: int) -> jax.Array:
    """int32 [n]: 0 .. n - 1 (inside a kernel)."""
    return lax.broadcasted_iota(jnp.int32, (n,), 0)


def is_pow2(v: int) -> bool:
    """Whether a launch size is a power of two (Triton block shapes must be)."""
    return v >= 1 and not v & (v - 1)


def program_id(axis: int, size: int) -> jax.Array:
    """`pl.program_id(axis)` for a grid of `size` along that axis, as int32 in [0, size).

    The remainder is an identity at run time, but it tells LLVM the id's range. The
    Triton lowering adds it by itself only to grid axes past CUDA's 65535 limit, and
    the T2D SDDMM compiled without it took 1.8x as long per row at M <= 32768 (96
    registers instead of 126; docs/performance_notes.md, "T2D SDDMM and SpMM").
    """
    return lax.rem(pl.program_id(axis), jnp.int32(size))


def on_gpu() -> bool:
    """True when the default JAX backend is a CUDA GPU."""
    return jax.default_backend() == "gpu"


# The kernel-backed ops' backends: "pallas" (the kernel, bf16), "interpret" (the same
# kernel in the Pallas interpreter, for CPU tests), "xla" (the op in jnp: any dtype)
# and "auto" (pallas on a GPU for bf16 and supported shapes, xla otherwise).
IMPLS = ("auto", "pallas", "interpret", "xla")


def resolve_impl(impl: str, dtype, reason: str | None, operand: str) -> str:
    """The backend that `impl` runs for an op whose operand `operand` has `dtype`:
    "pallas", "interpret" or "xla". `reason` says why the kernel cannot run the
    operands' shapes (None: it can).

    Raises:
      ValueError: an unknown impl, or a kernel impl asked for a dtype other than bf16
        or a shape the kernel cannot run.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}: must be one of {IMPLS}")
    if impl == "auto":
        return "pallas" if on_gpu() and dtype == jnp.bfloat16 and reason is None else "xla"
    if impl != "xla" and dtype != jnp.bfloat16:
        raise ValueError(f"impl={impl!r} runs bf16 only, got {operand} of dtype {dtype}")
    if impl != "xla" and reason is not None:
        raise ValueError(f"impl={impl!r}: {reason}")
    return impl


def resolve_interpret(interpret: bool | None) -> bool:
    """`None` means: compile for the GPU when there is one, else interpret."""
    return (not on_gpu()) if interpret is None else bool(interpret)


def pallas_call(*args, **kwargs):
    """`pl.pallas_call` with the backend's deprecation warning silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Tt]riton.*", category=DeprecationWarning)
        return pl.pallas_call(*args, **kwargs)
