"""SparseTrainConfig: validation names the kernel and field, defaults, and fitting of
every launch to the shapes."""

import dataclasses

import pytest

from pallas_kernels._gather import RowLaunch
from pallas_kernels.sparse_train import SparseTrainConfig, resolve_config, sparse_train_supported
from pallas_kernels.sparse_train.compaction import CompactLaunch


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"ell_width": 96}, "ell_width"),
        ({"tail_capacities": (256, 0)}, "tail_capacities"),
        ({"impl": "cuda"}, "impl"),
        ({"fallback_block_rows": 0}, "fallback_block_rows"),
        ({"spmm_dx": RowLaunch(group=3, num_warps=4, block_h=64)}, r"spmm_dx\.group=3"),
        ({"spmm_dx": RowLaunch(group=2, num_warps=3, block_h=64)}, r"spmm_dx\.num_warps=3"),
        ({"spmm_csc": RowLaunch(group=4, num_warps=2, block_h=96)}, r"spmm_csc\.block_h=96"),
        ({"compact": CompactLaunch(block_m=3)}, r"compact\.block_m=3"),
        ({"compact": CompactLaunch(ahead=0)}, r"compact\.ahead=0"),
        ({"compact": CompactLaunch(block_m=256)}, r"compact\.block_m=256 overflows"),
        ({"compact": CompactLaunch(group=32)}, r"compact\.group=32"),
        (
            {"ell_width": 16, "sddmm_up": RowLaunch(group=32, num_warps=1, block_h=64)},
            r"multiple of sddmm_up\.group=32",
        ),
    ],
)
def test_bad_config_raises(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SparseTrainConfig(**kwargs)


def test_default_launches():
    """The launches the op runs at production shapes (H=2048, N=5632: nothing is fitted)."""
    cfg = SparseTrainConfig()
    assert cfg.compact == CompactLaunch(256, group=8, block_m=8, ahead=1, num_warps=2)
    assert cfg.sddmm_up == RowLaunch(group=2, num_warps=1, block_h=1024)
    assert cfg.spmm_down == RowLaunch(group=4, num_warps=1, block_h=512)
    assert cfg.sddmm_grad == RowLaunch(group=4, num_warps=1, block_h=1024)
    assert cfg.spmm_dx == RowLaunch(group=2, num_warps=4, block_h=1024)
    assert cfg.spmm_csc == RowLaunch(group=4, num_warps=2, block_h=512)
    fitted = resolve_config(16384, 2048, 5632, cfg)
    assert fitted == dataclasses.replace(cfg, hot_min_count=256)


@pytest.mark.parametrize("m, expected", [(16384, 256), (32768, 512), (100, 2), (1, 1)])
def test_hot_min_count_scales_with_m(m, expected):
    """None: a neuron is hot from M / 64 entries (rounded up); a set value is kept."""
    assert resolve_config(m, 2048, 5632, SparseTrainConfig()).hot_min_count == expected
    kept = resolve_config(m, 2048, 5632, SparseTrainConfig(hot_min_count=7))
    assert kept.hot_min_count == 7


def test_fit_shrinks_warps_with_the_block():
    """A block 4x narrower gets 4x fewer warps (at least one): H = 768 fits 1024 to 256."""
    launch = RowLaunch(group=2, num_warps=4, block_h=1024)
    assert launch.fit(768) == RowLaunch(group=2, num_warps=1, block_h=256)
    assert launch.fit(1536) == RowLaunch(group=2, num_warps=2, block_h=512)
    assert launch.fit(2048) == launch


def test_resolve_config_fits_each_launch():
    cfg = SparseTrainConfig(spmm_dx=RowLaunch(group=2, num_warps=2, block_h=2048))
    fitted = resolve_config(32, 96, 192, cfg)
    assert fitted.spmm_dx == RowLaunch(group=2, num_warps=1, block_h=32)  # 32 | 96
    assert fitted.sddmm_up == RowLaunch(group=2, num_warps=1, block_h=32)
    assert fitted.spmm_csc.block_h == 32
    assert fitted.compact.block_cols == 64  # largest power of two <= 256 dividing 192
    assert fitted.tail_capacities == (0, 32)  # capped at M


def test_supported_names_the_launch():
    cfg = SparseTrainConfig()
    assert sparse_train_supported(64, 2048, 5632, cfg) is None
    assert "sddmm_up.block_h" in sparse_train_supported(64, 100, 5632, cfg)
    assert "compact.block_cols" in sparse_train_supported(64, 2048, 5640, cfg)
    # 4 columns: narrower than a group, so the group shrinks with them.
    assert cfg.compact.fit(500) == CompactLaunch(block_cols=4, group=4)
    assert "compact.block_cols" in sparse_train_supported(64, 2048, 500, cfg)
    assert sparse_train_supported(64, 100, 5640, SparseTrainConfig(impl="xla")) is None
