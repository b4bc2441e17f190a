"""Train step: gradient accumulation, multi-device equivalence, learning, state creation."""

import functools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from twell_jax import config as C
from twell_jax import sharding, train
from twell_jax.overrides import with_overrides

# fp32 compute for the equivalence tests: Adam's first step moves every parameter by
# about +-lr whatever the gradient's size, so bf16 noise would flip the sign of tiny
# gradients. With fp32, micro-batching and sharding only reassociate sums.
LOSS_RTOL = 1e-5
GRAD_NORM_RTOL = 1e-4
# Relative norm of the difference of the parameter updates ||du|| / ||u||.
UPDATE_RTOL = 1e-3


def small_config(**optim) -> C.TrainConfig:
    """fp32 tiny model; L1 warmup and dead-row re-init on so that the step exercises them."""
    model = C.model_preset(
        "tiny",
        vocab_size=256,
        d_model=64,
        d_ff=256,
        n_layers=2,
        n_heads=4,
        seq_len=16,
        dtype="float32",
    )
    return C.TrainConfig(
        model=model,
        batch_size=16,
        optim=C.OptimConfig(lr=3e-3, warmup_steps=0, total_steps=100, **optim),
        sparsity=C.SparsityConfig(l1_warmup_steps=5, reinit_dead_every=5),
    )


@functools.cache
def cached_step(cfg: C.TrainConfig, mesh):
    """One compiled train step per (config, mesh) for the whole module (compiles dominate)."""
    return train.make_train_step(cfg, mesh)


