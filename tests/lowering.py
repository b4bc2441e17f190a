"""Cross-lowering of jitted functions to CUDA on a CPU-only jaxlib.

Interpret mode accepts Pallas code that the Triton lowering rejects; lowering for
"cuda" under an abstract CUDA mesh runs the real Pallas -> Triton IR path and raises
the errors the GPU would (it cannot catch Triton compile errors such as shared memory
overflow; those need the GPU run).
"""

import jax
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

TRITON_CALL = "__gpu$xla.gpu.triton"


def lower_for_cuda(fn, *args) -> str:
    """Lowers `jax.jit(fn)` for CUDA on abstract args; returns the StableHLO text."""
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
    mesh = AbstractMesh(
        (1,),
        ("x",),
        (AxisType.Explicit,),
        abstract_device=AbstractDevice("NVIDIA H100", 1, "cuda"),
    )
    with use_abstract_mesh(mesh):
        return jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()


def count_triton_calls(fn, *args) -> int:
    """Number of Triton kernels in the CUDA lowering of `fn`."""
    return lower_for_cuda(fn, *args).count(TRITON_CALL)
