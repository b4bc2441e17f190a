"""`experiments.pretrain --init_from_hf`: continued pretraining from the tiny HF fixture.

In-process runs of `pretrain.main` on tests/fixtures/hf_tiny/relu_gqa (2 layers, GQA,
untied, vocab 128, a character tokenizer.json) over a small corpus of that tokenizer:
a fresh start whose first loss is the HF model's, its config and record, a resume that
never reads the HF weights (with and without the flag, the directory present or gone),
and the refusals (conflicting flags, missing or corrupt directories, another
tokenizer), each before anything is written.
"""

import dataclasses
import json
import logging
import shutil
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from absl import flags
from flax import nnx

from experiments import pretrain
from twell_jax import config as C
from twell_jax import (
    config_io,
    corpus,
    documents,
    hf,
    input_pipeline,
    metrics,
    overrides,
    sharding,
    train,
)
from twell_jax import tokenizer as tokenizer_lib
from twell_jax.hf import init as hf_init

pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf_tiny"
GQA, TIED, SILU = (FIXTURES / n for n in ("relu_gqa", "relu_tied", "silu_tied"))
# fp32 compute on both sides; the same batch through the same function.
LOSS_RTOL = 1e-5
RUN_FLAGS = (
    "--preset=tiny",
    "--steps=4",
    "--warmup_steps=1",
    "--seq_len=16",
    "--batch_size=2",
    "--l1_coef=1e-2",
    "--log_every=1",
    "--eval_every=1000",
    "--checkpoint_every=1000",
    "--set=model.dtype=float32",
)


def run_pretrain(*argv: str) -> int:
    """`pretrain.main` in this process with RUN_FLAGS and `argv`; its exit code."""
    flags.FLAGS(["pretrain", *RUN_FLAGS, *argv])
    try:
        return pretrain.main(["pretrain"])
    finally:
        flags.FLAGS.unparse_flags()


def _prepare(out: Path, tok) -> str:
    chars = list("abcdefghijklmnopqrstuvwxyz    .,")
    rng = np.random.default_rng(0)
    docs = [documents.Document(f"d{i}", "".join(rng.choice(chars, 300))) for i in range(40)]
    corpus.prepare_corpus(docs, out, tok, source="test", val_fraction=0.0)
    return str(out)


@pytest.fixture(scope="module")
def char_corpus(tmp_path_factory) -> str:
    """A corpus of the fixture's character tokenizer (98 ids), no validation split."""
    tok = tokenizer_lib.HFTokenizer(GQA / "tokenizer.json")
    return _prepare(tmp_path_factory.mktemp("char") / "data", tok)


@pytest.fixture(scope="module")
def byte_corpus(tmp_path_factory) -> str:
    return _prepare(tmp_path_factory.mktemp("byte") / "data", tokenizer_lib.ByteTokenizer())


@pytest.fixture(scope="module")
def fresh(tmp_path_factory, char_corpus):
    """A run started from a copy of relu_gqa and stopped at step 2 of 4 (its workdir,
    the copy)."""
    root = tmp_path_factory.mktemp("fresh")
    src = Path(shutil.copytree(GQA, root / "hf"))
    workdir = root / "run"
    assert (
        run_pretrain(
            f"--init_from_hf={src}",
            f"--data_dir={char_corpus}",
            f"--workdir={workdir}",
            "--stop_at=2",
        )
        == 0
    )
    return workdir, src


def test_every_model_field_has_a_rule():
    ruled = [*hf_init.ARCHITECTURE_FIELDS, *hf_init.HF_DEFAULT_FIELDS, *hf_init.FLAG_FIELDS]
    ruled.append(hf_init.SEQ_LEN_FIELD)
    assert sorted(ruled) == sorted(f.name for f in dataclasses.fields(C.ModelConfig))


def test_fresh_start_takes_the_architecture_from_hf_and_the_rest_from_the_flags(fresh):
    workdir, src = fresh
    model = json.loads((workdir / "config.json").read_text())["model"]
    assert model == {
        **model,
        **dict(vocab_size=128, d_model=64, d_ff=96, n_layers=2, n_heads=4, n_kv_heads=2),
        **dict(rope_theta=5e4, norm_eps=1e-6, tie_embeddings=False, ffn_variant="gated_relu"),
        **dict(init_std=0.1, seq_len=16, dtype="float32", param_dtype="float32"),
        **dict(ffn_impl="dense", remat=False),
    }
    record = hf_init.read_record(workdir)
    assert record["hf_dir"] == str(src) and record["config"] == hf.read_config(src)
    assert record["files"]["model.safetensors"] == (src / "model.safetensors").stat().st_size
    records = metrics.read_metrics(workdir / metrics.METRICS_FILE)
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2]
    assert all(np.isfinite(r["loss"]) and r["loss"] > r["ce"] for r in records)  # L1 term on


