"""Mesh construction, the FSDP PartitionSpec rule, and the kernel FFN per batch shard."""

import jax
import pytest
from jax.sharding import PartitionSpec as P

from twell_jax import sharding


def test_param_spec_rule():
    key = jax.tree_util.DictKey
    assert sharding.param_spec((key("embed"),), (512, 128), 4) == P("fsdp", None)
    assert sharding.param_spec((key("embed"),), (510, 128), 4) == P(None, "fsdp")
    assert sharding.param_spec((key("embed"),), (510, 127), 4) == P()
    assert sharding.param_spec((key("embed"),), (512, 128), 1) == P()
    # Stacked layer axis first: never split, even when it is the largest.
    stacked = (key("blocks"), key("ffn"), key("w_up"))
    assert sharding.param_spec(stacked, (1024, 256, 64), 4) == P(None, "fsdp", None)
    assert sharding.param_spec((key("step"),), (), 4) == P()


def test_make_mesh_sizes():
    n = jax.device_count()
    assert sharding.make_mesh().shape == {"data": n, "fsdp": 1}
    assert sharding.make_mesh(1, -1).shape == {"data": 1, "fsdp": n}
    with pytest.raises(ValueError, match="does not fit"):
        sharding.make_mesh(n + 1, 1)


def test_sparse_ffn_per_batch_shard_lowers_for_cuda(monkeypatch):
    """The sparse training op's forward and backward in shard_map over a 2-GPU batch
    mesh lower to its six Triton kernels (a Pallas call's outputs carry no varying-axes
    type: with shard_map's check on, tracing fails)."""
    import jax.numpy as jnp
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

    from pallas_kernels import _triton
    from tests.lowering import TRITON_CALL
    from twell_jax import ffn

    monkeypatch.setattr(_triton, "on_gpu", lambda: True)  # the kernels, not the interpreter
    mesh = AbstractMesh(
        (2, 1),
        sharding.MESH_AXES,
        (AxisType.Auto,) * 2,
        abstract_device=AbstractDevice("NVIDIA H100", 2, "cuda"),
    )
    x = jax.ShapeDtypeStruct((256, 128), jnp.bfloat16)
    w = {k: jax.ShapeDtypeStruct((512, 128), jnp.bfloat16) for k in ("w_gate", "w_up", "w_down")}

    def loss(x, w):
        out, stats = ffn.per_batch_shard(lambda x, w: ffn.sparse(x, w, 128))(x, w)
        return jnp.sum(out.astype(jnp.float32)) + stats["l1"]

    with use_abstract_mesh(mesh):
        lowered = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(x, w)
        txt = lowered.lower(lowering_platforms=("cuda",)).as_text()
    assert txt.count(TRITON_CALL) == 6 and "manual_computation" in txt
