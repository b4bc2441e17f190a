"""Autoregressive generation with a preallocated KV cache (docs/design.md §11).

    result = generate.generate(cfg, params, [[1, 2, 3], [4, 5]], max_new_tokens=32,
                               sampling=generate.SamplingConfig(temperature=0.8, top_p=0.9),
                               stop_tokens=(eos_id,))
    result.new_token_ids   # one list per prompt, up to and including its first stop token

A batch of prompts of different lengths is left-padded to P tokens (the longest,
rounded up to a multiple of `PROMPT_BUCKET`). Each
row carries its own RoPE positions (0 at its first real token) and an attention mask
that hides its padding, so a row's logits are the same alone or in any batch up to
float rounding, and greedy decoding gives the same tokens: in fp32; in bf16 two
near-tied logits can swap with the batch (docs/design.md §11). Sampling draws every
row from one key per step, so a sampled row depends on its batch. One jitted prefill
runs the prompts through the model, writing cache slots 0..P-1, and samples the first
token; each jitted decode step feeds the
last token at slot P + t. The cache is one [B, P + max_new_tokens, n_kv_heads,
head_dim] buffer per layer in the compute dtype, updated in place (the step donates
its state). The layers run unrolled over per-layer weight buffers in the compute
dtype, with the attention projections re-laid for one-token products
(`twell_jax.serving`); on a GPU the prefill's attention is one flash-attention kernel
per layer (`pallas_kernels.prompt_attention`) and a decode step's attention block
another (`pallas_kernels.decode_attention`); `attention="xla"` runs XLA's ops for both.

Without a streaming callback the decode steps run in one `lax.while_loop` that stops
when every row has produced a stop token; with one, a Python loop calls the jitted
step and hands each new column of tokens to the callback.

FFN (`ffn`), picked by the tokens per call: "dense" runs the dense XLA FFN everywhere;
"sparse" runs the prefill (B x P tokens) through the TwELL inference kernels
(`ffn_impl="twell"`: a gated ReLU FFN, kernel-supported widths; a bf16 model — with
fp32 compute the prefill stays dense) and the decode steps (B tokens) through
`ffn_impl="decode"` (`pallas_kernels.sparse_decode_ffn_block`: the FFN norm, the gate
GEMV, then only the batch's active rows of W_up and W_down, and the residual add,
docs/design.md §4.5; a non-gated model decodes densely). "auto", for a model
configured with ffn_impl="twell" or "decode", takes the faster path as measured on an
H200 (docs/results.md, "Decode and generation"): the TwELL prefill from
`AUTO_TWELL_PREFILL_TOKENS` prompt tokens up, the dense FFN below that; the decode op
in the decode steps of batches of up to `AUTO_DECODE_OP_MAX_BATCH` prompts (1.28x end
to end at batch 1, 1.05x at batch 8), the dense FFN in larger ones; for any other
model "auto" is "dense" (the sparse training kernels have no inference advantage over
dense, as in `train.make_eval_step`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.decode_attention import IMPLS as ATTENTION_IMPLS
from twell_jax import lm_loss
from twell_jax.config import ModelConfig
from twell_jax.model import check_token_ids, rope_angles
from twell_jax.serving import merge_model, run_layers, serving_params
from twell_jax.train import model_graphdef

Params = dict[str, Any]
FFN_MODES = ("auto", "dense", "sparse")
# The decode kernels (attention block, q / k / v projection, FFN) take these.
GENERATION_DTYPES = ("float32", "bfloat16")
# Generated-token slots after a row's stop token.
NO_TOKEN = -1
# "auto" runs the TwELL prefill from this many prompt tokens (B x P) up: on the 1.5B
# preset the whole prefill took 0.92x the dense one's time at 4096 tokens and 1.07x /
# 1.14x / 1.23x at 8192 / 16384 / 32768 (docs/results.md, "Prefill").
AUTO_TWELL_PREFILL_TOKENS = 8192
# "auto" decodes through the decode op up to this batch: its FFN GPU time is 1.75x /
# 1.11x / 1.12x / 1.04x dense at 1 / 2 / 4 / 8 tokens, generation 1.28x / 1.04x end to
# end at batch 1 / 8 (docs/results.md); above 8 tokens the op runs the dense formula.
AUTO_DECODE_OP_MAX_BATCH = 8
# The prefill runs without XLA's command buffers (CUDA graphs; one prefill is one
# ~1200-node graph with a conditional per TwELL layer): with them the TwELL prefill of
# 8192 prompt tokens ran ~20 ms above its GPU busy time, 0.81-0.82x dense, and
# 1.05-1.07x without (docs/results.md, "Prefill"). The decode steps keep them.
PREFILL_COMPILER_OPTIONS = {"xla_gpu_enable_command_buffer": ""}
# Padded prompt lengths are multiples of this, so that prompts of similar lengths share
# one compiled prefill and decode loop.
PROMPT_BUCKET = 8


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How the next token is drawn from the logits.

    Attributes:
      temperature: softmax temperature; <= 0 means greedy (argmax).
      top_k: sample among the k most likely tokens only (0: no limit).
      top_p: sample among the most likely tokens whose probabilities sum to top_p
        (nucleus sampling; 1: no limit).
      vocab_limit: only ids below this are drawn (a tokenizer smaller than the model's
        padded vocabulary); None: every id.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    vocab_limit: int | None = None

    def __post_init__(self):
        if not np.isfinite(self.temperature):
            raise ValueError(f"SamplingConfig.temperature={self.temperature}: must be finite")
        if not isinstance(self.top_k, (int, np.integer)) or self.top_k < 0:
            raise ValueError(f"SamplingConfig.top_k={self.top_k!r}: must be an int >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingConfig.top_p={self.top_p}: must be in (0, 1]")
        if self.vocab_limit is not None and self.vocab_limit < 1:
            raise ValueError(f"SamplingConfig.vocab_limit={self.vocab_limit}: must be >= 1")


def sample(logits: jax.Array, key: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """Next tokens of fp32 logits [B, V]: int32 [B]."""
    if cfg.vocab_limit is not None:
        logits = jnp.where(jnp.arange(logits.shape[-1]) < cfg.vocab_limit, logits, -jnp.inf)
    if cfg.temperature <= 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / cfg.temperature
    if 0 < cfg.top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, cfg.top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if cfg.top_p < 1:
        ranked = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(ranked, axis=-1)
        # Keep a token while the more likely ones hold less than top_p (the first always).
        kept = jnp.cumsum(probs, axis=-1) - probs < cfg.top_p
        threshold = jnp.min(jnp.where(kept, ranked, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < threshold, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def inference_configs(cfg: ModelConfig, ffn: str = "auto") -> tuple[ModelConfig, ModelConfig]:
    """(prefill, decode) model configs for the `ffn` mode (module docstring); with
    "auto" a TwELL prefill config runs only from `twell_prefill_min_tokens` tokens up
    and a decode-op config only up to `decode_op_max_batch` prompts.

    Raises:
      ValueError: an unknown mode, or "sparse" for a model the TwELL kernels cannot run
        (the ModelConfig error names why).
    """
    if ffn not in FFN_MODES:
        raise ValueError(f"ffn={ffn!r}: must be one of {FFN_MODES}")
    dense = dataclasses.replace(cfg, ffn_impl="dense", remat=False)
    auto_sparse = ffn == "auto" and cfg.ffn_impl in ("twell", "decode")
    if ffn == "sparse" or auto_sparse:
        # The decode path is gated only; a non-gated ReLU model decodes densely.
        decode = dataclasses.replace(dense, ffn_impl="decode") if cfg.gated else dense
        if cfg.dtype != "bfloat16":  # the TwELL kernels are bf16; the decode path is not
            return dense, decode
        return dataclasses.replace(dense, ffn_impl="twell"), decode
    return dense, dense


def twell_prefill_min_tokens(ffn: str) -> int:
    """Prompt tokens (B x P) from which a TwELL prefill config runs: 0 for "sparse"."""
    return AUTO_TWELL_PREFILL_TOKENS if ffn == "auto" else 0


def decode_op_max_batch(ffn: str) -> int | None:
    """Prompts per batch up to which a decode-op config runs (None: any batch)."""
    return AUTO_DECODE_OP_MAX_BATCH if ffn == "auto" else None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """Everything a decode step reads and writes (a pytree; the step donates it).

    Attributes:
      cache_k, cache_v: L-tuples of [B, T, nKV, D] compute dtype, T = P + max_new_tokens
        (one buffer per layer, updated in place).
      pad: [B] int32, left padding of each row (its first real slot).
      last: [B] int32, the token the next step feeds.
      tokens: [B, max_new_tokens] int32, generated so far (`NO_TOKEN` after a stop).
      step: int32 scalar, tokens generated so far (the next step writes `last`'s keys
        and values to slot P + step - 1).
      done: [B] bool, the row has produced a stop token.
      key: PRNG key of the sampler.
    """

    cache_k: tuple[jax.Array, ...]
    cache_v: tuple[jax.Array, ...]
    pad: jax.Array
    last: jax.Array
    tokens: jax.Array
    step: jax.Array
    done: jax.Array
    key: jax.Array


def _embed(model, tokens: jax.Array) -> jax.Array:
    return jnp.take(model.embed[...], tokens, axis=0).astype(model.cfg.compute_dtype)


def _record(state: DecodeState, token: jax.Array, stop: jax.Array) -> DecodeState:
    """Writes `token` [B] as generated token number `state.step` and advances."""
    new = jnp.where(state.done, NO_TOKEN, token)
    tokens = jax.lax.dynamic_update_slice(state.tokens, new[:, None], (0, state.step))
    done = state.done | jnp.isin(token, stop)
    return dataclasses.replace(state, last=token, tokens=tokens, step=state.step + 1, done=done)


@functools.cache
def _compiled(
    prefill_cfg: ModelConfig,
    decode_cfg: ModelConfig,
    sampling: SamplingConfig,
    min_prefill_tokens: int = 0,
    max_decode_batch: int | None = None,
    attention: str = "auto",
):
    """Jitted (prefill, step, loop) for one model / sampling setup (one compile per
    shape); a prefill of fewer than `min_prefill_tokens` tokens, and the decode steps of
    a batch larger than `max_decode_batch` (None: no limit), run the dense FFN; the
    attention runs `prompt_attention` (prefill) and `decode_attention` (decode steps)
    with impl `attention`."""
    prefill_def, decode_def = model_graphdef(prefill_cfg), model_graphdef(decode_cfg)
    dense_def = model_graphdef(dataclasses.replace(prefill_cfg, ffn_impl="dense"))
    cfg = decode_cfg

    def prefill(params, tokens, pad, max_new, key, stop):
        b, p = tokens.shape  # static: the FFN path is picked at trace time
        model = merge_model(prefill_def if b * p >= min_prefill_tokens else dense_def, params)
        cols = jnp.arange(p)
        cos, sin = rope_angles(jnp.maximum(cols - pad[:, None], 0), cfg.head_dim, cfg.rope_theta)
        shape = (b, p + max_new, cfg.kv_heads, cfg.head_dim)
        cache = tuple(jnp.zeros(shape, cfg.compute_dtype) for _ in range(cfg.n_layers))
        x, cache_k, cache_v = run_layers(
            model,
            params,
            _embed(model, tokens),
            cos,
            sin,
            cache,
            cache,
            None,  # a prefill
            pad,
            attention=attention,
        )
        key, sub = jax.random.split(key)
        first = sample(lm_loss.logits(x[:, -1], model.head_weight()), sub, sampling)
        state = DecodeState(
            cache_k=cache_k,
            cache_v=cache_v,
            pad=pad,
            last=first,
            tokens=jnp.full((b, max_new), NO_TOKEN, jnp.int32),
            step=jnp.zeros((), jnp.int32),
            done=jnp.zeros((b,), bool),
            key=key,
        )
        return _record(state, first, stop)

    def step(params, state, stop):
        b = state.last.shape[0]  # static: the FFN path is picked at trace time
        fits = max_decode_batch is None or b <= max_decode_batch
        model = merge_model(decode_def if fits else dense_def, params)
        t = state.cache_k[0].shape[1]
        slot = t - state.tokens.shape[1] + state.step - 1  # P + step - 1: `last`'s slot
        pos = (slot - state.pad)[:, None]  # [B, 1]
        cos, sin = rope_angles(pos, cfg.head_dim, cfg.rope_theta)
        x, cache_k, cache_v = run_layers(
            model,
            params,
            _embed(model, state.last[:, None]),
            cos,
            sin,
            state.cache_k,
            state.cache_v,
            slot,
            state.pad,
            attention=attention,
        )
        key, sub = jax.random.split(state.key)
        token = sample(lm_loss.logits(x[:, 0], model.head_weight()), sub, sampling)
        state = dataclasses.replace(state, cache_k=cache_k, cache_v=cache_v, key=key)
        return _record(state, token, stop)

    def loop(params, state, stop):
        def more(s):
            return (s.step < s.tokens.shape[1]) & ~jnp.all(s.done)

        return jax.lax.while_loop(more, lambda s: step(params, s, stop), state)

    return (
        jax.jit(prefill, static_argnames="max_new", compiler_options=PREFILL_COMPILER_OPTIONS),
        jax.jit(step, donate_argnums=1),
        jax.jit(loop, donate_argnums=1),
    )


def generation_fns(
    cfg: ModelConfig,
    ffn: str = "auto",
    sampling: SamplingConfig = SamplingConfig(),
    attention: str = "auto",
):
    """The jitted (prefill, step, loop) that `generate` runs, for timing them apart.

    Their params are `serving_params(params, cfg)`.
    prefill(params, tokens [B, P], pad [B], max_new (static), key, stop) -> DecodeState
    with the first new token; loop(params, state, stop) runs the remaining decode steps
    (donating state); step(params, state, stop) is one of them.

    Raises:
      ValueError: an unknown `ffn` or `attention`.
    """
    if attention not in ATTENTION_IMPLS:
        raise ValueError(f"attention={attention!r}: must be one of {ATTENTION_IMPLS}")
    return _compiled(
        *inference_configs(cfg, ffn),
        sampling,
        twell_prefill_min_tokens(ffn),
        decode_op_max_batch(ffn),
        attention,
    )


@dataclasses.dataclass(frozen=True)
class Generation:
    """What `generate` returns, one entry per prompt.

    Attributes:
      prompt_ids: the prompts as given.
      new_token_ids: the generated ids, up to and including the first stop token.
    """

    prompt_ids: list[list[int]]
    new_token_ids: list[list[int]]


def _left_pad(prompts: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Prompts -> (tokens int32 [B, P] right-aligned, pad int32 [B]); padding id 0.

    P is the longest prompt rounded up to a multiple of `PROMPT_BUCKET`.
    """
    p = -(-max(len(row) for row in prompts) // PROMPT_BUCKET) * PROMPT_BUCKET
    tokens = np.zeros((len(prompts), p), np.int32)
    for b, row in enumerate(prompts):
        tokens[b, p - len(row) :] = row
    return tokens, np.asarray([p - len(row) for row in prompts], np.int32)


def _check_inputs(
    cfg: ModelConfig, prompts: list[list[int]], max_new_tokens: int, stop_tokens: list[int]
) -> None:
    """Host-side checks before anything is jitted (jitted code cannot raise on values)."""
    if cfg.dtype not in GENERATION_DTYPES:
        raise ValueError(
            f"ModelConfig.dtype={cfg.dtype!r}: generation computes in one of {GENERATION_DTYPES}"
        )
    check_token_ids(np.asarray(stop_tokens, np.int64), cfg.vocab_size, name="stop_tokens")
    if not prompts:
        raise ValueError("no prompts")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}: must be >= 1")
    for b, row in enumerate(prompts):
        if not row:
            raise ValueError(f"prompt {b} is empty: a prompt needs at least one token")
        check_token_ids(np.asarray(row), cfg.vocab_size, name=f"prompts[{b}]")
    longest = max(len(row) for row in prompts)
    if longest + max_new_tokens > cfg.seq_len:
        raise ValueError(
            f"the longest prompt ({longest} tokens) + max_new_tokens={max_new_tokens} exceeds "
            f"the model's context seq_len={cfg.seq_len}"
        )


