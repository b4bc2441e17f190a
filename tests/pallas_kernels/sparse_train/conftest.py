"""The `verified_modules` fixture of the CUDA cross-lowering tests."""

import pytest


@pytest.fixture
def verified_modules(monkeypatch):
    """Runs the MLIR verifier on every Triton module the Pallas lowering builds.

    The lowering serialises the module without verifying it, so operand shape or type
    mismatches would otherwise surface only in the GPU compiler. Uses a private jax
    hook (0.11.2); returns the list of verified modules' names.
    """
    from jax._src.pallas.triton import lowering as triton_lowering

    lower = triton_lowering.lower_jaxpr_to_triton_module
    seen = []

    def lower_and_verify(*args, **kwargs):
        result = lower(*args, **kwargs)
        assert result.module.operation.verify()
        seen.append(str(result.module.operation.attributes["sym_name"]))
        return result

    monkeypatch.setattr(triton_lowering, "lower_jaxpr_to_triton_module", lower_and_verify)
    return seen