def _ce(model_cfg, params, batch) -> float:
    logits, _ = nnx.merge(train.model_graphdef(model_cfg), params)(batch["inputs"])
    return float(optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean())


def test_the_first_step_loss_is_the_hf_models(fresh, char_corpus):
    """Step 1's CE is computed on the step-0 parameters: it must be the HF model's CE on
    the run's first batch, and far from a random init's (so the check can fail)."""
    workdir, src = fresh
    cfg = config_io.train_config_from_dict(json.loads((workdir / "config.json").read_text()))
    data = input_pipeline.DataConfig(char_corpus, seq_len=16, batch_size=2, seed=cfg.seed)
    batch = next(input_pipeline.make_train_iterator(data))
    hf_cfg, hf_params = hf.load_checkpoint(src, dtype="float32", seq_len=16)
    expected = _ce(hf_cfg, hf_params, batch)
    first = metrics.read_metrics(workdir / metrics.METRICS_FILE)[0]
    assert first["step"] == 1
    np.testing.assert_allclose(first["ce"], expected, rtol=LOSS_RTOL)
    random_state = train.create_train_state(cfg, sharding.make_mesh(*cfg.mesh_shape))
    assert abs(_ce(cfg.model, random_state.params, batch) - expected) > 0.1


def test_the_state_is_the_hf_weights_at_step_0_sharded_or_not_bf16_or_fp32(tmp_path, char_corpus):
    flags_cfg = C.train_preset("tiny")
    cfg, _ = hf_init.prepare(flags_cfg, str(GQA), set(), tmp_path / "w", char_corpus)
    mesh = sharding.make_mesh(*cfg.mesh_shape)
    state = hf_init.create_train_state(cfg, mesh, GQA)
    assert int(state.step) == 0 and not (tmp_path / "w").exists()
    want = hf.load_params(GQA, cfg.model)
    for got, ref in zip(jax.tree.leaves(state.params), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.dtype == np.float32]
    assert moments and not any(np.any(np.asarray(m)) for m in moments)
    shardings = train.train_state_shardings(cfg, mesh).params
    assert jax.tree.leaves(jax.tree.map(lambda a: a.sharding, state.params)) == jax.tree.leaves(
        shardings
    )
    # The same model as bf16 shards: the bf16-rounded weights.
    sharded = tmp_path / "sharded"
    hf.save_checkpoint(sharded, cfg.model, want, dtype="bfloat16", max_shard_bytes=60_000)
    assert (sharded / hf.INDEX_FILE).is_file()
    cfg2, _ = hf_init.prepare(flags_cfg, str(sharded), set(), tmp_path / "w", char_corpus)
    assert cfg2.model == cfg.model  # the flags' dtypes, not the checkpoint's bf16
    state2 = hf_init.create_train_state(cfg2, mesh, sharded)
    rounded = jax.tree.map(lambda a: np.asarray(a.astype("bfloat16").astype("float32")), want)
    for got, ref in zip(jax.tree.leaves(state2.params), jax.tree.leaves(rounded), strict=True):
        np.testing.assert_array_equal(np.asarray(got), ref)


def test_resume_ignores_the_hf_init(fresh, char_corpus, tmp_path, monkeypatch, caplog):
    """A workdir with checkpoints resumes them: the HF weights are not read, with the
    flag or without it (the record names the source), and even once the source is gone."""
    src_workdir, src = fresh

    def no_read(*args, **kwargs):
        raise AssertionError("the HF weights were read on resume")

    monkeypatch.setattr(hf_init.weights, "load_params", no_read)
    workdir = Path(shutil.copytree(src_workdir, tmp_path / "run"))
    record = (workdir / hf_init.RECORD_FILE).read_text()
    common = (f"--data_dir={char_corpus}", f"--workdir={workdir}")
    with caplog.at_level(logging.INFO, logger="absl"):
        assert run_pretrain(f"--init_from_hf={src}", *common, "--stop_at=3") == 0
    assert "resuming them, not reading" in caplog.text
    assert "starting from the HF checkpoint" not in caplog.text
    moved = src.with_name("hf_moved")
    src.rename(moved)
    try:
        assert run_pretrain(*common) == 0  # no flag, no source: the record's config
    finally:
        moved.rename(src)
    steps = [r["step"] for r in metrics.read_metrics(workdir / metrics.METRICS_FILE)]
    assert steps == [1, 2, 3, 4]
    assert (workdir / hf_init.RECORD_FILE).read_text() == record


def _flags_model(**changes) -> C.ModelConfig:
    return overrides.with_overrides(C.model_preset("tiny"), changes)