def random_batch(cfg: C.TrainConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Tokens from a small alphabet so that the loss can drop quickly."""
    data = np.random.default_rng(seed).integers(0, 32, (cfg.batch_size, cfg.model.seq_len + 1))
    return {"inputs": data[:, :-1].astype(np.int32), "targets": data[:, 1:].astype(np.int32)}


def one_step(cfg: C.TrainConfig, mesh, batch):
    """(params before, params after, host metrics) of one optimizer step."""
    state = train.create_train_state(cfg, mesh)
    before = jax.device_get(state.params)
    state, metrics = cached_step(cfg, mesh)(state, batch)
    return before, jax.device_get(state.params), train.host_metrics(metrics)


def update_rel_diff(before, after_a, after_b) -> float:
    """||u_a - u_b|| / ||u_b|| over all parameters, u = after - before."""
    diff = sum(
        float(np.sum((a - b) ** 2))
        for a, b in zip(jax.tree.leaves(after_a), jax.tree.leaves(after_b), strict=True)
    )
    norm = sum(
        float(np.sum((b - p) ** 2))
        for p, b in zip(jax.tree.leaves(before), jax.tree.leaves(after_b), strict=True)
    )
    return (diff / norm) ** 0.5


def test_weight_decay_skips_norms():
    params = {
        "embed": 0,
        "final_norm": {"scale": 0},
        "blocks": {"attn_norm": {"scale": 0}, "ffn": {"w_up": 0}},
    }
    assert train._decay_mask(params) == {
        "embed": True,
        "final_norm": {"scale": False},
        "blocks": {"attn_norm": {"scale": False}, "ffn": {"w_up": True}},
    }


def test_lr_schedule():
    schedule = train.lr_schedule(C.OptimConfig(lr=1e-3, warmup_steps=10, total_steps=110))
    assert float(schedule(0)) == 0.0
    assert float(schedule(10)) == pytest.approx(1e-3)
    assert float(schedule(60)) == pytest.approx(5e-4)
    assert float(schedule(110)) == pytest.approx(0.0, abs=1e-12)


def test_grad_accumulation_matches_full_batch():
    cfg = small_config()
    mesh = sharding.make_mesh()
    batch = random_batch(cfg)
    before, full, m_full = one_step(cfg, mesh, batch)
    _, accum, m_accum = one_step(small_config(grad_accum_steps=2), mesh, batch)
    assert m_accum["loss"] == pytest.approx(m_full["loss"], rel=LOSS_RTOL)
    assert m_accum["grad_norm"] == pytest.approx(m_full["grad_norm"], rel=GRAD_NORM_RTOL)
    np.testing.assert_allclose(m_accum["l0"], m_full["l0"], rtol=1e-6)
    assert update_rel_diff(before, accum, full) < UPDATE_RTOL
    # Validation in the same micro-batches: the same mean CE.
    params = train.create_train_state(cfg, mesh).params
    ce_full = train.make_eval_step(cfg, mesh)(params, batch)
    ce_accum = train.make_eval_step(small_config(grad_accum_steps=2), mesh)(params, batch)
    assert float(ce_accum) == pytest.approx(float(ce_full), rel=LOSS_RTOL)


_SHARDED = textwrap.dedent("""
    import dataclasses
    import json
    import sys

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import pallas_kernels
    from tests.twell_jax.test_train import small_config, random_batch, one_step
    from twell_jax import ffn
    from twell_jax import model as M
    from twell_jax import sharding, train

    assert jax.device_count() == 8
    cfg = small_config(grad_accum_steps=2)
    batch = random_batch(cfg)
    mesh8 = sharding.make_mesh(2, 4)
    before8, after8, m8 = one_step(cfg, mesh8, batch)
    np.savez(sys.argv[1], *jax.tree.leaves(before8), *jax.tree.leaves(after8))
    params = train.create_train_state(cfg, mesh8).params
    result = {
        "loss": m8["loss"],
        "grad_norm": m8["grad_norm"],
        "w_up_spec": str(params["blocks"]["ffn"]["w_up"].sharding.spec),
    }

    # The attention block in chunks of sequences per batch shard (16 sequences, 2 per
    # shard, chunks of 1): the same loss and gradients, and no collective more (a chunk
    # that mixed shards would move activations; weights cast inside a chunk would be
    # gathered once per chunk).
    def attention_run(p):
        def loss(p):
            logits, _ = nnx.merge(train.model_graphdef(cfg.model), p)(batch["inputs"])
            return jnp.mean(logits**2)

        step = jax.jit(jax.value_and_grad(loss))
        text = step.lower(p).compile().as_text()
        collectives = sum(text.count(op + "(") + text.count(op + "-start(") for op in (
            "all-gather", "all-to-all", "collective-permute", "all-reduce", "reduce-scatter"))
        value, grads = step(p)
        return float(value), [np.asarray(g) for g in jax.tree.leaves(grads)], collectives

    # Split over devices the sparse FFN's residuals are recomputed, not kept (XLA's GPU
    # partitioner gathered kept ones onto every device).
    remat = dataclasses.replace(cfg.model, ffn_impl="sparse", dtype="bfloat16", remat=True)
    with jax.set_mesh(mesh8):
        result["policy_split"] = M._remat_policy(remat) is None
    result["policy_one_device"] = M._remat_policy(remat) is not None

    with jax.set_mesh(mesh8):
        whole = attention_run(params)
        M.ATTENTION_CHUNK_SEQS = 1
        chunked = attention_run(params)
        M.ATTENTION_CHUNK_SEQS = 32
    result.update({
        "chunked_loss": [whole[0], chunked[0]],
        "chunked_grad_max_diff": max(
            float(np.max(np.abs(a - b))) for a, b in zip(whole[1], chunked[1])),
        "chunked_collectives": [whole[2], chunked[2]],
    })

    # Kernel FFNs run per batch shard: a dense stand-in for the sparse op must give the
    # dense model's outputs and statistics, with counters summed over the 8 shards.
    def stand_in(x, w_gate, w_up, w_down, *, config):
        weights = {"w_gate": w_gate, "w_up": w_up, "w_down": w_down}
        out, stats = ffn.dense_counted(x, weights, config.ell_width)
        return out, {**stats, "tail_rows": jnp.ones((), jnp.int32)}

    real_op = pallas_kernels.sparse_gated_mlp_train
    pallas_kernels.sparse_gated_mlp_train = stand_in
    dense = dataclasses.replace(cfg.model, dtype="bfloat16")
    sparse = dataclasses.replace(dense, ffn_impl="sparse")

    def forward(model_cfg, p):
        logits, stats = nnx.merge(train.model_graphdef(model_cfg), p)(
            batch["inputs"], jnp.ones(cfg.model.n_layers, bool))
        return logits.mean() + stats["l1"].mean(), stats

    with jax.set_mesh(mesh8):
        (want, want_stats), (got, got_stats) = [
            jax.jit(forward, static_argnums=0)(c, params) for c in (dense, sparse)]
        # The backward through shard_map must at least trace.
        jax.eval_shape(jax.grad(lambda p: forward(sparse, p)[0]), params)
    result.update({
        "kernel_loss": [float(want), float(got)],
        "kernel_l0": [want_stats["l0"].tolist(), got_stats["l0"].tolist()],
        "kernel_fired_equal": bool(jnp.all(want_stats["fired"] == got_stats["fired"])),
        "kernel_tail_rows": got_stats["tail_rows"].tolist(),
    })

    # The real op (its kernels in the interpreter) per batch shard, forward and
    # backward, against the same op on one device.
    pallas_kernels.sparse_gated_mlp_train = real_op
    grad = jax.jit(jax.value_and_grad(lambda p: forward(sparse, p), has_aux=True))
    with jax.set_mesh(mesh8):
        (loss8, stats8), grads8 = grad(params)
    (loss1, stats1), grads1 = grad(jax.device_put(params, jax.devices()[0]))
    g8, g1 = ([np.asarray(a, np.float32) for a in jax.tree.leaves(jax.device_get(g))]
              for g in (grads8, grads1))
    diff = sum(float(np.sum((a - b) ** 2)) for a, b in zip(g8, g1))
    norm = sum(float(np.sum(b ** 2)) for b in g1)
    result.update({
        "real_loss": [float(loss1), float(loss8)],
        "real_l0": [stats1["l0"].tolist(), stats8["l0"].tolist()],
        "real_fired_equal": bool(np.array_equal(stats1["fired"], stats8["fired"])),
        "real_grad_rel_diff": (diff / norm) ** 0.5,
    })
    print(json.dumps(result))
""")


@pytest.mark.slow
def test_sharded_step_matches_single_device(tmp_path):
    """On 8 simulated CPUs, mesh (data=2, fsdp=4): the train step equals the 1-device
    step, the attention block in chunks of sequences equals it whole, the per-shard
    kernel FFN path equals the dense one, and the sparse training op itself runs per
    shard, forward and backward, as on one device."""
    env = dict(
        os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu"
    )
    root = Path(__file__).resolve().parents[2]
    params_file = tmp_path / "params8.npz"
    proc = subprocess.run(
        [sys.executable, "-c", _SHARDED, str(params_file)],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])

    # The 1-device reference runs here (its compile is shared with the accumulation test).
    cfg = small_config(grad_accum_steps=2)
    before1, after1, m1 = one_step(
        cfg, sharding.make_mesh(1, 1, jax.devices()[:1]), random_batch(cfg)
    )
    with np.load(params_file) as f:
        leaves8 = [f[f"arr_{i}"] for i in range(len(f.files))]
    n = len(jax.tree.leaves(before1))
    before8, after8 = leaves8[:n], leaves8[n:]
    for a, b in zip(jax.tree.leaves(before1), before8, strict=True):
        np.testing.assert_array_equal(a, b)  # same init whatever the sharding
    assert out["loss"] == pytest.approx(m1["loss"], rel=LOSS_RTOL)
    assert out["grad_norm"] == pytest.approx(m1["grad_norm"], rel=GRAD_NORM_RTOL)
    assert update_rel_diff(before8, after8, jax.tree.leaves(after1)) < UPDATE_RTOL
    # [L, N, H] = [2, 256, 64]: N is the largest dimension after the layer axis.
    assert out["w_up_spec"] == str(P(None, "fsdp", None))
    assert out["kernel_loss"][1] == pytest.approx(out["kernel_loss"][0], rel=LOSS_RTOL)
    np.testing.assert_allclose(out["kernel_l0"][1], out["kernel_l0"][0], rtol=1e-6)
    assert out["kernel_fired_equal"]
    # The real sparse op per shard: the same forward, and weight gradients summed over
    # the 8 shards from bf16 partials (a missing or doubled sum would be off by ~1x).
    assert out["real_loss"][1] == pytest.approx(out["real_loss"][0], rel=1e-5)
    np.testing.assert_allclose(out["real_l0"][1], out["real_l0"][0], rtol=1e-6)
    assert out["real_fired_equal"] and out["real_grad_rel_diff"] < 0.03
    assert out["policy_split"] and out["policy_one_device"]
    # The attention block in chunks of one sequence per shard (fp32).
    assert out["chunked_loss"][1] == pytest.approx(out["chunked_loss"][0], rel=1e-6)
    assert out["chunked_grad_max_diff"] < 1e-6
    whole, chunked = out["chunked_collectives"]
    assert chunked == whole > 0
    assert out["kernel_tail_rows"] == [8, 8]


def test_loss_decreases_and_metrics():
    """20 steps on one batch must learn something; metrics are consistent."""
    cfg = small_config()
    mesh = sharding.make_mesh()
    state = train.create_train_state(cfg, mesh)
    step = cached_step(cfg, mesh)  # shared with the grad-accumulation test
    batch = random_batch(cfg)
    losses = []
    for _ in range(20):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    m = train.host_metrics(metrics)
    assert losses[-1] < losses[0] - 0.5, losses
    assert int(state.step) == 20
    n_layers = cfg.model.n_layers
    for key in ("l1", "l0", "sparsity", "alive", "use_sparse"):
        assert m[key].shape == (n_layers,), key
    assert np.all((m["alive"] >= 0) & (m["alive"] <= 1))
    np.testing.assert_allclose(m["sparsity"], 1 - m["l0"] / cfg.model.d_ff, rtol=1e-6)
    assert m["l1_coef"] == pytest.approx(cfg.sparsity.l1_coef)
    assert m["l1_loss"] == pytest.approx(m["loss"] - m["ce"], abs=1e-5)
    assert m["l1_loss"] == pytest.approx(cfg.sparsity.l1_coef * np.mean(m["l1"]), rel=1e-3)
    eval_ce = train.make_eval_step(cfg, mesh)(state.params, batch)
    assert float(eval_ce) < losses[0] - 0.5


def test_twell_cannot_train():
    cfg = with_overrides(small_config(), {"model.ffn_impl": "twell", "model.dtype": "bfloat16"})
    with pytest.raises(ValueError, match="inference-only"):
        train.make_train_step(cfg, sharding.make_mesh())


def test_micro_batch_must_split_over_devices():
    cfg = C.TrainConfig(
        model=small_config().model, batch_size=6, optim=C.OptimConfig(grad_accum_steps=2)
    )
    # The check runs before the mesh's devices are used: an abstract 2-device mesh will do.
    mesh = jax.sharding.AbstractMesh((2, 1), ("data", "fsdp"))
    with pytest.raises(ValueError, match="split evenly"):
        train.make_train_step(cfg, mesh)


def test_abstract_state_matches_created():
    cfg = small_config()
    mesh = sharding.make_mesh()
    abstract = train.abstract_train_state(cfg, mesh)
    state = train.create_train_state(cfg, mesh)
    for a, s in zip(jax.tree.leaves(abstract), jax.tree.leaves(state), strict=True):
        assert a.shape == s.shape and a.dtype == s.dtype
    assert state.tokens_since_fired.shape == (2, 256)
    assert state.use_sparse.dtype == jnp.bool_


def test_state_from_given_params_is_a_fresh_fp32_state():
    cfg = small_config()
    mesh = sharding.make_mesh()
    made = train.create_train_state(cfg, mesh)
    bf16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), made.params)
    state = train.train_state_from_params(cfg, mesh, bf16)
    for a, s in zip(jax.tree.leaves(made), jax.tree.leaves(state), strict=True):
        assert a.shape == s.shape and a.dtype == s.dtype
    for p, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(bf16), strict=True):
        np.testing.assert_array_equal(np.asarray(p), np.asarray(b, np.float32))
    assert int(state.step) == 0 and not bool(state.use_sparse.any())
    jax.block_until_ready(bf16)  # not donated by default: still readable


def test_state_from_params_names_a_wrong_parameter():
    cfg = small_config()
    mesh = sharding.make_mesh()
    params = jax.device_get(train.create_train_state(cfg, mesh).params)
    params["blocks"]["ffn"]["w_up"] = params["blocks"]["ffn"]["w_up"][:, :128]
    with pytest.raises(ValueError, match=r"\['w_up'\]: shape \(2, 128, 64\), the model expects"):
        train.train_state_from_params(cfg, mesh, params)
    del params["blocks"]["ffn"]["w_up"]
    with pytest.raises(ValueError, match=r"\['w_up'\]: shape missing"):
        train.train_state_from_params(cfg, mesh, params)
