"""Frozen configuration dataclasses and presets.

One `TrainConfig` composes `ModelConfig`, `SparsityConfig` and `OptimConfig`. Every
default lives here once; flagfiles and presets only override. `__post_init__` checks
raise `ValueError` naming the offending field; the kernel shape rules are the kernels'
own (`pallas_kernels.twell_supported`, `pallas_kernels.sparse_train_supported`).
Round trips through JSON-friendly dicts and config diffs are `twell_jax.config_io`;
dotted-key overrides ("model.d_ff=1024") are `twell_jax.overrides`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp

import pallas_kernels

FFN_VARIANTS = ("gated_relu", "relu", "gated_silu")
FFN_IMPLS = ("dense", "twell", "sparse", "decode")
L1_TARGETS = ("activations", "weights")
DTYPES = ("float32", "bfloat16", "float16")


def _require(obj: Any, field: str, ok: bool, why: str) -> None:
    """Raises ValueError naming `obj`'s class, the field and its value unless `ok`."""
    if not ok:
        raise ValueError(f"{type(obj).__name__}.{field}={getattr(obj, field)!r}: {why}")


def _require_positive(obj: Any, *fields: str) -> None:
    for field in fields:
        _require(obj, field, 0 < getattr(obj, field) < math.inf, "must be > 0 and finite")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Llama-style transformer with a sparse-able FFN (docs/design.md §7).

    Attributes:
      vocab_size: V, rows of the (tied) embedding.
      d_model: H.
      d_ff: N, FFN hidden width; the kernel FFNs take the widths their kernels support.
      n_layers: L.
      n_heads: query heads; head_dim = d_model / n_heads, even for RoPE.
      n_kv_heads: key / value heads (grouped-query attention: each serves n_heads /
        n_kv_heads query heads); None means n_heads (multi-head attention).
      seq_len: maximum context S.
      rope_theta: RoPE base.
      norm_eps: RMSNorm epsilon.
      init_std: std of the N(0, init_std) init of every matrix.
      tie_embeddings: LM head reuses the embedding matrix.
      ffn_variant: "gated_relu" relu(x Wg^T) * (x Wu^T), "relu" relu(x Wu^T), or
        "gated_silu" silu(x Wg^T) * (x Wu^T) (the dense Llama baseline).
      ffn_impl: "dense" (XLA, exact stats), "twell" (Pallas TwELL inference, no
        gradient), "sparse" (Pallas sparse training kernels, gated_relu only) or
        "decode" (`pallas_kernels.sparse_decode_mlp`: inference on a few tokens per
        call, gated_relu only, bf16 or fp32).
      twell_compression: C of the TwELL format (ffn_impl="twell").
      sparse_ell_width: W of the sparse training op's ELL rows (ffn_impl="sparse"): a
        token with more positive gate entries in a layer goes to the dense tail. The
        ELL residuals the remat policy keeps for the backward take 6 W bytes per token
        per layer (12.6 MB at W=128 and 16384 tokens); any `SparseTrainConfig.ell_width`.
      sparse_save_residuals: with remat and ffn_impl="sparse", keep those ELL
        residuals for the backward (True) or recompute them with the rest of the layer
        (False, as the dense FFN recomputes its activations): 6 W bytes per token per
        layer less at the peak, at the cost of running the layer's sparse forward
        again in the backward. The gradients are the same either way. With the
        batch split over several devices they are always recomputed (the model's
        remat policy: kept ones were all-gathered onto every GPU).
      dtype: compute dtype name.
      param_dtype: master parameter dtype name.
      remat: rematerialise every layer in the backward pass.
    """

    vocab_size: int = 512
    d_model: int = 128
    d_ff: int = 512
    n_layers: int = 4
    n_heads: int = 4
    # A saved config without this key (written before it existed) means None:
    # `ADDED_FIELD_DEFAULTS`.
    n_kv_heads: int | None = None
    seq_len: int = 128
    rope_theta: float = 1e5
    norm_eps: float = 1e-5
    init_std: float = 0.02
    tie_embeddings: bool = True
    ffn_variant: str = "gated_relu"
    ffn_impl: str = "dense"
    # C=2: the fastest 1.5B/2B body on the H200 (docs/design.md §9); it never overflows
    # at ~29 nnz, where C=8 recomputes 0.04% of (token, tile) pairs.
    twell_compression: int = 2
    sparse_ell_width: int = 128
    # A saved config without this key means True: `ADDED_FIELD_DEFAULTS`.
    sparse_save_residuals: bool = True
    dtype: str = "bfloat16"
    param_dtype: str = "float32"
    remat: bool = False

    def __post_init__(self):
        _require_positive(self, "vocab_size", "d_model", "d_ff", "n_layers", "n_heads", "seq_len")
        _require_positive(self, "rope_theta", "norm_eps", "init_std")
        _require(
            self, "ffn_variant", self.ffn_variant in FFN_VARIANTS, f"must be one of {FFN_VARIANTS}"
        )
        _require(self, "ffn_impl", self.ffn_impl in FFN_IMPLS, f"must be one of {FFN_IMPLS}")
        _require(
            self,
            "d_model",
            self.d_model % self.n_heads == 0,
            f"must be divisible by n_heads={self.n_heads}",
        )
        _require(
            self,
            "n_kv_heads",
            self.n_kv_heads is None
            or (self.n_kv_heads > 0 and self.n_heads % self.n_kv_heads == 0),
            f"must be None or a positive divisor of n_heads={self.n_heads}",
        )
        _require(
            self,
            "n_heads",
            self.head_dim % 2 == 0,
            f"head_dim={self.head_dim} must be even for RoPE",
        )
        _require(self, "dtype", self.dtype in DTYPES, f"must be one of {DTYPES}")
        _require(self, "param_dtype", self.param_dtype in DTYPES, f"must be one of {DTYPES}")
        try:
            sparse_config = pallas_kernels.SparseTrainConfig(ell_width=self.sparse_ell_width)
        except ValueError as e:
            _require(self, "sparse_ell_width", False, str(e))
        if self.ffn_impl != "dense":
            kernels = f"with ffn_impl={self.ffn_impl!r}"
            _require(
                self,
                "ffn_impl",
                self.ffn_variant != "gated_silu",
                "needs a ReLU FFN (ffn_variant 'gated_relu' or 'relu'), not 'gated_silu'",
            )
            if self.ffn_impl != "decode":
                _require(self, "dtype", self.dtype == "bfloat16", f"must be 'bfloat16' {kernels}")
        shape = f"d_model={self.d_model}, d_ff={self.d_ff}"
        if self.ffn_impl == "twell":
            reason = pallas_kernels.twell_supported(self.d_model, self.d_ff, self.twell_compression)
            shape += f", twell_compression={self.twell_compression}"
            _require(
                self, "ffn_impl", reason is None, f"the TwELL kernels reject {shape}: {reason}"
            )
        if self.ffn_impl == "decode":
            _require(
                self,
                "ffn_impl",
                self.ffn_variant == "gated_relu",
                "the decode path implements ffn_variant='gated_relu' only",
            )
        if self.ffn_impl == "sparse":
            _require(
                self,
                "ffn_impl",
                self.ffn_variant == "gated_relu",
                "the sparse training kernels implement ffn_variant='gated_relu' only",
            )
            # The token count only caps the tail buckets; any M gives the shape rule.
            reason = pallas_kernels.sparse_train_supported(
                self.seq_len, self.d_model, self.d_ff, sparse_config
            )
            _require(
                self, "ffn_impl", reason is None, f"the sparse kernels reject {shape}: {reason}"
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Key / value heads: n_kv_heads, or n_heads when that is None."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def gated(self) -> bool:
        """Whether the FFN has a gate matrix."""
        return self.ffn_variant != "relu"

    @property
    def compute_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    @property
    def weight_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.param_dtype)


@dataclasses.dataclass(frozen=True)
class SparsityConfig:
    """L1 sparsity objective and dead-neuron handling (docs/design.md §2).

    Attributes:
      l1_coef: lambda of `CE + lambda * mean_layers(mean_tokens(sum_N |h|))`.
      l1_warmup_steps: lambda ramps linearly from 0 over this many steps (0 = constant).
      l1_target: "activations" (the paper) or "weights" (lambda * sum |W| of the FFN
        matrices, mean over layers).
      tokens_until_dead: a neuron is dead when it has not fired for this many tokens;
        None means one global batch (the reference's default).
      reinit_dead_every: every this many steps re-draw the gate rows of dead neurons
        (0 = never).
      sparse_switch: how the per-layer switch's l0 cutoff is set (ffn_impl="sparse"):
        "cost" measures where the sparse op beats dense for the run's layer shape on
        the GPU at start-up (`twell_jax.switch_cost`; without a GPU it keeps
        sparse_l0_cutoff), "l0" uses sparse_l0_cutoff as given.
      sparse_l0_cutoff: with ffn_impl="sparse", a layer runs the sparse kernels only
        while its last measured l0 is below its cutoff (this, moved by
        sparse_hot_shift: `sparsity.l0_cutoff`) and its heavy rows fit the sparse op's
        dense tail (`sparsity.next_use_sparse`).
      sparse_hot_shift: knots (share_1, shift_1, share_2, shift_2, ...), shares
        ascending in [0, 1]: hot neurons (the sparse op's dense block) make the sparse
        step cheaper, so a layer's cutoff moves by the shift (l0 units) interpolated
        linearly at its hot share, held at the end knots. "cost" sets one knot per
        calibration pattern: the uniform one's share with no shift, and each skewed
        one's share at its own crossover with that crossover's distance from the
        uniform one. A saved 3-tuple (low, high, shift), the earlier form, stands for
        the knots (low, 0, high, shift).
      sparse_recheck_every: steps between re-evaluations of that per-layer switch.
    """

    l1_coef: float = 2e-5
    l1_warmup_steps: int = 0
    l1_target: str = "activations"
    tokens_until_dead: int | None = None
    reinit_dead_every: int = 0
    sparse_switch: str = "cost"
    sparse_l0_cutoff: float = 50.0
    sparse_hot_shift: tuple[float, ...] = (0.0, 0.0)
    sparse_recheck_every: int = 20

    def __post_init__(self):
        _require(self, "l1_coef", 0 <= self.l1_coef < math.inf, "must be >= 0 and finite")
        _require(self, "l1_warmup_steps", self.l1_warmup_steps >= 0, "must be >= 0")
        _require(self, "l1_target", self.l1_target in L1_TARGETS, f"must be one of {L1_TARGETS}")
        _require(
            self,
            "tokens_until_dead",
            self.tokens_until_dead is None or self.tokens_until_dead > 0,
            "must be None or > 0",
        )
        _require(self, "reinit_dead_every", self.reinit_dead_every >= 0, "must be >= 0")
        _require(
            self, "sparse_switch", self.sparse_switch in ("cost", "l0"), "must be 'cost' or 'l0'"
        )
        knots = tuple(float(v) for v in self.sparse_hot_shift)
        if len(knots) == 3:  # the earlier (low, high, shift) of saved configs
            knots = (knots[0], 0.0, knots[1], knots[2])
        object.__setattr__(self, "sparse_hot_shift", knots)
        shares = knots[0::2]
        _require(
            self,
            "sparse_hot_shift",
            len(knots) >= 2 and len(knots) % 2 == 0 and all(map(math.isfinite, knots)),
            "needs finite (share, shift) pairs",
        )
        _require(
            self,
            "sparse_hot_shift",
            shares[0] >= 0 and shares[-1] <= 1 and list(shares) == sorted(set(shares)),
            "needs shares ascending in [0, 1]",
        )
        _require_positive(self, "sparse_recheck_every")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warmup then cosine decay to 0 (docs/design.md §7).

    Attributes:
      lr: peak learning rate.
      betas: Adam (b1, b2).
      eps: Adam epsilon.
      weight_decay: decoupled weight decay, not applied to norm scales.
      clip_norm: global gradient-norm clip.
      warmup_steps: linear warmup from 0 to lr.
      total_steps: optimizer steps of the whole run (end of the cosine).
      grad_accum_steps: micro-batches per optimizer step (scanned inside one jit).
    """

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    warmup_steps: int = 600
    total_steps: int = 30000
    grad_accum_steps: int = 1

    def __post_init__(self):
        object.__setattr__(self, "betas", tuple(self.betas))
        _require_positive(self, "lr", "eps", "clip_norm", "total_steps", "grad_accum_steps")
        _require(
            self,
            "betas",
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
            "must be two values in [0, 1)",
        )
        _require(self, "weight_decay", 0 <= self.weight_decay < math.inf, "must be >= 0 and finite")
        _require(
            self,
            "warmup_steps",
            0 <= self.warmup_steps < self.total_steps,
            f"must be in [0, total_steps={self.total_steps})",
        )


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything a training run needs besides data paths.

    Attributes:
      model, sparsity, optim: the component configs.
      batch_size: global batch in sequences per optimizer step (all micro-batches).
      seed: seeds parameter init and dead-neuron re-init.
      mesh_shape: (data, fsdp) device-mesh sizes; one entry may be -1 ("all the rest").
      log_every, eval_every, eval_batches, checkpoint_every: loop cadence in steps.
      ce_chunk_tokens: the LM head and its cross-entropy run over chunks of about this
        many tokens of a micro-batch (`twell_jax.lm_loss`), so that the [tokens, V] fp32
        logits exist one chunk at a time.
    """

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    sparsity: SparsityConfig = dataclasses.field(default_factory=SparsityConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    batch_size: int = 32
    seed: int = 0
    mesh_shape: tuple[int, int] = (-1, 1)
    log_every: int = 10
    eval_every: int = 100
    eval_batches: int = 4
    checkpoint_every: int = 500
    ce_chunk_tokens: int = 4096

    def __post_init__(self):
        object.__setattr__(self, "mesh_shape", tuple(self.mesh_shape))
        # The data order's PRNG takes 32-bit seeds.
        _require(self, "seed", 0 <= self.seed < 2**32, "must be in [0, 2**32)")
        _require_positive(
            self,
            "batch_size",
            "log_every",
            "eval_every",
            "eval_batches",
            "checkpoint_every",
            "ce_chunk_tokens",
        )
        accum = self.optim.grad_accum_steps
        _require(
            self,
            "batch_size",
            self.batch_size % accum == 0,
            f"must be divisible by optim.grad_accum_steps={accum}",
        )
        sizes = self.mesh_shape
        _require(
            self,
            "mesh_shape",
            len(sizes) == 2 and all(s == -1 or s > 0 for s in sizes) and sizes.count(-1) <= 1,
            "must be (data, fsdp) sizes > 0, at most one of them -1",
        )

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.model.seq_len

    @property
    def tokens_until_dead(self) -> int:
        """SparsityConfig.tokens_until_dead with None resolved to one global batch."""
        return self.sparsity.tokens_until_dead or self.tokens_per_step


_PAPER = dict(vocab_size=49152, d_model=2048, d_ff=5632, n_heads=32, seq_len=2048, remat=True)
_MODEL_PRESETS = {
    # CPU default: trains a few hundred steps in minutes on 2 cores, byte-level vocab.
    "tiny": dict(vocab_size=512, d_model=128, d_ff=512, n_layers=4, n_heads=4, seq_len=128),
    # Single-GPU experiment; d_ff = 8/3 * 768, a multiple of 256.
    "125m": dict(vocab_size=49152, d_model=768, d_ff=2048, n_layers=12, n_heads=12, seq_len=1024),
    # Paper sizes (docs/design.md §7).
    "0.5b": dict(_PAPER, n_layers=8),
    "1b": dict(_PAPER, n_layers=18),
    "1.5b": dict(_PAPER, n_layers=28),
    "2b": dict(_PAPER, n_layers=38),
}


def model_preset(name: str, **overrides: Any) -> ModelConfig:
    """Returns the named ModelConfig preset ("tiny", "125m", "0.5b", "1b", "1.5b", "2b").

    Raises:
      ValueError: unknown name.
    """
    if name not in _MODEL_PRESETS:
        raise ValueError(f"model preset {name!r}: must be one of {sorted(_MODEL_PRESETS)}")
    return ModelConfig(**{**_MODEL_PRESETS[name], **overrides})


def train_preset(name: str) -> TrainConfig:
    """A TrainConfig around `model_preset(name)`; "tiny" gets a short CPU schedule.

    The paper sizes use the paper recipe (docs/design.md §7): 512 x 2048-token
    batches, 600 warmup steps, 30000 steps, FSDP over every device.
    """
    model = model_preset(name)
    if name == "tiny":
        return TrainConfig(
            model=model, batch_size=16, optim=OptimConfig(warmup_steps=20, total_steps=300)
        )
    if name == "125m":
        # 128 x 1024 tokens per step in 2 micro-batches: fp32 logits of 64 x 1024 x 49152
        # (13 GB) fit next to the activations on one H200.
        return TrainConfig(
            model=model,
            batch_size=128,
            optim=OptimConfig(warmup_steps=200, total_steps=5000, grad_accum_steps=2),
        )
    # Paper: 1M tokens per step as 8 micro-batches of 8 sequences per GPU on 8 GPUs.
    return TrainConfig(
        model=model, batch_size=512, mesh_shape=(1, -1), optim=OptimConfig(grad_accum_steps=8)
    )
