"""Dotted-key overrides: string parsing to the field's type, validation, `--set` items."""

import pytest

from twell_jax import config as C
from twell_jax import config_io, overrides


def test_string_overrides_take_the_field_type():
    cfg = C.train_preset("tiny")
    other = overrides.with_overrides(
        cfg,
        {
            "model.d_ff": "1024",
            "optim.betas": "0.9,0.99",
            "sparsity.tokens_until_dead": "4096",
            "model.remat": "true",
        },
    )
    assert other.model.d_ff == 1024 and other.optim.betas == (0.9, 0.99)
    assert other.sparsity.tokens_until_dead == 4096 and other.model.remat is True
    assert config_io.config_diff(cfg, other).keys() == {
        "model.d_ff",
        "model.remat",
        "optim.betas",
        "sparsity.tokens_until_dead",
    }
    with pytest.raises(ValueError, match="n_experts"):
        overrides.with_overrides(cfg, {"model.n_experts": 8})
    with pytest.raises(ValueError, match=r"ModelConfig\.ffn_impl='twell': .*d_ff=300"):
        overrides.with_overrides(cfg, {"model.ffn_impl": "twell", "model.d_ff": 300})


def test_a_tuple_of_any_length_takes_any_number_of_values():
    """sparse_hot_shift's knots (tuple[float, ...]) are pairs, as many as wanted; a
    fixed-length tuple (betas) still needs its length."""
    cfg = C.train_preset("tiny")
    knots = "0,0,0.6,2,0.9,16"
    other = overrides.with_overrides(cfg, {"sparsity.sparse_hot_shift": knots})
    assert other.sparsity.sparse_hot_shift == (0.0, 0.0, 0.6, 2.0, 0.9, 16.0)
    with pytest.raises(ValueError, match=r"sparse_hot_shift='0,0,x': expected a float"):
        overrides.with_overrides(cfg, {"sparsity.sparse_hot_shift": "0,0,x"})
    with pytest.raises(ValueError, match=r"sparse_hot_shift=.*needs finite \(share, shift\) pairs"):
        overrides.with_overrides(cfg, {"sparsity.sparse_hot_shift": "0,0,0.5,1,2"})


def test_assignments_split_at_the_first_equals_sign():
    items = ["model.d_ff=1024", " optim.betas = 0.9,0.99", "model.d_ff=2048", "x.y=a=b"]
    assert overrides.parse_assignments(items) == {
        "model.d_ff": "2048",
        "optim.betas": "0.9,0.99",
        "x.y": "a=b",
    }
    with pytest.raises(ValueError, match=r"expected section\.field=value"):
        overrides.parse_assignments(["model.d_ff"])


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("model.d_model", "abc", r"ModelConfig\.d_model='abc': expected an int$"),
        ("model.d_model", "1.5", r"ModelConfig\.d_model='1\.5': expected an int$"),
        ("optim.lr", "fast", r"OptimConfig\.lr='fast': expected a float$"),
        (
            "optim.betas",
            "0.9",
            r"OptimConfig\.betas='0\.9': expected 2 comma-separated float values, got 1$",
        ),
        ("optim.betas", "0.9,x", r"OptimConfig\.betas='0\.9,x': expected a float$"),
        ("model.remat", "yes", r"ModelConfig\.remat='yes': expected a bool"),
        ("sparsity.tokens_until_dead", "lots", r"tokens_until_dead='lots': expected an int$"),
    ],
)
def test_unparsable_values_name_the_field_and_value(key, value, message):
    with pytest.raises(ValueError, match=message):
        overrides.with_overrides(C.train_preset("tiny"), {key: value})


@pytest.mark.parametrize(
    "given, message",
    [
        ({"seed.x": "1"}, r"TrainConfig\.seed is not a config section: override seed=<value>"),
        ({"model.d_ff.x": "3"}, r"ModelConfig\.d_ff is not a config section"),
        ({"model": "1", "model.d_ff": "256"}, "'model' is overridden both whole and by its"),
        ({"batch_size.foo": "3", "batch_size": "4"}, "'batch_size' is overridden both"),
    ],
)
def test_a_field_and_a_section_are_not_mixed_up(given, message):
    with pytest.raises(ValueError, match=message):
        overrides.with_overrides(C.train_preset("tiny"), given)
