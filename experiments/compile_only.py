"""GPU devices to compile for on a machine without a GPU: the jax CUDA plugin's
compile-only devices for a `GpuTargetConfigProto` (`experiments/configs/*.txtpb`).

Used by `experiments.plan_train_memory` and by the CUDA cross-lowering tests
(`tests/lowering.py`). Needs `jax[cuda12]` (the plugin and its CUDA wheels: ptxas
compiles the Triton kernels), no GPU; run with JAX_PLATFORMS=cpu where there is none,
so that the plugin does not look for one at start-up.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import pathlib

H200 = pathlib.Path(__file__).resolve().parent / "configs" / "h200.gpu_target.txtpb"


def cuda_plugin() -> str | None:
    """The installed jax CUDA plugin's module name, or None."""
    for name in ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13"):
        with contextlib.suppress(ModuleNotFoundError):
            if importlib.util.find_spec(name) is not None:
                return name
    return None


def install_hint() -> str:
    """The pip command that brings the plugin for this jax."""
    return f"pip install 'jax[cuda12]=={importlib.metadata.version('jax')}'"


def devices(target_config: str, count: int = 1) -> list:
    """`count` compile-only GPUs of one host, as `target_config` (the proto's text)
    describes them."""
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(
        "compile_only", "cuda", target_config=target_config, topology=f"1x1x{count}"
    )
    return list(topology.devices)


@contextlib.contextmanager
def gpu_code_paths():
    """The model and the kernels pick cuDNN attention and the Triton kernels from the
    default backend, which is the CPU here while the code compiles for the GPU."""
    import jax

    default_backend = jax.default_backend
    jax.default_backend = lambda: "gpu"
    try:
        yield
    finally:
        jax.default_backend = default_backend
