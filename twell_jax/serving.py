"""Serving weights and the unrolled layer stack that generation runs (docs/design.md §11).

    params = serving_params(params, cfg)      # once, before generating
    model = merge_model(graphdef, params)     # embed, final norm, head
    x, cache_k, cache_v = run_layers(model, params, x, cos, sin, cache_k, cache_v, slot, pad)
    # slot=None: a prefill into empty caches

`serving_params` re-lays a model's parameters for token-by-token decoding:
- the stacked [L, ...] block parameters become a tuple of L per-layer trees, so that a
  layer's weights are whole buffers that the FFN kernels read in place (a slice of the
  stacked arrays would be copied out for them in every layer of every step);
- every matrix is cast to the compute dtype once (cast at use, a decode step would
  read fp32 masters and write bf16 copies of every weight in every step: more bytes
  than the step itself reads);
- the attention projections become two 2-D matrices with H last, as the FFN's are:
  W_q, W_k and W_v stacked into one [(nH + 2 nKV) D, H] matrix (one product instead
  of three), and W_o as [H, nH D]. With the training layout ([H, nH, D] and [nH, D, H])
  a one-token product ran as a reduction over the weight's leading axis, far below the
  memory bandwidth that a GEMV reaches (docs/performance_notes.md, "Generation").
  The attention norm's scale is folded into the stacked matrix's columns (in fp32,
  then rounded once), so that the norm and the product run as one kernel
  (`pallas_kernels.normed_projection`);
- the FFN norm's scale is folded the same way into W_gate's and W_up's columns, and
  the norm's own scale becomes ones: every FFN path sees the same model, and a decode
  step's FFN half (norm, MLP, residual add) runs as the decode op's two kernels
  (`pallas_kernels.sparse_decode_ffn_block`) with nothing between them and the
  next layer.
  The block trees keep empty placeholders for the four attention weights, so that
  `nnx.merge` still builds their norms and FFN.

The math is the model's (`twell_jax.model.Block`): the same products and rounding
points, except the norms: the q, k and v columns of one product instead of three, and
each norm's scale rounded into the weights rather than into the normed x (equal within
bf16 rounding; to fp32 rounding in fp32). A decode step of up to
`normed_projection.MAX_ROWS` tokens runs that product as one kernel on a GPU in bf16,
the norm included. A one-token step runs
its attention block (RoPE, cache update, softmax over the row's slots) through
`pallas_kernels.decode_attention`, and a prefill (`slot=None`: S tokens from slot 0)
through `pallas_kernels.prompt_attention`: one flash-attention kernel per layer on a
GPU in bf16, XLA's attention ops otherwise.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.decode import sparse_decode_ffn_block
from pallas_kernels.decode_attention import cached_attention, decode_attention
from pallas_kernels.normed_projection import fitted_config, kernel_unsupported, normed_projection
from pallas_kernels.prompt_attention import prompt_attention
from twell_jax.config import ModelConfig

Params = dict[str, Any]
ATTENTION_KEY = "attention"
_PLACEHOLDER = ("wq", "wk", "wv", "wo")


def serving_params(params: Params, cfg: ModelConfig) -> Params:
    """`Transformer(cfg)`'s pure-dict params in the serving layout (module docstring):
    new device buffers; params already in that layout are returned as they are.

    Returns {**params, "blocks": L per-layer trees, "attention": L dicts of "wqkv"
    [(nH + 2 nKV) D, H] (column h scaled by the layer's attn_norm scale[h]) and "wo"
    [H, nH D]}, matrices in cfg's compute dtype; each block's ffn w_gate and w_up
    have its ffn_norm scale folded into their columns and that scale is ones."""
    if ATTENTION_KEY in params:
        return params
    dtype = cfg.compute_dtype
    cast = lambda a: a.astype(dtype) if a.ndim >= 2 else a  # norms' scales stay fp32
    blocks, h = params["blocks"], cfg.d_model
    layers, attention = [], []
    for i in range(cfg.n_layers):
        att = jax.tree.map(lambda a, i=i: a[i].astype(jnp.float32), blocks["attn"])
        scale = blocks["attn_norm"]["scale"][i].astype(jnp.float32)
        wqkv = jnp.concatenate([att[k].reshape(h, -1) for k in ("wq", "wk", "wv")], axis=1)
        wqkv = (wqkv * scale[:, None]).T.astype(dtype)  # [F, H], the norm's scale folded in
        wo = att["wo"].reshape(-1, h)  # [nH D, H]
        attention.append({"wqkv": wqkv, "wo": wo.T.astype(dtype)})
        layer = jax.tree.map(lambda a, i=i: cast(a[i]), blocks)
        ffn_scale = blocks["ffn_norm"]["scale"][i].astype(jnp.float32)
        first = {  # the FFN's [N, H] matrices that x multiplies
            k: (blocks["ffn"][k][i].astype(jnp.float32) * ffn_scale[None, :]).astype(dtype)
            for k in ("w_gate", "w_up")
            if k in blocks["ffn"]
        }
        empty = jnp.zeros((0,), dtype)
        layers.append({
            **layer,
            "attn": {k: empty for k in _PLACEHOLDER},
            "ffn": {**layer["ffn"], **first},
            "ffn_norm": {"scale": jnp.ones_like(layer["ffn_norm"]["scale"])},
        })  # fmt: skip
    head = {k: jax.tree.map(cast, v) for k, v in params.items() if k != "blocks"}
    return {**head, "blocks": tuple(layers), ATTENTION_KEY: tuple(attention)}


def merge_model(graphdef: nnx.GraphDef, params: Params):
    """The model from serving params, for its embedding, final norm and head. Its
    stacked blocks are a stub built from the per-layer trees that nothing reads (XLA
    drops it): `run_layers` uses the layers."""
    stub = jax.tree.map(lambda *a: jnp.stack(a), *params["blocks"])
    rest = {k: v for k, v in params.items() if k not in ("blocks", ATTENTION_KEY)}
    return nnx.merge(graphdef, {**rest, "blocks": stub})


def _attention(att: Params, x, cos, sin, cache_k, cache_v, slot, pad, cfg: ModelConfig, impl):
    """The attention block's core for the residual stream x [B, S, H] (normed here):
    (o [B, S, nH D], cache_k, cache_v), the new keys / values written to slots
    slot..slot+S-1 (0..S-1 when slot is None: a prefill)."""
    b, s, h = x.shape
    x2, w = x.reshape(b * s, h), att["wqkv"].astype(x.dtype)
    # A prefill's B x S rows make a GEMM: XLA's product. A decode step's rows go
    # through the kernel where impl and the operands allow it.
    proj_impl = "xla" if slot is None or impl == "xla" else "auto"
    if impl == "interpret" and proj_impl == "auto":
        fits = kernel_unsupported(x2, w, fitted_config(h, w.shape[0])) is None
        proj_impl = "interpret" if fits else "xla"
    y = normed_projection(x2, w, eps=cfg.norm_eps, impl=proj_impl).reshape(b, s, -1)
    if slot is None:  # a prefill: the prompt's own slots 0..S-1
        return prompt_attention(y, cos, sin, cache_k, cache_v, pad, n_heads=cfg.n_heads, impl=impl)
    if x.shape[1] > 1:
        return cached_attention(y, cos, sin, cache_k, cache_v, slot, pad, cfg.n_heads)
    o, cache_k, cache_v = decode_attention(
        y[:, 0], cos[:, 0], sin[:, 0], cache_k, cache_v, slot, pad, n_heads=cfg.n_heads, impl=impl
    )
    return o[:, None], cache_k, cache_v


def run_layers(model, params: Params, x, cos, sin, cache_k, cache_v, slot, pad, *,
               attention: str = "auto"):  # fmt: skip
    """The blocks over x [B, S, H] with the KV cache: new keys / values go to slots
    slot..slot+S-1; query slot q of row b attends to slots pad[b]..q.

    params: `serving_params`' tree; its layers run unrolled.
    cos, sin: [B, S, D / 2] RoPE angles of the rows' positions.
    cache_k, cache_v: L-tuples of [B, T, nKV, D] caches, one buffer per layer.
    slot: int32 scalar, the first new slot; None for a prefill, the prompt written to
      slots 0..S-1 of an empty cache and attended by the prompt-attention kernel over
      those slots only. pad: int32 [B], each row's first real slot.
    attention: the impl of `decode_attention` and `normed_projection` for one-token
      steps and of `prompt_attention` for a prefill ("auto": the kernels on a GPU in
      bf16).
    Returns (final-norm hidden states [B, S, H], cache_k, cache_v).
    """
    cfg = model.cfg
    graphdef = nnx.split(model.blocks)[0]
    off = jnp.zeros((), bool)
    cache_k, cache_v = list(cache_k), list(cache_v)
    for i, (block_state, att) in enumerate(
        zip(params["blocks"], params[ATTENTION_KEY], strict=True)
    ):
        block = nnx.merge(graphdef, block_state)
        o, cache_k[i], cache_v[i] = _attention(
            att, x, cos, sin, cache_k[i], cache_v[i], slot, pad, cfg, attention
        )
        b, s, h = x.shape
        wo = att["wo"].astype(x.dtype)
        x = x + jnp.einsum("bsf,hf->bsh", o, wo)
        if cfg.ffn_impl == "decode":  # norm, MLP and residual add in the decode op
            w = block_state["ffn"]
            x = sparse_decode_ffn_block(x, w["w_gate"], w["w_up"], w["w_down"], eps=cfg.norm_eps)
        else:  # the norm's scale is ones: folded into the weights
            out, _ = block.ffn(block.ffn_norm(x).reshape(b * s, h), off)
            x = x + out.reshape(x.shape)
    return model.final_norm(x), tuple(cache_k), tuple(cache_v)