def _trim(tokens: np.ndarray) -> list[list[int]]:
    """Generated [B, max_new] -> per-row lists without the `NO_TOKEN` tail."""
    return [[int(t) for t in row if t != NO_TOKEN] for row in tokens]


def generate(
    cfg: ModelConfig,
    params: Params,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    sampling: SamplingConfig = SamplingConfig(),
    stop_tokens: Sequence[int] = (),
    seed: int = 0,
    ffn: str = "auto",
    attention: str = "auto",
    on_tokens: Callable[[np.ndarray], None] | None = None,
) -> Generation:
    """Generates up to `max_new_tokens` after each prompt (module docstring).

    Args:
      cfg: the model config; params: `Transformer(cfg)`'s pure-dict parameters.
      prompts: B token-id lists, each non-empty, any lengths.
      max_new_tokens: tokens to generate per prompt; the longest prompt plus this must
        fit in cfg.seq_len.
      sampling: greedy by default.
      stop_tokens: a row stops after producing one of these ids.
      seed: PRNG seed of the sampler.
      ffn: "auto", "dense" or "sparse" (module docstring).
      attention: the impl of the prefill's and the decode steps' attention
        (`pallas_kernels.prompt_attention`, `pallas_kernels.decode_attention`; "auto":
        their kernels on a GPU in bf16, XLA's ops otherwise).
      on_tokens: streaming: called with each new column of tokens, int32 numpy [B]
        (`NO_TOKEN` for rows already stopped), as soon as it is produced.

    Returns:
      A `Generation`.

    Raises:
      ValueError: an empty prompt list or prompt, a prompt or stop id outside [0,
        vocab_size) (named with its position), too long a generation, a compute dtype
        other than float32 or bfloat16, or an unusable `ffn`.
    """
    prompts = [[int(t) for t in row] for row in prompts]
    stop_tokens = [int(t) for t in stop_tokens]
    _check_inputs(cfg, prompts, max_new_tokens, stop_tokens)
    prefill, step, loop = generation_fns(cfg, ffn, sampling, attention)
    params = serving_params(params, cfg)
    tokens, pad = _left_pad(prompts)
    stop = jnp.asarray(stop_tokens, jnp.int32)
    key = jax.random.key(seed)
    state = prefill(params, tokens, pad, max_new_tokens, key, stop)
    if on_tokens is None:
        state = loop(params, state, stop)
    else:
        on_tokens(np.asarray(state.tokens[:, 0]))
        for t in range(1, max_new_tokens):
            if bool(np.all(np.asarray(state.done))):
                break
            state = step(params, state, stop)
            on_tokens(np.asarray(state.tokens[:, t]))
    return Generation(prompt_ids=prompts, new_token_ids=_trim(np.asarray(state.tokens)))
