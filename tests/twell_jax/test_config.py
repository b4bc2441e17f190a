"""Config validation (the kernels' own shape rules), presets and dict round-trips."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

import pallas_kernels
from twell_jax import config as C
from twell_jax import config_io
from twell_jax import model as M


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (dict(d_model=100, n_heads=3), "d_model"),
        (dict(d_ff=500, ffn_impl="twell"), "ffn_impl='twell': the TwELL kernels reject .*d_ff=500"),
        (
            dict(d_ff=500, ffn_impl="sparse"),
            "ffn_impl='sparse': the sparse kernels reject .*d_ff=500",
        ),
        (dict(d_model=96, n_heads=2, ffn_impl="twell"), "ffn_impl='twell': .*d_model=96"),
        (dict(ffn_variant="gated_silu", ffn_impl="twell"), "ffn_impl"),
        (dict(ffn_variant="relu", ffn_impl="sparse"), "ffn_impl"),
        (dict(ffn_impl="twell", dtype="float32"), "dtype"),
        (dict(ffn_variant="swiglu"), "ffn_variant"),
        (dict(ffn_impl="cuda"), "ffn_impl"),
        (dict(twell_compression=16, ffn_impl="twell"), "ffn_impl='twell': .*twell_compression=16"),
        (dict(sparse_ell_width=2), "sparse_ell_width=2: "),
        (dict(n_layers=0), "n_layers"),
        (dict(d_model=96, n_heads=32), "n_heads"),  # head_dim 3: odd, no RoPE pairs
        (dict(rope_theta=float("inf")), "rope_theta=inf: must be > 0 and finite"),
        (dict(rope_theta=float("nan")), "rope_theta=nan: must be > 0"),
        (dict(rope_theta=0.0), "rope_theta=0.0: must be > 0"),
        (dict(rope_theta=-1e4), r"rope_theta=-10000.0: must be > 0"),
        (dict(norm_eps=float("inf")), "norm_eps=inf: must be > 0 and finite"),
    ],
)
def test_model_config_validation(overrides, field):
    with pytest.raises(ValueError, match=rf"ModelConfig\.{field}"):
        C.ModelConfig(**overrides)


def test_dense_allows_any_d_ff():
    assert C.ModelConfig(d_ff=500).d_ff == 500


def test_train_config_validation():
    with pytest.raises(ValueError, match=r"TrainConfig\.batch_size="):
        C.TrainConfig(batch_size=6, optim=C.OptimConfig(grad_accum_steps=4))
    with pytest.raises(ValueError, match=r"OptimConfig\.warmup_steps="):
        C.OptimConfig(warmup_steps=10, total_steps=10)
    with pytest.raises(ValueError, match=r"SparsityConfig\.l1_target="):
        C.SparsityConfig(l1_target="gradients")
    with pytest.raises(ValueError, match=r"TrainConfig\.mesh_shape="):
        C.TrainConfig(mesh_shape=(-1, -1))
    # Values a run would only fail on later: the data order's 32-bit seed, and
    # non-finite rates that make it diverge at once.
    for seed in (-1, 2**32):
        with pytest.raises(ValueError, match=rf"TrainConfig\.seed={seed}: must be in"):
            C.TrainConfig(seed=seed)
    with pytest.raises(ValueError, match=r"OptimConfig\.lr=inf: must be > 0 and finite"):
        C.OptimConfig(lr=float("inf"))
    with pytest.raises(ValueError, match=r"OptimConfig\.weight_decay=nan: must be >= 0"):
        C.OptimConfig(weight_decay=float("nan"))
    with pytest.raises(ValueError, match=r"SparsityConfig\.l1_coef=inf: must be >= 0 and fin"):
        C.SparsityConfig(l1_coef=float("inf"))


@pytest.mark.parametrize(
    ("name", "params"), [("0.5b", 0.512e9), ("1b", 1.026e9), ("1.5b", 1.539e9), ("2b", 2.053e9)]
)
def test_paper_presets_parameter_counts(name, params):
    """Parameter counts of the paper sizes (docs/design.md §7)."""
    cfg = C.model_preset(name)
    shapes = nnx.state(nnx.eval_shape(lambda: M.Transformer(cfg, rngs=nnx.Rngs(0))))
    count = sum(np.prod(x.shape) for x in jax.tree.leaves(shapes))
    assert abs(count - params) / params < 1e-3


def test_presets_are_valid():
    for name in ("tiny", "125m", "0.5b", "1b", "1.5b", "2b"):
        cfg = C.train_preset(name)
        m = cfg.model
        assert pallas_kernels.twell_supported(m.d_model, m.d_ff, m.twell_compression) is None
    with pytest.raises(ValueError, match="preset"):
        C.model_preset("7b")


def test_dict_round_trip_and_diff():
    cfg = C.train_preset("tiny")
    d = config_io.config_to_dict(cfg)
    assert d["optim"]["betas"] == [0.9, 0.95]
    assert config_io.train_config_from_dict(d) == cfg
    other = dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, d_ff=1024, remat=True),
        optim=dataclasses.replace(cfg.optim, betas=(0.9, 0.99)),
        sparsity=dataclasses.replace(cfg.sparsity, tokens_until_dead=4096),
    )
    assert config_io.config_diff(cfg, other) == {
        "model.d_ff": (512, 1024),
        "model.remat": (False, True),
        "optim.betas": ([0.9, 0.95], [0.9, 0.99]),
        "sparsity.tokens_until_dead": (None, 4096),
    }
    assert list(config_io.config_diff(cfg, other, ignore_keys=["remat", "optim.betas"])) == [
        "model.d_ff",
        "sparsity.tokens_until_dead",
    ]
    assert config_io.config_diff({"a": {"b": 1}}, {"a": {}}) == {"a.b": (1, config_io.MISSING)}
    with pytest.raises(ValueError, match=r"model\.n_experts"):
        config_io.train_config_from_dict({"model": {"n_experts": 8}})
