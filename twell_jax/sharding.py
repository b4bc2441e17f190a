"""Device mesh, PartitionSpecs and the per-batch-shard wrapper of the Pallas FFNs.

One layout for 1 CPU, N simulated CPUs, 1 GPU and many GPUs: a 2-D device mesh
(`DATA_AXIS`, `FSDP_AXIS`); the batch dimension is split over both axes; parameters and
optimizer state are split FSDP-style over `FSDP_AXIS` (largest divisible dimension, never
the stacked layer axis) and replicated over `DATA_AXIS`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DATA_AXIS = "data"
FSDP_AXIS = "fsdp"
MESH_AXES = (DATA_AXIS, FSDP_AXIS)
# Mesh axes the batch dimension is split over.
BATCH_AXES = MESH_AXES
# Parameter subtree whose leaves carry a leading [L] axis (scanned, never sharded).
STACKED = "blocks"


def make_mesh(data: int = -1, fsdp: int = 1, devices: list | None = None) -> Mesh:
    """Device mesh with axes `MESH_AXES`.

    Args:
      data, fsdp: axis sizes; one may be -1 to take all remaining devices.
      devices: defaults to all of `jax.devices()`.

    Raises:
      ValueError: the sizes do not multiply to the device count.
    """
    devices = list(jax.devices() if devices is None else devices)
    if data == -1:
        data = len(devices) // fsdp
    elif fsdp == -1:
        fsdp = len(devices) // data
    if data * fsdp != len(devices) or data < 1 or fsdp < 1:
        raise ValueError(f"mesh (data={data}, fsdp={fsdp}) does not fit {len(devices)} devices")
    # Auto axes: the partitioner propagates shardings; no sharding-in-types rules.
    return jax.make_mesh((data, fsdp), MESH_AXES, (AxisType.Auto, AxisType.Auto), devices=devices)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """[B, S] batches: B split over data x fsdp."""
    return NamedSharding(mesh, P(BATCH_AXES))


def param_spec(path: tuple, shape: tuple[int, ...], fsdp_size: int) -> P:
    """FSDP rule: split the largest dimension divisible by the fsdp size, else replicate.

    The leading [L] axis of stacked block parameters is excluded: `lax.scan` slices it,
    so sharding it would gather every layer at once.
    """
    keys = {getattr(k, "key", getattr(k, "name", None)) for k in path}
    first = 1 if STACKED in keys else 0
    dims = [d for d in range(first, len(shape)) if shape[d] % fsdp_size == 0]
    if fsdp_size == 1 or not dims:
        return P()
    best = max(dims, key=lambda d: shape[d])
    return P(*[(FSDP_AXIS if d == best else None) for d in range(len(shape))])


def tree_shardings(tree: Any, mesh: Mesh) -> Any:
    """NamedSharding of every leaf of a parameter-shaped tree, by `param_spec`."""
    fsdp = mesh.shape[FSDP_AXIS]
    return jax.tree_util.tree_map_with_path(
        lambda path, x: NamedSharding(mesh, param_spec(path, x.shape, fsdp)), tree
    )


def _batch_mesh() -> jax.sharding.AbstractMesh | None:
    """The mesh in context if it has the batch axes, else None (single-device code)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not set(BATCH_AXES) <= set(mesh.axis_names):
        return None
    return mesh


def batch_shards() -> int:
    """How many pieces the batch dimension is split into under the mesh in context (1
    without a training mesh)."""
    mesh = _batch_mesh()
    return 1 if mesh is None else math.prod(mesh.shape[a] for a in BATCH_AXES)


def constrain_batch(x: jax.Array) -> jax.Array:
    """Keeps activations split over the batch axes when traced under a training mesh.

    Without it the partitioner may follow the FSDP-sharded weights instead and
    shard activations along H, which costs an all-to-all per matmul.
    """
    if _batch_mesh() is None:
        return x
    return jax.lax.with_sharding_constraint(x, P(BATCH_AXES))


def per_batch_shard(fn: Callable, reductions: Mapping[str, Callable]) -> Callable:
    """Runs a kernel FFN `fn(x [M, H], w) -> (out, stats)` once per batch shard.

    XLA cannot partition a Pallas call, so under a multi-device mesh the kernels run in
    `shard_map`: tokens stay split over the batch axes, the weights are gathered whole
    (what FSDP does before every layer anyway) and each statistic is combined over the
    shards by `reductions[name](value, BATCH_AXES)` (e.g. `jax.lax.psum`). Without such a
    mesh in context, `fn` itself.
    """
    mesh = _batch_mesh()
    if mesh is None or mesh.size == 1:
        return fn

    def per_shard(x, w):
        out, stats = fn(x, w)
        return out, {k: reductions[k](v, BATCH_AXES) for k, v in stats.items()}

    # check_vma=False: a Pallas call's outputs carry no varying-axes type, which the
    # check demands of every value made inside shard_map. The reductions above do
    # what the check guards.
    return jax.shard_map(
        per_shard, in_specs=(P(BATCH_AXES), P()), out_specs=(P(BATCH_AXES), P()), check_vma=False
    )


def with_mesh(fn: Callable, mesh: Mesh) -> Callable:
    """Calls the jitted `fn` with `mesh` set, so the model's sharding constraints see it.

    The wrapper's `.lower(*args)` lowers `fn` under the mesh too (for
    `.compile().memory_analysis()`, say).
    """

    def wrapped(*args):
        with jax.set_mesh(mesh):
            return fn(*args)

    def lower(*args):
        with jax.set_mesh(mesh):
            return fn.lower(*args)

    wrapped.lower = lower
    return wrapped
