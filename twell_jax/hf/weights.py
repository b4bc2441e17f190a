"""HF Llama safetensors <-> our pure-dict parameters (docs/design.md §11).

Weights are model.safetensors, or model-*.safetensors shards listed in
model.safetensors.index.json, in fp32, bf16 or fp16. HF nn.Linear weights are
[out, in]; ours (`twell_jax.model`):

    q_proj [nH*D, H] -> wq [H, nH, D]      k_proj, v_proj [nKV*D, H] -> wk, wv [H, nKV, D]
    o_proj [H, nH*D] -> wo [nH, D, H]      gate_proj, up_proj [N, H] -> w_gate, w_up [N, H]
    down_proj [H, N] -> w_down [N, H]      (transposed: out = h @ w_down)

and the per-layer tensors stack into the leading [L] axis. HF's RoPE rotates the two
halves of each head ("rotate_half"), as `model.apply_rope` does, so q and k need no
permutation. Reading converts one tensor at a time (safetensors' numpy API) and places
each parameter on its device(s) before the next, so the model never sits twice in host
memory; writing holds one shard at a time.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import stat
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from twell_jax import sharding
from twell_jax.config import DTYPES, ModelConfig
from twell_jax.hf.config_map import CONFIG_FILE, config_from_hf, config_to_hf, read_config
from twell_jax.model import Transformer

Params = dict[str, Any]

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# HF's default shard size: files up to 5 GB.
DEFAULT_SHARD_BYTES = 5 * 10**9
# Non-persistent buffers that old exports contain; recomputed from the config.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _safetensors():
    """Imports the optional `safetensors` package with an actionable error."""
    try:
        import safetensors
        import safetensors.numpy
    except ImportError as e:
        raise ImportError(
            "HF checkpoints need the `safetensors` package: pip install -e '.[hf]'"
        ) from e
    return safetensors


# ------------------------------------------------------------------------- tensor map


@dataclasses.dataclass(frozen=True)
class _Tensor:
    """One of our parameters and its HF tensor(s).

    Attributes:
      path: key path in our pure-dict params.
      hf_name: HF tensor name, with "{i}" for the layer of a stacked block parameter.
      to_ours, to_hf: one layer's (or the unstacked) HF array -> ours, and back.
    """

    path: tuple[str, ...]
    hf_name: str
    to_ours: Callable[[Any], Any]
    to_hf: Callable[[Any], Any]

    @property
    def stacked(self) -> bool:
        return "{i}" in self.hf_name


def _tensor_map(cfg: ModelConfig) -> list[_Tensor]:
    """Every parameter of `Transformer(cfg)` with its HF name and layout conversions."""
    h, d = cfg.d_model, cfg.head_dim
    same = lambda w: w
    transpose = lambda w: w.T

    def heads_in(k):  # [k*D, H] <-> [H, k, D]
        return (lambda w: w.T.reshape(h, k, d), lambda w: w.reshape(h, k * d).T)

    heads_out = (lambda w: w.T.reshape(cfg.n_heads, d, h), lambda w: w.reshape(-1, h).T)
    layer = "model.layers.{i}."
    tensors = [
        _Tensor(("embed",), "model.embed_tokens.weight", same, same),
        _Tensor(("final_norm", "scale"), "model.norm.weight", same, same),
        _Tensor(("blocks", "attn_norm", "scale"), layer + "input_layernorm.weight", same, same),
        _Tensor(
            ("blocks", "ffn_norm", "scale"), layer + "post_attention_layernorm.weight", same, same
        ),
        _Tensor(
            ("blocks", "attn", "wq"), layer + "self_attn.q_proj.weight", *heads_in(cfg.n_heads)
        ),
        _Tensor(
            ("blocks", "attn", "wk"), layer + "self_attn.k_proj.weight", *heads_in(cfg.kv_heads)
        ),
        _Tensor(
            ("blocks", "attn", "wv"), layer + "self_attn.v_proj.weight", *heads_in(cfg.kv_heads)
        ),
        _Tensor(("blocks", "attn", "wo"), layer + "self_attn.o_proj.weight", *heads_out),
        _Tensor(("blocks", "ffn", "w_gate"), layer + "mlp.gate_proj.weight", same, same),
        _Tensor(("blocks", "ffn", "w_up"), layer + "mlp.up_proj.weight", same, same),
        _Tensor(("blocks", "ffn", "w_down"), layer + "mlp.down_proj.weight", transpose, transpose),
    ]
    if not cfg.tie_embeddings:
        tensors.append(_Tensor(("lm_head",), "lm_head.weight", same, same))
    return tensors


def _names(t: _Tensor, cfg: ModelConfig) -> list[str]:
    """The HF names of `t`: one per layer when stacked."""
    return [t.hf_name.format(i=i) for i in range(cfg.n_layers)] if t.stacked else [t.hf_name]


def abstract_params(cfg: ModelConfig) -> Params:
    """`Transformer(cfg)`'s pure-dict parameters as jax.ShapeDtypeStruct (nothing allocated)."""
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def _get(tree: Mapping, path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _put(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


# --------------------------------------------------------------------------- reading


class _Reader:
    """The tensors of an HF checkpoint directory, each read on request (a context manager)."""

    def __init__(self, hf_dir: str | os.PathLike):
        self.dir = Path(hf_dir)
        self._safe_open = _safetensors().safe_open
        self._open: dict[str, Any] = {}
        self._keys: dict[str, set[str]] = {}  # the tensors each open file holds
        if (self.dir / INDEX_FILE).is_file():
            try:
                self.weight_map = json.loads((self.dir / INDEX_FILE).read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{self.dir / INDEX_FILE}: corrupt index: {e!r}") from e
        elif (self.dir / WEIGHTS_FILE).is_file():
            names = self._file(WEIGHTS_FILE).keys()
            self.weight_map = dict.fromkeys(names, WEIGHTS_FILE)
        else:
            raise FileNotFoundError(f"{self.dir}: neither {WEIGHTS_FILE} nor {INDEX_FILE}")

    def _file(self, name: str) -> Any:
        if name not in self._open:
            path = self.dir / name
            if not path.is_file():
                raise FileNotFoundError(f"{path}: listed in {INDEX_FILE} but missing")
            try:
                self._open[name] = self._safe_open(str(path), framework="np").__enter__()
            except Exception as e:  # safetensors raises its own SafetensorError
                raise ValueError(f"{path}: not a readable safetensors file: {e}") from e
            self._keys[name] = set(self._open[name].keys())
        return self._open[name]

    def _file_of(self, name: str) -> Any:
        """The open file that the index says holds tensor `name`."""
        if name not in self.weight_map:
            raise ValueError(f"{self.dir}: no tensor {name!r}, which the config implies")
        f = self._file(self.weight_map[name])
        if name not in self._keys[self.weight_map[name]]:
            raise ValueError(
                f"{self.dir / self.weight_map[name]}: no tensor {name!r}, which "
                f"{INDEX_FILE} places there"
            )
        return f

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of tensor `name`, from the file's header (no data is read)."""
        return tuple(self._file_of(name).get_slice(name).get_shape())

    def get(self, name: str) -> np.ndarray:
        """The tensor `name` as a numpy array in its stored dtype."""
        return self._file_of(name).get_tensor(name)

    def __enter__(self) -> _Reader:
        return self

    def __exit__(self, *exc) -> None:
        for f in self._open.values():
            f.__exit__(None, None, None)
        self._open.clear()


def _check_names(names: set[str], cfg: ModelConfig) -> None:
    """Raises ValueError listing the stored tensors our model has no place for."""
    known = {n for t in _tensor_map(cfg) for n in _names(t, cfg)}
    if cfg.tie_embeddings:
        known.add("lm_head.weight")  # HF ignores a stored head when tied, and so do we
    unknown = sorted(n for n in names - known if not n.endswith(_IGNORED_SUFFIXES))
    if unknown:
        raise ValueError(
            f"{len(unknown)} stored tensor(s) have no place in our model (biases, another "
            f"architecture or more layers than num_hidden_layers?): {unknown[:8]}"
        )


def _layer_struct(t: _Tensor, param: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    """One layer of a stacked parameter (the parameter itself when unstacked)."""
    return jax.ShapeDtypeStruct(param.shape[1:] if t.stacked else param.shape, param.dtype)


def _hf_shape(t: _Tensor, layer: jax.ShapeDtypeStruct) -> tuple[int, ...]:
    """The HF tensor shape of one layer of `t` (traced: nothing allocated)."""
    return tuple(jax.eval_shape(t.to_hf, layer).shape)


def _shape_error(reader: _Reader, name: str, shape: tuple[int, ...], want: tuple[int, ...]):
    return ValueError(
        f"{reader.dir}: tensor {name!r} has shape {list(shape)}; config.json implies {list(want)}"
    )


def check_params(hf_dir: str | os.PathLike, cfg: ModelConfig) -> None:
    """Checks `hf_dir`'s safetensors against `cfg` from their headers alone: every tensor
    of `Transformer(cfg)` present in its shape, none left over, every file readable.

    Raises:
      FileNotFoundError: no weights in `hf_dir`, or a file its index lists is missing.
      ValueError: a corrupt file or index, a tensor missing, misshapen or left over.
    """
    abstract = abstract_params(cfg)
    with _Reader(hf_dir) as reader:
        _check_names(set(reader.weight_map), cfg)
        for t in _tensor_map(cfg):
            want = _hf_shape(t, _layer_struct(t, _get(abstract, t.path)))
            for name in _names(t, cfg):
                if (shape := reader.shape(name)) != want:
                    raise _shape_error(reader, name, shape, want)


def load_params(
    hf_dir: str | os.PathLike, cfg: ModelConfig, mesh: jax.sharding.Mesh | None = None
) -> Params:
    """Our pure-dict parameters from the safetensors of `hf_dir`, in cfg.param_dtype.

    Each parameter is assembled on the host from its HF tensors (one layer at a time),
    then placed: with `mesh`, by `sharding.tree_shardings` (the training layout;
    every process reads the files), else on the default device.

    Raises:
      FileNotFoundError: no weights in `hf_dir`.
      ValueError: a tensor missing, shaped unlike `cfg` implies, or left over.
    """
    abstract = abstract_params(cfg)
    shardings = sharding.tree_shardings(abstract, mesh) if mesh is not None else None
    params: Params = {}
    with _Reader(hf_dir) as reader:
        _check_names(set(reader.weight_map), cfg)
        for t in _tensor_map(cfg):
            want = _get(abstract, t.path)
            layer = _layer_struct(t, want)
            host = np.empty(want.shape, want.dtype)
            for i, name in enumerate(_names(t, cfg)):
                w = reader.get(name)
                if tuple(w.shape) != _hf_shape(t, layer):
                    raise _shape_error(reader, name, tuple(w.shape), _hf_shape(t, layer))
                converted = t.to_ours(w).astype(want.dtype)
                if t.stacked:
                    host[i] = converted
                else:
                    host[...] = converted
            target = _get(shardings, t.path) if shardings is not None else None
            _put(params, t.path, jax.device_put(host, target))
            del host  # the device copy is the only one from here on
    return params


def load_checkpoint(
    hf_dir: str | os.PathLike, mesh: jax.sharding.Mesh | None = None, **overrides: Any
) -> tuple[ModelConfig, Params]:
    """(`config_from_hf(config.json, **overrides)`, `load_params`) of an HF directory."""
    cfg = config_from_hf(read_config(hf_dir), **overrides)
    return cfg, load_params(hf_dir, cfg, mesh)


# --------------------------------------------------------------------------- writing


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One HF tensor to write: layer `layer` of our parameter `tensor` (None: unstacked)."""

    name: str
    tensor: _Tensor
    layer: int | None
    nbytes: int


def _entries(cfg: ModelConfig, dtype: str) -> list[_Entry]:
    """Every HF tensor of `Transformer(cfg)` saved in `dtype`, in file order."""
    abstract = abstract_params(dataclasses.replace(cfg, param_dtype=dtype))
    entries = []
    for t in _tensor_map(cfg):
        layer = _layer_struct(t, _get(abstract, t.path))
        nbytes = math.prod(_hf_shape(t, layer)) * layer.dtype.itemsize
        for i, name in enumerate(_names(t, cfg)):
            entries.append(_Entry(name, t, i if t.stacked else None, nbytes))
    return entries


def _plan_shards(entries: list[_Entry], max_bytes: int) -> list[list[_Entry]]:
    """Entries grouped in order into shards of at most `max_bytes` (a larger one alone)."""
    shards: list[list[_Entry]] = [[]]
    size = 0
    for e in entries:
        if shards[-1] and size + e.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    return shards


def _host_tensor(e: _Entry, params: Params, dtype: np.dtype) -> np.ndarray:
    """The HF tensor of `e` as a C-contiguous numpy array (only that layer is fetched)."""
    leaf = _get(params, e.tensor.path)
    part = leaf if e.layer is None else leaf[e.layer]
    return np.ascontiguousarray(e.tensor.to_hf(np.asarray(jax.device_get(part))).astype(dtype))


def check_export_dir(hf_dir: str | os.PathLike) -> None:
    """Raises FileExistsError unless `hf_dir` is new or empty (what `save_checkpoint`
    writes into; an exporter can check it before loading anything)."""
    out = Path(hf_dir)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} is a file; export into a new or empty directory")
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if held:
        shown = ", ".join(held[:3]) + (", ..." if len(held) > 3 else "")
        raise FileExistsError(
            f"{out} is not empty (it holds {shown}); export into a new or empty directory"
        )


def save_checkpoint(
    hf_dir: str | os.PathLike,
    cfg: ModelConfig,
    params: Params,
    dtype: str | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    **token_ids: int | list[int] | None,
) -> list[Path]:
    """Writes `params` of `Transformer(cfg)` as an HF Llama checkpoint directory.

    One model.safetensors if it fits in `max_shard_bytes`, else model-0000k-of-0000n
    shards and model.safetensors.index.json; then config.json (`config_to_hf`). Each
    tensor is fetched from its device(s) when its shard is written (multi-host params
    must be fully addressable).

    Args:
      hf_dir: a new or empty directory.
      cfg, params: the model; params as `Transformer(cfg)`'s pure dict (any float dtype).
      dtype: tensor dtype name ("float32", "bfloat16", "float16"); default cfg.param_dtype.
      max_shard_bytes: largest safetensors file (a bigger single tensor gets its own).
      **token_ids: bos_token_id, eos_token_id, ... for config.json.

    Returns:
      The files written.

    Raises:
      FileExistsError: `hf_dir` is not empty.
      ValueError: cfg.ffn_variant="relu" (no HF Llama form), or an unknown dtype.
    """
    st = _safetensors()
    dtype = dtype or cfg.param_dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: must be one of {DTYPES}")
    hf_config = config_to_hf(cfg, dtype, **token_ids)
    out = Path(hf_dir)
    check_export_dir(out)
    out.mkdir(parents=True, exist_ok=True)
    entries = _entries(cfg, dtype)
    shards = _plan_shards(entries, max_shard_bytes)
    n = len(shards)
    files = (
        [WEIGHTS_FILE]
        if n == 1
        else [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    )
    np_dtype = np.dtype(jnp.dtype(dtype))
    for file, shard in zip(files, shards, strict=True):
        tensors = {e.name: _host_tensor(e, params, np_dtype) for e in shard}
        # safetensors writes a private (0600) temporary file and renames it over the
        # target: the mode an empty file gets here (0666 less the umask, as config.json)
        # goes back on after.
        (out / file).touch()
        mode = stat.S_IMODE((out / file).stat().st_mode)
        # "format": "pt" is the metadata transformers expects of its own files.
        st.numpy.save_file(tensors, str(out / file), {"format": "pt"})
        (out / file).chmod(mode)
        del tensors
    written = [out / f for f in files]
    if n > 1:
        index = {
            "metadata": {"total_size": sum(e.nbytes for e in entries)},
            "weight_map": {
                e.name: f for f, shard in zip(files, shards, strict=True) for e in shard
            },
        }
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        written.append(out / INDEX_FILE)
    (out / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n")
    return [*written, out / CONFIG_FILE]
