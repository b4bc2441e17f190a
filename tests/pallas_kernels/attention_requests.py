"""Checks that both attention ops (`prompt_attention`, `decode_attention`) share: the
requests they must refuse with a ValueError naming what is wrong."""

import jax.numpy as jnp
import pytest


def assert_refuses_unsupported_requests(op, make_args):
    """op(*make_args(...), n_heads=..., impl=...) raises for a head count that is not a
    multiple of the key / value heads, an unknown impl, a kernel impl on fp32 and a
    head size the kernel cannot run. make_args(dtype=, d=) builds valid operands of 4
    query and 2 key / value heads."""
    with pytest.raises(ValueError, match="n_heads=3"):
        op(*make_args(), n_heads=3)
    with pytest.raises(ValueError, match="impl="):
        op(*make_args(), n_heads=4, impl="cuda")
    with pytest.raises(ValueError, match="bf16 only"):
        op(*make_args(dtype=jnp.float32), n_heads=4, impl="interpret")
    with pytest.raises(ValueError, match="head_dim=24"):
        op(*make_args(d=24), n_heads=4, impl="interpret")
