"""`python -m experiments.generate` on the tiny HF fixture and on a pretrain workdir, and
`python -m experiments.hf_convert` exporting that workdir (subprocesses: the CLIs' absl
flags would clash with other CLIs' in one test process)."""

import dataclasses
import json
import shutil
import subprocess
from pathlib import Path

import jax
import numpy as np
import pytest

from experiments import pretrain_run
from tests.corpora import prepare_byte_corpus, write_text_corpus
from tests.experiments.cli import refusal, run_module
from twell_jax import checkpoint, config, config_io, corpus, run_data, sharding, train, trainer
from twell_jax import generate as G
from twell_jax.input_pipeline import DataConfig

pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")

REPO = Path(__file__).resolve().parents[2]
HF_TINY = REPO / "tests" / "fixtures" / "hf_tiny" / "relu_gqa"


def run(module: str, *flags: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = run_module(module, *flags)
    if check:
        assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _make_run(root: Path, data_dir: Path, **model_fields) -> Path:
    """A workdir as pretrain leaves it: config.json, data.json (its corpus) and a step-3
    checkpoint of a fresh model."""
    model = config.model_preset(
        "tiny", d_model=64, n_layers=2, d_ff=256, seq_len=32, n_kv_heads=2, init_std=0.2,
        **model_fields,
    )  # fmt: skip
    cfg = config.TrainConfig(model=model, batch_size=4)
    state = train.create_train_state(cfg, sharding.make_mesh())
    with checkpoint.Checkpointer(root / trainer.CHECKPOINT_DIR, async_save=False) as ckpt:
        ckpt.save(3, state, {}, cfg)
    (root / trainer.CONFIG_FILE).write_text(json.dumps(config_io.config_to_dict(cfg)))
    run_data.write_data_record(root, str(data_dir), corpus.load_meta(data_dir))
    return root


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> tuple[Path, Path]:
    """(a workdir of a fresh model, its corpus)."""
    root = tmp_path_factory.mktemp("run")
    data_dir = root / "data"
    prepare_byte_corpus(write_text_corpus(root)[0], data_dir)
    return _make_run(root / "workdir", data_dir), data_dir


@pytest.mark.slow
def test_hf_prompt_ids_batch_matches_transformers(tmp_path):
    golden = json.loads((HF_TINY / "greedy.json").read_text())
    out = tmp_path / "out.json"
    ids = ";".join(",".join(map(str, p)) for p in golden["prompts"])
    run("generate", f"--hf_dir={HF_TINY}", f"--prompt_ids={ids}", "--max_new_tokens=8",
        "--vocab_limit=0", f"--output_json={out}")  # fmt: skip
    record = json.loads(out.read_text())
    assert record["prompt_ids"] == golden["prompts"]
    assert record["new_token_ids"] == golden["new_tokens"]
    assert isinstance(record["text"], list) and len(record["text"]) == 2


@pytest.mark.slow
def test_hf_text_prompt_streams_and_samples(tmp_path):
    out = tmp_path / "out.json"
    proc = run("generate", f"--hf_dir={HF_TINY}", "--prompt=Hello", "--max_new_tokens=6",
               "--temperature=0.9", "--top_k=20", "--seed=2", f"--output_json={out}")  # fmt: skip
    record = json.loads(out.read_text())
    # BOS (1) from config.json, then the characters; ids the tokenizer cannot decode
    # (>= its 98 ids, below the model's 128) are never drawn.
    assert record["prompt_ids"] == [1, 43, 72, 79, 79, 82]
    assert len(record["new_token_ids"]) == 6 and max(record["new_token_ids"]) < 98
    assert proc.stdout == "Hello" + record["text"] + "\n"
    bad = run("generate", f"--hf_dir={HF_TINY}", "--prompt_ids=1,200", check=False)
    assert bad.returncode == 2 and "prompts[0][1] = 200 is not a token id" in bad.stderr


@pytest.mark.slow
def test_workdir_generation_and_export(tmp_path, workdir):
    run_dir, data_dir = workdir
    out = tmp_path / "out.json"
    # The tokenizer of the corpus that the run's data.json names.
    run("generate", f"--workdir={run_dir}", "--prompt=the qu", "--prompt=héllo",
        "--max_new_tokens=5", f"--output_json={out}")  # fmt: skip
    record = json.loads(out.read_text())
    assert record["prompt_ids"][0] == list(b"the qu")
    cfg, params, step = pretrain_run.load_params(run_dir)
    assert step == 3
    want = G.generate(cfg.model, params, record["prompt_ids"], 5, stop_tokens=[256],
                      sampling=G.SamplingConfig(vocab_limit=257))  # fmt: skip
    assert record["new_token_ids"] == want.new_token_ids
    assert len(record["text"]) == 2

    hf_dir = tmp_path / "hf"
    run("hf_convert", f"--workdir={run_dir}", f"--data_dir={data_dir}", f"--to_hf_dir={hf_dir}")
    from twell_jax import hf

    hf_cfg, hf_params = hf.load_checkpoint(hf_dir, dtype=cfg.model.dtype)
    assert hf_cfg == cfg.model and hf.read_config(hf_dir)["eos_token_id"] == 256
    for a, b in zip(jax.tree.leaves(hf_params), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # safetensors' own writer would leave the weights 0600 whatever the umask
    assert (hf_dir / "model.safetensors").stat().st_mode == (hf_dir / "config.json").stat().st_mode
    again = run("hf_convert", f"--workdir={run_dir}", f"--to_hf_dir={hf_dir}", check=False)
    assert again.returncode == 2 and f"{hf_dir} is not empty (it holds config.json" in again.stderr
    # checked before the workdir is read: a missing one is not what it reports
    nothing = run("hf_convert", f"--workdir={tmp_path}/none", f"--to_hf_dir={hf_dir}", check=False)
    assert nothing.returncode == 2 and "is not empty" in nothing.stderr
    into_run = run("hf_convert", f"--workdir={run_dir}", f"--to_hf_dir={run_dir}", check=False)
    assert into_run.returncode == 2 and "is not empty (it holds checkpoints" in into_run.stderr


def test_prompt_ids_past_the_tokenizer_are_read_with_a_warning():
    """Ids below the model's padded vocabulary but past the tokenizer's are the model's
    to read (no refusal), and the warning says why their text is U+FFFD."""
    proc = run("generate", f"--hf_dir={HF_TINY}", "--prompt_ids=1,2,100", "--max_new_tokens=2")
    assert "--prompt_ids [100] are past the tokenizer's 98 ids" in proc.stderr


def test_bad_requests_are_refused_before_any_output(tmp_path):
    """A single prompt's text is streamed only once every check has passed."""
    hf = f"--hf_dir={HF_TINY}"
    for flags, message in [
        (["--prompt=Hello", "--max_new_tokens=200"], "+ max_new_tokens=200 exceeds"),
        (["--prompt=Hello", "--max_new_tokens=0"], "max_new_tokens=0: must be >= 1"),
        (["--prompt_ids=1,2,9999"], "prompts[0][2] = 9999 is not a token id"),
        (["--prompt=Hello", "--stop_ids=2,99999999999"], "stop_tokens[1] = 99999999999 is not"),
        (["--prompt=Hello", "--temperature=nan"], "temperature=nan: must be finite"),
        (["--prompt=Hello", "--vocab_limit=5000"], "--vocab_limit=5000: must be in [0, 128]"),
        (
            ["--prompt=Hello", f"--output_json={tmp_path}/no_dir/out.json"],
            f"--output_json={tmp_path}/no_dir/out.json: no directory",
        ),
        (["--prompt=Hello", "stray"], "unexpected arguments ['stray'] (flags take --name=value)"),
    ]:
        proc = run("generate", hf, *flags, check=False)
        assert proc.stdout == "", (flags, proc.stdout)
        line = refusal(proc)
        assert message in line, line


@pytest.mark.slow
def test_a_run_of_the_training_op_generates_in_float32(tmp_path, workdir):
    """ffn_impl="sparse" (the bf16 training op) takes no part in generation, so the
    run's model may be computed in float32."""
    run_dir = _make_run(tmp_path / "run", workdir[1], ffn_impl="sparse")
    out = tmp_path / "out.json"
    run("generate", f"--workdir={run_dir}", "--prompt_ids=5,6,7", "--dtype=float32",
        "--max_new_tokens=4", "--ffn=sparse", f"--output_json={out}")  # fmt: skip
    cfg, params, _ = pretrain_run.load_params(run_dir)
    fp32 = dataclasses.replace(cfg.model, ffn_impl="dense", dtype="float32")
    want = G.generate(fp32, params, [[5, 6, 7]], 4, stop_tokens=[256], ffn="sparse",
                      sampling=G.SamplingConfig(vocab_limit=257))  # fmt: skip
    assert json.loads(out.read_text())["new_token_ids"] == want.new_token_ids[0]


def test_the_run_corpus_is_the_recorded_one(tmp_path, workdir):
    run_dir, data_dir = workdir
    assert pretrain_run.run_corpus(run_dir) == str(data_dir.resolve())
    assert pretrain_run.run_corpus(run_dir, str(data_dir)) == str(data_dir)
    # A run from before data.json: the default corpus, as pretraining's.
    assert pretrain_run.run_corpus(tmp_path) == DataConfig.data_dir


@pytest.mark.slow
def test_sentencepiece_text_keeps_the_space_before_the_continuation(tmp_path):
    """A Metaspace tokenizer (Llama-2, Mistral) writes a word's leading space into its
    token, which decoding the new ids alone would drop; its EOS is config.json's id."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    hf_dir = tmp_path / "hf"
    shutil.copytree(HF_TINY, hf_dir)
    vocab = {"<unk>": 0, "<s>": 1, "<end>": 2, **{f"\u2581w{i}": i for i in range(3, 98)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.add_special_tokens(["<unk>", "<s>", "<end>"])  # no EOS of the usual names
    tok.save(str(hf_dir / "tokenizer.json"))
    out = tmp_path / "out.json"
    proc = run("generate", f"--hf_dir={hf_dir}", "--prompt=w3 w4", "--max_new_tokens=3",
               "--stop_ids=", f"--output_json={out}")  # fmt: skip
    record = json.loads(out.read_text())
    assert record["prompt_ids"] == [1, 3, 4]
    words = [f"w{i}" for i in record["new_token_ids"]]
    assert record["text"] == "".join(f" {w}" for w in words)
    assert proc.stdout == "w3 w4" + record["text"] + "\n"