@pytest.mark.parametrize(
    "key, value, hf_key",
    [
        ("d_model", "128", "hidden_size"),
        ("vocab_size", "256", "vocab_size"),
        ("n_layers", "1", "num_hidden_layers"),
        ("n_kv_heads", "4", "num_key_value_heads"),
        ("n_kv_heads", "none", "num_key_value_heads"),
        ("ffn_variant", "relu", "hidden_act"),
        ("tie_embeddings", "true", "tie_word_embeddings"),
        ("norm_eps", "1e-5", "rms_norm_eps"),
        ("rope_theta", "1e5", "rope_theta"),
    ],
)
def test_a_flag_conflicting_with_the_architecture_raises(key, value, hf_key):
    model = _flags_model(**{key: value})
    with pytest.raises(ValueError, match=rf"model\.{key}=.*conflicts with .*{hf_key}"):
        hf_init.model_config(model, hf.read_config(GQA), {f"model.{key}"})
    # The same value from the preset alone is no request: replaced.
    assert hf_init.model_config(model, hf.read_config(GQA), set()).d_model == 64


def test_explicit_values_equal_to_the_checkpoints_and_seq_len_bounds():
    hf_config = hf.read_config(GQA)
    same = _flags_model(d_model="64", n_kv_heads="2", norm_eps="1e-6", init_std="0.5")
    keys = {"model.d_model", "model.n_kv_heads", "model.norm_eps", "model.init_std"}
    model = hf_init.model_config(same, hf_config, keys)
    assert (model.n_kv_heads, model.init_std, model.seq_len) == (2, 0.5, 64)  # 128 lowered
    silu = hf_init.model_config(
        _flags_model(n_kv_heads="none"), hf.read_config(SILU), {"model.n_kv_heads"}
    )
    assert silu.n_kv_heads is None and silu.ffn_variant == "gated_silu"
    with pytest.raises(ValueError, match=r"model\.seq_len=128 exceeds max_position_embeddings"):
        hf_init.model_config(_flags_model(), hf_config, {"model.seq_len"})


def test_the_cli_refuses_a_conflict_or_a_missing_dir_before_writing(tmp_path, char_corpus, caplog):
    workdir = tmp_path / "run"
    common = (f"--data_dir={char_corpus}", f"--workdir={workdir}")
    with caplog.at_level(logging.ERROR):
        assert run_pretrain(f"--init_from_hf={GQA}", *common, "--set=model.d_model=128") == 1
        assert "model.d_model=128" in caplog.text and "hidden_size" in caplog.text
        assert run_pretrain(f"--init_from_hf={tmp_path / 'nope'}", *common) == 1
        assert "no config.json" in caplog.text
    assert not workdir.exists()


def _broken(tmp_path, name, edit) -> Path:
    out = Path(shutil.copytree(TIED, tmp_path / name))
    edit(out)
    return out


@pytest.mark.parametrize(
    "edit, error, match",
    [
        (lambda d: shutil.rmtree(d), FileNotFoundError, "no config.json"),
        (lambda d: (d / "config.json").write_text("{"), ValueError, "not valid JSON"),
        (lambda d: (d / "model.safetensors").unlink(), FileNotFoundError, "neither model"),
        (lambda d: (d / "model.safetensors").write_bytes(b"\0" * 64), ValueError, "readable"),
        (
            lambda d: (d / "config.json").write_text(
                json.dumps({**hf.read_config(TIED), "intermediate_size": 128})
            ),
            ValueError,
            r"gate_proj\.weight' has shape \[96, 64\]",
        ),
    ],
)
def test_a_missing_or_corrupt_dir_raises(tmp_path, char_corpus, edit, error, match):
    bad = _broken(tmp_path, "hf", edit)
    with pytest.raises(error, match=match):
        hf_init.prepare(C.train_preset("tiny"), str(bad), set(), tmp_path / "w", char_corpus)
    assert not (tmp_path / "w").exists()


def test_the_corpus_must_speak_the_checkpoints_tokens(tmp_path, char_corpus, byte_corpus, caplog):
    cfg = C.train_preset("tiny")
    with pytest.raises(ValueError, match=r"prepared with the tokenizer 'byte', not .*--tokenizer="):
        hf_init.prepare(cfg, str(GQA), set(), tmp_path, byte_corpus)
    # No tokenizer.json: the corpus's is taken, if its ids fit the embedding.
    with pytest.raises(ValueError, match=r"257 ids, more than .*vocab_size=128"):
        hf_init.prepare(cfg, str(TIED), set(), tmp_path, byte_corpus)
    with caplog.at_level(logging.WARNING):
        model = hf_init.prepare(cfg, str(TIED), set(), tmp_path, char_corpus)[0].model
    assert model.n_layers == 1 and model.tie_embeddings and "no tokenizer.json" in caplog.text
