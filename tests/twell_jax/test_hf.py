"""HF Llama checkpoints: golden logits, round trips, sharded files, refusals (twell_jax.hf)."""

import dataclasses
import json
import os
import shutil
import stat
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from tests.twell_jax.test_model import init_params, small_model
from twell_jax import hf, sharding, train

safetensors_numpy = pytest.importorskip("safetensors.numpy")

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf_tiny"
VARIANTS = ("relu_gqa", "relu_tied", "silu_tied")
# fp32 on both sides; measured max |ours - HF| / max |HF| ~7e-7 (tests/fixtures/make_hf_tiny.py).
GOLDEN_RTOL = 1e-4


def logits_of(cfg, params, tokens):
    return np.asarray(nnx.merge(train.model_graphdef(cfg), params)(tokens)[0])


def assert_same_params(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.shape == y.shape and x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def copy_fixture(name, tmp_path, edit=None):
    """A copy of a fixture variant whose config.json `edit(config)` may change."""
    out = tmp_path / name
    shutil.copytree(FIXTURES / name, out)
    if edit:
        cfg = json.loads((out / "config.json").read_text())
        edit(cfg)
        (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.mark.parametrize("variant", VARIANTS)
def test_golden_logits_match_transformers(variant):
    d = FIXTURES / variant
    cfg, params = hf.load_checkpoint(d)
    assert cfg.dtype == cfg.param_dtype == "float32"
    want = np.load(d / "logits.npy")
    # fp32 GEMMs on every backend (GPUs default to TF32 for fp32 inputs).
    with jax.default_matmul_precision("highest"):
        got = logits_of(cfg, params, np.load(d / "tokens.npy"))
    assert np.max(np.abs(got - want)) / np.max(np.abs(want)) < GOLDEN_RTOL


def test_config_mapping():
    cfg = hf.config_from_hf(hf.read_config(FIXTURES / "relu_gqa"))
    assert (cfg.vocab_size, cfg.d_model, cfg.d_ff, cfg.n_layers) == (128, 64, 96, 2)
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.seq_len) == (4, 2, 64)
    assert (cfg.rope_theta, cfg.norm_eps, cfg.init_std) == (5e4, 1e-6, 0.1)
    assert cfg.ffn_variant == "gated_relu" and not cfg.tie_embeddings
    silu = hf.config_from_hf(hf.read_config(FIXTURES / "silu_tied"), dtype="bfloat16")
    assert silu.ffn_variant == "gated_silu" and silu.tie_embeddings
    assert silu.n_kv_heads is None and silu.dtype == "bfloat16"
    assert hf.eos_token_ids(hf.read_config(FIXTURES / "relu_gqa")) == (2,)
    assert hf.eos_token_ids({"eos_token_id": [2, 7]}) == (2, 7)
    # float16 tensors load exactly as float32 (the kernels compute in bf16 or fp32); a
    # null `dtype` beside the older `torch_dtype` is the latter.
    base = {k: v for k, v in hf.read_config(FIXTURES / "relu_gqa").items() if k != "dtype"}
    assert hf.config_from_hf({**base, "torch_dtype": "float16"}).dtype == "float32"
    old_spelling = hf.config_from_hf({**base, "dtype": None, "torch_dtype": "bfloat16"})
    assert old_spelling.dtype == old_spelling.param_dtype == "bfloat16"
    # rope_scaling of the default type is plain RoPE; zero kv heads are refused.
    plain = hf.config_from_hf({**base, "rope_scaling": {"rope_type": "default"}})
    assert plain == hf.config_from_hf(base)
    with pytest.raises(ValueError, match=r"ModelConfig\.n_kv_heads=0"):
        hf.config_from_hf({**base, "num_key_value_heads": 0})


def test_stop_ids_include_the_generation_configs_and_bad_json_is_named(tmp_path):
    d = copy_fixture("relu_gqa", tmp_path)
    assert hf.stop_token_ids(d) == (2,)
    # A chat model's end-of-turn tokens are in generation_config.json.
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 9, 11]}))
    assert hf.stop_token_ids(d) == (2, 9, 11)
    (d / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json: not valid JSON"):
        hf.read_config(d)


def test_pre_transformers_5_config_spelling(tmp_path):
    def legacy(c):
        c["rope_theta"] = c.pop("rope_parameters")["rope_theta"]
        c["torch_dtype"] = c.pop("dtype")

    d = copy_fixture("relu_gqa", tmp_path, legacy)
    new_cfg, new_params = hf.load_checkpoint(FIXTURES / "relu_gqa")
    old_cfg, old_params = hf.load_checkpoint(d)
    assert old_cfg == new_cfg
    assert_same_params(old_params, new_params)


@pytest.mark.parametrize(
    "field, value",
    [
        ("rope_scaling", {"rope_type": "linear", "factor": 2.0}),
        ("rope_parameters", {"rope_theta": 5e4, "rope_type": "llama3", "factor": 8.0}),
        ("attention_bias", True),
        ("mlp_bias", True),
        ("architectures", ["MistralForCausalLM"]),
        ("head_dim", 32),
        ("hidden_act", "gelu"),
    ],
)
def test_unsupported_fields_are_named(field, value):
    config = {**hf.read_config(FIXTURES / "relu_gqa"), field: value}
    name = "rope_parameters.rope_type" if field == "rope_parameters" else field
    with pytest.raises(ValueError, match=rf"HF config {name}="):
        hf.config_from_hf(config)


def test_missing_extra_and_misshapen_tensors(tmp_path):
    src = FIXTURES / "relu_tied"
    tensors = safetensors_numpy.load_file(src / "model.safetensors")
    cfg = hf.config_from_hf(hf.read_config(src))

    def write(name, ts):
        d = tmp_path / name
        d.mkdir()
        shutil.copy(src / "config.json", d)
        safetensors_numpy.save_file(ts, d / "model.safetensors")
        return d

    bias = {**tensors, "model.layers.0.self_attn.q_proj.bias": np.zeros(64, np.float32)}
    with pytest.raises(ValueError, match=r"no place in our model.*q_proj\.bias"):
        hf.load_params(write("extra", bias), cfg)
    missing = {k: v for k, v in tensors.items() if "up_proj" not in k}
    with pytest.raises(ValueError, match=r"no tensor 'model\.layers\.0\.mlp\.up_proj\.weight'"):
        hf.load_params(write("missing", missing), cfg)
    wide = {**tensors, "model.layers.0.self_attn.k_proj.weight": np.zeros((32, 64), np.float32)}
    with pytest.raises(ValueError, match=r"k_proj\.weight' has shape \[32, 64\].*\[16, 64\]"):
        hf.load_params(write("wide", wide), cfg)
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        hf.load_checkpoint(tmp_path)
    # An index that places a tensor in a shard without it.
    listed = write("listed", missing)
    names = {**dict.fromkeys(missing, "model.safetensors"), "model.layers.0.mlp.up_proj.weight":
             "model.safetensors"}  # fmt: skip
    (listed / "model.safetensors.index.json").write_text(json.dumps({"weight_map": names}))
    with pytest.raises(ValueError, match=r"no tensor 'model\.layers\.0\.mlp\.up_proj\.weight',"
                       r" which model\.safetensors\.index\.json places there"):  # fmt: skip
        hf.load_params(listed, cfg)


@pytest.mark.parametrize("tied", [False, True])
def test_round_trip_ours_hf_ours(tmp_path, tied):
    cfg = small_model(n_kv_heads=2, tie_embeddings=tied, ffn_variant="gated_relu")
    params = init_params(cfg, seed=3)
    files = hf.save_checkpoint(tmp_path / "hf", cfg, params, eos_token_id=5)
    assert [f.name for f in files] == ["model.safetensors", "config.json"]
    assert hf.read_config(tmp_path / "hf")["eos_token_id"] == 5
    loaded_cfg, loaded = hf.load_checkpoint(tmp_path / "hf", dtype=cfg.dtype)
    assert loaded_cfg == cfg
    assert_same_params(loaded, params)


def test_sharded_bf16_export_and_mesh_placement(tmp_path):
    cfg = small_model(n_kv_heads=1)
    params = init_params(cfg)
    files = hf.save_checkpoint(
        tmp_path / "hf", cfg, params, dtype="bfloat16", max_shard_bytes=40_000
    )
    shards = [f.name for f in files if f.suffix == ".safetensors"]
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert {f.name for f in files} - set(shards) == {hf.INDEX_FILE, "config.json"}
    assert hf.read_config(tmp_path / "hf")["dtype"] == "bfloat16"
    mesh = sharding.make_mesh()
    loaded_cfg, loaded = hf.load_checkpoint(tmp_path / "hf", mesh=mesh, param_dtype="float32")
    assert loaded_cfg.dtype == "bfloat16"
    rounded = jax.tree.map(lambda a: a.astype("bfloat16").astype("float32"), params)
    assert_same_params(loaded, rounded)
    want = sharding.tree_shardings(hf.abstract_params(loaded_cfg), mesh)
    for a, s in zip(jax.tree.leaves(loaded), jax.tree.leaves(want), strict=True):
        assert a.sharding == s


def test_hf_fixture_re_exports_to_the_same_tensors(tmp_path):
    src = FIXTURES / "relu_gqa"
    cfg, params = hf.load_checkpoint(src)
    hf.save_checkpoint(tmp_path / "hf", cfg, params)
    want = safetensors_numpy.load_file(src / "model.safetensors")
    got = safetensors_numpy.load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_export_refusals(tmp_path):
    cfg = small_model(ffn_variant="relu")
    with pytest.raises(ValueError, match="ffn_variant='relu': HF Llama has only gated MLPs"):
        hf.save_checkpoint(tmp_path / "a", cfg, init_params(cfg))
    gated = dataclasses.replace(cfg, ffn_variant="gated_relu")
    hf.save_checkpoint(tmp_path / "b", gated, init_params(gated))
    with pytest.raises(FileExistsError, match=r"b is not empty \(it holds config.json, model"):
        hf.save_checkpoint(tmp_path / "b", gated, init_params(gated))
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "notes.txt").write_text("")
    with pytest.raises(FileExistsError, match=r"c is not empty \(it holds notes.txt\)"):
        hf.save_checkpoint(tmp_path / "c", gated, init_params(gated))
    with pytest.raises(FileExistsError, match="is a file"):
        hf.check_export_dir(tmp_path / "c" / "notes.txt")
    hf.check_export_dir(tmp_path / "new")  # new or empty: fine
    assert not (tmp_path / "new").exists()


def test_export_files_get_the_mode_of_the_umask(tmp_path):
    cfg = small_model(ffn_variant="gated_relu")
    old = os.umask(0o027)
    try:
        files = hf.save_checkpoint(tmp_path / "hf", cfg, init_params(cfg), max_shard_bytes=4000)
    finally:
        os.umask(old)
    assert len(files) > 3  # shards, their index and config.json
    assert {stat.S_IMODE(f.stat().st_mode) for f in files} == {0o640}
