r"""End-to-end generation: prefill, then KV-cache decode, dense FFNs against sparse ones.

    python -m experiments.benchmark --mode=generate --model_presets=1.5b \
        --generate_batch=1,8,64 --out=results/generate_1.5b_h200.json

One bf16 model with synthetic sparsity (`twell_jax.synthetic.synthetic_sparse_params`,
~nnz positive gate entries per token and layer) generates greedily from random prompts
of `prompt_len` tokens, `new_tokens` per row, no stop token (every step runs), through
`twell_jax.generate.generation_fns` with ffn="dense" and ffn="sparse" (prefill through
the TwELL kernels, decode steps through `pallas_kernels.sparse_decode_mlp`). Each round
times the prefill and the decode loop of both, alternating (docs/design.md §8);
medians over rounds. Decode tokens/s counts the B x (new_tokens - 1) tokens of the
loop (the first new token comes out of the prefill).

`attentions` lists the attention impls of the prefill and the decode steps
to run: the first one gives the main keys; each other one runs both FFNs in the same
rotation, under keys named after it (`dense_xla_attention_decode_ms`, ...), with its
own dense / sparse ratio and each FFN's time over the first impl's.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from experiments import bench_util as bu
from twell_jax import generate
from twell_jax.config import model_preset
from twell_jax.synthetic import synthetic_sparse_params

FFNS = ("dense", "sparse")


def _timed(fn, *args):
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return out, (time.perf_counter() - start) * 1e3


def _step_profile(prefill, loop, params, prefill_args, stop, steps: int) -> dict:
    """One traced decode loop of `steps` steps: per step, the GPU's busy and span µs and
    kernel launches, and the 40 costliest kernels (launches and mean µs per step)."""
    state = jax.block_until_ready(prefill(params, *prefill_args))
    events = bu.trace_events(lambda: loop(params, state, stop))
    line = bu.gpu_timeline(events)
    table = bu.kernel_table(events, steps)
    return {
        **{f"{k}_per_step": line[k] / steps for k in ("kernels", "busy_us", "span_us")},
        "kernels_per_step_by_name": dict(list(table.items())[:40]),
    }


def _prefill_profile(prefill, params, prefill_args) -> dict:
    """One traced prefill: the GPU's busy and span µs, kernel launches, and the 30
    costliest kernels (launches and mean µs)."""
    jax.block_until_ready(prefill(params, *prefill_args))
    events = bu.trace_events(lambda: prefill(params, *prefill_args))
    return {
        **bu.gpu_timeline(events),
        "kernels_by_name": dict(list(bu.kernel_table(events, 1).items())[:30]),
    }


def _path_name(ffn: str, attention: str, attentions: Sequence[str]) -> str:
    return ffn if attention == attentions[0] else f"{ffn}_{attention}_attention"


def case(
    cfg,
    params,
    batch: int,
    prompt_len: int,
    new_tokens: int,
    reps: int,
    kernel_trace: bool = False,
    attentions: Sequence[str] = ("auto",),
) -> dict:
    """One batch size: prefill and decode ms, decode tokens/s and ratios of both FFNs
    (under each of `attentions`); with kernel_trace also each FFN's decode step and
    prefill as the GPU ran them with the first attention (`_step_profile`,
    `_prefill_profile`)."""
    rng = np.random.default_rng(batch)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, prompt_len)), jnp.int32)
    pad = jnp.zeros((batch,), jnp.int32)
    stop = jnp.zeros((0,), jnp.int32)
    key = jax.random.key(0)
    fns = {
        _path_name(ffn, att, attentions): generate.generation_fns(cfg, ffn, attention=att)
        for att in attentions
        for ffn in FFNS
    }
    params = generate.serving_params(params, cfg)
    times = {path: {"prefill": [], "decode": []} for path in fns}
    generated = {}
    for rnd in range(reps + 1):  # round 0 compiles and warms up
        for path, (prefill, _, loop) in fns.items():
            state, t_prefill = _timed(prefill, params, tokens, pad, new_tokens, key, stop)
            state, t_decode = _timed(loop, params, state, stop)
            if rnd:
                times[path]["prefill"].append(t_prefill)
                times[path]["decode"].append(t_decode)
            generated[path] = np.asarray(state.tokens)
    decoded = batch * (new_tokens - 1)
    rec = {"batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens, "reps": reps}
    rec["attentions"] = list(attentions)
    for path in fns:
        for part in ("prefill", "decode"):
            rec[f"{path}_{part}_ms"] = float(np.median(times[path][part]))
        rec[f"{path}_decode_tokens_per_s"] = decoded / (rec[f"{path}_decode_ms"] * 1e-3)
    ratio = lambda a, b, part="decode": float(
        np.median(np.asarray(times[a][part]) / np.asarray(times[b][part]))
    )
    rec["decode_speedup"] = ratio("dense", "sparse")
    rec["prefill_speedup"] = ratio("dense", "sparse", "prefill")
    for att in attentions[1:]:
        dense, sparse = (_path_name(ffn, att, attentions) for ffn in FFNS)
        rec[f"decode_speedup_{att}_attention"] = ratio(dense, sparse)
        rec[f"prefill_speedup_{att}_attention"] = ratio(dense, sparse, "prefill")
        for ffn, path in (("dense", dense), ("sparse", sparse)):
            for part in ("decode", "prefill"):
                rec[f"{ffn}_{part}_{att}_attention_over_{attentions[0]}"] = ratio(path, ffn, part)
    same = generated["dense"] == generated["sparse"]
    rec["same_tokens_fraction"] = float(same.mean())
    rec["rows_identical"] = int(same.all(axis=1).sum())
    if kernel_trace:
        for ffn in FFNS:
            prefill, _, loop = fns[ffn]
            prefill_args = (tokens, pad, new_tokens, key, stop)
            rec[f"{ffn}_step_profile"] = _step_profile(
                prefill, loop, params, prefill_args, stop, new_tokens - 1
            )
            rec[f"{ffn}_prefill_profile"] = _prefill_profile(prefill, params, prefill_args)
    return rec


def run(
    presets: Sequence[str],
    batches: Sequence[int],
    *,
    nnz: float = 29.0,
    prompt_len: int = 512,
    new_tokens: int = 256,
    reps: int = 5,
    kernel_trace: bool = False,
    attentions: Sequence[str] = ("auto",),
) -> list[dict]:
    """One `case` record per preset and batch size (JSON-able), printed as it completes."""
    records = []
    for preset in presets:
        params, calib_l0 = synthetic_sparse_params(preset, nnz)
        cfg = model_preset(preset)
        head = {"preset": preset, "target_nnz": nnz, "calibration_l0_mean": float(calib_l0.mean())}
        for batch in batches:
            rec = case(cfg, params, batch, prompt_len, new_tokens, reps, kernel_trace, attentions)
            records.append({**head, **rec})
            print(json.dumps(records[-1]), flush=True)
        del params
    return records
