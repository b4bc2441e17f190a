"""Cross-lowering of jitted functions to CUDA on a CPU-only jaxlib.

Interpret mode accepts Pallas code that the Triton lowering rejects; lowering for
"cuda" under an abstract CUDA mesh runs the real Pallas -> Triton IR path and raises
the errors the GPU would. It cannot catch Triton compiler errors (shared memory or
registers past the device's limits). Where the jax CUDA plugin is installed (no GPU
needed; `experiments.compile_only`), the functions are also compiled, Triton kernels
to cubin included, for an H200 on the plugin's compile-only devices, which does catch
them (TWELL_LOWER_ONLY=1: lower only).
"""

import functools
import os

import jax
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

from experiments import compile_only

TRITON_CALL = "__gpu$xla.gpu.triton"


@functools.cache
def _compile_only_h200():
    """A one-device mesh of the CUDA plugin's compile-only H200, or None without the
    plugin (or with TWELL_LOWER_ONLY=1)."""
    if os.environ.get("TWELL_LOWER_ONLY") == "1" or compile_only.cuda_plugin() is None:
        return None
    return jax.sharding.Mesh(compile_only.devices(compile_only.H200.read_text()), ("x",))


def lower_for_cuda(fn, *args) -> str:
    """Lowers `jax.jit(fn)` for CUDA on abstract args; returns the StableHLO text.
    Compiles it too where the CUDA plugin is installed (module docstring)."""
    mesh = _compile_only_h200()
    if mesh is not None:
        lowered, _ = _compile_for_h200(mesh, fn, args)
        return lowered.as_text()
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
    mesh = AbstractMesh(
        (1,),
        ("x",),
        (AxisType.Explicit,),
        abstract_device=AbstractDevice("NVIDIA H100", 1, "cuda"),
    )
    with use_abstract_mesh(mesh):
        return jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()


def _compile_for_h200(mesh, fn, args):
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated) for a in args]
    with jax.set_mesh(mesh):
        lowered = jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",))
        return lowered, lowered.compile()


def compiled_hlo_for_h200(fn, *args) -> str:
    """XLA's optimized HLO of `jax.jit(fn)` compiled for the compile-only H200: the
    fusions and copies its plan runs. Needs the CUDA plugin (`_compile_only_h200`)."""
    mesh = _compile_only_h200()
    if mesh is None:
        raise RuntimeError("compiled_hlo_for_h200 needs the jax CUDA plugin")
    return _compile_for_h200(mesh, fn, args)[1].as_text()


def count_triton_calls(fn, *args) -> int:
    """Number of Triton kernels in the CUDA lowering of `fn`."""
    return lower_for_cuda(fn, *args).count(TRITON_CALL)
