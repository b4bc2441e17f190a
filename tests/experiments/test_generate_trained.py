"""Generation from a checkpoint of the real trainer, loaded as `experiments.generate
--workdir` loads it: with fp32 compute, greedy (and seeded sampled) tokens through the
dense FFN and through the sparse decode path are the same, and the decode steps ran
`sparse_decode_mlp` over few active neurons, not its dense fallback.

The run is short (a 2-layer tiny model, 80 steps of 8 x 128 tokens on a 1 MB slice of
the stdlib byte corpus) with the L1 ramp over 20 steps only: without L1 such a run ends
near l0 200 of d_ff 512, and a 4-prompt decode step then fires most neurons.
"""

import dataclasses

import jax
import numpy as np
import pytest

from experiments import pretrain_run
from twell_jax import config, corpus, documents, serving, tokenizer, trainer
from twell_jax import generate as G

STEPS = 80
NEW = 64
TEXTS = ("def ", "import os\nimport sys\n\n", "class Parser(object):\n    def __init__(self",
         "    return self.")  # fmt: skip


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(fp32 ModelConfig, params, the run's summary) of a finished short run."""
    root = tmp_path_factory.mktemp("trained")
    data_dir = root / "data"
    corpus.prepare_corpus(
        documents.stdlib_documents(max_bytes=1_000_000),
        data_dir,
        tokenizer.ByteTokenizer(),
        source="stdlib slice",
        val_fraction=0.1,
    )
    cfg = config.TrainConfig(
        model=config.model_preset("tiny", n_layers=2, n_kv_heads=2),
        batch_size=8,
        optim=config.OptimConfig(lr=2e-3, warmup_steps=5, total_steps=STEPS),
        sparsity=config.SparsityConfig(l1_coef=1e-2, l1_warmup_steps=20),
        log_every=20,
        eval_every=1000,
        eval_batches=1,
        checkpoint_every=1000,
    )
    summary = trainer.run(cfg, trainer.RunOptions(str(root / "run"), str(data_dir)))
    run_cfg, params, step = pretrain_run.load_params(root / "run")
    assert step == STEPS
    return dataclasses.replace(run_cfg.model, dtype="float32"), params, summary


@pytest.fixture
def decode_calls(monkeypatch):
    """Records (active neurons, dense_fallback) of every decode-op call that generation
    runs (`sparse_decode_ffn_block`, one per layer and decode step)."""
    calls = []
    op = serving.sparse_decode_ffn_block

    def recorded(x, w_gate, w_up, w_down, **kw):
        y, stats = op(x, w_gate, w_up, w_down, return_stats=True, **kw)
        record = lambda *v: calls.append(tuple(int(a) for a in v))
        jax.debug.callback(record, stats.active_neurons, stats.dense_fallback)
        return y

    monkeypatch.setattr(serving, "sparse_decode_ffn_block", recorded)
    G._compiled.cache_clear()  # trace the generation functions with the recording op
    yield calls
    G._compiled.cache_clear()


def test_trained_model_generates_the_same_tokens_dense_and_sparse(trained, decode_calls):
    cfg, params, summary = trained
    assert summary["step"] == STEPS and summary["l0_mean"] < 64, summary
    tok = tokenizer.ByteTokenizer()
    prompts = [tok.encode(t).tolist() for t in TEXTS]
    greedy = G.SamplingConfig(vocab_limit=tok.vocab_size)

    def run(ffn, rows, sampling=greedy):
        return G.generate(cfg, params, rows, NEW, sampling=sampling, seed=3, ffn=ffn).new_token_ids

    dense = run("dense", prompts)
    assert not decode_calls  # the dense path never calls the decode op
    sparse = run("sparse", prompts)
    assert all(len(row) == NEW for row in dense)
    assert sparse == dense
    # Seeded sampling visits more varied states than greedy decoding: the same draws.
    hot = G.SamplingConfig(temperature=1.0, vocab_limit=tok.vocab_size)
    assert run("sparse", prompts, hot) == run("dense", prompts, hot)

    jax.effects_barrier()
    # Two sparse generations of NEW - 1 decode steps (the prefill is dense in fp32).
    assert len(decode_calls) == 2 * (NEW - 1) * cfg.n_layers
    active, fallback = np.asarray(decode_calls).T
    spread = np.percentile(active, [0, 50, 100])
    seen = f"dense fallback in {fallback.mean():.0%} of calls; active min/median/max {spread}"
    assert fallback.mean() <= 0.1, seen
    # A decode step (4 tokens) fires a small part of d_ff: a model gone dense fails here.
    assert 0 < np.median(active[fallback == 0]) < cfg.d_ff / 4, seen
