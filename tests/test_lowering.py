"""The CUDA cross-lowering helper: a kernel past the H200's shared memory lowers (the
Triton IR is valid), and fails to compile where the jax CUDA plugin lets it compile."""

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from tests import lowering


def _matmul_in_one_block(a, b):
    """One program holding [512, 2048] and [2048, 512] fp32 blocks: 4 MiB of shared
    memory for the dot's operands, where the H200 has 227 KiB per block."""

    def kernel(a_ref, b_ref, o_ref):
        o_ref[...] = jnp.dot(a_ref[...], b_ref[...], preferred_element_type=jnp.float32)

    out = jax.ShapeDtypeStruct((a.shape[0], b.shape[1]), jnp.float32)
    params = plgpu.CompilerParams(num_warps=4, num_stages=1)
    return pl.pallas_call(kernel, out_shape=out, compiler_params=params)(a, b)


ARGS = (jnp.zeros((512, 2048), jnp.float32), jnp.zeros((2048, 512), jnp.float32))


@pytest.mark.skipif(lowering._compile_only_h200() is not None, reason="compiles here")
def test_lowering_alone_accepts_a_kernel_past_shared_memory():
    assert lowering.count_triton_calls(_matmul_in_one_block, *ARGS) == 1


@pytest.mark.skipif(lowering._compile_only_h200() is None, reason="needs the jax CUDA plugin")
def test_compiling_rejects_a_kernel_past_shared_memory():
    with pytest.raises(Exception, match="Shared memory size limit exceeded"):
        lowering.lower_for_cuda(_matmul_in_one_block, *ARGS)
