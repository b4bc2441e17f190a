"""Cross-lowering of jitted functions to CUDA on a CPU-only jaxlib.

Interpret mode accepts Pallas code that the Triton lowering rejects; lowering for
"cuda" under an abstract CUDA mesh runs the real Pallas -> Triton IR path and raises
the errors the GPU would. It cannot catch Triton compiler errors (shared memory or
registers past the device's limits). Where the jax CUDA plugin is installed (no GPU
needed), the functions are also compiled, Triton kernels to cubin included, for the
H200 of `experiments/configs/h200.gpu_target.txtpb` on the plugin's compile-only
devices, which does catch them (TWELL_LOWER_ONLY=1: lower only).
"""

import functools
import os

import jax
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

from experiments.plan_train_memory import TARGET, cuda_plugin

TRITON_CALL = "__gpu$xla.gpu.triton"


@functools.cache
def _compile_only_h200():
    """A one-device mesh of the CUDA plugin's compile-only H200, or None without the
    plugin (or with TWELL_LOWER_ONLY=1)."""
    if os.environ.get("TWELL_LOWER_ONLY") == "1" or cuda_plugin() is None:
        return None
    from jax.experimental import topologies

    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    topology = topologies.get_topology_desc(
        "h200", "cuda", target_config=TARGET.read_text(), topology="1x1x1"
    )
    return jax.sharding.Mesh(topology.devices, ("x",))


def lower_for_cuda(fn, *args) -> str:
    """Lowers `jax.jit(fn)` for CUDA on abstract args; returns the StableHLO text.
    Compiles it too where the CUDA plugin is installed (module docstring)."""
    mesh = _compile_only_h200()
    if mesh is not None:
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated) for a in args]
        with jax.set_mesh(mesh):
            lowered = jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",))
            lowered.compile()
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


def count_triton_calls(fn, *args) -> int:
    """Number of Triton kernels in the CUDA lowering of `fn`."""
    return lower_for_cuda(fn, *args).count(TRITON_CALL)
