"""Mesh construction and the FSDP PartitionSpec rule."""

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
